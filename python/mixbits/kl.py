"""Fused KL divergence over vocabulary-sized logits.

The only module besides ops.py that calls mixbits._ext: every argument is
checked here, with a message naming it, before any kernel runs.

``kl_divergence(ref_logits, logits)`` is KL(P_ref || Q) per token, P_ref =
softmax(ref_logits), Q = softmax(logits), over the last axis, in float32,
from one pass over both arrays. ``kl_compare`` also returns the argmax of
both sides and, given target tokens, both probabilities of the target.
``KLReference`` prepares the reference once for a sweep that compares many
candidates with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import _ext
from .layout import FLOAT_DTYPES
from ._backends import BACKENDS, backend_id, names

__all__ = ["KLResult", "KLReference", "kl_divergence", "kl_compare", "kl_backends"]

_INTS = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)

# Kernel modes (cpp/kl/kernel.h KLMode).
_LOGITS, _FIXED_SHIFT, _PROBS = 0, 1, 2

# Status bits (cpp/kl/kernel.h KLStatus): what each means, and which
# argument it is about.
_STATUS = [
    (1, "ref_logits", "contains NaN"),
    (2, "logits", "contains NaN"),
    (4, "ref_logits", "contains +inf"),
    (8, "logits", "contains +inf"),
    (16, "ref_logits", "has no finite entry (every logit is -inf)"),
    (32, "logits", "has no finite entry (every logit is -inf)"),
    (64, "ref_logits", "has a negative reference weight"),
]

# Probs16 stores w * 2^15 as float16, w = e^(a - max a) <= 1 (proportional
# to p): w = 1 stays below float16's max (65504) and weights down to
# ~1.9e-9 keep 11 significant bits.
_P16_SCALE = 2.0**15


def kl_backends() -> list[str]:
    """CPU backends of the KL kernel usable on this machine."""
    return names(_ext.kl_backends())


def _backend_id(backend: str | None) -> int:
    return backend_id(backend)


def _as_array(x, name: str) -> mx.array:
    if isinstance(x, np.ndarray):
        if x.dtype == np.float64:
            x = x.astype(np.float32)
        x = mx.array(x)
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    return x


def _check_logits(x, name: str) -> mx.array:
    x = _as_array(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension (the vocabulary)")
    if x.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary axis (V = 0); V must be >= 1")
    return x


def _check_pair(ref_logits, logits) -> tuple[mx.array, mx.array]:
    ref_logits = _check_logits(ref_logits, "ref_logits")
    logits = _check_logits(logits, "logits")
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits shape {tuple(ref_logits.shape)} differs from logits "
            f"shape {tuple(logits.shape)}"
        )
    return ref_logits, logits


def _check_targets(targets, lead: tuple[int, ...], V: int) -> mx.array | None:
    if targets is None:
        return None
    targets = _as_array(targets, "targets")
    if targets.dtype not in _INTS:
        raise TypeError(f"targets must be an integer array, got {targets.dtype}")
    if tuple(targets.shape) != lead:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the leading "
            f"shape of the logits {lead}"
        )
    if targets.size:
        lo, hi = mx.min(targets).item(), mx.max(targets).item()
        if lo < 0 or hi >= V:
            bad = lo if lo < 0 else hi
            raise ValueError(f"targets must lie in [0, {V}); found {bad}")
    return targets.astype(mx.int32)


def _raise_on_status(status: mx.array, names: dict[str, str] | None = None) -> None:
    """Raises ValueError naming the argument and the first bad token."""
    st = np.array(status)
    if not st.any():
        return
    idx = np.unravel_index(int(np.flatnonzero(st)[0]), st.shape) if st.ndim else ()
    code = int(st[idx])
    nbad = int(np.count_nonzero(st))
    for bit, arg, what in _STATUS:
        if code & bit:
            arg = (names or {}).get(arg, arg)
            where = f" at token {tuple(int(i) for i in idx)}" if st.ndim else ""
            raise ValueError(
                f"kl_divergence: {arg} {what}{where} ({nbad} invalid token row(s) in all)"
            )
    raise ValueError(f"kl_divergence: invalid row (status {code})")


def _checked(outs: list[mx.array], check: bool, names=None) -> None:
    if not check:
        return
    try:
        mx.eval(outs)
    except ValueError as e:
        if "transformations" in str(e):
            raise ValueError(
                "kl_divergence(check=True) evaluates its result to look for "
                "NaN; inside mx.compile or vmap pass check=False (invalid "
                "rows then give NaN)"
            ) from e
        raise
    _raise_on_status(outs[1], names)


@dataclass
class KLResult:
    """Per-token results of one pass; every array has the leading shape."""

    kl: mx.array  # float32 KL(P_ref || Q)
    argmax_ref: mx.array  # int32, first index of the maximum
    argmax: mx.array  # int32, candidate's argmax
    logp_ref_target: mx.array | None = None  # float32 log P_ref(target)
    logp_target: mx.array | None = None  # float32 log Q(target)
    status: mx.array | None = None  # int32, 0 for valid rows

    @property
    def same_top(self) -> mx.array:
        """Whether both sides put their maximum on the same token."""
        return mx.equal(self.argmax_ref, self.argmax)

    @property
    def p_ref_target(self) -> mx.array | None:
        return None if self.logp_ref_target is None else mx.exp(self.logp_ref_target)

    @property
    def p_target(self) -> mx.array | None:
        return None if self.logp_target is None else mx.exp(self.logp_target)

    @property
    def delta_p(self) -> mx.array | None:
        """Q(target) - P_ref(target), as llama.cpp's Δp."""
        if self.logp_target is None:
            return None
        return self.p_target - self.p_ref_target


