"""How exactly the aggregated adapter represents the clients' mean update: standard LoRA against
FFA-LoRA (``model.lora_freeze_a``, Sun et al., ICLR 2024), under DP; with the bytes each client
uploads and the held-out accuracy each reaches.

Goal: FFA-LoRA's aggregate is exact (its error is float32 rounding); the accuracy has no target set.

    python benchmarks/lora_aggregation.py [--rounds 3] [--seeds 1] [--out DIR]

A LoRA layer adds Delta W = (alpha / r) * B @ A to its base weight. FedAvg averages A and B
separately, and mean(B) @ mean(A) != mean(B @ A); with A frozen at the init every node shares,
mean(B) @ A = mean(B @ A) exactly. Measured every round, on the real client and strategy code
(``VerlClient`` + ``FedProxAdapters`` through ``inprocess.fit_round``, FedAvg, DP with each
client's noise set for ``--target-epsilon`` over the run):

- aggregation error: for every LoRA layer, Delta W of the aggregated adapter against the
  num_examples-weighted mean of the clients' Delta W (each client's adapter = global + its
  update), as max |difference| / max |mean| and as ||difference||_F / ||mean||_F over all layers;
- the parameters and bytes each client uploads (``FitReport.bytes_sent``: the update's arrays,
  float32 in the clear; ``federation_wire.py`` measures the serialized messages);
- greedy reward of the global adapter on ``--eval-size`` validation problems (disjoint from all
  training prompts) after each round.
"""

from __future__ import annotations

import statistics
import time

import harness

harness.quiet()


def aggregation_error(policy, adapters, initial, updates, aggregate) -> dict[str, float]:
    """Delta W of the ``aggregate`` adapter against the weighted mean of the clients' Delta W.

    ``updates``: (update arrays, num_examples) per client, each relative to ``initial``. Leaves
    ``adapters`` holding ``aggregate``."""
    from flwr_verl.engine.models import lora_delta_weights

    total = sum(n for _, n in updates)
    client_deltas = []
    for update, _ in updates:
        adapters.set_arrays([w + u for w, u in zip(initial, update)])
        client_deltas.append(lora_delta_weights(policy))
    adapters.set_arrays(aggregate)
    worst = largest = diff_sq = mean_sq = 0.0
    for name, delta in lora_delta_weights(policy).items():
        mean = sum(n / total * d[name].double() for d, (_, n) in zip(client_deltas, updates))
        diff = delta.double() - mean
        worst, largest = max(worst, diff.abs().max().item()), max(largest, mean.abs().max().item())
        diff_sq, mean_sq = diff_sq + diff.square().sum().item(), mean_sq + mean.square().sum().item()
    return {"max_relative": worst / largest, "frobenius_relative": (diff_sq / mean_sq) ** 0.5}


def run(args, freeze_a: bool, seed: int, eval_rows: list[dict]) -> dict:
    from flwr.common import parameters_to_ndarrays

    from flwr_verl.config import FederationConfig, SecAggConfig, engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import FitReport
    from flwr_verl.federation.strategy import FedProxAdapters

    config = engine_config(
        model={"lora_freeze_a": freeze_a},
        data={"train_size": args.train_size, "train_batch_size": args.train_batch_size, "val_size": 0},
        actor={"ppo_mini_batch_size": args.train_batch_size, "lr": args.lr},
        privacy={"enabled": True, "target_epsilon": args.target_epsilon, "deterministic": True},
        trainer={"seed": seed, "local_iterations": args.local_iterations},
    )
    models = build_models(config.model, with_critic=False, seed=seed)
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", seed, i, args.clients), [],
                                  partition_id=i, models=models) for i in range(args.clients)}
    federation = FederationConfig(num_server_rounds=args.rounds, min_fit_clients=args.clients,
                                  min_evaluate_clients=args.clients, min_available_clients=args.clients,
                                  proximal_mu=0.0, secagg=SecAggConfig(enabled=False))
    adapters = models.adapters
    strategy = FedProxAdapters(federation, adapters.get_arrays(), local_iterations=args.local_iterations,
                               frozen_weights=adapters.frozen_fingerprint)
    evaluator = clients["0"].trainer
    rounds = [{"round": 0, "eval_reward": evaluator.evaluate(eval_rows).reward}]
    start = time.perf_counter()
    for server_round in range(1, args.rounds + 1):
        initial = [a.copy() for a in strategy.global_arrays]
        results, metrics = fit_round(strategy, InProcessClients(clients), server_round)
        updates = [(parameters_to_ndarrays(res.parameters), res.num_examples) for _, res in results]
        error = aggregation_error(models.policy, adapters, initial, updates, strategy.global_arrays)
        reports = [FitReport.from_metrics(res.metrics) for _, res in results]
        rounds.append({
            "round": server_round, **error, "eval_reward": evaluator.evaluate(eval_rows).reward,
            "parameters_up_per_client": sum(u.size for u in updates[0][0]),
            "bytes_up_per_client": reports[0].bytes_sent, "epsilon": max(r.privacy.epsilon_run for r in reports),
        })
    return {"freeze_a": freeze_a, "seed": seed, "rounds": rounds, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = harness.federation_parser(__doc__, rounds=3, train_size=512)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--local-iterations", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3, help="actor.lr (the engine default)")
    parser.add_argument("--target-epsilon", type=float, default=8.0)
    args = parser.parse_args()
    eval_rows = harness.federation_setup(args)
    runs = []
    for seed in range(args.seeds):
        for freeze_a in (False, True):
            runs.append(run(args, freeze_a, seed, eval_rows))
            label = "FFA-LoRA" if freeze_a else "LoRA"
            for r in runs[-1]["rounds"][1:]:
                print(f"seed {seed} {label:8s} round {r['round']}: Delta W error max-rel {r['max_relative']:.2e}, "
                      f"Frobenius-rel {r['frobenius_relative']:.2e}; up {r['parameters_up_per_client']} params "
                      f"({r['bytes_up_per_client']} B); eval reward {r['eval_reward']:.3f}; "
                      f"epsilon {r['epsilon']:.2f}", flush=True)
    summary = {}
    for freeze_a, label in ((False, "lora"), (True, "ffa_lora")):
        rows = [r for run_ in runs if run_["freeze_a"] == freeze_a for r in run_["rounds"][1:]]
        finals = [run_["rounds"][-1]["eval_reward"] for run_ in runs if run_["freeze_a"] == freeze_a]
        summary[label] = {
            **harness.median_range("max_relative", [r["max_relative"] for r in rows]),
            "frobenius_relative_median": statistics.median(r["frobenius_relative"] for r in rows),
            "parameters_up_per_client": rows[0]["parameters_up_per_client"],
            "bytes_up_per_client": rows[0]["bytes_up_per_client"],
            "final_eval_reward_mean": statistics.mean(finals),
        }
        print(f"{label:8s} " + ", ".join(f"{k} {v}" for k, v in summary[label].items()))
    print(f"upload per client, FFA-LoRA / LoRA: "
          f"{summary['ffa_lora']['bytes_up_per_client'] / summary['lora']['bytes_up_per_client']:.3f}")
    harness.write_json(args.out / "lora_aggregation.json", {"settings": vars(args), "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
