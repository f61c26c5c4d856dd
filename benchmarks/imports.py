"""Import cost of the engine: wall time, CPU time and peak RSS of ``import flwr_verl.federation.client``
(the ClientApp's engine: client, trainer, rollout, rewards, verl) in fresh processes, and which
heavy modules it pulled in. CPU time (user + system) depends less on other jobs' load than wall
time does.

With ``--compare DIR`` (another checkout of this repository, e.g. the main branch), each
repetition imports from this checkout and from DIR in turn, in fresh processes, so that both
see the same machine load; figures are medians with ranges.

    python benchmarks/imports.py [--repeats 5] [--compare /work/main] [--out benchmarks/results/imports.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODULE = "flwr_verl.federation.client"
HEAVY = ("opacus", "ray", "pandas", "datasets", "fastapi", "uvicorn", "torchdata", "pydantic", "aiohttp",
         "verl.trainer.ppo.ray_trainer", "verl.workers.reward_manager")
PROBE = f"""
import json, resource, sys, time
start = time.perf_counter()
import {MODULE}
seconds = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT" + json.dumps({{"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def measure(checkout: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=checkout,
                          timeout=600, check=True)
    return json.loads(next(line[6:] for line in proc.stdout.splitlines() if line.startswith("RESULT")))


def summary(runs: list[dict]) -> dict:
    def stats(key: str) -> dict:
        values = [run[key] for run in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"seconds": stats("seconds"), "cpu_seconds": stats("cpu_seconds"), "peak_rss_mib": stats("peak_rss_mib"), "heavy_modules": runs[0]["heavy"],
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout of this repository")
    parser.add_argument("--out", type=Path, default=RESULTS / "imports.json")
    args = parser.parse_args()
    checkouts = {"this": ROOT} | ({"compare": args.compare.resolve()} if args.compare else {})
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.repeats):
        for name, checkout in checkouts.items():  # interleaved: both see the same load
            runs[name].append(measure(checkout))
    result = {"module": MODULE, "repeats": args.repeats, "cpus": os.cpu_count(),
              "checkouts": {name: {"path": str(path), **summary(runs[name])} for name, path in checkouts.items()}}
    for name, figures in result["checkouts"].items():
        seconds, cpu, rss = figures["seconds"], figures["cpu_seconds"], figures["peak_rss_mib"]
        print(f"{name:8s} {figures['path']}: import {MODULE} {seconds['median']:.2f} s "
              f"({seconds['min']:.2f}-{seconds['max']:.2f}), CPU {cpu['median']:.2f} s "
              f"({cpu['min']:.2f}-{cpu['max']:.2f}), peak RSS {rss['median']:.0f} MiB "
              f"({rss['min']:.0f}-{rss['max']:.0f}); heavy modules: {', '.join(figures['heavy_modules']) or 'none'}")
    if args.compare:
        this, other = (result["checkouts"][n] for n in ("this", "compare"))
        result["ratio_seconds"] = this["seconds"]["median"] / other["seconds"]["median"]
        result["ratio_cpu_seconds"] = this["cpu_seconds"]["median"] / other["cpu_seconds"]["median"]
        result["saved_rss_mib"] = other["peak_rss_mib"]["median"] - this["peak_rss_mib"]["median"]
        print(f"this / compare import time: {result['ratio_seconds']:.2f} wall, "
              f"{result['ratio_cpu_seconds']:.2f} CPU; peak RSS saved: "
              f"{result['saved_rss_mib']:.0f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
