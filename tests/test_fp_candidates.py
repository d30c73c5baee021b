"""MLX's floating-point modes as candidates: ``mxfp4``, ``nvfp4``,
``mxfp8``. Names and errors, the layers they build (MLX's own quantized
classes, in every form MLX supports the mode for), their storage counted
from the arrays, and the gradient proxy's weight error, against float64
of ``mx.dequantize``."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import tiny_models
from mixbits.adapter import ModelAdapter, dense_weight
from mixbits.measure.candidates import (FP_MODES, PRESETS, build_layer, expand_candidates, parse_candidate,
                                        supports)
from mixbits.measure.grad import estimate
from mixbits.measure.sweep import storage_bits

# mode -> (group size, bits, storage bits per weight: codes + one uint8 scale per group)
EXPECT = {"mxfp4": (32, 4, 4 + 8 / 32), "nvfp4": (16, 4, 4 + 8 / 16), "mxfp8": (32, 8, 8 + 8 / 32)}


@pytest.mark.parametrize("mode", list(EXPECT))
def test_names(mode):
    gs, bits, _ = EXPECT[mode]
    c = parse_candidate(mode)
    assert (c.name, c.kind, c.mode, c.group_size, c.bits, c.nominal_bits) == (mode, "fp", mode, gs, bits, bits)
    assert parse_candidate(f"{mode}_g{gs}") == c  # the fixed group size may be written, one name
    with pytest.raises(ValueError, match=f"{mode} mode has group size {gs}"):
        parse_candidate(f"{mode}_g64" if gs != 64 else f"{mode}_g128")
    with pytest.raises(ValueError, match="affine kinds only"):
        parse_candidate(f"{mode}+gptq")
    with pytest.raises(ValueError, match="affine kinds only"):
        parse_candidate(f"{mode}+search")


def test_presets_and_unknown_names():
    assert PRESETS["fp"] == ("mxfp4", "nvfp4", "mxfp8")
    assert set(PRESETS["wide"]) < set(PRESETS["all"]) and set(PRESETS["fp"]) < set(PRESETS["all"])
    assert expand_candidates(["4b_g64", "fp", "mxfp4_g32"]) == ["4b_g64", "mxfp4", "nvfp4", "mxfp8"]
    with pytest.raises(ValueError, match="MLX's fp modes 'mxfp4', 'nvfp4', 'mxfp8'"):
        parse_candidate("fp4")


def _linear(k=128, n=48, bias=True, dtype=mx.float32):
    mx.random.seed(3)
    lin = nn.Linear(k, n, bias=bias)
    lin.update({"weight": lin.weight.astype(dtype)})
    return lin


def _f64(a):
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("mode", list(EXPECT))
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_linear_layer(mode, dtype):
    gs, bits, _ = EXPECT[mode]
    lin = _linear(dtype=dtype)
    q = build_layer(lin, parse_candidate(mode))
    assert type(q) is nn.QuantizedLinear and (q.mode, q.group_size, q.bits) == (mode, gs, bits)
    assert q.get("biases") is None and q["scales"].dtype == mx.uint8
    # Codes from the weight in its own dtype, as MLX's own conversion makes them.
    wq, s = mx.quantize(lin.weight, gs, bits, mode=mode)
    assert mx.array_equal(q["weight"], wq).item() and mx.array_equal(q["scales"], s).item()
    w64 = _f64(mx.dequantize(wq, s, group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
    np.testing.assert_array_equal(np.array(dense_weight(q), dtype=np.float64), w64)
    x = mx.random.normal((5, 128)).astype(dtype)
    ref = _f64(x) @ w64.T + _f64(lin.bias)
    tol = {mx.float32: 1e-5, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    assert np.abs(_f64(q(x)) - ref).max() <= tol * np.abs(ref).max()


@pytest.mark.parametrize("mode", list(EXPECT))
def test_storage_and_proxy_error(mode):
    """Storage as stored (the arrays' bytes) and the gradient proxy's
    0.5 sum F (W_c - W)^2 / tokens, against float64 of mx.dequantize."""
    model, _ = tiny_models.build("llama")
    ad = ModelAdapter(model)
    site = next(s for s in ad.sites if s.path.endswith("mlp.down_proj"))
    orig = ad.get(site.path)
    q = build_layer(orig, parse_candidate(mode))
    assert storage_bits(q, site) == sum(q[k].nbytes * 8 for k in ("weight", "scales"))
    assert storage_bits(q, site) / site.nparams == EXPECT[mode][2]
    dense = dense_weight(orig)
    fisher = mx.abs(mx.random.normal(dense.shape, key=mx.random.key(2)))
    gs, bits, _ = EXPECT[mode]
    deq = _f64(mx.dequantize(q["weight"], q["scales"], group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
    want = 0.5 * np.sum(_f64(fisher) * (deq - _f64(dense)) ** 2) / 32
    assert estimate(fisher, 32, dense, q) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("mode", list(EXPECT))
def test_embedding_and_tied_head(mode):
    model, _ = tiny_models.build("llama")
    emb = model.model.embed_tokens
    q = build_layer(emb, parse_candidate(mode))
    assert type(q) is nn.QuantizedEmbedding and q.mode == mode
    gs, bits, _ = EXPECT[mode]
    w64 = _f64(mx.dequantize(q["weight"], q["scales"], group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
    ids = mx.array([[0, 5, 17, 159]])
    np.testing.assert_array_equal(_f64(q(ids)), w64[np.array(ids)])
    x = mx.random.normal((3, w64.shape[1]))
    np.testing.assert_allclose(_f64(q.as_linear(x)), _f64(x) @ w64.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", list(EXPECT))
def test_expert_stack(mode):
    """mlx-lm's QuantizedSwitchLinear takes the mode: an expert stack at an
    fp candidate is that class, each expert its own dequantized matrix."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    model, _ = tiny_models.build("qwen3_moe")
    ad = ModelAdapter(model)
    site = next(s for s in ad.sites if s.experts)
    cand = parse_candidate(mode)
    assert supports(cand, site)
    q = build_layer(ad.get(site.path), cand)
    assert type(q) is QuantizedSwitchLinear and q.mode == mode
    gs, bits, bpw = EXPECT[mode]
    assert storage_bits(q, site) / site.nparams == bpw
    w64 = _f64(mx.dequantize(q["weight"], q["scales"], group_size=gs, bits=bits, mode=mode, dtype=mx.float32))
    x = mx.random.normal((3, 1, 1, w64.shape[-1]))
    idx = mx.array([[0, 2], [1, 3], [3, 3]])
    y = _f64(q(x, idx))  # (3, 2, 1, N)
    ref = np.stack([np.stack([_f64(x[i, 0]) @ w64[int(idx[i, j])].T for j in range(2)]) for i in range(3)])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_fp_kinds_do_not_fit_where_k_is_not_a_multiple():
    """The fixed group size decides where an fp kind fits (nvfp4's 16
    fits where mxfp4's 32 does not)."""
    from mixbits.adapter import Site

    site = Site("x.proj", 0, (8, 48), "linear")
    assert supports(parse_candidate("nvfp4"), site)
    assert not supports(parse_candidate("mxfp4"), site) and not supports(parse_candidate("mxfp8"), site)
    assert FP_MODES["nvfp4"] == (16, 4)


@pytest.mark.parametrize("mode", list(EXPECT))
def test_multi_head_stack(mode):
    """MLA's multi-head stacks (mlx-lm's MultiLinear) take fp kinds as
    their own QuantizedMultiLinear, float or already quantized."""
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

    mx.random.seed(4)
    m = MultiLinear(64, 32, 4)
    gs, bits, _ = EXPECT[mode]
    for src in (m, build_layer(m, parse_candidate("4b_g64"))):
        q = build_layer(src, parse_candidate(mode))
        assert type(q) is QuantizedMultiLinear and (q.mode, q.group_size, q.bits) == (mode, gs, bits)
        w64 = _f64(mx.dequantize(q["weight"], q["scales"], group_size=gs, bits=bits, mode=mode,
                                 dtype=mx.float32))
        x = mx.random.normal((2, 4, 3, 64))
        ref = _f64(x) @ np.swapaxes(w64, -1, -2)
        np.testing.assert_allclose(_f64(q(x)), ref, rtol=1e-5, atol=1e-5)
