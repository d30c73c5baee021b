"""Quantization candidates a sweep tries for each tensor.

A candidate is named by a short string so tables stay readable:
  ``4b_g64``              uniform affine, 4 bits, group 64
  ``ternary_g64``         {-s, 0, +s} per group of 64 (a 2-bit segment)
  ``4b10_3b_g64``         10% of the columns at 4 bits, the rest at 3 bits;
                          the 4-bit columns are those with the largest
                          weight-column norms (stored first via a permutation)

  ``mxfp4`` ``nvfp4`` ``mxfp8``
                          MLX's floating-point modes (``mx.quantize(mode=)``):
                          E2M1 / E4M3 codes with one 8-bit scale per group
                          and no bias, at MLX's fixed group size (32, 16, 32;
                          ``mxfp4_g32`` etc. name the same kinds). Stored as
                          MLX's own quantized layers (``mode`` in
                          config.json), so mlx-lm loads them; they run on
                          MLX's kernels (mixbits has none for them)

  ``8b@4096_4b_g64``      an embedding in two row bands: its first 4096 rows
                          (token ids; byte-pair and SentencePiece
                          vocabularies number frequent pieces first) at
                          8 bits, the rest at ``4b_g64`` (any kind above);
                          both bands at its group size and quantizer
                          (mixbits.nn.RowBandEmbedding); embeddings only

An optional suffix names the quantizer (default: round-to-nearest min-max):
  ``3b_g64+search``       per-group scale/bias search on the weighted error
  ``3b_g64+gptq``         GPTQ error feedback on the layer input's X^T X; a
                          mixed kind (``4b10_3b_g64+gptq``) orders columns by
                          the Hessian diagonal (act-order: salient columns in
                          the wide segment, as EXL2), a uniform one keeps the
                          natural order (an MLX-loadable single segment)
Every quantizer stores the same layout, so kernels, layers and saved
folders do not know which one ran. Calibrated quantizers need the layer
inputs the sweep's reference pass records; they apply to linears inside
decoder blocks -- except ``+search``, which also applies to a head outside
the blocks and to embeddings: it weighs the error by the energy of what
the tensor multiplies (a linear's input; for an embedding the model also
calls as its head, ``as_linear``, the head's input) and searches the plain
squared error of an embedding that is only looked up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..layout import BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, TERNARY

_UNIFORM = re.compile(r"^(\d)b_g(\d+)$")
_TERNARY = re.compile(r"^ternary_g(\d+)$")
_MIXED = re.compile(r"^(\d)b(\d+)_(\d)b_g(\d+)$")
_FP = re.compile(r"^(mxfp4|nvfp4|mxfp8)(?:_g(\d+))?$")
_BANDED = re.compile(r"^(\d)b@(\d+)_(.+)$")

# MLX's floating-point modes -> (group size, bits), fixed by MLX (the table
# in help(mx.quantize)); scales are one uint8 per group (E8M0 for mx, E4M3
# for nv), so storage is bits + 8/group: 4.25, 4.5, 8.25. nvfp4's optional
# per-tensor global scale is not used: MLX's QuantizedLinear and its CPU
# matmul take none.
FP_MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # "uniform", "ternary", "mixed" or "fp" (an MLX fp mode)
    group_size: int
    bits: int | None = None  # uniform
    hi_bits: int | None = None  # mixed
    hi_percent: int | None = None
    lo_bits: int | None = None
    quantizer: str = "rtn"  # "rtn", "act", "search" or "gptq"
    mode: str = "affine"  # MLX's quantization mode: "affine" or one of FP_MODES
    # An embedding's first ``hot_rows`` rows at ``hot_bits`` (row bands);
    # the fields above then describe the other rows.
    hot_rows: int | None = None
    hot_bits: int | None = None

    @property
    def calibrated(self) -> bool:
        """Needs the layer's input statistics (X^T X)."""
        return self.quantizer != "rtn"

    def segments(self, k: int) -> list[tuple]:
        """Segment spec for a tensor with k input columns."""
        gs = self.group_size
        if k % gs:
            raise ValueError(f"candidate {self.name}: K={k} is not a multiple of group size {gs}")
        if self.kind == "fp":
            raise ValueError(f"candidate {self.name}: MLX's {self.mode} mode has no affine segments")
        if self.kind == "uniform":
            return [(self.bits, gs, k)]
        if self.kind == "ternary":
            return [(TERNARY, gs, k)]
        k_hi = int(round(k * self.hi_percent / 100 / gs)) * gs
        k_hi = min(max(k_hi, gs), k - gs) if k > gs else k
        specs = [(self.hi_bits, gs, k_hi)]
        if k - k_hi:
            specs.append((self.lo_bits, gs, k - k_hi))
        return specs

    def bands(self) -> tuple["Candidate", "Candidate"]:
        """(hot rows' kind, other rows' kind) of a row-banded candidate."""
        import dataclasses

        if self.hot_rows is None:
            raise ValueError(f"candidate {self.name}: not row-banded")
        q = "" if self.quantizer == "rtn" else "+" + self.quantizer
        rest = self.name.split("_", 1)[1]
        hot = parse_candidate(f"{self.hot_bits}b_g{self.group_size}{q}")
        return hot, dataclasses.replace(self, name=rest, hot_rows=None, hot_bits=None)

    @property
    def nominal_bits(self):
        """Width as allocation.json counts it: the bits (ternary: 2), or a
        mixed candidate's share-weighted width."""
        if self.kind in ("uniform", "fp"):
            return self.bits
        if self.kind == "ternary":
            return 2
        return (self.hi_percent * self.hi_bits + (100 - self.hi_percent) * self.lo_bits) / 100

    @property
    def storage_bpw(self) -> float:
        """Bits per weight as stored, for a matrix whose K the group size
        divides: codes plus an fp16 scale and bias per group (affine kinds),
        or one uint8 scale per group (fp modes). A mixed kind's permutation
        (4 bytes per input column) is left out: it vanishes with N."""
        per_group = 8 if self.kind == "fp" else 32
        return self.nominal_bits + per_group / self.group_size

    def perm(self, w: np.ndarray):
        """Input order for mixed candidates: salient (large-norm) columns
        first. ``w`` is [N, K], or an expert stack [E, N, K] that shares one
        order: each expert's column norms, summed over experts (an expert's
        salient columns count as much however the others' norms compare)."""
        if self.kind != "mixed":
            return None
        w = np.asarray(w, dtype=np.float32)
        norms = np.linalg.norm(w, axis=-2).reshape(-1, w.shape[-1]).sum(axis=0)
        return np.argsort(-norms, kind="stable").astype(np.int32)


