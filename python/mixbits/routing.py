"""Route an mlx-lm model's attention, SwiGLU, RMSNorm, RoPE and float linears to the mixbits CPU kernels.

mlx-lm's model files call module-level functions,
``scaled_dot_product_attention`` and ``swiglu``, bound in the model's own
module. :func:`patch_functions` swaps those names, in that module, for
routers, and gives the patched model and its decoder layers a subclass
whose ``__call__`` marks "this model is routed" for the duration of the
call. A router takes the call only inside such a mark and only in the
cases the kernels cover (on the CPU; SwiGLU in float32, or float16 /
bfloat16 through float32, attention in
float32, float16 or bfloat16 with the causal mask, a one-query decode step
without a mask, or a compiled decode step's prefix mask (mixbits.decode),
no quantized cache or sinks, and the kernel's shapes, checked per call: key
and value heads of one size, which multi-head latent attention's are not;
on arm64 decode steps only);
everything else (other models of the same architecture, other array masks,
mixed dtypes, GPU) goes to the original function.
"""

from __future__ import annotations

import contextvars
import functools
import importlib

import mlx.core as mx
import mlx.nn as nn

from . import _ext, float_linear
from ._backends import names, on_cpu
from .attention import fits_kernel
from .layout import FLOAT_DTYPES

__all__ = ["patch_functions", "unpatch_functions"]

_SAVED = "_mixbits_originals"
_ACTIVE = contextvars.ContextVar("mixbits_routed", default=False)
_SUBCLASSES: dict[type, type] = {}


def _one_float_dtype(*arrays) -> bool:
    """The attention kernel's inputs: float32, float16 or bfloat16, one dtype."""
    dt = arrays[0].dtype
    return dt in FLOAT_DTYPES and all(a.dtype == dt for a in arrays)


# Each router's kernel's backends on this CPU.
_KERNEL_BACKENDS = {"scaled_dot_product_attention": lambda: _ext.attn_backends(),
                    "swiglu": lambda: _ext.act_backends()}


@functools.cache
def _has_vector_kernel(name: str) -> bool:
    """Whether the kernel behind router ``name`` has more than the scalar
    reference here. Where it has not (a CPU with neither AVX2 nor NEON),
    MLX's own op is faster and the call is not taken over. Asked once per
    process (the CPU does not change): the routers call it on every
    attention / SwiGLU call."""
    return any(b != "ref" for b in names(_KERNEL_BACKENDS[name]()))


@functools.cache
def _routes_prompt_attention() -> bool:
    """Whether prompts (more than one query per head) go to the attention
    kernel too, not only decode steps: on x86 (AVX2 / AVX-512), where MLX's
    CPU matmul on Linux is a reference BLAS and the kernel measured 37-83x
    MLX's sdpa. On arm64 (NEON) MLX's CPU matmul is Accelerate's, whose
    matrix units a prompt's score and value GEMMs may well favour, so only
    decode steps are taken: one node that reads its cache once, in place of
    MLX's chain of small ones. Neither is measured on a Mac."""
    return any(b in ("avx2", "avx512") for b in names(_ext.attn_backends()))


def _prefix_length(cache, mask, queries):
    """kv_len when ``mask`` is the plain causal mask of a compiled decode
    step (mixbits.decode) over this full-length cache buffer: the one query
    then sees exactly the buffer's first kv_len keys."""
    prefix = getattr(cache, "decode_prefix", None)
    if (prefix and mask is prefix.get("mask") and getattr(cache, "window", 0) is None
            and queries.shape[-2] == 1):
        return prefix["kv_len"]
    return None


