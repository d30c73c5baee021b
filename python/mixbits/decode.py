"""Compiled single-token decode for mlx-lm models (opt-in).

A plain decode step rebuilds the whole graph in Python every token and MLX
dispatches each node on its own. On the CPU that graph is large because
MLX runs ``mx.fast.rms_norm``, ``rope`` and ``scaled_dot_product_attention``
as composed fallbacks: SmolLM2-135M's decode token is ~4,200 nodes, and
building plus dispatching them costs about as much as its 211 quantized
matmuls (bench/decode_profile.py). :class:`Decoder` runs the model's *own* forward under
``mx.compile`` instead, so the graph is traced once and replayed, and
MLX fuses the elementwise chains.

``mx.compile`` caches a trace by the shapes of its inputs and bakes every
Python value in, so mlx-lm's KV caches (Python offsets, buffers that grow
and get sliced to the current length) cannot be traced as they are. Here
each cache is replaced, for the decode steps, by a fixed-capacity buffer
whose offset is an *array* input: rope takes an array offset, the new key
is written at that offset (on the CPU by ``_ext.kv_write``, which reads the
values through the model's reshape and transpose; elsewhere by
``mx.slice_update``), and the cache's
``make_mask`` (which mlx-lm models call through ``create_attention_mask``)
returns a boolean mask over the buffer that hides the unused slots. The
trace then has the same shapes at every step and is built once per
capacity.

This holds for models that touch their cache only through ``offset``,
``update_and_fetch`` and ``make_mask`` with ``KVCache`` or
``RotatingKVCache`` (keep=0) caches: llama, qwen2/3, gemma3, mistral, phi3,
MoE variants... Other caches (quantized, SSM/recurrent, ``keep`` > 0) are
refused with :class:`Unsupported` at prefill; so is a forward that cannot
be traced with an array offset. Because a model could still build its
decode mask without asking the cache, the first compiled step is checked
against the model's plain forward on the same state (``verify``), and
refused if they disagree.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from . import _ext
from ._backends import on_cpu
from .layout import FLOAT_DTYPES

__all__ = ["Decoder", "Unsupported", "greedy_generate"]

# Buffer capacity: rounded up to ROUND positions, grown by GROW when a
# sequence outgrows it. Every capacity is a new trace (~0.1-0.2 s CPU on
# SmolLM2, plus a one-off JIT build of MLX's fused CPU kernels the first
# time a graph is seen on a machine -- cached on disk), and MLX's
# CPU attention behind the mask costs time in proportion to the capacity,
# not to the tokens held: hence a tight first capacity (the caller knows
# prompt + max new tokens) and rare, large growth steps.
ROUND = 32
GROW = 256


class Unsupported(ValueError):
    """The model's caches (or forward) cannot run as a compiled decode step."""


def _kv_write_takes(buf, x) -> bool:
    """Whether ``_ext.kv_write`` takes these: a float buffer (B, H, S, D)
    and one token's float rows (B, H, 1, D)."""
    return (buf.ndim == 4 and x.shape == (*buf.shape[:2], 1, buf.shape[3])
            and buf.dtype in FLOAT_DTYPES and x.dtype in FLOAT_DTYPES)


class _StepCache:
    """Stands in for one mlx-lm KV cache while a decode step is traced.

    ``keys``/``values`` are (B, heads, capacity, dim) buffers; ``offset`` is
    an int32 scalar array: the position of the token being decoded. With a
    ``window`` (a RotatingKVCache's max_size) the buffer is a ring: slot s
    holds the latest token t <= offset with t % window == s."""

    def __init__(self, keys, values, offset, window, prefix: dict):
        self.keys, self.values, self.offset, self.window = keys, values, offset, window
        self.masked = False
        # Shared by the step's caches: the plain causal mask a cache made
        # ({"mask": the array, "kv_len": offset + 1}), so an attention
        # kernel handed that very mask and a full-length cache may read the
        # first kv_len keys instead (mixbits.routing; any model asks one
        # layer's cache for the mask and passes it to every layer).
        self.decode_prefix = prefix

    def update_and_fetch(self, keys, values):
        if keys.shape[2] != 1:
            raise Unsupported(f"a compiled decode step takes one token, got {keys.shape[2]}")
        slot = self.offset if self.window is None else self.offset % self.window
        if on_cpu() and _kv_write_takes(self.keys, keys) and _kv_write_takes(self.values, values):
            # The values read through the model's reshape to heads and
            # transpose, no nodes of their own (cpp/cache/kv_write.h).
            self.keys = _ext.kv_write(self.keys, keys, slot)
            self.values = _ext.kv_write(self.values, values, slot)
            return self.keys, self.values
        start = mx.reshape(slot, (1,))
        self.keys = mx.slice_update(self.keys, keys.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, values.astype(self.values.dtype), start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, N, window_size=None, return_array=False):
        if N != 1:
            raise Unsupported(f"a compiled decode step takes one token, got {N}")
        self.masked = True
        pos = mx.arange(self.keys.shape[2])
        if self.window is None:
            # Slots past the current token hold nothing yet.
            mask = pos <= self.offset
            if window_size is not None:
                mask = mask & (pos > self.offset - window_size)
            else:
                self.decode_prefix.update(mask=mask, kv_len=self.offset + 1)
            return mask
        # Ring: slot s holds the token (offset - (offset - s) mod window),
        # valid when it exists (slot <= offset) and lies inside window_size.
        mask = pos <= self.offset
        if window_size is not None and window_size < self.window:
            mask = mask & (((self.offset - pos) % self.window) < window_size)
        return mask

    # mlx-lm asks these of a cache in some code paths; answer as a non-empty cache.
    def empty(self):
        return False

    def __bool__(self):
        return True


