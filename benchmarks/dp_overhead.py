"""Time and memory cost of DP-SGD for the local PPO update.

On the embedded model with the default engine config (privacy on, grpo, 32 prompts x 4
responses, one mini-batch), one batch is rolled out once; then the policy update on that
same batch is timed with and without DP, side by side, alternating the order every repeat:

* ``none``: the trainer's non-private update (global-norm clip, AdamW);
* ``hooks`` / ``functorch``: the trainer's DP update (Opacus per-row gradients pooled per
  prompt, per-prompt clipping, Gaussian noise, AdamW), attached with ``make_private`` exactly
  as ``LocalPPOTrainer.fit`` does. Attaching and detaching Opacus are outside the timed span:
  they happen once per fit, not once per update.

The figure is the median over repeats of (DP update time / non-DP update time) measured in the
same repeat. Peak memory is the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over one update, each variant in a fresh process (after a warm-up update,
median of 3, large blocks returned to the OS on free) so that RSS follows live memory.

    python benchmarks/dp_overhead.py [--repeats 20] [--out benchmarks/results/dp_overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("none", "hooks", "functorch")


def setup(seed: int = 0):
    """One trainer per variant on the default config (sharing one model), and one rolled-out batch
    of exactly train_batch_size prompts."""
    import dataclasses

    import torch

    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.data import task_rows
    from flwr_verl.trainer import LocalPPOTrainer

    config = engine_config(privacy={"deterministic": True})
    rows = task_rows(config.data.task, config.data.train_size, seed=seed, split="train")
    # Roll out with a non-private twin (its loader draws exactly train_batch_size prompts), keep
    # the batch its update would get, and the time the other phases of an iteration take.
    twin = LocalPPOTrainer(dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, enabled=False)),
                           rows)
    captured = {}

    def capture(fit, batch, num_units):
        captured.update(batch=batch, num_units=num_units)
        return {}

    twin._update = capture
    phases = ("time_rollout", "time_reward", "time_log_prob", "time_advantage")
    metrics = twin.fit(4, seed=seed).metrics[1:]  # the first iteration pays one-time costs
    other_phases = statistics.median(sum(m[k] for k in phases) for m in metrics)
    trainers = {"none": LocalPPOTrainer(twin.config, rows, models=twin.models)}
    for mode in VARIANTS[1:]:
        private = dataclasses.replace(config.privacy, grad_sample_mode=mode)
        trainers[mode] = LocalPPOTrainer(dataclasses.replace(config, privacy=private), rows, models=twin.models)
    params = trainers["none"].policy_params
    return {
        "trainers": trainers,
        "params": params,
        "snapshot": [p.detach().clone() for p in params],
        "mu": FederationConfig().proximal_mu,
        "batch": captured["batch"],
        "num_units": captured["num_units"],
        "other_phases_seconds": other_phases,
        "torch": torch,
    }


@contextlib.contextmanager
def started_fit(state: dict, variant: str):
    """The trainer of ``variant`` in the state its ``fit`` is in before the first update: the same
    weights every time, a fresh optimizer, FedProx anchored at those weights."""
    torch, params = state["torch"], state["params"]
    with torch.no_grad():
        for param, value in zip(params, state["snapshot"]):
            param.copy_(value)
            param.grad = None
    trainer = state["trainers"][variant]
    with trainer.start_fit(anchor=state["snapshot"], proximal_mu=state["mu"], seed=0) as fit:
        yield trainer, fit


def timed_update(state: dict, variant: str) -> float:
    with started_fit(state, variant) as (trainer, fit):
        start = time.perf_counter()
        trainer._update(fit, state["batch"], num_units=state["num_units"])
        return time.perf_counter() - start


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def memory_child(variant: str, repeats: int = 3) -> None:
    """In a fresh process: peak RSS rise over one update of ``variant`` (printed as JSON).

    One warm-up update first (lazy one-time allocations), then the median over ``repeats``
    updates of (VmHWM after the update - VmRSS before it), with VmHWM reset before each. The
    parent sets MALLOC_MMAP_THRESHOLD_ so that large blocks go back to the OS when freed and RSS
    follows live memory instead of glibc's cached heap.
    """
    import gc

    state = setup()
    rises = []
    for repeat in range(1 + repeats):
        with started_fit(state, variant) as (trainer, fit):
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            base = _kib("VmRSS")
            trainer._update(fit, state["batch"], num_units=state["num_units"])
            peak = _kib("VmHWM")
        if repeat:
            rises.append((peak - base) / 1024)
    print(json.dumps({"variant": variant, "peak_rise_mib": statistics.median(rises), "rises_mib": rises}))


def measure_memory(variants) -> dict:
    if not Path("/proc/self/clear_refs").exists():
        return {}
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = {}
    for variant in variants:
        proc = subprocess.run([sys.executable, __file__, "--memory-child", variant], capture_output=True, text=True,
                              env=env, check=True)
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["hooks", "functorch"], choices=["hooks", "functorch"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--out", type=Path, default=RESULTS / "dp_overhead.json")
    parser.add_argument("--memory-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return

    state = setup()
    trainer = state["trainers"]["none"]
    variants = ["none", *args.modes]
    times = {v: [] for v in variants}
    for repeat in range(args.warmup + args.repeats):
        shift = repeat % len(variants)  # rotate the order: no variant always runs first
        for variant in variants[shift:] + variants[:shift]:
            seconds = timed_update(state, variant)
            if repeat >= args.warmup:
                times[variant].append(seconds)

    result = {
        "setup": {
            "model": "embedded arithmetic Llama (LoRA rank %d)" % trainer.config.model.lora_rank,
            "trainable_params": sum(p.numel() for p in state["params"]),
            "prompts": state["num_units"], "responses_per_prompt": trainer.config.rollout.n,
            "rows": len(state["batch"]), "mini_batches": trainer.num_mini_batches,
            "ppo_epochs": trainer.config.actor.ppo_epochs,
            "sequence_length": int(state["batch"].batch["input_ids"].shape[1]),
            "noise_multiplier": trainer.config.privacy.noise_multiplier, "proximal_mu": state["mu"],
            "torch_threads": state["torch"].get_num_threads(), "repeats": args.repeats,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        },
        "update_seconds_median": {v: statistics.median(t) for v, t in times.items()},
        "ratio_median": {}, "ratio_quartiles": {},
    }
    for mode in args.modes:
        ratios = sorted(d / n for d, n in zip(times[mode], times["none"]))
        result["ratio_median"][mode] = statistics.median(ratios)
        result["ratio_quartiles"][mode] = [ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]]
    # The rest of an RL iteration (rollout, reward, log-probs, advantages) is the same with and
    # without DP: the DP cost of a whole iteration, for context.
    rest = state["other_phases_seconds"]
    result["other_phases_seconds_median"] = rest
    result["iteration_ratio_median"] = {
        mode: (rest + result["update_seconds_median"][mode]) / (rest + result["update_seconds_median"]["none"])
        for mode in args.modes
    }
    if not args.no_memory:
        result["peak_memory"] = measure_memory(variants)

    print(f"update on {result['setup']['prompts']} prompts x {result['setup']['responses_per_prompt']} responses, "
          f"{result['setup']['trainable_params']} LoRA parameters, median of {args.repeats} repeats:")
    for variant in variants:
        line = f"  {variant:10s} {1000 * result['update_seconds_median'][variant]:8.1f} ms"
        if variant != "none":
            q1, q3 = result["ratio_quartiles"][variant]
            line += f"   DP/non-DP {result['ratio_median'][variant]:.2f}x (IQR {q1:.2f}-{q3:.2f})"
        if "peak_memory" in result and variant in result["peak_memory"]:
            line += f"   peak RSS rise {result['peak_memory'][variant]['peak_rise_mib']:.1f} MiB"
        print(line)
    print(f"  rest of an iteration (rollout, reward, log-probs, advantages): {1000 * rest:.1f} ms; whole iteration "
          + ", ".join(f"{mode} {result['iteration_ratio_median'][mode]:.2f}x" for mode in args.modes))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
