"""Streaming load client for any OpenAI-compatible server, and the metrics it reports.

Per request: TTFT (first SSE chunk carrying content), inter-token latencies between content
chunks, TPOT ((e2el - ttft) / (completion_tokens - 1)), end-to-end latency, prompt / completion /
cached tokens (from the usage chunk, else counted from content chunks), and the error.
Per run: aggregate output tok/s = completion tokens / wall window (first send to last byte), never
a sum of per-stream rates; request throughput; error rate; p50/p90/p95/p99 of ttft, tpot, itl and
e2el (the names ``vllm bench serve`` uses).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable, Optional

import httpx
import numpy as np

from mlxb.bench.apis import APIS, piece_and_usage, shaped  # noqa: F401  (APIS: the CLI's --api choices)
from mlxb.bench.datasets import (AGENT_TOOLS, Dataset, _follow_up, agent_loop_dataset, jsonl_dataset,  # noqa: F401
                                 mixed_dataset, multi_turn_dataset, random_dataset, shared_prefix_dataset)

PCTS = (50, 90, 95, 99)


@dataclass
class RequestResult:
    index: int
    start: float  # monotonic seconds
    ok: bool = False
    error: Optional[str] = None
    status: Optional[int] = None
    ttft: Optional[float] = None
    e2el: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: Optional[int] = None
    completion_tokens: int = 0
    cached_tokens: Optional[int] = None
    end: Optional[float] = None
    logprob_tokens: int = 0  # content tokens that came with logprobs
    min_top_logprobs: Optional[int] = None  # fewest top_logprobs alternatives on any of them
    text: str = ""  # the reply (multi-turn conversations send it back); not stored in results
    turn: Optional[int] = None  # multi-turn datasets: 0 for a conversation's first request, then 1, 2, ...
    constrained: bool = False  # the request asked for a forced tool call or a response format (a grammar row)
    tools: bool = False  # the request declared tools

    @property
    def tpot(self) -> Optional[float]:
        if not self.ok or self.ttft is None or self.e2el is None or self.completion_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.completion_tokens - 1)

    def to_row(self) -> dict:
        d = asdict(self)
        del d["text"]
        d["tpot"] = self.tpot
        d["itl_mean"] = float(np.mean(self.itls)) if self.itls else None
        d["itls"] = [float(x) for x in self.itls]
        return d


def _pcts(values: list[float], prefix: str) -> dict:
    out = {}
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    out[f"mean_{prefix}"] = float(arr.mean()) if arr.size else None
    for p in PCTS:
        out[f"p{p}_{prefix}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def summarize(results: list[RequestResult]) -> dict:
    """Run-level metrics from per-request results (exact, no timing of its own)."""
    ok = [r for r in results if r.ok]
    n = len(results)
    if not results:
        return {"requests": 0}
    t0 = min(r.start for r in results)
    t1 = max((r.end for r in results if r.end is not None), default=t0)
    wall = max(t1 - t0, 1e-9)
    out_tokens = sum(r.completion_tokens for r in ok)
    s = {
        "requests": n,
        "completed": len(ok),
        "failed": n - len(ok),
        "error_rate": (n - len(ok)) / n,
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_throughput": out_tokens / wall,
        "request_throughput": len(ok) / wall,
    }
    s.update(_pcts([r.ttft for r in ok], "ttft"))
    s.update(_pcts([r.tpot for r in ok], "tpot"))
    s["constrained"] = sum(r.constrained for r in ok)
    # rows with neither tools nor a grammar: beside grammar rows, or beside the same prompts unconstrained
    s.update(_pcts([r.tpot for r in ok if not r.constrained and not r.tools], "tpot_free"))
    # their gaps between tokens: the median is the decode step those rows saw, whatever the arrivals did (TPOT
    # also charges prefills of later arrivals run between their tokens, and so follows how arrivals line up)
    s.update(_pcts([x for r in ok if not r.constrained and not r.tools for x in r.itls], "itl_free"))
    s.update(_pcts([x for r in ok for x in r.itls], "itl"))
    s.update(_pcts([r.e2el for r in ok], "e2el"))
    if any(r.turn is not None for r in results):  # conversations: what a returning agent waits for
        later = [r for r in results if (r.turn or 0) >= 1]
        s.update(_pcts([r.ttft for r in later if r.ok], "ttft_later"))
        s["failed_turns"] = sum(not r.ok for r in results)
        s["turns_later"] = len(later)
    return s


# ---- one streamed request --------------------------------------------------------------------
async def stream_request(client: httpx.AsyncClient, base_url: str, payload: dict, index: int,
                         api_key: Optional[str] = None, clock: Callable[[], float] = time.perf_counter,
                         api: str = "chat") -> RequestResult:
    chat = "messages" in payload
    path, body = shaped(payload, api)
    url = base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = RequestResult(index, clock())
    res.constrained = payload.get("tool_choice") not in (None, "auto", "none") or bool(payload.get("response_format"))
    res.tools = bool(payload.get("tools"))
    last = None
    counted = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    err = json.loads(text)["error"]
                    text = err["message"] if isinstance(err, dict) else err
                except Exception:
                    pass
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                pieces, usage, error = piece_and_usage(api, chat, chunk, res)
                if error:
                    res.error = error
                    return res
                for piece in pieces:
                    if piece:
                        res.text += piece
                        now = clock()
                        if res.ttft is None:
                            res.ttft = now - res.start
                        elif last is not None:
                            res.itls.append(now - last)
                        last = now
                        counted += 1
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
        res.end = clock()
        res.e2el = res.end - res.start
        if not res.completion_tokens:
            res.completion_tokens = counted  # the server sent no usage: count content chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        if res.end is None:
            res.end = clock()
    return res


# ---- arrival processes -----------------------------------------------------------------------
def arrival_gaps(rate: float, burstiness: float, n: int, seed: int = 0) -> list[float]:
    """Gaps between request sends: gamma with shape ``burstiness`` and mean ``1/rate`` (1.0 = Poisson)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n).tolist()


