"""The block-by-block Fisher pass (mixbits.measure.fisher_blocks) against
the whole-model pass it replaces: the same Fisher diagonal, output-gradient
energies and grad table (same seed, float tolerance) on tiny models of the
shapes that stress it -- a plain llama, a tied head, gemma3 (a VLM wrapper,
sliding windows, scaled embeddings), qwen3_moe (expert stacks), qwen3_5
(linear-attention hybrid), gemma3n (AltUp streams written in place after
the last block, per-layer inputs made from the embeddings) -- and from a
model whose weights stay on disk. Models it cannot chain fall back to the
whole-model pass with a warning, never to other numbers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import tiny_models
from mixbits.adapter import ModelAdapter
from mixbits.measure import fisher_blocks
from mixbits.measure.grad import fisher_diagonal

ARCHS = ["llama", "llama_tied", "gemma3", "qwen3_moe", "qwen3_5"]


def _tokens(n=5, t=12):
    return np.random.default_rng(1).integers(0, 160, (n, t))


def _both(model, toks, sites, **kw):
    """(block-wise, whole-model) Fisher and energies; the block-wise one
    must have run block by block (no fallback warning)."""
    runs = []
    for blockwise in (True, False):
        energy: dict = {}
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            fisher, n = fisher_diagonal(model, toks, sites, progress=False, out_energy=energy,
                                        blockwise=blockwise, **kw)
        runs.append((fisher, energy, n))
    return runs


def _close(got: dict, want: dict):
    assert set(got) == set(want)
    for p in want:
        g, w = np.asarray(got[p], np.float64), np.asarray(want[p], np.float64)
        assert np.isfinite(w).all() and np.abs(w).max() > 0, p
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * np.abs(w).max(), err_msg=p)


def _falls_back_with_same_numbers(model, sites, toks, match, seed=0):
    """The block-wise call warns (``match``) and runs the whole-model pass:
    the same Fisher as asking for that pass outright."""
    with pytest.warns(RuntimeWarning, match=match):
        got, _ = fisher_diagonal(model, toks, sites, progress=False, seed=seed)
    want, _ = fisher_diagonal(model, toks, sites, progress=False, seed=seed, blockwise=False)
    _close(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_blockwise_fisher_equals_the_whole_model_pass(arch):
    model, _ = tiny_models.build(arch)
    sites = ModelAdapter(model).sites
    # 5 sequences in chunks of 2: a short last chunk; 2 samples per sequence.
    (bw, e_bw, n_bw), (whole, e_whole, n_whole) = _both(model, _tokens(), sites, samples=2, seed=7)
    assert n_bw == n_whole == 5 * 12 * 2
    _close(bw, whole)
    _close(e_bw, e_whole)


def test_blockwise_fisher_on_block_tensors_of_gemma3n():
    """gemma3n: the model writes its AltUp unembedding into the last
    block's output after the block returns; the head's cotangent is taken
    at the block's own output, recomputed."""
    model, _ = tiny_models.build("gemma3n")
    sites = [s for s in ModelAdapter(model).sites if s.block is not None]
    (bw, e_bw, _), (whole, e_whole, _) = _both(model, _tokens(3), sites, seed=2)
    _close(bw, whole)
    _close(e_bw, e_whole)


def test_embeddings_feeding_block_arguments_fall_back_with_a_warning():
    """gemma3n's per-layer inputs come from its embeddings and reach every
    block beside the hidden state: with those embeddings measured, the
    block chain would miss a path, so the whole-model pass runs (said)."""
    model, _ = tiny_models.build("gemma3n")
    sites = ModelAdapter(model).sites
    _falls_back_with_same_numbers(model, sites, _tokens(2),
                                  "whole model at once.*other than the hidden state", seed=4)


def test_a_model_whose_blocks_return_tuples_falls_back_with_a_warning():
    model, _ = tiny_models.build("rwkv7")
    sites = ModelAdapter(model).sites[:4]
    _falls_back_with_same_numbers(model, sites, _tokens(2), "whole model at once.*returns tuple")


