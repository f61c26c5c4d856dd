"""What client-level DP with distributed Skellam noise costs (``flwr_verl.privacy.distributed_dp``):
the error of its discretisation against central Gaussian noise of the same variance, and the
held-out accuracy it leaves at a target client-level epsilon.

Goal: the discretisation costs nothing measurable; the accuracy has no target set.

    python benchmarks/client_level_dp.py [--dim 29696] [--clients 3] [--trials 5] [--utility]
        [--fraction-fit 1] [--train-size 256] [--train-batch-size 16] [--local-iterations 4] [--out DIR]

Two measurements, each printed and written to ``--out/client_level_dp.json``:

1. ``discretisation`` (numpy only, seconds): ``--clients`` clients' updates of ``--dim``
   parameters (a LoRA-sized adapter; Gaussian entries plus a few large coordinates, then clipped
   to C) go through the whole pipeline: clip, rotate, scale, conditional rounding, Skellam shares,
   the modular sum (what SecAgg+ computes exactly, ``tests/privacy/test_distributed_dp.py``), decode.
   Against it, the same clipped mean with Gaussian noise of the *same* variance added centrally
   (what a trusted server would do). Reported per bit width, with and without rotation: the RMS
   error of each against the exact clipped mean over ``--trials`` trials (median and range), their
   ratio, the error of the same pipeline without noise (rounding alone), and the epsilon of 10 rounds at q = 1 for the Skellam mechanism against Opacus's Gaussian
   mechanism at the same noise (the privacy price of discreteness).
2. ``utility`` (``--utility``, minutes): held-out greedy accuracy of the embedded task after
   ``--rounds`` rounds of ``--clients`` in-process ``VerlClient``s (per-prompt DP off, to isolate
   the client-level mechanism; each with ``--train-size`` prompts in batches of
   ``--train-batch-size``) under client-level DP at epsilon 1, 4 and 10 (delta 1e-5), and without
   it. Each round samples ``--fraction-fit`` of the clients uniformly at random (default 1: q = 1,
   no sampling approximation; below 1 the rounds are accounted as Poisson sampling at that rate,
   ``distributed_dp``). The real client and strategy code runs, with
   ``inprocess.fit_round(secure=True)`` in place of Flower's transport, and SecAgg+'s default
   3 shares and threshold 2 set the fewest survivors each client's noise share assumes
   (``secagg.fewest_survivors``). The clipping norm is the median norm of the non-private
   clients' round-1 updates (training data only); the noise multiplier is the smallest that
   keeps epsilon within the target over the planned rounds. Accuracy is on the task's validation
   problems, disjoint from every client's training problems (``embedded.split_problems``). Two
   more arms run the same pipeline at the small fixed noise multipliers ``--noises`` (their
   epsilon is reported, huge): the mechanism's cost without the noise that the epsilon targets
   need. ``benchmarks/scale.py`` runs this at 30, 100 and 300 clients.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import harness  # first: puts this checkout on sys.path
import numpy as np

from flwr_verl.config import ClientLevelConfig, SecAggConfig
from flwr_verl.federation.secagg import fewest_survivors
from flwr_verl.privacy import distributed_dp as ddp

harness.quiet()
SECAGG = SecAggConfig()  # its default shares and reconstruction threshold decide the fewest survivors
DELTA = 1e-5


def survivors(clients: int) -> int:
    """The fewest of ``clients`` sampled clients whose noise SecAgg+'s aggregate holds."""
    return fewest_survivors(clients, SECAGG.num_shares, SECAGG.reconstruction_threshold)


