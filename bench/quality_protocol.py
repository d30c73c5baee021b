"""One evaluation protocol for every quality claim (issue 41 item 1).

What every contender gets, and how each is scored:

- calibration: ``N_CAL`` x ``SEQ_LEN`` tokens of Botchan (the default
  corpus) per seed. Seed 0 is exactly what ``mixbits convert`` cuts by
  default (the first windows of the text); seed s > 0 is ``N_CAL`` windows
  drawn at random (numpy seed s) from the part of the text the in-domain
  held-out set does not use. Every calibrated contender (mixbits,
  dynamic_quant) of a seed gets the same token array.
- held out, never used for any choice:
  ``licenses``: ``HELD_N`` windows spread evenly over the license texts
  Debian ships (/usr/share/common-licenses: legal English, another text
  and register than the calibration prose) -- the score the claims use;
  ``botchan_story_tail``: the story's last ``HELD_N`` windows (before the
  Project Gutenberg license that ends the file), disjoint from every
  seed's calibration windows (same text, other passages): the gap
  between the two is how much of a loss is transfer rather than noise.
- reference: the model as loaded, in float32 (for SmolLM2 the GGUF's
  Q4_1 block linears dequantized); KL = mean per-token KL(ref || quantized)
  of the final logits; a sequence's score is its tokens' mean.
- storage bpw, one count for all: codes + an fp16 scale and bias per group
  (mlx-lm's count), summed over every tensor the allocation covers -- all
  linears in the blocks and the embedding, which SmolLM2 ties to the head
  (so the head is the embedding: one tensor, counted once, quantized by
  every contender). Norms and other small float tensors are left as they
  are by all and counted by none.
- ratio: contender A over contender B as the ratio of mean KLs (means over
  seeds and held-out sequences); 95% interval from a paired bootstrap that
  resamples held-out sequences (the same indices for both and for every
  seed). The spread over seeds is reported beside it, per seed.

Contenders built here (all on the same tensors, judged at storage bpw <=
the budget): uniform affine at 2/3/4/5/6/8 bits, group 32/64 (mlx-lm's
``convert -q`` with ``--q-bits/--q-group-size``); mlx-lm's ``mixed_*``
recipes via its own ``mixed_quant_predicate_builder`` (group 32/64);
mlx-lm's ``dynamic_quant`` (its ``estimate_sensitivities`` on the seed's
calibration tokens) at the width pairs in ``DQ_PAIRS``, its threshold set
at the budget; mixbits' default ``convert`` (one measurement per seed shared
by all budgets). With ``--kquant`` (bench/kquant.py; the llama.cpp tools from
bench/ggml/build_llama_quant.sh): llama.cpp's mixes Q2_K ... Q5_K_M from the
reference written as an F32 GGUF, with each seed's importance matrix
(llama-imatrix on the seed's tokens) and without; their storage bpw are the
bytes of the same tensors in the quantized GGUF (K-quant super-block scales
included, whatever type the mix gave each tensor); a mix over the largest
budget is only sized (no table row can use it), unless ``--kquant-all``.
With ``--gptq`` / ``--awq`` / ``--dwq EPOCHS``: mlx-lm's own quantizers
(mlx_lm.quant.gptq / awq / dwq, called as functions) on the float model, each
seed's calibration tokens (the same array every calibrated contender gets),
every site at one width and group (the finest group that fits each budget,
as for uniform; GPTQ packs 2/4/8 bits only), the embedding (tied head) at
that same kind, round-to-nearest (GPTQ's fallback, AWQ's embed bits, DWQ's
quantize_model). The model each leaves is scored as it is (``score_model``:
its site layers, and any other parameter it changed -- AWQ's norms -- swapped
into the evaluator for the run) with the same KL; storage bpw from its
arrays with fp16 scales and biases (``quantized_bpw``), checked equal to the
uniform kind's count. On the Linux CPU their float and quantized products
run on mixbits' kernels (``routed_products``, ``awq_routes``: same products,
mlx-lm's code unchanged); DWQ's training needs MLX's own quantized matmul
and its gradient (no mixbits route), ~0.3 GFLOP/s here.

Run:  nice -n 10 python bench/quality_protocol.py [--seeds 0 1] [--mixbits-seeds 0]
      [--budgets 3 3.5 4 4.5 5] [--work DIR]
Every stage is kept in --work (default /tmp/quality_protocol): a rerun
after a kill continues. Writes bench/results/quality_protocol_<model>.json.

A/B of mixbits' own settings on the same protocol: ``--method`` and
``--candidates`` are passed to ``convert`` (default: convert's own);
``--records-from`` takes the contenders' scores from another run's records
file (they do not depend on mixbits' settings; its mixbits rows are
dropped); ``--result`` names the results file; ``--n-cal`` gives every
seed fewer calibration sequences (the small-set case: seed 0 is still
convert's own cut, its first windows).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

N_CAL, SEQ_LEN, HELD_N = 8, 256, 16
# group 128 divides neither SmolLM2 (576) nor Gemma-3-270M (640) columns
BITS, GROUPS = (2, 3, 4, 5, 6, 8), (32, 64)
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")
# dynamic_quant (low, high) bit pairs, group 64 as mlx-lm's defaults (4/5 is
# its default pair); each pair costs mlx-lm's backward passes per seed, ~4 min
# here, so four (3/8 and 2/4 scored 1.6-2.9x uniform's KL in convert_smollm2.json).
DQ_PAIRS = ((2, 3), (2, 4), (3, 5), (4, 5))
RESULTS = Path(__file__).parent / "results"

def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def host() -> dict:
    """CPU model, the ISA flags the kernels choose between, cores and load."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
                 platform.processor())
    flags = set(info.split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "asimd") if f in flags]
    return {"machine": platform.machine(), "cpu": model, "isa": isa, "cores": os.cpu_count(),
            "load_1min": os.getloadavg()[0]}

