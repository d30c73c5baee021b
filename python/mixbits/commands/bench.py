"""``mixbits bench``: the quantized-matmul benchmark, with its baselines
measured in the same run.

For each weight shape N x K, activation rows M and weight kind it times
mixbits.qmatmul, mx.quantized_matmul on the same weights (a mixed tensor
is one MLX call per segment), and numpy float32 ``x @ W.T`` on the
dequantized weights; a multithreaded stream-read probe gives the memory
roofline. The table shows time, GB/s of weight bytes, % of the probe,
speedup over MLX and GFLOP/s against numpy; a JSON file keeps it all.

bench/bench_qmatmul.py runs the same cases under pytest-benchmark.

``--vs-ggml PATH`` adds ggml (llama.cpp's kernels) in the same run, through
the harness bench/ggml/build.sh builds (see bench_ggml.py); optional.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass, field

SHAPES_FULL = [(4096, 4096), (11008, 4096), (4096, 11008), (1536, 576), (49152, 576)]
SHAPES_QUICK = [(4096, 4096), (4096, 11008)]
MS_FULL = [1, 4, 8, 128, 512]
MS_QUICK = [1, 8, 128]
KINDS_FULL = ["2bit", "3bit", "4bit", "8bit", "mixed"]
KINDS_QUICK = ["4bit", "mixed"]
GROUP_SIZE = 64
# MLX's CPU quantized matmul is scalar: skip it where one call would take
# longer than this (estimated from its M=1 time, which scales with M).
MLX_BUDGET_S = 3.0
PROBE_BYTES = 1 << 30  # much larger than the caches the kernels reuse


def add_arguments(p) -> None:
    p.add_argument("--full", action="store_true",
                   help="all shapes, M in {1,4,8,128,512}, 2/3/4/8-bit and mixed "
                        "(default: a quick subset)")
    p.add_argument("--shapes", help="override shapes, e.g. 4096x4096,1536x576 (N x K)")
    p.add_argument("--m", help="override rows M, e.g. 1,8,128")
    p.add_argument("--kinds", help="override weight kinds: 2bit,3bit,4bit,5bit,6bit,8bit,mixed")
    p.add_argument("--min-time", type=float, default=0.3,
                   help="seconds of repetitions per measurement (default 0.3)")
    p.add_argument("--no-baselines", action="store_true", help="time mixbits only")
    from mixbits.ops import ACTIVATIONS

    p.add_argument("--activations", choices=list(ACTIVATIONS), default="float",
                   help="mixbits' numeric contract (mixbits.qmatmul's activations=; int8/int16 "
                        "apply to M <= 16, int8-all at every M, as ggml quantizes its activations; "
                        "CPU kernels: an integer contract runs on the CPU)")
    p.add_argument("--repack", action="store_true",
                   help="also time mixbits on the row-interleaved layout of the integer GEMV "
                        "(mixbits.ops.repack; every kind: 2/3/4/5/6/8-bit and mixed), "
                        "same contract: the integer kernels with --activations int8/int16 and "
                        "M <= 16, else the float path (on x86 with AVX2 or AVX-512 the prefill GEMM "
                        "reads the blocks in place above 16 rows; otherwise W is un-repacked per call)")
    p.add_argument("--vs-float", action="store_true",
                   help="with --activations other than float: also time the float contract "
                        "(mixbits.qmatmul's default, MLX's layout) on the same weights in the "
                        "same run, and print float time / integer time")
    p.add_argument("--backend", choices=["auto", "ref", "avx2", "avx512", "neon"], default="auto",
                   help="mixbits' CPU kernels (mixbits.qmatmul's backend=), e.g. avx2 to time "
                        "an AVX2-only CPU's kernels on an AVX-512 host (ggml is not affected)")
    p.add_argument("--threads", type=int, default=0,
                   help="cap mixbits' worker threads (default: all cores); for numpy set "
                        "OPENBLAS_NUM_THREADS to match")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: elapsed time; cpu: CPU time of this process (with "
                        "--threads 1 and OPENBLAS_NUM_THREADS=1, per-core work that other "
                        "processes on a shared machine do not inflate)")
    p.add_argument("--vs-ggml", metavar="HARNESS",
                   help="also time ggml through this harness (build/ggml/ggml_mm from "
                        "bench/ggml/build.sh): q2_K/q3_K/q4_K/q4_0/q8_0 next to mixbits "
                        "2/3/4/8-bit; default shapes 4096x4096,11008x4096,4096x11008, "
                        "M 1,2,4,8,16,128")
    p.add_argument("--cold", action="store_true",
                   help=f"hold each weight in copies filling {COLD_MB} MiB and take them in turn, "
                        "so every call reads its weight from DRAM as a decode step does (a "
                        "repeated call on one weight finds it in the caches); ggml's harness "
                        "does the same (--cold-mb)")
    p.add_argument("--calls-per-eval", type=int, default=CALLS_PER_EVAL, metavar="N",
                   help=f"mixbits calls per mx.eval (default {CALLS_PER_EVAL}); the time per call "
                        "is reported. MLX's fixed cost of one eval (handing the graph to its "
                        "stream thread: ~40 us of CPU on the EPYC host of bench/README.md) is "
                        "then shared by N calls, as a model's step shares it among hundreds of "
                        "nodes; 1 times each call alone (the figures before 2026-12-05)")
    p.add_argument("--json", default="qmatmul_bench.json",
                   help="where to save the results (default ./qmatmul_bench.json)")


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    n: int
    k: int
    m: int
    kind: str

    @property
    def id(self) -> str:
        return f"{self.n}x{self.k}-M{self.m}-{self.kind}"


def cases(full: bool = False, shapes=None, ms=None, kinds=None) -> list[Case]:
    shapes = shapes or (SHAPES_FULL if full else SHAPES_QUICK)
    ms = ms or (MS_FULL if full else MS_QUICK)
    kinds = kinds or (KINDS_FULL if full else KINDS_QUICK)
    return [Case(n, k, m, kind) for (n, k) in shapes for kind in kinds for m in ms]


def segments_for(kind: str, k: int):
    """(segments, use_perm): uniform kinds are one segment; "mixed" is 10%
    of the columns at 4 bits (act-order first) and the rest at 3 bits."""
    if kind == "mixed":
        hi = max(GROUP_SIZE, round(k * 0.10 / GROUP_SIZE) * GROUP_SIZE)
        return [(4, GROUP_SIZE, hi), (3, GROUP_SIZE, k - hi)], True
    bits = int(kind.removesuffix("bit"))
    return [(bits, GROUP_SIZE, k)], False


class Weights:
    """One quantized weight and everything the three implementations need."""

    def __init__(self, n: int, k: int, kind: str, seed: int = 0):
        import mlx.core as mx
        import numpy as np

        import mixbits

        rng = np.random.default_rng(seed)
        w = mx.array(rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
        segs, use_perm = segments_for(kind, k)
        perm = rng.permutation(k).astype(np.int32) if use_perm else None
        self.qt = mixbits.quantize(w.astype(mx.float16), segs, perm=perm)
        mx.eval(self.qt.arrays())
        self.nbytes = self.qt.nbytes
        self.bpw = self.qt.bits_per_weight
        self._dense = None
        self._repacked = None
        self._copies = {}  # repacked? -> Weights.copies

    def repacked(self):
        """The weight in the row-interleaved layout (built once), or None
        where its bits have none."""
        import mlx.core as mx

        from mixbits import ops
        from mixbits.repack import REPACK_BITS

        if self._repacked is None and all(b in REPACK_BITS for b, _, _ in self.qt.specs):
            self._repacked = ops.repack(self.qt)
            mx.eval(self._repacked.arrays())
        return self._repacked

    def copies(self, repacked: bool = False) -> list:
        """The weight (or its repacked layout) and enough copies of it --
        the same values in distinct memory -- to fill COLD_MB (at most
        MAX_COPIES in all): taken in turn, each call reads its weight from
        DRAM, not from the caches the previous calls warmed."""
        import math

        import mlx.core as mx
        import numpy as np

        if repacked not in self._copies:
            t = self.repacked() if repacked else self.qt
            n = min(MAX_COPIES, max(1, math.ceil((COLD_MB << 20) / self.nbytes)))
            out = [t]
            for _ in range(n - 1):
                # through numpy: a new buffer with the same bits (an MLX op
                # could share the buffer or, for float scales, turn -0 to +0)
                segs = [dataclasses.replace(sg, **{f.name: mx.array(np.array(getattr(sg, f.name), copy=True))
                                                   for f in dataclasses.fields(sg)
                                                   if isinstance(getattr(sg, f.name), mx.array)})
                        for sg in t.segments]
                out.append(type(t)(segs, t.perm, t.shape[0]) if repacked else type(t)(segs, t.perm))
            mx.eval([a for c in out for a in c.arrays()])
            self._copies[repacked] = out
        return self._copies[repacked]

    def dense(self):
        """float32 [N, K] in stored (permuted) order, for numpy."""
        import mlx.core as mx
        import numpy as np

        if self._dense is None:
            self._dense = np.ascontiguousarray(
                np.array(self.qt.dequantize().astype(mx.float32)))
        return self._dense


def make_x(case: Case, seed: int = 1):
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((case.m, case.k), dtype=np.float32))
    mx.eval(x)
    return x


def runners(wt: Weights, x, activations: str = "float", backend: str = "auto", cold: bool = False,
            calls_per_eval: int = 1):
    """name -> zero-argument callable doing one full evaluation. ``cold``:
    mixbits' calls take the weight's copies in turn (Weights.copies).
    Each mixbits evaluation holds ``calls_per_eval`` independent calls
    (divide its time by that); MLX's and numpy's hold one (calls of
    milliseconds, where one eval's fixed cost does not show)."""
    import itertools

    import mlx.core as mx
    import numpy as np

    import mixbits

    qt = wt.qt
    plain = itertools.cycle(wt.copies() if cold else [qt])
    packed = None  # built on first use: repacked() may be None (bits without the layout)

    def evaluate(weights, contract):
        """One evaluation: calls_per_eval calls, each on the next weight."""
        mx.eval([mixbits.qmatmul(x, next(weights), activations=contract, backend=backend)
                 for _ in range(calls_per_eval)])

    def run_mixbits():
        evaluate(plain, activations)

    def run_repacked():
        nonlocal packed
        if packed is None:
            packed = itertools.cycle(wt.copies(repacked=True) if cold else [wt.repacked()])
        evaluate(packed, activations)

    def run_float():
        evaluate(plain, "float")

    def run_mlx():
        xs = x if qt.perm is None else mx.take(x, qt.perm, axis=-1)
        y, k0 = None, 0
        for s in qt.segments:
            part = mx.quantized_matmul(xs[..., k0 : k0 + s.k], s.wq, s.scales, s.biases,
                                       transpose=True, group_size=s.group_size, bits=s.bits)
            y = part if y is None else y + part
            k0 += s.k
        mx.eval(y)

    xn = np.array(x) if qt.perm is None else np.array(x)[:, np.array(qt.perm)]
    xn = np.ascontiguousarray(xn)

    def run_numpy():
        xn @ wt.dense().T

    return {"mixbits": run_mixbits, "mixbits_repacked": run_repacked, "mixbits_float": run_float,
            "mlx": run_mlx, "numpy": run_numpy}


CLOCK = time.perf_counter  # time.process_time with --clock cpu
# --cold: each weight's copies fill this much, several times the last-level
# cache of the CPUs this bench targets (32 MiB L3 on the EPYC host of
# bench/README.md); ggml_mm --cold-mb takes the same number.
COLD_MB = 256
MAX_COPIES = 64


CALLS_PER_EVAL = 8


def time_call(fn, min_time: float = 0.3, max_reps: int = 200, min_reps: int = 3,
              calls: int = 1) -> dict:
    """Best and median of repeated calls after one warm-up (the best is the
    least disturbed by other processes on a shared machine); fn makes
    ``calls`` calls, and the times are per call."""
    fn()
    ts: list[float] = []
    start = time.perf_counter()
    while len(ts) < max_reps and (len(ts) < min_reps or time.perf_counter() - start < min_time):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    ts.sort()
    med = ts[len(ts) // 2]
    # CPU time of a thread that is running can be accounted late, so an
    # occasional reading comes out too small: with --clock cpu report the
    # median, with wall time the best.
    best = med if CLOCK is time.process_time else ts[0]
    return {"best_s": best / calls, "min_s": ts[0] / calls, "median_s": med / calls,
            "reps": len(ts), "calls_per_eval": calls}


def mlx_estimate(fn) -> float:
    """Seconds of one MLX call at M=1 (MLX's CPU path scales ~linearly in M)."""
    fn()
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def probe_gbps(nbytes: int = PROBE_BYTES, reps: int = 5) -> float:
    from mixbits import _ext

    return float(_ext.read_bandwidth_gbps(int(nbytes), int(reps)))


# ---------------------------------------------------------------- results


@dataclass
class Row:
    case: Case
    bpw: float
    weight_bytes: int
    times: dict = field(default_factory=dict)  # impl -> time_call dict or {"skipped": why}

    def best(self, impl):
        t = self.times.get(impl) or {}
        return t.get("best_s")

    def derived(self, probe: float) -> dict:
        c = self.case
        t = self.best("mixbits")
        flops = 2.0 * c.m * c.n * c.k
        out = {"mixbits_ms": t * 1e3, "gbps": self.weight_bytes / t / 1e9,
               "pct_probe": 100.0 * self.weight_bytes / t / 1e9 / probe,
               "gflops": flops / t / 1e9}
        if self.best("mixbits_repacked"):
            tr = self.best("mixbits_repacked")
            out["repacked_ms"] = tr * 1e3
            out["repacked_gbps"] = self.weight_bytes / tr / 1e9
            out["repacked_pct_probe"] = 100.0 * self.weight_bytes / tr / 1e9 / probe
            out["speedup_repacked_vs_mixbits"] = t / tr
        if self.best("mixbits_float"):
            tf = self.best("mixbits_float")
            out["float_ms"] = tf * 1e3
            out["float_over_mixbits"] = tf / t
            if self.best("mixbits_repacked"):
                out["float_over_repacked"] = tf / self.best("mixbits_repacked")
        if self.best("mlx"):
            out["mlx_ms"] = self.best("mlx") * 1e3
            out["speedup_vs_mlx"] = self.best("mlx") / t
        if self.best("numpy"):
            out["numpy_ms"] = self.best("numpy") * 1e3
            out["numpy_gflops"] = flops / self.best("numpy") / 1e9
            out["pct_numpy_gflops"] = 100.0 * self.best("numpy") / t
        return out


def format_table(rows: list[Row], probe: float) -> str:
    hdr = (f"{'N x K':>12} {'M':>4} {'weights':>8} {'bpw':>5} {'mixbits ms':>10} "
           f"{'GB/s':>6} {'%probe':>7} {'MLX ms':>10} {'vs MLX':>7} {'numpy ms':>9} "
           f"{'GFLOP/s':>8} {'numpy GF':>9} {'%numpy':>7}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        c, d = r.case, r.derived(probe)
        mlx = r.times.get("mlx", {})
        if "skipped" in mlx:
            mlx_ms, sp = f"skip~{mlx['estimate_s']:.0f}s", "-"
        elif "mlx_ms" in d:
            mlx_ms, sp = f"{d['mlx_ms']:.2f}", f"{d['speedup_vs_mlx']:.1f}x"
        else:
            mlx_ms, sp = "-", "-"
        np_ms = f"{d['numpy_ms']:.2f}" if "numpy_ms" in d else "-"
        np_gf = f"{d['numpy_gflops']:.1f}" if "numpy_gflops" in d else "-"
        pct_np = f"{d['pct_numpy_gflops']:.0f}%" if "pct_numpy_gflops" in d else "-"
        lines.append(
            f"{c.n:>6}x{c.k:<5} {c.m:>4} {c.kind:>8} {r.bpw:5.2f} {d['mixbits_ms']:10.3f} "
            f"{d['gbps']:6.1f} {d['pct_probe']:6.0f}% {mlx_ms:>10} {sp:>7} {np_ms:>9} "
            f"{d['gflops']:8.1f} {np_gf:>9} {pct_np:>7}")
    return "\n".join(lines)


# Linux's transparent-huge-page policy: whether large buffers (weights, and
# ggml's) may sit on 2 MiB pages. Cold (DRAM-bound) GEMV times move by
# ~10-15% with it, ggml's as ours (bench/README.md, "M = 1 on cold weights").
THP_POLICY = "/sys/kernel/mm/transparent_hugepage/enabled"


def page_policy(path: str = THP_POLICY) -> dict:
    """The THP mode in force ("always", "madvise", "never"; None where the
    file is missing, e.g. macOS) and GLIBC_TUNABLES (``glibc.malloc.hugetlb=1``
    puts every malloc'd buffer on huge pages under "madvise")."""
    import re

    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        thp = None
    else:
        chosen = re.search(r"\[(\w+)\]", text)
        thp = chosen.group(1) if chosen else text.strip()
    return {"transparent_hugepage": thp, "glibc_tunables": os.environ.get("GLIBC_TUNABLES")}


def machine_info(pages: dict) -> dict:
    """The machine record of a run; ``pages``: its page_policy(), read once
    by the run (it also prints it)."""
    from mixbits import _ext, ops

    return {"platform": platform.platform(), "machine": platform.machine(),
            "python": sys.version.split()[0], "threads": _ext.num_threads(),
            "backends": ops.available_backends(),
            "isa_limit": ops.isa_limit(),  # avx2: held to AVX2 (README)
            # Other processes on the machine skew absolute times (ratios less).
            "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "openblas_env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                        "OPENBLAS_NUM_THREADS")
                             if k in os.environ},
            "pages": pages}


def save_json(path: str, machine: dict, probe: dict, rows: list[Row], notes: list[str],
              extra: dict | None = None) -> None:
    data = {"machine": machine, "probe_gbps": probe, "notes": notes,
            "m8_over_m1": m8_over_m1(rows),
            "rows": [{"case": asdict(r.case), "bpw": r.bpw, "weight_bytes": r.weight_bytes,
                      "times": r.times, **r.derived(probe["dram"])} for r in rows],
            **(extra or {})}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def m8_over_m1(rows: list[Row], impl: str = "mixbits") -> dict:
    """t(M=8) / t(M=1) per weight: the cost of decoding once for 8 rows."""
    t = {(r.case.n, r.case.k, r.case.kind, r.case.m): r.best(impl) for r in rows}
    return {f"{n}x{k}-{kind}": t[(n, k, kind, 8)] / t[(n, k, kind, 1)]
            for (n, k, kind, m) in t if m == 1 and t[(n, k, kind, 1)] and t.get((n, k, kind, 8))}


def runs_vpdpbusd(activations: str, backend: str) -> bool:
    """Whether the repacked int8 kernels this run times may be the VNNI ones,
    so that a vpdpbusd floor describes them: not with --backend avx2 (its
    kernels use maddubs/madd, as on a CPU without AVX-512) nor ref/neon,
    nor for the float or int16 contracts. (On a CPU without VNNI the probe
    itself returns 0 and no floor is printed.)"""
    return activations in ("int8", "int8-all") and backend in ("auto", "avx512")


def dot_floor(rows: list[Row], dot_ns: float, impl: str) -> dict:
    """Per weight measured at M = 1 and 8 under activations="int8": the time
    M = 8 rows need for their vpdpbusd alone (one per 64 weight x activation
    products, at the probe's rate), that floor over the measured M = 1
    time (the smallest t(M=8)/t(M=1) any kernel with one dot per 64
    products could reach, decoding and memory for free), and the measured
    M = 8 time over the floor."""
    t = {(r.case.n, r.case.k, r.case.kind, r.case.m): r.best(impl) for r in rows}
    out = {}
    for (n, k, kind, m), t1 in t.items():
        t8 = t.get((n, k, kind, 8))
        if m != 1 or not t1 or not t8:
            continue
        floor = n * k * 8 / 64 * dot_ns * 1e-9
        out[f"{n}x{k}-{kind}"] = {"m8_floor_ms": round(floor * 1e3, 4),
                                  "best_m8_over_m1": round(floor / t1, 3),
                                  "m8_over_floor": round(t8 / floor, 3)}
    return out


def format_repacked_table(rows: list[Row], probe: float) -> str:
    """The row-interleaved layout next to the original one (--repack)."""
    hdr = (f"{'N x K':>12} {'M':>4} {'kind':>5} {'orig ms':>9} {'repacked ms':>11} "
           f"{'orig/rep':>8} {'rep GB/s':>8} {'%probe':>7}")
    lines = ["repacked layout (same weights, same contract)", hdr, "-" * len(hdr)]
    for r in rows:
        d = r.derived(probe)
        if "repacked_ms" not in d:
            continue
        lines.append(f"{r.case.n:>6}x{r.case.k:<5} {r.case.m:>4} {r.case.kind:>5} "
                     f"{d['mixbits_ms']:9.3f} {d['repacked_ms']:11.3f} "
                     f"{d['speedup_repacked_vs_mixbits']:8.2f} {d['repacked_gbps']:8.1f} "
                     f"{d['repacked_pct_probe']:6.0f}%")
    return "\n".join(lines)


def format_float_table(rows: list[Row], probe: float) -> str:
    """The float contract next to the integer one (--vs-float)."""
    rep = any("repacked_ms" in r.derived(probe) for r in rows)
    hdr = (f"{'N x K':>12} {'M':>4} {'kind':>5} {'float ms':>9} {'int ms':>9} {'float/int':>9}"
           + (f" {'int rep ms':>10} {'float/rep':>9}" if rep else ""))
    lines = ["float contract (MLX layout) vs the integer one, same weights, same run", hdr,
             "-" * len(hdr)]
    for r in rows:
        d = r.derived(probe)
        if "float_ms" not in d:
            continue
        line = (f"{r.case.n:>6}x{r.case.k:<5} {r.case.m:>4} {r.case.kind:>5} {d['float_ms']:9.3f} "
                f"{d['mixbits_ms']:9.3f} {d['float_over_mixbits']:9.2f}")
        if rep:
            fr = d.get("float_over_repacked")
            line += (f" {d.get('repacked_ms', float('nan')):10.3f} "
                     f"{f'{fr:.2f}' if fr else '-':>9}")
        lines.append(line)
    return "\n".join(lines)


def _parse_list(s, conv):
    return [conv(v) for v in s.split(",")] if s else None


def run(args) -> int:
    import gc

    shapes = _parse_list(args.shapes, lambda v: tuple(int(t) for t in v.lower().split("x")))
    ms = _parse_list(args.m, int)
    kinds = _parse_list(args.kinds, str)
    harness = getattr(args, "vs_ggml", None)
    if harness is not None:
        from . import bench_ggml

        harness = bench_ggml.check_harness(harness)  # before anything is timed
        ggml_info = bench_ggml.harness_info(harness)
        print(bench_ggml.cpu_flags_line(ggml_info))
        shapes = shapes or (None if args.full else bench_ggml.SHAPES)
        ms = ms or (None if args.full else bench_ggml.MS)
        kinds = kinds or bench_ggml.KINDS
    for kd in kinds or []:
        if kd != "mixed" and kd.removesuffix("bit") not in ("2", "3", "4", "5", "6", "8"):
            raise SystemExit(f"--kinds: unknown kind {kd!r}")
    todo = cases(args.full, shapes, ms, kinds)
    notes = []
    global CLOCK
    from mixbits import _ext, ops

    _ext.set_max_threads(args.threads)
    if args.clock == "cpu":
        CLOCK = time.process_time
        notes.append("times are CPU time of the process (--clock cpu), not elapsed time")
    if args.threads:
        notes.append(f"mixbits capped at {args.threads} thread(s); OPENBLAS_NUM_THREADS="
                     f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; the probe uses "
                     "the same cap")
    if args.backend != "auto":
        if args.backend not in ops.available_backends():
            raise SystemExit(f"--backend {args.backend}: not available on this CPU "
                             f"(available: {', '.join(ops.available_backends())})")
        notes.append(f"mixbits ran backend={args.backend!r} (forced)")
    if ops.isa_limit() == "avx2":
        notes.append("MIXBITS_ISA=avx2: every mixbits kernel held to AVX2 + FMA + F16C, as on a CPU "
                     "without AVX-512 (auto and --backend avx512 take the AVX2 rows or are refused)")
    if args.calls_per_eval < 1:
        raise SystemExit(f"--calls-per-eval must be >= 1, got {args.calls_per_eval}")
    notes.append(f"mixbits: {args.calls_per_eval} call(s) per mx.eval, times per call (MLX's fixed "
                 "cost of an eval shared among them, as among a model step's nodes); MLX and "
                 "numpy: one call per evaluation")
    if args.vs_float and args.activations == "float":
        raise SystemExit("--vs-float compares an integer --activations with the float one: "
                         "pass e.g. --activations int8-all")
    from mixbits._backends import cpu_for_contract

    moved = cpu_for_contract(args.activations, repack=args.repack)
    if moved:
        notes.append(moved)
        print("note:", moved, file=sys.stderr)
    if args.activations != "float":
        notes.append(f"mixbits ran activations={args.activations!r} (x quantized per group; "
                     + ("every M)" if args.activations == "int8-all"
                        else "M <= 16 only, larger M takes the float path)"))
    if any(k in os.environ for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        notes.append("OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE set: numpy may be slowed; "
                     "run as `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE mixbits bench`")
        print("note:", notes[-1], file=sys.stderr)
    if args.cold:
        notes.append(f"--cold: each weight held in copies filling {COLD_MB} MiB (at most "
                     f"{MAX_COPIES}), taken in turn by consecutive calls, so each call read its "
                     "weight from DRAM (ggml's harness likewise); numpy and MLX time one copy")
    probe = {"dram": probe_gbps(PROBE_BYTES), "32MiB": probe_gbps(32 << 20)}
    if hasattr(os, "getloadavg"):
        print(f"load average before: {os.getloadavg()[0]:.2f} "
              f"(on {os.cpu_count()} CPUs; other processes skew the timings)")
    print(f"read-bandwidth probe: {probe['dram']:.1f} GB/s over 1 GiB, "
          f"{probe['32MiB']:.1f} GB/s over 32 MiB; {len(todo)} cases", flush=True)
    pages = page_policy()
    if args.cold and pages["transparent_hugepage"] is not None:
        print(f"huge pages: THP {pages['transparent_hugepage']}, GLIBC_TUNABLES="
              f"{pages['glibc_tunables'] or '(unset)'} (cold times move ~10-15% with them, ggml's too)")
    rows: list[Row] = []
    extra_floor: dict = {}
    by_weight: dict = {}
    for c in todo:
        key = (c.n, c.k, c.kind)
        if key not in by_weight:
            by_weight.clear()
            gc.collect()
            by_weight[key] = Weights(c.n, c.k, c.kind)
        wt = by_weight[key]
        n = args.calls_per_eval
        fns = runners(wt, make_x(c), args.activations, args.backend, cold=args.cold,
                      calls_per_eval=n)
        row = Row(c, wt.bpw, wt.nbytes)
        row.times["mixbits"] = time_call(fns["mixbits"], args.min_time, calls=n)
        if args.repack:
            row.times["mixbits_repacked"] = (
                time_call(fns["mixbits_repacked"], args.min_time, calls=n)
                if wt.repacked() is not None else {"skipped": "bits without a repacked layout"})
        if args.vs_float:
            row.times["mixbits_float"] = time_call(fns["mixbits_float"], args.min_time, calls=n)
        if not args.no_baselines:
            est = mlx_estimate(fns["mlx"]) if c.m == 1 else None
            if c.m > 1:
                ref = next((r for r in rows if r.case == Case(c.n, c.k, 1, c.kind)), None)
                t1 = ref.best("mlx") if ref and ref.best("mlx") else mlx_estimate(
                    runners(wt, make_x(Case(c.n, c.k, 1, c.kind)))["mlx"])
                est = t1 * c.m
            if est > MLX_BUDGET_S:
                row.times["mlx"] = {"skipped": f"estimated {est:.1f} s per call", "estimate_s": est}
            else:
                row.times["mlx"] = time_call(fns["mlx"], args.min_time, max_reps=50, min_reps=2)
            row.times["numpy"] = time_call(fns["numpy"], args.min_time)
        rows.append(row)
        print(format_table([row], probe["dram"]).splitlines()[-1], flush=True)
    skipped = sum("skipped" in r.times.get("mlx", {}) for r in rows)
    if skipped:
        notes.append(f"MLX skipped in {skipped} cases where one call was estimated "
                     f"over {MLX_BUDGET_S:.0f} s (skip~Ns = the estimate).")
    print()
    print(format_table(rows, probe["dram"]))
    ratios = m8_over_m1(rows)
    if ratios:
        print("\nM=8 time / M=1 time: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    if args.repack:
        print()
        print(format_repacked_table(rows, probe["dram"]))
        ratios_r = m8_over_m1(rows, "mixbits_repacked")
        print("\nrepacked M=8 time / M=1 time: " +
              ", ".join(f"{k} {v:.2f}" for k, v in ratios_r.items()))
        from mixbits import _ext

        dot_ns = float(_ext.int8_dot_ns()) if runs_vpdpbusd(args.activations, args.backend) else 0.0
        floors = dot_floor(rows, dot_ns, "mixbits_repacked") if dot_ns else {}
        if floors:
            print(f"\nvpdpbusd probe: {dot_ns:.3f} ns per 64 products (one thread); repacked M=8 against "
                  "its dot-count floor -- floor ms, floor / t(M=1) (the best M8/M1 possible), t(M=8) / floor: "
                  + ", ".join(f"{w} {f['m8_floor_ms']:.3f} {f['best_m8_over_m1']:.2f} {f['m8_over_floor']:.2f}"
                              for w, f in floors.items()))
            extra_floor = {"int8_dot_ns": dot_ns, "repacked_m8_dot_floor": floors}
        notes.append("mixbits_repacked: the same weights in the row-interleaved layout "
                     "(mixbits.ops.repack), same contract; repacking is not timed (done once)")
    if args.vs_float:
        print()
        print(format_float_table(rows, probe["dram"]))
        notes.append("mixbits_float: the float contract (activations='float', MLX's layout) on "
                     "the same weights and x, timed right after the integer calls")
    for n in notes:
        print("note:", n)
    if not args.cold:
        notes.append("a repeated call finds (part of) its weights in the caches, so it can read "
                     "them faster than the 1 GiB DRAM probe (>100%); --cold times DRAM reads")
    extra = dict(extra_floor) if extra_floor else None
    if harness is not None:
        threads = args.threads or os.cpu_count() or 1
        parsed = bench_ggml.run_harness(harness, list(dict.fromkeys((c.n, c.k) for c in todo)),
                                        sorted({c.m for c in todo}), threads, args.min_time,
                                        cold_mb=COLD_MB if args.cold else 0)
        recs = bench_ggml.comparison(rows, bench_ggml.best_times(parsed, args.clock))
        print()
        print(bench_ggml.cpu_flags_line(parsed["info"]))
        print(bench_ggml.format_comparison(recs))
        notes.append("ggml: the faster of its plain and CPU_REPACK weight layouts per case "
                     f"({'median CPU time' if args.clock == 'cpu' else 'best wall time'}); "
                     f"{threads} thread(s); activation quantization inside the op is timed")
        extra = {**(extra or {}), "ggml": {"info": parsed["info"], "command": parsed["command"],
                                           "results": parsed["rows"], "comparison": recs}}
    save_json(args.json, machine_info(pages), probe, rows, notes, extra)
    print(f"saved {args.json}")
    return 0
