"""The ``flwr-verl`` command.

    flwr-verl check-config my-profile.toml --set actor.lr=1e-3 --set "algorithm.adv_estimator='rloo'"
    flwr-verl ledger show [PATH] [--delta 1e-5] [--accountant rdp] [--client-level-delta 1e-5]
    flwr-verl run . my-superlink --run-config my-profile.toml --timeout 7200
    flwr-verl preference-pairs --model DIR --task reasoning_gym:chain_sum --out DIR [...]
    flwr-verl engine start|status|stop [--dir DIR] [--run-config my-profile.toml]

``check-config`` validates a run config before ``flwr run`` sees it. Flower rejects a key that is
not in the app's ``[tool.flwr.app.config]`` before the app starts, with only
``[code: 15] Invalid run configuration``, so the app's own message (which key, which keys are
allowed) never reaches the user. This command reads the file as ``flwr run --run-config FILE``
does (a flat TOML of the app's keys), applies ``--set key=value`` overrides (TOML literals, parsed by Flower's own parser), overlays
them on the app's defaults and validates the result as the app would. It prints
``ok: <n> keys valid`` and exits 0, or prints the error and exits 2. Checks that need the model
or the data (``model.target_modules``, prompt lengths, the reward function) run when a client
builds its engine, before any training.

``ledger show`` prints a node's privacy ledger (``ledger.py``; default: the node's default
ledger file): each data set's spent epsilon at ``--delta``, per run and in total, composed by the
accountant (a total is not the sum of the runs' epsilons); its client-level DP spends (privacy
unit "client") at ``--client-level-delta``. It opens the file read-only.

``run`` is ``flwr run APP SUPERLINK --stream`` that returns the run's outcome: ``flwr run``
exits 0 whether the run finished or failed, so a script or CI job cannot tell them apart. It
checks the config as ``check-config`` does, submits the run, streams its log, then reads the
run's status from the SuperLink (``flwr ls --run-id ID --format json``, the same record
``flwr ls`` shows) and exits 0 on ``finished:completed``, 1 on a failed or stopped run, 2 on
an invalid config, 3 when ``--timeout`` passed first (the run is then stopped with
``flwr stop``).

``preference-pairs`` writes on-policy preference pairs for stage ``dpo``: the base model's
sampled replies to a task's problems, labelled by the task's verifier, as TRL parquet split
train / tune / validation by a hash of the problem (``tools/pairs.py``); exit 2 on a bad argument.

``engine`` manages this node's warm engine (``flwr_verl.federation.engine_server``; node config
``engine = "warm"``): ``start`` starts it if none runs and waits until it answers (with
``--run-config FILE`` it also loads that run config's models, binding the engine to their base
model, so the first round does not pay for it); ``status`` prints its pid, base model, calls and
uptime as JSON (exit 1 when none runs); ``stop`` lets it finish the call it is running, then ends
it. ``--dir`` is the node's ``engine-dir`` (default ``$FLWR_HOME/flwr-verl/engine``: run it with
the SuperNode's ``FLWR_HOME``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import tomli_w

from flwr_verl.config import ConfigError
from flwr_verl.federation.run_config import load_run_config
from flwr_verl.tools.config_files import app_defaults, read_run_config

# The Flower app this package ships with: the repository's pyproject.toml (a source checkout or
# an editable install). Elsewhere pass --app.
APP_DIR = Path(__file__).resolve().parents[2]
EXIT_FAILED, EXIT_INVALID, EXIT_TIMEOUT = 1, 2, 3
COMPLETED = "finished:completed"  # the status Flower's SuperLink gives a run that ended normally


def checked_run_config(path: str | None, overrides: list[str], app_dir: Path) -> dict[str, Any]:
    """The run config ``flwr run`` would fuse (the app's defaults, then the file, then the
    overrides), validated; raises ``ConfigError`` naming the first bad key."""
    defaults = app_defaults(app_dir)
    values = read_run_config(path, overrides)
    fused = {**defaults, **values}
    load_run_config(fused)
    # A key flwr-verl knows but this app's manifest lacks is still refused by Flower.
    missing = sorted(set(values) - set(defaults))
    if missing:
        raise ConfigError(f"unknown config key {missing[0]!r}: not in [tool.flwr.app.config] of "
                          f"{app_dir / 'pyproject.toml'}, so Flower refuses it")
    return fused


def check_config(args: argparse.Namespace) -> int:
    """Validate a run config as `flwr run` and the app would: print `ok: <n> keys valid` (exit 0)
    or the first error, naming the key and what is allowed (exit 2)."""
    try:
        fused = checked_run_config(args.file, args.set, args.app)
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    print(f"ok: {len(fused)} keys valid")
    return 0


def ledger_show(args: argparse.Namespace) -> int:
    """Print each data set's spent epsilon at a delta, per run and in total."""
    from flwr_verl.privacy.ledger import LedgerError, PrivacyLedger, default_path, show

    try:
        print(show(PrivacyLedger(args.path or default_path(), read_only=True), args.delta, args.accountant,
                   args.client_level_delta))
    except LedgerError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    return 0


