"""SecAgg+: the derived settings (fast) and what real Flower SecAgg+ delivers (slow).

The slow tests run one Flower simulation (``flwr.simulation.run_simulation``: Ray backend, 3
supernodes, Flower's ``secaggplus_mod`` on the ClientApp through the project's
``secaggplus_when_requested``, ``SecAggPlusWorkflow`` in a ServerApp with a ``FedProxAdapters``
strategy) in a child process, through ``benchmarks/secagg_harness.py`` with the spec of
``benchmarks/secagg_precision.py``. Each client returns a fixed update seeded by its partition id
(a LoRA-sized adapter, 29k parameters, |update| < 0.5; 96, 256 and 480 examples, max-weight
500), and the same updates go through plain aggregation and SecAgg+, as deltas and as full
weights, in float32 and float64, one round per configuration. Ray binds to 127.0.0.1 only and
everything it started is killed afterwards (both are checked).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flwr_verl.config import ConfigError, DataConfig, FlwrVerlError, SecAggConfig
from flwr_verl.federation.secagg import (
    MAX_CLIENTS,
    MAX_QUANTIZATION_RANGE,
    MODULUS_RANGE,
    UpdateOutOfRange,
    check_update,
    derive_parameters,
    error_bound,
    exact_update,
    fewest_survivors,
    quantization_range_for,
)

TARGET = 1e-7  # max abs error of the secure aggregate against exact FedAvg


# ----------------------------------------------------------------------------- settings (fast)
def test_derived_parameters_are_accepted_by_flower():
    from flwr.server.workflow import SecAggPlusWorkflow

    params = derive_parameters(SecAggConfig(), DataConfig(train_size=256), num_clients=3)
    # the smallest range for 1e-7 with weights down to the 256 prompts each client has, of max-weight 512
    assert params.quantization_range == quantization_range_for(1e-7, 1.0, 256 / 512) < 2**31  # Flower: int32
    assert params.modulus_range == MODULUS_RANGE and bin(MODULUS_RANGE).count("1") == 1
    assert params.max_weight == 512.0  # auto: twice the prompts a task generator gives a client
    assert (params.num_shares, params.reconstruction_threshold, params.clipping_range) == (3, 2, 1.0)
    SecAggPlusWorkflow(**params.workflow_kwargs())  # Flower's own checks pass


def test_the_modulus_holds_the_largest_allowed_sum_without_wrapping():
    """Each client's quantized entry lies in [0, Q]: the sum of k clients unmasks correctly only
    while k * Q < modulus. MAX_CLIENTS is the largest such k, and one more client is refused."""
    from flwr.common.secure_aggregation.quantization import quantize

    top = int(quantize([np.array([1.0])], 1.0, MAX_QUANTIZATION_RANGE)[0][0])  # the largest quantized value
    assert top == MAX_QUANTIZATION_RANGE
    assert (MAX_CLIENTS * top) % MODULUS_RANGE == MAX_CLIENTS * top  # no wrap at the edge of the range
    assert ((MAX_CLIENTS + 1) * top) % MODULUS_RANGE != (MAX_CLIENTS + 1) * top  # 513 clients would wrap
    derive_parameters(SecAggConfig(), DataConfig(), num_clients=MAX_CLIENTS)
    with pytest.raises(ConfigError, match=rf"min-fit-clients={MAX_CLIENTS + 1} is invalid under SecAgg\+"):
        derive_parameters(SecAggConfig(), DataConfig(), num_clients=MAX_CLIENTS + 1)


def test_the_strategy_refuses_to_sample_more_clients_than_the_modulus_holds():
    from flwr.common import ndarrays_to_parameters

    from flwr_verl.config import FederationConfig
    from flwr_verl.federation.inprocess import InProcessClients
    from flwr_verl.federation.protocol import SecAggBounds
    from flwr_verl.federation.strategy import FedProxAdapters

    initial = [np.zeros(2, np.float32)]
    strategy = FedProxAdapters(FederationConfig(min_fit_clients=3, min_available_clients=3), initial,
                               local_iterations=1, secure_aggregation=SecAggBounds(1.0, 64.0))
    manager = InProcessClients.named(range(MAX_CLIENTS + 1))
    with pytest.raises(ConfigError, match=f"samples {MAX_CLIENTS + 1} clients"):
        strategy.configure_fit(1, ndarrays_to_parameters(initial), manager)
    assert len(strategy.configure_fit(1, ndarrays_to_parameters(initial), InProcessClients.named(range(MAX_CLIENTS)))) \
        == MAX_CLIENTS


def _flowers_secagg_ring(num_clients: int, num_shares: int, threshold: int, monkeypatch):
    """Flower's own SecAgg+ workflow after its setup stage (its neighbour windows over
    ``num_clients`` sampled node ids, 0..n-1), and the state whose survivors its threshold check reads."""
    from flwr.app import ArrayRecord, ConfigRecord
    from flwr.common import FitIns, ndarrays_to_parameters
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
    from flwr.server.workflow.secure_aggregation import secaggplus_workflow

    monkeypatch.setattr(secaggplus_workflow, "Message", lambda **_: None)  # nothing is sent: no run to name
    fit = FitIns(ndarrays_to_parameters([np.zeros(1)]), {})
    proxies = [(SimpleNamespace(node_id=node), fit) for node in range(num_clients)]
    context = SimpleNamespace(
        state=SimpleNamespace(config_records={MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: 1})},
                              array_records={MAIN_PARAMS_RECORD: ArrayRecord([np.zeros(1)])}),
        strategy=SimpleNamespace(configure_fit=lambda *_: proxies),
        client_manager=SimpleNamespace(num_available=lambda: num_clients))
    workflow, state = SecAggPlusWorkflow(num_shares, threshold), secaggplus_workflow.WorkflowState()
    workflow.setup_stage(SimpleNamespace(send_and_receive=lambda *_, **__: []), context, state)  # nobody answers
    return workflow, state


@pytest.mark.parametrize("num_shares, threshold", [(3, 2), (4, 2), (4, 3), (5, 2), (5, 4)])
def test_fewest_survivors_is_the_smallest_set_flowers_secagg_unmasks(num_shares, threshold, monkeypatch):
    """Client-level DP splits its noise over ``fewest_survivors`` clients (``distributed_dp``): no
    set of fewer survivors may pass Flower's threshold check, or the aggregate would hold less
    noise than accounted. Checked against every subset of Flower's own neighbour windows; and
    it is the smallest set that passes, so the noise is not over-provisioned either."""
    import itertools

    for num_clients in range(num_shares, 10):
        workflow, state = _flowers_secagg_ring(num_clients, num_shares, threshold, monkeypatch)
        assert len(state.nid_to_neighbours) == num_clients

        def unmasks(survivors) -> bool:
            state.active_node_ids = set(survivors)
            return workflow._check_threshold(state)

        smallest = min(size for size in range(num_clients + 1)
                       if any(unmasks(s) for s in itertools.combinations(range(num_clients), size)))
        assert fewest_survivors(num_clients, num_shares, threshold) == smallest, num_clients
    # at scale: 300 sampled clients with the default 3 shares and threshold 2 leave at least 200
    assert fewest_survivors(300, 3, 2) == 200 and fewest_survivors(3, 3, 2) == 2


def test_rejects_more_shares_than_sampled_clients():
    with pytest.raises(ConfigError, match=r"num-shares=4 .* 3 clients"):
        derive_parameters(SecAggConfig(num_shares=4), DataConfig(), num_clients=3)
    assert derive_parameters(SecAggConfig(num_shares=4), DataConfig(), num_clients=4).num_shares == 4


@pytest.mark.parametrize("threshold", [3, 4])
def test_rejects_reconstruction_threshold_not_below_num_shares(threshold):
    # Validated when the config is built (parse_run_config builds it), so derive_parameters never
    # receives such a config; Flower's SecAggPlusWorkflow would refuse it as well.
    with pytest.raises(ConfigError, match=rf"reconstruction-threshold={threshold} .*num-shares=3"):
        SecAggConfig(num_shares=3, reconstruction_threshold=threshold)
    with pytest.raises(ConfigError, match="reconstruction-threshold"):
        dataclasses.replace(SecAggConfig(), reconstruction_threshold=threshold)


def test_auto_max_weight_is_rejected_with_parquet_files():
    files = DataConfig(train_files="/data/train.parquet")
    with pytest.raises(ConfigError, match=r"max-weight=0 \(auto\) .*train_files"):
        derive_parameters(SecAggConfig(max_weight=0), files, num_clients=3)
    loose = SecAggConfig(max_weight=5000, precision=1e-6)  # 64-prompt clients: 1e-7 is out of reach at 5000
    assert derive_parameters(loose, files, num_clients=3).max_weight == 5000.0


def test_auto_max_weight_is_rejected_under_dirichlet_partitioning():
    # A client's share of the pooled prompts is unbounded by train_size there (133 of 192 seen).
    skewed = DataConfig(partition="dirichlet", train_size=64)
    with pytest.raises(ConfigError, match=r"max-weight=0 \(auto\) .*partition='dirichlet'"):
        derive_parameters(SecAggConfig(), skewed, num_clients=3)
    assert derive_parameters(SecAggConfig(max_weight=192), skewed, num_clients=3).max_weight == 192.0


def test_check_update_refuses_values_beyond_the_clipping_range():
    update = [np.zeros((4, 8), np.float32), np.array([0.5, -1.25, 0.75], np.float32)]
    with pytest.raises(UpdateOutOfRange, match=r"1\.25 exceeds secagg\.clipping-range=1\.0") as info:
        check_update(update, num_examples=10, clipping_range=1.0, max_weight=512)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FlwrVerlError)


def test_check_update_refuses_more_examples_than_max_weight():
    with pytest.raises(UpdateOutOfRange, match=r"num_examples=513 exceeds secagg\.max-weight=512"):
        check_update([np.full(3, 0.1)], num_examples=513, clipping_range=1.0, max_weight=512)


def test_check_update_accepts_the_bounds_themselves():
    check_update([np.array([1.0, -1.0]), np.zeros(0)], num_examples=512, clipping_range=1.0, max_weight=512)
    check_update([], num_examples=0, clipping_range=1.0, max_weight=512)


def test_exact_update_is_float64_and_exact_for_float32_weights():
    rng = np.random.default_rng(0)
    old = rng.uniform(-0.4, 0.4, 1000).astype(np.float32)
    new = (old + rng.uniform(-0.5, 0.5, 1000).astype(np.float32)).astype(np.float32)
    update = exact_update([new], [old])[0]
    assert update.dtype == np.float64
    assert np.array_equal(update + old.astype(np.float64), new.astype(np.float64))  # no rounding at all
    assert not np.array_equal((new - old).astype(np.float64), update)  # float32 arithmetic rounds


# ----------------------------------------------------------------------------- precision (fast)
@pytest.mark.parametrize("precision, clipping_range, max_weight",
                         [(1e-7, 1.0, 0), (1e-6, 0.5, 4096), (1e-8, 0.5, 0), (1e-5, 2.0, 1000)])
def test_derived_parameters_meet_the_precision_target_through_flowers_arithmetic(precision, clipping_range,
                                                                                   max_weight):
    """Flower's own SecAgg+ functions in this process (``secure_mean_in_process``), in the worst
    case the derivation allows: updates filling [-c, c] (many at the edges) and two of three
    clients at the smallest weight (one batch, or all of a client's prompts under auto
    max-weight), the third close to it. The measured error is 0.4 to
    0.6 of the target (the bound is worst-case rounding); a quantization range 8x smaller misses it."""
    harness, _, _ = _benchmark_modules()
    data = DataConfig(train_size=64, train_batch_size=16)
    params = derive_parameters(SecAggConfig(clipping_range=clipping_range, precision=precision,
                                            max_weight=max_weight), data, num_clients=3)
    smallest = 16 if max_weight else 64  # one batch; under auto max-weight a client has all 64 prompts
    floor = smallest / params.max_weight
    assert error_bound(clipping_range, params.quantization_range, floor) <= precision
    assert error_bound(clipping_range, params.quantization_range - 1, floor) > precision  # the smallest
    rng = np.random.default_rng(11)
    c = clipping_range
    updates = [[rng.uniform(-c, c, size=(64, 8)), rng.choice([-c, c], size=257)] for _ in range(3)]
    weights = [smallest, smallest, smallest * 3 // 2]
    exact = [sum(n * u[i] for n, u in zip(weights, updates)) / sum(weights) for i in range(2)]

    def error(workflow: dict) -> float:
        secure, uploads = harness.secure_mean_in_process(updates, weights, workflow, seed=3)
        assert all(a.dtype == np.int64 for upload in uploads for a in upload)  # int64 whatever the modulus
        return max(float(np.max(np.abs(s - e))) for s, e in zip(secure, exact))

    kwargs = params.workflow_kwargs()
    assert 0 < error(kwargs) <= precision
    assert error({**kwargs, "quantization_range": params.quantization_range // 8}) > precision


def test_a_finer_precision_needs_a_wider_range_and_an_unreachable_one_names_the_key():
    data = DataConfig(train_size=64, train_batch_size=16)
    ranges = [derive_parameters(SecAggConfig(precision=p), data, num_clients=3).quantization_range
              for p in (1e-5, 1e-6, 1e-7)]
    assert ranges == sorted(ranges) and ranges[0] * 90 < ranges[2]
    moduli = [derive_parameters(SecAggConfig(precision=p), data, num_clients=3).smallest_modulus(3)
              for p in (1e-5, 1e-7)]
    assert moduli[0].bit_length() < moduli[1].bit_length() <= 41
    with pytest.raises(ConfigError, match=r"secagg.precision=1e-09 is unreachable: .* The best reachable is "
                                          r"[0-9.e-]+: raise secagg.precision, or lower secagg.max-weight"):
        derive_parameters(SecAggConfig(precision=1e-9), data, num_clients=3)
    # fixed weights (all 1) get max-weight 1: full precision at a small range
    fixed = derive_parameters(SecAggConfig(), data, num_clients=3, num_examples="fixed")
    assert fixed.max_weight == 1.0 and fixed.quantization_range == quantization_range_for(1e-7, 1.0, 1.0)


@pytest.mark.parametrize("value", [0.0, -1e-7, 1.0, 2.0])
def test_a_bad_precision_fails_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"secagg.precision={value} is invalid: must be in \(0, "
                                          r"secagg.clipping-range=1\)"):
        SecAggConfig(precision=value)


def test_an_unreachable_precision_fails_when_the_run_config_is_loaded():
    from flwr_verl.federation.run_config import load_run_config

    with pytest.raises(ConfigError, match="secagg.precision=1e-10 is unreachable"):
        load_run_config({"secagg.precision": 1e-10})


# ----------------------------------------------------------------------------- real SecAgg+ (slow)
def _benchmark_modules():
    """``secagg_harness``, ``secagg_clients`` and ``secagg_precision``, imported as the benchmark
    scripts import them (top-level modules from ``benchmarks/``: Opacus's own ``benchmarks``
    package shadows the folder)."""
    folder = str(Path(__file__).resolve().parents[2] / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import secagg_clients
    import secagg_harness
    import secagg_precision

    return secagg_harness, secagg_clients, secagg_precision


@pytest.fixture(scope="module")
def flower(tmp_path_factory):
    harness, clients, precision = _benchmark_modules()
    spec = precision.precision_spec()
    results = harness.run_flower(spec, timeout=300, workdir=tmp_path_factory.mktemp("secagg"))
    phases = {p["name"]: p for p in results["phases"]}
    for name, phase in phases.items():
        assert phase["aggregated_rounds"] == 1, f"{name}: not aggregated; {phase['failures']}\n{results['log'][-4000:]}"
    report = precision.precision_report(results, spec)
    print("\nSecAgg+ precision (max / rms abs error vs exact FedAvg):")
    for name, entry in report.items():
        print(f"  {name:<24} C={entry['clipping_range']!s:<5} max {entry['error_vs_exact_fedavg']:.3e}  "
              f"rms {entry['rms_error_vs_exact_fedavg']:.3e}")
    return SimpleNamespace(harness=harness, clients=clients, precision=precision), spec, results, phases, report


def _bound(spec: dict, workflow: dict) -> float:
    """Worst case of SecAgg+ against exact FedAvg of the same (float64) updates: per client less
    than one quantization step, plus the rounding of its weight n/max_weight to 1/Q, scaled back
    by max_weight / sum(n) when the weighted mean is recovered."""
    q, c, w = workflow["quantization_range"], workflow["clipping_range"], workflow["max_weight"]
    clients, spread = len(spec["num_examples"]), 2 * spec["delta_scale"]
    return clients * (2 * c / q + 0.5 / q * spread) * w / sum(spec["num_examples"])


@pytest.mark.slow
def test_secure_aggregate_matches_plain_aggregation(flower):
    bench, spec, _, phases, report = flower
    workflow = next(p for p in spec["phases"] if p["name"] == "secagg_delta_f64")["secagg"]
    secure, plain = phases["secagg_delta_f64"]["weights"], phases["plain_delta_f64"]["weights"]
    difference = bench.precision.max_abs_diff(secure, plain)
    assert difference <= _bound(spec, workflow) < TARGET, difference
    assert report["plain_delta_f64"]["error_vs_exact_fedavg"] < 1e-12
    assert report["secagg_delta_f64"]["error_vs_exact_fedavg"] <= TARGET
    # the rounding is real: SecAgg+ did quantize
    assert difference > 0


@pytest.mark.slow
def test_plain_and_secure_runs_aggregate_the_same_client_updates(flower):
    bench, spec, _, phases, _ = flower
    initial = bench.clients.initial_arrays(spec)
    for dtype, short in (("float32", "f32"), ("float64", "f64")):
        received = phases[f"plain_delta_{short}"]["received"]
        for num_examples, metrics, arrays in received:
            pid = int(metrics["partition_id"])
            assert num_examples == spec["num_examples"][pid]
            expected = bench.clients.client_output(spec, pid, initial, "delta", dtype)
            assert all(a.dtype == np.dtype(dtype) and np.array_equal(a, e) for a, e in zip(arrays, expected))


@pytest.mark.slow
def test_float32_updates_lose_precision_under_secagg(flower):
    """secaggplus_mod computes in the update's dtype: float32 rounds to 2**-23 * clipping_range."""
    _, _, _, _, report = flower
    f32, f64 = (report[f"secagg_delta_{d}"]["error_vs_exact_fedavg"] for d in ("f32", "f64"))
    assert f64 * 10 < f32, (f32, f64)
    assert f32 < 3 * 2**-23  # about float32's resolution at the clipping range (1), no worse


