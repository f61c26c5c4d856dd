"""DP-SGD through Opacus on the LoRA policy: per-unit gradients, clipping, noise, accounting.

Offline and CPU-only: the embedded model (shipped with the package, ``flwr_verl/embedded/shipped``)
is loaded once for this module. Tests that change the adapter weights
get them restored afterwards, and every test checks that it left no Opacus hooks behind.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from opacus.accountants.analysis.prv import (
    Domain,
    PoissonSubsampledGaussianPRV,
    TruncatedPrivacyRandomVariable,
    compose_heterogeneous,
    compute_safe_domain_size,
    discretize,
)
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from opacus.accountants.rdp import RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from flwr_verl.config import ConfigError, PrivacyConfig, engine_config
from flwr_verl.engine._verl import core_algos, verl_F
from flwr_verl.engine.data import task_rows
from flwr_verl.engine.forward import response_logits
from flwr_verl.engine.models import build_models
from flwr_verl.engine.proximal import Proximal
from flwr_verl.engine.rollout import generate
from flwr_verl.engine.trainer import LocalPPOTrainer
from flwr_verl.privacy.dpsgd import (
    IterationMechanism,
    PrivacyAccount,
    PrivacyAccountError,
    PrivateUpdate,
    make_private,
    noise_for_target_epsilon,
    sample_rate,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::RuntimeWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"
)

DELTA = 1e-5
G, N_RESPONSES = 3, 4  # prompt groups (privacy units) x responses per prompt in the test batch


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    built = build_models(engine_config().model, with_critic=False, seed=0)
    # Fresh LoRA B matrices are zero, which makes every lora_A gradient zero: a per-sample
    # gradient check would then compare zeros with zeros. Move the adapters off their init.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in trainable(built.policy):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return built


@pytest.fixture(autouse=True)
def restore_adapters(request):
    """Give every test the same adapter weights, and check it detached Opacus."""
    if "models" not in request.fixturenames:
        yield
        return
    policy = request.getfixturevalue("models").policy
    saved = [p.detach().clone() for p in trainable(policy)]
    yield
    attached = per_sample_hooks_attached(policy)
    with torch.no_grad():
        for param, value in zip(trainable(policy), saved):
            param.copy_(value)
    policy.eval()
    assert not attached, "Opacus hooks were left attached to the policy"


def clear_gradients(policy) -> None:
    for param in trainable(policy):
        param.grad = None
        for attr in ("grad_sample", "summed_grad"):
            if hasattr(param, attr):
                delattr(param, attr)


def per_sample_hooks_attached(policy) -> bool:
    """Behaviour, not Opacus's internals: while its hooks are attached, a backward pass in
    training mode leaves per-sample gradients (``grad_sample``) on the LoRA weights."""
    clear_gradients(policy)
    policy.train()
    policy(input_ids=torch.tensor([[1, 2, 3]], device="cpu")).logits.sum().backward()
    attached = any(getattr(p, "grad_sample", None) is not None for p in trainable(policy))
    clear_gradients(policy)
    policy.eval()
    return attached


@pytest.fixture(scope="module")
def rows():
    return task_rows("arithmetic", 64, seed=0, split="train")


@pytest.fixture(scope="module")
def batch(models, rows):
    """G prompts x n sampled responses (adjacent rows per prompt), with fixed per-row advantages."""
    config = engine_config()
    torch.manual_seed(0)
    data = generate(models.policy, models.tokenizer, rows[:G], config.rollout, config.data.max_prompt_length,
                    n=N_RESPONSES)
    generator = torch.Generator().manual_seed(1)
    advantages = torch.randn(G * N_RESPONSES, 1, generator=generator)
    data.batch["advantages"] = advantages.expand_as(data.batch["responses"]).contiguous()
    assert data.batch["response_mask"].sum(-1).min() >= 1
    return data


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def unit_rows(unit: int) -> np.ndarray:
    return np.arange(unit * N_RESPONSES, (unit + 1) * N_RESPONSES)


def policy_loss(policy, data, shared_prompts: bool = False) -> torch.Tensor:
    """-(log_prob * advantage) per token, aggregated like the trainer (seq-mean-token-mean); with
    ``shared_prompts`` each prompt is computed once for its responses, as the trainer does."""
    responses = data.batch["responses"]
    logits = response_logits(policy, data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"],
                             responses.shape[1], N_RESPONSES if shared_prompts else 1)
    log_prob = verl_F.logprobs_from_logits(logits, responses)
    return core_algos.agg_loss(-(log_prob * data.batch["advantages"]), data.batch["response_mask"],
                               "seq-mean-token-mean")


def dp_backward(private: PrivateUpdate, policy, batch, shared_prompts: bool = False) -> None:
    """The trainer's forward pass inside the update's recording, then its per-sample backward."""
    with private.recording():
        private.backward(policy_loss(policy, batch, shared_prompts))


def dp_step(private: PrivateUpdate, policy, batch) -> None:
    """One DP-SGD step as the trainer takes it: per-prompt backward, then clip, noise, step."""
    dp_backward(private, policy, batch)
    private.step()


def attach(policy, optimizer, *, noise: float, max_grad_norm: float = 1.0, mode: str = "hooks",
           batch_size: int = G, num_prompts: int = 4 * G, num_mini_batches: int = 1, proximal: Proximal | None = None,
           seed: int = 0, rows_per_unit: int = N_RESPONSES) -> PrivateUpdate:
    """Opacus on the policy exactly as the trainer does it (``make_private``); with
    ``rows_per_unit=1`` its gradients are per row."""
    policy.train()
    return make_private(
        policy, optimizer, num_prompts, PrivacyConfig(max_grad_norm=max_grad_norm, grad_sample_mode=mode),
        batch_size=batch_size, num_mini_batches=num_mini_batches, rows_per_unit=rows_per_unit, noise_multiplier=noise,
        proximal=proximal, seed=seed,
    )


def unit_gradients_alone(policy, data) -> list[list[torch.Tensor]]:
    """Plain autograd (no Opacus hooks): each unit's gradient of its own mean loss, computed alone."""
    params = trainable(policy)
    return [list(torch.autograd.grad(policy_loss(policy, data.select_idxs(unit_rows(u))), params))
            for u in range(G)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def rdp_epsilon(sigma: float, q: float, steps: int, delta: float = DELTA) -> float:
    """Independent RDP computation: Opacus's analysis functions, called directly."""
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    return float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])


