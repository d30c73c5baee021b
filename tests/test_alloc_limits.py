"""Bit counts and budgets at the edges of int64: exact, or a clear refusal;
never a wrapped sum reported as "solved exactly"."""

import json

import numpy as np
import pytest

from mixbits.alloc import MCKProblem, solve
from mixbits.cli import main


def _table(nparams, bits=(4, 8)):
    entries = [{"path": f"model.layers.{i}.mlp.up_proj", "layer": i, "nparams": n,
                "candidates": [{"kind": f"{b}b_g64", "bits": b, "kl": 1.0 / b + i} for b in bits]}
               for i, n in enumerate(nparams)]
    return {"format": "mixbits.sensitivity", "version": 1, "entries": entries}


def test_totals_past_2_62_are_refused_not_wrapped(tmp_path, capsys):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table([2**59, 2**59])))  # 8-bit options sum to 2**63
    out = tmp_path / "a.json"
    rc = main(["allocate", str(t), "--budget-bits", str(2**63 - 1), "--count", "nominal", "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 2 and "2**62" in cap.err and "solved exactly" not in cap.out
    assert not out.exists()


def test_single_option_past_int64_is_refused():
    with pytest.raises(ValueError, match="more than 2\\*\\*62"):
        MCKProblem(weights=[[1, 2**70]], costs=[[1.0, 0.0]])
    with pytest.raises(ValueError, match="integers"):
        MCKProblem(weights=[[1, 2.5]], costs=[[1.0, 0.0]])


def test_large_exact_totals_stay_exact():
    # 2**61 + small offsets: float64 would round these, int64 sums must not.
    big = 2**60
    p = MCKProblem(weights=[[big + 1, big + 3], [big + 5, big + 7]], costs=[[1.0, 0.5], [1.0, 0.25]])
    s = solve(p, 2 * big + 9)  # room for exactly one upgrade: the cheaper-per-bit second slot
    assert s.bits == (big + 1) + (big + 7) and isinstance(s.bits, int)
    assert s.cost == pytest.approx(1.25) and s.gap >= -1e-12


@pytest.mark.parametrize("bpw", ["1e300"])
def test_huge_bpw_budget_cannot_bind(tmp_path, capsys, bpw):
    t = tmp_path / "t.json"
    t.write_text(json.dumps(_table([2**40, 2**41])))  # 1e300 * 3 * 2**40 overflows a float
    out = tmp_path / "a.json"
    assert main(["allocate", str(t), "--bpw", bpw, "--count", "nominal", "--out", str(out), "--quiet"]) == 0
    a = json.loads(out.read_text())
    assert [e["bits"] for e in a["assignment"]] == [8, 8]  # the budget does not bind: cheapest KL
    assert "gap" in capsys.readouterr().out


def test_huge_budget_bits_is_capped(tmp_path):
    p = MCKProblem(weights=[np.array([10, 20]), np.array([5, 50])], costs=[[1.0, 0.0], [1.0, 0.0]])
    s = solve(p, 10**40)
    assert s.bits == 70 and s.budget == 70 and s.gap == pytest.approx(0.0, abs=1e-12)
