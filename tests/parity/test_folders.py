"""Parity on any mlx-lm folder: a folder written by ``mlxb models build`` and a 4-bit ``mlx_lm convert -q``
of it, live against the oracle; folder goldens keyed by content (they survive a rename); honest labels on
a machine key without goldens; ``--dtype`` refused where it does not apply."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.parity


def mlxb(*args, env=None):
    cmd = [sys.executable, "-m", "mlxb.commands.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, COLUMNS="200", **(env or {})))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("folders")
    plain, q4 = base / "llama", base / "llama-4bit"
    r = mlxb("models", "build", "tiny-llama", "--out", str(plain))
    assert r.returncode == 0, r.stderr
    from mlx_lm import convert

    convert(str(plain), mlx_path=str(q4), quantize=True, q_bits=4, q_group_size=64)
    assert json.loads((q4 / "config.json").read_text())["quantization"]["bits"] == 4
    return plain, q4


@pytest.mark.parametrize("which", [0, 1])
def test_folder_and_its_4bit_copy_match_the_live_oracle_at_b1_to_4(folders, which):
    folder = folders[which]
    r = mlxb("parity", "-m", str(folder), "--b", "1,2,3,4", "-c", "join", "-c", "leave", "-c", "extend",
             "-c", "ring", "--against", "live", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout)
    res = out["results"]
    assert len(res) == 12 and all(x["ok"] for x in res)
    assert all(x["exact"] == x["steps"] > 0 and x["tokens_only"] == 0 for x in res)  # full-logit hashes compared
    label = res[0]["case"].split()[0]
    assert label.startswith("llama-q4-" if which else "llama-") and str(folder) not in label  # content, not path
    assert out["skipped"][label] == {"ring": "no sliding-window layers"}  # the case list adapts to the model


def test_the_gate_fails_on_a_planted_bug_for_a_folder(folders):
    r = mlxb("parity", "-m", str(folders[1]), "--b", "3", "-c", "join", "--against", "live",
             "--plant-fault", "scalar_rope")
    assert r.returncode == 1 and "first divergence" in r.stdout, r.stdout[-2000:]


def test_folder_goldens_survive_a_rename_and_a_key_without_goldens_says_tokens_only(folders, tmp_path):
    import shutil

    g = tmp_path / "goldens"
    moved = tmp_path / "elsewhere" / "renamed-model"
    shutil.copytree(folders[1], moved)
    gen = mlxb("golden-gen", "-m", str(folders[1]), "--b", "2", "-c", "join", "--goldens", str(g))
    assert gen.returncode == 0 and "1 new" in gen.stdout, gen.stdout + gen.stderr
    r = mlxb("parity", "-m", str(moved), "--b", "2", "-c", "join", "--against", "golden", "--goldens", str(g), "--json")
    out = json.loads(r.stdout)
    (x,) = out["results"]
    assert r.returncode == 0 and x["against"] == "golden:machine" and x["exact"] == x["steps"] > 0
    assert out["warnings"] == []
    # the same goldens seen from a machine key that has none of its own: only the shared layer applies
    r = mlxb("parity", "-m", str(moved), "--b", "2", "-c", "join", "--against", "golden", "--goldens", str(g),
             "--json", env={"MLXB_MACHINE_KEY": "cpu-test-no-goldens"})
    out = json.loads(r.stdout)
    (x,) = out["results"]
    assert x["against"] == "golden:shared" and x["exact"] == 0 and x["tokens_only"] == x["steps"] > 0
    assert "cpu-test-no-goldens" in out["warnings"][0] and "mlxb golden-gen --model" in out["warnings"][0]
    table = mlxb("parity", "-m", str(moved), "--b", "2", "-c", "join", "--against", "golden", "--goldens", str(g),
                 env={"MLXB_MACHINE_KEY": "cpu-test-no-goldens"})
    assert "0 exact" in table.stdout and "tokens only" in table.stdout and "warning: no goldens" in table.stdout


def test_dtype_is_refused_for_quantized_weights_and_unknown_names(folders):
    r = mlxb("parity", "-m", str(folders[1]), "--dtype", "bf16", "--b", "2", "-c", "join")
    assert r.returncode != 0 and "quantized" in (r.stdout + r.stderr) and "leave --dtype out" in (r.stdout + r.stderr)
    r = mlxb("parity", "-m", str(folders[0]), "--dtype", "int8", "--b", "2", "-c", "join")
    assert r.returncode != 0 and "float32, bfloat16 or float16" in (r.stdout + r.stderr)


@pytest.mark.parametrize("arch", [
    dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    dict(model_type="phi3"),
    # query heads folded into (B, kv, repeats, L, S) scores: mlx-lm's batch mask needs another axis (model_fixes.py)
    dict(model_type="gemma2", head_dim=32, query_pre_attn_scalar=32, attn_logit_softcapping=50.0,
         final_logit_softcapping=30.0, sliding_window=16),
])
def test_other_architectures_match_the_oracle_also_with_compiled_decode(tmp_path, arch):
    """mlx-lm folders of architectures no preset has (written here with random weights): every case of a
    join and a retirement is exact, plain and with --compile-decode (which checks itself at start-up)."""
    from mlxb.models.presets import _tiny
    from mlxb.models.synth import write_folder

    folder = write_folder(_tiny("x", arch["model_type"], hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                                **arch), tmp_path / arch["model_type"])
    for extra in ([], ["--compile-decode"]):
        r = mlxb("parity", "-m", str(folder), "--b", "1,2,3", "-c", "join", "-c", "leave", "-c", "prefix",
                 "--against", "live", "--json", *extra)
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["ok"], r.stdout[-2000:] + r.stderr[-2000:]
        assert all(x["exact"] == x["steps"] > 0 for x in out["results"])
    g = mlxb("generate", "-m", str(folder), "-p", "hi", "-n", "8", "--compile-decode", "--json")
    assert g.returncode == 0 and len(json.loads(g.stdout.splitlines()[-1])["token_ids"]) == 8, g.stderr[-2000:]


def test_cache_list_layers_batch_exactly_against_mlx_lm_s_own_cache_lists(tmp_path):
    """Falcon-H1 keeps an mlx-lm ``CacheList`` (SSM state + KV cache) per layer. The engine sees the parts as
    layer caches of their own (``mlxb/models/flat.py``) and batches the model; the oracle runs mlx-lm's batch
    mode on its own CacheLists. Join, leave, the prompt cache's prefix case and the ssm case are exact at
    B=1..3, cache geometry included, and a planted bug still fails the gate."""
    from mlxb.models.presets import _tiny
    from mlxb.models.synth import write_folder

    cfg = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
               mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16)
    folder = write_folder(_tiny("fh1", "falcon_h1", model_type="falcon_h1", **cfg), tmp_path / "falcon_h1")
    r = mlxb("parity", "-m", str(folder), "--b", "1,2,3", "-c", "join", "-c", "leave", "-c", "prefix", "-c", "ssm",
             "--against", "live", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] and len(out["results"]) == 12, r.stdout[-2000:] + r.stderr[-2000:]
    assert all(x["exact"] == x["steps"] > 0 for x in out["results"])
    bad = mlxb("parity", "-m", str(folder), "--b", "3", "-c", "join", "--against", "live", "--plant-fault",
               "scalar_rope")
    assert bad.returncode == 1 and "first divergence" in bad.stdout, bad.stdout[-2000:]

