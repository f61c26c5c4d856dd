"""The RLHF pipeline's stages behind one seam: the models a stage trains, the data it reads and
its local objective. The client and the server ask here; nothing else branches on ``stage``.

- ``policy``: verl's PPO family (``trainer.LocalPPOTrainer``) on prompts, against the rule
  reward or a learned reward model (``reward_model.*``);
- ``reward_model``: Bradley-Terry on preference pairs (``preference.LocalRewardModelTrainer``);
  its merged output directory is a later ``policy`` stage's ``reward_model.model.path``.

Every stage trains LoRA adapters through ``trainer.start_update`` (the same DP-SGD, FedProx and
accounting), so the federation (strategy, SecAgg+, run directory, resume) is the same for all.
"""

from __future__ import annotations

from flwr_verl.config import EngineConfig


def build_stage_models(config: EngineConfig):
    """The models of ``config.stage``, seeded: every process builds the same initial adapter."""
    if config.stage == "reward_model":
        from flwr_verl.preference import build_reward_model_trainee

        return build_reward_model_trainee(config.model, seed=config.trainer.seed)
    from flwr_verl.models import build_models

    return build_models(config.model, config.needs_critic, seed=config.trainer.seed)


def load_stage_rows(config: EngineConfig, split: str, seed: int, partition_id: int, num_partitions: int) -> list:
    """One client's training units of ``split``: prompts (policy) or preference units (reward_model)."""
    if config.stage == "reward_model":
        from flwr_verl.preference import load_units

        return load_units(config.data, split, seed, partition_id, num_partitions)
    from flwr_verl.data import load_rows

    return load_rows(config.data, split, seed, partition_id, num_partitions)


def reward_model_trainer(config: EngineConfig, train_units: list, val_units: list, models):
    """Stage ``reward_model``'s local trainer, its data checked against the model first."""
    from flwr_verl.preference import LocalRewardModelTrainer, check_unit_lengths

    check_unit_lengths(models, train_units + val_units)
    return LocalRewardModelTrainer(config, train_units, models=models)