async def closed_loop(send: Callable[[int], Awaitable[RequestResult]], concurrency: int, n_requests: int,
                      on_done: Optional[Callable[[RequestResult], None]] = None) -> list[RequestResult]:
    """``concurrency`` workers, each sending its next request when the previous one ends."""
    nxt = iter(range(n_requests))
    results: list[RequestResult] = []

    async def worker():
        for i in nxt:
            r = await send(i)
            results.append(r)
            if on_done:
                on_done(r)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    return sorted(results, key=lambda r: r.index)


async def open_loop(send: Callable[[int], Awaitable[RequestResult]], rate: float, burstiness: float, duration: float,
                    seed: int = 0, on_done: Optional[Callable[[RequestResult], None]] = None) -> list[RequestResult]:
    """Send on a gamma/Poisson schedule for ``duration`` seconds, never waiting for replies."""
    gaps = arrival_gaps(rate, burstiness, max(1, int(rate * duration * 3) + 10), seed)
    tasks, t, i = [], 0.0, 0
    start = time.perf_counter()
    for g in gaps:
        t += g
        if t > duration:
            break
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

        async def one(k=i):
            r = await send(k)
            if on_done:
                on_done(r)
            return r

        tasks.append(asyncio.create_task(one()))
        i += 1
    return sorted(await asyncio.gather(*tasks), key=lambda r: r.index)


async def _conversations(send_payload: Callable[[dict, int], Awaitable["RequestResult"]], dataset: Dataset,
                         concurrency: int, n_requests: int,
                         on_done: Optional[Callable[["RequestResult"], None]]) -> list["RequestResult"]:
    """``concurrency`` conversations in flight; each sends its turns in order."""
    queue = list(dataset.conversations)
    out: list[RequestResult] = []
    counter = iter(range(10**9))

    async def worker():
        while queue and len(out) < n_requests:
            conv = queue.pop(0)
            msgs = [dict(m) for m in conv["messages"]]
            for turn, nxt in enumerate([*conv["users"], None]):
                if len(out) >= n_requests:
                    return
                res = await send_payload({"messages": msgs, "max_tokens": conv["max_tokens"], **conv["extra"]},
                                         next(counter))
                res.turn = turn
                out.append(res)
                if on_done:
                    on_done(res)
                if not res.ok or nxt is None:
                    break
                msgs = msgs + _follow_up(res.text, nxt)

    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return sorted(out, key=lambda r: r.index)


async def run_load(base_url: str, model: str, dataset: Dataset, *, concurrency: Optional[int] = None,
                   n_requests: Optional[int] = None, rate: Optional[float] = None, burstiness: float = 1.0,
                   duration: Optional[float] = None, ignore_eos: bool = False, api_key: Optional[str] = None,
                   seed: int = 0, on_done: Optional[Callable[[RequestResult], None]] = None,
                   timeout: float = 600.0, api: str = "chat") -> list[RequestResult]:
    """One closed-loop (``concurrency``) or open-loop (``rate``) run against ``base_url``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        def payload(i: int) -> dict:
            p: dict[str, Any] = dict(dataset.payloads[i % len(dataset)], model=model)
            if ignore_eos:
                p["ignore_eos"] = True
            return p

        async def send(i: int) -> RequestResult:
            return await stream_request(client, base_url, payload(i), i, api_key, api=api)

        if dataset.conversations is not None:
            def conv_payload(p: dict, i: int):
                p = dict(p, model=model)
                if ignore_eos:
                    p["ignore_eos"] = True
                return stream_request(client, base_url, p, i, api_key, api=api)

            return await _conversations(conv_payload, dataset, concurrency or 1, n_requests or len(dataset), on_done)

        if rate is not None:
            return await open_loop(send, rate, burstiness, duration or 10.0, seed, on_done)
        return await closed_loop(send, concurrency or 1, n_requests or len(dataset), on_done)


def knee(points: list[tuple[float, Optional[float]]], threshold: float) -> Optional[float]:
    """Highest load, going up, before p95 TTFT first exceeds ``threshold`` seconds (points: (load, p95))."""
    best = None
    # NOTE: within one load the worst repeat comes first (a failed repeat has no p95): any breach stops it
    for load, p95 in sorted(points, key=lambda x: (x[0], float("-inf") if x[1] is None else -x[1])):
        if p95 is None or p95 > threshold:
            break
        best = load
    return best


def decode_rates(ts: list, gen: int) -> dict:
    """One stream's decode rate from token 0 and from token 1 (arrival times of tokens 0, 1 and last)."""
    out = {"decode": (gen - 1) / (ts[-1] - ts[0])}
    if gen > 2:
        out["decode_from1"] = (gen - 2) / (ts[-1] - ts[1])
    return out
