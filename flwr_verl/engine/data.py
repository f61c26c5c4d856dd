"""Prompts: verl-format rows from parquet files or a task generator, split across clients.

A row is a dict in verl's data format::

    {"data_source": str,
     "prompt": [{"role": "user", "content": str}, ...],
     "reward_model": {"ground_truth": ...},
     "extra_info": {...}}            # optional

Rows are validated when loaded, so a malformed file fails before any training with the file,
the row number and the missing field in the message.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from flwr_verl import embedded
from flwr_verl.config import ConfigError, DataConfig, DataError

Row = dict[str, Any]
ComputeScore = Callable[..., Any]


# ----------------------------------------------------------------------------- parquet
def validate_row(row: Row, where: str) -> Row:
    """Check one verl-format row; ``where`` ("file.parquet row 3") prefixes any error."""
    prompt = row.get("prompt")
    if prompt is None:
        raise DataError(f"{where}: missing field 'prompt'")
    prompt = list(prompt) if not isinstance(prompt, str) else prompt
    if not prompt or isinstance(prompt, str) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt
    ):
        raise DataError(f"{where}: field 'prompt' must be a non-empty list of {{'role', 'content'}} messages")
    if not isinstance(row.get("data_source"), str):
        raise DataError(f"{where}: missing field 'data_source'")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: missing field 'reward_model.ground_truth'")
    extra_info = row.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: field 'extra_info' must be a mapping")
    return {**row, "prompt": prompt, "extra_info": dict(extra_info)}


def read_parquet_files(files: str) -> Iterator[tuple[Path, list[dict]]]:
    """Each of the comma-separated parquet ``files`` with its records; a missing or unreadable
    file is a ``DataError`` naming it."""
    import pyarrow.parquet as pq

    for name in [f.strip() for f in files.split(",") if f.strip()]:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"{path}: dataset file not found")
        try:
            records = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable parquet file: {error}") from error
        yield path, records


def read_parquet_units(files: str, units_of: Callable[[list[dict], str], list]) -> list:
    """The privacy units of comma-separated parquet ``files``, grouped per file by
    ``units_of(records, path)`` (a stage's own format: ``sft``, ``reward_model``); none is a
    ``DataError``."""
    units = [unit for path, records in read_parquet_files(files) for unit in units_of(records, str(path))]
    if not units:
        raise DataError(f"{files}: no rows")
    return units


def load_parquet_rows(files: str) -> list[Row]:
    """Rows of comma-separated parquet ``files``, validated."""
    rows = [validate_row(record, f"{path} row {index}")
            for path, records in read_parquet_files(files) for index, record in enumerate(records)]
    if not rows:
        raise DataError(f"{files}: no rows")
    return rows


# ----------------------------------------------------------------------------- TRL's formats (stages sft, reward_model)
def trl_response(value, where: str, field: str) -> str:
    """A TRL-format response ``field`` as text: a string, or a list of messages whose contents are
    joined; ``where`` ("file.parquet row 3") prefixes any error."""
    if isinstance(value, str):
        return value
    messages = list(value) if value is not None and not isinstance(value, (str, dict)) else None
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise DataError(f"{where}: field {field!r} must be a string or a non-empty list of "
                        "{'role', 'content'} messages")
    return "".join(m["content"] for m in messages)


def trl_prompt(value, where: str) -> list[dict]:
    """A TRL-format ``prompt`` as messages: a non-empty string (one user message) or a list of
    {'role', 'content'} messages."""
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    messages = list(value) if value is not None and not isinstance(value, (str, dict)) else None
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m
                               for m in messages):
        raise DataError(f"{where}: field 'prompt' must be a non-empty string or a non-empty list of "
                        "{'role', 'content'} messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# ----------------------------------------------------------------------------- task generators
def task_rows(task: str, size: int, seed: int, split: str, params: dict[str, Any] | None = None) -> list[Row]:
    """``size`` rows of ``split`` from a task generator; the splits never share a problem.
    ``params`` (``data.task_params``) are a reasoning-gym task's config fields."""
    embedded.check_split(split)
    if task == "arithmetic":
        return embedded.arithmetic_rows(size, seed, split)
    name = task.removeprefix("reasoning_gym:")
    return [
        {
            "data_source": f"reasoning_gym/{name}",
            "prompt": [{"role": "user", "content": entry["question"]}],
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            # reasoning-gym scores an answer against its whole entry (answer and metadata).
            "extra_info": {"split": split, "index": index, "reasoning_gym_entry": dict(entry)},
        }
        for index, entry in enumerate(reasoning_gym_entries(name, size, seed, split, params))
    ]


REASONING_GYM_ATTEMPTS = 20  # generator calls per split before a task counts as too small


def reasoning_gym_entries(name: str, size: int, seed: int, split: str,
                          params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``size`` distinct entries of reasoning-gym task ``name`` whose question hashes to ``split``.

    reasoning-gym draws problems at random from a seed, so every split comes from the same
    generator: a split keeps only the entries its hash selects, and asks for more (with fresh
    seeds) until it has ``size`` distinct questions."""
    try:
        import reasoning_gym
    except ImportError as error:
        raise DataError(f"data.task='reasoning_gym:{name}' needs the 'reasoning-gym' package: "
                        "pip install reasoning-gym") from error
    share = embedded.SPLIT_FRACTIONS[split]
    chunk = max(16, int(size / share * 1.2))  # one call is usually enough
    kept: dict[str, dict[str, Any]] = {}
    for attempt in range(REASONING_GYM_ATTEMPTS):
        try:
            # reasoning-gym seeds entry i with seed + i: attempts ``chunk`` seeds apart share no entry.
            dataset = reasoning_gym.create_dataset(name, size=chunk, seed=seed * 1_000_003 + attempt * chunk,
                                                   **(params or {}))
        except (TypeError, AssertionError, ValueError) as error:  # reasoning-gym's config dataclass and its checks
            raise DataError(f"data.task_params={json.dumps(params)!r} for reasoning_gym:{name}: {error}") from error
        for entry in dataset:
            if len(kept) < size and embedded.split_of(entry["question"]) == split:
                kept.setdefault(entry["question"], entry)
        if len(kept) == size:
            return list(kept.values())
    raise DataError(
        f"data.task='reasoning_gym:{name}': found only {len(kept)} distinct {split!r} problems of the "
        f"{size} needed in {REASONING_GYM_ATTEMPTS * chunk} generated; the task's problem space is too "
        f"small for data.train_size/val_size: lower them"
    )


def task_compute_score(task: str) -> ComputeScore:
    """The scorer that belongs to a task generator (verl's reward contract)."""
    if task == "arithmetic":
        return embedded.compute_score
    return reasoning_gym_compute_score


def reasoning_gym_compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """reasoning-gym's own checker for the entry a row was generated from."""
    import reasoning_gym

    entry = extra_info["reasoning_gym_entry"]
    score_answer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(score_answer(solution_str, entry))


# ----------------------------------------------------------------------------- splitting
def partition_rows(rows: list[Row], partition_id: int, num_partitions: int, config: DataConfig, seed: int,
                   source: str = "rows") -> list[Row]:
    """This client's share of ``rows``, through flwr-datasets' partitioners.

    ``iid``: a uniform random split. ``dirichlet``: label skew over the values of the row
    field ``data.partition_by`` (dotted paths reach into dicts), with concentration
    ``data.dirichlet_alpha``; smaller alpha gives more skew. ``source`` (the files) names the
    data in errors.
    """
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id={partition_id} must be in [0, num-partitions={num_partitions})")
    if len(rows) < num_partitions:
        raise DataError(f"{source}: {len(rows)} rows cannot be split into num-partitions={num_partitions} "
                        "partitions: every partition needs at least one row")
    if num_partitions == 1:
        return list(rows)
    labels = [str(_field(row, config.partition_by)) for row in rows]
    index = Dataset.from_dict({"row": list(range(len(rows))), "label": labels})
    if config.partition == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
        index = index.shuffle(seed=seed)
    else:
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions, partition_by="label", alpha=config.dirichlet_alpha,
            min_partition_size=1, self_balancing=True, seed=seed,
        )
    partitioner.dataset = index
    return [rows[i] for i in partitioner.load_partition(partition_id)["row"]]


def _field(row: Row, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"data.partition_by={dotted!r}: rows have no field {dotted!r}")
        value = value[part]
    return value


def load_rows(config: DataConfig, split: str, seed: int, partition_id: int = 0, num_partitions: int = 1) -> list[Row]:
    """One client's rows for ``split`` ("train", "tune" or "val").

    Task generators make the pooled set (``size * num_partitions`` rows of the split, seeded by the
    run seed; "tune" is as large as "val") and split it like a file; their splits are disjoint by
    construction. Parquet data has train and val files only ("tune" is empty); validation prompts
    that also appear in the training files are counted in a warning."""
    embedded.check_split(split)
    if config.train_files:
        source = {"train": config.train_files, "val": config.val_files}.get(split, "")
        if not source:  # no validation (or tune) file: no held-out prompts
            return []
        rows = load_parquet_rows(source)
        if split == "val":
            warn_on_overlap(rows, load_parquet_rows(config.train_files), source, config.train_files)
    else:
        size = config.train_size if split == "train" else config.val_size
        if size == 0:
            return []
        source = f"data.task={config.task!r}"
        rows = with_format_instruction(task_rows(config.task, size * num_partitions, seed, split,
                                                 config.task_parameters()),
                                       config.format_instruction)
    return partition_rows(rows, partition_id, num_partitions, config, seed, source=source)


def with_format_instruction(rows: list[Row], instruction: str) -> list[Row]:
    """``rows`` with ``instruction`` (``data.format_instruction``) appended to each prompt's last
    message, on a new line: it tells the model how to state its answer, in the form the task's
    scorer reads (reasoning-gym's scorers compare the whole response with the answer)."""
    if not instruction:
        return rows
    return [{**row, "prompt": [*row["prompt"][:-1],
                               {**row["prompt"][-1], "content": f"{row['prompt'][-1]['content']}\n{instruction}"}]}
            for row in rows]


def load_stage_units(config: DataConfig, split: str, seed: int, partition_id: int, num_partitions: int, *,
                     stage: str, read_files: Callable[[str], list], arithmetic: Callable[[int, int, str], list],
                     file_format: str) -> list:
    """One client's privacy units of ``split`` for a stage with a data format of its own (``sft``,
    ``reward_model``): read from the split's parquet files by ``read_files``, or made by
    ``arithmetic(count, seed, split)`` from the embedded task (``size * num_partitions`` of them,
    disjoint splits by construction); partitioned as prompts are (``load_rows``). Each unit has
    a ``data_source``, which ``data.partition_by`` may skew on. ``file_format`` names the parquet
    format in the error for another task."""
    embedded.check_split(split)
    if config.train_files:
        source = {"train": config.train_files, "val": config.val_files}.get(split, "")
        if not source:
            return []
        units = read_files(source)
    else:
        if config.task != "arithmetic":
            raise ConfigError(f"data.task={config.task!r} has no data under stage={stage!r}; allowed: arithmetic, "
                              f"or set data.train_files to {file_format} parquet")
        size = config.train_size if split == "train" else config.val_size
        if size == 0:
            return []
        source = f"data.task={config.task!r}"
        units = arithmetic(size * num_partitions, seed, split)
    rows = [{"data_source": unit.data_source, "unit": unit} for unit in units]
    return [row["unit"] for row in partition_rows(rows, partition_id, num_partitions, config, seed, source=source)]


def warn_on_overlap(val_rows: list[Row], train_rows: list[Row], val_files: str, train_files: str) -> int:
    """Warn when validation prompts also appear in the training files: such a figure is not
    held-out. Returns the number of distinct shared prompts."""
    shared = {_prompt_key(row) for row in val_rows} & {_prompt_key(row) for row in train_rows}
    if shared:
        distinct = len({_prompt_key(row) for row in val_rows})
        warnings.warn(f"{len(shared)} of {distinct} distinct validation prompts in {val_files} also appear in "
                      f"the training files {train_files}: the validation figures are not held-out", stacklevel=3)
    return len(shared)


def _prompt_key(row: Row) -> str:
    return json.dumps(row["prompt"], sort_keys=True)


def prompt_text(row: Row, tokenizer) -> str:
    """The prompt as the model sees it: the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    return (tokenizer.bos_token or "") + "\n".join(message["content"] for message in row["prompt"])
