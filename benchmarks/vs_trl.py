"""flwr-verl's local engine against TRL's GRPOTrainer on the standard tiny workload, side by
side: sequences per second, the phase breakdown and peak RSS of each.

Goal: at least 1.0x TRL's seq/s at both sizes, and peak RSS at most TRL's + 10% (the aim: 1.3x).

    python benchmarks/vs_trl.py --trl-python /work/venv-trl/bin/python [--peer ../shared/peer/bench_trl.py]
                                [--repeats 3] [--warmup 3] [--iterations 20] [--size 512,1024,4] [--clock cpu]
                                [--out benchmarks/results/vs_trl.json]

The workload is the peer benchmark's (``../shared/peer/bench_trl.py``, its docstring): a
char-level tokenizer, a random-init Llama (hidden 128, intermediate 256, 2 layers, 4 heads, 2 KV
heads, untied), LoRA r=8, alpha 16 on q_proj,v_proj, prompts "a+b=? ####" with reward 1.0 when
the first number of the response is a+b, 16 prompts x 4 responses = 64 sequences per iteration,
16 new tokens, temperature 1, one optimizer step per iteration at lr 1e-4, no KL, fp32, 1 thread.
flwr-verl runs it through its public engine API (``LocalPPOTrainer`` on a model directory and
verl-format rows): GRPO, ``token-mean`` loss (TRL's default ``dapo``), clip 0.2, grad clip 1,
AdamW, privacy off. One difference is inherent: flwr-verl puts the BOS token before a prompt
(``data.prompt_text``; TRL does not), so its prompts are one token longer.

``--clock cpu`` times with the process's CPU time (``time.process_time``, user + system, put in
place of ``time.perf_counter`` in both processes) instead of wall time: on a shared machine it
leaves out the time a process waits for a core, which wall time counts for whichever side ran
while the machine was busier. Both sides use one torch thread.

``--size HIDDEN,INTERMEDIATE,LAYERS`` changes only the model size, on both sides (the peer
script is run unchanged, with ``transformers.LlamaConfig`` given those sizes).

Each repetition runs TRL and flwr-verl in fresh processes, one after the other, alternating which
goes first (interleaved: both see the same machine load). Per process: ``--warmup`` iterations,
then ``--iterations`` timed ones; an iteration is the wall time of one RL iteration (TRL: between
``on_step_end`` callbacks; flwr-verl: one ``LocalPPOTrainer.iteration``). Printed and written as
JSON: seq/s, the ratio flwr-verl / TRL (per repetition, so each ratio compares runs under the
same load), the phase breakdown and peak RSS (``ru_maxrss`` of the whole process), all medians
over repetitions with ranges.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

PEER = harness.REPO.parent / "shared" / "peer" / "bench_trl.py"
NUM_PROMPTS, NUM_GEN, MAX_NEW = 16, 4, 16
SEQUENCES = NUM_PROMPTS * NUM_GEN
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "PYTHONWARNINGS": "ignore"}
# The peer script, unchanged, with LlamaConfig given the requested sizes.
TRL_RUNNER = """
import runpy, sys, time
if sys.argv[2] == "cpu":
    time.perf_counter = time.process_time
import peft, transformers, trl  # first: importing them re-resolves transformers' lazy attributes
hidden, intermediate, layers = (int(v) for v in sys.argv[1].split(","))
base = transformers.LlamaConfig
transformers.LlamaConfig = lambda **kw: base(**{**kw, "hidden_size": hidden, "intermediate_size": intermediate,
                                                 "num_hidden_layers": layers})
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# ----------------------------------------------------------------------------- the workload, flwr-verl side
def build_tokenizer():
    """The peer's char-level tokenizer (bench_trl.build_tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    chars = list(string.digits) + list(string.ascii_letters) + list(" +-*/=?#:.,\n")
    tokenizer = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left", truncation_side="left", clean_up_tokenization_spaces=False)


def build_model_dir(directory: Path, size: tuple[int, int, int], seed: int) -> None:
    """The peer's random-init Llama and tokenizer, saved as a local Hugging Face model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    hidden, intermediate, layers = size
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def build_rows(count: int, seed: int) -> list[dict]:
    """The peer's prompts (bench_trl.build_dataset) as verl-format rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}=? ####"}], "data_source": "peer",
                     "reward_model": {"ground_truth": str(a + b)}, "extra_info": {}})
    return rows


NUMBER = re.compile(r"-?\d+")


def correctness(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The peer's reward (bench_trl.correctness_reward) in verl's contract."""
    match = NUMBER.search(solution_str)
    return 1.0 if match is not None and int(match.group()) == int(ground_truth) else 0.0


