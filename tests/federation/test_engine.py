"""The warm engine behind the ClientApp (``engine_server``, ``engine_client``), as real processes:
who may call it, that two runs through one engine each match a cold run message for message,
that it refuses another base model, and that a crash fails one call and the next one restarts it.
The deployment tests run the whole app on it (``test_deployment``, ``test_faults``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from flwr.app import Context, RecordDict

from flwr_verl.config import ConfigError, FlwrVerlError
from flwr_verl.config.node import NodeEngineConfig
from flwr_verl.federation import node
from flwr_verl.federation.client import client_from_context
from flwr_verl.federation.engine_client import STATE_KEY, Engine, WarmClient, _alive, read_info
from flwr_verl.federation.engine_server import private_dir
from flwr_verl.federation.engine_wire import EngineUnavailable, decode_values, recv_arrays, recv_header, send_message
from flwr_verl.federation.protocol import EvaluateConfig, FitConfig, PreflightConfig, SparseRound
from flwr_verl.federation.run_config import load_run_config
from flwr_verl.tools.cli import app_defaults
from tests.flower_harness import REPO

TINY_RUN = {"data.train_size": 32, "data.val_size": 16, "data.train_batch_size": 8, "rollout.n": 2,
            "rollout.response_length": 6, "actor.ppo_mini_batch_size": 4, "secagg.enabled": False,
            "privacy.enabled": False}
# Two runs with different configs: DP (deterministic noise) and seed 0; sparse uploads with an
# error-feedback residual (Context.state), another seed, learning rate and FedProx term.
RUN_A = {**TINY_RUN, "privacy.enabled": True, "privacy.noise_multiplier": 0.8, "privacy.deterministic": True}
RUN_B = {**TINY_RUN, "trainer.seed": 1, "actor.lr": 3e-3, "compression.density": 0.5, "proximal-mu": 0.1}


@pytest.fixture
def engine_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine computes with the test process's thread count
    directory = tmp_path / "engine"
    yield directory
    for process in psutil.process_iter():  # every engine this test started, the one a crash restarted too
        try:
            if str(directory) in " ".join(process.cmdline()):
                process.kill()
        except psutil.Error:
            pass


def settings(directory: Path) -> NodeEngineConfig:
    return NodeEngineConfig(directory=directory, idle_timeout_s=600)


def context(run: dict, run_id: int, ledger: Path, state: RecordDict | None = None) -> Context:
    return Context(run_id=run_id, node_id=5, node_config={"partition-id": 1, "num-partitions": 3,
                                                          "privacy-ledger": str(ledger)},
                   state=state if state is not None else RecordDict(), run_config={**app_defaults(REPO), **run})


def cold_client(ctx: Context):
    """What a fresh ClientApp process builds: nothing cached from an earlier message."""
    node._MODELS.clear(), node._ROWS.clear(), node._LEDGERS.clear(), node._REWARD_MODELS.clear()
    return client_from_context(ctx, load_run_config(ctx.run_config).engine)


def fit_config(server_round: int, run: dict) -> dict:
    sparse = SparseRound(0.5, 1000 + server_round) if run.get("compression.density", 1.0) < 1 else None
    return FitConfig(server_round=server_round, local_iterations=2, planned_iterations=4,
                     proximal_mu=run.get("proximal-mu", 0.01), sparse=sparse).to_config()


def comparable(metrics: dict) -> dict:
    """Metrics without wall-clock entries, NaN made comparable."""
    return {k: "nan" if isinstance(v, float) and v != v else v for k, v in metrics.items() if "time" not in k}


def test_two_runs_through_one_engine_each_match_a_cold_run(engine_dir, tmp_path):
    """Runs A and B interleave on one engine: preflight-carrying evaluation, two fits each, an
    evaluation. Every reply (update, weight, metrics, error-feedback state) equals what a fresh
    process computes for the same message."""
    warm_ledger, cold_ledger = tmp_path / "warm.sqlite", tmp_path / "cold.sqlite"
    states = {"A": (RecordDict(), RecordDict()), "B": (RecordDict(), RecordDict())}
    runs = {"A": (RUN_A, 11), "B": (RUN_B, 12)}
    start = {name: cold_client(context(run, run_id, cold_ledger)).get_parameters({})
             for name, (run, run_id) in runs.items()}
    evaluation = EvaluateConfig(server_round=0, preflight=PreflightConfig()).to_config()
    script = [("A", "evaluate", 0), ("B", "evaluate", 0), ("A", "fit", 1), ("B", "fit", 1), ("A", "fit", 2),
              ("B", "fit", 2), ("A", "evaluate", 2), ("B", "evaluate", 2)]
    current = {name: [a.copy() for a in arrays] for name, arrays in start.items()}
    for name, method, server_round in script:
        run, run_id = runs[name]
        warm = WarmClient(context(run, run_id, warm_ledger, states[name][0]), settings(engine_dir))
        cold = cold_client(context(run, run_id, cold_ledger, states[name][1]))
        if method == "evaluate":
            config = evaluation if server_round == 0 else EvaluateConfig(server_round=server_round).to_config()
            got, want = warm.evaluate(current[name], config), cold.evaluate(current[name], config)
            assert got[:2] == want[:2] and comparable(got[2]) == comparable(want[2]), (name, method, server_round)
            continue
        config = fit_config(server_round, run)
        (update, weight, metrics), (update_cold, weight_cold, metrics_cold) = (
            warm.fit([a.copy() for a in current[name]], config), cold.fit([a.copy() for a in current[name]], config))
        assert weight == weight_cold and comparable(metrics) == comparable(metrics_cold), (name, server_round)
        assert all(np.array_equal(u, c) for u, c in zip(update, update_cold, strict=True)), (name, server_round)
        if name == "A":
            current[name] = [c + u for c, u in zip(current[name], update)]
        warm_state, cold_state = (s.array_records.get(STATE_KEY) for s in states[name])
        assert (warm_state is None) == (name == "A") == (cold_state is None)
        if warm_state is not None:
            assert all(np.array_equal(w, c) for w, c in zip(warm_state.to_numpy_ndarrays(),
                                                            cold_state.to_numpy_ndarrays()))
    assert Engine(settings(engine_dir)).status()["calls"] == len(script)  # one engine served them all


def test_a_local_process_without_the_token_is_refused(engine_dir):
    engine = Engine(settings(engine_dir))
    engine.start().close()
    assert stat.S_IMODE(engine_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((engine_dir / "engine.sock").stat().st_mode) == 0o600
    assert stat.S_IMODE((engine_dir / "token").stat().st_mode) == 0o600
    probe = f"""
