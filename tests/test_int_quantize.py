"""The integer contracts' quantization of x (cpp/qmatmul_int8/kernel.h's
int_quantize, vectorized by the compiler and cloned per ISA) must equal a
numpy model of the contract bit for bit (float32 id = Q / max|x|, x * id in
float32, round half to even), on rows built to reach its edges."""

import numpy as np
import pytest

from mixbits import _ext

WIDTHS = {8: 127, 16: 32767}
MIN_AMAX = {8: np.float32(2.0**-119), 16: np.float32(2.0**-111)}


def numpy_model(x, G, width):
    Q = np.float32(WIDTHS[width])
    xg = x.reshape(-1, G)
    amax = np.abs(xg).max(axis=1).astype(np.float32)
    codes = np.zeros_like(xg, dtype=np.int64)
    d = np.zeros(len(xg), np.float32)
    live = amax >= MIN_AMAX[width]
    with np.errstate(divide="ignore"):
        idv = (Q / np.where(live, amax, np.float32(1))).astype(np.float32)
    v = np.rint((xg * idv[:, None]).astype(np.float32))
    codes[live] = np.clip(v, -Q, Q)[live].astype(np.int64)
    d[live] = (amax[live] / Q).astype(np.float32)
    ix = codes.sum(axis=1)
    xs = (d * ix.astype(np.float32)).astype(np.float32)
    return codes.reshape(-1), d, ix, xs


def rows(rng, G, ng):
    """Rows that reach the contract's edges: mixed magnitudes per group,
    exact ties (a group whose max is Q, so id = 1 and x = k + 1/2), zero
    groups, groups under the zero threshold, subnormal and huge values."""
    out = []
    for scale in (1.0, 1e-3, 3e4, 1e-30):
        out.append((rng.standard_normal(G * ng) * scale).astype(np.float32))
    x = (rng.standard_normal(G * ng) * rng.choice([1e-2, 1.0, 50.0], G * ng)).astype(np.float32)
    out.append(x)
    for width, Q in WIDTHS.items():
        t = (rng.integers(-Q, Q, G * ng) + 0.5).astype(np.float32)
        t[::G] = Q  # max |x| = Q: id = 1, every x a tie
        t = np.clip(t, -Q, Q)
        out.append(t)
    z = rng.standard_normal(G * ng).astype(np.float32)
    z[:G] = 0.0
    if ng > 1:
        z[G:2 * G] = np.float32(2.0**-125) * rng.standard_normal(G).astype(np.float32)
    if ng > 2:
        z[2 * G:3 * G] = np.float32(2.0**-140)  # subnormal
    if ng > 3:
        z[3 * G] = np.float32(3e38)
    out.append(z)
    return out


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("G", [32, 64, 128, 16, 96])
def test_quantize_equals_numpy_model(width, G):
    rng = np.random.default_rng(G * 31 + width)
    for x in rows(rng, G, ng=int(rng.integers(4, 9))):
        got = _ext.int_quantize_row(x, G, width)
        codes, d, ix, xs = numpy_model(x, G, width)
        np.testing.assert_array_equal(np.asarray(got[0]), codes)
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), d)
        np.testing.assert_array_equal(np.asarray(got[2]), ix)
        np.testing.assert_array_equal(np.asarray(got[3], np.float32), xs)


def test_bad_arguments():
    x = np.zeros(64, np.float32)
    with pytest.raises(ValueError):
        _ext.int_quantize_row(x, 48, 8)
    with pytest.raises(ValueError):
        _ext.int_quantize_row(x, 32, 4)
