import pytest

from mlxb.errors import ModelNotFoundError
from mlxb.models.registry import model_path, resolve_model


def test_default_is_tiny_llama_preset():
    s = resolve_model(None)
    assert (s.kind, s.source, s.synthetic) == ("preset", "tiny-llama", True)


def test_alias_maps_to_hf_id():
    s = resolve_model("gemma-12b")
    assert s.kind == "hf" and s.source.startswith("mlx-community/")


def test_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "folder"


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_names_presets():
    with pytest.raises(ModelNotFoundError, match="tiny-llama.*tiny-gemma3"):
        resolve_model("not-a-model")


def test_hf_id_offline_fails_fast_naming_presets(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = resolve_model("some-org/some-model-that-is-not-cached")
    assert spec.kind == "hf"
    with pytest.raises(ModelNotFoundError, match="synthetic preset: tiny-llama"):
        model_path(spec)
