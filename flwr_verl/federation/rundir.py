"""The run directory: one run's outputs, its checkpoints, and the records resume reconciles.

    <output-dir>/<run-id>/
      config.json                  the validated run config
      metrics.jsonl                one JSON object per round (round 0: the initial adapter's evaluation)
      adapters/round-NNNN/policy/  the global adapter, a PEFT directory (PeftModel.from_pretrained)
      adapters/round-NNNN/server_state.{safetensors,json}   the strategy's state_dict (``checkpoint.py``)
      adapters/final/              the last round's adapter
      progress.png                 reward, KL and epsilon per round

A checkpoint is written to a temporary directory, synced to disk and renamed into place, so a
server killed mid-save leaves the previous one intact. ``metrics.jsonl`` lines are appended and
synced.

Resume continues the newest run that saved a round (it has ``adapters/``) and never writes over
anything it did not verify. It checks the config, then looks for the newest checkpoint whose
hash verifies; only then does it write anything:

- newer checkpoints that failed verification are moved aside, not replaced, to
  ``adapters/round-NNNN.damaged-<time>``, with a WARNING naming each, and their rounds run again;
- ``metrics.jsonl`` is rewritten to hold rounds 0..N of that checkpoint once each (later rounds
  are dropped and run again; a torn last line is dropped; the checkpoint's own round is restored
  if the kill came between saving it and appending it).

With no checkpoint that verifies it refuses (``CheckpointError``) before any client trains,
changing nothing: the error names each damaged file and the ways on, a new run (``resume=false``
or a new ``output-dir``), started from the newest saved policy adapter that loads
(``model.init_adapter``) when there is one.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
import shutil
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.common import log
from safetensors import SafetensorError
from safetensors.torch import load_file

from flwr_verl.config import ConfigError, RunConfig
from flwr_verl.engine.models import AdapterSet
from flwr_verl.federation.checkpoint import CheckpointError, load_state, save_state

# What a resumed run may change: how long it runs, where it writes, how often it evaluates and
# saves, how long it waits, and whether evaluations overlap the next round. Everything else
# changes what is trained or what it spends.
RESUMABLE_CHANGES = frozenset({
    "federation.num_server_rounds", "federation.output_dir", "federation.resume", "federation.evaluate_every",
    "federation.save_every", "federation.connect_timeout", "federation.fit_timeout", "federation.evaluate_timeout",
    "federation.overlap_evaluation", "federation.inject_failure_partition", "federation.secagg.timeout",
    "engine.trainer.num_threads",
})


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


ROUND_DIR = re.compile(r"round-(\d{4,})")  # what ``save`` names; a moved-aside damaged one does not match


def fingerprint(arrays: list[np.ndarray]) -> str:
    """A short sha256 of adapter arrays (as float32), to show in logs which adapter a run holds."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]


def _loads_as_adapter(directory: Path) -> bool:
    """Whether ``directory`` parses as a PEFT adapter (config JSON, complete safetensors)."""
    try:
        json.loads((directory / "adapter_config.json").read_text())
        load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError):
        return False
    return True


