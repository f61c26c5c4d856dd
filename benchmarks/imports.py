"""Import cost of the engine: wall time, CPU time and peak RSS of ``import flwr_verl.federation.client``
(the ClientApp's engine: client, trainer, rollout, rewards, verl) in fresh processes, and which
heavy modules it pulled in.

Goal: no target set.

    python benchmarks/imports.py [--repeats 5] [--compare /work/main] [--out benchmarks/results/imports.json]

CPU time (user + system) depends less on other jobs' load than wall time does. With ``--compare
DIR`` (another checkout of this repository, e.g. the main branch), each repetition imports from
this checkout and from DIR in turn, in fresh processes, so that both see the same machine load;
figures are medians with ranges.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import harness

MODULE = "flwr_verl.federation.client"
HEAVY = ("opacus", "ray", "pandas", "datasets", "fastapi", "uvicorn", "torchdata", "pydantic", "aiohttp",
         "verl.trainer.ppo.ray_trainer", "verl.workers.reward_manager")
# The probe imports nothing of the benchmarks (the harness included): only the module measured.
PROBE = f"""
import json, resource, sys, time
start = time.perf_counter()
import {MODULE}
seconds = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print({harness.RESULT_MARK!r} + json.dumps({{"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def measure(checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return harness.child_result([sys.executable, "-c", PROBE], env=env, cwd=checkout, timeout=600)


def summary(runs: list[dict]) -> dict:
    return {**{key: harness.spread([run[key] for run in runs]) for key in ("seconds", "cpu_seconds", "peak_rss_mib")},
            "heavy_modules": runs[0]["heavy"], "runs": runs}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout of this repository")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "imports.json")
    args = parser.parse_args()
    checkouts = {"this": harness.REPO} | ({"compare": args.compare.resolve()} if args.compare else {})

    def importing_from(checkout: Path):
        return lambda _repeat: measure(checkout)

    runs = harness.interleaved({name: importing_from(path) for name, path in checkouts.items()}, args.repeats)
    result = {"module": MODULE, "repeats": args.repeats, "cpus": os.cpu_count(),
              "checkouts": {name: {"path": str(path), **summary(runs[name])} for name, path in checkouts.items()}}
    for name, figures in result["checkouts"].items():
        print(f"{name:8s} {figures['path']}: import {MODULE} {harness.format_spread(figures['seconds'], '.2f', ' s')}, "
              f"CPU {harness.format_spread(figures['cpu_seconds'], '.2f', ' s')}, "
              f"peak RSS {harness.format_spread(figures['peak_rss_mib'], '.0f', ' MiB')}; "
              f"heavy modules: {', '.join(figures['heavy_modules']) or 'none'}")
    if args.compare:
        this, other = (result["checkouts"][n] for n in ("this", "compare"))
        result["ratio_seconds"] = this["seconds"]["median"] / other["seconds"]["median"]
        result["ratio_cpu_seconds"] = this["cpu_seconds"]["median"] / other["cpu_seconds"]["median"]
        result["saved_rss_mib"] = other["peak_rss_mib"]["median"] - this["peak_rss_mib"]["median"]
        print(f"this / compare import time: {result['ratio_seconds']:.2f} wall, "
              f"{result['ratio_cpu_seconds']:.2f} CPU; peak RSS saved: "
              f"{result['saved_rss_mib']:.0f} MiB")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
