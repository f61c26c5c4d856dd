"""Stage ``policy``: verl's PPO family on prompts (``engine.trainer.LocalPPOTrainer``), against the
rule reward or a learned reward model; the client builds its trainer around the node's reward."""

from __future__ import annotations

from flwr_verl.engine.data import load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.stages import Stage

STAGE = Stage(
    build_models=lambda config: build_models(config.model, config.needs_critic, seed=config.trainer.seed),
    load_units=lambda config, split, seed, partition_id, num_partitions: load_rows(
        config.data, split, seed, partition_id, num_partitions),
    unit_trainer=None,
    prompt_of=lambda row: row["prompt"],
)
