"""One-run privacy audit: an empirical lower bound on epsilon from a single federated training run.

This module holds the audit's statistics and canaries; ``tools.audit`` trains the federation
with them planted (``run_audit``) and is the ``flwr-verl-audit`` command.

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run" (NeurIPS 2023):

1. m canaries are drawn; each is included, independently with probability 1/2, in one
   client's private data (``run_audit``);
2. the federation trains once, as configured (in one process: ``inprocess.InProcessClients``,
   the same clients, strategy and typed messages as over Flower's wire; SecAgg+ only hides the
   individual updates from the server, it does not change the released model);
3. every canary is scored under the final global adapter;
4. the k top-scored canaries are guessed members and the k bottom-scored non-members;
5. the number v of correct guesses out of r = 2k gives an epsilon that the mechanism cannot have
   at 95% confidence (``epsilon_lower_bound``, the paper's Theorem 5.2 / its Algorithm for
   (epsilon, delta)): under (epsilon, delta)-DP, P[v or more correct] <= P[Binomial(r,
   e^eps / (1 + e^eps)) >= v] + 2 m delta alpha, with alpha from the binomial's lower tail.

Two kinds of canaries (``audit.kind``).

**Gradient canaries (default; the paper's white-box setting, with Dirac canaries).** Canary i is a
privacy unit whose gradient is ``privacy.max_grad_norm`` times a sign on one adapter weight and 0
elsewhere (``GradientCanaries``). A member enters the canary client's real update exactly as a
prompt does (``WithGradientCanaries``): Poisson-sampled at the update's rate q each local
iteration, assigned to a mini-batch in each PPO epoch; under DP it arrives as one per-prompt
gradient sample (as ``rollout.n`` per-response ones when the update clips per response), so it
goes through Opacus's clipping, the noise of the accounted noise multiplier, the optimizer, FedProx's aggregation; without DP it is
one more unit of the mini-batch's mean gradient. So a canary is one privacy unit of the RL
update (a prompt with all its responses) in the worst case DP must cover: a unit gradient at the
clipping norm, along a direction no other prompt pushes. Its score is how far its weight moved
against its sign. Two canaries share no weight, so a member moves only its own weight and a
non-member's weight moves only by the task's gradients and the noise: no cross-talk. They audit
the DP update and its accounting (a noise multiplier too small for the claim, clipping or pooling
that lets a unit weigh more than ``max_grad_norm``, sampling that is not the accounted q); they
cannot see a per-sample gradient that misses a layer or a coupling between prompts made earlier
in the RL batch (prompt canaries can, in principle).

**Prompt canaries (black-box), and why they suit RL on prompts.** A canary is a prompt that
occurs nowhere else (``<x>-<y>-<z>=``) whose secret answer is one digit; its reward is 1 when a
response starts with it. The secret is drawn by a fair coin between the two answers the initial
(public) policy finds likeliest on that prompt, and the other one is the canary's alternative
(``make_canaries``). So (a) the only way the model can learn which of the two is the secret is
from the rewarded rollouts of that very prompt; (b) both answers are sampled often by the initial
policy, so GRPO/RLOO see a reward difference within the prompt's group and the gradient is not
zero (an RL update never sees a target it does not sample); (c) a non-member's score, the change
of log p(secret) - log p(alternative), is as likely to be negative as positive whatever training
did to the prompt, because the coin that named the secret is independent of training; (d) one
canary is one privacy unit of the DP guarantee (a prompt with all its responses and rewards).

Prompt canaries have no power on the embedded tiny model. On ``benchmarks/audit_power.py``'s
earlier small configuration (64 canaries, 16 guesses, 2 rounds of 30 iterations) DP off gave 12
and 13 of 16 correct (a bound of 1 needs 15), and 9 development runs of variants (below) gave 11
to 16 of 16, an AUC of 0.68-0.82. Member canaries do learn (log-odds up by about 1-1.5 nats,
p(secret) 0.42 -> 0.78 at the median), but a non-member's log-odds move as much: with no canary
planted at all, training on the task alone moves them by 1.1-1.5 nats at the median (sd 1.3-1.9)
for every prompt format tried (dashes, random digits, plus and minus signs, ``a+b+c=``, lengths
6 to 17), and member canaries add cross-talk through shared features (the model learns smooth
functions of the prompt; the median |cosine| between two canaries' gradients is 0.3 to 0.5).
Tried in development, on other seeds than the reported ones, none above an AUC of about 0.8:
more iterations (120 per client), learning rates 1.5e-3 to 1e-2, one client, longer prompts,
128 canaries, canaries whose answer pairs share no digit, canaries chosen greedily for
near-orthogonal gradients and a small projection on the task's gradients, subtracting the drift
predicted from 300-1500 never-trained probe prompts (ridge regression on the initial hidden
state: R^2 0.5-0.8 on probes, but it removes the members' generalising signal with the drift:
member scores 1.28 -> 0.78 nats on average), and white-box alignment scores (the canary's
gradient against the model's change, raw, normalised or deconvolved by ridge regression over all
canaries' gradients).

The bound is a lower bound: a small value proves nothing about a large epsilon, and one audit
with r guesses can never exceed logit(0.05^(1/r)) (all guesses right: 1.58 at r = 16, 3.04 at
r = 64), so a claim above that cannot be refuted by it.

    flwr-verl-audit [run-config.toml] --set privacy.enabled=false --canaries 256 --guesses 64 --out audit.jsonl
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.stats
import torch

from flwr_verl.config import require

Row = dict[str, Any]  # a prompt row in verl's format (``engine.data.Row``)

CANARY_SOURCE = "flwr_verl/canary"
SECRETS = tuple("0123456789")  # the alphabet of secret answers
CANARY_KINDS = ("gradient", "prompt")


# ----------------------------------------------------------------------------- the statistics
def p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """The largest probability that an (epsilon, delta)-DP mechanism lets an auditor make v or
    more correct guesses out of r, with m canaries each included with probability 1/2
    (Steinke et al. 2023, Theorem 5.2 and their Algorithm for approximate DP)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= correct={v} <= guesses={r} <= canaries={m}")
    q = 1.0 / (1.0 + math.exp(-epsilon))  # the accuracy of epsilon-DP randomized response
    tail = scipy.stats.binom.sf(v - 1, r, q)  # P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return float(min(tail, 1.0))
    # alpha = max_i P[v - i <= Binomial(r, q) < v] / i
    below = np.cumsum(scipy.stats.binom.pmf(np.arange(v - 1, -1, -1), r, q))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return float(min(tail + 2 * m * delta * alpha, 1.0))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float = 0.0, confidence: float = 0.95) -> float:
    """The largest epsilon that v correct guesses out of r reject at ``confidence``: the
    mechanism is not (epsilon, delta)-DP for any smaller epsilon, except with probability
    1 - confidence. 0 when the guesses reject nothing."""
    beta = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= beta:
        return 0.0
    low, high = 0.0, 1.0
    while p_value(m, r, v, high, delta) < beta:
        low, high = high, 2 * high
    for _ in range(60):  # keep p_value(low) < beta <= p_value(high)
        middle = (low + high) / 2
        low, high = (middle, high) if p_value(m, r, v, middle, delta) < beta else (low, middle)
    return low


