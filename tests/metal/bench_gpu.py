"""Metal benchmarks (a Mac with Metal only): mixbits on mx.gpu against
mx.quantized_matmul on the same weights (the GEMV at M = 1, 8; the tiled
simdgroup-matrix kernel at M = 32 .. 512), the gathered GEMV against
mx.gather_qmm on an expert stack (top-8 of 128 experts, as Qwen3-30B-A3B's
MoE layers), the gradient wrt x (the transposed kernel, M <= 8) against
MLX's own vjp of mx.quantized_matmul, the gathered gradient wrt x (the
gathered transposed kernel) against MLX's vjp of mx.gather_qmm, and the
fused KL against MLX's op composition. Prints one table; exit status 0 even
when mixbits is slower (check_on_mac.sh reports the ratios, it does not
judge them).

    python tests/metal/bench_gpu.py [--quick]
    python tests/metal/bench_gpu.py --traffic [--out FILE]

--traffic times every case metal_traffic.py counts in the emulator (its
--full case list: qmatmul at 1, 2, 3 K-segments and with a permutation at
M = 1, 8, 17, 512; the gathered matmul at top-8 of 128 experts and, tiled,
top-2 of 8, at 1, 2, 3 K-segments; KL)
against mx.quantized_matmul / mx.gather_qmm / MLX's composition, at the
issue's sizes (qmatmul 4096 x 4096 at every M), and prints the achieved
bandwidth on the analytic minimum, so the first Mac run gives the real
table next to the counts (bench/results/metal_traffic.json).
"""

import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
import mixbits.kl as mkl


def best_ms(fn, reps):
    mx.eval(fn())  # warm-up: pipeline creation, metallib load
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


TILED_MS = (32, 64, 128, 256, 512)


def qmm_rows(quick):
    shapes = [(4096, 4096), (11008, 4096)] if not quick else [(4096, 4096)]
    for N, K in shapes:
        for bits in (4, 3, 8):
            rng = np.random.default_rng(bits)
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(mx.float16)
            wq, s, b = mx.quantize(w, group_size=64, bits=bits)
            # M <= 8: the GEMV (vs MLX's qmv); M >= 9: the tiled simdgroup-matrix
            # kernel (vs MLX's qmm_t), 32..512 rows.
            for M in (1, 8) + TILED_MS:
                x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.float16)
                ours = best_ms(lambda: mixbits.quantized_matmul(x, wq, s, b, 64, bits), 20)
                mlx = best_ms(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True,
                                                          group_size=64, bits=bits), 20)
                kind = "gemv" if M <= 8 else "tiled"
                yield f"qmm {N}x{K} b{bits} M={M} {kind}", ours, mlx


def gather_rows(quick):
    # 128 experts of 768 x 2048 (an MoE layer's up projection), top-8 per
    # token, unsorted: decode (1 token) and small batches, which run the
    # gathered GEMV; then sorted prefill (mlx-lm's sorted SwitchGLU call),
    # which runs the tiled gathered kernel from 64 rows.
    E, N, K, top = 128, 768, 2048, 8
    for bits in ((4,) if quick else (4, 3)):
        rng = np.random.default_rng(bits)
        w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=64, bits=bits)
        for tokens in (1, 8, 64):
            x = mx.array(rng.standard_normal((tokens, 1, 1, K)).astype(np.float16))
            idx = mx.array(np.stack([rng.choice(E, top, replace=False)
                                     for _ in range(tokens)]).astype(np.uint32))
            mx.eval(x, idx, wq, s, b)
            ours = best_ms(lambda: mixbits.gather_quantized_matmul(x, wq, s, b, None, idx, 64,
                                                                   bits), 20)
            mlx = best_ms(lambda: mx.gather_qmm(x, wq, s, b, None, idx, transpose=True,
                                                group_size=64, bits=bits), 20)
            yield f"gather {E}x{N}x{K} b{bits} tok={tokens} top{top}", ours, mlx
        for tokens in ((256,) if quick else (64, 256, 1024)):
            idx = rng.integers(0, E, (tokens, top)).reshape(-1)
            order = np.argsort(idx, kind="stable")
            x = mx.array(rng.standard_normal((tokens * top, 1, K)).astype(np.float16))
            ridx = mx.array(idx[order].astype(np.uint32))
            mx.eval(x, ridx)
            ours = best_ms(lambda: mixbits.gather_quantized_matmul(
                x, wq, s, b, None, ridx, 64, bits, sorted_indices=True), 10)
            mlx = best_ms(lambda: mx.gather_qmm(x, wq, s, b, None, ridx, transpose=True,
                                                group_size=64, bits=bits, sorted_indices=True), 10)
            yield f"gather {E}x{N}x{K} b{bits} tok={tokens} top{top} sorted", ours, mlx