class _StepRoPE:
    """Stands in for an ``nn.RoPE`` while a decode step is traced.

    On the CPU ``mx.fast.rope`` runs as a composed fallback of ~13 nodes per
    call (SmolLM2: 60 calls, ~780 nodes a token) that recomputes the same
    cosines and sines in every layer. For one token at an array offset this
    computes them once per step and rope configuration (``memo``, shared by
    every layer) and rotates with one fused multiply-add,
    ``x * C + swap(x) * S``, the fallback's formulas (positions in x's dtype,
    frequencies in float32). ``swap`` exchanges the two halves (or the two
    elements of each pair, ``traditional``) as a reversed view of x
    reshaped to (..., 2, d/2) (or (..., d/2, 2)): no gather, whose CPU form
    is four nodes. With ``dims`` short of the features, the rest pass
    through and a gather does the swap. Anything else goes to the real
    module."""

    def __init__(self, rope: nn.RoPE, memo: dict):
        self.rope, self.memo = rope, memo

    def __call__(self, x, offset=0):
        r = self.rope
        if x.ndim < 3 or x.shape[-2] != 1 or not isinstance(offset, mx.array) or offset.size != 1:
            return r(x, offset=offset)
        d, half, n = r.dims, r.dims // 2, x.shape[-1]
        key = (id(offset), d, r.traditional, r.base, r.scale, n, x.dtype)
        if key not in self.memo:
            inv_freqs = mx.exp(mx.arange(half, dtype=mx.float32) * (-math.log(r.base) / half))
            theta = (offset.astype(x.dtype) * r.scale).astype(mx.float32) * inv_freqs
            c, s = mx.cos(theta).astype(x.dtype), mx.sin(theta).astype(x.dtype)
            if d == n:  # factors in the (2, half) / (half, 2) shape of the reshaped x
                if r.traditional:
                    self.memo[key] = (mx.stack([c, c], -1), mx.stack([-s, s], -1), None)
                else:
                    self.memo[key] = (mx.stack([c, c]), mx.stack([-s, s]), None)
            else:
                if r.traditional:  # pairs (2i, 2i+1)
                    cos, sin = mx.stack([c, c], -1).reshape(d), mx.stack([-s, s], -1).reshape(d)
                    rot = [i ^ 1 for i in range(d)]
                else:  # halves (i, i + d/2)
                    cos, sin = mx.concatenate([c, c]), mx.concatenate([-s, s])
                    rot = list(range(half, d)) + list(range(half))
                # Features past dims pass through unchanged.
                cos = mx.concatenate([cos, mx.ones((n - d,), x.dtype)])
                sin = mx.concatenate([sin, mx.zeros((n - d,), x.dtype)])
                self.memo[key] = (cos, sin, mx.array(rot + list(range(d, n)), dtype=mx.int32))
        cos, sin, rot = self.memo[key]
        if rot is not None:
            return x * cos + mx.take(x, rot, axis=-1) * sin
        lead = x.shape[:-1]
        if r.traditional:
            xr = x.reshape(*lead, half, 2)
            swapped = xr[..., ::-1]
        else:
            xr = x.reshape(*lead, 2, half)
            swapped = xr[..., ::-1, :]
        return (xr * cos + swapped * sin).reshape(*lead, n)


