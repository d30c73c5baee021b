"""KL statistics in the shape of llama.cpp's ``perplexity --kl-divergence``.

Per-token values (KL, argmax agreement, target log-probabilities) from one
or many batches become: mean KL ± standard error, max, percentiles 99.9 /
99 / 95 / 90, median, 10 / 5 / 1 / 0.1, min; mean Δp ± standard error,
RMS Δp ± error, its percentiles; same-top-token %; and, given targets,
PPL of both sides, ln(PPL_q/PPL_ref) ± standard error and the correlation
of per-token log-probabilities. ``format_kl_stats`` prints a table,
``save_kl_stats`` writes JSON.

Definitions: standard error = sample standard deviation (ddof=1) / sqrt(n)
(llama.cpp's sqrt((E[x²] - E[x]²) / (n-1)) is the same number);
percentiles interpolate linearly between order statistics (numpy's
default); Δp = Q(target) - P_ref(target); the RMS error comes from the
standard error of Δp² by the delta method; the same-top error is
sqrt(f (1 - f) / (n - 1)).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .atomic import write_json_atomic

__all__ = ["KLStats", "kl_stats", "format_kl_stats", "save_kl_stats", "PERCENTILES"]

PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)


def _np(x) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)
    return np.asarray(x).reshape(-1)


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    n = x.size
    mean = float(np.mean(x))
    se = float(np.std(x, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return mean, se


def _spread(x: np.ndarray) -> dict:
    out = {"max": float(np.max(x))}
    for p in PERCENTILES:
        out[_pkey(p)] = float(np.percentile(x, p))
    out["min"] = float(np.min(x))
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
                "stderr": math.sqrt(f * (1 - f) / (n - 1)) if n > 1 else float("nan"),
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
                "rms_stderr": ms_se / (2 * rms) if rms > 0 else float("nan"),
                **_spread(dp),
            }
            diff = lpr - lpq  # per-token ln(PPL_q / PPL_ref) contribution
            lmean, lse = _mean_se(diff)
            cor = float(np.corrcoef(lpq, lpr)[0, 1]) if lpq.size > 1 else float("nan")
            out["ppl"] = {
                "ppl_ref": math.exp(-float(lpr.mean())),
                "ppl_q": math.exp(-float(lpq.mean())),
                "ln_ratio": lmean,
                "ln_ratio_stderr": lse,
                "ratio": math.exp(lmean),
                "cor_logp": cor,
            }
        return out


def kl_stats(kl, *, same_top=None, logp_ref_target=None, logp_target=None) -> dict:
    """Statistics of one set of per-token values (see ``KLStats``)."""
    return KLStats().add(kl=kl, same_top=same_top, logp_ref_target=logp_ref_target,
                         logp_target=logp_target).summary()


def _spread_lines(d: dict, label: str, fmt, unit: str = "") -> list[str]:
    lines = [f"Maximum {label}: {fmt(d['max'])}{unit}"]
    for p in PERCENTILES:
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
            f"Mean PPL(Q)                   : {p['ppl_q']:12.6f}",
            f"Mean PPL(base)                : {p['ppl_ref']:12.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * p['cor_logp']:11.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {p['ln_ratio']:12.6f} ± {p['ln_ratio_stderr']:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {p['ratio']:12.6f}",
            "",
        ]
    k = s["kl"]
    f6 = lambda v: f"{v:11.6f}"  # noqa: E731
    lines += ["====== KL divergence statistics ======",
              f"Mean    KLD: {k['mean']:11.6f} ± {k['stderr']:10.6f}"]
    lines += _spread_lines(k, "KLD", f6)
    if "delta_p" in s or "same_top" in s:
        lines += ["", "====== Token probability statistics ======"]
    if "delta_p" in s:
        d = s["delta_p"]
        pc = lambda v: f"{100 * v:9.3f}"  # noqa: E731
        lines.append(f"Mean    Δp: {pc(d['mean'])} ± {100 * d['stderr']:7.3f} %")
        lines += _spread_lines(d, "Δp", pc, " %")
        lines.append(f"RMS Δp    : {pc(d['rms'])} ± {100 * d['rms_stderr']:7.3f} %")
    if "same_top" in s:
        t = s["same_top"]
        lines.append(f"Same top p: {100 * t['fraction']:9.3f} ± {100 * t['stderr']:7.3f} %")
    lines.append(f"({s['n_tokens']} tokens)")
    return "\n".join(lines)


def save_kl_stats(s: dict, path: str) -> None:
    """Writes the statistics as JSON atomically (temp file, fsync, replace)."""
    write_json_atomic(s, path, indent=2, allow_nan=True)