def grad_x_rows(quick):
    # dx = dy · W only (the forward output is never evaluated): mixbits'
    # transposed kernel against MLX's vjp (its qvm kernel). Where mixbits
    # loses at M = 8, MB_QT_MAX_M (metal/qmatmul_t_params.h) is too high.
    N, K, gs = 4096, 4096, 64
    for bits in ((4,) if quick else (4, 3, 8)):
        rng = np.random.default_rng(bits)
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        for M in (1, 4, 8):
            x = mx.array(rng.standard_normal((M, K)).astype(np.float16))
            dy = mx.array(rng.standard_normal((M, N)).astype(np.float16))
            mx.eval(x, dy, wq, s, b)

            def dx(f):
                return lambda: mx.vjp(f, [x], [dy])[1][0]

            ours = best_ms(dx(lambda x: mixbits.quantized_matmul(x, wq, s, b, gs, bits)), 20)
            mlx = best_ms(dx(lambda x: mx.quantized_matmul(x, wq, s, b, transpose=True,
                                                           group_size=gs, bits=bits)), 20)
            yield f"dx {N}x{K} b{bits} M={M}", ours, mlx


def gather_grad_x_rows(quick):
    # dx of the gathered matmul only: mixbits' gathered transposed kernel
    # (dx[lhs[i]] += dy[i] · W[rhs[i]], grouped by dx matrix) against MLX's
    # vjp of mx.gather_qmm, on the expert stack of gather_rows: decode and
    # small batches unsorted, then sorted prefill (one pair per dx matrix,
    # each re-decoding its expert's weights: where mixbits loses there,
    # gather_qmm_t_gpu_runs should send many sorted pairs to dequantize +
    # gather_mm instead).
    E, N, K, top = 128, 768, 2048, 8
    bits = 4
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=64, bits=bits)
    cases = [(t, False) for t in (1, 8, 64)] + [(t, True) for t in ((256,) if quick
                                                                 else (256, 1024))]
    for tokens, srt in cases:
        idx = np.stack([rng.choice(E, top, replace=False) for _ in range(tokens)])
        if srt:
            flat = idx.reshape(-1)
            order = np.argsort(flat, kind="stable")
            x = mx.array(rng.standard_normal((tokens * top, 1, K)).astype(np.float16))
            ridx = mx.array(flat[order].astype(np.uint32))
            dy = mx.array(rng.standard_normal((tokens * top, 1, N)).astype(np.float16))
        else:
            x = mx.array(rng.standard_normal((tokens, 1, 1, K)).astype(np.float16))
            ridx = mx.array(idx.astype(np.uint32))
            dy = mx.array(rng.standard_normal((tokens, top, 1, N)).astype(np.float16))
        mx.eval(x, ridx, dy, wq, s, b)

        def dx(f):
            return lambda: mx.vjp(f, [x], [dy])[1][0]

        ours = best_ms(dx(lambda x: mixbits.gather_quantized_matmul(
            x, wq, s, b, None, ridx, 64, bits, sorted_indices=srt)), 10)
        mlx = best_ms(dx(lambda x: mx.gather_qmm(x, wq, s, b, None, ridx, transpose=True,
                                                 group_size=64, bits=bits,
                                                 sorted_indices=srt)), 10)
        yield f"gather dx {E}x{N}x{K} b{bits} tok={tokens}{' sorted' if srt else ''}", ours, mlx


