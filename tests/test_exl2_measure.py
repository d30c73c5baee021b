"""ExLlamaV2-style measurement.json from a model, read back by the formats
reader and the allocator; accuracy checked against a direct numpy formula."""

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mixbits.formats.exl2 import Measurement  # noqa: E402
from mixbits.measure.exl2_measure import measure_modules  # noqa: E402
from mixbits.nn import MixedQuantizedLinear  # noqa: E402
from tiny_model import tiny_llama, tiny_tokens  # noqa: E402


def test_measurement_file_and_accuracy(tmp_path):
    model = tiny_llama(layers=2, hidden=128)  # K >= 128: the 25% share is a whole group
    toks = tiny_tokens(n=2)
    out = tmp_path / "measurement.json"
    d = measure_modules(model, toks, ["2b_g64", "4b_g64", "4b25_2b_g64"], out, chunk=2,
                        progress=False)
    m = Measurement.load(out)
    assert json.loads(out.read_text()) == d
    keys = list(m.measured())
    assert keys == ["model.layers.0.self_attn", "model.layers.0.mlp",
                    "model.layers.1.self_attn", "model.layers.1.mlp"]
    for opts in m.measured().values():
        acc = [o.accuracy for o in opts]
        assert acc[1] > acc[0] and acc[1] > acc[2] > acc[0]  # 4 bits > 4/2 mix > 2 bits
        assert opts[0].total_bits < opts[2].total_bits < opts[1].total_bits
    # recompute one accuracy directly: layer 1 mlp at 2 bits
    # by hand, with the model's own modules: layer 1 input from model.layers[0]
    x = mx.array(toks)
    h = model.layers[0](model.model.embed_tokens(x), "causal", cache=None)
    layer = model.layers[1]
    y = np.array(layer(h, "causal", cache=None), dtype=np.float64)
    for name in ("gate_proj", "up_proj", "down_proj"):
        lin = getattr(layer.mlp, name)
        setattr(layer.mlp, name, MixedQuantizedLinear.from_linear(
            lin, [(2, 64, lin.weight.shape[1])], dtype=mx.float16))
    yq = np.array(layer(h, "causal", cache=None), dtype=np.float64)
    want = 1 - (np.linalg.norm(yq - y, axis=-1) / np.linalg.norm(y, axis=-1)).mean()
    assert m.modules["model.layers.1.mlp"][0].accuracy == pytest.approx(want, rel=1e-4)


def test_resume_and_ternary_refused(tmp_path):
    model = tiny_llama(layers=2)
    out = tmp_path / "m.json"
    with pytest.raises(ValueError, match="no ternary"):
        measure_modules(model, tiny_tokens(n=1), ["ternary_g64"], out, progress=False)
    first = measure_modules(model, tiny_tokens(n=1), ["4b_g64"], out, progress=False)
    again = measure_modules(model, tiny_tokens(n=1), ["4b_g64"], out, resume=True, progress=False)
    assert again == first
