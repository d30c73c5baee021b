"""A gradient proxy for the sweep: every tensor x candidate's KL estimated
from a few backward passes, no forward per candidate.

At the reference weights the KL of the final logits is at its minimum
(zero), so its gradient vanishes and the first change is second order:

    KL(P || Q_{W+dW}) ~= 1/2 dW^T F dW,

with F the Fisher information of the model's output distribution. We keep
F's diagonal, estimated without bias from one backward pass per sequence:
sample y_t ~ P(.|x_<t) at every position from the reference logits, take
the gradient g of sum_t -log q(y_t) w.r.t. every tensor, and accumulate g^2
(the cross terms g_t g_s, t != s, have zero mean because each y_t is drawn
independently, so E[(sum_t g_t)^2] = sum_t E[g_t^2]). The estimate of a
candidate is 1/2 sum F (W_c - W)^2 / tokens, mean KL per token as the exact
sweep reports it.

The estimate is local: it trusts the model's slope at the reference
weights. At a few positions (the first tokens of a window cut from running
text, where the model puts its attention sink) that slope can be thousands
of times the sequence's typical one while the model's response to a
finite quantization error stays ordinary; one such window put 22-47x the
largest other window's Fisher total on the embedding and layer 0, and the
allocation followed it (Gemma-3-270M, bench/README). So each position's
output gradient is clipped to POSITION_CLIP times its sequence's median
(see :func:`clip_positions`); the other windows' totals move by a median
0-9%.

Cost: ``samples`` backward passes (about three forwards each) per sequence
for all tensors together, plus one quantization per tensor x candidate;
the exact sweep runs about half a model forward per tensor x candidate.
The estimate ignores off-diagonal curvature (interactions inside a tensor
and between layers), so it ranks better than it predicts: ``two-stage``
(mixbits.measure.two_stage) measures exactly where that matters.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .taps import Taps, split_key


class ProxyFallbackWarning(UserWarning):
    """Tensors the gradient proxy cannot rate (a non-finite Fisher
    diagonal), measured exactly instead."""


def _nonfinite(fisher: dict) -> dict[str, int]:
    """{path: count of non-finite Fisher entries}, for the tensors that have any."""
    out = {}
    for p, f in fisher.items():
        n = int(f.size - np.count_nonzero(np.isfinite(f)))
        if n:
            out[p] = n
    return out


def _float_stack(m, w):
    """A float twin of an expert stack (mlx-lm's SwitchLinear), or None."""
    try:
        from mlx_lm.models.switch_layers import SwitchLinear
    except ImportError:  # pragma: no cover - mlx-lm is a test dependency
        return None
    if type(m).__name__ not in ("SwitchLinear", "QuantizedSwitchLinear", "MixedQuantizedSwitchLinear"):
        return None
    e, n, k = w.shape
    twin = SwitchLinear(k, n, e, bias="bias" in m)
    twin.weight = w
    if "bias" in m:
        twin.bias = m["bias"]
    return twin


def stack_modules(ad, sites) -> tuple[dict, dict]:
    """({path: module whose float ``weight`` gets differentiated}, {path:
    original module to put back}) for the expert / multi-head stacks. A
    stack routes each token to some of its matrices, so its gradient is
    taken on the weight itself (float twins of quantized stacks), not
    through taps."""
    from ..adapter import dense_weight

    diff, originals = {}, {}
    for s in sites:
        if s.form != "stack":
            continue
        m = ad.get(s.path)
        if "scales" in m or not isinstance(m.get("weight"), mx.array) or m["weight"].ndim != 3:
            f = _float_stack(m, dense_weight(m))
            if f is None:
                raise ValueError(f"{s.path}: no float twin for {type(m).__name__}; "
                                 "the gradient proxy cannot differentiate it")
            originals[s.path] = m
            m = f
        diff[s.path] = m
    return diff, originals


def check_fisher_memory(model, sites, rp=None, samples: int = 1) -> None:
    """Warn, before the first backward, when the Fisher pass cannot fit.
    The whole-model pass (``rp`` None) holds every weight of the model at
    once (in the dtype it runs in; a model streamed from disk included) and
    a float32 total per weight of every measured tensor. The block-wise
    pass (``rp``: its Replayer, see :mod:`.fisher_blocks`) holds one
    block's weights (or those outside the blocks) with that stage's float32
    totals, the cotangents of every sequence, one chunk's logits and the
    recorded calls unless they are spilled to disk. A pass killed by the
    system after an hour is the worst way to learn this."""
    from mlx.utils import tree_flatten

    from ..errors import MemoryWarning
    from ..streaming import available_memory

    gib = 2 ** 30
    if rp is not None:
        from .fisher_blocks import blockwise_bytes

        h = rp.records[0][0][0][0]
        n_tok = sum(int(np.prod(c.shape)) for c in rp.chunks)
        records = 0 if rp.stream else len(rp.adapter.blocks) * n_tok * h.shape[-1] * h.itemsize
        need = blockwise_bytes(model, sites, rp.adapter, n_tok, samples, h.shape[-1], h.itemsize,
                               rp.logits[0].nbytes, records)
        have = available_memory()
        if have is not None and need > have:
            warnings.warn(
                f"the gradient (Fisher) pass needs about {need / gib:.1f} GiB (its largest block or the "
                f"embedding and head, with their float32 totals, and {n_tok} tokens' cotangents), but "
                f"{have / gib:.1f} GiB is available, so it may be killed part way. Fewer calibration "
                "tokens shrink the cotangents; a smaller --dtype (bfloat16) halves the weights' share",
                MemoryWarning, stacklevel=3)
        return
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()) if isinstance(v, mx.array))
    fisher = 4 * sum(s.nparams for s in sites)
    have = available_memory()
    if have is not None and weights + fisher > have:
        warnings.warn(
            f"the gradient (Fisher) pass needs about {(weights + fisher) / gib:.1f} GiB: the weights "
            f"({weights / gib:.1f} GiB) at once for its backward and a float32 total per measured weight "
            f"({fisher / gib:.1f} GiB), but {have / gib:.1f} GiB is available, so it may be killed part "
            "way. --method exact streams one block at a time; a smaller --dtype (bfloat16) halves the "
            "weights' share", MemoryWarning, stacklevel=3)