@pytest.mark.slow
@pytest.mark.parametrize("name", ["secagg_delta_f64", "secagg_delta_f32", "secagg_weights_f64"])
def test_server_only_sees_the_aggregate(flower, name):
    bench, spec, _, phases, _ = flower
    received = phases[name]["received"]
    assert len(received) == 3
    aggregate = received[0][2]
    for _, _, arrays in received:  # every FitRes carries the same, already aggregated, arrays
        assert all(a.dtype == np.float64 and np.array_equal(a, b) for a, b in zip(arrays, aggregate))
    # num_examples and metrics arrive in the clear, one per client
    seen = {int(m["partition_id"]): (n, m["probe"]) for n, m, _ in received}
    assert seen == {pid: (n, 1000 + pid) for pid, n in enumerate(spec["num_examples"])}
    # no FitRes equals any single client's update: it differs by far more than quantization error
    phase = next(p for p in spec["phases"] if p["name"] == name)
    initial = bench.clients.initial_arrays(spec)
    for pid in range(3):
        own = bench.clients.client_output(spec, pid, initial, phase["format"], phase["dtype"])
        assert bench.precision.max_abs_diff(aggregate, own) > 0.1
        mean_gap = np.mean(np.concatenate([np.abs(a - b).ravel() for a, b in zip(aggregate, own)]))
        assert mean_gap > 1e6 * _bound(spec, phase["secagg"])


