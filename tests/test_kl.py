"""Fused KL divergence against an independent float64 numpy reference."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits.kl import KLReference, kl_backends, kl_compare, kl_divergence

BACKENDS = kl_backends()
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def as_np64(x: mx.array) -> np.ndarray:
    """The exact values the kernel sees, as float64."""
    return np.array(x.astype(mx.float32)).astype(np.float64)


def log_softmax64(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def kl64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la, lb = log_softmax64(a), log_softmax64(b)
    p = np.exp(la)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (la - lb), 0.0)
    return terms.sum(-1)


def check_close(got: mx.array, want: np.ndarray, atol=2e-6, rtol=2e-5):
    got = np.array(got).astype(np.float64)
    assert got.shape == want.shape
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin), (got, want)
    assert np.array_equal(got[~fin], want[~fin])
    err = np.abs(got[fin] - want[fin])
    tol = atol + rtol * np.abs(want[fin])
    assert np.all(err <= tol), f"max err {err.max()} (want {want[fin][np.argmax(err - tol)]})"


def pair(rng, shape, dtype, scale=3.0, noise=0.3):
    a = rng.normal(size=shape) * scale
    b = a + rng.normal(size=shape) * noise
    return mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(dtype)


# --- random logits, every dtype and backend ---------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (5, 1), (3, 7), (2, 3, 1001), (4, 2053), (2, 9000)])
def test_random(backend, dtype, shape):
    rng = np.random.default_rng(hash((str(dtype), shape)) % 2**32)
    a, b = pair(rng, shape, dtype)
    got = kl_divergence(a, b, backend=backend)
    want = kl64(as_np64(a), as_np64(b))
    assert got.dtype == mx.float32 and got.shape == shape[:-1]
    check_close(got, want)
    assert np.all(np.array(got) >= 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes(backend):
    rng = np.random.default_rng(3)
    a, _ = pair(rng, (3, 3001), mx.float32)
    _, b = pair(rng, (3, 3001), mx.bfloat16)
    a16 = a.astype(mx.float16)
    check_close(kl_divergence(a16, b, backend=backend), kl64(as_np64(a16), as_np64(b)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_are_split_and_merged(backend):
    # Few rows: the kernel cuts each row into pieces on several threads and
    # merges the states; V = 262144 is the largest vocabulary in the brief.
    rng = np.random.default_rng(4)
    for shape in [(1, 262144), (3, 100003)]:
        a, b = pair(rng, shape, mx.float16, scale=4.0)
        check_close(kl_divergence(a, b, backend=backend), kl64(as_np64(a), as_np64(b)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rising_maximum_rebases(backend):
    # Increasing logits move the running maximum in every block.
    V = 5000
    a = np.linspace(-30, 30, V)[None] + np.zeros((2, 1))
    b = a[:, ::-1].copy()
    b[1] = a[1] * 0.9
    A, B = mx.array(a.astype(np.float32)), mx.array(b.astype(np.float32))
    check_close(kl_divergence(A, B, backend=backend), kl64(as_np64(A), as_np64(B)))


# --- adversarial -------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_magnitudes(backend, dtype):
    rng = np.random.default_rng(5)
    a = rng.normal(size=(4, 3000)) * 1e4
    b = a + rng.normal(size=a.shape) * 1e3
    b[1] = a[1] + 5e3  # a pure shift: same distribution
    b[2] = rng.normal(size=3000) * 1e4  # unrelated: KL in the thousands
    A, B = mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(dtype)
    want = kl64(as_np64(A), as_np64(B))
    check_close(kl_divergence(A, B, backend=backend), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_and_argmax(backend):
    V = 2500
    a = np.zeros((4, V), np.float32)
    b = np.zeros((4, V), np.float32)
    a[1, [7, 1500, 2400]] = 3.0  # tie across blocks: first index wins
    b[1, [2000, 9]] = 3.0
    b[2, :] = 1.0  # uniform vs uniform
    a[3, ::2] = 2.0
    b[3, 1::2] = 2.0
    A, B = mx.array(a), mx.array(b)
    r = kl_compare(A, B, backend=backend)
    check_close(r.kl, kl64(a.astype(np.float64), b.astype(np.float64)))
    assert np.array_equal(np.array(r.argmax_ref), a.argmax(-1))
    assert np.array_equal(np.array(r.argmax), b.argmax(-1))
    assert np.array_equal(np.array(r.same_top), a.argmax(-1) == b.argmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_masks(backend, dtype):
    rng = np.random.default_rng(6)
    V = 3001
    a = rng.normal(size=(6, V)) * 3
    b = a + rng.normal(size=a.shape) * 0.5
    mask = rng.random(size=V) < 0.3
    a[0, mask] = -np.inf  # masked vocabulary on both sides
    b[0, mask] = -np.inf
    a[1, mask] = -np.inf  # reference masks more than the candidate: finite
    b[2, 100] = -np.inf  # candidate masks a token the reference uses: +inf
    a[3, :] = -np.inf  # one-hot reference
    a[3, 1234] = 0.0
    a[4, :] = -np.inf  # one-hot on both sides, same token: 0
    a[4, 17] = 5.0
    b[4, :] = -np.inf
    b[4, 17] = -2.0
    b[5, 2000:] = -np.inf  # a whole block of -inf at the end
    A, B = mx.array(a.astype(np.float32)).astype(dtype), mx.array(b.astype(np.float32)).astype(dtype)
    got = kl_divergence(A, B, backend=backend)
    want = kl64(as_np64(A), as_np64(B))
    assert want[2] == np.inf and want[5] == np.inf and want[4] == 0
    check_close(got, want)
    r = kl_compare(A, B, backend=backend)
    assert np.array(r.argmax_ref)[3] == 1234


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("V", [1, 2, 7, 8, 9, 1023, 1024, 1025])
def test_odd_and_tiny_vocab(backend, V):
    rng = np.random.default_rng(V)
    a, b = pair(rng, (5, V), mx.float32)
    got = kl_divergence(a, b, backend=backend)
    check_close(got, kl64(as_np64(a), as_np64(b)))
    if V == 1:
        assert np.all(np.array(got) == 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_of_p_with_itself_is_zero(backend, dtype):
    rng = np.random.default_rng(7)
    a = mx.array((rng.normal(size=(3, 4099)) * 5).astype(np.float32)).astype(dtype)
    assert np.all(np.array(kl_divergence(a, a, backend=backend)) == 0)
    # Nearly equal distributions (a shift, up to the dtype's rounding).
    b = a + 7.0
    got = kl_divergence(a, b, backend=backend)
    check_close(got, kl64(as_np64(a), as_np64(b)))
    assert np.all(np.array(got) >= 0)


# --- invalid input -----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["ref_logits", "logits"])
@pytest.mark.parametrize("bad", ["nan", "posinf", "allneginf"])
def test_bad_values_rejected(backend, which, bad):
    rng = np.random.default_rng(8)
    a = rng.normal(size=(2, 3, 2000)).astype(np.float32)
    b = a + 0.1
    x = a if which == "ref_logits" else b
    if bad == "nan":
        x[1, 2, 1500] = np.nan
        msg = "contains NaN"
    elif bad == "posinf":
        x[1, 2, 3] = np.inf
        msg = r"contains \+inf"
    else:
        x[1, 2, :] = -np.inf
        msg = r"has no finite entry \(every logit is -inf\)"
    A, B = mx.array(a), mx.array(b)
    with pytest.raises(ValueError, match=rf"{which} {msg} at token \(1, 2\)"):
        kl_divergence(A, B, backend=backend)
    # Unchecked: only the bad row is NaN.
    got = np.array(kl_divergence(A, B, check=False, backend=backend))
    assert np.isnan(got[1, 2]) and np.isfinite(np.delete(got.reshape(-1), 5)).all()


def test_nan_in_general_path_rejected():
    # A NaN in a block that also holds -inf (the path with masks) is found.
    a = np.zeros((1, 3000), np.float32)
    b = np.zeros((1, 3000), np.float32)
    b[0, 10] = -np.inf
    b[0, 20] = np.nan
    with pytest.raises(ValueError, match="logits contains NaN"):
        kl_divergence(mx.array(a), mx.array(b))


def test_argument_errors():
    a = mx.zeros((2, 5))
    with pytest.raises(ValueError, match=r"shape \(2, 5\) differs from logits shape \(2, 6\)"):
        kl_divergence(a, mx.zeros((2, 6)))
    with pytest.raises(TypeError, match="logits must be float32, float16 or bfloat16"):
        kl_divergence(a, mx.zeros((2, 5), dtype=mx.int32))
    with pytest.raises(TypeError, match="ref_logits must be an mlx.core.array"):
        kl_divergence([1.0], a)
    with pytest.raises(ValueError, match="V must be >= 1"):
        kl_divergence(mx.zeros((2, 0)), mx.zeros((2, 0)))
    with pytest.raises(ValueError, match="at least one dimension"):
        kl_divergence(mx.array(1.0), mx.array(1.0))
    with pytest.raises(ValueError, match="backend must be one of"):
        kl_divergence(a, a, backend="gpu")
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 5\); found 5"):
        kl_compare(a, a, mx.array([0, 5]))
    with pytest.raises(ValueError, match="targets shape"):
        kl_compare(a, a, mx.array([0, 1, 2]))
    with pytest.raises(TypeError, match="targets must be an integer array"):
        kl_compare(a, a, mx.array([0.0, 1.0]))
    # The C++ builder checks too, for callers that bypass the wrapper.
    with pytest.raises(ValueError, match="differs from logits shape"):
        _ext.kl_divergence(a, mx.zeros((3, 5)), None, 0, 0)


# --- layout, compile, targets ------------------------------------------------

def test_strided_inputs_and_leading_dims():
    rng = np.random.default_rng(9)
    a = mx.array(rng.normal(size=(300, 4, 3)).astype(np.float32))
    b = mx.array(rng.normal(size=(300, 4, 3)).astype(np.float32))
    at, bt = mx.transpose(a, (2, 1, 0)), mx.transpose(b, (2, 1, 0))[:, ::-1]
    got = kl_divergence(at, bt)
    assert got.shape == (3, 4)
    check_close(got, kl64(as_np64(at), as_np64(bt)))
    one = kl_divergence(a[0, 0], b[0, 0])
    assert one.shape == ()
    check_close(one, kl64(as_np64(a[0, 0]), as_np64(b[0, 0])))
    assert mixbits.kl_divergence is kl_divergence


def test_compile():
    rng = np.random.default_rng(10)
    a, b = pair(rng, (4, 3000), mx.float16)

    def f(x, y):
        return kl_divergence(x, y, check=False) * 2.0

    check_close(mx.compile(f)(a, b), 2 * kl64(as_np64(a), as_np64(b)))
    with pytest.raises(ValueError, match="pass check=False"):
        mx.compile(lambda x, y: kl_divergence(x, y))(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_probabilities(dtype):
    rng = np.random.default_rng(11)
    a, b = pair(rng, (3, 5, 1500), dtype)
    t = rng.integers(0, 1500, size=(3, 5))
    r = kl_compare(a, b, mx.array(t))
    la, lb = log_softmax64(as_np64(a)), log_softmax64(as_np64(b))
    wa = np.take_along_axis(la, t[..., None], -1)[..., 0]
    wb = np.take_along_axis(lb, t[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.array(r.logp_ref_target), wa, atol=2e-5)
    np.testing.assert_allclose(np.array(r.logp_target), wb, atol=2e-5)
    np.testing.assert_allclose(np.array(r.delta_p), np.exp(wb) - np.exp(wa), atol=2e-6)


# --- the reference object for sweeps ------------------------------------------

def kl16_64(a64: np.ndarray, b64: np.ndarray) -> np.ndarray:
    """KL from the float16-rounded scaled probabilities, computed independently."""
    w = np.exp(a64 - a64.max(-1, keepdims=True))  # weights, max 1
    p16 = (w.astype(np.float32) * 2.0**15).astype(np.float16).astype(np.float64)
    p16 /= p16.sum(-1, keepdims=True)
    lb = log_softmax64(b64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p16 > 0, p16 * (np.log(np.where(p16 > 0, p16, 1)) - lb), 0).sum(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", KLReference.FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_forms(backend, form, dtype):
    rng = np.random.default_rng(12)
    a, b = pair(rng, (2, 3, 5003), dtype, scale=4.0, noise=0.2)
    an = np.array(a.astype(mx.float32))
    an[0, 0, :100] = -np.inf  # masked vocabulary in the reference
    a = mx.array(an).astype(dtype)
    t = rng.integers(100, 5003, size=(2, 3))
    ref = KLReference(a, mx.array(t), form=form, backend=backend)
    r = ref.compare(b)
    a64, b64 = as_np64(a), as_np64(b)
    exact = kl64(a64, b64)
    if form == "probs16":
        check_close(r.kl, kl16_64(a64, b64), atol=2e-6, rtol=2e-5)
        check_close(r.kl, exact, atol=1e-5, rtol=2e-3)
        assert ref.nbytes == 2 * a.size
    else:
        check_close(r.kl, exact)
    assert np.array_equal(np.array(r.argmax_ref), a64.argmax(-1))
    assert np.array_equal(np.array(r.argmax), b64.argmax(-1))
    wa = np.take_along_axis(log_softmax64(a64), t[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.array(r.logp_ref_target), wa, atol=2e-5)
    self_kl = np.array(ref.kl(a))
    assert np.all(self_kl >= 0) and np.all(self_kl < 1e-5)


def test_reference_errors():
    a = mx.zeros((2, 50))
    with pytest.raises(ValueError, match="form must be one of"):
        KLReference(a, form="top8")
    bad = np.zeros((2, 50), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"ref_logits contains NaN at token \(1,\)"):
        KLReference(mx.array(bad))
    ref = KLReference(a, form="probs16")
    with pytest.raises(ValueError, match="differs from the reference shape"):
        ref.compare(mx.zeros((2, 51)))
    q = np.zeros((2, 50), np.float32)
    q[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"logits contains NaN at token \(0,\)"):
        ref.compare(mx.array(q))


# --- the vectorized exp -------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_vector_exp(backend):
    x = np.concatenate([np.linspace(-87.3, 1.0, 400001), [-1e-30, 0.0, 1e-7, 5.0, 80.0]]).astype(np.float32)
    y = np.empty_like(x)
    _ext.kl_vector_exp(x, y, mixbits.kl.BACKENDS[backend])
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y / want - 1)) < 2e-7
    low = np.array([-87.5, -100.0, -1e30, -np.inf], np.float32)
    out = np.empty_like(low)
    _ext.kl_vector_exp(low, out, mixbits.kl.BACKENDS[backend])
    # Below float32's normal range the kernel's exp is 0 (the reference's
    # double exp rounds to a subnormal or 0: either way <= 1.2e-38).
    assert np.all(out <= 1.2e-38) and np.all(out >= 0)
