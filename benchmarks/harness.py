"""What every benchmark shares: paths and results, figures (medians and ranges), timing arms
side by side, peak memory, child processes, and the embedded task's held-out problems.

A benchmark script imports this module before anything of the project (``import harness``).
Importing it puts this checkout's root on ``sys.path`` ahead of any installed copy of
flwr_verl (an editable install may point at another checkout), and this folder too, so that
sibling benchmark modules import as top-level modules (``import secagg_harness``) from wherever
a script or a test runs. Never as ``benchmarks.secagg_harness``: Opacus installs a top-level
package named ``benchmarks`` that shadows this folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"  # git-ignored
for _folder in (BENCHMARKS, REPO):  # REPO ends up first
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

MIB = 2**20
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}  # cpu: leaves out waiting for a core
RESULT_MARK = "RESULT"  # starts the stdout line that carries a child process's result
T = TypeVar("T")


# ----------------------------------------------------------------------------- setup and results
def quiet() -> None:
    """No Python warnings and no tokenizers fork warning in a benchmark's output. Call it at
    import time: processes spawned from the script import it again and stay quiet too."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def argument_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def command_line() -> str:
    """The command that started this process, for the record."""
    return " ".join(["python", *sys.argv])


def _json_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable: {value!r}")


def write_json(path: Path, data: Any) -> Path:
    """Write a benchmark's results to ``path`` (its folder made if needed; paths as strings) and
    say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_value))
    print(f"wrote {path}")
    return path


# ----------------------------------------------------------------------------- figures
def spread(values: Sequence[float]) -> dict:
    """Median and range of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def median_range(name: str, values: Sequence[float]) -> dict:
    """``{name}_median`` and ``{name}_range`` ([min, max]) of repeated measurements."""
    return {f"{name}_median": statistics.median(values), f"{name}_range": [min(values), max(values)]}


def format_spread(figures: dict, spec: str = ".3f", unit: str = "") -> str:
    """A ``spread`` as ``median (min-max)``; signed figures as ``+m (+a to +b)``, so that a
    negative bound cannot be read as a dash."""
    dash = " to " if "+" in spec else "-"
    return f"{figures['median']:{spec}}{unit} ({figures['min']:{spec}}{dash}{figures['max']:{spec}})"


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict:
    """Median, interquartile range and range of the per-repeat ratios numerator / denominator:
    each ratio compares two arms measured in the same repeat, under the same machine load."""
    ratios = sorted(n / d for n, d in zip(numerators, denominators, strict=True))
    return {"median": statistics.median(ratios), "quartiles": [ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]],
            "range": [ratios[0], ratios[-1]]}


