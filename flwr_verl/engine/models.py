"""Models and adapters: a causal LM with LoRA (the policy), an optional LoRA value model (the
critic), and the adapter weights as the arrays that federated learning exchanges.

The reference policy for KL is the policy with its adapter disabled
(``peft_model.disable_adapter()``), so no second copy of the base weights exists.

Checked against the loaded model, before any training (each error names the keys involved):
every name in ``model.target_modules`` must match a module (PEFT silently skips names that match
none as long as one matches), and a rollout's prompt plus response must fit the model's
positions (``check_lengths``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from transformers.pytorch_utils import Conv1D

from flwr_verl.config import ConfigError, EngineConfig, FlwrVerlError, ModelConfig
from flwr_verl.embedded import embedded_model_path
from flwr_verl.engine.data import Row, prompt_text


class ModelLoadError(FlwrVerlError, ValueError):
    """The configured model cannot be loaded as a causal LM (or as a value model)."""


class AdapterShapeError(FlwrVerlError, ValueError):
    """Received adapter arrays do not match this model's adapters."""


def select_device(requested: str) -> torch.device:
    """``auto`` picks CUDA when torch sees a GPU. verl's own detection says "cuda" on CPU-only hosts."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("model.device='cuda' but torch sees no CUDA device; use 'auto' or 'cpu'")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def resolve_model_path(config: ModelConfig) -> Path:
    return Path(config.path) if config.path else embedded_model_path()


def load_tokenizer(path: Path):
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"model.path={str(path)!r} has no usable tokenizer: {error}") from error
    tokenizer.padding_side = "left"  # generation continues from the right edge of every prompt
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _target_modules(config: ModelConfig) -> str | list[str]:
    """``model.target_modules`` as PEFT takes it: "all-linear", or a list of module names."""
    targets = config.target_modules.strip()
    return targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]


def lora_config(config: ModelConfig, task_type: TaskType, modules_to_save: list[str] | None = None) -> LoraConfig:
    return LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=_target_modules(config),
        task_type=task_type,
        modules_to_save=modules_to_save,
    )


def check_target_modules(config: ModelConfig, base: torch.nn.Module) -> None:
    """Every name in ``model.target_modules`` must match a module of ``base``, as PEFT matches a
    name (the full module path or its last components). PEFT itself fails only when no name
    matches: ``q_proj,nope`` would silently train q_proj alone."""
    targets = _target_modules(config)
    if targets == "all-linear":
        return
    names = [name for name, _ in base.named_modules()]
    unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        linear = sorted({name.rpartition(".")[2] for name, module in base.named_modules()
                         if isinstance(module, (torch.nn.Linear, Conv1D))})
        raise ModelLoadError(f"model.target_modules={config.target_modules!r}: no module of this model matches "
                             f"{', '.join(map(repr, unmatched))}; its linear modules: {', '.join(linear)} "
                             "(or 'all-linear')")


def with_lora(base: torch.nn.Module, config: ModelConfig, lora: LoraConfig) -> PeftModel:
    check_target_modules(config, base)
    try:
        model = get_peft_model(base, lora)
    except ValueError as error:
        raise ModelLoadError(f"model.target_modules={config.target_modules!r}: {error}") from error
    if config.lora_freeze_a:
        freeze_lora_a(model)
    return model


def freeze_lora_a(model: PeftModel) -> None:
    """FFA-LoRA: freeze every LoRA A factor, through PEFT's own registry of adapter weights that
    stay frozen (which MiCA uses for B): PEFT re-enables gradients of all adapter weights
    whenever an adapter is switched back on, as after every ``disable_adapter()`` block (the
    reference log-probs), and skips the registered ones."""
    from peft.tuners.lora import LoraLayer

    try:
        from peft.tuners.lora.variants import _register_frozen_peft_weight
    except ImportError as error:
        import peft

        raise ModelLoadError(f"model.lora_freeze_a=true needs peft >= 0.20 (installed: {peft.__version__})") from error
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for factor in ("lora_A", "lora_embedding_A"):
                for adapter in getattr(module, factor):
                    _register_frozen_peft_weight(module, adapter, factor)


def lora_delta_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The effective weight update of every LoRA layer, Delta W = (alpha / r) * B @ A (PEFT's
    own ``get_delta_weight``, float32 for float32 weights), keyed by module name. What merging
    the adapter would add to each base weight; used to measure how exactly an aggregated
    adapter represents the clients' mean update."""
    from peft.tuners.lora import LoraLayer

    return {name: module.get_delta_weight(adapter).detach()
            for name, module in model.named_modules() if isinstance(module, LoraLayer)
            for adapter in module.active_adapters if adapter in module.lora_A}


