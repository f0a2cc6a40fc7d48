import os
import tempfile

import pytest

# one model cache for the whole run, never the user's
os.environ.setdefault("MLXB_HOME", os.path.join(tempfile.gettempdir(), "mlxb-test-home"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = ["tiny-llama", "tiny-gemma3", "tiny-gemma4", "tiny-qwen3.5", "tiny-minicpm", "tiny-glm-mla"]


@pytest.fixture(scope="session")
def tiny_models():
    from mlxb.models import load_model

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_model(name)
        return cache[name]

    return get