def fisher_stream(model, tokens, sites, *, samples: int = 1, seed: int = 0, batch: int = 2,
                  progress: bool = True, out_energy: dict | None = None, blockwise: bool = True,
                  start=None, chain: dict | None = None):
    """Yields {path: diag Fisher} groups covering ``sites``: one per block,
    freed by the caller before the next is formed (:mod:`.fisher_blocks`),
    or, for a model whose blocks cannot be chained (or ``blockwise``
    False), all of them at once from the whole-model pass, with a warning
    when the block-wise pass was asked for. ``chain``: a dict that gets
    ``pass`` ("blocks" or "whole": which pass made the group being
    yielded) and, from the block-wise pass, the state ``start`` continues
    from (see :func:`.fisher_blocks.fisher_groups`)."""
    from ..adapter import ModelAdapter
    from . import fisher_blocks

    chain = {} if chain is None else chain
    rp = None
    if blockwise:
        rp, why = fisher_blocks.block_chain(model, tokens, batch, ModelAdapter(model), sites)
        if rp is None:
            warnings.warn(f"the gradient (Fisher) pass runs on the whole model at once ({why}): it "
                          "holds every weight for its backward", RuntimeWarning, stacklevel=3)
    if rp is None:
        chain["pass"] = "whole"
        yield _whole_model_fisher(model, tokens, sites, samples=samples, seed=seed, batch=batch,
                                  progress=progress, out_energy=out_energy)
        return
    check_fisher_memory(model, sites, rp, samples)
    chain["pass"] = "blocks"
    try:
        yield from fisher_blocks.fisher_groups(model, tokens, sites, rp, samples=samples, seed=seed,
                                               progress=progress, out_energy=out_energy, start=start,
                                               chain=chain)
    except fisher_blocks.Unchained as e:  # found part way: the groups yielded so far are redone
        warnings.warn(f"the gradient (Fisher) pass runs on the whole model at once ({e}): it holds "
                      "every weight for its backward", RuntimeWarning, stacklevel=3)
        if out_energy is not None:
            out_energy.clear()
        chain.clear()
        chain["pass"] = "whole"
        yield _whole_model_fisher(model, tokens, sites, samples=samples, seed=seed, batch=batch,
                                  progress=progress, out_energy=out_energy)


