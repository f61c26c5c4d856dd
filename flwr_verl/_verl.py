"""The one place flwr-verl imports verl.

Importing verl prints warnings about optional GPU engines it cannot find, and calls
``logging.basicConfig`` (which makes every Flower log line appear twice). Both are side effects
of import, so they are contained here; the rest of the package imports verl's pieces from this
module.
"""

from __future__ import annotations

import logging
import warnings

_root = logging.getLogger()
_handlers_before = list(_root.handlers)
_level_before = _root.level
logging.disable(logging.WARNING)  # verl logs "no accelerator" warnings while it imports
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import KLControlConfig
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import apply_kl_penalty, compute_advantage, compute_response_mask
    from verl.utils import torch_functional as verl_F
    from verl.utils.import_utils import load_extern_object
    from verl.utils.model import compute_position_id_with_mask
    from verl.utils.reward_score import default_compute_score
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.reward_manager import NaiveRewardManager
logging.disable(logging.NOTSET)
_root.handlers[:] = _handlers_before
_root.setLevel(_level_before)

__all__ = [
    "AlgoConfig",
    "DataProto",
    "KLControlConfig",
    "NaiveRewardManager",
    "VerlActorConfig",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_response_mask",
    "core_algos",
    "compute_position_id_with_mask",
    "default_compute_score",
    "load_extern_object",
    "verl_F",
]
