"""Fuzz worker, run in a subprocess by test_fuzz.py so a crash (segfault,
abort) fails that test instead of killing pytest.

``python fuzz_worker.py SEED SECONDS MAX_CASES`` runs random cases (the
same sequence for a seed) until MAX_CASES or the time is up and prints one
JSON line: {"cases": {kind: n}, "failures": [...]}.
Every case either matches an independent reference (numpy float64 from
mx.dequantize, MLX's own op, the safetensors package) or raises an
expected error (a MixbitsError, or ValueError/TypeError as MLX raises them)
whose message names the argument. Anything else is a failure.
"""

from __future__ import annotations

import copy
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mixbits
from mixbits.errors import FormatError, MixbitsError
from mixbits.layout import BITS, GROUP_SIZES

HERE = Path(__file__).resolve().parent
DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 8e-2}
ARG_NAMES = ("bits", "group_size", "k_columns", "segments", "x", "perm", "w", "scales", "biases",
             "logits", "ref_logits", "K=")


class Failure(Exception):
    pass


def _expect_error(e: BaseException, names=ARG_NAMES) -> None:
    if not isinstance(e, (MixbitsError, ValueError, TypeError)):
        raise Failure(f"unexpected {type(e).__name__}: {e}")
    if not any(n in str(e) for n in names):
        raise Failure(f"{type(e).__name__} does not name an argument: {e}")


def _close(got: np.ndarray, ref: np.ndarray, tol: float, what: str) -> None:
    if got.shape != ref.shape:
        raise Failure(f"{what}: shape {got.shape} != {ref.shape}")
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(got)):
        raise Failure(f"{what}: finiteness differs from the reference")
    scale = max(1.0, float(np.abs(ref[fin]).max())) if fin.any() else 1.0
    err = float(np.abs(got[fin] - ref[fin]).max()) if fin.any() else 0.0
    if err > tol * scale:
        raise Failure(f"{what}: max error {err:.3g} > {tol * scale:.3g}")


# ------------------------------------------------------------ kernels


def _random_segments(rng, k_groups_max=3):
    segs = []
    for _ in range(rng.integers(1, 4)):
        bits = rng.choice([*BITS, "ternary"])
        bits = bits if bits == "ternary" else int(bits)
        gs = int(rng.choice(GROUP_SIZES))
        segs.append((bits, gs, gs * int(rng.integers(1, k_groups_max + 1))))
    return segs


def _mutate_segments(rng, segs):
    """One invalid change, or None for a valid case."""
    i = int(rng.integers(len(segs)))
    b, g, k = segs[i]
    bad = rng.integers(6)
    segs = list(segs)
    if bad == 0:
        segs[i] = (rng.choice([1, 7, 9, -4, 0]).item(), g, k)
    elif bad == 1:
        segs[i] = (4.0, g, k)
    elif bad == 2:
        segs[i] = (b, int(rng.choice([16, 48, 256, 0])), k)
    elif bad == 3:
        segs[i] = (b, g, k + int(rng.integers(1, g)))
    elif bad == 4:
        segs[i] = (b, g)
    else:
        segs[i] = ("x", g, k)
    return segs


def case_qmatmul(rng):
    segs = _random_segments(rng)
    invalid = rng.random() < 0.3
    if invalid:
        segs = _mutate_segments(rng, segs)
    K = sum(s[2] for s in segs if len(s) == 3 and isinstance(s[2], int))
    K = max(K, 32)
    N = int(rng.integers(0, 24))
    dtype = DTYPES[rng.integers(3)]
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0]))
    perm = rng.permutation(K) if rng.random() < 0.4 else None
    lead = tuple(int(d) for d in rng.integers(0, 4, size=rng.integers(1, 3)))
    x_np = rng.standard_normal(lead + (K,)).astype(np.float32)
    bad_x = not invalid and rng.random() < 0.1
    try:
        qt = mixbits.quantize(w.astype(dtype), segs, perm=perm)
        x = mx.array(x_np).astype(dtype)
        if bad_x:
            x = x[..., :-1] if rng.random() < 0.5 else x.astype(mx.int32)
        y = mixbits.qmatmul(x, qt)
        mx.eval(y)
    except Exception as e:  # noqa: BLE001 -- classified below
        if not (invalid or bad_x):
            raise Failure(f"valid case raised {type(e).__name__}: {e} (segments {segs})")
        _expect_error(e)
        return
    if invalid or bad_x:
        raise Failure(f"invalid case accepted: segments {segs}, bad x {bad_x}")
    wd = np.array(qt.dequantize().astype(mx.float32), dtype=np.float64)
    xs = np.array(x.astype(mx.float32), dtype=np.float64)
    if perm is not None:
        xs = xs[..., perm]
    ref = xs @ wd.T
    _close(np.array(y.astype(mx.float32), dtype=np.float64), ref, TOL[dtype], f"qmatmul {segs}")


