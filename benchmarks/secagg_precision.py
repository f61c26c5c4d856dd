"""SecAgg+ precision: how far the aggregate of real Flower SecAgg+ lies from exact FedAvg, and
what each precision target costs on the wire.

Goal: the error is at most ``secagg.precision``.

    python benchmarks/secagg_precision.py [--out benchmarks/results/secagg_precision.json]
    python benchmarks/secagg_precision.py --bits [--out benchmarks/results/secagg_bits.json]

``--bits``: for each ``secagg.precision`` in ``BITS_PRECISIONS``, the derived quantization range
and the smallest modulus for 3 clients (``flwr_verl.federation.secagg.derive_parameters``), and, for this
spec's client updates, through real SecAgg+ (one Flower simulation, one round per precision)
and through Flower's SecAgg+ functions in this process (``secure_mean_in_process``, also at the
worst-case weights the derivation assumes): the max abs error against exact FedAvg, and the
bytes per parameter of each client's masked upload as Flower 1.42 serializes it (the
``ConfigRecord`` of ``ndarray_to_bytes`` int64 arrays that ``secaggplus_mod`` returns, deflated
as it is pushed), beside what k-bit packing of the smallest modulus would cost.

The same client updates of a LoRA-sized adapter (29k parameters, |update| < 0.5, 96/256/480
examples, max-weight 500) go through plain aggregation and through real SecAgg+ (one Flower
simulation, 3 supernodes, one round per configuration, ``secagg_harness.run_flower``) as deltas
and as full weights, in float32 and float64, at the derived parameters (clipping range 1) and at a
clipping range fitted to the deltas (0.5). Errors are max and rms |.| against the exact float64
FedAvg of the clients' new weights, for the new global adapter (the strategy's float64 state);
``error_vs_plain`` isolates the protocol's own error from the update's format, and
``bound_quantization_step`` is SecAgg+'s quantization step at that clipping range.
``tests/federation/test_secagg.py`` runs the same spec and checks these errors against their bounds.
"""

from __future__ import annotations

from pathlib import Path

import harness
import numpy as np
from secagg_clients import NUM_EXAMPLES, client_new_weights, client_output, initial_arrays, secagg_kwargs
from secagg_harness import run_flower, secure_mean_in_process

# A LoRA adapter (rank 8) on every linear layer of a 2-layer Llama of hidden size 96 and MLP 256:
# per layer q/k/v/o (96 -> 96), gate/up (96 -> 256), down (256 -> 96); A is (r, in), B is (out, r).
LORA_SHAPES = [shape for _ in range(2)
               for fan_in, fan_out in [(96, 96)] * 4 + [(96, 256)] * 2 + [(256, 96)]
               for shape in ((8, fan_in), (fan_out, 8))]


# The phases' secagg.precision: float64 updates then aggregate far below float32's resolution
# (1.2e-7), which the tests compare. At clipping range 0.5 half of it gives the same quantization
# range, so the two ranges compare at equal Q.
SPEC_PRECISION = 1e-8
BITS_PRECISIONS = (1e-4, 1e-5, 1e-6, 1e-7, 1e-8)


def precision_spec() -> dict:
    derived = secagg_kwargs(precision=SPEC_PRECISION)
    tight = secagg_kwargs(clipping_range=0.5, precision=SPEC_PRECISION / 2)  # fits |delta| <= 0.5, not |w| <= 0.9
    phases = [
        {"name": "plain_delta_f32", "secagg": None, "format": "delta", "dtype": "float32"},
        {"name": "plain_delta_f64", "secagg": None, "format": "delta", "dtype": "float64"},
        {"name": "secagg_delta_f32", "secagg": derived, "format": "delta", "dtype": "float32"},
        {"name": "secagg_delta_f64", "secagg": derived, "format": "delta", "dtype": "float64"},
        {"name": "secagg_weights_f32", "secagg": derived, "format": "weights", "dtype": "float32"},
        {"name": "secagg_weights_f64", "secagg": derived, "format": "weights", "dtype": "float64"},
        {"name": "secagg_delta_f64_c0.5", "secagg": tight, "format": "delta", "dtype": "float64"},
        {"name": "secagg_delta_f32_c0.5", "secagg": tight, "format": "delta", "dtype": "float32"},
    ]
    return {"num_supernodes": 3, "num_examples": list(NUM_EXAMPLES), "shapes": [list(s) for s in LORA_SHAPES],
            "seed": 7, "delta_scale": 0.5, "weight_scale": 0.4, "client_cpus": 1, "verbose": True,
            "phases": [{**p, "rounds": 1, "capture": True} for p in phases]}


