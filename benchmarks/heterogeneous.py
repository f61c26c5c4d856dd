"""Clients with different compute: held-out accuracy and round wall time with per-node budgets
of 2, 5 and 10 local iterations against uniform budgets with the same total (6, 6, 5 = 17
iterations a round), with FedProx's mean and with FedNova's normalised averaging
(``aggregation = "fednova"``, Wang et al. 2020).

Goal: no target set.

    python benchmarks/heterogeneous.py [--rounds 4] [--seeds 1] [--out DIR]

The real client and strategy code (``VerlClient`` with a ``config.LocalBudget`` per client,
``FedProxAdapters``) run in one process through ``inprocess.fit_round``; the round asks for
``trainer.local_iterations = 10`` and each node's ``local-iterations`` caps it. Reported per arm
and round: greedy reward of the global adapter on ``--eval-size`` validation problems (disjoint
from all training prompts), the iterations each client ran, and the round's wall time as a
federation would see it: the slowest client's fit (clients train in parallel), and here, where
they run one after another, the sum.
"""

from __future__ import annotations

import time

import harness

harness.quiet()

ARMS = {  # name: (local-iterations per node, aggregation)
    "uniform_6_6_5": ((6, 6, 5), "mean"),
    "budgets_2_5_10": ((2, 5, 10), "mean"),
    "budgets_2_5_10_fednova": ((2, 5, 10), "fednova"),
}


def run(args, arm: str, seed: int, eval_rows: list[dict]) -> dict:
    from flwr_verl.config import FederationConfig, LocalBudget, SecAggConfig, engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.strategy import FedProxAdapters

    budgets, aggregation = ARMS[arm]
    config = engine_config(
        data={"train_size": args.train_size, "train_batch_size": args.train_batch_size, "val_size": 0},
        actor={"ppo_mini_batch_size": args.train_batch_size, "lr": args.lr},
        privacy={"enabled": args.dp, "deterministic": True},
        trainer={"seed": seed, "local_iterations": max(budgets)},
    )
    models = build_models(config.model, with_critic=False, seed=seed)
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", seed, i, len(budgets)), [], partition_id=i,
                                  models=models, budget=LocalBudget(iterations=b))
               for i, b in enumerate(budgets)}
    federation = FederationConfig(num_server_rounds=args.rounds, min_fit_clients=len(budgets),
                                  min_evaluate_clients=len(budgets), min_available_clients=len(budgets),
                                  proximal_mu=args.proximal_mu, aggregation=aggregation,
                                  secagg=SecAggConfig(enabled=False))
    strategy = FedProxAdapters(federation, models.adapters.get_arrays(), local_iterations=max(budgets))
    evaluator = clients["0"].trainer
    rounds = [{"round": 0, "eval_reward": evaluator.evaluate(eval_rows).reward}]
    for server_round in range(1, args.rounds + 1):
        start = time.perf_counter()
        _, metrics = fit_round(strategy, InProcessClients(clients), server_round)
        seconds = time.perf_counter() - start
        models.adapters.set_arrays(strategy.global_arrays)
        rounds.append({"round": server_round, "eval_reward": evaluator.evaluate(eval_rows).reward,
                       "iterations": strategy.last_round["iterations"], "time_fit_max": metrics["time_fit_max"],
                       "time_fit_sum": metrics["time_fit_sum"], "round_seconds_sequential": seconds})
    return {"arm": arm, "seed": seed, "rounds": rounds}


def main() -> None:
    parser = harness.federation_parser(__doc__, rounds=4, train_size=512)
    parser.add_argument("--lr", type=float, default=1e-3, help="actor.lr (the no-DP choice of federation.py)")
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--dp", action="store_true", help="train under DP (privacy.noise_multiplier default)")
    args = parser.parse_args()

    import numpy as np

    eval_rows = harness.federation_setup(args)
    runs = []
    for seed in range(args.seeds):
        for arm in ARMS:
            runs.append(run(args, arm, seed, eval_rows))
            curve = " ".join(f"{r['eval_reward']:.3f}" for r in runs[-1]["rounds"])
            later = runs[-1]["rounds"][1:]
            print(f"seed {seed} {arm:24s} eval reward by round {curve}; iterations {later[-1]['iterations']}; "
                  f"round wall time: slowest client {np.median([r['time_fit_max'] for r in later]):.1f} s "
                  f"(sequential {np.median([r['round_seconds_sequential'] for r in later]):.1f} s)", flush=True)
    summary = {}
    for arm in ARMS:
        items = [r for r in runs if r["arm"] == arm]
        curves = np.array([[x["eval_reward"] for x in r["rounds"]] for r in items])
        later = [x for r in items for x in r["rounds"][1:]]
        summary[arm] = {
            "eval_reward_by_round_mean": curves.mean(0).tolist(),
            "final_eval_reward_range": [float(curves[:, -1].min()), float(curves[:, -1].max())],
            "round_wall_time_slowest_client_median_s": float(np.median([x["time_fit_max"] for x in later])),
            "round_wall_time_slowest_client_range_s": [min(x["time_fit_max"] for x in later),
                                                       max(x["time_fit_max"] for x in later)],
            "round_seconds_sequential_median": float(np.median([x["round_seconds_sequential"] for x in later])),
            "iterations_per_round": sum(later[0]["iterations"].values()),
        }
        print(f"{arm:24s} " + ", ".join(f"{k} {v}" for k, v in summary[arm].items()))
    harness.write_json(args.out / "heterogeneous.json", {"settings": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
