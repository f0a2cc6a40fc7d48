"""Prompt cache across a restart: TTFT of a long repeated prompt, cold vs after a graceful restart
that wrote the cache to the SSD tier (the same server folder), plus a warm in-process repeat."""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from typing import Callable, Optional

import httpx

from mlxb.bench import load as L
from mlxb.bench import servers


async def _one(base_url: str, model: str, payload: dict, index: int) -> L.RequestResult:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return await L.stream_request(client, base_url, dict(payload, model=model), index)


def run(model_path: str, tokenizer, vocab: int, *, prompt_len: int = 2048, output_len: int = 16, repeats: int = 3,
        batch: int = 8, progress: Optional[Callable[[str, int, int], None]] = None) -> tuple[list, list]:
    """Per repeat, a fresh prompt and a fresh SSD folder: start, ask (cold), ask again (RAM hit),
    stop gracefully, start again on the same folder, ask (SSD hit). Returns (request rows, summary rows)."""
    req_rows, summ = [], []
    for rep in range(repeats):
        text = L._random_text(tokenizer, random.Random(7919 * rep + 1), prompt_len, vocab)
        payload = {"messages": [{"role": "user", "content": text}], "max_tokens": output_len, "ignore_eos": True}
        d = tempfile.mkdtemp(prefix="mlxb-restart-")
        phases = []
        srv = servers.start("mlxb", model_path, batch=batch, prompt_cache_dir=d)
        try:
            phases.append(("cold", asyncio.run(_one(srv.base_url, srv.model_name, payload, 0))))
            phases.append(("repeat", asyncio.run(_one(srv.base_url, srv.model_name, payload, 1))))
        finally:
            srv.stop(grace=60)
        srv = servers.start("mlxb", model_path, batch=batch, prompt_cache_dir=d)
        try:
            phases.append(("after-restart", asyncio.run(_one(srv.base_url, srv.model_name, payload, 2))))
        finally:
            srv.stop(grace=60)
            shutil.rmtree(d, ignore_errors=True)  # this repeat's SSD folder: nothing later reads it
        for name, r in phases:
            req_rows.append({"cell": "restart", "stack": name, **r.to_row()})
            summ.append({"cell": "restart", "stack": name, "concurrency": 1, "repeat": rep,
                         "status": "ok" if r.ok else "failed", "failed": 0 if r.ok else 1,
                         "p50_ttft": r.ttft, "p95_ttft": r.ttft, "prompt_tokens": r.prompt_tokens,
                         "cached_tokens": r.cached_tokens, "e2el": r.e2el, "server_flags": " ".join(srv.flags),
                         "error": r.error})
        if progress:
            progress("restart", rep + 1, repeats)
    return req_rows, summ
