"""One tiny config per architecture in the installed mlx-lm's models/ folder.

``python tests/arch_configs.py --write`` builds a random model from each
architecture's own ModelArgs with a small config (hidden 64, 2 layers,
vocabulary 160 unless the architecture needs otherwise), runs it on
tokens (each in its own process: a native crash ends only its row), and
writes tests/data/architectures/<name>.json: the config, or
``{"refused": reason}`` when the architecture cannot run on text alone
(or mlx-lm's own code fails on a tiny config). Rerun it when mlx-lm is
bumped: tests/test_architectures.py fails while the folder's list and the
data differ.

Configs: tests/tiny_models.py's where it has the architecture (those are
tuned by hand: MoE, MLA, hybrids), else a generic base plus the few
fields an architecture names differently (below)."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "architectures"
VOCAB = 160
MAX_PARAMS = 3_000_000

# Field names mlx-lm's architectures use for the same few sizes.
BASE = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-5, layer_norm_eps=1e-5,
    norm_eps=1e-5, layer_norm_epsilon=1e-5, max_position_embeddings=512, rope_theta=10000.0,
    # gpt2 / gpt_neox / phi-style names
    n_embd=64, n_layer=2, n_head=4, n_positions=512, n_ctx=512, d_model=64, n_layers=2, n_heads=4,
    num_layers=2, dim=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=128, hidden_dim=128,
    # MoE names
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, top_k=2,
    moe_intermediate_size=64, n_shared_experts=1, num_shared_experts=1, shared_expert_intermediate_size=64,
    first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)

# Building blocks of the per-architecture fields: a wrapper's text model,
# multi-head latent attention, MoE, a sliding + full layer pair.
_TEXT = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, rms_norm_eps=1e-5,
             max_position_embeddings=512, rope_theta=10000.0)
_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
_MOE = {k: BASE[k] for k in ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                              "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                              "n_group", "topk_group", "shared_expert_intermediate_size",
                              "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob")}
_SW2 = ["sliding_attention", "full_attention"]
# Per-architecture fields beyond BASE and the guesses of _guess (found by
# running --write: each is what that architecture's code reads).
EXTRA: dict[str, dict] = {
    "afm7": dict(num_kv_reuse_layers=1, num_hidden_layers=3),
    "afmoe": dict(layer_types=_SW2, sliding_window=8, num_dense_layers=1),
    "baichuan_m1": dict(sliding_window_layers=[0], sliding_window=8, conv_window=2),
    "cohere2": dict(sliding_window_pattern=2, sliding_window=8),
    "dbrx": dict(ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
                 attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0)),
    "deepseek_v32": dict(**_MLA, index_head_dim=16, index_n_heads=2, index_topk=8),
    "deepseek_v41": dict(**_MLA),
    "exaone4": dict(rope_scaling=None, sliding_window=8, sliding_window_pattern="LG"),
    "exaone_moe": dict(layer_types=_SW2, sliding_window=8, is_moe_layer=[False, True]),
    "gemma4_text": dict(layer_types=_SW2, sliding_window=8, num_kv_shared_layers=0,
                        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                        global_head_dim=16),
    "gemma4": dict(text_config=dict(model_type="gemma4_text", **_TEXT, layer_types=_SW2, sliding_window=8,
                                    num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB,
                                    hidden_size_per_layer_input=16, global_head_dim=16)),
    "glm4_moe_lite": dict(**_MLA),
    "glm_moe_dsa": dict(topk_method="noaux_tc", **_MLA, index_head_dim=16, index_n_heads=2, index_topk=8,
                        rope_parameters=dict(rope_theta=10000.0)),
    "gptj": dict(rotary_dim=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                             mamba_chunk_size=8, shared_intermediate_size=64),
    "hunyuan": dict(rope_scaling=dict(alpha=1.0, factor=1.0, type="dynamic"), moe_topk=2,
                    num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False),
    "kimi_linear": dict(linear_attn_config=dict(kda_layers=[1], full_attn_layers=[2], num_heads=4,
                                                head_dim=16, short_conv_kernel_size=4),
                        **_MLA, model_max_length=512),
    "lfm2": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, block_dim=64,
                 block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], conv_L_cache=3, num_dense_layers=1,
                     use_expert_bias=True),
    "llama4": dict(text_config=dict(_TEXT, **{**_MOE, "num_experts_per_tok": 1}, model_type="llama4_text",
                                    rope_scaling=None, num_hidden_layers=4,  # layer 4 is the global one
                                    intermediate_size_mlp=128, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
                                    interleave_moe_layer_step=1, attention_chunk_size=8)),
    "llama4_text": dict(intermediate_size_mlp=128, no_rope_layers=[1, 0], use_qk_norm=True,
                        interleave_moe_layer_step=1, attention_chunk_size=8),
    "mamba2": dict(time_step_limit=[0.0, 1e9], num_heads=4, head_dim=16, n_groups=1, state_size=8,
                   conv_kernel=4, expand=2, chunk_size=8),
    "mellum": dict(layer_types=_SW2, sliding_window=8,
                   rope_parameters=dict(sliding_attention=dict(rope_theta=10000.0),
                                        full_attention=dict(rope_theta=10000.0))),
    "longcat_flash": dict(**_MLA, mla_scale_q_lora=True, mla_scale_kv_lora=True, zero_expert_type="identity"),
    "longcat_flash_ngram": dict(**_MLA, mla_scale_q_lora=True, mla_scale_kv_lora=True),
    "mimo_v2_flash": dict(partial_rotary_factor=1, topk_method="noaux_tc", hybrid_layer_pattern=[1, 0], moe_layer_freq=[0, 1], sliding_window_size=8,
                          swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                          v_head_dim=16, swa_v_head_dim=16, n_routed_experts=4),
    "minimax": dict(rotary_dim=8, shared_intermediate_size=64),
    "mistral4": dict(**_MLA, rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                                  original_max_position_embeddings=64)),
    "nemotron-nas": dict(block_configs=[dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
                                        dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0))]),
    "nemotron_h": dict(hybrid_override_pattern="M*E", num_hidden_layers=3, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, conv_kernel=4, n_groups=1,
                       n_routed_experts=4, moe_shared_expert_intermediate_size=64),
    "olmo3": dict(layer_types=_SW2, sliding_window=8),
    "openelm": dict(num_transformer_layers=2, model_dim=64, head_dim=16, num_query_heads=[4, 4],
                    num_kv_heads=[2, 2], ffn_multipliers=[1.0, 1.0], ffn_dim_divisor=32),
    "phixtral": dict(num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8),
    "plamo": dict(num_key_value_heads=2, n_shared_head=2),
    "plamo2": dict(mamba_d_state=8, mamba_d_conv=4, mamba_num_heads=4, hidden_size_per_head=16,
                   mamba_step=2, mamba_chunk_size=8),
    "mistral3": dict(text_config=dict(_TEXT, model_type="ministral3", sliding_window=8, layer_types=_SW2,
                                      rope_parameters=dict(rope_theta=10000.0, llama_4_scaling_beta=0.1,
                                                           original_max_position_embeddings=64))),
    "qwen": dict(intermediate_size=256, kv_channels=16),
    "spark2_5": dict(sliding_window=8, layer_types=_SW2,
                     rope_parameters=dict(sliding_attention=dict(rope_theta=10000.0),
                                          full_attention=dict(rope_theta=10000.0))),
    "step3p5": dict(moe_num_experts=4, moe_top_k=2, share_expert_dim=64, num_attention_groups=2),
    "youtu_llm": dict(**_MLA),
    # tied, its head is embed_tokens.weight.T: no quantized embedding can
    # serve it (mlx-lm's convert output fails the same way); real Seed-OSS is untied
    "seed_oss": dict(tie_word_embeddings=False),
    "kimi_k3": dict(text_config=dict(model_type="kimi_k3", **_TEXT, **_MLA, linear_attn_config=dict(
        kda_layers=[1], full_attn_layers=[2], num_heads=4, head_dim=16, short_conv_kernel_size=4))),
    "muse_spark": dict(text_config=dict(model_type="muse_spark", **_TEXT, layer_types=_SW2, sliding_window=8,
                                        layer_rope_theta=[10000.0, 10000.0], moe_hidden_size=64,
                                        rope_parameters=dict(rope_theta=10000.0), num_shared_experts=0)),
}
for _vlm, _text in (("kimi_vl", "deepseek_v3"), ("kimi_k25", "deepseek_v3"),
                     ("pixtral", "llama"), ("qwen2_vl", "qwen2"), ("qwen3_vl", "qwen3"), ("lfm2-vl", "lfm2"),
                    ("minimax_m3_vl", "minimax"), ("qwen3_vl_moe", "qwen3_moe")):
    EXTRA[_vlm] = dict(text_config=dict(_TEXT, **_MOE, model_type=_text, **(_MLA if _text == "deepseek_v3" else {}), **{
        k: v for k, v in EXTRA.get(_text, {}).items() if k != "text_config"}))

# Architectures that cannot run on text alone; the reason is written as is.
REFUSE: dict[str, str] = {
    "bitnet": "its BitLinear layers run only as a Metal kernel (mlx-lm's bitlinear_layers): no CPU path",
    "muse_spark": "its fused qk-norm + RoPE runs only as a Metal kernel (mlx-lm's qk_norm_rope): no CPU path",
    "olmo": "mlx-lm's module needs the ai2-olmo package (hf_olmo), which it asks to install and exits",
    "prism_hadamard_qwen35": "a pre-quantized format (2-bit, group 128, Hadamard-rotated packs): no float "
                             "weights to measure or quantize",
    "phi3small": "MLX's CPU backend crashes the process (segmentation fault) in about half the runs of "
                 "this model's forward on a tiny config (its block-sparse attention mask)",
}


def architectures() -> list[str]:
    """Every module of mlx_lm/models defining both ModelArgs and Model."""
    import mlx_lm.models as pkg

    names = []
    for f in Path(pkg.__file__).parent.glob("*.py"):
        src = f.read_text()
        if "class ModelArgs" in src and "class Model(" in src:
            names.append(f.stem)
    return sorted(names)


def _tiny_models():
    sys.path.insert(0, str(HERE))
    import tiny_models

    return tiny_models


def generated(name: str) -> dict:
    """The config --write starts from (before trying it)."""
    tm = _tiny_models()
    if name in tm.CONFIGS:
        return tm.config(name)
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    params = inspect.signature(mod.ModelArgs).parameters
    cfg = {"model_type": name}
    for k, v in BASE.items():
        if k in params:
            cfg[k] = copy.deepcopy(v)
    cfg.update(copy.deepcopy(EXTRA.get(name, {})))
    _fill(mod.ModelArgs, cfg)
    text = cfg.get("text_config")
    if isinstance(text, dict):  # a wrapper: its text model's own required fields too
        cls = getattr(mod, "TextArgs", None) or getattr(mod, "TextConfig", None)
        if cls is None:
            cls = importlib.import_module(f"mlx_lm.models.{text['model_type']}").ModelArgs
        _fill(cls, text)
    return cfg


def _fill(cls, cfg: dict) -> None:
    """Guess the required fields of ``cls`` that ``cfg`` does not name."""
    for k, prm in inspect.signature(cls).parameters.items():
        if k not in cfg and prm.default is inspect.Parameter.empty:
            cfg[k] = _guess(k, prm.annotation)


def _guess(name: str, ann) -> object:
    """A small value for a required field, from its name and type."""
    t = str(ann)
    if t in ("bool", "<class 'bool'>"):
        return False
    if "float" in t:
        return 1e-5 if "eps" in name else 1.0
    if t in ("str", "<class 'str'>"):
        return "silu" if "act" in name else ""
    if "dict" in t.lower() or "Optional" in t or "None" in t:
        return None
    if "list" in t.lower():
        return None
    n = name.lower()
    for keys, v in ((("rank",), 16), (("head_dim", "head_size"), 16), (("kv_head", "kv_reuse"), 2),
                    (("window",), 8), (("topk", "top_k"), 2), (("expert",), 4),
                    (("heads", "n_head"), 4), (("offset",), 1),
                    (("period", "interval", "every", "layers", "group"), 2),
                    (("size", "dim", "hidden", "length", "block"), 64)):
        if any(key in n for key in keys):
            return v
    return 2


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def build(name: str, cfg: dict | None = None, seed: int = 0):
    """(model, config) of architecture ``name`` with random weights (as
    tiny_models.build: every float parameter perturbed, float32)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    cfg = load(name) if cfg is None else cfg
    if "refused" in cfg:
        raise ValueError(f"{name} is refused: {cfg['refused']}")
    cfg = copy.deepcopy(cfg)
    mod = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    params = tree_flatten(model.parameters())
    # Arrays are lazy until evaluated: refuse a size left at a real model's
    # default (a 262,144-token embedding) before it takes the memory.
    big = max(params, key=lambda kv: kv[1].size, default=None)
    if big is not None and sum(v.size for _, v in params) > MAX_PARAMS:
        raise ValueError(f"{sum(v.size for _, v in params):,} parameters: {big[0]} is "
                         f"{tuple(big[1].shape)} (a size the tiny config leaves at its default)")
    keys = mx.random.split(mx.random.key(seed + 1), max(1, len(params)))
    new = []
    for i, (k, v) in enumerate(params):
        if mx.issubdtype(v.dtype, mx.floating):
            v = (v + mx.random.normal(v.shape, key=keys[i]) * 0.02).astype(mx.float32)
        new.append((k, v))
    model.load_weights(new, strict=False)
    mx.eval(model.parameters())
    model.eval()
    return model, cfg


