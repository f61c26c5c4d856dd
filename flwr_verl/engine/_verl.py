"""The one place flwr-verl imports verl.

Importing verl prints warnings about optional GPU engines it cannot find, and calls
``logging.basicConfig`` (which makes every Flower log line appear twice). Both are side effects
of import, so they are contained here; the rest of the package imports verl's pieces from this
module.

Only verl's light modules are imported: ``core_algos``, the configs, ``torch_functional`` and
the reward scorers. ``verl.trainer.ppo.ray_trainer`` (the Ray driver: pandas, datasets, FastAPI,
uvicorn, torchdata) and ``verl.workers.reward_manager`` (pydantic, aiohttp) are not; the three
small driver functions this engine uses from ``ray_trainer`` are restated below over
``core_algos``, and the reward manager lives in ``flwr_verl.engine.rewards``. Ray itself is still
imported (about 1.4 s and 50 MiB): ``verl.protocol``, which defines ``DataProto``, imports it at
module level. A stand-in module in ``sys.modules`` during verl's import would avoid that, but
it races with any thread that imports Ray meanwhile (Flower's simulation runtime does, beside
the ServerApp), so it is not done.
"""

from __future__ import annotations

import logging
import warnings

import torch

from flwr_verl.config import EngineConfig, require

_root = logging.getLogger()
_handlers_before = list(_root.handlers)
_level_before = _root.level
logging.disable(logging.WARNING)  # verl logs "no accelerator" warnings while it imports
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from verl import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.config.algorithm import KLControlConfig
        from verl.trainer.ppo import core_algos
        from verl.utils import torch_functional as verl_F
        from verl.utils.import_utils import load_extern_object
        from verl.utils.model import compute_position_id_with_mask
        from verl.utils.reward_score import default_compute_score
        from verl.utils.reward_score.gsm8k import extract_solution
        from verl.workers.config import ActorConfig as VerlActorConfig
finally:
    logging.disable(logging.NOTSET)
    _root.handlers[:] = _handlers_before
    _root.setLevel(_level_before)


# ----------------------------------------------------------------------------- from ray_trainer
# verl's driver functions of the same names and signatures (verl.trainer.ppo.ray_trainer),
# restated for the estimators flwr-verl offers; tests/engine/test_lean.py checks them against
# verl's own.
def compute_response_mask(data: DataProto) -> torch.Tensor:
    """The attention mask over the response tokens: (bs, R)."""
    response_length = data.batch["responses"].size(1)
    return data.batch["attention_mask"][:, -response_length:]


def apply_kl_penalty(data: DataProto, kl_ctrl, kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * KL(old || ref) per token (bs, R); the
    batch's mean KL updates ``kl_ctrl`` (an adaptive controller moves beta)."""
    response_mask = data.batch["response_mask"]
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty)
    kld = kld * response_mask
    beta = kl_ctrl.value
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = torch.mean(verl_F.masked_mean(kld, mask=response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=data.batch.batch_size[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_advantage(data: DataProto, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      num_repeat: int = 1, norm_adv_by_std_in_grpo: bool = True,
                      config: AlgoConfig | None = None) -> DataProto:
    """``advantages`` and ``returns`` (bs, R) from verl's registered estimator ``adv_estimator``.
    ``num_repeat`` is unused, as in verl (the groups come from ``uid``)."""
    batch = data.batch
    if adv_estimator == "gae":
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=batch["token_level_rewards"], values=batch["values"],
            response_mask=batch["response_mask"], gamma=gamma, lam=lam)
    elif adv_estimator == "grpo":
        advantages, returns = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
            index=data.non_tensor_batch["uid"], norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    else:
        kwargs = {"token_level_rewards": batch["token_level_rewards"], "response_mask": batch["response_mask"],
                  "config": config}
        if "uid" in data.non_tensor_batch:
            kwargs["index"] = data.non_tensor_batch["uid"]
        if "reward_baselines" in batch.keys():
            kwargs["reward_baselines"] = batch["reward_baselines"]
        advantages, returns = core_algos.get_adv_estimator_fn(adv_estimator)(**kwargs)
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data


__all__ = [
    "AlgoConfig",
    "check_registered_names",
    "DataProto",
    "KLControlConfig",
    "VerlActorConfig",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_response_mask",
    "core_algos",
    "compute_position_id_with_mask",
    "default_compute_score",
    "extract_solution",
    "load_extern_object",
    "verl_F",
]


def check_registered_names(config: EngineConfig) -> None:
    """The config's names that verl's registries must know (``actor.policy_loss``), checked
    against them, so that a name registered with ``register_policy_loss`` is accepted too."""
    losses = sorted(core_algos.POLICY_LOSS_REGISTRY)
    require(config.actor.policy_loss in losses, "actor.policy_loss", config.actor.policy_loss,
            f"allowed: {', '.join(losses)}")
