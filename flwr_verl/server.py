"""The server workflow: Flower's ``DefaultWorkflow`` with SecAgg+, plus a run directory.

``run_server`` is what the bundled ServerApp calls. It validates the run config, builds the
initial global adapter (the same seeded LoRA init every client builds), and runs
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` on a ``LegacyContext``, so the
strategy only ever receives the securely aggregated update. ``RoundLoop`` supplies the fit and
evaluate steps of each round: before the first round it evaluates the initial adapter on the
clients' held-out prompts (round 0); after each aggregated round it writes the checkpoint at
once, before evaluating, then appends the round's record.

The run directory::

    <output-dir>/<run-id>/
      config.json                  the validated run config
      metrics.jsonl                one JSON object per round (round 0: the initial adapter's evaluation)
      adapters/round-NNNN/policy/  the global adapter, a PEFT directory (PeftModel.from_pretrained)
      adapters/round-NNNN/server_state.{safetensors,json}   the strategy's state_dict, for resume
      adapters/final/              the last round's adapter
      progress.png                 reward, KL and epsilon per round

With ``resume = true`` it continues the newest run under ``output-dir`` from its newest intact
checkpoint: the global adapter (exactly, from the float64 weights), the server optimizer, the
privacy ledger and the exhausted clients are restored (``strategy.load_state_dict``), so no
round is repeated or lost and epsilon keeps counting. A checkpoint is written to a temporary
directory, synced to disk and renamed into place, so a server killed mid-save leaves the
previous one intact; one that fails its hash check is skipped with a warning. ``metrics.jsonl``
is reconciled with the checkpoint on resume (rounds after it are dropped and run again; the
checkpoint's own round is restored if the kill came between saving it and appending it).

How a run ends:

- normally, after ``num-server-rounds`` rounds;
- normally, earlier, when too few clients can train within their privacy budgets
  (``StopFederation``): ``adapters/final`` is the last completed round;
- as failed, with one ERROR line, on a ``FlwrVerlError``: a bad config or model before any
  training, or a round that could not be completed (``RoundFailed``: every client failed, or
  SecAgg+ lost more clients than its reconstruction threshold allows). The run directory keeps
  the adapter of the last completed round; ``resume = true`` continues from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.common import log
from flwr.server import Grid, LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.server.workflow.default_workflows import default_evaluate_workflow, default_fit_workflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from flwr_verl.checkpoint import MANIFEST, CheckpointError, load_state, save_state
from flwr_verl.config import FederationConfig, RunConfig, parse_run_config
from flwr_verl.models import AdapterSet, build_models
from flwr_verl.protocol import SecAggBounds
from flwr_verl.secagg import derive_parameters
from flwr_verl.strategy import FedProxAdapters, RoundFailed, StopFederation, describe_failures


def fingerprint(arrays: list[np.ndarray]) -> str:
    """A short sha256 of adapter arrays (as float32), to show in logs which adapter a run holds."""
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]


class CheckedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow, except that a halted protocol raises ``RoundFailed``.

    Flower only logs "Secure aggregation halted." and goes on to the next round, so a round
    that lost more clients than the reconstruction threshold allows would pass silently. Here
    it ends the run with the stage, the number of clients left, the threshold and every
    client's reason; the global adapter is left as it was.
    """

    STAGES = ("setup", "share keys", "collect masked vectors", "unmask")

    def __call__(self, grid: Grid, context: LegacyContext) -> None:
        state = WorkflowState()
        steps = (self.setup_stage, self.share_keys_stage, self.collect_masked_vectors_stage, self.unmask_stage)
        log(INFO, "Secure aggregation commencing.")
        for stage, step in zip(self.STAGES, steps):
            if not step(grid, context, state):
                log(INFO, "Secure aggregation halted.")
                raise RoundFailed(self._halted(context, state, stage))
        log(INFO, "Secure aggregation completed.")

    @staticmethod
    def _halted(context: LegacyContext, state: WorkflowState, stage: str) -> str:
        current = int(context.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])
        round_number = context.strategy.round_number(current)
        sampled = len(state.sampled_node_ids)
        if not sampled:
            return f"round {round_number}: secure aggregation halted at stage '{stage}': too few clients sampled"
        reasons = "; ".join(describe_failures(state.failures)) or "no reply before secagg.timeout"
        return (f"round {round_number}: secure aggregation halted at stage '{stage}': "
                f"{len(state.active_node_ids)} of {sampled} sampled clients still taking part, fewer than the "
                f"reconstruction threshold {state.threshold} allows. Client failures: {reasons}")


class RunDirectory:
    """Writes one run's outputs and finds the checkpoint to resume from."""

    def __init__(self, path: Path, adapters: AdapterSet) -> None:
        self.path = path
        self.adapters = adapters
        self.path.mkdir(parents=True, exist_ok=True)

    @classmethod
    def create(cls, output_dir: str, adapters: AdapterSet, config: RunConfig) -> RunDirectory:
        root = Path(output_dir).expanduser().resolve()
        if config.federation.resume:
            runs = sorted(p for p in root.glob("run-*") if (p / "adapters").is_dir()) if root.is_dir() else []
            if runs:
                return cls(runs[-1], adapters)
            log(INFO, "resume: no earlier run under %s, starting a new one", root)
        run = cls(root / time.strftime("run-%Y%m%d-%H%M%S"), adapters)
        (run.path / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
        return run

    def checkpoints(self) -> list[Path]:
        """Saved round directories, oldest first."""
        return sorted(p.parent for p in self.path.glob(f"adapters/round-*/{MANIFEST}"))

    def last_checkpoint(self) -> dict | None:
        """The newest intact checkpoint's strategy state (a damaged one is skipped, with a warning)."""
        for directory in reversed(self.checkpoints()):
            try:
                state = load_state(directory)
            except CheckpointError as error:
                log(WARNING, "resume: skipping a damaged checkpoint: %s", error)
                continue
            self.reconcile_metrics(int(state["round"]), state["last_round"] or None)
            return state
        return None

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
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def reconcile_metrics(self, done: int, record: dict | None) -> None:
        """Make ``metrics.jsonl`` hold exactly rounds 0..done once each, as the checkpoint saw them."""
        before = self.records()
        kept = {r["round"]: r for r in before if r.get("round", 0) <= done}
        if record is not None:
            kept[done] = {**kept.get(done, {}), **record}
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
                  ("epsilon", [("epsilon_total", "fit")])]
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