def fisher_diagonal(model, tokens, sites, *, samples: int = 1, seed: int = 0, batch: int = 2,
                    progress: bool = True, out_energy: dict | None = None, blockwise: bool = True):
    """{path: diag Fisher summed over tokens (numpy float32, weight shape)}
    and the token count. ``sites``: adapter Sites of ``model``.
    ``out_energy``: if given, filled with {path: sum over tokens and samples
    of dy^2 per output (float64 [N])} for the linears (see
    :func:`estimate`). ``blockwise``: one block at a time where the model
    allows (:func:`fisher_stream`); the same numbers to float rounding.
    """
    fisher = {}
    for group in fisher_stream(model, tokens, sites, samples=samples, seed=seed, batch=batch,
                               progress=progress, out_energy=out_energy, blockwise=blockwise):
        fisher.update(group)
    return fisher, np.asarray(tokens).size * samples


def _whole_model_fisher(model, tokens, sites, *, samples, seed, batch, progress, out_energy) -> dict:
    """{path: diag Fisher} by one backward of the whole model per sample.

    The model runs as it is (its own quantized / mixbits layers and routed
    attention/SwiGLU kernels, all with derivatives). Per batch of
    sequences: one recording forward (the reference distribution P and
    every tapped module's input x), then per sample one backward pass for
    the output gradients dy of all tapped modules at once; the weight
    gradient of sequence b is dy_b^T x_b (numpy), squared and summed.
    Embeddings: dy rows added at their token ids, plus dy^T x of their use
    as a tied head. Stacks: their weights' own gradient, per batch.
    """
    from tqdm import tqdm

    from ..adapter import ModelAdapter

    check_fisher_memory(model, sites)
    ad = ModelAdapter(model)
    tapped = {s.path: ad.get(s.path) for s in sites if s.form != "stack"}
    forms = {s.path: s.form for s in sites}
    stacks, originals = stack_modules(ad, sites)
    fisher = {s.path: np.zeros(s.shape, np.float32) for s in sites}
    toks = np.asarray(tokens)

    def loss(deltas, weights, x, targets):
        taps.perturb(deltas)
        for p, w in weights.items():
            stacks[p].weight = w
        logits = model(x).astype(mx.float32)
        lse = mx.logsumexp(logits, axis=-1)
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return (lse - picked).sum()

    grad_fn = mx.value_and_grad(loss, argnums=(0, 1))
    key = mx.random.key(seed)
    bar = tqdm(total=len(toks) * samples, desc="fisher", unit="seq", disable=not progress)
    try:
        for p, m in stacks.items():
            if p in originals:
                ad.set(p, m)
        weights0 = {p: m.weight for p, m in stacks.items()}
        with Taps(tapped) as taps:
            for b0 in range(0, len(toks), batch):
                x = mx.array(toks[b0 : b0 + batch])
                n_seq = int(x.shape[0])
                taps.capture()
                ref = model(x).astype(mx.float32)
                mx.eval(ref, list(taps.inputs.values()))
                # Modules fed the same array (q/k/v, gate/up) share one copy.
                copies, inputs = {}, {}
                for k, v in taps.inputs.items():
                    if id(v) not in copies:
                        copies[id(v)] = np.array(
                            v if mx.issubdtype(v.dtype, mx.integer) else v.astype(mx.float32))
                    inputs[k] = copies[id(v)]
                for _ in range(samples):
                    key, sub = mx.random.split(key)
                    y = mx.random.categorical(ref, key=sub)  # y_t ~ P(.|x_<t)
                    deltas = {k: mx.zeros(shape, dtype) for k, (shape, dtype) in taps.shapes.items()}
                    _, (gd, gw) = grad_fn(deltas, weights0, x, y)
                    mx.eval(gd, gw)
                    accumulate_fisher(fisher, inputs, gd, forms, n_seq, out_energy)
                    for p, g in gw.items():
                        g = np.array(g.astype(mx.float32))
                        fisher[p] += g * g
                    bar.update(n_seq)
    finally:
        for p, m in stacks.items():
            m.weight = weights0.get(p, m.weight)
        for p, m in originals.items():
            ad.set(p, m)
        from .. import streaming

        # The backward needs every weight at once; a model on disk lets them go after it.
        streaming.release(model)
    bar.close()
    return fisher


