"""Calibrated quantizers on SmolLM2-135M: held-out joint KL and perplexity
of every decoder-block linear quantized uniformly at 2/3/4 bits, group 64,
fp16 scales, by each of our quantizers and by mlx-lm's GPTQ.

Run:  nice -n 5 python bench/quantizers_smollm2.py [N_SEQ] [ROW ...]
  N_SEQ: calibration sequences of 256 tokens (held out: the next 8 x 256).
  ROW:   e.g. 3:rtn 3:gptq (default: every row, 3 bits first). Rows are
         merged into bench/results/smollm2/quantizers.json, the record is
         printed after every row (a killed run keeps what it finished).
Quantizers (rows):
  rtn         min-max round to nearest (``3b_g64``)
  search      ``3b_g64+search`` (clip/LS search weighted by diag X^T X)
  gptq        ``3b_g64+gptq``: GPTQ, natural column order, group params by search
  gptq_act    ``mixbits.quantizers.gptq(act_order=True, params="search")`` on one
              segment (the act order is the stored perm)
  awq         ``mixbits.measure.awq_scale.scale_model`` (AWQ scales searched at the row's
              bits on the calibration tokens, folded into the norms feeding q/k/v
              and gate/up: the float model computes the same function), then RTN
  awq_search  the same scaling, then ``+search``
  awq_gptq    the same scaling, then ``+gptq`` (X^T X carried over: D H D)
  mlxlm_gptq  mlx-lm's ``gptq_quantize`` (its own loop, scales, packing)
  mlxlm_awq   mlx-lm's ``awq_quantize`` with its llama config (scales into the norms
              and up_proj, clip search, its fallback), on all calibration tokens
The reference is the GGUF as loaded: its block linears are Q4_1 (group 32),
dequantized to float32 they are the "unquantized" weights every quantizer
starts from; the embedding / tied head stay as loaded (Q8_0).
"""
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

import mixbits
from mixbits.adapter import dense_weight
from mixbits.layout import QuantizedTensor, Segment
from mixbits.measure.awq_scale import is_norm, scale_model
from mixbits.measure.calib import load_texts, token_sequences
from mixbits.measure.candidates import build_layer, parse_candidate
from mixbits.measure.joint import JointEvaluator
from mixbits.measure.replay import Replayer
from mixbits.measure.sweep import kl_per_token
from mixbits.models import load
from mixbits.nn import MixedQuantizedLinear
from mixbits import quantizers as Q

N_HELD = 8
GS = 64
args = sys.argv[1:]
n_cal = int(args.pop(0)) if args and args[0].isdigit() else 8
KINDS = ["rtn", "search", "gptq", "mlxlm_gptq", "gptq_act", "awq", "awq_search", "awq_gptq", "mlxlm_awq"]
rows = args or [f"{b}:{k}" for b in (3, 4, 2) for k in KINDS]
OUT = Path(__file__).parent / "results" / "smollm2" / "quantizers.json"

t0 = time.perf_counter()
model, tok, _ = load("smollm2")
mixbits.patch(model)
toks = np.asarray(token_sequences(tok, load_texts(None, "auto"), n_cal + N_HELD, 256))
cal, held = toks[:n_cal], toks[n_cal : n_cal + N_HELD]
ev = JointEvaluator(model, held, chunk=4)
ad = ev.adapter
sites = [s for s in ad.sites if s.form == "linear" and s.block is not None]
paths = [s.path for s in sites]
orig = {p: ad.get(p) for p in paths}


def evaluate():
    """(mean KL vs reference, its s.e., perplexity) on the held-out tokens."""
    kls, nll, n = [], 0.0, 0
    for ci, i in enumerate(range(0, len(held), ev.chunk)):
        t = mx.array(held[i : i + ev.chunk])
        logits = model(t).astype(mx.float32)
        kls.append(np.array(kl_per_token(ev.ref_logits[ci], logits), dtype=np.float64).ravel())
        lp = logits[:, :-1] - mx.logsumexp(logits[:, :-1], axis=-1, keepdims=True)
        tgt = mx.take_along_axis(lp, t[:, 1:, None], axis=-1)
        nll += -float(tgt.astype(mx.float32).sum())
        n += t[:, 1:].size
    v = np.concatenate(kls)
    return float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), math.exp(nll / n)


