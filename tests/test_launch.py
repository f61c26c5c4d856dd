"""The launch helpers in ``deploy/`` that every real-process test relies on (fast: no Flower)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from deploy.launch import MARKER, wait_for_line
from deploy.simulation import isolated_env


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