def _sdpa_router(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # One query without a mask (a decode step) sees every key, which is
        # what the causal kernel does for the last query row; a compiled
        # decode step's prefix mask is the same over the first kv_len keys.
        kv_len = _prefix_length(cache, mask, queries) if isinstance(mask, mx.array) else None
        one_query = queries.shape[-2] == 1
        causal = (isinstance(mask, str) and mask == "causal") or (
            mask is None and one_query) or kv_len is not None
        if (_ACTIVE.get() and causal and (one_query or _routes_prompt_attention())
                and sinks is None and not hasattr(cache, "bits")
                and _one_float_dtype(queries, keys, values) and fits_kernel(queries, keys, values)
                and on_cpu()
                and _has_vector_kernel("scaled_dot_product_attention")):
            return _ext.causal_attention(queries, keys, values, float(scale), 0, kv_len)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    return scaled_dot_product_attention


def _swiglu_router(original):
    def swiglu(gate, x):
        if (_ACTIVE.get() and _one_float_dtype(gate, x) and gate.shape == x.shape and on_cpu()
                and _has_vector_kernel("swiglu")):
            if gate.dtype == mx.float32:
                return _ext.swiglu(gate, x, 0)
            # Half precision: widened, the float32 kernel, rounded once. mlx-lm's
            # compiled swiglu on float16 took 47 ms on 256 x 2816 (one layer of a
            # 1024-wide float16 Llama), these three nodes 3.6 ms; float32
            # arithmetic, so closer to exact than MLX's half ops.
            y = _ext.swiglu(gate.astype(mx.float32), x.astype(mx.float32), 0)
            return y.astype(gate.dtype)
        return original(gate, x)

    return swiglu


_ROUTERS = {"scaled_dot_product_attention": _sdpa_router, "swiglu": _swiglu_router}


class _RoutedRMSNorm(nn.RMSNorm):
    """An ``nn.RMSNorm`` whose calls inside a routed model, on the CPU, run
    as one mixbits node (:func:`mixbits.norm.rms_norm`) instead of MLX's
    three-node CPU fallback. The module's parameters are untouched."""

    def __call__(self, x):
        w = self["weight"]
        if _ACTIVE.get() and on_cpu() and _one_float_dtype(x) and _one_float_dtype(w):
            return _ext.rms_norm(x, w, self.eps)
        return super().__call__(x)


class _RoutedRoPE(nn.RoPE):
    """An ``nn.RoPE`` whose calls inside a routed model, on the CPU, run as
    one mixbits node (:func:`mixbits.rope.rope`) instead of MLX's ~13-node
    CPU fallback; an array offset (a compiled decode step's position) is
    read when the graph runs."""

    def __call__(self, x, offset=0):
        if (_ACTIVE.get() and on_cpu() and _one_float_dtype(x) and x.ndim >= 2
                and self.dims <= x.shape[-1] and self.dims % 2 == 0
                and (type(offset) is int or (isinstance(offset, mx.array) and offset.size == 1
                                             and mx.issubdtype(offset.dtype, mx.integer)))):
            off = mx.array(offset, dtype=mx.int32) if type(offset) is int else offset
            return _ext.rope(x, off, self.dims, bool(self.traditional), float(self.base), float(self.scale))
        return super().__call__(x, offset=offset)


class _RoutedLinear(nn.Linear):
    """An ``nn.Linear`` whose calls inside a routed model, on the CPU with a
    BLAS (Linux), run as one :func:`mixbits.float_linear.float_matmul` node:
    OpenBLAS or a half-reading GEMV instead of the mlx-cpu wheel's reference
    BLAS. The module's parameters are untouched. ``_mixbits_routes``: the
    class whose product it computes (mixbits.adapter measures it as one)."""

    _mixbits_routes = nn.Linear

    def __call__(self, x):
        w = self["weight"]
        b = self["bias"] if "bias" in self else None
        if _ACTIVE.get() and float_linear.routes(x, w, b):
            return float_linear.linear(x, w, b)
        return super().__call__(x)


class _RoutedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose ``as_linear`` (a tied output head, the
    largest matmul of a small model) runs as :class:`_RoutedLinear` does;
    the lookup is MLX's."""

    _mixbits_routes = nn.Embedding

    def as_linear(self, x):
        w = self["weight"]
        if _ACTIVE.get() and float_linear.routes(x, w):
            return float_linear.linear(x, w)
        return super().as_linear(x)


# Module classes whose instances patch_functions re-classes (exact types
# only: subclasses such as mlx-lm's scaled ropes keep their own call).
_LEAF_ROUTES = {nn.RMSNorm: ("rms_norm", _RoutedRMSNorm), nn.RoPE: ("rope", _RoutedRoPE),
                nn.Linear: ("linear", _RoutedLinear), nn.Embedding: ("linear", _RoutedEmbedding)}


def _leaf_route_available(name: str) -> bool:
    """The float linears are taken only where float_matmul has a BLAS (on
    Linux; on macOS MLX's matmul is Accelerate's); norms and ropes always."""
    return name != "linear" or float_linear.blas_library() is not None


def _leaves(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if type(m) is cls]


def _routed_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that routes the calls made inside it."""
    if getattr(cls, "_mixbits_routed", False):
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        def __call__(self, *args, **kwargs):
            token = _ACTIVE.set(True)
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_mixbits_routed": True,
                                          "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def _entry_points(model: nn.Module) -> list[nn.Module]:
    """The modules whose calls get routed: the model itself (``model(x)``)
    and its decoder blocks (what a sweep calls directly), wherever the
    model keeps them (``model.layers``, ``language_model.model.layers``)."""
    from .adapter import ModelAdapter

    return [model, *ModelAdapter(model).blocks]


def _model_modules(model: nn.Module) -> list:
    """The Python modules defining the model's classes (a VLM wrapper's
    text blocks live in another file than the wrapper)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    names = {type(model).__module__}
    names.update(type(m).__module__ for _, m in model.named_modules())
    return [importlib.import_module(n) for n in sorted(names)
            if not n.startswith(("mlx.", "mixbits."))]


