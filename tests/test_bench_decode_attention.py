"""bench/bench_decode_attention.py times what it says: each implementation
gives one decode step's attention over the filled prefix of every layer's
own cache, the answer checked against MLX's op, on tiny shapes."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_decode_attention as bda  # noqa: E402


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_case_rows_agree_with_mlx_and_count_the_cache_bytes(dtype, monkeypatch):
    monkeypatch.setattr(bda, "LAYERS", 3)
    rng = np.random.default_rng(0)
    row = bda.case("tiny", (4, 2, 16), 20, dtype, reps=1, probe=10.0, rng=rng)
    itemsize = 4 if dtype == mx.float32 else 2
    assert row["kv_bytes_per_call"] == 2 * 2 * 20 * 16 * itemsize
    assert row["bound_us"] == pytest.approx(row["kv_bytes_per_call"] / 10e9 * 1e6)
    impls = {"mixbits", "mlx"} | ({"numpy"} if dtype == mx.float32 else set())
    assert set(row["max_abs_diff_vs_mlx_f32"]) == impls
    for impl in impls:  # every layer's output, as timed, against MLX's op in float32
        assert row["max_abs_diff_vs_mlx_f32"][impl] < (1e-5 if dtype == mx.float32 else 2e-2), impl
        assert row[f"{impl}_us"] > 0 and row[f"{impl}_gbps"] > 0
    assert ("numpy_us" in row) == (dtype == mx.float32)


def test_caches_are_prefixes_of_bigger_buffers(monkeypatch):
    """Each layer's K and V have room past the filled n keys, as a decode
    step's buffers do, and no two layers share a buffer."""
    monkeypatch.setattr(bda, "LAYERS", 4)
    kv = bda.caches(2, 8, 10, mx.float32, np.random.default_rng(1))
    assert len(kv) == 4 and all(k.shape == (1, 2, 42, 8) == v.shape for k, v in kv)
    assert len({id(a) for pair in kv for a in pair}) == 8
    assert not any(mx.array_equal(kv[0][0], kv[i][0]).item() for i in range(1, 4))