# ---------------------------------------------------------------- token sets

def _windows(tok, text: str) -> np.ndarray:
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    n = len(ids) // SEQ_LEN
    return ids[: n * SEQ_LEN].reshape(n, SEQ_LEN)

def token_sets(tok, seeds, n_cal: int = N_CAL) -> tuple[dict[int, np.ndarray], dict[str, np.ndarray]]:
    """({seed: calibration [n_cal, SEQ_LEN]}, {held-out name: [HELD_N, SEQ_LEN]})."""
    from mixbits.models.calibration import calibration_text

    text = calibration_text("botchan")
    # the file ends with Project Gutenberg's license (~18 windows of legal
    # text): the in-domain set is the story's last windows before it
    end = text.find("End of Project Gutenberg")
    story = _windows(tok, text[:end] if end > 0 else text)
    legal = _windows(tok, calibration_text("licenses"))
    tail = len(story) - HELD_N  # story windows >= tail are the in-domain held-out set
    held = {"licenses": legal[np.linspace(0, len(legal) - 1, HELD_N).round().astype(int)],
            "botchan_story_tail": story[tail:]}
    calib = {}
    for s in seeds:
        # seed 0: convert's own cut (the first windows of the whole file)
        idx = np.arange(n_cal) if s == 0 else np.sort(np.random.default_rng(s).choice(tail, n_cal, replace=False))
        calib[s] = _windows(tok, text)[idx] if s == 0 else story[idx]
    return calib, held


# -------------------------------------------------------------- storage bits

def kind_bits(kind: str, shape) -> int:
    """Storage bits of one tensor [N, K] at a uniform affine ``kind``: codes
    + an fp16 scale and bias per group (mlx-lm's count; equal to the stored
    layer's bytes, which :meth:`Scorer.bpw` counts for other kinds)."""
    from mixbits.measure.candidates import parse_candidate

    return int(round(parse_candidate(kind).storage_bpw * int(np.prod(shape))))


def size_table(sites, kinds) -> dict:
    """A table-shaped dict (entries with candidates' storage_bits) over the
    tensors ``sites``, so baselines.entry_bpw and dynamic_quant.assignment
    count every contender's bits the same way."""
    entries = []
    for s in sites:
        n = int(np.prod(s.shape))
        entries.append({"path": s.path, "nparams": n,
                        "candidates": [{"kind": k, "storage_bits": kind_bits(k, s.shape)} for k in kinds]})
    return {"entries": entries}

# ------------------------------------------------------------------- scoring

class Scorer:
    """The reference model and one JointEvaluator per held-out set."""

    def __init__(self, model_name: str, sets=None):
        """``sets``: the held-out sets to build evaluators for (default all;
        each SmolLM2 set's float32 reference is 0.8 GB)."""
        import mixbits
        from mixbits.measure.calib import cast_model
        from mixbits.measure.joint import JointEvaluator
        from mixbits.nn import patch

        self.model, self.tok, _ = mixbits.load(model_name)
        cast_model(self.model, "float32")
        patch(self.model)
        self.seeds_calib, self.held = {}, {}
        _, held = token_sets(self.tok, [])
        unknown = sorted(set(sets or ()) - set(held))
        if unknown:
            raise ValueError(f"unknown held-out sets {unknown}; the protocol's are {sorted(held)}")
        self.held = {k: v for k, v in held.items() if sets is None or k in sets}
        # the second evaluator shares the first's layer cache (no calibrated
        # candidates here, so nothing is fitted on either set)
        self.evals, ev = {}, None
        for k, v in self.held.items():
            self.evals[k] = JointEvaluator(self.model, v, chunk=4, calibration=ev)
            ev = ev or self.evals[k]
        self.sites = [s for s in ev.adapter.sites]
        kinds = [f"{b}b_g{g}" for b in BITS for g in GROUPS]
        self.table = size_table(self.sites, kinds)

    def bpw(self, plan: dict[str, str]) -> float:
        from mixbits.measure.baselines import entry_bpw
        from mixbits.measure.candidates import parse_candidate, supports
        from mixbits.measure.sweep import storage_bits

        kinds = {c["kind"] for c in self.table["entries"][0]["candidates"]}
        for k in sorted(set(plan.values()) - kinds):
            # a kind first seen here (mixbits' ternary, 4b10_3b, an embedding's
            # row bands ...): the built layer's codes, scales, biases and
            # permutation, as measure counts them, at the tensors it fits
            cand = parse_candidate(k)
            uni = cand.kind == "uniform" and cand.hot_rows is None
            ev = next(iter(self.evals.values()))
            for e, s in zip(self.table["entries"], self.sites):
                if not supports(cand, s):
                    continue
                bits = kind_bits(k, s.shape) if uni else storage_bits(ev.layer(s.path, k), s)
                e["candidates"].append({"kind": k, "storage_bits": bits})
        return entry_bpw(self.table, plan)

    def score(self, plan: dict[str, str], sets=None, calibration=None) -> dict[str, list[float]]:
        """{held-out name: per-sequence KL} on ``sets`` (default: all). A plan
        with calibrated kinds (``+search``, ``+gptq``...) needs the tokens its
        allocation was calibrated on (``calibration``): its layers are fitted
        on them, never on the held-out text."""
        from mixbits.measure.candidates import parse_candidate

        evals = self.evals
        if any(parse_candidate(k).calibrated for k in set(plan.values())):
            if calibration is None:
                raise ValueError("a plan with calibrated kinds needs its calibration tokens")
            evals = self._fitted_on(np.asarray(calibration))
        return {k: ev.sequence_kls(plan).tolist() for k, ev in evals.items() if sets is None or k in sets}

    def _fitted_on(self, tokens: np.ndarray) -> dict:
        """Held-out evaluators whose calibrated layers are fitted on ``tokens``
        (one seed's set at a time: the previous seed's are let go)."""
        from mixbits.measure.joint import JointEvaluator

        if getattr(self, "_fit_tokens", None) is None or not np.array_equal(self._fit_tokens, tokens):
            self._fitted = None  # free the last seed's reference logits and layers first
            cal = JointEvaluator(self.model, tokens, chunk=4)
            # the held-out reference is the scorer's own (same model and tokens):
            # shared, not held twice (Gemma-3-270M: 2.1 GiB per set as probs16)
            self._fitted = {k: JointEvaluator(self.model, v, chunk=4, calibration=cal, same_reference=self.evals[k])
                            for k, v in self.held.items()}
            self._fit_tokens = tokens
        return self._fitted

