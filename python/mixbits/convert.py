"""One run from a model to quantized folders at the asked storage bpw.

Stages, each kept in a work folder beside the output (``DIR.work/``) so a
rerun of the same command after a kill continues where it stopped:

1. calibration -- token ids cut from the text (``tokens.npy``);
2. measure     -- the sensitivity table (``table.json``, checkpointed per
   tensor by the sweep itself; two-stage's exact pairs in
   ``table.json.exact.json``);
3. refine      -- one ``allocation_<bpw>bpw.json`` per budget: exact
   knapsack optimum, joint-KL search, then the baseline guard (uniform and
   mlx-lm's mixed recipe at the same or lower bpw win if they score lower);
   by default once per candidate menu (:func:`refine_menus`, each menu's
   result in ``allocation_<bpw>bpw.<menu>.json``), the lower calibration
   joint KL kept;
4. quantize    -- the folder(s), each written whole or not at all, with a
   model card (README.md), the allocation and a sensitivity plot.

``settings.json`` in the work folder records what the results depend on
(model, calibration, method, candidates ...); a rerun with other settings
is refused, naming them, before any model loads. Several budgets share one
measurement. Storage bits per weight (codes + fp16 scales and biases, as
mlx-lm counts them) are what is asked for and what is printed.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import UsageError

SETTINGS = "settings.json"
TOKENS = "tokens.npy"
TABLE = "table.json"


def work_dir(out) -> Path:
    out = Path(out)
    return out.with_name(out.name + ".work")


def output_dirs(out, bpws) -> dict[float, Path]:
    """One budget: ``out`` itself; several: ``out/<bpw>bpw`` each."""
    out = Path(out)
    if len(bpws) == 1:
        return {bpws[0]: out}
    return {b: out / f"{b:g}bpw" for b in bpws}


def allocation_path(work: Path, bpw: float) -> Path:
    return work / f"allocation_{bpw:g}bpw.json"


def smallest_storage_bpw(candidates) -> tuple[float, str]:
    """(storage bpw, name) of the narrowest candidate."""
    from .measure.candidates import parse_candidate

    return min((parse_candidate(c).storage_bpw, c) for c in candidates)


def _file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def settings(args) -> dict:
    """What the work folder's results depend on (not the budgets: one
    measurement serves any bpw)."""
    calib = {"dtype": args.dtype}
    if args.tokens:
        calib["tokens_sha256_16"] = _file_digest(args.tokens)
    else:
        calib.update(n_seq=args.n_seq, seq_len=args.seq_len)
        if args.text:
            calib["text_sha256_16"] = [_file_digest(p) for p in args.text]
        else:
            calib["corpus"] = args.corpus
    # The kinds added for the loaded model's stored grids are left out: they
    # follow from the model, and the settings are checked before it loads.
    added = getattr(args, "stored_added", None) or {}
    out = {"model": str(args.model), "method": args.method,
           "candidates": [c for c in args.candidates if c not in added.get("candidates", ())],
           "calibration": calib, "max_evals": args.max_evals}
    if getattr(args, "menus", None):  # absent for one menu: such a run's settings are as before menus
        menus_added = added.get("menus", {})
        out["menus"] = {k: [c for c in v if c not in menus_added.get(k, ())] for k, v in args.menus.items()}
    if args.method != "exact":
        out["fisher_samples"] = args.fisher_samples
    if args.method == "two-stage":
        out["exact_budget"] = args.exact_budget
    return out


# Sensitivity methods, most exact first: --time-budget takes the first that fits.
METHODS = ("exact", "two-stage", "grad")


def saved_settings(work: Path) -> dict | None:
    from .formats.errors import load_json

    path = work / SETTINGS
    return load_json(path, str(path)) if path.exists() else None


@dataclass
class Plan:
    """What --time-budget chose: the method, refine's evaluations, whether
    the projection fits the budget and the projected seconds of each
    method at the user's --max-evals."""

    method: str
    max_evals: int
    fits: bool
    totals: dict


