"""The server: ``run_server`` is what the bundled ServerApp calls.

It validates the run config, builds the initial global adapter (the same seeded LoRA init every
client builds), and runs Flower's ``DefaultWorkflow`` on a ``LegacyContext`` with the fit and
evaluate steps of ``workflow.RoundLoop`` (SecAgg+ through ``SecAggPlusWorkflow`` when enabled, so
the strategy only ever receives the securely aggregated update). Outputs go to a
``rundir.RunDirectory``.

With ``resume = true`` it continues the newest run under ``output-dir`` from its newest
checkpoint that verifies: the global adapter (exactly, from the float64 weights), the server
optimizer, the privacy ledger and the exhausted clients are restored
(``strategy.load_state_dict``), so no round is repeated or lost and epsilon keeps counting.
With no such checkpoint it refuses before any client trains and changes nothing (``rundir``).

How a run ends:

- normally, after ``num-server-rounds`` rounds;
- normally, earlier, when too few clients can train within their privacy budgets
  (``StopFederation``): ``adapters/final`` is the last completed round;
- as failed, with one ERROR line, on a ``FlwrVerlError``: a bad config or model before any
  training, or a round that could not be completed (``RoundFailed``: every client failed, too
  few SuperNodes connected within ``connect-timeout``, or SecAgg+ lost more clients than its
  reconstruction threshold allows). The run directory keeps the adapter of the last completed
  round; ``resume = true`` continues from it.
"""

from __future__ import annotations

from logging import INFO, WARNING
from pathlib import Path

from flwr.app import Context
from flwr.common import log
from flwr.server import Grid, LegacyContext, ServerConfig
from flwr.server.workflow import DefaultWorkflow

from flwr_verl.config import ModelConfig
from flwr_verl.federation.protocol import SecAggBounds
from flwr_verl.federation.rounds import RoundFailed, StopFederation
from flwr_verl.federation.run_config import load_run_config
from flwr_verl.federation.rundir import RunDirectory, fingerprint
from flwr_verl.federation.secagg import derive_parameters, integer_secagg_parameters
from flwr_verl.federation.strategy import FedProxAdapters
from flwr_verl.federation.workflow import CheckedSecAggPlusWorkflow, RoundLoop
from flwr_verl.stages import build_stage_models


def run_server(grid: Grid, context: Context) -> Path:
    """Run the federation described by ``context.run_config``; return the run directory.

    Everything that can be checked on the server is checked before any client trains: the run
    config, the SecAgg+ settings, and the model (the server builds the initial adapter from it).
    """
    config = load_run_config(context.run_config)
    federation, engine = config.federation, config.engine
    client_level = engine.privacy.client_level if engine.privacy.client_level.enabled else None
    weights = "fixed" if client_level else engine.privacy.num_examples  # client-level DP sends weight 1
    secagg = (derive_parameters(federation.secagg, engine.data, federation.min_fit_clients, weights)
              if federation.secagg.enabled else None)
    workflow_secagg = integer_secagg_parameters(secagg, client_level.bits) if client_level else secagg
    adapters = build_stage_models(engine).adapters
    run = RunDirectory.create(federation.output_dir, adapters, config)
    strategy = FedProxAdapters(
        federation, adapters.get_arrays(), local_iterations=engine.trainer.local_iterations,
        secure_aggregation=SecAggBounds(secagg.clipping_range, secagg.max_weight) if secagg else None,
        client_level=client_level,
        frozen_weights=adapters.frozen_fingerprint, mask_seed=engine.trainer.seed,
    )
    if run.resumed:
        strategy.load_state_dict(run.resumed)
        log(INFO, "resume: %s continues after round %s from adapter %s", run.path, strategy.completed_round,
            fingerprint(strategy.global_arrays))
    log(INFO, "flwr-verl: run directory %s", run.path)
    done = strategy.completed_round
    remaining = federation.num_server_rounds - done
    if remaining <= 0:
        log(INFO, "resume: all %s rounds are done already", federation.num_server_rounds)
        return run.path

    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=remaining), strategy=strategy)
    rounds = RoundLoop(strategy, run, federation, CheckedSecAggPlusWorkflow(**workflow_secagg.workflow_kwargs()) if secagg else None)
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
    if engine.stage == "reward_model":  # stage 1's product: what a policy stage's reward_model.model.path takes
        merged = export_reward_model(run.path, engine.model)
        log(INFO, "flwr-verl: merged reward model in %s (use it as reward_model.model.path)", merged)
    if engine.stage in ("sft", "dpo"):  # a policy: what a later stage's model.init_adapter takes
        log(INFO, "flwr-verl: %s adapter in %s (use it as model.init_adapter)", engine.stage.upper(),
            run.path / "adapters" / "final" / "policy")
    log(INFO, "flwr-verl: finished; %s; outputs in %s", summary(run.records()), run.path)
    return run.path


def export_reward_model(run_path: Path, model: ModelConfig) -> Path:
    """``<run>/reward_model/``: the final reward-model adapter merged into its base."""
    from flwr_verl.stages.preference import REWARD_MODEL_ROLE, export_merged

    return export_merged(run_path / "adapters" / "final" / REWARD_MODEL_ROLE, run_path / "reward_model", model)


def summary(records: list[dict]) -> str:
    """Where held-out accuracy started (round 0) and ended, and the epsilon of the last run."""
    evaluated = [r for r in records if "accuracy" in r.get("evaluate", {})]
    parts = []
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        parts.append(f"held-out accuracy {first['evaluate']['accuracy']:.3f} at round {first['round']} -> "
                     f"{last['evaluate']['accuracy']:.3f} at round {last['round']}")
    if spent := [r["fit"]["epsilon_run"] for r in records if "epsilon_run" in r.get("fit", {})]:
        parts.append(f"epsilon {spent[-1]:.2f} in the last run")
    if client_level := [r["fit"]["epsilon_client_level"] for r in records if "epsilon_client_level" in r.get("fit", {})]:
        parts.append(f"client-level epsilon {client_level[-1]:.2f}")
    return ", ".join(parts) or "no round was recorded"
