"""Honest evaluation: train / tune / val never share a problem, for any seed or client count;
parquet overlap is reported; the shipped embedded model is checked, its build is deterministic and
sees train problems only."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flwr_verl import embedded
from flwr_verl.config import DataConfig, FlwrVerlError
from flwr_verl.engine.data import DataError, load_rows

CLIENTS = 3
TASKS = ["arithmetic", "reasoning_gym:chain_sum"]


def prompts(rows) -> set[str]:
    return {row["prompt"][0]["content"] for row in rows}


def pooled(config: DataConfig, split: str, seed: int) -> set[str]:
    """The prompts of ``split`` over all clients of a federation of CLIENTS."""
    return prompts([row for k in range(CLIENTS) for row in load_rows(config, split, seed, k, CLIENTS)])


# ----------------------------------------------------------------------------- task generators
@pytest.mark.parametrize("task", TASKS)
def test_splits_pooled_over_clients_share_no_prompt(task):
    if task.startswith("reasoning_gym"):
        pytest.importorskip("reasoning_gym")
    config = DataConfig(task=task, train_size=64, val_size=16)
    seen = {split: pooled(config, split, seed=0) for split in embedded.SPLITS}
    assert len(seen["train"]) > 100 and len(seen["tune"]) > 20 and len(seen["val"]) > 20
    assert not seen["train"] & seen["val"]
    assert not seen["train"] & seen["tune"]
    assert not seen["tune"] & seen["val"]


def test_arithmetic_splits_are_disjoint_across_seeds_and_commuted_operands():
    config = DataConfig(train_size=512, val_size=64)
    train = pooled(config, "train", seed=0) | pooled(config, "train", seed=7)
    val = pooled(config, "val", seed=3)
    assert not train & val
    commuted = {"+".join(reversed(p.rstrip("=").split("+"))) + "=" for p in val}
    assert not train & commuted  # b+a is the same fact as a+b: never one in train, one in val


def test_every_arithmetic_problem_has_exactly_one_split():
    parts = [set(embedded.split_problems(split)) for split in embedded.SPLITS]
    top = embedded.RECIPE["max_operand"]
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == (top + 1) ** 2
    val_share = len(parts[2]) / (top + 1) ** 2
    assert abs(val_share - embedded.SPLIT_FRACTIONS["val"]) < 0.03


def test_arithmetic_rows_repeat_problems_only_past_the_split_size():
    size = len(embedded.split_problems("val"))
    assert len(prompts(embedded.arithmetic_rows(size, seed=0, split="val"))) == size
    assert len(prompts(embedded.arithmetic_rows(size + 10, seed=0, split="val"))) == size


def test_rows_are_deterministic_in_the_seed():
    config = DataConfig(train_size=32, val_size=8)
    assert load_rows(config, "val", 5, 1, CLIENTS) == load_rows(config, "val", 5, 1, CLIENTS)
    assert load_rows(config, "train", 5) != load_rows(config, "train", 6)


def test_unknown_split_is_a_data_error():
    with pytest.raises(DataError, match="split='test'"):
        load_rows(DataConfig(), "test", seed=0)
    assert issubclass(DataError, FlwrVerlError)


def test_reasoning_gym_task_too_small_is_a_clear_error(monkeypatch):
    reasoning_gym = pytest.importorskip("reasoning_gym")
    monkeypatch.setattr(reasoning_gym, "create_dataset",
                        lambda name, size, seed: [{"question": f"q{i}", "answer": "1"} for i in range(5)])
    with pytest.raises(DataError, match=r"reasoning_gym:tiny.*only \d+ distinct 'train' problems.*too small"):
        load_rows(DataConfig(task="reasoning_gym:tiny", train_size=50), "train", seed=0)



def test_reasoning_gym_attempts_draw_fresh_problems(monkeypatch):
    """reasoning-gym seeds entry i with seed + i; a later attempt must not redraw the earlier ones."""
    reasoning_gym = pytest.importorskip("reasoning_gym")
    monkeypatch.setattr(reasoning_gym, "create_dataset",  # 16 entries a call, as from a slow generator
                        lambda name, size, seed: [{"question": f"q{seed + i}", "answer": "1"} for i in range(16)])
    rows = load_rows(DataConfig(task="reasoning_gym:few_per_call", val_size=10), "val", seed=0)
    assert len({row["prompt"][0]["content"] for row in rows}) == 10


# ----------------------------------------------------------------------------- parquet files
@pytest.fixture()
def write_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write(rows, name):
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)

    return write


def test_parquet_validation_prompts_in_training_files_are_counted_in_a_warning(write_parquet):
    train = embedded.arithmetic_rows(20, seed=0, split="train")
    val = train[:3] + embedded.arithmetic_rows(5, seed=0, split="val")
    config = DataConfig(train_files=write_parquet(train, "train.parquet"), val_files=write_parquet(val, "val.parquet"))
    with pytest.warns(UserWarning, match=r"3 of 8 distinct validation prompts .*val.parquet"):
        assert len(load_rows(config, "val", seed=0)) == 8
    assert load_rows(config, "tune", seed=0) == []


def test_disjoint_parquet_files_load_without_warning(write_parquet):
    config = DataConfig(train_files=write_parquet(embedded.arithmetic_rows(8, 0, "train"), "train.parquet"),
                        val_files=write_parquet(embedded.arithmetic_rows(4, 0, "val"), "val.parquet"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(load_rows(config, "val", seed=0)) == 4


def test_fewer_rows_than_partitions_names_file_rows_and_partitions(write_parquet):
    path = write_parquet(embedded.arithmetic_rows(2, seed=0), "small.parquet")
    with pytest.raises(DataError, match=r"small.parquet: 2 rows cannot be split into num-partitions=3"):
        load_rows(DataConfig(train_files=path), "train", seed=0, partition_id=0, num_partitions=3)


def test_clients_evaluate_on_the_tune_split_only_when_asked(tiny_config):
    """``data.eval_split="tune"`` (choosing settings) evaluates on tune rows, never on val ones;
    parquet data has no tune split, which the config refuses."""
    from flwr.app import Context, RecordDict

    from flwr_verl.config import ConfigError
    from flwr_verl.federation.client import client_from_context

    def evaluated(eval_split: str) -> set[str]:
        node = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 1},
                       state=RecordDict(), run_config={})
        return prompts(client_from_context(node, tiny_config(data={"eval_split": eval_split})).val_rows)

    config = tiny_config().data
    assert evaluated("val") == prompts(load_rows(config, "val", seed=0))
    assert evaluated("tune") == prompts(load_rows(config, "tune", seed=0)) and not evaluated("tune") & evaluated("val")
    with pytest.raises(ConfigError, match=r"data\.eval_split='tune' is invalid: 'tune' needs a task generator"):
        DataConfig(train_files="train.parquet", eval_split="tune")
    with pytest.raises(ConfigError, match=r"data\.eval_split='test' is invalid: allowed: val, tune"):
        DataConfig(eval_split="test")


# ----------------------------------------------------------------------------- the embedded build
def test_warm_start_sees_only_train_split_problems():
    recipe = {**embedded.RECIPE, "warm_start_steps": 40}
    batches = list(embedded.warm_start_batches(recipe))
    assert len(batches) == 40 and all(len(b) == recipe["warm_start_batch_size"] for b in batches)
    train = set(embedded.split_problems("train"))
    assert all(problem in train for batch in batches for problem in batch)


# The real build path (``build_embedded_model``: its own process, portable kernels) with a short
# warm start (40 of its steps): determinism does not depend on how many steps run.
BUILD = """
import json, sys, torch
from pathlib import Path
torch.set_num_threads(int(sys.argv[1]))
from flwr_verl import embedded
embedded.build_embedded_model(Path(sys.argv[2]), json.loads(sys.argv[3]))
assert torch.get_num_threads() == int(sys.argv[1]) and not torch.are_deterministic_algorithms_enabled()
"""
# The 40-step build's weights, recorded on 2026-12-02 on an AMD EPYC with AVX-512 and no AMX (torch
# 2.13.0, transformers 5.10.4), and reproduced on AVX2. A Xeon with AMX builds other bits: its
# oneDNN kernels are not pinned by PORTABLE_KERNELS. That is why the built model ships with the
# package: every machine runs the shipped bits, whoever can rebuild them.
BUILD_40_STEPS_SHA256 = "a160fef159069a4afbb6a5a6c63118e0be73322c5ce83949891bd6187f337526"


def build_in_fresh_process(out: Path, threads: int, recipe: dict, **env) -> str:
    env = {**os.environ, **env}
    result = subprocess.run([sys.executable, "-c", BUILD, str(threads), str(out), json.dumps(recipe)], env=env,
                            capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    return result.stderr


def weights_digest(model_dir: Path) -> str:
    from safetensors.torch import load_file

    weights = load_file(model_dir / "model.safetensors")
    return hashlib.sha256(b"".join(name.encode() + weights[name].numpy().tobytes() for name in sorted(weights))
                          ).hexdigest()


def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def unpinned_kernels_here() -> str:
    """The CPU features whose kernels the build does not pin (AMX), if this CPU has any."""
    return " ".join(sorted(flag for flag in cpu_flags() if flag.startswith("amx")))


def test_the_shipped_model_is_what_every_node_loads_checked_against_its_manifest(tmp_path, monkeypatch):
    manifest = embedded.read_manifest()
    assert manifest["recipe"] == embedded.RECIPE and "model.safetensors" in manifest["files"]
    assert embedded.embedded_model_path() == embedded.SHIPPED
    assert embedded.verify_model_dir(embedded.SHIPPED, manifest["files"]) is None
    assert sorted(p.name for p in embedded.SHIPPED.iterdir() if p.is_file()) == sorted([*manifest["files"],
                                                                                        embedded.MANIFEST])
    # A Flower app's FAB copy of the package holds no weights: the installed copy is found and checked.
    fab = tmp_path / "fab" / embedded.model.SHIPPED_IN_PACKAGE
    fab.mkdir(parents=True)
    shutil.copy(embedded.SHIPPED / embedded.MANIFEST, fab)
    installed = tmp_path / "site" / embedded.model.SHIPPED_IN_PACKAGE
    shutil.copytree(embedded.SHIPPED, installed)
    monkeypatch.setattr(embedded.model, "SHIPPED", fab)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "fab"), str(tmp_path / "site")])
    monkeypatch.setattr(embedded.model, "DISTRIBUTION", "no-such-distribution")
    assert embedded.embedded_model_path() == installed
    # An altered file is refused, naming it.
    weights = bytearray((installed / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (installed / "model.safetensors").write_bytes(bytes(weights))
    with pytest.raises(embedded.EmbeddedModelError, match=r"model\.safetensors has sha256 [0-9a-f]{64}, the manifest"):
        embedded.embedded_model_path()
    monkeypatch.setattr(embedded.model, "RECIPE", {**embedded.RECIPE, "warm_start_steps": 1})
    with pytest.raises(embedded.EmbeddedModelError, match="another recipe.*python -m flwr_verl.embedded"):
        embedded.embedded_model_path()


@pytest.mark.slow
def test_embedded_build_is_bit_identical_across_thread_counts_and_cpus_and_says_what_it_does(tmp_path):
    """Torch's vector kernels (AVX-512, AVX2) and MKL's code paths round float sums differently;
    the build's own process runs portable ones, whatever the caller's threads and kernels. The
    full recipe rebuilds the shipped bits (``python -m flwr_verl.embedded``), except on CPUs with
    AMX, whose kernels the build does not pin: there the check is an expected failure, and every
    node still runs the shipped model."""
    short = {**embedded.RECIPE, "warm_start_steps": 40}
    log = build_in_fresh_process(tmp_path / "one", 1, short)
    build_in_fresh_process(tmp_path / "two", 2, short, ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2")
    assert weights_digest(tmp_path / "one") == weights_digest(tmp_path / "two")
    assert "building the embedded model" in log and "built the embedded model in" in log
    # The short build decides first: where it already differs on an AMX CPU, so would the full one
    # (five minutes of one core), which is then not run.
    if weights_digest(tmp_path / "one") != BUILD_40_STEPS_SHA256 and unpinned_kernels_here():
        pytest.xfail(f"this CPU ({unpinned_kernels_here()}) builds other bits than the shipped model: its AMX "
                     "kernels are not pinned; every node loads the shipped model, not a local build")
    assert weights_digest(tmp_path / "one") == BUILD_40_STEPS_SHA256, (
        "this machine builds another 40-step model than the one recorded: a different torch or transformers "
        "(their weight init), or kernels that PORTABLE_KERNELS do not pin")
    build_in_fresh_process(tmp_path / "full", 1, embedded.RECIPE)
    rebuilt = {n: embedded.file_sha256(tmp_path / "full" / n) for n in embedded.read_manifest()["files"]}
    assert rebuilt == embedded.read_manifest()["files"], "the recipe no longer rebuilds the shipped model"
