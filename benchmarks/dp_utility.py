"""What differential privacy costs in reward: held-out accuracy of the embedded task at epsilon
1, 3, 8 and without DP, and the share of the non-private accuracy gain each epsilon keeps.

Goal: at epsilon 8, at least 90% of the non-private gain.

    python benchmarks/dp_utility.py [--iterations 80] [--train-size 2048] [--seeds 1] [--out DIR]

The default federated run is emulated in one process, without Flower's transport: ``--clients``
clients (3), each with its own share of the prompts (``flwr_verl.engine.data.load_rows``, iid), run
``--local-iterations`` (10) RL iterations per round from the global adapter, with FedProx's
term (``--proximal-mu``), and the server steps the strategy's server optimizer on the mean of their
updates (FedAvg, server learning rate 1, unless ``args`` sets ``server_optimizer``,
``server_learning_rate`` or ``server_momentum``) for ``--iterations / --local-iterations`` rounds.
This is what the ClientApp and ServerApp do, minus the messages (SecAgg+ changes the sum by less
than 1e-4).

Each client's noise multiplier is set by ``privacy.target_epsilon`` through
``noise_for_target_epsilon`` for its planned ``--iterations`` local iterations, so each client
spends exactly the target (delta = 1e-5, RDP); the privacy unit is one prompt with its responses.
Every setting uses the same seed(s), data and iteration budget, and ``privacy.deterministic`` for
reproducibility (never in production: a known seed reveals the noise).

The reward is the greedy exact-match accuracy of the global adapter on the task's validation
problems (all of them, or ``--eval-size`` of them): the split of the problem space that no
client trains on (``embedded.split_problems``), before training and after each round. Reported:
final reward per setting, and the share of the non-private reward gain kept at each epsilon.

Learning rates were chosen on the tune split, never on the validation problems: under DP the
engine's default ``actor.lr`` (3e-3), without DP 1e-3 (``--baseline-lr``; what every arm of
``federation.py`` chose on the tune split), so the share of the gain is measured against a
tuned baseline, not a flattered one. Two runs go in parallel (``--workers``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import harness

harness.quiet()


def arm_settings(args, **attributes: str) -> dict:
    """The config keys (``key="attribute"``) that ``args`` sets (an absent or None attribute sets
    nothing, an arm's False or 0 is passed on); the others keep the config's defaults."""
    return {key: getattr(args, name) for key, name in attributes.items() if getattr(args, name, None) is not None}


def engine(args, *, private: bool, seed: int):
    from flwr_verl.config import engine_config

    lr = args.lr if private or not args.baseline_lr else args.baseline_lr
    return engine_config(
        model={"path": str(getattr(args, "model_path", "") or ""),
               **arm_settings(args, lora_rank="lora_rank", lora_freeze_a="lora_freeze_a",
                              target_modules="target_modules")},
        rollout=arm_settings(args, n="rollout_n", temperature="temperature"),
        data={"train_size": args.train_size, "train_batch_size": args.train_batch_size, "val_size": 0},
        actor={"ppo_mini_batch_size": args.mini_batch_size or args.train_batch_size, "lr": lr,
               "ppo_epochs": args.ppo_epochs, **arm_settings(args, loss_agg_mode="loss_agg_mode")},
        algorithm=arm_settings(args, adv_estimator="adv_estimator", norm_adv_by_std_in_grpo="norm_adv_by_std"),
        privacy={"enabled": private, "max_grad_norm": args.max_grad_norm, "deterministic": True},
        trainer={"seed": seed, "local_iterations": args.local_iterations},
    )


def run(args, target_epsilon: float | None, seed: int, eval_rows: list[dict], fixed_noise: float | None = None) -> dict:
    """One emulated federated run; ``target_epsilon`` None trains without DP, unless ``fixed_noise``
    gives the noise multiplier directly."""
    import numpy as np
    import torch

    from flwr_verl.config import FederationConfig
    from flwr_verl.engine.data import load_rows
    from flwr_verl.engine.models import build_models
    from flwr_verl.engine.trainer import LocalPPOTrainer
    from flwr_verl.federation.strategy import server_optimizer, server_step
    from flwr_verl.privacy.dpsgd import PrivacyAccount, noise_for_target_epsilon, sample_rate

    private = target_epsilon is not None or fixed_noise is not None
    config = engine(args, private=private, seed=seed)
    models = build_models(config.model, config.needs_critic, seed=seed)  # one cache per process, as in the app
    trainers = [LocalPPOTrainer(config, load_rows(config.data, "train", seed, pid, args.clients), models=models)
                for pid in range(args.clients)]
    adapters = models.adapters
    sigma = 0.0
    if fixed_noise is not None:
        sigma = fixed_noise
    elif private:
        q = sample_rate(config.data.train_batch_size, min(len(t.train_rows) for t in trainers))
        sigma = noise_for_target_epsilon(dataclasses.replace(config.privacy, target_epsilon=target_epsilon), q,
                                         args.iterations, config.actor.ppo_epochs)
    accounts = [PrivacyAccount(config.privacy.accountant) for _ in trainers]
    global_arrays = adapters.get_arrays()
    server = FederationConfig(**arm_settings(args, server_optimizer="server_optimizer",
                                             server_learning_rate="server_learning_rate",
                                             server_momentum="server_momentum"))
    global_weights = [torch.tensor(a, dtype=torch.float64) for a in global_arrays]
    optimizer = server_optimizer(server, global_weights)
    weights = np.array([len(t.train_rows) for t in trainers], dtype=np.float64)
    weights /= weights.sum()
    curve = [trainers[0].evaluate(eval_rows).reward]
    train_reward = []
    rounds = math.ceil(args.iterations / args.local_iterations)
    start = time.perf_counter()
    for server_round in range(1, rounds + 1):
        iterations = min(args.local_iterations, args.iterations - (server_round - 1) * args.local_iterations)
        updates, rewards = [], []
        for pid, trainer in enumerate(trainers):
            adapters.set_arrays(global_arrays)
            result = trainer.fit(
                iterations, anchor=global_arrays, proximal_mu=args.proximal_mu,
                noise_multiplier=sigma if private else None, seed=seed + 100_003 * server_round + 7919 * pid,
            )
            if result.mechanism is not None:
                accounts[pid].record(result.mechanism, result.iterations)
            updates.append([new - old for new, old in zip(adapters.get_arrays(), global_arrays)])
            rewards += [m["reward_mean"] for m in result.metrics if "reward_mean" in m]
        server_step(optimizer, global_weights, [sum(w * u[i] for w, u in zip(weights, updates))
                                                for i in range(len(global_arrays))])
        global_arrays = [w.detach().numpy().astype(np.float32) for w in global_weights]
        adapters.set_arrays(global_arrays)
        curve.append(trainers[0].evaluate(eval_rows).reward)
        train_reward.append(float(np.mean(rewards)) if rewards else math.nan)
    spent = max(account.epsilon(config.privacy.delta) for account in accounts) if private else None
    return {"target_epsilon": target_epsilon, "fixed_noise": fixed_noise, "seed": seed, "noise_multiplier": sigma, "epsilon_spent": spent,
            "eval_reward_per_round": curve, "train_reward_per_round": train_reward,
            "initial_reward": curve[0], "final_reward": curve[-1], "seconds": time.perf_counter() - start}


def setting_key(item: dict) -> str:
    if item.get("fixed_noise") is not None:
        return f"sigma_{item['fixed_noise']:g}"
    return "no_dp" if item["target_epsilon"] is None else f"eps_{item['target_epsilon']:g}"


def summarize(runs: list[dict]) -> dict:
    import numpy as np

    by_setting: dict[str, list[dict]] = {}
    for item in runs:
        key = setting_key(item)
        by_setting.setdefault(key, []).append(item)
    base = by_setting.get("no_dp", [])
    base_gain = np.mean([r["final_reward"] - r["initial_reward"] for r in base]) if base else math.nan
    summary = {}
    for key, items in by_setting.items():
        gain = float(np.mean([r["final_reward"] - r["initial_reward"] for r in items]))
        summary[key] = {
            "final_reward": float(np.mean([r["final_reward"] for r in items])),
            "initial_reward": float(np.mean([r["initial_reward"] for r in items])),
            "reward_gain": gain,
            "fraction_of_non_private_gain": gain / base_gain if base_gain > 0 else math.nan,
            "noise_multiplier": items[0]["noise_multiplier"],
            "epsilon_spent": items[0]["epsilon_spent"],
            "seeds": len(items),
        }
    return summary


def plot(runs: list[dict], summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"no_dp": "black", "eps_8": "tab:green", "eps_3": "tab:orange", "eps_1": "tab:red"}
    for key in summary:
        curves = np.array([r["eval_reward_per_round"] for r in runs if setting_key(r) == key])
        label = "no DP" if key == "no_dp" else \
            f"epsilon {summary[key]['epsilon_spent']:.2g} (sigma {summary[key]['noise_multiplier']:.2f})"
        left.plot(range(curves.shape[1]), curves.mean(0), marker="o", label=label, color=colors.get(key))
    left.set_xlabel("server round")
    left.set_ylabel("greedy exact-match reward")
    left.legend()
    left.grid(alpha=0.3)
    keys = [k for k in summary if k != "no_dp"]
    fractions = [100 * summary[k]["fraction_of_non_private_gain"] for k in keys]
    right.bar([k.split("_", 1)[1] for k in keys], fractions, color=[colors.get(k, "gray") for k in keys])
    right.axhline(90, color="gray", linestyle="--", label="goal at epsilon 8: 90%")
    right.axhline(100, color="black", linewidth=0.8)
    right.set_xlabel("epsilon (delta = 1e-5)")
    right.set_ylabel("% of non-private reward gain kept")
    right.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _task(args, task: tuple, eval_rows: list[dict]) -> dict:
    import torch

    torch.set_num_threads(1)
    target, seed, fixed_noise = task
    return run(args, target, seed, eval_rows, fixed_noise=fixed_noise)


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--epsilons", type=float, nargs="*", default=[1.0, 3.0, 8.0])
    parser.add_argument("--iterations", type=int, default=80, help="local iterations per client, all rounds")
    parser.add_argument("--local-iterations", type=int, default=10, help="local iterations per round")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--train-size", type=int, default=2048, help="prompts per client")
    parser.add_argument("--train-batch-size", type=int, default=64, help="expected prompts per iteration")
    parser.add_argument("--mini-batch-size", type=int, default=0, help="prompts per update (0: the whole batch)")
    parser.add_argument("--ppo-epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of the DP runs (the engine default)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, default=1, help="repeat every setting over seeds 0..SEEDS-1")
    parser.add_argument("--eval-size", type=int, default=0, help="validation problems (0: all of the split)")
    parser.add_argument("--noise-multipliers", type=float, nargs="*", default=[],
                        help="extra DP runs at these fixed noise multipliers (diagnostics; 0 = clipping only)")
    parser.add_argument("--baseline-lr", type=float, default=1e-3,
                        help="learning rate of the non-private run (its own best; 0: --lr)")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                        help="runs in parallel, one process each")
    parser.add_argument("--skip-baseline", action="store_true", help="no non-private run (for sweeps)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS, help="directory for dp_utility.json and .png")
    parser.add_argument("--name", default="dp_utility", help="file name stem of the outputs")
    parser.add_argument("--model-path", default="", help="base model directory ('': the embedded model)")
    parser.add_argument("--eval-split", default="val", choices=("val", "tune"),
                        help="the split evaluated on (tune: for choosing settings)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    eval_rows = harness.validation_problems(args.eval_size, args.eval_split)

    def report(result: dict) -> None:
        if result["noise_multiplier"] or result["fixed_noise"] is not None:
            label = f"{setting_key(result)} (sigma {result['noise_multiplier']:.3f}, spent {result['epsilon_spent']:.2f})"
        else:
            label = "no DP"
        print(f"seed {result['seed']} {label:36s} reward {result['initial_reward']:.3f} -> "
              f"{result['final_reward']:.3f}  [{result['seconds']:.0f} s]", flush=True)

    tasks = []
    for seed in range(args.seeds):
        tasks += [(target, seed, None) for target in ([] if args.skip_baseline else [None]) + list(args.epsilons)]
        tasks += [(None, seed, sigma) for sigma in args.noise_multipliers]
    started = time.perf_counter()
    runs = []
    if args.workers > 1:
        # Runs are independent and single-threaded: one process per core. Results do not depend on it.
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_task, args, task, eval_rows) for task in tasks]
            for future in as_completed(futures):
                runs.append(future.result())
                report(runs[-1])
        order = {task: i for i, task in enumerate(tasks)}
        runs.sort(key=lambda r: order[(r["target_epsilon"], r["seed"], r["fixed_noise"])])
    else:
        for task in tasks:
            runs.append(_task(args, task, eval_rows))
            report(runs[-1])
    summary = summarize(runs)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "name", "skip_baseline", "workers")}
    title = (f"{args.clients} clients x {args.iterations} local iterations ({args.local_iterations}/round), "
             f"{args.train_size} prompts/client, batch {args.train_batch_size}, lr {args.lr:g}"
             f"{'' if not args.baseline_lr else f' (no DP: {args.baseline_lr:g})'}, "
             f"C {args.max_grad_norm:g}, {args.seeds} seed(s)")
    print(title)
    for key, row in summary.items():
        extra = "" if key == "no_dp" else f"  sigma {row['noise_multiplier']:.3f}  kept {100 * row['fraction_of_non_private_gain']:.0f}%"
        print(f"  {key:7s} final reward {row['final_reward']:.3f}  gain {row['reward_gain']:+.3f}{extra}")
    kept8 = summary.get("eps_8", {}).get("fraction_of_non_private_gain")
    if kept8 is not None:
        print(f"share of the non-private reward gain kept at epsilon 8: {100 * kept8:.0f}% (goal >= 90%)")
    harness.write_json(args.out / f"{args.name}.json", {"settings": settings, "summary": summary, "runs": runs,
                                                        "seconds": time.perf_counter() - started})
    plot(runs, summary, args.out / f"{args.name}.png", title)
    print(f"wrote {args.out / args.name}.png")


if __name__ == "__main__":
    main()