def ref_ppl():
    nll, n = 0.0, 0
    for ci, i in enumerate(range(0, len(held), ev.chunk)):
        t = mx.array(held[i : i + ev.chunk])
        lg = ev.ref_logits[ci][:, :-1]
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        nll += -float(mx.take_along_axis(lp, t[:, 1:, None], axis=-1).sum())
        n += t[:, 1:].size
    return math.exp(nll / n)


norm_mods = {p: m for p, m in model.named_modules() if is_norm(m)}
norms_as_loaded = {p: (m.weight, m.get("bias")) for p, m in norm_mods.items()}
rec = json.loads(OUT.read_text()) if OUT.exists() else {}
rec.update({
    "what": "SmolLM2-135M-Instruct GGUF as loaded = reference (its block linears are Q4_1, group 32: "
            "the 'unquantized' weights are those dequantized to float32); every linear inside the 30 "
            "decoder blocks (210) re-quantized uniformly, group 64, fp16 scales and biases; embedding / "
            "tied head left as loaded (Q8_0)",
    "command": "nice -n 5 python bench/quantizers_smollm2.py [N_SEQ] [ROW ...] (rows carry their run's calibration_seqs)",
    "calibration": f"{n_cal} x 256 tokens (first sequences of load_texts(None, 'auto'))",
    "held_out": f"{N_HELD} x 256 tokens (the following sequences; never used for choosing)",
    "reference_ppl": round(ref_ppl(), 4),
})
rec.setdefault("rows", {})
print(f"load + reference: {time.perf_counter() - t0:.1f}s", flush=True)

_hess = {}


def hessians():
    """X^T X of every block linear's input on the calibration tokens, from
    the unquantized model (computed once, shared by all calibrated rows)."""
    if not _hess:
        t = time.perf_counter()
        rp = Replayer(model, [mx.array(cal[i : i + 4]) for i in range(0, len(cal), 4)], ad)
        for s in sites:
            h, n = rp.input_hessian(s)
            _hess[s.path] = (np.asarray(h, dtype=np.float64), n)
        del rp
        rec[f"hessian_seconds_{n_cal}seq"] = round(time.perf_counter() - t, 1)
    return _hess


def bpw(layers):
    bits = sum(sum(v.nbytes for _, v in _flat(l.parameters())) * 8 for l in layers.values())
    return bits / sum(s.nparams for s in sites)


def _flat(tree):
    from mlx.utils import tree_flatten
    return [(k, v) for k, v in tree_flatten(tree) if k.split(".")[-1] != "inv"]


def build_ours(bits, kind):
    cand = parse_candidate(f"{bits}b_g{GS}" + {"rtn": "", "search": "+search", "gptq": "+gptq",
                                               "awq": "", "awq_search": "+search",
                                               "awq_gptq": "+gptq"}.get(kind, ""))
    H = hessians() if kind != "rtn" else None
    t = time.perf_counter()
    inv = {}
    if kind.startswith("awq"):  # scales folded into the norms; linears become float W diag(s)
        for r in scale_model(model, cal, bits, GS, progress=False):
            for p in r["linears"] if r["scaled"] else []:
                inv[p] = r["inv_scales"].astype(np.float64)
    out = {}
    for s in sites:
        m = ad.get(s.path)
        if kind != "gptq_act":
            h = None
            if cand.calibrated:
                h, n = H[s.path]
                if s.path in inv:  # the layer now reads x * inv
                    h = h * inv[s.path][:, None] * inv[s.path][None, :]
                h = (h, n)
            layer = build_layer(m, cand, mx.float16, h)
        else:  # gptq_act
            w = dense_weight(m)
            h, n = H[s.path]
            qt = Q.gptq(w, [(bits, GS, s.k)], h, act_order=True, dtype=mx.float16, n_tokens=n,
                        params="search")
            layer = MixedQuantizedLinear.from_tensor(qt, m.get("bias"))
        mx.eval(layer.parameters())
        out[s.path] = layer
    return out, time.perf_counter() - t