QUANTIZERS = ("rtn", "act", "search", "gptq")


AWQ_HELP = ("AWQ-style scaling first: scales searched at this uniform kind (e.g. 3b_g64) on the "
            "calibration tokens are folded into the norms that feed linears (q/k/v, gate/up), so "
            "the float model computes the same function and every candidate then quantizes the "
            "rescaled weights; measure and quantize must get the same --awq and tokens. AWQ is a "
            "model transform, not a per-tensor candidate (+awq): its scales are shared by the "
            "linears reading one norm")


def awq_kind(name: str) -> Candidate:
    """The uniform candidate an ``--awq`` value names (ValueError otherwise)."""
    cand = parse_candidate(name)
    if cand.kind != "uniform" or cand.quantizer != "rtn":
        raise ValueError(f"--awq {name!r}: give a uniform round-to-nearest kind such as 3b_g64 "
                         "(the width and group size the scales are searched for)")
    return cand


def parse_candidate(name: str) -> Candidate:
    import dataclasses

    base, plus, quantizer = name.partition("+")
    if plus:
        if quantizer not in QUANTIZERS[1:]:
            raise ValueError(f"candidate {name!r}: unknown quantizer {quantizer!r}; "
                             f"expected one of {', '.join('+' + q for q in QUANTIZERS[1:])}")
        cand = dataclasses.replace(parse_candidate(base), name=name, quantizer=quantizer)
        if cand.kind == "fp":
            raise ValueError(f"candidate {name!r}: {base!r} is MLX's {cand.mode} mode, whose scales "
                             f"MLX computes; the {'+' + quantizer} quantizer makes affine kinds only")
        if cand.hot_rows is not None and quantizer != "search":
            raise ValueError(f"candidate {name!r}: row bands are for embeddings, whose "
                             "calibrated quantizer is +search")
        if quantizer == "act" and cand.kind != "mixed":
            raise ValueError(f"candidate {name!r}: +act only orders a mixed kind's columns; "
                             f"{base!r} has one segment (use {base!r} itself)")
        return cand
    if m := _BANDED.match(name):
        hot_bits, rows, rest = int(m[1]), int(m[2]), parse_candidate(m[3])
        if rest.kind == "fp" or rest.hot_rows is not None or rows < 1:
            raise ValueError(f"candidate {name!r}: row bands take an affine kind after the "
                             "row count, e.g. '8b@4096_4b_g64'")
        _check(name, rest.group_size, [hot_bits])
        return dataclasses.replace(rest, name=name, hot_rows=rows, hot_bits=hot_bits)
    if m := _UNIFORM.match(name):
        bits, gs = int(m[1]), int(m[2])
        cand = Candidate(name, "uniform", gs, bits=bits)
        _check(name, gs, [bits])
    elif m := _TERNARY.match(name):
        cand = Candidate(name, "ternary", int(m[1]))
        _check(name, cand.group_size, [])
    elif m := _FP.match(name):
        mode = m[1]
        gs, bits = FP_MODES[mode]
        if m[2] is not None and int(m[2]) != gs:
            raise ValueError(f"candidate {name!r}: MLX's {mode} mode has group size {gs} "
                             f"(write {mode!r} or '{mode}_g{gs}')")
        # One name per kind (the bare mode), however it was written.
        cand = Candidate(mode, "fp", gs, bits=bits, mode=mode)
    elif m := _MIXED.match(name):
        hi, pct, lo, gs = int(m[1]), int(m[2]), int(m[3]), int(m[4])
        if not 0 < pct < 100:
            raise ValueError(f"candidate {name!r}: the high-bit share must be 1..99 percent")
        cand = Candidate(name, "mixed", gs, hi_bits=hi, hi_percent=pct, lo_bits=lo)
        _check(name, gs, [hi, lo])
    else:
        raise ValueError(
            f"unknown candidate {name!r}; expected e.g. '4b_g64', 'ternary_g64', '4b10_3b_g64' "
            f"or one of MLX's fp modes {', '.join(map(repr, FP_MODES))}"
        )
    return cand