def prv_epsilon(history, delta: float = DELTA, eps_error: float = 0.01) -> float:
    """Independent PRV computation (Gopi et al.) from Opacus's analysis primitives."""
    delta_error = delta / 1000
    prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in history]
    counts = [steps for _, _, steps in history]
    size = compute_safe_domain_size(prvs=prvs, max_self_compositions=counts, eps_error=eps_error,
                                    delta_error=delta_error)
    mesh = eps_error / np.sqrt(sum(counts) * np.log(12 / delta_error) / 2)
    domain = Domain.create_aligned(-size, size, mesh)
    dprvs = [discretize(TruncatedPrivacyRandomVariable(prv, domain.t_min, domain.t_max), domain) for prv in prvs]
    return float(compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
                 .compute_epsilon(delta, delta_error, eps_error)[2])


def gaussian_epsilon(mu: float, delta: float = DELTA) -> float:
    """Exact epsilon of a Gaussian mechanism with sensitivity / sigma = mu (Balle & Wang 2018)."""
    return brentq(lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta, 0, 500)


# ----------------------------------------------------------------------------- per-unit gradients
@pytest.mark.parametrize("shared_prompts", [False, True], ids=["full-forward", "shared-prompts"])
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_per_unit_gradients_equal_each_unit_alone(models, batch, mode, shared_prompts):
    """Each prompt's gradient (computed per unit, without per-row gradients) is the gradient of
    that prompt computed alone, with a full forward, also when the update's forward computes each
    prompt once for its responses (a prompt pass of G rows and a response pass of G x n rows
    through every layer); and it is the mean of its rows' per-row gradients, to float rounding."""
    policy = models.policy
    params = trainable(policy)
    per_unit, per_row = [], []
    for rows_per_unit, out in ((N_RESPONSES, per_unit), (1, per_row)):
        private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0, mode=mode, rows_per_unit=rows_per_unit)
        try:
            dp_backward(private, policy, batch, shared_prompts)
            out.extend(p.grad_sample.detach().clone() for p in params)
            private.optimizer.zero_grad()
        finally:
            private.close()
    batch_grad = torch.autograd.grad(policy_loss(policy, batch), params)
    assert all(g.shape == (G, *p.shape) for g, p in zip(per_unit, params))
    assert all(g.shape == (G * N_RESPONSES, *p.shape) for g, p in zip(per_row, params))
    pooled_rows = [g.view(G, N_RESPONSES, *g.shape[1:]).mean(1) for g in per_row]
    for unit in range(G):
        got, want = flat(g[unit] for g in per_unit), flat(g[unit] for g in pooled_rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    alone = unit_gradients_alone(policy, batch)
    for unit in range(G):
        got, want = flat(g[unit] for g in per_unit), flat(alone[unit])
        assert want.norm() > 1e-3, "degenerate check: the unit's gradient is zero"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # The batch loss is the mean of the units' losses, so its gradient is their mean.
    torch.testing.assert_close(flat(g.mean(0) for g in per_unit), flat(batch_grad), rtol=1e-4, atol=1e-6)
    # Units differ: the per-unit gradients are not one gradient broadcast.
    assert (flat(alone[0]) - flat(alone[1])).norm() > 1e-3


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_per_unit_gradients_of_other_layer_types_equal_each_unit_alone(mode):
    """Per unit, a linear layer gets a unit's rows as one row, any other layer type (here a layer
    norm) its per-row gradients summed; through a pass of one row per unit and one of n rows per
    unit, each unit's gradient is the gradient of its own mean loss."""
    from flwr_verl.privacy.per_sample import PerSampleGradients

    torch.manual_seed(0)
    units, n = 3, 4
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 1))
    prompts, responses = torch.randn(units, 2, 6), torch.randn(units * n, 3, 6)

    def row_losses(prompt_rows, response_rows):  # each response row's loss, its prompt's included
        return model(response_rows).sum((1, 2)) + model(prompt_rows).sum((1, 2)).repeat_interleave(n)

    params = list(model.parameters())
    per_sample = PerSampleGradients(model, functorch=mode == "functorch", rows_per_unit=n)
    try:
        with per_sample.recording():
            per_sample.backward(row_losses(prompts, responses).mean())
        got = [p.grad_sample for p in params]
    finally:
        per_sample.close()
    assert all(g.shape == (units, *p.shape) for g, p in zip(got, params))
    for unit in range(units):
        alone = torch.autograd.grad(row_losses(prompts[unit:unit + 1], responses[unit * n:(unit + 1) * n]).mean(),
                                    params)
        torch.testing.assert_close(flat(g[unit] for g in got), flat(alone))


