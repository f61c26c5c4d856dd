"""Scale in simulation: 100 and 300 simulated organisations, 10% of them sampled a round, with
SecAgg+ and per-prompt DP on, through a real Flower simulation; where memory and time go as the
federation grows; and how many organisations client-level DP needs before it is useful.

Goals: 100 and 300 organisations complete 3 rounds within 4 GiB peak RSS, summed over every
process the run starts and sampled every second. Client-level DP: no target set.

    python benchmarks/scale.py [--supernodes 100 300] [--rounds 3] [--organisations 30 100 300]
        [--skip-simulation] [--skip-client-level-dp] [--out benchmarks/results/scale.json]

1. **Simulation** (per ``--supernodes`` N): one ``flwr run <this checkout> --stream
   --federation-config num-supernodes=N`` (``deploy/simulation.py``: its own FLWR_HOME, ports
   and Ray dir, ``PYTHONPATH`` on this checkout) with the app's own ServerApp and ClientApp and
   ``run_config``'s settings: fraction-fit and fraction-evaluate 0.1 (min-fit-clients and
   min-evaluate-clients N / 10, min-available-clients N: every organisation connected before
   round 1), SecAgg+ with its default 3 shares and reconstruction threshold 2 (valid for 10 and
   30 clients a round: the protocol survives as long as every client keeps 2 of its 3
   neighbours), per-prompt DP at the default noise, 3 rounds. Each organisation has 32 training
   prompts (``data.train_size``: 3,200 and 9,600 in all) and 4 validation prompts; a local
   iteration takes 8 of them (q = 1/4) x 4 responses, 2 iterations a round; ``privacy.metrics``
   is ``clear`` so that each fit reports its compute time. Flower's default client resources (2
   CPUs) give one client actor on 2 cores: the sampled clients run one after another.
   Measured:
   - memory: the resident set of this process and every process it started (the SuperLink and
     its SuperExec, the ``flwr-simulation`` process that runs the ServerApp and drives Ray, Ray's
     own processes, Ray's workers with the client actor, the ``flwr run`` CLI), summed each
     second (``harness.RssSampler``); the peak, split by process kind at that moment, and each
     kind's CPU seconds;
   - time, from the run's ``metrics.jsonl``: each round's fit (configure_fit to the aggregated
     update: training plus SecAgg+'s four message exchanges; median and range over the rounds),
     the clients' summed fit compute in it (``fit.time_fit_sum``) and the rest, the evaluation's
     seconds, and the run's wall time outside the rounds (start, imports, the preflight of
     every organisation, the initial evaluation, shutdown).
2. **Client-level DP** (``--organisations``): ``client_level_dp.py --utility`` at each count,
   every organisation in every round (fraction-fit 1: q = 1, the most each round's mean can
   average the noise away, and no sampling approximation in the accounting), 4 rounds. Per-client
   work is ``client_level_dp.py``'s 4 local iterations of 16 prompts a round, from a pool of 64
   training prompts (its default pool is 256; a smaller one loads faster and each round uses 64
   anyway). Half that work, 2 iterations of 8, left the non-private arm with no gain in 4 rounds
   (0.457 -> 0.440 at 6 organisations, read on the validation problems: the one choice made
   there, of how much work, and no setting of the private arms). Held-out greedy accuracy on every
   validation problem (disjoint from training) at client-level epsilon
   1, 4 and 10 (delta 1e-5) and without client-level DP; the gain kept is (epsilon arm - round 0)
   / (no-DP arm - round 0), one seed (None where the no-DP arm gains nothing).

Writes ``benchmarks/results/scale.json``: one ``simulation`` row per N (``supernodes``,
``peak_rss_gib``, seconds per round, memory and CPU by process kind, the time split) and one
``client_level_dp`` row per organisation count and epsilon (``organisations``, ``epsilon``,
``accuracy``, ``gain_kept``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import harness  # first: puts this checkout on sys.path

from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env

harness.quiet()
SAMPLED_FRACTION = 0.1
MEMORY_GOAL_GIB = 4.0
GIB = 2**30
# Per-client sizes of the client-level DP arms (``client_level_dp.py``'s options).
CLIENT_LEVEL_DP_ARGS = ["--rounds", "4", "--train-size", "64", "--train-batch-size", "16", "--local-iterations", "4",
                        "--eval-size", "0",  # every validation problem
                        "--noises"]  # and none of its fixed small-noise arms
# Process kinds, by what their command line says; the first match wins.
PROCESS_KINDS = (
    ("superlink", ("flower-superlink", "flower-superexec")),
    ("simulation", ("flwr-simulation",)),
    ("flwr run CLI", ("flwr run",)),
    ("ray workers", ("ray::", "default_worker.py")),
    ("ray core", ("ray",)),
)


# ----------------------------------------------------------------------------- 1. simulation
def run_config(supernodes: int, rounds: int, output_dir: Path) -> dict:
    sampled = int(supernodes * SAMPLED_FRACTION)
    return {
        "num-server-rounds": rounds, "fraction-fit": SAMPLED_FRACTION, "fraction-evaluate": SAMPLED_FRACTION,
        "min-fit-clients": sampled, "min-evaluate-clients": sampled, "min-available-clients": supernodes,
        "secagg.enabled": True, "privacy.enabled": True, "privacy.metrics": "clear",
        "data.train_size": 32, "data.val_size": 4, "data.train_batch_size": 8, "actor.ppo_mini_batch_size": 8,
        "trainer.local_iterations": 2, "output-dir": str(output_dir),
    }


def process_kind(process) -> str:
    """Which part of the run a process is (``PROCESS_KINDS``), from its command line."""
    if process.pid == os.getpid():
        return "this script"
    command = " ".join(process.cmdline())
    return next((kind for kind, marks in PROCESS_KINDS if any(mark in command for mark in marks)), "other")


def time_split(records: list[dict], wall: float) -> dict:
    """Seconds per round and where they go, from the run's metrics.jsonl records."""
    rounds = [r for r in records if "fit" in r]
    fits = [r["seconds"] for r in rounds]
    compute = [r["fit"]["time_fit_sum"] for r in rounds]
    evaluations = [r.get("evaluate", {}).get("seconds", 0.0) for r in rounds]
    return {
        **harness.median_range("seconds_per_round", fits),
        "rounds": [{"round": r["round"], "seconds": r["seconds"], "clients": r["fit"]["num_clients"],
                    "fit_compute_sum": r["fit"]["time_fit_sum"], "fit_compute_max": r["fit"]["time_fit_max"],
                    "rest": r["seconds"] - r["fit"]["time_fit_sum"], "evaluate_seconds": e,
                    "epsilon_run": r["fit"].get("epsilon_run")} for r, e in zip(rounds, evaluations)],
        **harness.median_range("fit_compute_share", [c / s for c, s in zip(compute, fits)]),
        **harness.median_range("evaluate_seconds", evaluations),
        "outside_rounds_seconds": wall - sum(fits) - sum(evaluations),
    }


