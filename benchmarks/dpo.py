"""Federated DP-DPO on the embedded preference pairs, and the DPO policy as the verifier for GRPO.

What it measures, on held-out problems no client trains on (``--eval-split val``; choose settings
with ``--eval-split tune``):

1. stage ``dpo`` on ``--clients`` clients under DP at ``--epsilon`` (SecAgg+'s arithmetic in
   process, ``inprocess.fit_round(secure=True)``): each round, the held-out pairwise accuracy
   (a tie counts half; round 0 is the untrained model scored the same way) of the verifier's
   scores, the implicit reward beta (log pi_dpo - log pi_ref) and the DPO policy's likelihood
   log pi_dpo, each whole and per token; and the DPO policy's own greedy exact match;
2. the anchor: TRL 1.16's ``DPOTrainer``, centralized and without DP, on the pooled training
   pairs of all clients, from the same model (LoRA r ``--lora-rank`` on all linear layers), with
   the same loss (DPO's, plus TRL's "sft" term at ``--sft-weight``), scored the same way
   (``trl_dpo_anchor.py``, run by ``--trl-python``: a venv with trl and peft);
3. GRPO from the embedded policy in two arms with the same rounds, data, seeds and epsilon:
   against the rule reward, and against the DPO verifier (``reward_model.kind = "implicit"``,
   score ``--verifier-score``); greedy exact match each round, and the verifier's score of the
   same greedy answers, so that reward hacking (score up, exact match down) shows.

Goals (issue 26), at epsilon <= 8:
- the verifier's held-out pairwise accuracy >= 0.90, and within 0.02 of the TRL anchor's;
- the DPO policy's greedy exact match rises by >= 70% of what the rule-reward GRPO arm gains;
- GRPO against the verifier keeps >= 70% of the rule arm's gain, and its exact match is never
  more than 0.02 below round 0 in any round (no reward hacking).

Writes ``--out/dpo.json``: ``pairwise_accuracy`` (``round_0``, ``final``, per score),
``epsilon``, ``exact_match`` (``round_0``, ``final``: the DPO policy's), ``anchor_trl``, and
``arms`` (``rule``, ``verifier``: exact match and verifier score per round, epsilon).

    python benchmarks/dpo.py [--eval-split tune] [--trl-python ~/.cache/flwr-verl/venv-trl/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import harness

harness.quiet()
SCORES = ("implicit", "likelihood", "implicit_per_token", "likelihood_per_token")


def pairwise_accuracies(model, tokenizer, units: list, max_prompt_length: int, beta: float,
                        micro_batch_size: int = 32) -> dict[str, float]:
    """Held-out pairwise accuracy of each of ``SCORES`` (a tie counts half), from the DPO policy
    ``model`` and its adapter-disabled reference, on every pair of ``units``."""
    import torch

    from flwr_verl.stages.dpo import pair_examples, pairwise_accuracy, sequence_log_probs
    from flwr_verl.stages.sft import response_batch

    margins: dict[str, list] = {score: [] for score in SCORES}
    model.eval()
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(units), micro_batch_size):
            chunk = units[start: start + micro_batch_size]
            examples, unit_of_row = pair_examples(chunk)
            batch = response_batch(examples, unit_of_row, len(chunk), tokenizer, max_prompt_length, device)
            policy, tokens = sequence_log_probs(model, batch)
            with model.disable_adapter():
                reference, _ = sequence_log_probs(model, batch)
            pairs = len(policy) // 2
            for score, values in (("implicit", beta * (policy - reference)), ("likelihood", policy)):
                margins[score].append(values[:pairs] - values[pairs:])
                per_token = values / tokens.clamp(min=1)
                margins[f"{score}_per_token"].append(per_token[:pairs] - per_token[pairs:])
    return {score: round(pairwise_accuracy(torch.cat(values)), 4) for score, values in margins.items()}


def stage_dpo(args, workdir: Path, eval_rows: list[dict]) -> dict:
    from flwr_verl.config import parse_run_config
    from flwr_verl.engine.trainer import LocalPPOTrainer
    from flwr_verl.stages.policy import policy_models
    from flwr_verl.stages.preference import load_units
    from rlhf_pipeline import federate

    run_config = {"stage": "dpo", "num-server-rounds": args.dpo_rounds, "data.train_size": args.dpo_train_size,
                  "data.val_size": args.dpo_val_size, "data.train_batch_size": args.dpo_batch_size,
                  "actor.ppo_mini_batch_size": args.dpo_batch_size, "actor.lr": args.dpo_lr,
                  "dpo.beta": args.beta, "dpo.sft_weight": args.sft_weight, "model.lora_rank": args.lora_rank,
                  "model.lora_alpha": 2.0 * args.lora_rank, "privacy.max_grad_norm": args.dpo_clip_norm}
    config = parse_run_config({**run_config, "trainer.seed": args.seed}).engine
    models = policy_models(config)
    held_out = load_units(config.data, args.eval_split, args.seed)
    judge = LocalPPOTrainer(parse_run_config({"data.val_size": 0}).engine, [], models=models)

    def evaluate() -> dict:
        return {"pairwise_accuracy": pairwise_accuracies(models.policy, models.tokenizer, held_out,
                                                         config.data.max_prompt_length, args.beta),
                "exact_match": round(judge.evaluate(eval_rows).accuracy, 4)}

    print(f"stage dpo: {sum(len(u.pairs) for u in held_out)} held-out pairs ({args.eval_split} split)", flush=True)
    start = time.perf_counter()
    curve, privacy = federate(args, run_config, models, evaluate)
    models.adapters.save(workdir / "dpo")
    train_pairs = [{"prompt": unit.prompt[-1]["content"], "chosen": chosen, "rejected": rejected}
                   for client in range(args.clients)
                   for unit in load_units(config.data, "train", args.seed, client, args.clients)
                   for chosen, rejected in unit.pairs]
    return {"per_round": curve, "privacy_per_round": privacy, "held_out_pairs": sum(len(u.pairs) for u in held_out),
            "train_pairs": len(train_pairs), "seconds": time.perf_counter() - start,
            "adapter": str(workdir / "dpo" / "policy"), "_train_pairs": train_pairs, "_held_out": held_out,
            "_max_prompt_length": config.data.max_prompt_length}


def anchor_trl(args, dpo: dict, workdir: Path) -> dict:
    """TRL's centralized DPO on the pooled training pairs, scored as the federated adapter is."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flwr_verl.config import ModelConfig
    from flwr_verl.engine.models import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path(ModelConfig())
    pairs = workdir / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in dpo["_train_pairs"]))
    spec = {"model": str(model_dir), "pairs": str(pairs), "out": str(workdir / "trl"), "beta": args.beta,
            "epochs": args.trl_epochs, "lr": args.trl_lr, "batch_size": args.trl_batch_size,
            "lora_rank": args.lora_rank, "seed": args.seed, "sft_weight": args.sft_weight}
    (workdir / "trl.json").write_text(json.dumps(spec))
    print(f"anchor: TRL DPOTrainer on {len(dpo['_train_pairs'])} pairs, {args.trl_epochs} epochs", flush=True)
    done = subprocess.run([args.trl_python, str(harness.BENCHMARKS / "trl_dpo_anchor.py"), str(workdir / "trl.json")],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the TRL anchor failed:\n{done.stderr[-3000:]}")
    trained = json.loads(done.stdout.strip().splitlines()[-1])
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model = PeftModel.from_pretrained(base, str(workdir / "trl" / "policy"))
    accuracy = pairwise_accuracies(model, load_tokenizer(model_dir), dpo["_held_out"], dpo["_max_prompt_length"],
                                   args.beta)
    return {"pairwise_accuracy": accuracy, "epochs": args.trl_epochs, "lr": args.trl_lr,
            "batch_size": args.trl_batch_size, **trained}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=8.0, help="each stage's; 0: without DP")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-iterations", type=int, default=10)
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--eval-split", choices=("tune", "val"), default="val",
                        help="held-out prompts: tune (for choosing settings) or val (for reporting)")
    parser.add_argument("--dpo-rounds", type=int, default=6)
    parser.add_argument("--dpo-train-size", type=int, default=512, help="prompts per client (5 pairs each)")
    parser.add_argument("--dpo-val-size", type=int, default=120)
    parser.add_argument("--dpo-batch-size", type=int, default=64)
    parser.add_argument("--dpo-lr", type=float, default=6e-3)
    parser.add_argument("--dpo-clip-norm", type=float, default=1.0, help="stage dpo's privacy.max_grad_norm")
    parser.add_argument("--beta", type=float, default=1.0, help="dpo.beta, and the verifier's reward_model.beta")
    parser.add_argument("--sft-weight", type=float, default=1.0,
                        help="dpo.sft_weight, the chosen responses' NLL term (RPO), also the TRL anchor's; 0: plain DPO")
    parser.add_argument("--lora-rank", type=int, default=8)
    # The verifier's score and ranks, as chosen on the tune split (docs/rlhf.md): no flags run the measured setup.
    parser.add_argument("--verifier-score", choices=("implicit", "likelihood"), default="likelihood")
    parser.add_argument("--length-normalize", action="store_true", help="the verifier's reward_model.length_normalize")
    parser.add_argument("--verifier-rank", action=argparse.BooleanOptionalAction, default=True,
                        help="the verifier's reward_model.group_rank")
    parser.add_argument("--verifier-lr", type=float, default=None,
                        help="the verifier arm's actor.lr (default: the config's, as the rule arm's)")
    parser.add_argument("--ppo-rounds", type=int, default=8)
    parser.add_argument("--ppo-train-size", type=int, default=512)
    parser.add_argument("--ppo-batch-size", type=int, default=32)
    parser.add_argument("--eval-size", type=int, default=120)
    parser.add_argument("--trl-python", default=os.environ.get("FLWR_VERL_TRL_PYTHON", ""),
                        help="python of a venv with trl 1.16 and peft; empty: no anchor")
    # The anchor at its own best on the tune split (docs/rlhf.md): a weak anchor would flatter us.
    parser.add_argument("--trl-epochs", type=float, default=2.0)
    parser.add_argument("--trl-lr", type=float, default=5e-3)
    parser.add_argument("--trl-batch-size", type=int, default=16)
    parser.add_argument("--no-arms", action="store_true", help="stage dpo (and the anchor) only, for tuning")
    parser.add_argument("--out", type=Path, default=harness.RESULTS)
    args = parser.parse_args()

    import torch
    from rlhf_pipeline import stage2

    from flwr_verl.config import ModelConfig, parse_run_config
    from flwr_verl.engine.models import load_tokenizer, resolve_model_path
    from flwr_verl.engine.reward_model import LearnedReward, load_dpo_verifier

    torch.set_num_threads(1)
    started = time.perf_counter()
    eval_rows = harness.validation_problems(args.eval_size, args.eval_split)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        dpo = stage_dpo(args, workdir, eval_rows)
        first, last = dpo["per_round"][0], dpo["per_round"][-1]
        result.update({
            "pairwise_accuracy": {"round_0": first["pairwise_accuracy"], "final": last["pairwise_accuracy"]},
            "epsilon": dpo["privacy_per_round"][-1]["epsilon"],
            "exact_match": {"round_0": first["exact_match"], "final": last["exact_match"]},
            "stage_dpo": {k: v for k, v in dpo.items() if not k.startswith("_")},
        })
        print(f"stage dpo: pairwise accuracy {first['pairwise_accuracy']} -> {last['pairwise_accuracy']}", flush=True)
        result["anchor_trl"] = anchor_trl(args, dpo, workdir) if args.trl_python else None
        if result["anchor_trl"]:
            print(f"anchor: pairwise accuracy {result['anchor_trl']['pairwise_accuracy']}", flush=True)
        if not args.no_arms:
            verifier = {"reward_model.kind": "implicit", "reward_model.model.path": dpo["adapter"],
                        "reward_model.score": args.verifier_score, "reward_model.beta": args.beta,
                        "reward_model.length_normalize": args.length_normalize,
                        "reward_model.group_rank": args.verifier_rank}
            # the verifier's own score of each greedy answer (a group of one has no rank), to show reward hacking
            reward_config = parse_run_config({**verifier, "reward_model.enable": True,
                                              "reward_model.group_rank": False}).engine.reward_model
            scorer = LearnedReward(load_dpo_verifier(dpo["adapter"], ModelConfig(), torch.device("cpu")),
                                   load_tokenizer(resolve_model_path(ModelConfig())), reward_config)
            arms = {}
            for name, reward, lr in (("verifier", verifier, args.verifier_lr), ("rule", None, None)):
                print(f"GRPO against the {name}:", flush=True)
                arm = stage2(args, reward, eval_rows, scorer, lr)
                arms[name] = {"exact_match": [r["exact_match"] for r in arm["per_round"]],
                              "verifier_score": [r["learned_reward"] for r in arm["per_round"]],
                              "epsilon": arm["privacy_per_round"][-1]["epsilon"], "seconds": arm["seconds"]}
            result["arms"] = arms
    summarize(args, result)
    result.update(seconds=time.perf_counter() - started, peak_rss_mib=harness.peak_rss_mib())
    print(json.dumps(result["goals"], indent=2))
    harness.write_json(args.out / "dpo.json", result)


