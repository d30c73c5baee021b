"""llama.cpp's llama-bench as the baseline of bench/bench_decode.py
(``--llama-bench PATH``), in the same run as our implementations.

PATH is the executable bench/ggml/build_llama_bench.sh builds
(build/ggml/llama-bench, from the llama.cpp that the llama-cpp-python sdist
vendors). It is given the very GGUF file our loader reads. Two invocations
per measurement, each one thread (``-t 1``):

- prefill: ``-p PROMPT -n 0`` (``ppPROMPT`` from an empty cache, as our
  prefill);
- decode: ``-p 0 -n STEPS -d PROMPT`` (``tgSTEPS`` after a PROMPT-token
  context, as our decode steps; llama-bench fills the context once, untimed,
  and restores it before each repetition).

llama-bench times each repetition by the wall clock (a steady clock around
the test). Its CPU time is not in its output, so each test is run twice,
with ``-r REPS`` and ``-r 1``, and the children's CPU time
(``getrusage(RUSAGE_CHILDREN)``: user + system) of the two processes is
subtracted: model load, warmup and the context fill cancel, leaving the CPU
time of REPS - 1 repetitions. Nothing here imports or builds llama.cpp.
Standard library only (tests/test_llama_bench.py loads this file directly).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import time

BUILD_HINT = "build it with bench/ggml/build_llama_bench.sh (it writes build/ggml/llama-bench)"


class LlamaBenchError(Exception):
    """A missing, non-executable or misbehaving llama-bench (bench_decode.py
    exits with it as one line before anything is timed)."""


def check_executable(path: str | None) -> str:
    """The absolute path of an executable file, or a clear error."""
    from mixbits.commands.bench_ggml import check_executable as check

    return check(path, "--llama-bench", "llama-bench", BUILD_HINT, LlamaBenchError)


def check_runs(path: str) -> str:
    """``llama-bench --help`` must run and list the flags we pass; returns
    the build line of ``--version`` (or "")."""
    try:
        h = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
        v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise LlamaBenchError(f"--llama-bench: cannot run {path}: {e}; {BUILD_HINT}") from e
    text = h.stdout + h.stderr
    missing = [f for f in ("--n-prompt", "--n-gen", "--n-depth", "--repetitions", "--threads", "--output")
               if f not in text]
    if h.returncode != 0 or missing:
        raise LlamaBenchError(f"--llama-bench: {path} is not llama-bench (`--help` gave rc {h.returncode}"
                              f"{', lacks ' + ' '.join(missing) if missing else ''}: {text[:200]!r}); "
                              f"{BUILD_HINT}")
    return (v.stdout + v.stderr).strip().splitlines()[0] if (v.stdout + v.stderr).strip() else ""


def command(path: str, model: str, n_prompt: int, n_gen: int, depth: int, reps: int,
            threads: int = 1) -> list[str]:
    return [path, "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
            "-d", str(depth), "-r", str(reps), "-o", "json"]


def parse_output(text: str) -> list[dict]:
    """The tests of ``llama-bench -o json``, each with its wall-clock rates
    recomputed from ``samples_ns``: ``wall_median_tps`` (tokens / median
    repetition), ``wall_best_tps`` (fastest) next to llama-bench's own
    ``avg_ts`` (mean of the per-repetition rates)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise LlamaBenchError(f"--llama-bench: output is not JSON: {e}: {text[:200]!r}") from e
    if not isinstance(data, list) or not data:
        raise LlamaBenchError(f"--llama-bench: output is not a non-empty JSON list of tests: {text[:200]!r}")
    tests = []
    for t in data:
        if not isinstance(t, dict):
            raise LlamaBenchError(f"--llama-bench: test record is not an object: {t!r}")
        missing = {"n_prompt", "n_gen", "n_depth", "n_threads", "samples_ns", "avg_ts"} - set(t)
        if missing:
            raise LlamaBenchError(f"--llama-bench: test lacks {sorted(missing)}: {str(t)[:200]}")
        ns = t["samples_ns"]
        if not isinstance(ns, list) or not ns or not all(isinstance(x, (int, float)) and x > 0 for x in ns):
            raise LlamaBenchError(f"--llama-bench: bad samples_ns {ns!r}")
        tokens = int(t["n_prompt"]) + int(t["n_gen"])
        tests.append(dict(t, tokens=tokens, reps=len(ns),
                          wall_median_tps=tokens / (statistics.median(ns) * 1e-9),
                          wall_best_tps=tokens / (min(ns) * 1e-9)))
    return tests


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(cmd: list[str]) -> dict:
    """One llama-bench process: its parsed tests, its CPU time (children's
    rusage delta) and wall time."""
    c0, w0 = _children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    cpu, wall = _children_cpu() - c0, time.perf_counter() - w0
    if out.returncode != 0:
        raise LlamaBenchError(f"--llama-bench: {' '.join(cmd)} failed (rc {out.returncode}): "
                              f"{out.stderr[-500:]}")
    return {"command": cmd, "tests": parse_output(out.stdout), "process_cpu_s": cpu, "process_wall_s": wall}


def cpu_rates(full: dict, one: dict) -> dict:
    """CPU time per repetition from two processes of the same test, ``-r R``
    and ``-r 1``: (cpu_R - cpu_1) / (R - 1); the wall time of the same
    repetitions (their samples) for the CPU/wall ratio."""
    (t,), (t1,) = full["tests"], one["tests"]
    extra = t["reps"] - t1["reps"]
    if extra < 1:
        raise LlamaBenchError("--llama-bench: CPU time needs more repetitions in the full run than in the short one")
    cpu_rep = (full["process_cpu_s"] - one["process_cpu_s"]) / extra
    wall_rep = statistics.mean(t["samples_ns"]) * 1e-9
    return {"cpu_per_rep_s": cpu_rep, "cpu_tps": t["tokens"] / cpu_rep if cpu_rep > 0 else None,
            "wall_mean_per_rep_s": wall_rep, "cpu_over_wall": cpu_rep / wall_rep}


def measure(path: str, model: str, prompt: int, steps: int, reps: int) -> dict:
    """Prefill and decode of llama.cpp: {"prefill": ..., "decode": ...},
    each the full run's test (wall-clock rates), its CPU-time rate and the
    two processes' commands and times."""
    out = {}
    for name, (p, n, d) in {"prefill": (prompt, 0, 0), "decode": (0, steps, prompt)}.items():
        full = run_once(command(path, model, p, n, d, reps))
        one = run_once(command(path, model, p, n, d, 1))
        if len(full["tests"]) != 1 or len(one["tests"]) != 1:
            raise LlamaBenchError(f"--llama-bench: expected one test per run, got {len(full['tests'])}")
        test = {k: v for k, v in full["tests"][0].items()}
        out[name] = {"test": test, **cpu_rates(full, one),
                     "runs": [{k: r[k] for k in ("command", "process_cpu_s", "process_wall_s")}
                              for r in (full, one)]}
    return out