def fewest_canaries(confidence: float) -> int:
    """Below this many canaries even all-correct guesses (probability 2^-m at epsilon 0) reject nothing."""
    return math.floor(math.log2(1 / (1 - confidence))) + 1


# ----------------------------------------------------------------------------- the audit
@dataclass
class AuditConfig:
    """``canaries``: m; ``guesses``: r (k = r/2 guessed members, k non-members);
    ``canary_client``: the partition whose data holds the included canaries; ``kind``: "gradient"
    (white-box Dirac canaries in the canary client's update, ``GradientCanaries``) or "prompt"
    (black-box prompt canaries in its training prompts, ``make_canaries``)."""

    canaries: int = 64
    guesses: int = 16
    confidence: float = 0.95
    canary_client: int = 0
    seed: int = 0
    kind: str = "gradient"

    def __post_init__(self) -> None:
        least = fewest_canaries(self.confidence) if 0 < self.confidence < 1 else 1
        require(0 < self.confidence < 1, "audit.confidence", self.confidence, "must be in (0, 1)")
        require(self.canaries >= least, "audit.canaries", self.canaries,
                f"must be >= {least} at confidence {self.confidence:g}: with fewer, even all-correct guesses "
                "bound nothing (each is right by chance with probability 1/2)")
        require(self.guesses >= least and self.guesses % 2 == 0 and self.guesses <= self.canaries, "audit.guesses",
                self.guesses, f"must be even, >= {least} and <= audit.canaries={self.canaries}")
        require(self.canary_client >= 0, "audit.canary_client", self.canary_client, "must be >= 0")
        require(self.kind in CANARY_KINDS, "audit.kind", self.kind, f"must be one of {', '.join(CANARY_KINDS)}")


@dataclass
class AuditResult:
    canaries: int
    guesses: int
    correct: int
    confidence: float
    delta: float  # the delta the bound is computed at (the run's privacy.delta; 0 without DP)
    epsilon_lower_bound: float
    epsilon_claimed: float  # what the canary client reported (inf without DP)
    members: int
    seconds: float
    kind: str = "gradient"

    def to_json(self) -> dict[str, Any]:
        return {"audit": {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in dataclasses.asdict(self).items()}}