def build_mlxlm_gptq(bits):
    """mlx-lm's gptq_quantize on a holder of fp16 nn.Linear copies of the
    block linears. Its Hessian pass (Catcher: model(batch), H += x^T x in MLX)
    is given our X^T X (same tokens, same unquantized model, same sum):
    an MLX-CPU forward of the dequantized model costs minutes per chunk here.
    3 bits: its packer asserts bits in {2,4,8}; codes are packed by
    mixbits.layout.pack_codes (MLX's bitstream layout) instead, same codes."""
    import mlx_lm.quant.gptq as mg
    from mlx.utils import tree_flatten
    from mixbits.layout import pack_codes

    H = hessians()

    class Holder(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def __call__(self, batch):
            return None

    lins, byid = {}, {}
    for p in paths:
        lin = nn.Linear(1, 1, bias=False)
        lin.weight = dense_weight(orig[p]).astype(mx.float16)
        lins[p.replace(".", "_")] = lin
        byid[id(lin)] = mx.array(H[p][0].astype(np.float32))
    hold = Holder(lins)

    class GivenH(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.H = byid[id(module)]

        def __call__(self, x, *a, **k):
            return self.module(x, *a, **k)

    saved = mg.Catcher, mg.quantize

    def pack3(w, b, scales, biases):
        if b in (2, 4, 8):
            return saved[1](w, b, scales, biases)
        w = mx.unflatten(w, -1, (scales.shape[-1], -1))
        q = mx.clip(mx.round((w - biases[..., None]) / scales[..., None]), 0.0, 2**b - 1)
        return mx.array(pack_codes(np.array(q.flatten(-2, -1)).astype(np.int64), b))

    mg.Catcher, mg.quantize = GivenH, pack3
    try:
        t = time.perf_counter()
        mg.gptq_quantize(hold, [mx.zeros((1, 1), mx.int32)], bits, GS, 8, GS, batch_size=8)
        sec = time.perf_counter() - t
    finally:
        mg.Catcher, mg.quantize = saved
    out = {}
    for p in paths:
        q = hold.lin[p.replace(".", "_")]
        assert isinstance(q, nn.QuantizedLinear) and q.bits == bits, type(q)
        seg = Segment(bits, GS, q.scales.shape[-1] * GS, q.weight, q.scales, q.biases, "affine")
        out[p] = MixedQuantizedLinear.from_tensor(QuantizedTensor([seg]), orig[p].get("bias"))
        mx.eval(out[p].parameters())
    return out, sec


class _NumpyEinsum:
    """``mx`` for mlx_lm.quant.awq with einsum through numpy (its clip search
    is a batched matmul; MLX's Linux CPU matmul is reference BLAS)."""

    def __getattr__(self, name):
        return getattr(mx, name)

    @staticmethod
    def einsum(spec, a, b):
        a32, b32 = (np.array(v.astype(mx.float32)) for v in (a, b))
        if spec == "bdg,odg->bod":
            out = np.matmul(a32.transpose(1, 0, 2), b32.transpose(1, 2, 0)).transpose(1, 2, 0)
        else:
            out = np.einsum(spec, a32, b32, optimize=True)
        return mx.array(out).astype(a.dtype if a.dtype == b.dtype else mx.float32)


def build_mlxlm_awq(bits):
    """mlx-lm's awq_quantize on the model with fp16 nn.Linear copies of the
    block linears, its llama AWQ config. Substitutions (same arithmetic,
    faster engine): float nn.Linear and its clip einsum run through numpy
    float32 matmul, nn.QuantizedLinear through mixbits.quantized_matmul
    (equal to mx.quantized_matmul to float tolerance); the embedding is kept
    as loaded (awq_quantize would re-quantize it to 4 bits)."""
    import mlx_lm.quant.awq as ma
    from mixbits import quantized_matmul

    for p in paths:
        m = orig[p]
        lin = nn.Linear(1, 1, bias=m.get("bias") is not None)
        lin.weight = dense_weight(m).astype(mx.float16)
        if m.get("bias") is not None:
            lin.bias = m["bias"]
        ad.set(p, lin)

    def linear_np(self, x):
        y = np.array(x.astype(mx.float32)) @ np.array(self.weight.astype(mx.float32)).T
        if "bias" in self:
            y = y + np.array(self.bias.astype(mx.float32))
        return mx.array(y).astype(x.dtype)

    def qlinear(self, x):
        y = quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size, self.bits)
        return y + self.bias if "bias" in self else y

    emb = type(model.model.embed_tokens)
    saved = (nn.Linear.__call__, nn.QuantizedLinear.__call__, ma.mx, emb.__dict__.get("to_quantized"))
    nn.Linear.__call__, nn.QuantizedLinear.__call__, ma.mx = linear_np, qlinear, _NumpyEinsum()
    emb.to_quantized = lambda self, **kw: self
    try:
        t = time.perf_counter()
        ma.awq_quantize(model, mx.array(cal), ma.AWQ_MODEL_CONFIGS["llama"], group_size=GS, bits=bits)
        sec = time.perf_counter() - t
    finally:
        nn.Linear.__call__, nn.QuantizedLinear.__call__, ma.mx = saved[:3]
        if saved[3] is None:
            del emb.to_quantized
        else:
            emb.to_quantized = saved[3]
    out = {}
    for p in paths:
        q = ad.get(p)
        assert isinstance(q, nn.QuantizedLinear) and q.bits == bits, type(q)
        # Scales and biases stored fp16, as mlx-lm stores them for an fp16
        # model (here they follow the float32 activations' dtype).
        seg = Segment(bits, GS, q.scales.shape[-1] * GS, q.weight, q.scales.astype(mx.float16),
                      q.biases.astype(mx.float16), "affine")
        out[p] = MixedQuantizedLinear.from_tensor(QuantizedTensor([seg]), q.get("bias"))
        mx.eval(out[p].parameters())
    return out, sec


def restore():
    """The model as loaded: block linears and norms (AWQ rows fold into them)."""
    for p in paths:
        ad.set(p, orig[p])
    for p, (w, b) in norms_as_loaded.items():
        norm_mods[p].weight = w
        if b is not None:
            norm_mods[p].bias = b


def save():
    """Write the record, keeping rows another run (e.g. one started in
    parallel on other rows) saved in the meantime."""
    OUT.parent.mkdir(parents=True, exist_ok=True)
    now = json.loads(OUT.read_text()) if OUT.exists() else {}
    mine = rec.setdefault("_mine", [])
    rows_now = {**rec["rows"], **now.get("rows", {}), **{k: rec["rows"][k] for k in mine}}
    out = {**now, **{k: v for k, v in rec.items() if k not in ("rows", "_mine")}, "rows": rows_now}
    OUT.write_text(json.dumps(out, indent=1))


for row in rows:
    b, kind = row.split(":")
    bits = int(b)
    t = time.perf_counter()
    try:
        build = {"mlxlm_gptq": build_mlxlm_gptq, "mlxlm_awq": build_mlxlm_awq}.get(kind)
        layers, sec = build(bits) if build else build_ours(bits, kind)
    except Exception as e:  # recorded, the other rows still run
        import traceback
        traceback.print_exc()
        restore()
        rec.setdefault("_mine", []).append(f"{bits}b {kind}")
        rec["rows"][f"{bits}b {kind}"] = {"bits": bits, "quantizer": kind,
                                          "error": f"{type(e).__name__}: {e}"[:500],
                                          "after_seconds": round(time.perf_counter() - t, 1)}
        save()
        continue
    for p, l in layers.items():
        ad.set(p, l)
    try:
        kl, se, ppl = evaluate()
    finally:
        restore()
    rec.setdefault("_mine", []).append(f"{bits}b {kind}")
    rec["rows"][f"{bits}b {kind}"] = {
        "bits": bits, "quantizer": kind, "heldout_kl": round(kl, 5), "kl_se": round(se, 5),
        "heldout_ppl": round(ppl, 4), "bpw": round(bpw(layers), 4), "quantize_seconds": round(sec, 1),
        "calibration_seqs": n_cal, "row_wall_seconds": round(time.perf_counter() - t, 1)}
    save()
    print(json.dumps(rec, indent=1), flush=True)