@pytest.mark.slow
def test_deltas_aggregate_at_least_as_accurately_as_weights(flower):
    """Both through real SecAgg+. The error scales with the clipping range, not with the values:
    at the same range deltas and weights are equally accurate; deltas fit a smaller range
    (|delta| <= 0.5 here, |weights| <= 0.9) and then aggregate about twice as accurately."""
    _, _, _, _, report = flower
    rms = {name: entry["rms_error_vs_exact_fedavg"] for name, entry in report.items()}
    assert rms["secagg_delta_f64"] <= 1.1 * rms["secagg_weights_f64"]
    assert rms["secagg_delta_f64_c0.5"] <= 0.7 * rms["secagg_weights_f64"]
    assert rms["secagg_delta_f32"] <= 1.1 * rms["secagg_weights_f32"]
    assert rms["secagg_delta_f32_c0.5"] <= 0.7 * rms["secagg_weights_f32"]


@pytest.mark.slow
def test_ray_listens_on_loopback_only_and_is_cleaned_up(flower):
    _, _, results, _, _ = flower
    listeners = results["listeners"]
    assert any(s["process"] == "gcs_server" for s in listeners), listeners  # Ray was seen running
    for socket in listeners:
        address = ipaddress.ip_address(socket["ip"])
        mapped = getattr(address, "ipv4_mapped", None)
        assert (mapped or address).is_loopback, socket
    assert results["leftover_pids"] == []


