"""GGUF files of every supported architecture, written here with gguf-py's
GGUFWriter from random weights in many tensor types: ``mixbits.load``
must give the logits of mlx-lm's own model holding the values gguf-py
decodes from the same bytes, and tokenizers must round-trip text.
"""

import itertools

import numpy as np
import pytest

import gguf
import mlx.core as mx
import mlx.nn as nn
from gguf import GGMLQuantizationType as T

import mixbits
from gguf_build import SP, spm_reference_encode, write_model
from mixbits.models.gguf import UnsupportedArchitecture

EXACT_AFFINE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_AND_IQ = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS)


# ---------------------------------------------------------------- vocabularies

def spm_vocab(add_space_prefix=True):
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, pieces ranked by score."""
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>"]
    types = [2, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    chars = [SP, *"abcdefghijklmnopqrstuvwxyz", "T", "H", ".", ",", "1", "2"]
    merged = [SP + "t", "he", SP + "the", "in", SP + "a", "er", SP + "in", "an", SP + SP, "re", "on",
              SP + "th", "ing", SP + "an", SP + "and", "at", "ch", SP + "c", SP + "cat"]
    tokens += merged + chars
    types += [1] * (len(merged) + len(chars))
    tokens.append("\n\n")
    types.append(4)
    scores = [0.0] * 260 + [-float(i) for i in range(len(merged) + len(chars))] + [0.0]
    return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "bos": 1, "eos": 2,
            "unk": 0, "add_bos": True, "add_space_prefix": add_space_prefix}


def _byte_chars():
    """GPT-2's byte -> printable character table."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def bpe_vocab(pre="qwen2"):
    tokens = [_byte_chars()[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("Ġ", "c"),
              ("a", "t"), ("Ġc", "at"), ("Ġ", "Ġ"), ("ĊĊ", "Ċ"), ("Ċ", "Ċ")]
    merges.sort(key=lambda m: m != ("Ċ", "Ċ"))  # "ĊĊ" must exist before "ĊĊĊ"
    tokens += ["".join(m) for m in merges] + ["<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types,
            "merges": [" ".join(m) for m in merges], "eos": len(tokens) - 1}


# ---------------------------------------------------------------- models


def _cycle(kinds):
    it = itertools.cycle(kinds)
    return lambda path, shape: next(it)


CASES = {
    # name: (tensor types cycled over the matrices, tokenizer, tied embeddings)
    "llama": (_cycle([T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.F16, T.BF16, T.Q6_K]), spm_vocab(True), False),
    "qwen2": (_cycle(K_AND_IQ), bpe_vocab("qwen2"), False),
    "qwen3": (_cycle([T.Q8_0, T.Q4_K, T.Q5_0, T.Q6_K, T.F16]), bpe_vocab("qwen2"), True),
    "gemma3_text": (_cycle([T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q5_0]), spm_vocab(False), None),
    "phi3": (_cycle([T.Q4_0, T.Q6_K, T.F16, T.Q3_K]), spm_vocab(True), False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def written(request, tmp_path_factory):
    name = request.param
    types, vocab, tied = CASES[name]
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    ref, cfg = write_model(path, name, types, vocab, tied=tied)
    model, tok, loaded_cfg = mixbits.load(path)
    return name, path, vocab, ref, model, tok, loaded_cfg


def _rel_err(a, b) -> float:
    a, b = np.array(a, np.float64), np.array(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_logits_equal_mlx_lm_model_on_decoded_weights(written):
    name, _, vocab, ref, model, _, cfg = written
    assert cfg["model_type"] == name
    ids = mx.array(np.random.default_rng(1).integers(0, len(vocab["tokens"]), size=(2, 11)))
    got, want = model(ids), ref(ids)
    # Quantized embeddings return fp16 rows (MLX's dequantize rounds d*q to
    # the scales' dtype) while the reference keeps them in float32: that
    # leaves ~1e-3; a wrong name, rope order or norm offset is O(1).
    assert _rel_err(got, want) < 5e-3, name
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


def test_each_tensor_decodes_like_gguf_py(written):
    """Exact affine types (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) become MLX quantized
    layers that dequantize to exactly gguf-py's values; every other tensor
    is gguf-py's float32 decode (Gemma norms minus the 1 llama.cpp added)."""
    from mlx.utils import tree_flatten

    from gguf_build import gguf_name

    name, path, _, ref, model, _, _ = written
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    want = dict(tree_flatten(ref.parameters()))
    bits = {T.Q4_0: 4, T.Q4_1: 4, T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8}
    quantized = set()
    for p, m in model.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            assert (m.group_size, m.bits) == (32, bits[types[gguf_name(name, p + ".weight")]]), p
            deq = mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                                group_size=32, bits=m.bits)
            assert mx.array_equal(deq, want[f"{p}.weight"]).item(), p
            quantized.add(p)
    for p, v in tree_flatten(model.parameters()):
        if p.rsplit(".", 1)[0] in quantized:
            continue
        assert types[gguf_name(name, p)] not in bits, f"{p} should be a quantized layer"
        assert mx.array_equal(v.astype(mx.float32), want[p]).item(), p
    assert quantized or not set(types.values()) & set(bits)


def test_tokenizer_round_trips(written):
    name, _, vocab, _, _, tok, _ = written
    texts = ["the cat and the hat", "Thinking in 12 ways, at once.", "spaces  here and ü 🙂\nnext"]
    if not vocab.get("add_space_prefix"):
        texts += ["spaces  here\n\nand", "the" + "\n\n\n" + "cat"]
    for text in texts:
        assert tok.decode(_strip_bos(tok, tok.encode(text))) == text, (name, text)
    if vocab.get("add_space_prefix"):
        # llama.cpp prefixes every run of text after a special or user-defined
        # token with a space, so such text does not round-trip there either.
        ids = {t: i for i, t in enumerate(vocab["tokens"])}
        assert tok.encode("a\n\nthe")[-2:] == [ids["\n\n"], ids[SP + "the"]]
    if vocab["model"] == "llama":
        for text in ["the cat and the hat", "Thinking in 12 ways, at once.", "an ü cat  in"]:
            assert tok.encode(text) == spm_reference_encode(vocab, text), text
        assert tok.encode("<start_of_turn>")[-1] == 3  # control tokens are single ids
    else:
        ids = {t: i for i, t in enumerate(vocab["tokens"])}
        assert tok.encode(" the cat") == [ids["Ġthe"], ids["Ġcat"]]
        assert tok.encode("the") == [ids["t"], ids["he"]]
        assert tok.encode("<|endoftext|>") == [vocab["eos"]]


def _strip_bos(tok, ids):
    return ids[1:] if tok.add_bos and ids and ids[0] == tok.bos_token_id else ids


def test_kquant_blocks_reach_the_model_as_gguf_py_decodes_them(written):
    """The K/IQ types are really in the files (not silently re-encoded)."""
    name, path, _, _, _, _, _ = written
    present = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    if name == "qwen2":
        assert set(K_AND_IQ) <= present
    if name == "llama":
        assert set(EXACT_AFFINE) | {T.F16, T.BF16, T.Q6_K} <= present


# ---------------------------------------------------------------- errors


def test_unsupported_architecture_is_named_before_tensors_are_read(tmp_path):
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    # Q8_1 cannot be decoded by gguf-py: reaching the tensors would fail differently.
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=T.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitecture, match="'mamba'.*supported: llama, qwen2, qwen3, gemma3, phi3"):
        mixbits.load(path)


def test_undecodable_tensor_type_named(tmp_path):
    path = tmp_path / "q81.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in (("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                   ("attention.head_count", 2)):
        w.add_uint32(f"llama.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((4, 40), np.uint8), raw_dtype=T.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(mixbits.errors.FormatError, match="token_embd.weight.*Q8_1"):
        mixbits.load(path)


def test_saved_folder_loads_in_mlx_lm_with_same_logits_and_tokens(written, tmp_path):
    """What the loader builds is a plain mlx-lm model: save it, load the
    folder with mlx_lm.load, same logits and token ids."""
    import mlx_lm

    name, _, vocab, _, model, tok, cfg = written
    mixbits.save(model, tmp_path / "m", cfg, tok)
    loaded, tok2 = mlx_lm.load(str(tmp_path / "m"))
    ids = mx.array(np.random.default_rng(2).integers(0, len(vocab["tokens"]), size=(1, 9)))
    assert mx.array_equal(loaded(ids), model(ids)).item(), name
    text = "the cat and the hat, 12 at once"
    assert tok2.encode(text) == tok.encode(text), name
