"""Choosing the embedded model's recipe: for each candidate build, the default job emulated in
process on it, and the rise of its held-out accuracy on the tune split.

Goal: no target set (it chooses the recipe: the warm start's length and ``actor.lr`` were chosen
with it, never on the validation problems).

    python benchmarks/embedded_recipe.py --steps 200,235 --build-seeds 1234 --lrs 3e-3,6e-3 --ns 4,8 --seeds 0,1,2
    python benchmarks/embedded_recipe.py --lrs 1e-2,2e-2 --batches 256 --local-iterations 3
    python benchmarks/embedded_recipe.py --lrs 1e-2 --batches 256 --local-iterations 3 --temperatures 0.5,1.0
    python benchmarks/embedded_recipe.py --lrs 1e-2 --batches 256 --local-iterations 3 --lora-ranks 2,4,8 --freeze-a 0,1

The default job (``pyproject.toml``): 3 clients x 2048 prompts, 8 rounds of DP-GRPO, FedProx mu
0.01; each arm sets the batch (``--batches``: ``data.train_batch_size``, one update an iteration),
the local iterations a round (``--local-iterations``), ``actor.lr`` (``--lrs``), ``rollout.n``
(``--ns``), ``rollout.temperature`` (``--temperatures``), ``model.lora_rank`` (``--lora-ranks``) and
``model.lora_freeze_a`` (``--freeze-a``: FFA-LoRA, half the trained parameters, so each gets less
of DP's noise), and gets the noise multiplier that
spends ``--epsilon`` (7.21 at delta 1e-5, the default job's) over its 8 rounds.
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

from flwr_verl.config import ModelConfig, RolloutConfig  # the defaults of the axes below

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


def job_args(model_path: Path, lr: float, n: int, batch: int, local_iterations: int,
             temperature: float, lora_rank: int, freeze_a: bool) -> argparse.Namespace:
    return argparse.Namespace(model_path=str(model_path), rollout_n=n, temperature=temperature, lora_rank=lora_rank,
                              lora_freeze_a=freeze_a, train_size=2048,
                              train_batch_size=batch, mini_batch_size=batch, lr=lr, ppo_epochs=1,
                              max_grad_norm=1.0, baseline_lr=0, local_iterations=local_iterations,
                              iterations=ROUNDS * local_iterations, clients=3, proximal_mu=0.01)


def _one(name: str, job: argparse.Namespace, epsilon: float, seed: int) -> dict:
    import torch

    torch.set_num_threads(1)
    result = run(job, epsilon, seed, harness.validation_problems(0, "tune"))
    return {"candidate": name, "lr": job.lr, "n": job.rollout_n, "batch": job.train_batch_size,
            "local_iterations": job.local_iterations, "temperature": job.temperature, "lora_rank": job.lora_rank,
            "freeze_a": job.lora_freeze_a, **result}


def lora(result: dict) -> str:
    return f"r {result['lora_rank']}" + (" FFA" if result["freeze_a"] else "")


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--steps", default="235", help="comma-separated warm-start step counts")
    parser.add_argument("--build-seeds", default="1234", help="comma-separated recipe seeds")
    parser.add_argument("--warm-start-lr", type=float, default=0.0, help="0: the recipe's")
    parser.add_argument("--lrs", default="3e-3", help="comma-separated actor.lr values of the job")
    parser.add_argument("--ns", default="4", help="comma-separated rollout.n values of the job")
    parser.add_argument("--batches", default="64", help="comma-separated data.train_batch_size values (one update each)")
    parser.add_argument("--local-iterations", default="10", help="comma-separated trainer.local_iterations values")
    parser.add_argument("--temperatures", default=f"{RolloutConfig.temperature:g}",
                        help="comma-separated rollout.temperature values")
    parser.add_argument("--lora-ranks", default=str(ModelConfig.lora_rank), help="comma-separated model.lora_rank values")
    parser.add_argument("--freeze-a", default=str(int(ModelConfig.lora_freeze_a)),
                        help="comma-separated model.lora_freeze_a values (0 or 1)")
    parser.add_argument("--epsilon", type=float, default=7.21,
                        help="every arm's epsilon at delta 1e-5 (the noise follows); 7.21 is the default job's")
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
            for lr in (float(x) for x in args.lrs.split(",")):
                for n, batch, local, temperature, rank, freeze_a in itertools.product(
                        *(map(int, values.split(",")) for values in (args.ns, args.batches, args.local_iterations)),
                        map(float, args.temperatures.split(",")), map(int, args.lora_ranks.split(",")),
                        (bool(int(x)) for x in args.freeze_a.split(","))):
                    job = job_args(path, lr, n, batch, local, temperature, rank, freeze_a)
                    tasks += [(path.name, job, args.epsilon, int(seed)) for seed in args.seeds.split(",")]
    started = time.perf_counter()
    runs = []
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for future in as_completed([pool.submit(_one, *task) for task in tasks]):
            r = future.result()
            runs.append(r)
            print(f"{r['candidate']} lr {r['lr']:g} n {r['n']} T {r['temperature']:g} {lora(r)} batch {r['batch']} x "
                  f"{r['local_iterations']} (sigma {r['noise_multiplier']:.3f}) seed {r['seed']}: tune {r['initial_reward']:.3f} -> "
                  f"{r['final_reward']:.3f} ({r['final_reward'] - r['initial_reward']:+.3f}), epsilon "
                  f"{r['epsilon_spent']:.2f} [{r['seconds']:.0f} s]", flush=True)
    print("candidate | actor.lr | rollout.n | rollout.temperature | LoRA | batch x local iterations | round 0 | "
          "last round, median (range) | rise, median (range)")
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["candidate"], r["lr"], r["n"], r["temperature"], lora(r), r["batch"],
                           r["local_iterations"]), []).append(r)
    for (name, lr, n, temperature, shape, batch, local), items in sorted(groups.items()):
        finals = harness.spread([r["final_reward"] for r in items])
        rises = harness.spread([r["final_reward"] - r["initial_reward"] for r in items])
        print(f"{name} | {lr:g} | {n} | {temperature:g} | {shape} | {batch} x {local} | {items[0]['initial_reward']:.3f} | {harness.format_spread(finals)} | "
              f"{harness.format_spread(rises, '+.3f')}")
    previous = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    harness.write_json(args.out, {"runs": previous + runs, "seconds": time.perf_counter() - started})


if __name__ == "__main__":
    main()
