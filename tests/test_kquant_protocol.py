"""bench/kquant.py, llama.cpp's K-quant mixes as quality_protocol contenders,
without any llama.cpp binary (the GGUFs are written here):

- storage bpw from a GGUF's bytes, per ggml type, against hand-computed
  values (super-block scales included);
- the read-back: each protocol site of a K-quant GGUF gets exactly gguf-py's
  decode of its bytes (q/k rows back in HF order, tied embedding);
- the scoring swap: per-sequence KL equals a float64 KL of an mlx-lm model
  holding the same weights, and the evaluator's own layers come back after;
- the F32 reference GGUF: same metadata and tokenizer, every tensor decoded;
- the calibration text tokenizes back to the protocol's tokens.
"""
import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

import gguf
import mlx.core as mx
from gguf import GGMLQuantizationType as T
from gguf_build import write_model
from protocol_models import float_llama_evaluator, kl64
from test_gguf_models import bpe_vocab

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kquant  # noqa: E402

# bits per weight by hand: bytes of one block * 8 / weights in it (ggml's block structs)
HAND_BPW = {
    T.Q2_K: (16 + 64 + 2 + 2) * 8 / 256,        # scales[16], qs[64], d, dmin = 2.625
    T.Q3_K: (32 + 64 + 12 + 2) * 8 / 256,       # hmask[32], qs[64], scales[12], d = 3.4375
    T.Q4_K: (2 + 2 + 12 + 128) * 8 / 256,       # d, dmin, scales[12], qs[128] = 4.5
    T.Q5_K: (2 + 2 + 12 + 32 + 128) * 8 / 256,  # + qh[32] = 5.5
    T.Q6_K: (128 + 64 + 16 + 2) * 8 / 256,      # ql, qh, scales, d = 6.5625
    T.Q8_0: (2 + 32) * 8 / 32,                  # 8.5
    T.Q4_0: (2 + 16) * 8 / 32,                  # 4.5
    T.Q5_0: (2 + 4 + 16) * 8 / 32,              # 5.5
    T.Q5_1: (2 + 2 + 4 + 16) * 8 / 32,          # 6.0
    T.IQ4_NL: (2 + 16) * 8 / 32,                # 4.5
    T.F16: 16.0,
    T.F32: 32.0,
}
COLS = 512