def flwr_command(name: str, *args: str) -> list[str]:
    """``flwr`` of this interpreter's environment (else from PATH)."""
    path = Path(sys.executable).with_name(name)
    return [str(path) if path.exists() else name, *args]


def run_status(run_id: str, superlink: list[str]) -> str:
    """The SuperLink's status of run ``run_id`` (``finished:completed``, ``finished:failed``, ...)."""
    done = subprocess.run(flwr_command("flwr", "ls", *superlink, "--run-id", run_id, "--format", "json"),
                          capture_output=True, text=True, timeout=120)
    try:
        runs = json.loads(done.stdout).get("runs", [])
    except json.JSONDecodeError:
        runs = []
    return next((str(r.get("status")) for r in runs if str(r.get("run-id")) == run_id),
                f"unknown (flwr ls: {(done.stdout + done.stderr).strip()[-300:]})")


def run(args: argparse.Namespace) -> int:
    """Check the config, then `flwr run APP [SUPERLINK] --stream` and follow the run until it
    ends or --timeout passes; exit 0 on finished:completed, 1 on a failed or stopped run, 2 on an
    invalid config, 3 on timeout (the run is stopped)."""
    app = Path(args.app)
    try:
        checked_run_config(args.run_config, args.set, app)
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    superlink = [args.superlink] if args.superlink else []
    with tempfile.TemporaryDirectory() as scratch:
        command = flwr_command("flwr", "run", str(app), *superlink, "--stream",
                               *run_config_args(args.run_config, args.set, Path(scratch)))
        return _follow(command, superlink, args.timeout)


def run_config_args(path: str | None, overrides: list[str], scratch: Path) -> list[str]:
    """``flwr run``'s ``--run-config`` arguments for a file and ``key=value`` overrides. Flower
    takes a TOML file or key=value pairs but not both, so both are merged into one file in
    ``scratch``."""
    if path and overrides:
        merged = scratch / "run-config.toml"
        merged.write_text(tomli_w.dumps(read_run_config(path, overrides)))
        return ["--run-config", str(merged)]
    return [arg for value in ([path] if path else []) + overrides for arg in ("--run-config", value)]


