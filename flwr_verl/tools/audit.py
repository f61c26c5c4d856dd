"""``flwr-verl-audit``: the one-run privacy audit (``privacy.audit``: the method, its statistics
and canaries) run on an in-process federation of the real clients and strategy, and a
deliberately broken mechanism that shows the audit has power."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from flwr_verl.config import EngineConfig, FederationConfig, FlwrVerlError, require
from flwr_verl.engine.data import Row, load_rows, prompt_text
from flwr_verl.privacy.audit import (
    SECRETS,
    AuditConfig,
    AuditResult,
    GradientCanaries,
    epsilon_lower_bound,
    flat_weights,
    guess,
    make_canaries,
    make_canary_prompts,
    plant_gradient_canaries,
    score_canaries,
    with_canary_reward,
)


@torch.no_grad()
def answer_log_probs(policy, tokenizer, prompts: list[str]) -> np.ndarray:
    """log p(answer | canary prompt) under ``policy``'s current adapter, for every prompt and
    every possible secret: (len(prompts), len(SECRETS))."""
    policy.eval()
    device = next(policy.parameters()).device
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in SECRETS]
    out = np.zeros((len(prompts), len(SECRETS)))
    for i, text in enumerate(prompts):
        row = {"prompt": [{"role": "user", "content": text}]}
        prompt = tokenizer(prompt_text(row, tokenizer), add_special_tokens=False)["input_ids"]
        for j, answer in enumerate(answers):
            ids = torch.tensor([prompt + answer], device=device)
            logits = policy(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
            out[i, j] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer, device=device)[:, None]).sum()
    return out


def train_planted(engine: EngineConfig, federation: FederationConfig, planted: list[Row], *, planted_client: int = 0,
                  num_clients: int = 2, models=None, compute_score=None, plant=None,
                  log=print) -> tuple[list[np.ndarray], float]:
    """Train the federation once, in one process, with ``planted`` rows added to partition
    ``planted_client``'s training prompts: the same ``VerlClient``s, strategy and typed messages
    as over Flower's wire (``inprocess.InProcessClients``), every client in every round, SecAgg+
    off (it hides individual updates from the server, not what the released model learned).
    ``plant(trainer)``, when given, is called on the planted client's ``LocalPPOTrainer``
    (``plant_gradient_canaries``). Returns the final global adapter arrays and the epsilon the planted
    client's own ledger holds (infinity without DP)."""
    from flwr_verl.federation.client import VerlClient, cached_models
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.strategy import FedProxAdapters

    require(0 <= planted_client < num_clients, "audit.canary_client", planted_client,
            f"must be a partition in [0, {num_clients})")
    models = models or cached_models(engine)
    clients = {}
    for pid in range(num_clients):
        rows = load_rows(engine.data, "train", engine.trainer.seed, pid, num_clients)
        clients[str(pid)] = VerlClient(engine, rows + planted if pid == planted_client else rows, [], partition_id=pid,
                                       models=models, compute_score=compute_score)
    if plant is not None:
        plant(clients[str(planted_client)].trainer)
    federation = dataclasses.replace(
        federation, min_fit_clients=num_clients, min_available_clients=num_clients,
        min_evaluate_clients=num_clients, fraction_fit=1.0,
        secagg=dataclasses.replace(federation.secagg, enabled=False))
    strategy = FedProxAdapters(federation, models.adapters.get_arrays(),
                               local_iterations=engine.trainer.local_iterations)
    manager = InProcessClients(clients)
    for server_round in range(1, federation.num_server_rounds + 1):
        fit_round(strategy, manager, server_round)
        log(f"round {server_round}/{federation.num_server_rounds} done")
    planted, privacy = clients[str(planted_client)], engine.privacy
    claimed = (planted.ledger.account(planted.data_set, privacy.accountant).epsilon(privacy.delta)
               if privacy.enabled else math.inf)
    return strategy.global_arrays, claimed