class RunDirectory:
    """Writes one run's outputs and finds the checkpoint to resume from."""

    def __init__(self, path: Path, adapters: AdapterSet) -> None:
        self.path = path
        self.adapters = adapters
        self.resumed: dict | None = None  # the checkpoint state a resumed run continues from
        self.path.mkdir(parents=True, exist_ok=True)

    @classmethod
    def create(cls, output_dir: str, adapters: AdapterSet, config: RunConfig) -> RunDirectory:
        """The newest run under ``output_dir`` when resuming, its config checked against
        ``config`` and its newest verified checkpoint in ``resumed`` (or ``CheckpointError``),
        else a new run directory with a unique name."""
        root = Path(output_dir).expanduser().resolve()
        if config.federation.resume:
            runs = sorted(p for p in root.glob("run-*") if (p / "adapters").is_dir()) if root.is_dir() else []
            if runs:
                run = cls(runs[-1], adapters)
                changes = run.check_resumed_config(config)
                run.resumed = run.last_checkpoint()
                run.record_config_changes(changes)
                return run
            log(INFO, "resume: no earlier run under %s, starting a new one", root)
        root.mkdir(parents=True, exist_ok=True)
        while True:  # microseconds order the names; exist_ok=False makes two servers never share one
            path = root / datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S-%f")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        run = cls(path, adapters)
        (run.path / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
        return run

    def check_resumed_config(self, config: RunConfig) -> dict[str, tuple]:
        """A resumed run must train what it trained before: a change to any key but rounds,
        output, cadences and deadlines is one ``ConfigError`` naming every changed key. Returns
        the allowed changes, ``{key: (before, now)}``; it writes nothing."""
        saved_file = self.path / "config.json"
        try:
            saved = _flat(json.loads(saved_file.read_text()))
        except (OSError, ValueError) as error:
            raise ConfigError(f"resume: {saved_file} is unreadable ({error}); cannot check that the run's "
                              "config is unchanged") from error
        now = _flat(dataclasses.asdict(config))
        changed = {key: (saved.get(key), now.get(key)) for key in saved.keys() | now.keys()
                   if saved.get(key) != now.get(key)}
        forbidden = sorted(key for key in changed if key not in RESUMABLE_CHANGES)
        if forbidden:
            raise ConfigError("resume: the run in {} was trained with a different config; changed: {}. Only {} may "
                              "change on resume: start a new run (resume=false) to train with the new values".format(
                                  self.path, "; ".join(f"{k} {changed[k][0]!r} -> {changed[k][1]!r}" for k in forbidden),
                                  ", ".join(sorted(RESUMABLE_CHANGES))))
        return changed

    def record_config_changes(self, changed: dict[str, tuple]) -> None:
        """Log the allowed changes and append them to ``config_changes.jsonl``."""
        if changed:
            log(INFO, "resume: config changes recorded: %s",
                "; ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))
            with open(self.path / "config_changes.jsonl", "a") as handle:
                handle.write(json.dumps({"time": time.time(), "changes": {k: list(v) for k, v in changed.items()}})
                             + "\n")

    def checkpoints(self) -> list[Path]:
        """Saved round directories, oldest first, verified or not (``load_state`` verifies)."""
        found = [(int(m[1]), p) for p in self.path.glob("adapters/round-*") if (m := ROUND_DIR.fullmatch(p.name))]
        return [p for _, p in sorted(found)]

    def last_checkpoint(self) -> dict:
        """The state of the newest checkpoint that verifies, to resume from (module docstring):
        newer damaged ones are moved aside and ``metrics.jsonl`` is reconciled with it. With
        none that verifies, a ``CheckpointError`` saying how to go on, and nothing changed."""
        damaged: list[tuple[Path, CheckpointError]] = []
        for directory in reversed(self.checkpoints()):
            try:
                state = load_state(directory)
            except CheckpointError as error:
                damaged.append((directory, error))
                continue
            self.reconcile_metrics(int(state["round"]), state["last_round"] or None)
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            for bad, error in damaged:
                aside = bad.with_name(f"{bad.name}.damaged-{stamp}")
                os.replace(bad, aside)
                log(WARNING, "resume: %s failed verification (%s); moved aside to %s, its round runs again from "
                    "%s", bad, error, aside, directory.name)
            return state
        raise CheckpointError(self._no_checkpoint(damaged))

    def _no_checkpoint(self, damaged: list[tuple[Path, CheckpointError]]) -> str:
        """Why resume cannot continue this run, and the ways on (a new run, from the adapter that loads)."""
        why = ("; ".join(str(error) for _, error in damaged) if damaged
               else f"no round was checkpointed ({self.path / 'adapters'} holds no round-NNNN)")
        ways = f"start a new run instead: resume=false (a new run directory under {self.path.parent}) or a new output-dir"
        loads = next((d / "policy" for d, _ in damaged if _loads_as_adapter(d / "policy")), None)
        if loads:
            ways += (f"; to start it from the adapter saved in {loads.parent.name}, whose policy adapter loads (its "
                     f"files carry no hash: they parse), also set model.init_adapter={loads}; the nodes' privacy "
                     "ledgers keep what this run spent")
        return (f"resume: {self.path} has no checkpoint that verifies: {why}. Nothing in it was changed and no "
                f"client trained; {ways}")

    def save(self, state: dict, final: bool) -> str:
        """Write the checkpoint of ``state`` (a strategy's ``state_dict()``) atomically; return
        the adapter's fingerprint."""
        arrays = [w.numpy().astype(np.float32) for w in state["weights"]]
        self.adapters.set_arrays(arrays)
        adapters = self.path / "adapters"
        target = adapters / f"round-{int(state['round']):04d}"
        self._atomic(target, lambda tmp: (self.adapters.save(tmp), save_state(tmp, state)))
        if final:
            self._atomic(adapters / "final", lambda tmp: shutil.copytree(target, tmp, dirs_exist_ok=True))
        return fingerprint(arrays)

    def finalize(self) -> None:
        """``adapters/final`` := the newest checkpoint (when a run stops before its last round)."""
        if checkpoints := self.checkpoints():
            self._atomic(self.path / "adapters" / "final",
                         lambda tmp: shutil.copytree(checkpoints[-1], tmp, dirs_exist_ok=True))

    @staticmethod
    def _atomic(target: Path, write) -> None:
        tmp = target.with_name(f".{target.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write(tmp)
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)

    def append_metrics(self, record: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def records(self) -> list[dict]:
        """The records of ``metrics.jsonl``; a torn last line (a kill during an append) is left out,
        with a warning."""
        path = self.path / "metrics.jsonl"
        lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        records = []
        for number, line in enumerate(lines, start=1):
            try:
                records.append(json.loads(line))
            except ValueError:
                if number < len(lines):
                    raise CheckpointError(f"{path} line {number} is not JSON, and it is not the last line: the "
                                          "file was damaged, not torn by a kill; repair or remove it") from None
                log(WARNING, "%s: dropping a torn last line (%s characters)", path, len(line))
        return records

    def reconcile_metrics(self, done: int, record: dict | None) -> None:
        """Make ``metrics.jsonl`` hold exactly rounds 0..done once each, as the checkpoint saw them."""
        before = self.records()
        kept = {r["round"]: r for r in before if r.get("round", 0) <= done}
        if record is not None:
            kept[done] = {**kept.get(done, {}), **record}
        if missing := [r for r in range(1, done + 1) if r not in kept]:
            log(WARNING, "resume: metrics.jsonl has no record of round(s) %s, which the round-%s checkpoint "
                "completed; their metrics are lost (the adapter and privacy ledger are not)", missing, done)
        if [kept[r] for r in sorted(kept)] != before:
            log(INFO, "resume: metrics.jsonl reconciled with the round-%s checkpoint (%s records kept, %s before)",
                done, len(kept), len(before))
        tmp = self.path / ".metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(kept[r]) + "\n" for r in sorted(kept)))
        os.replace(tmp, self.path / "metrics.jsonl")

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        if not records:
            return
        panels = [("reward", [("reward_after", "fit"), ("reward", "evaluate")]), ("kl", [("kl", "fit")]),
                  ("epsilon in this run", [("epsilon_run", "fit")])]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        for axis, (title, series) in zip(axes, panels):
            for key, part in series:
                points = [(r["round"], r[part][key]) for r in records if key in r.get(part, {})]
                axis.plot([x for x, _ in points], [y for _, y in points], marker="o", label=f"{part} {key}")
            axis.set_title(title)
            axis.set_xlabel("round")
            axis.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.path / "progress.png", dpi=90)
        plt.close(fig)
