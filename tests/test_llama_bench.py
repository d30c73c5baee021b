"""bench/bench_decode.py --llama-bench: needs no llama.cpp. A bad path is one
clear error before anything is timed; llama-bench's JSON (a sample captured
from build/ggml/llama-bench, tests/data/llama_bench_sample.json) parses into
wall-clock rates; CPU-time rates are the difference of two processes' rusage
(checked with a stand-in llama-bench that prints the sample)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = Path(__file__).resolve().parent / "data" / "llama_bench_sample.json"

_spec = importlib.util.spec_from_file_location("llama_bench", ROOT / "bench" / "llama_bench.py")
lb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lb)

HELP = ("usage: llama-bench [options]\n  -r, --repetitions <n>\n  -o, --output <csv|json>\n"
        "  -p, --n-prompt <n>\n  -n, --n-gen <n>\n  -d, --n-depth <n>\n  -t, --threads <n>\n")


def _exe(tmp_path, body: str, name="llama-bench") -> Path:
    p = tmp_path / name
    p.write_text(body)
    p.chmod(0o755)
    return p


def test_check_executable_errors(tmp_path):
    for bad, why in [(None, "no path given"), ("", "no path given"),
                     (str(tmp_path / "nope"), "does not exist"), (str(tmp_path), "is not a file")]:
        with pytest.raises(lb.LlamaBenchError, match=why) as e:
            lb.check_executable(bad)
        assert "build_llama_bench.sh" in str(e.value)
    f = tmp_path / "plain"
    f.write_text("x")
    with pytest.raises(lb.LlamaBenchError, match="not executable"):
        lb.check_executable(str(f))
    exe = _exe(tmp_path, "#!/bin/sh\n")
    assert lb.check_executable(str(exe)) == str(exe)


def test_check_runs_wants_llama_bench_flags(tmp_path):
    other = _exe(tmp_path, "#!/bin/sh\necho 'usage: something else'\n", "other")
    with pytest.raises(lb.LlamaBenchError, match="is not llama-bench.*lacks --n-prompt"):
        lb.check_runs(str(other))
    failing = _exe(tmp_path, f"#!/bin/sh\necho '{HELP}'\nexit 3\n", "failing")
    with pytest.raises(lb.LlamaBenchError, match="rc 3"):
        lb.check_runs(str(failing))
    ok = _exe(tmp_path, f"""#!/bin/sh
if [ "$1" = --version ]; then echo 'version: 1 (abc)' >&2; exit 0; fi
cat <<'EOF'
{HELP}
EOF
""")
    assert lb.check_runs(str(ok)) == "version: 1 (abc)"


def test_parse_sample():
    tests = lb.parse_output(SAMPLE.read_text())
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"], t["n_threads"]) for t in tests] == [(64, 0, 0, 1),
                                                                                           (0, 32, 0, 1)]
    for t in tests:
        ns = sorted(t["samples_ns"])
        assert t["reps"] == len(ns) == 3
        assert t["tokens"] == t["n_prompt"] + t["n_gen"]
        assert t["wall_median_tps"] == pytest.approx(t["tokens"] / (ns[1] * 1e-9))
        assert t["wall_best_tps"] == pytest.approx(t["tokens"] / (ns[0] * 1e-9))
        # llama-bench's own mean of the per-repetition rates is close to ours
        assert t["avg_ts"] == pytest.approx(t["wall_median_tps"], rel=0.2)


@pytest.mark.parametrize("text, why", [
    ("not json", "not JSON"),
    ("[]", "non-empty JSON list"),
    ('{"n_prompt": 1}', "non-empty JSON list"),
    ("[1]", "not an object"),
    ('[{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "n_threads": 1, "avg_ts": 1}]', "lacks \\['samples_ns'\\]"),
    ('[{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "n_threads": 1, "avg_ts": 1, "samples_ns": []}]', "bad samples"),
    ('[{"n_prompt": 64, "n_gen": 0, "n_depth": 0, "n_threads": 1, "avg_ts": 1, "samples_ns": [0]}]', "bad samples"),
])
def test_parse_errors(text, why):
    with pytest.raises(lb.LlamaBenchError, match=why):
        lb.parse_output(text)


def test_cpu_rates_subtract_the_short_run():
    def run(reps, cpu):
        t = lb.parse_output(json.dumps([{"n_prompt": 0, "n_gen": 32, "n_depth": 64, "n_threads": 1,
                                         "avg_ts": 80.0, "samples_ns": [400_000_000] * reps}]))
        return {"tests": t, "process_cpu_s": cpu}

    r = lb.cpu_rates(run(10, 5.0), run(1, 1.4))
    assert r["cpu_per_rep_s"] == pytest.approx(0.4)
    assert r["cpu_tps"] == pytest.approx(80.0)
    assert r["cpu_over_wall"] == pytest.approx(1.0)
    with pytest.raises(lb.LlamaBenchError, match="more repetitions"):
        lb.cpu_rates(run(1, 1.0), run(1, 1.0))


def test_measure_with_stand_in(tmp_path):
    """measure() runs prefill (-p 64 -n 0 -d 0) and decode (-p 0 -n 32 -d 64),
    each with -r REPS and -r 1, one thread, on the given model file."""
    log = tmp_path / "calls.txt"
    script = _exe(tmp_path, f"""#!{sys.executable}
import json, sys
a = sys.argv[1:]
open({str(log)!r}, "a").write(" ".join(a) + "\\n")
v = dict(zip(a[::2], a[1::2]))
reps = int(v["-r"])
print(json.dumps([{{"n_prompt": int(v["-p"]), "n_gen": int(v["-n"]), "n_depth": int(v["-d"]),
                   "n_threads": int(v["-t"]), "avg_ts": 1.0, "samples_ns": [10**8] * reps}}]))
""")
    m = lb.measure(str(script), "/models/x.gguf", 64, 32, 5)
    calls = log.read_text().splitlines()
    assert calls == [f"-m /models/x.gguf -t 1 -p {p} -n {n} -d {d} -r {r} -o json"
                     for p, n, d in [(64, 0, 0), (0, 32, 64)] for r in (5, 1)]
    assert m["prefill"]["test"]["wall_median_tps"] == pytest.approx(640)
    assert m["decode"]["test"]["wall_median_tps"] == pytest.approx(320)
    assert m["decode"]["test"]["n_depth"] == 64
    assert [r["command"][-3] for r in m["decode"]["runs"]] == ["5", "1"]


def test_measure_reports_a_failing_run(tmp_path):
    script = _exe(tmp_path, "#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(lb.LlamaBenchError, match="failed \\(rc 1\\).*failed to load model"):
        lb.measure(str(script), "/models/x.gguf", 64, 32, 3)


@pytest.mark.parametrize("path, why", [("/nonexistent/llama-bench", "does not exist"), ("tests", "is not a file")])
def test_bench_decode_refuses_before_timing(path, why):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_decode.py"), "--llama-bench", path,
                          "--out", os.devnull], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"error: --llama-bench: {path} {why}"
        + (" (want the llama-bench executable)" if why == "is not a file" else "")
        + "; build it with bench/ggml/build_llama_bench.sh (it writes build/ggml/llama-bench)"]
    assert "prefill" not in out.stdout and "load average" not in out.stdout
