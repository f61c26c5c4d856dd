"""What the global model remembers of one client's secrets: exposure (bits) and verbatim
reproduction of planted secrets, without DP, with DP, and with DP behind the de-identification
filter.

Goal: no target set; the filter reproduces nothing (exposure 0).

    nice -n 5 python benchmarks/memorization.py [--seeds 2] [--secrets 8] [--copies 4] [--out FILE]

Secrets in the format of an identifier, ``dddd-dddd`` (the embedded tokenizer knows only digits
and ``+-=``; think "patient id 4821-9930"), are planted in one client's private prompts: the
prompt is the record's first half, ``4821-``, and the client's reward for a response is the
share of the second half, ``9930``, that it reproduces from its start (a record-completion task:
each correct leading digit earns a quarter, so RL, which learns only what it samples, gets a
signal from the first digit on). Each secret is planted ``--copies`` times (Carlini et al. insert
theirs several times too): under DP each copy is its own privacy unit, so a secret planted c
times is protected only at group-privacy level c. The federation trains once per arm, in one
process (``audit.train_planted``: the real clients and strategy), with ``--clients`` clients.

Measured under the final global adapter, for every secret:

* **exposure** (Carlini et al. 2019, "The Secret Sharer"): log2 |R| - log2 rank, where R is the
  candidate space of same-format completions (all 10^4 four-digit endings of the secret's own
  prompt) and rank is the secret's position when R is sorted by the model's log-probability
  (ties counted against the secret). Chance is about 1 bit; 13.3 bits is the maximum (rank 1).
  Computed exactly by enumerating R as a tree of teacher-forced forwards.
* **reproduction**: whether greedy decoding from the secret's prompt, or any of ``--samples``
  sampled responses (temperature 1, as in training), starts with the secret's second half.

Arms: ``initial`` (the model before training: the reference for chance), ``no_dp``, ``dp``
(``privacy.target_epsilon``, ``--epsilon``), and ``dp_filter``: the ``dp`` model served through
the generation-time filter (``deidentify.NoVerbatimNgrams``, MemFree decoding) built from the
organisation's own records (the full secrets) as its protected corpus. The filter applies to
exposure too: a token it blocks has probability 0 in the distribution the model is served with.
Medians and ranges are over secrets and seeds.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from pathlib import Path

import harness

warnings.filterwarnings("ignore")

SECRET_SOURCE = "benchmarks/secret"
DIGITS = "0123456789"
HALF = 4  # digits in each half of a secret


def secret_rows(count: int, copies: int, seed: int) -> list[dict]:
    """``count`` distinct secrets ``dddd-dddd`` as verl rows, each ``copies`` times."""
    import random

    rng = random.Random(f"secrets-{seed}")
    secrets: dict[str, None] = {}
    while len(secrets) < count:
        secrets["".join(rng.choices(DIGITS, k=HALF)) + "-" + "".join(rng.choices(DIGITS, k=HALF))] = None
    return [{"data_source": SECRET_SOURCE, "prompt": [{"role": "user", "content": secret[: HALF + 1]}],
             "reward_model": {"ground_truth": secret[HALF + 1:]}, "extra_info": {"secret": secret}}
            for secret in secrets for _ in range(copies)]


def with_secret_reward(compute_score):
    """``compute_score`` that also scores the planted records: the share of the secret's second
    half that the response reproduces from its start."""

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source != SECRET_SOURCE:
            return compute_score(data_source, solution_str, ground_truth, extra_info)
        matched = 0
        for produced, wanted in zip(solution_str.strip(), ground_truth):
            if produced != wanted:
                break
            matched += 1
        return matched / len(ground_truth)

    return score


def completion_log_probs(policy, tokenizer, row: dict, processors=None):
    """log p(c | prompt) for every completion c in DIGITS^HALF, in lexicographic order: (10^HALF,).
    ``processors`` (a ``LogitsProcessorList``) transform each step's logits as ``generate`` does."""
    import torch

    from flwr_verl.engine.data import prompt_text

    prompt = tokenizer(prompt_text(row, tokenizer), add_special_tokens=False)["input_ids"]
    digit_ids = torch.tensor([tokenizer.convert_tokens_to_ids(d) for d in DIGITS])
    totals = torch.zeros(1)
    prefixes = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(HALF):
            logits = policy(input_ids=prefixes).logits[:, -1].float()
            if processors is not None:
                logits = processors(prefixes, logits)
            step = torch.log_softmax(logits, -1)[:, digit_ids]  # (prefixes, 10)
            totals = (totals[:, None] + step).reshape(-1)
            prefixes = torch.cat([prefixes.repeat_interleave(len(DIGITS), 0),
                                  digit_ids.repeat(prefixes.shape[0])[:, None]], dim=1)
    return totals


def exposure(log_probs, secret_index: int) -> float:
    """Carlini et al.'s exposure: log2 |R| - log2 rank, ties counted against the secret."""
    rank = int((log_probs >= log_probs[secret_index]).sum())
    return math.log2(len(log_probs)) - math.log2(rank)


def measure(policy, tokenizer, rows: list[dict], engine, samples: int, processors=None) -> list[dict]:
    """Exposure and reproduction of each distinct secret in ``rows``."""
    from flwr_verl.engine.rollout import generate

    distinct = list({row["extra_info"]["secret"]: row for row in rows}.values())
    greedy = generate(policy, tokenizer, distinct, engine.rollout, engine.data.max_prompt_length, n=1, greedy=True,
                      logits_processor=processors)
    sampled = generate(policy, tokenizer, distinct, engine.rollout, engine.data.max_prompt_length, n=samples,
                       logits_processor=processors)

    def texts(batch):
        return tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)

    greedy_texts, sampled_texts = texts(greedy), texts(sampled)
    out = []
    for i, row in enumerate(distinct):
        answer = row["reward_model"]["ground_truth"]
        log_probs = completion_log_probs(policy, tokenizer, row, processors)
        mine = sampled_texts[i * samples:(i + 1) * samples]
        out.append({"secret": row["extra_info"]["secret"], "exposure": exposure(log_probs, int(answer)),
                    "log_prob": float(log_probs[int(answer)]),
                    "greedy_reproduced": greedy_texts[i].strip().startswith(answer),
                    "sampled_reproduced": sum(t.strip().startswith(answer) for t in mine)})
    return out


