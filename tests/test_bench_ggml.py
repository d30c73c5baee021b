"""`mixbits bench --vs-ggml`: needs no ggml. A bad harness path is one clear
error before anything is timed; the harness's JSON (a sample shipped here,
as bench/ggml/ggml_mm prints it) parses into the comparison table."""

import json
import os

import pytest

from mixbits.cli import main
from mixbits.commands import bench, bench_ggml
from cpu_flags import cpu_flags

# Shortened output of build/ggml/ggml_mm --types q4_K,q4_0,q2_K --shapes
# 4096x4096 --m 1,8 (ggml from llama-cpp-python 0.3.36, one thread).
SAMPLE = """{"ggml_version": "0.25.3", "ggml_source": "llama-cpp-python==0.3.36", "cpu": {"avx": 1, "avx2": 1,
"fma": 1, "f16c": 1, "bmi2": 1, "avx_vnni": 0, "avx512": 1, "avx512_vbmi": 1,
"avx512_vnni": 1, "avx512_bf16": 0, "amx_int8": 0, "neon": 0, "dotprod": 0, "llamafile": 1},
"threads": 1, "min_time_s": 0.3, "repack_buffer": "CPU_REPACK", "results": [
{"type": "q4_K", "layout": "plain", "n": 4096, "k": 4096, "m": 1, "bpw": 4.5000,
 "weight_bytes": 9437184, "reps": 120, "cpu_median_s": 0.0021, "cpu_min_s": 0.0020,
 "wall_median_s": 0.0022, "wall_min_s": 0.0020, "rel_err_vs_dequant": 0.0041, "quantize_s": 0.5},
{"type": "q4_K", "layout": "repack", "n": 4096, "k": 4096, "m": 1, "bpw": 4.5000,
 "weight_bytes": 9437184, "reps": 150, "cpu_median_s": 0.0018, "cpu_min_s": 0.0017,
 "wall_median_s": 0.0019, "wall_min_s": 0.0017, "rel_err_vs_dequant": 0.0041, "quantize_s": 0.5},
{"type": "q4_K", "layout": "plain", "n": 4096, "k": 4096, "m": 8, "bpw": 4.5000,
 "weight_bytes": 9437184, "reps": 40, "cpu_median_s": 0.0090, "cpu_min_s": 0.0088,
 "wall_median_s": 0.0091, "wall_min_s": 0.0089, "rel_err_vs_dequant": 0.0041, "quantize_s": 0.5},
{"type": "q4_0", "layout": "plain", "n": 4096, "k": 4096, "m": 1, "bpw": 4.5000,
 "weight_bytes": 9437184, "reps": 130, "cpu_median_s": 0.0016, "cpu_min_s": 0.0015,
 "wall_median_s": 0.0017, "wall_min_s": 0.0015, "rel_err_vs_dequant": 0.006, "quantize_s": 0.1},
{"type": "q2_K", "layout": "repack", "n": 4096, "k": 4096, "m": 1, "unsupported": true}
]}
"""


def _fail(capsys, path):
    rc = main(["bench", "--vs-ggml", str(path), "--shapes", "64x64", "--m", "1"])
    err = capsys.readouterr()
    assert rc == 2
    assert "--vs-ggml" in err.err and "bench/ggml/build.sh" in err.err
    assert len(err.err.strip().splitlines()) == 1
    return err


@pytest.fixture
def no_timing(monkeypatch):
    """Anything that would time or probe fails the test."""
    def boom(*a, **k):
        raise AssertionError("timed before the harness was checked")

    monkeypatch.setattr(bench, "probe_gbps", boom)
    monkeypatch.setattr(bench, "time_call", boom)


def test_missing_harness(tmp_path, capsys, no_timing):
    err = _fail(capsys, tmp_path / "nope" / "ggml_mm")
    assert "does not exist" in err.err


def test_not_executable(tmp_path, capsys, no_timing):
    p = tmp_path / "ggml_mm"
    p.write_text("not a program\n")
    os.chmod(p, 0o644)
    if os.access(p, os.X_OK):  # root ignores mode bits for some checks
        pytest.skip("running as a user who may execute anything")
    assert "not executable" in _fail(capsys, p).err


def test_directory(tmp_path, capsys, no_timing):
    assert "not a file" in _fail(capsys, tmp_path).err


def test_not_the_harness(tmp_path, capsys, no_timing):
    p = tmp_path / "ggml_mm"
    p.write_text("#!/bin/sh\necho hello\n")
    os.chmod(p, 0o755)
    assert "not the ggml_mm harness" in _fail(capsys, p).err