def opacus_hooks_grad_samples(policy, batch, mode: str) -> list[torch.Tensor]:
    """The reference: per-row gradients from Opacus's own hooks (what ``PrivacyEngine.make_private``
    attaches), through a plain ``loss.backward()``."""
    from opacus.grad_sample import GradSampleHooks

    policy.train()
    hooks = GradSampleHooks(policy, loss_reduction="mean", force_functorch=mode == "functorch")
    try:
        policy_loss(policy, batch).backward()
        return [p.grad_sample.detach().clone() for p in trainable(policy)]
    finally:
        hooks.cleanup()
        clear_gradients(policy)


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_per_row_gradients_are_bit_identical_to_opacus_hooks(models, batch, mode):
    policy = models.policy
    params = trainable(policy)
    reference = opacus_hooks_grad_samples(policy, batch, mode)
    private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0, mode=mode, rows_per_unit=1)
    try:
        dp_backward(private, policy, batch)
        got = [p.grad_sample.detach().clone() for p in params]
        assert all(p.grad is None for p in params), "the weights' batch gradient is computed and thrown away"
        private.optimizer.zero_grad()
    finally:
        private.close()
    assert len(got) == len(reference) == len(params) and all(r.abs().max() > 0 for r in reference)
    mismatched = [i for i, (g, r) in enumerate(zip(got, reference)) if not torch.equal(g, r)]
    assert not mismatched, f"per-row gradients differ from Opacus's hooks for {len(mismatched)} weights"


def test_pooling_by_unit_of_row_needs_per_row_gradients(models):
    """An update whose gradients are already per prompt refuses to pool them again by ``unit_of_row``."""
    private = attach(models.policy, torch.optim.SGD(trainable(models.policy), lr=1.0), noise=0.0)
    try:
        for param in private.optimizer.params:
            param.grad_sample = torch.zeros((G, *param.shape))
        with pytest.raises(ValueError, match=r"pooling by unit_of_row needs rows_per_unit=1"):
            private.step(torch.arange(G))
    finally:
        private.close()


def test_passes_outside_the_update_run_unhooked_and_record_nothing(models, batch, rows):
    """While a private update is open, generation and no-grad passes give exactly what they give
    without DP and leave nothing behind; inside its recording only the training forward counts."""
    policy = models.policy
    params = trainable(policy)
    config = engine_config()

    def no_grad_log_probs():
        with torch.no_grad():
            return policy(input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"],
                          position_ids=batch.batch["position_ids"]).logits

    def rollout():
        torch.manual_seed(3)
        return generate(policy, models.tokenizer, rows[:2], config.rollout, config.data.max_prompt_length,
                        n=2).batch["responses"]

    policy.eval()
    without_dp = (rollout(), no_grad_log_probs())
    private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0)
    try:
        dp_backward(private, policy, batch)
        alone = [p.grad_sample.detach().clone() for p in params]
        private.optimizer.zero_grad()
        policy.eval()
        under_dp = (rollout(), no_grad_log_probs())
        policy.train()
        with private.recording():
            no_grad_log_probs()  # a no-grad pass inside the recording records nothing
            with pytest.raises(RuntimeError, match="no training forward pass was recorded"):
                private.backward(torch.zeros((), requires_grad=True))
            loss = policy_loss(policy, batch)
            no_grad_log_probs()  # nor between the training forward and its backward
            private.backward(loss)
        interleaved = [p.grad_sample.detach().clone() for p in params]
        private.optimizer.zero_grad()
        policy.train()
        policy_loss(policy, batch).backward()  # outside the recording: a plain backward
        assert all(getattr(p, "grad_sample", None) is None for p in params)
        with pytest.raises(RuntimeError, match=r"update.backward\(loss\)"):
            private.step()
    finally:
        clear_gradients(policy)
        private.close()
    assert torch.equal(under_dp[0], without_dp[0]) and torch.equal(under_dp[1], without_dp[1])
    assert all(torch.equal(a, b) for a, b in zip(interleaved, alone))


