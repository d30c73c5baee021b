"""`mixbits convert` of an 8B-class float checkpoint on this machine (issue
40): the projected time of every method from convert's own timing probe,
each stage's peak memory, and, with --run, the real run's stage times
against the projection.

    python bench/float_folder.py --shape llama3-8b --out /tmp/llama8b   # 16 GB, once
    python bench/convert_8b.py --folder /tmp/llama8b                     # probe only (minutes)
    python bench/convert_8b.py --folder /tmp/llama8b --run               # the whole convert (hours)
    python bench/convert_8b.py --folder /tmp/llama8b --run --skip-probe --n-seq 1 --time-budget 40 --max-evals 3
    python bench/convert_8b.py --folder /tmp/llama8b --n-seq 1 --check   # the written folder runs?

--skip-probe leaves out the separate dry run: convert's own timing probe
(run when --time-budget picks the method) prints the same costs and the
picked method's stage estimates. With --run the convert is watched while it
runs: its output goes to --log line by line with the UTC time and the
process's resident set, which is sampled every --poll seconds; each stage
(from convert's "[i/4]" lines; "load" before them, "probe" from the probe's
start to its plan) gets its start, end, wall seconds, peak RSS and the
progress line that was current at the peak.

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
import subprocess
import sys
import threading
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


def _utc(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t))


def _rss(pid: int) -> int:
    """Resident set of ``pid`` now, bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


STAGE = re.compile(r"^\[(\d)/4\] (\w+)")


def watched(argv: list[str], log_path: Path, poll: float = 2.0) -> dict:
    """Run ``mixbits argv`` (bench_memory's child, which ends with its VmHWM)
    and watch it: every output line (tqdm's carriage returns split too) to
    ``log_path`` with the time and RSS; the RSS sampled every ``poll`` s.
    Returns the stages in order, each {name, start, end, seconds,
    peak_rss_gib, at}, with the return code, the whole wall time, the
    process's own peak (VmHWM) and its output's lines."""
    import bench_memory

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, bench_memory.__file__, "--child", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    log = open(log_path, "a", buffering=1)
    log.write(f"{_utc(t0)} start pid {proc.pid}: mixbits {' '.join(argv)}\n")
    lock = threading.Lock()
    stages = [{"name": "load", "start": t0, "peak": 0, "at": ""}]
    state = {"last": "", "hwm": -1, "lines": []}

    def begin(name: str, now: float) -> None:
        stages[-1]["end"] = now
        stages.append({"name": name, "start": now, "peak": 0, "at": ""})

    def reader():
        buf = b""
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            buf += chunk
            parts = re.split(rb"[\r\n]", buf)
            buf = parts.pop()
            for raw in parts:
                text = raw.decode(errors="replace").strip()
                if not text:
                    continue
                now = time.time()
                with lock:
                    if text.startswith("BENCH_PEAK "):
                        state["hwm"] = int(text.split()[1])
                    m = STAGE.match(text)
                    if m:
                        # "[1/4] calibration" comes after the model is loaded, before the probe
                        begin("probe" if m.group(2) == "calibration" else m.group(2), now)
                    state["last"] = text
                    state["lines"].append(text)
                log.write(f"{_utc(now)} {_rss(proc.pid) / GiB:6.2f} GiB | {text}\n")

    def summary(now: float) -> list[dict]:
        return [{"name": st["name"], "start_utc": _utc(st["start"]), "end_utc": _utc(st.get("end", now)),
                 "seconds": round(st.get("end", now) - st["start"], 1),
                 "peak_rss_gib": round(st["peak"] / GiB, 2), "at": st["at"]} for st in stages]

    snapshot = log_path.with_name(log_path.name + ".stages.json")  # so far, should the run not end
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    last_note, loads = 0.0, []
    while proc.poll() is None:
        r = _rss(proc.pid)
        now = time.time()
        with lock:
            st = stages[-1]
            if r > st["peak"]:
                st["peak"], st["at"] = r, state["last"][:200]
        if now - last_note >= 60:
            loads.append(round(os.getloadavg()[0], 2))
            log.write(f"{_utc(now)} {r / GiB:6.2f} GiB | (sample; load {loads[-1]}, stage {st['name']})\n")
            with lock:
                snapshot.write_text(json.dumps({"pid": proc.pid, "stages": summary(now), "load_1min": loads},
                                               indent=1) + "\n")
            last_note = now
        time.sleep(poll)
    th.join(timeout=30)
    t1 = time.time()
    stages[-1]["end"] = t1
    log.write(f"{_utc(t1)} exit {proc.returncode}\n")
    log.close()
    return {"rc": proc.returncode, "seconds": round(t1 - t0, 1), "vmhwm_gib": round(state["hwm"] / GiB, 2),
            "stages": summary(t1), "load_1min_samples": loads, "output": "\n".join(state["lines"])}



