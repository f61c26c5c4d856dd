"""What an evaluation on held-out data returns, in every stage: a plain value with no heavy
import, so that the wire protocol (``federation.protocol.EvaluateReport``) can carry it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Evaluation:
    """Greedy decoding on held-out prompts (disjoint from every client's training data), or a
    fixed-data stage's held-out score; ``federation.protocol.Evaluation`` carries it on the wire."""

    reward: float
    accuracy: float  # share of responses with reward >= 1
    response_loss: float | None = None  # stage sft: mean held-out response NLL per token (``stages.sft``)

    @property
    def loss(self) -> float:
        """What the client returns as Flower's evaluation loss: the response loss where there is
        one, else 1 - reward."""
        return 1.0 - self.reward if self.response_loss is None else self.response_loss
