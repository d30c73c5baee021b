"""bench/quality_protocol.py's invariants: held-out windows never among any
seed's calibration windows, seed 0 is exactly convert's default cut, the
paired bootstrap's ratio, and the group-size choice per budget."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality_protocol as qp  # noqa: E402


def test_ratio_ci_is_the_ratio_of_means_and_pairs_sequences():
    rng = np.random.default_rng(1)
    b = rng.uniform(1, 3, 16)
    a = 0.5 * b  # paired: every resample has ratio exactly 0.5
    r, ci = qp.ratio_ci(a, b)
    assert r == 0.5 and abs(ci[0] - 0.5) < 1e-12 and abs(ci[1] - 0.5) < 1e-12
    # two seeds of mixbits against one contender row: ratio of the pooled means
    a2 = np.stack([0.4 * b, 0.6 * b])
    r2, ci2 = qp.ratio_ci(a2, b)
    assert abs(r2 - 0.5) < 1e-12 and ci2[0] <= r2 <= ci2[1]
    # unpaired noise widens the interval
    _, ci3 = qp.ratio_ci(rng.permutation(a), b)
    assert ci3[1] - ci3[0] > 0.01


def test_finest_fitting_takes_the_smallest_group_within_each_budget():
    plans = {"uniform 3b_g32": {"w": "3b_g32"}, "uniform 3b_g64": {"w": "3b_g64"},
             "mlx-lm mixed_3_4 g32": {"w": "m32"}, "mlx-lm mixed_3_4 g64": {"w": "m64"}}
    bpw = {"3b_g32": 4.0, "3b_g64": 3.5, "m32": 4.1, "m64": 3.6}
    got = qp.finest_fitting(plans, lambda p: bpw[p["w"]], [3.5, 4.0])
    assert sorted(got) == ["mlx-lm mixed_3_4 g64", "uniform 3b_g32", "uniform 3b_g64"]


def test_token_sets_seed0_is_converts_cut_and_heldout_is_disjoint():
    import mixbits
    from mixbits.measure.calib import load_texts, token_sequences

    _, tok, _ = mixbits.load("smollm2")
    calib, held = qp.token_sets(tok, [0, 1, 2])
    assert np.array_equal(calib[0], token_sequences(tok, load_texts(None, "auto"), qp.N_CAL, qp.SEQ_LEN))
    assert not np.array_equal(calib[1], calib[2])
    seen = {w.tobytes() for s in calib for w in calib[s]}
    for name, h in held.items():
        assert h.shape == (qp.HELD_N, qp.SEQ_LEN)
        assert not any(w.tobytes() in seen for w in h), name
    # the in-domain set is the story, not the Gutenberg license after it
    assert "Project Gutenberg" not in tok.decode(list(held["botchan_story_tail"].ravel()))
    # a small calibration set (--n-cal 2): still convert's own cut, and the held-out sets unchanged
    small, held2 = qp.token_sets(tok, [0, 1], n_cal=2)
    assert np.array_equal(small[0], token_sequences(tok, load_texts(None, "auto"), 2, qp.SEQ_LEN))
    assert small[1].shape == (2, qp.SEQ_LEN)
    assert all(np.array_equal(held[k], held2[k]) for k in held)


def test_summarize_pairs_each_seed_with_the_contenders_same_seed_row():
    # records written seed 1 first (a --records-from merge keeps the other file's order)
    b = np.linspace(1.0, 2.0, 16)
    recs = {"llama.cpp Q3_K_M+imatrix seed1": {"bpw": 4.6, "kl": {"licenses": list(4 * b)}},
            "llama.cpp Q3_K_M+imatrix seed0": {"bpw": 4.6, "kl": {"licenses": list(2 * b)}},
            "llama.cpp Q3_K_M+imatrix seed7": {"bpw": 4.6, "kl": {"licenses": list(100 * b)}},  # not a seed here
            "uniform 4b_g64": {"bpw": 4.5, "kl": {"licenses": list(10 * b)}},
            "mixbits @5 seed0": {"bpw": 5.0, "kl": {"licenses": list(1 * b)}},
            "mixbits @5 seed1": {"bpw": 5.0, "kl": {"licenses": list(3 * b)}}}
    (row,) = qp.summarize(recs, [5.0], [0, 1], [0, 1])
    best = row["contenders"][0]
    assert best["name"] == "llama.cpp Q3_K_M+imatrix" and abs(best["kl"] - 3 * b.mean()) < 1e-12
    assert abs(best["ratio"] - 4 / 6) < 1e-12  # pooled means (1 + 3) / (2 + 4)
    per = best["ratio_per_seed"]
    assert abs(per["0"]["ratio"] - 0.5) < 1e-12 and abs(per["1"]["ratio"] - 0.75) < 1e-12
    assert abs(per["1"]["ci95"][0] - 0.75) < 1e-12  # paired: exact in every resample
    # a seedless contender: both seeds against its one row
    uni = next(c for c in row["contenders"] if c["name"] == "uniform 4b_g64")
    assert abs(uni["ratio_per_seed"]["0"]["ratio"] - 0.1) < 1e-12
    assert abs(uni["ratio_per_seed"]["1"]["ratio"] - 0.3) < 1e-12


def test_summarize_only_writes_the_records_summary_without_a_model(tmp_path, monkeypatch):
    import json

    b = np.linspace(1.0, 2.0, 16)
    recs = {"uniform 4b_g64": {"bpw": 4.5, "kl": {"licenses": list(2 * b)}},
            "mlx-lm gptq 4b_g64 seed0": {"bpw": 4.5, "kl": {"licenses": list(3 * b)}},
            "uniform 2b_g32": {"bpw": 3.0, "kl": {"licenses": list(9 * b)}},
            "mixbits @4.5 seed0": {"bpw": 4.5, "kl": {"licenses": list(1 * b)}}}
    (tmp_path / "records_smollm2.json").write_text(json.dumps(recs))
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["quality_protocol.py", "--seeds", "0", "--budgets", "4.5", "--work",
                                      str(tmp_path), "--result", str(out), "--summarize-only", "--held-out",
                                      "licenses"])
    qp.main()
    r = json.loads(out.read_text())
    (row,) = r["summary"]["licenses"]
    names = [c["name"] for c in row["contenders"]]
    assert names == ["uniform 4b_g64", "mlx-lm gptq 4b_g64", "uniform 2b_g32"]
    assert abs(row["contenders"][0]["ratio"] - 0.5) < 1e-12 and abs(row["contenders"][1]["ratio"] - 1 / 3) < 1e-12
    assert r["protocol"]["mlx_lm_quantizers"]["methods"] == ["gptq"] and "DWQ" not in \
        r["protocol"]["mlx_lm_quantizers"]["calibration"]
    assert r["records"] == recs


def test_bpw_counts_an_embeddings_row_bands_and_only_where_they_fit():
    # The protocol's storage count of a mixbits plan with a banded embedding
    # (8b@64_4b_g32) against the format's own count: hot rows at 8 bits,
    # the rest at 4, an fp16 scale and bias per group of 32, every tensor.
    import tiny_models
    from mixbits.adapter import ModelAdapter
    from mixbits.measure.candidates import build_layer, parse_candidate

    model, _ = tiny_models.build("llama_tied")
    ad = ModelAdapter(model)

    class Layers:
        def layer(self, path, kind):
            return build_layer(ad.get(path), parse_candidate(kind))

    sc = qp.Scorer.__new__(qp.Scorer)
    sc.sites, sc.evals = list(ad.sites), {"held": Layers()}
    sc.table = qp.size_table(sc.sites, ["4b_g32"])
    emb = next(s for s in sc.sites if s.form == "embedding")
    plan = {s.path: "4b_g32" for s in sc.sites} | {emb.path: "8b@64_4b_g32"}
    vocab, dims = emb.shape
    bits = sum(s.nparams * 5 for s in sc.sites if s is not emb)
    bits += 64 * dims * 8 + (vocab - 64) * dims * 4 + vocab * dims // 32 * 32
    assert sc.bpw(plan) == pytest.approx(bits / sum(s.nparams for s in sc.sites), rel=1e-12)


def test_llama_cpp_ids_compared_with_the_bos_it_prepends():
    import kquant

    want = [5, 6, 7, 8]
    # SmolLM2: no BOS asked for; the same ids, or the first place they part
    assert kquant.compare_ids([5, 6, 7, 8], want, None)["equal"]
    r = kquant.compare_ids([5, 6, 9, 8], want, None)
    assert not r["equal"] and r["first_difference"] == 2
    r = kquant.compare_ids([5, 6, 7], want, None)
    assert not r["equal"] and r["first_difference"] == 3
    # Gemma, seed 0: the windows start at the text's own BOS, which llama.cpp gives back
    r = kquant.compare_ids([2, 6, 7, 8], [2, 6, 7, 8], 2)
    assert r["equal"] and not r["bos_prepended"] and r["imatrix_chunks_start_at_bos"]
    # Gemma, seeds > 0: windows from mid-text; llama.cpp's stream is BOS, then the same ids
    r = kquant.compare_ids([2, 5, 6, 7, 8], want, 2)
    assert r["equal"] and r["bos_prepended"] and r["llama_cpp_tokens"] == 5
    # a BOS only where none was asked for is a difference, not a prefix
    assert not kquant.compare_ids([2, 5, 6, 7, 8], want, None)["equal"]
    assert not kquant.compare_ids([2, 5, 6, 9, 8], want, 2)["equal"]