def plan_for_budget(probe: "Probe", bpws, max_evals: int, exact_budget: float, samples: int,
                    budget_s: float) -> Plan:
    """The most exact method whose projected measure + refine fits
    ``budget_s``. When none does, grad with refine's joint evaluations
    lowered to what the rest of the budget pays for (at least 1: refine
    keeps the knapsack optimum and the baseline guard), ``fits`` False only
    when even that is over."""
    totals = probe.totals(bpws, max_evals, exact_budget, samples)
    for m in METHODS:
        if totals[m] <= budget_s:
            return Plan(m, max_evals, True, totals)
    cheapest = METHODS[-1]
    measure = probe.stage_seconds(cheapest, bpws, max_evals, exact_budget, samples)["measure"]
    first = measure + probe.refine_seconds(bpws, 1)  # the guard's evaluations included
    per_eval = probe.refine_seconds(bpws, 2) - probe.refine_seconds(bpws, 1)  # a later (reusing) one
    if budget_s < first:
        affordable = 0
    else:
        affordable = 1 + math.floor((budget_s - first) / per_eval) if per_eval > 0 else max_evals
    evals = max(1, min(max_evals, affordable))
    return Plan(cheapest, evals, affordable >= 1, totals)


def check_settings(work: Path, current: dict) -> None:
    """A work folder from another run's settings is refused, naming them."""
    saved = saved_settings(work)
    if saved is not None and saved != current:
        keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        diff = "; ".join(f"{k}: {saved.get(k)!r} then, {current.get(k)!r} now" for k in keys)
        raise UsageError(f"{work} holds the stages of a run with other settings ({diff}). Rerun with "
                         f"the same options to continue it, or remove {work} to start over")


# The baseline guard's evaluations per search (uniform kinds, mlx-lm's recipe): full forwards.
GUARD_EVALS = 4
# A search evaluation after its first, as a share of a full one: the least
# saving measured (bench/results/joint_reuse_1b.json, Llama-shaped 1B, 1 x
# 256 tokens: 2 budgets x 8 evaluations ran 270 of 380 block calls, 0.71,
# and 16 of 19 forwards; one budget x 30 ran 0.43 of the block calls at
# 0.46x the CPU seconds). What a search skips depends on its moves, which
# a probe on one sequence cannot see, so the smaller saving is taken.
REUSE = 0.71


