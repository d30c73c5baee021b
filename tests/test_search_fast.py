"""quantizers.search's fused kernel (cpp/quant_search, AVX2 and its scalar
reference) against the numpy definition it replaces (search_reference:
search_affine / search_ternary on the whole segment): codes, scales and
biases bit for bit, on randomized shapes, every width, ternary, mixed
segments, permutations, the three storage dtypes, zero and constant groups,
huge dynamic range, zero input weights and blocks of rows of any size."""

import importlib

import mlx.core as mx
import numpy as np
import pytest

from mixbits import _ext
from mixbits.layout import BITS, TERNARY
from mixbits.measure.candidates import parse_candidate

S = importlib.import_module("mixbits.quantizers.search")
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def parts(qt):
    out = [np.asarray(qt.perm)] if qt.perm is not None else []
    for s in qt.segments:
        assert s.scales.dtype == s.biases.dtype
        out += [(s.bits, s.group_size, s.k, s.kind), np.array(s.wq)]
        out += [np.array(a.astype(mx.float32)) for a in (s.scales, s.biases)]
    return out


def assert_same(a, b, what):
    pa, pb = parts(a), parts(b)
    assert len(pa) == len(pb), what
    for x, y in zip(pa, pb):
        if isinstance(x, tuple):
            assert x == y, what
        else:
            np.testing.assert_array_equal(x, y, err_msg=what)


