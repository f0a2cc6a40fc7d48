"""`mlxb generate`: one prompt (or K of them) through the engine, streamed to the terminal."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer

from mlxb.commands._common import DtypeOpt, ModelOpt, cli_errors, console


@cli_errors
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text (chat template applied unless --raw)."),
    model: ModelOpt = None,
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", min=1),
    temp: float = typer.Option(0.0, "--temp", min=0.0),
    seed: Optional[int] = typer.Option(None, "--seed"),
    raw: bool = typer.Option(False, "--raw", help="Feed the prompt as plain text, no chat template."),
    dtype: DtypeOpt = None,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object: text, token ids, finish reason, timings."),
) -> None:
    """Generate from one prompt through mlx-lm's stream_generate."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlxb.models import load_model

    t_load = time.perf_counter()
    m, tok, spec, path = load_model(model, dtype)
    load_s = time.perf_counter() - t_load
    ids = tok.encode(prompt) if raw else tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    if seed is not None:
        mx.random.seed(seed)
    sampler = make_sampler(temp=temp)
    text, tokens, finish, last = [], [], None, None
    t0 = time.perf_counter()
    for r in stream_generate(m, tok, ids, max_tokens=max_tokens, sampler=sampler):
        if r.finish_reason != "stop" or r.token not in tok.eos_token_ids:
            tokens.append(r.token)
        text.append(r.text)
        if not json_out:
            console.print(r.text, end="", markup=False, highlight=False, soft_wrap=True)
        finish, last = r.finish_reason, r
    total = time.perf_counter() - t0
    out = {
        "model": spec.name,
        "text": "".join(text),
        "prompt_tokens": len(ids),
        "token_ids": tokens,
        "finish_reason": finish,
        "timings": {
            "load_s": round(load_s, 4),
            "total_s": round(total, 4),
            "prompt_tps": round(last.prompt_tps, 2) if last else None,
            "generation_tps": round(last.generation_tps, 2) if last else None,
        },
    }
    if json_out:
        print(json.dumps(out))
    else:
        console.print()
        console.print(f"[dim]{len(tokens)} tokens, finish={finish}, {out['timings']['generation_tps']} tok/s ({spec.name})[/]")
