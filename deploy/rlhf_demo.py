"""The embedded RLHF pipeline in one command: SFT, then DPO, then GRPO against the DPO verifier.

Three ``flwr run`` simulations of ``--supernodes`` organisations on the embedded model, each with
DP (its own epsilon, on its own prompts; the nodes' ledgers keep them) and SecAgg+:

1. stage ``sft`` on the embedded (prompt, answer) pairs;
2. stage ``dpo`` on the embedded preference pairs (chosen: the right sum; rejected: a near
   miss), starting from the SFT adapter (``model.init_adapter``);
3. GRPO (stage ``policy``) from the DPO adapter, against the DPO policy as each organisation's
   verifier (``reward_model.kind = "implicit"``), never against the rule.

Each stage's held-out figures (problems and pairs no client trains on) are printed as it ends,
and the three run directories stay under ``--out``. A few minutes on 2 cores::

    python deploy/rlhf_demo.py [--out ~/flwr_verl_runs/rlhf-demo]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's deploy package

from deploy.simulation import flwr_run_simulation, isolated_env, kill_tree_with_env  # noqa: E402

# DP: each stage targets epsilon 8 on its own prompts. DPO's beta, lr and SFT term (RPO) were chosen on the
# tune split (benchmarks/dpo.py --eval-split tune), and so was the verifier's score: the DPO policy's likelihood
# (its implicit reward scored an empty answer highest, and GRPO against it fell to 0 held-out accuracy),
# scored by its rank among each prompt's answers (reward_model.group_rank, chosen on the tune split with
# benchmarks/dpo.py; docs/rlhf.md has its figures). The rounds keep the whole demo at a few minutes on 2 cores.
PRIVATE = {"privacy.target_epsilon": 8.0}
STAGES = {
    "sft": {**PRIVATE, "stage": "sft", "num-server-rounds": 2, "data.train_size": 512},
    "dpo": {**PRIVATE, "stage": "dpo", "num-server-rounds": 4, "data.train_size": 512, "data.val_size": 32,
            "actor.lr": 6e-3, "dpo.beta": 1.0, "dpo.sft_weight": 1.0},
    "grpo": {**PRIVATE, "num-server-rounds": 4, "reward_model.enable": True, "reward_model.kind": "implicit",
             "reward_model.score": "likelihood", "reward_model.group_rank": True},
}


def final_adapter(out: Path) -> Path:
    """The policy adapter of the newest run under ``out``."""
    runs = sorted(out.glob("run-*"))
    if not runs or not (runs[-1] / "adapters" / "final" / "policy" / "adapter_config.json").is_file():
        raise SystemExit(f"no finished run with a final policy adapter under {out}")
    return runs[-1] / "adapters" / "final" / "policy"


def summary(out: Path) -> str:
    """Round 0 and the last round's held-out figures, and the epsilon of the newest run under ``out``."""
    rounds = [json.loads(line) for line in (sorted(out.glob("run-*"))[-1] / "metrics.jsonl").read_text().splitlines()
              if line.strip()]
    first, last = rounds[0].get("evaluate", {}), rounds[-1].get("evaluate", {})
    epsilon = rounds[-1].get("fit", {}).get("epsilon_run")
    return (f"held-out accuracy {first.get('accuracy', float('nan')):.3f} at round 0 -> "
            f"{last.get('accuracy', float('nan')):.3f} at round {rounds[-1]['round']}"
            + (f", epsilon {epsilon:.2f}" if epsilon is not None else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("~/flwr_verl_runs/rlhf-demo").expanduser())
    parser.add_argument("--supernodes", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each stage's run")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = isolated_env(args.out)  # one FLWR_HOME under --out: the nodes' ledgers span the three stages, and stay
    try:
        adapter = None
        for name, run_config in STAGES.items():
            out = args.out / name
            config = {**run_config, "output-dir": str(out)}
            if adapter is not None:
                config["model.init_adapter"] = str(adapter)
            if name == "grpo":
                config["reward_model.model.path"] = str(adapter)  # the DPO policy as the verifier
            print(f"== stage {name}: {' '.join(f'{k}={v}' for k, v in config.items())}", flush=True)
            done = flwr_run_simulation(env, args.out, config, args.supernodes, args.timeout, capture=False)
            if done.returncode:
                raise SystemExit(f"stage {name} failed (flwr run exit {done.returncode})")
            print(f"== stage {name}: {summary(out)}", flush=True)
            adapter = final_adapter(out)
    finally:
        kill_tree_with_env(env["FLWR_HOME"])


if __name__ == "__main__":
    main()