def _check(name: str, gs: int, bits: list[int]) -> None:
    if gs not in GROUP_SIZES:
        raise ValueError(f"candidate {name!r}: group size must be one of {GROUP_SIZES}")
    for b in bits:
        if b not in BITS:
            raise ValueError(f"candidate {name!r}: bits must be one of {BITS}")


# Rows an embedding's hot band holds in the menus' row-banded kinds: on
# Gemma 3 (262,144 tokens) the first 4,096 ids are 54% of held-out text's
# tokens, and 8-bit rows there cost 0.04 bits per weight of the model.
HOT_ROWS = 4096
# Row-banded kinds: embeddings only (:func:`supports`), so each adds one
# build per embedding to a sweep.
BANDED_CANDIDATES = tuple(f"8b@{HOT_ROWS}_{b}b_g64" for b in (2, 3, 4))
DEFAULT_CANDIDATES = ("2b_g64", "3b_g64", "4b_g64", "8b_g64", "ternary_g64", "4b10_3b_g64") + BANDED_CANDIDATES
# The default menu and four kinds it lacks: on SmolLM2-135M neither menu's
# allocations scored lower held-out KL at every budget, and at each budget
# the one with the lower calibration joint KL also won on held-out text
# (bench/results/quality_menu_smollm2.json) -- so convert measures this
# superset once and refines with both (CONVERT_MENUS).
EXTENDED_CANDIDATES = DEFAULT_CANDIDATES + ("5b_g64", "6b_g64", "3b_g32", "4b_g32")
# convert's candidate menus, by --menu name; the first is what a tie keeps.
CONVERT_MENUS = {"default": DEFAULT_CANDIDATES, "extended": EXTENDED_CANDIDATES}
# The quantizer convert builds its menus' kinds with (--quantizer): "search"
# (each group's scale and bias searched on the input-weighted error, never
# worse than round-to-nearest's for that group) or "rtn" (MLX's min-max).
CONVERT_QUANTIZERS = ("search", "rtn")


