"""KL statistics against scipy / numpy computed independently here."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as sps

from mixbits.kl import kl_compare
from mixbits.klstats import KLStats, format_kl_stats, kl_stats, save_kl_stats


def sample(rng, n=5000):
    kl = rng.gamma(0.5, 0.02, size=n)
    lpr = np.log(rng.uniform(0.01, 1, size=n))
    lpq = lpr + rng.normal(size=n) * 0.05
    lpq = np.minimum(lpq, 0)
    top = rng.random(n) < 0.93
    return kl, top, lpr, lpq


def test_against_scipy():
    rng = np.random.default_rng(0)
    kl, top, lpr, lpq = sample(rng)
    s = kl_stats(kl, same_top=top, logp_ref_target=lpr, logp_target=lpq)
    assert s["n_tokens"] == kl.size
    k = s["kl"]
    assert k["mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert k["stderr"] == pytest.approx(sps.sem(kl), rel=1e-10)
    assert k["max"] == kl.max() and k["min"] == kl.min()
    assert k["median"] == pytest.approx(np.median(kl), rel=1e-12)
    for p in (99.9, 99, 95, 90, 10, 5, 1, 0.1):
        assert k[f"p{p:g}"] == pytest.approx(sps.scoreatpercentile(kl, p), rel=1e-12)
    dp = np.exp(lpq) - np.exp(lpr)
    d = s["delta_p"]
    assert d["mean"] == pytest.approx(dp.mean(), rel=1e-10)
    assert d["stderr"] == pytest.approx(sps.sem(dp), rel=1e-10)
    assert d["rms"] == pytest.approx(math.sqrt(np.mean(dp**2)), rel=1e-10)
    assert d["rms_stderr"] == pytest.approx(sps.sem(dp**2) / (2 * math.sqrt(np.mean(dp**2))), rel=1e-10)
    assert d["p99"] == pytest.approx(np.percentile(dp, 99), rel=1e-10)
    f = top.mean()
    assert s["same_top"]["fraction"] == pytest.approx(f)
    assert s["same_top"]["stderr"] == pytest.approx(math.sqrt(f * (1 - f) / (top.size - 1)))
    p = s["ppl"]
    ppl_r, ppl_q = math.exp(-lpr.mean()), math.exp(-lpq.mean())
    assert p["ppl_ref"] == pytest.approx(ppl_r) and p["ppl_q"] == pytest.approx(ppl_q)
    assert p["ln_ratio"] == pytest.approx(math.log(ppl_q / ppl_r), rel=1e-9)
    assert p["ln_ratio_stderr"] == pytest.approx(sps.sem(lpr - lpq), rel=1e-10)
    assert p["cor_logp"] == pytest.approx(sps.pearsonr(lpq, lpr)[0], rel=1e-10)


def test_batches_equal_one_pass():
    rng = np.random.default_rng(1)
    kl, top, lpr, lpq = sample(rng, 3000)
    acc = KLStats()
    for i in range(0, 3000, 700):
        acc.add(kl=kl[i:i + 700], same_top=top[i:i + 700],
                logp_ref_target=lpr[i:i + 700], logp_target=lpq[i:i + 700])
    whole = kl_stats(kl, same_top=top, logp_ref_target=lpr, logp_target=lpq)
    assert acc.summary() == whole


def test_from_kernel_results(tmp_path):
    rng = np.random.default_rng(2)
    a = rng.normal(size=(2, 64, 3000)).astype(np.float32) * 3
    b = a + rng.normal(size=a.shape).astype(np.float32) * 0.5
    t = rng.integers(0, 3000, size=(2, 64))
    acc = KLStats()
    for i in range(2):
        acc.add(kl_compare(mx.array(a[i]), mx.array(b[i]), mx.array(t[i])))
    s = acc.summary()
    # Independent float64 computation of the same per-token quantities.
    def lsm(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    la, lb = lsm(a), lsm(b)
    kl = (np.exp(la) * (la - lb)).sum(-1).reshape(-1)
    lpr = np.take_along_axis(la, t[..., None], -1).reshape(-1)
    lpq = np.take_along_axis(lb, t[..., None], -1).reshape(-1)
    assert s["kl"]["mean"] == pytest.approx(kl.mean(), rel=1e-5)
    assert s["kl"]["p90"] == pytest.approx(np.percentile(kl, 90), rel=1e-4)
    assert s["same_top"]["fraction"] == pytest.approx(np.mean(a.argmax(-1) == b.argmax(-1)))
    assert s["ppl"]["ln_ratio"] == pytest.approx(np.mean(lpr - lpq), abs=1e-5)
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt(np.mean((np.exp(lpq) - np.exp(lpr)) ** 2)), rel=1e-4)
    text = format_kl_stats(s)
    for line in ("Mean    KLD:", "99.9%   KLD:", "Median  KLD:", " 0.1%   KLD:", "Minimum KLD:",
                 "Mean    Δp:", "RMS Δp    :", "Same top p:", "Mean ln(PPL(Q)/PPL(base))"):
        assert line in text, line
    path = tmp_path / "stats.json"
    save_kl_stats(s, str(path))
    assert json.loads(path.read_text()) == s


def test_stats_errors():
    with pytest.raises(ValueError, match="kl contains NaN"):
        kl_stats(np.array([0.1, np.nan]))
    with pytest.raises(ValueError, match="same_top has 3 values but kl has 2"):
        kl_stats(np.array([0.1, 0.2]), same_top=np.array([True, False, True]))
    with pytest.raises(ValueError, match="give both"):
        kl_stats(np.array([0.1, 0.2]), logp_target=np.array([-1.0, -2.0]))
    with pytest.raises(ValueError, match="no tokens"):
        KLStats().summary()
    acc = KLStats().add(kl=np.array([0.1]), same_top=np.array([True]))
    with pytest.raises(ValueError, match="same_top given for some batches"):
        acc.add(kl=np.array([0.2]))


# ------------------------------------------------ llama.cpp's fields and edge cases


def test_infinite_kls_give_infinite_top_percentiles_not_nan():
    rng = np.random.default_rng(3)
    kl = np.concatenate([rng.gamma(0.5, 0.02, size=1000), np.full(20, np.inf)])
    rng.shuffle(kl)
    k = kl_stats(kl)["kl"]
    assert k["max"] == np.inf and k["p99.9"] == np.inf and k["p99"] == np.inf
    for p in (95, 90, 50, 10, 1):  # between finite neighbours numpy's interpolation is the reference
        key = "median" if p == 50 else f"p{p:g}"
        assert math.isfinite(k[key]) and k[key] == pytest.approx(np.percentile(kl, p), rel=1e-12)
    assert k["mean"] == np.inf and k["stderr"] is None
    text = format_kl_stats(kl_stats(kl))
    assert "nan" not in text.lower() and "99.9%   KLD:         inf" in text


def test_delta_p_quartiles_as_llama_cpp_prints_them():
    rng = np.random.default_rng(4)
    kl, top, lpr, lpq = sample(rng, 2000)
    s = kl_stats(kl, same_top=top, logp_ref_target=lpr, logp_target=lpq)
    dp = np.exp(lpq) - np.exp(lpr)
    assert s["delta_p"]["p75"] == pytest.approx(sps.scoreatpercentile(dp, 75), rel=1e-10)
    assert s["delta_p"]["p25"] == pytest.approx(sps.scoreatpercentile(dp, 25), rel=1e-10)
    text = format_kl_stats(s)
    assert "75.0%   Δp:" in text and "25.0%   Δp:" in text


def test_ppl_uncertainties_by_the_delta_method():
    rng = np.random.default_rng(5)
    kl, top, lpr, lpq = sample(rng, 4000)
    p = kl_stats(kl, logp_ref_target=lpr, logp_target=lpq)["ppl"]
    n = lpq.size
    ppl_q, ppl_r = math.exp(-lpq.mean()), math.exp(-lpr.mean())
    # Independent: gradient of (PPL_q, PPL_r, PPL_q/PPL_r, PPL_q - PPL_r) with respect to the two
    # mean NLLs, through the covariance matrix of those means.
    sigma = np.cov(np.stack([-lpq, -lpr])) / n
    for key, grad in (("ppl_q_stderr", [ppl_q, 0]), ("ppl_ref_stderr", [0, ppl_r]),
                      ("ratio_stderr", [ppl_q / ppl_r, -ppl_q / ppl_r]), ("diff_stderr", [ppl_q, -ppl_r])):
        g = np.array(grad)
        assert p[key] == pytest.approx(math.sqrt(g @ sigma @ g), rel=1e-9), key
    assert p["diff"] == pytest.approx(ppl_q - ppl_r)
    text = format_kl_stats(kl_stats(kl, logp_ref_target=lpr, logp_target=lpq))
    assert "Mean PPL(Q)-PPL(base)         :" in text
    assert text.count("±") >= 6


def test_one_token_has_no_standard_error(tmp_path):
    s = kl_stats(np.array([0.25]), same_top=np.array([True]), logp_ref_target=np.array([-1.0]),
                 logp_target=np.array([-1.5]))
    assert s["kl"]["stderr"] is None and s["same_top"]["stderr"] is None
    assert s["ppl"]["ppl_q_stderr"] is None and s["delta_p"]["stderr"] is None
    text = format_kl_stats(s)
    assert "nan" not in text.lower() and "n/a" in text
    path = tmp_path / "one.json"
    save_kl_stats(s, str(path))
    json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