def _target_logp(logits: mx.array, targets: mx.array, lse: mx.array) -> mx.array:
    x = mx.take_along_axis(logits, mx.expand_dims(targets, -1), axis=-1)
    return mx.squeeze(x, -1).astype(mx.float32) - lse


def kl_divergence(
    ref_logits: mx.array,
    logits: mx.array,
    *,
    check: bool = True,
    backend: str | None = None,
) -> mx.array:
    """Per-token KL(P_ref || Q) over the last axis, float32.

    Both arrays have the same shape [..., V] (float32, float16 or bfloat16;
    V >= 1; any leading dims). -inf logits are a masked vocabulary; a token
    with reference mass where ``logits`` is -inf gives KL = +inf. NaN or
    +inf in either input, or a row that is entirely -inf, is an error:
    with ``check=True`` (default) the result is evaluated and a ValueError
    names the argument and the first bad token; with ``check=False`` the
    result stays lazy (usable inside ``mx.compile``) and such rows are NaN.
    """
    ref_logits, logits = _check_pair(ref_logits, logits)
    outs = _ext.kl_divergence(ref_logits, logits, None, _LOGITS, _backend_id(backend))
    _checked(outs, check)
    return outs[0]


def kl_compare(
    ref_logits: mx.array,
    logits: mx.array,
    targets: mx.array | None = None,
    *,
    check: bool = True,
    backend: str | None = None,
) -> KLResult:
    """KL, argmax of both sides and (given ``targets``, integer token ids of
    the leading shape) the log-probability of the target on both sides, all
    from the same single pass."""
    ref_logits, logits = _check_pair(ref_logits, logits)
    targets = _check_targets(targets, tuple(logits.shape[:-1]), logits.shape[-1])
    outs = _ext.kl_divergence(ref_logits, logits, None, _LOGITS, _backend_id(backend))
    _checked(outs, check)
    kl, status, argq, lseq, argr, lser = outs
    res = KLResult(kl=kl, argmax_ref=argr, argmax=argq, status=status)
    if targets is not None:
        res.logp_ref_target = _target_logp(ref_logits, targets, lser)
        res.logp_target = _target_logp(logits, targets, lseq)
    return res


def _row_negentropy(w: np.ndarray) -> np.ndarray:
    """sum p log p per row for p = w / sum(w), in float64."""
    w = w.astype(np.float64)
    s = w.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = w / s
        lp = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), 0.0)
    return (p * lp).sum(-1)


