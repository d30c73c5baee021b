"""Every architecture of the installed mlx-lm through mixbits' checks.

For each tests/data/architectures/<name>.json (tests/arch_configs.py
writes them): the sweep's reference is model(tokens); the table KL equals
the KL of the candidate put in the real model for one tensor of each role;
measure -> allocate -> quantize -> save -> mixbits.load gives identical
logits; mixbits.patch leaves prompt and decode logits unchanged. Refused
architectures are listed with their reason. Each architecture runs in its
own process (a native crash in mlx-lm's code ends only that row).

    python bench/all_architectures.py [--only a,b] [--out bench/results/architectures.json]

Prints the table (architecture, status, reason, seconds) and writes it."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "python"))


def check_one(name: str) -> dict:
    """All checks on one architecture, in this process."""
    import numpy as np

    import arch_checks
    import arch_configs

    cfg = arch_configs.load(name)
    if "refused" in cfg:
        return {"status": "refused", "reason": cfg["refused"]}
    done = []
    step = "build"
    try:
        model, cfg = arch_configs.build(name)
        step = "reference"
        rp, replayable = arch_checks.reference(model)
        done.append("reference" if replayable else "reference (full-forward fallback)")
        step = "kl"
        worst = 0.0
        roles = arch_checks.kl_roles(model, rp)
        for path, cand, kl, direct in roles:
            assert direct > 0, (path, cand)
            rel = abs(kl - direct) / direct
            assert rel <= 1e-4, f"{path} {cand}: table KL {kl:.6g}, real model {direct:.6g}"
            worst = max(worst, rel)
        done.append(f"kl ({len(roles)} roles, worst rel {worst:.1e})")
        step = "patch"
        model, cfg = arch_configs.build(name)
        (wp, ws), (gp, gs) = arch_checks.patched_logits(model)
        np.testing.assert_allclose(gp, wp, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(gs, ws, rtol=1e-4, atol=1e-4)
        done.append("patch")
        step = "pipeline"
        model, cfg = arch_configs.build(name)
        with tempfile.TemporaryDirectory() as d:
            arch_checks.pipeline(model, cfg, Path(d))
        done.append("pipeline")
    except Exception as e:  # the row says which check failed and how
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return {"status": "fail", "reason": f"{step}: {type(e).__name__}: {msg}", "passed": done}
    return {"status": "pass", "reason": "", "passed": done}


def main(argv) -> int:
    import arch_configs
    from mixbits.atomic import write_json_atomic

    if "--one" in argv:
        print(json.dumps(check_one(argv[argv.index("--one") + 1])))
        return 0
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else ROOT / "bench/results/architectures.json"
    names = argv[argv.index("--only") + 1].split(",") if "--only" in argv else arch_configs.architectures()
    rows = []
    for name in names:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True)
        if r.returncode == 0:
            row = json.loads(r.stdout.strip().splitlines()[-1])
        else:
            tail = (r.stderr.strip().splitlines() or [""])[-1][:200]
            row = {"status": "fail", "reason": f"process exit {r.returncode}: {tail}"}
        row = {"architecture": name, **row, "seconds": round(time.perf_counter() - t, 1)}
        rows.append(row)
        print(f"{name:24s} {row['status']:8s} {row['seconds']:6.1f}s  {row['reason']}", flush=True)
    import mlx_lm

    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "refused", "fail")}
    print(" ".join(f"{k} {v}" for k, v in counts.items()), f"of {len(rows)}")
    write_json_atomic({"mlx_lm": mlx_lm.__version__, "counts": counts, "rows": rows}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