def test_block_sites_only_stop_at_the_lowest_measured_block(monkeypatch):
    """Without tensors outside the blocks the backward goes no lower than
    the lowest measured block (convert's timing probe measures one)."""
    model, _ = tiny_models.build("llama")  # 4 blocks
    sites = [s for s in ModelAdapter(model).sites if s.block == 2]
    stages = []

    class Counted(fisher_blocks._Stage):
        def __init__(self, adapter, sites):
            stages.append([s.block for s in sites])
            super().__init__(adapter, sites)

    monkeypatch.setattr(fisher_blocks, "_Stage", Counted)
    (bw, _, _), (whole, _, _) = _both(model, _tokens(2), sites)
    assert stages == [[], [2] * len(sites)]  # block 3 (nothing measured), block 2; not 1, 0
    _close(bw, whole)


def test_grad_table_equals_the_whole_model_pass_s(monkeypatch):
    """proxy_sweep --method grad with the Fisher taken block by block (each
    block's tensors rated as soon as its Fisher is complete) and with the
    block chain refused (the whole-model pass): the same table."""
    model, _ = tiny_models.build("qwen3_moe")
    toks = _tokens(4)
    cands = ["2b_g64", "4b_g64", "4b10_3b_g64", "3b_g64+gptq"]  # gptq: X^T X mid-pass
    tables = []
    for refuse in (False, True):
        if refuse:
            monkeypatch.setattr(fisher_blocks, "block_chain", lambda *a, **k: (None, "refused"))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tables.append(_table(model, toks, cands))
        assert any("whole model at once (refused)" in str(w.message) for w in seen) == refuse
    a, b = ({e["path"]: [c["kl"] for c in e["candidates"]] for e in t["entries"]} for t in tables)
    assert list(a) == list(b) == [s.path for s in ModelAdapter(model).sites if s.path in a]
    for p in b:
        np.testing.assert_allclose(a[p], b[p], rtol=1e-5, err_msg=p)


def _table(model, toks, cands):
    import tempfile
    from pathlib import Path

    from mixbits.measure.two_stage import proxy_sweep

    with tempfile.TemporaryDirectory() as d:
        return proxy_sweep(model, toks, Path(d) / "t.json", cands, method="grad", progress=False)


def test_streamed_model_blockwise_equals_eager_whole_model(tmp_path):
    """A model on disk (mixbits.load(lazy=True): each block's weights read
    when it runs and let go after) gives the eager whole-model numbers."""
    import mixbits
    from mixbits import streaming
    from mixbits.measure.calib import cast_model

    model, cfg = tiny_models.build("llama")
    mixbits.save(model, tmp_path / "m", cfg)
    toks = _tokens(3)
    eager, _, _ = mixbits.load(tmp_path / "m")
    cast_model(eager, "float32")
    want, _ = fisher_diagonal(eager, toks, ModelAdapter(eager).sites, progress=False, blockwise=False)
    lazy, _, _ = mixbits.load(tmp_path / "m", lazy=True)
    cast_model(lazy, "float32")
    assert streaming.streams(lazy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got, _ = fisher_diagonal(lazy, toks, ModelAdapter(lazy).sites, progress=False)
    _close(got, want)


def test_a_block_output_changed_in_place_falls_back_with_a_warning():
    """A model that writes into block 2's output before block 3 reads it
    (the same array object, so the chain of recorded calls looks intact):
    the recorded output is not what block 2 returns, the chain rule through
    the records would skip the write, so the pass falls back -- part way,
    with a warning -- and gives the whole-model numbers."""
    model, _ = tiny_models.llama_writing_into_block(2)
    sites = ModelAdapter(model).sites
    _falls_back_with_same_numbers(model, sites, _tokens(2),
                                  "whole model at once.*block 2's recorded output differs", seed=5)