def test_a_ray_start_that_misses_rays_30_s_is_tried_again_and_any_other_failure_is_raised(monkeypatch):
    """``secagg_harness.start_ray``: on a loaded machine Ray's raylet can miss Ray's fixed 30 s to
    register, and Flower's simulation then hangs. That failure is shut down and tried again; the
    third one, or any other error, is raised at once."""
    import ray

    harness = _benchmark_modules()[0]
    timed_out = Exception("The current node timed out during startup. This could happen because ...")
    calls: list[str] = []

    def init_failing(errors):
        def init(**kwargs):
            calls.append("init")
            assert kwargs["num_cpus"] == 2 and "PYTHONPATH" in kwargs["runtime_env"]["env_vars"]
            if errors:
                raise errors.pop(0)
        return init

    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setenv("PYTHONPATH", "")  # start_ray sets it, as Flower does
    monkeypatch.setattr(ray, "init", init_failing([timed_out, timed_out]))
    harness.start_ray({"num_cpus": 2})
    assert calls == ["init", "shutdown", "init", "shutdown", "init"]

    calls.clear()
    monkeypatch.setattr(ray, "init", init_failing([timed_out] * 3))
    with pytest.raises(Exception, match="timed out during startup"):
        harness.start_ray({"num_cpus": 2})
    assert calls == ["init", "shutdown", "init", "shutdown", "init"]

    calls.clear()
    monkeypatch.setattr(ray, "init", init_failing([ValueError("bad argument")]))
    with pytest.raises(ValueError, match="bad argument"):
        harness.start_ray({"num_cpus": 2})
    assert calls == ["init"]
