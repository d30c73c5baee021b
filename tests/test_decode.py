"""mixbits.decode.Decoder: the compiled decode step gives the logits of the
model's own plain forward (mlx-lm caches, one token per call) at every step
after a prompt, on tiny random-weight mlx-lm models quantized to 4 bits and
patched with mixbits; and it refuses what it cannot compile."""

from __future__ import annotations

import pytest

import mlx.core as mx
import mlx.nn as nn

import mixbits
import tiny_models
from mixbits.decode import Decoder, Unsupported

# llama / qwen3: KVCache; gemma3_text: RotatingKVCache(8) on every other
# layer (the prompt + steps pass the window, so the ring wraps); qwen3_moe:
# expert stacks through gather_qmatmul; ministral3: sliding layers by
# layer_types; phi3: fused qkv and gate_up projections; gpt_oss: sinks,
# sliding layers, experts. deepseek_v3 (MLA) stays float: its 24-wide
# projections fit no quantization group.
ARCHS = ["llama", "qwen3", "gemma3_text", "qwen3_moe", "ministral3", "phi3", "gpt_oss", "deepseek_v3"]
FLOAT = {"deepseek_v3"}


def _patched(arch: str, dtype=mx.float32):
    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build(arch, dtype=dtype)
    if arch in FLOAT:
        return model, cfg
    nn.quantize(model, group_size=32, bits=4)
    assert mixbits.patch(model), f"{arch}: nothing patched"
    return model, cfg


def _plain_logits(model, prompt, tokens):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[:, -1:]]
    for t in tokens:
        out.append(model(mx.array([[t]]), cache=cache))
    return out


def _compiled_logits(model, prompt, tokens, capacity=None):
    d = Decoder(model)
    out = [d.prefill(prompt, capacity=capacity)[:, -1:]]
    for t in tokens:
        out.append(d.step(t))
    return out, d.offset


