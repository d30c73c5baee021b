#!/usr/bin/env bash
# For a Mac owner: everything about mixbits' Metal path that Linux cannot
# check, in one run. Builds the wheel from this checkout in a fresh
# virtualenv, checks that the metallib is inside and loads, runs the whole
# test suite (MLX's default device on a Mac is the GPU, so the ops run
# their eval_gpu), the GPU-only tests (tests/metal/test_gpu_device.py:
# GPU vs CPU primitive and mx.quantized_matmul / mx.gather_qmm, the gathered
# kernel really in the graph, the gradient wrt x through the transposed
# kernel (MixedQMatmulT) against the CPU's, the gathered gradient wrt x
# through the gathered transposed kernel (MixedGatherQMMT) against the
# CPU's, KL in every mode, bad input refused before dispatch), the fp-mode
# GEMV (mxfp4 / nvfp4 / mxfp8) against mx.quantized_matmul, and the Metal
# benchmarks against mx.quantized_matmul and mx.gather_qmm (forward and
# dx), and every case the emulator's traffic counters count
# (tests/metal/metal_traffic.py) timed the same way, then prints one summary. Nothing is installed
# outside the temporary directory. Needs: macOS 14+ on Apple silicon,
# python3 (3.10+), Xcode command line tools with the Metal toolchain.
#
#   tests/metal/check_on_mac.sh            # full
#   QUICK=1 tests/metal/check_on_mac.sh    # smaller benchmark
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
WORK=$(mktemp -d -t mixbits-mac-check)
LOG="$WORK/log"
mkdir -p "$LOG"
declare -a RESULTS=()
step() {  # step NAME COMMAND...: run, log, remember PASS/FAIL
  local name=$1; shift
  echo "== $name"
  if "$@" >"$LOG/$name.txt" 2>&1; then RESULTS+=("PASS  $name")
  else RESULTS+=("FAIL  $name   (log: $LOG/$name.txt)"); tail -20 "$LOG/$name.txt"; fi
}

step platform bash -c '[ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ] && xcrun -sdk macosx metal --version'
step venv python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
step build-wheel "$PY" -m pip wheel "$ROOT" --no-deps -w "$WORK/dist"
step wheel-has-metallib bash -c "unzip -l '$WORK'/dist/mixbits-*.whl | grep -q 'mixbits/mixbits.metallib'"
# The wheel's tag names the macOS the metallib is built for (pyproject.toml's
# CMAKE_OSX_DEPLOYMENT_TARGET), whatever macOS builds it.
step wheel-tag-is-metallib-target bash -c "ls '$WORK'/dist/mixbits-*-macosx_14_0_arm64.whl"
# Apple's compiler defines __FAST_MATH__ under -ffast-math as g++ does (the
# Linux test of the guard relies on it): a fast-math build must stop.
step fast-math-refused bash -c "! xcrun -sdk macosx metal -std=metal3.1 -ffast-math -I '$ROOT/metal' -c '$ROOT/metal/kl.metal' -o '$WORK/fast_math.air' > '$WORK/fast_math.txt' 2>&1 && grep -q 'without fast math' '$WORK/fast_math.txt'"
step install bash -c "'$PY' -m pip install '$WORK'/dist/mixbits-*.whl && '$PY' -m pip install 'pytest>=8' 'pytest-benchmark>=4' 'scipy>=1.10' 'mlx-lm==0.32.2' 'gguf>=0.10'"
# The installed wheel, not the checkout's python/ tree, must be imported.
step import-on-gpu "$PY" -c "
import mlx.core as mx, mixbits, pathlib
assert mx.metal.is_available(), 'no Metal device'
assert 'site-packages' in mixbits.__file__, mixbits.__file__
assert (pathlib.Path(mixbits.__file__).parent / 'mixbits.metallib').exists()
w = mx.random.normal((64, 256)); wq, s, b = mx.quantize(w, 64, 4)
x = mx.random.normal((3, 256))
with mx.stream(mx.gpu):
    y = mixbits.quantized_matmul(x, wq, s, b, 64, 4); mx.eval(y)
ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=64, bits=4, stream=mx.cpu)
assert mx.allclose(y, ref, rtol=1e-4, atol=1e-4).item()
print('eval_gpu linked, metallib loaded, result matches mx.quantized_matmul')"
# The gathered matmul on the GPU runs mixbits' Metal kernel (its node is
# MixedGatherQMM, not MLX's GatherMM) and agrees with mx.gather_qmm,
# an out-of-range expert index giving a NaN matrix.
step gather-on-gpu "$PY" -c "
import mlx.core as mx, mixbits, numpy as np, re, tempfile, os
rng = np.random.default_rng(0)
w = mx.array(rng.standard_normal((8, 96, 256)).astype(np.float32)).astype(mx.float16)
wq, s, b = mx.quantize(w, 64, 3)
x = mx.array(rng.standard_normal((5, 1, 1, 256)).astype(np.float16))
idx = mx.array(rng.integers(0, 8, (5, 2)).astype(np.uint32))
with mx.stream(mx.gpu):
    y = mixbits.gather_quantized_matmul(x, wq, s, b, None, idx, 64, 3)
