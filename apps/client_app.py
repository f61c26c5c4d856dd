"""ClientApp: one organisation's node. Its partition comes from the node config
(``partition-id``, ``num-partitions``), in simulation and deployment alike."""

import logging

from flwr.app import Context
from flwr.client import Client, ClientApp

from flwr_verl.client import client_from_context, secaggplus_when_requested
from flwr_verl.config import parse_run_config


# SecAgg+ logs every protocol stage at DEBUG; keep client output to one line per event that matters.
logging.getLogger("flwr").setLevel(logging.INFO)


def client_fn(context: Context) -> Client:
    config = parse_run_config(context.run_config).engine
    return client_from_context(context, config).to_client()


app = ClientApp(client_fn=client_fn, mods=[secaggplus_when_requested])