def exact_fedavg(spec: dict) -> list[np.ndarray]:
    """The exact (float64) num_examples-weighted mean of the clients' new weights."""
    news = [client_new_weights(spec, pid) for pid in range(spec["num_supernodes"])]
    total = float(sum(spec["num_examples"]))
    return [sum(n * news[pid][i].astype(np.float64) for pid, n in enumerate(spec["num_examples"])) / total
            for i in range(len(spec["shapes"]))]


def _gaps(a: list[np.ndarray], b: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).ravel()
                           for x, y in zip(a, b, strict=True)])


def max_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.max(_gaps(a, b)))


def rms_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.sqrt(np.mean(_gaps(a, b) ** 2)))


def precision_report(results: dict, spec: dict) -> dict:
    """Max abs error of each phase's new global adapter (float64 server state) vs exact FedAvg."""
    exact = exact_fedavg(spec)
    phases = {p["name"]: p for p in results["phases"]}
    report = {}
    for name, phase in phases.items():
        setting = next(p for p in spec["phases"] if p["name"] == name)
        kwargs = setting["secagg"]
        if setting["format"] == "weights":  # the aggregate is the new global adapter itself
            estimate = phase["received"][0][2] if kwargs else phase["weights"]
        else:  # FedProxAdapters (sgd, lr 1): global + mean update, in float64
            estimate = phase["weights"]
        entry = {"format": setting["format"], "dtype": setting["dtype"],
                 "error_vs_exact_fedavg": max_abs_diff(estimate, exact),
                 "rms_error_vs_exact_fedavg": rms_diff(estimate, exact),
                 "clipping_range": kwargs["clipping_range"] if kwargs else None}
        if kwargs:
            # the same update format without SecAgg+: isolates the protocol's own error
            plain = phases.get(name.replace("secagg_", "plain_").replace("_c0.5", ""))
            if plain:
                entry["error_vs_plain"] = max_abs_diff(phase["weights"], plain["weights"])
            entry["bound_quantization_step"] = 2 * kwargs["clipping_range"] / kwargs["quantization_range"]
        report[name] = entry
    return report


def measure(timeout: float) -> dict:
    """One run of ``precision_spec``; its setup and the error of every configuration."""
    spec = precision_spec()
    spec["verbose"] = False
    results = run_flower(spec, timeout=timeout)
    workflow = secagg_kwargs(precision=SPEC_PRECISION)
    return {"setup": {"num_params": int(sum(int(np.prod(s)) for s in spec["shapes"])),
                      "num_examples": spec["num_examples"], "max_abs_delta": spec["delta_scale"],
                      "max_abs_initial_weight": spec["weight_scale"], "max_weight": workflow["max_weight"],
                      "quantization_range": workflow["quantization_range"]},
            "errors": precision_report(results, spec),
            "leftover_processes": results["leftover_pids"]}


def upload_bytes(upload: list[np.ndarray]) -> int:
    """One client's masked upload as Flower 1.42 sends it: ``secaggplus_mod`` returns
    ``{masked_parameters: [ndarray_to_bytes(a) for a in arrays]}`` in a ConfigRecord."""
    from flwr.app import ConfigRecord
    from flwr.common import ndarray_to_bytes

    return len(ConfigRecord({"masked_parameters": [ndarray_to_bytes(a) for a in upload]}).deflate())


def bits_spec() -> dict:
    """One real SecAgg+ round per precision, float64 deltas."""
    spec = precision_spec()
    spec["phases"] = [{"name": f"precision_{p:g}", "secagg": secagg_kwargs(precision=p), "format": "delta",
                       "dtype": "float64", "rounds": 1, "capture": True} for p in BITS_PRECISIONS]
    spec["verbose"] = False
    return spec


