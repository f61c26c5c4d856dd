"""Time and memory cost of DP-SGD for the local PPO update: DP time over non-DP time, for the
update alone and for the whole iteration, and the peak RSS rise over an update.

Goal: at most 1.15x for the update and 1.05x for the whole iteration.

    python benchmarks/dp_overhead.py [--repeats 200] [--clock cpu] [--out benchmarks/results/dp_overhead.json]

On the embedded model with the default engine config (privacy on, grpo, 32 prompts x 4
responses, one mini-batch), one batch is rolled out once; then the policy update on that
same batch is timed with and without DP, side by side, alternating the order every repeat:

* ``none``: the trainer's non-private update (global-norm clip, AdamW);
* ``hooks`` / ``functorch``: the trainer's DP update (per-prompt gradients,
  ``per_sample.PerSampleGradients``, per-prompt clipping, Gaussian noise, AdamW), attached with ``make_private`` exactly
  as ``LocalPPOTrainer.fit`` does. Attaching and detaching Opacus are outside the timed span:
  they happen once per fit, not once per update.

The whole iteration (rollout, reward, log-probs, advantages, update) is timed the same way, each
variant on the same prompts (the first ``train_batch_size``, instead of its own draw) and the
same rollout seed, so a DP iteration also pays whatever Opacus costs outside the update (its
hooks on generation and no-grad passes, if any).

The figures are medians over repeats of (DP time / non-DP time) measured in the same repeat,
with their interquartile range and full range. ``--clock cpu`` times with the thread's CPU time
(``time.thread_time``) instead of wall time: on a machine shared with other jobs it leaves out
the time the benchmark waits for a core. Peak memory is the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs) over one update, each variant in a fresh process (after a warm-up update,
median of 3, large blocks returned to the OS on free) so that RSS follows live memory.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import re
import statistics
import sys
import warnings
from pathlib import Path

import harness

warnings.filterwarnings("ignore")

VARIANTS = ("none", "hooks", "functorch")


def setup(seed: int = 0):
    """One trainer per variant on the default config (sharing one model), one rolled-out batch of
    exactly train_batch_size prompts, and the prompts every variant's timed iteration draws."""
    import dataclasses

    import torch

    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.engine.data import task_rows
    from flwr_verl.engine.trainer import LocalPPOTrainer

    config = engine_config(privacy={"deterministic": True})
    rows = task_rows(config.data.task, config.data.train_size, seed=seed, split="train")
    # Roll out with a non-private twin (its loader draws exactly train_batch_size prompts) and keep
    # the batch its update would get.
    twin = LocalPPOTrainer(dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, enabled=False)),
                           rows)
    captured = {}

    def capture(fit, batch, num_units):
        captured.update(batch=batch, num_units=num_units)
        return {}

    twin._update = capture
    twin.fit(1, seed=seed)
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
        "prompts": list(range(config.data.train_batch_size)),
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


def timed_update(state: dict, variant: str, clock) -> float:
    with started_fit(state, variant) as (trainer, fit):
        start = clock()
        trainer._update(fit, state["batch"], num_units=state["num_units"])
        return clock() - start


def timed_iteration(state: dict, variant: str, seed: int, clock) -> float:
    """One whole iteration of a started fit of ``variant`` on ``state["prompts"]``, rollout seeded."""
    with started_fit(state, variant) as (trainer, fit):
        fit.batches = itertools.repeat(state["prompts"])
        state["torch"].manual_seed(seed)
        start = clock()
        trainer.iteration(fit)
        return clock() - start


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def memory_child(variant: str, repeats: int = 3) -> None:
    """In a fresh process: peak RSS rise over one update of ``variant`` (``harness.print_result``).

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
    harness.print_result({"variant": variant, "peak_rise_mib": statistics.median(rises), "rises_mib": rises})


def measure_memory(variants) -> dict:
    if not Path("/proc/self/clear_refs").exists():
        return {}
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MALLOC_MMAP_THRESHOLD_": "65536"}
    return {variant: harness.child_result([sys.executable, __file__, "--memory-child", variant], env=env)
            for variant in variants}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=200,
                        help="paired repeats (the ratios' IQR is about 0.1 wide: 30 cannot resolve a 5%% goal)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["hooks", "functorch"], choices=["hooks", "functorch"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--clock", choices=tuple(harness.CLOCKS), default="wall")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "dp_overhead.json")
    parser.add_argument("--memory-child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child)
        return
    clock = harness.CLOCKS[args.clock]
    state = setup()
    trainer = state["trainers"]["none"]
    variants = ["none", *args.modes]

    def update_and_iteration(variant: str):
        return lambda repeat: (timed_update(state, variant, clock), timed_iteration(state, variant, repeat, clock))

    measured = harness.interleaved({v: update_and_iteration(v) for v in variants}, args.repeats, args.warmup)
    times = {v: [update for update, _ in pairs] for v, pairs in measured.items()}
    iteration_times = {v: [iteration for _, iteration in pairs] for v, pairs in measured.items()}

    result = {
        "setup": {
            "model": "embedded arithmetic Llama (LoRA rank %d)" % trainer.config.model.lora_rank,
            "trainable_params": sum(p.numel() for p in state["params"]),
            "prompts": state["num_units"], "responses_per_prompt": trainer.config.rollout.n,
            "rows": len(state["batch"]), "mini_batches": trainer.num_mini_batches,
            "ppo_epochs": trainer.config.actor.ppo_epochs,
            "sequence_length": int(state["batch"].batch["input_ids"].shape[1]),
            "noise_multiplier": trainer.config.privacy.noise_multiplier, "proximal_mu": state["mu"],
            "torch_threads": state["torch"].get_num_threads(), "repeats": args.repeats, "clock": args.clock,
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "update_seconds_median": {v: statistics.median(t) for v, t in times.items()},
        "iteration_seconds_median": {v: statistics.median(t) for v, t in iteration_times.items()},
        "update_ratio": {mode: harness.paired_ratios(times[mode], times["none"]) for mode in args.modes},
        "iteration_ratio": {mode: harness.paired_ratios(iteration_times[mode], iteration_times["none"])
                            for mode in args.modes},
    }
    if not args.no_memory:
        result["peak_memory"] = measure_memory(variants)

    def ratio(stats: dict) -> str:
        return (f"{stats['median']:.2f}x (IQR {stats['quartiles'][0]:.2f}-{stats['quartiles'][1]:.2f}, "
                f"range {stats['range'][0]:.2f}-{stats['range'][1]:.2f})")

    print(f"{result['setup']['prompts']} prompts x {result['setup']['responses_per_prompt']} responses, "
          f"{result['setup']['trainable_params']} LoRA parameters, {args.clock} clock, median of {args.repeats} repeats:")
    for variant in variants:
        line = (f"  {variant:10s} update {1000 * result['update_seconds_median'][variant]:7.1f} ms, "
                f"iteration {1000 * result['iteration_seconds_median'][variant]:7.1f} ms")
        if variant != "none":
            line += (f"\n    DP/non-DP update {ratio(result['update_ratio'][variant])}"
                     f"\n    DP/non-DP iteration {ratio(result['iteration_ratio'][variant])}")
        if "peak_memory" in result and variant in result["peak_memory"]:
            line += f"\n    peak RSS rise over an update {result['peak_memory'][variant]['peak_rise_mib']:.1f} MiB"
        print(line)
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
