"""The RLHF pipeline on the embedded task: a federated reward model, then GRPO against it.

Stage 1 trains a reward model from preference pairs (chosen: the correct sum; rejected: a near
miss) on ``--clients`` clients under DP at ``--epsilon``; held-out pairwise accuracy is measured
each round, round 0 included, on the validation split's pairs (prompts no client trains on).
Stage 2 runs federated GRPO from the embedded policy, in two arms with the same rounds, data,
seeds and epsilon: against the merged learned reward model (``reward_model.enable``), and
against the rule reward. The measure that matters is greedy exact match on validation problems
(the hidden rule); the learned reward of the same greedy answers is reported beside it, so that
reward hacking (learned reward up while exact match goes down) shows.

Goals (issue 11): pairwise accuracy >= 0.9 at epsilon <= 8; the learned-reward arm keeps >= 70% of
the rule arm's exact-match gain.

The federation is emulated in one process (as ``dp_utility.py`` does): each client fits from the
global adapter with FedProx's term, the server averages the updates (FedAvg). Each client's
noise multiplier spends exactly ``--epsilon`` over its planned iterations of that stage. The
stages use disjoint data here (pairs vs prompts), so their epsilons do not compose.

    python benchmarks/rlhf_pipeline.py [--rm-iterations 60] [--ppo-iterations 40] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RESULTS = Path(__file__).resolve().parent / "results"


def federate(args, trainers, adapters, iterations: int, evaluate, sigma: float, seed: int) -> tuple[list, list]:
    """FedAvg rounds of ``args.local_iterations``; ``evaluate()`` after each (and before the first).
    Returns the evaluations and the final global arrays."""
    import numpy as np

    global_arrays = adapters.get_arrays()
    weights = np.array([len(t.train_units if hasattr(t, "train_units") else t.train_rows) for t in trainers], float)
    weights /= weights.sum()
    curve = [evaluate()]
    for server_round in range(1, math.ceil(iterations / args.local_iterations) + 1):
        steps = min(args.local_iterations, iterations - (server_round - 1) * args.local_iterations)
        updates = []
        for pid, trainer in enumerate(trainers):
            adapters.set_arrays(global_arrays)
            trainer.fit(steps, anchor=global_arrays, proximal_mu=args.proximal_mu, noise_multiplier=sigma,
                        seed=seed + 100_003 * server_round + 7919 * pid)
            updates.append([new - old for new, old in zip(adapters.get_arrays(), global_arrays)])
        global_arrays = [g + sum(w * u[i] for w, u in zip(weights, updates)) for i, g in enumerate(global_arrays)]
        adapters.set_arrays(global_arrays)
        curve.append(evaluate())
        print(f"    round {server_round}: {curve[-1]}", flush=True)
    return curve, global_arrays


def noise(config, num_units: int, iterations: int, epsilon: float) -> float:
    from flwr_verl.privacy import noise_for_target_epsilon, sample_rate

    q = sample_rate(config.data.train_batch_size, num_units)
    return noise_for_target_epsilon(dataclasses.replace(config.privacy, target_epsilon=epsilon), q, iterations,
                                    config.actor.ppo_epochs)


def stage1(args, workdir: Path) -> dict:
    from flwr_verl.config import parse_run_config
    from flwr_verl.preference import LocalRewardModelTrainer, build_reward_model_trainee, export_merged, load_units

    config = parse_run_config({
        "stage": "reward_model", "privacy.deterministic": True, "trainer.seed": args.seed,
        "data.train_size": args.rm_train_size, "data.val_size": args.rm_val_size,
        "data.train_batch_size": args.rm_batch_size, "actor.ppo_mini_batch_size": args.rm_batch_size,
        "actor.lr": args.rm_lr,
    }).engine
    models = build_reward_model_trainee(config.model, seed=args.seed)
    trainers = [LocalRewardModelTrainer(config, load_units(config.data, "train", args.seed, pid, args.clients),
                                        models=models) for pid in range(args.clients)]
    held_out = load_units(config.data, "val", args.seed)  # --rm-val-size validation prompts, all pairs
    sigma = noise(config, min(len(t.train_units) for t in trainers), args.rm_iterations, args.epsilon)
    print(f"stage 1: {sum(len(t.train_units) for t in trainers)} training prompts, "
          f"{sum(len(u.pairs) for u in held_out)} held-out pairs, sigma {sigma:.3f}", flush=True)
    start = time.perf_counter()
    curve, _ = federate(args, trainers, models.adapters, args.rm_iterations,
                        lambda: trainers[0].evaluate(held_out).accuracy, sigma, args.seed)
    models.adapters.save(workdir / "final")
    merged = export_merged(workdir / "final" / "reward_model", workdir / "merged", config.model)
    return {"pairwise_accuracy_per_round": curve, "noise_multiplier": sigma, "epsilon": args.epsilon,
            "held_out_pairs": sum(len(u.pairs) for u in held_out), "seconds": time.perf_counter() - start,
            "merged": str(merged)}


def stage2(args, reward_model_path: str | None, eval_rows: list[dict], scorer) -> dict:
    """GRPO from the embedded policy, against ``reward_model_path`` (None: the rule)."""
    from flwr_verl.config import parse_run_config
    from flwr_verl.data import load_rows
    from flwr_verl.models import build_models
    from flwr_verl.rollout import generate
    from flwr_verl.trainer import LocalPPOTrainer

    run_config = {"privacy.deterministic": True, "trainer.seed": args.seed, "data.train_size": args.ppo_train_size,
                  "data.val_size": 0, "data.train_batch_size": args.ppo_batch_size,
                  "actor.ppo_mini_batch_size": args.ppo_batch_size}
    if reward_model_path:
        run_config.update({"reward_model.enable": True, "reward_model.model.path": reward_model_path})
    config = parse_run_config(run_config).engine
    models = build_models(config.model, False, seed=args.seed)
    trainers = [LocalPPOTrainer(config, load_rows(config.data, "train", args.seed, pid, args.clients), models=models,
                                reward_model=scorer.reward_model if reward_model_path else None)
                for pid in range(args.clients)]
    sigma = noise(config, min(len(t.train_rows) for t in trainers), args.ppo_iterations, args.epsilon)

    def evaluate() -> dict:
        greedy = generate(models.policy, models.tokenizer, eval_rows, config.rollout, config.data.max_prompt_length,
                          n=1, greedy=True)
        return {"exact_match": trainers[0].evaluate(eval_rows).accuracy,
                "learned_reward": scorer(greedy).sum(-1).mean().item()}

    start = time.perf_counter()
    curve, _ = federate(args, trainers, models.adapters, args.ppo_iterations, evaluate, sigma, args.seed)
    return {"per_round": curve, "noise_multiplier": sigma, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-iterations", type=int, default=10)
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--rm-iterations", type=int, default=60)
    parser.add_argument("--rm-train-size", type=int, default=512)
    parser.add_argument("--rm-val-size", type=int, default=120)
    parser.add_argument("--rm-batch-size", type=int, default=32)
    parser.add_argument("--rm-lr", type=float, default=3e-3)
    parser.add_argument("--ppo-iterations", type=int, default=40)
    parser.add_argument("--ppo-train-size", type=int, default=1024)
    parser.add_argument("--ppo-batch-size", type=int, default=32)
    parser.add_argument("--eval-size", type=int, default=120)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    import random

    import torch

    from dp_utility import validation_problems  # noqa: E402  (benchmarks/ is the script's folder)
    from flwr_verl.config import ModelConfig, RewardModelConfig
    from flwr_verl.models import load_tokenizer, resolve_model_path
    from flwr_verl.reward_model import LearnedReward, load_reward_model

    torch.set_num_threads(1)
    random.seed(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rm = stage1(args, Path(tmp))
        print(f"stage 1: held-out pairwise accuracy {rm['pairwise_accuracy_per_round']}", flush=True)
        tokenizer = load_tokenizer(resolve_model_path(ModelConfig()))  # the policy's
        scorer = LearnedReward(load_reward_model(rm["merged"], torch.device("cpu")), tokenizer, RewardModelConfig())
        eval_rows = validation_problems(args.eval_size)
        arms = {}
        for name, path in (("learned_reward", rm["merged"]), ("rule_reward", None)):
            print(f"stage 2 against the {name.replace('_', ' ')}:", flush=True)
            arms[name] = stage2(args, path, eval_rows, scorer)
    gains = {name: arm["per_round"][-1]["exact_match"] - arm["per_round"][0]["exact_match"] for name, arm in arms.items()}
    learned = [r["learned_reward"] for r in arms["learned_reward"]["per_round"]]
    exact = [r["exact_match"] for r in arms["learned_reward"]["per_round"]]
    hacking = [i for i in range(1, len(exact)) if learned[i] > learned[i - 1] and exact[i] < exact[i - 1]]
    summary = {
        "reward_model_final_pairwise_accuracy": rm["pairwise_accuracy_per_round"][-1],
        "goal_pairwise_accuracy_0.9": rm["pairwise_accuracy_per_round"][-1] >= 0.9,
        "exact_match_gain": gains,
        "share_of_rule_gain": gains["learned_reward"] / gains["rule_reward"] if gains["rule_reward"] > 0 else None,
        "reward_hacking_rounds": hacking,  # learned reward up, exact match down (learned-reward arm)
    }
    summary["goal_share_0.7"] = bool(summary["share_of_rule_gain"] is not None and summary["share_of_rule_gain"] >= 0.7)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "stage1": rm, "stage2": arms, "summary": summary,
              "seconds": time.perf_counter() - started,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rlhf_pipeline.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'rlhf_pipeline.json'}")


if __name__ == "__main__":
    main()
