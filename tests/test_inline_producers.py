"""Producers run inside their consumers (cpp/common/inline_producer.h).

RMSNorm before a repacked matmul (q/k/v, gate/up, the head), SwiGLU before
one (down_proj), RoPE before the decode cache write and before a decode
attention (kv_len): the consumer takes the producer's inputs and runs the
producer's own code. Checked: the same bits as the consumer on the
producer's evaluated output, the producer's node gone from the graph, a
producer with another consumer still right for both, and consumers with
derivatives (the float-contract qmatmul, attention without kv_len) left
as they were.
"""

from __future__ import annotations

import os
import re
import tempfile

import mlx.core as mx
import numpy as np
import pytest

import mixbits
from mixbits import _ext, ops
from mixbits.activations import swiglu
from mixbits.nn import quantize_stack
from mixbits.norm import rms_norm
from mixbits.rope import rope

K = 192


def nodes(*arrays) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *arrays)
        return re.findall(r'\[label ="?([A-Za-z_]+)', open(path).read())


def rand(shape, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def evaluated(a):
    mx.eval(a)
    return a


def repacked(seed, n=48):
    return ops.repack(mixbits.quantize(rand((n, K), seed), [(4, 32, 128), (8, 64, 64)]))


PRODUCERS = {
    "rms_norm": lambda seed, dtype: rms_norm(rand((2, 1, K), seed, dtype), rand((K,), seed + 1, dtype), 1e-5),
    "rms_norm_heads": lambda seed, dtype: rms_norm(
        rand((2, 1, K), seed, dtype).reshape(2, 1, 3, 64), rand((64,), seed + 1, dtype), 1e-5).reshape(2, 1, K),
    "swiglu": lambda seed, dtype: swiglu(rand((2, 1, K), seed), rand((2, 1, K), seed + 1)),
}


@pytest.mark.parametrize("producer", list(PRODUCERS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_repacked_matmuls_run_their_input_producer(producer, dtype, activations):
    mx.set_default_device(mx.cpu)
    rq, rq2 = repacked(1), repacked(2, n=32)
    name = {"rms_norm": "RmsNorm", "rms_norm_heads": "RmsNorm", "swiglu": "Swiglu"}[producer]
    act = ops.activations_id(activations)
    consumers = [
        lambda x: mixbits.qmatmul(x, rq, activations=activations),
        lambda x: _ext.repacked_qmatmul_group(
            x, [(rq.arrays(), rq.specs, rq.shape[0]), (rq2.arrays(), rq2.specs, rq2.shape[0])], 0, act)[1],
    ]
    for f in consumers:
        x = PRODUCERS[producer](3, dtype)
        y = f(x)
        assert name not in nodes(y), nodes(y)
        # The consumer on the producer's own, evaluated output.
        want = f(evaluated(PRODUCERS[producer](3, dtype)))
        assert y.dtype == want.dtype and y.shape == want.shape
        assert mx.array_equal(y, want).item()


def test_a_producer_with_another_consumer():
    mx.set_default_device(mx.cpu)
    rq = repacked(4)
    n = rms_norm(rand((1, 1, K), 5), rand((K,), 6), 1e-5)
    y, z = mixbits.qmatmul(n, rq, activations="int8"), n * 2.0
    mx.eval(y, z)
    n_eval = evaluated(rms_norm(rand((1, 1, K), 5), rand((K,), 6), 1e-5))
    assert mx.array_equal(y, mixbits.qmatmul(n_eval, rq, activations="int8")).item()
    assert mx.array_equal(z, n_eval * 2.0).item()


def test_consumers_with_derivatives_keep_the_node():
    """The float-contract qmatmul on MLX's layout and a prompt's attention
    differentiate through their inputs: the producer stays a node."""
    mx.set_default_device(mx.cpu)
    qt = mixbits.quantize(rand((48, K), 7), [(4, 32, K)])
    x = rms_norm(rand((1, 1, K), 8), rand((K,), 9), 1e-5)
    assert "RmsNorm" in nodes(mixbits.qmatmul(x, qt))
    q = rope(rand((1, 3, 4, 64), 10), 64, offset=mx.array(0))
    kv = rand((1, 3, 4, 64), 11)
    assert "Rope" in nodes(_ext.causal_attention(q, kv, kv, 0.125))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_decode_cache_write_and_attention_run_rope(dtype):
    mx.set_default_device(mx.cpu)
    B, H, S, D = 1, 3, 12, 64
    off = mx.array(7, dtype=mx.int32)
    heads = lambda seed: rand((B, 1, H * D), seed, dtype).reshape(B, 1, H, D).transpose(0, 2, 1, 3)
    buf = rand((B, H, S, D), 12, dtype)
    # The keys' rope into the cache write.
    got = _ext.kv_write(buf, rope(heads(13), D, offset=off), off)
    assert "Rope" not in nodes(got), nodes(got)
    want = _ext.kv_write(buf, evaluated(rope(heads(13), D, offset=off)), off)
    assert mx.array_equal(got, want).item()
    # The queries' rope into a decode attention (kv_len).
    kv_len = mx.array(8, dtype=mx.int32)
    q = rope(heads(14), D, offset=off)
    got = _ext.causal_attention(q, buf, buf, 0.125, 0, kv_len)
    assert "Rope" not in nodes(got), nodes(got)
    want = _ext.causal_attention(evaluated(rope(heads(14), D, offset=off)), buf, buf, 0.125, 0, kv_len)
    assert mx.array_equal(got, want).item()


def test_shapeless_compile_of_a_fold_refused_on_new_sizes():
    mx.set_default_device(mx.cpu)
    rq = repacked(15)
    w = rand((K,), 16)
    f = mx.compile(lambda a: mixbits.qmatmul(rms_norm(a, w, 1e-5), rq, activations="int8"),
                   shapeless=True)
    a = rand((1, 1, K), 17)
    assert mx.array_equal(f(a), mixbits.qmatmul(evaluated(rms_norm(a, w, 1e-5)), rq,
                                                activations="int8")).item()
    with pytest.raises(ValueError, match="shapeless"):
        mx.eval(f(rand((3, 1, K), 18)))


@pytest.mark.parametrize("producer", ["swiglu", "none"])
@pytest.mark.parametrize("activations", ["int8", "float"])
def test_repacked_expert_stack_reads_lazy_inputs(producer, activations):
    """The gathered product on a repacked expert stack, as an expert MLP
    calls it: x through expand_dims (and from the SwiGLU node before the
    down projection), indices computed in the graph (top-k of a router).
    No contiguous, expand_dims or SwiGLU node; the same bits as on
    evaluated dense inputs."""
    mx.set_default_device(mx.cpu)
    E, k = 6, 2
    stack = ops.repack(quantize_stack(rand((E, 40, K), 19), [(4, 32, 128), (8, 64, 64)]))

    def inputs():
        if producer == "swiglu":
            x = swiglu(rand((3, k, 1, K), 20), rand((3, k, 1, K), 21))  # (tokens, k, 1, K)
        else:
            x = mx.expand_dims(rand((3, K), 20), (-2, -3))  # (tokens, 1, 1, K)
        scores = rand((3, E), 22)
        idx = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k].astype(mx.uint32)
        return x, idx

    x, idx = inputs()
    y = mixbits.gather_qmatmul(x, stack, rhs_indices=idx, activations=activations)
    names = nodes(y)
    for gone in ("Contiguous", "ExpandDims", "Swiglu"):
        assert gone not in names, names
    xe, ie = (evaluated(a) for a in inputs())
    want = mixbits.gather_qmatmul(mx.array(np.array(xe)), stack, rhs_indices=mx.array(np.array(ie)),
                                  activations=activations)
    assert y.shape == want.shape
    assert mx.array_equal(y, want).item()


def test_a_producer_of_a_producer():
    """A query's RMSNorm (q_norm), transposed, into its RoPE, into the cache
    write and into a decode attention: both producers run inside the
    consumer, the inner one first; the same bits."""
    mx.set_default_device(mx.cpu)
    B, H, S, D = 1, 3, 12, 64
    off = mx.array(5, dtype=mx.int32)
    w = rand((D,), 23)

    def rotated(seed):
        heads = rand((B, 1, H * D), seed).reshape(B, 1, H, D)
        return rope(rms_norm(heads, w, 1e-6).transpose(0, 2, 1, 3), D, offset=off)

    buf = rand((B, H, S, D), 24)
    kv_len = mx.array(6, dtype=mx.int32)
    consumers = [lambda x: _ext.kv_write(buf, x, off),
                 lambda x: _ext.causal_attention(x, buf, buf, 0.125, 0, kv_len)]
    for f in consumers:
        y = f(rotated(25))
        names = nodes(y)
        for gone in ("RmsNorm", "Rope", "Transpose"):
            assert gone not in names, names
        assert mx.array_equal(y, f(evaluated(rotated(25)))).item()
