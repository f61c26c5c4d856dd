"""The centralized baseline: the local RL engine alone, no federation, on pooled data.

    flwr-verl-baseline --clients 3 --iterations 240 --output baseline.jsonl
    flwr-verl-baseline --run-config my-profile.toml --set actor.lr=5e-4 --set "algorithm.adv_estimator='rloo'"

It reads the same run config as the Flower app (a flat or nested TOML of the app's keys, or a
pyproject.toml with ``[tool.flwr.app.config]``; ``--set key=value`` overrides, parsed by Flower's
own ``flwr run --run-config`` parser: values are TOML literals, so strings are quoted as in the
example above, and a bare word such as ``algorithm.adv_estimator=rloo`` is an error) and trains
on the union of ``--clients`` clients' data: for a task generator the ``train_size * N`` prompts
the federation splits among N clients, for parquet files the whole files. Training runs in rounds
of ``trainer.local_iterations`` iterations, each a ``LocalPPOTrainer.fit`` (a fresh optimizer per
round, as in a client's fit); privacy, when enabled, is accounted over all rounds. The default
``--iterations`` is ``num-server-rounds * trainer.local_iterations * N``: as many iterations as N
clients run in the whole federation, each on ``data.train_batch_size`` prompts.

Every iteration prints one line and writes one JSON line; the greedy evaluation on the pooled
validation prompts is printed (and written) before the first and after the last iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from flwr_verl.config import ConfigError, EngineConfig
from flwr_verl.engine.data import DataError, Row, load_rows
from flwr_verl.engine.models import ModelLoadError
from flwr_verl.engine.rewards import RewardError
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.federation.run_config import load_run_config
from flwr_verl.privacy.dpsgd import PrivacyAccount, noise_for_target_epsilon, sample_rate
from flwr_verl.tools.config_files import read_run_config

Record = dict[str, Any]


# ----------------------------------------------------------------------------- the run
def pooled_rows(config: EngineConfig, num_clients: int) -> tuple[list[Row], list[Row]]:
    """Train and validation rows of ``num_clients`` clients together (what the federation splits)."""
    data = config.data
    if not data.train_files:  # a generator makes size * N rows from the run seed, then splits them
        data = dataclasses.replace(data, train_size=data.train_size * num_clients,
                                   val_size=data.val_size * num_clients)
    seed = config.trainer.seed
    return load_rows(data, "train", seed), load_rows(data, "val", seed)


def run_baseline(config: EngineConfig, iterations: int, num_clients: int = 1,
                 on_iteration: Callable[[Record], None] | None = None) -> list[Record]:
    """Train on the pooled data of ``num_clients`` clients for ``iterations`` iterations.

    Returns the records in order, each also passed to ``on_iteration`` as it is produced:
    ``{"event": "eval", "iteration": 0, "reward", "accuracy"}`` (greedy, validation prompts),
    one ``{"event": "iteration", "iteration": i, "round": r, <trainer metrics>}`` per iteration
    (with ``"epsilon"`` spent so far under privacy), and a final ``"eval"`` record.
    """
    train_rows, val_rows = pooled_rows(config, num_clients)
    trainer = LocalPPOTrainer(config, train_rows)
    records: list[Record] = []

    def emit(record: Record) -> None:
        records.append(record)
        if on_iteration is not None:
            on_iteration(record)

    def evaluation(done: int) -> Record:
        report = trainer.evaluate(val_rows)
        return {"event": "eval", "iteration": done, "prompts": len(val_rows),
                **(dataclasses.asdict(report) if report else {})}

    emit(evaluation(0))
    privacy = config.privacy
    noise = None  # None: privacy.noise_multiplier
    if privacy.enabled and privacy.target_epsilon > 0:
        q = sample_rate(config.data.train_batch_size, len(train_rows))
        noise = noise_for_target_epsilon(privacy, q, iterations, config.actor.ppo_epochs)
    account, done, round_number = PrivacyAccount(privacy.accountant), 0, 0
    while done < iterations:
        round_number += 1
        steps = min(config.trainer.local_iterations, iterations - done)
        result = trainer.fit(steps, noise_multiplier=noise, seed=config.trainer.seed * 1_000_003 + round_number)
        for step, metrics in enumerate(result.metrics, start=1):
            done += 1
            spent = {}
            if result.mechanism is not None:  # epsilon after this iteration, accounted as a client accounts it
                spent = {"epsilon": account.after(result.mechanism, step).epsilon(privacy.delta)}
            emit({"event": "iteration", "iteration": done, "round": round_number, **metrics, **spent})
        if result.mechanism is not None:
            account.record(result.mechanism, result.iterations)
    emit(evaluation(done))
    return records


# ----------------------------------------------------------------------------- the command
def format_record(record: Record) -> str:
    if record["event"] == "eval":
        if "reward" not in record:
            return f"eval  after {record['iteration']:4d} iterations: no validation prompts"
        return (f"eval  after {record['iteration']:4d} iterations: greedy reward {record['reward']:.3f}  "
                f"accuracy {record['accuracy']:.3f}  ({record['prompts']} val prompts)")
    head = f"iter {record['iteration']:4d}"
    if not record.get("prompts"):
        return f"{head}  empty Poisson draw: noise-only steps"
    parts = [f"reward {record['reward_mean']:.3f}", f"len {record['response_length']:.2f}"]
    if "kl" in record:  # only with a KL term (the reference pass)
        parts.append(f"kl {record['kl']:.4f}")
    parts.append(f"pg_loss {record['pg_loss']:+.2e}")
    if "vf_loss" in record:
        parts.append(f"vf_loss {record['vf_loss']:.3e}")
    parts.append(f"clipfrac {record['pg_clipfrac']:.3f}")
    if "epsilon" in record:
        parts.append(f"eps {record['epsilon']:.2f}")
    times = " ".join(f"{k.removeprefix('time_')} {v:.3f}" for k, v in record.items() if k.startswith("time_"))
    return f"{head}  {'  '.join(parts)}  | s: {times}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flwr-verl-baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-config", metavar="FILE.toml", help="run config (flat or nested TOML, or pyproject.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one key (repeatable); the value is a TOML literal as in "
                             "`flwr run --run-config`: quote strings (--set \"algorithm.adv_estimator='rloo'\")")
    parser.add_argument("--clients", type=int, default=1, help="train on the pooled data of this many clients")
    parser.add_argument("--iterations", type=int, help="default: num-server-rounds * local_iterations * clients")
    parser.add_argument("--output", metavar="FILE.jsonl", help="write every record as a JSON line")
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error(f"--clients={args.clients}: must be >= 1")
    try:
        run_config = load_run_config(read_run_config(args.run_config, args.set))
    except (ConfigError, OSError, tomllib.TOMLDecodeError) as error:
        parser.error(str(error))
    config = run_config.engine
    rounds = run_config.federation.num_server_rounds
    iterations = args.iterations or rounds * config.trainer.local_iterations * args.clients
    if iterations < 1:
        parser.error(f"--iterations={iterations}: must be >= 1")

    output = None
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        output = open(args.output, "w")

    def report(record: Record) -> None:
        print(format_record(record), flush=True)
        if output is not None:
            output.write(json.dumps(record) + "\n")
            output.flush()

    print(f"centralized baseline: {args.clients} client(s)' pooled data, {iterations} iterations in rounds of "
          f"{config.trainer.local_iterations}, {config.algorithm.adv_estimator}, "
          f"privacy {'on' if config.privacy.enabled else 'off'}", flush=True)
    try:
        records = run_baseline(config, iterations, args.clients, on_iteration=report)
    except (ConfigError, DataError, ModelLoadError, RewardError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if output is not None:
            output.close()
    before, after = records[0], records[-1]
    if "reward" in before:
        print(f"greedy eval on {before['prompts']} val prompts: "
              f"reward {before['reward']:.3f} -> {after['reward']:.3f}, "
              f"accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