def stored_kinds(model, quantizer: str = "rtn") -> list[str]:
    """The uniform kinds the model's quantizable tensors are already stored
    at (a GGUF's Q5_0 tensors: ``5b_g32``; Q8_0: ``8b_g32``), built by
    ``quantizer``, by storage cost. Convert adds them to its menus: a
    tensor quantized at its own grid is kept as stored (:func:`stored_at`),
    so keeping it is one of the choices the allocation weighs -- as
    llama.cpp re-quantizing a quantized file finds its grid again. A float
    model has none."""
    from ..adapter import ModelAdapter, get_module

    found = set()
    for site in ModelAdapter(model).sites:
        qt = _stored_tensor(get_module(model, site.path))
        if qt is not None:
            seg = qt.segments[0]
            if seg.bits in BITS and seg.group_size in GROUP_SIZES:
                found.add(f"{seg.bits}b_g{seg.group_size}")
    kinds = sorted(found, key=lambda k: (parse_candidate(k).storage_bpw, k))
    return with_quantizer(kinds, quantizer)


def with_quantizer(kinds, quantizer: str) -> list[str]:
    """``kinds`` (round-to-nearest names) built by ``quantizer`` ("rtn": as given)."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    return [k if quantizer == "rtn" else f"{k}+{quantizer}" for k in kinds]

# Named sets for ``--candidates``: "default"; "extended" (above); "wide" -- every width at
# two group sizes, ternary, and two mixed kinds -- for sweeps that can
# afford ~16 candidates per tensor; "fp" -- MLX's three floating-point
# modes, to add to another set (``default fp``: one allocation over both);
# "all" -- "wide" and "fp".
_WIDE = tuple(f"{b}b_g{g}" for b in (2, 3, 4, 5, 6, 8) for g in (64, 128)) + (
    "ternary_g64", "4b10_3b_g64", "3b10_2b_g64", "6b10_4b_g64")
PRESETS = {
    "default": DEFAULT_CANDIDATES,
    "extended": EXTENDED_CANDIDATES,
    "wide": _WIDE,
    "fp": tuple(FP_MODES),
    "all": _WIDE + tuple(FP_MODES),
}


def expand_candidates(names) -> list[str]:
    """Candidate names with presets expanded, in order, without repeats;
    every name checked (ValueError on an unknown one)."""
    out = []
    for n in names:
        for c in PRESETS.get(n, (n,)):
            c = parse_candidate(c).name  # mxfp4_g32 -> mxfp4: one name per kind
            if c not in out:
                out.append(c)
    return out


def records_input(site) -> bool:
    """Whether the replay records ``site``'s input (X^T X): linears inside blocks."""
    return site.form == "linear" and site.block is not None


def needs_inputs(cand: Candidate, site) -> bool:
    """Whether building ``cand`` at ``site`` takes the input's X^T X: a
    calibrated kind at a linear inside a block, and ``+search`` at a site
    outside the blocks too (a head's input; an embedding's when the model
    calls it as its head: the tied head of SmolLM2 and Gemma 3, where the
    input's energy is 80x its mean in one of Gemma's 640 columns)."""
    if not cand.calibrated:
        return False
    return records_input(site) or (cand.quantizer == "search" and site.block is None
                                   and site.form in ("linear", "embedding"))


def supports(cand: Candidate, site) -> bool:
    """Whether ``cand`` can be built for ``site`` (an adapter Site): group
    size dividing K; mixed kinds for linears, embeddings and expert stacks
    (MixedQuantizedSwitchLinear), not for other stacks (multi-head weights,
    kept in MLX's stock quantized class); calibrated quantizers only for
    linears inside blocks (whose inputs are recorded), ``+search`` also for
    other linears and embeddings (unweighted there)."""
    if site.k % cand.group_size or getattr(site, "own_call", None):
        return False
    if cand.hot_rows is not None and (site.form != "embedding" or site.shape[0] <= cand.hot_rows):
        return False
    if cand.calibrated and not records_input(site):
        if cand.quantizer != "search" or site.form not in ("linear", "embedding"):
            return False
    return not (site.form == "stack" and cand.kind == "mixed" and not site.experts)


