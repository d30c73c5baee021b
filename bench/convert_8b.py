"""`mixbits convert` of an 8B-class float checkpoint on this machine (issue
40): the projected time of every method from convert's own timing probe,
each stage's peak memory, and, with --run, the real run's stage times
against the projection.

    python bench/float_folder.py --shape llama3-8b --out /tmp/llama8b   # 16 GB, once
    python bench/convert_8b.py --folder /tmp/llama8b                     # probe only (minutes)
    python bench/convert_8b.py --folder /tmp/llama8b --run               # the whole convert (hours)

Each command runs in its own process, whose peak resident set is read as
bench/bench_memory.py does. The probe's times are wall seconds at the
machine's load when it ran: the JSON records the load average before and
after, the CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_float_linear import cpu_info  # noqa: E402
from bench_memory import peak_of  # noqa: E402

GiB = 1024 ** 3
UNITS = {"s": 1, "min": 60, "h": 3600}


def seconds(text: str) -> float:
    """'~4.8 h' / '17 min' / '50 s' (convert's format_duration) -> seconds."""
    m = re.match(r"~?\s*([\d.]+)\s*(s|min|h)\b", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def parse_probe(output: str) -> dict:
    """What the dry run printed: per-sequence costs, every method's projected
    total and the chosen method's stage estimates."""
    out = {}
    m = re.search(r"Fisher pass ([\d.]+) s, exact pair ([\d.]+) s \+ ([\d.]+) s per block, "
                  r"joint evaluation ([\d.]+) s", output)
    if m:
        out["per_sequence_s"] = dict(zip(("fisher", "pair_fixed", "pair_per_block", "joint"),
                                         map(float, m.groups())))
    m = re.search(r"reference forward ([\d.]+) s", output)
    if m:
        out.setdefault("per_sequence_s", {})["reference_forward"] = float(m.group(1))
    m = re.search(r"quantizing every tensor once ([\d.]+) s", output)
    if m:
        out["quantize_every_tensor_once_s"] = float(m.group(1))
    m = re.search(r"projected measure \+ refine: (.*?); budget", output)
    if m:
        out["projected_total_s"] = {k: seconds(v) for k, v in
                                    (part.strip().split(" ", 1) for part in m.group(1).split(","))}
    m = re.search(r"^method: (\S+?)[;( ]", output, re.M)
    if m:
        out["method"] = m.group(1)
    m = re.search(r"estimated: measure (~[\d.]+ \w+), refine (~[\d.]+ \w+)", output)
    if m:
        out["estimated_s"] = {"measure": seconds(m.group(1)), "refine": seconds(m.group(2))}
    m = re.search(r"refine: (\d+) joint evaluations per budget", output)
    if m:
        out["max_evals"] = int(m.group(1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="a float folder (bench/float_folder.py) with tokens.npy")
    ap.add_argument("--bpw", type=float, default=3.5)
    ap.add_argument("--time-budget", type=float, default=180, metavar="MIN")
    ap.add_argument("--dtype", default="bfloat16", help="the sweep's float dtype (--dtype of convert)")
    ap.add_argument("--work", default="/tmp/mixbits-8b", help="where the converted folder goes")
    ap.add_argument("--run", action="store_true", help="after the probe, run the whole convert")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "convert_8b.json"))
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    out_dir = Path(a.work) / f"{a.bpw:g}bpw"
    base = ["convert", "--model", str(folder), "--tokens", str(folder / "tokens.npy"), "--bpw", str(a.bpw),
            "--out", str(out_dir), "--dtype", a.dtype, "--time-budget", str(a.time_budget)]
    result = {"host": cpu_info(), "folder": str(folder), "weights_gib": round(weights / GiB, 2),
              "config": json.loads((folder / "config.json").read_text()), "argv": base,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{folder}: {weights / GiB:.1f} GiB of weights; host {result['host']['cpu']}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    peak, secs, rc, tail = peak_of(base + ["--dry-run"])
    print(tail)
    result["probe"] = {"rc": rc, "seconds": round(secs, 1), "peak_rss_gib": round(peak / GiB, 2),
                       "load_after": os.getloadavg()[0], **parse_probe(tail)}
    print(f"probe: exit {rc}, {secs:.0f} s, peak RSS {peak / GiB:.1f} GiB", flush=True)
    if a.run and rc == 0:
        peak, secs, rc, tail = peak_of(base)
        print(tail)
        timings_path = Path(str(out_dir) + ".work") / "timings.json"
        timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
        est = result["probe"].get("estimated_s", {})
        result["run"] = {"rc": rc, "seconds": round(secs, 1), "peak_rss_gib": round(peak / GiB, 2),
                         "stage_seconds": timings, "load_after": os.getloadavg()[0],
                         "measured_over_projected": {k: round(timings[k] / est[k], 2)
                                                     for k in est if k in timings and est[k] > 0}}
        print(f"convert: exit {rc}, {secs / 60:.0f} min, peak RSS {peak / GiB:.1f} GiB; stages {timings}",
              flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
