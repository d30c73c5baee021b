"""Fused KL divergence under pytest-benchmark, with its baselines and bounds
measured in the same run:

- ``mlx``: the MLX op composition (log_softmax of both sides in float32,
  sum p (log p - log q)); ``numpy``: the same in float32 numpy;
- ``mixbits``: ``kl_divergence`` (one pass over both logit arrays);
- ``ref:<form>``: ``KLReference(...).compare`` for each prepared form;
- bounds: bytes read / the bandwidth probe (``probe_gbps``, best of the
  session's readings), and the exps
  the pass needs / the exp throughput of the kernel's own vectorized exp
  on cache-resident data (``_ext.kl_exp_seconds``).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python -m pytest bench/bench_kl.py

The table is printed at the end and saved as bench/results/kl.json; the
accuracy of the compact reference form as bench/results/kl_accuracy.json.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mixbits import _ext
from mixbits.kl import KLReference, kl_divergence

CASES = [(256, 151936), (2048, 49152), (64, 262144)]
IMPLS = ["mixbits", "ref:logits", "ref:probs32", "ref:probs16", "mlx", "numpy"]
_ROWS: dict = {}


@functools.lru_cache(maxsize=1)
def _data(M: int, V: int):
    """float16 reference logits and a candidate close to it (KL ~ 5e-3)."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((M, V), dtype=np.float32) * 3).astype(np.float16)
    b = (a + rng.standard_normal((M, V), dtype=np.float32) * 0.1).astype(np.float16)
    A, B = mx.array(a), mx.array(b)
    mx.eval(A, B)
    return a, b, A, B


@functools.lru_cache(maxsize=3)
def _reference(M: int, V: int, form: str) -> KLReference:
    return KLReference(_data(M, V)[2], form=form)


def mlx_kl(A, B):
    la = A.astype(mx.float32)
    lb = B.astype(mx.float32)
    la = la - mx.logsumexp(la, axis=-1, keepdims=True)
    lb = lb - mx.logsumexp(lb, axis=-1, keepdims=True)
    out = mx.sum(mx.exp(la) * (la - lb), axis=-1)
    mx.eval(out)
    return out


def numpy_kl(a, b):
    a = a.astype(np.float32)
    b = b.astype(np.float32)
    a -= a.max(-1, keepdims=True)
    b -= b.max(-1, keepdims=True)
    la = a - np.log(np.exp(a).sum(-1, keepdims=True))
    lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
    return (np.exp(la) * (la - lb)).sum(-1)


def _runner(impl: str, M: int, V: int):
    a, b, A, B = _data(M, V)
    if impl == "mixbits":
        return lambda: kl_divergence(A, B)
    if impl.startswith("ref:"):
        ref = _reference(M, V, impl[4:])
        return lambda: mx.eval(ref.compare(B).kl)
    if impl == "mlx":
        return lambda: mlx_kl(A, B)
    return lambda: numpy_kl(a, b)


def _bytes_and_exps(impl: str, M: int, V: int) -> tuple[int, int]:
    cand = 2 * M * V
    if impl.startswith("ref:"):
        ref = _reference(M, V, impl[4:])
        exps = 2 * M * V if impl == "ref:logits" else M * V
        return ref.nbytes + cand, exps
    return 2 * cand, 2 * M * V


@functools.lru_cache(maxsize=1)
def _exp_rate() -> float:
    """Exps per second of the kernel's exp, all threads, cache-resident:
    best of many short runs (the machine is shared; the bound is the
    unloaded rate), measured once per session like the bandwidth probe."""
    n = 1 << 25
    return n / min(_ext.kl_exp_seconds(n, 0) for _ in range(25))


@functools.lru_cache(maxsize=1)
def _bandwidth(fixture_gbps: float) -> float:
    """The best read bandwidth seen this session: the conftest probe and a
    few more readings of the same probe (one reading on a shared machine
    can land in a busy moment and make every kernel look better)."""
    more = [_ext.read_bandwidth_gbps(1 << 28, 3) for _ in range(8)]
    return max([fixture_gbps] + more)


def _exp_seconds(n: int) -> float:
    return n / _exp_rate()