def tokens(n: int = 2, seq: int = 16, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, VOCAB, (n, seq))


def _try(name: str) -> dict:
    import mlx.core as mx
    import numpy as np

    if name in REFUSE:
        return {"refused": REFUSE[name]}
    try:
        cfg = generated(name)
        model, _ = build(name, cfg)
        out = model(mx.array(tokens()))
        out = np.array(out.astype(mx.float32))
        if out.shape[:2] != (2, 16) or not np.isfinite(out).all():
            raise ValueError(f"logits of shape {out.shape}, finite: {np.isfinite(out).all()}")
    except (Exception, SystemExit) as e:  # the reason is the data (olmo's import exits)
        tb = traceback.extract_tb(e.__traceback__)[-1]
        where = f"{Path(tb.filename).name}:{tb.lineno}"
        return {"refused": f"mlx-lm's code fails on a tiny config ({where}): "
                           f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"}
    return cfg


def _probe(name: str) -> dict:
    """_try in a child process: some tiny configs crash mlx-lm's code
    natively (a heap corruption), which must not end the run."""
    import subprocess

    r = subprocess.run([sys.executable, __file__, "--probe", name], capture_output=True, text=True)
    if r.returncode != 0:
        return {"refused": f"the process dies running mlx-lm's code on a tiny config (exit {r.returncode}): "
                           f"{(r.stderr.strip().splitlines() or [''])[-1][:120]}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv) -> int:
    if "--probe" in argv:
        print(json.dumps(_try(argv[argv.index("--probe") + 1])))
        return 0
    names = argv[argv.index("--only") + 1].split(",") if "--only" in argv else architectures()
    ok = 0
    for n in names:
        cfg = _probe(n)
        ok += "refused" not in cfg
        print(f"{n:28s} {'ok' if 'refused' not in cfg else cfg['refused']}", flush=True)
        if "--write" in argv:
            DATA.mkdir(parents=True, exist_ok=True)
            (DATA / f"{n}.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    print(f"{ok} of {len(names)} run")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