# A position's output gradient is held to this many times its sequence's
# median (per tensor and call). bench/fisher_windows.py, Gemma-3-270M's 16
# calibration windows one at a time: the largest ratio of an ordinary window
# was 836 (its first token, a BOS, in a middle layer's down_proj); one window
# cut mid-sentence reached 7,300 at its third token (layer 1's v_proj) and
# put 2.8e8 into layer 0's v_proj and 3.7e8 into the embedding, against
# 0.8e6-5.8e6 and 4.2e6-1.7e7 from each other window. At 100x its embedding
# still got 1.3e8; at 30x, 1.6e6 and 1.5e7, inside the others' range, while
# the others moved by a median 0-9% (at most 3x lower: one window's v_proj).
# The expert stacks' gradients are taken on their weights whole, unclipped.
POSITION_CLIP = 30.0


def clip_positions(rows: np.ndarray, clip: float | None = None) -> np.ndarray:
    """``rows`` ([positions, outputs], one sample's output gradient) with
    every row whose norm exceeds ``clip`` (default POSITION_CLIP, read at
    call time) times the median row norm scaled down to it (a Huber-like
    cap: the directions are kept); ``rows`` itself when none does."""
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))
    cap = (POSITION_CLIP if clip is None else clip) * np.median(norms)
    over = norms > cap
    if not over.any():
        return rows
    out = rows.copy()
    out[over] *= (cap / norms[over]).astype(out.dtype)[:, None]
    return out


def accumulate_fisher(fisher, inputs, grads, forms, n_seq, out_energy) -> None:
    """fisher[path] += (weight gradient of one sample)^2 for every tapped
    path. A sample is one sequence when every recorded call of the module
    keeps the batch as its leading axis, else the whole batch (still
    unbiased: cross terms between positions have zero mean, see above).
    Each call's output gradient is clipped per position first
    (:func:`clip_positions`)."""
    calls: dict[str, list] = {}
    for k, d in grads.items():
        path, tag = split_key(k)
        calls.setdefault(path, []).append((tag, inputs[k], np.array(d.astype(mx.float32))))
    for path, parts in calls.items():
        split = all(x.ndim >= 2 and x.shape[0] == n_seq and d.shape[0] == n_seq
                    for _, x, d in parts)
        lookups = forms[path] == "embedding" and all(tag == "call" for tag, _, _ in parts)
        for b in range(n_seq if split else 1):
            if lookups:
                # Only the looked-up rows have a gradient: those are summed and
                # squared (the same numbers; an 8B embedding's whole gradient
                # was 2 GiB per sequence, nearly all zeros).
                ids = np.concatenate([(x[b] if split else x).reshape(-1) for _, x, _ in parts])
                rows = np.concatenate([clip_positions((d[b] if split else d).reshape(-1, d.shape[-1]))
                                       for _, _, d in parts])
                uniq, inv = np.unique(ids.astype(np.int64), return_inverse=True)
                g = np.zeros((len(uniq), rows.shape[-1]), np.float32)
                np.add.at(g, inv.reshape(-1), rows)
                fisher[path][uniq] += np.square(g, out=g)
                continue
            g = None
            for tag, x, d in parts:
                xb, db = (x[b], d[b]) if split else (x, d)
                db = clip_positions(db.reshape(-1, d.shape[-1]))
                if forms[path] == "embedding" and tag == "call":
                    g = np.zeros(fisher[path].shape, np.float32) if g is None else g
                    np.add.at(g, xb.reshape(-1).astype(np.int64), db)  # rows of the looked-up ids
                else:
                    prod = db.T @ xb.reshape(-1, x.shape[-1])
                    if g is None:
                        g = prod  # no zeros to add it to: one weight-sized array fewer
                    else:
                        g += prod
                    if out_energy is not None and forms[path] == "linear":
                        e = np.square(db, dtype=np.float64).sum(axis=0)
                        out_energy[path] = out_energy.get(path, 0) + e
            fisher[path] += np.square(g, out=g)  # in place: no third weight-sized array