def _format(rows, meta) -> str:
    bw = meta["probe_gbps"]
    head = (f"{'case':<14}{'impl':<13}{'ms':>9}{'x mlx':>8}{'x numpy':>9}{'GB/s':>7}"
            f"{'bw ms':>7}{'exp ms':>8}{'% bw':>6}{'% exp':>7}{'% bound':>8}")
    out = [f"bandwidth probe {bw:.1f} GB/s; exp rate {meta['exp_rate'] / 1e9:.2f} G exp/s "
           "(the kernel's exp, all threads, cache-resident data)", head]
    for r in rows:
        case = f"{r['M']}x{r['V']}"
        base = {x["impl"]: x for x in rows if x["M"] == r["M"] and x["V"] == r["V"]}

        def ratio(k):
            t = base.get(k, {}).get("best_s")
            return f"{t / r['best_s']:8.1f}" if t else f"{'-':>8}"

        if r["impl"] in ("mlx", "numpy"):
            out.append(f"{case:<14}{r['impl']:<13}{1e3 * r['best_s']:9.1f}{ratio('mlx')}{ratio('numpy'):>9}")
            continue
        out.append(
            f"{case:<14}{r['impl']:<13}{1e3 * r['best_s']:9.2f}{ratio('mlx')}{ratio('numpy'):>9}"
            f"{r['gbps']:7.1f}{1e3 * r['bw_s']:7.1f}{1e3 * r['exp_s']:8.1f}"
            f"{100 * r['bw_s'] / r['best_s']:6.0f}{100 * r['exp_s'] / r['best_s']:7.0f}"
            f"{100 * max(r['bw_s'], r['exp_s']) / r['best_s']:8.0f}"
        )
    out.append("% bound: of the slower bound (max of bw ms, exp ms), i.e. the one that binds")
    return "\n".join(out)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("M,V", CASES, ids=[f"{m}x{v}" for m, v in CASES])
def test_kl(benchmark, M, V, impl, probe_gbps, bench_table):
    table = bench_table("kl", _format)
    probe_gbps = _bandwidth(probe_gbps)
    table.meta["probe_gbps"] = probe_gbps
    table.meta["exp_rate"] = _exp_rate()
    fn = _runner(impl, M, V)
    slow = impl in ("mlx", "numpy")
    benchmark.group = f"kl {M}x{V}"
    benchmark.pedantic(fn, rounds=2 if slow else 9, iterations=1, warmup_rounds=0 if slow else 1)
    st = benchmark.stats.stats
    row = {"M": M, "V": V, "impl": impl, "best_s": st.min, "median_s": st.median}
    if not slow:
        nbytes, nexp = _bytes_and_exps(impl, M, V)
        row.update(bytes=nbytes, exps=nexp, gbps=nbytes / st.min / 1e9,
                   bw_s=nbytes / (probe_gbps * 1e9), exp_s=_exp_seconds(nexp))
    benchmark.extra_info.update(row)
    table.add(row)


def _acc_format(rows, meta) -> str:
    out = [f"{'noise':>6}{'form':>9}{'mean KL':>12}{'rel err mean':>14}{'max |err|':>11}"
           f"{'p50 rel':>10}{'p99 rel':>10}{'max rel':>10}"]
    for r in rows:
        out.append(f"{r['noise']:6.2f}{r['form']:>9}{r['mean_kl']:12.5f}{r['rel_err_mean']:14.2e}"
                   f"{r['max_abs_err']:11.2e}{r['p50_rel']:10.2e}{r['p99_rel']:10.2e}{r['max_rel']:10.2e}")
    out.append("errors of per-token KL against float64 numpy on the same float16 logits")
    return "\n".join(out)


def test_reference_form_accuracy(bench_table):
    """What each prepared reference form costs in accuracy (not timed)."""
    table = bench_table("kl_accuracy", _acc_format)
    rng = np.random.default_rng(1)
    M, V = 64, 151936
    a = (rng.standard_normal((M, V), dtype=np.float32) * 3).astype(np.float16)
    a64 = a.astype(np.float64)
    la = a64 - a64.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    refs = {f: KLReference(mx.array(a), form=f) for f in KLReference.FORMS}
    for noise in (0.03, 0.1, 0.3, 1.0):
        b = (a + rng.standard_normal((M, V), dtype=np.float32) * noise).astype(np.float16)
        b64 = b.astype(np.float64)
        lb = b64 - b64.max(-1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        exact = (np.exp(la) * (la - lb)).sum(-1)
        B = mx.array(b)
        for form, got in [("direct", kl_divergence(mx.array(a), B))] + [
            (f, r.compare(B).kl) for f, r in refs.items()
        ]:
            err = np.abs(np.array(got).astype(np.float64) - exact)
            rel = err / exact
            table.add({"noise": noise, "form": form, "mean_kl": float(exact.mean()),
                       "rel_err_mean": float(abs(np.array(got).mean() - exact.mean()) / exact.mean()),
                       "max_abs_err": float(err.max()), "p50_rel": float(np.median(rel)),
                       "p99_rel": float(np.percentile(rel, 99)), "max_rel": float(rel.max())})
            assert np.all(np.isfinite(err))
