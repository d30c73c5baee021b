"""The gradient proxy's per-position clip (grad.clip_positions): a few
positions whose output gradient is thousands of times their sequence's
typical one (on Gemma-3-270M, the first tokens of a calibration window cut
mid-sentence) must not set a tensor's Fisher diagonal; ordinary sequences
pass unchanged. References: float64 numpy, row by row."""

import mlx.core as mx
import numpy as np
import pytest

from mixbits.measure.grad import POSITION_CLIP, accumulate_fisher, clip_positions


def clipped_f64(rows: np.ndarray) -> np.ndarray:
    """Each row with a norm above POSITION_CLIP x the median row norm
    scaled to that norm, in float64."""
    rows = rows.astype(np.float64)
    norms = np.array([np.linalg.norm(r) for r in rows])
    cap = POSITION_CLIP * np.median(norms)
    return np.stack([r * (cap / n) if n > cap else r for r, n in zip(rows, norms)])


def sink_gradients(rng, n_seq, length, width, sink=(0, 1, 2), factor=3000.0):
    """Output gradients [n_seq, length, width]; the last sequence's ``sink``
    positions ``factor`` times the rest (Gemma's window 6: 1,700-7,300x)."""
    d = rng.standard_normal((n_seq, length, width)).astype(np.float32)
    d *= rng.uniform(0.3, 3.0, (n_seq, length, 1)).astype(np.float32)
    d[-1, list(sink)] *= factor
    return d


@pytest.mark.parametrize("seed", range(5))
def test_only_the_outlying_rows_are_scaled_and_keep_their_direction(seed):
    rng = np.random.default_rng(seed)
    length, width = int(rng.integers(3, 300)), int(rng.integers(1, 80))
    rows = rng.standard_normal((length, width)).astype(np.float32)
    far = rng.choice(length, size=max(1, length // 10), replace=False)
    rows[far] *= rng.uniform(50, 1e4, (len(far), 1)).astype(np.float32)
    got = clip_positions(rows)
    want = clipped_f64(rows)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    cos = np.sum(got.astype(np.float64) * rows, axis=1) / (
        np.linalg.norm(got.astype(np.float64), axis=1) * np.linalg.norm(rows.astype(np.float64), axis=1))
    np.testing.assert_allclose(cos, 1.0, atol=1e-6)
    assert got.dtype == rows.dtype and not np.shares_memory(got, rows)


def test_ordinary_rows_come_back_as_they_are():
    rows = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    assert clip_positions(rows) is rows
    one = rows[:1] * 1e6  # a single position is its own median
    assert clip_positions(one) is one


def test_a_window_s_sink_positions_cannot_set_the_fisher_diagonal():
    """Linear and embedding (lookup) paths of accumulate_fisher against
    float64: per sequence, g = clip(dy)^T x (or the clipped dy rows summed
    per looked-up id) and F = sum over sequences of g^2. Then the sink
    window's share: unclipped its three positions carry 3 x 3000^2 times a
    typical position's squared gradient against ~L for an ordinary window
    (~2e5 x); clipped at 30x the median they carry at most 3 x 30^2, so
    its Fisher total stays within ~(L + 2700) / L of the ordinary window's."""
    rng = np.random.default_rng(7)
    n_seq, length, k, n, vocab = 2, 128, 24, 16, 40
    x = rng.standard_normal((n_seq, length, k)).astype(np.float32)
    d = sink_gradients(rng, n_seq, length, n)
    ids = rng.integers(0, vocab, (n_seq, length)).astype(np.int32)
    de = sink_gradients(rng, n_seq, length, k)
    forms = {"lin": "linear", "emb": "embedding"}

    def fisher_of(seqs):
        f = {"lin": np.zeros((n, k), np.float32), "emb": np.zeros((vocab, k), np.float32)}
        accumulate_fisher(f, {"lin|call|0": x[seqs], "emb|call|0": ids[seqs]},
                          {"lin|call|0": mx.array(d[seqs]), "emb|call|0": mx.array(de[seqs])},
                          forms, len(seqs), None)
        return f

    got = fisher_of([0, 1])
    want_lin = np.zeros((n, k))
    want_emb = np.zeros((vocab, k))
    for b in range(n_seq):
        g = clipped_f64(d[b]).T @ x[b].astype(np.float64)
        want_lin += g * g
        rows = clipped_f64(de[b])
        ge = np.zeros((vocab, k))
        np.add.at(ge, ids[b], rows)
        want_emb += ge * ge
    np.testing.assert_allclose(got["lin"], want_lin, rtol=1e-4)
    np.testing.assert_allclose(got["emb"], want_emb, rtol=1e-4)

    ordinary, sink = fisher_of([0]), fisher_of([1])
    for p in ("lin", "emb"):
        share = sink[p].sum() / ordinary[p].sum()
        assert share < 100, (p, share)  # unclipped: ~2e5