def estimate(fisher: mx.array, n_tokens: int, dense: mx.array, layer,
             hessian=None, out_energy=None) -> float:
    """1/2 sum F (W_c - W)^2 per token for one tensor (``dense``: its
    float32 weight and ``fisher`` its Fisher diagonal, both evaluated once
    per tensor) and candidate layer.

    With the layer input's ``hessian`` (X^T X) and the outputs' gradient
    energy ``out_energy`` (sum dy_n^2), the diagonal estimate is scaled by

        r = sum_n e_n dW_n H dW_n^T / sum_n e_n sum_k H_kk dW_nk^2,

    the share of the error's output energy that survives the input's
    correlations (Kronecker-factored curvature, diag(E) x H, against its own
    diagonal). Round-to-nearest errors are uncorrelated across columns
    (r ~ 1); error feedback (GPTQ) moves error into directions the inputs
    cancel (r << 1), which the diagonal alone cannot see: on a tiny llama
    it rated GPTQ no better than round-to-nearest where the exact KL was
    2-7x lower."""
    from ..adapter import dense_weight, weighted_weight_error

    if hessian is None or out_energy is None or dense.ndim != 2:
        return 0.5 * weighted_weight_error(layer, dense, fisher) / n_tokens
    d = np.array(dense_weight(layer)) - np.array(dense)
    est = 0.5 * float(np.vdot(np.array(fisher), d * d)) / n_tokens
    h = np.asarray(hessian, dtype=np.float64)
    e = np.asarray(out_energy, dtype=np.float64)[:, None]
    d = d.astype(np.float64)
    full = float(np.sum(e * (d @ h) * d))
    diag = float(np.sum(e * d * d * np.diag(h)[None, :]))
    return est * (full / diag) if diag > 0 else est


@dataclass
class GradCheckpoint:
    """Where :func:`grad_entries` keeps its progress, so a run killed part
    way loses at most the group (block) it was rating. ``save(entries,
    state)`` is called after every rated tensor with the entries so far
    (the model's order) and the state a resume gives back here:
    ``entries`` ({path: entry}), ``fallback`` ({path: why} for tensors
    left to the exact sweep) and ``fisher_pass`` ("blocks" or "whole": the
    pass those came from). ``cotangents``: the file of the block chain's
    state after the last finished block (written after that block's
    tensors are saved, removed when the pass ends), tagged with ``key``
    (what the pass depends on: model, tokens, samples, seed)."""

    save: Callable[[list, dict], None]
    cotangents: Path
    key: str
    entries: dict = field(default_factory=dict)
    fallback: dict = field(default_factory=dict)
    fisher_pass: str | None = None