@dataclass
class Probe:
    """Measured costs on one calibration sequence, scaled to the whole set:
    what each stage's work is made of, timed rather than modelled (a
    forward's FLOPs miss the head's KL over the vocabulary, the Fisher
    pass's bookkeeping and candidate quantization)."""

    n_seq: int
    fisher_seq: float  # one Fisher pass over one sequence, one sample
    pair: tuple[float, float]  # an exact pair's seconds: fixed + per block forward, one sequence
    pair_units: list[int]  # every (tensor, candidate) pair's block forwards
    joint_seq: float  # one joint-KL evaluation over one sequence, every tensor quantized
    reference_seq: float = 0.0  # refine's evaluator setup per sequence: the float forward (reference logits)
    build_set: float = 0.0  # quantizing every tensor at one candidate (refine's layers, each built once)
    candidates: int = 1  # candidate kinds: at most that many such sets get built
    refines: int = 1  # searches per budget: one per candidate menu (refine_menus)
    # The proxy's rating of each (tensor, candidate) pair, seconds, in pair_units' order:
    # quantizing the tensor at the candidate and the Fisher-weighted error (grad/two-stage).
    rate_units: list[float] = field(default_factory=list)
    # blocks holding a linear with a calibrated candidate: one replay each records
    # their X^T X (Replayer.input_hessian's along)
    hessian_blocks: int = 0

    @property
    def pairs(self) -> int:
        return len(self.pair_units)

    def grad_seconds(self, samples: int) -> float:
        """The gradient proxy's measure stage: the Fisher pass (every
        measured tensor's squared gradients summed, ``samples`` backward
        passes per sequence; timed with one, the recording forward so
        counted once per sample: a little over), then every (tensor,
        candidate) pair quantized and rated, and for tensors with a
        calibrated candidate their input's X^T X (one forward of their
        block per sequence, taken as an exact pair's per-block cost)."""
        return (self.n_seq * samples * self.fisher_seq + sum(self.rate_units)
                + self.hessian_blocks * self.n_seq * self.pair[1])

    def stage_seconds(self, method: str, bpws, max_evals: int, exact_budget: float,
                      samples: int) -> dict[str, float]:
        a, b = self.pair
        exact = self.n_seq * sum(a + b * u for u in self.pair_units)
        grad = self.grad_seconds(samples)
        measure = {"exact": exact, "grad": grad, "two-stage": grad + exact_budget * exact}[method]
        return {"measure": measure, "refine": self.refine_seconds(bpws, max_evals)}

    def refine_seconds(self, bpws, max_evals: int) -> float:
        # One reference pass; the layers, each (tensor, candidate) quantized
        # once for all budgets and menus: about two full sets per search
        # (its optimum's widths, its guard's uniform one), never more sets
        # than candidates; then each search's joint-KL evaluations plus ~4
        # of the baseline guard's (every menu's search has all --max-evals).
        # The evaluator reuses (measure/joint.py, prefix.py): a search's
        # first evaluation and the guard's run whole; the later ones are
        # local changes of the best so far, whose unchanged first blocks'
        # outputs are kept and whose repeats are scored from memory. They
        # are counted at REUSE of a full evaluation (see there).
        sets = min(self.candidates, 2 * len(bpws) * self.refines)
        fixed = self.n_seq * self.reference_seq + sets * self.build_set
        full = min(max_evals, 1) + GUARD_EVALS
        later = REUSE * max(max_evals - 1, 0)
        return fixed + self.refines * len(bpws) * (full + later) * self.n_seq * self.joint_seq

    def totals(self, bpws, max_evals: int, exact_budget: float, samples: int) -> dict[str, float]:
        """Projected measure + refine seconds of every method."""
        return {m: sum(self.stage_seconds(m, bpws, max_evals, exact_budget, samples).values())
                for m in METHODS}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timing_kinds(cands) -> list:
    """``cands`` as round-to-nearest kinds, once each: what the probe builds
    to time forwards with quantized layers. A layer runs at the same speed
    whichever quantizer chose its codes, and a calibrated kind cannot be
    built without the layer inputs the probe does not record; dropping them
    instead left convert's default menus (all ``+search``) with nothing to
    time -- refine and the exact pairs projected at 0 s, so --time-budget
    picked the exact sweep. The search's own cost is in the rating probe."""
    import dataclasses

    out = {}
    for c in cands:
        base = c if not c.calibrated else dataclasses.replace(c, name=c.name.partition("+")[0], quantizer="rtn")
        out.setdefault(base.name, base)
    return list(out.values())


def _quantized_probe(ev, sites, cands, bpw=None) -> tuple[float, float]:
    """(seconds of one joint evaluation with every tensor quantized, seconds
    to quantize every tensor once) on ``ev``'s one sequence.

    What refine runs is the quantized model, whose linears are mixbits'
    quantized kernels -- not the float forward (BLAS on widened weights,
    weights read from disk per block), which can be several times slower
    (Llama-3-8B shapes in bf16: 182 s per sequence). To keep the probe cheap
    on a large model, one layer is built per distinct (form, shape) -- at the
    candidate nearest ``bpw`` -- and put in place of every tensor of that
    shape: the same kernels on the same shapes, so the same time, for the
    cost of quantizing about one block and the embeddings/head. The
    quantizing rate of those builds, per weight, scales to the whole model."""
    import mlx.core as mx

    from . import streaming
    from .measure.candidates import build_layer, supports

    plain = timing_kinds(cands)
    if bpw is not None:
        plain.sort(key=lambda c: abs(c.storage_bpw - bpw))
    built, modules, build_s, build_w = {}, {}, 0.0, 0
    for s in sites:
        cand = next((c for c in plain if supports(c, s)), None)
        if cand is None:
            continue  # stays float in refine too
        key = (s.form, tuple(s.shape), s.experts, cand.name)
        if key not in built:
            original = ev.originals[s.path]
            t0 = time.perf_counter()
            layer = build_layer(original, cand, ev.scale_dtype)
            mx.eval(layer.parameters())
            build_s += time.perf_counter() - t0
            build_w += s.nparams
            streaming.release(original)
            built[key] = layer
        modules[s.path] = built[key]
    if not modules:
        return 0.0, 0.0
    joint = _timed(lambda: ev.token_kls_of(modules, 1))
    total_w = sum(s.nparams for s in sites if s.path in modules)
    return joint, build_s / build_w * total_w