def run_seed(args, seed: int) -> dict[str, list[dict]]:
    import torch
    from transformers import LogitsProcessorList

    from flwr_verl.config import FederationConfig, engine_config
    from flwr_verl.engine.rewards import resolve_compute_score
    from flwr_verl.federation.client import cached_models
    from flwr_verl.privacy.deidentify import NoVerbatimNgrams, ProtectedNgrams
    from flwr_verl.tools.audit import train_planted

    def engine_for(privacy: dict):
        return engine_config(
            privacy=privacy, trainer={"seed": seed, "local_iterations": args.local_iterations},
            data={"train_size": args.train_size, "train_batch_size": args.batch_size, "val_size": 8},
            rollout={"n": args.n, "response_length": HALF + 1},
            actor={"ppo_mini_batch_size": args.batch_size, "lr": args.lr})

    federation = dataclasses.replace(FederationConfig(), num_server_rounds=args.rounds)
    planted = secret_rows(args.secrets, args.copies, seed)
    arms: dict[str, list[dict]] = {}
    for arm, privacy in (("no_dp", {"enabled": False}),
                         ("dp", {"enabled": True, "target_epsilon": args.epsilon, "deterministic": True})):
        engine = engine_for(privacy)
        models = cached_models(engine)
        initial = models.adapters.get_arrays()
        torch.manual_seed(seed)
        if "initial" not in arms:
            arms["initial"] = measure(models.policy, models.tokenizer, planted, engine, args.samples)
        score = with_secret_reward(resolve_compute_score(engine.custom_reward_function, engine.data))
        started = time.perf_counter()
        final, epsilon = train_planted(engine, federation, planted, num_clients=args.clients, models=models,
                                       compute_score=score, log=lambda line: None)
        seconds = time.perf_counter() - started
        models.adapters.set_arrays(final)
        torch.manual_seed(seed)
        arms[arm] = measure(models.policy, models.tokenizer, planted, engine, args.samples)
        for entry in arms[arm]:
            entry.update(epsilon=epsilon, train_seconds=seconds)
        if arm == "dp":
            records = sorted({row["extra_info"]["secret"] for row in planted})
            protected = ProtectedNgrams.from_texts(models.tokenizer, records, ngram=args.ngram)
            torch.manual_seed(seed)
            arms["dp_filter"] = measure(models.policy, models.tokenizer, planted, engine, args.samples,
                                        LogitsProcessorList([NoVerbatimNgrams(protected)]))
            for entry in arms["dp_filter"]:
                entry.update(epsilon=epsilon, train_seconds=seconds)
        models.adapters.set_arrays(initial)  # the next arm trains from the same start
    return arms


def summarise(per_seed: list[dict[str, list[dict]]], samples: int) -> dict:
    summary = {}
    for arm in per_seed[0]:
        entries = [e for arms in per_seed for e in arms[arm]]
        exposures = [e["exposure"] for e in entries]
        summary[arm] = {
            **harness.median_range("exposure", exposures),
            "secrets": len(entries),
            "greedy_reproduced": sum(e["greedy_reproduced"] for e in entries),
            "sampled_reproduced_secrets": sum(e["sampled_reproduced"] > 0 for e in entries),
            "sampled_reproduction_rate": sum(e["sampled_reproduced"] for e in entries) / (samples * len(entries)),
        }
        if "epsilon" in entries[0]:
            epsilons = [e["epsilon"] for e in entries]
            summary[arm]["epsilon_claimed_max"] = str(max(epsilons)) if math.isinf(max(epsilons)) else max(epsilons)
    return summary


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--secrets", type=int, default=8)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-iterations", type=int, default=20)
    parser.add_argument("--train-size", type=int, default=16, help="task prompts per client, besides the secrets")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--lr", type=float, default=3e-3, help="actor.lr of every arm (the engine's default)")
    parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon of the dp arms")
    parser.add_argument("--samples", type=int, default=64, help="sampled responses per secret")
    parser.add_argument("--ngram", type=int, default=6)
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "memorization.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    per_seed = [run_seed(args, seed) for seed in range(args.seeds)]
    summary = summarise(per_seed, args.samples)
    for arm, s in summary.items():
        lo, hi = s["exposure_range"]
        eps = f", claimed epsilon {s['epsilon_claimed_max']}" if "epsilon_claimed_max" in s else ""
        print(f"{arm:9s} exposure median {s['exposure_median']:.2f} bits (range {lo:.2f}-{hi:.2f}, max "
              f"{math.log2(10 ** HALF):.1f}) over {s['secrets']} secrets; greedy reproduced {s['greedy_reproduced']}, "
              f"sampled: {s['sampled_reproduced_secrets']} secrets ever, rate {s['sampled_reproduction_rate']:.4f}{eps}")
    peak_mib = harness.peak_rss_mib()
    result = {"command": harness.command_line(), "config": vars(args), "summary": summary, "per_seed": per_seed,
              "peak_rss_mib": peak_mib, "torch_threads": torch.get_num_threads(),
              "seconds": time.perf_counter() - started}
    print(f"peak RSS {peak_mib:.0f} MiB, {result['seconds']:.0f} s")
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