def kl_rows(quick):
    for rows, V in ([(256, 151936), (64, 262144)] if not quick else [(64, 151936)]):
        rng = np.random.default_rng(0)
        a = mx.array((3 * rng.standard_normal((rows, V))).astype(np.float16))
        b = mx.array((3 * rng.standard_normal((rows, V))).astype(np.float16))

        def composed():
            la = a.astype(mx.float32) - mx.logsumexp(a.astype(mx.float32), -1, keepdims=True)
            lb = b.astype(mx.float32) - mx.logsumexp(b.astype(mx.float32), -1, keepdims=True)
            return mx.sum(mx.exp(la) * (la - lb), -1)

        ours = best_ms(lambda: mkl.kl_divergence(a, b, check=False), 10)
        yield f"kl {rows}x{V}", ours, best_ms(composed, 10)


def gemv_rows():
    """The GEMV at every M it takes (1 .. 8), 4-bit group 64 float16, K =
    4096, against mx.quantized_matmul: from M = 2 .. 5 on the host widens a
    threadgroup to 256 / 512 rows of W (qmv_shape: lane sets) so that x is
    re-read at most 1/16 of W's bytes, at the price of fewer threadgroups
    (8 at N = 4096, 2 at N = 1024): these rows show what that costs or saves
    on a GPU whose caches catch the re-reads."""
    for N in (1024, 4096, 14336):
        K = 4096
        rng = np.random.default_rng(N)
        w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(mx.float16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        for M in range(1, 9):
            x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.float16)
            mx.eval(x, wq, s, b)
            ours = best_ms(lambda: mixbits.quantized_matmul(x, wq, s, b, 64, 4), 50)
            mlx = best_ms(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True,
                                                      group_size=64, bits=4), 50)
            yield f"gemv {N}x{K} b4 M={M}", ours, mlx


def gather_segment_rows():
    """The gathered matmul over 2- and 3-segment layouts (4-bit group 64 in
    1024 + 1024 and 1024 + 512 + 512 columns: the product MLX's 4-bit
    gather_qmm computes, split as a mixbits layout is), one dispatch walking
    the segment table, against mx.gather_qmm: 128 experts of 768 x 2048,
    top-8; 1 / 8 tokens unsorted and 8 tokens sorted take the gathered GEMV
    (metal/gather_qmv.metal), 512 tokens sorted (about 32 rows per expert)
    the tiled kernel (metal/gather_qmm.metal)."""
    from mixbits.layout import QuantizedTensor, Segment

    E, N, K, top = 128, 768, 2048, 8
    rng = np.random.default_rng(7)
    w = mx.array(rng.standard_normal((E, N, K)).astype(np.float32)).astype(mx.float16)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(wq, s, b)
    routes = []
    for tokens, srt in ((1, False), (8, False), (8, True), (512, True)):
        idx = np.stack([rng.choice(E, top, replace=False) for _ in range(tokens)])
        if srt:
            flat = idx.reshape(-1)
            ridx = mx.array(flat[np.argsort(flat, kind="stable")].astype(np.uint32))
            x = mx.array(rng.standard_normal((tokens * top, 1, K)).astype(np.float16))
        else:
            ridx = mx.array(idx.astype(np.uint32))
            x = mx.array(rng.standard_normal((tokens, 1, 1, K)).astype(np.float16))
        mx.eval(x, ridx)
        routes.append((tokens, srt, x, ridx))
    for layout in ([(4, 64, 1024), (4, 64, 1024)], [(4, 64, 1024), (4, 64, 512), (4, 64, 512)]):
        qt = mixbits.quantize(w.reshape(E * N, K), layout, dtype=mx.float16)
        qt = QuantizedTensor([Segment(g.bits, g.group_size, g.k,
                                      *(a.reshape(E, N, -1) for a in (g.wq, g.scales, g.biases)))
                              for g in qt.segments], qt.perm)
        mx.eval(*qt.arrays())
        for tokens, srt, x, ridx in routes:
            ours = best_ms(lambda: mixbits.gather_qmatmul(x, qt, None, ridx, sorted_indices=srt),
                           20)
            mlx = best_ms(lambda: mx.gather_qmm(x, wq, s, b, None, ridx, transpose=True,
                                                group_size=64, bits=4, sorted_indices=srt), 20)
            rows = tokens * top  # metal/gather_host.h's gather_tiled, at M = 1
            kind = "tiled" if srt and rows >= 64 and rows >= 8 * min(E, rows) else "gemv"
            yield (f"gather {len(layout)} segs {E}x{N}x{K} b4 tok={tokens}"
                   f"{' sorted' if srt else ''} ({kind})", ours, mlx)