# ----------------------------------------------------------------------------- clipping
def test_noise_free_update_is_mean_of_clipped_unit_gradients(models, batch):
    policy = models.policy
    params = trainable(policy)
    alone = unit_gradients_alone(policy, batch)
    norms = torch.stack([flat(g).norm() for g in alone])
    max_grad_norm = float(norms.median())  # some units clipped, at least one not
    assert (norms > max_grad_norm * 1.01).any() and (norms <= max_grad_norm).any()
    clipped = [[g * min(1.0, max_grad_norm / (norm.item() + 1e-6)) for g in grads]
               for grads, norm in zip(alone, norms)]
    expected_update = [sum(c[i] for c in clipped) / G for i in range(len(params))]

    before = [p.detach().clone() for p in params]
    private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0, max_grad_norm=max_grad_norm)
    try:
        assert private.optimizer.expected_batch_size == G
        dp_step(private, policy, batch)
    finally:
        private.close()
    update = [b - p.detach() for b, p in zip(before, params)]  # SGD, lr=1: the update is -grad
    torch.testing.assert_close(flat(update), flat(expected_update), rtol=1e-4, atol=1e-6)
    # The unclipped mean is measurably different: clipping really happened.
    unclipped = flat(sum(g[i] for g in alone) / G for i in range(len(params)))
    assert (unclipped - flat(expected_update)).norm() > 1e-3 * unclipped.norm()


def test_no_unit_contributes_more_than_max_grad_norm(models, batch):
    """Each unit alone through the DP optimizer (noise 0, averaging over 1): update = clip(g)."""
    policy = models.policy
    params = trainable(policy)
    max_grad_norm = 0.05
    alone = unit_gradients_alone(policy, batch)
    assert all(flat(g).norm() > 2 * max_grad_norm for g in alone), "pick max_grad_norm below the gradients"
    for unit in range(G):
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0, max_grad_norm=max_grad_norm,
                         batch_size=1, num_prompts=4)
        try:
            dp_step(private, policy, batch.select_idxs(unit_rows(unit)))
        finally:
            private.close()
        contribution = flat(s - p.detach() for s, p in zip(start, params))
        assert contribution.norm() <= max_grad_norm * (1 + 1e-5)
        assert contribution.norm() >= max_grad_norm * (1 - 1e-3)  # clipped to the bound, not beyond
        direction = flat(alone[unit])
        assert torch.nn.functional.cosine_similarity(contribution, direction, dim=0) > 0.9999
        with torch.no_grad():
            for param, value in zip(params, start):
                param.copy_(value)


# ----------------------------------------------------------------------------- noise
def test_noise_std_is_sigma_times_clip_over_expected_batch(models):
    policy = models.policy
    params = trainable(policy)
    sigma, max_grad_norm = 1.3, 0.7
    private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=sigma, max_grad_norm=max_grad_norm,
                     batch_size=8, num_prompts=64, num_mini_batches=2, seed=123)
    expected_std = sigma * max_grad_norm / 4  # expected batch per mini-batch: 8 prompts / 2
    draws = []
    try:
        assert private.optimizer.expected_batch_size == 4
        for _ in range(2):
            before = flat(p.detach().clone() for p in params)
            private.noise_only_step()
            draws.append(before - flat(p.detach() for p in params))
    finally:
        private.close()
    for noise in draws:
        count = noise.numel()
        assert count > 20_000
        # std of the sample std of a normal: std / sqrt(2 count), about 0.4% here; allow 5 sigma.
        assert noise.std().item() == pytest.approx(expected_std, rel=5 / math.sqrt(2 * count))
        assert abs(noise.mean().item()) < 5 * expected_std / math.sqrt(count)
    assert torch.corrcoef(torch.stack(draws))[0, 1].abs() < 0.05  # fresh noise every step


# ----------------------------------------------------------------------------- training through the trainer
def small_config(**privacy):
    return engine_config(
        data={"train_batch_size": 8, "train_size": 64},
        actor={"ppo_mini_batch_size": 4, "lr": 1e-2},
        privacy={"deterministic": True, **privacy},
    )


