"""Public ops. The only module that calls mixbits._ext: every argument is
checked here, with a message naming it, before any kernel runs."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import _ext
from ._backends import BACKENDS, backend_id, isa_limit, names  # noqa: F401  (isa_limit: for the benches)
from .errors import UsageError
from .layout import BITS, DEFAULT_GROUP_SIZE, FLOAT_DTYPES, GROUP_SIZES, QuantizedTensor, Segment, check_int
from .repack import REPACK_BITS, REPACK_ROWS, RepackedSegment, RepackedTensor

def available_backends() -> list[str]:
    """CPU backends of the quantized matmul usable on this machine."""
    return names(_ext.qmm_backends())


def _backend_id(backend: str | None) -> int:
    return backend_id(backend)


def _check_x(x, K: int, name: str = "x") -> None:
    # As MLX: TypeError for a wrong Python type, ValueError for a wrong
    # dtype or shape of an array.
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != K:
        raise ValueError(f"{name} has last dimension {x.shape[-1:]} but the weight has K={K}")


# The CPU matmul's numeric contracts by name -> the C++ Activations enum
# value; the extension's list is the one definition (cpp/qmatmul/qmatmul.h).
ACTIVATIONS = {name: i for i, name in enumerate(_ext.activation_names())}


def activations_id(activations) -> int:
    if not isinstance(activations, str):
        raise TypeError(f"activations must be a str, got {type(activations).__name__}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {sorted(ACTIVATIONS)}, got {activations!r}")
    return ACTIVATIONS[activations]


def qmatmul(x: mx.array, qt: QuantizedTensor, *, backend: str | None = None,
            activations: str = "float") -> mx.array:
    """``x @ W.T`` for a mixed-segment quantized W; any leading dims of x.

    With a permutation this is ``x[..., perm] @ qt.dequantize().T``. The
    output has x's dtype; accumulation is float32.

    ``activations="int8"`` or ``"int16"`` (CPU) opt into an
    integer contract where x has at most 16 rows: x is quantized per weight
    group to Q = 127 or 32767 levels (scale max|x|/Q) and multiplied with
    integer dots; the result is the exact product of the dequantized weights
    with the quantized x, so ``|error| <= sum_g (max|x_g|/(2Q)) * sum_{i in g}
    |w_i|`` (bench/INT8.md: int8 is the faster, int16 the one whose error a
    model's output does not notice). Calls with more rows, or with an
    inf/NaN in x, run the float path. ``activations="int8-all"`` is int8's
    contract at every number of rows (prompts too; identical to ``"int8"``
    up to 16 rows, and above them the same rows called 16 at a time, bit
    for bit). Fast on a repacked weight (the integer kernels in passes of 8
    rows); on MLX's layout it runs the batch kernels over row chunks.
    Every value: :data:`ACTIVATIONS`. A weight with batch dims takes them
    per matrix, as :func:`gather_qmatmul` does per expert.

    ``qt`` may also be a :class:`~mixbits.repack.RepackedTensor` (see
    :func:`repack`): same results and contracts, CPU only; the integer
    contracts then run the row-interleaved kernels (AVX512-VNNI or AVX2 on
    x86, NEON on arm64: :func:`repacked_kernels_available`), float-path
    calls of more than 16 rows on x86 (a prompt) read the blocks in place
    (bit for bit the original layout's result where both run the prefill
    GEMM: above 16 rows on AVX2, above 40 on AVX-512; to float rounding
    below); other CPUs, backends and calls un-repack W into a temporary per
    call, bit for bit the original layout's result).
    """
    if isinstance(qt, RepackedTensor):
        act = activations_id(activations)
        _check_x(x, qt.shape[1])
        if qt.batch_shape:  # a repacked stack: as the batched product below
            return gather_qmatmul(x, qt, backend=backend, activations=activations)
        return _ext.repacked_qmatmul(x, qt.perm, qt.arrays(), qt.specs, qt.shape[0],
                                     _backend_id(backend), act)
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
    act = activations_id(activations)
    _check_x(x, qt.shape[1])
    if qt.batch_shape:
        # A stack of matrices: batch dims broadcast as in mx.quantized_matmul;
        # an integer contract as in gather_qmatmul (per matrix's rows).
        return _ext.batched_qmatmul(x, qt.perm, qt.arrays(), qt.specs, _backend_id(backend), act)
    return _ext.qmatmul(x, qt.perm, qt.arrays(), qt.specs, _backend_id(backend), act)


def promote_x(x, qt):
    """x cast to the dtype MLX's quantized_matmul would return for (x,
    scales) -- e.g. float16 x with float32 scales gives float32 -- so a
    layer's output dtype matches the stock layer it replaces. Cast before
    the matmul (not after) so no precision is lost. ``qt`` a
    QuantizedTensor or RepackedTensor."""
    if isinstance(x, mx.array) and x.dtype != qt.dtype:
        dt = mx.result_type(x.dtype, qt.dtype)
        if dt != x.dtype:
            return x.astype(dt)
    return x


def _per_matrix(fn, arrays, n: int, stacked: bool, join=mx.stack):
    """``fn`` (one matrix's arrays and its ``n`` rows -> arrays) on one
    matrix, or over a stack of them (``stacked``: leading dim E): one call
    on the stack seen as one tall matrix of E*n rows when every matrix is
    whole blocks of 16 rows (blocks then never straddle two matrices), else
    one call per matrix, the results put together by ``join``."""
    if not stacked:
        return fn(arrays, n)
    e = arrays[0].shape[0]
    if n % REPACK_ROWS == 0:
        flat = fn([a.reshape(e * a.shape[1], *a.shape[2:]) for a in arrays], e * n)
        return [a.reshape(e, a.shape[0] // e, *a.shape[1:]) for a in flat]
    per = [fn([a[i] for a in arrays], n) for i in range(e)]
    return [join([p[j] for p in per]) for j in range(len(per[0]))]


def repack(qt: QuantizedTensor) -> RepackedTensor:
    """``qt`` in the row-interleaved layout of the CPU's batch-1 integer GEMV
    (:mod:`mixbits.repack`), built now. 2-D tensors, and stacks of them
    with one batch dim (an expert stack: each expert repacked on its own,
    arrays ``(E, blocks, ·, 16)``), whose segments all have bits in
    ``REPACK_BITS`` (2, 3, 4, 5, 6, 8: every width of
    :data:`mixbits.layout.BITS`); others raise a UsageError (a
    ValueError). :func:`unrepack` is the exact inverse."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"qt must be a mixbits.QuantizedTensor, got {type(qt).__name__}")
    if len(qt.batch_shape) > 1:
        raise UsageError(f"repack takes a 2-D tensor or a stack with one batch dim, got batch dims {qt.batch_shape}")
    bad = [s.bits for s in qt.segments if s.bits not in REPACK_BITS]
    if bad:
        raise UsageError(
            f"repack: bits {sorted(set(bad))} have no repacked layout; "
            f"supported: {list(REPACK_BITS)}"
        )
    n, segs = qt.shape[0], []
    for s in qt.segments:
        def one(a, rows, s=s):
            return list(_ext.repack_segment(*a, s.bits, s.group_size))
        # repacked arrays start on a 64-byte line, a stack's too (not mx.stack)
        wq_r, sc_r, bi_r = _per_matrix(one, [s.wq, s.scales, s.biases], n, bool(qt.batch_shape),
                                       join=_ext.line_aligned_stack)
        segs.append(RepackedSegment(s.bits, s.group_size, s.k, wq_r, sc_r, bi_r, s.kind))
    return RepackedTensor(segs, qt.perm, n)


def repacked_kernels_available() -> bool:
    """Whether this CPU has kernels for the repacked layout: x86 with
    AVX512-VNNI or AVX2, and arm64 (NEON; checked under qemu, speed on
    Apple cores not measured). Elsewhere (an x86 CPU without AVX2) a
    repacked weight is un-repacked on every call: correct, and slower than
    MLX's layout."""
    return bool(_ext.repacked_kernels())


def unrepack(rt: RepackedTensor) -> QuantizedTensor:
    """The exact original :class:`QuantizedTensor` of a repacked one (bit
    for bit), in MLX's layout: what saving, dequantize, gradients and the
    GPU read."""
    if not isinstance(rt, RepackedTensor):
        raise TypeError(f"rt must be a mixbits.repack.RepackedTensor, got {type(rt).__name__}")
    n, segs = rt.shape[0], []
    for s in rt.segments:
        def one(a, rows, s=s):
            return list(_ext.unrepack_segment(*a, rows, s.bits))
        wq, sc, bi = _per_matrix(one, [s.wq_r, s.scales_r, s.biases_r], n, bool(rt.batch_shape))
        segs.append(Segment(s.bits, s.group_size, s.k, wq, sc, bi, s.kind))
    return QuantizedTensor(segs, rt.perm)


# MLX's quantization modes and, per mode, its default (group_size, bits)
# (the table in help(mx.quantize)). The fp modes' group size and bits are
# fixed: mx.quantize refuses any other.
MODES = {"affine": (DEFAULT_GROUP_SIZE, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
# The fp modes with a mixbits CPU kernel (cpp/fpmatmul), by the C++ FpMode value.
FP_MODES = {"mxfp4": 0, "nvfp4": 1, "mxfp8": 2}


def available_fp_backends() -> list[str]:
    """CPU backends of the fp-mode matmul usable on this machine."""
    return names(_ext.fpm_backends())


# Rows of x up to which a GPU call in an fp mode runs mixbits' Metal GEMV
# (metal/fp_qmv.metal; MB_FPQ_MAX_M in fp_qmv_params.h).
FP_GPU_MAX_M = 8


def _fp_kernel_runs(mode, transpose, w, x=None) -> bool:
    """Whether a call in an fp mode runs a mixbits kernel: a 2-D w and either
    the default device a CPU, either ``transpose`` (cpp/fpmatmul), or a GPU
    with transpose=True and 1..FP_GPU_MAX_M rows of x (the Metal GEMV).
    Other calls in these modes (a stack of matrices; on the GPU
    transpose=False or more rows) run MLX's op."""
    if not (isinstance(mode, str) and mode in FP_MODES and isinstance(transpose, (bool, np.bool_))
            and isinstance(w, mx.array) and w.ndim == 2):
        return False
    if mx.default_device().type == mx.cpu:
        return True
    if not (bool(transpose) and isinstance(x, mx.array) and x.ndim >= 1 and x.shape[-1] > 0):
        return False  # (MLX's op also says what is wrong with x)
    return 1 <= x.size // x.shape[-1] <= FP_GPU_MAX_M


def _fp_quantized_matmul(x, w, scales, biases, group_size, bits, mode, transpose, backend, activations):
    """The CPU fp-mode kernel, after MLX's checks of what only Python sees
    (the C++ node checks dtypes and shapes, with ValueErrors as MLX)."""
    if activations != "float":
        activations_id(activations)  # a bad value: its own error first
        raise UsageError(f"activations={activations!r} chooses an integer contract of the affine "
                         f"kernels, and mode={mode!r} has none: leave it at 'float'")
    g, b = MODES[mode]
    # mx.quantized_matmul accepts any group_size / bits in these modes and
    # reads the codes as the mode's anyway; mx.quantize refuses them with a
    # ValueError, and so does this (the same words).
    if group_size is not None and group_size != g:
        raise ValueError(f"[quantized_matmul] {mode} quantization requires group size {g} but got {group_size}.")
    if bits is not None and bits != b:
        raise ValueError(f"[quantized_matmul] {mode} quantization requires bits to be {b} but got {bits}.")
    if biases is not None:
        raise ValueError(f"[quantized_matmul] Biases must be null for quantization mode '{mode}'.")
    for name, a in (("x", x), ("w", w), ("scales", scales)):
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
    return _ext.fp_qmatmul(x, w, scales, FP_MODES[mode], bool(transpose), _backend_id(backend))


def _mlx_route(mode, transpose, bits, backend, activations) -> bool:
    """Whether a call with MLX's arguments goes to MLX's own op: the
    non-affine modes' calls :func:`_fp_kernel_runs` leaves out,
    ``transpose=False`` and 1-bit affine, for which mixbits has no kernel. ``backend`` and ``activations`` choose among
    mixbits' kernels, so a routed call refuses any but the defaults."""
    if not isinstance(mode, str):
        raise TypeError(f"mode must be a str, got {type(mode).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not isinstance(transpose, (bool, np.bool_)):
        raise TypeError(f"transpose must be a bool, got {type(transpose).__name__}")
    route = mode != "affine" or not transpose or (type(bits) is int and bits == 1)
    if route and (backend is not None or activations != "float"):
        raise UsageError(
            f"backend= and activations= choose a mixbits kernel, and mode={mode!r} with "
            f"transpose={bool(transpose)}{' and bits=1' if bits == 1 else ''} has none "
            "(the call runs MLX's own op): leave them at their defaults")
    return route


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    *,
    transpose: bool = True,
    mode: str = "affine",
    backend: str | None = None,
    activations: str = "float",
) -> mx.array:
    """Same meaning as ``mx.quantized_matmul(x, w, scales, biases,
    transpose=transpose, group_size=group_size, bits=bits, mode=mode)``
    (``group_size`` / ``bits`` default to MLX's for the mode: :data:`MODES`);
    ``activations`` as in :func:`qmatmul`. ``w`` may have
    leading batch dimensions ``(..., N, K*bits/32)`` (scales and biases
    ``(..., N, K/group_size)``); they broadcast against x's as in MLX, which
    needs x to have batch dimensions too (MLX would silently use the first
    matrix of w for a 1-D or 2-D x; this refuses with a ValueError).

    Affine weights with ``transpose=True`` run mixbits' kernels; the calls
    they do not cover (``mode`` mxfp4 / nvfp4 / mxfp8, ``transpose=False``,
    1-bit affine) run MLX's own op, with its results and its errors.

    On the CPU, ``mode`` mxfp4 / nvfp4 / mxfp8 with a 2-D ``w`` runs
    mixbits' fp-mode kernels, either ``transpose`` (cpp/fpmatmul: float32
    sums, the same result at any thread count; the gradient wrt x is the
    other orientation's kernel; ``backend`` as for affine, among
    :func:`available_fp_backends`); on the GPU, ``transpose=True`` with at
    most 8 rows of x runs mixbits' Metal GEMV (metal/fp_qmv.metal); their
    other calls (a stack of matrices; on the GPU transpose=False or more
    rows) run MLX's op."""
    if _fp_kernel_runs(mode, transpose, w, x):
        return _fp_quantized_matmul(x, w, scales, biases, group_size, bits, mode, transpose, backend,
                                    activations)
    if _mlx_route(mode, transpose, bits, backend, activations):
        return mx.quantized_matmul(x, w, scales, biases, transpose=bool(transpose),
                                   group_size=group_size, bits=bits, mode=mode)
    group_size = MODES["affine"][0] if group_size is None else group_size
    bits = MODES["affine"][1] if bits is None else bits
    qt = _mlx_tensor(w, scales, biases, group_size, bits)
    return qmatmul(_mlx_out_dtype(x, qt), qt, backend=backend, activations=activations)


def _mlx_out_dtype(x, qt: QuantizedTensor):
    """:func:`promote_x` for a float x; anything else is left for the
    argument checks to refuse, as MLX does."""
    return promote_x(x, qt) if isinstance(x, mx.array) and x.dtype in FLOAT_DTYPES else x


def _mlx_tensor(w, scales, biases, group_size, bits) -> QuantizedTensor:
    """One-segment tensor from MLX's (w, scales, biases) arguments, checked
    as MLX checks them (TypeError for types, ValueError for values)."""
    check_int("bits", bits, BITS)
    check_int("group_size", group_size, GROUP_SIZES)
    for name, a in (("w", w), ("scales", scales), ("biases", biases)):
        if a is None:
            # MLX: "Biases must be provided for affine quantization" (ValueError).
            raise ValueError(f"{name} must be provided for affine quantization")
        if not isinstance(a, mx.array):
            raise TypeError(f"{name} must be an mlx.core.array, got {type(a).__name__}")
    if w.dtype != mx.uint32 or w.ndim < 2:
        raise ValueError(f"w must be a uint32 array with at least 2 dimensions, got {w.dtype} with shape {w.shape}")
    k = w.shape[-1] * 32 // bits
    return QuantizedTensor([Segment(bits, group_size, k, w, scales, biases)])


def _check_indices(name: str, idx):
    if idx is None:
        return None
    if not isinstance(idx, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array or None, got {type(idx).__name__}")
    if not mx.issubdtype(idx.dtype, mx.integer):
        # MLX's message and type (ValueError) for float indices.
        raise ValueError("[gather_qmm] Got indices with invalid dtype. Indices must be integral.")
    return idx


def gather_qmatmul(
    x: mx.array,
    qt: QuantizedTensor,
    lhs_indices: mx.array | None = None,
    rhs_indices: mx.array | None = None,
    sorted_indices: bool = False,
    *,
    backend: str | None = None,
    activations: str = "float",
) -> mx.array:
    """``mx.gather_qmm(x, ..., transpose=True)`` for a mixed-segment stack
    of matrices: ``qt`` holds segments with leading batch dims ``(E, ...)``
    (an expert stack) and ``out[i] = x[lhs[i]][..., perm] @ W[rhs[i]].T``
    with x ``(..., M, K)``; indices index the flattened batch dims and
    broadcast together; each defaults to every batch of its operand. Output
    ``broadcast(lhs, rhs).shape + (M, N)`` in x's dtype. An index out of
    range gives NaN rows, and a NaN gradient wrt x (MLX cannot check it
    when building the graph either). ``sorted_indices`` (as MLX: rhs sorted by expert) is a
    speed hint: the CPU kernel groups rows by expert whether or not they are sorted; on the
    GPU it picks the tiled gathered kernel from 64 rows (weight tiles read once per 32
    rows), which stays correct, only slower, if the indices are not in fact sorted.

    ``activations`` (CPU): :func:`qmatmul`'s contracts, per expert. The
    CPU kernel multiplies each expert's rows (the x rows of the pairs that
    chose it) in one call, and that call takes the integer contract as
    :func:`qmatmul` would on those rows: ``"int8"``/``"int16"`` where the
    expert has at most 16 rows (a decode step's top-k experts), the float
    path where it has more (a prompt) or where a row holds an inf or NaN;
    ``"int8-all"`` at any number. Each pair's output is the contract's
    value for its row (each row is quantized on its own) to float rounding,
    and bit for bit :func:`qmatmul` of that expert's rows, in pair order,
    on its matrix.

    ``qt`` may be a repacked stack (:func:`repack` of one): each expert's
    rows then run as :func:`qmatmul` runs them on that expert's repacked
    matrix (the repacked integer GEMV in a decode step), CPU only; it has
    no gradient (:func:`unrepack` it first)."""
    if not isinstance(qt, (QuantizedTensor, RepackedTensor)):
        raise TypeError(f"qt must be a mixbits.QuantizedTensor or RepackedTensor, got {type(qt).__name__}")
    if not isinstance(x, mx.array):
        raise TypeError(f"x must be an mlx.core.array, got {type(x).__name__}")
    if not isinstance(sorted_indices, (bool, np.bool_)):
        raise TypeError(f"sorted_indices must be a bool, got {type(sorted_indices).__name__}")
    lhs = _check_indices("lhs_indices", lhs_indices)
    rhs = _check_indices("rhs_indices", rhs_indices)
    act = activations_id(activations)
    if isinstance(qt, RepackedTensor):
        if not qt.batch_shape:
            raise ValueError("gather_qmatmul takes a stack of matrices; this RepackedTensor holds one")
        _check_x(x, qt.shape[1])
        return _ext.repacked_gather_qmatmul(x, qt.perm, qt.arrays(), qt.specs, qt.shape[0], lhs, rhs,
                                            _backend_id(backend), act)
    if lhs is None and rhs is None:
        # As MLX: without indices this is the (batched) quantized matmul.
        return qmatmul(x, qt, backend=backend, activations=activations)
    _check_x(x, qt.shape[1])
    return _ext.gather_qmatmul(x, qt.perm, qt.arrays(), qt.specs, lhs, rhs,
                               bool(sorted_indices), _backend_id(backend), act)


def gather_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None = None,
    lhs_indices: mx.array | None = None,
    rhs_indices: mx.array | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    sorted_indices: bool = False,
    *,
    transpose: bool = True,
    mode: str = "affine",
    global_scale: mx.array | None = None,
    backend: str | None = None,
) -> mx.array:
    """Same meaning as ``mx.gather_qmm(x, w, scales, biases, lhs_indices,
    rhs_indices, transpose=transpose, group_size=group_size, bits=bits,
    mode=mode, global_scale=global_scale, sorted_indices=sorted_indices)``:
    w ``(E..., N, K*bits/32)``, x ``(B..., M, K)``, output
    ``broadcast(lhs, rhs).shape + (M, N)``. See :func:`gather_qmatmul` for
    the mixed-segment form. Affine weights with ``transpose=True`` run
    mixbits' kernels; other modes, ``transpose=False``, 1-bit affine and a
    ``global_scale`` (nvfp4's, which MLX takes on the GPU only) run
    ``mx.gather_qmm``."""
    if _mlx_route(mode, transpose, bits, backend, "float") or global_scale is not None:
        return mx.gather_qmm(x, w, scales, biases, lhs_indices, rhs_indices, transpose=bool(transpose),
                             group_size=group_size, bits=bits, mode=mode, global_scale=global_scale,
                             sorted_indices=sorted_indices)
    group_size = MODES["affine"][0] if group_size is None else group_size
    bits = MODES["affine"][1] if bits is None else bits
    qt = _mlx_tensor(w, scales, biases, group_size, bits)
    return gather_qmatmul(_mlx_out_dtype(x, qt), qt, lhs_indices, rhs_indices, sorted_indices,
                          backend=backend)