class FloatTensorWarning(UserWarning):
    """Tensors that stay float because no candidate of the run fits them."""


def fitting(sites, cands: list[Candidate]) -> tuple[dict, list[dict]]:
    """Split ``sites`` by whether some candidate fits them (:func:`supports`).

    Returns (path -> the candidates that fit, for the tensors some fits;
    one ``{"path", "shape", "reason"}`` per tensor none fits). Those stay
    float, as mlx-lm's own quantizer leaves a layer whose input width its
    group size does not divide (mamba's dt_proj, K=48 at 130M widths;
    gemma3n's AltUp coefficients, K=4); they are named once, in a
    :class:`FloatTensorWarning`. Only a run in which no tensor fits at all
    is refused: there would be nothing to measure.
    """
    import warnings

    fits, left = {}, []
    for s in sites:
        ok = [c for c in cands if supports(c, s)]
        if ok:
            fits[s.path] = ok
        else:
            left.append({"path": s.path, "shape": list(s.shape), "reason": _why_none(s, cands)})
    if not fits:
        raise ValueError(f"no candidate fits any of the {len(left)} tensors (e.g. {left[0]['path']}: "
                         f"{left[0]['reason']})" if left else "no tensors to measure")
    if left:
        names = ", ".join(f"{e['path']} ({e['reason']})" for e in left[:8])
        more = f" and {len(left) - 8} more" if len(left) > 8 else ""
        warnings.warn(FloatTensorWarning(
            f"{len(left)} tensor(s) stay float, as mlx-lm leaves them, no candidate fitting: "
            f"{names}{more} (listed under 'float' in the table)"), stacklevel=3)
    return fits, left


def _why_none(site, cands: list[Candidate]) -> str:
    groups = sorted({c.group_size for c in cands})
    if getattr(site, "own_call", None):
        return (f"its class {site.own_call} post-processes the product in its own __call__, which "
                "no mixbits layer does")
    if all(site.k % g for g in groups):
        return f"K={site.k} is a multiple of none of the group sizes {groups}"
    where = "" if site.block is not None else " outside the decoder blocks"
    return (f"the candidates whose group size divides K={site.k} do not apply to a {site.form}{where} "
            "(mixed kinds: not to multi-head stacks; calibrated ones: to block linears only)")