def summarize(args, result: dict) -> None:
    """The issue's goals, each with the figures that decide it."""
    score = f"{args.verifier_score}{'_per_token' if args.length_normalize else ''}"
    final = result["pairwise_accuracy"]["final"][score]
    goals: dict = {"verifier_score": score, "pairwise_accuracy": final, "epsilon": result["epsilon"],
                   "pairwise_accuracy_0.9": final >= 0.9 and result["epsilon"] <= 8}
    if result["anchor_trl"]:
        anchor = result["anchor_trl"]["pairwise_accuracy"][score]
        goals.update({"anchor_pairwise_accuracy": anchor, "within_0.02_of_anchor": final >= anchor - 0.02})
    if arms := result.get("arms"):
        rule = arms["rule"]["exact_match"][-1] - arms["rule"]["exact_match"][0]
        verifier = arms["verifier"]["exact_match"]
        dpo_gain = result["exact_match"]["final"] - result["exact_match"]["round_0"]
        goals.update({
            "rule_gain": round(rule, 4), "verifier_gain": round(verifier[-1] - verifier[0], 4),
            "dpo_policy_gain": round(dpo_gain, 4),
            "dpo_policy_share_0.7": bool(rule > 0 and dpo_gain >= 0.7 * rule),
            "verifier_share_0.7": bool(rule > 0 and verifier[-1] - verifier[0] >= 0.7 * rule),
            "no_reward_hacking": all(v >= verifier[0] - 0.02 for v in verifier),
        })
    result["goals"] = goals


if __name__ == "__main__":
    main()
