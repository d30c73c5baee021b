"""Tensors no candidate fits stay float, as mlx-lm's own quantizer leaves
them (a layer whose input width its group size does not divide), and are
named once: in one warning and under "float" in the table. The run goes
on; only a run in which nothing fits is refused.

The model is a tiny mamba built from mlx-lm's ModelArgs: its dt_proj reads
the time-step rank (K=4 here, 48 at mamba-130m), which no group size
divides."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mixbits.adapter import ModelAdapter
from mixbits.measure.candidates import FloatTensorWarning

CANDS = ["2b_g32", "4b_g64", "8b_g32"]


def _mamba(seed=0):
    from mlx_lm.utils import _get_classes

    cfg = dict(model_type="mamba", vocab_size=160, hidden_size=64, intermediate_size=128,
               state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False,
               use_conv_bias=True, time_step_rank=4, tie_word_embeddings=True)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    model.eval()
    mx.eval(model.parameters())
    return model, cfg


def _tokens():
    return np.random.default_rng(0).integers(0, 160, (2, 12))


def _sweep_one_warning(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        table = fn()
    ours = [w for w in seen if issubclass(w.category, FloatTensorWarning)]
    assert len(ours) == 1, [str(w.message) for w in seen]
    return table, str(ours[0].message)


def test_sweep_leaves_unfit_tensors_float_and_quantize_keeps_them(tmp_path):
    import mixbits
    from mixbits.commands.quantize import allocation_candidates, quantize_candidates
    from mixbits.formats.allocation import Allocation
    from mixbits.measure.refine import allocate_table
    from mixbits.measure.sweep import sweep

    model, cfg = _mamba()
    bare = [s.path for s in ModelAdapter(model).sites if s.k == 4]
    assert len(bare) == 2  # one dt_proj per block
    toks = _tokens()
    table, msg = _sweep_one_warning(
        lambda: sweep(model, toks, tmp_path / "t.json", CANDS, progress=False))
    assert all(p in msg for p in bare)
    assert [e["path"] for e in table["float"]] == bare
    assert all("K=4" in e["reason"] and e["shape"] == [128, 4] for e in table["float"])
    measured = {e["path"] for e in table["entries"]}
    assert table["complete"] and measured == {s.path for s in ModelAdapter(model).sites} - set(bare)
    assert table["meta"]["sites"] == [e["path"] for e in table["entries"]]
    # the table as written is the one returned (resumable: same settings)
    again = sweep(model, toks, tmp_path / "t.json", CANDS, progress=False, resume=True)
    assert again["float"] == table["float"] and again["entries"] == table["entries"]

    alloc, _, _ = allocate_table(table, 4.0)
    Allocation.from_dict(alloc).save(tmp_path / "alloc.json")
    chosen = allocation_candidates(tmp_path / "alloc.json", model)
    quantize_candidates(model, chosen)
    for p in bare:
        assert type(ModelAdapter(model).get(p)) is nn.Linear  # still float
    want = np.array(model(mx.array(toks)))
    mixbits.save(model, tmp_path / "out", cfg)
    loaded, _, _ = mixbits.load(tmp_path / "out")
    for p in bare:
        assert type(ModelAdapter(loaded).get(p)) is nn.Linear
    np.testing.assert_array_equal(np.array(loaded(mx.array(toks))), want)


def test_grad_method_lists_unfit_tensors_too(tmp_path):
    from mixbits.measure.two_stage import proxy_sweep

    model, _ = _mamba()
    table, _ = _sweep_one_warning(
        lambda: proxy_sweep(model, _tokens(), tmp_path / "g.json", CANDS, method="grad",
                            progress=False))
    bare = [s.path for s in ModelAdapter(model).sites if s.k == 4]
    assert [e["path"] for e in table["float"]] == bare
    assert not {e["path"] for e in table["entries"]} & set(bare)


def test_run_where_nothing_fits_is_refused_before_work(tmp_path):
    from mixbits.measure.sweep import sweep

    model, _ = _mamba()
    bare = [s.path for s in ModelAdapter(model).sites if s.k == 4]
    with pytest.raises(ValueError, match="no candidate fits any of the 2 tensors"):
        sweep(model, _tokens(), tmp_path / "t.json", CANDS, sites=bare, progress=False)
    assert not (tmp_path / "t.json").exists()