def build_layer(module, cand: Candidate, scale_dtype=None, inputs=None, dense=None):
    """The quantized module that replaces ``module`` at candidate ``cand``.

    The one constructor the sweep, joint evaluation and ``quantize`` share,
    so a measured candidate is exactly what gets saved. Linears and
    embeddings become mixbits layers; stacks (SwitchLinear, MultiLinear)
    at single-segment kinds keep mlx-lm's own quantized class with
    MLX-layout arrays, so saved folders load with ``mlx_lm.load``; expert
    stacks at mixed kinds become a MixedQuantizedSwitchLinear with one
    permutation for all experts. MLX's fp kinds (mxfp4, nvfp4, mxfp8) are
    MLX's own quantized class of the module in that mode (:func:`_fp_layer`),
    in every form. ``scale_dtype`` (affine kinds) defaults to float16.
    ``inputs``: (X^T X [K, K], token count) of the layer's input on the
    calibration set, for calibrated quantizers. ``dense``: the module's
    ``dense_weight``, when the caller builds several candidates of one
    module (decoding it once instead of per candidate).
    """
    import copy

    import mlx.core as mx

    from ..adapter import dense_weight
    from ..layout import quantize as quantize_tensor
    from ..nn import (MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear,
                      is_expert_stack, quantize_stack)

    scale_dtype = scale_dtype or mx.float16
    if cand.hot_rows is not None:
        return _banded_layer(module, cand, scale_dtype, inputs, dense)
    embedding = _is_embedding(module)
    stored = stored_at(module, cand, scale_dtype)
    if stored is not None and not stored.batch_shape:  # kept as stored: nothing to decode
        if embedding:
            return MixedQuantizedEmbedding.from_tensor(stored)
        return MixedQuantizedLinear.from_tensor(stored, module.get("bias"))
    w = dense_weight(module) if dense is None else dense
    k = w.shape[-1]
    # Codes as MLX's quantizer makes them: from the weight in its own dtype
    # (quantizing a float32 weight cast to float16 first moves 0.03-4% of
    # the codes), scales and biases then stored in ``scale_dtype``.
    native = _native_dtype(module)
    wn = w if w.dtype == native else w.astype(native)
    if cand.kind == "fp":
        return _fp_layer(module, cand, wn)
    segs = cand.segments(k)
    if cand.calibrated:
        if w.ndim != 2 or (inputs is None and cand.quantizer != "search"):
            raise ValueError(f"candidate {cand.name!r} needs the layer input's X^T X (a linear "
                             "inside a decoder block, measured or quantized with calibration tokens)")
        qt = _calibrated(w, segs, cand, inputs, scale_dtype)
        if embedding:
            return MixedQuantizedEmbedding.from_tensor(qt)
        return MixedQuantizedLinear.from_tensor(qt, module.get("bias"))
    if w.ndim == 2:
        perm = cand.perm(np.array(w)) if cand.kind == "mixed" else None
        qt = _scales_as(quantize_tensor(wn, segs, perm=perm, dtype=native), scale_dtype)
        if embedding:
            return MixedQuantizedEmbedding.from_tensor(qt)
        return MixedQuantizedLinear.from_tensor(qt, module.get("bias"))
    if cand.kind == "mixed":
        if not is_expert_stack(module):
            raise ValueError(f"candidate {cand.name!r}: mixed segments are not available for "
                             f"{type(module).__name__} stacks (single-segment kinds only)")
        qt = _scales_as(quantize_stack(wn, segs, perm=cand.perm(np.array(w)), dtype=native),
                        scale_dtype)
        return MixedQuantizedSwitchLinear.from_tensor(qt, module.get("bias"))
    seg = (stored or _scales_as(quantize_stack(wn, segs, dtype=native), scale_dtype)).segments[0]
    bits = seg.bits
    if isinstance(module, MixedQuantizedSwitchLinear):
        # Back to mlx-lm's class (MLX-loadable); its constructor's random
        # weight is lazy and replaced below before anything evaluates it.
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear

        q = QuantizedSwitchLinear(k, w.shape[-2], w.shape[0], bias=False,
                                  group_size=cand.group_size, bits=bits)
        if "bias" in module:
            q.bias = module["bias"]
    elif "scales" in module:
        q = copy.copy(module)
    else:
        q = module.to_quantized(group_size=cand.group_size, bits=bits)
    q.weight, q.scales, q.biases = seg.wq, seg.scales, seg.biases
    q.group_size, q.bits = cand.group_size, bits
    if getattr(q, "mode", "affine") != "affine":
        q.mode = "affine"
    q.freeze()
    return q


def _is_embedding(module) -> bool:
    """An embedding table in any storage: float, MLX-quantized, mixbits, row bands."""
    import mlx.nn as nn

    from ..nn import MixedQuantizedEmbedding, RowBandEmbedding

    return isinstance(module, (nn.Embedding, nn.QuantizedEmbedding, MixedQuantizedEmbedding, RowBandEmbedding))


def _banded_layer(module, cand: Candidate, scale_dtype, inputs, dense):
    """A RowBandEmbedding: each band built by :func:`build_layer` from its
    rows of the dense weight (a band is never kept as stored: a stored grid
    spans all rows; ``+search`` finds a decoded grid again)."""
    import mlx.nn as nn

    from ..adapter import dense_weight
    from ..nn import RowBandEmbedding

    if not _is_embedding(module):
        raise ValueError(f"candidate {cand.name!r}: row bands are for embeddings, "
                         f"not {type(module).__name__}")
    w = dense_weight(module) if dense is None else dense
    if w.shape[0] <= cand.hot_rows:
        raise ValueError(f"candidate {cand.name!r}: the embedding has {w.shape[0]} rows, "
                         f"not more than the {cand.hot_rows} hot ones")
    native = _native_dtype(module)
    layers = []
    for kind, rows in zip(cand.bands(), (w[:cand.hot_rows], w[cand.hot_rows:])):
        part = nn.Embedding(*rows.shape)
        part.weight = rows.astype(native)
        layers.append(build_layer(part, kind, scale_dtype, inputs, rows))
    return RowBandEmbedding(layers)


