"""Sparse uploads (``compression.density``, ``flwr_verl/federation/compression.py``): held-out
accuracy against rounds, and bytes uploaded, at densities 1, 0.25 and 0.05, under DP at epsilon 8.

Goal: bytes scale with density; the accuracy each density keeps has no target set.

    python benchmarks/compression.py [--rounds 4] [--seeds 1] [--densities 1 0.25 0.05] [--out DIR]

At density d < 1 every client sends the same round-seeded d share of the adapter's coordinates
and keeps the rest as its error-feedback residual (Stich et al. 2018). The real client and
strategy code (``VerlClient``, each keeping its residual in its own ``ErrorFeedback``;
``FedProxAdapters`` with ``compression.density = d``) run in one process through
``inprocess.fit_round(secure=True)``: SecAgg+'s arithmetic without its masking or quantization.
Each client sends its update as it would under SecAgg+ (float64, checked against
``secagg.clipping-range`` and ``secagg.max-weight``) and the strategy receives the
num_examples-weighted mean of the aligned sparse vectors, which is what SecAgg+'s secure sum
hands the server; the quantization error of the real protocol (<= ``secagg.precision``) is
measured by ``secagg_precision.py``, its messages by ``federation_wire.py``.

Reported per density and round: greedy reward (exact match) of the global adapter on
``--eval-size`` validation problems, disjoint from all training prompts (round 0: the shared
initial adapter); the coordinates each client uploads, ``FitReport.bytes_sent`` (the float64
vector SecAgg+ receives) and what SecAgg+ puts on the wire for it (8 bytes per coordinate:
Flower 1.42's masked int64 vectors, see README). Training uses the engine defaults
(``actor.lr``), DP-SGD with each client's noise set for ``--target-epsilon`` over the run;
nothing is tuned on the evaluation set.
"""

from __future__ import annotations

import statistics
import time

import harness

harness.quiet()

SECAGG_BYTES_PER_COORDINATE = 8  # Flower 1.42's SecAgg+ masks and sends int64 whatever the modulus (README)


def run(args, density: float, seed: int, eval_rows: list[dict]) -> dict:
    from flwr.common import parameters_to_ndarrays

    from flwr_verl.config import CompressionConfig, FederationConfig, SecAggConfig, engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import FitReport, SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    config = engine_config(
        data={"train_size": args.train_size, "train_batch_size": args.train_batch_size, "val_size": 0},
        actor={"ppo_mini_batch_size": args.train_batch_size},
        privacy={"target_epsilon": args.target_epsilon, "deterministic": True},
        trainer={"seed": seed, "local_iterations": args.local_iterations},
    )
    models = build_models(config.model, with_critic=False, seed=seed)
    clients = {str(i): VerlClient(config, load_rows(config.data, "train", seed, i, args.clients), [],
                                  partition_id=i, models=models) for i in range(args.clients)}
    secagg = SecAggConfig()
    federation = FederationConfig(num_server_rounds=args.rounds, min_fit_clients=args.clients,
                                  min_evaluate_clients=args.clients, min_available_clients=args.clients,
                                  secagg=secagg, compression=CompressionConfig(density=density))
    strategy = FedProxAdapters(federation, models.adapters.get_arrays(), local_iterations=args.local_iterations,
                               secure_aggregation=SecAggBounds(secagg.clipping_range, args.train_size),
                               mask_seed=seed)
    total_coordinates = sum(a.size for a in strategy.global_arrays)
    evaluator = clients["0"].trainer
    rounds = [{"round": 0, "eval_reward": evaluator.evaluate(eval_rows).reward}]
    start = time.perf_counter()
    for server_round in range(1, args.rounds + 1):
        results, _ = fit_round(strategy, InProcessClients(clients), server_round, secure=True)
        models.adapters.set_arrays(strategy.global_arrays)
        reports = [FitReport.from_metrics(res.metrics) for _, res in results]
        sent = [parameters_to_ndarrays(res.parameters) for _, res in results]
        rounds.append({
            "round": server_round, "eval_reward": evaluator.evaluate(eval_rows).reward,
            "coordinates_up_per_client": max(sum(a.size for a in arrays) for arrays in sent),
            "bytes_sent_per_client": max(r.bytes_sent for r in reports),
            "epsilon": max(r.privacy.epsilon_run for r in reports if r.privacy),
        })
    return {"density": density, "seed": seed, "coordinates_total": total_coordinates,
            "rounds": rounds, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = harness.federation_parser(__doc__, rounds=4, train_size=256)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--local-iterations", type=int, default=5)
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="over the run, as lora_aggregation.py")
    parser.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.25, 0.05])
    args = parser.parse_args()

    import numpy as np

    eval_rows = harness.federation_setup(args)
    runs = []
    for seed in range(args.seeds):
        for density in args.densities:
            runs.append(run(args, density, seed, eval_rows))
            curve = " ".join(f"{r['eval_reward']:.3f}" for r in runs[-1]["rounds"])
            last = runs[-1]["rounds"][-1]
            print(f"seed {seed} density {density:<5g} eval reward by round {curve}; up per client and round "
                  f"{last['coordinates_up_per_client']} of {runs[-1]['coordinates_total']} coordinates, "
                  f"{last['bytes_sent_per_client']} B; epsilon {last['epsilon']:.2f}; "
                  f"{runs[-1]['seconds']:.0f} s", flush=True)
    summary = {}
    for density in args.densities:
        items = [r for r in runs if r["density"] == density]
        curves = np.array([[x["eval_reward"] for x in r["rounds"]] for r in items])
        gains = curves[:, -1] - curves[:, 0]
        last = items[0]["rounds"][-1]
        summary[str(density)] = {
            "eval_reward_by_round_median": np.median(curves, 0).tolist(),
            "eval_reward_by_round_range": [curves.min(0).tolist(), curves.max(0).tolist()],
            **harness.median_range("gain", gains.tolist()),
            "coordinates_up_per_client": last["coordinates_up_per_client"],
            "bytes_sent_per_client": last["bytes_sent_per_client"],
            "secagg_wire_bytes_per_client": last["coordinates_up_per_client"] * SECAGG_BYTES_PER_COORDINATE,
            "seconds_median": statistics.median(r["seconds"] for r in items),
        }
    dense = summary[str(max(args.densities))]["bytes_sent_per_client"]
    print(f"{'density':>8s} {'reward by round (median)':>36s} {'gain (range)':>22s} {'coords up':>10s} "
          f"{'bytes up':>9s} {'vs d=' + format(max(args.densities), 'g'):>7s}")
    for density, s in summary.items():
        curve = " ".join(f"{x:.3f}" for x in s["eval_reward_by_round_median"])
        print(f"{density:>8s} {curve:>36s} {s['gain_median']:+.3f} [{s['gain_range'][0]:+.3f}, "
              f"{s['gain_range'][1]:+.3f}] {s['coordinates_up_per_client']:>10d} {s['bytes_sent_per_client']:>9d} "
              f"{s['bytes_sent_per_client'] / dense:>7.3f}")
    peak_rss_mib = harness.peak_rss_mib()
    print(f"aggregation: SecAgg+ arithmetic in process (weighted mean of aligned vectors; no masking or "
          f"quantization); peak RSS {peak_rss_mib:.0f} MiB")
    harness.write_json(args.out / "compression.json", {
        "settings": vars(args), "aggregation": "inprocess.fit_round(secure=True): SecAgg+ arithmetic, no masking",
        "summary": summary, "peak_rss_mib": peak_rss_mib, "runs": runs})


if __name__ == "__main__":
    main()
