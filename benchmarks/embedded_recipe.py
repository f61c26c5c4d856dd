"""Choosing the embedded model's recipe: for each candidate build, the default job emulated in
process on it, and the rise of its held-out accuracy on the tune split.

Goal: no target set (it chooses the recipe: the warm start's length and ``actor.lr`` were chosen
with it, never on the validation problems).

    python benchmarks/embedded_recipe.py --steps 200,235 --build-seeds 1234 --lrs 3e-3,6e-3 --ns 4,8 --seeds 0,1,2
    python benchmarks/embedded_recipe.py --lrs 1e-2,2e-2 --batches 256 --local-iterations 3
    python benchmarks/embedded_recipe.py --lrs 1e-2 --batches 256 --local-iterations 3 --temperatures 0.5,1.0
    python benchmarks/embedded_recipe.py --lrs 1e-2 --batches 256 --local-iterations 3 --lora-ranks 2,4,8 --freeze-a 0,1
    python benchmarks/embedded_recipe.py --servers sgd,momentum:0.5:1 --clip-norms 0.3,1,2
    python benchmarks/embedded_recipe.py --target-modules all-linear,q_proj+v_proj
    python benchmarks/embedded_recipe.py --estimators rloo,remax
    python benchmarks/embedded_recipe.py --batches 384,512 --lrs 1e-2,1.5e-2
    python benchmarks/embedded_recipe.py --no-dp --lrs 1e-3,3e-3,5e-3,1e-2,2e-2

Every axis defaults to the default job's value (``flwr_verl.config``), so the last five commands
vary only what they name.

The default job (``pyproject.toml``): 3 clients x 2048 prompts, 8 rounds of DP-GRPO, FedProx mu
0.01; each arm is one value of every axis in ``AXES`` (the batch, local iterations, ``actor.lr``,
``rollout.n`` and temperature, the LoRA shape and targets, FFA-LoRA, the clipping bound, the
advantage estimator and its scaling, the loss aggregation, the server optimizer; ``--help``
lists them), and gets the noise multiplier that spends ``--epsilon``
(7.21 at delta 1e-5, the default job's) over its 8 rounds.
``benchmarks/dp_utility.run`` emulates it (no Flower transport; SecAgg+ changes the sum by less
than 1e-4); every seed draws other DP noise and batches, as a fresh run of the real job does.
The accuracy is greedy exact match on every tune problem.

On 2026-12-05 (tune split, 3 seeds each, version 3's build): batch 64 x 10 at lr 6e-3 with n 8
+0.173, at 9e-3 +0.177; batch 128 x 5 at 6e-3 +0.193, at 1.2e-2 +0.165; batch 256 x 5 at 6e-3
+0.202, at 1.2e-2 +0.198; batch 256 x 3 at 1e-2 **+0.206** (+0.198 to +0.218), at 2e-2 +0.169.
At one epsilon a larger batch buys more signal than noise (sigma 0.65 at 64 x 80 iterations, 0.863
at 256 x 24: signal / noise 98 -> 297 prompts per unit of noise), so the default job is now 256 x 3
at 1e-2, for 1.2x the rollouts.

On 2026-12-06 (tune split, batch 256 x 3, n 4 unless said; seeds 0-2, five where said), rollout
temperature and lr: at 1e-2, T 1.0 +0.181 (+0.165 to +0.185), 0.8 +0.185, 0.7 +0.210, 0.6 +0.210,
0.5 +0.218; n 8 at 1e-2: T 0.7 +0.206, 1.0 +0.202, 1.3 +0.198 (2x the compute); T 0.7 at 7e-3
+0.181, 1.5e-2 +0.226, 2e-2 +0.218; T 0.5 at 1.5e-2 +0.198 (five seeds, +0.173 to +0.251), 2e-2
**+0.226** (five seeds, +0.206 to +0.255), 3e-2 diverged (-0.181 to +0.107); T 0.35 at 2e-2
+0.235. The best arm, T 0.5 at 2e-2, was then run as the real default job on a fresh clone
(cabbbca, ``default_job.py --runs 3``): validation rise +0.136 (+0.120 to +0.240), no better than
the shipped recipe's +0.188 (+0.146 to +0.193; 6bdae50, the same machine and day), its last
rounds swinging by up to 0.08 between rounds (the larger step under the same noise). Not adopted:
the default job stays at T 1.0 and 1e-2.

On 2026-12-06 (later; tune split, the same job, seeds 0-2), the LoRA shape: at lr 1e-2, rank 2 +0.177
(+0.169 to +0.181), 4 +0.169 (+0.152 to +0.193), 8 +0.185 (+0.165 to +0.189); FFA-LoRA (rank 8,
A frozen) +0.160 at 1e-2 and +0.198 (+0.173 to +0.214) at 2e-2. Nothing to adopt. (``model.lora_alpha``
stays 16, so a smaller rank also scales its update up, alpha / r: 8 at rank 2, 2 at rank 8.)

On 2026-12-07 (tune split, the same job, seeds 0-2), the noise that Opacus's PRV accountant would
spend epsilon 7.21 with: sigma 0.803 against RDP's 0.863 (``--epsilon 8.324`` gives RDP that
sigma): +0.185 (+0.165 to +0.198) against +0.185 (+0.165 to +0.189), side by side. No gain.

On 2026-12-07 (later; tune split, the same job at lr 1e-2, seeds 0-2): the server optimizer, FedAvg
(shipped) +0.185 (+0.165 to +0.189), FedAvgM at server lr 1 with momentum 0.3 +0.181 and 0.5 +0.185
(+0.181 to +0.206), plain server lr 1.5 +0.082; the clipping bound ``privacy.max_grad_norm`` 0.03
+0.152, 0.1 +0.173, 0.3 +0.169, 1 (shipped) +0.185, 2 +0.173, 4 +0.132; the LoRA targets q_proj+v_proj
+0.123, the attention projections +0.152, the MLP +0.123, all-linear (shipped) +0.185. In a
throwaway variant of ``dp_utility.run`` (not kept), ``actor.lr`` falling round by round: linear
2e-2 -> 5e-3 +0.198, 2e-2 -> 2e-3 +0.198, 3e-2 -> 5e-3 +0.193, 1.5e-2 -> 5e-3 +0.189, 2e-2 for
rounds 1-4 then 1e-2 +0.206, cosine from 1.5e-2 +0.173; and evaluating an average of the global
adapters (an EMA at 0.5 or 0.7, or the mean of the last three) in place of the last: no higher
(at lr 1e-2, last 0.551 / 0.560 / 0.531, EMA 0.5 0.547 / 0.547 / 0.531). The same 24 DP steps
(so the same noise) in other shapes: 12 rounds x 2 local iterations +0.165, 24 x 1 +0.132, 6 x 4
+0.177, against 8 x 3 +0.185; each client's AdamW state kept from round to round (each fit starts
a fresh one): 8 x 3 +0.185, 24 x 1 +0.189. So a fresh AdamW costs short local runs (its first
steps move every coordinate by about lr), but not the shipped 3 iterations. Nothing to adopt: each
within the spread of seeds, and a tune arm +0.04 above the shipped one has already failed on
validation (above).

On 2026-12-07 (later; tune split, the same job, seeds 0-2, this checkout), the RL objective:
``--estimators rloo,remax`` +0.181 (+0.169 to +0.185) each (other curves, the same last rounds);
``--std-norms 0`` (Dr. GRPO: the group's mean subtracted, not divided by its standard deviation)
+0.160 (+0.160 to +0.165); ``--loss-agg-modes seq-mean-token-sum,seq-mean-token-sum-norm``
+0.173 (+0.173 to +0.189) and +0.169 (+0.165 to +0.173); against GRPO with
``seq-mean-token-mean`` (shipped) +0.185 (+0.165 to +0.189). Nothing to adopt.

On 2026-12-07 (later; tune split, the same job), a larger batch at the same epsilon: at lr 1e-2,
384 (sigma 1.036) +0.210 (+0.177 to +0.226, seeds 0-4) against 256 (shipped) +0.185 (+0.165 to
+0.189, seeds 0-4), 512 (sigma 1.209) +0.210 (+0.189 to +0.239, seeds 0-2); at 1.5e-2, 384 +0.185
and 512 +0.202. Batch 384 at 1e-2 then rose +0.162 on validation as the real default job (ten
runs) beside +0.156 for the shipped 256 (``default_job.py --set``; docs/benchmarks.md):
within the spread, not adopted. Without DP (``--no-dp``: neither clipping nor noise; seeds 0-2):
lr 1e-3 +0.160, 3e-3 +0.210 (+0.193 to +0.235), 5e-3 +0.210, 1e-2 +0.070, 2e-2 diverged; so the
job's non-private anchor runs at 3e-3, and DP at epsilon 7.21 keeps 88% of its rise here.

Each candidate varies the recipe (``embedded.RECIPE``) by ``--steps`` (warm-start steps) and
``--build-seeds`` (the recipe's seed: weight init and warm-start batches), built with
``embedded.build_embedded_model`` (its own process, portable kernels) into ``--builds``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import harness
from dp_utility import run

from flwr_verl.config import (  # the defaults of the axes below: the default job's
    DP_ESTIMATORS,
    PER_SEQUENCE_AGG_MODES,
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    FederationConfig,
    ModelConfig,
    PrivacyConfig,
    RolloutConfig,
    TrainerConfig,
)

harness.quiet()

ROUNDS = 8  # the default job's num-server-rounds


def candidate_dir(builds: Path, recipe: dict) -> Path:
    import hashlib

    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return builds / f"steps{recipe['warm_start_steps']}-seed{recipe['seed']}-lr{recipe['warm_start_lr']:g}-{digest}"


def build(builds: Path, recipe: dict) -> Path:
    from flwr_verl import embedded

    out = candidate_dir(builds, recipe)
    if not (out / "model.safetensors").exists():
        staging = out.with_name(out.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        embedded.build_embedded_model(staging, recipe)
        staging.rename(out)
    return out


def server_arm(spec: str) -> dict:
    """``OPTIMIZER[:MOMENTUM[:LR]]`` (``--servers``) as ``FederationConfig`` keys; an absent part is
    the config's default."""
    optimizer, momentum, lr = (spec.split(":") + [None, None])[:3]
    return {"server_optimizer": optimizer, "server_momentum": None if momentum is None else float(momentum),
            "server_learning_rate": None if lr is None else float(lr)}


