"""bench/quality_menu.py: each menu's ratio to the first is the paired ratio
of its held-out KLs, the pick is the menu with the lower calibration joint
KL (never the held-out one), and a budget a menu's run did not reach is
left out rather than guessed."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality_menu as qm  # noqa: E402


def _result(kls: dict[float, list[float]]) -> dict:
    """A quality_protocol results file holding mixbits' rows at ``kls``."""
    rows = [{"budget": b, "mixbits_kl": float(np.mean(v)), "mixbits_bpw": [b], "mixbits_written": ["mixed"],
             "contenders": [{"name": "uniform", "bpw": b, "kl": 2.0, "ratio": float(np.mean(v)) / 2.0,
                             "ratio_ci95": [0.0, 1.0]}]} for b, v in kls.items()]
    return {"model": "m", "protocol": {"mixbits_seeds": [0]}, "summary": {"licenses": rows},
            "records": {f"mixbits @{b:g} seed0": {"kl": {"licenses": v}} for b, v in kls.items()}}


def _work(tmp: Path, name: str, cal: dict[float, float]) -> Path:
    w = tmp / name
    w.mkdir()
    for b, kl in cal.items():
        (w / f"allocation_{b:g}bpw.json").write_text(json.dumps({"guard": {"joint_kl": kl}}))
    return w


def test_ratio_to_first_pick_by_calibration_and_missing_budget(tmp_path):
    a = {3.0: [1.0, 2.0, 3.0], 4.5: [1.0, 1.0, 1.0]}
    b = {3.0: [2.0, 4.0, 6.0]}  # twice a at 3.0 on every sequence; never reached 4.5
    menus = {"a": _result(a), "b": _result(b)}
    # calibration says b at 3.0 although held-out says a: the pick follows calibration
    works = {"a": _work(tmp_path, "a", {3.0: 0.5, 4.5: 0.2}), "b": _work(tmp_path, "b", {3.0: 0.4})}
    rows = qm.table(menus, "licenses", works)
    r3 = rows[0]
    assert r3["menus"]["b"]["ratio_to_a"] == 2.0 and r3["menus"]["b"]["ratio_to_a_ci95"] == [2.0, 2.0]
    assert r3["picked"] == "b" and r3["menus"]["a"]["calibration_joint_kl"] == 0.5
    r45 = rows[1]
    assert r45["menus"]["b"] is None and r45["picked"] is None
