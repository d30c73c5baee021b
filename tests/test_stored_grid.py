"""A tensor already stored on a candidate's grid keeps its codes when
quantized at that candidate (``build_layer`` -> ``stored_at``): a GGUF's
Q5_0 tensor at 5b_g32, a Q4_1 one at 4b_g32. Re-quantizing the decoded
weight by min-max rounding instead moves the codes of every group whose
values miss an end of the grid -- error where there was none.

The reference is MLX's own ``mx.dequantize`` of the source layer's arrays;
the counter-check is MLX's ``mx.quantize`` of the same decoded weight,
which must differ on these inputs (else the test could not see the rule).
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.adapter import dense_weight
from mixbits.measure.candidates import build_layer, parse_candidate, stored_at


def _inner_codes(q, bits, seed):
    """``q`` (a stock quantized layer) with codes drawn inside the grid,
    never at either end, so min-max re-quantization cannot find it."""
    rng = np.random.default_rng(seed)
    per_word = 32 // bits if 32 % bits == 0 else None
    n, k = q.weight.shape[0], q.weight.shape[1] * 32 // bits
    codes = rng.integers(1, 2 ** bits - 1, size=(n, k)).astype(np.uint64)
    # Pack little-endian, bits per code, into uint32 words (MLX's layout).
    words = np.zeros((n, k * bits // 32), dtype=np.uint64)
    for j in range(k):
        bit = j * bits
        w, off = divmod(bit, 32)
        words[:, w] |= (codes[:, j] << off) & 0xFFFFFFFF
        if off + bits > 32:
            words[:, w + 1] |= codes[:, j] >> (32 - off)
    del per_word
    q.weight = mx.array(words.astype(np.uint32))
    # float16 scales and biases, as a GGUF's blocks load (and the sweep stores).
    q.scales, q.biases = q.scales.astype(mx.float16), q.biases.astype(mx.float16)
    return q


def _source_linear(bits, gs, n=24, k=128, seed=0):
    lin = nn.Linear(k, n, bias=False)
    lin.weight = mx.array(np.random.default_rng(seed).normal(size=(n, k)).astype(np.float32))
    q = lin.to_quantized(group_size=gs, bits=bits)
    return _inner_codes(q, bits, seed)


def _mlx_decoded(m):
    """MLX's decoding of the layer's arrays, in float32 (scales widened)."""
    f32 = mx.float32
    return mx.dequantize(m.weight, m.scales.astype(f32), m.biases.astype(f32), group_size=m.group_size,
                         bits=m.bits)


@pytest.mark.parametrize("bits,gs", [(5, 32), (4, 32), (8, 32), (3, 64), (6, 64)])
@pytest.mark.parametrize("quantizer", ["", "+search", "+gptq"])
def test_linear_on_its_own_grid_keeps_its_codes(bits, gs, quantizer):
    src = _source_linear(bits, gs, seed=bits * 7 + gs)
    ref = _mlx_decoded(src)
    cand = parse_candidate(f"{bits}b_g{gs}{quantizer}")
    inputs = None
    if quantizer == "+gptq":
        x = np.random.default_rng(1).normal(size=(64, 128))
        inputs = (mx.array(x.T @ x), 64)
    out = build_layer(src, cand, mx.float16, inputs=inputs)
    np.testing.assert_array_equal(np.array(dense_weight(out)), np.array(ref))
    # Min-max rounding of the same decoded weight lands elsewhere.
    wq, s, b = mx.quantize(ref, group_size=gs, bits=bits)
    rtn = mx.dequantize(wq, s.astype(mx.float16).astype(mx.float32), b.astype(mx.float16).astype(mx.float32),
                        group_size=gs, bits=bits)
    assert not np.array_equal(np.array(rtn), np.array(ref))


def test_embedding_on_its_own_grid_keeps_its_codes():
    emb = nn.Embedding(64, 128)
    emb.weight = mx.array(np.random.default_rng(3).normal(size=(64, 128)).astype(np.float32))
    src = _inner_codes(emb.to_quantized(group_size=32, bits=8), 8, seed=3)
    out = build_layer(src, parse_candidate("8b_g32+search"), mx.float16)
    np.testing.assert_array_equal(np.array(dense_weight(out)), np.array(_mlx_decoded(src)))


def test_expert_stack_on_its_own_grid_keeps_its_codes():
    from mlx_lm.models.switch_layers import SwitchLinear

    stack = SwitchLinear(128, 16, 3, bias=False)
    stack.weight = mx.array(np.random.default_rng(4).normal(size=(3, 16, 128)).astype(np.float32))
    src = stack.to_quantized(group_size=32, bits=5)
    w = np.array(src.weight)
    for e in range(3):  # each expert's codes off the grid's ends, as above
        one = _inner_codes(nn.Linear(128, 16, bias=False).to_quantized(group_size=32, bits=5), 5, seed=e)
        w[e] = np.array(one.weight)
    src.weight = mx.array(w)
    src.scales, src.biases = src.scales.astype(mx.float16), src.biases.astype(mx.float16)
    ref = _mlx_decoded(src)
    out = build_layer(src, parse_candidate("5b_g32"), mx.float16)
    np.testing.assert_array_equal(np.array(dense_weight(out)), np.array(ref))


def test_other_grids_and_inexact_scales_are_quantized_afresh():
    src = _source_linear(5, 32)
    # Another group size or width: quantized from the decoded weight.
    assert stored_at(src, parse_candidate("5b_g64"), mx.float16) is None
    assert stored_at(src, parse_candidate("4b_g32"), mx.float16) is None
    assert stored_at(src, parse_candidate("4b10_3b_g32"), mx.float16) is None
    # float16 scales kept as float16: exact; float32 scales with more
    # mantissa than float16 holds are not kept (casting would move them).
    assert stored_at(src, parse_candidate("5b_g32"), mx.float16) is not None
    src.scales = src.scales.astype(mx.float32) * (1 + 2.0 ** -20)
    assert stored_at(src, parse_candidate("5b_g32"), mx.float16) is None
    # A float module has nothing stored.
    assert stored_at(nn.Linear(128, 8), parse_candidate("5b_g32"), mx.float16) is None


@pytest.fixture(scope="module")
def stored_5bit(tmp_path_factory):
    """A tiny llama stored at 5-bit g32 (every linear and the embedding),
    float16 scales: what a GGUF of Q5_0 tensors loads as."""
    import mixbits
    import tiny_models

    d = tmp_path_factory.mktemp("stored")
    model, cfg = tiny_models.build("llama", dtype=mx.float16)
    nn.quantize(model, group_size=32, bits=5)
    cfg = {**cfg, "quantization": {"group_size": 32, "bits": 5}}
    mixbits.save(model, d / "model", cfg)
    np.save(d / "tokens.npy", np.random.default_rng(5).integers(0, 160, (2, 16)))
    return d


def test_convert_keeps_a_stored_grid_the_budget_affords(stored_5bit, tmp_path, capsys):
    """At 6.0 bpw every tensor can stay at its stored 5b_g32: convert adds
    that kind to both menus (printed), chooses it, and the saved folder's
    weights are the source's, to the bit, by MLX's own decoding of each."""
    import mixbits
    from mixbits.cli import main

    src, out = stored_5bit / "model", tmp_path / "q"
    argv = ["convert", "--model", str(src), "--tokens", str(stored_5bit / "tokens.npy"), "--bpw", "6.0",
            "--method", "grad", "--quantizer", "rtn", "--max-evals", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "stored grids: 5b_g32 in every menu" in printed
    work = json.loads((tmp_path / "q.work" / "settings.json").read_text())
    assert "5b_g32" not in work["candidates"]  # follows from the model: not a setting
    alloc = json.loads((out / "allocation.json").read_text())
    assert {a["kind"] for a in alloc["assignment"]} == {"5b_g32"}
    assert "5b_g32" in alloc["menu"]["candidates"]["default"]
    source, _, _ = mixbits.load(src)
    saved, _, _ = mixbits.load(out)
    src_mods, out_mods = dict(source.named_modules()), dict(saved.named_modules())
    for a in alloc["assignment"]:
        np.testing.assert_array_equal(np.array(dense_weight(out_mods[a["path"]])),
                                      np.array(_mlx_decoded(src_mods[a["path"]])), err_msg=a["path"])
    # A rerun finds its settings equal (the added kind is not among them) and keeps every stage.
    assert main(argv) == 0
    assert "kept from the last run" in capsys.readouterr().out


def test_candidates_as_given_get_no_stored_grid(stored_5bit, tmp_path, capsys):
    from mixbits.cli import main

    argv = ["convert", "--model", str(stored_5bit / "model"), "--tokens", str(stored_5bit / "tokens.npy"),
            "--bpw", "4.5", "--method", "grad", "--candidates", "4b_g64", "8b_g64", "--max-evals", "1",
            "--out", str(tmp_path / "q"), "--dry-run"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "stored grids" not in printed and "5b_g32" not in printed


def test_time_budget_rerun_matches_its_settings(stored_5bit, tmp_path, capsys):
    """With --time-budget the settings are written after the model loads
    (the probe picks the method): the added stored kind must stay out of
    them, or the rerun -- checked before the load -- is refused."""
    from mixbits.cli import main

    argv = ["convert", "--model", str(stored_5bit / "model"), "--tokens", str(stored_5bit / "tokens.npy"),
            "--bpw", "6.0", "--time-budget", "30", "--quantizer", "rtn", "--max-evals", "1",
            "--out", str(tmp_path / "q")]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    assert "kept from the last run" in capsys.readouterr().out
