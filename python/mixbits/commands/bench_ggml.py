"""ggml as an optional baseline of ``mixbits bench`` (``--vs-ggml PATH``).

PATH is the harness bench/ggml/build.sh builds (build/ggml/ggml_mm): it times
ggml_mul_mat of a ggml-quantized weight by float32 activations, activation
quantization included, and prints JSON. Nothing here imports or downloads
ggml; without --vs-ggml this module is not used.
"""

from __future__ import annotations

import json
import os
import subprocess

from ..errors import UsageError

# mixbits kind -> ggml types at a similar storage bpw (mixbits g64: bits + 0.5)
GGML_FOR_KIND = {"2bit": ["q2_K"], "3bit": ["q3_K"], "4bit": ["q4_K", "q4_0"], "8bit": ["q8_0"]}
KINDS = list(GGML_FOR_KIND)
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
MS = [1, 2, 4, 8, 16, 128]
BUILD_HINT = "build it with bench/ggml/build.sh (it writes build/ggml/ggml_mm)"


class HarnessError(UsageError):
    """A missing, non-executable or misbehaving ggml harness (the CLI prints
    it as one line, exit status 2)."""


def check_executable(path: str | None, flag: str, want: str, hint: str, error=None) -> str:
    """The absolute path of an executable file, or one clear ``error``
    (default :class:`HarnessError`) naming the option ``flag`` and how to
    build the ``want`` executable (``hint``): for the optional baselines
    the benches run, checked before anything is timed."""
    error = error or HarnessError
    if not path:
        raise error(f"{flag}: no path given; {hint}")
    p = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(p):
        raise error(f"{flag}: {path} does not exist; {hint}")
    if not os.path.isfile(p):
        raise error(f"{flag}: {path} is not a file (want the {want} executable); {hint}")
    if not os.access(p, os.X_OK):
        raise error(f"{flag}: {path} is not executable; {hint}")
    return p


def check_harness(path: str) -> str:
    """The absolute path of an executable harness, or a clear error; called
    before anything is timed."""
    return check_executable(path, "--vs-ggml", "ggml_mm", BUILD_HINT)


