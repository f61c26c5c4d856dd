"""The local engine's configuration: the model, its data, rewards, rollout, the PPO family's
actor, critic and algorithm, the trainer, the stage and its DPO loss (verl's names:
``actor.clip_ratio``, ``rollout.n``, ``algorithm.adv_estimator``, ...). Each ``__post_init__``
rejects a bad value with a ``ConfigError`` naming the key, the value and what is allowed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr_verl.config.errors import require
from flwr_verl.config.privacy import DeidentifyConfig, PrivacyConfig

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
    train_batch_size: int = 256  # prompts per local iteration (expected prompts under DP)
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
    ``pkg://flwr_verl.engine.rewards`` with ``final_number_score`` (the reply's last number).

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
# classifier: a sequence classifier's score (``reward_model.RewardModel``); implicit: a stage-dpo
# policy adapter's log-probabilities (``reward_model.DPOVerifier``), scored by ``IMPLICIT_SCORES``.
REWARD_MODEL_KINDS = ("classifier", "implicit")
IMPLICIT_SCORES = ("implicit", "likelihood")


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

    ``kind``: ``classifier`` (a one-label sequence classifier) or ``implicit`` (a stage-dpo policy
    adapter on the policy's base, scored by ``score``: DPO's implicit reward ``beta`` (log pi_dpo
    - log pi_ref) or the DPO policy's ``likelihood`` log pi_dpo; per token with
    ``length_normalize``).

    ``group_rank``: replace each response's score by its rank among the responses to the same
    prompt, from 0 (lowest) to 1 (highest), before ``combine``; GRPO's advantages then follow the
    model's order only, not its score gaps (one outlier score no longer flattens the rest).
    """

    enable: bool = False
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size: int = 32  # sequences per reward-model forward pass
    combine: str = "replace"
    rule_weight: float = 1.0
    kind: str = "classifier"
    score: str = "likelihood"  # chosen on the tune split (benchmarks/dpo.py; docs/rlhf.md says why)
    beta: float = 0.1
    length_normalize: bool = False
    group_rank: bool = False

    def __post_init__(self) -> None:
        require(self.micro_batch_size > 0, "reward_model.micro_batch_size", self.micro_batch_size, "must be > 0")
        require(self.combine in REWARD_COMBINE, "reward_model.combine", self.combine,
                f"allowed: {', '.join(REWARD_COMBINE)}")
        require(math.isfinite(self.rule_weight), "reward_model.rule_weight", self.rule_weight, "must be finite")
        require(self.kind in REWARD_MODEL_KINDS, "reward_model.kind", self.kind,
                f"allowed: {', '.join(REWARD_MODEL_KINDS)}")
        require(self.score in IMPLICIT_SCORES, "reward_model.score", self.score, f"allowed: {', '.join(IMPLICIT_SCORES)}")
        require(math.isfinite(self.beta) and self.beta > 0, "reward_model.beta", self.beta, "must be a number > 0")


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
    ppo_mini_batch_size: int = 256  # prompts per update (each with its n responses)
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    policy_loss: str = "vanilla"  # a name in verl's policy-loss registry (engine.check_engine_config)
    loss_agg_mode: str = "seq-mean-token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    lr: float = 1e-2  # chosen on the embedded task's tune split under DP (benchmarks/embedded_recipe.py)
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        require(self.ppo_mini_batch_size > 0, "actor.ppo_mini_batch_size", self.ppo_mini_batch_size, "must be > 0")
        require(self.ppo_epochs >= 1, "actor.ppo_epochs", self.ppo_epochs, "must be >= 1")
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            require(getattr(self, key) > 0, f"actor.{key}", getattr(self, key), "must be > 0")
        require(self.clip_ratio_c > 1, "actor.clip_ratio_c", self.clip_ratio_c, "must be > 1 (dual-clip bound)")
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
class TrainerConfig:
    seed: int = 0
    local_iterations: int = 3  # RL iterations (rollout + update) per fit / per baseline round
    num_threads: int = 1  # torch threads; one is fastest for tiny models on shared cores

    def __post_init__(self) -> None:
        require(self.local_iterations >= 1, "trainer.local_iterations", self.local_iterations, "must be >= 1")
        require(self.num_threads >= 1, "trainer.num_threads", self.num_threads, "must be >= 1")


# The stages of the RLHF pipeline, each a local objective on LoRA adapters (``flwr_verl.stages``):
# policy: verl's PPO family against the rule reward or a learned reward model (reward_model.*);
# reward_model: a reward model learned from preference pairs (Bradley-Terry, ``flwr_verl.stages.preference``);
# sft: supervised fine-tuning of the policy on (prompt, response) pairs (``flwr_verl.stages.sft``);
# dpo: direct preference optimisation of the policy on preference pairs (``flwr_verl.stages.dpo``).
STAGES = ("policy", "reward_model", "sft", "dpo")
DPO_LOSS_NAMES = ("sigmoid", "ipo", "cdpo", "robust")  # ``dpo.DPO_LOSSES``' keys (a test keeps them equal)
LABEL_SMOOTHED_DPO_LOSSES = ("cdpo", "robust")


@dataclass
class DPOConfig:
    """Stage ``dpo``: ``beta`` (the KL weight: DPO's temperature, IPO's tau), ``loss``, ``label_smoothing``
    (cdpo's and robust's share of pairs assumed flipped), ``sft_weight`` (RPO's weight of the chosen NLL)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0

    def __post_init__(self) -> None:
        require(math.isfinite(self.beta) and self.beta > 0, "dpo.beta", self.beta, "must be a number > 0")
        require(self.loss in DPO_LOSS_NAMES, "dpo.loss", self.loss, f"allowed: {', '.join(DPO_LOSS_NAMES)}")
        require(0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")
        require(self.label_smoothing == 0 or self.loss in LABEL_SMOOTHED_DPO_LOSSES, "dpo.label_smoothing",
                self.label_smoothing, f"must be 0 with dpo.loss={self.loss!r}; it applies to "
                f"{', '.join(LABEL_SMOOTHED_DPO_LOSSES)}")
        require(math.isfinite(self.sft_weight) and self.sft_weight >= 0, "dpo.sft_weight", self.sft_weight,
                "must be a number >= 0")


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
                    "deidentify.corpus_file in training, and the prompts at serving: tools.serving.deidentified_generation)")
            require(not (self.algorithm.use_kl_in_reward and self.algorithm.kl_ctrl_type == "adaptive"),
                    "algorithm.kl_ctrl.type", self.algorithm.kl_ctrl_type,
                    "under privacy.enabled=true only 'fixed' (an adaptive coefficient is fitted to batch statistics)")

    @property
    def needs_critic(self) -> bool:
        return self.stage == "policy" and self.algorithm.adv_estimator == "gae"


