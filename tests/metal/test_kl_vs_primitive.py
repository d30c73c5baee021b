"""The Metal KL kernel, on the emulator, given exactly the buffers the
primitive is given, agrees with the CPU primitive's outputs in every mode.

The public entry points (kl_compare; KLReference with form logits, probs32,
probs16) run on the CPU while a recorder notes every call they make to
mixbits._ext.kl_divergence: the reference, the logits, the row parameter
(float32 [rows] shift, or [rows, 2] negH hi + lo) and the mode. The same
arrays, byte for byte, then go to the emulator, whose harness checks them
against the launch's buffer description (metal/kl_host.h), and the six
outputs are compared with the primitive's.
"""

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
import mixbits.kl as mkl

# The CPU primitive's own error per token (float32 terms; bench/KL.md: up
# to ~1.5e-7 absolute in the probs forms); the emulated kernel is closer to
# float64 than that (test_kl_accuracy.py), so the two agree within it.
CPU_KL_ERR = 3e-7
MODES = {0: "logits", 1: "fixed_shift", 2: "probs"}
ACT = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    if E.compiler() is None:
        pytest.skip("no C++ compiler to build the Metal emulator")
    E.lib()


class Recorder:
    """Stands in for mixbits._ext inside mixbits.kl; records kl_divergence."""

    def __init__(self, ext):
        self._ext = ext
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def kl_divergence(self, ref, logits, param, mode, backend):
        outs = self._ext.kl_divergence(ref, logits, param, mode, backend)
        self.calls.append((ref, logits, param, mode, outs))
        return outs


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder(mkl._ext)
    monkeypatch.setattr(mkl, "_ext", rec)
    return rec


def storage(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def run_on_emulator(ref, logits, param, mode):
    V = logits.shape[-1]
    a = storage(ref).reshape(-1, V)
    b = storage(logits).reshape(-1, V)
    rp = None if param is None else np.array(param)  # its real shape
    return E.kl(a, b, ACT[ref.dtype], ACT[logits.dtype], mode=MODES[mode], row_param=rp)


def compare(call, kl_atol):
    ref, logits, param, mode, outs = call
    mx.eval(outs)
    r = run_on_emulator(ref, logits, param, mode)
    kl, status, argq, lseq, argr, lser = (np.array(o).ravel() for o in outs)
    np.testing.assert_array_equal(r["status"], status)
    np.testing.assert_array_equal(r["argmax_q"], argq)
    np.testing.assert_array_equal(r["argmax_ref"], argr)
    np.testing.assert_allclose(r["kl"], kl, rtol=1e-6, atol=kl_atol, equal_nan=True)
    np.testing.assert_allclose(r["lse_q"], lseq, rtol=3e-7, atol=0, equal_nan=True)
    np.testing.assert_allclose(r["lse_ref"], lser, rtol=3e-7, atol=0, equal_nan=True)
    return r, kl


def rows(rng, shape, dtype, noise=0.3):
    a = (3 * rng.standard_normal(shape)).astype(np.float32)
    b = (a + noise * rng.standard_normal(shape)).astype(np.float32)
    return mx.array(a).astype(dtype), mx.array(b).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_logits_mode(recorder, dtype):
    a, b = rows(np.random.default_rng(1), (2, 3, 3001), dtype)
    mkl.kl_compare(a, b)
    (call,) = recorder.calls
    assert call[3] == 0 and call[2] is None
    compare(call, kl_atol=CPU_KL_ERR)


@pytest.mark.parametrize("form,mode,param_shape", [
    ("logits", 1, (2, 3)), ("probs32", 2, (2, 3, 2)), ("probs16", 2, (2, 3, 2))])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_reference_forms(recorder, form, mode, param_shape, dtype):
    a, b = rows(np.random.default_rng(2), (2, 3, 3001), dtype)
    ref = mkl.KLReference(a, form=form)
    recorder.calls.clear()
    res = ref.compare(b)
    (call,) = recorder.calls
    assert call[3] == mode and tuple(call[2].shape) == param_shape
    r, kl = compare(call, kl_atol=CPU_KL_ERR)
    assert (kl > 1e-3).all()  # a real KL, not a degenerate zero
    np.testing.assert_array_equal(r["argmax_q"], np.array(res.argmax).ravel())


def test_every_mode_with_masks_ties_and_bad_rows(recorder):
    # Adversarial rows through every mode; status bits and NaNs must match.
    rng = np.random.default_rng(3)
    V = 1200
    a = (3 * rng.standard_normal((6, V))).astype(np.float32)
    b = (a + rng.standard_normal(a.shape)).astype(np.float32)
    a[1, 900:] = -np.inf
    b[1, 600:] = -np.inf        # q = 0 where p > 0: KL = +inf
    a[2, 700:] = -np.inf
    b[2, 700:] = -np.inf        # shared mask
    a[3] = 1.0
    b[3, [5, 1000]] = 9.0       # ties
    b[4, 20] = np.nan           # candidate NaN: status 2
    b[5] = -np.inf              # empty candidate: status 32
    A, B = mx.array(a), mx.array(b)
    mkl.kl_compare(A, B, check=False)
    for form in ("logits", "probs32", "probs16"):
        mkl.KLReference(A, form=form).compare(B, check=False)
    calls = [c for c in recorder.calls if c[1] is B]
    assert sorted(c[3] for c in calls) == [0, 1, 2, 2]
    for call in calls:
        r, kl = compare(call, kl_atol=CPU_KL_ERR)
        assert np.isinf(r["kl"][1]) and np.isnan(r["kl"][4:]).all()