# ----------------------------------------------------------------------------- 1. discretisation
def client_updates(rng: np.random.Generator, clients: int, dim: int, clip: float) -> list[np.ndarray]:
    """Updates with a heavy tail (1% of coordinates 20x larger), norms 0.5..2 x the clip."""
    updates = []
    for _ in range(clients):
        u = rng.normal(size=dim)
        u[rng.choice(dim, size=max(1, dim // 100), replace=False)] *= 20
        updates.append(u / np.linalg.norm(u) * clip * rng.uniform(0.5, 2.0))
    return updates


def distributed_mean(updates: list[np.ndarray], plan: ddp.SkellamPlan, rng: np.random.Generator) -> np.ndarray:
    """Every client's ``encode_update``, SecAgg+'s sum (exact: a plain sum of the integers it is
    handed), the server's ``decode_aggregate``."""
    sent = [ddp.encode_update([u], plan, server_round=1, rng=rng)[0] for u in updates]
    aggregate = [sum(sent) / len(updates)]  # what SecAggPlusWorkflow hands the strategy
    return ddp.decode_aggregate(aggregate, len(updates), plan, 1, [(plan.dim,)])[0]


def discretisation(args) -> list[dict]:
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    rows = []
    for rotation in (True, False):
        for bits in args.bits:
            config = ClientLevelConfig(enabled=True, clip_norm=args.clip, noise_multiplier=args.noise,
                                       bits=bits, rotation=rotation)
            try:
                plan = ddp.plan_round(config, args.dim, args.clients, survivors(args.clients))
            except Exception as error:  # noqa: BLE001 - a refused width is a result
                rows.append({"bits": bits, "rotation": rotation, "refused": str(error)})
                continue
            # the noise actually in the sum: every survivor's share (all clients survive here)
            central_std = math.sqrt(plan.client_variance * args.clients) / plan.scale / args.clients
            noiseless = dataclasses.replace(plan, noise_multiplier=0.0)  # same grid, no noise: rounding alone
            distributed, central, rounding = [], [], []
            for trial in range(args.trials):
                rng = np.random.default_rng([args.seed, bits, rotation, trial])
                updates = client_updates(rng, args.clients, args.dim, args.clip)
                exact = np.mean([ddp.clip_l2(u, args.clip) for u in updates], axis=0)
                distributed.append(float(np.sqrt(np.mean((distributed_mean(updates, plan, rng) - exact) ** 2))))
                rounding.append(float(np.sqrt(np.mean((distributed_mean(updates, noiseless, rng) - exact) ** 2))))
                noisy = exact + rng.normal(scale=central_std, size=args.dim)
                central.append(float(np.sqrt(np.mean((noisy - exact) ** 2))))
            account = ddp.ClientLevelAccount()
            for _ in range(10):
                account.record(plan, 1.0)
            orders = [float(a) for a in ddp.ORDERS]
            gaussian = get_privacy_spent(orders=orders, delta=DELTA, rdp=compute_rdp(
                q=1.0, noise_multiplier=args.noise, steps=10, orders=orders))[0]
            ratio = [d / c for d, c in zip(distributed, central)]
            rows.append({
                "bits": bits, "rotation": rotation, "scale": plan.scale,
                "sensitivity_growth": plan.l2_sensitivity / (plan.scale * plan.clip_norm),
                "rms_error_distributed": harness.spread(distributed), "rms_error_central": harness.spread(central),
                "rms_error_rounding_only": harness.spread(rounding),
                "error_ratio": harness.spread(ratio), "epsilon_10_rounds_skellam": account.epsilon(DELTA),
                "epsilon_10_rounds_gaussian": float(gaussian),
            })
    return rows


# ----------------------------------------------------------------------------- 2. utility
def noise_for_epsilon(config: ClientLevelConfig, dim: int, sampled: int, rate: float, rounds: int,
                      target: float) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds of ``sampled`` clients at sampling
    rate ``rate`` stay within ``target``."""
    def epsilon(noise: float) -> float:
        plan = ddp.plan_round(ClientLevelConfig(**{**config.__dict__, "noise_multiplier": noise}), dim, sampled,
                              survivors(sampled))
        account = ddp.ClientLevelAccount([(plan.central_variance, plan.l1_sensitivity, plan.l2_sensitivity, rate,
                                           rounds)])
        return account.epsilon(DELTA)

    low, high = 0.05, 200.0
    for _ in range(40):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if epsilon(mid) > target else (low, mid)
    return high


def utility(args) -> dict:
    import random

    import torch
    from flwr.common import parameters_to_ndarrays

    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    torch.set_num_threads(1)
    eval_rows = harness.validation_problems(args.eval_size)
    sampled = max(int(args.clients * args.fraction_fit), SECAGG.num_shares)  # as the strategy samples
    data = {"train_size": args.train_size, "train_batch_size": args.train_batch_size, "val_size": 0}
    actor = {"ppo_mini_batch_size": args.train_batch_size}  # one minibatch a local iteration
    train_rows = [load_rows(engine_config(data=data, actor=actor).data, "train", args.seed, i, args.clients)
                  for i in range(args.clients)]  # the same prompts in every arm

    def run(client_level: dict | None) -> dict:
        privacy = {"enabled": False, "deterministic": True}
        if client_level:
            privacy.update({f"client_level.{k}": v for k, v in client_level.items()}, **{"client_level.enabled": True})
        config = engine_config(data=data, actor=actor, privacy=privacy,
                               trainer={"seed": args.seed, "local_iterations": args.local_iterations})
        models = build_models(config.model, config.needs_critic, seed=args.seed)
        clients = {str(i): VerlClient(config, rows, [], partition_id=i, models=models)
                   for i, rows in enumerate(train_rows)}
        federation = FederationConfig(fraction_fit=args.fraction_fit, min_fit_clients=sampled,
                                      min_available_clients=args.clients, num_server_rounds=args.rounds,
                                      proximal_mu=0.0, secagg=dataclasses.replace(SECAGG, enabled=bool(client_level)))
        strategy = FedProxAdapters(federation, models.adapters.get_arrays(), local_iterations=args.local_iterations,
                                   secure_aggregation=SecAggBounds(1.0, 4096.0) if client_level else None,
                                   client_level=config.privacy.client_level if client_level else None)
        manager = InProcessClients(clients, rng=random.Random(args.seed))  # the same samples in every arm

        def accuracy() -> float:
            models.adapters.set_arrays(strategy.global_arrays)
            return clients["0"].trainer.evaluate(eval_rows).accuracy

        curve, norms, start = [accuracy()], [], time.perf_counter()
        for server_round in range(1, args.rounds + 1):
            results, metrics = fit_round(strategy, manager, server_round, secure=bool(client_level))
            if server_round == 1 and not client_level:
                norms = [float(np.linalg.norm(np.concatenate([a.ravel() for a in parameters_to_ndarrays(r.parameters)])))
                         for _, r in results]
            curve.append(accuracy())
        return {"accuracy_per_round": curve, "round1_update_norms": norms,
                "epsilon_client_level": metrics.get("epsilon_client_level"), "seconds": time.perf_counter() - start}

    baseline = run(None)
    clip = float(np.median(baseline["round1_update_norms"]))
    dim = sum(a.size for a in build_models(engine_config().model, False, seed=args.seed).adapters.get_arrays())
    arms = {"no_client_level_dp": baseline}
    for target in args.epsilons:
        base = ClientLevelConfig(enabled=True, clip_norm=clip, bits=args.utility_bits)
        noise = noise_for_epsilon(base, dim, sampled, sampled / args.clients, args.rounds, target)
        arm = run({"clip_norm": clip, "noise_multiplier": noise, "bits": args.utility_bits})
        arms[f"epsilon_{target:g}"] = {**arm, "noise_multiplier": noise, "clip_norm": clip}
        print(f"  epsilon {target:g}: noise {noise:.3f}, spent {arm['epsilon_client_level']:.3f}, "
              f"accuracy {arm['accuracy_per_round'][0]:.3f} -> {arm['accuracy_per_round'][-1]:.3f}", flush=True)
    for noise in args.noises:  # the same pipeline at little noise: what the mechanism costs without the noise
        arm = run({"clip_norm": clip, "noise_multiplier": noise, "bits": args.utility_bits})
        arms[f"noise_{noise:g}"] = {**arm, "noise_multiplier": noise, "clip_norm": clip}
    return {"clients": args.clients, "sampled_per_round": sampled, "fewest_survivors": survivors(sampled),
            "rounds": args.rounds, "local_iterations": args.local_iterations, "train_size": args.train_size,
            "train_batch_size": args.train_batch_size, "fraction_fit": args.fraction_fit, "delta": DELTA,
            "eval_problems": len(eval_rows), "dim": dim, "arms": arms}


def argument_parser() -> argparse.ArgumentParser:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--dim", type=int, default=29696, help="parameters per update (default: a LoRA r=8 size)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--noise", type=float, default=1.0, help="noise multiplier for the discretisation part")
    parser.add_argument("--bits", type=int, nargs="+", default=[10, 12, 14, 16, 20, 24])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--utility", action="store_true", help="also measure held-out accuracy (minutes)")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 10.0])
    parser.add_argument("--noises", type=float, nargs="*", default=[0.01, 0.05],
                        help="also these fixed client-level noise multipliers (their epsilon is reported)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--local-iterations", type=int, default=4)
    parser.add_argument("--train-size", type=int, default=256, help="prompts per client")
    parser.add_argument("--train-batch-size", type=int, default=16, help="prompts per local iteration")
    parser.add_argument("--fraction-fit", type=float, default=1.0,
                        help="share of the clients sampled each round, uniformly at random (1: all)")
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--utility-bits", type=int, default=20)
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    return parser


def main() -> None:
    args = argument_parser().parse_args()

    payload: dict = {"command": harness.command_line(), "clients": args.clients, "dim": args.dim,
                     "fewest_survivors": survivors(args.clients), "clip_norm": args.clip,
                     "noise_multiplier": args.noise}
    payload["discretisation"] = discretisation(args)
    print(f"discretisation: {args.clients} clients, {args.dim} parameters, C={args.clip}, z={args.noise}, "
          f"{args.trials} trials (RMS error vs the exact clipped mean; median [min, max])")
    for row in payload["discretisation"]:
        if "refused" in row:
            print(f"  bits {row['bits']:>2} rotation {row['rotation']!s:<5} refused: {row['refused'][:110]}")
            continue
        d, c, r = row["rms_error_distributed"], row["rms_error_central"], row["error_ratio"]
        print(f"  bits {row['bits']:>2} rotation {row['rotation']!s:<5} distributed {d['median']:.4e} "
              f"central {c['median']:.4e} ratio {r['median']:.4f} [{r['min']:.4f}, {r['max']:.4f}] "
              f"rounding alone {row['rms_error_rounding_only']['median']:.2e}  "
              f"eps(10 rounds) skellam {row['epsilon_10_rounds_skellam']:.3f} "
              f"gaussian {row['epsilon_10_rounds_gaussian']:.3f}")
    if args.utility:
        print(f"utility: {args.clients} clients, {args.fraction_fit:g} of them a round, {args.rounds} rounds x "
              f"{args.local_iterations} local iterations of {args.train_batch_size} of {args.train_size} prompts")
        payload["utility"] = utility(args)
        for name, arm in payload["utility"]["arms"].items():
            spent = arm["epsilon_client_level"]
            print(f"  {name:<20} accuracy {arm['accuracy_per_round'][0]:.3f} -> {arm['accuracy_per_round'][-1]:.3f}"
                  + ("" if spent is None else f"  client-level epsilon {spent:.4g}"))
    harness.write_json(args.out / "client_level_dp.json", payload)


if __name__ == "__main__":
    main()