def make_canary_prompts(count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct canary prompts ``<x>-<y>-<z>=``: a format that no task row has."""
    prompts: dict[str, None] = {}
    while len(prompts) < count:
        prompts["-".join(str(x) for x in rng.integers(10, 100, size=3)) + "="] = None
    return list(prompts)


def make_canaries(prompts: list[str], initial: np.ndarray, rng: np.random.Generator) -> list[Row]:
    """One canary per prompt: its secret is, by a fair coin, one of the two answers the initial
    policy finds likeliest on that prompt, and the other is its ``alternative`` (module docstring).
    ``initial``: log p(answer | prompt) under the initial adapter, (len(prompts), len(SECRETS))."""
    top_two = np.argsort(-initial, axis=1, kind="stable")[:, :2]
    coins = rng.integers(2, size=len(prompts))
    return [{"data_source": CANARY_SOURCE, "prompt": [{"role": "user", "content": text}],
             "reward_model": {"ground_truth": SECRETS[pair[coin]]},
             "extra_info": {"canary": index, "alternative": SECRETS[pair[1 - coin]]}}
            for index, (text, pair, coin) in enumerate(zip(prompts, top_two, coins))]


def with_canary_reward(compute_score):
    """``compute_score`` that also scores canaries: 1 when the response starts with the secret."""

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if data_source == CANARY_SOURCE:
            return 1.0 if solution_str.strip().startswith(str(ground_truth)) else 0.0
        return compute_score(data_source, solution_str, ground_truth, extra_info)

    return score


def score_canaries(before: np.ndarray, after: np.ndarray, canaries: list[Row]) -> np.ndarray:
    """Black-box membership scores: how much training raised the log-odds of each canary's
    secret against its alternative, on its own prompt. A non-member's secret is a fair coin
    between the two, independent of the trained model, so its score is as likely to be
    negative as positive whatever training did to canary-like prompts in general; a member's
    rollouts were rewarded for its secret only, which pushes its score up."""
    change = after - before  # (m, answers)
    rows = np.arange(len(canaries))
    secret = np.array([SECRETS.index(row["reward_model"]["ground_truth"]) for row in canaries])
    alternative = np.array([SECRETS.index(row["extra_info"]["alternative"]) for row in canaries])
    return change[rows, secret] - change[rows, alternative]


def guess(scores: np.ndarray, included: np.ndarray, guesses: int) -> int:
    """Correct guesses when the top ``guesses/2`` scores are called members and the bottom ones not."""
    order = np.argsort(-scores, kind="stable")
    k = guesses // 2
    return int(included[order[:k]].sum() + (~included[order[-k:]]).sum())


# ----------------------------------------------------------------------------- gradient canaries
@dataclass(frozen=True)
class GradientCanaries:
    """White-box gradient canaries (Steinke et al. 2023's white-box setting; the Dirac canaries of
    Nasr et al. 2023, "Tight Auditing of Differentially Private Machine Learning"): canary i is a
    privacy unit whose gradient is ``norm * signs[i]`` on the one adapter weight ``coordinates[i]``
    (a flat index over the trainable policy weights, in ``policy.parameters()`` order) and 0
    elsewhere, a loss gradient like any unit's. Its score is how far training moved that weight
    against its sign: the way gradient descent moves it when the canary is in the data."""

    coordinates: np.ndarray  # (m,) distinct
    signs: np.ndarray  # (m,) of +-1
    norm: float

    @classmethod
    def draw(cls, count: int, num_weights: int, norm: float, rng: np.random.Generator) -> GradientCanaries:
        require(count <= num_weights, "audit.canaries", count, f"must be <= the {num_weights} trainable weights")
        return cls(coordinates=rng.choice(num_weights, size=count, replace=False),
                   signs=rng.choice([-1.0, 1.0], size=count), norm=norm)

    def scores(self, before: np.ndarray, after: np.ndarray) -> np.ndarray:
        """Each canary's weight change against its gradient, from flat weights before and after."""
        return self.signs * (before[self.coordinates] - after[self.coordinates])


def flat_weights(params: list[torch.nn.Parameter]) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in params]).cpu().double().numpy()