# Weights of the slice each (shape, candidate) rating is timed on (whole rows).
RATE_SLICE = 1 << 20


def _rate_stand_in(module, site, rows: int):
    """(module, weights) to time a candidate's rating on: a float linear or
    embedding cut to its first ``rows`` rows (quantizing and the weighted
    error go row group by row group, so the time per weight carries over;
    a mixed kind's column split is kept whole), else the module itself."""
    import mlx.core as mx
    import mlx.nn as nn

    w = module.get("weight") if hasattr(module, "get") else None
    if ("scales" in module or not isinstance(w, mx.array) or w.ndim != 2 or rows >= w.shape[0]
            or not isinstance(module, (nn.Linear, nn.Embedding))):
        return module, site.nparams
    if isinstance(module, nn.Embedding):
        cut = nn.Embedding(rows, w.shape[1])
    else:
        cut = nn.Linear(w.shape[1], rows, bias=False)
    cut.weight = w[:rows]
    mx.eval(cut.weight)
    return cut, rows * w.shape[1]


def _rating_probe(originals: dict, sites, cands, clock=time.perf_counter) -> list[float]:
    """Seconds the gradient proxy spends rating each (tensor, candidate) pair
    (in the order of the pairs: every site, every candidate it supports):
    what grad.py's ``_rate`` does -- the candidate layer built, its storage
    counted, the Fisher-weighted error (with the input correlations when a
    calibrated candidate is among the tensor's) -- timed per candidate on
    one tensor of each (form, shape), cut to about RATE_SLICE weights
    (:func:`_rate_stand_in`), as seconds per weight; the Fisher diagonal,
    X^T X and output energy there are stand-ins of the right shapes (the
    work does not depend on their values)."""
    import mlx.core as mx

    from . import streaming
    from .adapter import dense_weight
    from .measure.candidates import build_layer, supports
    from .measure.grad import estimate
    from .measure.sweep import storage_bits

    per_weight: dict[tuple, dict[str, float]] = {}
    out = []
    for s in sites:
        fits = [c for c in cands if supports(c, s)]
        if not fits:
            continue
        key = (s.form, tuple(s.shape), s.experts, s.block is None)
        if key not in per_weight:
            original = originals[s.path]
            k = s.shape[-1]
            module, n = _rate_stand_in(original, s, max(1, -(-RATE_SLICE // k)))
            dense = dense_weight(module)
            fish = mx.ones(dense.shape, mx.float32)
            calibrated = any(c.calibrated for c in fits)
            inputs = (mx.eye(k, dtype=mx.float32), 1) if calibrated else None
            energy = np.ones(dense.shape[0]) if calibrated and dense.ndim == 2 else None
            mx.eval(dense, fish)
            rates = {}
            for c in fits:
                t0 = clock()
                layer = build_layer(module, c, None, inputs, dense)
                storage_bits(layer, s)
                estimate(fish, 1, dense, layer, inputs[0] if inputs else None, energy)
                rates[c.name] = (clock() - t0) / n
            per_weight[key] = rates
            streaming.release(original)
        out += [per_weight[key][c.name] * s.nparams for c in fits]
    return out


def timing_probe(model, tokens, sites, candidates, bpw=None, refines: int = 1) -> Probe:
    """Time, on the first calibration sequence: a Fisher pass over every
    measured tensor, each (form, shape)'s proxy rating per candidate
    (:func:`_rating_probe`), two exact
    pairs (a tensor of the first block and one of the last, so the fixed
    and per-block parts separate), the float reference forward and a
    joint-KL evaluation of the quantized model (:func:`_quantized_probe`;
    ``bpw``: the target its candidate is chosen nearest to). ``refines``:
    refine's searches per budget (one per candidate menu)."""
    from .adapter import ModelAdapter
    from .measure.candidates import needs_inputs, parse_candidate, supports
    from .measure.grad import fisher_stream
    from .measure.joint import JointEvaluator
    from .measure.replay import Replayer, token_chunks
    from .measure.sweep import SweepConfig, measure_site
    from .measure.two_stage import pair_costs

    one = np.asarray(tokens)[:1]
    cands = [parse_candidate(c) for c in candidates]
    cost = pair_costs([{"path": s.path, "layer": s.block} for s in sites])
    units = [cost[s.path] for s in sites for c in cands if supports(c, s)]
    timed = timing_kinds(cands)
    linears = [s for s in sites if s.block is not None and s.form == "linear"
               and any(supports(c, s) for c in timed)]
    measured = [s for s in sites if any(supports(c, s) for c in cands)]

    def fisher_pass():
        # As the measure stage runs it: every measured tensor's squared
        # gradients summed (and the outputs' energy), one block's group at a
        # time, each dropped once formed.
        for group in fisher_stream(model, one, measured, samples=1, progress=False, out_energy={}):
            del group

    fisher = _timed(fisher_pass)
    pair = (0.0, 0.0)
    if linears:
        rp = Replayer(model, token_chunks(one, 1), ModelAdapter(model))
        cfg = SweepConfig([c.name for c in timed])
        first, last = linears[0], linears[-1]
        cand = next(c for c in timed if supports(c, first))
        t_first = _timed(lambda: measure_site(rp, first, [cand], cfg))
        t_last = _timed(lambda: measure_site(rp, last, [cand], cfg))
        du = cost[first.path] - cost[last.path]
        per = max((t_first - t_last) / du, 0.0) if du else 0.0
        pair = (max(t_last - per * cost[last.path], 0.0), per)
    t0 = time.perf_counter()
    ev = JointEvaluator(model, one, chunk=1)
    reference = time.perf_counter() - t0
    joint, build = _quantized_probe(ev, sites, cands, bpw)
    rates = _rating_probe(ev.originals, sites, cands)
    return Probe(len(tokens), fisher, pair, units, joint, reference, build, len(cands), refines,
                 rate_units=rates, hessian_blocks=len({s.block for s in sites
                                                       if any(supports(c, s) and needs_inputs(c, s) for c in cands)}))


def menu_allocation_path(work: Path, bpw: float, menu: str) -> Path:
    return work / f"allocation_{bpw:g}bpw.{menu}.json"


def refine_menus(table: dict, evaluator, bpw: float, menus: dict, max_evals: int, work: Path | None = None,
                 progress: bool = True) -> dict:
    """Refine the allocation at ``bpw`` once per candidate menu ({name:
    kinds}, each a subset of the table's candidates) on the one
    ``evaluator`` -- the same calibration tokens, reference logits, built
    layers and scores for all -- and return the allocation with the lower
    calibration joint KL (what its baseline guard wrote it at; ties: the
    first menu), with the decision under "menu". Each menu's search gets
    all ``max_evals``: the first menu's result is then the one refining
    with it alone gives, and what is kept never scores above it. ``work``:
    each menu's result is kept there (:func:`menu_allocation_path`) so a
    rerun after a kill continues with the next menu."""
    from .atomic import write_json_atomic
    from .formats.errors import load_json
    from .measure.refine import refine, restrict_table

    runs = {}
    for name, kinds in menus.items():
        path = menu_allocation_path(work, bpw, name) if work is not None else None
        if path is not None and path.exists():
            runs[name] = load_json(path, str(path))
            continue
        runs[name] = refine(restrict_table(table, kinds), evaluator, bpw, max_evals=max_evals,
                            progress=progress)
        if path is not None:
            write_json_atomic(runs[name], path)
    kls = {name: a["guard"]["joint_kl"] for name, a in runs.items()}
    kept = min(kls, key=kls.get)  # the first of the lowest: ties keep the first menu
    out = dict(runs[kept])
    out["menu"] = {"kept": kept, "rule": "the lower calibration joint KL (ties: the first menu)",
                   "calibration_joint_kl": kls,
                   "written": {name: a["guard"]["written"] for name, a in runs.items()},
                   "evaluations": {name: a["joint_refine"]["evaluations"] for name, a in runs.items()},
                   "candidates": {name: list(kinds) for name, kinds in menus.items()}}
    return out


def menu_line(allocation: dict) -> str | None:
    """The menu decision in one line (None for a one-menu run)."""
    m = allocation.get("menu")
    if not m:
        return None
    kls = ", ".join(f"{n} {kl:.4f}" for n, kl in m["calibration_joint_kl"].items())
    return f"candidate menu: {m['kept']} kept (calibration joint KL: {kls})"


def format_duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


@dataclass
class Result:
    bpw: float
    out: Path
    allocation: dict
    seconds: dict = field(default_factory=dict)


def kind_counts(allocation: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for a in allocation["assignment"]:
        counts[a["kind"]] = counts.get(a["kind"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def card(model: str, r: Result, n_tokens: tuple[int, int], method: str) -> str:
    """The summary card: printed at the end and written as DIR/README.md."""
    a = r.allocation
    g = a.get("guard", {})
    lines = [f"# {Path(str(model)).name} at {r.bpw:g} bpw (mixbits)", "",
             f"- source model: `{model}`",
             f"- budget: {r.bpw:g} bits per weight as stored (codes + fp16 scales and biases), "
             f"over the {len(a['assignment'])} quantized tensors",
             f"- storage bpw: {a.get('average_bpw_storage', float('nan')):.3f}",
             f"- measured by `{method}` on {n_tokens[0]} x {n_tokens[1]} calibration tokens",
             f"- written: {g.get('written', 'mixed allocation')}",
             *([f"- {menu_line(a)}"] if menu_line(a) else []), "",
             "| allocation | bpw | joint KL (calibration) |", "|---|---|---|",
             f"| mixbits mixed allocation | {a.get('average_bpw_storage', float('nan')):.3f} "
             f"| {g.get('mixed_joint_kl', float('nan')):.4f} |"]
    lines += [f"| {b['name']} | {b['bpw']:.3f} | {b['joint_kl']:.4f} |" for b in a.get("baselines", [])]
    lines += ["", "| kind | tensors |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in kind_counts(a).items()]
    if r.seconds:
        lines += ["", "Time: " + ", ".join(f"{k} {format_duration(v)}" for k, v in r.seconds.items())]
    from .measure.candidates import parse_candidate

    if any(parse_candidate(k).kind == "mixed" for k in kind_counts(a)):
        stock = ("stock mlx-lm runs it through its model file: `mlx_lm.load(DIR, trust_remote_code=True)`, "
                 "`python -m mlx_lm generate --model DIR --trust-remote-code`")
    else:
        stock = "every kind in it is MLX-native: `mlx_lm.load(DIR)` and `python -m mlx_lm generate --model DIR`"
    lines += ["", f"Run it with `mixbits.load(DIR)`; {stock}.",
              "`sensitivity.png`: the per-tensor KL of every candidate and the chosen kinds.", ""]
    return "\n".join(lines)
