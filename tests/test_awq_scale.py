"""AWQ scaling as a model transform (mixbits.measure.awq_scale): groups
found from the model's own forward, folds that leave the float model's
output unchanged on many architectures, and lower quantization error."""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mixbits.adapter import ModelAdapter  # noqa: E402
from mixbits.measure.awq_scale import scale_model  # noqa: E402
from mixbits.measure.candidates import build_layer, parse_candidate  # noqa: E402
from mixbits.measure.sweep import kl_per_token  # noqa: E402
from tiny_models import build  # noqa: E402

OUTLIERS = [3, 17, 40, 41]


def plant_outliers(model, offset: bool):
    """Every norm's output channels OUTLIERS x12: activation outliers, as
    real LLMs have, so the linears reading them have salient columns."""
    for _, m in model.named_modules():
        w = m.get("weight") if "norm" in type(m).__name__.lower() else None
        if isinstance(w, mx.array) and w.ndim == 1 and w.shape[0] == 64:
            a = np.array(w.astype(mx.float32))
            a[OUTLIERS] = 12 * (1 + a[OUTLIERS]) - 1 if offset else 12 * a[OUTLIERS]
            m.weight = mx.array(a).astype(w.dtype)
    mx.eval(model.parameters())


def tokens(n=4, t=24, seed=3):
    return np.random.default_rng(seed).integers(0, 160, size=(n, t))


def quantize_all(model, cand):
    ad = ModelAdapter(model)
    for s in ad.sites:
        if s.form == "linear" and s.block is not None:
            ad.set(s.path, build_layer(ad.get(s.path), parse_candidate(cand), mx.float16, None))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "phi3", "qwen3_next", "gpt_oss"])
def test_scaling_keeps_the_models_output_and_finds_norm_fed_groups(arch):
    model, _ = build(arch)
    plant_outliers(model, offset=arch.startswith("gemma"))
    toks = tokens()
    ref = model(mx.array(toks)).astype(mx.float32)
    report = scale_model(model, toks, bits=3, group_size=32, grid=10, progress=False)
    out = model(mx.array(toks)).astype(mx.float32)
    # The transform preserves the function: same logits to float rounding.
    assert float(mx.abs(out - ref).max()) <= 2e-3 * float(mx.abs(ref).max())
    assert report, "no norm-fed linear group found"
    for r in report:
        assert r["scaled"] or r["reason"], r
        assert all(".layers." in p or "layers." in p for p in r["linears"])
    scaled = [r for r in report if r["scaled"]]
    assert scaled, [r["reason"] for r in report]
    if arch == "gemma3_text":  # gemma's norms compute (1 + w) * n(x)
        assert {r["form"] for r in scaled} == {"offset"}
    else:
        assert {r["form"] for r in scaled} == {"weight"}
    if arch == "llama":
        names = {tuple(sorted(p.rsplit(".", 1)[1] for p in r["linears"])) for r in report}
        assert names == {("k_proj", "q_proj", "v_proj"), ("gate_proj", "up_proj")}


def test_group_whose_norm_also_feeds_expert_stacks_is_refused():
    """qwen3_next's MLP norm feeds the shared expert's gate/up (linears) *and*
    the router and expert stacks (not scaled): folding into that norm would
    change the experts' input, so the probe check must refuse the group."""
    model, _ = build("qwen3_next")
    plant_outliers(model, offset=False)
    report = scale_model(model, tokens(), bits=3, group_size=32, grid=10, progress=False)
    shared = [r for r in report if any("shared_expert" in p for p in r["linears"])]
    assert len(shared) == 4 and not any(r["scaled"] for r in shared)
    assert all("probe KL" in r["reason"] for r in shared)
    assert all(r["scaled"] for r in report if r["norm"].endswith("input_layernorm"))


def test_scaling_lowers_the_quantized_models_kl():
    model, _ = build("llama")
    plant_outliers(model, offset=False)
    toks, held = tokens(seed=3), tokens(seed=4)
    ref = model(mx.array(held)).astype(mx.float32)
    base, _ = build("llama")
    plant_outliers(base, offset=False)
    quantize_all(base, "3b_g32")
    kl_rtn = float(kl_per_token(ref, base(mx.array(held))).mean())
    scale_model(model, toks, bits=3, group_size=32, progress=False)
    quantize_all(model, "3b_g32")
    kl_awq = float(kl_per_token(ref, model(mx.array(held))).mean())
    assert kl_awq < 0.8 * kl_rtn, (kl_awq, kl_rtn)


def test_bad_tokens_are_refused_before_any_forward():
    model, _ = build("llama")
    with pytest.raises(ValueError, match="tokens"):
        scale_model(model, np.zeros((0, 4), np.int64), bits=3)
