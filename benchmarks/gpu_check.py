"""GPU smoke check: device placement, bf16, one fit and one federated round, on a CUDA device;
seconds per phase and peak device memory.

Goal: every check passes (a check, not a measurement: no target set for its figures).

    python benchmarks/gpu_check.py                 # CUDA; exits 2 with a message when torch sees none
    python benchmarks/gpu_check.py --device cpu    # the same checks on the CPU (to test the script)

For each of float32 and bfloat16, with DP on and off: two clients (the embedded model) each fit
once on ``--device`` and the strategy aggregates their SecAgg+-format (float64) updates; one
client then evaluates the new global adapter. Checked, and printed as JSON (also written to
``--out``):

- every model parameter and the FedProx anchor live on the device; the frozen base weights have
  the requested dtype, the LoRA weights float32 (PEFT's autocast of adapters);
- the arrays that travel are float32 (weights) and float64 (updates); all finite;
- the fit's seconds per phase and the peak device memory.

Any failed check exits 1 with the list of failures.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import harness


def check(device: str, dtype: str, privacy: bool) -> dict:
    import numpy as np
    import torch
    from flwr.common import parameters_to_ndarrays

    from flwr_verl.config import FederationConfig, SecAggConfig, engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import EvaluateConfig, FitReport, SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    config = engine_config(model={"device": device, "dtype": dtype},
                           privacy={"enabled": privacy, "deterministic": True, "metrics": "clear"},
                           data={"train_size": 64, "val_size": 16, "train_batch_size": 16},
                           actor={"ppo_mini_batch_size": 8}, trainer={"local_iterations": 2})
    train, val = load_rows(config.data, "train", 0), load_rows(config.data, "val", 0)
    clients = [VerlClient(config, train, val, partition_id=i) for i in range(2)]
    initial = clients[0].adapters.get_arrays()
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=2, min_available_clients=2, proximal_mu=0.01,
                                                secagg=SecAggConfig(enabled=False)),
                               initial, local_iterations=2, secure_aggregation=SecAggBounds(1.0, 1024.0))
    failures: list[str] = []
    policy = clients[0].trainer.policy
    if {p.device.type for p in policy.parameters()} != {torch.device(device).type}:
        failures.append("policy parameters are not all on the device")
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    if frozen != {getattr(torch, dtype)}:
        failures.append(f"frozen base weights are {frozen}, not {dtype}")
    with clients[0].trainer.start_fit(anchor=initial, proximal_mu=0.5) as fit:
        if {a.device.type for a in fit.update.proximal.anchor} != {torch.device(device).type}:
            failures.append("the FedProx anchor is not on the device")

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    results, round_metrics = fit_round(strategy, InProcessClients({str(i): c for i, c in enumerate(clients)}), 1)
    reports = [FitReport.from_metrics(res.metrics) for _, res in results]
    for proxy, res in results:
        if any(u.dtype != np.float64 or not np.isfinite(u).all() for u in parameters_to_ndarrays(res.parameters)):
            failures.append(f"client {proxy.cid}: update not finite float64")
    round_seconds = time.perf_counter() - start
    _, _, evaluation = clients[0].evaluate(strategy.global_arrays, EvaluateConfig(server_round=1).to_config())
    if any(a.dtype != np.float32 or not np.isfinite(a).all() for a in strategy.global_arrays):
        failures.append("global adapter arrays are not finite float32")
    training = reports[0].training
    return {
        "device": device, "dtype": dtype, "privacy": privacy, "failures": failures,
        "round_seconds": round_seconds, "fit_seconds": training.time_fit,
        "phases": {k: getattr(training, k) for k in ("time_rollout", "time_reward", "time_log_prob", "time_update")},
        "reward_after": round_metrics.get("reward_after"), "epsilon_run": round_metrics.get("epsilon_run"),
        "eval_accuracy": evaluation.get("accuracy"),
        "peak_device_memory_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
    }


def main() -> int:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "gpu_check.json")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing checked (use --device cpu to test the script)")
        return 2
    torch.set_num_threads(1)
    results = [check(args.device, dtype, privacy) for dtype in ("float32", "bfloat16") for privacy in (False, True)]
    for r in results:
        memory = f", peak {r['peak_device_memory_mib']:.0f} MiB" if r["peak_device_memory_mib"] is not None else ""
        print(f"{r['device']} {r['dtype']:8s} dp={'on ' if r['privacy'] else 'off'} round {r['round_seconds']:.2f} s, "
              f"fit {r['fit_seconds']:.2f} s{memory}, eval accuracy {r['eval_accuracy']:.3f}: "
              + ("ok" if not r["failures"] else "FAILED " + "; ".join(r["failures"])))
    harness.write_json(args.out, {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                                  "torch": torch.__version__, "results": results})
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
