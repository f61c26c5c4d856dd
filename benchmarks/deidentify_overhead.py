"""Cost of generation-time de-identification (``flwr_verl.privacy.deidentify``, MemFree
decoding): rollout generation time with the filter over without it, and the filter's size and
build time.

Goal: at most 1.1x.

    python benchmarks/deidentify_overhead.py [--repeats 7] [--clock cpu] [--out benchmarks/results/deidentify_overhead.json]

Rollout generation (``rollout.generate``, sampled, as in training) is timed with and without the
filter on the same prompts, side by side, alternating the order every repeat; the figure is the
median over repeats of (filtered time / unfiltered time) in the same repeat, with its range.
Two workloads:

* ``embedded``: the default job's rollout (embedded model, 32 prompts x 4 responses, 8 new
  tokens), protecting the organisation's 2,048 training prompts (6-grams). Generation rarely
  continues a protected prefix, so the filter mostly costs its prefix check.
* ``wide-vocab``: a random Llama (hidden 256, 2 layers, vocabulary 32,000), 8 prompts x 4
  responses, 16 new tokens, protecting 2,000 random 64-token passages. Every prompt is the
  start of a protected passage, so each response's first step checks the whole vocabulary
  (the later ones rarely continue a protected prefix). The worst case, every row of every step
  continuing a protected prefix, is timed as the processor alone on one step's scores
  (``full_check_ms_per_step``), beside one decoding step of the model (``decode_ms_per_step``).

Also reported: the filter's size in bytes per protected token (both Bloom filters, packed) and
the time to build it.

``--clock cpu`` times with the thread's CPU time instead of wall time (as ``dp_overhead.py``).
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from pathlib import Path

import harness

warnings.filterwarnings("ignore")


def embedded_workload():
    from flwr_verl.config import engine_config
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models

    config = engine_config(privacy={"enabled": False})
    models = build_models(config.model, with_critic=False)
    train = load_rows(config.data, "train", seed=0)
    texts = [m["content"] for row in train for m in row["prompt"]]
    return models.policy, models.tokenizer, train[: config.data.train_batch_size // 2], config, texts, None


def wide_vocab_workload():
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from flwr_verl.config import engine_config

    vocab = 32_000
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256))
    policy = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")).eval()
    # A word-level tokenizer whose words are the token ids: "t123" -> 123.
    words = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        padding_side="left")
    passages = torch.randint(2, vocab, (2000, 64), generator=torch.Generator().manual_seed(1)).tolist()
    texts = [" ".join(f"t{t}" for t in passage) for passage in passages]
    rows = [{"data_source": "synthetic", "prompt": [{"role": "user", "content": " ".join(text.split()[:16])}],
             "reward_model": {"ground_truth": ""}} for text in texts[:8]]
    config = engine_config(privacy={"enabled": False}, rollout={"response_length": 16},
                           data={"max_prompt_length": 64})
    return policy, tokenizer, rows, config, texts, vocab


def measure(name: str, workload, repeats: int, warmup: int, clock) -> dict:
    import torch
    from transformers import LogitsProcessorList

    from flwr_verl.engine.rollout import generate
    from flwr_verl.privacy.deidentify import NoVerbatimNgrams, ProtectedNgrams

    policy, tokenizer, rows, config, texts, _ = workload()
    start = time.perf_counter()
    protected = ProtectedNgrams.from_texts(tokenizer, texts, ngram=6, false_positive_rate=1e-4)
    build_seconds = time.perf_counter() - start
    processors = LogitsProcessorList([NoVerbatimNgrams(protected)])

    def generate_seconds(logits_processor, repeat: int) -> float:
        torch.manual_seed(repeat)  # both variants sample the same way in a repeat
        begin = clock()
        generate(policy, tokenizer, rows, config.rollout, config.data.max_prompt_length,
                 logits_processor=logits_processor)
        return clock() - begin

    times = harness.interleaved({"plain": functools.partial(generate_seconds, None),
                                 "filtered": functools.partial(generate_seconds, processors)}, repeats, warmup)
    slowdown = harness.paired_ratios(times["filtered"], times["plain"])
    # Worst case: every row's context is a protected prefix (the first 5 tokens of a passage).
    ids = [s for s in tokenizer(texts, add_special_tokens=False)["input_ids"] if len(s) >= protected.ngram]
    context = torch.tensor([s[: protected.ngram - 1] for s in ids[: len(rows) * config.rollout.n]])
    scores = torch.randn(context.shape[0], policy.config.vocab_size)
    full = []
    for _ in range(repeats):
        begin = clock()
        processors[0](context, scores)
        full.append(clock() - begin)
    return {
        "workload": name, "prompts": len(rows), "responses_per_prompt": config.rollout.n,
        "new_tokens": config.rollout.response_length, "vocab_size": policy.config.vocab_size,
        "protected_tokens": protected.num_tokens, "protected_ngrams": protected.num_ngrams, "ngram": protected.ngram,
        "false_positive_rate": 1e-4, "filter_bytes": protected.nbytes,
        "bytes_per_protected_token": protected.nbytes / protected.num_tokens,
        "build_seconds": build_seconds, "repeats": repeats, "torch_threads": torch.get_num_threads(),
        "generate_seconds_median": {v: statistics.median(t) for v, t in times.items()},
        "slowdown_median": slowdown["median"], "slowdown_range": slowdown["range"],
        "full_check_ms_per_step": 1000 * statistics.median(full),
        "decode_ms_per_step": 1000 * statistics.median(times["plain"]) / config.rollout.response_length,
    }


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(harness.CLOCKS), default="wall",
                        help="cpu: the thread's CPU time, which leaves out waiting for a core on a shared machine")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "deidentify_overhead.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    clock = harness.CLOCKS[args.clock]
    results = [measure("embedded", embedded_workload, args.repeats, args.warmup, clock),
               measure("wide-vocab", wide_vocab_workload, args.repeats, args.warmup, clock)]
    for r in results:
        lo, hi = r["slowdown_range"]
        print(f"{r['workload']:10s} vocab {r['vocab_size']:6d}, {r['prompts']}x{r['responses_per_prompt']} x "
              f"{r['new_tokens']} tokens: generate {1000 * r['generate_seconds_median']['plain']:.1f} ms -> "
              f"{1000 * r['generate_seconds_median']['filtered']:.1f} ms, slowdown {r['slowdown_median']:.3f}x "
              f"(range {lo:.3f}-{hi:.3f}); filter {r['filter_bytes']} B for {r['protected_tokens']} protected "
              f"tokens = {r['bytes_per_protected_token']:.2f} B/token, built in {r['build_seconds']:.2f} s; "
              f"worst-case check {r['full_check_ms_per_step']:.2f} ms/step vs decode {r['decode_ms_per_step']:.2f} "
              "ms/step")
    peak_mib = harness.peak_rss_mib()
    print(f"clock {args.clock}; peak RSS {peak_mib:.0f} MiB")
    harness.write_json(args.out, {"clock": args.clock, "peak_rss_mib": peak_mib, "workloads": results})


if __name__ == "__main__":
    main()
