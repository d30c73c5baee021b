"""Device-memory traffic of the Metal kernels, counted in the SIMT emulator.

Every public op call of the case list (qmatmul at 1, 2 and 3 K-segments and
with a permutation, M = 1, 4, 8, 9, 17, 512, and at one segment M = 10, 12,
16, 18, 24, 25, 31 for the tiled kernel's MMA use; MLX's own kernel for the one-segment
case (op mlx_qmatmul, mlx_emu.py); the gathered qmatmul at top-8 of 128
experts, decode and sorted prefill, and a sorted prefill at top-2 of 8
experts that takes the tiled kernel, each at 1, 2 and 3 K-segments; the
gradients wrt x, dense (op qmatmul_t, M = 1 and 8) and gathered (op
gather_t, one decode token), at 1, 2 and 3 segments and with a
permutation; KL) runs on the emulator with its
counters on (metal_emu.counting: bytes read and written per access width,
threadgroup bytes, barriers, MMAs, threads), one record per call with the
analytic minimum -- every weight, scale, bias, index and x element read
once, every output written once -- and the ratio of the counted device
bytes to it.

    python tests/metal/metal_traffic.py --json          # quick sizes (default)
    python tests/metal/metal_traffic.py --full --json   # 4096 x 4096 GEMV etc.
    python tests/metal/metal_traffic.py --full --op qmatmul --m 17   # some records

A filtered run draws the inputs of the cases it leaves out all the same,
so its records are those of the whole run (the gathered ones on the same
routing).

The weights, scales and x are random: the kernels' access pattern does not
depend on the values (indices excepted, which are valid and sorted as
mlx-lm sorts them). Counts are exact for what the kernel source asks
(loads at the width it wrote them, see metal_emu.KERNEL_FLAGS); what a GPU
cache turns into DRAM traffic is not modelled.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import metal_emu as E  # noqa: E402

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ---------------------------------------------------------------- cases

# (N, K) per M. The emulator's cost grows with M N K (the tiled kernel runs
# every 8x8x8 MMA lane by lane), so the tiled rows run smaller matrices; the
# counts per call scale with N K at fixed M and layout (see the notes).
SIZES = {
    False: {1: (1024, 1024), 4: (1024, 1024), 8: (1024, 1024), 9: (512, 512), 17: (512, 512),
            512: (128, 256)},
    True: {1: (4096, 4096), 4: (4096, 4096), 8: (4096, 4096), 9: (1024, 1024),
           17: (2048, 2048),
           512: (512, 512)},
}


# The tiled kernel's MMA use between those rows (issue 45: >= 50% from
# M = 9): 16-row blocks up to 16 rows, 32-row ones above, an 8-row fragment
# wholly past M not multiplied; 10 and 18 just past the block changes, 25
# past 24 (three fragments of a 32-row block). One segment: the MMA count
# does not depend on the layout (the records of M = 9 and 17 agree).
MMA_M = (10, 12, 16, 18, 24, 25, 31)
MMA_SIZES = {False: (256, 256), True: (1024, 1024)}


def qmatmul_cases(full: bool) -> list[dict]:
    """Equal bits (4-bit, group 64) for every layout, so the layouts differ
    only in how the product is split: one segment, two, three, and two with
    a K permutation (a mixbits layout's reordered columns)."""
    cases = []
    for M, (N, K) in SIZES[full].items():
        h = K // 2
        for segs, perm in (([[4, 64, K]], False),
                           ([[4, 64, h], [4, 64, h]], False),
                           ([[4, 64, K // 4], [4, 64, K // 4], [4, 64, h]], False),
                           ([[4, 64, h], [4, 64, h]], True)):
            cases.append({"op": "qmatmul", "M": M, "N": N, "K": K, "segments": segs,
                          "perm": perm, "x_dtype": "float16", "scale_dtype": "float16"})
    N, K = MMA_SIZES[full]
    for M in MMA_M:
        cases.append({"op": "qmatmul", "M": M, "N": N, "K": K, "segments": [[4, 64, K]],
                      "perm": False, "x_dtype": "float16", "scale_dtype": "float16"})
    return cases


# The transposed products (the gradient wrt x, M <= 8 rows of dy: their
# kernels' range) at the GEMV sizes: dy [M, N], W [N, K], dx [M, K].
T_SIZES = {False: (1024, 1024), True: (4096, 4096)}


def qmatmul_t_cases(full: bool) -> list[dict]:
    """dx = dy · W un-permuted (MixedQMatmulT) at M = 1 and 8, the same
    four layouts as the forward: 1, 2 and 3 segments and 2 with a perm."""
    N, K = T_SIZES[full]
    h = K // 2
    cases = []
    for M in (1, 8):
        for segs, perm in (([[4, 64, K]], False),
                           ([[4, 64, h], [4, 64, h]], False),
                           ([[4, 64, K // 4], [4, 64, K // 4], [4, 64, h]], False),
                           ([[4, 64, h], [4, 64, h]], True)):
            cases.append({"op": "qmatmul_t", "M": M, "N": N, "K": K, "segments": segs,
                          "perm": perm, "x_dtype": "float16", "scale_dtype": "float16"})
    return cases


def gather_t_cases(full: bool) -> list[dict]:
    """dx[lhs[i]] += dy[i] · W[rhs[i]] (MixedGatherQMMT, the MoE gradient)
    for one decode token at top-8 of 128 experts (the forward's decode
    size), one segment, two, three and two with a perm."""
    N, K = (768, 2048) if full else (256, 512)
    h = K // 2
    cases = []
    for segs, perm in (([[4, 64, K]], False), ([[4, 64, h], [4, 64, h]], False),
                       ([[4, 64, K // 4], [4, 64, K // 4], [4, 64, h]], False),
                       ([[4, 64, h], [4, 64, h]], True)):
        cases.append({"op": "gather_t", "M": 1, "N": N, "K": K, "segments": segs,
                      "perm": perm, "x_dtype": "float16", "scale_dtype": "float16",
                      "experts": 128, "top_k": 8, "tokens": 1, "sorted": False})
    return cases


def mlx_cases(full: bool) -> list[dict]:
    """MLX's own kernels (mlx_emu: compiled from the installed mlx package)
    for the one-segment qmatmul cases: the kernel MLX's host code picks for
    each M, per GPU family where the choice differs (M = 8: qmv_fast on
    M1/M2, qmv_wide on M3/M4). The tiled rows run smaller matrices than
    4096 x 4096, where MLX may split K differently (it aims at ~512
    threadgroups): then MLX's split at 4096 x 4096 is run too (mlx_split_k)."""
    import mlx_emu as X

    cases = []
    for M, (N, K) in SIZES[full].items():
        seen = {}
        for gpu in X.GPUS:
            p = X.plan(M, N, K, gpu)
            if p["kernel"] in seen:  # the same kernel as the other family
                for k in (p["kernel"], ("at4096", X.plan(M, 4096, 4096, gpu).get("split_k"))):
                    if k in seen:
                        seen[k]["gpu"] += "," + gpu
                continue
            seen[p["kernel"]] = c = {
                "op": "mlx_qmatmul", "M": M, "N": N, "K": K, "segments": [[4, 64, K]],
                "perm": False, "x_dtype": "float16", "scale_dtype": "float16", "gpu": gpu,
                "mlx_kernel": p["kernel"], "mlx_note": p["note"]}
            cases.append(c)
            p4096 = X.plan(M, 4096, 4096, gpu)
            sk = p4096.get("split_k")
            if p["kind"].startswith("qmm") and sk and sk != p["split_k"]:
                seen[("at4096", sk)] = c2 = dict(
                    c, mlx_split_k=sk, mlx_kernel=X.plan(M, N, K, gpu, sk)["kernel"],
                    mlx_note=f"split_k {sk}: MLX's choice at 4096 x 4096 (here {p['split_k']})")
                cases.append(c2)
    return cases


def gather_cases(full: bool) -> list[dict]:
    """Top-8 routing over 128 experts: a decode token (8 pairs of one row,
    unsorted) and a sorted prefill of 8 tokens (64 pairs, sorted by expert
    as mlx-lm does from 64 pairs; one or two rows per expert, so the GEMV
    too); then a sorted prefill with at least 8 rows per expert, which takes
    the tiled kernel: 32 tokens at top-2 of 8 experts (Mixtral's routing, 64
    pairs). Each at one segment, then (after the one-segment records, so
    their routing stays the same) at two and three segments of equal bits
    (4-bit, group 64), as for qmatmul."""
    decode = (768, 2048) if full else (256, 512)
    prefill = (256, 512) if full else (128, 256)
    shapes = ((1, 8, 128, False, decode), (8, 8, 128, True, prefill),
              (32, 2, 8, True, prefill))

    def case(T, top, nexp, sort, N, K, segs):
        return {"op": "gather", "M": 1, "N": N, "K": K, "segments": segs, "perm": False,
                "x_dtype": "float16", "scale_dtype": "float16", "experts": nexp,
                "top_k": top, "tokens": T, "sorted": sort}

    cases = [case(T, top, nexp, sort, N, K, [[4, 64, K]])
             for T, top, nexp, sort, (N, K) in shapes[:2]]
    for T, top, nexp, sort, (N, K) in shapes:
        h = K // 2
        for segs in ([[4, 64, K]], [[4, 64, h], [4, 64, h]],
                     [[4, 64, K // 4], [4, 64, K // 4], [4, 64, h]]):
            if len(segs) > 1 or nexp == 8:  # the first two one-segment cases are above
                cases.append(case(T, top, nexp, sort, N, K, segs))
    return cases


def kl_cases(full: bool) -> list[dict]:
    V = 151936 if full else 32000
    return [{"op": "kl", "M": rows, "N": V, "K": 0, "segments": [], "perm": False,
             "x_dtype": "float16"} for rows in (1, 8)]


# ---------------------------------------------------------------- inputs

def _storage(rng, shape, dtype: str, scale=1.0) -> np.ndarray:
    a = (scale * rng.standard_normal(shape)).astype(np.float32)
    if dtype == "bfloat16":
        return E.bf16_bits(a)
    return a.astype(E.storage_dtype(dtype))


def _packed(rng, lead, N, bits, gs, k, sdt):
    wq = rng.integers(0, 2**32, size=(*lead, N, k * bits // 32), dtype=np.uint64)
    return (wq.astype(np.uint32), _storage(rng, (*lead, N, k // gs), sdt, 0.01),
            _storage(rng, (*lead, N, k // gs), sdt, 0.01))


def run_case(c: dict, rng, run: bool = True) -> list[dict]:
    """Runs one op call with counting on; returns its per-dispatch records.
    run=False draws the call's inputs from rng and runs nothing (returns
    []): main does that for the cases a filter leaves out, so every case
    sees the same inputs (the gathered ones their routing) whichever
    cases run."""
    M, N, K = c["M"], c["N"], c["K"]
    call = (lambda f, *a, **k: f(*a, **k)) if run else (lambda *a, **k: None)
    if c["op"] == "mlx_qmatmul":
        import mlx_emu as X

        gpu = c["gpu"].split(",")[0]
        with X.counting() if run else contextlib.nullcontext([]) as rec:
            x = _storage(rng, (M, K), c["x_dtype"])
            call(X.run, x, *_packed(rng, (), N, 4, 64, K, c["scale_dtype"]), gpu=gpu,
                 split_k=c.get("mlx_split_k"))
        p = X.plan(M, N, K, gpu, c.get("mlx_split_k"))
        if run and p["kind"] == "qmm_t_splitk":  # + MLX's reduce of the partials (not emulated)
            rec.append(X.reduce_record(M, N, p["split_k"]))
        return rec
    with E.counting() if run else contextlib.nullcontext([]) as rec:
        if c["op"] == "qmatmul":
            x = _storage(rng, (M, K), c["x_dtype"])
            segs = [(b, g, k, *_packed(rng, (), N, b, g, k, c["scale_dtype"]))
                    for b, g, k in c["segments"]]
            perm = rng.permutation(K).astype(np.int32) if c["perm"] else None
            call(E.qmatmul, x, c["x_dtype"], segs, N, perm=perm, scale_type=c["scale_dtype"])
        elif c["op"] == "gather":
            T, top, nexp = c["tokens"], c["top_k"], c["experts"]
            idx = np.stack([rng.choice(nexp, top, replace=False) for _ in range(T)])
            c["_experts_used"] = len(np.unique(idx))  # for the analytic minimum
            if c["sorted"]:  # mlx-lm: x rows repeated per pair, pairs sorted by expert
                order = np.argsort(idx.ravel(), kind="stable")
                rhs = idx.ravel()[order].astype(np.uint32)
                lhs = np.arange(T * top, dtype=np.uint32)
                x = _storage(rng, (T * top, M, K), c["x_dtype"])
            else:
                rhs = idx.ravel().astype(np.uint32)
                lhs = np.repeat(np.arange(T), top).astype(np.uint32)
                x = _storage(rng, (T, M, K), c["x_dtype"])
            packed = [a for b, g, k in c["segments"]
                      for a in _packed(rng, (nexp,), N, b, g, k, c["scale_dtype"])]
            call(E.gather, [x, *packed, lhs, rhs], c["segments"], c["x_dtype"], c["scale_dtype"],
                 False, sorted_indices=c["sorted"])
        elif c["op"] == "qmatmul_t":
            dy = _storage(rng, (M, N), c["x_dtype"])
            packed = [a for b, g, k in c["segments"]
                      for a in _packed(rng, (), N, b, g, k, c["scale_dtype"])]
            perm = [rng.permutation(K).astype(np.int32)] if c["perm"] else []
            call(E.qmv_t, [dy, *perm, *packed], c["segments"], c["x_dtype"], c["scale_dtype"],
                 c["perm"])
        elif c["op"] == "gather_t":
            T, top, nexp = c["tokens"], c["top_k"], c["experts"]
            idx = np.stack([rng.choice(nexp, top, replace=False) for _ in range(T)])
            c["_experts_used"] = len(np.unique(idx))
            rhs = idx.ravel().astype(np.uint32)
            lhs = np.repeat(np.arange(T), top).astype(np.uint32)
            dy = _storage(rng, (T * top, M, N), c["x_dtype"])
            packed = [a for b, g, k in c["segments"]
                      for a in _packed(rng, (nexp,), N, b, g, k, c["scale_dtype"])]
            perm = [rng.permutation(K).astype(np.int32)] if c["perm"] else []
            call(E.gather_t, [dy, *perm, *packed, lhs, rhs], c["segments"], c["x_dtype"],
                 c["scale_dtype"], c["perm"], T, fused=c.get("fused"))
        elif c["op"] == "kl":
            a = _storage(rng, (M, N), c["x_dtype"], 3.0)
            b = _storage(rng, (M, N), c["x_dtype"], 3.0)
            call(E.kl, a, b, c["x_dtype"])
        else:
            raise ValueError(f"unknown op {c['op']!r}")
    return rec


def analytic_min(c: dict) -> int:
    """Bytes a call must move at least: every input element it needs read
    once, every output written once."""
    M, N, K, xb = c["M"], c["N"], c["K"], BYTES[c["x_dtype"]]
    if c["op"] == "kl":  # two [rows, V] inputs; six 4-byte outputs per row
        return 2 * M * N * xb + 6 * 4 * M
    sb = BYTES[c["scale_dtype"]]

    def weights(n_mats):
        return n_mats * sum(N * k * b // 8 + 2 * N * (k // g) * sb
                            for b, g, k in c["segments"])

    perm = 4 * K if c["perm"] else 0
    if c["op"] in ("qmatmul", "mlx_qmatmul"):
        return weights(1) + M * K * xb + M * N * xb + perm
    if c["op"] == "qmatmul_t":  # dy [M, N] in, dx [M, K] out
        return weights(1) + M * N * xb + M * K * xb + perm
    T, top = c["tokens"], c["top_k"]
    pairs = T * top
    experts_used = c["_experts_used"]
    x_rows = pairs if c["sorted"] else T
    # gather: x [x_rows, M, K] in, y [pairs, M, N] out; gather_t: dy
    # [pairs, M, N] in, dx [T, M, K] out -- the same sizes.
    return (weights(experts_used) + x_rows * M * K * xb + pairs * M * N * xb
            + 2 * 4 * pairs + perm)


def summarize(c: dict, rec: list[dict]) -> dict:
    out = {k: v for k, v in c.items() if not k.startswith("_")}
    if "_experts_used" in c:
        out["experts_used"] = c["_experts_used"]
    tot = lambda key: sum(r[key] for r in rec)  # noqa: E731
    by_w = {w: sum(r["device_read_by_width"][w] for r in rec) for w in E.WIDTHS}
    by_ww = {w: sum(r["device_write_by_width"][w] for r in rec) for w in E.WIDTHS}
    out.update({
        "dispatches": len(rec), "kernels": [r["kernel"] for r in rec],
        "bytes_read": tot("device_read_bytes"), "bytes_written": tot("device_write_bytes"),
        "unique_read": tot("device_unique_read_bytes"),
        "unique_written": tot("device_unique_write_bytes"),
        "read_by_width": by_w, "write_by_width": by_ww,
        "threadgroup_read": tot("threadgroup_read_bytes"),
        "threadgroup_written": tot("threadgroup_write_bytes"),
        "barriers": tot("barriers"), "simdgroup_barriers": tot("simdgroup_barriers"),
        "mma": tot("mma"), "threads": tot("threads")})
    out["analytic_min"] = analytic_min(c)
    out["ratio"] = round((out["bytes_read"] + out["bytes_written"]) / out["analytic_min"], 3)
    # Distinct bytes per dispatch, summed: the ratio if caches caught every
    # repeat within a dispatch (what stays is cross-dispatch round trips).
    out["unique_ratio"] = round((out["unique_read"] + out["unique_written"])
                                / out["analytic_min"], 3)
    if c["op"] in ("qmatmul", "mlx_qmatmul", "gather") and out["mma"]:
        # MMA work needed: every row of x times N columns, K deep, in 8x8x8.
        rows = c["M"] * (c["tokens"] * c["top_k"] if c["op"] == "gather" else 1)
        out["mma_utilisation"] = round(rows * c["N"] * c["K"] / 512 / out["mma"], 3)
    out["per_dispatch"] = rec
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="small shapes (default; seconds to a minute or two)")
    size.add_argument("--full", action="store_true", help="4096 x 4096 and larger shapes")
    ap.add_argument("--op", choices=("qmatmul", "mlx_qmatmul", "gather", "kl", "qmatmul_t",
                                     "gather_t"), action="append",
                    help="only these ops (repeatable)")
    ap.add_argument("--m", type=int, action="append",
                    help="only the cases of these M (repeatable)")
    ap.add_argument("--one-segment", action="store_true",
                    help="qmatmul: only the one-segment layout (the product MLX's kernels compute)")
    ap.add_argument("--per-dispatch", action="store_true",
                    help="keep every dispatch's own record in the JSON")
    ap.add_argument("--out", type=Path, help="also write {host, records} JSON here")
    a = ap.parse_args(argv)
    full = bool(a.full)
    cases = [(c, (not a.op or op in a.op)
              and not (a.one_segment and op == "qmatmul"
                       and (len(c["segments"]) > 1 or c["perm"]))
              and (not a.m or c["M"] in a.m))
             for f, op in ((qmatmul_cases, "qmatmul"), (mlx_cases, "mlx_qmatmul"),
                           (gather_cases, "gather"), (qmatmul_t_cases, "qmatmul_t"),
                           (gather_t_cases, "gather_t"), (kl_cases, "kl"))
             for c in f(full)]
    rng = np.random.default_rng(0)
    records = []
    for c, chosen in cases:
        if not chosen:  # its inputs still drawn: the chosen ones get the whole run's
            run_case(c, rng, run=False)
            continue
        t0 = time.perf_counter()
        rec = run_case(c, rng)
        r = summarize(c, rec)
        r["emulator_s"] = round(time.perf_counter() - t0, 2)
        if not a.per_dispatch:
            r.pop("per_dispatch")
        records.append(r)
        if not a.json:
            print(f"{r['op']:8s} M={r['M']:<4d} N={r['N']:<6d} K={r['K']:<5d} "
                  f"segs={len(r['segments'])} perm={int(r['perm'])} "
                  f"disp={r['dispatches']} read={r['bytes_read']:>11d} "
                  f"write={r['bytes_written']:>10d} min={r['analytic_min']:>11d} "
                  f"ratio={r['ratio']:<6} uniq={r['unique_ratio']:<6} bytes1={r['read_by_width']['1']:>10d} "
                  f"mma={r['mma']} bar={r['barriers']} ({r['emulator_s']} s)"
                  + (f" {r['mlx_kernel']} [{r['gpu']}]" if "mlx_kernel" in r else "")
                  + (f" split_k={r['mlx_split_k']}" if "mlx_split_k" in r else ""), flush=True)
    if a.json:
        print(json.dumps(records, indent=1))
    if a.out:
        doc = {"host": {"machine": platform.machine(), "node": platform.node(),
                        "python": platform.python_version(),
                        "note": "counts from the SIMT emulator (tests/metal), not a GPU"},
               "size": "full" if full else "quick", "records": records}
        tmp = a.out.with_suffix(a.out.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