def uniform_plans(sites) -> dict[str, dict[str, str]]:
    return {f"uniform {b}b_g{g}": {s.path: f"{b}b_g{g}" for s in sites} for b in BITS for g in GROUPS}

def recipe_plans(model, sites) -> dict[str, dict[str, str]]:
    """mlx-lm's mixed recipes, asked of its own predicate for each tensor path
    (with tied embeddings there is no lm_head: the embedding gets low bits, as
    mlx_lm.convert gives it)."""
    from mlx_lm.convert import mixed_quant_predicate_builder

    out = {}
    for r in RECIPES:
        for g in GROUPS:
            pred = mixed_quant_predicate_builder(r, model, group_size=g)
            plan = {}
            for s in sites:
                spec = pred(s.path, None)
                plan[s.path] = f"{spec['bits']}b_g{spec['group_size']}"
            out[f"mlx-lm {r} g{g}"] = plan
    return out

def finest_fitting(plans: dict[str, dict[str, str]], bpw, budgets) -> dict[str, dict[str, str]]:
    """Of each family (a width or a recipe, over group sizes), the finest
    group whose storage bpw fits each budget: the same widths with smaller
    groups at a higher bpw still within the budget are what a user would take
    (each evaluation costs ~1 min here, so the dominated ones are not run)."""
    keep = {}
    fam = {}
    for name, plan in plans.items():
        family, g = name.rsplit("g", 1) if name.startswith("mlx-lm") else name.rsplit("_g", 1)
        fam.setdefault(family, []).append((int(g), name, plan))
    for family, opts in fam.items():
        for b in budgets:
            fit = [(g, n, p) for g, n, p in opts if bpw(p) <= b + 1e-9]
            if fit:
                g, n, p = min(fit, key=lambda o: o[0])
                keep[n] = p
    return keep


def dq_plans(scorer: Scorer, calib: np.ndarray, budgets, cache: Path) -> dict[str, dict[str, str]]:
    """mlx-lm dynamic_quant at every DQ_PAIRS pair and budget, its
    sensitivities (kept in ``cache``) estimated on ``calib``."""
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    from mixbits.measure.dynamic_quant import assignment, float_copy
    from mixbits.nn import patch

    out = {}
    for lo, hi in DQ_PAIRS:
        f = cache / f"dq_sens_{lo}_{hi}.json"
        if not f.exists():
            t0 = time.perf_counter()
            # the float twin's linears on mixbits' float GEMM (same function and
            # gradients, tests/test_float_linear.py): MLX's Linux CPU matmul
            # takes ~25 min per 4 x 256-token batch here
            twin = float_copy(scorer.model)
            patch(twin)
            sens = dict(estimate_sensitivities(twin, mx.array(calib), lo, 64, hi, 64, batch_size=4))
            del twin
            f.write_text(json.dumps({"seconds": time.perf_counter() - t0, "sens": sens}))
        sens = json.loads(f.read_text())["sens"]
        lo_bpw = scorer.bpw({s.path: f"{lo}b_g64" for s in scorer.sites})
        hi_bpw = scorer.bpw({s.path: f"{hi}b_g64" for s in scorer.sites})
        for b in budgets:
            if not lo_bpw <= b < hi_bpw:  # all low does not fit, or all high does (uniform)
                continue
            out[f"mlx-lm dynamic_quant {lo}/{hi} @{b:g}"] = assignment(scorer.table, sens, b, f"{lo}b_g64",
                                                                      f"{hi}b_g64")
    return out

# ------------------------------------- mlx-lm's calibrated quantizers (GPTQ, AWQ, DWQ)

# mlx-lm's gptq packs its codes itself for these widths only (an assert);
# awq and dwq quantize with mx.quantize (any width of BITS).
GPTQ_BITS = (2, 4, 8)
# DWQ's steps over the seed's calibration set (batches of DWQ_BATCH
# sequences, mlx-lm's default batch and learning rate): mlx-lm's default run
# is 2,048 samples of 1,025 tokens, ~1,000x these 2,048 tokens.
DWQ_BATCH, DWQ_LR = 4, 1e-6


@contextlib.contextmanager
def routed_products():
    """mlx-lm's quantizers as the protocol runs them on a Linux CPU: the
    float twin's linears, attention and norms on mixbits' routes (as
    dq_plans' twin), and every 2-D float32 ``a @ b`` they compute themselves
    (GPTQ's X^T X and error updates) through mixbits.float_linear's OpenBLAS
    product instead of the mlx-cpu wheel's reference BLAS (0.34 GFLOP/s on
    X^T X here: 30 s per down_proj Hessian). Same products (float32 sums);
    mlx-lm's code is not changed."""
    from mixbits import float_linear, routing

    orig = mx.array.__matmul__

    def matmul(a, b):
        if (isinstance(b, mx.array) and a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype == mx.float32
                and float_linear.on_cpu()):
            return float_linear.float_matmul(a, b, trans_b=False)
        return orig(a, b)

    mx.array.__matmul__ = matmul
    token = routing._ACTIVE.set(True)
    try:
        yield
    finally:
        routing._ACTIVE.reset(token)
        mx.array.__matmul__ = orig


