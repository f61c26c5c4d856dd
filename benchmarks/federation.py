"""The federation against the engine alone: rounds to a target held-out accuracy, bytes on the
wire, and the framework tax (a round's wall time over the clients' compute).

Goal: rounds to target at most 1.3x the centralized arms'; framework tax at most 1.2x.

    python benchmarks/federation.py [--rounds 8] [--seeds 5] [--sim-rounds 4]

Sizes (chosen to finish in 8-12 minutes on a loaded 2-core machine): 3 clients of 256 train
prompts each, batches of 16 prompts x 4 responses, ``trainer.local_iterations`` 4, 8 rounds,
greedy accuracy on 3 x 64 held-out prompts. Everything else is the app's default config.

1. **Rounds to target.** Three arms, each fed the same samples per round:
   - ``federated``: 3 ``VerlClient``s and the app's ``FedProxAdapters`` (FedProx mu 0.01, server
     optimizer sgd at lr 1), emulated in this process: a round's figures do not depend on the
     transport, and real Flower would only add minutes;
   - ``centralized_same_steps``: the engine on the pooled data, ``local_iterations`` steps per
     round on a batch 3 x as large (as many optimizer steps as one client takes);
   - ``centralized_3x_steps``: 3 x ``local_iterations`` steps per round on one client's batch.
   Privacy is off in all arms: DP's noise is calibrated to the sample rate q = batch / N, which
   pooling changes (3x the prompts, 3x the batch in one arm, not in the other), so no DP setting
   is "the same" in all three, and the question here is the cost of federation alone.
   Each arm gets its own ``actor.lr``: the best of ``--lrs`` by accuracy over the last two rounds
   on the **tune** split (one seed, 0), disjoint from train and val by construction. The grid
   is 3e-4, 1e-3, 3e-3: at 1e-2 both centralized arms collapsed (tune accuracy 0.29 -> 0.04 and
   -> 0.00), and with 1e-2 in the grid every arm chose 1e-3, its lower edge. The target
   is the round-0 accuracy plus ``delta``, chosen from those tune runs: halfway between the
   largest round-1 gain of any arm and the smallest final gain (mean of the last two rounds), so
   that on the tune runs no arm reaches it in round 1 and every arm reaches it eventually. Then
   ``--seeds`` seeds (1..S: data, LoRA init, sampling) per arm at its lr, on the **val** split.
   Reported: rounds to target per arm (median, range) and federated / centralized per seed.
2. **Bytes on the wire** (``federation_wire.py``): the app's own ServerApp and ClientApp in this
   process, 2 rounds each with SecAgg+ on and off, every message serialized with Flower's serde.
3. **Framework tax**: ``--sim-rounds`` rounds of one real ``flwr run`` simulation (3
   supernodes) with SecAgg+ on, and one with it off: a round's wall time (``seconds`` in
   metrics.jsonl: configure_fit to aggregate_fit done, evaluation excluded) divided by the
   slowest client's local compute (``fit.time_fit_max``), and separately by the sum of the
   clients' compute (``fit.time_fit_sum``). Median over rounds after the first (which pays the
   imports).

Writes ``benchmarks/results/federation.json`` (medians, ranges, per-seed values, chosen lrs,
target, peak RSS) and a PNG of held-out accuracy per round per arm.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import harness  # first: puts this checkout on sys.path
import torch
from federation_wire import bytes_per_message, measure_wire

from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env
from flwr_verl.config import RunConfig, parse_run_config
from flwr_verl.engine.data import Row, load_rows
from flwr_verl.engine.models import build_models
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.federation.client import VerlClient
from flwr_verl.federation.inprocess import InProcessClients, fit_round
from flwr_verl.federation.strategy import FedProxAdapters

CLIENTS = 3
ARMS = ("federated", "centralized_same_steps", "centralized_3x_steps")
TUNE_SEED = 0
BASE_CONFIG = {
    "privacy.enabled": False, "secagg.enabled": False, "evaluate-every": 1,
    "data.train_size": 256, "data.val_size": 64, "data.train_batch_size": 16,
    "actor.ppo_mini_batch_size": 16, "trainer.local_iterations": 4,
}


# ----------------------------------------------------------------------------- rounds to target
def run_config(rounds: int, seed: int, lr: float, **extra) -> dict:
    return {**BASE_CONFIG, "num-server-rounds": rounds, "trainer.seed": seed, "actor.lr": lr, **extra}


def pooled(config: RunConfig, split: str) -> list[Row]:
    """All clients' rows of ``split`` together (the generator makes size x clients, then splits)."""
    data = config.engine.data
    data = dataclasses.replace(data, train_size=data.train_size * CLIENTS, val_size=data.val_size * CLIENTS)
    return load_rows(data, split, config.engine.trainer.seed)


