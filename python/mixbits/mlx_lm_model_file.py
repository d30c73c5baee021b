"""The small architecture file that lets stock mlx-lm run a mixbits folder.

A folder whose quantized layers are all single MLX affine segments loads
with ``mlx_lm.load`` as it is. Layers only mixbits can run (several
K-segments in one weight, a column permutation) are listed in config.json's
``"mixbits"`` block alone, and mlx-lm would build plain placeholders for
them and refuse the unknown parameters. For such folders :func:`mixbits.save`
also writes :data:`MODEL_FILE` and names it under config.json's
``"model_file"`` key: mlx-lm's hook for custom architectures, which it
imports (as a file, not a package module) only when told to trust it --
``mlx_lm.load(folder, trust_remote_code=True)`` or ``--trust-remote-code``
on ``python -m mlx_lm generate / chat / server / evaluate``. mlx-lm then
calls ``ModelArgs.from_dict(config)`` and ``Model(args)``, runs
``model.sanitize(weights)``, quantizes the layers named in config.json's
``"quantization"`` and finally ``model.load_weights(weights, strict=True)``.

The file itself holds no model code: it imports :func:`model_classes` from
this module, so it runs with whatever mixbits is installed and says
``pip install mixbits`` when none is. :class:`Model` builds the stock
mlx-lm class of the config's ``model_type`` (an instance of a subclass of
it, so every attribute and method mlx-lm uses is the stock one), hands
mixbits' arrays back unchanged after the stock ``sanitize`` (they were
saved from the built model, already in their final layout), and on
``load_weights`` swaps in the mixbits layers with
:func:`mixbits.io.place_layers` -- the step :func:`mixbits.load` takes, so
both give the same model. :func:`mixbits.load` itself never runs the file.
"""

from __future__ import annotations

from pathlib import Path

MODEL_FILE = "mixbits_model.py"
# Bumped when the generated file's contract with model_classes() changes.
MODEL_FILE_FORMAT = 1

_TEMPLATE = '''\
"""Lets stock mlx-lm run this folder, whose quantized layers only mixbits
can run (several bit widths in one weight, or permuted columns).

mlx-lm imports this file (config.json "model_file") only when told to
trust it: mlx_lm.load(folder, trust_remote_code=True), or
--trust-remote-code on python -m mlx_lm generate / chat / server. It
builds the model's own mlx-lm architecture and puts mixbits layers where
config.json's "mixbits" block says. Written by mixbits {version}.
"""

MODEL_FILE_FORMAT = {format}

try:
    from mixbits.mlx_lm_model_file import model_classes
except ImportError as e:
    raise ImportError(
        "this model folder's quantized layers run only with mixbits: pip install mixbits "
        f"(importing it failed: {{e}})"
    ) from e

Model, ModelArgs = model_classes(MODEL_FILE_FORMAT)
'''


def model_file_text() -> str:
    from . import __version__

    return _TEMPLATE.format(version=__version__, format=MODEL_FILE_FORMAT)


def mixbits_only_layers(config: dict) -> list[str]:
    """Paths of the config's mixbits layers that stock mlx-lm cannot load:
    those without an entry in the mlx-lm ``quantization`` block (every
    single-segment affine layer gets one, see :func:`mixbits.io.quantization_config`)."""
    layers = (config.get("mixbits") or {}).get("layers") or {}
    native = config.get("quantization") or {}
    return [p for p in layers if p not in native]


def with_model_file(config: dict) -> dict:
    """``config`` naming :data:`MODEL_FILE` under ``"model_file"`` when it
    has mixbits-only layers, and without that key otherwise."""
    out = {k: v for k, v in config.items() if k != "model_file"}
    if mixbits_only_layers(out):
        out["model_file"] = MODEL_FILE
    return out


def write_model_file(folder, config: dict) -> None:
    """Write :data:`MODEL_FILE` into ``folder`` if ``config`` names it."""
    if config.get("model_file") == MODEL_FILE:
        (Path(folder) / MODEL_FILE).write_text(model_file_text())


# ---------------------------------------------------------------- runtime


def model_classes(file_format: int):
    """``(Model, ModelArgs)`` for a generated model file of ``file_format``."""
    if file_format != MODEL_FILE_FORMAT:
        raise ImportError(
            f"{MODEL_FILE} is of model file format {file_format}; the installed mixbits reads "
            f"format {MODEL_FILE_FORMAT}: pip install --upgrade mixbits, or save the folder again"
        )
    return Model, ModelArgs


class ModelArgs:
    """The whole config, as mlx-lm passes it to ``from_dict``: the stock
    architecture's arguments and the mixbits block are both read from it."""

    def __init__(self, config: dict):
        self.config = config

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        return cls(dict(config))


class Model:
    """``Model(args)`` gives the stock mlx-lm model of the config's
    ``model_type`` with mixbits' loading steps (see :class:`_MixbitsLoading`)."""

    def __new__(cls, args: ModelArgs):
        return build_model(args.config)


def build_model(config: dict):
    from mlx_lm.utils import _get_classes

    from .formats.mlx_config import mixbits_layers

    layers = mixbits_layers(config, required=True)
    stock_model, stock_args = _get_classes(config)
    # A subclass per load: the layers descriptor lives on the class, out of
    # the module tree (an nn.Module stores dict attributes as children).
    cls = type(stock_model.__name__, (_MixbitsLoading, stock_model), {"_mixbits_layers": layers})
    return cls(stock_args.from_dict(config))


class _MixbitsLoading:
    """Mixed in before the stock model class."""

    _mixbits_layers: dict = {}
    _mixbits_placed = False

    def _is_mixbits_key(self, key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in self._mixbits_layers for i in range(1, len(parts)))

    def sanitize(self, weights: dict) -> dict:
        # The stock sanitize sees every key (it decides structure from them,
        # e.g. gemma3 drops lm_head when no lm_head.weight is saved), but it
        # is written for checkpoints: what it does to mixbits' arrays, saved
        # from the built model in their final layout, is undone -- as
        # mixbits.load takes them from the file as they are.
        stock = getattr(super(), "sanitize", None)
        out = stock(dict(weights)) if stock is not None else dict(weights)
        out = {k: v for k, v in out.items() if not self._is_mixbits_key(k)}
        out.update((k, v) for k, v in weights.items() if self._is_mixbits_key(k))
        return out

    def load_weights(self, file_or_weights, strict: bool = True):
        # mlx-lm has quantized the stock layers by now; the mixbits layers
        # replace their placeholders once, from the arrays they will hold.
        # Later calls (e.g. LoRA adapters) go straight to the stock method.
        if not self._mixbits_placed:
            import mlx.core as mx

            from .io import place_layers

            if isinstance(file_or_weights, (str, Path)):
                file_or_weights = list(mx.load(str(file_or_weights)).items())
            place_layers(self, self._mixbits_layers, dict(file_or_weights))
            self._mixbits_placed = True
        return super().load_weights(file_or_weights, strict=strict)