def simulate(supernodes: int, rounds: int, timeout: float) -> dict:
    """One ``flwr run`` of ``supernodes`` organisations: peak memory by process kind and the time split."""
    root = Path(tempfile.mkdtemp(prefix=f"scale-{supernodes}-"))
    env = {**isolated_env(root), "PYTHONPATH": str(harness.REPO)}  # this checkout's code and shipped model
    config = run_config(supernodes, rounds, root / "out")
    sampler = harness.RssSampler(interval=1.0, kind_of=process_kind).start()
    before = sampler.begin()
    start = time.perf_counter()
    try:
        done = flwr_run_simulation(env, root, config, num_supernodes=supernodes, timeout=timeout)
    finally:
        wall = time.perf_counter() - start
        memory = sampler.end(before)
        sampler.stop()
        kill_tree_with_env(env["FLWR_HOME"])
    (root / "flwr_run.log").write_text(done.stdout + done.stderr)
    runs = sorted((root / "out").glob("run-*"))
    records = [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines()] if runs else []
    if done.returncode != 0 or len([r for r in records if "fit" in r]) != rounds:
        raise SystemExit(f"{supernodes} supernodes: the run did not complete {rounds} rounds; see "
                         f"{root / 'flwr_run.log'}:\n{(done.stdout + done.stderr)[-3000:]}")
    preflight = re.search(r"preflight: (\d+) clients ready", done.stdout + done.stderr)
    return {
        "supernodes": supernodes, "sampled_per_round": config["min-fit-clients"], "rounds": rounds,
        "peak_rss_gib": memory["all_peak_mib"] / 1024, "within_goal": memory["all_peak_mib"] / 1024 <= MEMORY_GOAL_GIB,
        "peak_rss_by_kind_mib": memory["all_peak_by_kind"], "cpu_seconds_by_kind": memory["cpu_seconds_by_kind"],
        "wall_seconds": wall, "preflight_clients": int(preflight.group(1)) if preflight else None,
        **time_split(records, wall), "run_config": config, "log": str(root / "flwr_run.log"),
    }


