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
round: the global adapter, the server optimizer and the clients' privacy ledger are restored,
so no round is repeated or lost and epsilon keeps counting.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import Context
from flwr.common import log
from flwr.server import Grid, LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.server.workflow.default_workflows import default_evaluate_workflow

from flwr_verl.config import RunConfig, parse_run_config
from flwr_verl.models import AdapterSet, build_models, load_adapter_into
from flwr_verl.secagg import derive_parameters
from flwr_verl.strategy import FedProxAdapters


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
        rounds = sorted(self.path.glob("adapters/round-*/server_state.pt"))
        if not rounds:
            return None
        state = torch.load(rounds[-1], weights_only=False)
        for role, model in self.adapters.models.items():
            load_adapter_into(model, rounds[-1].parent / role)
        return state["round"], state

    def save(self, server_round: int, strategy: FedProxAdapters, final: bool) -> None:
        self.adapters.set_arrays(strategy.global_arrays)
        target = self.path / "adapters" / f"round-{server_round:04d}"
        self.adapters.save(target)
        torch.save({"round": server_round, "optimizer": strategy.optimizer.state_dict(),
                    "privacy_ledger": strategy.privacy_ledger}, target / "server_state.pt")
        if final:
            shutil.rmtree(self.path / "adapters" / "final", ignore_errors=True)
            shutil.copytree(target, self.path / "adapters" / "final")

    def append_metrics(self, record: dict) -> None:
        with open(self.path / "metrics.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = [json.loads(line) for line in (self.path / "metrics.jsonl").read_text().splitlines()]
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
    """Run the federation described by ``context.run_config``; return the run directory."""
    config = parse_run_config(context.run_config)
    federation, engine = config.federation, config.engine
    secagg = (derive_parameters(federation.secagg, engine.data, federation.min_fit_clients)
              if federation.secagg.enabled else None)
    adapters = build_models(engine.model, engine.needs_critic, seed=engine.trainer.seed).adapters
    run = RunDirectory.create(federation.output_dir, adapters, config)
    done, state = 0, {}
    if federation.resume and (checkpoint := run.last_checkpoint()):
        done, state = checkpoint
        log(INFO, "resume: %s continues after round %s", run.path, done)
    log(INFO, "flwr-verl: run directory %s", run.path)

    strategy = FedProxAdapters(
        federation, adapters.get_arrays(), local_iterations=engine.trainer.local_iterations,
        secure_aggregation=({"secagg_clipping_range": secagg.clipping_range, "secagg_max_weight": secagg.max_weight}
                            if secagg else None),
        round_offset=done, privacy_ledger=state.get("privacy_ledger"),
        server_optimizer_state=state.get("optimizer"),
    )

    def record(server_round: int, record: dict) -> None:
        run.append_metrics(record)
        last = server_round == federation.num_server_rounds
        if last or server_round % federation.save_every == 0:
            run.save(server_round, strategy, final=last)
        run.plot()

    strategy.on_round_end = record
    remaining = federation.num_server_rounds - done
    if remaining <= 0:
        log(INFO, "resume: all %s rounds are done already", federation.num_server_rounds)
        return run.path

    def evaluate_then_record(grid: Grid, legacy: LegacyContext) -> None:
        default_evaluate_workflow(grid, legacy)
        strategy.finish_round(int(legacy.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND]))

    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=remaining), strategy=strategy)
    fit_workflow = SecAggPlusWorkflow(**secagg.workflow_kwargs()) if secagg else None
    DefaultWorkflow(fit_workflow=fit_workflow, evaluate_workflow=evaluate_then_record)(grid, legacy)
    log(INFO, "flwr-verl: finished; outputs in %s", run.path)
    return run.path
