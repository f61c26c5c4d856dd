"""SecAgg+ cost, measured through real Flower runs: a SecAgg+ fit round's time over a plain
round's (the protocol alone, no training) at about 100k, 1M and 10M parameters, and the memory
it adds.

Goal: at most 1.1x at 1M parameters.

    python benchmarks/secagg_overhead.py [--out benchmarks/results/secagg_overhead.json]
                                         [--sizes 100000,1000000,10000000] [--rounds 5] [--quick]

For each adapter size (about 100k, 1M and 10M parameters) one Flower simulation
(``flwr.simulation.run_simulation``, Ray backend, 3 supernodes) runs, side by side:

- ``plain``: ``DefaultWorkflow`` with Flower's default fit workflow, ``FedProxAdapters`` with
  ``secure_aggregation=None``, clients returning float32 updates (what ``VerlClient`` sends);
- ``secagg``: ``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(**derive_parameters(...)))``,
  the same clients behind ``secaggplus_mod``;
- ``secagg_f64``: the same, with float64 updates (more precise: ``secagg_precision.py``).

Each configuration runs one warm-up round and then ``--rounds`` timed rounds; the figure is the
median fit-round time (the whole fit workflow: configure_fit, every message stage, unmasking,
aggregate_fit). Clients return fixed random updates of the given size (cached per process), so
the benchmark measures the aggregation protocol, not RL: with real local training, which takes
seconds to minutes per round, the same absolute overhead is a far smaller fraction. Peak memory is
sampled (RSS, every 50 ms) for the server process and for all processes of the run (server, Ray,
client actors), as the rise over the level before each configuration.

Reading the figures: SecAgg+ takes four message exchanges per round where plain FedAvg takes
one. Flower 1.42 delivers messages by polling (simulation: every 0.1 s on both sides, not
configurable for the node side; deployment: ``HttpGrid`` and idle SuperNodes every 3 s), so the
two small key-exchange stages cost about 0.1 s each in simulation whatever the size; the rest is
mask generation and quantization (numpy, per client). ``--diagnose-sizes`` reruns sizes with both
polls patched down to 5 ms to separate the two. ``training_seconds_for_1.1x`` is the local
training time per round at which the measured extra time would be 10% of the round.

The runs go through ``secagg_harness.run_flower`` (an isolated child process, Ray on 127.0.0.1,
every process killed afterwards). ``--quick`` runs the smallest size, 2 timed rounds and no
diagnosis: a check that the benchmark works, not a measurement. The precision of SecAgg+ is
``secagg_precision.py``.
"""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

import harness
import numpy as np
import psutil
from secagg_clients import NUM_EXAMPLES, secagg_kwargs
from secagg_harness import FlowerRunError, run_flower


def shapes_for(num_params: int) -> list[list[int]]:
    """LoRA-like (r=16) A/B pairs on square layers of width 1024, about ``num_params`` in all."""
    pair = 2 * 16 * 1024
    layers = max(1, round(num_params / pair))
    return [list(shape) for _ in range(layers) for shape in ((16, 1024), (1024, 16))]


def overhead_spec(num_params: int, rounds: int, pull_interval: float | None = None,
                  vce_poll_interval: float | None = None) -> dict:
    shapes = shapes_for(num_params)
    derived = secagg_kwargs()
    phases = [
        {"name": "warmup_plain", "secagg": None, "format": "fixed", "dtype": "float32", "rounds": 1},
        {"name": "warmup_secagg", "secagg": derived, "format": "fixed", "dtype": "float32", "rounds": 1},
        {"name": "plain", "secagg": None, "format": "fixed", "dtype": "float32", "rounds": rounds},
        {"name": "secagg", "secagg": derived, "format": "fixed", "dtype": "float32", "rounds": rounds},
        {"name": "secagg_f64", "secagg": derived, "format": "fixed", "dtype": "float64", "rounds": rounds},
    ]
    return {"num_supernodes": 3, "num_examples": list(NUM_EXAMPLES), "shapes": shapes, "seed": 11,
            "delta_scale": 0.5, "weight_scale": 0.0, "client_cpus": 1, "memory": True, "phases": phases,
            "pull_interval": pull_interval, "vce_poll_interval": vce_poll_interval}


