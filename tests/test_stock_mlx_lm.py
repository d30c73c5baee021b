"""A folder with mixbits-only layers (several K-segments, a column
permutation) runs in stock mlx-lm through the model file mixbits.save
writes for it (mixbits.mlx_lm_model_file): mlx_lm.load with
trust_remote_code, ``python -m mlx_lm generate`` and ``mlx_lm server``
give what mixbits.load and mixbits' greedy decode give."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mixbits
import tiny_models
from mixbits.folder import MANIFEST
from mixbits.mlx_lm_model_file import MODEL_FILE
from mixbits.models.eval import greedy_generate
from mixbits.models.tokenizer import Tokenizer
from mixbits.nn import MixedWeight
from tiny_model import tiny_llama

PROMPT = "w217 w163 w130 w69 w78 w10"  # greedy continuation has 4 distinct tokens
IDS = mx.array([[5, 17, 200, 3, 99, 42, 7]])

MIXED = {
    "model.layers.0.self_attn.q_proj": "ternary",  # single segment: also in mlx-lm's block
    "model.layers.0.mlp.up_proj": [(4, 32, 32), (2, 32, 32)],
    "model.layers.0.mlp.down_proj": {"segments": [(4, 64, 128)],
                                     "perm": np.random.default_rng(0).permutation(128)},
    "model.layers.1.mlp.gate_proj": [("ternary", 32, 32), (3, 32, 32)],
    "model.layers.1.mlp.down_proj": 4,
    "model.embed_tokens": [(8, 32, 32), (4, 32, 32)],  # tied: also the output head
}
NATIVE = {"model.layers.0.self_attn.q_proj": "ternary", "model.layers.1.mlp.down_proj": 4,
          "model.embed_tokens": (6, 32)}


def _tokenizer(vocab: int = 256) -> Tokenizer:
    from tokenizers import Tokenizer as Tk, models, pre_tokenizers

    tk = Tk(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tk, eos_token_ids=[])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("stock")
    model = tiny_llama()
    # one stock MLX quantized layer too, beside the mixbits ones
    nn.quantize(model, 64, 4, class_predicate=lambda p, m: p == "model.layers.1.self_attn.o_proj")
    mixbits.quantize_model(model, MIXED)
    mixbits.save(model, root / "mixed", tokenizer=_tokenizer())
    native = tiny_llama()
    mixbits.quantize_model(native, NATIVE)
    mixbits.save(native, root / "native", tokenizer=_tokenizer())
    return root / "mixed", root / "native"


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_model_file_only_for_mixbits_only_layers(folders, tmp_path):
    mixed, native = folders
    assert _config(mixed)["model_file"] == MODEL_FILE
    assert MODEL_FILE in json.loads((mixed / MANIFEST).read_text())["files"]
    cfg = _config(native)
    assert "model_file" not in cfg and not (native / MODEL_FILE).exists()
    # an MLX-native folder loads in stock mlx-lm as before, no trust needed
    from mlx_lm import load

    model, _ = load(str(native))
    want, _, _ = mixbits.load(native)
    np.testing.assert_allclose(np.array(model(IDS)), np.array(want(IDS)), rtol=1e-4, atol=1e-4)
    # re-saving with a config that named the model file drops the key
    mixbits.save(want, tmp_path / "again", {**cfg, "model_file": MODEL_FILE})
    assert "model_file" not in _config(tmp_path / "again")


def test_mlx_lm_load_matches_mixbits_load(folders):
    from mlx_lm import load

    mixed, _ = folders
    model, tokenizer = load(str(mixed), trust_remote_code=True)
    want, _, _ = mixbits.load(mixed)
    modules = dict(model.named_modules())
    for path in MIXED:
        assert isinstance(modules[path], MixedWeight), path
    assert type(modules["model.layers.1.self_attn.o_proj"]) is nn.QuantizedLinear
    np.testing.assert_array_equal(np.array(model(IDS)), np.array(want(IDS)))
    assert tokenizer.encode(PROMPT) == [217, 163, 130, 69, 78, 10]


def test_mlx_lm_refuses_the_model_file_without_trust(folders):
    from mlx_lm import load

    with pytest.raises(ValueError, match="trust_remote_code"):
        load(str(folders[0]))


def _greedy(folder, n: int = 4) -> str:
    model, tok, _ = mixbits.load(folder)
    out = greedy_generate(model, tok, PROMPT, max_tokens=n)
    assert len(set(out.ids)) > 1  # a repeated token would not tell much
    return tok.decode(out.ids)


def test_mlx_lm_generate_cli(folders):
    mixed, _ = folders
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(mixed),
                        "--trust-remote-code", "--prompt", PROMPT, "--max-tokens", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # mlx-lm prints the text between two rules of "="
    text = r.stdout.split("==========")[1].strip()
    assert text == _greedy(mixed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlx_lm_server(folders, tmp_path):
    mixed, _ = folders
    port = _free_port()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(mixed),
                             "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    try:
        deadline, reply = time.monotonic() + 25, None
        while reply is None:
            assert proc.poll() is None, "server exited: " + (tmp_path / "server.log").read_text()[-2000:]
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=10) as resp:
                    reply = json.loads(resp.read())
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "no reply: " + (tmp_path / "server.log").read_text()[-2000:]
                time.sleep(0.2)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert reply["choices"][0]["text"] == _greedy(mixed)
    assert reply["usage"]["completion_tokens"] == 4


def test_model_file_without_mixbits_says_how_to_install(folders):
    # The file imported as mlx-lm does, with mixbits made unimportable.
    code = (
        "import sys, importlib.util\n"
        "sys.modules['mixbits'] = None\n"
        f"spec = importlib.util.spec_from_file_location('custom_model', {str(folders[0] / MODEL_FILE)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "ImportError: this model folder's quantized layers run only with mixbits: pip install mixbits" in r.stderr
    # a file from a newer mixbits says to upgrade
    from mixbits.mlx_lm_model_file import MODEL_FILE_FORMAT, model_classes

    with pytest.raises(ImportError, match="pip install --upgrade mixbits"):
        model_classes(MODEL_FILE_FORMAT + 1)


def test_expert_stacks_through_the_model_file(tmp_path):
    # A MoE: mixbits expert stacks skip the stock sanitize (which restacks
    # per-expert checkpoints) and replace mlx-lm's SwitchLinear placeholders.
    from mlx_lm.utils import load_model  # mlx_lm.load without a tokenizer

    model, cfg = tiny_models.build("qwen3_moe")
    mixbits.quantize_model(model, {
        "model.layers.0.mlp.switch_mlp.up_proj": [(4, 32, 32), (2, 32, 32)],
        "model.layers.1.mlp.switch_mlp.down_proj": {"segments": [(4, 32, 64)],
                                                    "perm": np.random.default_rng(1).permutation(64)},
        "model.layers.2.mlp.switch_mlp.gate_proj": 4,
    })
    mixbits.save(model, tmp_path / "moe", cfg)
    got, _ = load_model(tmp_path / "moe", trust_remote_code=True)
    want, _, _ = mixbits.load(tmp_path / "moe")
    ids = IDS % cfg["vocab_size"]
    np.testing.assert_array_equal(np.array(got(ids)), np.array(want(ids)))


def test_stock_sanitize_cannot_rewrite_mixbits_arrays(folders, monkeypatch):
    # A stock sanitize is written for checkpoints: here one that keeps only
    # the names it knows. mixbits' arrays go around it, as in mixbits.load.
    import mlx_lm.models.llama as llama
    from mlx_lm import load

    stock = llama.Model.sanitize
    monkeypatch.setattr(llama.Model, "sanitize",
                        lambda self, w: {k: v for k, v in stock(self, w).items() if ".segments." not in k})
    model, _ = load(str(folders[0]), trust_remote_code=True)
    want, _, _ = mixbits.load(folders[0])
    np.testing.assert_array_equal(np.array(model(IDS)), np.array(want(IDS)))
