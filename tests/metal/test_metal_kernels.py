"""The Metal kernels (metal/*.metal), run unchanged on the SIMT emulator,
against independent references: float64 numpy of mx.dequantize for the
quantized matmul, float64 numpy for the KL divergence.

This checks kernel logic, indexing, the bit layout and the host launch plan
(metal/*_host.h); it does not check Metal compilation or speed."""

import itertools

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
ACTS = ("float32", "float16", "bfloat16")
MX_DTYPE = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
OUT_EPS = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# Rows of x: GEMV up to 8, the tiled kernel from 9 (every M runs both).
MS = (1, 3, 8, 9, 33, 100)


@pytest.fixture(scope="module", autouse=True)
def emulator():
    if E.compiler() is None:
        pytest.skip("no C++ compiler to build the Metal emulator")
    E.lib()


# mx dtype -> the emulator's activation name (the inverse of MX_DTYPE).
ACT_OF = {v: k for k, v in MX_DTYPE.items()}


def rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# ---------------------------------------------------------------- helpers

def to_storage(a: mx.array) -> np.ndarray:
    """An MLX array as the raw storage a kernel reads (bfloat16 as bits)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def make_segments(rng, N, specs, scale_act, as_stored=False):
    """Quantize random weights per segment with mx.quantize; return kernel
    inputs and the float64 dense reference (via mx.dequantize: with the
    scales as float32, or with as_stored, in the scales' own dtype, as
    mx.dequantize rounds it there)."""
    segs, dense = [], []
    for bits, gs, k in specs:
        w = mx.array(rng.standard_normal((N, k)).astype(np.float32)).astype(MX_DTYPE[scale_act])
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        segs.append((bits, gs, k, np.array(wq), to_storage(s), to_storage(b)))
        if as_stored:
            deq = mx.dequantize(wq, s, b, group_size=gs, bits=bits).astype(mx.float32)
        else:
            deq = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=gs,
                                bits=bits)
        dense.append(np.array(deq, dtype=np.float64))
    return segs, np.concatenate(dense, axis=1)


def make_x(rng, M, K, act):
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(MX_DTYPE[act])
    return to_storage(x)


def assert_close(got_storage, act, ref, mag, acc_rtol=2e-5):
    got = E.storage_to_f64(got_storage, act)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "some outputs never written (NaN sentinel) or not finite"
    tol = acc_rtol * mag + 2 * OUT_EPS[act] * np.abs(ref) + 1e-30
    bad = np.abs(got - ref) > tol
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()}/{bad.size} off; first {i}: got {got[i]}, "
                             f"want {ref[i]}, tol {tol[i]}")


# Against MLX's own op in the same dtype: MLX rounds its dequantized W (and
# its products) to the activation dtype, so agreement is to that dtype's
# precision, relative to the largest output.
MLX_RTOL = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 8e-2}


def assert_near_mlx(got, want, act):
    """got, want: float64 arrays; |got - want| <= MLX_RTOL[act] * max|want|."""
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= MLX_RTOL[act] * max(np.abs(want).max(), 1e-6)


def run_case(rng, M, N, specs, act, scale_act=None, perm=True, paths=("gemv", "tiled"),
             order="shuffle"):
    scale_act = scale_act or act
    state = rng.bit_generator.state
    segs, W = make_segments(rng, N, specs, scale_act)
    W16 = None
    if act == scale_act == "float16":  # the tiled kernel's float16 W tile
        after = rng.bit_generator.state
        rng.bit_generator.state = state
        _, W16 = make_segments(rng, N, specs, scale_act, as_stored=True)
        assert rng.bit_generator.state == after
    K = W.shape[1]
    x = make_x(rng, M, K, act)
    p = rng.permutation(K).astype(np.int32) if perm else None
    xf = E.storage_to_f64(x, act)
    if p is not None:
        xf = xf[:, p]
    for path in paths:
        # The tiled kernel multiplies W as mx.dequantize gives it in float16
        # when x and the scales are float16 (as MLX's own kernel does); the
        # GEMV and every other dtype pair, W in float.
        tiled = path == "tiled" or (path == "auto" and M > 8)
        Wp = W16 if tiled and W16 is not None else W
        ref, mag = xf @ Wp.T, np.abs(xf) @ np.abs(Wp).T
        y = E.qmatmul(x, act, segs, N, perm=p, scale_type=scale_act, path=path, order=order,
                      seed=int(rng.integers(1 << 30)))
        assert y.dtype == E.storage_dtype(act)
        assert_close(y, act, ref, mag)


# ---------------------------------------------------------------- qmatmul

@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
@pytest.mark.parametrize("act", ACTS)
def test_qmatmul_every_width_group_and_dtype(bits, gs, act):
    rng = np.random.default_rng(bits * 1000 + gs + 7 * ACTS.index(act))
    # N not a multiple of the 8 rows of a GEMV threadgroup nor of the 32 of
    # a tile; K spans a partial 512-column GEMV block and several BK steps
    # of the tiled kernel; M = 100 is four row tiles, the last one partial.
    N = int(rng.choice([5, 13, 37]))
    k = gs * int(rng.integers(1, 5))
    for M in MS:
        run_case(rng, M, N, [(bits, gs, k)], act, perm=bool(M % 2))


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("act", ACTS)
def test_qmatmul_mixed_segments_with_perm(M, act):
    rng = np.random.default_rng(100 + M)
    specs = [(8, 128, 128), (6, 64, 64), (5, 32, 96), (4, 64, 640), (3, 32, 32), (2, 128, 128)]
    run_case(rng, M, 67, specs, act, perm=True)


@pytest.mark.parametrize("act,scale_act", [(a, s) for a in ACTS for s in ACTS if a != s])
def test_qmatmul_scale_dtype_differs_from_x(act, scale_act):
    # Each (x dtype, scale dtype) pair is its own kernel instantiation.
    rng = np.random.default_rng(5)
    run_case(rng, 3, 21, [(5, 64, 128), (3, 32, 96)], act, scale_act=scale_act)
    run_case(rng, 33, 21, [(5, 64, 128), (3, 32, 96)], act, scale_act=scale_act)


@pytest.mark.parametrize("N", [1, 4, 7, 9, 31, 33])
def test_qmatmul_small_and_ragged_n(N):
    rng = np.random.default_rng(N)
    run_case(rng, 2, N, [(4, 32, 64), (6, 128, 128)], "float32")
    run_case(rng, 40, N, [(4, 32, 64), (6, 128, 128)], "float32", paths=("tiled",))


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_qmatmul_thread_orders(order):
    # The tiled kernel shares tiles through threadgroup memory: a missing
    # barrier would show in at least one of these orders.
    rng = np.random.default_rng(11)
    run_case(rng, 33, 40, [(3, 32, 96), (5, 64, 64)], "float16", order=order)


@pytest.mark.parametrize("path", ["gemv", "tiled"])
def test_qmatmul_bad_perm_entry_poisons_output_without_reading_out_of_bounds(path):
    rng = np.random.default_rng(12)
    segs, W = make_segments(rng, 10, [(4, 32, 64)], "float32")
    x = make_x(rng, 3, 64, "float32")
    for bad in (64, -1, 1 << 30):
        p = rng.permutation(64).astype(np.int32)
        p[17] = bad
        y = E.qmatmul(x, "float32", segs, 10, perm=p, path=path)
        assert np.isnan(y).all()


@pytest.mark.parametrize("M", [2, 9])
def test_qmatmul_eight_segments_of_every_width_in_one_dispatch(M):
    # The most segments one dispatch takes (MB_QMM_MAX_SEGS): every width and
    # group size in one segment table, shuffled so that neighbours differ.
    rng = np.random.default_rng(20 + M)
    specs = [(5, 32, 64), (8, 128, 128), (2, 64, 128), (6, 32, 96), (3, 128, 128),
             (4, 64, 64), (2, 32, 32), (8, 32, 544)]
    run_case(rng, M, 13, specs, "bfloat16")


@pytest.mark.parametrize("M", [3, 17])
def test_qmatmul_more_segments_than_one_dispatch_takes(M):
    # 11 segments: two dispatches (8 + 3) passing the float32 partial sum.
    rng = np.random.default_rng(30 + M)
    specs = [(b, gs, gs) for b, gs in itertools.islice(
        itertools.cycle(itertools.product(BITS, GROUP_SIZES)), 11)]
    run_case(rng, M, 10, specs, "float16")


@pytest.mark.parametrize("M", [16, 17, 31])
def test_qmatmul_tiled_block_rows_boundary(M):
    # Up to 16 rows the tiled kernel takes 16 x 64 blocks, from 17 32 x 32
    # ones; N = 70 leaves a partial block of either width.
    rng = np.random.default_rng(40 + M)
    run_case(rng, M, 70, [(3, 32, 96), (6, 64, 64)], "float16", paths=("tiled",))


@pytest.mark.parametrize("N", [2000, 4100])
@pytest.mark.parametrize("M", [3, 8])
def test_qmatmul_gemv_wide_threadgroups(M, N):
    # From N = 1985 the host gives the GEMV 16 simdgroups
    # (64 rows of W per threadgroup), from N = 3969 32 (128 rows,
    # qmv_simdgroups); both Ns leave a last threadgroup whose later
    # simdgroups have no rows (they stage x, meet the barriers, store
    # nothing).
    rng = np.random.default_rng(50 + M + N)
    run_case(rng, M, N, [(4, 64, 64), (3, 32, 96)], "float16", paths=("gemv",))


@pytest.mark.parametrize("bits,gs", list(itertools.product(BITS, GROUP_SIZES)))
def test_qmatmul_gemv_lane_sets(bits, gs):
    # At M = 6 the host widens a GEMV threadgroup to 256 or 512 rows of W
    # (qmv_shape: 32 simdgroups in 2 or 4 lane sets of 16 or 8 lanes, each
    # set its own 4 rows; 2 sets for 8-bit g32 here, 4 for the rest). N = 1030
    # leaves a last threadgroup whose first set has 2 rows and whose other
    # sets have none; K spans two 512-column blocks, the second partial.
    rng = np.random.default_rng(60 + bits * 7 + gs)
    run_case(rng, 6, 1030, [(bits, gs, 512 + gs)], "float16", perm=bits % 2 == 0,
             paths=("gemv",))


@pytest.mark.parametrize("scale_act", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("bits", BITS)
def test_qmatmul_tiled_w_tile_is_mx_dequantize(bits, scale_act):
    # One-hot rows of float16 x pick single weights: y[m, n] = W[n, j_m], one
    # exact product and exact zeros, so the tiled kernel's output is its W
    # tile's value rounded to float16. With float16 scales the tile is
    # float16 and must equal mx.dequantize's float16 result bit for bit
    # (which rounds s q, then the sum with b); with float32 / bfloat16 scales
    # it is float, and y is mx.dequantize's float32 result rounded to
    # float16. Every group size, 16- and 32-row blocks.
    rng = np.random.default_rng(70 + bits)
    N, k = 70, 128
    sdt = MX_DTYPE[scale_act]
    for gs in GROUP_SIZES:
        w = rand(rng, (N, k), sdt)
        wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
        # Scales and biases of both signs and many exponents; scales with
        # float16's 11 bits, so s q is exact in float whatever their dtype.
        s = (rand(rng, s.shape) * 0.05).astype(mx.float16).astype(sdt)
        b = rand(rng, b.shape, sdt)
        if scale_act == "float16":
            want = mx.dequantize(wq, s, b, group_size=gs, bits=bits)
        else:
            want = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32),
                                 group_size=gs, bits=bits)
        want = np.array(want.astype(mx.float16).view(mx.uint16))
        segs = [(bits, gs, k, np.array(wq), to_storage(s), to_storage(b))]
        for M in (16, 32):
            cols = rng.integers(0, k, size=M)
            x = np.zeros((M, k), np.float16)
            x[np.arange(M), cols] = 1
            y = E.qmatmul(x, "float16", segs, N, scale_type=scale_act, path="tiled")
            np.testing.assert_array_equal(y.view(np.uint16), want[:, cols].T)


def test_qmatmul_long_k_many_gemv_blocks():
    rng = np.random.default_rng(3)
    run_case(rng, 1, 9, [(4, 64, 2048 + 64), (2, 32, 544)], "float32")


def test_qmatmul_auto_path_threshold():
    # Auto picks GEMV up to 8 rows and the tiled kernel above; both must agree
    # with the reference at the boundary.
    rng = np.random.default_rng(4)
    for M in (8, 9):
        run_case(rng, M, 12, [(4, 64, 128)], "float32", paths=("auto",))


# ---------------------------------------------------------------- KL

def kl_ref(a64: np.ndarray, b64: np.ndarray):
    """float64 KL(softmax(a) || softmax(b)) per row, lse of both, argmaxes."""
    def lse(z):
        m = np.max(z, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            return (m + np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True)))[:, 0]
    la, lb = lse(a64), lse(b64)
    logp = a64 - la[:, None]
    logq = b64 - lb[:, None]
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (logp - logq), 0.0)
    return terms.sum(axis=-1), lb, la, np.argmax(b64, -1), np.argmax(a64, -1)


def kl_inputs(a32, b32, act):
    a = to_storage(mx.array(a32).astype(MX_DTYPE[act]))
    b = to_storage(mx.array(b32).astype(MX_DTYPE[act]))
    return a, b, E.storage_to_f64(a, act), E.storage_to_f64(b, act)


def check_kl(a32, b32, act, threads=256, order="shuffle"):
    a, b, a64, b64 = kl_inputs(a32, b32, act)
    r = E.kl(a, b, act, threads=threads, order=order)
    kl, lq, lr, aq, ar = kl_ref(a64, b64)
    V = a.shape[1]
    # float32 sums of V terms: error ~ eps * (log V + mean |a - b| + |lse|).
    with np.errstate(invalid="ignore"):
        d = np.abs(a64 - b64)
    scale = 1 + np.log(V) + np.where(np.isfinite(d), d, 0).max(axis=1)
    np.testing.assert_allclose(r["kl"], kl, rtol=1e-4, atol=3e-6 * scale.max())
    np.testing.assert_allclose(r["lse_q"], lq, rtol=2e-6, atol=2e-5 * (1 + np.log(V)))
    np.testing.assert_allclose(r["lse_ref"], lr, rtol=2e-6, atol=2e-5 * (1 + np.log(V)))
    np.testing.assert_array_equal(r["argmax_q"], aq)
    np.testing.assert_array_equal(r["argmax_ref"], ar)
    np.testing.assert_array_equal(r["status"], 0)
    return r


@pytest.mark.parametrize("V", [1, 31, 32, 257, 1000, 4099])
@pytest.mark.parametrize("act", ACTS)
def test_kl_random(V, act):
    rng = np.random.default_rng(V)
    a = (3 * rng.standard_normal((3, V))).astype(np.float32)
    b = (a + 0.3 * rng.standard_normal((3, V))).astype(np.float32)
    check_kl(a, b, act)


@pytest.mark.parametrize("threads", [32, 64, 1024])
def test_kl_threadgroup_sizes(threads):
    rng = np.random.default_rng(threads)
    a = (2 * rng.standard_normal((2, 3001))).astype(np.float32)
    b = rng.standard_normal((2, 3001)).astype(np.float32)
    check_kl(a, b, "float32", threads=threads)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_kl_thread_orders(order):
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 777)).astype(np.float32)
    b = rng.standard_normal((2, 777)).astype(np.float32)
    check_kl(a, b, "float32", order=order)


def test_kl_large_offsets_do_not_overflow_or_cancel():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((4, 2000)).astype(np.float32)
    a = base + np.array([[0], [1e4], [-1e4], [3e4]], np.float32)
    b = base + 1e-3 * rng.standard_normal(base.shape).astype(np.float32) + np.float32(-500)
    a, b = a.astype(np.float32), b.astype(np.float32)
    r = check_kl(a, b, "float32")
    assert (r["kl"] < 1e-3).all()


def test_kl_identical_rows_give_zero():
    rng = np.random.default_rng(2)
    a = (5 * rng.standard_normal((3, 1500))).astype(np.float32)
    r = check_kl(a, a.copy(), "float32")
    assert np.all(r["kl"] <= 1e-6)


def test_kl_peaked_and_shifted_rows():
    V = 600
    a = np.full((3, V), -100.0, np.float32)
    b = np.full((3, V), -100.0, np.float32)
    a[0, 17], b[0, 17] = 100.0, 100.0           # same one-hot
    a[1, 17], b[1, 400] = 100.0, 100.0          # different peaks: KL ~ 200
    a[2, :], b[2, :] = 7.0, -3.0                # constant rows (ties -> index 0)
    r = check_kl(a, b, "float32")
    assert r["kl"][1] > 100


def test_kl_ties_pick_first_index_across_threads():
    V = 1000
    a = np.zeros((1, V), np.float32)
    b = np.zeros((1, V), np.float32)
    a[0, [700, 33, 901]] = 5.0   # thread 33 % 256 holds the first maximum
    b[0, [999, 300]] = 2.0
    r = check_kl(a, b, "float32")
    assert r["argmax_ref"][0] == 33 and r["argmax_q"][0] == 300


def test_kl_masked_vocabulary():
    rng = np.random.default_rng(6)
    a = rng.standard_normal((2, 900)).astype(np.float32)
    b = rng.standard_normal((2, 900)).astype(np.float32)
    a[:, 500:] = -np.inf                 # p = 0 there: any q is fine
    b[0, 500:] = -np.inf
    check_kl(a, b, "float32")


def test_kl_zero_q_where_p_positive_is_inf():
    rng = np.random.default_rng(7)
    a = rng.standard_normal((2, 600)).astype(np.float32)
    b = rng.standard_normal((2, 600)).astype(np.float32)
    b[0, 250] = -np.inf
    # Row 1: the infinite term comes first in thread 0's elements, then a
    # much larger logit rebases that thread's sums by e^-300 = 0 in float32;
    # the infinity must survive (0 * inf would be NaN).
    a[1, 0], b[1, 0] = -200.0, -np.inf
    a[1, 256] = 100.0
    r = E.kl(a, b, "float32")
    assert r["kl"].tolist() == [np.inf, np.inf] and r["status"].tolist() == [0, 0]


@pytest.mark.parametrize("where,value,flag", [
    ("a", np.nan, 1), ("b", np.nan, 2), ("a", np.inf, 4), ("b", np.inf, 8),
])
def test_kl_bad_values_set_status_and_nan(where, value, flag):
    rng = np.random.default_rng(8)
    a = rng.standard_normal((3, 500)).astype(np.float32)
    b = rng.standard_normal((3, 500)).astype(np.float32)
    (a if where == "a" else b)[1, 123] = value
    r = E.kl(a, b, "float32")
    assert np.isnan(r["kl"][1]) and np.isnan(r["lse_q"][1]) and r["status"][1] == flag
    assert np.isfinite(r["kl"][[0, 2]]).all() and (r["status"][[0, 2]] == 0).all()


def test_kl_empty_rows_flagged():
    a = np.full((2, 100), -np.inf, np.float32)
    b = np.zeros((2, 100), np.float32)
    a[1] = 0.0
    b[1] = -np.inf
    r = E.kl(a, b, "float32")
    assert r["status"].tolist() == [16, 32] and np.isnan(r["kl"]).all()


@pytest.mark.parametrize("a_act,b_act", [("float32", "bfloat16"), ("bfloat16", "float16"),
                                           ("float16", "float32")])
def test_kl_reference_and_logits_dtypes_differ(a_act, b_act):
    rng = np.random.default_rng(13)
    a32 = (2 * rng.standard_normal((3, 1100))).astype(np.float32)
    b32 = (a32 + 0.5 * rng.standard_normal(a32.shape)).astype(np.float32)
    a = to_storage(mx.array(a32).astype(MX_DTYPE[a_act]))
    b = to_storage(mx.array(b32).astype(MX_DTYPE[b_act]))
    r = E.kl(a, b, a_act, b_act)
    kl, lq, lr, aq, ar = kl_ref(E.storage_to_f64(a, a_act), E.storage_to_f64(b, b_act))
    np.testing.assert_allclose(r["kl"], kl, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r["lse_q"], lq, rtol=2e-6, atol=2e-4)
    np.testing.assert_array_equal(r["argmax_ref"], ar)
    np.testing.assert_array_equal(r["argmax_q"], aq)


def test_kl_fixed_shift_mode():
    # The reference's row max is given; the kernel never rebases that side.
    rng = np.random.default_rng(14)
    a = (4 * rng.standard_normal((3, 2000))).astype(np.float32)
    b = (a + rng.standard_normal(a.shape)).astype(np.float32)
    r = E.kl(a, b, "float32", mode="fixed_shift", row_param=a.max(axis=1))
    kl, lq, lr, aq, _ = kl_ref(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(r["kl"], kl, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(r["lse_ref"], lr, rtol=2e-6, atol=2e-4)
    np.testing.assert_array_equal(r["argmax_q"], aq)
    np.testing.assert_array_equal(r["argmax_ref"], -1)
    np.testing.assert_array_equal(r["status"], 0)


def negh_pair(w: np.ndarray) -> np.ndarray:
    """sum p log p per row of weights w, as the primitive's float32 hi + lo
    pair [rows, 2] (computed here in float64, independently of mixbits)."""
    w64 = w.astype(np.float64)
    p64 = w64 / w64.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        negh = np.where(p64 > 0, p64 * np.log(np.where(p64 > 0, p64, 1)), 0).sum(axis=1)
    hi = negh.astype(np.float32)
    lo = (negh - hi.astype(np.float64)).astype(np.float32)
    return np.stack([hi, lo], -1), p64


def test_kl_probs_mode():
    # Reference given as unnormalized weights ~ p (here p * 7) and negH.
    rng = np.random.default_rng(15)
    a = (3 * rng.standard_normal((3, 1500))).astype(np.float64)
    b = (a + rng.standard_normal(a.shape)).astype(np.float32)
    p = np.exp(a - a.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[0, :100] = 0.0                     # zero weights contribute nothing
    p /= p.sum(axis=1, keepdims=True)
    w = (7 * p).astype(np.float32)
    param, p64 = negh_pair(w)
    r = E.kl(w, b, "float32", mode="probs", row_param=param)
    lb = kl_ref(b.astype(np.float64), b.astype(np.float64))[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(p64 > 0, p64 * (np.log(p64) - (b - lb[:, None])), 0).sum(axis=1)
    np.testing.assert_allclose(r["kl"], want, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(r["lse_q"], lb, rtol=2e-7, atol=1e-6)
    assert np.isnan(r["lse_ref"]).all() and (r["argmax_ref"] == -1).all()
    np.testing.assert_array_equal(r["status"], 0)


def test_kl_probs_mode_refuses_a_one_word_row_parameter():
    # The primitive passes negH as [rows, 2]; a [rows] array (what this
    # harness once passed, and the kernel once read) is not what the launch
    # binds, so the harness refuses it rather than run the kernel on it.
    w = np.full((2, 100), 0.01, np.float32)
    with pytest.raises(E.EmulatorError, match=r"row_param \(buffer 2, float32\[4\]\)"):
        E.kl(w, np.zeros((2, 100), np.float32), "float32", mode="probs",
             row_param=np.zeros(2, np.float32))


def test_kl_probs_mode_negative_weight_flagged():
    w = np.full((2, 100), 0.01, np.float32)
    w[1, 5] = -0.01
    r = E.kl(w, np.zeros((2, 100), np.float32), "float32", mode="probs",
             row_param=np.zeros((2, 2), np.float32))
    assert r["status"].tolist() == [0, 64] and np.isnan(r["kl"][1])


def test_kl_agrees_with_the_cpu_primitive():
    # The Metal kernel and the CPU primitive (mixbits.kl_compare) on the same
    # rows, including masked vocabularies, ties and rows the CPU flags:
    # same KL, argmaxes and status bits. One known difference: a +inf logit
    # also makes the CPU report its row as empty (bit 32, a by-product of
    # shifting by +inf); the Metal kernel reports only the +inf. Where a
    # NaN/+inf bit is set, only those bits are compared.
    import mixbits.kl as mkl

    rng = np.random.default_rng(16)
    V = 1200
    a = (3 * rng.standard_normal((8, V))).astype(np.float32)
    b = (a + rng.standard_normal(a.shape)).astype(np.float32)
    a[1, 600:] = -np.inf
    b[1, 900:] = -np.inf                # KL = +inf (q = 0 where p > 0)
    a[2, 700:] = -np.inf
    b[2, 700:] = -np.inf                # shared mask
    a[3] = 1.0
    b[3, [5, 1000]] = 9.0               # ties in both
    a[4, 10] = np.nan                   # status 1
    b[5, 20] = np.inf                   # status 8
    a[6] = -np.inf                      # status 16 (empty reference)
    r = E.kl(a, b, "float32")
    cpu = mkl.kl_compare(mx.array(a), mx.array(b), check=False)
    cpu_status = np.array(cpu.status)
    bad_value = (cpu_status & 15) != 0
    cpu_status = np.where(bad_value, cpu_status & 15, cpu_status)
    np.testing.assert_array_equal(r["status"], cpu_status)
    np.testing.assert_array_equal(r["argmax_q"], np.array(cpu.argmax))
    np.testing.assert_array_equal(r["argmax_ref"], np.array(cpu.argmax_ref))
    np.testing.assert_allclose(r["kl"], np.array(cpu.kl), rtol=1e-4, atol=1e-5, equal_nan=True)