dot = os.path.join(tempfile.mkdtemp(), 'g.dot'); mx.export_to_dot(dot, y)
ops = set(re.findall(r'label =\"(\\w+)\"', open(dot).read()))
assert 'MixedGatherQMM' in ops and 'GatherMM' not in ops, ops
ref = mx.gather_qmm(x, wq, s, b, None, idx, transpose=True, group_size=64, bits=3, stream=mx.cpu)
y, ref = np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32))
assert np.abs(y - ref).max() <= 2e-2 * np.abs(ref).max(), np.abs(y - ref).max()
bad = mx.array(np.array([[0, 8]], np.uint32))
with mx.stream(mx.gpu):
    z = np.array(mixbits.gather_quantized_matmul(x[:1], wq, s, b, None, bad, 64, 3))
assert np.isfinite(z[0, 0]).all() and np.isnan(z[0, 1]).all()
# Sorted prefill (200 rows, the tiled kernel), against mx.gather_qmm.
ids = np.sort(rng.integers(0, 8, 200)).astype(np.uint32)
xs = mx.array(rng.standard_normal((200, 1, 256)).astype(np.float16))
with mx.stream(mx.gpu):
    ys = mixbits.gather_quantized_matmul(xs, wq, s, b, None, mx.array(ids), 64, 3, sorted_indices=True)
refs = mx.gather_qmm(xs, wq, s, b, None, mx.array(ids), transpose=True, group_size=64, bits=3,
                     sorted_indices=True, stream=mx.cpu)
ys, refs = np.array(ys.astype(mx.float32)), np.array(refs.astype(mx.float32))
assert np.abs(ys - refs).max() <= 2e-2 * np.abs(refs).max(), np.abs(ys - refs).max()
print('gather_qmm on the GPU: Metal kernels in the graph, GEMV and sorted tiled match mx.gather_qmm, bad index -> NaN')"
# The gradient wrt x on the GPU: for few rows it runs mixbits' transposed
# Metal kernel (MixedQMatmulT in the graph; dequantize + matmul above 8
# rows) and agrees with the CPU gradient, a permutation undone.
step grad-on-gpu "$PY" -c "
import mlx.core as mx, mixbits, numpy as np, re, tempfile, os
rng = np.random.default_rng(1)
w = mx.array(rng.standard_normal((96, 384)).astype(np.float32))
qt = mixbits.quantize(w, [(4, 64, 256), (3, 32, 128)], perm=rng.permutation(384))
x = mx.array(rng.standard_normal((2, 384)).astype(np.float32))
gy = mx.array(rng.standard_normal((2, 96)).astype(np.float32))
dx = lambda x: mx.vjp(lambda x: mixbits.qmatmul(x, qt), [x], [gy])[1][0]
with mx.stream(mx.gpu):
    g = dx(x)
    dot = os.path.join(tempfile.mkdtemp(), 't.dot'); mx.export_to_dot(dot, g)
ops = set(re.findall(r'label =\"(\w+)\"', open(dot).read()))
assert 'MixedQMatmulT' in ops, ops
with mx.stream(mx.cpu):
    c = dx(x)
g, c = np.array(g), np.array(c)
assert np.abs(g - c).max() <= 1e-4 * np.abs(c).max(), np.abs(g - c).max()
print('dx on the GPU: MixedQMatmulT in the graph, matches the CPU gradient')"
# The gathered gradient wrt x on the GPU: MoE-shaped (top-2 of 8 experts,
# one row per token, so several experts write each token's dx) it runs
# mixbits' gathered transposed kernels (MixedGatherQMMT in the graph) and
# agrees with the CPU gradient, a permutation undone; a bad index -> NaN.
step gather-grad-on-gpu "$PY" -c "
import mlx.core as mx, mixbits, numpy as np, re, tempfile, os
from mixbits.layout import QuantizedTensor, Segment
rng = np.random.default_rng(2)
E, n, K = 8, 96, 384
qt = mixbits.quantize(mx.array(rng.standard_normal((E * n, K)).astype(np.float32)),
                      [(4, 64, 256), (3, 32, 128)], perm=rng.permutation(K))