def test_lora_weights_change_under_dp(models, rows):
    """Opacus + PEFT pitfall: adapters that never move while epsilon grows. Noise 0, so only
    gradients through the per-sample hooks can move them."""
    trainer = LocalPPOTrainer(small_config(), rows, models=models)
    names = [name for name, p in models.policy.named_parameters() if p.requires_grad]
    params = trainable(models.policy)
    assert all("lora_" in name for name in names) and len(params) > 0
    before = [p.detach().clone() for p in params]
    result = trainer.fit(2, noise_multiplier=0.0, seed=0)
    assert result.metrics[0]["prompts"] > 0
    unchanged = [name for name, b, p in zip(names, before, params) if torch.equal(b, p.detach())]
    assert not unchanged, f"LoRA weights did not change under DP-SGD: {unchanged}"
    assert result.mechanism == IterationMechanism(0.0, 8 / 64, 1) and result.iterations == 2
    assert not per_sample_hooks_attached(models.policy), "fit left Opacus hooks attached"


def test_dp_fit_is_unchanged_from_opacus_hooks_throughout(models, rows, monkeypatch):
    """A short seeded DP fit (2 iterations of 2 mini-batches, noise on) ends at the same weights,
    to float rounding, as the same fit with Opacus's hooks on the policy throughout and their
    per-row gradients pooled per prompt (the path before per-sample gradients were recorded only
    in the update, and computed per prompt). Both take the full forward: Opacus's hooks cannot
    take a prompt pass and a response pass of different widths (they add the prompt rows'
    gradients to the first rows of the batch, not to each prompt's rows)."""
    from opacus.grad_sample import GradSampleHooks

    from flwr_verl.privacy.per_sample import PerSampleGradients

    params = trainable(models.policy)
    start = [p.detach().clone() for p in params]

    def fit() -> tuple[list[torch.Tensor], list[dict[str, float]]]:
        with torch.no_grad():
            for param, value in zip(params, start):
                param.copy_(value)
        config = engine_config(data={"train_batch_size": 8, "train_size": 64}, privacy={"deterministic": True},
                               actor={"ppo_mini_batch_size": 4, "lr": 1e-2}, model={"shared_prompt_cache": False})
        result = LocalPPOTrainer(config, rows, models=models).fit(2, seed=4)
        return [p.detach().clone() for p in params], result.metrics

    def hooks_backward(self, loss):
        loss.backward()  # Opacus's hooks: per-row gradients, pooled here per prompt of n adjacent rows
        for param in params:
            param.grad_sample = param.grad_sample.view(-1, self.rows_per_unit, *param.shape).mean(1)

    weights, metrics = fit()
    with monkeypatch.context() as patch:
        hooks = GradSampleHooks(models.policy, loss_reduction="mean")
        patch.setattr(PerSampleGradients, "recording", lambda self: contextlib.nullcontext())
        patch.setattr(PerSampleGradients, "backward", hooks_backward)
        try:
            reference_weights, reference_metrics = fit()
        finally:
            hooks.cleanup()
    assert any(not torch.equal(w, s) for w, s in zip(weights, start))
    torch.testing.assert_close(flat(weights), flat(reference_weights), rtol=1e-5, atol=1e-7)
    timings = {key for m in metrics for key in m if key.startswith("time_")}
    # pg_loss and ppo_kl are means of differences of float32 log-probabilities (about -1 to -5): the
    # two paths' rounding moves them by about 1e-7 (ppo_kl by 1.1e-7 in one CI-like run).
    assert ([{k: pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in m.items() if k not in timings} for m in metrics]
            == [{k: v for k, v in m.items() if k not in timings} for m in reference_metrics])


def test_fit_records_multi_epoch_iterations_at_sigma_over_sqrt_k(models, rows):
    trainer = LocalPPOTrainer(engine_config(
        data={"train_batch_size": 8}, actor={"ppo_mini_batch_size": 4, "ppo_epochs": 4},
        privacy={"deterministic": True, "noise_multiplier": 1.0}), rows[:40], models=models)
    trainer.iteration = lambda fit: {"prompts": float(len(next(fit.batches)))}  # sampling and accounting only
    result = trainer.fit(5, seed=0)
    assert result.mechanism == IterationMechanism(1.0, 8 / 40, 4) and result.iterations == 5
    account = PrivacyAccount(history=[(0.5, 8 / 40, 3)])
    account.record(result.mechanism, result.iterations)
    assert account.history == [(0.5, 8 / 40, 8)]  # merged: the same (sigma/sqrt(4), q)


def test_poisson_draws_are_fresh_and_at_rate_batch_over_n(models, rows):
    """The sampler draws at exactly q = train_batch_size / N, and never replays its draws."""
    num_prompts, batch_size = 18, 4  # Opacus's own loader would sample at 1/ceil(18/4) = 0.2
    trainer = LocalPPOTrainer(engine_config(data={"train_batch_size": batch_size},
                                            actor={"ppo_mini_batch_size": batch_size},
                                            privacy={"deterministic": True}), rows[:num_prompts], models=models)
    draws = []
    trainer.iteration = lambda fit: draws.append(tuple(next(fit.batches))) or {"prompts": float(len(draws[-1]))}
    result = trainer.fit(400, seed=1)
    q = batch_size / num_prompts
    assert result.mechanism == IterationMechanism(trainer.config.privacy.noise_multiplier, q, 1)
    assert result.iterations == 400
    period = math.ceil(num_prompts / batch_size)
    assert draws[:period] != draws[period: 2 * period], "Poisson draws repeat: subsampling is not fresh"
    assert len(set(draws)) > 300
    counts = np.bincount([i for draw in draws for i in draw], minlength=num_prompts) / len(draws)
    # Each prompt is included with probability q, independently (binomial std ~0.02 here).
    assert np.abs(counts - q).max() < 0.1
    assert np.mean([len(d) for d in draws]) == pytest.approx(batch_size, rel=0.1)


