"""The ``flwr-verl`` command.

    flwr-verl check-config my-profile.toml --set actor.lr=1e-3 --set "algorithm.adv_estimator='rloo'"
    flwr-verl ledger show [PATH] [--delta 1e-5] [--accountant rdp]

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
accountant (a total is not the sum of the runs' epsilons). It opens the file read-only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from flwr.common.config import flatten_dict

from flwr_verl.baseline import read_run_config
from flwr_verl.config import ConfigError, parse_run_config

# The Flower app this package ships with: the repository's pyproject.toml (a source checkout or
# an editable install). Elsewhere pass --app.
APP_DIR = Path(__file__).resolve().parents[1]
EXIT_INVALID = 2


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The flat ``[tool.flwr.app.config]`` of the Flower app in ``app_dir``."""
    manifest = app_dir / "pyproject.toml"
    try:
        document = tomllib.loads(manifest.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--app={str(app_dir)!r} is invalid: no pyproject.toml there "
                          "(pass the directory of the Flower app)") from None
    config = document.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if config is None:
        raise ConfigError(f"--app={str(app_dir)!r} is invalid: {manifest} has no [tool.flwr.app.config]")
    return flatten_dict(config)


def checked_run_config(path: str | None, overrides: list[str], app_dir: Path) -> dict[str, Any]:
    """The run config ``flwr run`` would fuse (the app's defaults, then the file, then the
    overrides), validated; raises ``ConfigError`` naming the first bad key."""
    defaults = app_defaults(app_dir)
    values = read_run_config(path, overrides)
    fused = {**defaults, **values}
    parse_run_config(fused)
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
    from flwr_verl.ledger import LedgerError, PrivacyLedger, default_path, show

    try:
        print(show(PrivacyLedger(args.path or default_path(), read_only=True), args.delta, args.accountant))
    except LedgerError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
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
    shown.set_defaults(handler=ledger_show)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