def check_output(out_dir: Path, tokens_path: Path, n_prompt: int = 16, n_new: int = 8) -> dict:
    """Whether the written folder runs: its size and storage bpw (the card's),
    then, each loaded alone (the other freed): ``mixbits.load`` -- greedy
    ``n_new`` tokens after the first ``n_prompt`` calibration tokens (the
    folder has no tokenizer) and the prompt's last logits -- and stock
    mlx-lm's ``load_model`` (without trust_remote_code, then with it when
    config.json names a model file): the same greedy tokens, and its
    logits' largest difference from mixbits'. Seconds and peak RSS of each."""
    import gc

    import mlx.core as mx
    import numpy as np

    from mixbits.streaming import peak_rss

    files = [f for f in out_dir.iterdir() if f.is_file()]
    weights = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    alloc = json.loads((out_dir / "allocation.json").read_text())
    config = json.loads((out_dir / "config.json").read_text())
    card = (out_dir / "README.md").read_text()
    m = re.search(r"storage bpw: ([\d.]+)", card)
    res = {"folder": str(out_dir), "folder_bytes": sum(f.stat().st_size for f in files),
           "safetensors_gib": round(weights / GiB, 3), "storage_bpw_card": float(m.group(1)) if m else None,
           "storage_bpw_allocation": alloc.get("average_bpw_storage"), "model_file": config.get("model_file"),
           "written": (re.search(r"written: (.*)", card) or [None, None])[1]}
    prompt = np.load(tokens_path)[0, :n_prompt].tolist()

    def greedy(model):
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
        mx.eval(logits)
        prefill = time.perf_counter() - t0
        out, nxt = [], int(mx.argmax(logits).item())
        t1 = time.perf_counter()
        for _ in range(n_new):
            out.append(nxt)
            nxt = int(mx.argmax(model(mx.array([[nxt]]), cache=cache)[0, -1]).item())
        return out, np.array(logits), prefill, (time.perf_counter() - t1) / n_new

    import mixbits

    t0 = time.perf_counter()
    model, _, _ = mixbits.load(str(out_dir))
    load_s = time.perf_counter() - t0
    toks, ref, prefill, per_tok = greedy(model)
    res["mixbits_load"] = {"load_s": round(load_s, 1), "prefill_s": round(prefill, 2),
                           "s_per_token": round(per_tok, 2), "greedy_tokens": toks,
                           "logits_finite": bool(np.isfinite(ref).all()), "peak_rss_gib": round(peak_rss() / GiB, 2)}
    del model
    gc.collect()
    from mlx_lm.utils import load_model

    stock = {}
    try:
        load_model(out_dir)
        stock["without_trust_remote_code"] = "loaded"
    except Exception as e:  # what stock mlx-lm says of a folder with mixbits-only layers
        stock["without_trust_remote_code"] = f"refused: {type(e).__name__}: {str(e)[:160]}"
    gc.collect()
    t0 = time.perf_counter()
    model, _ = load_model(out_dir, trust_remote_code=True)
    load_s = time.perf_counter() - t0
    toks2, logits2, prefill, per_tok = greedy(model)
    stock.update({"load_s": round(load_s, 1), "prefill_s": round(prefill, 2), "s_per_token": round(per_tok, 2),
                  "greedy_tokens": toks2, "same_tokens_as_mixbits": toks2 == toks,
                  "max_abs_logit_diff": float(np.abs(logits2 - ref).max()),
                  "peak_rss_gib": round(peak_rss() / GiB, 2)})
    res["mlx_lm_load_model"] = stock
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--folder", required=True, help="a float folder (bench/float_folder.py) with tokens.npy")
    ap.add_argument("--bpw", type=float, default=3.5)
    ap.add_argument("--time-budget", type=float, default=180, metavar="MIN")
    ap.add_argument("--dtype", default="bfloat16", help="the sweep's float dtype (--dtype of convert)")
    ap.add_argument("--work", default="/tmp/mixbits-8b", help="where the converted folder goes")
    ap.add_argument("--max-evals", type=int, default=None,
                    help="convert's --max-evals: refine's joint evaluations at most (the budget may lower it)")
    ap.add_argument("--run", action="store_true", help="after the probe, run the whole convert")
    ap.add_argument("--skip-probe", action="store_true",
                    help="no separate dry run: the run's own probe (with --time-budget) prints the plan")
    ap.add_argument("--n-seq", type=int, default=None,
                    help="calibrate on the first N sequences of the folder's tokens.npy")
    ap.add_argument("--log", default=None, help="the watched run's log (default: WORK/convert.log)")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between RSS samples of the run")
    ap.add_argument("--check", action="store_true",
                    help="only check the written folder (WORK/<bpw>bpw): loads and runs in mixbits and "
                         "stock mlx-lm; the result goes under 'check' in --out (kept otherwise)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "convert_8b.json"))
    a = ap.parse_args(argv)
    if a.check:
        out_dir = Path(a.work) / f"{a.bpw:g}bpw"
        tok = Path(a.work) / f"tokens_{a.n_seq}.npy" if a.n_seq else Path(a.folder) / "tokens.npy"
        res = check_output(out_dir, tok)
        print(json.dumps(res, indent=1))
        out = Path(a.out)
        old = json.loads(out.read_text()) if out.exists() else {}
        old["check"] = {**res, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "load_avg": list(os.getloadavg())}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(old, indent=1) + "\n")
        tmp.replace(out)
        return 0
    folder = Path(a.folder)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    out_dir = Path(a.work) / f"{a.bpw:g}bpw"
    tokens = folder / "tokens.npy"
    if a.n_seq is not None:
        import numpy as np

        all_tokens = np.load(tokens)
        if not 1 <= a.n_seq <= len(all_tokens):
            ap.error(f"--n-seq must be 1..{len(all_tokens)}, got {a.n_seq}")
        Path(a.work).mkdir(parents=True, exist_ok=True)
        tokens = Path(a.work) / f"tokens_{a.n_seq}.npy"
        np.save(tokens, all_tokens[:a.n_seq])
    base = ["convert", "--model", str(folder), "--tokens", str(tokens), "--bpw", str(a.bpw),
            "--out", str(out_dir), "--dtype", a.dtype, "--time-budget", str(a.time_budget)]
    if a.max_evals is not None:
        base += ["--max-evals", str(a.max_evals)]
    result = {"host": cpu_info(), "folder": str(folder), "weights_gib": round(weights / GiB, 2),
              "config": json.loads((folder / "config.json").read_text()), "argv": base,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(f"{folder}: {weights / GiB:.1f} GiB of weights; host {result['host']['cpu']}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)

    rc = 0
    if not a.skip_probe:
        peak, secs, rc, tail = peak_of(base + ["--dry-run"])
        print(tail)
        result["probe"] = {"rc": rc, "seconds": round(secs, 1), "peak_rss_gib": round(peak / GiB, 2),
                           "load_after": os.getloadavg()[0], **parse_probe(tail)}
        print(f"probe: exit {rc}, {secs:.0f} s, peak RSS {peak / GiB:.1f} GiB", flush=True)
    if a.run and rc == 0:
        log_path = Path(a.log) if a.log else Path(a.work) / "convert.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        print(f"convert running; its output, times and RSS: {log_path}", flush=True)
        w = watched(base, log_path, a.poll)
        rc = w["rc"]
        print("\n".join(w["output"].splitlines()[-30:]))
        timings_path = Path(str(out_dir) + ".work") / "timings.json"
        timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
        plan = parse_probe(w["output"])  # the run's own probe, when it picked the method
        est = plan.get("estimated_s") or result.get("probe", {}).get("estimated_s", {})
        result["run"] = {"rc": rc, "seconds": w["seconds"], "peak_rss_gib": w["vmhwm_gib"],
                         "plan": plan, "stages": w["stages"], "stage_seconds": timings,
                         "load_1min_samples": w["load_1min_samples"], "load_after": os.getloadavg()[0],
                         "measured_over_projected": {k: round(timings[k] / est[k], 2)
                                                     for k in est if k in timings and est[k] > 0}}
        print(f"convert: exit {rc}, {w['seconds'] / 60:.0f} min, peak RSS {w['vmhwm_gib']:.1f} GiB; "
              f"stages {timings}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
