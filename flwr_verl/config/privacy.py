"""Privacy settings: DP-SGD per prompt (``privacy.*``), client-level DP under SecAgg+
(``privacy.client_level.*``) and generation-time de-identification (``deidentify.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flwr_verl.config.errors import require

# Opacus modes that materialise per-sample (per-prompt, or per-row then pooled) gradients before clipping.
# "ghost" never materialises them and "ew" needs a positional-input module: neither fits.
GRAD_SAMPLE_MODES = ("hooks", "functorch")
PRIVACY_METRICS = ("auto", "clear", "none", "dp")
NUM_EXAMPLES_WEIGHTS = ("exact", "bucketed", "fixed")


@dataclass
class ClientLevelConfig:
    """Client-level DP with distributed Skellam noise under SecAgg+ (``distributed_dp.py``): the
    privacy unit is one client's whole round update, and no one ever holds a noise-free sum."""

    enabled: bool = False
    clip_norm: float = 0.1  # L2 bound on one client's whole update (every adapter array together)
    noise_multiplier: float = 1.0  # std of the summed noise / clip_norm, with the fewest survivors SecAgg+ allows
    bits: int = 20  # modular range 2**bits of each coordinate of the sum (at most 30: Flower rounds through int32)
    rotation: bool = True  # randomized Hadamard transform, seeded by the round: fewer bits for the same error
    delta: float = 1e-5

    def __post_init__(self) -> None:
        require(self.clip_norm > 0, "privacy.client_level.clip_norm", self.clip_norm, "must be > 0")
        require(self.noise_multiplier >= 0, "privacy.client_level.noise_multiplier", self.noise_multiplier,
                "must be >= 0")
        require(self.noise_multiplier > 0 or not self.enabled, "privacy.client_level.noise_multiplier",
                self.noise_multiplier, "must be > 0 under privacy.client_level.enabled=true (no noise: epsilon = "
                "infinity)")
        require(2 <= self.bits <= 30, "privacy.client_level.bits", self.bits,
                "must be in [2, 30] (Flower's SecAgg+ quantizes through int32)")
        require(0 < self.delta < 1, "privacy.client_level.delta", self.delta, "must be in (0, 1)")


@dataclass
class PrivacyConfig:
    """DP-SGD through Opacus. The privacy unit is one prompt with everything generated from it."""

    enabled: bool = True
    noise_multiplier: float = 0.863  # epsilon ~7.2 at delta 1e-5 for the default run (24 iterations, q=1/8)
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    accountant: str = "rdp"
    grad_sample_mode: str = "hooks"
    target_epsilon: float = 0.0  # > 0: derive noise_multiplier from it before training
    epsilon_budget: float = 0.0  # > 0: a client refuses rounds that would spend past it
    # Seed DP sampling and noise from trainer.seed. For tests and benchmarks only: whoever
    # knows the seed can subtract the noise, which voids the guarantee.
    deterministic: bool = False
    # Training metrics on the private prompts (reward, KL, lengths, losses, timings), which no
    # epsilon covers: "clear" sends them, "none" does not, "auto" is "none" under DP; "dp" sends
    # the mean sampled reward and response length with Gaussian noise, spent in the same account
    # (``privacy.DP_METRICS``), at metrics_noise_multiplier.
    metrics: str = "auto"
    metrics_noise_multiplier: float = 4.0
    # The weight sent as num_examples: "exact" (the prompt count: FedAvg's weighting), "bucketed"
    # (rounded up to a power of two) or "fixed" (1: every client weighs the same).
    num_examples: str = "exact"

    @property
    def sent_metrics(self) -> str:
        """``metrics`` with "auto" resolved: "none" under DP, "clear" without."""
        if self.metrics == "auto":
            return "none" if self.enabled else "clear"
        return self.metrics
    client_level: ClientLevelConfig = field(default_factory=ClientLevelConfig)

    def __post_init__(self) -> None:
        require(self.noise_multiplier >= 0, "privacy.noise_multiplier", self.noise_multiplier, "must be >= 0")
        require(self.noise_multiplier > 0 or not self.enabled or self.target_epsilon > 0,
                "privacy.noise_multiplier", self.noise_multiplier,
                "must be > 0 under privacy.enabled=true (no noise means epsilon = infinity; "
                "set privacy.enabled=false to train without DP)")
        require(self.max_grad_norm > 0, "privacy.max_grad_norm", self.max_grad_norm, "must be > 0")
        require(0 < self.delta < 1, "privacy.delta", self.delta, "must be in (0, 1)")
        require(self.accountant in ("rdp", "prv"), "privacy.accountant", self.accountant, "allowed: rdp, prv")
        require(self.grad_sample_mode in GRAD_SAMPLE_MODES, "privacy.grad_sample_mode", self.grad_sample_mode,
                f"allowed: {', '.join(GRAD_SAMPLE_MODES)}")
        require(self.target_epsilon >= 0, "privacy.target_epsilon", self.target_epsilon, "must be >= 0 (0 = off)")
        require(self.epsilon_budget >= 0, "privacy.epsilon_budget", self.epsilon_budget, "must be >= 0 (0 = none)")
        require(self.metrics in PRIVACY_METRICS, "privacy.metrics", self.metrics,
                f"allowed: {', '.join(PRIVACY_METRICS)}")
        require(self.metrics != "dp" or self.enabled, "privacy.metrics", self.metrics,
                "'dp' needs privacy.enabled=true (its noise is accounted with the DP-SGD update's); "
                "without DP use 'clear' or 'none'")
        require(self.metrics != "dp" or self.metrics_noise_multiplier > 0, "privacy.metrics_noise_multiplier",
                self.metrics_noise_multiplier, "must be > 0 under privacy.metrics='dp'")
        require(self.num_examples in NUM_EXAMPLES_WEIGHTS, "privacy.num_examples", self.num_examples,
                f"allowed: {', '.join(NUM_EXAMPLES_WEIGHTS)}")


@dataclass
class DeidentifyConfig:
    """Generation-time de-identification (``deidentify.py``, MemFree decoding): this
    organisation's rollouts and evaluations never emit an n-gram of its protected text. The
    filter is built on the node and never leaves it."""

    enabled: bool = False
    ngram: int = 6  # tokens per protected n-gram
    false_positive_rate: float = 1e-4  # chance that the Bloom filter blocks an innocent candidate token
    protect_prompts: bool = True  # the organisation's training prompts are protected text
    corpus_file: str = ""  # more protected text on the node: .jsonl (a "text" per line) or a passage per line

    def __post_init__(self) -> None:
        require(not isinstance(self.ngram, bool) and self.ngram >= 2, "deidentify.ngram", self.ngram,
                "must be an integer >= 2")
        require(0 < self.false_positive_rate < 1, "deidentify.false_positive_rate", self.false_positive_rate,
                "must be in (0, 1)")
        if self.corpus_file:
            require(Path(self.corpus_file).expanduser().is_file(), "deidentify.corpus_file", self.corpus_file,
                    "must be an existing file on this node")
        if self.enabled:
            require(self.protect_prompts or bool(self.corpus_file), "deidentify.corpus_file", self.corpus_file,
                    "must name a file when deidentify.protect_prompts=false (else nothing is protected)")


