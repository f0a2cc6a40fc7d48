import json

from typer.testing import CliRunner

from mlxb.commands.main import app

runner = CliRunner()


def test_help_lists_all_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0
    for cmd in ("serve", "generate", "parity", "golden-gen", "bench", "report", "models", "doctor"):
        assert cmd in r.output


def test_unknown_model_exit_2_names_presets():
    r = runner.invoke(app, ["generate", "-p", "hi", "-m", "no-such-model"])
    assert r.exit_code == 2
    assert "tiny-llama" in r.output


def test_generate_json_shape():
    r = runner.invoke(app, ["generate", "-p", "hello", "-n", "6", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output.strip().splitlines()[-1])
    assert set(out) >= {"text", "token_ids", "finish_reason", "timings", "prompt_tokens"}
    assert out["finish_reason"] in ("length", "stop")
    assert 1 <= len(out["token_ids"]) <= 6 and all(isinstance(t, int) for t in out["token_ids"])


def test_models_lists_presets_and_random_weights_note():
    r = runner.invoke(app, ["models"])
    assert r.exit_code == 0
    assert "tiny-qwen3.5" in r.output and "RANDOM" in r.output and "gemma-12b" in r.output


def test_doctor_json():
    r = runner.invoke(app, ["doctor", "--json", "--quick"])
    assert r.exit_code == 0
    facts = json.loads(r.output)
    assert facts["machine_key"] and facts["blas"] and facts["versions"]["mlx"]


def test_parity_bad_input_names_the_fix():
    r = runner.invoke(app, ["parity", "--b", "0"])
    assert r.exit_code == 2 and "--b" in r.output and "e.g. --b 4" in r.output
    r = runner.invoke(app, ["parity", "-c", "sideways"])
    assert r.exit_code == 2 and "unknown case" in r.output and "static" in r.output
    r = runner.invoke(app, ["parity", "--against", "psychic", "--b", "1", "-c", "static"])
    assert r.exit_code == 2 and "live, golden or both" in r.output


def test_bench_spec_writes_labelled_ratios_and_rejects_bad_batches(tmp_path):
    out = tmp_path / "spec.json"
    r = runner.invoke(app, ["bench", "spec", "-m", "tiny-llama", "--batches", "1", "--regimes", "random", "--context", "32",
                            "--gen", "8", "--repeats", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["labels"]["model"] == "tiny-llama" and res["config"]["method"] == "lookup"
    assert [(s["regime"], s["B"]) for s in res["summary"]] == [("random", 1)] and res["summary"][0]["plain_tps"] > 0
    bad = runner.invoke(app, ["bench", "spec", "--batches", "x"])
    assert bad.exit_code != 0 and "comma-separated" in bad.output


def test_bench_lora_writes_labelled_ratios_and_build_adapter_writes_mlx_lm_format(tmp_path):
    out = tmp_path / "lora.json"
    r = runner.invoke(app, ["bench", "lora", "-m", "tiny-llama", "--adapters", "2", "--batches", "2", "--context", "16",
                            "--gen", "8", "--repeats", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    (s,) = res["summary"]
    assert res["labels"]["model"] == "tiny-llama" and s["B"] == 2 and s["mixed_tps"] > 0 and s["fused_tps"] > 0
    (row,) = res["rows"]  # one repeat: the summary's ratio is that repeat's
    assert s["mixed_vs_fused_median"] == row["mixed_vs_fused"] == row["mixed_tps"] / row["fused_tps"]
    ad = tmp_path / "coder"
    r = runner.invoke(app, ["models", "build-adapter", "coder", "--rank", "4", "--out", str(ad)])
    assert r.exit_code == 0, r.output
    from mlx_lm.tuner.utils import load_adapters

    from mlxb.models import load_model

    m, *_ = load_model("tiny-llama")
    load_adapters(m, str(ad))  # mlx-lm reads it
    assert json.loads((ad / "adapter_config.json").read_text())["lora_parameters"]["rank"] == 4
