"""llama.cpp's K-quant mixes with an importance matrix as contenders of
bench/quality_protocol.py (issue 41 item 1).

Every step keeps the protocol's terms:

- the float model llama.cpp quantizes is the protocol's reference: every
  tensor of the model's GGUF decoded (gguf-py's ``dequantize``: Q4_1 block
  linears, Q8_0 embedding, F32 norms) and written to an F32 GGUF with the
  same metadata and tokenizer (:func:`write_float_gguf`). F32, not F16:
  Q4_1's ``d * q + m`` is exact in float32, not always in float16; and not
  ``--allow-requantize`` of the Q4_1 file, which llama.cpp would dequantize
  and quantize again on its own terms;
- llama-imatrix sees the seed's calibration tokens: the windows decoded to
  text, which llama.cpp tokenizes back (:func:`check_tokens` compares its
  ids with the seed's array: they must be equal), in chunks of SEQ_LEN;
- the quantized GGUF is read back by mixbits' own GGUF loader (K-quants,
  IQ4_NL... decoded by gguf-py to float32; Q4_0/Q5_0/Q5_1/Q8_0 held as the
  same values in MLX affine layers; llama q/k rows back in HF order), and its
  block linears and embedding replace the reference's in the protocol's
  evaluators (:func:`score_gguf`): the same held-out tokens, the same KL;
- storage bpw over the same tensors as every contender (block linears and
  the tied embedding), from the bytes each tensor has in the GGUF
  (:func:`gguf_bpw`): super-block scales included, and whatever type
  llama.cpp's mix actually chose (it bumps attn_v / ffn_down, gives the
  tied embedding the output's type, and falls back from a 256-block K type
  to a 32-block one where a row's length is not a multiple of 256).
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

MIXES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")
# llama.cpp gives a tied embedding the output's type: Q6_K, or Q8_0 where a
# row is not a multiple of 256 (SmolLM2's 576, Gemma-3-270M's 640) -- 21% of
# SmolLM2's weights at 8.5 bpw puts every mix above 5 bpw. The override a
# llama.cpp user has for it (--output-tensor-type, which this llama.cpp
# applies to a tied embedding) at Q4_0, the type the mixes' 576-wide
# tensors fall back to: a second set.
EMBED_OVERRIDES = ("q4_0",)
BIN_DIR = Path(__file__).resolve().parents[1] / "build" / "ggml"
ALL_F32 = 0  # llama_ftype LLAMA_FTYPE_ALL_F32


def tool(name: str) -> Path:
    p = Path(os.environ.get("LLAMA_BIN_DIR", BIN_DIR)) / name
    if not p.is_file():
        raise SystemExit(f"{p} not found: build it with bench/ggml/build_llama_quant.sh")
    return p


# ------------------------------------------------------------ float reference

def write_float_gguf(src, dst) -> None:
    """``src`` with every tensor decoded to float32 (same names, shapes,
    order, metadata and tokenizer; file type ALL_F32). Atomic."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    tmp = Path(str(dst) + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for name, f in r.fields.items():
        # GGUF.* are the header's own fields; the writer adds the architecture
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    w.add_file_type(ALL_F32)
    for t in r.tensors:
        w.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)


# -------------------------------------------------------------- storage bits

def gguf_bpw(path, covered) -> tuple[float, dict[str, int]]:
    """(storage bits per weight, {ggml type: weights at that type}) over the
    GGUF tensors named in ``covered``, from each tensor's bytes in the file."""
    import gguf

    r = gguf.GGUFReader(str(path))
    have = {t.name: t for t in r.tensors}
    missing = sorted(set(covered) - set(have))
    if missing:
        raise ValueError(f"{path} lacks tensors {missing[:5]}")
    bits = n = 0
    types: dict[str, int] = {}
    for name in covered:
        t = have[name]
        bits += 8 * int(t.n_bytes)
        n += int(t.n_elements)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_elements)
    return bits / n, types


def covered_names(path, sites) -> list[str]:
    """GGUF names of the protocol's sites (mlx module paths): each site's weight."""
    import gguf

    from mixbits.models import gguf_arch

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    by_path = {gguf_arch.mlx_name(arch, t.name): t.name for t in r.tensors}
    out = []
    for p in sites:
        if f"{p}.weight" not in by_path:
            raise ValueError(f"no tensor of {path} is the weight of {p}")
        out.append(by_path[f"{p}.weight"])
    return out