def overhead(num_params: int, rounds: int, timeout: float, pull_interval: float | None = None,
             vce_poll_interval: float | None = None) -> dict:
    spec = overhead_spec(num_params, rounds, pull_interval, vce_poll_interval)
    results = run_flower(spec, timeout=timeout)
    phases = {p["name"]: p for p in results["phases"]}
    for phase in phases.values():
        if phase["aggregated_rounds"] != len(phase["round_seconds"]):
            raise FlowerRunError(f"{phase['name']}: {phase['aggregated_rounds']} of {len(phase['round_seconds'])} "
                                 f"rounds aggregated; failures {phase['failures']}\n{results['log'][-4000:]}")
    median = {name: statistics.median(p["round_seconds"]) for name, p in phases.items()}
    return {
        "num_params": int(sum(int(np.prod(s)) for s in spec["shapes"])),
        "clients": spec["num_supernodes"], "rounds": rounds, "pull_interval": pull_interval,
        "vce_poll_interval": vce_poll_interval,
        "median_round_seconds": {k: median[k] for k in ("plain", "secagg", "secagg_f64")},
        "round_seconds": {k: phases[k]["round_seconds"] for k in ("plain", "secagg", "secagg_f64")},
        "ratio_secagg_over_plain": median["secagg"] / median["plain"],
        "ratio_secagg_f64_over_plain": median["secagg_f64"] / median["plain"],
        "extra_seconds_per_round": median["secagg"] - median["plain"],
        # local training time per round at which SecAgg+ would cost 10%: (T + secagg) / (T + plain) = 1.1
        "training_seconds_for_1.1x": max(0.0, (median["secagg"] - 1.1 * median["plain"]) / 0.1),
        "memory": {k: phases[k]["memory"] for k in ("plain", "secagg", "secagg_f64")},
        "secagg_stage_median_seconds": {stage: statistics.median(values)
                                        for stage, values in phases["secagg"]["stage_seconds"].items()},
        "listeners": sorted({s["ip"] for s in results.get("listeners", [])}),
        "leftover_processes": results["leftover_pids"],
        "simulation_seconds": results["simulation_seconds"],
    }


HEADER = (f"{'params':>10} {'plain s':>8} {'secagg s':>9} {'ratio':>6} {'f64 s':>7} {'ratio':>6} "
          f"{'1.1x at T s':>11} {'stages setup/keys/collect/unmask s':>35} {'all-proc rise MiB plain/secagg':>31}")


def format_row(row: dict) -> str:
    m, mem, st = row["median_round_seconds"], row["memory"], row["secagg_stage_median_seconds"]
    stages = "/".join(f"{st.get(k, float('nan')):.2f}" for k in ("setup", "share_keys", "collect_masked_vectors",
                                                                   "unmask"))
    return (f"{row['num_params']:>10} {m['plain']:>8.3f} {m['secagg']:>9.3f} {row['ratio_secagg_over_plain']:>6.2f} "
            f"{m['secagg_f64']:>7.3f} {row['ratio_secagg_f64_over_plain']:>6.2f} "
            f"{row['training_seconds_for_1.1x']:>11.1f} {stages:>35} "
            f"{mem['plain']['all_rise_mib']:>15.0f}/{mem['secagg']['all_rise_mib']:<15.0f}")


def machine() -> dict:
    import flwr

    return {"cpus": os.cpu_count(), "memory_gib": psutil.virtual_memory().total / 2**30,
            "python": platform.python_version(), "flwr": flwr.__version__, "load_avg_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "secagg_overhead.json")
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--pull-interval", type=float, default=None,
                        help="InMemoryGrid pull interval in s (Flower's default 0.1); simulation only")
    parser.add_argument("--vce-poll-interval", type=float, default=None,
                        help="diagnosis: patch the simulation runtime's fixed 0.1 s message poll")
    parser.add_argument("--diagnose-sizes", default="1000000",
                        help="sizes to rerun with Flower's polling latency patched out ('' to skip)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the smallest size, 2 rounds, no diagnosis (overrides those options)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.diagnose_sizes = str(min(int(s) for s in args.sizes.split(","))), 2, ""

    report: dict = {"machine": machine(), "overhead": []}
    print(HEADER)
    for size in (int(s) for s in args.sizes.split(",")):
        row = overhead(size, args.rounds, args.timeout, args.pull_interval, args.vce_poll_interval)
        report["overhead"].append(row)
        print(format_row(row), flush=True)
    if args.diagnose_sizes:
        # The same, with Flower's fixed 0.1 s polls (server pull, simulation delivery) cut to 5 ms:
        # what remains is SecAgg+'s computation (masks, quantization, serialization).
        report["diagnosis_without_polling_latency"] = []
        print("\ndiagnosis: Flower's 0.1 s message polls patched down to 5 ms")
        for size in (int(s) for s in args.diagnose_sizes.split(",")):
            row = overhead(size, args.rounds, args.timeout, pull_interval=0.005, vce_poll_interval=0.005)
            report["diagnosis_without_polling_latency"].append(row)
            print(format_row(row), flush=True)
    report["machine"]["load_avg_end"] = os.getloadavg()
    print()
    harness.write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
