"""Does the one-run privacy audit (``flwr_verl.privacy.audit``) have power? The epsilon lower
bound it finds in five settings, on the same canaries.

Goal: a bound of at least 1 with DP off; above the claim of each broken mechanism; never above
the claim with DP.

    nice -n 5 python benchmarks/audit_power.py [--seeds 3] [--out benchmarks/results/audit_power.json]

* ``no_dp``: privacy off. An audit with power bounds epsilon clearly above 0 here (at least 1).
* ``broken``: a deliberately broken DP mechanism: the DP optimizer clips at 1e6 and adds no
  noise, while the accountant still records the noise multiplier of ``privacy.target_epsilon
  = --broken-epsilon``. An audit with power bounds epsilon above that claim.
* ``unpooled``: another broken mechanism: no per-prompt pooling, so Opacus clips each of a
  prompt's ``rollout.n`` response gradients on its own (a prompt weighs up to n times the clipping
  norm), while the noise is calibrated for ``privacy.target_epsilon = --unpooled-epsilon``.
* ``dp``: DP-SGD at ``privacy.target_epsilon = --epsilon``, and ``dp_small`` at
  ``--small-epsilon``: the bound must never exceed the claim. r guesses can bound epsilon at
  logit(0.05^(1/r)) at most (3.04 at r = 64), so only a claim below that can be refuted.

The configuration is the small one of ``tests/privacy/test_audit.py``: two clients of 16 task prompts,
8 responses per prompt, ``--rounds`` rounds of ``--local-iterations`` iterations; m =
``--canaries`` of ``--kind`` (gradient: in client 0's update; prompt: in its prompts), r =
``--guesses``. Medians and ranges are over ``--seeds`` (the audit's seed: which canaries, which
members).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
import warnings
from pathlib import Path

import harness

warnings.filterwarnings("ignore")

# The small configuration (tests/privacy/test_audit.py uses the same, with fewer iterations and canaries).
SMALL = {
    "data": {"train_size": 16, "val_size": 8, "train_batch_size": 16},
    "rollout": {"n": 8, "response_length": 3},
    "actor": {"ppo_mini_batch_size": 16},
}


def audit_small(privacy: dict, *, local_iterations: int, rounds: int, canaries: int, guesses: int, seed: int,
                kind: str = "gradient"):
    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.tools.audit import AuditConfig, run_audit

    engine = engine_config(privacy=privacy, trainer={"local_iterations": local_iterations}, **SMALL)
    federation = dataclasses.replace(FederationConfig(), num_server_rounds=rounds)
    audit = AuditConfig(canaries=canaries, guesses=guesses, seed=seed, kind=kind)
    return run_audit(engine, federation, audit, num_clients=2, log=lambda line: None)


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="audit seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--kind", default="gradient", choices=("gradient", "prompt"))
    parser.add_argument("--canaries", type=int, default=256)
    parser.add_argument("--guesses", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-iterations", type=int, default=10)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--small-epsilon", type=float, default=1.0)
    parser.add_argument("--broken-epsilon", type=float, default=0.5)
    parser.add_argument("--unpooled-epsilon", type=float, default=1.0)
    parser.add_argument("--settings", default="no_dp,broken,unpooled,dp,dp_small", help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "audit_power.json")
    args = parser.parse_args()
    import torch

    from flwr_verl.tools.audit import broken_mechanism

    torch.set_num_threads(1)
    settings = {
        "no_dp": ({"enabled": False}, contextlib.nullcontext),
        "broken": ({"enabled": True, "target_epsilon": args.broken_epsilon, "deterministic": True},
                   broken_mechanism),
        "unpooled": ({"enabled": True, "target_epsilon": args.unpooled_epsilon, "deterministic": True},
                     functools.partial(broken_mechanism, "unpooled")),
        "dp": ({"enabled": True, "target_epsilon": args.epsilon, "deterministic": True}, contextlib.nullcontext),
        "dp_small": ({"enabled": True, "target_epsilon": args.small_epsilon, "deterministic": True},
                     contextlib.nullcontext),
    }
    started = time.perf_counter()
    results: dict[str, list[dict]] = {}
    for name in args.settings.split(","):
        privacy, context = settings[name]
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            with context():
                result = audit_small(privacy, local_iterations=args.local_iterations, rounds=args.rounds,
                                     canaries=args.canaries, guesses=args.guesses, seed=seed, kind=args.kind)
            results.setdefault(name, []).append(result.to_json()["audit"])
            print(f"{name:8s} seed {seed}: {result.correct}/{result.guesses} correct, epsilon >= "
                  f"{result.epsilon_lower_bound:.3f}, claimed {result.epsilon_claimed:.3g}, {result.seconds:.0f} s",
                  flush=True)
    summary = {}
    for name, runs in results.items():
        bounds = [r["epsilon_lower_bound"] for r in runs]
        correct = [r["correct"] for r in runs]
        claimed = [float(r["epsilon_claimed"]) for r in runs]
        summary[name] = {**harness.median_range("bound", bounds), **harness.median_range("correct", correct),
                         "guesses": args.guesses, "claimed_max": "inf" if math.isinf(max(claimed)) else max(claimed),
                         "bound_exceeds_claim": sum(b > c for b, c in zip(bounds, claimed)),
                         "seconds_median": statistics.median(r["seconds"] for r in runs)}
        s = summary[name]
        print(f"{name:8s} bound median {s['bound_median']:.3f} (range {s['bound_range'][0]:.3f}-"
              f"{s['bound_range'][1]:.3f}), correct {s['correct_median']}/{args.guesses} (range "
              f"{s['correct_range'][0]}-{s['correct_range'][1]}), claimed <= {s['claimed_max']}, bound > claim in "
              f"{s['bound_exceeds_claim']}/{len(runs)} runs, {s['seconds_median']:.0f} s a run")
    peak_mib = harness.peak_rss_mib()
    print(f"peak RSS {peak_mib:.0f} MiB, {time.perf_counter() - started:.0f} s")
    harness.write_json(args.out, {"command": harness.command_line(), "config": vars(args), "summary": summary,
                                  "runs": results, "peak_rss_mib": peak_mib})


if __name__ == "__main__":
    main()
