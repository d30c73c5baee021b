"""The joint evaluator's built candidate layers, bounded in bytes.

Refine and the baseline guard score many assignments; each quantizes its
tensors with some candidate, and building a (tensor, candidate) layer costs
about 10 ns per weight (bench/joint_profile.py: ~3 one-sequence
evaluations for a whole set of layers). Keeping every layer built is
fastest but grows by a whole quantized copy of the model per candidate the
search touches -- at 8B, 2-5 GB per candidate, past a 24 GiB machine with
the default six-kind menu. So :class:`LayerCache` drops the least recently
used layers once it holds more than its limit: a search's current
allocation stays warm (a swap trial changes two tensors), and a dropped
layer is rebuilt, bit for bit the same, if it is asked for again: time for
memory, never a different score.
"""

from __future__ import annotations

from collections import OrderedDict

from mlx.utils import tree_flatten


def layer_bytes(layer) -> int:
    """Bytes of a built layer's arrays (codes, scales, biases, any float weight)."""
    return sum(int(v.nbytes) for _, v in tree_flatten(layer.parameters()))


class BytesLRU:
    """Items by key, the least recently used dropped while they hold more
    than ``limit`` bytes (None: no limit); ``size(item)`` gives an item's
    bytes, counted once when it is put. The most recent item is never
    dropped, so what was just put is always there for its caller. The
    joint evaluator's two caches (built layers here, block outputs in
    :mod:`.prefix`) are both this."""

    def __init__(self, limit: int | None, size):
        self.limit = None if limit is None else int(limit)
        self.size = size
        self.bytes = 0
        self.peak_bytes = 0  # the most it held (after dropping)
        self.builds = 0  # items put (a re-put of a dropped one counts again)
        self.dropped = 0
        self._items: OrderedDict = OrderedDict()  # key -> (item, bytes)

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key):
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return entry[0]

    def put(self, key, item) -> None:
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        n = self.size(item)
        self._items[key] = (item, n)
        self.bytes += n
        self.builds += 1
        while self.limit is not None and self.bytes > self.limit and len(self._items) > 1:
            _, (_, old) = self._items.popitem(last=False)
            self.bytes -= old
            self.dropped += 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


class LayerCache(BytesLRU):
    """Layers by (tensor path, candidate name), least recently used dropped
    while they hold more than ``limit`` bytes (None: no limit). A layer
    larger than the limit is still returned and kept until the next put,
    so the assignment being built always gets every layer."""

    def __init__(self, limit: int | None = None):
        super().__init__(limit, layer_bytes)

    def by_candidate(self) -> dict[str, int]:
        """Bytes held per candidate name (for memory reports)."""
        out: dict[str, int] = {}
        for (_, cand), (_, n) in self._items.items():
            out[cand] = out.get(cand, 0) + n
        return out