# ----------------------------------------------------------------- read-back

def read_back(path, sites):
    """{site path: module} of the quantized GGUF, as the protocol's model
    holds its layers (float weights float32, quantized ones on mixbits'
    kernels). The embedding module is the (tied) head as well."""
    from mixbits.measure.calib import cast_model
    from mixbits.models.gguf import load_gguf
    from mixbits.nn import patch

    model, _, _ = load_gguf(path)
    cast_model(model, "float32")
    patch(model)
    mods = dict(model.named_modules())
    return {p: mods[p] for p in sites}


def score_gguf(evaluators: dict, path, sets=None) -> dict[str, list[float]]:
    """{held-out name: per-sequence KL} of the model in ``path`` on the
    protocol's evaluators (one model: each run swaps its sites for the
    GGUF's and puts them back). Through ``token_kls_of``, not an assignment:
    the evaluator keys stored scores and block outputs by candidate names,
    which these layers have none of."""
    ev0 = next(iter(evaluators.values()))
    if ev0.pinned:
        raise ValueError("the model pins layers outside the sites: the read-back would not replace them")
    layers = read_back(path, list(ev0.sites))
    return {k: ev.token_kls_of(layers).mean(axis=1).tolist()
            for k, ev in evaluators.items() if sets is None or k in sets}


def record(evaluators: dict, path, sets=None) -> dict:
    """The protocol's record of the GGUF in ``path``: storage bpw over the
    evaluators' sites, the weights at each ggml type, per-sequence KLs on
    ``sets`` (default: every held-out set)."""
    sites = list(next(iter(evaluators.values())).sites)
    bpw, types = gguf_bpw(path, covered_names(path, sites))
    return {"bpw": bpw, "kl": score_gguf(evaluators, path, sets), "ggml_types": types}


# ---------------------------------------------------------- llama.cpp stages

def calibration_text(tok, tokens: np.ndarray) -> str:
    """The text of the calibration windows, checked to tokenize back to them
    with the model's own tokenizer (llama.cpp's is checked by check_tokens).
    A leading BOS (Gemma's stream starts with one) is left out of the text:
    llama.cpp adds it back when the GGUF asks for BOS, and spelled as text
    it would be parsed as the characters '<bos>'."""
    ids = np.asarray(tokens).ravel()
    bos = getattr(tok, "bos_token_id", None)
    body = ids[1:] if bos is not None and len(ids) and ids[0] == bos else ids
    text = tok.decode([int(t) for t in body])
    back = np.asarray(tok.encode(text))
    if bos is not None and len(back) == len(body) + 1 and back[0] == bos:
        back = back[1:]  # a tokenizer that prepends BOS to any text
    if not np.array_equal(back, body):
        raise ValueError("the calibration windows do not tokenize back to themselves from their text")
    return text


def gguf_bos(model_gguf) -> int | None:
    """The BOS id llama.cpp prepends to a text, or None when the GGUF does
    not ask for one (SmolLM2's does not, Gemma's does)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(model_gguf)).fields
    add, bos = fields.get("tokenizer.ggml.add_bos_token"), fields.get("tokenizer.ggml.bos_token_id")
    if add is None or not bool(add.parts[add.data[0]][0]) or bos is None:
        return None
    return int(bos.parts[bos.data[0]][0])


def compare_ids(ids: list[int], want: list[int], bos: int | None) -> dict:
    """llama.cpp's ids of the calibration text against the protocol's.
    ``bos``: what llama.cpp put in front (None: nothing). A seed whose first
    window starts at the text's BOS (seed 0, convert's cut) gets it back from
    llama.cpp; other seeds' windows start mid-text, so llama.cpp's stream
    is that BOS and then exactly the protocol's ids."""
    prepended = bos is not None and bool(want) and want[0] != bos and ids[:1] == [bos]
    body = ids[1:] if prepended else ids
    first_diff = next((i for i, (a, b) in enumerate(zip(body, want)) if a != b),
                      None if len(body) == len(want) else min(len(body), len(want)))
    # llama-imatrix also starts every chunk at BOS when the GGUF asks for
    # one, overwriting that window's first token (or, with BOS prepended,
    # shifting each window by one: it sees BOS then all but its last
    # token): recorded, since its statistics then miss one token per window.
    return {"llama_cpp_tokens": len(ids), "protocol_tokens": len(want), "equal": body == want,
            "first_difference": first_diff, "bos_prepended": prepended,
            "imatrix_chunks_start_at_bos": bos is not None}


