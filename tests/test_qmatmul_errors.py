"""Every bad argument is refused with a message naming it, before any kernel."""

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext
from mixbits.layout import QuantizedTensor, Segment


@pytest.fixture(scope="module")
def qt():
    w = mx.array(np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32))
    return mixbits.quantize(w, [(4, 64, 64), (3, 32, 64)])


def test_k_mismatch(qt):
    with pytest.raises(ValueError, match="K=128"):
        mixbits.qmatmul(mx.zeros((2, 127)), qt)


def test_x_dtype_and_type(qt):
    with pytest.raises(ValueError, match="x must be float32"):
        mixbits.qmatmul(mx.zeros((2, 128), dtype=mx.int32), qt)
    with pytest.raises(TypeError, match="mlx.core.array"):
        mixbits.qmatmul(np.zeros((2, 128), np.float32), qt)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        mixbits.qmatmul(mx.zeros((2, 128)), "weights")


@pytest.mark.parametrize(
    "segments,match",
    [
        ([(7, 64, 128)], "bits must be one of"),
        ([(4, 48, 128)], "group_size must be one of"),
        ([(4, 64, 96)], "multiple of group_size"),
        ([(4, 64, 64)], "sum to 64 but w has K=128"),
        ([(4, 64)], r"segments\[0\] must be"),
        ([], "sum to 0"),
    ],
)
def test_bad_segments(segments, match):
    with pytest.raises(ValueError, match=match):
        mixbits.quantize(mx.zeros((4, 128)), segments)


@pytest.mark.parametrize(
    "perm,exc,match",
    [
        (np.arange(127), ValueError, r"shape \(128,\)"),
        (np.r_[np.arange(127), 0], ValueError, "not a permutation"),
        (np.r_[np.arange(127), 128], ValueError, "not a permutation"),
        (np.arange(128, dtype=np.float32), ValueError, "integer"),
    ],
)
def test_bad_perm(perm, exc, match):
    with pytest.raises(exc, match=match):
        mixbits.quantize(mx.zeros((4, 128)), [(4, 64, 128)], perm=perm)


def test_bad_w():
    with pytest.raises(ValueError, match="2-D"):
        mixbits.quantize(mx.zeros((128,)), [(4, 64, 128)])
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        mixbits.quantize(mx.zeros((4, 128), dtype=mx.int32), [(4, 64, 128)])


def test_inconsistent_segment_arrays(qt):
    s0, s1 = qt.segments
    with pytest.raises(ValueError, match=r"segments\[1\].wq shape"):
        QuantizedTensor([s0, Segment(3, 32, 64, s1.wq[:4], s1.scales, s1.biases)])
    with pytest.raises(ValueError, match=r"segments\[1\].scales shape"):
        QuantizedTensor([s0, Segment(3, 32, 64, s1.wq, s1.scales[:, :1], s1.biases)])
    with pytest.raises(ValueError, match=r"segments\[1\].biases dtype"):
        QuantizedTensor([s0, Segment(3, 32, 64, s1.wq, s1.scales, s1.biases.astype(mx.float16))])
    with pytest.raises(ValueError, match="uint32"):
        QuantizedTensor([Segment(4, 64, 64, s0.wq.astype(mx.int32), s0.scales, s0.biases)])
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        QuantizedTensor([Segment(4, 64, 64, s0.wq, s0.scales.astype(mx.int32), s0.biases)])


def test_quantized_matmul_errors():
    w = mx.zeros((8, 128))
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.zeros((1, 128))
    with pytest.raises(ValueError, match="bits must be one of"):
        mixbits.quantized_matmul(x, wq, s, b, group_size=64, bits=7)
    with pytest.raises(ValueError, match="group_size must be one of"):
        mixbits.quantized_matmul(x, wq, s, b, group_size=16, bits=4)
    with pytest.raises(ValueError, match=r"scales shape"):
        # group size 32 needs twice the scales this triplet has
        mixbits.quantized_matmul(x, wq, s, b, group_size=32, bits=4)
    with pytest.raises(ValueError, match="K=64"):
        # the same words read as 8-bit cover only 64 columns
        mixbits.quantized_matmul(x, wq, s[:, :1], b[:, :1], group_size=64, bits=8)


def test_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        mixbits.qmatmul(mx.zeros((1, 64)), mixbits.quantize(mx.zeros((2, 64)), [(4, 64, 64)]),
                        backend="gpu")


def test_extension_checks_too(qt):
    """The C++ op builder re-checks what Python checked (defence in depth)."""
    arrs = qt.arrays()
    with pytest.raises(ValueError, match="bits must be one of"):
        _ext.qmatmul(mx.zeros((1, 128)), None, arrs, [(7, 64, 64), (3, 32, 64)])
    with pytest.raises(ValueError, match="3 arrays"):
        _ext.qmatmul(mx.zeros((1, 128)), None, arrs[:5], qt.specs)
    with pytest.raises(ValueError, match="input features"):
        _ext.qmatmul(mx.zeros((1, 100)), None, arrs, qt.specs)
    with pytest.raises(ValueError, match="perm shape"):
        _ext.qmatmul(mx.zeros((1, 128)), mx.arange(5).astype(mx.int32), arrs, qt.specs)
    with pytest.raises(ValueError, match="wq shape"):
        _ext.qmatmul(mx.zeros((1, 128)), None, [arrs[0][:, :3]] + arrs[1:], qt.specs)


def test_backend_names_match_the_extension():
    """Python's name -> enum table is the C++ enum (cpp/common/backend.h)."""
    from mixbits import _ext
    from mixbits._backends import BACKENDS
    assert list(BACKENDS) == _ext.backend_names()
    assert list(BACKENDS.values()) == list(range(len(BACKENDS)))
