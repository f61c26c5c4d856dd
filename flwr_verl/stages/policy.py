"""Stage ``policy``: verl's PPO family on prompts (``engine.trainer.LocalPPOTrainer``), against the
rule reward or a learned reward model; the client builds its trainer around the node's reward."""

from __future__ import annotations

from flwr_verl.config import EngineConfig
from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import Models, build_models
from flwr_verl.stages import Stage


def policy_models(config: EngineConfig) -> Models:
    """The policy (and, for ``gae``, the critic), seeded: what stages policy, sft and dpo train."""
    return build_models(config.model, config.needs_critic, seed=config.trainer.seed)


STAGE = Stage(build_models=policy_models, load_units=load_rows, unit_trainer=None, prompt_of=lambda row: row["prompt"])
