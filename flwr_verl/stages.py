"""The RLHF pipeline's stages behind one seam: the models a stage trains, the data it reads and
its local objective. The client and the server ask here; nothing else branches on ``stage``.

- ``sft``: supervised fine-tuning of the policy on (prompt, response) pairs
  (``sft.LocalSFTTrainer``); its final adapter is a later stage's ``model.init_adapter``;
- ``reward_model``: Bradley-Terry on preference pairs (``preference.LocalRewardModelTrainer``);
  its merged output directory is a later ``policy`` stage's ``reward_model.model.path``;
- ``dpo``: direct preference optimisation of the policy on preference pairs
  (``dpo.LocalDPOTrainer``); its final adapter is a later stage's ``model.init_adapter``;
- ``policy``: verl's PPO family (``trainer.LocalPPOTrainer``) on prompts, against the rule
  reward or a learned reward model (``reward_model.*``).

Every stage trains LoRA adapters through ``trainer.start_update`` (the same DP-SGD, FedProx and
accounting), so the federation (strategy, SecAgg+, run directory, resume) is the same for all.
``sft``, ``reward_model`` and ``dpo`` learn from fixed data, in the loop of ``supervised.UnitTrainer``.
"""

from __future__ import annotations

from flwr_verl.config import EngineConfig


def build_stage_models(config: EngineConfig):
    """The models of ``config.stage``, seeded: every process builds the same initial adapter
    (``model.init_adapter``'s, when set)."""
    if config.stage == "reward_model":
        from flwr_verl.preference import build_reward_model_trainee

        return build_reward_model_trainee(config.model, seed=config.trainer.seed)
    from flwr_verl.models import build_models  # sft and dpo train the policy itself

    return build_models(config.model, config.needs_critic, seed=config.trainer.seed)


def load_stage_rows(config: EngineConfig, split: str, seed: int, partition_id: int, num_partitions: int) -> list:
    """One client's training units of ``split``: prompts (policy), preference units
    (reward_model) or (prompt, responses) units (sft)."""
    if config.stage in ("reward_model", "dpo"):
        from flwr_verl.preference import load_units

        return load_units(config.data, split, seed, partition_id, num_partitions)
    if config.stage == "sft":
        from flwr_verl.sft import load_units

        return load_units(config.data, split, seed, partition_id, num_partitions)
    from flwr_verl.data import load_rows

    return load_rows(config.data, split, seed, partition_id, num_partitions)


def unit_trainer(config: EngineConfig, train_units: list, val_units: list, models):
    """The local trainer of a fixed-data stage (sft, reward_model, dpo), its data checked against
    the model first."""
    if config.stage == "dpo":
        from flwr_verl.dpo import LocalDPOTrainer, check_unit_lengths

        check_unit_lengths(config, models, train_units + val_units)
        return LocalDPOTrainer(config, train_units, models=models)
    if config.stage == "sft":
        from flwr_verl.sft import LocalSFTTrainer, check_unit_lengths

        check_unit_lengths(config, models, train_units + val_units)
        return LocalSFTTrainer(config, train_units, models=models)
    from flwr_verl.preference import LocalRewardModelTrainer, check_unit_lengths

    check_unit_lengths(models, train_units + val_units)
    return LocalRewardModelTrainer(config, train_units, models=models)


def unit_prompts(config: EngineConfig, units: list) -> list[list[dict]]:
    """The prompt (its messages) of each of ``units`` (``load_stage_rows``'s): what the node's
    ledger keys a data set by (``ledger.fingerprint_prompts``), so that the same prompts key alike
    in every stage."""
    if config.stage == "policy":
        return [row["prompt"] for row in units]
    return [unit.prompt for unit in units]  # sft.SFTUnit, preference.PreferenceUnit (reward_model, dpo)