def federated_curve(config: RunConfig, eval_rows: list[Row]) -> list[float]:
    """Held-out accuracy after rounds 0..R of FedProx over 3 in-process ``VerlClient``s."""
    engine, seed = config.engine, config.engine.trainer.seed
    models = build_models(engine.model, with_critic=False, seed=seed)
    clients = [VerlClient(engine, load_rows(engine.data, "train", seed, i, CLIENTS), [], partition_id=i,
                          models=models) for i in range(CLIENTS)]
    strategy = FedProxAdapters(config.federation, models.adapters.get_arrays(),
                               local_iterations=engine.trainer.local_iterations)
    manager = InProcessClients({str(i): client for i, client in enumerate(clients)})

    def accuracy() -> float:
        models.adapters.set_arrays(strategy.global_arrays)
        return clients[0].trainer.evaluate(eval_rows).accuracy

    curve = [accuracy()]
    for server_round in range(1, config.federation.num_server_rounds + 1):
        fit_round(strategy, manager, server_round)
        curve.append(accuracy())
    return curve


def centralized_curve(config: RunConfig, eval_rows: list[Row], same_steps: bool) -> list[float]:
    """Held-out accuracy after rounds 0..R of the engine alone on the pooled train rows, each round
    one fit (fresh optimizer, as a client's) on all clients' samples of a round: ``same_steps``:
    local_iterations steps on a 3x batch, else 3 x local_iterations steps on one client's batch."""
    engine = config.engine
    iterations = engine.trainer.local_iterations
    if same_steps:
        engine = dataclasses.replace(
            engine, data=dataclasses.replace(engine.data, train_batch_size=engine.data.train_batch_size * CLIENTS),
            actor=dataclasses.replace(engine.actor, ppo_mini_batch_size=engine.actor.ppo_mini_batch_size * CLIENTS))
    else:
        iterations *= CLIENTS
    seed = engine.trainer.seed
    trainer = LocalPPOTrainer(engine, pooled(config, "train"),
                              models=build_models(engine.model, with_critic=False, seed=seed))
    curve = [trainer.evaluate(eval_rows).accuracy]
    for round_number in range(1, config.federation.num_server_rounds + 1):
        trainer.fit(iterations, seed=seed * 1_000_003 + round_number)
        curve.append(trainer.evaluate(eval_rows).accuracy)
    return curve


def curve(arm: str, rounds: int, seed: int, lr: float, split: str) -> list[float]:
    config = parse_run_config(run_config(rounds, seed, lr))
    rows = pooled(config, split)
    if arm == "federated":
        return federated_curve(config, rows)
    return centralized_curve(config, rows, same_steps=arm == "centralized_same_steps")


def final(values: list[float]) -> float:
    """An arm's end point: the mean of its last two rounds (one 192-prompt round is noisy)."""
    return statistics.mean(values[-2:])


def tune(rounds: int, lrs: list[float]) -> dict:
    """Per arm, the curve on the tune split at every lr, and the chosen lr."""
    out = {}
    for arm in ARMS:
        curves = {lr: curve(arm, rounds, TUNE_SEED, lr, "tune") for lr in lrs}
        best = max(lrs, key=lambda lr: final(curves[lr]))
        out[arm] = {"lr": best, "curves": {str(lr): c for lr, c in curves.items()}, "curve": curves[best]}
        print(f"tune {arm}: " + "; ".join(f"lr {lr:g}: {' '.join(f'{a:.3f}' for a in c)}" for lr, c in curves.items())
              + f" -> lr {best:g}", flush=True)
    return out