def grad_entries(model, tokens, sites, site_cands, *, scale_dtype=None, samples: int = 1,
                 seed: int = 0, progress: bool = True,
                 checkpoint: GradCheckpoint | None = None) -> list[dict]:
    """Table entries (the sweep's layout) with proxy KLs for ``sites``.
    Calibrated candidates (``+gptq`` ...) get their layer's X^T X from a
    block replay, exactly as the exact sweep does (one K x K at a time),
    and every candidate of such a tensor is then rated with the input
    correlations (see :func:`estimate`).

    A tensor whose Fisher diagonal is not finite everywhere (a model whose
    forward has an infinite derivative: mlx-lm's RG-LRU takes
    sqrt(1 - a^2), infinite at a^2 = 1, and every tensor upstream of it
    gets NaN), or whose estimate overflows, cannot be rated by the proxy:
    it is measured exactly, as the exact sweep does (``source: "exact"``,
    the reason in the entry's ``proxy_fallback``), and the tensors are
    named once in a :class:`ProxyFallbackWarning`. No NaN reaches the table.

    ``checkpoint``: progress saved after every tensor (see
    :class:`GradCheckpoint`); the tensors it holds are not rated again and,
    when the block chain's state after their blocks is on disk, the
    Fisher pass goes on below them. The entries equal an uninterrupted
    run's (their ``seconds`` aside). Each entry's ``seconds``: its own
    rating plus an even share of its group's Fisher pass."""
    from tqdm import tqdm

    from . import fisher_blocks
    from ..adapter import ModelAdapter
    from .candidates import needs_inputs
    from .replay import Replayer, token_chunks

    energy: dict = {}
    n_tok = np.asarray(tokens).size * samples
    ad = ModelAdapter(model)
    replayer = []  # built once, when first needed

    def rp():
        if not replayer:
            replayer.append(Replayer(model, token_chunks(tokens, 4), ad))
        return replayer[0]

    ck = checkpoint
    known = {s.path for s in sites}
    out = {p: e for p, e in (ck.entries if ck else {}).items() if p in known}
    fallback = {p: w for p, w in (ck.fallback if ck else {}).items() if p in known and p not in out}
    fisher_pass = ck.fisher_pass if ck and (out or fallback) else None

    def save():
        if ck:
            ck.save([out[s.path] for s in sites if s.path in out],
                    {"fisher_pass": fisher_pass,
                     "fallback": {s.path: fallback[s.path] for s in sites if s.path in fallback}})

    def todo():
        return [s for s in sites if s.path not in out and s.path not in fallback]

    start = None
    if ck and fisher_pass == "blocks" and todo():
        got = fisher_blocks.load_cotangents(ck.cotangents, ck.key)
        # Only a state below which nothing is left: every tensor of its block and above is saved.
        if got is not None and all(s.block is None or s.block < got[0] for s in todo()):
            start = got
    bar = tqdm(total=len(sites), initial=len(sites) - len(todo()), desc="proxy", unit="tensor",
               disable=not progress)
    again = bool(todo())
    while again:
        again = False
        chain: dict = {}
        # Each group (one block's tensors, block by block) is rated as soon as
        # its Fisher diagonal is complete and freed before the next is formed.
        groups = fisher_stream(model, tokens, todo(), samples=samples, seed=seed, progress=progress,
                               out_energy=energy, blockwise=fisher_pass != "whole", start=start,
                               chain=chain)
        t_group = time.perf_counter()
        for fisher in groups:
            if fisher_pass is not None and chain["pass"] != fisher_pass:
                # The block chain broke part way (fisher_blocks.Unchained): what it
                # rated is redone from the whole-model pass, all of it.
                out.clear()
                fallback.clear()
                fisher_pass, start = chain["pass"], None
                bar.reset()
                save()
                if any(s.path not in fisher for s in sites):  # some came from a checkpoint
                    again = True
                    break
            fisher_pass = chain["pass"]
            share = (time.perf_counter() - t_group) / max(1, len(fisher))
            # the group's calibrated linears: their inputs recorded in one replay of the block
            along = [s for s in sites if s.path in fisher and s.path not in fallback
                     and any(needs_inputs(c, s) for c in site_cands[s.path])]
            fallback.update({p: f"{n} of the Fisher diagonal's {fisher[p].size} entries are not finite"
                             for p, n in _nonfinite(fisher).items()})
            for s in sites:
                if s.path not in fisher:
                    continue
                bar.update(1)
                if s.path in fallback:
                    continue
                t1 = time.perf_counter()
                # Let go of each diagonal once rated (an 8B embedding's is 2 GiB).
                entry = _rate(ad, s, fisher.pop(s.path), n_tok, site_cands[s.path], scale_dtype,
                              energy, rp, along)
                if entry is None:
                    fallback[s.path] = "the estimate overflows"
                else:
                    entry["seconds"] = round(share + time.perf_counter() - t1, 3)
                    out[s.path] = entry
                save()
            save()  # the group's fallbacks, when none of it was rated
            if replayer:
                replayer[0].forget_inputs()  # the group's X^T X, before the next Fisher pass
            if ck and chain.get("block") is not None:
                fisher_blocks.save_cotangents(ck.cotangents, chain["block"], chain["cotangents"], ck.key)
            del fisher
            t_group = time.perf_counter()
        groups.close()
    bar.close()
    if ck:
        Path(ck.cotangents).unlink(missing_ok=True)  # the pass is over: every group is saved
    pending = {s.path: fallback[s.path] for s in sites if s.path in fallback and s.path not in out}
    if pending:
        from .sweep import SweepConfig, measure_site

        named = ", ".join(f"{p} ({why})" for p, why in list(pending.items())[:6])
        more = f" and {len(pending) - 6} more" if len(pending) > 6 else ""
        warnings.warn(ProxyFallbackWarning(
            f"the gradient proxy cannot rate {len(pending)} tensor(s), measured exactly instead: "
            f"{named}{more}"), stacklevel=2)
        by_path = {s.path: s for s in sites}
        for p, why in tqdm(pending.items(), desc="exact (proxy fallback)", unit="tensor",
                           disable=not progress):
            names = [c.name for c in site_cands[p]]
            cfg = SweepConfig(names, **({"scale_dtype": scale_dtype} if scale_dtype else {}))
            entry = measure_site(rp(), by_path[p], site_cands[p], cfg).to_entry()
            entry["candidates"] = [{**c, "source": "exact"} for c in entry["candidates"]]
            out[p] = {**entry, "proxy_fallback": why}
            save()
    return [out[s.path] for s in sites]