def test_empty_poisson_draw_is_a_noise_only_step(models):
    """With q = 1/2000 a draw is empty about a third of the time: it must still release noise."""
    many_rows = task_rows("arithmetic", 2000, seed=1, split="train")
    config = engine_config(data={"train_batch_size": 1}, actor={"ppo_mini_batch_size": 1},
                           privacy={"deterministic": True, "noise_multiplier": 1.0})
    trainer = LocalPPOTrainer(config, many_rows, models=models)
    params = trainable(models.policy)
    start = [p.detach().clone() for p in params]
    for seed in range(30):
        with torch.no_grad():
            for param, value in zip(params, start):
                param.copy_(value)
        result = trainer.fit(1, seed=seed)
        if result.metrics[0]["prompts"] == 0:
            break
    else:
        pytest.fail("no empty Poisson draw in 30 seeds at q=1/2000")
    assert result.metrics == [{"prompts": 0.0}]
    assert result.mechanism == IterationMechanism(1.0, 1 / 2000, 1) and result.iterations == 1  # accounted
    changed = [not torch.equal(s, p.detach()) for s, p in zip(start, params)]
    assert all(changed), "an empty draw made no (noise) update"


def test_proximal_gradient_is_added_after_noise_and_not_clipped(models, batch):
    policy = models.policy
    params = trainable(policy)
    mu, max_grad_norm = 1e3, 1e-6
    generator = torch.Generator().manual_seed(5)
    offsets = [1e-3 * torch.randn(p.shape, generator=generator) for p in params]
    anchor = [p.detach() - d for p, d in zip(params, offsets)]  # theta - anchor = offsets
    before = [p.detach().clone() for p in params]
    private = attach(policy, torch.optim.SGD(params, lr=1.0), noise=0.0, max_grad_norm=max_grad_norm,
                     batch_size=G, num_prompts=4 * G, num_mini_batches=1,
                     proximal=Proximal.at(params, anchor, mu))
    try:
        assert private.optimizer.expected_batch_size == G  # a term added before scaling would shrink G-fold
        dp_step(private, policy, batch)
    finally:
        private.close()
    update = flat(b - p.detach() for b, p in zip(before, params))
    proximal = flat(mu * d for d in offsets)
    assert proximal.norm() > 1e3 * max_grad_norm
    # update = clipped mean (norm <= max_grad_norm) + mu * (theta - anchor), the latter in full.
    assert (update - proximal).norm() <= max_grad_norm * (1 + 1e-3) + 1e-5 * proximal.norm()


# ----------------------------------------------------------------------------- accounting
def spent(sigma: float, q: float, iterations: int, epochs: int = 1, accountant: str = "rdp") -> PrivacyAccount:
    """A fresh account after ``iterations`` iterations at (sigma, q, K = epochs)."""
    return PrivacyAccount(accountant).after(IterationMechanism(sigma, q, epochs), iterations)


@pytest.mark.parametrize(("sigma", "q", "steps", "reference"), [
    (1.0, 0.016, 1000, 3.40),
    (0.8, 0.016, 100, 2.84),
    (1.5, 0.016, 100, 0.63),
])
def test_rdp_epsilon_matches_independent_computation(sigma, q, steps, reference):
    account = spent(sigma, q, steps)
    assert account.history == [(sigma, q, steps)]
    ours = account.epsilon(DELTA)
    assert ours == pytest.approx(rdp_epsilon(sigma, q, steps), rel=1e-9)
    assert ours == pytest.approx(reference, abs=0.006)


def test_multi_epoch_iteration_is_one_step_at_sigma_over_sqrt_k():
    sigma, q, iterations, epochs = 1.0, 0.016, 1000, 4
    account = spent(sigma, q, iterations, epochs)
    assert account.history == [(sigma / 2, q, iterations)]
    honest = account.epsilon(DELTA)
    assert honest == pytest.approx(rdp_epsilon(sigma / 2, q, iterations), rel=1e-9)
    assert honest == pytest.approx(22.5, abs=0.01)  # the notes' honest figure
    undercounted = rdp_epsilon(sigma, q, epochs * iterations)  # Opacus's step hook: K fresh steps
    assert undercounted == pytest.approx(6.9, abs=0.05)
    assert honest > 3 * undercounted


