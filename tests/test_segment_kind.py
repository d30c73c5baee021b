"""A segment carries its kind (affine / ternary) from quantize through the
layer and a saved folder, so no module has to re-derive it."""

import mlx.core as mx
import numpy as np

import mixbits
from mixbits.measure.candidates import build_layer, parse_candidate
from mixbits.nn import MixedQuantizedLinear


def test_kind_travels_with_the_segment(tmp_path):
    import tiny_models

    w = mx.random.normal((32, 256), key=mx.random.key(0))
    qt = mixbits.quantize(w, [("ternary", 64, 128), (4, 64, 128)])
    assert [s.kind for s in qt.segments] == ["ternary", "affine"]
    assert [s.bits for s in qt.segments] == [2, 4]
    layer = MixedQuantizedLinear.from_tensor(qt)
    assert layer.layout.kinds == ("ternary", "affine")
    assert [s.kind for s in layer.quantized_tensor().segments] == ["ternary", "affine"]
    # ternary codes really are {-s, 0, +s}: 3 distinct values per group
    deq = np.array(qt.dequantize())[:, :64]
    assert all(len(np.unique(np.round(r, 5))) <= 3 for r in deq)

    model, cfg = tiny_models.build("llama")
    path = "model.layers.0.mlp.down_proj"
    new = build_layer(model.layers[0].mlp.down_proj, parse_candidate("ternary_g64"))
    assert new.layout.kinds == ("ternary",)
    model.layers[0].mlp.down_proj = new
    mixbits.save(model, tmp_path / "m", cfg)
    loaded, _, _ = mixbits.load(tmp_path / "m")
    got = dict(loaded.named_modules())[path]
    assert got.layout.kinds == ("ternary",)
