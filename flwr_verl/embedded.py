"""The embedded default: a tiny arithmetic model that the project builds itself, offline.

No hub download exists on the machines we target, so the default job makes everything it
needs from code:

1. a character-level tokenizer trained with the ``tokenizers`` library (every digit is a token);
2. a small Llama-style causal LM initialised from a config;
3. a short supervised warm start on answer tokens only, so that RL has reward signal from the
   first iteration (a random model never answers correctly and gets no gradient from a 0/1
   reward);
4. the task itself: ``a+b=`` prompts in verl's row format, and a ``compute_score`` that checks
   the answer exactly.

The result is an ordinary Hugging Face model directory, cached under
``$FLWR_VERL_CACHE`` (default ``~/.cache/flwr_verl``) and keyed by a hash of the recipe, so that
every process on a node (server, Ray actors) reuses one build. Building is deterministic:
the server and every client get bit-identical frozen base weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

DATA_SOURCE = "flwr_verl/arithmetic"

# Everything that changes the built model belongs in this recipe: its hash names the cache entry.
RECIPE: dict[str, Any] = {
    "version": 1,
    "max_operand": 49,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "warm_start_steps": 1000,
    "warm_start_batch_size": 64,
    "warm_start_lr": 3e-3,
    "seed": 1234,
}

_ALPHABET = list("0123456789+-=")
_SPECIAL = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


# ----------------------------------------------------------------------------- the task
def make_problem(rng: random.Random, max_operand: int | None = None) -> tuple[str, str]:
    """One addition problem as (prompt text, answer text)."""
    top = RECIPE["max_operand"] if max_operand is None else max_operand
    a, b = rng.randint(0, top), rng.randint(0, top)
    return f"{a}+{b}=", str(a + b)


def arithmetic_rows(num_prompts: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``num_prompts`` problems as verl-format rows (the same fields as verl's parquet data)."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for index in range(num_prompts):
        prompt, answer = make_problem(rng)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": prompt}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": split, "index": index},
            }
        )
    return rows


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """verl reward contract: 1.0 for the exact answer, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


# ----------------------------------------------------------------------------- building
def cache_root() -> Path:
    return Path(os.environ.get("FLWR_VERL_CACHE", Path.home() / ".cache" / "flwr_verl"))


def embedded_model_path() -> Path:
    """Directory of the embedded model, built on first use (safe under concurrent callers)."""
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    target = cache_root() / f"embedded-arithmetic-{digest}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_suffix(".lock")):
        if not (target / "config.json").exists():
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
            try:
                build_embedded_model(staging)
                staging.rename(target)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_tokenizer():
    """Character-level tokenizer, trained with ``tokenizers`` on the task's alphabet."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token=_SPECIAL["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=list(_SPECIAL.values()))
    tokenizer.train_from_iterator(["".join(_ALPHABET)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, padding_side="left", **_SPECIAL)


def build_embedded_model(out_dir: Path) -> None:
    """Build tokenizer and model, warm-start them, and save both to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RECIPE["seed"])
    rng = random.Random(RECIPE["seed"])
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_attention_heads"],
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    _warm_start(model, tokenizer, rng)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _warm_start(model, tokenizer, rng: random.Random) -> None:
    """Supervised steps on answer tokens only: enough for some right answers, far from all."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["warm_start_lr"])
    model.train()
    for _ in range(RECIPE["warm_start_steps"]):
        problems = [make_problem(rng) for _ in range(RECIPE["warm_start_batch_size"])]
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in problems]
        answers = [tokenizer(a, add_special_tokens=False)["input_ids"] for _, a in problems]
        sequences = [[tokenizer.bos_token_id] + p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
        labels = torch.full((len(sequences), width), -100)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, (seq, prompt) in enumerate(zip(sequences, prompts)):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention_mask[row, : len(seq)] = 1
            answer_start = 1 + len(prompt)
            labels[row, answer_start : len(seq)] = torch.tensor(seq[answer_start:])
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