def weight(rng, n, k, gs, style, wide=True):
    w = rng.standard_normal((n, k)).astype(np.float32)
    if style == "range":  # rows and groups spread over ~1e-5 .. 1e7 (float16: ~1e-4 .. 1e3)
        w *= np.exp(rng.uniform(-9, 9, (n, 1)) if wide else rng.uniform(-7, 3, (n, 1))).astype(np.float32)
        w[:, :gs] *= np.float32(1e3 if wide else 30)
    elif style == "outliers":
        idx = rng.integers(0, w.size, max(1, w.size // 97))
        w.flat[idx] *= np.float32(300)
    elif style == "special":  # zero, constant, one-valued and two-valued groups
        w[0, :gs] = 0
        w[-1, :gs] = 1.25
        if k >= 2 * gs:
            w[0, gs : 2 * gs] = -3.0
            w[-1, gs : 2 * gs] = np.where(np.arange(gs) % 2, 0.5, -0.25)
        if n > 2:
            w[1] = 0
    return w * np.float32(0.05)


def h_for(rng, k, style):
    if style == 0:
        return None
    h = rng.random(k) * np.exp(rng.standard_normal(k) * 3)
    if style == 2:  # inputs that never fire: weight 0 on some columns
        h[rng.random(k) < 0.3] = 0
    return h


def cases(count, seed):
    rng = np.random.default_rng(seed)
    widths = list(BITS) + [TERNARY]
    for i in range(count):
        gs = int(rng.choice((32, 64, 128)))
        bits = widths[i % len(widths)]
        n = int(rng.integers(1, 24))
        if i % 4 == 3:  # mixed: two or three segments of different widths
            ks = [gs * int(rng.integers(1, 4)) for _ in range(int(rng.integers(2, 4)))]
            segs = [(widths[(i + j * 3) % len(widths)], gs, kk) for j, kk in enumerate(ks)]
        else:
            segs = [(bits, gs, gs * int(rng.integers(1, 5)))]
        k = sum(s[2] for s in segs)
        dtype = DTYPES[i % 3]
        w = weight(rng, n, k, gs, ("plain", "range", "outliers", "special")[i % 4], dtype != mx.float16)
        perm = rng.permutation(k) if i % 3 == 1 else None
        yield dict(w=w, segments=segs, perm=perm, dtype=dtype, h_diag=h_for(rng, k, i % 3),
                   grid=int(rng.choice((20, 20, 5, 0))), refine=int(rng.choice((2, 2, 0, 3, 1))))


def test_kernel_is_built():
    # The fused path runs only where the extension has it; this build must.
    assert hasattr(_ext, "search_trials") and hasattr(_ext, "search_lsq_sums")


@pytest.mark.parametrize("simd", [True, False])
def test_fused_equals_numpy_reference(simd):
    for j, c in enumerate(cases(42, seed=1 + simd)):
        ref = S.search_reference(**c)
        got = S._search(c["w"], c["segments"], c["perm"], c["dtype"], c["h_diag"], c["grid"],
                        c["refine"], fast=True, simd=simd)
        assert_same(got, ref, f"case {j}: {c['segments']} {c['dtype']} grid={c['grid']} refine={c['refine']}")


def test_public_search_is_the_fused_path(monkeypatch):
    # search() goes through the kernel (counted), with blocks of rows that do
    # not divide N, and still equals the reference.
    calls = []
    real = _ext.search_trials
    monkeypatch.setattr(S._ext, "search_trials", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(S, "CHUNK_ELEMENTS", 3 * 192)
    rng = np.random.default_rng(7)
    w = weight(rng, 17, 192, 64, "range", wide=False)
    h = h_for(rng, 192, 2)
    for kind in ("3b_g64", "ternary_g64", "4b10_3b_g64", "8b_g32"):
        segs = parse_candidate(kind).segments(192)
        for dt in DTYPES:
            calls.clear()
            got = S.search(w, segs, dtype=dt, h_diag=h)
            assert_same(got, S.search_reference(w, segs, dtype=dt, h_diag=h), f"{kind} {dt}")
            assert len(calls) >= 2 * len(segs) and max(np.prod(c) for c in calls) <= 3 * 192


def test_float16_overflow_falls_back_to_the_definition():
    # Weights beyond float16's range stored as float16. Ternary: the scale
    # rounds to inf, the block goes to the numpy definition, same answer.
    # Affine: the rounded weight itself is inf; both paths refuse alike.
    w = np.random.default_rng(3).standard_normal((4, 128)).astype(np.float32)
    w[0, :64] = 1e5
    with np.errstate(all="ignore"):
        segs = [(TERNARY, 64, 128)]
        got = S.search(w, segs, dtype=mx.float16)
        assert_same(got, S.search_reference(w, segs, dtype=mx.float16), "ternary")
        assert not np.isfinite(np.array(got.segments[0].scales.astype(mx.float32))).all()
        for f, msg in ((S.search, "beyond mlx.core.float16's range"), (S.search_reference, "codes out of range")):
            with pytest.raises(ValueError, match=msg):
                f(w, [(4, 64, 128)], dtype=mx.float16)


def test_every_group_no_worse_than_rtn_on_a_large_block():
    # The kernel's answer on a tensor spanning many blocks keeps each group's
    # weighted error <= RTN's (search's promise), measured here in float64.
    rng = np.random.default_rng(11)
    w = weight(rng, 300, 512, 64, "outliers")
    h = h_for(rng, 512, 1)
    qt = S.search(w, [(3, 64, 512)], dtype=mx.bfloat16, h_diag=h)
    s = qt.segments[0]
    f32 = lambda a: a.astype(mx.float32)  # decode with the stored parameters, unrounded
    got = np.array(mx.dequantize(s.wq, f32(s.scales), f32(s.biases), group_size=64, bits=3), np.float64)
    wq, sc, bi = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=64, bits=3)
    rtn = np.array(mx.dequantize(wq, f32(sc), f32(bi), group_size=64, bits=3), np.float64)
    hw = h / h.max()
    e = lambda d: ((d - w.astype(np.float64)) ** 2 * hw).reshape(300, 8, 64).sum(-1)
    assert (e(got) <= e(rtn) * (1 + 1e-6) + 1e-30).all()
    assert e(got).sum() < 0.9 * e(rtn).sum()


def test_kernel_rejects_mismatched_shapes():
    t = np.zeros((2, 3, 64), np.float32)
    p = np.ones((1, 6), np.float32)
    err, idx, codes = np.zeros(6), np.full(6, -1, np.int32), np.zeros((2, 3, 64), np.uint8)
    with pytest.raises(ValueError, match="h must be"):
        _ext.search_trials(t, t, np.ones((3, 32), np.float32), p, p, p, p, 0, 3, 0, 0, err, idx, codes, True)
    with pytest.raises(ValueError, match="parameters must be"):
        _ext.search_trials(t, t, np.ones((3, 64), np.float32), p, p, p, np.ones((1, 5), np.float32),
                           0, 3, 0, 0, err, idx, codes, True)
    with pytest.raises(ValueError, match="differ in shape"):
        _ext.search_lsq_sums(t, np.ones((3, 64), np.float32), np.zeros((2, 3, 32), np.uint8), 0,
                             np.zeros((6, 5)), True)