def _swap_ropes(model: nn.Module, memo: dict) -> list:
    """Put a :class:`_StepRoPE` in place of every plain ``nn.RoPE`` (not
    mlx-lm's scaled variants, which keep the real op); returns what to put
    back."""
    swapped = []
    for _, m in model.named_modules():
        for k, v in list(m.items()):
            if type(v) is nn.RoPE:
                swapped.append((m, k, v))
                m[k] = _StepRoPE(v, memo)
    return swapped


def _capacity(n: int) -> int:
    return -(-n // ROUND) * ROUND


def _pad(a: mx.array, capacity: int) -> mx.array:
    extra = capacity - a.shape[2]
    if extra == 0:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)


def _window(cache) -> int | None:
    """None for a KVCache, the ring size for a RotatingKVCache (keep=0);
    Unsupported for any other cache."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if type(cache) is KVCache:
        return None
    if type(cache) is RotatingKVCache:
        if cache.keep != 0:
            raise Unsupported(f"RotatingKVCache with keep={cache.keep} (only keep=0 is compiled)")
        return cache.max_size
    raise Unsupported(f"{type(cache).__name__} is not compiled (KVCache and RotatingKVCache are)")


def _ring_size(window: int, capacity: int) -> int:
    """A ring holds min(window, capacity) slots: a sequence that ends
    inside the window never wraps, and MLX's masked attention costs per
    slot (gemma3's 512-token window for a 100-token generation)."""
    return min(window, capacity)


def _buffers(cache, capacity: int):
    """(keys, values, window) of one filled mlx-lm cache as step buffers."""
    w = _window(cache)
    if w is None:
        keys, values = cache.keys_and_values()
        return _pad(keys, capacity), _pad(values, capacity), None
    off, size = cache.offset, _ring_size(w, capacity)
    # Temporal order (mlx-lm's own helper), the last min(offset, w)
    # tokens, then token t moved to ring slot t % w.
    keys, values = (cache._temporal_order(a)[..., -min(off, w):, :] for a in (cache.keys, cache.values))
    if off < size:  # not wrapped (capacity > offset, so off >= size means size == w)
        return _pad(keys, size), _pad(values, size), w
    shift = (off - w) % w
    return mx.roll(keys, shift, axis=2), mx.roll(values, shift, axis=2), w


class Decoder:
    """Decoding state for one sequence (batch 1) of ``model``.

    ``prefill(ids)`` runs the model's plain forward over the prompt (mlx-lm
    caches, mixbits' prefill kernels when patched); ``step(token)`` then
    decodes one token per call through the compiled step and returns the
    logits ``model(token, cache)`` would return.

    The compiled step captures the model's weights when it is traced: make
    a new Decoder after changing them. ``verify=True`` checks the first
    compiled step against the model's plain forward (same state, same
    token) and raises :class:`Unsupported` if the logits differ by more
    than ``tol``·(1 + max|plain|) (default 1e-3 for float32 logits, 2e-2
    for half precision, where fused kernels round differently) -- e.g. a
    model that builds its own decode mask instead of asking the cache.

    ``fast_rope=True`` traces every plain ``nn.RoPE`` as :class:`_StepRoPE`
    (the same rotation in ~2 nodes instead of MLX's ~13-node CPU fallback).
    """

    def __init__(self, model: nn.Module, *, verify: bool = True, tol: float | None = None,
                 fast_rope: bool = True):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
        self.model = model
        self.verify, self.tol, self.fast_rope = verify, tol, fast_rope
        self._cache = None  # mlx-lm caches until the first step
        self._state = None  # (keys, values) step buffers after it
        self.offset = 0
        self._fn = mx.compile(self._traced)

    def prefill(self, ids, capacity: int | None = None) -> mx.array:
        """Logits of the model's plain forward over ``ids`` ((1, L) or a
        list of token ids). ``capacity``: the longest sequence expected
        (prompt + new tokens), so the step is traced once; without it,
        the prompt + 256. The buffer grows by 256 positions (one retrace
        each) when exceeded."""
        from mlx_lm.models.cache import make_prompt_cache

        x = mx.array([list(ids)]) if not isinstance(ids, mx.array) else ids
        if x.ndim != 2 or x.shape[0] != 1 or x.shape[1] < 1:
            raise ValueError(f"ids must be one non-empty sequence (1, L), got shape {tuple(x.shape)}")
        self._cache = make_prompt_cache(self.model)
        self._state = None  # a new sequence: drop the previous one's buffers
        logits = self.model(x, cache=self._cache)
        self.offset = x.shape[1]
        self._capacity = _capacity(max(capacity or self.offset + GROW, self.offset + 1))
        for c in self._cache:  # refuse unsupported caches before any decoding
            _window(c)
        return logits

    def _traced(self, tokens, offset, keys, values):
        # A ring smaller than its window has not wrapped yet: slot = offset
        # modulo its size is the offset itself until it grows.
        prefix = {}
        caches = [_StepCache(k, v, offset, k.shape[2] if w else None, prefix)
                  for k, v, w in zip(keys, values, self._windows)]
        # The stand-ins live only while tracing: the replayed step keeps
        # their ops, the model keeps its own modules.
        swapped = _swap_ropes(self.model, {}) if self.fast_rope else []
        try:
            logits = self.model(tokens, cache=caches)
        finally:
            for m, k, v in swapped:
                m[k] = v
        if not any(c.masked for c in caches):
            raise Unsupported(f"{type(self.model).__name__} never asked its cache for a decode mask")
        return logits, [c.keys for c in caches], [c.values for c in caches]

    def step(self, token) -> mx.array:
        """Logits (1, 1, vocab) for ``token`` (an int or a (1, 1) array)
        at the next position."""
        if self._cache is None and self._state is None:
            raise RuntimeError("call prefill(ids) before step()")
        x = token if isinstance(token, mx.array) else mx.array([[int(token)]])
        x = mx.reshape(x, (1, 1))
        plain = None
        if self._state is None:
            self._state = self._from_cache()
            if self.verify:
                plain = self.model(x, cache=self._cache)
            self._cache = None
        if self.offset >= self._capacity:
            self._capacity += GROW  # new shapes: MLX traces the step again
            # Full buffers and unwrapped rings (offset == their size < window) grow.
            sizes = [_ring_size(w, self._capacity) if w else self._capacity for w in self._windows]
            self._state = tuple([_pad(a, n) for a, n in zip(arrays, sizes)] for arrays in self._state)
        keys, values = self._state
        self._state = None  # drop our references so slice_update may reuse the buffers
        try:
            logits, keys, values = self._fn(x, mx.array(self.offset, dtype=mx.int32), keys, values)
        except Unsupported:
            raise
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            # e.g. Python control flow on cache.offset, or a cache attribute the stand-in lacks
            raise Unsupported(f"{type(self.model).__name__}'s forward cannot be traced with an array "
                              f"cache offset: {e}") from e
        self._state = (keys, values)
        self.offset += 1
        if plain is not None:
            self._check(plain, logits)
        return logits

    def _from_cache(self):
        bufs = [_buffers(c, self._capacity) for c in self._cache]
        self._windows = [w for _, _, w in bufs]
        return [k for k, _, _ in bufs], [v for _, v, _ in bufs]

    def _check(self, plain, compiled):
        tol = self.tol if self.tol is not None else (1e-3 if plain.dtype == mx.float32 else 2e-2)
        plain, compiled = plain.astype(mx.float32), compiled.astype(mx.float32)
        err = mx.abs(compiled - plain).max().item() if plain.shape == compiled.shape else float("inf")
        if not err <= tol * (1 + mx.abs(plain).max().item()):  # NaN fails too
            raise Unsupported(
                f"the compiled decode step of {type(self.model).__name__} disagrees with its plain forward "
                f"(max |diff| {err:.3g}); decode with the model itself")


def greedy_generate(model, tokenizer, prompt: str, max_tokens: int = 16, stop_at_eos: bool = True):
    """:func:`mixbits.models.greedy_generate` with the decode steps compiled
    (same tokens, same :class:`~mixbits.models.eval.Generation` result).
    Raises :class:`Unsupported` (before or at the first decode step) for a
    model the compiled step cannot run; callers fall back to the plain one."""
    import time

    from .models.eval import Generation

    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    eos = set(getattr(tokenizer, "eos_token_ids", []) or [])
    gen = Generation(prompt_ids=list(ids))
    dec = Decoder(model)
    t0 = time.perf_counter()
    logits = dec.prefill(ids, capacity=len(ids) + max_tokens)
    nxt = mx.argmax(logits[0, -1]).item()
    gen.prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()  # the first step's trace and check count as decode time
    while not (stop_at_eos and nxt in eos):
        gen.ids.append(nxt)
        if len(gen.ids) >= max_tokens:
            break
        nxt = mx.argmax(dec.step(nxt)[0, -1]).item()
    gen.decode_s = time.perf_counter() - t0
    gen.text = tokenizer.decode(gen.ids)
    return gen