def run_audit(engine: EngineConfig, federation: FederationConfig, audit: AuditConfig, *, num_clients: int = 2,
              models=None, log=print) -> AuditResult:
    """Train the federation once with the canaries planted, and bound epsilon (module docstring)."""
    from flwr_verl.engine.rewards import resolve_compute_score
    from flwr_verl.federation.client import cached_models

    require(0 <= audit.canary_client < num_clients, "audit.canary_client", audit.canary_client,
            f"must be a partition in [0, {num_clients})")
    start = time.perf_counter()
    rng = np.random.default_rng(audit.seed)
    models = models or cached_models(engine)
    initial = models.adapters.get_arrays()
    weights = [p for p in models.policy.parameters() if p.requires_grad]
    score = with_canary_reward(resolve_compute_score(engine.custom_reward_function, engine.data))
    train = functools.partial(train_planted, engine, federation, planted_client=audit.canary_client,
                              num_clients=num_clients, models=models, compute_score=score,
                              log=lambda line: log(f"audit: {line}"))
    if audit.kind == "gradient":
        canaries = GradientCanaries.draw(audit.canaries, sum(p.numel() for p in weights),
                                         engine.privacy.max_grad_norm, rng)
        included = rng.random(audit.canaries) < 0.5
        before = flat_weights(weights)
        final, claimed = train([], plant=functools.partial(plant_gradient_canaries, canaries=canaries,
                                                           members=np.flatnonzero(included), rng=rng))
        models.adapters.set_arrays(final)
        scores = canaries.scores(before, flat_weights(weights))
    else:
        prompts = make_canary_prompts(audit.canaries, rng)
        before = answer_log_probs(models.policy, models.tokenizer, prompts)
        canary_rows = make_canaries(prompts, before, rng)
        included = rng.random(audit.canaries) < 0.5
        final, claimed = train([c for c, member in zip(canary_rows, included) if member])
        models.adapters.set_arrays(final)
        scores = score_canaries(before, answer_log_probs(models.policy, models.tokenizer, prompts), canary_rows)
    models.adapters.set_arrays(initial)  # a cached model goes back as it came
    correct = guess(scores, included, audit.guesses)
    delta = engine.privacy.delta if engine.privacy.enabled else 0.0
    bound = epsilon_lower_bound(audit.canaries, audit.guesses, correct, delta, audit.confidence)
    return AuditResult(canaries=audit.canaries, guesses=audit.guesses, correct=correct, confidence=audit.confidence,
                       delta=delta, epsilon_lower_bound=bound, epsilon_claimed=claimed, members=int(included.sum()),
                       seconds=time.perf_counter() - start, kind=audit.kind)


FLAWS = ("unclipped_noiseless", "unpooled")


@contextlib.contextmanager
def broken_mechanism(flaw: str = "unclipped_noiseless"):
    """A deliberately broken DP mechanism, to check that the audit has power (never for training);
    the accountant still records the configured noise multiplier, so the claimed epsilon is a lie
    that an audit with power exposes (``benchmarks/audit_power.py``, ``tests/privacy/test_audit.py``).

    ``unclipped_noiseless``: the trainer's DP optimizer clips at 1e6 and adds no noise.
    ``unpooled``: no per-prompt pooling: Opacus clips each response's gradient on its own, so a
    prompt with n responses weighs up to n times ``max_grad_norm`` against noise calibrated for 1.
    """
    from flwr_verl.engine import update as update_module

    if flaw not in FLAWS:
        raise ValueError(f"flaw={flaw!r}: expected one of {', '.join(FLAWS)}")
    real_make_private = update_module.make_private

    def broken(*args, **kwargs):
        if flaw == "unpooled":  # per-response gradient samples: each response is clipped as a unit
            return real_make_private(*args, **{**kwargs, "rows_per_unit": 1})
        update = real_make_private(*args, **kwargs)
        update.optimizer.max_grad_norm = 1e6
        update.optimizer.noise_multiplier = 0.0
        return update

    update_module.make_private = broken
    try:
        yield
    finally:
        update_module.make_private = real_make_private


# ----------------------------------------------------------------------------- the command
def main(argv: list[str] | None = None) -> int:
    """``flwr-verl-audit``: train once with canaries planted and print the epsilon lower bound
    beside the claimed epsilon; the result is appended to ``--out`` as one JSON line."""
    from flwr_verl.federation.run_config import load_run_config
    from flwr_verl.tools.config_files import read_run_config
    from flwr_verl.tools.cli import APP_DIR, EXIT_INVALID, app_defaults

    parser = argparse.ArgumentParser(prog="flwr-verl-audit", description=main.__doc__)
    parser.add_argument("file", nargs="?", help="run-config TOML, as passed to `flwr run --run-config`")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key")
    parser.add_argument("--clients", type=int, default=2, help="clients of the in-process federation")
    for field in dataclasses.fields(AuditConfig):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default)
    parser.add_argument("--out", type=Path, default=Path("audit/metrics.jsonl"), help="JSON lines to append to")
    args = parser.parse_args(argv)
    try:
        audit = AuditConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(AuditConfig)})
        config = load_run_config({**app_defaults(APP_DIR), **read_run_config(args.file, args.set)})
        result = run_audit(config.engine, config.federation, audit, num_clients=args.clients)
    except FlwrVerlError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as handle:
        handle.write(json.dumps(result.to_json()) + "\n")
    print(f"{result.correct}/{result.guesses} guesses correct ({result.canaries} {result.kind} canaries): epsilon >= "
          f"{result.epsilon_lower_bound:.3f} at {100 * result.confidence:g}% confidence; claimed epsilon "
          f"{result.epsilon_claimed:.3g} (delta {result.delta:g}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