def test_account_composes_across_fits_and_noise_levels():
    q = 0.05
    account = spent(1.2, q, 30)
    account.record(IterationMechanism(1.2, q), 50)  # same mechanism: merged
    assert account.history == [(1.2, q, 80)]
    account.record(IterationMechanism(1.2, q, ppo_epochs=2), 20)  # two epochs: a new mechanism
    assert account.history == [(1.2, q, 80), (1.2 / math.sqrt(2), q, 20)] and account.steps == 100
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=q, noise_multiplier=1.2, steps=80, orders=orders) + \
        compute_rdp(q=q, noise_multiplier=1.2 / math.sqrt(2), steps=20, orders=orders)
    assert account.epsilon(DELTA) == pytest.approx(get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)[0],
                                                   rel=1e-9)
    assert PrivacyAccount().epsilon(DELTA) == 0.0
    assert spent(0.0, q, 1).epsilon(DELTA) == math.inf


def test_after_answers_what_if_without_spending():
    account = spent(1.0, 0.1, 5)
    future = account.after(IterationMechanism(1.0, 0.1), 5)
    assert account.history == [(1.0, 0.1, 5)] and future.history == [(1.0, 0.1, 10)]
    assert future.epsilon(DELTA) > account.epsilon(DELTA)


def test_account_round_trips_through_json_and_rejects_garbage():
    account = spent(0.9, 0.05, 7, epochs=2, accountant="prv")
    again = PrivacyAccount.from_json(account.to_json())
    assert again == account and again.epsilon(DELTA) == account.epsilon(DELTA)
    for text in ("", "[]", '{"accountant": "rdp"}', '{"accountant": "rdp", "history": [[1, 2]]}'):
        with pytest.raises(PrivacyAccountError, match="malformed privacy account"):
            PrivacyAccount.from_json(text)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_a_fit_of_zero_iterations_spends_nothing(accountant):
    assert spent(1.0, 0.1, 0, accountant=accountant).history == []
    account = spent(1.0, 0.1, 5, accountant=accountant)
    assert account.after(IterationMechanism(0.7, 0.1), 0).history == [(1.0, 0.1, 5)]
    # RDP alone would say 0.10 for a zero-step entry; PRV would crash on it.
    assert PrivacyAccount(accountant, [(1.0, 0.1, 0)]).epsilon(DELTA) == 0.0
    assert PrivacyAccount(accountant, [(1.0, 0.1, 0), (1.0, 0.1, 5)]).epsilon(DELTA) == account.epsilon(DELTA)


def test_prv_epsilon_matches_independent_computation():
    account = PrivacyAccount("prv", [(1.0, 0.016, 1000)])
    ours = account.epsilon(DELTA)
    assert ours == pytest.approx(prv_epsilon(account.history), rel=1e-6)
    assert ours == pytest.approx(3.06, abs=0.01)  # the notes' reference
    assert ours < PrivacyAccount("rdp", account.history).epsilon(DELTA)  # PRV is tighter than RDP here
    multi = spent(1.0, 0.016, 250, epochs=4, accountant="prv")
    assert multi.epsilon(DELTA) == pytest.approx(prv_epsilon([(0.5, 0.016, 250)]), rel=1e-6)


def test_multi_epoch_composition_is_exact_without_subsampling():
    """At q = 1, K releases at sigma are exactly one Gaussian mechanism with mu = sqrt(K)/sigma:
    the PRV accountant of the recorded history must match the closed form (its error is 0.01)."""
    sigma, epochs, iterations = 2.0, 4, 10
    exact = gaussian_epsilon(math.sqrt(epochs * iterations) / sigma)
    ours = spent(sigma, 1.0, iterations, epochs, accountant="prv").epsilon(DELTA)
    assert exact - 1e-3 <= ours <= exact + 0.02
    # K independent steps at sigma are the same mechanism at q = 1: also exact.
    assert spent(sigma, 1.0, epochs * iterations, accountant="prv").epsilon(DELTA) == pytest.approx(ours, abs=0.02)