def check_tokens(model_gguf, text_file, tokens: np.ndarray) -> dict:
    """llama.cpp's ids of ``text_file`` against ``tokens`` (compare_ids):
    llama-tokenize called as llama-imatrix tokenizes (special tokens not
    parsed; BOS first when the GGUF asks for it)."""
    bos = gguf_bos(model_gguf)
    out = subprocess.run([str(tool("llama-tokenize")), "-m", str(model_gguf), "-f", str(text_file), "--ids",
                          "--log-disable", *([] if bos is not None else ["--no-bos"]), "--no-parse-special"],
                         check=True, capture_output=True, text=True).stdout
    return compare_ids(json.loads(out.strip().splitlines()[-1]), np.asarray(tokens).ravel().tolist(), bos)


def run_imatrix(model_gguf, text_file, out, n_ctx: int, n_chunks: int, threads: int = 2) -> float:
    """llama-imatrix over the text's first ``n_chunks`` windows of ``n_ctx``
    tokens (each its own sequence, as the protocol's windows); seconds."""
    import time

    t0 = time.perf_counter()
    tmp = Path(str(out) + ".tmp.gguf")
    subprocess.run(["nice", "-n", "10", str(tool("llama-imatrix")), "-m", str(model_gguf), "-f", str(text_file),
                    "-o", str(tmp), "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(n_chunks),
                    "--no-ppl", "-t", str(threads)], check=True, capture_output=True)
    os.replace(tmp, out)
    return time.perf_counter() - t0


def run_quantize(model_gguf, out, mix: str, imatrix=None, embed_type=None, threads: int = 2) -> str:
    """llama-quantize to ``mix`` (with ``imatrix``, the tied embedding at
    ``embed_type`` when given); its log."""
    tmp = Path(str(out) + ".tmp.gguf")
    cmd = ["nice", "-n", "10", str(tool("llama-quantize"))]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    if embed_type is not None:
        cmd += ["--output-tensor-type", embed_type]
    r = subprocess.run([*cmd, str(model_gguf), str(tmp), mix, str(threads)], check=True,
                       capture_output=True, text=True)
    os.replace(tmp, out)
    return r.stdout + r.stderr


def contenders(model_name: str, tok, calib: dict[int, np.ndarray], work: Path, mixes=MIXES, plain: bool = True,
               embed_types=EMBED_OVERRIDES):
    """Yield (record name, GGUF path) of every mix with each seed's imatrix,
    the tied embedding at each of ``embed_types`` or as the mix sets it
    ("llama.cpp Q4_K_M+imatrix embed q4_0 seed0", "llama.cpp Q4_K_M+imatrix
    seed0"), then, if ``plain``, the same without imatrix ("llama.cpp
    Q4_K_M"); the GGUFs and imatrices are kept in ``work``."""
    from mixbits.models import KEYWORDS, resolve_keyword

    work.mkdir(parents=True, exist_ok=True)
    if model_name not in KEYWORDS:
        raise SystemExit(f"--kquant: the reference GGUF is written for the keyword models {KEYWORDS}, "
                         f"not {model_name!r}")
    ref = work / "reference_f32.gguf"
    if not ref.exists():
        write_float_gguf(resolve_keyword(model_name), ref)
    seq_len = next(iter(calib.values())).shape[1]
    for s, toks in calib.items():
        kept = work / f"calib_seed{s}.npy"  # the imatrix and GGUFs of seed s belong to these tokens
        if kept.exists() and not np.array_equal(np.load(kept), toks):
            raise SystemExit(f"{work} holds K-quant stages of other seed-{s} calibration tokens: use another --work")
        np.save(kept, toks)
        text_file = work / f"calib_seed{s}.txt"
        text_file.write_text(calibration_text(tok, toks), encoding="utf-8")
        check = check_tokens(ref, text_file, toks)
        (work / f"calib_seed{s}_tokens.json").write_text(json.dumps(check))
        if not check["equal"]:
            raise SystemExit(f"llama.cpp tokenizes seed {s}'s calibration text differently: {check}")
        im = work / f"imatrix_seed{s}.gguf"
        if not im.exists():
            run_imatrix(ref, text_file, im, seq_len, len(toks))
        # the overridden embedding first: on SmolLM2 only those fit 5 bpw
        for et in [*embed_types, None]:
            for mix in mixes:
                tag = f"_embed_{et}" if et else ""
                q = work / f"{mix}_imatrix{tag}_seed{s}.gguf"
                if not q.exists():
                    run_quantize(ref, q, mix, imatrix=im, embed_type=et)
                yield f"llama.cpp {mix}+imatrix{f' embed {et}' if et else ''} seed{s}", q
    if plain:  # last: the comparison point for what the imatrix is worth
        for et in [*embed_types, None]:
            for mix in mixes:
                q = work / (f"{mix}_embed_{et}.gguf" if et else f"{mix}.gguf")
                if not q.exists():
                    run_quantize(ref, q, mix, embed_type=et)
                yield f"llama.cpp {mix}{f' embed {et}' if et else ''}", q


