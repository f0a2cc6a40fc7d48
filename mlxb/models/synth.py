"""Build synthetic presets as ordinary mlx-lm model folders.

A folder holds config.json, safetensors weights, the shipped tokenizer and a recipe file. It is
built once under ``MLXB_HOME`` and reused; the folder name carries a hash of the recipe (config,
dtype, seed, tokenizer bytes, generator version), so a changed recipe builds a new folder.

Weights are deterministic: every array parameter of rank >= 2 gets its own PRNG key derived from
(seed, parameter name), independent of the order mlx-lm creates modules in; rank-1 parameters
(norm scales, biases, SSM decay terms) keep the architecture's own initial values, drawn after
seeding MLX's global generator with the preset seed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path

from mlxb.models.presets import Preset

GENERATOR_VERSION = 1
ASSETS = Path(__file__).parent / "assets"
TOKENIZER_JSON = ASSETS / "tokenizer.json"

# ChatML with tools (Hermes / Qwen2.5 style): the tool list in the system turn, assistant calls as JSON in
# <tool_call> tags, tool results as <tool_response> in a user turn; mlx-lm infers its json_tools parser from
# it. Plain conversations render exactly as the template before tools did.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions. Function signatures are within <tools></tools>:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' }}{%- if message['content'] %}{{ message['content'] + '\n' }}{%- endif %}"
    "{%- for tc in message['tool_calls'] %}{%- set tool_call = tc['function'] if tc.get('function') else tc %}"
    "{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + (tool_call.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- if not loop.last %}{{ '\n' }}{%- endif %}{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] if message['content'] is not none else '') + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "model_max_length": 131072,
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}

DTYPES = ("float32", "bfloat16", "float16")


def mlxb_home() -> Path:
    env = os.environ.get("MLXB_HOME")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxb"


def recipe(preset: Preset, dtype: str | None = None) -> dict:
    dtype = dtype or preset.dtype
    if dtype not in DTYPES:
        from mlxb.errors import ValidationError

        raise ValidationError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}", param="dtype")
    tok_hash = hashlib.sha256(TOKENIZER_JSON.read_bytes()).hexdigest()
    return {
        "preset": preset.name,
        "config": preset.config,
        "dtype": dtype,
        "seed": preset.seed,
        "tokenizer_sha256": tok_hash,
        "chat_template_sha256": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
        "generator": GENERATOR_VERSION,
    }


def recipe_hash(rec: dict) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:12]


def preset_dir(preset: Preset, dtype: str | None = None) -> Path:
    rec = recipe(preset, dtype)
    return mlxb_home() / "models" / f"{preset.name}-{rec['dtype']}-{recipe_hash(rec)}"


def build_model(preset: Preset, dtype: str | None = None):
    """Instantiate the architecture in memory with deterministic random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    rec = recipe(preset, dtype)
    arch = importlib.import_module(f"mlx_lm.models.{preset.config['model_type']}")
    mx.random.seed(preset.seed)  # rank-1 parameters some architectures draw at random (e.g. A_log)
    model = arch.Model(arch.ModelArgs.from_dict(preset.config))
    target = getattr(mx, rec["dtype"])
    new = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim >= 2:
            key = mx.random.key((preset.seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF)
            std = 1.0 / math.sqrt(p.shape[-1])
            p = mx.random.normal(p.shape, key=key) * std
        new.append((name, p.astype(target)))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def write_tokenizer(path: Path) -> None:
    shutil.copyfile(TOKENIZER_JSON, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def write_folder(preset: Preset, out: Path, dtype: str | None = None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write ``preset`` as an mlx-lm folder at ``out`` (atomic: built in a temp dir, then renamed)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    rec = recipe(preset, dtype)
    model = build_model(preset, rec["dtype"])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        weights = dict(tree_flatten(model.parameters()))
        shards: list[dict] = [{}]
        size = 0
        for k, v in weights.items():
            if size + v.nbytes > max_shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][k] = v
            size += v.nbytes
        index = {}
        for i, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(tmp / fname), shard, metadata={"format": "mlx"})
            index.update({k: fname for k in shard})
        if len(shards) > 1:
            total = sum(v.nbytes for v in weights.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2)
            )
        config = dict(preset.config)
        config["torch_dtype"] = rec["dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
        write_tokenizer(tmp)
        (tmp / "mlxb_recipe.json").write_text(json.dumps(rec, indent=2, sort_keys=True))
        (tmp / "README.md").write_text(
            f"# {preset.name} (synthetic)\n\nStands for: {preset.stands_for}. Weights are RANDOM "
            f"(seed {preset.seed}, {rec['dtype']}); the text it generates is meaningless.\n"
            "Built by mlxb; opens with mlx_lm.load() and mlx_lm.server --model <this folder>.\n"
        )
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_preset(preset: Preset, dtype: str | None = None) -> Path:
    """Return the cached folder for ``preset``, building it if missing or stale."""
    path = preset_dir(preset, dtype)
    if (path / "mlxb_recipe.json").exists():
        return path
    return write_folder(preset, path, dtype)
