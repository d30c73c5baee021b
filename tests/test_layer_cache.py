"""The joint evaluator's cache of built candidate layers stays within its
byte limit (mixbits.measure.layer_cache), and a limit that forces rebuilds
changes no score: a refine run with the baseline guard gives the same joint
KLs, bit for bit, with a tiny limit as with none."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")

from mixbits.measure.joint import JointEvaluator  # noqa: E402
from mixbits.measure.layer_cache import LayerCache  # noqa: E402
from mixbits.measure.refine import refine  # noqa: E402
from mixbits.measure.sweep import sweep  # noqa: E402
from tiny_models import build  # noqa: E402

CANDS = ["2b_g64", "3b_g64", "4b_g64", "8b_g64"]


def held_bytes(cache: LayerCache) -> int:
    """The cache's layers' bytes counted here, from numpy copies of their arrays."""
    return sum(np.array(v).nbytes for layer, _ in cache._items.values()
               for _, v in tree_flatten(layer.parameters()))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model, _ = build("llama", seed=3)
    toks = np.random.default_rng(0).integers(0, 160, size=(4, 24))
    table = sweep(model, toks, tmp_path_factory.mktemp("s") / "t.json", CANDS, progress=False)
    return model, toks, table


def _run(model, toks, table, limit):
    ev = JointEvaluator(model, toks, chunk=2, layer_limit=limit)
    seen = []
    score = ev.token_kls

    def recording(assignment, chunks=None):
        out = score(assignment, chunks)
        seen.append(out)
        cache = ev._layers
        # what it says it holds is what it holds, and never over the limit
        assert cache.bytes == held_bytes(cache)
        if limit is not None:
            assert cache.bytes <= limit
        return out

    ev.token_kls = recording
    out = refine(table, ev, high_avg=3.6, max_evals=8, progress=False)
    return out, seen, ev._layers


def test_tiny_limit_rebuilds_layers_and_changes_no_score(setup):
    model, toks, table = setup
    free, free_kls, free_cache = _run(model, toks, table, None)
    one_set = sum(n for (_, c), (_, n) in free_cache._items.items() if c == "4b_g64")
    limit = one_set // 3  # a third of one candidate's layers: most are dropped and rebuilt
    capped, capped_kls, cache = _run(model, toks, table, limit)

    assert free_cache.dropped == 0 and free_cache.bytes > 3 * limit
    assert cache.dropped > 0 and cache.builds > len(free_cache)  # rebuilds happened
    assert cache.peak_bytes <= limit
    assert len(capped_kls) == len(free_kls) > 4
    for a, b in zip(capped_kls, free_kls):
        assert np.array_equal(a, b)
    assert capped["assignment"] == free["assignment"]
    assert capped["joint_refine"]["joint_kl_after"] == free["joint_refine"]["joint_kl_after"]
    assert capped["guard"] == free["guard"]


def test_cache_drops_least_recently_used_first():
    layers = {k: nn.Linear(64, 64 * (k + 1)) for k in range(3)}
    size = {k: 4 * 64 * 64 * (k + 1) + 4 * 64 * (k + 1) for k in layers}  # float32 weight + bias
    c = LayerCache(limit=size[0] + size[1])
    c.put(("a", "x"), layers[0])
    c.put(("b", "x"), layers[1])
    assert c.bytes == size[0] + size[1]
    assert c.get(("a", "x")) is layers[0]  # now b is the least recently used
    c.put(("c", "x"), layers[0])
    assert ("b", "x") not in c and ("a", "x") in c and c.bytes == 2 * size[0]
    assert c.by_candidate() == {"x": 2 * size[0]}
    big = LayerCache(limit=1)
    big.put(("a", "x"), layers[2])  # larger than the limit: kept until the next put
    assert big.get(("a", "x")) is layers[2] and big.bytes == size[2]


def test_ternary_layers_are_built_in_bounded_pieces():
    """The ternary candidate's numpy work takes ~32 bytes per weight; done
    in row pieces it stays near one piece's, bit for bit the same layer."""
    import tracemalloc

    from mixbits.layout import ternary_triplet

    w = mx.random.normal((512, 2048), key=mx.random.key(0)).astype(mx.float16)
    whole = ternary_triplet(w, 64, chunk=w.size)
    tracemalloc.start()
    pieces = ternary_triplet(w, 64, chunk=1 << 16)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    for a, b in zip(whole, pieces):
        assert np.array_equal(np.array(a), np.array(b))
    assert peak < 4 * w.size  # the whole matrix at once: > 32 bytes per weight
    tracemalloc.start()
    ternary_triplet(w, 64, chunk=w.size)
    assert tracemalloc.get_traced_memory()[1] > 16 * w.size
    tracemalloc.stop()