def report_simulation(row: dict) -> None:
    kinds = ", ".join(f"{kind} {v['mib']:.0f} MiB ({v['processes']})"
                      for kind, v in row["peak_rss_by_kind_mib"].items())
    cpu = ", ".join(f"{kind} {seconds:.0f}" for kind, seconds in row["cpu_seconds_by_kind"].items())
    rounds = "; ".join(f"{r['seconds']:.1f} s = fits {r['fit_compute_sum']:.1f} + rest {r['rest']:.1f}, "
                       f"evaluation {r['evaluate_seconds']:.1f} s" for r in row["rounds"])
    low, high = row["seconds_per_round_range"]
    print(f"{row['supernodes']} supernodes, {row['sampled_per_round']} a round: peak RSS {row['peak_rss_gib']:.2f} GiB "
          f"(goal <= {MEMORY_GOAL_GIB:g}: {'met' if row['within_goal'] else 'NOT met'}); {kinds}\n"
          f"  fit round {row['seconds_per_round_median']:.1f} s ({low:.1f}-{high:.1f}): {rounds}\n"
          f"  wall {row['wall_seconds']:.0f} s, {row['outside_rounds_seconds']:.0f} s outside the rounds "
          f"(preflight of {row['preflight_clients']} clients among them); CPU seconds by kind: {cpu}", flush=True)


# ----------------------------------------------------------------------------- 2. client-level DP
def client_level_dp_rows(organisations: int) -> tuple[list[dict], dict]:
    """``client_level_dp.py --utility`` at ``organisations`` clients: one row per epsilon."""
    import client_level_dp

    args = client_level_dp.argument_parser().parse_args(["--clients", str(organisations), *CLIENT_LEVEL_DP_ARGS])
    start = time.perf_counter()
    result = client_level_dp.utility(args)
    arms = result["arms"]
    curve = arms["no_client_level_dp"]["accuracy_per_round"]
    before, clear = curve[0], curve[-1]
    rows = [{"organisations": organisations, "epsilon": None, "accuracy": clear, "gain": clear - before,
             "gain_kept": 1.0}]
    for target in args.epsilons:
        arm = arms[f"epsilon_{target:g}"]
        accuracy = arm["accuracy_per_round"][-1]
        gain_kept = (accuracy - before) / (clear - before) if clear > before else None  # None: no gain to keep
        rows.append({"organisations": organisations, "epsilon": target, "accuracy": accuracy,
                     "gain": accuracy - before, "gain_kept": gain_kept, "noise_multiplier": arm["noise_multiplier"],
                     "epsilon_spent": arm["epsilon_client_level"]})
    for row in rows:
        row["accuracy_round_0"] = before
    result["seconds"] = time.perf_counter() - start
    return rows, result


def report_client_level_dp(rows: list[dict], seconds: float) -> None:
    first = rows[0]
    parts = [f"epsilon {r['epsilon']:g}: {r['accuracy']:.3f} ({100 * r['gain_kept']:.0f}% of the gain, noise "
             f"{r['noise_multiplier']:.2f})" if r["gain_kept"] is not None else f"epsilon {r['epsilon']:g}: "
             f"{r['accuracy']:.3f}" for r in rows[1:]]
    print(f"client-level DP, {first['organisations']} organisations: {first['accuracy_round_0']:.3f} -> "
          f"{first['accuracy']:.3f} without it; " + "; ".join(parts) + f" ({seconds:.0f} s)", flush=True)


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--supernodes", type=int, nargs="*", default=[100, 300])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--organisations", type=int, nargs="*", default=[30, 100, 300])
    parser.add_argument("--skip-simulation", action="store_true")
    parser.add_argument("--skip-client-level-dp", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per simulation run")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "scale.json")
    args = parser.parse_args()
    for supernodes in args.supernodes:
        if supernodes * SAMPLED_FRACTION < 3:
            parser.error(f"--supernodes {supernodes}: at 10% a round it samples fewer than the 3 clients SecAgg+ "
                         "needs; allowed: 30 or more")
    result: dict = {"command": harness.command_line(), "simulation": [], "client_level_dp": [], "details": {}}
    start = time.perf_counter()

    def save() -> None:  # after every measurement: a later failure keeps what was measured
        result["seconds"] = time.perf_counter() - start
        harness.write_json(args.out, result)

    for supernodes in [] if args.skip_simulation else args.supernodes:  # first: this process still holds no torch
        row = simulate(supernodes, args.rounds, args.timeout)
        report_simulation(row)
        result["simulation"].append(row)
        save()
    for organisations in [] if args.skip_client_level_dp else args.organisations:
        rows, details = client_level_dp_rows(organisations)
        report_client_level_dp(rows, details["seconds"])
        result["client_level_dp"] += rows
        result["details"][f"client_level_dp_{organisations}"] = details
        save()
    print(f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