class _KernelQuantizedLinear(nn.QuantizedLinear):
    """An nn.QuantizedLinear whose product runs on mixbits.qmatmul over its
    own arrays (the mlx-cpu wheel's quantized matmul: 0.2 GFLOP/s here,
    16 s per 2,048-token down_proj); only while awq_routes() is on."""

    def __call__(self, x):
        from mixbits.nn.weight import tensor_from_mlx_layer
        from mixbits.ops import promote_x, qmatmul

        qt = tensor_from_mlx_layer(self, "QuantizedLinear")
        y = qmatmul(promote_x(x, qt), qt)
        return y + self["bias"] if "bias" in self else y


@contextlib.contextmanager
def awq_routes(model):
    """mlx-lm's AWQ on this CPU: the layers its nn.quantize calls make run on
    mixbits' quantized kernel (they are nn.QuantizedLinear again after), and
    its clip search's mx.einsum("bdg,odg->bod") -- per group column d, x_d @
    w_d.T -- as those products on float_linear's OpenBLAS path. Same
    products, float32 sums; mlx-lm's code is not changed."""
    from mixbits import float_linear

    quantize, einsum = nn.quantize, mx.einsum

    def quantize_routed(module, *args, **kwargs):
        out = quantize(module, *args, **kwargs)
        for _, m in module.named_modules():
            if type(m) is nn.QuantizedLinear:
                m.__class__ = _KernelQuantizedLinear
        return out

    def einsum_routed(subscripts, *operands, **kwargs):
        if (subscripts == "bdg,odg->bod" and len(operands) == 2 and not kwargs
                and all(o.dtype == mx.float32 and o.ndim == 3 for o in operands) and float_linear.on_cpu()):
            x, w = operands
            return mx.stack([float_linear.float_matmul(x[:, d, :], w[:, d, :]) for d in range(x.shape[1])], axis=-1)
        return einsum(subscripts, *operands, **kwargs)

    nn.quantize, mx.einsum = quantize_routed, einsum_routed
    try:
        yield
    finally:
        nn.quantize, mx.einsum = quantize, einsum
        for _, m in model.named_modules():
            if type(m) is _KernelQuantizedLinear:
                m.__class__ = nn.QuantizedLinear


def float_twin(model):
    """The protocol's float model as plain float32 Linear/Embedding layers
    (what mlx-lm's quantizers take), on mixbits' routes."""
    from mixbits.measure.dynamic_quant import float_copy
    from mixbits.nn import patch

    twin = float_copy(model)
    patch(twin)
    return twin


def _fp16_storage(qmodel) -> None:
    """Scales and biases of every affine quantized layer as the protocol
    stores and counts them (float16), as mlx-lm leaves them for an fp16 model."""
    for _, m in qmodel.named_modules():
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            m.scales = m.scales.astype(mx.float16)
            if m.get("biases") is not None:
                m.biases = m.biases.astype(mx.float16)


def quantized_bpw(qmodel, sites) -> float:
    """Storage bpw over ``sites`` of a model whose site layers are MLX affine
    quantized layers, from their arrays: the packed codes' bits (uint32
    words) + 16 bits per scale and per bias, over the weights they encode."""
    mods = dict(qmodel.named_modules())
    bits = n = 0
    for p in sites:
        m = mods.get(p)
        if not isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or getattr(m, "mode", "affine") != "affine":
            raise ValueError(f"{p} is not an affine quantized layer: {type(m).__name__}")
        codes = m.weight.size * 32
        bits += codes + 16 * (m.scales.size + (m.biases.size if m.get("biases") is not None else 0))
        n += codes // m.bits
    return bits / n


def score_model(evaluators: dict, qmodel, sets=None) -> dict[str, list[float]]:
    """{held-out name: per-sequence KL} of ``qmodel`` (a copy of the
    evaluators' model as a quantizer left it) on the protocol's evaluators:
    its site layers replace the evaluators' for the run (as kquant.score_gguf
    does), and every other parameter it changed (AWQ's norms, which take its
    input scales) is loaded for the run too; all put back after. The KL is
    the evaluators' own (token_kls_of), as for every plan."""
    from mlx.utils import tree_flatten, tree_unflatten

    ev0 = next(iter(evaluators.values()))
    if ev0.pinned:
        raise ValueError("the model pins layers outside the sites: the swap would not replace them")
    mods = dict(qmodel.named_modules())
    missing = [p for p in ev0.sites if p not in mods]
    if missing:
        raise ValueError(f"qmodel lacks the sites {missing[:5]}")
    layers = {p: mods[p] for p in ev0.sites}
    inside = tuple(f"{p}." for p in ev0.sites)
    mine = dict(tree_flatten(ev0.model.parameters()))
    changed, saved = [], []
    for k, v in tree_flatten(qmodel.parameters()):
        if k.startswith(inside):
            continue
        if k not in mine or mine[k].shape != v.shape:
            raise ValueError(f"qmodel's {k} is not a parameter of the evaluators' model of that shape")
        if not mx.array_equal(mine[k], v).item():
            changed.append((k, v.astype(mine[k].dtype)))
            saved.append((k, mine[k]))
    try:
        if changed:
            ev0.model.update(tree_unflatten(changed))
        return {k: ev.token_kls_of(layers).mean(axis=1).tolist()
                for k, ev in evaluators.items() if sets is None or k in sets}
    finally:
        if saved:
            ev0.model.update(tree_unflatten(saved))


