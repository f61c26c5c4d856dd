"""SecAgg+ precision: how far the aggregate of real Flower SecAgg+ lies from exact FedAvg.

    python benchmarks/secagg_precision.py [--out benchmarks/results/secagg_precision.json]

The same client updates of a LoRA-sized adapter (29k parameters, |update| < 0.5, 96/256/480
examples, max-weight 500) go through plain aggregation and through real SecAgg+ (one Flower
simulation, 3 supernodes, one round per configuration, ``secagg_harness.run_flower``) as deltas
and as full weights, in float32 and float64, at the derived parameters (clipping range 1) and at a
clipping range fitted to the deltas (0.5). Errors are max and rms |.| against the exact float64
FedAvg of the clients' new weights, for the new global adapter (the strategy's float64 state);
``error_vs_plain`` isolates the protocol's own error from the update's format, and
``bound_quantization_step`` is SecAgg+'s quantization step at that clipping range.
``tests/test_secagg.py`` runs the same spec and checks these errors against their bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from secagg_harness import NUM_EXAMPLES, REPO, client_new_weights, run_flower, secagg_kwargs  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "secagg_precision.json"

# A LoRA adapter (rank 8) on every linear layer of a 2-layer Llama of hidden size 96 and MLP 256:
# per layer q/k/v/o (96 -> 96), gate/up (96 -> 256), down (256 -> 96); A is (r, in), B is (out, r).
LORA_SHAPES = [shape for _ in range(2)
               for fan_in, fan_out in [(96, 96)] * 4 + [(96, 256)] * 2 + [(256, 96)]
               for shape in ((8, fan_in), (fan_out, 8))]


def precision_spec() -> dict:
    derived = secagg_kwargs()
    tight = secagg_kwargs(clipping_range=0.5)  # fits |delta| <= 0.5, not the weights (|w| <= 0.9)
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
    workflow = secagg_kwargs()
    return {"setup": {"num_params": int(sum(int(np.prod(s)) for s in spec["shapes"])),
                      "num_examples": spec["num_examples"], "max_abs_delta": spec["delta_scale"],
                      "max_abs_initial_weight": spec["weight_scale"], "max_weight": workflow["max_weight"],
                      "quantization_range": workflow["quantization_range"]},
            "errors": precision_report(results, spec),
            "leftover_processes": results["leftover_pids"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    report = measure(args.timeout)
    print("precision: |global - exact FedAvg| after one round (float64 server state), max and rms")
    for name, entry in report["errors"].items():
        extra = f"  (max vs plain {entry['error_vs_plain']:.2e})" if "error_vs_plain" in entry else ""
        print(f"  {name:<24} C={entry['clipping_range']!s:<5} max {entry['error_vs_exact_fedavg']:.2e}  "
              f"rms {entry['rms_error_vs_exact_fedavg']:.2e}{extra}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