def case_quantized_matmul(rng):
    bits = int(rng.choice(BITS))
    gs = int(rng.choice(GROUP_SIZES))
    K, N = gs * int(rng.integers(1, 4)), int(rng.integers(1, 20))
    dtype = DTYPES[rng.integers(3)]
    wq, s, b = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(dtype),
                           group_size=gs, bits=bits)
    x = mx.array(rng.standard_normal((int(rng.integers(1, 5)), K)).astype(np.float32)).astype(dtype)
    if dtype == mx.float32 and rng.random() < 0.2:
        # float32 only: in half precision MLX rounds s*q+b to the half type,
        # so a weight it rounds to 0 gives NaN (0*inf) where the exact
        # weight gives +-inf; neither is wrong.
        x_np = np.array(x.astype(mx.float32))
        x_np[0, int(rng.integers(K))] = rng.choice([np.inf, -np.inf])
        x = mx.array(x_np).astype(dtype)
    ours = mixbits.quantized_matmul(x, wq, s, b, group_size=gs, bits=bits)
    theirs = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    got = np.array(ours.astype(mx.float32), dtype=np.float64)
    ref = np.array(theirs.astype(mx.float32), dtype=np.float64)
    if not (np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(np.isinf(got), np.isinf(ref))):
        raise Failure(f"quantized_matmul {bits}b g{gs}: inf/NaN pattern differs from MLX")
    _close(got, ref, TOL[dtype] * 4, f"quantized_matmul {bits}b g{gs}")


def _kl_ref(p, q):
    def lsm(z):
        m = np.max(z, axis=-1, keepdims=True)
        return z - m - np.log(np.sum(np.exp(z - m), axis=-1, keepdims=True))

    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        lp, lq = lsm(p), lsm(q)
        pp = np.exp(lp)
        # Reference mass below float32's range is 0 in the kernel (its exp
        # underflows): such a token adds nothing even where Q is -inf.
        pp = np.where(pp < 1e-37, 0.0, pp)
        terms = np.where(pp > 0, pp * (lp - lq), 0.0)
        return terms.sum(-1)


def case_kl(rng):
    V = int(rng.integers(1, 300))
    lead = tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(1, 3)))
    dtype = DTYPES[rng.integers(3)]
    a = rng.standard_normal(lead + (V,)) * rng.choice([0.1, 3.0, 30.0]) + rng.choice([0.0, 1e4])
    b = a + rng.standard_normal(a.shape) * rng.choice([0.01, 1.0])
    special = rng.random() < 0.3
    if special:
        idx = tuple(int(rng.integers(d)) for d in a.shape)
        (a if rng.random() < 0.5 else b)[idx] = rng.choice([np.nan, np.inf, -np.inf])
    A = mx.array(a.astype(np.float32)).astype(dtype)
    B = mx.array(b.astype(np.float32)).astype(dtype)
    try:
        got = np.array(mixbits.kl_divergence(A, B), dtype=np.float64)
    except Exception as e:  # noqa: BLE001
        an = np.array(A.astype(mx.float32), dtype=np.float64)
        bn = np.array(B.astype(mx.float32), dtype=np.float64)
        bad = (np.isnan(an).any() or np.isnan(bn).any() or np.isposinf(an).any() or np.isposinf(bn).any()
               or np.isneginf(an).all(-1).any() or np.isneginf(bn).all(-1).any())
        if not bad:
            raise Failure(f"kl_divergence raised on valid input: {type(e).__name__}: {e}")
        _expect_error(e)
        return
    an = np.array(A.astype(mx.float32), dtype=np.float64)
    bn = np.array(B.astype(mx.float32), dtype=np.float64)
    ref = _kl_ref(an, bn)
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(got)):
        raise Failure("kl_divergence: finiteness differs from float64")
    if fin.any() and np.abs(got[fin] - ref[fin]).max() > 1e-3 * max(1.0, np.abs(ref[fin]).max()):
        raise Failure(f"kl_divergence: error {np.abs(got[fin] - ref[fin]).max():.3g}")


def case_linear(rng):
    import mlx.nn as nn

    from mixbits.nn import MixedQuantizedLinear

    segs = [s for s in _random_segments(rng) if s[0] != "ternary"] or [(4, 64, 64)]
    K, N = sum(s[2] for s in segs), int(rng.integers(1, 16))
    lin = nn.Linear(K, N, bias=bool(rng.random() < 0.5))
    lin.weight = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    perm = rng.permutation(K) if rng.random() < 0.5 else None
    q = MixedQuantizedLinear.from_linear(lin, segs, perm=perm)
    x = mx.array(rng.standard_normal((int(rng.integers(1, 4)), K)).astype(np.float32))
    got = np.array(q(x), dtype=np.float64)
    wd = np.array(q.quantized_tensor().dequantize(unpermute=True), dtype=np.float64)
    ref = np.array(x, dtype=np.float64) @ wd.T
    if "bias" in lin:
        ref = ref + np.array(lin.bias, dtype=np.float64)
    _close(got, ref, TOL[mx.float32], f"MixedQuantizedLinear {segs}")


