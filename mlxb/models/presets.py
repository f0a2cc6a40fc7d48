"""Synthetic presets (real mlx-lm architectures, random weights) and aliases for real models.

The tiny configs follow the verified dicts in the project's reference notes, with the vocabulary
widened to the shipped tokenizer (8192 ids). Weights are random: fine for parity and speed,
meaningless as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VOCAB = 8192


@dataclass(frozen=True)
class Preset:
    name: str
    stands_for: str
    config: dict
    dtype: str = "float32"
    seed: int = 0
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)


def _tiny(name: str, stands_for: str, notes: str = "", **config) -> Preset:
    config.setdefault("vocab_size", VOCAB)
    config.setdefault("max_position_embeddings", 4096)
    config.setdefault("eos_token_id", 2)
    return Preset(name, stands_for, config, notes=notes, tags=("tiny",))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _tiny(
            "tiny-llama", "Llama (full attention)",
            model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
        _tiny(
            "tiny-gemma3", "Gemma 3 (sliding window 64 + global layers)",
            notes="window 64: prompts over 64 tokens wrap the ring",
            model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
            rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=32,
            sliding_window=64, sliding_window_pattern=2,
        ),
        _tiny(
            "tiny-gemma4", "Gemma 4 (sliding + global, KV-shared layers, per-layer inputs)",
            model_type="gemma4_text", hidden_size=128, num_hidden_layers=6, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32, global_head_dim=64,
            rms_norm_eps=1e-6, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
            num_kv_shared_layers=2, sliding_window=64, sliding_window_pattern=4,
            final_logit_softcapping=30.0, tie_word_embeddings=True,
        ),
        _tiny(
            "tiny-qwen3.5", "Qwen3.5 (gated-DeltaNet hybrid)",
            model_type="qwen3_5", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, full_attention_interval=4,
            tie_word_embeddings=False,
            rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        _tiny(
            "tiny-minicpm", "MiniCPM",
            model_type="minicpm", hidden_size=128, dim_model_base=64, num_hidden_layers=2,
            intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            scale_depth=1.4, scale_emb=12.0, rope_theta=10000.0, tie_word_embeddings=False,
        ),
        _tiny(
            "tiny-glm-mla", "GLM MLA (latent KV, dense)",
            model_type="glm4_moe_lite", hidden_size=128, intermediate_size=256,
            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
            first_k_dense_replace=2, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
            qk_nope_head_dim=32, v_head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        ),
        Preset(
            "synth-llama-30m", "Llama, 29M params (CPU benchmark size)",
            dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
                 num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB,
                 rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=16384,
                 eos_token_id=2),
            tags=("bench",),
        ),
        Preset(
            "synth-llama-1b", "Llama-3.2-1B shape (bf16, 8k vocab)",
            dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                 vocab_size=VOCAB, rope_theta=500000.0, tie_word_embeddings=True,
                 max_position_embeddings=131072, eos_token_id=2),
            dtype="bfloat16", tags=("gpu",),
        ),
        Preset(
            "synth-llama-8b", "Llama-3-8B shape (bf16, 8k vocab, ~15 GB)",
            dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=VOCAB,
                 rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=8192,
                 eos_token_id=2),
            dtype="bfloat16", tags=("gpu",),
        ),
    ]
}

DEFAULT_MODEL = "tiny-llama"

# Real models the seed uses, mapped to mlx-community ids (downloaded by mlx-lm where a network exists).
ALIASES: dict[str, str] = {
    "gemma-12b": "mlx-community/gemma-3-12b-it-bf16",
    "gemma-e4b": "mlx-community/gemma-3n-E4B-it-bf16",
    "qwen3.5-4b": "mlx-community/Qwen3.5-4B-bf16",
    "minicpm5-1b": "mlx-community/MiniCPM4-0.5B-bf16",
    "llama-3b": "mlx-community/Llama-3.2-3B-Instruct-bf16",
}