import json, socket, sys
from flwr_verl.federation.engine_wire import recv_header, send_message
replies = []
for header in ({{"op": "ping"}}, {{"op": "ping", "token": "0" * 64}}, {{"op": "stop", "token": None}}):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect({str(engine_dir / "engine.sock")!r})
        send_message(sock, {{**header, "protocol": 1}})
        replies.append(recv_header(sock))
print(json.dumps(replies))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    replies = json.loads(done.stdout)
    assert [r["refused"] for r in replies] == ["wrong or missing token"] * 3, done.stdout + done.stderr
    assert all(set(r) == {"ok", "refused", "arrays"} for r in replies)  # nothing about the engine leaks
    status = engine.status()  # the holder of the token is served, and the engine still runs
    assert status["pid"] == read_info(engine_dir)["pid"]
    assert (engine_dir / "engine.log").read_text().count("wrong or missing token") == 3


def test_an_engine_dir_that_others_can_enter_is_refused(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(ConfigError, match=r"engine-dir=.*closed to group and others \(mode 0o755; run `chmod 700"):
        private_dir(directory)
    with pytest.raises(ConfigError, match="node config engine='hot' is invalid: must be one of warm, cold"):
        NodeEngineConfig(kind="hot")


def test_a_run_on_another_base_model_is_refused(engine_dir, tmp_path, model_path):
    ledger = tmp_path / "ledger.sqlite"
    WarmClient(context(TINY_RUN, 1, ledger), settings(engine_dir)).get_parameters({})
    other = shutil.copytree(model_path, tmp_path / "other-base")
    client = WarmClient(context({**TINY_RUN, "model.path": str(other)}, 2, ledger), settings(engine_dir))
    with pytest.raises(FlwrVerlError, match=r"this node's warm engine holds another base model") as caught:
        client.get_properties(PreflightConfig().to_config())
    assert type(caught.value).__name__ == "EngineBaseMismatch"  # the server's one line names it as a cold client would
    assert str(other) in str(caught.value) and "flwr-verl engine stop" in str(caught.value)
    WarmClient(context(TINY_RUN, 3, ledger), settings(engine_dir)).get_parameters({})  # its own base still served


def test_a_crash_fails_its_call_and_the_next_message_restarts_the_engine(engine_dir, tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    client = WarmClient(context(TINY_RUN, 1, ledger), settings(engine_dir))
    parameters = client.get_parameters({})
    first = read_info(engine_dir)["pid"]
    # Killed between messages: the next message finds a socket nobody serves and starts a new engine.
    os.kill(first, signal.SIGKILL)
    wait_dead(first)
    assert len(client.get_parameters({})) == len(parameters)
    second = read_info(engine_dir)["pid"]
    assert second != first and (engine_dir / "engine.sock").exists()
    # Killed mid-fit: that call fails with one line, and a new engine is already starting.
    errors: list[BaseException] = []
    long_fit = FitConfig(server_round=1, local_iterations=200, planned_iterations=200, proximal_mu=0.0).to_config()
    caller = threading.Thread(target=lambda: _capture(errors, client.fit, parameters, long_fit))
    log = engine_dir / "engine.log"
    calls = log.read_text().count("flwr-verl engine: fit for run")
    caller.start()
    deadline = time.monotonic() + 300
    while log.read_text().count("flwr-verl engine: fit for run") == calls:
        assert time.monotonic() < deadline and caller.is_alive(), "the fit never reached the engine"
        time.sleep(0.05)
    os.kill(second, signal.SIGKILL)
    caller.join(timeout=300)
    (error,) = errors
    assert isinstance(error, EngineUnavailable) and "the node's engine exited during fit" in str(error)
    assert len(client.get_parameters({})) == len(parameters)
    assert read_info(engine_dir)["pid"] not in (first, second)


def wait_dead(pid: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after {timeout:g} s"
        time.sleep(0.05)


def _capture(errors: list, function, *args) -> None:
    try:
        function(*args)
    except BaseException as error:  # noqa: BLE001 - the test inspects it
        errors.append(error)


def test_stop_ends_the_engine_and_status_says_none_runs(engine_dir):
    engine = Engine(settings(engine_dir))
    engine.start().close()
    pid = engine.status()["pid"]
    assert engine.stop() and engine.status() is None and not (engine_dir / "engine.sock").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not engine.stop()


def test_the_engine_protocol_never_unpickles_and_bounds_what_it_reads():
    left, right = socket.socketpair()
    with left, right:
        send_message(left, {"op": "ping", "config": {"b": {"$bytes": "AAE="}}}, [np.arange(3, dtype=np.float32)])
        header = recv_header(right)
        assert header["arrays"] == [["<f4", [3]]]
        assert recv_arrays(right, header)[0].tolist() == [0.0, 1.0, 2.0]
        assert decode_values(header["config"], "config") == {"b": b"\x00\x01"}
        left.sendall(b"FVE1" + (2**31).to_bytes(4, "big"))
        with pytest.raises(FlwrVerlError, match="exceeds"):
            recv_header(right)
    left, right = socket.socketpair()
    with left, right:
        with pytest.raises(FlwrVerlError, match="cannot travel"):
            send_message(left, {}, [np.array([object()])])


def test_the_forwarder_imports_no_engine_and_resolves_the_ledger_as_the_engine_does():
    from flwr_verl.federation.engine_client import LEDGER_KEY, default_ledger_path
    from flwr_verl.privacy.ledger import NODE_PRIVACY_LEDGER, default_path

    assert (LEDGER_KEY, default_ledger_path()) == (NODE_PRIVACY_LEDGER, default_path())
    probe = ("import sys, apps.client_app, flwr_verl.federation.engine_client; "
             "print(sorted(m for m in ('torch', 'transformers', 'peft', 'verl', 'opacus') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flwr_verl.tools.cli", "engine", *args], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_an_operator_starts_inspects_and_stops_the_engine_and_an_idle_one_exits(engine_dir, tmp_path):
    """``flwr-verl engine start --run-config`` loads the run's model and binds the base before any
    message; ``status`` says so; ``stop`` ends it; an engine left idle exits by itself."""
    profile = tmp_path / "run.toml"
    profile.write_text("".join(f'"{k}" = {json.dumps(v)}\n' for k, v in TINY_RUN.items()))
    started = cli("start", "--dir", str(engine_dir), "--run-config", str(profile))
    assert started.returncode == 0, started.stderr
    status = json.loads(cli("status", "--dir", str(engine_dir)).stdout)
    assert status["base"]["model.dtype"] == "float32" and status["calls"] == 1 and status["dir"] == str(engine_dir)
    stopped = cli("stop", "--dir", str(engine_dir))
    assert stopped.stdout.strip() == "stopped" and not _alive(status["pid"])
    missing = cli("status", "--dir", str(engine_dir))
    assert missing.returncode == 1 and missing.stdout.strip() == f"no engine runs in {engine_dir}"
    assert cli("start", "--dir", str(engine_dir), "--idle-timeout-s", "1").returncode == 0
    pid = read_info(engine_dir)["pid"]
    wait_dead(pid, timeout=120)
    assert "idle for 1 s; exiting" in (engine_dir / "engine.log").read_text()