def boolean(text: str) -> bool:
    return bool(int(text))


# Each arm is one value of every axis: (flag, the job's attribute, parser, default, what it sets).
AXES = [
    ("--lrs", "lr", float, f"{ActorConfig.lr:g}", "actor.lr"),
    ("--ns", "rollout_n", int, str(RolloutConfig.n), "rollout.n"),
    ("--batches", "train_batch_size", int, str(DataConfig.train_batch_size),
     "data.train_batch_size (one update an iteration)"),
    ("--local-iterations", "local_iterations", int, str(TrainerConfig.local_iterations), "trainer.local_iterations"),
    ("--temperatures", "temperature", float, f"{RolloutConfig.temperature:g}", "rollout.temperature"),
    ("--lora-ranks", "lora_rank", int, str(ModelConfig.lora_rank), "model.lora_rank"),
    ("--freeze-a", "lora_freeze_a", boolean, str(int(ModelConfig.lora_freeze_a)), "model.lora_freeze_a (0 or 1)"),
    ("--target-modules", "target_modules", lambda text: text.replace("+", ","), ModelConfig.target_modules,
     "model.target_modules ('+' between a value's module names, e.g. q_proj+v_proj)"),
    ("--clip-norms", "max_grad_norm", float, f"{PrivacyConfig.max_grad_norm:g}",
     "privacy.max_grad_norm (the per-prompt clipping bound)"),
    ("--estimators", "adv_estimator", str, AlgorithmConfig.adv_estimator,
     f"algorithm.adv_estimator (those allowed under DP: {', '.join(DP_ESTIMATORS)})"),
    ("--std-norms", "norm_adv_by_std", boolean, str(int(AlgorithmConfig.norm_adv_by_std_in_grpo)),
     "algorithm.norm_adv_by_std_in_grpo (0 or 1; 0 is Dr. GRPO's unscaled advantage)"),
    ("--loss-agg-modes", "loss_agg_mode", str, ActorConfig.loss_agg_mode,
     f"actor.loss_agg_mode (those allowed under DP: {', '.join(PER_SEQUENCE_AGG_MODES)})"),
    ("--servers", "server", str, FederationConfig.server_optimizer,
     "server-optimizer[:server-momentum[:server-learning-rate]] (sgd, momentum, adam; e.g. momentum:0.5:1)"),
]