def stored_at(module, cand: Candidate, scale_dtype):
    """``module``'s own quantized tensor when it is already stored on
    ``cand``'s grid -- one affine segment of the same bits and group size,
    in the natural column order, its scales and biases exact in
    ``scale_dtype`` -- else None. Re-quantizing such a tensor at that kind
    keeps it as stored: zero error, the optimum of every quantizer (a
    GGUF's Q5_0 tensor at 5b_g32, a Q4_1 one at 4b_g32), where min-max
    rounding of the decoded weights would move codes of every group whose
    values miss either end of the grid."""
    import mlx.core as mx

    qt = _stored_tensor(module) if cand.kind == "uniform" else None
    if qt is None or (qt.segments[0].bits, qt.segments[0].group_size) != (cand.bits, cand.group_size):
        return None
    seg = qt.segments[0]
    for a in (seg.scales, seg.biases):
        if a.dtype != scale_dtype and not mx.array_equal(a.astype(scale_dtype).astype(a.dtype), a).item():
            return None
    return _scales_as(qt, scale_dtype)


def _stored_tensor(module):
    """``module``'s quantized tensor when it is one affine segment in the
    natural column order (what :func:`stored_at` can keep and
    :func:`stored_kinds` names), else None."""
    from ..adapter import quantized_form

    if getattr(module, "mode", "affine") != "affine":
        return None
    try:
        qt = quantized_form(module)
    except ValueError:  # a quantized layer without biases: nothing to keep
        return None
    if qt is None or qt.perm is not None or len(qt.segments) != 1 or qt.segments[0].kind != "affine":
        return None
    return qt


def _fp_layer(module, cand: Candidate, wn):
    """MLX's own quantized module for ``module`` at an fp mode (mxfp4,
    nvfp4, mxfp8): codes and uint8 scales from ``mx.quantize`` of the
    weight ``wn`` (in the module's dtype), no biases. mlx-lm's loader and
    MLX's kernels read these layers as they are."""
    import copy

    import mlx.core as mx
    import mlx.nn as nn

    from ..nn import is_expert_stack

    gs, bits, mode = cand.group_size, cand.bits, cand.mode
    wq, scales = mx.quantize(wn, gs, bits, mode=mode)
    n, k = wn.shape[-2], wn.shape[-1]
    if _is_embedding(module):
        q = nn.QuantizedEmbedding(n, k, gs, bits, mode=mode)
    elif wn.ndim == 2:
        q = nn.QuantizedLinear(k, n, bias=False, group_size=gs, bits=bits, mode=mode)
    elif is_expert_stack(module):
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear

        q = QuantizedSwitchLinear(k, n, wn.shape[0], bias=False, group_size=gs, bits=bits, mode=mode)
    elif "scales" in module:  # another quantized stack (mlx-lm's QuantizedMultiLinear)
        q = copy.copy(module)
    else:  # a float stack: its own quantized class (MultiLinear -> QuantizedMultiLinear)
        q = module.to_quantized(group_size=gs, bits=bits, mode=mode)
    # The constructors' placeholder codes (lazy, random) are replaced before
    # anything evaluates them.
    q.weight, q.scales, q.biases = wq, scales, None
    q.group_size, q.bits, q.mode = gs, bits, mode
    if "global_scale" in q:
        q.global_scale = None
    if "bias" in module and not isinstance(q, nn.QuantizedEmbedding):
        q.bias = module["bias"]
    q.freeze()
    return q


def _native_dtype(module):
    """The dtype MLX would quantize ``module``'s weight in: a float weight's
    own; for a quantized module, that of its scales (what it decodes to)."""
    import mlx.core as mx

    from ..adapter import quantized_form
    from ..layout import FLOAT_DTYPES
    from ..nn import RowBandEmbedding

    if getattr(module, "mode", "affine") != "affine":
        # MLX's fp modes: uint8 scales; MLX decodes them to bfloat16 by default.
        return mx.bfloat16
    if isinstance(module, RowBandEmbedding):  # its bands share one dtype
        module = module.bands[0]
    qt = quantized_form(module)
    dt = module["weight"].dtype if qt is None else qt.segments[0].scales.dtype
    return dt if dt in FLOAT_DTYPES else mx.float32


