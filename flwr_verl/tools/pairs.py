"""On-policy preference pairs from a task's verifier: ``flwr-verl preference-pairs``.

    flwr-verl preference-pairs --model DIR --task reasoning_gym:chain_sum \\
        --task-params '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' \\
        --format-instruction "Answer with only the number." \\
        --reward pkg://flwr_verl.engine.rewards:final_number_score --right-at 0.5 --out DIR

For each split (``train``, ``tune``, ``val``) the command draws that split's problems from the task
generator (``data.task_rows``: a problem's split is decided by a hash of its text, so the splits are
disjoint by construction, as the embedded task's are), samples ``--samples`` replies to each from the
base model (the engine's own rollout, ``rollout.generate``: the prompt as the policy sees it, cut to
``--max-prompt-length``, at ``--temperature``, at most ``--response-length`` tokens), and scores each
reply with the verifier (the task's own checker, or ``--reward``) as the engine's reward manager does.
A reply scoring at least ``--right-at`` is right, any other wrong. A prompt with at least one right and
one wrong distinct reply gives up to ``--pairs-per-prompt`` pairs (chosen a right reply, rejected a
wrong one, each reply used about equally often); other prompts are dropped.

It writes ``train.parquet``, ``tune.parquet`` and ``validation.parquet`` in TRL's preference format,
conversational when the model's tokenizer has a chat template (``prompt`` the user message, ``chosen``
and ``rejected`` one assistant message each), else plain text; ``data_source``, ``ground_truth`` and
the two scores ride along as extra columns, which stage ``dpo`` ignores. And ``manifest.json``: the
settings, each split's counts (problems, prompts kept, pairs, share of right replies) and each file's
sha256. Every split is made with the same settings, in the same way: nothing here looks at one split to
decide anything about another.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SPLIT_FILES = {"train": "train.parquet", "tune": "tune.parquet", "val": "validation.parquet"}


class PairsError(ValueError):
    """A bad argument (the message names it and its value) or a model or task that cannot be used."""


@dataclass(frozen=True)
class PairSettings:
    """What ``preference-pairs`` does; every field is a command-line argument of the same name."""

    model: str
    out: str
    task: str = "reasoning_gym:chain_sum"
    task_params: str = ""
    format_instruction: str = ""
    train_prompts: int = 256
    tune_prompts: int = 48
    val_prompts: int = 48
    samples: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    response_length: int = 16
    max_prompt_length: int = 128
    pairs_per_prompt: int = 4
    reward: str = ""  # "" the task's checker, else "PATH:NAME" (PATH a file or pkg://module)
    right_at: float = 1.0
    seed: int = 0
    batch_prompts: int = 16
    threads: int = 1
    split_sizes: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_sizes", {"train": self.train_prompts, "tune": self.tune_prompts,
                                                 "val": self.val_prompts})
        self.check()

    def check(self) -> None:
        def bad(name: str, value, why: str) -> PairsError:
            return PairsError(f"--{name.replace('_', '-')}={value!r} is invalid: {why}")

        if not self.task.startswith("reasoning_gym:") and self.task != "arithmetic":
            raise bad("task", self.task, "allowed: arithmetic, reasoning_gym:<task name>")
        if self.task_params:
            try:
                params = json.loads(self.task_params)
            except json.JSONDecodeError as error:
                raise bad("task_params", self.task_params, f"not JSON ({error})") from None
            if not isinstance(params, dict) or self.task == "arithmetic":
                raise bad("task_params", self.task_params, "must be a JSON object, for a reasoning_gym task")
        for name in ("train_prompts", "tune_prompts", "val_prompts"):
            if getattr(self, name) < 0:
                raise bad(name, getattr(self, name), "must be >= 0")
        if self.samples < 2:
            raise bad("samples", self.samples, "a prompt needs at least 2 replies to have a right and a wrong one")
        if not self.temperature > 0:
            raise bad("temperature", self.temperature, "must be > 0 (on-policy samples, not greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        for name in ("response_length", "max_prompt_length", "pairs_per_prompt", "batch_prompts", "threads"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "must be >= 1")
        if self.reward and ":" not in self.reward.removeprefix("pkg://"):
            raise bad("reward", self.reward, "expected PATH:NAME, e.g. pkg://flwr_verl.engine.rewards:final_number_score")
        if not Path(self.model).expanduser().is_dir():
            raise bad("model", self.model, "must be an existing local model directory")

    @property
    def task_parameters(self) -> dict | None:
        return json.loads(self.task_params) if self.task_params else None


# ----------------------------------------------------------------------------- pairing
def pair_replies(replies: list[tuple[str, float]], right_at: float, limit: int, rng: random.Random
                 ) -> list[tuple[tuple[str, float], tuple[str, float]]]:
    """Up to ``limit`` (chosen, rejected) pairs from one prompt's scored ``replies``: distinct texts,
    a right one (score >= ``right_at``) against a wrong one, cycling through both lists (shuffled by
    ``rng``) so that each reply is used about equally often. None without a right and a wrong reply."""
    distinct = dict(replies)  # text -> score: one entry per distinct reply
    right = [(t, s) for t, s in distinct.items() if s >= right_at]
    wrong = [(t, s) for t, s in distinct.items() if s < right_at]
    if not right or not wrong:
        return []
    rng.shuffle(right)
    rng.shuffle(wrong)
    # a diagonal walk over right x wrong: k -> (k mod R, (k + k // lcm) mod W) visits every pair once,
    # and any prefix uses each reply about equally often
    lcm = math.lcm(len(right), len(wrong))
    pairs = [(right[k % len(right)], wrong[(k + k // lcm) % len(wrong)])
             for k in range(min(limit, len(right) * len(wrong)))]
    return pairs


def preference_record(row: dict, chosen: tuple[str, float], rejected: tuple[str, float],
                      conversational: bool) -> dict:
    """One TRL preference row (conversational or plain text) with its extra columns."""
    prompt = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
    record = ({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen[0]}],
               "rejected": [{"role": "assistant", "content": rejected[0]}]} if conversational else
              {"prompt": "\n".join(m["content"] for m in prompt), "chosen": chosen[0], "rejected": rejected[0]})
    return {**record, "data_source": row["data_source"], "ground_truth": str(row["reward_model"]["ground_truth"]),
            "chosen_score": float(chosen[1]), "rejected_score": float(rejected[1])}


# ----------------------------------------------------------------------------- sampling
def split_rows(settings: PairSettings, split: str) -> list[dict]:
    """The split's problems as verl rows, with the format instruction: the same rows whatever the
    other splits' sizes (``data.task_rows`` seeds each split alone)."""
    from flwr_verl.engine.data import task_rows, with_format_instruction

    size = settings.split_sizes[split]
    if not size:
        return []
    try:
        rows = task_rows(settings.task, size, settings.seed, split, settings.task_parameters)
    except Exception as error:  # reasoning-gym's own errors: an unknown task or parameter
        raise PairsError(f"--task={settings.task!r} with --task-params={settings.task_params!r}: {error}") from error
    return with_format_instruction(rows, settings.format_instruction)


