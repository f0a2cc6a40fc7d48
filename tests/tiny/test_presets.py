"""Synthetic presets: build, load with mlx-lm, generate; deterministic; tokenize identically."""

import hashlib
import json

import pytest
from tokenizers import Tokenizer

from mlxb.models.presets import PRESETS
from mlxb.models.synth import TOKENIZER_JSON, build_model, ensure_preset, preset_dir, write_folder
from tests.conftest import TINY

# Pinned on Linux x86_64 / mlx 0.32.4. A change here on another machine or Python means goldens
# built there would not match: investigate, never just re-pin.
WEIGHTS = {
    "tiny-llama": "f920227723b370b0",
    "tiny-gemma3": "03e3162367a27ffd",
    "tiny-gemma4": "887e80d03f809314",
    "tiny-qwen3.5": "6a3fdc92fe79650e",
    "tiny-minicpm": "b682c5e48804b113",
    "tiny-glm-mla": "935c20918e03d327",
}
TOKENIZER_SHA256 = "c95be6572bbd42e466cc0a86f42ea698999d8ed5f473407fce8809f3f45be4f8"
TEXTS = [
    "def hello(): return 1\n",
    "Hello, World! 12345 ça va? 日本語 \t\n\n  x=[1,2]  ",
    "<|im_start|>user\nhi<|im_end|>\n",
]


def test_shipped_tokenizer_is_pinned():
    assert hashlib.sha256(TOKENIZER_JSON.read_bytes()).hexdigest() == TOKENIZER_SHA256


@pytest.mark.parametrize("name", TINY)
def test_preset_builds_loads_and_generates(name, tiny_models):
    from mlx_lm import generate

    model, tok, spec, path = tiny_models(name)
    assert spec.synthetic and (path / "config.json").exists() and (path / "tokenizer.json").exists()
    from mlxb.models.fingerprint import weights_sha256

    assert weights_sha256(path)[:16] == WEIGHTS[name]
    text = generate(model, tok, prompt="def f(x):", max_tokens=8)
    assert isinstance(text, str) and len(text) > 0
    assert tok.eos_token_ids == {2}
    assert json.loads((path / "mlxb_recipe.json").read_text())["preset"] == name


@pytest.mark.parametrize("name", TINY)
def test_mlxb_and_mlx_lm_tokenize_identically(name, tiny_models):
    _, tok, _, _ = tiny_models(name)
    raw = Tokenizer.from_file(str(TOKENIZER_JSON))
    for t in TEXTS:
        assert tok.encode(t) == raw.encode(t).ids, (name, type(tok._tokenizer).__name__)
        assert tok.decode(tok.encode(t)) == t


def test_rebuild_is_identical_and_cached(tmp_path):
    from mlxb.models.fingerprint import weights_sha256

    p = PRESETS["tiny-llama"]
    a = write_folder(p, tmp_path / "a")
    b = write_folder(p, tmp_path / "b")
    assert weights_sha256(a) == weights_sha256(b)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert ensure_preset(p) == preset_dir(p)  # second call reuses the folder


def test_recipe_change_changes_folder():
    p = PRESETS["tiny-llama"]
    assert preset_dir(p, "float32") != preset_dir(p, "bfloat16")


def test_bf16_dtype_choice(tmp_path):
    import mlx.core as mx

    m = build_model(PRESETS["tiny-llama"], "bfloat16")
    assert m.model.embed_tokens.weight.dtype == mx.bfloat16
