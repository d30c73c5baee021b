"""mlx-lm's dynamic_quant as a baseline: its own sensitivity estimate on our
tokens, its threshold rule at equal storage bpw, scored by joint KL."""

import mlx.core as mx
import numpy as np
import pytest

import tiny_models
from mixbits.measure.compare import compare, entry_bpw
from mixbits.measure.dynamic_quant import assignment, sensitivities
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.sweep import sweep


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import mixbits

    model, _ = tiny_models.build("qwen3")
    toks = np.random.default_rng(0).integers(0, 160, (4, 16))
    table = sweep(model, toks, tmp_path_factory.mktemp("dq") / "t.json", ["3b_g64", "4b_g64"],
                  progress=False)
    mixbits.patch(model)  # as the commands run it: routed kernels, no vjp
    return model, toks, table


def test_sensitivities_are_mlx_lms_on_the_float_model(setup):
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    model, toks, table = setup
    ours = sensitivities(model, toks, (3, 64), (4, 64))
    plain, _ = tiny_models.build("qwen3")  # same seed: the same float weights, never patched
    want = dict(estimate_sensitivities(plain, mx.array(toks), 3, 64, 4, 64, batch_size=4))
    assert set(ours) == set(want) == {e["path"] for e in table["entries"]}
    for k in want:
        assert ours[k] == pytest.approx(want[k], rel=1e-3, abs=1e-6), k


def test_threshold_rule_at_equal_storage_bpw(setup):
    model, toks, table = setup
    sens = sensitivities(model, toks, (3, 64), (4, 64))
    lo = entry_bpw(table, {e["path"]: "3b_g64" for e in table["entries"]})
    hi = entry_bpw(table, {e["path"]: "4b_g64" for e in table["entries"]})
    for target in (lo, (lo + hi) / 2, hi):
        a = assignment(table, sens, target, "3b_g64", "4b_g64")
        assert entry_bpw(table, a) <= target + 1e-12
        up = {p for p, c in a.items() if c == "4b_g64"}
        # a threshold: every upgraded tensor is more sensitive than every other
        if up and len(up) < len(a):
            assert min(sens[p] for p in up) >= max(sens[p] for p in a if p not in up)
    assert set(assignment(table, sens, hi, "3b_g64", "4b_g64").values()) == {"4b_g64"}
    with pytest.raises(ValueError, match="below uniform"):
        assignment(table, sens, lo - 0.1, "3b_g64", "4b_g64")


def test_compare_reports_dynamic_quant(setup):
    model, toks, table = setup
    sens = sensitivities(model, toks, (3, 64), (4, 64))
    ev = JointEvaluator(model, toks, chunk=2)
    rows = compare(table, ev, [3.7], max_evals=2, dynamic=(sens, "3b_g64", "4b_g64"))
    d = rows[0]["dynamic_quant"]
    assert d["bpw"] <= 3.7 + 1e-12
    assert d["joint_kl"] == pytest.approx(
        ev.joint_kl(assignment(table, sens, 3.7, "3b_g64", "4b_g64"))[0])
    assert "dynamic_quant" not in rows[-1]  # the mixed-rule row has its own bpw
