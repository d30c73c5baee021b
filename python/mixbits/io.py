"""Save a (possibly mixed-precision) model to a folder and load it back.

Folder layout, as mlx-lm writes it: ``model.safetensors``, ``config.json``
and the tokenizer files. In config.json:

- ``"quantization"`` (copied to ``"quantization_config"``): mlx-lm's dict,
  ``{"group_size": 64, "bits": 4, "mode": "affine", "<module path>":
  {"group_size": .., "bits": ..}, ...}`` with an entry for every layer whose
  weight is a single MLX affine segment -- stock quantized layers and
  single-segment mixbits layers (ternary included: it is stored as 2-bit
  affine). When every quantized layer is of that kind the folder loads
  with ``mlx_lm.load`` unchanged.
- ``"mixbits"``: ``{"format": 1, "layers": {"<module path>": {"segments":
  [[bits, group_size, k], ...], "kinds": [...], "perm": bool}}}`` for every
  mixbits layer (linears, embeddings and expert stacks, whose arrays carry
  a leading expert axis). Multi-segment or permuted layers appear only here (their
  parameters are ``<path>.segments.<i>.weight/scales/biases`` and
  ``<path>.perm``); :func:`load` reads them. Such a folder also holds
  ``mixbits_model.py``, named by config.json's ``"model_file"``: through it
  stock mlx-lm runs the folder when told to trust it (mixbits.mlx_lm_model_file).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import UsageError
from .folder import check_complete, write_folder
from .formats.errors import FormatError, expect_dict, load_json
from .formats.safetensors_header import read_header
from .formats.mlx_config import MlxQuantization, mixbits_layers, with_quantization
from .adapter import weight_shape
from .layout import QuantizedTensor, Segment
from .mlx_lm_model_file import MODEL_FILE, with_model_file, write_model_file
from .nn import (MixedQuantizedEmbedding, MixedQuantizedLinear, MixedQuantizedSwitchLinear, MixedWeight,
                 RowBandEmbedding, is_expert_stack, repacked_layers, set_module)
from .nn import patch as _patch

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"

# Keys of a model config that describe weights, not architecture: rebuilt on save.
_QUANT_KEYS = ("quantization", "quantization_config", "mixbits")



def _model_config(model, config) -> dict:
    if config is not None:
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        return {k: v for k, v in config.items() if k not in _QUANT_KEYS}
    args = getattr(model, "args", None)
    if args is not None and dataclasses.is_dataclass(args):
        return {k: v for k, v in dataclasses.asdict(args).items() if v is not None}
    raise ValueError(
        "config is required: pass the model's config dict (architecture keys such as "
        "model_type, hidden_size ...) -- the model has no dataclass `args` to take it from"
    )


def quantization_config(model: nn.Module) -> tuple[MlxQuantization | None, dict]:
    """(mlx-lm quantization block or None, mixbits ``layers`` dict) describing
    every quantized layer of ``model``. Every MLX-loadable layer gets its
    own override entry, so the block does not depend on the defaults."""
    mlx_entries, mixbits_layers = {}, {}
    banded = ()  # a row-banded embedding is one entry; its bands are its storage
    for path, m in model.named_modules():
        if path.startswith(banded):
            continue
        if isinstance(m, RowBandEmbedding):
            mixbits_layers[path] = m.config()
            banded = (*banded, path + ".")
        elif isinstance(m, MixedWeight):
            mixbits_layers[path] = m.layout.config()
            if m.layout.is_mlx_affine:
                bits, gs, _ = m.layout.specs[0]
                mlx_entries[path] = {"group_size": gs, "bits": bits, "mode": "affine"}
        elif isinstance(m, nn.Module) and "scales" in m and isinstance(getattr(m, "bits", None), int):
            # Stock quantized modules of any class (QuantizedLinear, mlx-lm's
            # QuantizedSwitchLinear for expert stacks, QuantizedMultiLinear).
            mlx_entries[path] = {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
    if not mlx_entries:
        return None, mixbits_layers
    counts = {}
    for e in mlx_entries.values():
        key = (e["group_size"], e["bits"], e["mode"])
        counts[key] = counts.get(key, 0) + 1
    gs, bits, mode = max(counts, key=counts.get)
    quant = MlxQuantization(group_size=gs, bits=bits, mode=mode)
    for path, e in mlx_entries.items():
        # A folder mixing modes names every entry's mode, as mlx-lm writes
        # them: a reader that takes a missing key from the default block
        # would otherwise read an affine entry as the default's mode.
        explicit = e["mode"] != "affine" or mode != "affine"
        quant.set_override(path, e["bits"], e["group_size"], e["mode"] if explicit else None)
    return quant, mixbits_layers


def save(model: nn.Module, folder, config: dict | None = None, tokenizer=None, *,
         extra_files: dict | None = None) -> Path:
    """Write ``model`` (weights, config.json, tokenizer) to ``folder``.

    ``config``: the model's architecture config (as mlx-lm's config.json);
    taken from ``model.args`` when omitted. Quantization keys are rebuilt
    from the layers. ``tokenizer``: a mixbits tokenizer (``.save``) or a
    transformers/mlx-lm one (``.save_pretrained``). ``extra_files``: {name:
    str or bytes} written beside them (a model card, a plot), inside the
    same atomic write and manifest.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    if tokenizer is not None and not (hasattr(tokenizer, "save_pretrained") or hasattr(tokenizer, "save")):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has neither save() nor save_pretrained()")
    repacked = repacked_layers(model)
    if repacked:
        # Their parameters hold the row-interleaved layout, which no reader
        # of a saved folder (mixbits, mlx-lm) expects.
        raise UsageError(
            f"{len(repacked)} layers hold repacked weights (e.g. {repacked[0]!r}); "
            "call mixbits.nn.unrepack_layers(model) before saving"
        )
    cfg = _model_config(model, config)
    quant, layers = quantization_config(model)
    if quant is not None:
        cfg = with_quantization(cfg, quant)
    if layers:
        cfg["mixbits"] = {"format": FORMAT_VERSION, "layers": layers}
    cfg = with_model_file(cfg)  # mixbits-only layers: stock mlx-lm needs mixbits' model file

    weights = dict(tree_flatten(model.parameters()))
    text = json.dumps(cfg, indent=2, sort_keys=False)

    def fill(tmp: Path) -> None:
        mx.save_safetensors(str(tmp / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(text)
        if tokenizer is not None:
            if hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(str(tmp))
            else:
                tokenizer.save(tmp)
        write_model_file(tmp, cfg)
        for name, data in (extra_files or {}).items():
            target = tmp / name
            if target.exists() or Path(name).name != name:
                raise ValueError(f"extra file {name!r}: a plain name not already in the folder")
            (target.write_bytes if isinstance(data, bytes) else target.write_text)(data)

    # Written aside and renamed into place with a completeness marker
    # (mixbits.folder): an interrupted save never leaves a loadable folder.
    return write_folder(folder, fill)


def _tensor_from_weights(weights: dict, path: str, desc: dict) -> QuantizedTensor:
    def whole(v) -> int:  # int(3.9) would quietly read a 3.9-bit segment as 3 bits
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            raise ValueError(v)
        return int(v)

    try:
        specs = [tuple(whole(v) for v in s) for s in desc["segments"]]
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"config.json mixbits.layers[{path!r}] has no valid 'segments' (lists of "
                          f"whole numbers [bits, group_size, k]), got "
                          f"{desc.get('segments') if isinstance(desc, dict) else desc!r:.80}") from None
    single = len(specs) == 1 and not desc.get("perm", False)
    segs = []
    for i, (bits, gs, k) in enumerate(specs):
        prefix = f"{path}." if single else f"{path}.segments.{i}."
        try:
            w, s, b = (weights[prefix + n] for n in ("weight", "scales", "biases"))
        except KeyError as e:
            raise ValueError(f"{WEIGHTS_FILE} lacks {e.args[0]!r} for mixbits layer {path!r}") from None
        segs.append(Segment(bits, gs, k, w, s, b))
    perm = None
    if desc.get("perm", False):
        if f"{path}.perm" not in weights:
            raise ValueError(f"{WEIGHTS_FILE} lacks {path + '.perm'!r} for mixbits layer {path!r}")
        perm = weights[f"{path}.perm"]
    return QuantizedTensor(segs, perm)


def _banded_from_weights(weights: dict, path: str, bands, placeholder) -> RowBandEmbedding:
    """The RowBandEmbedding a ``{"bands": [...]}`` descriptor names, checked
    against the placeholder embedding it replaces."""
    if not isinstance(placeholder, (nn.Embedding, nn.QuantizedEmbedding)):
        raise FormatError(f"config.json mixbits.layers[{path!r}] has row bands, but the model's "
                          f"module there is a {type(placeholder).__name__}, not an embedding")
    if not isinstance(bands, list) or len(bands) < 2 or not all(isinstance(b, dict) for b in bands):
        raise FormatError(f"config.json mixbits.layers[{path!r}]['bands'] must be a list of two or "
                          f"more layer descriptors, got {bands!r:.80}")
    layers = []
    for i, desc in enumerate(bands):
        qt = _tensor_from_weights(weights, f"{path}.bands.{i}", desc)
        layers.append(MixedQuantizedEmbedding.from_tensor(qt, desc.get("kinds")))
    rows, dims = sum(b.num_embeddings for b in layers), {b.dims for b in layers}
    want = tuple(weight_shape(placeholder))  # a quantized placeholder's too
    if len(dims) != 1 or (rows, dims.pop()) != want:
        raise FormatError(f"config.json mixbits.layers[{path!r}]: bands of "
                          f"{[(b.num_embeddings, b.dims) for b in layers]} rows x dims do not "
                          f"make the model's embedding {want}")
    return RowBandEmbedding(layers)


def place_layers(model: nn.Module, layers: dict, weights: dict) -> None:
    """Swap each module named in config.json's ``mixbits.layers`` (path ->
    descriptor) for the mixbits layer holding its arrays from ``weights``
    (the folder's saved parameters). Used by :func:`load` and by the
    model file that lets stock mlx-lm run a folder (mixbits.mlx_lm_model_file)."""
    modules = dict(model.named_modules())
    for path, desc in layers.items():
        if path not in modules:
            raise ValueError(f"config.json mixbits.layers names {path!r}, which the model does not have")
        m = modules[path]
        if isinstance(desc, dict) and "bands" in desc:
            set_module(model, path, _banded_from_weights(weights, path, desc["bands"], m))
            continue
        qt = _tensor_from_weights(weights, path, desc)
        kinds = desc.get("kinds")
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            new = MixedQuantizedEmbedding.from_tensor(qt, kinds)
        elif is_expert_stack(m):  # mlx-lm's SwitchLinear placeholder (or its quantized form)
            new = MixedQuantizedSwitchLinear.from_tensor(qt, weights.get(f"{path}.bias"), kinds)
        else:
            new = MixedQuantizedLinear.from_tensor(qt, weights.get(f"{path}.bias"), kinds)
        set_module(model, path, new)


def _load_folder(folder: Path, patch: bool, lazy: bool = False):
    from mlx_lm.utils import load_model

    from .models.tokenizer import Tokenizer

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json")
    config = expect_dict(load_json(cfg_path, "config.json"), str(cfg_path))
    check_complete(folder, written_by_mixbits="mixbits" in config)
    layers = mixbits_layers(config, str(cfg_path))
    weights = {}
    for f in sorted(folder.glob("model*.safetensors")):
        read_header(f)  # MLX's loader does not validate it: duplicates, overlaps
        weights.update(mx.load(str(f)))
    if not weights:
        raise FileNotFoundError(f"{folder} has no model*.safetensors")

    # mlx-lm builds the architecture and loads every stock layer; layers
    # only mixbits understands are still float placeholders afterwards and
    # are swapped below. strict=False because of those; completeness is
    # checked after the swap instead.
    # The folder's own mlx-lm model file (stock mlx-lm's way in) is not
    # run here: mixbits builds the stock architecture itself.
    own = {"model_file": None} if config.get("model_file") == MODEL_FILE else None
    model, config = load_model(folder, strict=False, model_config=own, lazy=lazy)
    if own:
        del config["model_file"]
    place_layers(model, layers, weights)

    have = dict(tree_flatten(model.parameters()))
    missing = sorted(k for k in have if k not in weights)
    extra = sorted(k for k in weights if k not in have and not k.startswith("lm_head.") and "rotary_emb" not in k)
    if missing or extra:
        raise ValueError(
            f"{folder}: weights do not match the model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    bad = [k for k, v in have.items() if v.shape != weights[k].shape]
    if bad:
        raise ValueError(f"{folder}: shape mismatch for {bad[:5]}")
    from .config_check import check_attention_heads

    check_attention_heads(model, str(cfg_path))  # head counts that lie fail here, not in rope
    if lazy:
        from . import streaming

        # Left on disk, read by the block that uses them (mixbits.streaming).
        streaming.attach(model, sorted(folder.glob("model*.safetensors")), getattr(model, "sanitize", None))
    else:
        mx.eval(model.parameters())
    model.eval()
    if patch:
        _patch(model)
    eos = config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else eos
    tokenizer = Tokenizer.from_folder(folder, eos_token_ids=eos) if (folder / "tokenizer.json").exists() else None
    return model, tokenizer, config


def load(path, *, patch: bool = False, lazy: bool = False):
    """(model, tokenizer, config) from a folder written by :func:`save` (or
    mlx-lm), a ``.gguf`` file, or a keyword of :data:`mixbits.models.KEYWORDS`
    (``"smollm2"``, ``"gemma3"``).

    ``patch=True`` also swaps every remaining stock quantized layer for a
    mixbits one (see :func:`mixbits.patch`). ``lazy=True`` (a folder): the
    weights stay on disk until used, and code that runs the model block by
    block can let them go again (:mod:`mixbits.streaming`); a GGUF file is
    always read whole.
    """
    from .models import resolve_keyword

    path = resolve_keyword(path)
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from .models.gguf import load_gguf

        model, tokenizer, config = load_gguf(p)
        from .config_check import check_attention_heads

        check_attention_heads(model, f"{p}'s metadata")
        if patch:
            _patch(model)
        return model, tokenizer, config
    if p.is_dir():
        return _load_folder(p, patch, lazy)
    raise FileNotFoundError(f"model not found: {path!r} (expected 'smollm2', 'gemma3', a .gguf file, or a model folder)")