def _rate(ad, s, fisher, n_tok, cands_of_site, scale_dtype, energy, rp, along=()) -> dict | None:
    """The table entry of site ``s`` from its Fisher diagonal (None when an
    estimate is not finite). ``along``: the sites rated next whose inputs
    the same replay records (Replayer.input_hessian)."""
    from ..adapter import dense_weight
    from .candidates import build_layer, needs_inputs
    from .sweep import storage_bits

    original = ad.get(s.path)
    dense, fish = dense_weight(original), mx.array(fisher)
    mx.eval(dense, fish)
    del fisher  # the numpy copy: MLX holds its own now
    inputs = rp().input_hessian(s, along) if any(needs_inputs(c, s) for c in cands_of_site) else None
    cands = []
    for c in cands_of_site:
        layer = build_layer(original, c, scale_dtype, inputs, dense)
        sb = storage_bits(layer, s)
        cands.append({"kind": c.name, "bits": c.nominal_bits,
                      "kl": estimate(fish, n_tok, dense, layer,
                                     inputs[0] if inputs else None, energy.get(s.path)),
                      "storage_bits": sb, "bpw": sb / s.nparams, "group_size": c.group_size,
                      "source": "grad"})
    from .. import streaming

    streaming.release(original)  # its weight, read for the candidates (a model on disk)
    if not all(math.isfinite(c["kl"]) for c in cands):
        return None
    return {"path": s.path, **({"layer": s.block} if s.block is not None else {}),
            "nparams": s.nparams, "shape": list(s.shape), "candidates": cands}
