"""KL statistics in the shape of llama.cpp's ``perplexity --kl-divergence``.

Per-token values (KL, argmax agreement, target log-probabilities) from one
or many batches become: mean KL ± standard error, max, percentiles 99.9 /
99 / 95 / 90, median, 10 / 5 / 1 / 0.1, min; mean Δp ± standard error,
RMS Δp ± error, its percentiles; same-top-token %; and, given targets,
PPL of both sides, ln(PPL_q/PPL_ref) ± standard error and the correlation
of per-token log-probabilities. ``format_kl_stats`` prints a table,
``save_kl_stats`` writes JSON.

Definitions: standard error = sample standard deviation (ddof=1) / sqrt(n)
(llama.cpp's sqrt((E[x²] - E[x]²) / (n-1)) is the same number); it is
``None`` (printed "n/a") for a single token or an infinite mean, where it
is undefined -- llama.cpp prints 0 there, which reads as "exact";
percentiles interpolate linearly between order statistics (numpy's
default), and a percentile next to an infinite value is that infinity (as
llama.cpp's interpolation gives), not inf - inf = NaN; Δp = Q(target) -
P_ref(target); the RMS error comes from the standard error of Δp² by the
delta method; the same-top error is sqrt(f (1 - f) / (n - 1)). The PPL
errors are llama.cpp's: PPL · SE(ln PPL) for each side, the ratio's from
SE of the per-token log-ratio, the difference's from both sides' errors
and their covariance.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .atomic import write_json_atomic

__all__ = ["KLStats", "kl_stats", "format_kl_stats", "save_kl_stats", "PERCENTILES", "DP_PERCENTILES"]

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
# llama.cpp also prints the quartiles of Δp.
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def _np(x) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)
    return np.asarray(x).reshape(-1)


def _mean_se(x: np.ndarray) -> tuple[float, float | None]:
    n = x.size
    mean = float(np.mean(x))
    if n < 2 or not math.isfinite(mean):
        return mean, None  # undefined, not NaN (NaN is not JSON either)
    return mean, float(np.std(x, ddof=1) / math.sqrt(n))


def _percentile(xs: np.ndarray, p: float) -> float:
    """Linear interpolation between order statistics of sorted ``xs``;
    beside an infinity the result is that infinity instead of NaN."""
    pos = p / 100.0 * (xs.size - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, xs.size - 1)
    a, b = float(xs[lo]), float(xs[hi])
    if pos == lo or a == b:
        return a
    if math.isinf(a):
        return a
    if math.isinf(b):
        return b
    return float(np.percentile(xs, p))


def _spread(x: np.ndarray, percentiles=PERCENTILES) -> dict:
    xs = np.sort(x)
    out = {"max": float(xs[-1])}
    for p in percentiles:
        out[_pkey(p)] = _percentile(xs, p)
    out["min"] = float(xs[0])
    return out


def _pkey(p: float) -> str:
    return "median" if p == 50.0 else f"p{p:g}"


class KLStats:
    """Collects per-token values over batches; ``summary()`` reduces them."""

    def __init__(self):
        self._kl: list[np.ndarray] = []
        self._top: list[np.ndarray] = []
        self._lpr: list[np.ndarray] = []
        self._lpq: list[np.ndarray] = []

    def add(self, result=None, *, kl=None, same_top=None, logp_ref_target=None, logp_target=None):
        """Adds one batch: a ``mixbits.kl.KLResult`` or the arrays themselves."""
        if result is not None:
            kl, same_top = result.kl, result.same_top
            logp_ref_target, logp_target = result.logp_ref_target, result.logp_target
        kl = _np(kl)
        if kl is None:
            raise ValueError("kl is required")
        if np.isnan(kl).any():
            raise ValueError("kl contains NaN (an invalid row was not rejected)")
        parts = {"same_top": _np(same_top), "logp_ref_target": _np(logp_ref_target),
                 "logp_target": _np(logp_target)}
        for name, v in parts.items():
            if v is not None and v.size != kl.size:
                raise ValueError(f"{name} has {v.size} values but kl has {kl.size}")
        if (parts["logp_ref_target"] is None) != (parts["logp_target"] is None):
            raise ValueError("give both logp_ref_target and logp_target, or neither")
        for store, name in ((self._top, "same_top"), (self._lpr, "logp_ref_target")):
            if self._kl and bool(store) != (parts[name] is not None):
                raise ValueError(f"{name} given for some batches but not others")
        self._kl.append(kl.astype(np.float64))
        if parts["same_top"] is not None:
            self._top.append(parts["same_top"].astype(bool))
        if parts["logp_target"] is not None:
            self._lpr.append(parts["logp_ref_target"].astype(np.float64))
            self._lpq.append(parts["logp_target"].astype(np.float64))
        return self

    @property
    def n(self) -> int:
        return int(sum(x.size for x in self._kl))

    def summary(self) -> dict:
        if self.n == 0:
            raise ValueError("no tokens added")
        kl = np.concatenate(self._kl)
        mean, se = _mean_se(kl)
        out: dict = {"n_tokens": int(kl.size), "kl": {"mean": mean, "stderr": se, **_spread(kl)}}
        if self._top:
            top = np.concatenate(self._top).astype(np.float64)
            f = float(top.mean())
            n = top.size
            out["same_top"] = {
                "fraction": f,
                "stderr": math.sqrt(f * (1 - f) / (n - 1)) if n > 1 else None,
            }
        if self._lpq:
            lpr, lpq = np.concatenate(self._lpr), np.concatenate(self._lpq)
            dp = np.exp(lpq) - np.exp(lpr)
            dmean, dse = _mean_se(dp)
            ms, ms_se = _mean_se(dp * dp)
            rms = math.sqrt(ms)
            out["delta_p"] = {
                "mean": dmean,
                "stderr": dse,
                "rms": rms,
                "rms_stderr": ms_se / (2 * rms) if ms_se is not None and rms > 0 else None,
                **_spread(dp, DP_PERCENTILES),
            }
            out["ppl"] = _ppl(lpr, lpq)
        return out


def _ppl(lpr: np.ndarray, lpq: np.ndarray) -> dict:
    """Both perplexities, their ratio and difference, each with llama.cpp's
    uncertainty (None where a standard error is undefined)."""
    n = lpq.size
    (nll_q, se_q), (nll_r, se_r) = _mean_se(-lpq), _mean_se(-lpr)
    lmean, lse = _mean_se(lpr - lpq)  # per-token ln(PPL_q / PPL_ref)
    ppl_q, ppl_r = math.exp(nll_q), math.exp(nll_r)
    ratio = math.exp(lmean)
    cor = float(np.corrcoef(lpq, lpr)[0, 1]) if n > 1 else None
    diff_se = None
    if se_q is not None and se_r is not None:
        cov = float(np.cov(lpq, lpr, ddof=1)[0, 1]) / n  # covariance of the two mean log-probs
        var = (ppl_q * se_q) ** 2 + (ppl_r * se_r) ** 2 - 2 * ppl_q * ppl_r * cov
        diff_se = math.sqrt(max(var, 0.0))
    return {
        "ppl_ref": ppl_r,
        "ppl_ref_stderr": None if se_r is None else ppl_r * se_r,
        "ppl_q": ppl_q,
        "ppl_q_stderr": None if se_q is None else ppl_q * se_q,
        "ln_ratio": lmean,
        "ln_ratio_stderr": lse,
        "ratio": ratio,
        "ratio_stderr": None if lse is None else ratio * lse,
        "diff": ppl_q - ppl_r,
        "diff_stderr": diff_se,
        "cor_logp": cor,
    }


def kl_stats(kl, *, same_top=None, logp_ref_target=None, logp_target=None) -> dict:
    """Statistics of one set of per-token values (see ``KLStats``)."""
    return KLStats().add(kl=kl, same_top=same_top, logp_ref_target=logp_ref_target,
                         logp_target=logp_target).summary()


def _pm(v, scale: float = 1.0, width: int = 10) -> str:
    return f"{'n/a':>{width}}" if v is None else f"{scale * v:{width}.6f}"


def _spread_lines(d: dict, label: str, fmt, unit: str = "", percentiles=PERCENTILES) -> list[str]:
    lines = [f"Maximum {label}: {fmt(d['max'])}{unit}"]
    for p in percentiles:
        name = "Median " if p == 50.0 else f"{p:4.1f}%"
        lines.append(f"{name:<7} {label}: {fmt(d[_pkey(p)])}{unit}")
    lines.append(f"Minimum {label}: {fmt(d['min'])}{unit}")
    return lines


def format_kl_stats(s: dict) -> str:
    """A readable table in the order llama.cpp prints its report."""
    lines = []
    if "ppl" in s:
        p = s["ppl"]
        lines += [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {p['ppl_q']:12.6f} ± {_pm(p['ppl_q_stderr'])}",
            f"Mean PPL(base)                : {p['ppl_ref']:12.6f} ± {_pm(p['ppl_ref_stderr'])}",
            "Cor(ln(PPL(Q)), ln(PPL(base))): "
            + ("        n/a" if p["cor_logp"] is None else f"{100 * p['cor_logp']:11.2f}%"),
            f"Mean ln(PPL(Q)/PPL(base))     : {p['ln_ratio']:12.6f} ± {_pm(p['ln_ratio_stderr'])}",
            f"Mean PPL(Q)/PPL(base)         : {p['ratio']:12.6f} ± {_pm(p['ratio_stderr'])}",
            f"Mean PPL(Q)-PPL(base)         : {p['diff']:12.6f} ± {_pm(p['diff_stderr'])}",
            "",
        ]
    k = s["kl"]
    f6 = lambda v: f"{v:11.6f}"  # noqa: E731
    lines += ["====== KL divergence statistics ======",
              f"Mean    KLD: {k['mean']:11.6f} ± {_pm(k['stderr'])}"]
    lines += _spread_lines(k, "KLD", f6)
    if "delta_p" in s or "same_top" in s:
        lines += ["", "====== Token probability statistics ======"]
    if "delta_p" in s:
        d = s["delta_p"]
        pc = lambda v: f"{100 * v:9.3f}"  # noqa: E731
        pe = lambda v: "    n/a" if v is None else f"{100 * v:7.3f}"  # noqa: E731
        lines.append(f"Mean    Δp: {pc(d['mean'])} ± {pe(d['stderr'])} %")
        lines += _spread_lines(d, "Δp", pc, " %", DP_PERCENTILES)
        lines.append(f"RMS Δp    : {pc(d['rms'])} ± {pe(d['rms_stderr'])} %")
    if "same_top" in s:
        t = s["same_top"]
        pe = lambda v: "    n/a" if v is None else f"{100 * v:7.3f}"  # noqa: E731
        lines.append(f"Same top p: {100 * t['fraction']:9.3f} ± {pe(t['stderr'])} %")
    lines.append(f"({s['n_tokens']} tokens)")
    return "\n".join(lines)


def save_kl_stats(s: dict, path: str) -> None:
    """Writes the statistics as JSON atomically (temp file, fsync, replace)."""
    write_json_atomic(s, path, indent=2, allow_nan=True)