def measure_bits(timeout: float) -> dict:
    """Bytes per parameter against precision (see the module docstring)."""
    from flwr_verl.federation.secagg import MODULUS_RANGE

    spec = bits_spec()
    results = run_flower(spec, timeout=timeout)
    phases = {p["name"]: p for p in results["phases"]}
    exact, initial = exact_fedavg(spec), initial_arrays(spec)
    num_params = int(sum(int(np.prod(s)) for s in spec["shapes"]))
    updates = [client_output(spec, pid, initial, "delta", "float64") for pid in range(spec["num_supernodes"])]
    exact_mean = [sum(n * u[i] for n, u in zip(spec["num_examples"], updates)) / sum(spec["num_examples"])
                  for i in range(len(initial))]
    floor_weights = [min(spec["num_examples"])] * 3  # every client at the weight floor the derivation assumes
    floor_mean = [sum(u[i] for u in updates) / 3 for i in range(len(initial))]
    rows = []
    for precision, setting in zip(BITS_PRECISIONS, spec["phases"]):
        kwargs = setting["secagg"]
        phase = phases[setting["name"]]
        mean, uploads = secure_mean_in_process(updates, list(spec["num_examples"]), kwargs, seed=1)
        floor, _ = secure_mean_in_process(updates, floor_weights, kwargs, seed=1)
        smallest = (3 * kwargs["quantization_range"]).bit_length()  # modulus 2**smallest holds 3 clients
        rows.append({
            "precision": precision, "quantization_range": kwargs["quantization_range"],
            "quantization_bits": kwargs["quantization_range"].bit_length(),
            "smallest_modulus_bits_3_clients": smallest, "workflow_modulus_bits": MODULUS_RANGE.bit_length() - 1,
            "error_real_secagg": (max_abs_diff(phase["weights"], exact)
                                  if phase["aggregated_rounds"] == 1 else None),
            "error_in_process": max_abs_diff(mean, exact_mean),
            "error_in_process_at_weight_floor": max_abs_diff(floor, floor_mean),
            "upload_bytes_per_param": upload_bytes(uploads[0]) / num_params,
            "upload_dtype": str(uploads[0][1].dtype),
            "packed_bytes_per_param": smallest / 8,
        })
    workflow = secagg_kwargs()
    return {"setup": {"num_params": num_params, "num_examples": spec["num_examples"],
                      "max_weight": workflow["max_weight"], "weight_floor": min(spec["num_examples"]),
                      "clipping_range": workflow["clipping_range"], "clients": spec["num_supernodes"]},
            "rows": rows, "leftover_processes": results["leftover_pids"]}


def main(argv: list[str] | None = None) -> dict:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--bits", action="store_true", help="bytes per parameter against secagg.precision")
    args = parser.parse_args(argv)
    if args.bits:
        report = measure_bits(args.timeout)
        print("bytes per parameter against secagg.precision (3 clients, float64 deltas, clipping range 1)")
        print(f"  {'precision':>9} {'Q':>11} {'bits':>4} {'real':>9} {'in-proc':>9} {'floor':>9} {'wire B/p':>8} "
              f"{'packed B/p':>10}")
        for row in report["rows"]:
            real = f"{row['error_real_secagg']:.2e}" if row["error_real_secagg"] is not None else "failed"
            print(f"  {row['precision']:>9.0e} {row['quantization_range']:>11d} "
                  f"{row['smallest_modulus_bits_3_clients']:>4d} {real:>9} {row['error_in_process']:9.2e} "
                  f"{row['error_in_process_at_weight_floor']:9.2e} {row['upload_bytes_per_param']:8.3f} "
                  f"{row['packed_bytes_per_param']:10.3f}")
        print()
        harness.write_json(args.out or harness.RESULTS / "secagg_bits.json", report)
        return report
    report = measure(args.timeout)
    print("precision: |global - exact FedAvg| after one round (float64 server state), max and rms")
    for name, entry in report["errors"].items():
        extra = f"  (max vs plain {entry['error_vs_plain']:.2e})" if "error_vs_plain" in entry else ""
        print(f"  {name:<24} C={entry['clipping_range']!s:<5} max {entry['error_vs_exact_fedavg']:.2e}  "
              f"rms {entry['rms_error_vs_exact_fedavg']:.2e}{extra}")
    print()
    harness.write_json(args.out or harness.RESULTS / "secagg_precision.json", report)
    return report


if __name__ == "__main__":
    main()
