"""Formats of the field on the two real files in ../shared/data: parse,
JSON-equal round trips, recomputed summaries, EXL2 -> segments, and errors
that name the key path."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from mixbits.formats import (
    Allocation,
    FormatError,
    Measurement,
    MlxQuantization,
    ProjectionQuant,
    SensitivityTable,
    projection_shapes,
    read_config,
    with_quantization,
    write_config,
)
from mixbits.formats.mlx_config import from_allocation

from shared_files import ALLOC, DATA, HF_CONFIG, MEAS  # noqa: E402,F401


@pytest.fixture(scope="module")
def meas_raw():
    return json.loads(MEAS.read_text())


@pytest.fixture(scope="module")
def alloc_raw():
    return json.loads(ALLOC.read_text())


# ------------------------------------------------------------------ EXL2


def test_measurement_parses_into_typed_objects(meas_raw):
    m = Measurement.from_dict(meas_raw)
    assert len(m.modules) == 98
    assert m.modules["model.norm.norm"] is None and m.modules["lm_head.linear"] is None
    measured = m.measured()
    assert len(measured) == 96
    assert sum(len(v) for v in measured.values()) == 1728
    assert m.last_module_idx == 98
    o = measured["model.layers.0.self_attn"][0]
    assert o.accuracy == 0.9571942185100756 and o.total_bits == 80752640
    q = o.projections["q_proj"]
    assert q.bits == (3, 2) and q.bits_prop == (0.05, 0.95) and q.group_size == {3: 64, 2: 64}
    assert q.scale_bits == 4
    assert set(measured["model.layers.5.mlp"][0].projections) == {"gate_proj", "up_proj", "down_proj"}


def test_measurement_round_trip_is_json_equal(meas_raw, tmp_path):
    m = Measurement.load(MEAS)
    assert m.to_dict() == meas_raw
    out = tmp_path / "m.json"
    m.save(out)
    assert json.loads(out.read_text()) == meas_raw
    assert Measurement.load(out).to_dict() == meas_raw


def test_total_bits_recomputed_from_shapes_match_every_option():
    m = Measurement.load(MEAS)
    assert m.check_total_bits(projection_shapes(HF_CONFIG)) == 1728


def test_total_bits_by_hand():
    # q_proj of layers.0.self_attn option 0: 3-bit on 5% and 2-bit on 95%, g64, K=N=4096.
    q = ProjectionQuant.from_dict(
        {"group_size": {"3": 64, "2": 64}, "bits": [3, 2], "bits_prop": [0.05, 0.95], "scale_bits": 4}, "q")
    # 0.05*4096 = 204.8 -> 4 groups = 256 rows at 3 bits; the other 3840 rows (60 groups) at 2 bits
    weights = 256 * 4096 * 3 + 3840 * 4096 * 2
    overhead = 64 * 16 + 64 * 32 + 64 * 4096 * 4 + 4096 * 32
    assert q.total_bits(4096, 4096) == weights + overhead == 35785728
    kv = 256 * 512 * 3 + 3840 * 512 * 2 + 64 * 16 + 64 * 32 + 64 * 512 * 4 + 4096 * 32
    # q, o (4096 x 4096) plus k, v (4096 x 512): the file's 80752640
    assert 2 * 35785728 + 2 * kv == 80752640


def test_total_bits_mismatch_is_reported_with_its_path(meas_raw):
    raw = copy.deepcopy(meas_raw)
    raw["measurement"]["model.layers.7.mlp"][3]["total_bits"] += 16
    m = Measurement.from_dict(raw)
    with pytest.raises(FormatError, match=r"measurement\['model.layers.7.mlp'\]\[3\]\['total_bits'\]: stored"):
        m.check_total_bits(projection_shapes(HF_CONFIG))
    wrong = dict(HF_CONFIG, intermediate_size=14336)  # another model's shapes
    with pytest.raises(FormatError, match="total_bits"):
        Measurement.from_dict(meas_raw).check_total_bits(projection_shapes(wrong))


def _quant(bits, props, gs, scale_bits=4):
    return ProjectionQuant.from_dict({"group_size": {str(b): g for b, g in zip(bits, gs)}, "bits": list(bits),
                                      "bits_prop": list(props), "scale_bits": scale_bits}, "p")


def test_segments_by_hand():
    # down_proj, K = 11008: 0.05*K = 550.4 -> 18 groups of 32 = 576 rows; 0.2*K = 2201.6 -> 35 groups of 64 = 2240
    q = _quant((6, 3, 2), (0.05, 0.2, 0.75), (32, 64, 64))
    assert q.segments(11008) == [(6, 32, 576), (3, 64, 2240), (2, 64, 8192)]
    # EXL2 gives 8-bit 7 groups of 32 = 224 rows, then 3872 rows of g128, not whole groups:
    # the boundary rounds up to a multiple of 128 (the later group size)
    q = _quant((8, 4), (0.05, 0.95), (32, 128))
    assert [r for _, _, r in q.row_split(4096)] == [224, 3872]
    assert q.segments(4096) == [(8, 32, 256), (4, 128, 3840)]
    assert _quant((4,), (1.0,), (128,)).segments(4096) == [(4, 128, 4096)]


def test_segments_of_every_option_are_valid_and_follow_exl2():
    m = Measurement.load(MEAS)
    shapes = projection_shapes(HF_CONFIG)
    distinct = {}
    for opts in m.measured().values():
        for o in opts:
            for name, q in o.projections.items():
                k = shapes[name][0]
                segs = q.segments(k)
                assert sum(s[2] for s in segs) == k
                assert all(kc % g == 0 and kc > 0 for _, g, kc in segs)
                assert [b for b, _, _ in segs] == sorted((b for b, _, _ in segs), reverse=True)
                # where EXL2's split is already whole groups, the segments are exactly it
                split = q.row_split(k)
                if all(rows % q.group_size[b] == 0 for b, _, rows in split):
                    assert segs == [(b, q.group_size[b], rows) for b, _, rows in split if rows]
                distinct[(k, tuple(segs))] = True
    assert len(distinct) > 20
    # mixbits.quantize accepts them (a few distinct ones, 8 output rows)
    mixbits = pytest.importorskip("mixbits")
    import mlx.core as mx

    rng = np.random.default_rng(0)
    for k, segs in list(distinct)[:6]:
        w = mx.array(rng.normal(size=(8, k)).astype(np.float32))
        qt = mixbits.quantize(w, list(segs))
        assert qt.shape == (8, k) and qt.specs == list(segs)


def test_segments_reject_what_mixbits_cannot_store():
    with pytest.raises(ValueError, match="not a multiple"):
        _quant((4,), (1.0,), (128,)).segments(4000)
    with pytest.raises(ValueError, match="descending"):
        _quant((2, 3), (0.5, 0.5), (64, 64)).segments(4096)
    with pytest.raises(ValueError, match="group size 256"):
        _quant((4,), (1.0,), (256,)).segments(4096)


def _bad(meas_raw, edit):
    raw = copy.deepcopy(meas_raw)
    edit(raw["measurement"])
    return raw


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["model.layers.3.mlp"][2].__setitem__("accuracy", "x"),
     "measurement['model.layers.3.mlp'][2]['accuracy']: expected a number, got 'x'"),
    (lambda m: m["model.layers.3.mlp"][2].pop("total_bits"),
     "measurement['model.layers.3.mlp'][2]: missing key 'total_bits'"),
    (lambda m: m["model.layers.1.self_attn"][0]["q_proj"].__setitem__("bits", [3, -2]),
     "measurement['model.layers.1.self_attn'][0]['q_proj']['bits'][1]: unknown bit width -2"),
    (lambda m: m["model.layers.1.self_attn"][0]["q_proj"].__setitem__("bits", [7, 2]),
     "measurement['model.layers.1.self_attn'][0]['q_proj']['bits'][0]: unknown bit width 7"),
    (lambda m: m["model.layers.1.self_attn"][0]["k_proj"].__setitem__("bits_prop", [0.5, 0.4]),
     "['k_proj']['bits_prop']: proportions sum to"),
    (lambda m: m["model.layers.1.self_attn"][0]["k_proj"]["group_size"].pop("3"),
     "['k_proj']['group_size']: missing key '3'"),
    (lambda m: m["model.layers.1.self_attn"][0]["v_proj"].__setitem__("scale_bits", "4"),
     "['v_proj']['scale_bits']: expected an integer, got '4'"),
    (lambda m: m.__setitem__("model.layers.2.mlp", {"accuracy": 1}),
     "measurement['model.layers.2.mlp']: expected a list, got an object"),
    (lambda m: m.__setitem__("model.layers.2.mlp", []),
     "measurement['model.layers.2.mlp']: empty option list"),
    (lambda m: m["model.layers.4.mlp"].__setitem__(1, 3),
     "measurement['model.layers.4.mlp'][1]: expected an object, got 3"),
    (lambda m: m["model.layers.4.mlp"][1].__setitem__("total_bits", 1.5),
     "measurement['model.layers.4.mlp'][1]['total_bits']: expected an integer, got 1.5"),
    (lambda m: m["model.layers.4.mlp"][1].__setitem__("accuracy", 1.2),
     "['accuracy']: must be <= 1.0"),
])
def test_measurement_errors_name_the_key_path(meas_raw, edit, message):
    with pytest.raises(FormatError) as e:
        Measurement.from_dict(_bad(meas_raw, edit))
    assert message in str(e.value)


def test_measurement_structural_errors(tmp_path):
    with pytest.raises(FormatError, match="missing key 'measurement'"):
        Measurement.from_dict({"last_module_idx": 3})
    with pytest.raises(FormatError, match="no module has measured options"):
        Measurement.from_dict({"measurement": {"lm_head.linear": None}})
    with pytest.raises(FormatError, match="expected an object, got a list"):
        Measurement.from_dict([1, 2])
    with pytest.raises(FormatError, match="file not found"):
        Measurement.load(tmp_path / "nope.json")


def test_truncated_json_names_file_and_position(tmp_path):
    bad = tmp_path / "measurement.json"
    bad.write_bytes(MEAS.read_bytes()[:5000])
    with pytest.raises(FormatError, match=r"measurement.json is not valid JSON \(line 1, column \d+"):
        Measurement.load(bad)
    bad = tmp_path / "allocation.json"
    bad.write_bytes(ALLOC.read_bytes()[:3000])
    with pytest.raises(FormatError, match=r"allocation.json is not valid JSON \(line \d+"):
        Allocation.load(bad)


def test_projection_shapes_from_hf_config(tmp_path):
    sh = projection_shapes(HF_CONFIG)
    assert sh["q_proj"] == (4096, 4096) and sh["k_proj"] == (4096, 512) and sh["v_proj"] == (4096, 512)
    assert sh["o_proj"] == (4096, 4096) and sh["gate_proj"] == (4096, 11008) and sh["down_proj"] == (11008, 4096)
    p = tmp_path / "config.json"
    p.write_text(json.dumps({k: v for k, v in HF_CONFIG.items() if k != "head_dim"}))
    assert projection_shapes(p) == sh  # head_dim defaults to hidden / heads
    with pytest.raises(FormatError, match=r"config: missing key 'intermediate_size'"):
        projection_shapes({k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"})
    with pytest.raises(FormatError, match=r"config\['num_key_value_heads'\]: expected an integer, got 'four'"):
        projection_shapes(dict(HF_CONFIG, num_key_value_heads="four"))


# ------------------------------------------------------------ allocation.json


def test_allocation_parses_round_trips_and_recomputes(alloc_raw, tmp_path):
    a = Allocation.load(ALLOC)
    assert len(a.assignment) == 186
    assert a.embed_bits == 8 and a.budget == {"low_avg": 3.4, "high_avg": 3.5}
    assert a.joint_refine["swaps"] == 12 and a.joint_refine["calibration_n"] == 20
    kinds = {e.kind for e in a.assignment}
    assert kinds == {"2", "3", "4", "ternary"}
    # summaries recomputed here with plain arithmetic on the raw JSON
    n = sum(e["nparams"] for e in alloc_raw["assignment"])
    avg = sum(e["nparams"] * e["bits"] for e in alloc_raw["assignment"]) / n
    assert avg == pytest.approx(alloc_raw["average_bits"], rel=1e-12)
    assert sum(e["kl"] for e in alloc_raw["assignment"]) == pytest.approx(alloc_raw["sum_kl"], rel=1e-12)
    assert a.to_dict() == alloc_raw
    out = tmp_path / "a.json"
    a.save(out)
    assert json.loads(out.read_text()) == alloc_raw


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.__setitem__("average_bits", 3.45), "['average_bits']: stored average_bits 3.45 !="),
    (lambda d: d.__setitem__("sum_kl", 3.0), "['sum_kl']: stored sum_kl 3.0 !="),
    (lambda d: d["assignment"][5].__setitem__("bits", 7), "assignment[5]['bits']: unknown bit width 7"),
    (lambda d: d["assignment"][5].__setitem__("bits", -4), "assignment[5]['bits']: unknown bit width -4"),
    (lambda d: d["assignment"][5].__setitem__("kind", "3"), "assignment[5]: kind '3' disagrees with bits=4"),
    (lambda d: d["assignment"][9].pop("nparams"), "assignment[9]: missing key 'nparams'"),
    (lambda d: d["assignment"][9].__setitem__("kl", None), "assignment[9]['kl']: expected a number, got null"),
    (lambda d: d["assignment"][9].__setitem__("layer", 3), "assignment[9]['layer']: 3 but the path says layer 1"),
    (lambda d: d["assignment"].append(dict(d["assignment"][0])), "already assigned at assignment[0]"),
    (lambda d: d["budget"].__setitem__("high_avg", 3.45), "['budget']: average_bits"),
    (lambda d: d.__setitem__("assignment", {}), "assignment: expected a list, got an object"),
])
def test_allocation_errors(alloc_raw, edit, message):
    raw = copy.deepcopy(alloc_raw)
    edit(raw)
    with pytest.raises(FormatError) as e:
        Allocation.from_dict(raw)
    assert message in str(e.value)


# --------------------------------------------------------- mlx-lm config


def test_mlx_quantization_block_round_trip(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64}
    q = MlxQuantization(group_size=64, bits=4)
    q.set_override("model.layers.0.mlp.down_proj", 6, 32)
    q.overrides["lm_head"] = False
    path = tmp_path / "config.json"
    write_config(path, cfg, q)
    raw = json.loads(path.read_text())
    assert raw["quantization"] == raw["quantization_config"] == {
        "group_size": 64, "bits": 4, "mode": "affine",
        "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 6}, "lm_head": False}
    assert raw["model_type"] == "llama"
    cfg2, q2 = read_config(path)
    assert q2.for_path("model.layers.0.mlp.down_proj") == {"group_size": 32, "bits": 6}
    assert q2.for_path("model.layers.0.mlp.up_proj") == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert q2.for_path("lm_head") is False
    assert with_quantization(cfg2, q2) == raw
    assert read_config({"model_type": "llama"}) == ({"model_type": "llama"}, None)


def test_mlx_quantization_errors():
    with pytest.raises(FormatError, match=r"quantization\['model.layers.0.mlp'\]\['bits'\]: unknown bit width 7"):
        MlxQuantization.from_block({"group_size": 64, "bits": 4, "model.layers.0.mlp": {"group_size": 64, "bits": 7}})
    with pytest.raises(FormatError, match="quantization: missing key 'bits'"):
        MlxQuantization.from_block({"group_size": 64})
    with pytest.raises(FormatError, match=r"\['group_size'\]: 48 is not one of"):
        MlxQuantization.from_block({"group_size": 48, "bits": 4})


def test_mlx_overrides_from_allocation():
    a = Allocation.load(ALLOC)
    with pytest.raises(ValueError, match="ternary"):
        from_allocation(a)
    a.assignment = [e for e in a.assignment if e.kind != "ternary"]
    q = from_allocation(a, group_size=64)
    assert q.bits == 4  # the most common choice
    for e in a.assignment:
        assert q.for_path(e.path)["bits"] == e.bits


# ------------------------------------------------------- sensitivity table


def _table_from_allocation(alloc_raw):
    entries = []
    for e in alloc_raw["assignment"]:
        cands = [{"kind": str(b), "bits": b, "kl": e["kl"] * 2.0 ** (e["bits"] - b), "kl_stderr": 0.001}
                 for b in (2, 3, 4)]
        entries.append({"path": e["path"], "layer": e["layer"], "nparams": e["nparams"], "candidates": cands})
    return {"format": "mixbits.sensitivity", "version": 1, "metric": "kl", "embed_bits": 8,
            "meta": {"model": "hybrid-24"}, "entries": entries}


def test_sensitivity_table_round_trip(alloc_raw, tmp_path):
    raw = _table_from_allocation(alloc_raw)
    t = SensitivityTable.from_dict(raw)
    assert len(t.entries) == 186 and t.total_params == sum(e["nparams"] for e in alloc_raw["assignment"])
    assert t.to_dict() == raw
    t.save(tmp_path / "t.json")
    assert SensitivityTable.load(tmp_path / "t.json").to_dict() == raw
    a = t.to_allocation([2] * len(t.entries), high_avg=4.0, count="nominal")  # all 4-bit
    assert a.average_bits == 4.0 and a.embed_bits == 8
    assert Allocation.from_dict(a.to_dict()).to_dict() == a.to_dict()


def test_sensitivity_table_errors():
    good = {"format": "mixbits.sensitivity", "version": 1, "entries": [
        {"path": "model.layers.0.mlp.up_proj", "nparams": 4096,
         "candidates": [{"kind": "4b_g64", "bits": 4, "kl": 0.1, "storage_bits": 18432}]}]}
    t = SensitivityTable.from_dict(good)
    assert t.entries[0].layer == 0 and t.entries[0].candidates[0].storage_bits == 18432
    cases = [
        (("format",), "x", "table['format']: expected 'mixbits.sensitivity'"),
        (("version",), 2, "knows version 1, got 2"),
        (("entries", 0, "nparams"), -5, "entries[0]['nparams']: must be >= 1, got -5"),
        (("entries", 0, "candidates", 0, "bits"), 9, "entries[0]['candidates'][0]['bits']: unknown bit width 9"),
        (("entries", 0, "candidates", 0, "bits"), 1.5, "fractional width 1.5"),
        (("entries", 0, "candidates", 0, "kl"), "0.1", "['kl']: expected a number, got '0.1'"),
        (("entries", 0, "candidates", 0, "storage_bits"), 0, "['storage_bits']: must be >= 1"),
        (("entries", 0, "candidates"), [], "entries[0]['candidates']: no candidates"),
    ]
    for keys, value, message in cases:
        raw = copy.deepcopy(good)
        d = raw
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        with pytest.raises(FormatError) as e:
            SensitivityTable.from_dict(raw)
        assert message in str(e.value), (keys, str(e.value))
    raw = copy.deepcopy(good)
    raw["entries"][0]["candidates"].append(dict(raw["entries"][0]["candidates"][0]))
    with pytest.raises(FormatError, match="'kind'.*repeats"):
        SensitivityTable.from_dict(raw)


def _sweep_like_table():
    """What a measurement sweep writes: candidate names as kinds, fractional
    nominal widths for mixed candidates, storage bits, extra metadata."""
    def cand(kind, bits, kl, storage):
        return {"kind": kind, "bits": bits, "kl": kl, "kl_stderr": kl / 10, "storage_bits": storage,
                "bpw": storage / 4096, "group_size": 64}
    entries = []
    for i, path in enumerate(["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]):
        entries.append({"path": path, "layer": i, "nparams": 4096, "shape": [64, 64], "seconds": 0.5,
                        "candidates": [cand("4b_g64", 4, 0.01 + i, 18432), cand("4b10_3b_g64", 3.1, 0.05 + i, 14746),
                                       cand("8b50_6b_g64", 7.0, 0.001, 32768), cand("ternary_g64", 2, 0.9, 10240)]})
    return {"format": "mixbits.sensitivity", "version": 1, "metric": "kl", "meta": {"model": "tiny"},
            "complete": True, "entries": entries}


def test_sweep_written_table_reads_and_round_trips():
    raw = _sweep_like_table()
    t = SensitivityTable.from_dict(raw)
    assert t.to_dict() == raw and t.complete
    c = t.entries[0].candidates
    assert [x.bits for x in c] == [4, 3.1, 7.0, 2] and c[1].storage_bits == 14746
    a = t.to_allocation([1, 2], high_avg=8.0, count="storage")
    assert a.average_bits == pytest.approx((3.1 + 7.0) / 2)
    assert a.budget == {"low_avg": None, "high_avg": 8.0, "count": "storage"}
    assert Allocation.from_dict(a.to_dict()).to_dict() == a.to_dict()
    bad = copy.deepcopy(raw)
    bad["entries"][0]["candidates"][3]["bits"] = 3
    with pytest.raises(FormatError, match=r"entries\[0\]\['candidates'\]\[3\]: kind 'ternary_g64' is stored as 2 bits"):
        SensitivityTable.from_dict(bad)
