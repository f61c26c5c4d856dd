"""Typed configuration, validated once at the edge.

Every knob lives in one dataclass below; names follow verl (``actor.clip_ratio``,
``rollout.n``, ``algorithm.adv_estimator``, ...) for the RL engine and Flower (kebab-case:
``num-server-rounds``, ``proximal-mu``, ...) for the federation. ``parse_run_config`` turns
Flower's flat run config (``{"actor.clip_ratio": 0.2, ...}``) into these objects; each
``__post_init__`` rejects a bad value with a ``ConfigError`` naming the key, the value and
what is allowed, before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "remax")
GROUP_ESTIMATORS = ("grpo", "rloo")  # advantages compare the n responses of one prompt
# Under DP every privacy unit's loss must depend on that unit alone. verl's gae whitens
# advantages over the batch and needs a critic fitted to private data; reinforce_plus_plus
# whitens over the batch too. Both would break the per-unit sensitivity bound.
DP_ESTIMATORS = ("grpo", "rloo", "remax")
# Policy losses whose per-token terms depend on that token's sequence alone; others (clip_cov,
# kl_cov, ...) select tokens by batch statistics, which couples privacy units.
DP_POLICY_LOSSES = ("vanilla", "gspo", "gpg")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PER_SEQUENCE_AGG_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# Opacus modes that materialise per-sample (per-prompt, or per-row then pooled) gradients before clipping.
# "ghost" never materialises them and "ew" needs a positional-input module: neither fits.
GRAD_SAMPLE_MODES = ("hooks", "functorch")
PRIVACY_METRICS = ("auto", "clear", "none", "dp")
NUM_EXAMPLES_WEIGHTS = ("exact", "bucketed", "fixed")


class FlwrVerlError(Exception):
    """Base of the errors flwr-verl raises for bad input or a failed run. The message is written
    for users: it names what is wrong and what is allowed, so no traceback is needed."""


class ConfigError(FlwrVerlError, ValueError):
    """A configuration value is invalid. The message names the key, the value and what is allowed."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


# ----------------------------------------------------------------------------- engine
@dataclass
class ModelConfig:
    """Base model and LoRA adapters. An empty ``path`` selects the embedded default model.

    ``lora_freeze_a``: FFA-LoRA (Sun et al., ICLR 2024). Every LoRA A stays at the seeded
    initialisation that the server and every client build alike; only B trains and travels. The
    update of W = W0 + (alpha/r) B A is then linear in B, so averaging B averages the clients'
    effective weight updates exactly (averaging A and B separately does not:
    mean(B) mean(A) != mean(B A)), half the adapter travels, and DP noise enters through one
    factor only.
    """

    path: str = ""
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: str = "all-linear"  # comma-separated module names, or PEFT's "all-linear"
    dtype: str = "float32"
    device: str = "auto"
    lora_freeze_a: bool = False
    # A saved PEFT adapter of this base (e.g. a stage-sft run's adapters/final/policy): the policy's
    # starting LoRA weights, loaded bit for bit, in place of the seeded fresh ones. "" = fresh.
    init_adapter: str = ""
    # Each prompt computed once for its n responses, in generation and in the policy's passes, on
    # its key/value cache repeated along the batch (forward.py). False: every row computed whole.
    shared_prompt_cache: bool = True

    def __post_init__(self) -> None:
        if self.path:
            require(Path(self.path).is_dir(), "model.path", self.path, "must be an existing local model directory")
        if self.init_adapter:
            require((Path(self.init_adapter).expanduser() / "adapter_config.json").is_file(), "model.init_adapter",
                    self.init_adapter, "must be an existing PEFT adapter directory (with adapter_config.json), "
                    "e.g. a stage-sft run's adapters/final/policy; \"\" starts from fresh LoRA weights")
        require(self.lora_rank > 0, "model.lora_rank", self.lora_rank, "must be > 0")
        require(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "must be > 0")
        require(0 <= self.lora_dropout < 1, "model.lora_dropout", self.lora_dropout, "must be in [0, 1)")
        require(bool(self.target_modules.strip()), "model.target_modules", self.target_modules, "must name modules")
        require(self.dtype in ("float32", "bfloat16"), "model.dtype", self.dtype, "allowed: float32, bfloat16")
        require(self.device in ("auto", "cpu", "cuda"), "model.device", self.device, "allowed: auto, cpu, cuda")


