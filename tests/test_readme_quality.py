"""The README's quality claims are the stored protocol results, rounded as
printed: every row of the SmolLM2 table and every Gemma-3-270M ratio in the
prose under it is read back from the results file the README names, so a
rerun that moves a figure (or a hand edit) cannot leave the README behind."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
WHY = README[README.index("## Why"):README.index("\n## ", README.index("## Why") + 1)]


def _summary(model: str) -> dict[float, dict]:
    """{budget: licenses summary row} of the results file the Why section names for ``model``."""
    names = re.findall(rf"`bench/results/(quality_protocol_{model}\w*\.json)`", WHY)
    assert len(names) == 1, f"the Why section should name one results file for {model}, found {names}"
    result = json.loads((ROOT / "bench" / "results" / names[0]).read_text())
    return {r["budget"]: r for r in result["summary"]["licenses"]}


def _ratio(row: dict) -> tuple[str, str, str]:
    c = row["contenders"][0]
    return f"{c['ratio']:.2f}", f"{c['ratio_ci95'][0]:.2f}", f"{c['ratio_ci95'][1]:.2f}"


def test_smollm2_table_is_the_stored_result():
    rows = re.findall(r"^\| (\d\.\d) \| [^|]+ \| ([\d.]+) \| ([\d.]+) \| \*\*([\d.]+)\*\* \[([\d.]+), ([\d.]+)\] \|$",
                      WHY, re.M)
    summary = _summary("smollm2")
    assert sorted(float(r[0]) for r in rows) == sorted(summary), "the table should have one row per budget"
    for budget, its_kl, ours, *ratio in rows:
        row = summary[float(budget)]
        assert its_kl == f"{row['contenders'][0]['kl']:.3f}", budget
        assert ours == f"{row['mixbits_kl']:.3f}", budget
        assert tuple(ratio) == _ratio(row), budget


def test_gemma_ratios_are_the_stored_result():
    text = WHY[WHY.index("Gemma-3-270M"):]
    claims = re.findall(r"(\d\.\d\d)×\s+\[(\d\.\d\d),\s+(\d\.\d\d)\][^,;]*?\sat\s+(\d\.\d)\b", text)
    summary = _summary("gemma3")
    assert sorted(float(c[3]) for c in claims) == sorted(summary), "one ratio per budget"
    for *ratio, budget in claims:
        assert tuple(ratio) == _ratio(summary[float(budget)]), budget
