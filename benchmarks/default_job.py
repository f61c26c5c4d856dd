"""The default job, run for real several times: held-out accuracy by round of ``flwr run .
--stream`` with pyproject.toml's config (3 simulated clients, 8 rounds, DP and SecAgg+), and
the median and range of its rise over ``--runs`` runs.

Goal: a median rise of at least 0.2 in held-out accuracy by the last round.

    python benchmarks/default_job.py [--runs 3]
    python benchmarks/default_job.py --set privacy.enabled=false --set actor.lr=3e-3

``--set KEY=VALUE`` overrides one of pyproject.toml's keys, as ``flwr-verl check-config --set``
does (and is checked the same way, before any run); the second command is the job's non-private
anchor (lr 3e-3 chosen without DP on the tune split: ``embedded_recipe.py --no-dp``).

Each run is isolated (its own FLWR_HOME, SuperLink ports, Ray dir; ``deploy/simulation.py``) and
imports this checkout's flwr_verl. Every run draws fresh DP noise and batches
(``privacy.deterministic`` is off, as in production), so the curve differs from run to run:
reported are each run's held-out accuracy by round, and the median and range of round 0, the
last round and the rise.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path

import harness
from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env
from flwr_verl.config import ConfigError
from flwr_verl.tools.cli import checked_run_config

ROUND_ZERO = re.compile(r"round 0/\d+: held-out accuracy ([0-9.]+)")
ROUND = re.compile(r"round (\d+)/\d+: .*?held-out accuracy ([0-9.]+)")
EPSILON = re.compile(r"epsilon ([0-9.]+)")


def one_run(root: Path, timeout: float, run_config: dict) -> dict:
    env = isolated_env(root)
    env["PYTHONPATH"] = str(harness.REPO)  # the app's FAB holds no weights: the shipped model is found here
    started = time.perf_counter()
    try:
        done = flwr_run_simulation(env, root, run_config, num_supernodes=3, timeout=timeout)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])
    log = done.stdout + done.stderr
    (root / "flwr_run.log").write_text(log)
    curve = {0: float(m.group(1)) for m in ROUND_ZERO.finditer(log)}
    for m in ROUND.finditer(log):
        curve.setdefault(int(m.group(1)), float(m.group(2)))
    rounds = [curve[r] for r in sorted(curve)]
    if len(rounds) < 2:
        raise RuntimeError(f"no held-out accuracy in the run's output; see {root / 'flwr_run.log'}")
    epsilons = [float(e) for e in EPSILON.findall(log)]
    return {"accuracy_per_round": rounds, "epsilon": epsilons[-1] if epsilons else None,
            "seconds": time.perf_counter() - started, "log": str(root / "flwr_run.log")}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one of pyproject.toml's keys, a TOML literal as in `flwr run --run-config`")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "default_job.json")
    args = parser.parse_args()
    try:  # the config the runs will use, checked as check-config does: a bad key fails here, by name
        run_config = checked_run_config(None, args.set, harness.REPO)
    except ConfigError as error:
        parser.error(str(error))
    runs = []
    for index in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix=f"default-job-{index}-"))
        runs.append(one_run(root, args.timeout, run_config))
        r = runs[-1]
        print(f"run {index + 1}: held-out accuracy by round {' '.join(f'{a:.3f}' for a in r['accuracy_per_round'])}; "
              f"epsilon {r['epsilon']}; {r['seconds']:.0f} s", flush=True)
    first = [r["accuracy_per_round"][0] for r in runs]
    last = [r["accuracy_per_round"][-1] for r in runs]
    rise = [b - a for a, b in zip(first, last)]
    print(f"{args.runs} runs: round 0 {harness.format_spread(harness.spread(first))}, "
          f"last round {harness.format_spread(harness.spread(last))}, "
          f"rise {harness.format_spread(harness.spread(rise), '+.3f')}")
    harness.write_json(args.out, {"overrides": args.set, "runs": runs})


if __name__ == "__main__":
    main()
