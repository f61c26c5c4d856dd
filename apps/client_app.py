"""ClientApp: one organisation's node. Its partition comes from the node config
(``partition-id``, ``num-partitions``), in simulation and deployment alike; a node may also set
its own privacy budget (``epsilon-budget``).

In a deployment every message runs in a fresh ClientApp process. This module therefore imports
Flower only; the RL engine (torch, transformers, verl) is imported by ``client_fn``, which runs
only for messages that train or evaluate, not for the three SecAgg+ key-exchange stages.
Errors reach the server as one-line error replies (``flwr_verl.federation.mods.concise_errors``).
"""

import logging

from flwr.app import Context
from flwr.client import Client, ClientApp

from flwr_verl.federation.mods import concise_errors, install_concise_errors, secaggplus_when_requested

# SecAgg+ logs every protocol stage at DEBUG; keep client output to one line per event that matters.
logging.getLogger("flwr").setLevel(logging.INFO)
install_concise_errors()


def client_fn(context: Context) -> Client:
    from flwr_verl.federation.client import client_from_context
    from flwr_verl.federation.run_config import load_run_config

    config = load_run_config(context.run_config).engine
    return client_from_context(context, config).to_client()


app = ClientApp(client_fn=client_fn, mods=[concise_errors, secaggplus_when_requested])