def traffic_rows(ops=()):
    """(case, mixbits ms, mlx ms) for every counted case of metal_traffic.py
    (or those of the ops named); the qmatmul cases at 4096 x 4096 whatever
    M (the emulator counts smaller matrices at M = 17, 512; counts scale
    with N K)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import metal_traffic as T  # numpy-only at import: no emulator build

    dt = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    cases = (T.qmatmul_cases(True) + T.gather_cases(True) + T.qmatmul_t_cases(True)
             + T.gather_t_cases(True) + T.kl_cases(True))
    for c in cases:
        if ops and c["op"] not in ops:
            continue
        rng = np.random.default_rng(0)
        c = dict(c)
        if c["op"] == "qmatmul_t":
            # dx = dy · W alone (the forward output never evaluated): the
            # layout's one transposed dispatch against MLX's vjp of
            # mx.quantized_matmul on the one-segment weights of equal bits.
            N, K, M = c["N"], c["K"], c["M"]
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(
                dt[c["scale_dtype"]])
            x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(
                dt[c["x_dtype"]])
            dy = mx.array(rng.standard_normal((M, N)).astype(np.float32)).astype(
                dt[c["x_dtype"]])
            qt = mixbits.quantize(w, [tuple(s) for s in c["segments"]],
                                  perm=rng.permutation(K) if c["perm"] else None,
                                  dtype=dt[c["scale_dtype"]])
            b, g = c["segments"][0][:2]
            wq, s, bi = mx.quantize(w, group_size=g, bits=b)
            mx.eval(x, dy, wq, s, bi, *qt.arrays())
            ours = best_ms(lambda: mx.vjp(lambda x: mixbits.qmatmul(x, qt), [x], [dy])[1][0], 20)
            mlx = best_ms(lambda: mx.vjp(lambda x: mx.quantized_matmul(
                x, wq, s, bi, transpose=True, group_size=g, bits=b), [x], [dy])[1][0], 20)
        elif c["op"] == "gather_t":
            # The gathered dx for one decode token (top-8 of 128 experts) over
            # the layout's segments against MLX's vjp of mx.gather_qmm.
            from mixbits.layout import QuantizedTensor, Segment

            nexp, top, N, K = c["experts"], c["top_k"], c["N"], c["K"]
            b, g, _ = c["segments"][0]
            w = mx.array(rng.standard_normal((nexp, N, K)).astype(np.float32)).astype(
                dt[c["scale_dtype"]])
            wq, s, bi = mx.quantize(w, group_size=g, bits=b)
            qt = mixbits.quantize(w.reshape(nexp * N, K), [tuple(s) for s in c["segments"]],
                                  perm=rng.permutation(K) if c["perm"] else None,
                                  dtype=dt[c["scale_dtype"]])
            qt = QuantizedTensor([Segment(sg.bits, sg.group_size, sg.k,
                                          *(a.reshape(nexp, N, -1)
                                            for a in (sg.wq, sg.scales, sg.biases)))
                                  for sg in qt.segments], qt.perm)
            idx = rng.choice(nexp, top, replace=False)
            ridx = mx.array(idx.reshape(1, top).astype(np.uint32))
            x = mx.array(rng.standard_normal((1, 1, 1, K)).astype(np.float16))
            dy = mx.array(rng.standard_normal((1, top, 1, N)).astype(np.float16))
            mx.eval(x, dy, ridx, wq, s, bi, *qt.arrays())
            ours = best_ms(lambda: mx.vjp(lambda x: mixbits.gather_qmatmul(
                x, qt, None, ridx), [x], [dy])[1][0], 20)
            mlx = best_ms(lambda: mx.vjp(lambda x: mx.gather_qmm(
                x, wq, s, bi, None, ridx, transpose=True, group_size=g, bits=b),
                [x], [dy])[1][0], 20)
            c["_experts_used"] = top
        elif c["op"] == "qmatmul":
            N = K = 4096
            scale = K / c["K"]
            c["segments"] = [[b, g, int(k * scale)] for b, g, k in c["segments"]]
            c["N"], c["K"] = N, K
            w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(
                dt[c["scale_dtype"]])
            x = mx.array(rng.standard_normal((c["M"], K)).astype(np.float32)).astype(
                dt[c["x_dtype"]])
            qt = mixbits.quantize(w, [tuple(s) for s in c["segments"]],
                                  perm=rng.permutation(K) if c["perm"] else None,
                                  dtype=dt[c["scale_dtype"]])
            b, g = c["segments"][0][:2]  # every layout is one width: MLX's equal
            wq, s, bi = mx.quantize(w, group_size=g, bits=b)
            mx.eval(x, wq, s, bi, *qt.arrays())
            ours = best_ms(lambda: mixbits.qmatmul(x, qt), 20)
            mlx = best_ms(lambda: mx.quantized_matmul(x, wq, s, bi, transpose=True,
                                                      group_size=g, bits=b), 20)
        elif c["op"] == "gather":
            nexp, top, Tn = c["experts"], c["top_k"], c["tokens"]
            N, K = c["N"], c["K"]
            b, g, _ = c["segments"][0]
            w = mx.array(rng.standard_normal((nexp, N, K)).astype(np.float32)).astype(
                dt[c["scale_dtype"]])
            wq, s, bi = mx.quantize(w, group_size=g, bits=b)
            qt = None
            if len(c["segments"]) > 1:  # every layout is one width: MLX's equal
                from mixbits.layout import QuantizedTensor, Segment

                qt = mixbits.quantize(w.reshape(nexp * N, K), [tuple(t) for t in c["segments"]],
                                      dtype=dt[c["scale_dtype"]])
                qt = QuantizedTensor([Segment(sg.bits, sg.group_size, sg.k,
                                              *(a.reshape(nexp, N, -1)
                                                for a in (sg.wq, sg.scales, sg.biases)))
                                      for sg in qt.segments], qt.perm)
                mx.eval(*qt.arrays())
            idx = np.stack([rng.choice(nexp, top, replace=False) for _ in range(Tn)])
            if c["sorted"]:
                flat = idx.reshape(-1)
                ridx = mx.array(flat[np.argsort(flat, kind="stable")].astype(np.uint32))
                x = mx.array(rng.standard_normal((Tn * top, 1, K)).astype(np.float16))
            else:
                ridx = mx.array(idx.astype(np.uint32))
                x = mx.array(rng.standard_normal((Tn, 1, 1, K)).astype(np.float16))
            mx.eval(x, ridx, wq, s, bi)
            srt = c["sorted"]
            if qt is None:
                ours = best_ms(lambda: mixbits.gather_quantized_matmul(
                    x, wq, s, bi, None, ridx, g, b, sorted_indices=srt), 20)
            else:
                ours = best_ms(lambda: mixbits.gather_qmatmul(x, qt, None, ridx,
                                                              sorted_indices=srt), 20)
            mlx = best_ms(lambda: mx.gather_qmm(x, wq, s, bi, None, ridx, transpose=True,
                                                group_size=g, bits=b, sorted_indices=srt), 20)
            c["_experts_used"] = len(np.unique(idx))
        else:
            rows, V = c["M"], c["N"]
            a = mx.array((3 * rng.standard_normal((rows, V))).astype(np.float16))
            bb = mx.array((3 * rng.standard_normal((rows, V))).astype(np.float16))

            def composed():
                la = a.astype(mx.float32) - mx.logsumexp(a.astype(mx.float32), -1,
                                                         keepdims=True)
                lb = bb.astype(mx.float32) - mx.logsumexp(bb.astype(mx.float32), -1,
                                                          keepdims=True)
                return mx.sum(mx.exp(la) * (la - lb), -1)

            ours = best_ms(lambda: mkl.kl_divergence(a, bb, check=False), 10)
            mlx = best_ms(composed, 10)
        minimum = T.analytic_min(c)
        if c["op"] == "kl":
            name = f"kl rows={c['M']} V={c['N']}"
        else:
            name = (f"{c['op']} M={c['M']} {c['N']}x{c['K']} segs={len(c['segments'])}"
                    f"{' perm' if c['perm'] else ''}"
                    + (f" tok={c['tokens']}{' sorted' if c['sorted'] else ''}"
                       if c["op"] in ("gather", "gather_t") else ""))
        rec = {k: v for k, v in c.items() if not k.startswith("_")}
        rec.update({"mixbits_ms": ours, "mlx_ms": mlx, "analytic_min": minimum,
                    "mixbits_gbps_on_min": minimum / ours / 1e6,
                    "mlx_gbps_on_min": minimum / mlx / 1e6})
        yield name, ours, mlx, rec


def traffic_main(out, ops=()):
    mx.set_default_device(mx.gpu)
    print(f"{'case':52} {'mixbits ms':>11} {'mlx ms':>9} {'mlx/mixbits':>12} "
          f"{'GB/s(min)':>10}")
    records = []
    for name, ours, mlx, rec in traffic_rows(ops):
        records.append(rec)
        print(f"{name:52} {ours:11.3f} {mlx:9.3f} {mlx / ours:12.2f} "
              f"{rec['mixbits_gbps_on_min']:10.1f}", flush=True)
    if out:
        doc = {"host": {"machine": platform.machine(), "platform": platform.platform(),
                        "processor": platform.processor(), "mlx": mx.__version__},
               "records": records}
        tmp = Path(out + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
    return 0


def main():
    if not mx.metal.is_available():
        print("no Metal GPU")
        return 2
    if "--traffic" in sys.argv or "--grad-segments" in sys.argv:
        # --grad-segments: only the transposed products' counted cases (1, 2
        # and 3 segments and 2 with a perm, dense and gathered).
        i = sys.argv.index("--out") if "--out" in sys.argv else -1
        ops = ("qmatmul_t", "gather_t") if "--grad-segments" in sys.argv else ()
        return traffic_main(sys.argv[i + 1] if i >= 0 else None, ops)
    quick = "--quick" in sys.argv
    mx.set_default_device(mx.gpu)
    if "--gemv" in sys.argv or "--gather-segments" in sys.argv:
        rows = gemv_rows if "--gemv" in sys.argv else gather_segment_rows
        print(f"{'case':38} {'mixbits ms':>11} {'mlx ms':>9} {'mlx/mixbits':>12}")
        for name, ours, mlx in rows():
            print(f"{name:38} {ours:11.3f} {mlx:9.3f} {mlx / ours:12.2f}", flush=True)
        return 0
    print(f"{'case':38} {'mixbits ms':>11} {'mlx ms':>9} {'mlx/mixbits':>12}")
    rows = (list(qmm_rows(quick)) + list(gather_rows(quick)) + list(grad_x_rows(quick)) +
            list(gather_grad_x_rows(quick)) + list(kl_rows(quick)))
    for name, ours, mlx in rows:
        print(f"{name:38} {ours:11.3f} {mlx:9.3f} {mlx / ours:12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