def model_dtype(config: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if config.dtype == "bfloat16" else torch.float32


def load_policy(config: ModelConfig, device: torch.device) -> PeftModel:
    """The causal LM with fresh LoRA adapters; only adapter weights are trainable."""
    path = resolve_model_path(config)
    try:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(config), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(f"model.path={str(path)!r} is not a loadable Hugging Face causal LM: {error}") from error
    return with_lora(base, config, lora_config(config, TaskType.CAUSAL_LM)).to(device)


def load_critic(config: ModelConfig, device: torch.device) -> PeftModel:
    """A value model: the same base with a scalar token-classification head, LoRA-adapted.

    The head is new, so it is trained in full (``modules_to_save``); the body only through LoRA.
    """
    path = resolve_model_path(config)
    try:
        base = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=model_dtype(config), local_files_only=True
        )
    except (OSError, ValueError, KeyError) as error:
        raise ModelLoadError(
            f"model.path={str(path)!r} has no token-classification variant for a critic "
            f"(needed by algorithm.adv_estimator='gae'): {error}"
        ) from error
    head = next(name for name in ("score", "classifier") if hasattr(base, name))
    return with_lora(base, config, lora_config(config, TaskType.TOKEN_CLS, modules_to_save=[head])).to(device)


@dataclass
class Models:
    """Tokenizer, policy and (for gae) critic of one client, built once per process."""

    tokenizer: object
    policy: PeftModel
    critic: PeftModel | None
    device: torch.device

    @property
    def adapters(self) -> "AdapterSet":
        models = {"policy": self.policy} if self.critic is None else {"policy": self.policy, "critic": self.critic}
        return AdapterSet(models)


def build_models(config: ModelConfig, with_critic: bool, seed: int = 0) -> Models:
    """Load the base model(s) and attach LoRA adapters: fresh ones, or for the policy
    ``model.init_adapter``'s weights (``load_init_adapter``).

    Seeding first makes the fresh adapters identical in every process, so the server and the
    clients start from the same global adapter without shipping it.
    """
    torch.manual_seed(seed)
    device = select_device(config.device)
    policy = load_policy(config, device)
    if config.init_adapter:
        load_init_adapter(policy, config)
    tokenizer = load_tokenizer(resolve_model_path(config))
    critic = load_critic(config, device) if with_critic else None
    return Models(tokenizer=tokenizer, policy=policy, critic=critic, device=device)


def check_lengths(config: EngineConfig, models: Models, rows: list[Row]) -> None:
    """A rollout's sequence, its prompt (cut to ``data.max_prompt_length`` tokens) plus
    ``rollout.response_length`` new tokens, must fit the model's ``max_position_embeddings``.

    The rule counts the prompts that are actually there: positions needed = min(data.max_prompt_length,
    the longest of ``rows``' prompts in tokens) + rollout.response_length. So the embedded model (64
    positions) passes under the default max_prompt_length of 256 with its short prompts, and a
    long prompt fails here rather than being cut to a length the model cannot hold. The prompts
    are tokenized only when the configured sum exceeds the limit.
    """
    limit = getattr(models.policy.config, "max_position_embeddings", None)
    prompt, response = config.data.max_prompt_length, config.rollout.response_length
    if limit is None or prompt + response <= limit:
        return
    texts = [prompt_text(row, models.tokenizer) for row in rows]
    longest = max((len(ids) for ids in models.tokenizer(texts, add_special_tokens=False)["input_ids"]), default=0)
    if min(prompt, longest) + response > limit:
        raise ConfigError(
            f"data.max_prompt_length={prompt} + rollout.response_length={response} do not fit the model's "
            f"max_position_embeddings={limit}: the longest prompt has {longest} tokens, so a rollout needs "
            f"{min(prompt, longest) + response} positions. Allowed: data.max_prompt_length + "
            f"rollout.response_length <= {limit} (longer prompts are cut from the left), or shorter prompts"
        )