@dataclass
class DataConfig:
    """Prompts: verl-format parquet files, or a task generator (``arithmetic``, ``reasoning_gym:<name>``)."""

    train_files: str = ""  # comma-separated parquet paths; empty selects ``task``
    val_files: str = ""
    task: str = "arithmetic"
    train_size: int = 2048  # prompts generated per client by a task generator
    val_size: int = 64
    train_batch_size: int = 64  # prompts per local iteration (expected prompts under DP)
    max_prompt_length: int = 256
    partition: str = "iid"  # how a dataset is split across clients: iid | dirichlet
    dirichlet_alpha: float = 0.5
    partition_by: str = "data_source"  # the row field whose values the dirichlet split skews
    format_instruction: str = ""  # appended to every generated prompt: how to state the answer (task generators)
    task_params: str = ""  # reasoning_gym:<name> only: a JSON object of the task's config fields (its difficulty)
    # The held-out split clients evaluate on: "val" reports; "tune" (task generators: as large as val, disjoint
    # from train and val) is for choosing hyperparameters without looking at val.
    eval_split: str = "val"

    def __post_init__(self) -> None:
        require(
            bool(self.train_files) or self.task == "arithmetic" or self.task.startswith("reasoning_gym:"),
            "data.task", self.task, "allowed: arithmetic, reasoning_gym:<task name> (or set data.train_files)",
        )
        require(self.train_size > 0, "data.train_size", self.train_size, "must be > 0")
        require(self.val_size >= 0, "data.val_size", self.val_size, "must be >= 0")
        require(self.train_batch_size > 0, "data.train_batch_size", self.train_batch_size, "must be > 0")
        require(self.max_prompt_length > 0, "data.max_prompt_length", self.max_prompt_length, "must be > 0")
        require(self.partition in ("iid", "dirichlet"), "data.partition", self.partition, "allowed: iid, dirichlet")
        require(self.dirichlet_alpha > 0, "data.dirichlet_alpha", self.dirichlet_alpha, "must be > 0")
        require(not (self.format_instruction and self.train_files), "data.format_instruction",
                self.format_instruction, "applies to task generators only: with data.train_files the rows carry "
                "their own prompts; leave it empty")
        require(not self.task_params or (self.task.startswith("reasoning_gym:") and not self.train_files),
                "data.task_params", self.task_params, "applies to data.task='reasoning_gym:<name>' only; leave it empty")
        require(self.eval_split in ("val", "tune"), "data.eval_split", self.eval_split, "allowed: val, tune")
        require(self.eval_split == "val" or not self.train_files, "data.eval_split", self.eval_split,
                "'tune' needs a task generator (data.task); parquet data has train and val files only")
        require(isinstance(self.task_parameters(), dict), "data.task_params", self.task_params,
                'must be a JSON object of the task\'s config fields, e.g. \'{"max_digits": 1}\'')

    def task_parameters(self) -> dict | None:
        """``task_params`` parsed: {} when empty, None when it is not a JSON object."""
        try:
            parameters = json.loads(self.task_params) if self.task_params else {}
        except json.JSONDecodeError:
            return None
        return parameters if isinstance(parameters, dict) else None


PKG_PREFIX = "pkg://"  # verl's load_extern_object: a module by import path instead of a file


def _importable(path: str) -> bool:
    """A .py file that exists, or ``pkg://module.path`` naming a module that can be imported."""
    if not path.startswith(PKG_PREFIX):
        return Path(path).is_file()
    import importlib.util

    try:
        return importlib.util.find_spec(path.removeprefix(PKG_PREFIX).replace("/", ".")) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return False


@dataclass
class RewardConfig:
    """verl's ``custom_reward_function``: ``path`` to a .py file (or, as verl's ``load_extern_object``
    takes it, ``pkg://`` and a module's import path) and the ``name`` of its function. Built in:
    ``pkg://flwr_verl.rewards`` with ``final_number_score`` (the reply's last number).

    Empty ``path``: the task generator's own scorer, else verl's ``default_compute_score``.
    ``clip`` (ours; verl has no reward clipping key) bounds every score to [-clip, clip]; at 0 a
    score beyond +-1e6 stops the run instead (``rewards.checked``).
    """

    path: str = ""
    name: str = "compute_score"
    clip: float = 0.0

    def __post_init__(self) -> None:
        if self.path:
            require(_importable(self.path), "custom_reward_function.path", self.path,
                    f"must be an existing .py file or {PKG_PREFIX}<an importable module>")
        require(self.name.isidentifier(), "custom_reward_function.name", self.name, "must be a Python identifier")
        require(math.isfinite(self.clip) and self.clip >= 0, "custom_reward_function.clip", self.clip,
                "must be a finite number >= 0 (0 = off)")