def _scales_as(qt, dtype):
    """``qt`` with its scales and biases stored in ``dtype`` (codes unchanged)."""
    import dataclasses

    from ..layout import QuantizedTensor

    if all(s.scales.dtype == dtype for s in qt.segments):
        return qt
    return QuantizedTensor([dataclasses.replace(s, scales=s.scales.astype(dtype),
                                                biases=s.biases.astype(dtype)) for s in qt.segments],
                           qt.perm)


def candidate_for_entry(kind: str, bits, group_size: int = DEFAULT_GROUP_SIZE) -> Candidate:
    """The candidate an allocation entry names. Entries from a sweep carry
    the candidate name itself (``4b_g64``, ``4b10_3b_g64``); older ones a
    bare width (``"4"``) or ``"ternary"``, which take ``group_size``."""
    if kind == "ternary":
        return parse_candidate(f"ternary_g{group_size}")
    if kind.isdigit():
        return parse_candidate(f"{kind}b_g{group_size}")
    return parse_candidate(kind)


def act_perm(w: np.ndarray, x_energy: np.ndarray) -> np.ndarray:
    """Columns by E[x_k^2] * |W[:, k]|^2, largest first: the energy column k
    contributes to the layer's output on the calibration inputs (up to
    cross terms), so the wide segment goes where rounding costs most.
    ``x_energy``: the diagonal of X^T X (any positive multiple of E[x^2])."""
    col = np.square(np.asarray(w, dtype=np.float64)).sum(axis=0)
    return np.argsort(-(np.asarray(x_energy, dtype=np.float64) * col), kind="stable").astype(np.int32)


def _calibrated(w, segs, cand: Candidate, inputs, scale_dtype):
    """The calibrated quantizers of :mod:`mixbits.quantizers`."""
    from .. import quantizers

    if inputs is None or inputs[0] is None:
        # +search where nothing was recorded (an embedding only looked up,
        # never called as a head): the plain squared error
        if cand.quantizer != "search":
            raise ValueError(f"candidate {cand.name!r}: the layer received no input on the calibration set")
        perm = cand.perm(np.array(w)) if cand.kind == "mixed" else None
        return quantizers.search(w, segs, perm=perm, dtype=scale_dtype)
    hessian, n_tokens = inputs
    h = np.asarray(hessian, dtype=np.float64)
    if cand.quantizer == "act":
        from ..layout import quantize as quantize_tensor

        return quantize_tensor(w, segs, perm=act_perm(np.array(w), np.diag(h)), dtype=scale_dtype)
    if cand.quantizer == "gptq":
        # Group scales by the weighted clip search: the best GPTQ variant on
        # the quantizer tests (0.45 of RTN's output error at 2-4 bits vs 0.6).
        return quantizers.gptq(w, segs, h, act_order=cand.kind == "mixed", dtype=scale_dtype,
                               n_tokens=n_tokens, params="search")
    diag = np.diag(h)
    perm = None
    if cand.kind == "mixed":  # salient columns first, by the input's energy, as act-order does
        perm = np.argsort(-diag, kind="stable").astype(np.int32)
    return quantizers.search(w, segs, perm=perm, dtype=scale_dtype, h_diag=diag)


def embed_candidates(model, chosen: dict, embed_bits: int | None,
                     group_size: int = DEFAULT_GROUP_SIZE) -> dict:
    """{path: Candidate} for the embeddings and head (tensors outside the
    blocks) that ``chosen`` leaves out, at ``embed_bits`` (allocation.json's
    embed_bits: outside the budget, as ExLlamaV2-derived allocations set
    them). None or 16: none (left as loaded). A width whose group size
    does not divide the tensor leaves it float, as mlx-lm would. What
    quantize stores and what the joint evaluation pins alike."""
    from ..adapter import ModelAdapter

    if embed_bits is None or embed_bits == 16:
        return {}
    cand = parse_candidate(f"{embed_bits}b_g{group_size}")
    return {s.path: cand for s in ModelAdapter(model).sites
            if s.block is None and s.path not in chosen and supports(cand, s)}
