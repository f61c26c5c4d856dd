"""The RLHF pipeline on the embedded task: a federated reward model (its held-out pairwise
accuracy), then GRPO against it (the exact-match gain it keeps against GRPO on the rule reward).

Goal (issue 11): pairwise accuracy >= 0.9 at epsilon <= 8; the learned-reward arm keeps >= 70% of
the rule arm's exact-match gain.

    python benchmarks/rlhf_pipeline.py [--rm-rounds 6] [--ppo-rounds 8] [--stage1-only] [--out DIR]

Stage 1 trains a reward model from preference pairs (chosen: the correct sum; rejected: a near
miss) on ``--clients`` clients under DP at ``--epsilon``; held-out pairwise accuracy is measured
each round, round 0 included, on the validation split's pairs (prompts no client trains on).
Stage 2 runs federated GRPO from the embedded policy, in two arms with the same rounds, data,
seeds and epsilon: against the merged learned reward model (``reward_model.enable``), and
against the rule reward. The measure that matters is greedy exact match on validation problems
(the hidden rule); the learned reward of the same greedy answers is reported beside it, so that
reward hacking (learned reward up while exact match goes down) shows.

The federation runs in one process through the library's own pieces (``VerlClient``,
``FedProxAdapters``, ``inprocess.fit_round(secure=True)``: SecAgg+'s arithmetic without its
masking), as ``compression.py`` does, for both stages: each client fits from the global adapter
with FedProx's term, its noise planned by ``privacy.target_epsilon`` = ``--epsilon`` over the
stage's rounds, and the strategy averages the updates. The embedded pairs and the policy's
prompts are drawn separately (different prompt sets, so separate ledger entries): each stage
spends its own ``--epsilon``.

Why the reward model learns slowly (diagnosed on the tune split, 240 problems, 1,158 pairs, no
DP, one process, AdamW on LoRA r 8 all-linear + the score head, 64 prompts a step; on the
embedded model of recipe version 2, before its build was made portable):

- the base has the knowledge: the embedded LM's own log-likelihood of the answer, used as a
  zero-shot score, ranks 0.79 of the pairs right (0.81 with the closing EOS); a base warm-started
  1,000 steps (0.93 greedy exact match) 0.96-0.98;
- but not where the score is read: a linear Bradley-Terry probe on the frozen base's hidden state
  at the response's last token reaches 0.58 (0.58 on the stronger base too). That state is a
  next-token prediction; judging the answer needs the predictions made at the earlier positions;
- so LoRA must build that comparison itself: 0.62 after 100 steps, 0.71 after 200, 0.84-0.86
  after 400-600 (loss 0.26). Scoring at the EOS that closes the response (``conversation_text``)
  learns it faster: 0.69 after 80 steps, 0.77 after 160. Stronger or deeper bases learn it slower
  (1,000 warm-start steps: 0.62 after 240 steps without the EOS, 0.75 with it; 4 layers and 600
  steps: 0.69 after 240), so the reward model keeps the policy's embedded base;
- the hardest near misses are +-1 (the last digit): 0.55 / 0.42 after 240 steps with the EOS,
  against 0.90 / 0.83 for +-10 and 0.98 for swapped digits.

Under DP, stage 1 has 60 steps per client at epsilon 8 (6 rounds x 10 iterations, sigma 0.99):
less than the 100-500 steps the model needs without noise, and each noisier. With the EOS read,
``--stage1-only --eval-split tune``, seed 0, round 6 (575 pairs): ``--rm-lr 3e-3`` 0.58 (round 0
0.47), ``1e-2`` 0.57, ``1e-2 --rm-lora-rank 2`` 0.55 (0.59 in round 4): within each other's
round-to-round noise, so the defaults stay.

Choose settings with ``--eval-split tune`` (the tune split's prompts) and report with the
default ``--eval-split val``: neither is in any client's training data.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import harness

harness.quiet()


def federate(args, run_config: dict, models, evaluate, *, reward_model=None) -> tuple[list[dict], list[dict]]:
    """``run_config``'s stage over ``args.clients`` ``VerlClient``s and ``FedProxAdapters``, one
    round at a time through ``inprocess.fit_round(secure=True)`` (SecAgg+'s arithmetic), with each
    client's noise planned by ``privacy.target_epsilon`` for all the stage's rounds. ``evaluate()``
    runs on the global adapter before the first round and after each. Returns the evaluations and
    each round's largest client epsilon (from the clients' reports)."""
    from flwr_verl.config import parse_run_config
    from flwr_verl.federation.client import VerlClient
    from flwr_verl.federation.inprocess import InProcessClients, fit_round
    from flwr_verl.federation.protocol import FitReport, SecAggBounds
    from flwr_verl.federation.secagg import derive_parameters
    from flwr_verl.federation.strategy import FedProxAdapters
    from flwr_verl.privacy.dpsgd import noise_for_target_epsilon, sample_rate
    from flwr_verl.stages import load_stage_rows

    privacy_config = ({"privacy.deterministic": True, "privacy.target_epsilon": args.epsilon} if args.epsilon
                      else {"privacy.enabled": False})
    run = parse_run_config({
        **privacy_config, "trainer.seed": args.seed,
        "trainer.local_iterations": args.local_iterations, "proximal-mu": args.proximal_mu,
        "min-fit-clients": args.clients, "min-evaluate-clients": args.clients, "min-available-clients": args.clients,
        **run_config})
    config, federation = run.engine, run.federation
    clients = {str(i): VerlClient(config, load_stage_rows(config, "train", args.seed, i, args.clients), [],
                                  partition_id=i, models=models, reward_model=reward_model)
               for i in range(args.clients)}
    secagg = derive_parameters(federation.secagg, config.data, args.clients)
    strategy = FedProxAdapters(federation, models.adapters.get_arrays(), local_iterations=args.local_iterations,
                               secure_aggregation=SecAggBounds(secagg.clipping_range, secagg.max_weight),
                               mask_seed=args.seed)
    print(f"    {sum(len(c.train_rows) for c in clients.values())} training units in {args.clients} clients",
          flush=True)
    # What each client plans for itself (the server is not told): sigma for target_epsilon over the stage.
    units = min(len(c.train_rows) for c in clients.values())
    sigma = (noise_for_target_epsilon(config.privacy, sample_rate(config.data.train_batch_size, units),
                                      federation.num_server_rounds * args.local_iterations, config.actor.ppo_epochs)
             if args.epsilon else 0.0)
    curve, privacy = [evaluate()], []
    for server_round in range(1, federation.num_server_rounds + 1):
        results, _ = fit_round(strategy, InProcessClients(clients), server_round, secure=True)
        models.adapters.set_arrays(strategy.global_arrays)
        reports = [FitReport.from_metrics(res.metrics).privacy for _, res in results]
        privacy.append({"epsilon": max(r.epsilon_run for r in reports) if args.epsilon else math.inf,
                        "noise_multiplier": sigma})
        curve.append(evaluate())
        print(f"    round {server_round}: {curve[-1]}, epsilon {privacy[-1]['epsilon']:.2f}", flush=True)
    return curve, privacy


def near_miss_kinds(units: list) -> dict[str, list]:
    """The held-out pairs by how the rejected answer misses (``preference.near_misses``): off by
    +-1 or +-10, or the digits swapped; one single-pair unit per pair."""
    from flwr_verl.stages.preference import PreferenceUnit

    kinds: dict[str, list] = {}
    for unit in units:
        for chosen, rejected in unit.pairs:
            kind = {1: "+1", -1: "-1", 10: "+10", -10: "-10"}.get(int(rejected) - int(chosen), "swapped")
            kinds.setdefault(kind, []).append(PreferenceUnit(unit.data_source, unit.prompt, [(chosen, rejected)]))
    return kinds


def stage1(args, workdir: Path) -> dict:
    from flwr_verl.config import parse_run_config
    from flwr_verl.stages.preference import (
        LocalRewardModelTrainer,
        build_reward_model_trainee,
        export_merged,
        load_units,
    )

    run_config = {
        "stage": "reward_model", "num-server-rounds": args.rm_rounds, "data.train_size": args.rm_train_size,
        "data.val_size": args.rm_val_size, "data.train_batch_size": args.rm_batch_size,
        "actor.ppo_mini_batch_size": args.rm_batch_size, "actor.lr": args.rm_lr,
        "model.lora_rank": args.rm_lora_rank, "model.lora_alpha": 2.0 * args.rm_lora_rank,
    }
    config = parse_run_config(run_config).engine
    models = build_reward_model_trainee(config.model, seed=args.seed)
    held_out = load_units(config.data, args.eval_split, args.seed)  # prompts no client trains on, all their pairs
    scorer = LocalRewardModelTrainer(config, [], models=models)
    print(f"stage 1: {sum(len(u.pairs) for u in held_out)} held-out pairs ({args.eval_split} split)", flush=True)
    start = time.perf_counter()
    curve, privacy = federate(args, run_config, models, lambda: scorer.evaluate(held_out).accuracy)
    by_kind = {kind: scorer.evaluate(units).accuracy for kind, units in near_miss_kinds(held_out).items()}
    print(f"stage 1: final held-out pairwise accuracy by near miss {by_kind}", flush=True)
    models.adapters.save(workdir / "final")
    merged = export_merged(workdir / "final" / "reward_model", workdir / "merged", config.model)
    return {"pairwise_accuracy_per_round": curve, "final_accuracy_by_near_miss": by_kind,
            "privacy_per_round": privacy, "held_out_pairs": sum(len(u.pairs) for u in held_out),
            "seconds": time.perf_counter() - start, "merged": str(merged)}


def stage2(args, reward_model: dict | None, eval_rows: list[dict], scorer, lr: float | None = None) -> dict:
    """GRPO from the embedded policy, against the learned reward that the ``reward_model.*`` run
    config keys of ``reward_model`` describe (``scorer``'s model; None: the rule), at ``actor.lr``
    ``lr`` (None: the config's)."""
    from flwr_verl.config import parse_run_config
    from flwr_verl.engine.models import build_models
    from flwr_verl.engine.rollout import generate
    from flwr_verl.engine.trainer import LocalPPOTrainer

    run_config = {"num-server-rounds": args.ppo_rounds, "data.train_size": args.ppo_train_size, "data.val_size": 0,
                  "data.train_batch_size": args.ppo_batch_size, "actor.ppo_mini_batch_size": args.ppo_batch_size}
    if reward_model:
        run_config.update({"reward_model.enable": True, **reward_model})
    if lr is not None:
        run_config["actor.lr"] = lr
    config = parse_run_config(run_config).engine
    models = build_models(config.model, False, seed=args.seed)
    judge = LocalPPOTrainer(config, [], models=models)  # exact match against the hidden rule

    def evaluate() -> dict:
        greedy = generate(models.policy, models.tokenizer, eval_rows, config.rollout, config.data.max_prompt_length,
                          n=1, greedy=True)
        return {"exact_match": judge.evaluate(eval_rows).accuracy,
                "learned_reward": scorer(greedy).sum(-1).mean().item()}

    start = time.perf_counter()
    curve, privacy = federate(args, run_config, models, evaluate,
                              reward_model=scorer.reward_model if reward_model else None)
    return {"per_round": curve, "privacy_per_round": privacy, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=8.0, help="each stage's; 0: without DP (the ceiling)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-iterations", type=int, default=10)
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--eval-split", choices=("tune", "val"), default="val",
                        help="held-out prompts: tune (for choosing settings) or val (for reporting)")
    parser.add_argument("--rm-rounds", type=int, default=6)
    parser.add_argument("--rm-train-size", type=int, default=512)
    parser.add_argument("--rm-val-size", type=int, default=120)
    parser.add_argument("--rm-batch-size", type=int, default=64)
    parser.add_argument("--rm-lr", type=float, default=3e-3)
    parser.add_argument("--rm-lora-rank", type=int, default=8, help="the reward model's LoRA rank (alpha 2 x rank)")
    # 8, the default job's rounds: with the embedded model of recipe version 3 (0.45 before training) 2 rounds
    # gained only 3-4 of 120 validation problems under the rule, too few to compare the arms; on the tune
    # split the default job gained +0.07 by round 2 and +0.157 by round 8
    parser.add_argument("--ppo-rounds", type=int, default=8)
    parser.add_argument("--ppo-train-size", type=int, default=512)
    parser.add_argument("--ppo-batch-size", type=int, default=32)
    parser.add_argument("--eval-size", type=int, default=120)
    parser.add_argument("--stage1-only", action="store_true", help="the reward model alone (for tuning it)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args()

    import random

    import torch

    from flwr_verl.config import ModelConfig, RewardModelConfig
    from flwr_verl.engine.models import load_tokenizer, resolve_model_path
    from flwr_verl.engine.reward_model import LearnedReward, load_reward_model

    torch.set_num_threads(1)
    random.seed(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rm = stage1(args, Path(tmp))
        print(f"stage 1: held-out pairwise accuracy {rm['pairwise_accuracy_per_round']}", flush=True)
        summary = {"reward_model_final_pairwise_accuracy": rm["pairwise_accuracy_per_round"][-1],
                   "reward_model_epsilon": rm["privacy_per_round"][-1]["epsilon"],
                   "goal_pairwise_accuracy_0.9": rm["pairwise_accuracy_per_round"][-1] >= 0.9}
        arms = {}
        if not args.stage1_only:
            tokenizer = load_tokenizer(resolve_model_path(ModelConfig()))  # the policy's
            scorer = LearnedReward(load_reward_model(rm["merged"], torch.device("cpu")), tokenizer,
                                   RewardModelConfig())
            eval_rows = harness.validation_problems(args.eval_size, args.eval_split)
            for name, reward in (("learned_reward", {"reward_model.model.path": rm["merged"]}), ("rule_reward", None)):
                print(f"stage 2 against the {name.replace('_', ' ')}:", flush=True)
                arms[name] = stage2(args, reward, eval_rows, scorer)
    if arms:
        gains = {name: arm["per_round"][-1]["exact_match"] - arm["per_round"][0]["exact_match"]
                 for name, arm in arms.items()}
        learned = [r["learned_reward"] for r in arms["learned_reward"]["per_round"]]
        exact = [r["exact_match"] for r in arms["learned_reward"]["per_round"]]
        share = gains["learned_reward"] / gains["rule_reward"] if gains["rule_reward"] > 0 else None
        summary.update({
            "policy_epsilon": {name: arm["privacy_per_round"][-1]["epsilon"] for name, arm in arms.items()},
            "exact_match_gain": gains, "share_of_rule_gain": share,
            "goal_share_0.7": bool(share is not None and share >= 0.7),
            # learned reward up while exact match goes down, round over round (learned-reward arm)
            "reward_hacking_rounds": [i for i in range(1, len(exact))
                                      if learned[i] > learned[i - 1] and exact[i] < exact[i - 1]],
        })
    result = {"args": vars(args), "stage1": rm, "stage2": arms, "summary": summary,
              "seconds": time.perf_counter() - started, "peak_rss_mib": harness.peak_rss_mib()}
    print(json.dumps(summary, indent=1))
    harness.write_json(args.out / "rlhf_pipeline.json", result)


if __name__ == "__main__":
    main()
