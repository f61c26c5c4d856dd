"""The embedded task: ``a+b=`` problems (operands 0-49) as verl-format rows, with a
``compute_score`` that checks the answer exactly. The problem space is split once, by a hash of
each problem, into train / tune / val: held-out figures are held out whatever the seeds and
clients."""

from __future__ import annotations

import functools
import hashlib
import random
from typing import Any

from flwr_verl.config.errors import DataError

DATA_SOURCE = "flwr_verl/arithmetic"
MAX_OPERAND = 49  # the largest operand; the shipped model's recipe records it (``model.RECIPE``)


# ----------------------------------------------------------------------------- splits
# Every generated problem belongs to exactly one split, decided by a hash of the problem itself:
# a validation problem can never be drawn as a training problem, whatever the seed, the client or
# the number of clients. "tune" is for hyperparameter and recipe decisions, so that "val" is looked
# at only to report.
SPLITS = ("train", "tune", "val")
SPLIT_FRACTIONS = {"train": 0.8, "tune": 0.1, "val": 0.1}


def split_of(key: str) -> str:
    """The split a problem belongs to: sha256 of its ``key`` (the problem text) mapped to [0, 1)."""
    position = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    for split in SPLITS:
        position -= SPLIT_FRACTIONS[split]
        if position < 0:
            return split
    return SPLITS[-1]


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(f"split={split!r}: expected one of {', '.join(SPLITS)}")


# ----------------------------------------------------------------------------- the task
def problem_key(a: int, b: int) -> str:
    """What decides a problem's split: the unordered operands, so that ``a+b`` and ``b+a`` (the
    same fact to learn) always share a split."""
    return f"{min(a, b)}+{max(a, b)}="


def split_problems(split: str, max_operand: int | None = None) -> list[tuple[str, str]]:
    """Every ``a+b=`` problem of ``split`` as (prompt text, answer text), in a fixed order."""
    check_split(split)
    top = MAX_OPERAND if max_operand is None else max_operand
    return list(_split_problems(split, top))


@functools.lru_cache(maxsize=None)
def _split_problems(split: str, top: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{a}+{b}=", str(a + b)) for a in range(top + 1) for b in range(top + 1)
                 if split_of(problem_key(a, b)) == split)


def sample_problems(split: str, count: int, rng: random.Random,
                    max_operand: int | None = None) -> list[tuple[str, str]]:
    """``count`` problems of ``split``: passes over the split's problems, each pass freshly shuffled.

    Within a pass no problem repeats; problems repeat only once ``count`` exceeds the split's size.
    With operands 0..49 the splits hold about 2,000 / 240 / 240 problems: the default federation's
    192 pooled val prompts are all distinct, its 6,144 pooled train prompts cover each train problem
    about three times."""
    pool = split_problems(split, max_operand)
    drawn: list[tuple[str, str]] = []
    while len(drawn) < count:
        rng.shuffle(pool)
        drawn.extend(pool[: count - len(drawn)])
    return drawn


def arithmetic_rows(num_prompts: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """``num_prompts`` problems of ``split`` as verl-format rows (the fields of verl's parquet data)."""
    problems = sample_problems(split, num_prompts, random.Random(f"{seed}-{split}"))
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index},
        }
        for index, (prompt, answer) in enumerate(problems)
    ]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> float:
    """verl reward contract: 1.0 for the exact answer, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0
