"""The federation against the engine alone: framework tax, bytes, and rounds to a target reward.

    python benchmarks/federation.py [--rounds 8] [--out benchmarks/results/federation.json]

One real Flower simulation (`flwr run`, 3 supernodes, SecAgg+ on) and, side by side, the
centralized baseline: the same engine and config on the pooled data of the 3 clients, trained in
"round equivalents" of 3 x ``trainer.local_iterations`` iterations, so that after every round
both have used the same number of samples. Privacy is off in both: DP noise depends on the
dataset size (q = batch / N), which pooling changes, and the point here is the cost of federation.

Two baselines see the same samples per round: one takes as many optimizer steps as a client
(``local_iterations`` steps on the pooled batch of all clients: the comparison that isolates
federation), the other as many as all clients together (``clients x local_iterations`` steps
on one client's batch size).

Figures:
- framework tax: a federated round's wall time divided by the sum of its clients' pure local
  compute (``time_fit`` of each client), median over rounds after the first (which pays the
  client processes' imports);
- bytes up per round divided by the full model's bytes (fp32);
- rounds to reach the target greedy reward on the pooled held-out prompts (target: the start plus
  60% of the pooled-batch centralized run's best gain), federated divided by each centralized run.
Writes JSON and a PNG of held-out reward per round for both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flwr.common.config import parse_config_args  # noqa: E402

from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env  # noqa: E402
from flwr_verl.baseline import pooled_rows  # noqa: E402
from flwr_verl.config import parse_run_config  # noqa: E402
from flwr_verl.models import build_models, resolve_model_path  # noqa: E402
from flwr_verl.trainer import LocalPPOTrainer  # noqa: E402

NUM_CLIENTS = 3


def federated(run_config: dict, workdir: Path) -> list[dict]:
    env = isolated_env(workdir)
    try:
        proc = flwr_run_simulation(env, workdir, {**run_config, "output-dir": str(workdir / "out")},
                                   num_supernodes=NUM_CLIENTS, timeout=1800)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])
    runs = sorted((workdir / "out").glob("run-*"))
    if proc.returncode != 0 or not runs:
        raise SystemExit(f"flwr run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines()]


def centralized(run_config: dict, rounds: int, pooled_batch: bool) -> list[dict]:
    """Per round the samples of all clients' round. ``pooled_batch``: local_iterations steps on
    batches of clients x train_batch_size prompts (as many optimizer steps as a client takes);
    else clients x local_iterations steps on train_batch_size prompts."""
    config = parse_run_config(run_config).engine
    iterations = config.trainer.local_iterations
    if pooled_batch:
        batch = config.data.train_batch_size * NUM_CLIENTS
        config = dataclasses.replace(
            config, data=dataclasses.replace(config.data, train_batch_size=batch),
            actor=dataclasses.replace(config.actor, ppo_mini_batch_size=config.actor.ppo_mini_batch_size * NUM_CLIENTS))
    else:
        iterations *= NUM_CLIENTS
    train_rows, val_rows = pooled_rows(config, NUM_CLIENTS)
    trainer = LocalPPOTrainer(config, train_rows)
    records = [{"round": 0, "reward": trainer.evaluate(val_rows)["reward"], "seconds": 0.0}]
    for round_number in range(1, rounds + 1):
        start = time.perf_counter()
        trainer.fit(iterations, seed=round_number)
        records.append({"round": round_number, "reward": trainer.evaluate(val_rows)["reward"],
                        "seconds": time.perf_counter() - start})
    return records


def rounds_to(target: float, rewards: list[tuple[int, float]]) -> int | None:
    return next((r for r, reward in rewards if reward >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "federation.json"))
    parser.add_argument("--run-config", default="", help='overrides, as for flwr run: "key=value key2=value2"')
    args = parser.parse_args()
    run_config = {"num-server-rounds": args.rounds, "privacy.enabled": False,
                  **parse_config_args([args.run_config])}
    policy = build_models(parse_run_config(run_config).engine.model, with_critic=False).policy
    model_bytes = 4 * sum(p.numel() for name, p in policy.named_parameters() if "lora_" not in name)

    with tempfile.TemporaryDirectory() as tmp:
        fed = federated(run_config, Path(tmp))
    cen = centralized(run_config, args.rounds, pooled_batch=True)
    cen_steps = centralized(run_config, args.rounds, pooled_batch=False)

    taxes = [r["seconds"] / (r["fit"]["time_fit"] * r["fit"]["num_clients"]) for r in fed[1:]]
    bytes_ratio = statistics.median(r["fit"]["bytes_sent"] for r in fed) / model_bytes
    start = cen[0]["reward"]
    target = start + 0.6 * (max(r["reward"] for r in cen) - start)
    fed_rewards = [(r["round"], r["evaluate"]["reward"]) for r in fed if "evaluate" in r]
    cen_rewards = [(r["round"], r["reward"]) for r in cen[1:]]
    fed_rounds, cen_rounds = rounds_to(target, fed_rewards), rounds_to(target, cen_rewards)
    steps_rounds = rounds_to(target, [(r["round"], r["reward"]) for r in cen_steps[1:]])
    result = {
        "run_config": run_config, "clients": NUM_CLIENTS, "rounds": args.rounds, "model": str(resolve_model_path(parse_run_config(run_config).engine.model)),
        "framework_tax_median": statistics.median(taxes), "framework_tax_per_round": taxes,
        "round_seconds": [r["seconds"] for r in fed],
        "bytes_up_per_round_over_model_bytes": bytes_ratio, "model_bytes": model_bytes,
        "target_reward": target, "rounds_to_target_federated": fed_rounds, "rounds_to_target_centralized": cen_rounds,
        "rounds_ratio": (fed_rounds / cen_rounds) if fed_rounds and cen_rounds else None,
        "rounds_to_target_centralized_sequential": steps_rounds,
        "rounds_ratio_vs_sequential": (fed_rounds / steps_rounds) if fed_rounds and steps_rounds else None,
        "federated_eval_reward": fed_rewards, "centralized_eval_reward": [(r["round"], r["reward"]) for r in cen],
        "centralized_sequential_eval_reward": [(r["round"], r["reward"]) for r in cen_steps],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"framework tax (round time / clients' local compute): median {result['framework_tax_median']:.2f}x "
          f"(per round: {', '.join(f'{t:.2f}' for t in taxes)})")
    print(f"bytes up per round / full model bytes: {bytes_ratio:.3f}")
    print(f"rounds to reward {target:.3f}: federated {fed_rounds}, centralized (pooled batch, same steps) "
          f"{cen_rounds}: ratio {result['rounds_ratio']}; centralized ({NUM_CLIENTS}x the steps) {steps_rounds}: "
          f"ratio {result['rounds_ratio_vs_sequential']}")
    print(f"held-out reward per round: federated {[round(r, 3) for _, r in fed_rewards]}, "
          f"centralized {[round(r['reward'], 3) for r in cen]}, "
          f"centralized {NUM_CLIENTS}x steps {[round(r['reward'], 3) for r in cen_steps]}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 3.5))
    for key, label in (("federated_eval_reward", "federated (3 clients)"),
                       ("centralized_eval_reward", "centralized, pooled batch"),
                       ("centralized_sequential_eval_reward", "centralized, 3x steps")):
        rounds, rewards = zip(*result[key])
        axis.plot(rounds, rewards, marker="o", label=label)
    axis.axhline(result["target_reward"], linestyle="--", color="grey", label="target")
    axis.set_xlabel("round (same samples)")
    axis.set_ylabel("held-out greedy reward")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