def flwr_verl_child(size: tuple[int, int, int], warmup: int, iterations: int, seed: int) -> dict:
    start = time.perf_counter()
    from flwr_verl.config import engine_config
    from flwr_verl.engine.trainer import LocalPPOTrainer

    with tempfile.TemporaryDirectory() as directory:
        build_model_dir(Path(directory), size, seed)
        config = engine_config(
            model={"path": directory, "lora_rank": 8, "lora_alpha": 16.0, "target_modules": "q_proj,v_proj"},
            data={"train_batch_size": NUM_PROMPTS, "max_prompt_length": 32},
            rollout={"n": NUM_GEN, "response_length": MAX_NEW, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
            actor={"ppo_mini_batch_size": NUM_PROMPTS, "ppo_epochs": 1, "lr": 1e-4, "weight_decay": 0.0,
                   "grad_clip": 1.0, "loss_agg_mode": "token-mean", "clip_ratio": 0.2},
            algorithm={"adv_estimator": "grpo"}, privacy={"enabled": False},
            trainer={"num_threads": 1, "seed": seed},
        )
        trainer = LocalPPOTrainer(config, build_rows(NUM_PROMPTS * (warmup + iterations + 8), seed),
                                  compute_score=correctness)
    setup_s = time.perf_counter() - start
    rows = []
    with trainer.start_fit(seed=seed) as fit:
        for _ in range(warmup + iterations):
            began = time.perf_counter()
            metrics = trainer.iteration(fit)
            rows.append({"iter": time.perf_counter() - began, **metrics})
    timed = rows[warmup:]
    phases = {phase: statistics.median(r[f"time_{phase}"] for r in timed)
              for phase in ("rollout", "reward", "log_prob", "advantage", "update")}
    phases["other"] = statistics.median(r["iter"] - sum(r[f"time_{p}"] for p in phases) for r in timed)
    return {"median_s": statistics.median(r["iter"] for r in timed), "iters": [r["iter"] for r in timed],
            "phases": phases, "setup_s": setup_s, "rss_mb_peak": harness.peak_rss_mib(),
            "mean_reward_last": statistics.mean(r["reward_mean"] for r in rows[-5:])}


# ----------------------------------------------------------------------------- the processes
def run_trl(python: str, peer: Path, size: str, clock: str, warmup: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "trl.json"
        subprocess.run([python, "-c", TRL_RUNNER, size, clock, str(peer), "--warmup", str(warmup), "--iters", str(iterations),
                        "--repeats", "1", "--json", str(out)],
                       env={**os.environ, **ENV, "TRL_BENCH_OUT": str(Path(directory) / "out")},
                       cwd=directory, capture_output=True, text=True, check=True, timeout=1800)
        result = json.loads(out.read_text())
    run = result["runs"][0]
    phases = {"generate": run["median_generate"], "reward": run["median_reward"],
              "rollout_other": run["median_rollout_other"], "loss_fwd_bwd": run["median_loss_fwd_bwd"],
              "optimizer_step": run["median_optimizer_step"], "other": run["median_other_loop_overhead"]}
    return {"median_s": run["median_s"], "iters": run["iters"], "phases": phases, "setup_s": result["setup_s"],
            "rss_mb_peak": result["rss_mb_peak"], "versions": result["versions"],
            "mean_reward_last": statistics.mean(result["mean_reward_per_iter"][-5:])}


def run_flwr_verl(size: str, clock: str, warmup: int, iterations: int, seed: int) -> dict:
    return harness.child_result([sys.executable, __file__, "--child", size, "--clock", clock, "--warmup", str(warmup),
                                 "--iterations", str(iterations), "--seed", str(seed)],
                                env={**os.environ, **ENV, "PYTHONPATH": str(harness.REPO)}, timeout=1800)


def summarize(runs: list[dict]) -> dict:
    return {
        "seq_per_s": harness.spread([SEQUENCES / r["median_s"] for r in runs]),
        "iteration_s": harness.spread([r["median_s"] for r in runs]),
        "phases_s": {phase: harness.spread([r["phases"][phase] for r in runs]) for phase in runs[0]["phases"]},
        "rss_mb_peak": harness.spread([r["rss_mb_peak"] for r in runs]),
        "setup_s": harness.spread([r["setup_s"] for r in runs]),
        "mean_reward_last_5": harness.spread([r["mean_reward_last"] for r in runs]),
    }


def show(name: str, summary: dict) -> None:
    print(f"{name:10s} seq/s {harness.format_spread(summary['seq_per_s'], '.1f')}  "
          f"iteration {harness.format_spread(summary['iteration_s'], '.4f', ' s')}  "
          f"peak RSS {harness.format_spread(summary['rss_mb_peak'], '.0f', ' MiB')}")
    print("           phases: " + "  ".join(f"{phase} {s['median']:.4f}" for phase, s in summary["phases_s"].items()))


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--trl-python", default="/work/venv-trl/bin/python",
                        help="a Python with trl 1.16 (its own venv: TRL needs a newer transformers than verl)")
    parser.add_argument("--peer", type=Path, default=PEER)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved pairs of fresh processes")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=20, help="timed iterations per process")
    parser.add_argument("--size", default="128,256,2", help="hidden,intermediate,layers")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "vs_trl.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.clock == "cpu":  # before anything reads the clock (the trainer's phase timings too)
            time.perf_counter = time.process_time
        size = tuple(int(v) for v in args.child.split(","))
        harness.print_result(flwr_verl_child(size, args.warmup, args.iterations, args.seed))
        return

    if not args.peer.is_file():
        parser.error(f"--peer {args.peer}: no such file (the peer script, ../shared/peer/bench_trl.py from the repo)")
    if not Path(args.trl_python).is_file():
        parser.error(f"--trl-python {args.trl_python}: no such file (a venv with trl==1.16.0 torch==2.13.0)")
    sides = {"TRL": lambda: run_trl(args.trl_python, args.peer, args.size, args.clock, args.warmup, args.iterations),
             "flwr-verl": lambda: run_flwr_verl(args.size, args.clock, args.warmup, args.iterations, args.seed)}

    def side(name: str):
        def one_process(repeat: int) -> dict:
            result = sides[name]()
            print(f"repeat {repeat + 1}: {name} {SEQUENCES / result['median_s']:.0f} seq/s", flush=True)
            return result

        return one_process

    runs = harness.interleaved({name: side(name) for name in sides}, args.repeats)
    trl_runs, ours = runs["TRL"], runs["flwr-verl"]
    ratios = [t["median_s"] / o["median_s"] for t, o in zip(trl_runs, ours)]
    result = {
        "workload": {"size": args.size, "clock": args.clock, "prompts": NUM_PROMPTS, "generations": NUM_GEN, "max_new_tokens": MAX_NEW,
                     "warmup": args.warmup, "iterations": args.iterations, "repeats": args.repeats,
                     "cpus": os.cpu_count(), "load_average": os.getloadavg()},
        "trl": summarize(trl_runs), "flwr_verl": summarize(ours),
        "ratio_seq_per_s": harness.spread(ratios), "trl_versions": trl_runs[0]["versions"],
        "runs": {"trl": trl_runs, "flwr_verl": ours},
    }
    show("TRL", result["trl"])
    show("flwr-verl", result["flwr_verl"])
    print(f"flwr-verl seq/s over TRL seq/s: {harness.format_spread(result['ratio_seq_per_s'], '.2f')}, "
          f"{args.repeats} interleaved pairs, {args.clock} clock; peak RSS ratio "
          f"{result['flwr_verl']['rss_mb_peak']['median'] / result['trl']['rss_mb_peak']['median']:.2f}")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
