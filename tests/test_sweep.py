"""Sensitivity sweep on a tiny random llama: batched/suffix-reuse results
equal the naive one-forward-per-candidate loop; checkpoints resume exactly."""

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mixbits.measure.candidates import parse_candidate  # noqa: E402
from mixbits.measure.replay import Replayer  # noqa: E402
from mixbits.measure.sweep import SweepConfig, measure_site, measure_site_naive, sweep  # noqa: E402
from tiny_model import tiny_llama, tiny_tokens  # noqa: E402

CANDS = ["2b_g64", "4b_g64", "8b_g64", "ternary_g64", "4b25_2b_g64"]


def test_batched_suffix_equals_naive_forward():
    model = tiny_llama()
    toks = tiny_tokens(n=3)
    rp = Replayer(model, [mx.array(toks[:2]), mx.array(toks[2:])])
    cands = [parse_candidate(c) for c in CANDS]
    cfg = SweepConfig(CANDS, max_batch=4)
    for site in rp.adapter.sites[::3]:
        res = measure_site(rp, site, cands, cfg)
        for c in cands:
            naive = measure_site_naive(model, toks, site, c, cfg, rp.logits, chunk=2)
            assert res.kl[c.name] == pytest.approx(naive, rel=2e-4, abs=1e-7), (site.path, c.name)
        # more bits, less KL: a sanity check the measurement is not constant
        assert res.kl["2b_g64"] > res.kl["4b_g64"] > res.kl["8b_g64"] >= 0


def test_sweep_table_and_exact_resume(tmp_path):
    model = tiny_llama(layers=2)
    toks = tiny_tokens(n=2)
    full = sweep(model, toks, tmp_path / "full.json", CANDS[:3], progress=False)
    # the (tied) embedding, then 2 layers x 7 linears
    assert full["complete"] and len(full["entries"]) == 15
    assert full["entries"][0]["path"] == "model.embed_tokens" and "layer" not in full["entries"][0]
    e = next(e for e in full["entries"] if e["path"] == "model.layers.0.self_attn.q_proj")
    assert e["layer"] == 0 and e["nparams"] == 64 * 64
    assert [c["kind"] for c in e["candidates"]] == CANDS[:3]
    # stop after 5 tensors, then resume
    part = tmp_path / "part.json"

    class Stop(Exception):
        pass

    seen = []

    def stop_after_five(res):
        seen.append(res)
        if len(seen) == 5:
            raise Stop

    with pytest.raises(Stop):
        sweep(model, toks, part, CANDS[:3], progress=False, on_site=stop_after_five)
    saved = json.loads(part.read_text())
    assert not saved["complete"] and len(saved["entries"]) == 5
    with pytest.raises(FileExistsError, match="--resume"):
        sweep(model, toks, part, CANDS[:3], progress=False)
    with pytest.raises(ValueError, match="different settings"):
        sweep(model, toks, part, CANDS[:2], progress=False, resume=True)
    resumed = sweep(model, toks, part, CANDS[:3], progress=False, resume=True)
    strip = lambda t: [{k: v for k, v in e.items() if k != "seconds"} for e in t["entries"]]  # noqa: E731
    assert strip(resumed) == strip(full)


def test_bad_candidate_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="unknown candidate"):
        sweep(tiny_llama(), tiny_tokens(), tmp_path / "x.json", ["5bits"], progress=False)
    with pytest.raises(ValueError, match="no candidate fits any"):
        # no width (32, 64) is a multiple of 128; a tensor or two that no
        # candidate fits stay float instead (tests/test_left_float.py)
        sweep(tiny_llama(hidden=32), tiny_tokens(), tmp_path / "x.json", ["4b_g128"], progress=False)


def test_atomic_writer_leaves_no_temp_and_normal_mode(tmp_path):
    import os

    from mixbits.atomic import write_json_atomic

    p = tmp_path / "x.json"
    write_json_atomic({"a": 1}, p)
    write_json_atomic({"a": 2}, p)
    assert json.loads(p.read_text()) == {"a": 2}
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert (p.stat().st_mode & 0o777) == (0o666 & ~umask)
    with pytest.raises(ValueError):
        write_json_atomic({"a": float("nan")}, p)
    assert json.loads(p.read_text()) == {"a": 2}  # the old file survives a failed write
    assert [f.name for f in tmp_path.iterdir()] == ["x.json"]