qt = QuantizedTensor([Segment(s.bits, s.group_size, s.k, *(a.reshape(E, n, -1) for a in
                      (s.wq, s.scales, s.biases))) for s in qt.segments], qt.perm)
x = mx.array(rng.standard_normal((5, 1, 1, K)).astype(np.float32))
idx = mx.array(rng.integers(0, E, (5, 2)).astype(np.uint32))
gy = mx.array(rng.standard_normal((5, 2, 1, n)).astype(np.float32))
dx = lambda x, idx: mx.vjp(lambda x: mixbits.gather_qmatmul(x, qt, None, idx), [x], [gy])[1][0]
with mx.stream(mx.gpu):
    g = dx(x, idx)
    dot = os.path.join(tempfile.mkdtemp(), 'gt.dot'); mx.export_to_dot(dot, g)
ops = set(re.findall(r'label =\"(\w+)\"', open(dot).read()))
assert 'MixedGatherQMMT' in ops, ops
with mx.stream(mx.cpu):
    c = dx(x, idx)
g, c = np.array(g), np.array(c)
assert np.abs(g - c).max() <= 1e-4 * np.abs(c).max(), np.abs(g - c).max()
with mx.stream(mx.gpu):
    z = np.array(dx(x, mx.array(np.full((5, 2), 8, np.uint32))))
assert np.isnan(z).all()
print('gathered dx on the GPU: MixedGatherQMMT in the graph, matches the CPU gradient, bad index -> NaN')"
# MLX's fp modes on the GPU: up to 8 rows of x run mixbits' Metal GEMV
# (metal/fp_qmv.metal, FpQMatmul in the graph; Apple's compiler builds it
# here, the emulator checks its logic on Linux), more rows MLX's op; every
# mode x dtype against mx.quantized_matmul on the GPU and float64 of
# mx.dequantize; then M=1 timings next to mx.quantized_matmul's.
step fp-modes-on-gpu "$PY" -c "
import mlx.core as mx, mixbits, numpy as np, re, tempfile, os, time
rng = np.random.default_rng(3)
RTOL = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 8e-2}
def ops_of(y):
    dot = os.path.join(tempfile.mkdtemp(), 'f.dot'); mx.export_to_dot(dot, y)
    return set(re.findall(r'label =\"(\w+)\"', open(dot).read()))
for mode in ('mxfp4', 'nvfp4', 'mxfp8'):
    w = mx.array(rng.standard_normal((203, 1056)).astype(np.float32))
    wq, s = mx.quantize(w, mode=mode)
    W = np.array(mx.dequantize(wq, s, mode=mode, dtype=mx.float32), np.float64)
    for dt in (mx.float32, mx.float16, mx.bfloat16):
        for M in (1, 5, 8, 9):
            x = mx.array(rng.standard_normal((M, 1056)).astype(np.float32)).astype(dt)
            with mx.stream(mx.gpu):
                y = mixbits.quantized_matmul(x, wq, s, mode=mode)
                ref = mx.quantized_matmul(x, wq, s, mode=mode)
            want = ('FpQMatmul' if M <= 8 else 'QuantizedMatmul')
            assert want in ops_of(y), (mode, dt, M, ops_of(y))
            y, ref = np.array(y.astype(mx.float32), np.float64), np.array(ref.astype(mx.float32), np.float64)
            exact = np.array(x.astype(mx.float32), np.float64) @ W.T
            for other in (ref, exact):
                err = np.abs(y - other).max() / np.abs(other).max()
                assert err <= RTOL[dt], (mode, dt, M, err)
    print(mode, 'GPU GEMV (M<=8) and MLX route (M=9) match mx.quantized_matmul and float64 of mx.dequantize')
def best(f, n=50):
    mx.eval(f()); t = []
    for _ in range(n):
        t0 = time.perf_counter(); mx.eval(f()); t.append(time.perf_counter() - t0)
    return min(t)
for mode in ('mxfp4', 'nvfp4', 'mxfp8'):
    wq, s = mx.quantize(mx.random.normal((4096, 4096)), mode=mode)
    x = mx.random.normal((1, 4096)).astype(mx.float16)
    with mx.stream(mx.gpu):
        a = best(lambda: mixbits.quantized_matmul(x, wq, s, mode=mode))
        b = best(lambda: mx.quantized_matmul(x, wq, s, mode=mode))
    print(f'{mode} 4096x4096 M=1 float16: mixbits {a*1e3:.3f} ms, mlx {b*1e3:.3f} ms, mlx/mixbits {b/a:.2f}')