# ------------------------------------------------- cross-check with llama.cpp

def llama_kld(model_gguf, base_file, threads: int = 2) -> float:
    """llama-perplexity --kl-divergence of ``model_gguf`` against the base
    log-probabilities in ``base_file``: llama.cpp's own forward, KL on each
    window's positions n_ctx/2 .. n_ctx-2. --no-repack: this host's AMX
    tiles fault in ggml's AMX buffers (SIGILL at ldtilecfg) for Q4_0/Q8_0."""
    r = subprocess.run(["nice", "-n", "10", str(tool("llama-perplexity")), "-m", str(model_gguf), "-t", str(threads),
                        "--no-repack", "--kl-divergence-base", str(base_file), "--kl-divergence"],
                       check=True, capture_output=True, text=True)
    line = next(ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("Mean    KLD:"))
    return float(line.split(":")[1].split("±")[0])


def crosscheck(names, work: Path, out: Path) -> dict:
    """KL of the GGUFs ``work/<name>.gguf`` on the protocol's licenses set by
    our evaluator and by llama-perplexity, on the positions llama.cpp scores
    (the held-out windows as text: checked to tokenize to the same ids)."""
    import quality_protocol as qp

    sc = qp.Scorer("smollm2")
    ev = sc.evals["licenses"]
    ref, held = work / "reference_f32.gguf", sc.held["licenses"]
    text_file, base = work / "held_licenses.txt", work / "base_licenses.kld"
    text_file.write_text(calibration_text(sc.tok, held), encoding="utf-8")
    check = check_tokens(ref, text_file, held)
    if not check["equal"]:
        raise SystemExit(f"llama.cpp tokenizes the held-out text differently: {check}")
    if not base.exists():
        n, k = held.shape
        subprocess.run(["nice", "-n", "10", str(tool("llama-perplexity")), "-m", str(ref), "-f", str(text_file),
                        "-c", str(k), "-b", str(k), "--chunks", str(n), "-t", "2", "--no-repack",
                        "--kl-divergence-base", str(base)], check=True, capture_output=True)
    res = {"tokens": check, "positions": "n_ctx/2 .. n_ctx-2 of each 256-token window (llama-perplexity's)"}
    for name in names:
        tk = ev.token_kls_of(read_back(work / f"{name}.gguf", list(ev.sites)))
        k = tk.shape[1]
        res[name] = {"ours_all_positions": float(tk.mean()), "ours": float(tk[:, k // 2 : k - 1].mean()),
                     "llama_perplexity": llama_kld(work / f"{name}.gguf", base)}
        print(name, res[name], flush=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    os.replace(tmp, out)
    return res


if __name__ == "__main__":
    # python bench/kquant.py WORK/kquant NAME...  (after quality_protocol.py --kquant --work WORK)
    import sys

    crosscheck(sys.argv[2:], Path(sys.argv[1]),
               Path(__file__).parent / "results" / "kquant_crosscheck_smollm2.json")
