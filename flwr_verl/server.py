"""The server workflow: Flower's ``DefaultWorkflow`` with SecAgg+, plus a run directory.

``run_server`` is what the bundled ServerApp calls. It validates the run config, builds the
initial global adapter (the same seeded LoRA init every client builds), and runs
``DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))`` on a ``LegacyContext``, so the
strategy only ever receives the securely aggregated update.

After every round it appends to the run directory::

    <output-dir>/<run-id>/
      config.json                  the validated run config
      metrics.jsonl                one JSON object per round: fit and evaluate metrics, seconds, bytes
      adapters/round-NNNN/policy/  the global adapter, a PEFT directory (PeftModel.from_pretrained)
      adapters/round-NNNN/server_state.pt   server optimizer state and privacy ledger, for resume
      adapters/final/              the last round's adapter
      progress.png                 reward, KL and epsilon per round

With ``resume = true`` it continues the newest run under ``output-dir`` from its last saved
round: the global adapter (exactly, from the float64 weights saved beside it), the server
optimizer and the clients' privacy ledger are restored, so no round is repeated or lost and
epsilon keeps counting. A checkpoint is written to a temporary directory and renamed into place,
so a server killed mid-save leaves the previous one intact; ``metrics.jsonl`` is reconciled
with the checkpoint on resume (rounds after it are dropped and run again, the checkpoint's own
round is restored if the kill came between saving it and appending it).

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
import torch
from flwr.app import Context
from flwr.common import log
from flwr.server import Grid, LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.server.workflow.default_workflows import default_evaluate_workflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

from flwr_verl.config import RunConfig, parse_run_config
from flwr_verl.models import AdapterSet, build_models, load_adapter_into
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
        round_number = current + getattr(context.strategy, "round_offset", 0)
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

    def last_checkpoint(self) -> tuple[int, dict] | None:
        """Load the newest complete checkpoint into ``self.adapters``; return (round, server state)."""
        rounds = sorted(self.path.glob("adapters/round-*/server_state.pt"))
        if not rounds:
            return None
        state = torch.load(rounds[-1], weights_only=False)
        for role, model in self.adapters.models.items():
            load_adapter_into(model, rounds[-1].parent / role)
        self.reconcile_metrics(state["round"], state.get("record"))
        return state["round"], state

    def save(self, server_round: int, strategy: FedProxAdapters, record: dict | None, final: bool) -> str:
        """Write round ``server_round``'s checkpoint atomically; return the adapter's fingerprint."""
        arrays = strategy.global_arrays
        self.adapters.set_arrays(arrays)
        adapters = self.path / "adapters"
        target = adapters / f"round-{server_round:04d}"
        self._atomic(target, lambda tmp: (
            self.adapters.save(tmp),
            torch.save({"round": server_round, "optimizer": strategy.optimizer.state_dict(),
                        "privacy_ledger": strategy.privacy_ledger, "record": record,
                        "weights": [w.detach().numpy().copy() for w in strategy.weights],
                        "fingerprint": fingerprint(arrays)}, tmp / "server_state.pt"),
        ))
        if final:
            self._atomic(adapters / "final", lambda tmp: shutil.copytree(target, tmp, dirs_exist_ok=True))
        return fingerprint(arrays)

    def finalize(self) -> None:
        """``adapters/final`` := the newest checkpoint (when a run stops before its last round)."""
        rounds = sorted(self.path.glob("adapters/round-*/server_state.pt"))
        if rounds:
            self._atomic(self.path / "adapters" / "final",
                         lambda tmp: shutil.copytree(rounds[-1].parent, tmp, dirs_exist_ok=True))

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

    def records(self) -> list[dict]:
        path = self.path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def reconcile_metrics(self, done: int, record: dict | None) -> None:
        """Make ``metrics.jsonl`` hold exactly rounds 1..done once each, as the checkpoint saw them."""
        before = self.records()
        kept = {r["round"]: r for r in before if r.get("round", 0) <= done}
        if record is not None:
            kept[done] = record
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
        rounds = [r["round"] for r in records]
        panels = [("reward", [("reward_after", "fit"), ("reward", "evaluate")]), ("kl", [("kl", "fit")]),
                  ("epsilon", [("epsilon_total", "fit")])]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        for axis, (title, series) in zip(axes, panels):
            for key, part in series:
                values = [r.get(part, {}).get(key, np.nan) for r in records]
                axis.plot(rounds, values, marker="o", label=f"{part} {key}")
            axis.set_title(title)
            axis.set_xlabel("round")
            axis.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(self.path / "progress.png", dpi=90)
        plt.close(fig)


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
    done, state = 0, {}
    if federation.resume and (checkpoint := run.last_checkpoint()):
        done, state = checkpoint
    initial = [np.asarray(w) for w in state["weights"]] if "weights" in state else adapters.get_arrays()
    log(INFO, "flwr-verl: run directory %s", run.path)

    strategy = FedProxAdapters(
        federation, initial, local_iterations=engine.trainer.local_iterations,
        secure_aggregation=({"secagg_clipping_range": secagg.clipping_range, "secagg_max_weight": secagg.max_weight}
                            if secagg else None),
        round_offset=done, privacy_ledger=state.get("privacy_ledger"),
        server_optimizer_state=state.get("optimizer"),
    )
    if done:
        log(INFO, "resume: %s continues after round %s from adapter %s", run.path, done,
            fingerprint(strategy.global_arrays))

    def record(server_round: int, record: dict) -> None:
        last = server_round == federation.num_server_rounds
        if last or server_round % federation.save_every == 0:  # checkpoint first: resume trusts it
            saved = run.save(server_round, strategy, record, final=last)
            log(INFO, "round %s: adapter %s saved", server_round, saved)
        run.append_metrics(record)
        run.plot()

    strategy.on_round_end = record
    remaining = federation.num_server_rounds - done
    if remaining <= 0:
        log(INFO, "resume: all %s rounds are done already", federation.num_server_rounds)
        return run.path

    def evaluate_then_record(grid: Grid, legacy: LegacyContext) -> None:
        current = int(legacy.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])
        if strategy.round_record.get("round") == current + done:  # evaluate only an aggregated round
            default_evaluate_workflow(grid, legacy)
        strategy.finish_round(current)

    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=remaining), strategy=strategy)
    fit_workflow = CheckedSecAggPlusWorkflow(**secagg.workflow_kwargs()) if secagg else None
    try:
        DefaultWorkflow(fit_workflow=fit_workflow, evaluate_workflow=evaluate_then_record)(grid, legacy)
    except StopFederation as stop:
        log(INFO, "flwr-verl: %s", stop)
        if strategy.last_completed_round > done and strategy.last_completed_round % federation.save_every:
            run.save(strategy.last_completed_round, strategy, strategy.round_record, final=False)
        run.finalize()
    except RoundFailed:
        kept = sorted(run.path.glob("adapters/round-*/server_state.pt"))
        last = kept[-1].parent if kept else None
        where = (f"the run directory keeps the adapter of round {int(last.name.removeprefix('round-'))} ({last}); "
                 "resume=true continues from it" if last else "no round was completed")
        log(WARNING, "flwr-verl: the global adapter was not changed by the failed round; %s", where)
        raise
    log(INFO, "flwr-verl: finished; outputs in %s", run.path)
    return run.path