def test_parse_sample():
    parsed = bench_ggml.parse_output(SAMPLE)
    assert parsed["info"]["ggml_version"] == "0.25.3"
    assert parsed["info"]["cpu"]["avx2"] == 1
    assert len(parsed["rows"]) == 4  # the unsupported layout is dropped
    best = bench_ggml.best_times(parsed, "cpu")
    t, layout, _ = best[("q4_K", 4096, 4096, 1)]
    assert layout == "repack" and t == pytest.approx(0.0018)
    assert best[("q4_K", 4096, 4096, 8)][1] == "plain"
    assert ("q2_K", 4096, 4096, 1) not in best
    line = bench_ggml.cpu_flags_line(parsed["info"])
    assert "avx512" in line and "CPU_REPACK" in line and "avx_vnni" not in line
    info_only = {k: v for k, v in parsed["info"].items() if k != "repack_buffer"}
    assert "repack" not in bench_ggml.cpu_flags_line(info_only)  # `--info` does not know it


def test_comparison_table():
    best = bench_ggml.best_times(bench_ggml.parse_output(SAMPLE), "wall")
    rows = []
    for m, t in ((1, 0.0012), (8, 0.0030)):
        r = bench.Row(bench.Case(4096, 4096, m, "4bit"), 4.5, 9437184)
        r.times["mixbits"] = {"best_s": t}
        rows.append(r)
    recs = bench_ggml.comparison(rows, best)
    assert [r["m"] for r in recs] == [1, 8]
    assert recs[0]["ratio_ggml_over_mixbits"]["q4_K/4bit"] == pytest.approx(0.0017 / 0.0012)
    assert recs[0]["ratio_ggml_over_mixbits"]["q4_0/4bit"] == pytest.approx(0.0015 / 0.0012)
    assert "q4_0/4bit" not in recs[1]["ratio_ggml_over_mixbits"]
    table = bench_ggml.format_comparison(recs)
    assert "1.42" in table and "1.700R" in table
    json.dumps(recs)


def test_comparison_table_with_repacked_times():
    best = bench_ggml.best_times(bench_ggml.parse_output(SAMPLE), "wall")
    r = bench.Row(bench.Case(4096, 4096, 1, "4bit"), 4.5, 9437184)
    r.times["mixbits"] = {"best_s": 0.0012}
    r.times["mixbits_repacked"] = {"best_s": 0.0010}
    recs = bench_ggml.comparison([r], best)
    assert recs[0]["repacked_ms"]["4bit"] == pytest.approx(1.0)
    assert recs[0]["ratio_ggml_over_repacked"]["q4_K/4bit"] == pytest.approx(1.7)
    table = bench_ggml.format_comparison(recs)
    assert "xrep" in table and "1.70" in table
    d = r.derived(10.0)
    assert d["speedup_repacked_vs_mixbits"] == pytest.approx(1.2)
    assert "1.20" in bench.format_repacked_table([r], 10.0)
    assert bench.m8_over_m1([r], "mixbits_repacked") == {}  # no M=8 row


def test_dot_floor():
    """M = 8 rows of a 4096 x 4096 weight need 4096 * 4096 * 8 / 64 dots."""
    rows = []
    for m, t in ((1, 0.0004), (8, 0.0012)):
        r = bench.Row(bench.Case(4096, 4096, m, "2bit"), 2.5, 5 << 20)
        r.times["mixbits_repacked"] = {"best_s": t}
        rows.append(r)
    f = bench.dot_floor(rows, 0.25, "mixbits_repacked")["4096x4096-2bit"]
    floor_s = 4096 * 4096 * 8 / 64 * 0.25e-9  # 0.524 ms
    assert f["m8_floor_ms"] == pytest.approx(floor_s * 1e3, rel=1e-3)
    assert f["best_m8_over_m1"] == pytest.approx(floor_s / 0.0004, rel=1e-3)
    assert f["m8_over_floor"] == pytest.approx(0.0012 / floor_s, rel=1e-3)
    assert bench.dot_floor(rows[:1], 0.25, "mixbits_repacked") == {}  # no M=8 row


def test_vpdpbusd_floor_only_for_the_vnni_kernels():
    assert bench.runs_vpdpbusd("int8", "auto") and bench.runs_vpdpbusd("int8-all", "avx512")
    # The forced AVX2 rows use maddubs/madd; the float and int16 contracts no int8 dots.
    for act, backend in [("int8", "avx2"), ("int8", "ref"), ("int8", "neon"), ("float", "auto"),
                         ("int16", "auto")]:
        assert not bench.runs_vpdpbusd(act, backend), (act, backend)


def test_int8_dot_probe():
    """The vpdpbusd probe: 0 without AVX512-VNNI (as the extension sees the
    CPU: cpu_flags), else a plausible time (a 512-bit dot issues
    at most a few per cycle, and takes well under 10 ns)."""
    from mixbits import _ext

    ns = _ext.int8_dot_ns(2)
    if "avx512_vnni" in cpu_flags():
        assert 0.05 < ns < 10
    else:
        assert ns == 0.0
    with pytest.raises(ValueError):
        _ext.int8_dot_ns(0)


@pytest.mark.parametrize("text", ["", "[]", '{"results": [{"type": "q4_0"}]}'])
def test_parse_bad_output(text):
    with pytest.raises(bench_ggml.HarnessError):
        bench_ggml.parse_output(text)