class RoundLoop:
    """The fit and evaluate steps that ``DefaultWorkflow`` runs each round.

    ``fit``: before the first round of a fresh run, evaluate the initial adapter (round 0);
    then run the fit workflow (plain or SecAgg+) and checkpoint the aggregate at once.
    ``evaluate``: evaluate the new global adapter, then append the round's record.
    """

    def __init__(self, strategy: FedProxAdapters, run: RunDirectory, federation: FederationConfig,
                 fit_workflow) -> None:
        self.strategy, self.run, self.federation, self.fit_workflow = strategy, run, federation, fit_workflow
        self.saved_round = strategy.completed_round

    def fit(self, grid: Grid, legacy: LegacyContext) -> None:
        current = _current_round(legacy)
        if current == 1 and self.strategy.completed_round == 0 and self.federation.evaluate_every:
            self.run.append_metrics({"round": 0, "evaluate": self._evaluate(grid, legacy, 0)})
        self.fit_workflow(grid, legacy)
        state = self.strategy.state_dict()
        round_number = self.strategy.round_number(current)
        if state["round"] != round_number:
            raise RoundFailed(f"round {round_number}: no update was aggregated "
                              "(under SecAgg+: too few clients completed the protocol; see the clients' logs)")
        last = round_number == self.federation.num_server_rounds
        if last or round_number % self.federation.save_every == 0:  # checkpoint first: resume trusts it
            self.save(state, final=last)

    def evaluate(self, grid: Grid, legacy: LegacyContext) -> None:
        record = dict(self.strategy.state_dict()["last_round"])
        if evaluation := self._evaluate(grid, legacy, _current_round(legacy)):
            record["evaluate"] = evaluation
        self.run.append_metrics(record)
        self.run.plot()

    def save(self, state: dict, final: bool) -> None:
        saved = self.run.save(state, final=final)
        self.saved_round = int(state["round"])
        log(INFO, "round %s: adapter %s saved", self.saved_round, saved)

    @staticmethod
    def _evaluate(grid: Grid, legacy: LegacyContext, server_round: int) -> dict:
        """Flower's evaluate workflow for ``server_round``; its aggregated metrics, from Flower's history."""
        configs = legacy.state.config_records[MAIN_CONFIGS_RECORD]
        current = configs[Key.CURRENT_ROUND]
        configs[Key.CURRENT_ROUND] = server_round
        try:
            default_evaluate_workflow(grid, legacy)
        finally:
            configs[Key.CURRENT_ROUND] = current
        return {key: value for key, values in legacy.history.metrics_distributed.items()
                for at, value in values if at == server_round}


def _current_round(legacy: LegacyContext) -> int:
    return int(legacy.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])


def run_server(grid: Grid, context: Context) -> Path:
    """Run the federation described by ``context.run_config``; return the run directory.

    Everything that can be checked on the server is checked before any client trains: the run
    config, the SecAgg+ settings, and the model (the server builds the initial adapter from it).
    """
    config = parse_run_config(context.run_config)
    federation, engine = config.federation, config.engine
    secagg = (derive_parameters(federation.secagg, engine.data, federation.min_fit_clients)
              if federation.secagg.enabled else None)
    adapters = build_models(engine.model, engine.needs_critic, seed=engine.trainer.seed).adapters
    run = RunDirectory.create(federation.output_dir, adapters, config)
    strategy = FedProxAdapters(
        federation, adapters.get_arrays(), local_iterations=engine.trainer.local_iterations,
        secure_aggregation=SecAggBounds(secagg.clipping_range, secagg.max_weight) if secagg else None,
    )
    if federation.resume and (state := run.last_checkpoint()):
        strategy.load_state_dict(state)
        log(INFO, "resume: %s continues after round %s from adapter %s", run.path, strategy.completed_round,
            fingerprint(strategy.global_arrays))
    log(INFO, "flwr-verl: run directory %s", run.path)
    done = strategy.completed_round
    remaining = federation.num_server_rounds - done
    if remaining <= 0:
        log(INFO, "resume: all %s rounds are done already", federation.num_server_rounds)
        return run.path

    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=remaining), strategy=strategy)
    rounds = RoundLoop(strategy, run, federation,
                       CheckedSecAggPlusWorkflow(**secagg.workflow_kwargs()) if secagg else default_fit_workflow)
    try:
        DefaultWorkflow(fit_workflow=rounds.fit, evaluate_workflow=rounds.evaluate)(grid, legacy)
    except StopFederation as stop:
        log(INFO, "flwr-verl: %s", stop)
        if strategy.completed_round > rounds.saved_round:
            rounds.save(strategy.state_dict(), final=False)
        run.finalize()
    except RoundFailed:
        kept = run.checkpoints()
        where = (f"the run directory keeps the adapter of round {int(kept[-1].name.removeprefix('round-'))} "
                 f"({kept[-1]}); resume=true continues from it" if kept else "no round was completed")
        log(WARNING, "flwr-verl: the global adapter was not changed by the failed round; %s", where)
        raise
    log(INFO, "flwr-verl: finished; outputs in %s", run.path)
    return run.path
