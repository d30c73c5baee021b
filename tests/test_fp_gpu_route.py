"""Where an fp-mode call (mxfp4, nvfp4, mxfp8) goes when MLX's default
device is the GPU: 1..8 rows of x with transpose=True and a 2-D w to
mixbits' Metal GEMV (FpQMatmul, metal/fp_qmv.metal), everything else to
mx.quantized_matmul. The device is faked (no GPU here) and both ends are
recorded instead of run; the kernel itself is checked under the emulator
(tests/metal/test_fp_kernel.py) and on a Mac (check_on_mac.sh)."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops


@pytest.fixture
def on_gpu(monkeypatch):
    """Default device: the GPU; returns the list of ends reached."""
    seen = []
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(_ext, "fp_qmatmul", lambda x, w, s, mode, transpose, backend:
                        seen.append(("mixbits", x.shape, mode, transpose, backend)))
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a, **k: seen.append(("mlx", x.shape)))
    return seen


def weights(mode, n=16, k=64):
    w = mx.array(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32))
    return mx.quantize(w, mode=mode)


@pytest.mark.parametrize("mode", list(ops.FP_MODES))
def test_few_rows_run_the_metal_gemv_the_rest_mlx(on_gpu, mode):
    wq, s = weights(mode)
    for shape in [(64,), (1, 64), (8, 64), (2, 4, 64), (9, 64), (3, 3, 64), (0, 64)]:
        mixbits.quantized_matmul(mx.zeros(shape), wq, s, mode=mode)
    mixbits.quantized_matmul(mx.zeros((1, 64)), wq, s, mode=mode, transpose=False)
    mixbits.quantized_matmul(mx.zeros((1, 1, 64)), wq[None], s[None], mode=mode)
    m = ops.FP_MODES[mode]
    assert on_gpu == [("mixbits", (64,), m, True, 0), ("mixbits", (1, 64), m, True, 0),
                      ("mixbits", (8, 64), m, True, 0), ("mixbits", (2, 4, 64), m, True, 0),
                      ("mlx", (9, 64)), ("mlx", (3, 3, 64)), ("mlx", (0, 64)),
                      ("mlx", (1, 64)), ("mlx", (1, 1, 64))]


def test_the_limit_is_the_kernels():
    """FP_GPU_MAX_M is MB_FPQ_MAX_M of metal/fp_qmv_params.h."""
    text = (Path(__file__).resolve().parents[1] / "metal" / "fp_qmv_params.h").read_text()
    assert f"MB_FPQ_MAX_M = {ops.FP_GPU_MAX_M}," in text