class WithGradientCanaries:
    """One fit's update (``engine.update.PlainUpdate`` or ``privacy.dpsgd.PrivateUpdate``) with the member
    gradient canaries as extra privacy units, sampled as a prompt is: in each local iteration
    with the update's sample rate q, then, in each of the ``ppo_epochs`` passes, into one of the
    mini-batches uniformly. Under DP a sampled canary enters the real mechanism as a prompt of
    ``rows_per_unit`` responses does: as one per-prompt gradient sample (as many per-response
    ones, when the update clips per response, ``broken_mechanism("unpooled")``), so Opacus's
    clipping and noise treat it as any prompt; without DP it joins the mini-batch's mean gradient
    as one more unit."""

    def __init__(self, update, canaries: GradientCanaries, members: np.ndarray, *, sample_rate: float,
                 rows_per_unit: int, ppo_epochs: int, num_mini_batches: int, rng: np.random.Generator) -> None:
        self.update, self.canaries, self.members = update, canaries, members
        self.sample_rate, self.rows_per_unit, self.rng = sample_rate, rows_per_unit, rng
        self.num_mini_batches, self.steps_per_iteration = num_mini_batches, ppo_epochs * num_mini_batches
        self.private = update.mechanism is not None
        # a canary's gradient samples: one per unit of the update's rows_per_unit rows
        self.samples_per_canary = rows_per_unit // update.rows_per_unit if self.private else 1
        self.params = update.optimizer.params if self.private else update.params
        self.offsets = np.cumsum([0] + [p.numel() for p in self.params])
        self.steps, self.sampled, self.assigned, self.sizes = 0, members[:0], members[:0], []

    def __getattr__(self, name):  # everything else is the real update's
        return getattr(self.update, name)

    def split(self, unit_count: int) -> list[np.ndarray]:
        batches = self.update.split(unit_count)
        self.sizes = [len(units) for units in batches]
        return batches

    def _present(self) -> np.ndarray:
        """The canaries in this step's mini-batch (one call per step, empty ones included)."""
        if self.steps % self.steps_per_iteration == 0:
            self.sampled = self.members[self.rng.random(len(self.members)) < self.sample_rate]
        batch = self.steps % self.num_mini_batches
        if batch == 0:  # a new pass over the sampled units
            self.assigned = self.rng.integers(self.num_mini_batches, size=len(self.sampled))
        self.steps += 1
        return self.sampled[self.assigned == batch]

    def _gradients(self, present: np.ndarray) -> list[torch.Tensor]:
        """(len(present), *shape) per weight tensor: the present canaries' gradients."""
        out = [torch.zeros((len(present), *p.shape), dtype=p.dtype, device=p.device) for p in self.params]
        for row, index in enumerate(present):
            flat = int(self.canaries.coordinates[index])
            tensor = int(np.searchsorted(self.offsets, flat, side="right") - 1)
            out[tensor][row].view(-1)[flat - self.offsets[tensor]] = self.canaries.norm * self.canaries.signs[index]
        return out

    def step(self, unit_of_row: torch.Tensor | None = None) -> dict[str, float]:
        present = self._present()
        if len(present):
            rows = self._gradients(present)
            for param, grads in zip(self.params, rows):
                if self.private:
                    copies = grads.repeat_interleave(self.samples_per_canary, 0)
                    param.grad_sample = torch.cat([param.grad_sample, copies])
                else:  # the mean over the mini-batch's units, the canaries included
                    units = self.sizes[(self.steps - 1) % self.num_mini_batches]
                    param.grad = (param.grad * units + grads.sum(0)) / (units + len(present))
            if unit_of_row is not None:  # the canaries' rows are units of their own
                first = int(unit_of_row.max()) + 1
                extra = torch.arange(first, first + len(present), device=unit_of_row.device)
                unit_of_row = torch.cat([unit_of_row, extra.repeat_interleave(self.samples_per_canary)])
        return self.update.step(unit_of_row)

    def noise_only_step(self) -> None:
        present = self._present()
        if not (len(present) and self.private):  # without DP an empty mini-batch takes no step
            self.update.noise_only_step()
            return
        for param, grads in zip(self.params, self._gradients(present)):
            param.grad_sample = grads.repeat_interleave(self.samples_per_canary, 0)
        self.update.step()


def plant_gradient_canaries(trainer, canaries: GradientCanaries, members: np.ndarray, rng: np.random.Generator):
    """Make every fit of ``trainer`` (a ``LocalPPOTrainer``) run with the member canaries."""
    from flwr_verl.privacy.dpsgd import sample_rate

    real_start_fit = trainer.start_fit
    cfg = trainer.config

    @contextlib.contextmanager
    def start_fit(**kwargs):
        with real_start_fit(**kwargs) as fit:
            q = (fit.update.mechanism.sample_rate if fit.update.mechanism is not None
                 else sample_rate(cfg.data.train_batch_size, len(trainer.train_rows)))
            yield dataclasses.replace(fit, update=WithGradientCanaries(
                fit.update, canaries, members, sample_rate=q, rows_per_unit=cfg.rollout.n,
                ppo_epochs=cfg.actor.ppo_epochs, num_mini_batches=trainer.num_mini_batches, rng=rng))

    trainer.start_fit = start_fit