def _follow(command: list[str], superlink: list[str], timeout: float) -> int:
    """Run ``flwr run ... --stream``, print its log, and wait for the run's end (``run``'s exit codes)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    run_ids: list[str] = []

    def follow() -> None:  # stream the log through, and note the run id flwr run prints
        for line in process.stdout:
            sys.stdout.write(line)
            if match := re.search(r"Successfully started run (\d+)", line):
                run_ids.append(match[1])

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if run_ids:
            subprocess.run(flwr_command("flwr", "stop", run_ids[0], *superlink), capture_output=True, timeout=120)
        process.kill()
        process.wait()
        print(f"flwr-verl: run {run_ids[0] if run_ids else '(not started)'} did not end within --timeout="
              f"{timeout:g} s; stopped", file=sys.stderr)
        return EXIT_TIMEOUT
    reader.join(timeout=10)
    if not run_ids:
        print(f"flwr-verl: flwr run started no run (exit code {code})", file=sys.stderr)
        return code or EXIT_FAILED
    status = run_status(run_ids[0], superlink)
    print(f"flwr-verl: run {run_ids[0]} {status}")
    return 0 if status == COMPLETED else EXIT_FAILED


def engine(args: argparse.Namespace) -> int:
    """Start, inspect or stop this node's warm engine."""
    from flwr_verl.federation.engine_client import Engine, node_engine, preload
    from flwr_verl.federation.engine_wire import EngineUnavailable

    node = {"engine-dir": str(args.dir)} if args.dir else {}
    if args.idle_timeout_s is not None:
        node["engine-idle-timeout-s"] = args.idle_timeout_s
    try:
        settings = node_engine(node)
        handle = Engine(settings)
        if args.engine_command == "stop":
            print("stopped" if handle.stop() else f"no engine runs in {settings.directory}")
            return 0
        if args.engine_command == "start":
            if args.run_config:
                preload(settings, checked_run_config(args.run_config, [], args.app))
            else:
                handle.start().close()
        status = handle.status()
    except (ConfigError, EngineUnavailable, OSError, tomllib.TOMLDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID if isinstance(error, ConfigError) else EXIT_FAILED
    if status is None:
        print(f"no engine runs in {settings.directory}")
        return EXIT_FAILED
    print(json.dumps({key: status.get(key) for key in ("pid", "base", "calls", "uptime_s")} |
                     {"dir": str(settings.directory)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flwr-verl", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser("check-config", help="validate a run config before `flwr run`",
                                description=check_config.__doc__)
    check.add_argument("file", nargs="?", help="run-config TOML, as passed to `flwr run --run-config`")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one key (a TOML literal: strings quoted); repeatable")
    check.add_argument("--app", type=Path, default=APP_DIR,
                       help=f"directory of the Flower app whose defaults apply (default: {APP_DIR})")
    check.set_defaults(handler=check_config)
    ledger = commands.add_parser("ledger", help="inspect this node's privacy ledger").add_subparsers(
        dest="ledger_command", required=True, metavar="COMMAND")
    shown = ledger.add_parser("show", help=ledger_show.__doc__, description=ledger_show.__doc__)
    shown.add_argument("path", nargs="?", type=Path,
                       help="the ledger file (default: $FLWR_HOME/flwr-verl/privacy-ledger.sqlite)")
    shown.add_argument("--delta", type=float, default=1e-5, help="delta at which epsilon is shown (default 1e-5)")
    shown.add_argument("--accountant", choices=("rdp", "prv"), default="rdp", help="default: rdp")
    shown.add_argument("--client-level-delta", type=float, default=1e-5,
                       help="delta of privacy unit client (privacy.client_level.delta; default 1e-5)")
    shown.set_defaults(handler=ledger_show)

    submit = commands.add_parser("run", help="`flwr run --stream` that exits with the run's status",
                                 description=run.__doc__)
    submit.add_argument("app", nargs="?", default=".", help="directory of the Flower app (default: .)")
    submit.add_argument("superlink", nargs="?", help="SuperLink connection in $FLWR_HOME/config.toml "
                        "(default: its default one)")
    submit.add_argument("--run-config", metavar="FILE", help="run-config TOML, passed to `flwr run --run-config`")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key (a TOML literal: strings quoted); repeatable")
    submit.add_argument("--timeout", type=float, default=24 * 3600.0, metavar="SECONDS",
                        help="stop the run and exit 3 if it has not ended by then (default: 24 h)")
    submit.set_defaults(handler=run)

    from flwr_verl.tools import pairs

    pairs_command = commands.add_parser("preference-pairs", help="on-policy preference pairs labelled by a task's "
                                        "verifier, as TRL parquet (train/tune/validation)", description=pairs.run.__doc__)
    pairs.add_arguments(pairs_command)
    pairs_command.set_defaults(handler=pairs.run)

    engines = commands.add_parser("engine", help="start, inspect or stop this node's warm engine").add_subparsers(
        dest="engine_command", required=True, metavar="COMMAND")
    for name, text in (("start", "start the engine (if none runs) and wait until it answers"),
                       ("status", "print the running engine's pid, base model, calls and uptime"),
                       ("stop", "end the engine after the call it is running")):
        command = engines.add_parser(name, help=text, description=text)
        command.add_argument("--dir", type=Path, help="the node's engine-dir (default: $FLWR_HOME/flwr-verl/engine)")
        command.add_argument("--idle-timeout-s", type=float, help="start: exit after this long without a call "
                             "(default 3600)")
        command.add_argument("--run-config", metavar="FILE", help="start: also load this run config's models")
        command.add_argument("--app", type=Path, default=APP_DIR, help="the Flower app whose defaults apply")
        command.set_defaults(handler=engine)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
