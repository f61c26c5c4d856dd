"""A deployment round with warm and with cold engines: 3 SuperNodes and a SuperLink on loopback
(``deploy/launch.py``), TLS, SuperNode authentication, SecAgg+ and DP on.

Goals (issue 27): a warm node's per-message overhead <= 1 s (cold: about 10 s); a round's wall
time <= 1.5 x (the slowest client's fit compute + the SecAgg+ protocol alone).

    python benchmarks/deployment.py [--rounds 4] [--arms warm cold warm-sequential]

Per arm, one fresh deployment and one run of ``--rounds`` rounds (the deployment test's run: 128
prompts per client, 3 local iterations of 16 prompts x 4 responses, DP noise 0.8, SecAgg+,
evaluation every round). Arms: ``warm`` and ``cold`` (node config ``engine``) with the default
``overlap-evaluation = true``; ``warm-sequential``, warm with it off, so that each round's
evaluation is over before the next round's first message goes out. Figures:

- ``per_message_overhead_s``: for each message that calls the engine (preflight, fit, evaluate),
  the ClientApp process's time from its start to its reply, less the engine's compute for the
  message; each node logs both (``engine_client.MESSAGE_LINE``). Median over every message after
  each node's first (warm: the first one starts the engine; reported as ``first_message_overhead_s``),
  split into ``flower_clientapp_s`` (Flower's ``flwr-clientapp`` process until it calls the app:
  Python, Flower's imports, pulling the message and the app bundle) and ``app_overhead_s`` (the
  app's own: the ClientApp's client and, warm, the socket round trip; cold, the engine's imports
  and model load);
- ``round_over_fit``: a round's wall time (``seconds`` in metrics.jsonl: the server's
  configure_fit to aggregate_fit, evaluation excluded) over the slowest client's fit compute
  (``fit.time_fit_max``), median over rounds after the first;
- ``secagg_protocol_s``: the SecAgg+ stages that carry no training (setup, share_keys, unmask),
  timed by the server (``wire.seconds``): what SecAgg+ costs without any fit, Flower's ClientApp
  process per stage included; ``round_over_fit_and_secagg``: a round over
  (``fit.time_fit_max`` + ``secagg_protocol_s``), the issue's 1.5x goal;
- ``fit_stage_overhead_s``: the stage that carries the fit (collect_masked_vectors) less the
  slowest fit compute: the server's view of one fit message's overhead;
- ``cycle_s``: round to round (``finished_at`` of consecutive records), evaluation and every wait
  included, median over the rounds after the first: what a round costs. With overlap the
  evaluation runs ahead of the next round's SecAgg+ setup on each node, so ``round_s``, the setup
  stage's seconds and the ratios built on them include it; the goal's ratio is read on
  ``warm-sequential``, and ``overlap_saves_per_round_s`` is its ``cycle_s`` less ``warm``'s.

Writes ``benchmarks/results/deployment.json`` (per arm: figures, per-round records, load
average) and prints a line per arm.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import harness

from deploy.launch import LocalDeployment

# The deployment test's run (tests/flower_harness.py SMALL_RUN): DP and SecAgg+ on.
RUN = {"data.train_size": 128, "data.val_size": 16, "data.train_batch_size": 16, "actor.ppo_mini_batch_size": 16,
       "trainer.local_iterations": 3, "privacy.enabled": True, "privacy.noise_multiplier": 0.8,
       "privacy.deterministic": True, "secagg.enabled": True,
       "privacy.metrics": "clear"}  # the fits' own timings reach the server (fit.time_fit_max)

NO_FIT_STAGES = ("secagg_setup", "secagg_share_keys", "secagg_unmask")
FIT_STAGE = "secagg_collect_masked_vectors"
LINE = re.compile(r"flwr-verl: (\w+) message, (\w+) engine: ([\d.]+) s compute, ([\d.]+) s since the ClientApp "
                  r"process started \(([\d.]+) s of them before Flower called the app\)")


def message_overheads(logs: list[Path]) -> dict[str, list[float]]:
    """Per message: its overhead (process start to reply, less compute), split into Flower's part
    (process start to the app's ``client_fn``) and the app's (``client_fn`` to reply, less compute);
    each node's first engine message apart."""
    out: dict[str, list[float]] = {"first": [], "later": [], "flower": [], "app": []}
    for log in logs:
        found = [(float(total) - float(compute), float(flower), float(total) - float(compute) - float(flower))
                 for _, _, compute, total, flower in LINE.findall(log.read_text(errors="replace"))]
        out["first"] += [total for total, _, _ in found[:1]]
        out["later"] += [total for total, _, _ in found[1:]]
        out["flower"] += [flower for _, flower, _ in found[1:]]
        out["app"] += [app for _, _, app in found[1:]]
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(engine: str, root: Path, rounds: int, overlap: bool) -> dict:
    config = {**RUN, "num-server-rounds": rounds, "output-dir": str(root / "out"), "overlap-evaluation": overlap}
    load = os.getloadavg()[0]
    with LocalDeployment(root / "fl", 3, tls=True, auth=True, engine=engine) as fed:
        start = time.perf_counter()
        done = fed.flwr_verl_run(harness.REPO, config, timeout=1800)
        wall = time.perf_counter() - start
        log = done.stdout + done.stderr
        if done.returncode != 0:
            raise RuntimeError(f"{engine}: the run failed:\n{log[-4000:]}")
        run_dir = Path(re.search(r"flwr-verl: run directory (\S+)", log)[1])
        overheads = message_overheads([node.log for node in fed.supernodes])
    per_round = []
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if "fit" not in record:
            continue
        stages = record["wire"]["seconds"]
        fit_max = record["fit"]["time_fit_max"]
        protocol = sum(stages.get(stage, 0.0) for stage in NO_FIT_STAGES)
        per_round.append({"round": record["round"], "seconds": record["seconds"], "time_fit_max": fit_max,
                          "finished_at": record["finished_at"],
                          "secagg_protocol_s": protocol, "stage_seconds": stages,
                          "round_over_fit": record["seconds"] / fit_max,
                          "round_over_fit_and_secagg": record["seconds"] / (fit_max + protocol),
                          "fit_stage_overhead_s": stages.get(FIT_STAGE, 0.0) - fit_max})
    steady = per_round[1:] or per_round
    cycles = [later["finished_at"] - earlier["finished_at"] for earlier, later in zip(per_round, per_round[1:])]

    def steady_median(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    return {"per_message_overhead_s": median(overheads["later"]),
            "flower_clientapp_s": median(overheads["flower"]), "app_overhead_s": median(overheads["app"]),
            "first_message_overhead_s": median(overheads["first"]), "message_overheads_s": overheads["later"], "round_over_fit": steady_median("round_over_fit"),
            "round_over_fit_and_secagg": steady_median("round_over_fit_and_secagg"),
            "secagg_protocol_s": steady_median("secagg_protocol_s"), "time_fit_max_s": steady_median("time_fit_max"),
            "round_s": steady_median("seconds"), "fit_stage_overhead_s": steady_median("fit_stage_overhead_s"),
            "cycle_s": median(cycles), "cycles_s": cycles, "overlap_evaluation": overlap,
            "run_wall_s": wall, "load_average_1min_before": load, "rounds": per_round}


ARMS = {"warm": ("warm", True), "cold": ("cold", True), "warm-sequential": ("warm", False)}  # engine, overlap


def main() -> None:
    harness.quiet()
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "deployment.json")
    args = parser.parse_args()
    results = {}
    for arm in args.arms:
        engine, overlap = ARMS[arm]
        with tempfile.TemporaryDirectory(prefix=f"fvd-{arm}-") as scratch:
            results[arm] = measure(engine, Path(scratch), args.rounds, overlap)
        harness.write_json(args.out.with_suffix(f".{arm}.json"), results[arm])  # kept if a later arm fails
        figures = results[arm]
        print(f"{arm}: per-message overhead {figures['per_message_overhead_s']:.2f} s (Flower's ClientApp process "
              f"{figures['flower_clientapp_s']:.2f} s, the app {figures['app_overhead_s']:.2f} s; first message "
              f"{figures['first_message_overhead_s']:.2f} s); round {figures['round_s']:.1f} s = "
              f"{figures['round_over_fit']:.2f} x the slowest fit ({figures['time_fit_max_s']:.2f} s), "
              f"{figures['round_over_fit_and_secagg']:.2f} x (fit + SecAgg+ protocol {figures['secagg_protocol_s']:.1f} s); "
              f"fit stage overhead {figures['fit_stage_overhead_s']:.2f} s; round to round, evaluation included, "
              f"{figures['cycle_s']:.1f} s; run {figures['run_wall_s']:.0f} s; "
              f"load {figures['load_average_1min_before']:.1f}")
    if "warm" in results and "warm-sequential" in results:
        saved = results["warm-sequential"]["cycle_s"] - results["warm"]["cycle_s"]
        results["overlap_saves_per_round_s"] = saved
        print(f"overlap-evaluation saves {saved:.1f} s a round (warm, round to round)")
    harness.write_json(args.out, {"command": harness.command_line(), "rounds": args.rounds, "cpus": os.cpu_count(),
                                  "goals": {"per_message_overhead_s": 1.0, "round_over_fit_and_secagg": 1.5},
                                  **results})


if __name__ == "__main__":
    main()