def harness_info(path: str) -> dict:
    """``ggml_mm --info``: ggml version and the CPU features ggml was built for."""
    try:
        out = subprocess.run([path, "--info"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise HarnessError(f"--vs-ggml: cannot run {path}: {e}; {BUILD_HINT}") from e
    try:
        info = json.loads(out.stdout)
    except ValueError:
        info = None
    if out.returncode != 0 or not isinstance(info, dict) or "ggml_version" not in info:
        raise HarnessError(f"--vs-ggml: {path} is not the ggml_mm harness (`--info` gave rc "
                           f"{out.returncode}: {(out.stdout + out.stderr)[:200]!r}); {BUILD_HINT}")
    return info


def parse_output(text: str) -> dict:
    """Parse the harness JSON into {"info": ..., "rows": [...]}: each row one
    (type, layout, n, k, m) with its times; unsupported layouts dropped."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise HarnessError(f"--vs-ggml: harness output is not JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise HarnessError("--vs-ggml: harness output has no 'results' list")
    rows = []
    for r in data["results"]:
        if r.get("unsupported"):
            continue
        missing = {"type", "layout", "n", "k", "m", "cpu_median_s", "wall_min_s"} - set(r)
        if missing:
            raise HarnessError(f"--vs-ggml: harness result lacks {sorted(missing)}: {r}")
        rows.append(r)
    info = {k: v for k, v in data.items() if k != "results"}
    return {"info": info, "rows": rows}


def best_times(parsed: dict, clock: str) -> dict:
    """(type, n, k, m) -> (seconds, layout, row): the faster of ggml's weight
    layouts (plain or llama.cpp's default CPU_REPACK) by the bench's clock:
    median CPU time with --clock cpu, best wall time otherwise."""
    key_t = "cpu_median_s" if clock == "cpu" else "wall_min_s"
    best: dict = {}
    for r in parsed["rows"]:
        key = (r["type"], int(r["n"]), int(r["k"]), int(r["m"]))
        t = float(r[key_t])
        if key not in best or t < best[key][0]:
            best[key] = (t, r["layout"], r)
    return best


def run_harness(path: str, shapes, ms, threads: int, min_time: float, cold_mb: int = 0) -> dict:
    """The harness's results; ``cold_mb`` > 0: it holds each weight in
    copies filling that many MiB, taken in turn (``mixbits bench --cold``)."""
    types = sorted({t for ts in GGML_FOR_KIND.values() for t in ts})
    cmd = [path, "--types", ",".join(types), "--shapes", ",".join(f"{n}x{k}" for n, k in shapes),
           "--m", ",".join(str(m) for m in ms), "--threads", str(threads),
           "--min-time", str(min_time)]
    if cold_mb > 0:
        cmd += ["--cold-mb", str(cold_mb)]
    print("ggml:", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise HarnessError(f"--vs-ggml: {path} failed (rc {out.returncode}): "
                           f"{out.stderr[-500:]}")
    parsed = parse_output(out.stdout)
    parsed["command"] = cmd
    return parsed


def comparison(rows, best: dict) -> list[dict]:
    """One record per (n, k, m): mixbits time per kind, ggml time per type,
    and ggml/mixbits ratios for the pairs of similar bpw (>1: mixbits faster)."""
    mix = {(r.case.n, r.case.k, r.case.m, r.case.kind): (r.best("mixbits"), r.bpw) for r in rows}
    rep = {(r.case.n, r.case.k, r.case.m, r.case.kind): r.best("mixbits_repacked") for r in rows}
    flt = {(r.case.n, r.case.k, r.case.m, r.case.kind): r.best("mixbits_float") for r in rows}
    out = []
    for n, k, m in dict.fromkeys((r.case.n, r.case.k, r.case.m) for r in rows):
        rec = {"n": n, "k": k, "m": m, "mixbits_ms": {}, "mixbits_bpw": {}, "ggml_ms": {},
               "ggml_layout": {}, "ggml_bpw": {}, "ratio_ggml_over_mixbits": {},
               "repacked_ms": {}, "ratio_ggml_over_repacked": {}, "float_ms": {},
               "ratio_ggml_over_float": {}}
        for kind, gtypes in GGML_FOR_KIND.items():
            t_mix = mix.get((n, k, m, kind))
            if t_mix and t_mix[0]:
                rec["mixbits_ms"][kind] = t_mix[0] * 1e3
                rec["mixbits_bpw"][kind] = t_mix[1]
            t_rep = rep.get((n, k, m, kind))
            if t_rep:
                rec["repacked_ms"][kind] = t_rep * 1e3
            t_flt = flt.get((n, k, m, kind))
            if t_flt:
                rec["float_ms"][kind] = t_flt * 1e3
            for g in gtypes:
                b = best.get((g, n, k, m))
                if not b:
                    continue
                rec["ggml_ms"][g] = b[0] * 1e3
                rec["ggml_layout"][g] = b[1]
                if "bpw" in b[2]:
                    rec["ggml_bpw"][g] = b[2]["bpw"]
                if kind in rec["mixbits_ms"]:
                    rec["ratio_ggml_over_mixbits"][f"{g}/{kind}"] = b[0] * 1e3 / rec["mixbits_ms"][kind]
                if kind in rec["repacked_ms"]:
                    rec["ratio_ggml_over_repacked"][f"{g}/{kind}"] = b[0] * 1e3 / rec["repacked_ms"][kind]
                if kind in rec["float_ms"]:
                    rec["ratio_ggml_over_float"][f"{g}/{kind}"] = b[0] * 1e3 / rec["float_ms"][kind]
        out.append(rec)
    return out


PAIRS = [("2bit", "q2_K"), ("3bit", "q3_K"), ("4bit", "q4_K"), ("4bit", "q4_0"), ("8bit", "q8_0")]


def format_comparison(recs: list[dict]) -> str:
    """One line per (N, K, M); with repacked times (bench --repack) each
    pair also shows mixbits' repacked-layout time and ggml / that."""
    rep = any(r.get("repacked_ms") for r in recs)
    flt = any(r.get("float_ms") for r in recs)
    hdr = f"{'N x K':>12} {'M':>4}" + "".join(
        f" {k + ' ms':>9}" + (f" {'rep ms':>8}" if rep else "") + f" {g + ' ms':>9} {'x':>5}"
        + (f" {'xrep':>5}" if rep else "") + (f" {'xflt':>5}" if flt else "") for k, g in PAIRS)
    lines = ["ggml / mixbits (x = ggml time / mixbits time; > 1: mixbits faster; "
             "R = ggml's repacked layout" + ("; rep/xrep: mixbits' row-interleaved layout"
                                             if rep else "")
             + ("; xflt: ggml / mixbits' float contract" if flt else "") + ")", hdr,
             "-" * len(hdr)]
    for r in recs:
        cells = []
        for kind, g in PAIRS:
            tm, tg = r["mixbits_ms"].get(kind), r["ggml_ms"].get(g)
            x = r["ratio_ggml_over_mixbits"].get(f"{g}/{kind}")
            tag = "R" if r["ggml_layout"].get(g) == "repack" else ""
            cell = f" {_ms(tm):>9}"
            if rep:
                cell += f" {_ms(r['repacked_ms'].get(kind)):>8}"
            cell += f" {_ms(tg) + tag:>9} {f'{x:.2f}' if x else '-':>5}"
            if rep:
                xr = r["ratio_ggml_over_repacked"].get(f"{g}/{kind}")
                cell += f" {f'{xr:.2f}' if xr else '-':>5}"
            if flt:
                xf = r.get("ratio_ggml_over_float", {}).get(f"{g}/{kind}")
                cell += f" {f'{xf:.2f}' if xf else '-':>5}"
            cells.append(cell)
        lines.append(f"{r['n']:>6}x{r['k']:<5} {r['m']:>4}" + "".join(cells))
    return "\n".join(lines)


def _ms(t):
    if t is None:
        return "-"
    return f"{t:.3f}" if t < 10 else f"{t:.1f}"


def cpu_flags_line(info: dict) -> str:
    cpu = info.get("cpu", {})
    on = [k for k, v in cpu.items() if v]
    line = (f"ggml {info.get('ggml_version', '?')} ({info.get('ggml_source', '?')}), CPU "
            f"features ggml uses: {' '.join(on) or 'none'}")
    if "repack_buffer" in info:  # known after a run, not from --info
        line += f"; repack buffer: {info['repack_buffer'] or 'none'}"
    return line