# ----------------------------------------------------------------------------- timing
def interleaved(arms: dict[str, Callable[[int], T]], repeats: int, warmup: int = 0) -> dict[str, list[T]]:
    """Measure arms side by side: every repeat calls each arm once (with the repeat's index),
    rotating the order so that no arm always runs first, and all see the same machine load. The
    first ``warmup`` repeats are discarded."""
    names = list(arms)
    measured: dict[str, list[T]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            value = arms[name](repeat)
            if repeat >= warmup:
                measured[name].append(value)
    return measured


# ----------------------------------------------------------------------------- memory
def peak_rss_mib() -> float:
    """This process's peak resident set so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident set now."""
    import psutil

    return psutil.Process().memory_info().rss / MIB


class RssSampler:
    """Peak RSS of this process and of all its descendants, sampled every ``interval`` s, over
    spans marked by ``begin`` and ``end``. With ``kind_of`` (a ``psutil.Process`` -> a name for its
    kind, e.g. "superlink"), ``end`` also splits the peak by kind (the resident set and process
    count of each kind at the moment of the overall peak) and sums each kind's CPU seconds (of
    every process sampled in the span, since that process started, as last sampled)."""

    def __init__(self, interval: float = 0.05, kind_of: Callable[[Any], str] | None = None) -> None:
        import psutil

        self._psutil = psutil
        self.me = psutil.Process()
        self.interval = interval
        self.kind_of = kind_of
        self.procs: list = []
        self.peak_self = self.peak_all = 0
        self.peak_by_kind: dict[str, list[int]] = {}  # kind -> [bytes, processes] at the overall peak
        self._kinds: dict[int, str] = {}  # pid -> kind, looked up once per process
        self._cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds when last sampled)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._refreshed = 0.0

    def _sample(self) -> tuple[int, int, dict[str, list[int]]]:
        now = time.monotonic()
        if now - self._refreshed > 2.0:  # listing descendants is slow; they change rarely
            with contextlib.suppress(self._psutil.Error):
                self.procs = self.me.children(recursive=True)
            self._refreshed = now
        own = total = 0
        by_kind: dict[str, list[int]] = {}
        for proc in [self.me, *self.procs]:
            with contextlib.suppress(self._psutil.Error):
                rss = proc.memory_info().rss
                total += rss
                own = rss if proc is self.me else own
                if self.kind_of is not None:
                    kind = self._kinds.get(proc.pid) or self._kinds.setdefault(proc.pid, self.kind_of(proc))
                    entry = by_kind.setdefault(kind, [0, 0])
                    entry[0] += rss
                    entry[1] += 1
                    cpu = proc.cpu_times()
                    self._cpu[proc.pid] = (kind, cpu.user + cpu.system)
        return own, total, by_kind

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            own, total, by_kind = self._sample()
            with self._lock:
                if total > self.peak_all:
                    self.peak_all, self.peak_by_kind = total, by_kind
                self.peak_self = max(self.peak_self, own)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def begin(self) -> dict:
        self._refreshed = 0.0
        own, total, by_kind = self._sample()
        with self._lock:
            self.peak_self, self.peak_all, self.peak_by_kind = own, total, by_kind
            self._cpu = {}
        return {"self": own, "all": total}

    def end(self, before: dict) -> dict:
        with self._lock:
            peak_self, peak_all = self.peak_self, self.peak_all
            peak_by_kind, cpu = dict(self.peak_by_kind), dict(self._cpu)
        figures = {"server_peak_mib": peak_self / MIB, "server_rise_mib": (peak_self - before["self"]) / MIB,
                   "all_peak_mib": peak_all / MIB, "all_rise_mib": (peak_all - before["all"]) / MIB}
        if self.kind_of is not None:
            figures["all_peak_by_kind"] = {kind: {"mib": rss / MIB, "processes": count}
                                           for kind, (rss, count) in sorted(peak_by_kind.items())}
            cpu_by_kind: dict[str, float] = {}
            for kind, seconds in cpu.values():
                cpu_by_kind[kind] = cpu_by_kind.get(kind, 0.0) + seconds
            figures["cpu_seconds_by_kind"] = dict(sorted(cpu_by_kind.items()))
        return figures

    def stop(self) -> None:
        self._stop.set()


# ----------------------------------------------------------------------------- child processes
def print_result(data: Any) -> None:
    """In a child process: its result, one line on stdout, for ``child_result``."""
    print(RESULT_MARK + json.dumps(data), flush=True)


def child_result(command: list[str], **run: Any) -> Any:
    """Run ``command`` to completion (``run``: ``subprocess.run``'s env, timeout, cwd) and return
    the result it printed with ``print_result``."""
    proc = subprocess.run(command, capture_output=True, text=True, check=True, **run)
    return json.loads(next(line[len(RESULT_MARK):] for line in proc.stdout.splitlines()
                           if line.startswith(RESULT_MARK)))


# ----------------------------------------------------------------------------- the embedded task
def validation_problems(limit: int, split: str = "val") -> list[dict]:
    """Every problem of the task's validation split (or of ``split``) as verl rows (or a fixed
    sample of ``limit``)."""
    import random

    from flwr_verl import embedded

    problems = embedded.split_problems(split)
    if limit:
        problems = random.Random(12345).sample(problems, min(limit, len(problems)))
    return [
        {"data_source": embedded.DATA_SOURCE, "prompt": [{"role": "user", "content": prompt}],
         "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": split}}
        for prompt, answer in problems
    ]


def federation_parser(doc: str, *, rounds: int, train_size: int) -> argparse.ArgumentParser:
    """The arguments that the in-process federation benchmarks (compression, heterogeneous,
    lora_aggregation) share; each adds its own."""
    parser = argument_parser(doc)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--train-size", type=int, default=train_size, help="prompts per client")
    parser.add_argument("--train-batch-size", type=int, default=16)
    parser.add_argument("--eval-size", type=int, default=64, help="validation problems")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def federation_setup(args: argparse.Namespace) -> list[dict]:
    """One torch thread (figures comparable across machines and runs) and the validation rows."""
    import torch

    torch.set_num_threads(1)
    return validation_problems(args.eval_size)
