"""Real processes against a lying node: a SuperLink and 3 SuperNodes on loopback, SecAgg+ and DP
on, where one node runs a ClientApp changed to attack (as anyone who controls a node can).

- Poisoning: the node puts NaN into its upload after its own checks, before SecAgg+ masks it.
  The server cannot see that update, but the unmasked sum is not one honest clients can send:
  the round fails, naming it, and nothing of it is saved.
- A borrowed identity: a node claims another node's ``client-id``. The run is refused before
  round 1, naming both nodes, and nothing is trained.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.flower_harness import FAULT_RUN, REPO, RUN_DEADLINE_S, count_in, local_deployment, records, run_directories

pytestmark = pytest.mark.slow

POISONING_CLIENT_APP = '''"""A ClientApp that poisons its upload on partition 2: the honest client's fit, then one NaN,
after every check the client makes and before SecAgg+ masks it."""

from flwr.client import ClientApp

from apps.client_app import client_fn as honest_client_fn
from flwr_verl.federation.mods import concise_errors, secaggplus_when_requested


def client_fn(context):
    client = honest_client_fn(context)
    if int(context.node_config["partition-id"]) == 2:
        numpy_client, honest_fit = client.numpy_client, client.numpy_client.fit

        def fit(parameters, config):
            update, weight, metrics = honest_fit(parameters, config)
            update[0].flat[0] = float("nan")
            return update, weight, metrics

        numpy_client.fit = fit
    return client


app = ClientApp(client_fn=client_fn, mods=[concise_errors, secaggplus_when_requested])
'''


def poisoning_app(root: Path) -> Path:
    """The project's Flower app with its ClientApp replaced by the poisoning one."""
    app = root / "app"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("apps", "flwr_verl"):
        shutil.copytree(REPO / folder, app / folder, ignore=ignore)
    manifest = (REPO / "pyproject.toml").read_text()
    assert 'clientapp = "apps.client_app:app"' in manifest
    (app / "pyproject.toml").write_text(manifest.replace('clientapp = "apps.client_app:app"',
                                                         'clientapp = "apps.poisoning_client_app:app"'))
    (app / "apps" / "poisoning_client_app.py").write_text(POISONING_CLIENT_APP)
    return app


@pytest.mark.xdist_group("malicious-poisoning")  # each test has its own deployment
def test_a_node_that_poisons_its_masked_upload_fails_the_round_and_saves_nothing(tmp_path):
    out = tmp_path / "out"
    with local_deployment(tmp_path / "fl", num_supernodes=3) as deployment:
        done = deployment.flwr_verl_run(poisoning_app(tmp_path), {**FAULT_RUN, "num-server-rounds": 1,
                                                                  "output-dir": str(out)}, timeout=RUN_DEADLINE_S)
        log = done.stdout + done.stderr
        status = deployment.run_status(log)
    assert done.returncode == 1 and status == "finished:failed", log
    assert ("RoundFailed: round 1: the securely aggregated update of 3 clients is not one that honest clients "
            "can send: ") in log, log
    assert "coordinates are outside +-1 (secagg.clipping-range" in log, log
    assert "3 clients, 0 failed" not in log, log
    (run_dir,) = run_directories(out)
    assert not list(run_dir.glob("adapters/round-*")), "a round that failed was saved"
    assert [r["round"] for r in records(run_dir) if "fit" in r] == [], records(run_dir)


@pytest.mark.xdist_group("malicious-identity")
def test_a_node_that_claims_another_nodes_client_id_is_refused_before_round_1(tmp_path):
    out = tmp_path / "out"
    with local_deployment(tmp_path / "fl", num_supernodes=3, node_config={2: {"client-id": "1"}}) as deployment:
        done = deployment.flwr_verl_run(REPO, {**FAULT_RUN, "num-server-rounds": 1, "output-dir": str(out)},
                                        timeout=RUN_DEADLINE_S)
        log = done.stdout + done.stderr
        status = deployment.run_status(log)
        trained = [count_in(node.log, "Receiving: train message") for node in deployment.supernodes]
    assert done.returncode == 1 and status == "finished:failed", log
    assert "preflight: 2 of 3 clients cannot train; nothing was trained" in log, log
    assert "all claim client-id='1'" in log, log
    assert trained == [0, 0, 0], "a node got a train message"  # SecAgg+'s first stage is one
    for run_dir in run_directories(out):
        assert not list(run_dir.glob("adapters/round-*"))