def scored_replies(settings: PairSettings, model, tokenizer, reward, rows: list[dict], log=print
                   ) -> list[list[tuple[str, float]]]:
    """``settings.samples`` sampled replies to each of ``rows`` with their verifier scores."""
    from flwr_verl.config import RolloutConfig
    from flwr_verl.engine.rollout import generate

    rollout = RolloutConfig(n=settings.samples, temperature=settings.temperature, top_p=settings.top_p,
                            response_length=settings.response_length)
    replies: list[list[tuple[str, float]]] = []
    for start in range(0, len(rows), settings.batch_prompts):
        chunk = rows[start: start + settings.batch_prompts]
        batch = generate(model, tokenizer, chunk, rollout, settings.max_prompt_length)
        scores = reward(batch).sum(-1).tolist()
        lengths = batch.batch["response_mask"].sum(-1).tolist()
        texts = tokenizer.batch_decode([ids[:n] for ids, n in zip(batch.batch["responses"].tolist(), lengths)],
                                       skip_special_tokens=True)
        k = settings.samples
        replies.extend(list(zip(texts[i * k: (i + 1) * k], scores[i * k: (i + 1) * k])) for i in range(len(chunk)))
        log(f"  {len(replies)}/{len(rows)} prompts sampled")
    return replies


def load_reward(settings: PairSettings, tokenizer):
    from flwr_verl.config import DataConfig, RewardConfig
    from flwr_verl.engine.rewards import make_reward_manager, resolve_compute_score

    path, name = settings.reward.rsplit(":", 1) if settings.reward else ("", "compute_score")
    try:
        function = resolve_compute_score(RewardConfig(path=path, name=name), DataConfig(task=settings.task))
    except Exception as error:
        raise PairsError(f"--reward={settings.reward!r} is invalid: {error}") from error
    return make_reward_manager(tokenizer, function)


