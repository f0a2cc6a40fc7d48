"""A lone request through a running ``mlxb serve``, timed like ``bench engine``'s in-process B=1 arm.

The served arm sends the in-process arm's own prompt token ids to ``/v1/completions`` (streaming,
greedy, ``ignore_eos``), so both decode the same tokens from the same prompt and the ratio is only
what serving costs: HTTP, the event loop, the SSE encoding and the server's threads. Times are taken
where the client sees them: token 0 at its first text chunk, token 1 at the second, and the last
token at ``[DONE]`` (after the finish and usage chunks). Each request also opens its own connection,
as a client without keep-alive would; both make the served side, if anything, charged a little more
than the in-process one.

A token whose text is empty (part of a multi-byte character) sends no chunk; the second chunk is
then token 2. Random-weight presets rarely do this; the count of tokens is checked from ``usage``.
"""

from __future__ import annotations

import asyncio

import httpx

from mlxb.bench.load import decode_rates, stream_request


def served_single(base_url: str, model: str, prompt: list[int], gen: int) -> dict:
    """One streamed greedy completion of exactly ``gen`` tokens; rates as ``bench.load.decode_rates`` gives them."""
    async def go():
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
            body = {"model": model, "prompt": prompt, "max_tokens": gen, "ignore_eos": True, "temperature": 0.0}
            return await stream_request(client, base_url, body, 0)

    r = asyncio.run(go())
    if not r.ok:
        raise RuntimeError(f"served arm: the request to {base_url} failed: {r.error}")
    if r.completion_tokens != gen or not r.itls:
        raise RuntimeError(f"served arm: asked for {gen} tokens, usage says {r.completion_tokens} "
                           f"in {len(r.itls) + 1} text chunks")
    t0 = r.start + r.ttft
    return {"tokens": gen, "wall": r.end - r.start, "ttft": r.ttft, **decode_rates([t0, t0 + r.itls[0], r.end], gen)}