# ----------------------------------------------------------------------------- target epsilon
@pytest.mark.parametrize("target", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("epochs", [1, 2])
def test_noise_for_target_epsilon_meets_the_target(target, epochs):
    config = PrivacyConfig(target_epsilon=target)
    q, iterations = 0.05, 240
    sigma = noise_for_target_epsilon(config, q, iterations, epochs)
    assert target - 0.02 <= spent(sigma, q, iterations, epochs).epsilon(config.delta) <= target + 1e-6
    assert IterationMechanism(sigma, q, epochs).effective_noise_multiplier == pytest.approx(sigma / math.sqrt(epochs))
    # The least such noise: 1% less overspends.
    assert spent(sigma * 0.99, q, iterations, epochs).epsilon(config.delta) > target


def test_noise_for_target_epsilon_prv():
    config = PrivacyConfig(target_epsilon=3.0, accountant="prv")
    sigma = noise_for_target_epsilon(config, 0.1, 24, 1)
    assert 3.0 - 0.02 <= spent(sigma, 0.1, 24, accountant="prv").epsilon(config.delta) <= 3.0 + 1e-6


def test_impossible_target_epsilon_raises_config_error():
    # RDP's conversion to (epsilon, delta) cannot go below about 0.1 at delta=1e-5, whatever sigma.
    with pytest.raises(ConfigError, match="privacy.target_epsilon"):
        noise_for_target_epsilon(PrivacyConfig(target_epsilon=0.01), 1.0, 1000, 1)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("section", "values", "key"), [
    ("privacy", {"noise_multiplier": -0.1}, "privacy.noise_multiplier"),
    ("privacy", {"noise_multiplier": 0.0}, "privacy.noise_multiplier"),  # DP on without noise: epsilon = inf
    ("privacy", {"max_grad_norm": 0.0}, "privacy.max_grad_norm"),
    ("privacy", {"max_grad_norm": -1.0}, "privacy.max_grad_norm"),
    ("privacy", {"delta": 0.0}, "privacy.delta"),
    ("privacy", {"delta": 1.0}, "privacy.delta"),
    ("privacy", {"delta": 1.5}, "privacy.delta"),
    ("privacy", {"grad_sample_mode": "ghost"}, "privacy.grad_sample_mode"),
    ("privacy", {"grad_sample_mode": "bogus"}, "privacy.grad_sample_mode"),
    ("privacy", {"accountant": "gdp2"}, "privacy.accountant"),
    ("algorithm", {"adv_estimator": "gae"}, "algorithm.adv_estimator"),
    ("algorithm", {"adv_estimator": "reinforce_plus_plus"}, "algorithm.adv_estimator"),
    ("actor", {"loss_agg_mode": "token-mean"}, "actor.loss_agg_mode"),
    ("algorithm", {"use_kl_in_reward": True, "kl_ctrl_type": "adaptive"}, "algorithm.kl_ctrl.type"),
])
def test_bad_privacy_settings_raise_config_error_naming_the_key(section, values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        engine_config(**{section: values})


@pytest.mark.parametrize(("section", "values"), [
    ("algorithm", {"adv_estimator": "gae"}),
    ("algorithm", {"adv_estimator": "reinforce_plus_plus"}),
    ("actor", {"loss_agg_mode": "token-mean"}),
    ("algorithm", {"use_kl_in_reward": True, "kl_ctrl_type": "adaptive"}),
])
def test_batch_coupled_settings_are_fine_without_privacy(section, values):
    engine_config(**{section: values}, privacy={"enabled": False})  # the rejection above is DP-specific


@pytest.mark.parametrize(("batch_size", "num_prompts"), [(33, 32), (0, 32), (1, 0)])
def test_sample_rate_outside_unit_interval_raises(batch_size, num_prompts):
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        sample_rate(batch_size, num_prompts)


def test_batch_larger_than_prompts_fails_before_training(models, rows):
    trainer = LocalPPOTrainer(engine_config(data={"train_batch_size": 32}, actor={"ppo_mini_batch_size": 32}),
                              rows[:20], models=models)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        trainer.fit(1)
    params = trainable(models.policy)
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        make_private(models.policy, torch.optim.SGD(params, lr=1.0), 20, PrivacyConfig(),
                     batch_size=32, num_mini_batches=1, rows_per_unit=N_RESPONSES, noise_multiplier=1.0)
    assert not per_sample_hooks_attached(models.policy)


# ----------------------------------------------------------------------------- mini-batch assignment
def test_each_unit_joins_one_mini_batch_independently_of_the_others(models):
    """The accounting argument: a unit's mini-batch must not depend on how many other units were
    sampled. Adding unit 9 to a draw of 9 regroups none of the first 9 (``np.array_split`` of a
    permutation would regroup them), each unit is in exactly one mini-batch, and the assignment
    is uniform."""
    def private_update():
        return attach(models.policy, torch.optim.SGD(trainable(models.policy), lr=1.0), noise=1.0,
                      batch_size=8, num_prompts=64, num_mini_batches=4, seed=7)

    def assignment(update, count):
        return {int(unit): batch for batch, units in enumerate(update.split(count)) for unit in units}

    def assignments(count: int, draws: int = 1) -> list[dict[int, int]]:
        update = private_update()  # seeded: the same random stream each time
        try:
            return [assignment(update, count) for _ in range(draws)]
        finally:
            update.close()

    (with_nine,), (with_ten,) = assignments(9), assignments(10)
    assert sorted(with_ten) == list(range(10)) and sorted(with_nine) == list(range(9))
    assert all(with_ten[unit] == with_nine[unit] for unit in range(9))
    counts = np.zeros((5, 4))
    for draw in assignments(5, draws=2000):
        for unit, batch in draw.items():
            counts[unit, batch] += 1
    # Binomial(2000, 1/4): std ~0.0097 of the frequency; allow 5 std.
    assert np.abs(counts / 2000 - 0.25).max() < 0.05
