"""Accuracy of the Metal KL kernel (on the emulator) against the CPU
primitive's, both measured against float64 numpy on the same inputs: the
GPU's max |error| per token must be within 2x the CPU's, for the direct
kernel and every KLReference form (bench/KL.md, "GPU" section).

The emulator evaluates exp with the host's libm (correctly rounded or
nearly); an Apple GPU's precise::exp may be a few ulps worse, which
tests/metal/check_on_mac.sh measures on the real device.

Run as a script to print the table bench/KL.md quotes:
    python tests/metal/test_kl_accuracy.py
"""

import mlx.core as mx
import numpy as np
import pytest

import metal_emu as E
import mixbits.kl as mkl
from test_kl_vs_primitive import Recorder, run_on_emulator

NOISES = (0.03, 0.1, 0.3, 1.0)
FORMS = ("direct", "logits", "probs32", "probs16")


@pytest.fixture(scope="module", autouse=True)
def emulator():
    if E.compiler() is None:
        pytest.skip("no C++ compiler to build the Metal emulator")
    E.lib()


def truth(call) -> np.ndarray:
    """float64 KL of exactly the arrays the primitive was given."""
    ref, logits, param, mode, _ = call
    V = logits.shape[-1]
    b = np.array(logits.astype(mx.float32), np.float64).reshape(-1, V)
    lq = b - (b.max(1, keepdims=True)
              + np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True)))
    a = np.array(ref.astype(mx.float32), np.float64).reshape(-1, V)
    if mode == 2:  # weights
        p = a / a.sum(1, keepdims=True)
    else:
        z = a - a.max(1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - lq), 0).sum(1)


def measure(rows=16, V=151936, seed=0):
    """{(noise, form): (mean KL, cpu max |err|, gpu max |err|)}."""
    rng = np.random.default_rng(seed)
    out = {}
    for noise in NOISES:
        a = (3 * rng.standard_normal((rows, V))).astype(np.float32)
        b = a + noise * rng.standard_normal((rows, V)).astype(np.float32)
        A, B = mx.array(a).astype(mx.float16), mx.array(b).astype(mx.float16)
        for form in FORMS:
            rec = Recorder(mkl._ext)
            old, mkl._ext = mkl._ext, rec
            try:
                if form == "direct":
                    mkl.kl_divergence(A, B)
                else:
                    mkl.KLReference(A, form=form).compare(B)
            finally:
                mkl._ext = old
            call = [c for c in rec.calls if c[1] is B][-1]
            mx.eval(call[4])
            want = truth(call)
            cpu = np.array(call[4][0], np.float64).ravel()
            gpu = run_on_emulator(*call[:4])["kl"].astype(np.float64)
            out[(noise, form)] = (want.mean(), np.abs(cpu - want).max(),
                                  np.abs(gpu - want).max())
    return out


@pytest.fixture(scope="module")
def table():
    return measure(rows=4, V=151936)


@pytest.mark.parametrize("noise", NOISES)
@pytest.mark.parametrize("form", FORMS)
def test_gpu_kl_error_within_twice_the_cpu(table, noise, form):
    _, cpu, gpu = table[(noise, form)]
    # The result is a float32: half an ulp of the KL is the floor for both.
    floor = 0.5 * np.spacing(np.float32(table[(noise, form)][0]))
    assert gpu <= 2 * max(cpu, floor), (cpu, gpu)


if __name__ == "__main__":
    E.lib()
    t = measure()
    print(f"{'noise':>6} {'form':>8} {'mean KL':>10} {'CPU max|err|':>13} {'GPU max|err|':>13}")
    for (noise, form), (m, c, g) in t.items():
        print(f"{noise:6.2f} {form:>8} {m:10.5f} {c:13.2e} {g:13.2e}")