def patch_functions(model: nn.Module) -> list[str]:
    """Route ``model``'s attention / SwiGLU calls through the mixbits
    kernels; returns the function names taken over (those the model's module
    has, whose kernel has a vector backend on this CPU), and ``"rms_norm"``
    / ``"rope"`` when the model has ``nn.RMSNorm`` / ``nn.RoPE`` layers
    (their calls go to one-node kernels on every CPU: MLX's are composed
    fallbacks everywhere), and ``"linear"`` when it has float ``nn.Linear``
    layers or ``nn.Embedding`` tables (a tied head's ``as_linear``) and
    float_matmul has a BLAS (Linux: :mod:`mixbits.float_linear`). Other
    models are not affected. Idempotent."""
    taken = []
    for mod in _model_modules(model):
        saved = mod.__dict__.setdefault(_SAVED, {})
        for name, router in _ROUTERS.items():
            fn = getattr(mod, name, None)
            if not callable(fn) or not _has_vector_kernel(name):
                continue
            if name not in saved:
                saved[name] = fn
                setattr(mod, name, router(fn))
            if name not in taken:
                taken.append(name)
    for cls, (name, routed) in _LEAF_ROUTES.items():
        if not _leaf_route_available(name):
            continue
        leaves = _leaves(model, cls) + _leaves(model, routed)
        for m in leaves:
            m.__class__ = routed
        if leaves and name not in taken:
            taken.append(name)
    if taken:
        for m in _entry_points(model):
            m.__class__ = _routed_class(type(m))
    return taken


def unpatch_functions(model: nn.Module) -> None:
    """Undo :func:`patch_functions` for ``model`` (the module-level routers
    stay: without a routed model they pass every call through)."""
    _model_modules(model)
    for cls, (_, routed) in _LEAF_ROUTES.items():
        for m in _leaves(model, routed):
            m.__class__ = cls
    for m in _entry_points(model):
        cls = type(m)
        if getattr(cls, "_mixbits_routed", False) and cls in _SUBCLASSES.values():
            m.__class__ = cls.__bases__[0]
