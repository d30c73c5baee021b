"""A resume continues only the same measurement: method and its
parameters, candidates, tokens, tensors and the model itself (its
fingerprint) must match the table's. The issue's case: `measure --resume
--method grad` on a finished exact table exited 0 and replaced the exact
KLs by gradient estimates."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mixbits.models  # noqa: E402
from mixbits.cli import main  # noqa: E402
from mixbits.errors import UsageError  # noqa: E402
from mixbits.measure.sweep import sweep  # noqa: E402
from mixbits.measure.two_stage import proxy_sweep  # noqa: E402
from tiny_model import tiny_llama, tiny_tokens  # noqa: E402

TENSORS = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.v_proj"]
CANDS = ["2b_g64", "4b_g64"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import mixbits
    import tiny_models

    d = tmp_path_factory.mktemp("resume")
    model, cfg = tiny_models.build("llama")
    mixbits.save(model, d / "model", cfg)
    np.save(d / "tokens.npy", np.random.default_rng(3).integers(0, 160, (2, 16)))
    return d


def _measure(folder, out, *extra):
    return main(["measure", "--model", str(folder / "model"), "--tokens", str(folder / "tokens.npy"),
                 "--tensors", *TENSORS, "--candidates", *CANDS, "--out", str(out), *extra])


def test_grad_resume_on_an_exact_table_is_refused_before_the_model_loads(folder, tmp_path, capsys,
                                                                          monkeypatch):
    out = tmp_path / "t.json"
    assert _measure(folder, out) == 0
    before = out.read_text()
    capsys.readouterr()

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(mixbits.models, "load", no_load)
    assert _measure(folder, out, "--resume", "--method", "grad") == 2
    err = capsys.readouterr().err
    assert "different settings" in err and 'method: "exact" in the file, "grad" now' in err
    assert out.read_text() == before  # the exact KLs are kept
    # other candidates, other tokens: refused too, and as fast
    assert main(["measure", "--model", str(folder / "model"), "--tokens", str(folder / "tokens.npy"),
                 "--tensors", *TENSORS, "--candidates", "2b_g64", "3b_g64", "--out", str(out),
                 "--resume"]) == 2
    assert "candidates" in capsys.readouterr().err
    monkeypatch.undo()
    assert _measure(folder, out, "--resume") == 0  # the same settings still resume
    assert json.loads(out.read_text())["entries"] == json.loads(before)["entries"]


def test_library_proxy_sweep_refuses_an_exact_table(tmp_path):
    model, toks = tiny_llama(), tiny_tokens(n=2, t=16)
    out = tmp_path / "t.json"
    sweep(model, toks, out, CANDS, sites=TENSORS, progress=False)
    before = out.read_text()
    with pytest.raises(UsageError, match="method"):
        proxy_sweep(model, toks, out, CANDS, method="grad", sites=TENSORS, resume=True,
                    progress=False)
    assert out.read_text() == before
    # and the other way round: an exact resume of a grad table
    g = tmp_path / "g.json"
    proxy_sweep(model, toks, g, CANDS, method="grad", sites=TENSORS, progress=False)
    with pytest.raises(UsageError, match="method"):
        sweep(model, toks, g, CANDS, sites=TENSORS, resume=True, progress=False)
    # a grad resume with other Fisher samples is another measurement
    with pytest.raises(UsageError, match="fisher_samples"):
        proxy_sweep(model, toks, g, CANDS, method="grad", sites=TENSORS, resume=True,
                    samples=3, progress=False)
    # the same settings: the finished table comes back as it is
    assert proxy_sweep(model, toks, g, CANDS, method="grad", sites=TENSORS, resume=True,
                       progress=False) == json.loads(g.read_text())


def test_another_model_with_the_same_shapes_is_refused(tmp_path):
    from mixbits.measure.sweep import model_fingerprint

    toks = tiny_tokens(n=2, t=16)
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    assert model_fingerprint(a) == model_fingerprint(tiny_llama(seed=0))
    assert model_fingerprint(a) != model_fingerprint(b)
    out = tmp_path / "t.json"
    sweep(a, toks, out, CANDS, sites=TENSORS[:1], progress=False)
    with pytest.raises(UsageError, match="model_fingerprint"):
        sweep(b, toks, out, CANDS, sites=TENSORS, resume=True, progress=False)


def test_two_stage_side_checkpoint_keeps_its_budget(tmp_path):
    model, toks = tiny_llama(), tiny_tokens(n=2, t=16)
    out = tmp_path / "t.json"
    side = tmp_path / "t.json.exact.json"
    kw = dict(method="two-stage", targets=[3.0], progress=False)
    proxy_sweep(model, toks, out, CANDS, budget=0.5, **kw)
    assert side.exists()
    out.unlink()  # as if killed after the exact stage's checkpoints
    with pytest.raises(UsageError, match="exact_budget"):
        proxy_sweep(model, toks, out, CANDS, budget=0.3, resume=True, **kw)
    t = proxy_sweep(model, toks, out, CANDS, budget=0.5, resume=True, **kw)
    assert {c["source"] for e in t["entries"] for c in e["candidates"]} <= {"exact", "grad"}


def test_exl2_measurement_resumes_only_the_same_measurement(folder, tmp_path, capsys, monkeypatch):
    from mixbits.measure.exl2_measure import measure_modules

    model, toks = tiny_llama(), tiny_tokens(n=2, t=16)
    out = tmp_path / "m.json"
    measure_modules(model, toks, CANDS, out, progress=False)
    before = out.read_text()
    with pytest.raises(FileExistsError):  # was silently measured again over it
        measure_modules(model, toks, CANDS, out, progress=False)
    with pytest.raises(UsageError, match="candidates"):
        measure_modules(model, toks, ["2b_g64", "3b_g64"], out, resume=True, progress=False)
    with pytest.raises(UsageError, match="model_fingerprint"):
        measure_modules(tiny_llama(seed=1), toks, CANDS, out, resume=True, progress=False)
    assert out.read_text() == before
    measure_modules(model, toks, CANDS, out, resume=True, progress=False)
    # the command refuses an existing --exl2-out (without --resume) before the model loads
    monkeypatch.setattr(mixbits.models, "load", lambda *a, **k: pytest.fail("model loaded"))
    assert _measure(folder, tmp_path / "t.json", "--exl2-out", str(out)) == 2
    assert f"{out} exists" in capsys.readouterr().err


def test_a_table_without_the_new_settings_says_why(tmp_path):
    model, toks = tiny_llama(), tiny_tokens(n=2, t=16)
    out = tmp_path / "t.json"
    sweep(model, toks, out, CANDS, sites=TENSORS[:1], progress=False)
    t = json.loads(out.read_text())
    del t["meta"]["model_fingerprint"], t["meta"]["method"]  # as an older mixbits wrote it
    out.write_text(json.dumps(t))
    with pytest.raises(UsageError, match="does not record all the settings.*older mixbits"):
        sweep(model, toks, out, CANDS, sites=TENSORS[:1], resume=True, progress=False)