REWARD_COMBINE = ("replace", "add")


@dataclass
class RewardModelPathConfig:
    """verl's ``reward_model.model``: where the reward model lies on this node."""

    path: str = ""  # a local AutoModelForSequenceClassification directory (1 label), or a PEFT adapter on one


@dataclass
class RewardModelConfig:
    """verl's ``reward_model`` section: a learned reward model, local to each client.

    ``combine``: ``replace`` scores with the model alone; ``add`` adds the model's score to
    ``rule_weight`` times the rule reward (``custom_reward_function``). The path may be empty
    here when every node names its own model in its node config (``reward-model-path``); it is
    checked on the node that loads it, since the model never leaves its node.
    """

    enable: bool = False
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size: int = 32  # sequences per reward-model forward pass
    combine: str = "replace"
    rule_weight: float = 1.0

    def __post_init__(self) -> None:
        require(self.micro_batch_size > 0, "reward_model.micro_batch_size", self.micro_batch_size, "must be > 0")
        require(self.combine in REWARD_COMBINE, "reward_model.combine", self.combine,
                f"allowed: {', '.join(REWARD_COMBINE)}")
        require(math.isfinite(self.rule_weight), "reward_model.rule_weight", self.rule_weight, "must be finite")


@dataclass
class RolloutConfig:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    response_length: int = 8  # max new tokens per response

    def __post_init__(self) -> None:
        require(self.n >= 1, "rollout.n", self.n, "must be >= 1")
        require(self.temperature > 0, "rollout.temperature", self.temperature, "must be > 0")
        require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        require(self.top_k >= 0, "rollout.top_k", self.top_k, "must be >= 0")
        require(self.response_length > 0, "rollout.response_length", self.response_length, "must be > 0")


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 64  # prompts per update (each with its n responses)
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    policy_loss: str = "vanilla"  # any name in verl's policy-loss registry
    loss_agg_mode: str = "seq-mean-token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    lr: float = 6e-3  # chosen on the embedded task's tune split under DP (benchmarks/embedded_recipe.py)
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        from flwr_verl._verl import core_algos

        require(self.ppo_mini_batch_size > 0, "actor.ppo_mini_batch_size", self.ppo_mini_batch_size, "must be > 0")
        require(self.ppo_epochs >= 1, "actor.ppo_epochs", self.ppo_epochs, "must be >= 1")
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            require(getattr(self, key) > 0, f"actor.{key}", getattr(self, key), "must be > 0")
        require(self.clip_ratio_c > 1, "actor.clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
        losses = sorted(core_algos.POLICY_LOSS_REGISTRY)
        require(self.policy_loss in losses, "actor.policy_loss", self.policy_loss, f"allowed: {', '.join(losses)}")
        require(self.loss_agg_mode in LOSS_AGG_MODES, "actor.loss_agg_mode", self.loss_agg_mode,
                f"allowed: {', '.join(LOSS_AGG_MODES)}")
        require(self.entropy_coeff >= 0, "actor.entropy_coeff", self.entropy_coeff, "must be >= 0")
        require(self.kl_loss_coef >= 0, "actor.kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        require(self.kl_loss_type in KL_TYPES, "actor.kl_loss_type", self.kl_loss_type, f"allowed: {', '.join(KL_TYPES)}")
        require(self.lr > 0, "actor.lr", self.lr, "must be > 0")
        require(self.weight_decay >= 0, "actor.weight_decay", self.weight_decay, "must be >= 0")
        require(self.grad_clip > 0, "actor.grad_clip", self.grad_clip, "must be > 0")


@dataclass
class CriticConfig:
    """The value model, used only by the ``gae`` estimator."""

    lr: float = 1e-3
    cliprange_value: float = 0.5
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        require(self.lr > 0, "critic.lr", self.lr, "must be > 0")
        require(self.cliprange_value > 0, "critic.cliprange_value", self.cliprange_value, "must be > 0")
        require(self.grad_clip > 0, "critic.grad_clip", self.grad_clip, "must be > 0")


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl_type: str = "fixed"  # verl's algorithm.kl_ctrl.type
    kl_coef: float = 0.001  # verl's algorithm.kl_ctrl.kl_coef
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        require(self.adv_estimator in ADV_ESTIMATORS, "algorithm.adv_estimator", self.adv_estimator,
                f"allowed: {', '.join(ADV_ESTIMATORS)}")
        require(0 <= self.gamma <= 1, "algorithm.gamma", self.gamma, "must be in [0, 1]")
        require(0 <= self.lam <= 1, "algorithm.lam", self.lam, "must be in [0, 1]")
        require(self.kl_penalty in KL_TYPES, "algorithm.kl_penalty", self.kl_penalty, f"allowed: {', '.join(KL_TYPES)}")
        require(self.kl_ctrl_type in ("fixed", "adaptive"), "algorithm.kl_ctrl.type", self.kl_ctrl_type,
                "allowed: fixed, adaptive")
        require(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", self.kl_coef, "must be >= 0")
        require(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", self.target_kl, "must be > 0")
        require(self.horizon > 0, "algorithm.kl_ctrl.horizon", self.horizon, "must be > 0")


@dataclass
class ClientLevelConfig:
    """Client-level DP with distributed Skellam noise under SecAgg+ (``distributed_dp.py``): the
    privacy unit is one client's whole round update, and no one ever holds a noise-free sum."""

    enabled: bool = False
    clip_norm: float = 0.1  # L2 bound on one client's whole update (every adapter array together)
    noise_multiplier: float = 1.0  # std of the summed noise / clip_norm, with the threshold number of survivors
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
    noise_multiplier: float = 0.65  # epsilon ~7.2 at delta 1e-5 for the default run (80 iterations, q=1/32)
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


@dataclass
class TrainerConfig:
    seed: int = 0
    local_iterations: int = 10  # RL iterations (rollout + update) per fit / per baseline round
    num_threads: int = 1  # torch threads; one is fastest for tiny models on shared cores

    def __post_init__(self) -> None:
        require(self.local_iterations >= 1, "trainer.local_iterations", self.local_iterations, "must be >= 1")
        require(self.num_threads >= 1, "trainer.num_threads", self.num_threads, "must be >= 1")


# The stages of the RLHF pipeline, each a local objective on LoRA adapters (``flwr_verl.stages``):
# policy: verl's PPO family against the rule reward or a learned reward model (reward_model.*);
# reward_model: a reward model learned from preference pairs (Bradley-Terry, ``flwr_verl.preference``);
# sft: supervised fine-tuning of the policy on (prompt, response) pairs (``flwr_verl.sft``);
# dpo: direct preference optimisation of the policy on preference pairs (``flwr_verl.dpo``).
STAGES = ("policy", "reward_model", "sft", "dpo")
DPO_LOSS_NAMES = ("sigmoid", "ipo", "cdpo", "robust")  # ``dpo.DPO_LOSSES``' keys (a test keeps them equal)
LABEL_SMOOTHED_DPO_LOSSES = ("cdpo", "robust")


@dataclass
class DPOConfig:
    """Stage ``dpo``: ``beta`` (the KL weight: DPO's temperature, IPO's tau), ``loss`` and, for
    the label-smoothed losses, ``label_smoothing`` (the share of pairs assumed flipped)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.beta) and self.beta > 0, "dpo.beta", self.beta, "must be a number > 0")
        require(self.loss in DPO_LOSS_NAMES, "dpo.loss", self.loss, f"allowed: {', '.join(DPO_LOSS_NAMES)}")
        require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        require(self.label_smoothing == 0 or self.loss in LABEL_SMOOTHED_DPO_LOSSES, "dpo.label_smoothing",
                self.label_smoothing, f"must be 0 with dpo.loss={self.loss!r}; it applies to "
                f"{', '.join(LABEL_SMOOTHED_DPO_LOSSES)}")


@dataclass(frozen=True)
class LocalBudget:
    """One node's own limit on its local work per round, from its node config (a small device
    does less): ``local-iterations`` caps the round's ``trainer.local_iterations``;
    ``time-budget-s`` starts no new iteration once that many seconds of the fit have passed (at
    least one iteration always runs). None = no limit. The client reports the iterations it ran
    and accounts exactly those for privacy."""

    iterations: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        iterations, seconds = self.iterations, self.seconds
        require(iterations is None or (isinstance(iterations, int) and not isinstance(iterations, bool)
                                       and iterations >= 1),
                "node config local-iterations", iterations, "must be an integer >= 1 (omit it for no limit)")
        require(seconds is None or (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                    and math.isfinite(seconds) and seconds > 0),
                "node config time-budget-s", seconds, "must be a number of seconds > 0 (omit it for no limit)")

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> LocalBudget:
        return cls(iterations=node_config.get("local-iterations"), seconds=node_config.get("time-budget-s"))

    def iterations_for(self, requested: int) -> int:
        """The iterations this node runs of the ``requested`` ones (at most; its time budget may stop it sooner)."""
        return requested if self.iterations is None else min(requested, self.iterations)


@dataclass
class EngineConfig:
    """Everything one client's local RL engine needs. ``stage`` picks the local objective; under
    ``reward_model`` and ``dpo`` the data files are preference pairs, under ``sft`` (prompt, response) pairs,
    and ``actor``'s optimizer keys (lr, weight_decay, grad_clip, ppo_epochs, ppo_mini_batch_size)
    configure that stage's update."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    custom_reward_function: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    stage: str = "policy"
    deidentify: DeidentifyConfig = field(default_factory=DeidentifyConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def __post_init__(self) -> None:
        require(self.stage in STAGES, "stage", self.stage, f"allowed: {', '.join(STAGES)}")
        require(not (self.stage == "reward_model" and self.reward_model.enable), "reward_model.enable",
                self.reward_model.enable, "must be false under stage='reward_model' (that stage trains one)")
        require(not (self.stage == "sft" and self.reward_model.enable), "reward_model.enable", self.reward_model.enable,
                "must be false under stage='sft' (it learns from reference responses, not from a reward)")
        require(not (self.stage == "dpo" and self.reward_model.enable), "reward_model.enable", self.reward_model.enable,
                "must be false under stage='dpo' (it learns from preference pairs, not from a reward)")
        require(not (self.stage == "reward_model" and self.model.init_adapter), "model.init_adapter",
                self.model.init_adapter, "must be empty under stage='reward_model' (it starts the policy: stages "
                "policy and sft)")
        batch, mini = self.data.train_batch_size, self.actor.ppo_mini_batch_size
        require(batch % mini == 0, "actor.ppo_mini_batch_size", mini,
                f"must divide data.train_batch_size={batch}")
        estimator = self.algorithm.adv_estimator
        if estimator in GROUP_ESTIMATORS:
            require(self.rollout.n >= 2, "rollout.n", self.rollout.n,
                    f"must be >= 2 for algorithm.adv_estimator={estimator!r} (it compares responses of a prompt)")
        if self.privacy.enabled:
            require(estimator in DP_ESTIMATORS, "algorithm.adv_estimator", estimator,
                    f"under privacy.enabled=true allowed: {', '.join(DP_ESTIMATORS)} "
                    "(gae and reinforce_plus_plus whiten advantages over the batch, coupling privacy units)")
            require(self.actor.policy_loss in DP_POLICY_LOSSES, "actor.policy_loss", self.actor.policy_loss,
                    f"under privacy.enabled=true allowed: {', '.join(DP_POLICY_LOSSES)} "
                    "(the others use batch statistics, coupling privacy units)")
            require(self.actor.loss_agg_mode in PER_SEQUENCE_AGG_MODES, "actor.loss_agg_mode",
                    self.actor.loss_agg_mode,
                    f"under privacy.enabled=true allowed: {', '.join(PER_SEQUENCE_AGG_MODES)} "
                    "(token-mean divides by the batch's token count, coupling privacy units)")
            require(self.privacy.metrics != "dp" or self.stage == "policy", "privacy.metrics", self.privacy.metrics,
                    "'dp' releases the policy stage's sampled reward and response length; under stage="
                    f"{self.stage!r} use 'none' or 'clear'")
            require(self.privacy.metrics != "dp" or self.custom_reward_function.clip > 0, "custom_reward_function.clip",
                    self.custom_reward_function.clip,
                    "must be > 0 under privacy.metrics='dp': the clip is the range of the released mean reward, "
                    "so its sensitivity is known")
            require(not (self.deidentify.enabled and self.deidentify.protect_prompts), "deidentify.protect_prompts",
                    self.deidentify.protect_prompts,
                    "under privacy.enabled=true only false: a filter made of the training prompts makes every "
                    "prompt's rollouts depend on the other prompts, coupling privacy units (protect a "
                    "deidentify.corpus_file in training, and the prompts at serving: deidentify.deidentified_generation)")
            require(not (self.algorithm.use_kl_in_reward and self.algorithm.kl_ctrl_type == "adaptive"),
                    "algorithm.kl_ctrl.type", self.algorithm.kl_ctrl_type,
                    "under privacy.enabled=true only 'fixed' (an adaptive coefficient is fitted to batch statistics)")

    @property
    def needs_critic(self) -> bool:
        return self.stage == "policy" and self.algorithm.adv_estimator == "gae"


# ----------------------------------------------------------------------------- federation
# The largest server learning rate each server optimizer allows; the defaults are in
# ``FederationConfig.effective_server_learning_rate``. FedAdam moves every coordinate by about
# +-lr each step, whatever the update's size, and keeps moving as the updates shrink: lr 1 wrecks
# a LoRA adapter, whose round updates are ~1e-2 per coordinate, so it is capped at the top of
# Reddi et al. (2021)'s server learning rates (1e-3 to 1e-1).
MAX_SERVER_LEARNING_RATES = {"sgd": 2.0, "momentum": 2.0, "adam": 0.1}
AGGREGATIONS = ("mean", "fednova", "median", "trimmed_mean")
ROBUST_AGGREGATIONS = ("median", "trimmed_mean")  # read each update: in the clear only


@dataclass
class SecAggConfig:
    enabled: bool = True
    num_shares: int = 3  # clients that hold a share of each client's secrets
    reconstruction_threshold: int = 2  # shares needed to unmask: the round survives num_shares - this dropouts
    clipping_range: float = 1.0  # bound on |update| per coordinate; larger is an error, never clipped
    max_weight: int = 0  # bound on any client's num_examples; 0 = derive from data.train_size
    timeout: float = 300.0
    precision: float = 1e-7  # max abs error of the aggregate vs exact FedAvg: sets the quantization range (secagg.py)

    def __post_init__(self) -> None:
        require(self.num_shares >= 3, "secagg.num-shares", self.num_shares, "must be >= 3 (Flower's SecAgg+)")
        require(2 <= self.reconstruction_threshold < self.num_shares, "secagg.reconstruction-threshold",
                self.reconstruction_threshold, f"must be in [2, secagg.num-shares={self.num_shares})")
        require(self.clipping_range > 0, "secagg.clipping-range", self.clipping_range, "must be > 0")
        require(self.max_weight >= 0, "secagg.max-weight", self.max_weight, "must be >= 0 (0 = auto)")
        require(self.timeout > 0, "secagg.timeout", self.timeout, "must be > 0")
        require(0 < self.precision < self.clipping_range, "secagg.precision", self.precision,
                f"must be in (0, secagg.clipping-range={self.clipping_range:g}): the max abs error of the secure "
                "aggregate against exact FedAvg")


@dataclass
class CompressionConfig:
    """Sparse uploads (``compression.py``): each round every client sends the same random
    ``density`` share of the adapter's coordinates, keeping the rest as an error-feedback residual."""

    density: float = 1.0  # 1 = off: every coordinate travels

    def __post_init__(self) -> None:
        require(0 < self.density <= 1, "compression.density", self.density,
                "must be in (0, 1] (the share of coordinates each client uploads per round; 1 = all)")


@dataclass
class FederationConfig:
    num_server_rounds: int = 8
    fraction_fit: float = 1.0
    fraction_evaluate: float = 1.0
    min_fit_clients: int = 3
    min_evaluate_clients: int = 3
    min_available_clients: int = 3
    proximal_mu: float = 0.01
    server_optimizer: str = "sgd"  # sgd (FedAvg/FedProx), momentum (FedAvgM), adam (FedAdam)
    server_learning_rate: float = 0.0  # 0: the optimizer's default (effective_server_learning_rate)
    server_momentum: float = 0.9
    # mean: the num_examples-weighted mean of the updates (FedAvg, FedProx). fednova: FedNova's
    # normalised averaging (Wang et al. 2020), so clients that ran more local iterations do not
    # dominate: each client divides its update by its iterations, the server scales the mean by
    # the mean iteration count (strategy.FedProxAdapters). median, trimmed_mean: robust to a few
    # malicious updates (coordinate-wise, unweighted; Flower's aggregate_median/_trimmed_avg), in the clear only.
    aggregation: str = "mean"
    trim_fraction: float = 0.2  # aggregation = "trimmed_mean": the share of updates cut at each end, per coordinate
    evaluate_every: int = 1
    save_every: int = 1
    # Deadlines, in seconds: every wait of the server has one, and a message naming who is missing.
    connect_timeout: float = 120.0  # for min-available-clients SuperNodes to be connected before a round
    fit_timeout: float = 1800.0  # for the sampled clients' fit replies (plain rounds; SecAgg+ has secagg.timeout)
    evaluate_timeout: float = 600.0  # for the evaluation replies
    output_dir: str = "~/flwr_verl_runs"
    resume: bool = False
    inject_failure_partition: int = -1  # tests: this partition's fit raises (-1 = none)
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

    @property
    def effective_server_learning_rate(self) -> float:
        """``server-learning-rate``, or the chosen optimizer's default when it is 0: sgd 1 (FedAvg,
        FedProx: the mean update applied as is); momentum 1 - server-momentum, which keeps
        FedAvgM's effective step lr / (1 - momentum) at 1; adam 1e-3, the low end of Reddi et al."""
        if self.server_learning_rate:
            return self.server_learning_rate
        return {"sgd": 1.0, "momentum": 1.0 - self.server_momentum, "adam": 1e-3}[self.server_optimizer]

    def __post_init__(self) -> None:
        require(self.num_server_rounds >= 1, "num-server-rounds", self.num_server_rounds, "must be >= 1")
        require(0 < self.fraction_fit <= 1, "fraction-fit", self.fraction_fit, "must be in (0, 1]")
        require(0 <= self.fraction_evaluate <= 1, "fraction-evaluate", self.fraction_evaluate, "must be in [0, 1]")
        for key in ("min_fit_clients", "min_evaluate_clients", "min_available_clients"):
            require(getattr(self, key) >= 1, key.replace("_", "-"), getattr(self, key), "must be >= 1")
        require(self.proximal_mu >= 0, "proximal-mu", self.proximal_mu, "must be >= 0 (0 = FedAvg)")
        require(self.server_optimizer in ("sgd", "momentum", "adam"), "server-optimizer", self.server_optimizer,
                "allowed: sgd, momentum, adam")
        require(0 <= self.server_momentum < 1, "server-momentum", self.server_momentum, "must be in [0, 1)")
        require(self.aggregation in AGGREGATIONS, "aggregation", self.aggregation, f"allowed: {', '.join(AGGREGATIONS)}")
        require(0 <= self.trim_fraction < 0.5, "trim-fraction", self.trim_fraction, "must be in [0, 0.5)")
        require(not (self.secagg.enabled and self.aggregation in ROBUST_AGGREGATIONS), "aggregation", self.aggregation,
                "needs each client's update, which SecAgg+ hides: with secagg.enabled=true use mean or fednova")
        largest = MAX_SERVER_LEARNING_RATES[self.server_optimizer]
        require(self.server_learning_rate == 0 or 0 < self.server_learning_rate <= largest, "server-learning-rate",
                self.server_learning_rate,
                f"with server-optimizer={self.server_optimizer!r} must be in (0, {largest:g}], or 0 for its default")
        require(self.evaluate_every >= 0, "evaluate-every", self.evaluate_every, "must be >= 0 (0 = never)")
        require(self.save_every >= 1, "save-every", self.save_every, "must be >= 1")
        for key in ("connect_timeout", "fit_timeout", "evaluate_timeout"):
            require(getattr(self, key) > 0, key.replace("_", "-"), getattr(self, key), "must be > 0 seconds")
        if self.secagg.enabled:
            require(self.secagg.num_shares <= self.min_fit_clients, "secagg.num-shares", self.secagg.num_shares,
                    f"must be <= min-fit-clients={self.min_fit_clients} (shares go to other sampled clients)")


@dataclass
class RunConfig:
    """The whole app's configuration: one engine config per client, one federation config."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)

    def __post_init__(self) -> None:
        client_level, secagg = self.engine.privacy.client_level, self.federation.secagg
        data, weights = self.engine.data, self.engine.privacy.num_examples
        known_max_weight = (secagg.max_weight or weights == "fixed"
                            or (not data.train_files and data.partition == "iid"))
        if secagg.enabled and not client_level.enabled and known_max_weight:
            from flwr_verl.secagg import derive_parameters  # it imports this module

            # secagg.precision must be reachable. The server derives the same settings again, and
            # reports an automatic max-weight that the data cannot give.
            derive_parameters(secagg, data, self.federation.min_fit_clients, weights)
        if not client_level.enabled:
            return
        require(self.federation.compression.density == 1, "compression.density", self.federation.compression.density,
                "must be 1 with privacy.client_level.enabled=true (its rotated, noised integers are not sparsified)")
        require(secagg.enabled, "privacy.client_level.enabled", True,
                "needs secagg.enabled=true (without SecAgg+ the server would see each client's lightly noised update)")
        from flwr_verl.distributed_dp import plan_round  # it imports this module

        # The bit width against the fewest clients a round samples, at the smallest update; the
        # server checks again with the round's real numbers before the clients train.
        plan_round(client_level, dim=1, num_clients=self.federation.min_fit_clients,
                   threshold=secagg.reconstruction_threshold)


# ----------------------------------------------------------------------------- parsing
# Keys whose spelling differs from the dataclass field that holds them.
_ALIASES = {
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl_type",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.target_kl",
    "algorithm.kl_ctrl.horizon": "algorithm.horizon",
}


def _fields(cls) -> dict[str, tuple[type, Any]]:
    hints = get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        require(isinstance(value, bool), key, value, "must be true or false")
    elif kind is int:
        require(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer")
    elif kind is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number")
        value = float(value)
    elif kind is str:
        require(isinstance(value, str), key, value, "must be a string")
    return value


def _build(cls, values: dict[str, Any], prefix: str, kebab: bool):
    """Instantiate ``cls`` from ``values`` (keys relative to ``prefix``), rejecting unknown keys."""
    fields = _fields(cls)
    nested = {name for name, (kind, _) in fields.items() if dataclasses.is_dataclass(kind)}
    kwargs: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {name: {} for name in nested}
    for key, value in values.items():
        head, _, rest = key.partition(".")
        name = head.replace("-", "_") if kebab else head
        if name in nested and rest:
            grouped[name][rest] = value
        elif name in fields and name not in nested and not rest:
            kwargs[name] = _coerce(prefix + key, value, fields[name][0])
        else:
            allowed = sorted((n.replace("_", "-") if kebab else n) for n in fields)
            raise ConfigError(f"unknown config key {prefix + key!r}; allowed under {prefix or 'the top level'!r}: "
                              f"{', '.join(allowed)}")
    for name in nested:
        kind = fields[name][0]
        sub_prefix = f"{prefix}{name.replace('_', '-') if kebab else name}."
        kwargs[name] = _build(kind, grouped[name], sub_prefix, kebab)
    return cls(**kwargs)


def parse_run_config(run_config: dict[str, Any]) -> RunConfig:
    """Validate Flower's flat run config. Engine keys are verl-style, federation keys Flower-style."""
    engine_sections = {f.name for f in dataclasses.fields(EngineConfig)}
    engine_values: dict[str, Any] = {}
    federation_values: dict[str, Any] = {}
    for key, value in run_config.items():
        key = _ALIASES.get(key, key)
        (engine_values if key.partition(".")[0] in engine_sections else federation_values)[key] = value
    return RunConfig(
        engine=_build(EngineConfig, engine_values, "", kebab=False),
        federation=_build(FederationConfig, federation_values, "", kebab=True),
    )


def engine_config(**sections: dict[str, Any]) -> EngineConfig:
    """Convenience for Python users: ``engine_config(actor={"lr": 1e-3}, rollout={"n": 4})``."""
    flat = {f"{section}.{key}": value for section, values in sections.items() for key, value in values.items()}
    return parse_run_config(flat).engine

