"""What one node brings to the federation beyond its messages: its node config (the partition
it trains, its own epsilon budgets, its privacy ledger, its own reward model and protected
text), read and checked here, and the per-process caches of its models, data and ledgers
(Flower builds a fresh client for every message)."""

from __future__ import annotations

import dataclasses
from typing import Any

from flwr.app import Context

from flwr_verl.config import ConfigError, EngineConfig
from flwr_verl.engine.data import Row
from flwr_verl.engine.models import Models
from flwr_verl.engine.reward_model import PATH_KEY, DPOVerifier, RewardModel, load_dpo_verifier, load_reward_model
from flwr_verl.privacy.ledger import NODE_PRIVACY_LEDGER, PrivacyLedger, default_path
from flwr_verl.stages import build_stage_models, load_stage_rows

NODE_EPSILON_BUDGET = "epsilon-budget"  # node-config key: this node's own budget, when stricter than the run's
NODE_CLIENT_EPSILON_BUDGET = "client-epsilon-budget"  # node-config key: its client-level DP budget (its own unit)
NODE_CLIENT_ID = "client-id"  # node-config key: the name this client gives itself in reports and error lines
NODE_REWARD_MODEL_PATH = "reward-model-path"  # node-config key: this node's own reward model (never sent)
NODE_DEIDENTIFY_CORPUS = "deidentify-corpus-file"  # node-config key: this node's protected text (deidentify.py)

_MODELS: dict[str, Models] = {}
_ROWS: dict[str, list[Row]] = {}
_LEDGERS: dict[str, PrivacyLedger] = {}
_REWARD_MODELS: dict[str, RewardModel | DPOVerifier] = {}


def _models_key(config: EngineConfig) -> str:
    return repr((config.stage, config.model, config.needs_critic, config.trainer.seed))


def cached_models(config: EngineConfig) -> Models:
    """One set of models per process and model config (Flower re-creates clients per message)."""
    key = _models_key(config)
    if key not in _MODELS:
        _MODELS[key] = build_stage_models(config)
    return _MODELS[key]


def keep_only_models(config: EngineConfig) -> bool:
    """Drop every cached set of models but ``config``'s, before it is built: a warm engine then
    never holds two copies of a base model (a 7B one on a GPU twice would not fit). True when
    something was dropped."""
    others = [key for key in _MODELS if key != _models_key(config)]
    for key in others:
        del _MODELS[key]
    if others:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return bool(others)


def cached_reward_model(config: EngineConfig, path: str, key: str, device) -> RewardModel | DPOVerifier:
    """One reward model per process, kind, path and device (read-only, so clients can share it):
    a classifier, or a DPO policy adapter on the policy's base (``reward_model.kind``)."""
    kind = config.reward_model.kind
    cache_key = repr((kind, path, config.model if kind == "implicit" else None, str(device)))
    if cache_key not in _REWARD_MODELS:
        _REWARD_MODELS[cache_key] = (load_dpo_verifier(path, config.model, device, key=key) if kind == "implicit"
                                     else load_reward_model(path, device, key=key))
    return _REWARD_MODELS[cache_key]


def cached_rows(config: EngineConfig, split: str, partition_id: int, num_partitions: int) -> list[Row]:
    key = repr((config.stage, config.data, split, partition_id, num_partitions, config.trainer.seed))
    if key not in _ROWS:
        _ROWS[key] = load_stage_rows(config, split, config.trainer.seed, partition_id, num_partitions)
    return _ROWS[key]


def node_ledger(context: Context) -> PrivacyLedger:
    """This node's privacy ledger: the file at node config ``privacy-ledger``, else the default
    under Flower's state directory (one connection per process)."""
    path = context.node_config.get(NODE_PRIVACY_LEDGER, str(default_path()))
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"node config {NODE_PRIVACY_LEDGER}={path!r} is invalid: must be a file path")
    if path not in _LEDGERS:
        _LEDGERS[path] = PrivacyLedger(path)
    return _LEDGERS[path]


def with_node_reward_model(config: EngineConfig, path: Any) -> tuple[EngineConfig, str]:
    """``config`` with the node's own ``reward-model-path`` in place of ``reward_model.model.path``,
    and the key that errors about the path should name. The node's model is used only when the
    run enables a reward model (``reward_model.enable``): the objective is the federation's choice."""
    if path is None or not config.reward_model.enable:
        return config, PATH_KEY
    if not isinstance(path, str) or not path:
        raise ConfigError(f"node config {NODE_REWARD_MODEL_PATH}={path!r} is invalid: must be a directory path")
    reward_model = dataclasses.replace(config.reward_model,
                                       model=dataclasses.replace(config.reward_model.model, path=path))
    return dataclasses.replace(config, reward_model=reward_model), f"node config {NODE_REWARD_MODEL_PATH}"


def with_node_budget(config: EngineConfig, budget: Any) -> EngineConfig:
    """``config`` with the stricter of its epsilon budget and the node's own ``epsilon-budget``."""
    if budget is None:
        return config
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"node config {NODE_EPSILON_BUDGET}={budget!r} is invalid: must be a number > 0")
    federation_budget = config.privacy.epsilon_budget
    strictest = min(float(budget), federation_budget) if federation_budget > 0 else float(budget)
    return dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, epsilon_budget=strictest))


def node_client_epsilon_budget(budget: Any) -> float:
    """The node's ``client-epsilon-budget``: a number > 0, or 0 when unset (no budget)."""
    if budget is None:
        return 0.0
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"node config {NODE_CLIENT_EPSILON_BUDGET}={budget!r} is invalid: must be a number > 0 "
                          "(the client-level epsilon this node's data set may spend, over all runs)")
    return float(budget)


def with_node_corpus(config: EngineConfig, corpus_file: Any) -> EngineConfig:
    """``config`` with the node's own ``deidentify-corpus-file`` as ``deidentify.corpus_file``:
    each organisation protects its own text, at a path on its own machine."""
    if corpus_file is None:
        return config
    if not isinstance(corpus_file, str):
        raise ConfigError(f"node config {NODE_DEIDENTIFY_CORPUS}={corpus_file!r} is invalid: must be a path string")
    return dataclasses.replace(config, deidentify=dataclasses.replace(config.deidentify, corpus_file=corpus_file))