@dataclass
class AdapterSet:
    """The trainable weights of one or more PEFT models, as one ordered list of arrays.

    Order: each model in the order given (policy first, then critic), and within a model the
    order of ``named_parameters()``, which follows module registration and is therefore the
    same in every process that builds the same architecture. ``names`` documents it.
    """

    models: dict[str, torch.nn.Module]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [
            (f"{role}/{name}", param)
            for role, model in self.models.items()
            for name, param in model.named_parameters()
            if param.requires_grad
        ]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.named_parameters()]

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return [param for _, param in self.named_parameters()]

    def get_arrays(self) -> list[np.ndarray]:
        return [param.detach().to("cpu", torch.float32).numpy().copy() for param in self.parameters]

    def set_arrays(self, arrays: list[np.ndarray]) -> None:
        named = self.named_parameters()
        if len(arrays) != len(named):
            raise AdapterShapeError(
                f"expected {len(named)} adapter arrays (first {named[0][0]} {tuple(named[0][1].shape)}), "
                f"received {len(arrays)}: {[tuple(np.shape(a)) for a in arrays][:4]}..."
            )
        for (name, param), array in zip(named, arrays):
            if tuple(np.shape(array)) != tuple(param.shape):
                raise AdapterShapeError(
                    f"adapter array {name}: expected shape {tuple(param.shape)}, received {tuple(np.shape(array))}"
                )
        with torch.no_grad():
            for param, array in zip(self.parameters, arrays):
                param.copy_(torch.as_tensor(np.asarray(array), dtype=param.dtype, device=param.device))

    def num_parameters(self) -> int:
        return sum(param.numel() for param in self.parameters)

    @property
    def frozen_fingerprint(self) -> str:
        """sha256 of every weight that never travels, names and bytes: the base model's, and the
        LoRA A factors frozen under FFA-LoRA. The adapter updates only mean the same thing on the
        server and on every client when these are bit-identical there: the preflight compares
        this fingerprint."""
        digest = hashlib.sha256()
        for role, model in self.models.items():
            for name, param in model.named_parameters():
                if not param.requires_grad:
                    digest.update(f"{role}/{name}".encode())
                    digest.update(param.detach().to("cpu").reshape(-1).view(torch.uint8).numpy())
        return digest.hexdigest()

    def save(self, directory: Path) -> None:
        """One standard PEFT adapter directory per model (``policy/``, ``critic/``)."""
        for role, model in self.models.items():
            model.save_pretrained(Path(directory) / role)
        (Path(directory) / "adapter_order.json").write_text(json.dumps(self.names, indent=1))


def load_init_adapter(policy: PeftModel, config: ModelConfig) -> None:
    """``model.init_adapter``: the policy's LoRA weights, bit for bit, from a saved PEFT adapter
    (a stage-sft run's ``adapters/final/policy``). It must be an adapter of this shape: the same
    rank and alpha as ``model.lora_rank``/``model.lora_alpha``, and a weight for every trainable
    one of the policy (the same ``model.target_modules``); otherwise a ``ConfigError`` names the
    key. The reference policy for KL stays the base with the adapter disabled."""
    directory = Path(config.init_adapter).expanduser()
    saved = json.loads((directory / "adapter_config.json").read_text())
    if (saved.get("r"), float(saved.get("lora_alpha", 0))) != (config.lora_rank, config.lora_alpha):
        raise ConfigError(f"model.init_adapter={config.init_adapter!r} has LoRA r={saved.get('r')}, "
                          f"lora_alpha={saved.get('lora_alpha')}; set model.lora_rank and model.lora_alpha to "
                          f"them (now {config.lora_rank}, {config.lora_alpha:g})")
    try:
        result = load_adapter_into(policy, directory)
    except (RuntimeError, ValueError, OSError) as error:  # torch's size mismatch, a missing weights file
        raise ConfigError(f"model.init_adapter={config.init_adapter!r} does not fit this policy: {error}") from error
    missing = [key for key in result.missing_keys if ".lora_" in key]
    if missing or result.unexpected_keys:
        raise ConfigError(f"model.init_adapter={config.init_adapter!r} does not fit this policy's LoRA layers "
                          f"(model.target_modules={config.target_modules!r}): {len(missing)} missing "
                          f"(first {missing[:1]}), {len(result.unexpected_keys)} unexpected "
                          f"(first {list(result.unexpected_keys)[:1]})")


def load_adapter_into(model: PeftModel, directory: Path):
    """Load a saved PEFT adapter directory into an already-built PEFT model (same LoRA config);
    torch's load result (``missing_keys``, ``unexpected_keys``)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    return set_peft_model_state_dict(model, load_peft_weights(str(directory), device="cpu"))
