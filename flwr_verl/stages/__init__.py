"""The RLHF pipeline's stages behind one interface: the models a stage trains, the data it
reads and its local trainer. The client and the server ask here; nothing else branches on
``stage``.

- ``sft``: supervised fine-tuning of the policy on (prompt, response) pairs (``stages.sft``);
  its final adapter is a later stage's ``model.init_adapter``;
- ``reward_model``: Bradley-Terry on preference pairs (``stages.preference``); its merged output
  directory is a later ``policy`` stage's ``reward_model.model.path``;
- ``dpo``: direct preference optimisation of the policy on preference pairs (``stages.dpo``);
  its final adapter is a later stage's ``model.init_adapter``;
- ``policy``: verl's PPO family (``engine.trainer.LocalPPOTrainer``) on prompts, against the rule
  reward or a learned reward model (``reward_model.*``; ``stages.policy``).

Every stage trains LoRA adapters through ``engine.update.start_update`` (the same DP-SGD,
FedProx and accounting), so the federation (strategy, SecAgg+, run directory, resume) is the same
for all. ``sft``, ``reward_model`` and ``dpo`` learn from fixed data, in the loop of
``stages.supervised.UnitTrainer``.

Adding a stage: a module here that defines ``STAGE = Stage(...)``, one line in ``REGISTRY``, and
its name in ``config.STAGES`` (a test keeps the two equal).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from flwr_verl.config import DataConfig, EngineConfig

# stage name -> the module of this package that defines its ``STAGE`` (imported on first use:
# each pulls in torch and transformers, which the light parts of the server never need)
REGISTRY = {"policy": "policy", "sft": "sft", "reward_model": "preference", "dpo": "dpo"}


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline.

    - ``build_models(config)``: its models, seeded, so every process builds the same initial
      adapter (``model.init_adapter``'s, when set);
    - ``load_units(config.data, split, seed, partition_id, num_partitions)``: one client's privacy
      units of ``split``: prompts (policy), (prompt, responses) units (sft) or preference units;
    - ``unit_trainer(config, train_units, val_units, models)``: the local trainer of a fixed-data
      stage, its data checked against the model first; None for ``policy``, whose trainer the
      client builds around its reward (``federation.client.VerlClient``);
    - ``prompt_of(unit)``: a unit's prompt (its messages), what the node's ledger keys a data set
      by (``privacy.ledger.fingerprint_prompts``), so that the same prompts key alike in every stage.
    """

    build_models: Callable[[EngineConfig], Any]
    load_units: Callable[[DataConfig, str, int, int, int], list]
    unit_trainer: Callable[[EngineConfig, list, list, Any], Any] | None
    prompt_of: Callable[[Any], list[dict]]


def stage(name: str) -> Stage:
    """The registered stage ``name`` (one of ``config.STAGES``, which the config has validated)."""
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").STAGE


def build_stage_models(config: EngineConfig):
    """The models of ``config.stage``, seeded (``Stage.build_models``)."""
    return stage(config.stage).build_models(config)


def load_stage_rows(config: EngineConfig, split: str, seed: int, partition_id: int, num_partitions: int) -> list:
    """One client's training units of ``split`` for ``config.stage`` (``Stage.load_units``)."""
    return stage(config.stage).load_units(config.data, split, seed, partition_id, num_partitions)


def unit_trainer(config: EngineConfig, train_units: list, val_units: list, models):
    """The local trainer of a fixed-data stage (``Stage.unit_trainer``)."""
    make = stage(config.stage).unit_trainer
    if make is None:
        raise ValueError(f"stage={config.stage!r} trains against a reward: build engine.trainer.LocalPPOTrainer")
    return make(config, train_units, val_units, models)


def unit_prompts(config: EngineConfig, units: list) -> list[list[dict]]:
    """The prompt (its messages) of each of ``units`` (``Stage.prompt_of``)."""
    prompt_of = stage(config.stage).prompt_of
    return [prompt_of(unit) for unit in units]