# ------------------------------------------------------------ files


def _corrupt_json(rng, obj, depth=0):
    """A copy of ``obj`` with one random node replaced, deleted or retyped."""
    obj = copy.deepcopy(obj)
    node, parent, key = obj, None, None
    for _ in range(int(rng.integers(1, 7))):
        if isinstance(node, dict) and node:
            k = list(node)[int(rng.integers(len(node)))]
        elif isinstance(node, list) and node:
            k = int(rng.integers(len(node)))
        else:
            break
        parent, key, node = node, k, node[k]
    junk = [None, True, -1, 0, 1e308, -1e-300, "", "x" * 50, [], {}, [[1]], 2**70, 3.5]
    if parent is None:
        return junk[int(rng.integers(len(junk)))]
    if isinstance(parent, dict) and rng.random() < 0.3:
        del parent[key]
    else:
        parent[key] = junk[int(rng.integers(len(junk)))]
    return obj


_FILES = {}


def _files():
    if not _FILES:
        from test_cli_errors import tiny_table

        data = HERE / "data"
        _FILES["measurement"] = json.loads((data / "measurement.json").read_text())
        _FILES["allocation"] = json.loads((data / "allocation.json").read_text())
        _FILES["config"] = json.loads((data / "config.json").read_text())
        _FILES["table"] = tiny_table(3)
    return _FILES


def case_formats(rng):
    from mixbits.formats import Allocation, Measurement, SensitivityTable, projection_shapes

    kind = ["measurement", "allocation", "config", "table"][int(rng.integers(4))]
    raw = _corrupt_json(rng, _files()[kind])
    parse = {"measurement": Measurement.from_dict, "allocation": Allocation.from_dict,
             "config": projection_shapes, "table": SensitivityTable.from_dict}[kind]
    try:
        parse(raw)
    except FormatError as e:
        if not str(e):
            raise Failure(f"{kind}: empty FormatError")
    except Exception as e:  # noqa: BLE001
        raise Failure(f"{kind}: {type(e).__name__} instead of FormatError: {e}")


def case_safetensors(rng, tmp: Path):
    from safetensors import safe_open

    from mixbits.formats.safetensors_header import read_header

    path = tmp / "f.safetensors"
    arrays = {f"t{i}": mx.array(rng.standard_normal(tuple(int(d) for d in rng.integers(0, 5, size=2)))
                                .astype(np.float32)) for i in range(int(rng.integers(1, 4)))}
    mx.save_safetensors(str(path), arrays)
    b = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", bytes(b[:8]))
    how = int(rng.integers(4))
    if how == 0:
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(8, 8 + n))] = int(rng.integers(256))
    elif how == 1:
        del b[int(rng.integers(0, len(b))):]
    elif how == 2:
        b[:8] = struct.pack("<Q", int(rng.choice([0, n - 1, n + 1, 2**63])))
    else:
        b[int(rng.integers(0, 8))] = int(rng.integers(256))
    path.write_bytes(bytes(b))
    try:
        header = read_header(path)
    except FormatError:
        return
    except Exception as e:  # noqa: BLE001
        raise Failure(f"safetensors: {type(e).__name__} instead of FormatError: {e}")
    # Accepted: the safetensors package must accept it too, and MLX load it.
    try:
        with safe_open(str(path), framework="numpy") as f:
            keys = sorted(f.keys())
    except Exception as e:  # noqa: BLE001
        raise Failure(f"header accepted but the safetensors package refuses it: {e}")
    if keys != sorted(header):
        raise Failure("header names differ from the safetensors package's")
    mx.eval(list(mx.load(str(path)).values()))


def main():
    seed, seconds, max_cases = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    sys.path.insert(0, str(HERE))
    rng = np.random.default_rng(seed)
    cases = {"qmatmul": case_qmatmul, "quantized_matmul": case_quantized_matmul, "kl": case_kl,
             "linear": case_linear, "formats": case_formats, "safetensors": None}
    counts = {k: 0 for k in cases}
    failures = []
    t_end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory() as tmp:
        i = 0
        while i < max_cases and time.monotonic() < t_end:
            name = list(cases)[i % len(cases)]
            i += 1
            state = rng.bit_generator.state
            try:
                if name == "safetensors":
                    case_safetensors(rng, Path(tmp))
                else:
                    cases[name](rng)
            except Failure as e:
                failures.append({"case": name, "n": counts[name], "error": str(e)[:300], "rng": state})
            counts[name] += 1
    print(json.dumps({"cases": counts, "failures": failures[:20], "n_failures": len(failures)}))


if __name__ == "__main__":
    main()
