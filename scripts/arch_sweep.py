"""Sweep mlx-lm architectures no preset has: write a tiny random-weight folder of each, then run
``mlxb parity`` (join / leave at B=1..3 against the live oracle) and a served smoke (two concurrent
chat requests and one stream through ``mlxb serve``). Prints one line per architecture: exact, refused
(with the engine's reason) or failed (with the error). Random weights: parity and robustness only.

    python scripts/arch_sweep.py [--only a,b] [--keep DIR] [--no-serve] [--no-parity] [--flags "--kv-bits 8 ..."]

``--flags``: extra ``mlxb serve`` flags for the served smoke (a refusal at start-up is reported as such).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
ARCHS: dict[str, dict] = {
    "qwen2": {},
    "olmo2": {},
    "starcoder2": dict(norm_epsilon=1e-5),
    "cohere": dict(layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=False),
    "granite": dict(attention_bias=False, mlp_bias=False, embedding_multiplier=2.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=2.0),
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   sliding_window=16, hidden_activation="gelu_pytorch_tanh"),
    "gemma": dict(),
    "phi3": {},
    "internlm3": dict(bias=False, qkv_bias=False),
    "exaone4": dict(sliding_window=16, sliding_window_pattern="LG", rope_scaling=None,
                    layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(no_rope_layer_interval=4),
    "seed_oss": dict(attention_bias=True, attention_out_bias=False, mlp_bias=False),
    "ministral3": dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.0,
                                        "original_max_position_embeddings": 4096}),
    "qwen2_moe": dict(MOE),
    "qwen3_moe": dict(MOE),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(attention_bias=False, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, attention_multiplier=0.25,
                       residual_multiplier=0.5, logits_scaling=2.0),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                        first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        topk_method="noaux_tc", scoring_func="sigmoid"),
    "cohere2": dict(layer_norm_eps=1e-5, logit_scale=0.5, sliding_window=16, sliding_window_pattern=2),
    "olmo3": dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_token=2, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"], rope_scaling=None),
    "lfm2": dict(norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128,
                 block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                 full_attn_idxs=[1], layer_types=["conv", "full_attention"]),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_d_conv=4,
                      mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=16),
    "baichuan_m1": dict(sliding_window=16, sliding_window_layers=[0], conv_window=2),
    "deepseek_v32": dict(moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                         kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                         first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1,
                         routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
                         index_head_dim=16, index_n_heads=2, index_topk=8),
    "mamba2": dict(time_step_rank=8, num_heads=4, head_dim=32, state_size=16, n_groups=1, expand=2, conv_kernel=4, chunk_size=16,
                   layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, time_step_limit=[0.0, 1e9],
                   residual_in_fp32=True, tie_word_embeddings=True),
}


def build(arch: str, out: Path) -> Path:
    from mlxb.models.presets import _tiny
    from mlxb.models.synth import write_folder

    cfg = {**BASE, **ARCHS[arch]}
    return write_folder(_tiny(f"sweep-{arch}", arch, model_type=arch, **cfg), out / arch)


def mlxb(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "mlxb.commands.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, COLUMNS="200"), timeout=timeout)


def parity(folder: Path) -> str:
    r = mlxb("parity", "-m", str(folder), "--b", "1,2,3", "-c", "join", "-c", "leave", "--against", "live", "--json")
    try:
        out = json.loads(r.stdout)
    except json.JSONDecodeError:
        return "FAILED: " + (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
    res = out["results"]
    exact = sum(x["exact"] == x["steps"] > 0 for x in res)
    bad = [x["case"] for x in res if not x["ok"]]
    return (f"{'ok' if out['ok'] else 'FAILED'} {exact}/{len(res)} exact" + (f", failing {bad}" if bad else "")
            + (f", skipped {out['skipped']}" if out.get("skipped") else ""))


def serve(folder: Path, flags: tuple = ()) -> str:
    import concurrent.futures as cf

    import httpx

    from mlxb.bench import servers

    srv = servers.start("mlxb", str(folder), batch=4, ready_timeout=120, extra=flags)
    try:
        url = srv.base_url + "/chat/completions"
        body = lambda i: {"model": srv.model_name, "max_tokens": 12, "messages": [  # noqa: E731
            {"role": "system", "content": "You are a careful assistant. " * 20},
            {"role": "user", "content": f"question {i}: what is {i} plus {i}?"}]}
        with cf.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(httpx.post, url, json=body(i), timeout=120) for i in range(2)]
            with httpx.stream("POST", url, json={**body(9), "stream": True}, timeout=120) as s:
                chunks = sum(1 for line in s.iter_lines() if line.startswith("data: {"))
            rs = [f.result() for f in futs]
        codes = [r.status_code for r in rs]
        stats = httpx.get(srv.base_url.rsplit("/v1", 1)[0] + "/stats", timeout=10).json()
        health = httpx.get(srv.base_url.rsplit("/v1", 1)[0] + "/health", timeout=10).status_code
        lane = stats.get("engine", {}).get("serial_reason") or stats.get("serial_reason") or ""
        ok = codes == [200, 200] and chunks > 0 and health == 200
        return f"{'ok' if ok else 'FAILED'} codes {codes}, stream chunks {chunks}, health {health}" + (
            f", serial: {lane}" if lane else "") + ("" if ok else "\n" + srv.log_tail(15))
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--keep", default="")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--flags", default="")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(ARCHS)
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="mlxb-sweep-"))
    for arch in names:
        t0 = time.time()
        try:
            folder = build(arch, root)
        except Exception as e:  # the config guess, not mlxb: say so and go on
            print(f"{arch:12s} not built: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        p = "-" if a.no_parity else parity(folder)
        try:
            s = "" if a.no_serve else serve(folder, tuple(a.flags.split()))
        except Exception as e:
            s = f"FAILED to start: {str(e)[-400:]}"
        print(f"{arch:12s} parity {p} | serve {s} [{time.time() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
