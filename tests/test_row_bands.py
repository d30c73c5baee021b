"""Row-banded embeddings (``8b@R_<kind>``, mixbits.nn.RowBandEmbedding): the
first R rows at their own bits, the rest at the kind. References: each
band's rows quantized by ``mx.quantize`` and decoded in float64 numpy;
storage counted from the format (codes + fp16 scale and bias per group);
a folder read back by mixbits.load and by stock mlx-lm's loader."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
from mixbits.adapter import ModelAdapter, dense_weight, weighted_weight_error
from mixbits.errors import FormatError
from mixbits.measure.candidates import (BANDED_CANDIDATES, DEFAULT_CANDIDATES, build_layer, parse_candidate,
                                        supports)
from mixbits.measure.sweep import storage_bits
from mixbits.nn import RowBandEmbedding, repack_layers, set_module, unrepack_layers
from tiny_model import tiny_llama


def _reference(w16: np.ndarray, rows: int, hot_bits: int, bits: int, gs: int):
    """Each band quantized by MLX's own quantizer: its (codes, scales,
    biases), the table as mx.dequantize decodes it (float16, what a lookup
    returns) and in float64 (s * q + b)."""
    arrays, out, mlx16 = [], [], []
    for part, b in ((w16[:rows], hot_bits), (w16[rows:], bits)):
        q, s, z = mx.quantize(mx.array(part), group_size=gs, bits=b)
        arrays.append((q, s, z))
        mlx16.append(np.array(mx.dequantize(q, s, z, group_size=gs, bits=b)))
        # the integer codes (exact at unit scale, zero bias), then s * q + b in float64
        codes = np.array(mx.dequantize(q, mx.ones_like(s), mx.zeros_like(z), group_size=gs, bits=b)
                         .astype(mx.float32), dtype=np.float64)
        rep = lambda a: np.repeat(np.array(a.astype(mx.float32), dtype=np.float64), gs, axis=-1)
        out.append(rep(s) * codes + rep(z))
    return arrays, np.concatenate(mlx16), np.concatenate(out)


@pytest.mark.parametrize("seed", range(4))
def test_lookups_and_tied_head_match_mlx_band_by_band(seed):
    rng = np.random.default_rng(seed)
    gs = int(rng.choice([32, 64]))
    vocab, dims = int(rng.integers(70, 300)), gs * int(rng.integers(1, 4))
    rows, hot_bits, bits = int(rng.integers(1, vocab)), int(rng.choice([6, 8])), int(rng.choice([2, 3, 4]))
    emb = nn.Embedding(vocab, dims)
    emb.weight = mx.array(rng.standard_normal((vocab, dims)).astype(np.float16))
    layer = build_layer(emb, parse_candidate(f"{hot_bits}b@{rows}_{bits}b_g{gs}"), mx.float16)
    assert isinstance(layer, RowBandEmbedding) and layer.rows == (rows, vocab - rows)
    arrays, ref16, ref = _reference(np.array(emb.weight), rows, hot_bits, bits, gs)
    for band, (q, sc, z) in zip(layer.bands, arrays):  # MLX's codes, scales and biases
        seg = band.quantized_tensor().segments[0]
        assert all(mx.array_equal(a, b).item() for a, b in ((seg.wq, q), (seg.scales, sc), (seg.biases, z)))

    edges = [0, rows - 1, rows, vocab - 1]
    ids = np.array(edges + list(rng.integers(0, vocab, 20))).reshape(2, -1)
    np.testing.assert_array_equal(np.array(layer(mx.array(ids))), ref16[ids])

    x = rng.standard_normal((3, dims)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T
    np.testing.assert_allclose(np.array(layer.as_linear(mx.array(x))), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    np.testing.assert_allclose(np.array(dense_weight(layer)), ref, rtol=1e-6, atol=1e-6)

    # codes: bits per weight; fp16 scale and bias per group of each row
    want_bits = rows * dims * hot_bits + (vocab - rows) * dims * bits + vocab * (dims // gs) * 32
    site = next(s for s in ModelAdapter(_holder(emb)).sites)
    assert storage_bits(layer, site) == want_bits
    w = rng.standard_normal((vocab, dims)).astype(np.float32)
    h = rng.random((vocab, dims)).astype(np.float32)
    assert weighted_weight_error(layer, mx.array(w), mx.array(h)) == pytest.approx(
        float((h * (ref - w) ** 2).sum()), rel=1e-4)


def _holder(emb):
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = emb

    return Holder()


def test_candidate_names_and_where_they_fit():
    c = parse_candidate("8b@4096_4b_g64+search")
    hot, rest = c.bands()
    assert (c.hot_rows, c.hot_bits, hot.name, rest.name) == (4096, 8, "8b_g64+search", "4b_g64+search")
    assert parse_candidate("6b@10_4b10_3b_g32").bands()[1].name == "4b10_3b_g32"
    for bad in ("8b@4096_mxfp4", "8b@0_4b_g64", "8b@64_8b@4_4b_g64", "8b@64_4b_g64+gptq",
                "7b@64_4b_g64", "8b@64_4b_g48"):
        with pytest.raises(ValueError, match="candidate"):
            parse_candidate(bad)
    assert set(BANDED_CANDIDATES) <= set(DEFAULT_CANDIDATES)

    model = tiny_llama()  # vocab 256, tied
    sites = {s.form: s for s in ModelAdapter(model).sites}
    assert supports(parse_candidate("8b@64_4b_g32"), sites["embedding"])
    assert not supports(parse_candidate("8b@256_4b_g32"), sites["embedding"])  # no rows left
    assert not supports(parse_candidate("8b@64_4b_g32"), sites["linear"])
    with pytest.raises(ValueError, match="embeddings"):
        build_layer(model.model.layers[0].mlp.up_proj, parse_candidate("8b@64_4b_g32"))


@pytest.fixture(scope="module")
def banded_folder(tmp_path_factory):
    model = tiny_llama()
    layer = build_layer(model.model.embed_tokens, parse_candidate("8b@100_3b_g32"), mx.float16)
    set_module(model, "model.embed_tokens", layer)
    folder = tmp_path_factory.mktemp("bands") / "m"
    mixbits.save(model, folder)
    return model, folder


IDS = mx.array([[0, 99, 100, 255, 17, 180, 3]])


def test_folder_reads_back_in_mixbits_and_stock_mlx_lm(banded_folder):
    from mlx_lm.utils import load_model

    model, folder = banded_folder
    want = np.array(model(IDS))
    cfg = json.loads((folder / "config.json").read_text())
    desc = cfg["mixbits"]["layers"]["model.embed_tokens"]
    assert [b["segments"] for b in desc["bands"]] == [[[8, 32, 64]], [[3, 32, 64]]]
    assert cfg["model_file"] == "mixbits_model.py"  # not loadable by mlx-lm's own classes
    got, _, _ = mixbits.load(folder)
    assert isinstance(got.model.embed_tokens, RowBandEmbedding)
    np.testing.assert_array_equal(np.array(got(IDS)), want)
    stock, _ = load_model(folder, trust_remote_code=True)
    np.testing.assert_array_equal(np.array(stock(IDS)), want)


def test_bad_band_descriptors_are_format_errors(banded_folder):
    from mixbits.io import place_layers

    _, folder = banded_folder
    weights = mx.load(str(folder / "model.safetensors"))
    good = json.loads((folder / "config.json").read_text())["mixbits"]["layers"]["model.embed_tokens"]
    for edit, match in [
        (lambda d: d["bands"].pop(), "two or more"),
        (lambda d: d.__setitem__("bands", "x"), "two or more"),
    ]:
        desc = json.loads(json.dumps(good))
        edit(desc)
        with pytest.raises(FormatError, match=match):
            place_layers(tiny_llama(), {"model.embed_tokens": desc}, weights)
    short = {k: v[:-1] if ".bands.1." in k else v for k, v in weights.items()}  # a row lost
    with pytest.raises(FormatError, match="do not make"):
        place_layers(tiny_llama(), {"model.embed_tokens": good}, short)
    with pytest.raises(FormatError, match="not an embedding"):
        place_layers(tiny_llama(), {"model.layers.0.mlp.up_proj": good}, weights)


def test_repacked_bands_give_the_same_model(banded_folder):
    model, _ = banded_folder
    want = np.array(model(IDS))
    assert any(p.startswith("model.embed_tokens.bands.") for p in repack_layers(model))
    try:
        np.testing.assert_allclose(np.array(model(IDS)), want, rtol=1e-4, atol=1e-4)
    finally:
        unrepack_layers(model)
    np.testing.assert_array_equal(np.array(model(IDS)), want)


def test_measure_allocate_quantize_load_with_a_banded_embedding(tmp_path):
    import tiny_models
    from mixbits.cli import main
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.formats.allocation import Allocation, AllocationEntry

    model, cfg = tiny_models.build("llama_tied")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = np.random.default_rng(0).integers(0, 160, (2, 16))
    np.save(tmp_path / "t.npy", toks)
    m, t = str(tmp_path / "m"), str(tmp_path / "t.npy")
    kinds = ["4b_g32", "8b@64_2b_g32"]
    assert main(["measure", "--model", m, "--tokens", t, "--candidates", *kinds,
                 "--out", str(tmp_path / "table.json")]) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    by_path = {e["path"]: e for e in table["entries"]}
    emb = by_path["model.embed_tokens"]
    vocab, dims = emb["shape"]
    banded = next(c for c in emb["candidates"] if c["kind"] == "8b@64_2b_g32")
    assert banded["storage_bits"] == 64 * dims * 8 + (vocab - 64) * dims * 2 + vocab * dims // 32 * 32
    assert all(len(e["candidates"]) == 1 for p, e in by_path.items() if p != "model.embed_tokens")

    entries = []
    for e in table["entries"]:
        c = e["candidates"][-1]  # the embedding's banded kind, 4b_g32 elsewhere
        entries.append(AllocationEntry(e["path"], e.get("layer"), e["nparams"], c["bits"], c["kind"],
                                       c["kl"], {"storage_bits": c["storage_bits"]}))
    alloc = tmp_path / "alloc.json"
    Allocation.from_entries(entries).save(alloc)
    assert main(["quantize", "--model", m, "--allocation", str(alloc), "--out", str(tmp_path / "q")]) == 0
    loaded, _, _ = mixbits.load(tmp_path / "q")
    assert isinstance(loaded.model.embed_tokens, RowBandEmbedding)
    assert loaded.model.embed_tokens.rows == (64, vocab - 64)
    ref = mixbits.load(m)[0]
    quantize_candidates(ref, allocation_candidates(alloc, ref), tokens=toks)
    np.testing.assert_array_equal(np.array(loaded(mx.array(toks))), np.array(ref(mx.array(toks))))


@pytest.mark.parametrize("kind", ["4b_g32", "3b_g32+search", "mxfp4"])
def test_a_banded_embedding_requantizes_as_an_embedding(kind):
    # A saved banded folder measured or converted again: each candidate of
    # its embedding is built from the bands' decode, as an embedding.
    from mixbits.nn import MixedQuantizedEmbedding

    rng = np.random.default_rng(3)
    emb = nn.Embedding(300, 64)
    emb.weight = mx.array(rng.standard_normal((300, 64)).astype(np.float16))
    banded = build_layer(emb, parse_candidate("8b@100_2b_g32"), mx.float16)
    got = build_layer(banded, parse_candidate(kind), mx.float16)
    plain = nn.Embedding(300, 64)
    plain.weight = dense_weight(banded).astype(mx.float16)
    want = build_layer(plain, parse_candidate(kind), mx.float16)
    assert type(got) is type(want) and isinstance(got, (MixedQuantizedEmbedding, nn.QuantizedEmbedding))
    ids = mx.array([[0, 99, 100, 299]])
    np.testing.assert_array_equal(np.array(got(ids).astype(mx.float32)), np.array(want(ids).astype(mx.float32)))