def gptq_model(model, calib: np.ndarray, bits: int, group: int):
    """mlx-lm's gptq_quantize on the float twin of ``model`` with ``calib``
    (one batch), every block linear at ``bits``/``group``; the embedding
    (tied head), which GPTQ does not touch, round-to-nearest at the same
    width (its fallback), as uniform quantizes it."""
    from mixbits import routing
    from mlx_lm.quant import gptq

    if bits not in GPTQ_BITS:
        raise ValueError(f"mlx-lm's gptq packs {GPTQ_BITS} bits only, got {bits}")
    twin = float_twin(model)
    # its layer test is type(l) in {nn.Linear, SwitchLinear}: the twin's
    # routed linears (an nn.Linear subclass) count as linears for the run
    keep = gptq.SwitchLinear
    gptq.SwitchLinear = routing._RoutedLinear
    try:
        with routed_products():
            q, _ = gptq.gptq_quantize(twin, mx.array(calib), bits, group, bits, group, batch_size=len(calib))
    finally:
        gptq.SwitchLinear = keep
    return q


def awq_model(model, calib: np.ndarray, bits: int, group: int, model_type: str):
    """mlx-lm's awq_quantize on the float twin of ``model`` with ``calib``:
    scale search and clipping per block, the embedding (tied head) at the
    same width and group (its embed_bits / embed_group_size), n_grid 20."""
    from mlx_lm.quant import awq

    cfg = awq.AWQ_MODEL_CONFIGS.get(model_type)
    if cfg is None:
        raise ValueError(f"mlx-lm's awq has no config for {model_type!r}")
    twin = float_twin(model)
    with routed_products(), awq_routes(twin):
        awq.awq_quantize(twin, mx.array(calib), cfg, group_size=group, bits=bits, embed_group_size=group,
                         embed_bits=bits)
    return twin