def _ids(cfg, n, seed):
    return mx.random.randint(0, cfg["vocab_size"], (n,), key=mx.random.key(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_steps_match_the_plain_forward(arch):
    model, cfg = _patched(arch)
    # Fixed (not argmax) tokens, so a wrong step cannot hide behind the
    # same greedy choice.
    prompt, tokens = _ids(cfg, 11, 1), _ids(cfg, 12, 2)
    plain = _plain_logits(model, prompt, tokens)
    compiled, offset = _compiled_logits(model, prompt, tokens)
    for i, (p, c) in enumerate(zip(plain, compiled)):
        assert c.shape == p.shape, (arch, i)
        err = mx.abs(c - p).max().item()
        assert err <= 1e-4 * (1 + mx.abs(p).max().item()), f"{arch} step {i}: max |diff| {err}"
    assert offset == len(prompt) + len(tokens)


@pytest.mark.parametrize("arch, activations, repack", [("llama", "int8", True), ("qwen3_moe", "int8", True),
                                                      ("qwen3_moe", "int16", True), ("qwen3_moe", "int8", False)])
def test_compiled_steps_on_the_integer_contracts(arch, activations, repack):
    """The integer contracts (experts too, repacked or not; what
    bench_moe_decode.py times) through the compiled step: the plain
    forward's logits at every step, within the tolerance Decoder's own
    check uses (int8 rounding turns an ulp of x into a code step, so this
    is looser than the float test's; on this host these agree exactly)."""
    mx.set_default_device(mx.cpu)
    model, cfg = tiny_models.build(arch)
    nn.quantize(model, group_size=32, bits=4)
    assert mixbits.patch(model, activations=activations, repack=repack)
    prompt, tokens = _ids(cfg, 11, 1), _ids(cfg, 12, 2)
    plain = _plain_logits(model, prompt, tokens)
    compiled, _ = _compiled_logits(model, prompt, tokens)
    for i, (p, c) in enumerate(zip(plain, compiled)):
        err = mx.abs(c - p).max().item()
        assert err <= 1e-3 * (1 + mx.abs(p).max().item()), f"{arch} {activations} step {i}: max |diff| {err}"


@pytest.mark.parametrize("arch, full_layers, dtype", [("llama", None, mx.float32), ("gemma3_text", [1, 3], mx.float32),
                                                     ("llama", None, mx.float16), ("qwen3", None, mx.bfloat16)])
def test_compiled_attention_runs_the_kernel_on_the_filled_prefix(arch, full_layers, dtype, monkeypatch):
    """A compiled step's attention over a KVCache buffer goes to the mixbits
    kernel with kv_len = offset + 1 (not MLX's masked fallback over the
    whole buffer), in half precision too; ring-buffer (sliding) layers keep
    MLX's op."""
    from mixbits import _ext

    model, cfg = _patched(arch, dtype)
    seen = []
    real = _ext.causal_attention

    def counting(q, k, v, scale, backend=0, kv_len=None):
        seen.append((k.shape[2], kv_len))
        return real(q, k, v, scale, backend, kv_len)

    monkeypatch.setattr(_ext, "causal_attention", counting)
    prompt, tokens = _ids(cfg, 6, 3), _ids(cfg, 3, 4)
    plain = _plain_logits(model, prompt, tokens)
    seen.clear()
    compiled, _ = _compiled_logits(model, prompt, tokens, capacity=40)
    n_layers = len(model.layers) if full_layers is None else len(full_layers)
    traced = [s for s in seen if s[1] is not None]
    # One trace (the first step; its plain check runs without kv_len), one
    # kernel call per full-attention layer, over the whole 64-slot buffer.
    assert len(traced) == n_layers and all(s[0] == 64 for s in traced), seen
    tol = 1e-4 if dtype == mx.float32 else 2e-2  # the Decoder's own check for half precision
    for p, c in zip(plain, compiled):
        assert c.dtype == p.dtype == dtype
        assert mx.abs(c - p).max().item() <= tol * (1 + mx.abs(p).max().item())


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_capacity_grows_past_the_first_trace(arch):
    # capacity=1: a 64-slot buffer for 60 prompt tokens; the 5th step grows
    # it (retrace); gemma3's sliding-window rings keep their size.
    model, cfg = _patched(arch)
    prompt, tokens = _ids(cfg, 60, 3), _ids(cfg, 9, 4)
    plain = _plain_logits(model, prompt, tokens)
    compiled, _ = _compiled_logits(model, prompt, tokens, capacity=1)
    for i, (p, c) in enumerate(zip(plain, compiled)):
        assert mx.allclose(c, p, rtol=1e-4, atol=1e-4).item(), f"step {i}"


def test_recurrent_caches_are_refused():
    model, cfg = _patched("qwen3_next")
    with pytest.raises(Unsupported, match="not compiled"):
        Decoder(model).prefill(_ids(cfg, 5, 5))


def test_a_model_that_builds_its_own_decode_mask_is_refused(monkeypatch):
    # A model that never asks its cache for the mask would attend to the
    # buffer's empty slots: the trace refuses it.
    import mlx_lm.models.llama as llama

    model, cfg = _patched("llama")
    monkeypatch.setattr(llama, "create_attention_mask", lambda h, cache=None, **kw: None)
    d = Decoder(model)
    d.prefill(_ids(cfg, 5, 6))
    with pytest.raises(Unsupported, match="decode mask"):
        d.step(3)


def test_verify_refuses_a_step_that_disagrees(monkeypatch):
    # Plant a wrong mask (every slot visible, the empty ones too): the
    # first step's check against the plain forward catches it.
    from mixbits import decode

    model, cfg = _patched("llama")
    orig = decode._StepCache.make_mask

    def everything(self, N, window_size=None, return_array=False):
        return orig(self, N, window_size, return_array) | True

    monkeypatch.setattr(decode._StepCache, "make_mask", everything)
    d = Decoder(model)
    d.prefill(_ids(cfg, 5, 7))
    with pytest.raises(Unsupported, match="disagrees"):
        d.step(3)


def test_step_before_prefill_and_bad_ids():
    model, _ = _patched("llama")
    with pytest.raises(RuntimeError, match="prefill"):
        Decoder(model).step(1)
    with pytest.raises(ValueError, match="one non-empty sequence"):
        Decoder(model).prefill(mx.zeros((2, 3), dtype=mx.int32))
    with pytest.raises(TypeError):
        Decoder(object())


class _Tokens:
    """A tokenizer over space-separated token ids."""

    eos_token_ids = []

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_greedy_generate_gives_the_plain_tokens(arch):
    from mixbits.decode import greedy_generate as compiled
    from mixbits.models import greedy_generate as plain

    model, cfg = _patched(arch)
    prompt = " ".join(map(str, _ids(cfg, 7, 8)))
    want = plain(model, _Tokens(), prompt, max_tokens=14)
    got = compiled(model, _Tokens(), prompt, max_tokens=14)
    assert got.ids == want.ids and len(got.ids) == 14


def test_a_forward_branching_on_the_offset_is_refused(monkeypatch):
    # Python control flow on cache.offset needs its value while tracing.
    import mlx_lm.models.llama as llama

    model, cfg = _patched("llama")
    call = llama.Attention.__call__

    def branching(self, x, mask=None, cache=None):
        if cache is not None and cache.offset > 1000:
            raise AssertionError("unreachable in this test")
        return call(self, x, mask, cache)

    monkeypatch.setattr(llama.Attention, "__call__", branching)
    d = Decoder(model)
    d.prefill(_ids(cfg, 5, 9))
    with pytest.raises(Unsupported, match="cannot be traced"):
        d.step(3)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims,scale,dtype", [(16, 1.0, mx.float32), (8, 0.5, mx.float32), (16, 1.0, mx.float16)])
def test_step_rope_is_the_rope(traditional, dims, scale, dtype):
    # The stand-in traced for one token at an array offset against MLX's
    # own op; dims < 16 leaves the last features unrotated.
    from mixbits.decode import _StepRoPE

    mx.set_default_device(mx.cpu)
    rope = nn.RoPE(dims, traditional=traditional, base=10000.0, scale=scale)
    x = mx.random.normal((1, 3, 1, 16), key=mx.random.key(10)).astype(dtype)
    for offset in (0, 7, 1000):
        want = rope(x, offset=offset)
        got = _StepRoPE(rope, {})(x, offset=mx.array(offset, dtype=mx.int32))
        assert got.dtype == want.dtype
        tol = 1e-5 if dtype == mx.float32 else 2e-3
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=tol, atol=tol).item(), offset


def test_smollm2_compiled_generation_and_cli(capsys):
    """On the real model (mixbits layers): the compiled greedy decode gives
    the plain decode's tokens, and ``mixbits generate --compiled`` runs it."""
    from mixbits.cli import main
    from mixbits.decode import greedy_generate as compiled
    from mixbits.models import Unavailable, greedy_generate as plain, smollm2
    from mixbits.models.gguf import load_gguf

    mx.set_default_device(mx.cpu)
    try:
        path = smollm2.fetch()
    except Unavailable as e:
        pytest.skip(f"SmolLM2 GGUF cannot be downloaded here: {e}")
    model, tok, _ = load_gguf(path)
    mixbits.patch(model)
    prompt = "The capital of France is"
    want = plain(model, tok, prompt, max_tokens=12, stop_at_eos=False)
    got = compiled(model, tok, prompt, max_tokens=12, stop_at_eos=False)
    assert got.ids == want.ids
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-tokens", "2", "--patch",
                 "--compiled"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == prompt + " Paris."
    assert "compiled decode" in out.err and "--compiled:" not in out.err  # no fallback
    # the integer contract on repacked layers: same answer, compiled
    assert main(["generate", "--model", "smollm2", "--prompt", prompt, "--max-tokens", "2", "--patch",
                 "--compiled", "--activations", "int8", "--repack"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == prompt + " Paris."
    assert "mixbits int8 repacked layers, compiled decode" in out.err and "--compiled:" not in out.err


@pytest.mark.parametrize("argv, why", [
    (["--activations", "int8"], "add --patch"),
    (["--repack", "--patch"], "add an integer --activations"),
    (["--repack", "--patch", "--activations", "float"], "add an integer --activations"),
])
def test_generate_refuses_contract_options_before_loading(argv, why, capsys, monkeypatch):
    from mixbits.cli import main

    monkeypatch.setattr(mixbits, "load", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["generate", "--model", "smollm2", "--prompt", "x", *argv]) == 2
    assert why in capsys.readouterr().err


class FakeGPUDefault:
    """MLX's default device as a Mac has it (the GPU), on any host: what
    mixbits._backends sees and what it sets, recorded."""

    def __init__(self, monkeypatch):
        import mixbits._backends as backends

        self.device, self.set = mx.gpu, []
        monkeypatch.setattr(backends, "on_cpu", lambda: self.device == mx.cpu)
        monkeypatch.setattr(mx, "default_device", lambda: self.device)
        monkeypatch.setattr(mx, "set_default_device", self._set)

    def _set(self, d):
        self.set.append(d)
        self.device = d


@pytest.mark.parametrize("activations, moved", [("int8", True), ("int16", True), ("float", False), (None, False)])
def test_an_integer_contract_moves_a_gpu_default_to_the_cpu(activations, moved, monkeypatch):
    from mixbits._backends import cpu_for_contract

    fake = FakeGPUDefault(monkeypatch)
    note = cpu_for_contract(activations)
    assert fake.set == ([mx.cpu] if moved else [])
    assert (note is not None) == moved
    if moved:
        assert "runs on the CPU" in note and activations in note
    fake.device = mx.cpu  # already on the CPU: nothing to move, nothing to say
    assert cpu_for_contract(activations) is None and fake.set == ([mx.cpu] if moved else [])


def test_the_repacked_layout_moves_a_gpu_default_to_the_cpu(monkeypatch):
    from mixbits._backends import cpu_for_contract

    fake = FakeGPUDefault(monkeypatch)
    note = cpu_for_contract("float", repack=True)  # bench --repack times the float contract on it too
    assert fake.set == [mx.cpu] and "--repack" in note and "runs on the CPU" in note


def test_generate_with_an_integer_contract_runs_on_the_cpu_from_a_gpu_default(capsys, monkeypatch):
    """mixbits generate --activations int8 where the default device is the
    GPU (a Mac): the CPU is set before the model loads, and said."""
    from mixbits.cli import main

    fake = FakeGPUDefault(monkeypatch)
    devices_at_load = []

    def load(*a, **k):
        devices_at_load.append(fake.device)
        raise FileNotFoundError("stop here")

    monkeypatch.setattr(mixbits, "load", load)
    assert main(["generate", "--model", "smollm2", "--prompt", "x", "--patch", "--activations", "int8"]) == 2
    assert devices_at_load == [mx.cpu]
    assert "the integer contracts are CPU kernels, so this runs on the CPU" in capsys.readouterr().err


def test_a_decoder_reused_for_a_second_sequence_starts_afresh():
    model, cfg = _patched("llama")
    d = Decoder(model)
    d.prefill(_ids(cfg, 9, 11))
    for t in _ids(cfg, 4, 12):
        d.step(t)
    prompt, tokens = _ids(cfg, 6, 13), _ids(cfg, 5, 14)
    plain = _plain_logits(model, prompt, tokens)
    got = [d.prefill(prompt)[:, -1:]] + [d.step(t) for t in tokens]
    for i, (p, c) in enumerate(zip(plain, got)):
        assert mx.allclose(c, p, rtol=1e-4, atol=1e-4).item(), f"step {i}"
    assert d.offset == len(prompt) + len(tokens)


def test_a_ring_smaller_than_its_window_grows_then_wraps(monkeypatch):
    # Window 40, capacity=1: the rings start at 32 slots (the rounded
    # prompt + 1), grow to the window at offset 32, wrap past 40.
    cfgs = dict(tiny_models.CONFIGS)
    cfgs["gemma3_text"] = dict(cfgs["gemma3_text"], sliding_window=40)
    monkeypatch.setattr(tiny_models, "CONFIGS", cfgs)
    model, cfg = _patched("gemma3_text")
    prompt, tokens = _ids(cfg, 20, 15), _ids(cfg, 30, 16)
    plain = _plain_logits(model, prompt, tokens)
    compiled, _ = _compiled_logits(model, prompt, tokens, capacity=1)
    for i, (p, c) in enumerate(zip(plain, compiled)):
        err = mx.abs(c - p).max().item()
        assert err <= 1e-4 * (1 + mx.abs(p).max().item()), f"step {i}: max |diff| {err}"