class KLReference:
    """The reference side of a sweep, prepared once.

    ``form`` chooses what each candidate pass reads of the reference:

    - ``"logits"``: the reference logits as given, with their log-sum-exp
      precomputed (no max pass, no rescaling); exact; two exps per entry.
    - ``"probs32"``: float32 probabilities plus sum p log p per row; exact
      to float32; one exp per entry (the candidate's), 4 bytes per entry.
    - ``"probs16"``: weights e^(a - max) scaled by 2^15 in float16 (2 bytes
      per entry, half of probs32) plus sum p log p of those stored values;
      one exp per entry. It computes KL(P16 || Q) for P16 the float16-rounded
      reference; bench/KL.md measures what that costs in accuracy.

    argmax and the target log-probabilities of the reference are computed
    at construction with the exact kernel.
    """

    FORMS = ("logits", "probs32", "probs16")

    def __init__(
        self,
        ref_logits: mx.array,
        targets: mx.array | None = None,
        *,
        form: str = "logits",
        backend: str | None = None,
    ):
        if form not in self.FORMS:
            raise ValueError(f"form must be one of {self.FORMS}, got {form!r}")
        ref = _check_logits(ref_logits, "ref_logits")
        self.form = form
        self.shape = tuple(ref.shape)
        self._backend = _backend_id(backend)
        self.targets = _check_targets(targets, self.shape[:-1], self.shape[-1])
        # One pass of the exact kernel against itself validates the reference
        # and yields its log-sum-exp and argmax.
        outs = _ext.kl_divergence(ref, ref, None, _LOGITS, self._backend)
        _checked(outs, True, {"logits": "ref_logits"})
        _, _, _, _, self.argmax_ref, self.lse = outs
        self.logp_ref_target = (
            None if self.targets is None else _target_logp(ref, self.targets, self.lse)
        )
        # Shift by the row maximum, an input value: a - max is exact in
        # float32, a - lse would round.
        top = mx.take_along_axis(ref, mx.expand_dims(self.argmax_ref, -1), axis=-1)
        top = mx.squeeze(top, -1).astype(mx.float32)
        if form == "logits":
            self._data = mx.contiguous(ref)
            self._param = top
            self._mode = _FIXED_SHIFT
        else:
            # Weights proportional to p (max 1; the kernel normalizes them)
            # and sum p log p of exactly the stored weights in float64, a
            # few rows at a time in numpy.
            # rows are read out of MLX a slice at a time: no float32 copy of
            # the whole reference beside it (262K-vocabulary logits of
            # 4 x 256 tokens are 1 GiB)
            V = self.shape[-1]
            rows = ref.reshape(-1, V)
            tops = np.array(top).reshape(-1, 1)
            wdt = np.float32 if form == "probs32" else np.float16
            w = np.empty(rows.shape, wdt)
            negh = np.zeros(rows.shape[0])
            step = max(1, (1 << 20) // V)
            for i in range(0, rows.shape[0], step):
                wi = np.exp(np.array(rows[i : i + step].astype(mx.float32)) - tops[i : i + step])
                if form == "probs16":
                    wi *= np.float32(_P16_SCALE)
                w[i : i + step] = wi
                negh[i : i + step] = _row_negentropy(w[i : i + step])
            self._data = mx.array(w.reshape(self.shape))
            del w
            # float32 hi + lo keeps negH to ~1e-14 (one float32: ~5e-7).
            hi = negh.astype(np.float32)
            lo = (negh - hi.astype(np.float64)).astype(np.float32)
            self._param = mx.array(np.stack([hi, lo], -1).reshape(self.shape[:-1] + (2,)))
            self._mode = _PROBS
        mx.eval(self._data, self._param, self.argmax_ref, self.lse)

    @property
    def nbytes(self) -> int:
        """Bytes of the reference that each candidate pass reads."""
        return self._data.nbytes

    def compare(self, logits: mx.array, *, check: bool = True) -> KLResult:
        """KL(P_ref || Q) and friends for one candidate of the same shape."""
        logits = _check_logits(logits, "logits")
        if tuple(logits.shape) != self.shape:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} differs from the "
                f"reference shape {self.shape}"
            )
        outs = _ext.kl_divergence(self._data, logits, self._param, self._mode, self._backend)
        _checked(outs, check)
        kl, status, argq, lseq, _, _ = outs
        res = KLResult(kl=kl, argmax_ref=self.argmax_ref, argmax=argq, status=status)
        if self.targets is not None:
            res.logp_ref_target = self.logp_ref_target
            res.logp_target = _target_logp(logits, self.targets, lseq)
        return res

    def kl(self, logits: mx.array, *, check: bool = True) -> mx.array:
        """Per-token KL(P_ref || Q) for one candidate."""
        return self.compare(logits, check=check).kl