"
# From the checkout: its python/ tree is not on sys.path, so the tests
# import the installed wheel (checked by import-on-gpu above).
# The dense qmatmul's one-dispatch kernels (29 buffer slots, a segment table
# of up to 8 segments, qmv / qmm / qmm16) compiled by Apple's compiler and
# run on the GPU against the CPU: 4 and 8 segments in one dispatch, 11 in
# two, with a permutation, GEMV and both tiled block shapes (M = 2, 12, 17);
# the tiled gathered kernel's (31 slots, gather_qmm) the same way: 3 and 8
# segments in one dispatch, 11 in two, sorted prefill over 6 experts.
step fused-qmatmul-gpu "$PY" -m pytest tests/metal/test_gpu_device.py -q -p no:cacheprovider \
  -k "many_segments or mixed_segments"
# The GEMV's wide threadgroups (16 / 32 simdgroups at N = 2000 / 4100),
# the gathered GEMV walking runs of sorted experts, and the tiled kernel's
# double-buffered tiles with 2-byte x tiles (thread_elements fragment loads,
# float16 / bfloat16 x at M = 9, 33, 200), on the GPU.
step gemv-wide-gather-runs-tiles-gpu "$PY" -m pytest tests/metal/test_gpu_device.py -q \
  -p no:cacheprovider -k "wide_threadgroups or sorted_gemv_runs or quantized_matmul_gpu_matches_mlx"
step gpu-tests "$PY" -m pytest tests/metal/test_gpu_device.py -q -rs -p no:cacheprovider
step no-gpu-test-skipped bash -c "! grep -q 'SKIPPED' '$LOG/gpu-tests.txt'"
step full-suite "$PY" -m pytest tests -q -rs -p no:cacheprovider
step metal-bench "$PY" tests/metal/bench_gpu.py ${QUICK:+--quick}
# The GEMV at M = 1 .. 8 (lane sets: fewer, wider threadgroups from M = 2 .. 5,
# metal/qmatmul_host.h qmv_shape) against mx.quantized_matmul, N = 1024,
# 4096, 14336.
step gemv-lane-sets-bench "$PY" tests/metal/bench_gpu.py --gemv
# The gathered matmul over 2- and 3-segment layouts, one dispatch walking
# the segment table, against mx.gather_qmm: the GEMV (metal/gather_qmv.metal)
# at 1 / 8 tokens and the tiled kernel (metal/gather_qmm.metal) at 512
# sorted tokens, top-8 of 128 experts of 768 x 2048.
step gather-segments-bench "$PY" tests/metal/bench_gpu.py --gather-segments
# The gradient wrt x over 1, 2 and 3 segments and 2 with a perm, dense
# (4096 x 4096, M = 1 and 8) and gathered (one decode token, top-8 of 128
# experts of 768 x 2048): one transposed dispatch whatever the segment
# count (metal/qmatmul_t.metal, metal/gather_qmv_t.metal) against MLX's vjp
# of mx.quantized_matmul / mx.gather_qmm on equal-bit weights.
step grad-segments-bench "$PY" tests/metal/bench_gpu.py --grad-segments
# Every case the emulator counts (tests/metal/metal_traffic.py), timed on
# the GPU against MLX's own kernels: the real table next to the counts in
# bench/results/metal_traffic.json.
step metal-traffic-bench "$PY" tests/metal/bench_gpu.py --traffic --out "$LOG/metal_traffic_mac.json"

echo
echo "==================== mixbits Metal check: summary ===================="
sw_vers 2>/dev/null | tr '\n' ' '; echo
sysctl -n machdep.cpu.brand_string 2>/dev/null
for r in "${RESULTS[@]}"; do echo "$r"; done
grep -E "passed|failed" "$LOG/full-suite.txt" 2>/dev/null | tail -1 | sed 's/^/full suite: /'
grep -E "passed|failed" "$LOG/gpu-tests.txt" 2>/dev/null | tail -1 | sed 's/^/GPU tests:  /'
echo "benchmarks (mlx/mixbits > 1: mixbits faster):"
cat "$LOG/metal-bench.txt" 2>/dev/null
cat "$LOG/gemv-lane-sets-bench.txt" 2>/dev/null
cat "$LOG/gather-segments-bench.txt" 2>/dev/null
cat "$LOG/grad-segments-bench.txt" 2>/dev/null
echo "counted cases (tests/metal/metal_traffic.py) timed; JSON: $LOG/metal_traffic_mac.json"
cat "$LOG/metal-traffic-bench.txt" 2>/dev/null
echo "logs: $LOG"
! printf '%s\n' "${RESULTS[@]}" | grep -q '^FAIL'