def choose_delta(tuned: dict) -> dict:
    """The target gain over round 0, from the tune curves at the chosen lrs."""
    round1 = max(t["curve"][1] - t["curve"][0] for t in tuned.values())
    smallest_final = min(final(t["curve"]) - t["curve"][0] for t in tuned.values())
    degenerate = smallest_final <= round1
    delta = 0.6 * smallest_final if degenerate else (round1 + smallest_final) / 2
    return {"delta": delta, "largest_round1_gain": round1, "smallest_final_gain": smallest_final,
            "fraction_of_smallest_final_gain": delta / smallest_final if smallest_final > 0 else None,
            "degenerate": degenerate}


def rounds_to(target: float, values: list[float]) -> int | None:
    return next((r for r, a in enumerate(values) if r > 0 and a >= target), None)


def spread(values: list[float | None]) -> dict:
    """Median and range; None (never reached) counts as infinitely many rounds."""
    known = sorted(float("inf") if v is None else v for v in values)
    median = statistics.median(known)
    return {"median": None if median == float("inf") else median, "min": known[0],
            "max": None if known[-1] == float("inf") else known[-1], "never": sum(v is None for v in values)}


def rounds_to_target(rounds: int, seeds: int, tuned: dict, delta: float) -> dict:
    per_arm = {arm: {"curves": [], "rounds": []} for arm in ARMS}
    targets = []
    for seed in range(1, seeds + 1):
        for arm in ARMS:
            values = curve(arm, rounds, seed, tuned[arm]["lr"], "val")
            if arm == ARMS[0]:
                targets.append(values[0] + delta)  # round 0 is the same model in every arm: LoRA B = 0
            per_arm[arm]["curves"].append(values)
            per_arm[arm]["rounds"].append(rounds_to(targets[-1], values))
            print(f"seed {seed} {arm}: {' '.join(f'{a:.3f}' for a in values)}; "
                  f"target {targets[-1]:.3f} at round {per_arm[arm]['rounds'][-1]}", flush=True)
    fed = per_arm["federated"]["rounds"]
    result = {"targets": targets, "arms": per_arm, "ratios": {}}
    for arm in ARMS:
        per_arm[arm]["summary"] = spread(per_arm[arm]["rounds"])
        per_arm[arm]["reached_in_round_1"] = sum(r == 1 for r in per_arm[arm]["rounds"])
    for arm in ARMS[1:]:
        pairs = [f / c if f and c else None for f, c in zip(fed, per_arm[arm]["rounds"])]
        result["ratios"][f"federated / {arm}"] = {"per_seed": pairs, **spread(pairs)}
    return result


# ----------------------------------------------------------------------------- bytes on the wire
def wire(lr: float) -> dict:
    """Bytes per client per round, SecAgg+ on and off, against the full model's fp32 bytes."""
    policy = build_models(parse_run_config(run_config(2, 0, lr)).engine.model, with_critic=False).policy
    model_bytes = 4 * sum(p.numel() for name, p in policy.named_parameters() if "lora_" not in name)
    adapter_params = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    out = {"model_fp32_bytes": model_bytes, "adapter_parameters": adapter_params}
    for secagg in (False, True):
        per_message = bytes_per_message(measure_wire(
            run_config(2, 0, lr, **{"secagg.enabled": secagg, "evaluate-every": 0}), CLIENTS)[0])
        totals = {d: sum(s["protobuf"] for s in stages.values()) for d, stages in per_message.items()}
        out["secagg" if secagg else "plain"] = {
            "per_message": per_message, "per_round": totals,
            "per_round_over_model": {d: b / model_bytes for d, b in totals.items()}}
    # SecAgg+'s entries are mod 2**40: 5 bytes would carry what 8 carry now.
    out["secagg_masked_vector_packed_estimate"] = 5 * adapter_params
    return out