def test_cold_runs_both_libraries_on_rotating_copies(tmp_path, monkeypatch):
    """--cold: every mixbits call takes the next copy of the weight (the
    same values in other memory, enough copies to fill COLD_MB), and the
    ggml harness is asked for the same (--cold-mb)."""
    import shlex

    import mlx.core as mx
    import numpy as np

    import mixbits

    mx.set_default_device(mx.cpu)  # the repacked layout's kernels are CPU kernels
    wt = bench.Weights(64, 128, "4bit")
    copies = wt.copies()
    assert len(copies) == min(bench.MAX_COPIES, -(-(bench.COLD_MB << 20) // wt.nbytes)) > 1
    x = bench.make_x(bench.Case(64, 128, 1, "4bit"))
    want = np.array(mixbits.qmatmul(x, wt.qt))
    for c in copies[1:3]:
        assert c is not wt.qt and c.segments[0].wq is not wt.qt.segments[0].wq
        for a, b in zip(c.arrays(), wt.qt.arrays()):
            assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(np.array(mixbits.qmatmul(x, c)), want)
    packed = wt.copies(repacked=True)
    assert len(packed) == len(copies) and all(type(p).__name__ == "RepackedTensor" for p in packed)

    seen = []
    real = mixbits.qmatmul
    monkeypatch.setattr(mixbits, "qmatmul", lambda x, t, **kw: seen.append(t) or real(x, t, **kw))
    fns = bench.runners(wt, x, cold=True)
    for _ in range(len(copies) + 1):
        fns["mixbits"]()
    assert [id(t) for t in seen] == [id(c) for c in copies] + [id(copies[0])]
    seen.clear()
    fns["mixbits_repacked"]()
    fns["mixbits_repacked"]()
    assert [id(t) for t in seen] == [id(packed[0]), id(packed[1])]

    # the harness gets --cold-mb; a stand-in records its argv and prints a minimal result
    argv_file = tmp_path / "argv"
    fake = tmp_path / "ggml_mm"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$@\" > {shlex.quote(str(argv_file))}\n"
                    "echo '{\"ggml_version\": \"x\", \"ggml_source\": \"x\", \"cpu\": {}, \"threads\": 1, "
                    "\"min_time_s\": 0.1, \"repack_buffer\": \"\", \"results\": []}'\n")
    os.chmod(fake, 0o755)
    bench_ggml.run_harness(str(fake), [(64, 128)], [1], 1, 0.1, cold_mb=bench.COLD_MB)
    assert f"--cold-mb {bench.COLD_MB}" in argv_file.read_text()
    bench_ggml.run_harness(str(fake), [(64, 128)], [1], 1, 0.1)
    assert "--cold-mb" not in argv_file.read_text()


def test_calls_per_eval(monkeypatch, capsys):
    """--calls-per-eval N: each timed evaluation of mixbits holds N calls
    (on the copies in turn when cold) in one mx.eval, and the reported
    times are per call; MLX's and numpy's runners stay one call each."""
    import mlx.core as mx

    import mixbits

    mx.set_default_device(mx.cpu)
    wt = bench.Weights(64, 128, "4bit")
    x = bench.make_x(bench.Case(64, 128, 1, "4bit"))
    copies = wt.copies()
    evals, seen = [], []
    real_eval, real_qmm = mx.eval, mixbits.qmatmul
    monkeypatch.setattr(mx, "eval", lambda *a: evals.append(a) or real_eval(*a))
    monkeypatch.setattr(mixbits, "qmatmul", lambda x, t, **kw: seen.append(t) or real_qmm(x, t, **kw))
    fns = bench.runners(wt, x, cold=True, calls_per_eval=3)
    fns["mixbits"]()
    fns["mixbits"]()
    assert len(evals) == 2 and all(len(a[0]) == 3 for a in evals)
    assert [id(t) for t in seen] == [id(c) for c in copies[:6]]
    evals.clear()
    fns["mlx"]()
    assert len(evals) == 1 and not isinstance(evals[0][0], list)

    # a clock that advances 1 s per call: per-call times whatever N is
    ticks = [0.0]
    monkeypatch.setattr(bench, "CLOCK", lambda: ticks[0])

    def calls(n):
        def fn():
            ticks[0] += n
        return fn

    for n in (1, 3, 8):
        t = bench.time_call(calls(n), min_time=0.0, min_reps=4, calls=n)
        assert t["median_s"] == t["min_s"] == 1.0 and t["calls_per_eval"] == n

    # a count below 1 is refused before anything is timed
    def boom(*a, **k):
        raise AssertionError("timed before the arguments were checked")

    monkeypatch.setattr(bench, "probe_gbps", boom)
    monkeypatch.setattr(bench, "time_call", boom)
    with pytest.raises(SystemExit, match="--calls-per-eval must be >= 1"):
        main(["bench", "--shapes", "64x64", "--m", "1", "--calls-per-eval", "0"])