def dwq_model(model, calib: np.ndarray, bits: int, group: int, epochs: int):
    """mlx-lm's dwq_quantize: the float twin of ``model`` quantized
    round-to-nearest at ``bits``/``group`` (the embedding too: mlx-lm's
    quantize_model), its scales and biases then trained to the twin's
    logits (KL at temperature 2, Adam at mlx-lm's default learning rate,
    batches of DWQ_BATCH) for ``epochs`` passes over ``calib`` -- the only
    tokens it gets, for training and for its validation loss alike. Returns
    (model, {"steps", "valid_loss_before", "valid_loss_after"})."""
    import copy
    import io
    import mlx.optimizers as optimizers
    from contextlib import redirect_stdout

    from mlx_lm.quant import dwq

    twin = float_twin(model)
    student = copy.deepcopy(twin)
    nn.quantize(student, group_size=group, bits=bits)
    seqs = [(list(map(int, row)), 0) for row in calib]
    targets = {}

    def target_fn(batch, idx, split):
        key = np.asarray(batch).tobytes()
        if key not in targets:  # the same batches come back every epoch
            targets[key] = twin(batch)
            mx.eval(targets[key])
        return targets[key]

    log = io.StringIO()
    with routed_products(), redirect_stdout(log):
        dwq.dwq_quantize(student, target_fn, optimizers.Adam(learning_rate=DWQ_LR, bias_correction=True),
                         seqs * epochs, seqs, batch_size=DWQ_BATCH, max_seq_length=calib.shape[1] + 1, seed=0,
                         dtype=mx.float32)
    student.eval()
    losses = [float(ln.rsplit("loss=", 1)[1]) for ln in log.getvalue().splitlines() if ln.startswith("Validation")]
    return student, {"steps": epochs * (len(seqs) // DWQ_BATCH), "valid_loss_before": losses[0] if losses else None,
                     "valid_loss_after": losses[-1] if losses else None}


def mlxlm_widths(method: str, sites, bpw, budgets) -> list[tuple[int, int]]:
    """(bits, group) of ``method``'s runs: of each width it takes, the finest
    group whose storage bpw fits each budget (as finest_fitting does for
    uniform: every site, the embedding included, at that one kind)."""
    widths = GPTQ_BITS if method == "gptq" else BITS
    plans = {f"{method} {b}b_g{g}": {s.path: f"{b}b_g{g}" for s in sites} for b in widths for g in GROUPS}
    return sorted({tuple(int(x) for x in n.split()[1].replace("b_g", " ").split())
                   for n in finest_fitting(plans, bpw, budgets)})


def mlxlm_record(sc: "Scorer", method: str, calib: np.ndarray, bits: int, group: int, sets,
                 dwq_epochs: int = 0, model_type: str = "llama") -> dict:
    """Quantize the scorer's float model with mlx-lm's ``method`` on
    ``calib`` and score the model it leaves on ``sets``: storage bpw from
    its arrays (fp16 scales and biases), checked equal to the protocol's
    count for the uniform plan it is; quantize and score seconds."""
    from mixbits.nn import patch

    t0 = time.perf_counter()
    info = {}
    if method == "gptq":
        q = gptq_model(sc.model, calib, bits, group)
    elif method == "awq":
        q = awq_model(sc.model, calib, bits, group, model_type)
    elif method == "dwq":
        q, info = dwq_model(sc.model, calib, bits, group, dwq_epochs)
    else:
        raise ValueError(f"unknown mlx-lm quantizer {method!r}")
    mx.eval(q.parameters())
    secs = time.perf_counter() - t0
    _fp16_storage(q)
    paths = [s.path for s in sc.sites]
    bpw = quantized_bpw(q, paths)
    want = sc.bpw({p: f"{bits}b_g{group}" for p in paths})
    if abs(bpw - want) > 1e-9:
        raise RuntimeError(f"mlx-lm {method} stored {bpw:.6f} bpw, not the {want:.6f} of {bits}b_g{group}")
    patch(q)  # its quantized layers on mixbits' kernels, as the evaluators' own
    t1 = time.perf_counter()
    kl = score_model(sc.evals, q, sets)
    return {"bpw": bpw, "kl": kl, "quantize_s": round(secs, 1), "score_s": round(time.perf_counter() - t1, 1),
            "load_1min": round(os.getloadavg()[0], 2), "calibration_tokens": list(calib.shape), **info}


def run_convert(model_name: str, tokens: np.ndarray, budgets, out: Path, extra=()) -> float:
    """``mixbits convert`` with its defaults (or ``extra`` options) on
    ``tokens``; returns wall seconds of this call (the stage times over all
    runs are in out.work/timings.json)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tok_file = out.parent / "tokens.npy"
    np.save(tok_file, tokens)
    cmd = [sys.executable, "-m", "mixbits.cli", "convert", "--model", model_name,
           "--bpw", *[f"{b:g}" for b in budgets], "--tokens", str(tok_file), "--out", str(out), *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0

def mixbits_plan(work: Path, bpw: float) -> tuple[dict[str, str], str]:
    alloc = json.loads((Path(str(work) + ".work") / f"allocation_{bpw:g}bpw.json").read_text())
    return {a["path"]: a["kind"] for a in alloc["assignment"]}, alloc.get("guard", {}).get("written", "?")

# ----------------------------------------------------------------- statistics

def ratio_ci(a: np.ndarray, b: np.ndarray, n: int = 10_000, seed: int = 0) -> tuple[float, list[float]]:
    """Ratio of mean KLs a / b and its paired-bootstrap 95% interval. ``a``,
    ``b``: [seeds, sequences] (a row per calibration seed; one row for a
    contender that does not depend on calibration is broadcast); resampling
    draws held-out sequences, the same for both and for every seed."""
    a, b = np.atleast_2d(a), np.atleast_2d(b)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.shape[1], (n, a.shape[1]))
    r = a[:, idx].mean(axis=(0, 2)) / b[:, idx].mean(axis=(0, 2))
    return float(a.mean() / b.mean()), [float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))]

def summarize(records: dict, budgets, seeds, mixbits_seeds, held: str = "licenses") -> list[dict]:
    """Per budget: mixbits' KL, the best contender (lowest mean KL over
    ``seeds`` at storage bpw <= budget) and the ratio with its interval."""
    rows = []
    for b in budgets:
        have = [s for s in mixbits_seeds if f"mixbits @{b:g} seed{s}" in records]
        ours = np.array([records[f"mixbits @{b:g} seed{s}"]["kl"][held] for s in have])
        cands = {}
        for name, r in records.items():
            if name.startswith("mixbits") or r["bpw"] > b + 1e-9 or held not in r["kl"]:
                continue
            if "@" in name:  # budget-specific (dynamic_quant): only this budget's
                base, at = name.rsplit(" @", 1)
                if not at.startswith(f"{b:g} "):
                    continue
            else:
                base = name.rsplit(" seed", 1)[0]
            # a calibrated contender's rows in ``seeds`` order (other seeds' rows left out),
            # so row i is seed seeds[i] whatever order the records were written in
            seed = int(name.rsplit(" seed", 1)[1]) if " seed" in name else None
            if seed is None or seed in seeds:
                cands.setdefault(base, []).append((-1 if seed is None else seeds.index(seed), r))
        scored = []
        for base, rows_ in cands.items():
            rs = [r for _, r in sorted(rows_, key=lambda x: x[0])]
            kl = np.array([r["kl"][held] for r in rs])
            scored.append((kl.mean(), base, kl, rs[0]["bpw"]))
        scored.sort(key=lambda x: x[0])
        row = {"budget": b, "held_out": held, "mixbits_seeds": have,
               "mixbits_kl": float(ours.mean()) if have else None,
               "mixbits_kl_per_seed": [float(x.mean()) for x in ours],
               "mixbits_bpw": [records[f"mixbits @{b:g} seed{s}"]["bpw"] for s in have],
               "mixbits_written": [records[f"mixbits @{b:g} seed{s}"].get("written") for s in have],
               "contenders": []}
        # the best four, and every llama.cpp mix and mlx-lm quantizer run that fits (their own table rows)
        own = ("llama.cpp", "mlx-lm gptq", "mlx-lm awq", "mlx-lm dwq")
        for m, base, kl, bpw in scored[:4] + [x for x in scored[4:] if x[1].startswith(own)]:
            # pair mixbits' seeds with the contender's own (calibrated ones have a row per seed)
            c = {"name": base, "bpw": bpw, "kl": float(m), "kl_se": float(kl.std(ddof=1) / np.sqrt(kl.size))}
            if have:
                k = kl if kl.shape[0] == 1 else kl[[seeds.index(s) for s in have]]
                c["ratio"], c["ratio_ci95"] = ratio_ci(ours, k)
                if len(have) > 1:  # each seed alone: mixbits' row against the contender's same-seed row
                    c["ratio_per_seed"] = {}
                    for i, s in enumerate(have):
                        r, ci = ratio_ci(ours[i], k[0] if k.shape[0] == 1 else k[i])
                        c["ratio_per_seed"][str(s)] = {"ratio": r, "ci95": ci}
            row["contenders"].append(c)
        rows.append(row)
    return rows

# ------------------------------------------------------------------------ run

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budgets", type=float, nargs="+", default=[3.0, 3.5, 4.0, 4.5, 5.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="calibration seeds (contenders)")
    ap.add_argument("--mixbits-seeds", type=int, nargs="*", default=None,
                    help="seeds mixbits convert runs on (default: --seeds)")
    ap.add_argument("--work", default="/tmp/quality_protocol")
    ap.add_argument("--skip-dq", action="store_true")
    ap.add_argument("--no-convert", action="store_true",
                    help="score the mixbits allocations already written (a convert running elsewhere)")
    ap.add_argument("--method", choices=("two-stage", "exact", "grad"),
                    help="convert's --method (default: convert's default)")
    ap.add_argument("--candidates", nargs="+", help="convert's --candidates (default: its 'default' preset)")
    ap.add_argument("--records-from", type=Path,
                    help="a records_<model>.json whose contender rows (not mixbits') are reused")
    ap.add_argument("--n-cal", type=int, default=N_CAL,
                    help=f"calibration sequences per seed (default {N_CAL}; fewer: the small-set case)")
    ap.add_argument("--result", type=Path, help="results file (default: results/quality_protocol_<model>.json)")
    ap.add_argument("--kquant", action="store_true",
                    help="add llama.cpp's K-quant mixes, with and without imatrix (bench/kquant.py)")
    ap.add_argument("--held-out", nargs="+", metavar="SET",
                    help="held-out sets to build (default: all); contenders missing another set are not scored "
                         "on it and the summary covers these")
    ap.add_argument("--summarize-only", action="store_true",
                    help="write the results file from the records (--work's and --records-from's) without loading "
                         "the model or scoring anything")
    ap.add_argument("--gptq", action="store_true",
                    help="add mlx-lm's GPTQ (2/4/8 bits: what it packs) at the widths that fit the budgets")
    ap.add_argument("--awq", action="store_true", help="add mlx-lm's AWQ at the widths that fit the budgets")
    ap.add_argument("--dwq", type=int, default=0, metavar="EPOCHS",
                    help="add mlx-lm's DWQ (RTN, then scales/biases distilled) with EPOCHS passes over the seed's "
                         f"calibration set ({N_CAL // DWQ_BATCH} steps each at the default --n-cal)")
    ap.add_argument("--kquant-all", action="store_true",
                    help="score every K-quant mix; default: only those at storage bpw <= the largest budget "
                         "(the others' bpw and types are recorded, their KL is not run)")
    ap.add_argument("--kquant-imatrix-only", action="store_true",
                    help="K-quant mixes with each seed's imatrix only: those without one are neither built nor "
                         "scored (on SmolLM2 they trail: KL 0.65 vs 0.52 at 4.5 bpw, 0.31 vs 0.21 at 5.0)")
    args = ap.parse_args()
    conv_opts = ([*(["--method", args.method] if args.method else []),
                  *(["--candidates", *args.candidates] if args.candidates else [])])
    mseeds = args.mixbits_seeds if args.mixbits_seeds is not None else args.seeds
    if not set(mseeds) <= set(args.seeds):
        raise SystemExit("--mixbits-seeds must be among --seeds")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rec_file = work / f"records_{args.model}.json"
    records = json.loads(rec_file.read_text()) if rec_file.exists() else {}
    if args.records_from:
        other = json.loads(args.records_from.read_text())
        records = {**{k: v for k, v in other.items() if not k.startswith("mixbits")}, **records}
    for r in records.values():  # an earlier "botchan_tail" was the Gutenberg license, not the story
        r["kl"].pop("botchan_tail", None)
    t_start = time.perf_counter()

    def save():
        tmp = rec_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        os.replace(tmp, rec_file)

    if args.summarize_only:  # no model loaded, nothing scored: the records as they are
        held = {k: (HELD_N, SEQ_LEN) for k in (args.held_out or ("licenses", "botchan_story_tail"))}
        methods = sorted({n.split()[1] for n in records if n.startswith(("mlx-lm gptq ", "mlx-lm awq ", "mlx-lm dwq"))})
        write_result(args, records, held, {}, methods, conv_opts, mseeds, t_start, work)
        return
    sc = Scorer(args.model, args.held_out)
    calib, _ = token_sets(sc.tok, args.seeds, args.n_cal)

    def add(name, plan, sets=None, calibration=None, **extra):
        want = [k for k in sc.held if sets is None or k in sets]
        have = records.get(name, {}).get("kl", {})
        missing = [k for k in want if k not in have]
        if not missing:
            return
        t0 = time.perf_counter()
        records[name] = {"bpw": sc.bpw(plan), "kl": {**have, **sc.score(plan, missing, calibration)}, **extra}
        print(f"{name}: bpw {records[name]['bpw']:.3f} KL "
              + " ".join(f"{k} {np.mean(v):.4f}" for k, v in records[name]["kl"].items())
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
        save()

    for name, plan in finest_fitting({**uniform_plans(sc.sites), **recipe_plans(sc.model, sc.sites)},
                                     sc.bpw, args.budgets).items():
        add(name, plan)
    timings = {}
    if not args.skip_dq:  # the cheap calibrated contenders first, every seed
        for s in args.seeds:
            sdir = work / f"seed{s}"
            sdir.mkdir(exist_ok=True)
            for name, plan in dq_plans(sc, calib[s], args.budgets, sdir).items():
                add(f"{name} seed{s}", plan, sets=["licenses"])  # the claim's set only: CPU is short
    if args.kquant:  # llama.cpp's mixes, scored from the GGUFs llama-quantize wrote
        import kquant

        sites = list(next(iter(sc.evals.values())).sites)
        for name, path in kquant.contenders(args.model, sc.tok, calib, work / "kquant",
                                            plain=not args.kquant_imatrix_only):
            if "licenses" not in records.get(name, {}).get("kl", {}):
                bpw, types = kquant.gguf_bpw(path, kquant.covered_names(path, sites))
                if bpw > max(args.budgets) + 1e-9 and not args.kquant_all:
                    # over every budget: no table row can use it; its size is kept, its KL not run
                    records[name] = {"bpw": bpw, "kl": {}, "ggml_types": types}
                    save()
                    continue
                t0 = time.perf_counter()
                records[name] = kquant.record(sc.evals, path, ["licenses"])  # the claim's set only, as dq
                print(f"{name}: bpw {records[name]['bpw']:.3f} KL licenses "
                      f"{np.mean(records[name]['kl']['licenses']):.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
                save()
    methods = [m for m, on in (("gptq", args.gptq), ("awq", args.awq), ("dwq", args.dwq > 0)) if on]
    for method in methods:  # mlx-lm's calibrated quantizers, every seed, the claim's set only (as dq)
        for bits, group in reversed(mlxlm_widths(method, sc.sites, sc.bpw, args.budgets)):  # widest first
            for s in args.seeds:
                name = f"mlx-lm {method}{args.dwq if method == 'dwq' else ''} {bits}b_g{group} seed{s}"
                if "licenses" in records.get(name, {}).get("kl", {}):
                    continue
                records[name] = mlxlm_record(sc, method, calib[s], bits, group, ["licenses"], args.dwq,
                                             getattr(sc.model, "model_type", "llama"))
                r = records[name]
                print(f"{name}: bpw {r['bpw']:.3f} KL licenses {np.mean(r['kl']['licenses']):.4f} "
                      f"(quantize {r['quantize_s']:.0f} s, score {r['score_s']:.0f} s)", flush=True)
                save()
    for s in mseeds:
        out = work / f"seed{s}" / args.model
        ready = [b for b in args.budgets if (Path(str(out) + ".work") / f"allocation_{b:g}bpw.json").exists()]
        if len(ready) < len(args.budgets) and not args.no_convert:
            run_convert(args.model, calib[s], args.budgets, out, conv_opts)
            ready = args.budgets
        tf = Path(str(out) + ".work") / "timings.json"
        timings[s] = json.loads(tf.read_text()) if tf.exists() else None
        used = np.load(Path(str(out) + ".work") / "tokens.npy")
        if not np.array_equal(used, calib[s]):
            raise SystemExit(f"{out}.work holds other calibration tokens than seed {s}'s")
        for b in ready:
            plan, written = mixbits_plan(out, b)
            add(f"mixbits @{b:g} seed{s}", plan, calibration=calib[s], written=written)
    write_result(args, records, {k: v.shape for k, v in sc.held.items()}, timings, methods, conv_opts, mseeds,
                 t_start, work)

def write_result(args, records: dict, held: dict, timings: dict, methods: list, conv_opts: list, mseeds: list,
                 t_start: float, work: Path) -> None:
    """The results file: host, protocol, per-budget summary on each held-out set in ``held``
    ({name: [sequences, tokens]}), every record."""
    result = {"host": host(), "model": args.model, "command": " ".join(sys.argv),
              "convert_options": conv_opts,
              "protocol": {"calibration": f"{args.n_cal} x {SEQ_LEN} Botchan tokens per seed (seed 0 = convert's "
                                          "default cut)", "seeds": args.seeds, "mixbits_seeds": mseeds,
                           "held_out": {k: list(v) for k, v in held.items()},
                           "bpw": "storage (codes + fp16 scale/bias per group) over all block linears and "
                                  "the (tied) embedding, the same tensors for every contender",
                           "reference": "the model as loaded, float32"},
              "mixbits_stage_wall_s": timings, "bench_wall_s_this_run": round(time.perf_counter() - t_start, 1),
              "summary": {h: summarize(records, args.budgets, args.seeds, mseeds, h) for h in held},
              "records": records}
    if methods:
        result["protocol"]["mlx_lm_quantizers"] = {
            "methods": methods, "mlx_lm": _version("mlx-lm"), "mlx": _version("mlx"),
            "calibration": "the seed's calibration tokens, one batch (GPTQ Hessians, AWQ activations)"
                           + (f"; DWQ: {args.dwq} epoch(s) of batches of {DWQ_BATCH} at lr {DWQ_LR}"
                              if "dwq" in methods else ""),
            "kinds": "every site at one bits/group, the embedding (tied head) round-to-nearest at the same kind",
            "bpw": "from the quantized arrays, fp16 scales and biases (equal to the uniform kind's count)",
            "scored": "the model as the quantizer left it (sites + changed norms swapped in), same evaluator"}
    if args.kquant:
        result["protocol"]["llama_cpp"] = {
            "bpw": "bytes of the same 211 tensors in the quantized GGUF (super-block scales included)",
            "reference": "every tensor of the model's GGUF decoded, written as F32 GGUF (bench/kquant.py)",
            "imatrix_tokens": {s: json.loads((work / "kquant" / f"calib_seed{s}_tokens.json").read_text())
                               for s in args.seeds}}
    out = args.result or RESULTS / f"quality_protocol_{args.model}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)
    for r in result["summary"]["licenses"]:
        c = r["contenders"][0]
        if r["mixbits_kl"] is None:
            print(f"{r['budget']:g} bpw: best contender {c['name']} {c['kl']:.4f} ({c['bpw']:.3f} bpw)")
            continue
        per = "".join(f"; seed {s} {v['ratio']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]"
                      for s, v in c.get("ratio_per_seed", {}).items())
        print(f"{r['budget']:g} bpw: mixbits {r['mixbits_kl']:.4f} vs {c['name']} {c['kl']:.4f} "
              f"({c['bpw']:.3f} bpw): {c['ratio']:.3f} [{c['ratio_ci95'][0]:.3f}, {c['ratio_ci95'][1]:.3f}]{per}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