# ----------------------------------------------------------------------------- framework tax
def simulation(config: dict, workdir: Path) -> list[dict]:
    env = isolated_env(workdir)
    try:
        proc = flwr_run_simulation(env, workdir, {**config, "output-dir": str(workdir / "out")},
                                   num_supernodes=CLIENTS, timeout=900)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])
    runs = sorted((workdir / "out").glob("run-*"))
    if proc.returncode != 0 or not runs:
        raise SystemExit(f"flwr run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines()]


def framework_tax(rounds: int, lr: float) -> dict:
    out = {}
    for secagg in (True, False):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            records = [r for r in simulation(run_config(rounds, 0, lr, **{"secagg.enabled": secagg}), Path(tmp))
                       if "fit" in r]
        later = records[1:]
        over_slowest = [r["seconds"] / r["fit"]["time_fit_max"] for r in later]
        over_sum = [r["seconds"] / r["fit"]["time_fit_sum"] for r in later]
        out["secagg" if secagg else "plain"] = {
            "round_seconds": [r["seconds"] for r in records],
            "slowest_time_fit": [r["fit"]["time_fit_max"] for r in records],
            "over_slowest_client": statistics.median(over_slowest), "over_sum_of_clients": statistics.median(over_sum),
            "over_slowest_client_per_round": over_slowest, "over_sum_per_round": over_sum,
            "wall_seconds": time.perf_counter() - start}
    return out


# ----------------------------------------------------------------------------- report
def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6.5, 3.8))
    for arm, data in result["rounds_to_target"]["arms"].items():
        curves = data["curves"]
        rounds = range(len(curves[0]))
        mean = [statistics.mean(c[r] for c in curves) for r in rounds]
        axis.plot(rounds, mean, marker="o", label=f"{arm} (lr {result['tuned'][arm]['lr']:g})")
        axis.fill_between(rounds, [min(c[r] for c in curves) for r in rounds],
                          [max(c[r] for c in curves) for r in rounds], alpha=0.15)
    axis.axhline(statistics.mean(result["rounds_to_target"]["targets"]), linestyle="--", color="grey",
                 label="target (mean over seeds)")
    axis.set_xlabel("round (same samples in every arm)")
    axis.set_ylabel("held-out greedy accuracy (val)")
    axis.set_title(f"mean and range over {len(curves)} seeds", fontsize=9)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fmt(summary: dict) -> str:
    top = "never" if summary["max"] is None else f"{summary['max']:g}"
    median = "never" if summary["median"] is None else f"{summary['median']:g}"
    return f"median {median} (range {summary['min']:g}-{top})"


def report(result: dict) -> None:
    rtt, wire_, tax = result["rounds_to_target"], result["wire"], result["framework_tax"]
    lrs = ", ".join(f"{arm} {t['lr']:g}" for arm, t in result["tuned"].items())
    print(f"lrs: {lrs}; "
          f"target = round 0 + {result['target']['delta']:.3f}")
    for arm in ARMS:
        print(f"rounds to target, {arm}: {fmt(rtt['arms'][arm]['summary'])}; "
              f"per seed {rtt['arms'][arm]['rounds']}; reached in round 1: {rtt['arms'][arm]['reached_in_round_1']}")
    for name, ratio in rtt["ratios"].items():
        print(f"ratio {name}: {fmt(ratio)}; per seed {[None if r is None else round(r, 2) for r in ratio['per_seed']]}")
    for mode in ("plain", "secagg"):
        per_round, over = wire_[mode]["per_round"], wire_[mode]["per_round_over_model"]
        print(f"bytes per client per round, {mode}: down {per_round['down']:.0f} ({over['down']:.3f} x model fp32), "
              f"up {per_round['up']:.0f} ({over['up']:.3f} x)")
    for mode in ("secagg", "plain"):
        t = tax[mode]
        print(f"framework tax, {mode}: round / slowest client's compute {t['over_slowest_client']:.2f}x, "
              f"round / sum of clients' compute {t['over_sum_of_clients']:.2f}x")
    print(f"peak RSS {result['peak_rss_mib']:.0f} MiB; {result['seconds']:.0f} s")


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    parser.add_argument("--sim-rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "federation.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    tuned = tune(args.rounds, [float(x) for x in args.lrs.split(",")])
    target = choose_delta(tuned)
    result = {"config": BASE_CONFIG, "clients": CLIENTS, "rounds": args.rounds, "seeds": args.seeds,
              "tuned": tuned, "target": target,
              "rounds_to_target": rounds_to_target(args.rounds, args.seeds, tuned, target["delta"]),
              "wire": wire(tuned["federated"]["lr"]),
              "framework_tax": framework_tax(args.sim_rounds, tuned["federated"]["lr"])}
    result["peak_rss_mib"] = harness.peak_rss_mib()
    result["seconds"] = time.perf_counter() - start
    report(result)
    harness.write_json(args.out, result)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
