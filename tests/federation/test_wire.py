"""Bytes on the wire: the server meters every message it exchanges (``wire.MeteredGrid``) and
writes the figures into each round's ``metrics.jsonl`` record.

The app's real ServerApp and ClientApp (SecAgg+ mods included) run in this process over the
loopback grid of ``benchmarks/federation_wire.py``, which counts what it carries on its own:
the server's record must agree with it, and each upload must be its arrays plus a bounded
overhead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flwr_verl.config import parse_run_config
from flwr_verl.engine.models import build_models

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from federation_wire import measure_wire  # noqa: E402

RUN = {"num-server-rounds": 1, "min-fit-clients": 3, "min-evaluate-clients": 3, "min-available-clients": 3,
       "evaluate-every": 0, "data.train_size": 32, "data.val_size": 8, "data.train_batch_size": 8, "rollout.n": 2,
       "rollout.response_length": 6, "actor.ppo_mini_batch_size": 4, "trainer.local_iterations": 1,
       "privacy.enabled": False}
# Per message: Flower's object headers and ids, the FitReport's metrics, the config records.
OVERHEAD_PER_ARRAY, OVERHEAD = 512, 8192


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "secagg-ffa-lora"])
def measured(request):
    secure = request.param
    # In the clear, round 1's updates of all A factors are zero (B starts at zero) and identical
    # arrays travel as one object: the upload is measured in round 2.
    config = {**RUN, "secagg.enabled": secure, "model.lora_freeze_a": secure, "num-server-rounds": 1 if secure else 2}
    traffic, records = measure_wire(config, num_clients=3)
    adapters = build_models(parse_run_config(config).engine.model, with_critic=False).adapters
    return secure, traffic, records, adapters


def test_the_record_agrees_with_what_the_transport_carried(measured):
    _, traffic, records, _ = measured
    recorded: dict[str, dict[str, int]] = {"up": {}, "down": {}}
    for record in records:  # the preflight goes into round 0's record, or round 1's when there is none
        for direction in recorded:
            for stage, size in record["wire"][direction].items():
                recorded[direction][stage] = recorded[direction].get(stage, 0) + size
    carried: dict[str, dict[str, int]] = {"up": {}, "down": {}}
    for (_, direction, stage), sizes in traffic.items():
        carried[direction][stage] = carried[direction].get(stage, 0) + sum(objects for _, objects in sizes)
    assert recorded == carried
    assert set(records[-1]["wire"]["per_client"]) == {"1", "2", "3"}


def test_each_upload_is_its_arrays_plus_a_bounded_overhead(measured):
    secure, _, records, adapters = measured
    wire = records[-1]["wire"]
    params, arrays = adapters.num_parameters(), len(adapters.names)
    if secure:  # one masked int64 vector (8 bytes a parameter whatever the 2**40 modulus), B factors only
        assert all(".lora_B." in name for name in adapters.names)
        payload, stage = 8 * params, "secagg_collect_masked_vectors"
        assert {"secagg_setup", "secagg_share_keys", "secagg_unmask"} <= set(wire["up"])
    else:  # the float32 update arrays
        payload, stage = 4 * params, "train"
    per_client = wire["up"][stage] / 3
    assert payload <= per_client <= payload + OVERHEAD_PER_ARRAY * arrays + OVERHEAD, (per_client, payload)
    assert records[-1]["clients"] == [0, 1, 2]  # the round aggregated every client's update
