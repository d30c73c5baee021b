"""A GGUF whose tensor data holds 0xFF bytes (NaN fp16 block scales)
loaded and generated end-of-text tokens without a word. Now the tensor is
named as it is decoded; MIXBITS_ALLOW_NONFINITE=1 loads it anyway."""

from __future__ import annotations

import shutil

import gguf
import mlx.core as mx
import pytest
from gguf import GGMLQuantizationType as T

import mixbits
from gguf_build import write_model
from mixbits.errors import FormatError
from test_gguf_models import bpe_vocab


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    path = tmp_path_factory.mktemp("nan") / "clean.gguf"
    # Q4_0 (decoded to an MLX affine triplet) except the MLPs' down_proj, Q6_K (decoded densely)
    write_model(path, "qwen2", lambda p, s: T.Q6_K if "down_proj" in p else T.Q4_0, bpe_vocab())
    return path


def _damaged(clean, tmp_path, tensor: str):
    """A copy of ``clean`` with up to 4 KB of 0xFF over ``tensor``'s data."""
    t = {t.name: t for t in gguf.GGUFReader(clean).tensors}[tensor]
    out = tmp_path / "damaged.gguf"
    shutil.copy(clean, out)
    with open(out, "r+b") as f:
        f.seek(t.data_offset)
        f.write(b"\xff" * min(4096, int(t.n_bytes)))
    return out


@pytest.mark.parametrize("tensor, what", [("blk.0.attn_q.weight", "block scales"),
                                          ("blk.1.ffn_down.weight", "values")])
def test_nan_block_scales_are_named(clean, tmp_path, tensor, what):
    mixbits.load(clean)  # the undamaged file loads
    bad = _damaged(clean, tmp_path, tensor)
    with pytest.raises(FormatError, match=f"GGUF tensor '{tensor}' .*{what} are NaN or infinite"):
        mixbits.load(bad)


def test_opt_out_loads_the_damaged_file(clean, tmp_path, monkeypatch):
    bad = _damaged(clean, tmp_path, "blk.0.attn_q.weight")
    monkeypatch.setenv("MIXBITS_ALLOW_NONFINITE", "1")
    model, _, _ = mixbits.load(bad)
    logits = model(mx.array([[1, 2, 3]]))
    assert not mx.all(mx.isfinite(logits)).item()  # what the check stood in front of
