"""flwr-verl: privacy-preserving federated RLHF on Flower, verl and Opacus.

The package is a house of rooms; each imports only the rooms listed before it:

- ``config``: typed configuration and its errors, validated once at the edge (imports nothing of
  flwr-verl);
- ``embedded``: the default task and the shipped tiny model, made offline;
- ``privacy``: DP-SGD with per-prompt gradients, the accountant, the node's ledger, client-level
  distributed DP, the privacy audit's statistics, generation-time de-identification;
- ``engine``: the local RL engine on LoRA adapters (data, models, rollout, rewards, log-probs,
  verl's PPO family), with no Flower import;
- ``stages``: the RLHF pipeline's stages (sft, reward_model, dpo, policy) behind one interface;
- ``federation``: the Flower client and strategy, the round workflow with SecAgg+, the wire
  protocol, compression, checkpoints and the server;
- ``tools``: command lines (``flwr-verl``, the baseline, the audit, model builders).

The flat module paths of version 0.1 (``flwr_verl.client``, ``flwr_verl.trainer``, ...) still
import, with a ``DeprecationWarning`` naming the new path; they go in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# Version 0.1's flat modules and where they live now.
MOVED_MODULES = {
    "_verl": "engine._verl", "data": "engine.data", "models": "engine.models", "forward": "engine.forward",
    "rollout": "engine.rollout", "rewards": "engine.rewards", "reward_model": "engine.reward_model",
    "trainer": "engine.trainer", "proximal": "engine.proximal",
    "per_sample": "privacy.per_sample", "ledger": "privacy.ledger", "distributed_dp": "privacy.distributed_dp",
    "deidentify": "privacy.deidentify", "audit": "tools.audit",
    "supervised": "stages.supervised", "sft": "stages.sft", "preference": "stages.preference", "dpo": "stages.dpo",
    "client": "federation.client", "strategy": "federation.strategy", "workflow": "federation.workflow",
    "protocol": "federation.protocol", "secagg": "federation.secagg", "compression": "federation.compression",
    "wire": "federation.wire", "checkpoint": "federation.checkpoint", "rundir": "federation.rundir",
    "server": "federation.server", "mods": "federation.mods", "inprocess": "federation.inprocess",
    "cli": "tools.cli", "baseline": "tools.baseline", "smollm2": "tools.smollm2",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``flwr_verl.<old>`` as the module at its new path (the same module object, so
    patches and ``isinstance`` behave), warning once per old path."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if fullname.startswith(__name__ + ".") and old in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        new = f"{__name__}.{MOVED_MODULES[module.__name__.removeprefix(__name__ + '.')]}"
        warnings.warn(f"{module.__name__} moved to {new}; the old path goes in flwr-verl 0.2",
                      DeprecationWarning, stacklevel=2)
        sys.modules[module.__name__] = importlib.import_module(new)  # what the import statement returns


# First in line: an installed copy of 0.1 elsewhere on the path must not answer for the old names.
if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())