def _write_types(path, rows: dict):
    """A GGUF with one [rows, COLS] tensor per type (random bytes: only sizes matter)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for qtype, n in rows.items():
        if qtype in (T.F16, T.F32):
            w.add_tensor(qtype.name, rng.normal(size=(n, COLS)).astype(np.float16 if qtype == T.F16 else np.float32))
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, size=(n, COLS // block * size), dtype=np.uint8)
            w.add_tensor(qtype.name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bpw_counts_each_types_bytes_as_by_hand(tmp_path):
    path = tmp_path / "types.gguf"
    _write_types(path, {t: 2 for t in HAND_BPW} | {T.Q8_0: 4})
    for t, want in HAND_BPW.items():
        got, types = kquant.gguf_bpw(path, [t.name])
        assert got == pytest.approx(want, abs=1e-12), t.name
        assert types == {t.name: (4 if t == T.Q8_0 else 2) * COLS}
    # several tensors: weighted by their sizes (2 rows of Q2_K, 4 of Q8_0), others not counted
    got, types = kquant.gguf_bpw(path, ["Q2_K", "Q8_0"])
    assert got == pytest.approx((2 * 2.625 + 4 * 8.5) / 6, abs=1e-12)
    assert types == {"Q2_K": 2 * COLS, "Q8_0": 4 * COLS}
    with pytest.raises(ValueError, match="lacks"):
        kquant.gguf_bpw(path, ["Q2_K", "token_embd.weight"])


MIX = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.Q4_0, T.Q5_1, T.IQ4_NL]


def _cycle(kinds):
    it = itertools.cycle(kinds)
    return lambda path, shape: next(it)


def _sites(model):
    from mixbits.adapter import ModelAdapter

    return [s.path for s in ModelAdapter(model).sites]


def _dense(m) -> np.ndarray:
    from mixbits.adapter import dense_weight

    return np.array(dense_weight(m).astype(mx.float32))


@pytest.fixture(scope="module")
def kq_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("kq") / "kq.gguf"
    ref, cfg = write_model(path, "llama", _cycle(MIX), bpe_vocab("smollm"), tied=True, seed=3)
    return path, ref


def test_read_back_sites_are_gguf_py_decodes_in_hf_row_order(kq_model):
    path, ref = kq_model
    sites = _sites(ref)
    assert "model.embed_tokens" in sites and not any("lm_head" in p for p in sites)  # tied: one tensor
    got = kquant.read_back(path, sites)
    from mlx.utils import tree_flatten

    want = dict(tree_flatten(ref.parameters()))
    for p in sites:
        np.testing.assert_array_equal(_dense(got[p]), np.array(want[f"{p}.weight"]), err_msg=p)


def test_score_swaps_sites_in_and_back(kq_model, tmp_path):
    from mlx.utils import tree_flatten

    kq_path, kq_ref = kq_model
    fpath = tmp_path / "float.gguf"
    _, fref, evs, tokens = float_llama_evaluator(fpath, (3, 16))
    got = np.array(kquant.score_gguf(evs, kq_path)["a"])
    # independent: mlx-lm's float model with the K-quant file's decoded sites, KL in float64
    sites = _sites(fref)
    kq_w = dict(tree_flatten(kq_ref.parameters()))
    fref.load_weights([(f"{p}.weight", kq_w[f"{p}.weight"]) for p in sites], strict=False)
    for p, v in tree_flatten(fref.parameters()):
        assert v.dtype == mx.float32, p
    ref_logits = np.concatenate([np.array(lg) for lg in evs["a"].ref_logits]).astype(np.float64)
    q_logits = np.array(fref(mx.array(tokens))).astype(np.float64)
    want = kl64(ref_logits, q_logits)
    assert want.min() > 1e-3  # the swap changed the model
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
    # the evaluator's own layers are back: the reference scores zero
    assert np.abs(evs["a"].sequence_kls({})).max() < 1e-6
    # the float GGUF read back is the reference itself
    assert np.abs(kquant.score_gguf(evs, fpath)["a"]).max() < 1e-6


def test_float_gguf_keeps_metadata_and_decodes_every_tensor(tmp_path):
    src = tmp_path / "q.gguf"
    write_model(src, "llama", _cycle([T.Q4_1, T.Q8_0, T.Q4_K]), bpe_vocab("smollm"), tied=True, seed=5)
    dst = tmp_path / "f32.gguf"
    kquant.write_float_gguf(src, dst)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    keys = [k for k in a.fields if not k.startswith("GGUF.") and k != "general.file_type"]
    assert keys and set(keys) <= set(b.fields)
    for k in keys:
        assert a.fields[k].contents() == b.fields[k].contents(), k
    assert b.fields["general.file_type"].contents() == kquant.ALL_F32
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert tb.tensor_type == T.F32
        np.testing.assert_array_equal(np.asarray(tb.data), gguf.quants.dequantize(ta.data, ta.tensor_type))
    assert {t.tensor_type for t in a.tensors} >= {T.Q4_1, T.Q8_0, T.Q4_K}


def test_calibration_text_tokenizes_back_to_the_protocols_tokens():
    import mixbits
    import quality_protocol as qp

    _, tok, _ = mixbits.load("smollm2")
    calib, _ = qp.token_sets(tok, [0, 1])
    for s in (0, 1):
        text = kquant.calibration_text(tok, calib[s])
        assert np.array_equal(tok.encode(text), calib[s].ravel())
    # a split the tokenizer would not make is refused, not passed on as text
    ab = tok.encode(" the")
    assert len(ab) == 1
    pieces = [tok.encode(" th")[0], tok.encode("e")[0]]
    with pytest.raises(ValueError, match="tokenize back"):
        kquant.calibration_text(tok, np.array(pieces))


class _BosFirst:
    """A tokenizer that prepends BOS to every text, as Gemma's does; its
    windows start with that BOS (the start of a document)."""

    def __init__(self, tok, bos: int):
        self.tok, self.bos_token_id = tok, bos

    def encode(self, text):
        return [self.bos_token_id, *self.tok.encode(text)]

    def decode(self, ids):
        return "".join("<bos>" if i == self.bos_token_id else self.tok.decode([i]) for i in ids)


def test_calibration_text_of_a_bos_first_stream_leaves_the_bos_to_llama_cpp():
    import mixbits

    _, tok, _ = mixbits.load("smollm2")
    body = tok.encode("The licence text, in words that tokenize back.")
    bos = 0  # SmolLM2's <|endoftext|>, standing in for a BOS id
    fake = _BosFirst(tok, bos)
    text = kquant.calibration_text(fake, np.array([bos, *body]))
    assert text == tok.decode(body)  # no '<bos>' spelled as characters
    assert kquant.calibration_text(fake, np.array(body)) == tok.decode(body)
    with pytest.raises(ValueError, match="tokenize back"):  # a BOS inside the stream cannot be written as text
        kquant.calibration_text(fake, np.array([*body[:3], bos, *body[3:]]))
