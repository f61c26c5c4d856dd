"""The launch helpers in ``deploy/`` that every real-process test relies on (fast: no Flower)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.launch import MARKER, free_port, wait_for_line
from deploy.simulation import isolated_env, local_superlink_command, wait_healthy, write_cli_config


def spawn(script: str, log, append: bool = False) -> subprocess.Popen:
    with open(log, "ab" if append else "wb") as handle:
        return subprocess.Popen([sys.executable, "-u", "-c", script], stdout=handle, stderr=subprocess.STDOUT)


def test_wait_for_line_returns_when_the_line_is_written(tmp_path):
    log = tmp_path / "p.log"
    process = spawn("import time; print('booting'); time.sleep(0.5); print('ready: 1'); time.sleep(30)", log)
    try:
        started = time.monotonic()
        wait_for_line(process, log, "ready:", 20, what="the test process")
        assert 0.4 < time.monotonic() - started < 10 and process.poll() is None  # woke on the line, not at exit
    finally:
        process.kill()
        process.wait()


def test_wait_for_line_skips_what_an_earlier_start_wrote(tmp_path):
    log = tmp_path / "p.log"
    log.write_text("ready: from the last start\n")
    start = log.stat().st_size
    process = spawn("print('starting again')", log, append=True)
    with pytest.raises(RuntimeError, match=r"waiting for the restart: the process exited with code 0; see .*p\.log"):
        wait_for_line(process, log, "ready:", 20, what="the restart", start=start)


def test_wait_for_line_has_a_deadline_that_names_what_was_awaited(tmp_path):
    log = tmp_path / "p.log"
    process = spawn("import time; print('still booting'); time.sleep(30)", log)
    try:
        with pytest.raises(RuntimeError, match=r"waiting for the SuperLink: no 'Uvicorn' after 1 s.*\n.*still booting"):
            wait_for_line(process, log, "Uvicorn", 1, what="the SuperLink")
    finally:
        process.kill()
        process.wait()


def test_isolated_env_gives_each_run_its_own_home_ports_and_ray_dir(tmp_path):
    first, second = isolated_env(tmp_path / "a"), isolated_env(tmp_path / "b")
    keys = ("FLWR_HOME", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT", "RAY_TMPDIR", MARKER)
    assert all(first[k] != second[k] for k in keys)
    assert first["FLWR_HOME"] == str((tmp_path / "a" / "flwr_home").resolve())
    assert first["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # Ray on loopback only
    assert first["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] == "1"  # offline


def test_wait_healthy_has_a_deadline_that_names_the_command_and_the_log(tmp_path):
    log = tmp_path / "superlink.log"
    process = spawn("print('still starting'); import time; time.sleep(30)", log)
    url = f"http://127.0.0.1:{free_port()}/health"  # nothing listens there
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"waiting for the slow SuperLink: {url} did not answer within 1 s; "
                                               rf"see .*superlink\.log:\nstill starting"):
            wait_healthy(url, process, 1, "the slow SuperLink", log)
        assert time.monotonic() - started < 10
    finally:
        process.kill()
        process.wait()
    with pytest.raises(RuntimeError, match=r"waiting for the SuperLink: it exited with code 3"):
        wait_healthy(url, spawn("raise SystemExit(3)", log), 60, "the SuperLink", log)


def test_local_superlink_is_flowers_own_command_on_this_runs_home_and_ports(tmp_path, monkeypatch):
    """The command Flower's CLI would run for this environment, captured where it spawns it (so a
    Flower upgrade that changes it fails here)."""
    import click
    import flwr.cli.local_superlink as flower

    env = isolated_env(tmp_path)
    monkeypatch.setenv("FLWR_HOME", env["FLWR_HOME"])
    monkeypatch.setattr(flower, "LOCAL_SUPERLINK_HTTP_API_PORT", env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"])
    monkeypatch.setattr(flower, "LOCAL_CONTROL_API_ADDRESS", f"127.0.0.1:{env['FLWR_LOCAL_CONTROL_API_PORT']}")
    spawned = []

    def popen(command, **kwargs):
        spawned.append(command)
        raise OSError("not started in this test")

    monkeypatch.setattr(flower.subprocess, "Popen", popen)
    with pytest.raises(click.ClickException):
        flower._start_local_superlink()
    ours = local_superlink_command(env)
    assert Path(ours[0]).name == spawned[0][0] == "flower-superlink" and ours[1:] == spawned[0][1:]


def test_flwr_run_reaches_our_superlink_by_address_and_never_probes_or_starts_one(tmp_path, monkeypatch):
    """Read back by Flower's own CLI code: the default connection is this environment's SuperLink
    by address, so ``flwr run`` treats it as user-managed. Flower's ``:local:`` connection would
    probe it with a 0.4 s timeout and, when a loaded machine answered later, start a second one."""
    import flwr.cli.local_superlink as flower
    from flwr.cli.flower_config import read_superlink_connection

    env = isolated_env(tmp_path)
    write_cli_config(env)
    monkeypatch.setenv("FLWR_HOME", env["FLWR_HOME"])

    def never(*args, **kwargs):
        raise AssertionError("flwr run probed or started a local SuperLink")

    monkeypatch.setattr(flower, "_is_local_superlink_started", never)
    monkeypatch.setattr(flower, "_start_local_superlink", never)
    connection = read_superlink_connection()
    assert flower.ensure_local_superlink(connection) is connection
    assert connection.name == "local"
    assert connection.address == f"127.0.0.1:{env['FLWR_LOCAL_SUPERLINK_HTTP_API_PORT']}"
    assert connection.insecure is True