def job_args(model_path: Path, arm: dict) -> argparse.Namespace:
    """The default job (module docstring) with ``arm``'s values."""
    arm = dict(arm)
    return argparse.Namespace(**server_arm(arm.pop("server")), **arm, model_path=str(model_path), train_size=2048,
                              mini_batch_size=arm["train_batch_size"], ppo_epochs=1, baseline_lr=0,
                              iterations=ROUNDS * arm["local_iterations"], clients=3, proximal_mu=0.01)


def label(arm: dict) -> str:
    """The arm's values, e.g. ``lr 0.01 rollout_n 4 ... server sgd``."""
    return " ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}" for name, value in arm.items())


def _one(name: str, arm: dict, job: argparse.Namespace, epsilon: float | None, seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    result = run(job, epsilon, seed, harness.validation_problems(0, "tune"))
    return {"candidate": name, "arm": arm, **result}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--steps", default="235", help="comma-separated warm-start step counts")
    parser.add_argument("--build-seeds", default="1234", help="comma-separated recipe seeds")
    parser.add_argument("--warm-start-lr", type=float, default=0.0, help="0: the recipe's")
    for flag, _, _, default, sets in AXES:
        parser.add_argument(flag, default=default, help=f"comma-separated values of {sets} (default {default})")
    parser.add_argument("--epsilon", type=float, default=7.21,
                        help="every arm's epsilon at delta 1e-5 (the noise follows); 7.21 is the default job's")
    parser.add_argument("--no-dp", action="store_true",
                        help="train every arm without DP (no clipping, no noise): the non-private anchor of its rise")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated job seeds (other DP noise and batches each)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--builds", type=Path, default=harness.RESULTS / "embedded_recipes")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "embedded_recipe.json")
    args = parser.parse_args()

    from flwr_verl import embedded

    tasks = []
    for steps in (int(s) for s in args.steps.split(",")):
        for build_seed in (int(s) for s in args.build_seeds.split(",")):
            recipe = {**embedded.RECIPE, "warm_start_steps": steps, "seed": build_seed}
            if args.warm_start_lr:
                recipe["warm_start_lr"] = args.warm_start_lr
            path = build(args.builds, recipe)
            values = [[parse(x) for x in getattr(args, flag[2:].replace("-", "_")).split(",")]
                      for flag, _, parse, _, _ in AXES]
            for arm in itertools.product(*values):
                arm = {attribute: value for (_, attribute, *_), value in zip(AXES, arm)}
                tasks += [(path.name, arm, job_args(path, arm), None if args.no_dp else args.epsilon,
                           int(seed))
                          for seed in args.seeds.split(",")]
    started = time.perf_counter()
    runs = []
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(_one, *task) for task in tasks]):
            r = future.result()
            runs.append(r)
            privacy = "no DP" if r["epsilon_spent"] is None else f"epsilon {r['epsilon_spent']:.2f}"
            print(f"{r['candidate']} {label(r['arm'])} (sigma {r['noise_multiplier']:.3f}) seed {r['seed']}: tune "
                  f"{r['initial_reward']:.3f} -> {r['final_reward']:.3f} ({r['final_reward'] - r['initial_reward']:+.3f}), "
                  f"{privacy} [{r['seconds']:.0f} s]", flush=True)
    print("candidate | arm | round 0 | last round, median (range) | rise, median (range)")
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["candidate"], json.dumps(r["arm"])), []).append(r)
    for (name, arm), items in sorted(groups.items()):
        finals = harness.spread([r["final_reward"] for r in items])
        rises = harness.spread([r["final_reward"] - r["initial_reward"] for r in items])
        print(f"{name} | {label(json.loads(arm))} | {items[0]['initial_reward']:.3f} | {harness.format_spread(finals)} | "
              f"{harness.format_spread(rises, '+.3f')}")
    previous = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    harness.write_json(args.out, {"runs": previous + runs, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
