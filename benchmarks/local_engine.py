"""Speed and memory of the local RL engine (one client, no federation): iteration time, rollout
tokens/s, update time per sample, and peak RSS against the model and optimizer state.

Goal: peak RSS / (model + optimizer state) at most 1.3.

    python benchmarks/local_engine.py [--variants dp nodp] [--processes 2] [--iterations 8]
                                      [--set rollout.n=8] [--out benchmarks/results/local_engine.json]

Each variant runs in fresh processes (``--processes`` of them): build the trainer on the
embedded model with the default engine config (or ``--set key=value`` overrides), run
``--warmup`` iterations, then ``--iterations`` timed ones. Per iteration:

* rollout tokens/s: generated response tokens (up to and including EOS) / rollout seconds;
* update seconds per sample: the PPO update phase / responses in the batch (and per prompt).

Memory, per process: peak RSS (``getrusage``'s ru_maxrss) against the bytes the job needs by
definition, the model (parameters and buffers of policy, and critic for gae) plus the adapter
optimizer state (AdamW's two moments). The ratio is also given with the process's RSS after
the imports and before the model is loaded subtracted (``above imports``), which separates what
the Python/torch/verl runtime costs from what the engine costs.

Figures are medians over all timed iterations of all processes (timing) and over processes
(memory).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import warnings
from pathlib import Path

import harness

warnings.filterwarnings("ignore")

VARIANTS = {  # name -> run-config overrides on top of the defaults
    "dp": {},  # the default engine: DP-GRPO (Opacus hooks)
    "nodp": {"privacy.enabled": False},
    "gae": {"privacy.enabled": False, "algorithm.adv_estimator": "gae"},  # with a critic
}

def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def child(variant: str, overrides: list[str], warmup: int, iterations: int) -> dict:
    """One process: build, warm up, time ``iterations`` iterations; memory figures at the end
    (resident sets in MiB, tensors in bytes)."""
    start_rss = harness.rss_mib()
    import torch

    from flwr_verl.config import parse_run_config
    from flwr_verl.embedded import embedded_model_path
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.trainer import LocalPPOTrainer
    from flwr_verl.tools.config_files import read_run_config

    embedded_model_path()  # check the shipped model's files now, not inside the measurement
    config = parse_run_config({**read_run_config(None, overrides), **VARIANTS[variant]}).engine
    rows = load_rows(config.data, "train", config.trainer.seed)
    imports_rss = harness.rss_mib()
    trainer = LocalPPOTrainer(config, rows)
    model_rss = harness.rss_mib()
    trainer.fit(warmup, seed=1)
    with trainer.start_fit(seed=2) as fit:
        metrics = [m for m in (trainer.iteration(fit) for _ in range(iterations)) if m.get("prompts")]
        optimizers = [fit.update.optimizer] + ([fit.critic_optimizer] if fit.critic_optimizer else [])
        optimizer_bytes = sum(tensor_bytes(t for s in o.state.values() for t in s.values() if torch.is_tensor(t))
                              for o in optimizers)

    models = [m for m in (trainer.policy, trainer.critic) if m is not None]
    model_bytes = sum(tensor_bytes(m.parameters()) + tensor_bytes(m.buffers()) for m in models)
    adapter_bytes = tensor_bytes(p for m in models for p in m.parameters() if p.requires_grad)
    n = config.rollout.n
    return {
        "variant": variant,
        "rollout_tokens_per_s": [m["prompts"] * n * m["response_length"] / m["time_rollout"] for m in metrics],
        "update_s_per_sample": [m["time_update"] / (m["prompts"] * n) for m in metrics],
        "update_s_per_prompt": [m["time_update"] / m["prompts"] for m in metrics],
        "iteration_s": [sum(v for k, v in m.items() if k.startswith("time_")) for m in metrics],
        "prompts": [m["prompts"] for m in metrics],
        "start_rss": start_rss, "imports_rss": imports_rss, "model_rss": model_rss, "peak_rss": harness.peak_rss_mib(),
        "model_bytes": model_bytes, "adapter_bytes": adapter_bytes, "optimizer_bytes": optimizer_bytes,
        "setup": {
            "estimator": config.algorithm.adv_estimator, "privacy": config.privacy.enabled,
            "train_batch_size": config.data.train_batch_size, "n": n,
            "response_length": config.rollout.response_length, "ppo_epochs": config.actor.ppo_epochs,
            "mini_batches": trainer.num_mini_batches, "lora_rank": config.model.lora_rank,
            "model_parameters": sum(p.numel() for m in models for p in m.parameters()),
            "adapter_parameters": sum(p.numel() for m in models for p in m.parameters() if p.requires_grad),
            "torch_threads": torch.get_num_threads(),
        },
    }


def summarize(runs: list[dict]) -> dict:
    median = statistics.median
    flat = lambda key: [v for run in runs for v in run[key]]  # noqa: E731
    needed = [run["model_bytes"] + run["optimizer_bytes"] for run in runs]
    return {
        "setup": runs[0]["setup"],
        "processes": len(runs),
        "timed_iterations": len(flat("iteration_s")),
        "rollout_tokens_per_s": median(flat("rollout_tokens_per_s")),
        "update_ms_per_sample": 1000 * median(flat("update_s_per_sample")),
        "update_ms_per_prompt": 1000 * median(flat("update_s_per_prompt")),
        "iteration_s": median(flat("iteration_s")),
        "memory_mib": {
            "model": median(r["model_bytes"] for r in runs) / harness.MIB,
            "adapters": median(r["adapter_bytes"] for r in runs) / harness.MIB,
            "adapter_optimizer_state": median(r["optimizer_bytes"] for r in runs) / harness.MIB,
            "rss_at_start": median(r["start_rss"] for r in runs),
            "rss_after_imports": median(r["imports_rss"] for r in runs),
            "rss_after_model_load": median(r["model_rss"] for r in runs),
            "peak_rss": median(r["peak_rss"] for r in runs),
            "peak_rss_per_process": [r["peak_rss"] for r in runs],
        },
        # Goal: <= 1.3. The whole process against model + optimizer state:
        "peak_rss_ratio": median(r["peak_rss"] * harness.MIB / b for r, b in zip(runs, needed)),
        # The same with the runtime (interpreter, torch, transformers, verl, opacus) taken out:
        "peak_rss_above_imports_ratio": median((r["peak_rss"] - r["imports_rss"]) * harness.MIB / b
                                               for r, b in zip(runs, needed)),
    }


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--variants", nargs="+", default=["dp", "nodp"], choices=list(VARIANTS))
    parser.add_argument("--processes", type=int, default=2, help="fresh processes per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=8, help="timed iterations per process")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="engine config override, a TOML literal as in flwr-verl-baseline --set")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "local_engine.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = args.set  # parsed in the child, as flwr_verl.tools.baseline parses --set
    if args.child:
        harness.print_result(child(args.child, overrides, args.warmup, args.iterations))
        return

    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "overrides": overrides, "variants": {}}
    for variant in args.variants:
        runs = []
        for _ in range(args.processes):
            command = [sys.executable, __file__, "--child", variant, "--warmup", str(args.warmup),
                       "--iterations", str(args.iterations), *(f"--set={item}" for item in args.set)]
            runs.append(harness.child_result(command, env={**os.environ, "PYTHONWARNINGS": "ignore"}))
        summary = result["variants"][variant] = summarize(runs)
        setup, memory = summary["setup"], summary["memory_mib"]
        print(f"{variant}: {setup['estimator']}, privacy {'on' if setup['privacy'] else 'off'}, "
              f"{setup['train_batch_size']} prompts x {setup['n']} responses, {setup['model_parameters']:,} parameters "
              f"({setup['adapter_parameters']:,} in adapters); medians of {summary['timed_iterations']} iterations "
              f"in {summary['processes']} processes")
        print(f"  rollout {summary['rollout_tokens_per_s']:8.0f} tokens/s   "
              f"update {summary['update_ms_per_sample']:.3f} ms/sample "
              f"({summary['update_ms_per_prompt']:.2f} ms/prompt)   "
              f"iteration {summary['iteration_s']:.3f} s")
        print(f"  memory MiB: model {memory['model']:.2f} + adapter optimizer state "
              f"{memory['adapter_optimizer_state']:.3f}; RSS at start {memory['rss_at_start']:.0f}, after imports "
              f"{memory['rss_after_imports']:.0f}, after model load {memory['rss_after_model_load']:.0f}, "
              f"peak {memory['peak_rss']:.0f}")
        print(f"  peak RSS / (model + optimizer state) = {summary['peak_rss_ratio']:.1f} (goal <= 1.3); "
              f"(peak - RSS after imports) / (model + optimizer state) = {summary['peak_rss_above_imports_ratio']:.1f}")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
