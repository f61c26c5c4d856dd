"""ClientApp: one organisation's node. Its partition comes from the node config
(``partition-id``, ``num-partitions``), in simulation and deployment alike; a node may also set
its own privacy budget (``epsilon-budget``).

In a deployment every message runs in a fresh ClientApp process. This module therefore imports
Flower only. With node config ``engine = "warm"`` (the default) ``client_fn`` returns a thin
forwarder to the node's warm engine process (``flwr_verl.federation.engine_client``), which keeps
torch, transformers, verl and the model loaded across messages and runs; with ``engine = "cold"``
it imports and builds the engine in this process, for messages that train or evaluate only (the
three SecAgg+ key-exchange stages never call ``client_fn``'s client). Only a ``flwr-clientapp``
process forwards: a simulation's Ray actors, and a ClientApp called in a process that keeps
running, stay up across messages and build the engine in place, as with ``cold``.
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
    from flwr_verl.federation.engine_client import (
        TimedClient,
        WarmClient,
        fresh_process_per_message,
        node_engine,
        process_age_s,
    )

    called_at = process_age_s()  # what Flower's ClientApp process took before this call (logged per message)
    settings = node_engine(context.node_config)
    if settings.kind == "warm" and fresh_process_per_message():  # elsewhere this process is warm already
        return WarmClient(context, settings, called_at).to_client()
    from flwr_verl.federation.client import client_from_context
    from flwr_verl.federation.run_config import load_run_config

    config = load_run_config(context.run_config).engine
    return TimedClient(client_from_context(context, config), called_at).to_client()


app = ClientApp(client_fn=client_fn, mods=[concise_errors, secaggplus_when_requested])