def load_model(settings: PairSettings):
    """The base model (no adapter) and its tokenizer, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    from flwr_verl.engine.models import load_tokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(Path(settings.model).expanduser(), local_files_only=True,
                                                     dtype=torch.float32)
        tokenizer = load_tokenizer(Path(settings.model).expanduser())
    except (OSError, ValueError, KeyError) as error:
        raise PairsError(f"--model={settings.model!r} is not a loadable Hugging Face causal LM: {error}") from error
    return model.eval(), tokenizer


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_pairs(settings: PairSettings, log=print) -> dict:
    """Sample, label and pair every split; write the three parquet files and ``manifest.json`` into
    ``settings.out``. Returns the manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    model, tokenizer = load_model(settings)
    reward = load_reward(settings, tokenizer)
    conversational = bool(getattr(tokenizer, "chat_template", None))
    out = Path(settings.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"settings": {k: v for k, v in asdict(settings).items() if k != "split_sizes"},
                      "format": "conversational" if conversational else "standard", "splits": {}}
    started = time.perf_counter()
    for split, file_name in SPLIT_FILES.items():
        rows = split_rows(settings, split)
        log(f"{split}: sampling {settings.samples} replies to each of {len(rows)} problems")
        torch.manual_seed(settings.seed * 10 + list(SPLIT_FILES).index(split))  # a split's samples: its own seed
        replies = scored_replies(settings, model, tokenizer, reward, rows, log) if rows else []
        rng = random.Random(f"{settings.seed}-{split}-pairs")
        records = [preference_record(row, chosen, rejected, conversational)
                   for row, scored in zip(rows, replies)
                   for chosen, rejected in pair_replies(scored, settings.right_at, settings.pairs_per_prompt, rng)]
        path = out / file_name
        pq.write_table(pa.Table.from_pylist(records) if records else pa.table({}), path)
        scores = [s for scored in replies for _, s in scored]
        manifest["splits"][split] = {
            "file": file_name, "problems": len(rows), "prompts": len({json.dumps(r["prompt"]) for r in records}),
            "pairs": len(records), "right_share": round(sum(s >= settings.right_at for s in scores) / max(1, len(scores)), 4),
            "sha256": sha256(path)}
        log(f"{split}: {manifest['splits'][split]}")
    manifest["seconds"] = round(time.perf_counter() - started, 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {name: f.default for name, f in PairSettings.__dataclass_fields__.items() if f.init}
    parser.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face causal LM (the base policy)")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the parquet files and manifest")
    helps = {"task": "arithmetic or reasoning_gym:<name>", "task_params": "JSON object of the task's config fields",
             "format_instruction": "appended to each prompt on a new line (as data.format_instruction)",
             "train_prompts": "problems sampled in the train split", "tune_prompts": "... in the tune split",
             "val_prompts": "... in the validation split", "samples": "replies sampled per problem",
             "pairs_per_prompt": "most pairs kept per problem",
             "reward": "verifier PATH:NAME (e.g. pkg://flwr_verl.engine.rewards:final_number_score); "
                       "default: the task's own checker",
             "right_at": "a reply is right when its score is at least this", "batch_prompts": "problems per generate call",
             "threads": "torch threads"}
    for name, default in defaults.items():
        if name in ("model", "out"):
            continue
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{helps.get(name, name.replace('_', ' '))} (default: {default!r})")


def run(args: argparse.Namespace) -> int:
    """Write on-policy preference pairs labelled by the task's verifier (module docstring)."""
    fields = [name for name, f in PairSettings.__dataclass_fields__.items() if f.init]
    try:
        settings = PairSettings(**{name: getattr(args, name) for name in fields})
        manifest = write_pairs(settings, log=lambda line: print(line, flush=True))
    except PairsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{split}: {entry['pairs']} pairs" for split, entry in manifest["splits"].items())
    print(f"wrote {', '.join(SPLIT_FILES.values())} and manifest.json to {settings.out} ({counts})")
    return 0
