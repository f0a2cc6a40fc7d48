"""The ASGI app (Starlette on uvicorn): routes call the gateway and nothing else.

The engine runs on its own thread; streams reach the event loop through ``OutputStream``
(``call_soon_threadsafe``), so neither side ever blocks the other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxb.engine.gateway import Gateway
from mlxb.errors import MlxbError, ModelNotFoundError, ValidationError
from mlxb.server import protocol as P
from mlxb.server.metrics import Metrics
from mlxb.server.agent_routes import agent_routes
from mlxb.server.toolcalls import ToolCallStream
from mlxb.server.toolcalls import split as split_tool_calls

DEFAULT_MAX_BODY = 4 << 20


class _HTTPError(MlxbError):
    def __init__(self, status: int, message: str, kind: str, code: str):
        super().__init__(message, code=code)
        self.status, self.kind = status, kind


def _choice_input(inp, i: int):
    """Choice ``i`` of a request with ``n`` > 1: the same input, its seed offset by ``i`` (unseeded
    choices sample independently)."""
    sp = inp.sampling
    seed = None if sp.seed is None else sp.seed + i
    return dataclasses.replace(inp, sampling=dataclasses.replace(sp, seed=seed), request_id=None)


def err(e: MlxbError) -> JSONResponse:
    return JSONResponse(P.error_body(e), status_code=e.status)


def create_app(gateway: Gateway, *, api_key: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY,
               served_names: Optional[set[str]] = None) -> Starlette:
    gw = gateway
    metrics = Metrics()
    names = {gw.model_name} | set(served_names or ())
    adapter_paths = dict(getattr(getattr(gw.engine.model, "mlxb_lora", None), "paths", {}))
    started = time.time()

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        if (request.headers.get("authorization", "") != f"Bearer {api_key}"
                and request.headers.get("x-api-key") != api_key):  # Anthropic's clients send x-api-key
            raise _HTTPError(401, "missing or invalid API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                             "authentication_error", "invalid_api_key")

    async def read_json(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise _HTTPError(413, f"request body is {length} bytes; the limit is {max_body_bytes}",
                             "invalid_request_error", "body_too_large")
        body = b""
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                raise _HTTPError(413, f"request body exceeds the limit of {max_body_bytes} bytes",
                                 "invalid_request_error", "body_too_large")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValidationError(f"malformed JSON body: {e}") from None

    async def completions(request: Request, chat: bool):
        subs, received = [], time.perf_counter()
        try:
            check_auth(request)
            body = await read_json(request)
            inp, opts = P.parse(body, chat=chat, default_max_tokens=gw.default_max_tokens)
            inp.adapter, inp.received = _adapter(opts), received
            loop = asyncio.get_running_loop()
            echoes, prompt_lens = [], []  # echo: per choice, the prompt's text and logprobs block
            for k, (text, ids) in enumerate(opts["prompts"]):  # a completions batch: prompt by prompt
                base = inp if k == 0 else dataclasses.replace(inp, prompt=text, prompt_ids=ids)
                if opts["score_only"]:  # max_tokens 0 with echo: checked like a request, never submitted
                    req = gw.build(base)
                else:
                    for i in range(opts["n"]):  # n choices: rows of the batch, seeds offset by the choice index
                        subs.append(await gw.submit_async(base if i == 0 else _choice_input(base, i), loop))
                    req = subs[-1][0]
                prompt_lens.append(req.num_prompt_tokens)
                if opts["echo"]:
                    echoes += [await echo_of(text, req.prompt_ids, req.adapter, opts)] * opts["n"]
        except MlxbError as e:
            for req, _ in subs:
                gw.cancel(req.request_id)
            metrics.requests.labels("chat" if chat else "completions", f"http_{e.status}").inc()
            return err(e)
        except ClientDisconnect:
            return Response(status_code=499)
        for req, _ in subs:
            metrics.prompt_tokens.inc(req.num_prompt_tokens)
        cid, model = P.new_id(chat), gw.model_name
        if opts["score_only"]:
            return scored(echoes, prompt_lens, cid, model, opts)
        if opts["stream"]:
            return StreamingResponse(sse(subs, cid, model, chat, opts, echoes), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(subs, cid, model, chat, opts, echoes)

    async def echo_of(text, ids, slot, opts):
        """The echoed prompt of a completions choice: its text and, with logprobs, every prompt token's
        logprob (scored on the engine thread between iterations)."""
        lp = None
        if opts["logprobs"]:
            try:
                scores = await asyncio.get_running_loop().run_in_executor(None, gw.engine.score, ids, opts["top"], slot)
            except MlxbError:
                raise
            except Exception as e:
                raise MlxbError(f"scoring the prompt failed: {e}", param="echo") from None
            lp = P.echo_logprobs(gw.tokenizer, ids, scores)
        return (text if text is not None else gw.tokenizer.decode(ids)), lp

    def scored(echoes, prompt_lens, cid, model, opts):
        """``echo`` with ``max_tokens: 0``: the prompts and their logprobs, nothing generated."""
        metrics.requests.labels("completions", "ok").inc()
        u = {"prompt_tokens": sum(prompt_lens), "completion_tokens": 0, "total_tokens": sum(prompt_lens)}
        choices = [P.choice(False, i, text, "length", lp) for i, (text, lp) in enumerate(echoes)]
        if not opts["stream"]:
            return JSONResponse(P.full(cid, model, False, choices, u))

        async def events():
            for i, (text, lp) in enumerate(echoes):
                yield f"data: {json.dumps(P.chunk(cid, model, False, text, 'length', lp, index=i))}\n\n"
            if opts["include_usage"]:
                yield f"data: {json.dumps({'id': cid, 'object': 'text_completion', 'created': int(time.time()), 'model': model, 'choices': [], 'usage': P.usage(u)})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _adapter(opts) -> Optional[str]:
        """The request's LoRA adapter: ``model: "base:name"`` (as vLLM lists them) or mlx-lm's ``adapters``."""
        model, want = opts["model"], opts["adapters"]
        if model is not None and model not in names and model != "default_model":
            base, _, name = model.rpartition(":")
            if base not in names or name not in gw.adapters:
                raise ModelNotFoundError(f"model {model!r} is not served here; this server serves "
                                         f"{sorted(names | adapter_ids())} (see GET /v1/models)", param="model")
            want = want or name
        if want is not None:
            by_path = {str(Path(p).expanduser().resolve()): n for n, p in adapter_paths.items()}
            want = by_path.get(str(Path(want).expanduser().resolve()), want) if want not in gw.adapters else want
            if want not in gw.adapters:
                raise ModelNotFoundError(f"adapter {want!r} is not loaded here; loaded: {gw.adapters or 'none'} "
                                         "(start the server with --adapters NAME=PATH)", param="adapters")
        return want

    def adapter_ids() -> set:
        return {f"{gw.model_name}:{a}" for a in gw.adapters}

    def observe(out, last_t):
        now = time.perf_counter()
        if out.token is not None:
            metrics.tokens.inc()
            if last_t is not None:
                metrics.itl.observe(now - last_t)
        return now

    def lp_block(chat, outs):
        return (P.logprobs_chat if chat else P.logprobs_completion)(gw.tokenizer, outs)

    async def drain(req, stream):
        outs, last = [], None
        try:
            async for out in stream:
                observe(out, None)
                outs.append(out)
                last = out
        finally:
            if last is None or last.finish_reason is None:
                gw.cancel(req.request_id)
        if last.timings and last.timings.get("ttft_s") is not None:
            metrics.ttft.observe(last.timings["ttft_s"])
        return outs, last

    async def collect(subs, cid, model, chat, opts, echoes=()):
        tasks = [asyncio.ensure_future(drain(req, st)) for req, st in subs]
        try:
            done = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        kind = "chat" if chat else "completions"
        for _, last in done:
            if last.finish_reason == "error":
                metrics.requests.labels(kind, "error").inc()
                return err(last.error if isinstance(last.error, MlxbError) else MlxbError(str(last.error)))
        metrics.requests.labels(kind, "ok").inc()
        choices = []
        for i, (outs, last) in enumerate(done):
            shown, echo_lp = echoes[i] if echoes else ("", None)
            lp = None
            if opts["logprobs"]:
                lp = lp_block(chat, outs) if chat else P.join_logprobs(echo_lp, P.logprobs_completion(gw.tokenizer, outs, len(shown)))
            body = "".join(o.text for o in outs)
            if echoes:
                body = shown + P.echo_gap(gw.tokenizer, next((o.token for o in outs if o.token is not None), None), body) + body
            calls, reason = None, P.finish(last.finish_reason)
            fmt = subs[i][0].tool_format
            if opts["tools"] and fmt is not None:
                body, calls = split_tool_calls(fmt, opts["tools"], body, None if opts["parallel_tool_calls"] else 1,
                                              cut=last.finish_reason == "length")
                if calls and reason == "stop":
                    reason = "tool_calls"
            choices.append(P.choice(chat, i, body, reason, lp, calls))
        return JSONResponse(P.full(cid, model, chat, choices, P.total_usage([last.usage for _, last in done], opts["n"])))

    async def merged(subs):
        """(choice index, output) from every choice's stream as they come; (index, None) ends a choice."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    await q.put((i, out))
            finally:
                await q.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, st)) for i, (_, st) in enumerate(subs)]
        try:
            open_ = len(subs)
            while open_:
                i, out = await q.get()
                if out is None:
                    open_ -= 1
                else:
                    yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def sse(subs, cid, model, chat, opts, echoes=()):
        n = len(subs)
        done, last_t, first = [False] * n, [None] * n, [True] * n
        usages, offset = [None] * n, [0] * n  # offset: completion text so far (legacy logprobs' text_offset)
        gapped: set = set()
        calls = [ToolCallStream(req.tool_format, opts["tools"], None if opts["parallel_tool_calls"] else 1)
                 if (opts["tools"] and req.tool_format is not None) else None for req, _ in subs]
        kind = "chat" if chat else "completions"
        try:
            for i, (shown, echo_lp) in enumerate(echoes):  # echo: each choice starts with its prompt
                yield f"data: {json.dumps(P.chunk(cid, model, chat, shown, None, echo_lp, index=i))}\n\n"
                offset[i] = len(shown)
            async for i, out in merged(subs):
                last_t[i] = observe(out, last_t[i])
                lp = None
                if opts["logprobs"] and out.logprob is not None:
                    lp = lp_block(chat, [out]) if chat else P.logprobs_completion(gw.tokenizer, [out], offset[i])
                    if not chat:
                        offset[i] += sum(len(t) for t in lp["tokens"])
                if echoes and out.token is not None and i not in gapped:
                    gapped.add(i)  # the first generated token of an echoed choice: keep its leading space
                    out = dataclasses.replace(out, text=P.echo_gap(gw.tokenizer, out.token, out.text or "") + (out.text or ""))
                parts = [("content", out.text or "")]
                if calls[i] is not None:  # text is split into content and tool calls (a tag may wait a chunk)
                    parts = calls[i].feed(out.text or "") + (calls[i].finish(out.finish_reason == "length") if out.finish_reason is not None else [])
                    parts = parts or [("content", "")]
                for part, v in parts:
                    text, tc = (v, None) if part == "content" else ("", v)
                    if text or tc or lp or first[i]:
                        if first[i] and out.timings is None:
                            metrics.ttft.observe(time.perf_counter() - subs[i][0].timings.submitted)
                        yield f"data: {json.dumps(P.chunk(cid, model, chat, text, None, lp, first[i], tc, i))}\n\n"
                        first[i], lp = False, None
                if out.finish_reason is not None:
                    done[i], usages[i] = True, out.usage
                    if out.finish_reason == "error":
                        e = out.error if isinstance(out.error, MlxbError) else MlxbError(str(out.error))
                        yield f"data: {json.dumps(P.error_body(e))}\n\n"
                    reason = P.finish(out.finish_reason)
                    if calls[i] is not None and calls[i].num_calls and reason == "stop":
                        reason = "tool_calls"
                    yield f"data: {json.dumps(P.chunk(cid, model, chat, '', reason, index=i))}\n\n"
                    metrics.requests.labels(kind, out.finish_reason).inc()
            if all(done):
                if opts["include_usage"]:
                    u = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [],
                         "usage": P.usage(P.total_usage(usages, opts["n"]))}
                    yield f"data: {json.dumps(u)}\n\n"
                yield "data: [DONE]\n\n"
        finally:
            for (req, _), d in zip(subs, done):
                if not d:  # the client went away mid-stream: free the row within one step
                    gw.cancel(req.request_id)
                    metrics.requests.labels(kind, "disconnected").inc()

    async def chat_route(request: Request):
        return await completions(request, chat=True)

    async def completions_route(request: Request):
        return await completions(request, chat=False)

    def model_cards() -> list[dict]:
        return ([{"id": n, "object": "model", "created": int(started), "owned_by": "mlxb",
                  # the parser for this chat template's tool calls (None: calls stay text), the format forced
                  # calls are written in, whether the template renders tools or mlxb adds them (the addendum)
                  **gw.tool_card()} for n in sorted(names)]
                + [{"id": a, "object": "model", "created": int(started), "owned_by": "mlxb", "parent": gw.model_name}
                   for a in sorted(adapter_ids())])

    async def models_route(request: Request):
        try:
            check_auth(request)
        except MlxbError as e:
            return err(e)
        return JSONResponse({"object": "list", "data": model_cards()})

    async def model_route(request: Request):
        """GET /v1/models/{id}: one served model or adapter (ids may hold slashes: a folder's path)."""
        try:
            check_auth(request)
            want = request.path_params["model_id"]
            for card in model_cards():
                if card["id"] in (want, "/" + want):
                    return JSONResponse(card)
            raise ModelNotFoundError(f"model {want!r} is not served here; this server serves "
                                     f"{[c['id'] for c in model_cards()]} (see GET /v1/models)", param="model")
        except MlxbError as e:
            return err(e)

    async def health(request: Request):
        if gw.engine.alive:
            why = gw.engine.device_health.degraded()
            if why is None:
                return JSONResponse({"status": "ok"})
            return JSONResponse({"status": "degraded", "reason": why}, status_code=503)
        reason = repr(gw.engine.fatal) if gw.engine.fatal else "engine thread not running"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    async def stats(request: Request):
        s = gw.engine.stats()
        batch = {k: s[k] for k in ("configured", "mode", "batched", "active_rows", "pending_rows", "submitted_rows",
                                   "kv_bytes", "kv_budget_bytes")}
        return JSONResponse({"model": gw.model_name, "batch": batch,
                             "prompt_cache": ({**s["prompt_cache"], "reply_ids": gw.replies.stats()}
                                              if isinstance(s["prompt_cache"], dict) and gw.replies else s["prompt_cache"]),
                             "shared_prefix": s["shared_prefix"],
                             "engine": {k: v for k, v in s.items() if k not in batch and k not in ("prompt_cache",
                                                                                                  "shared_prefix")},
                             "gil_switch_interval_ms": round(sys.getswitchinterval() * 1000, 4),
                             "uptime_s": round(time.time() - started, 3), "alive": gw.engine.alive})

    async def metrics_route(request: Request):
        return Response(metrics.render(gw.engine.stats()), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
        Route("/chat/completions", chat_route, methods=["POST"]),
        Route("/v1/completions", completions_route, methods=["POST"]),
        *agent_routes(gw, SimpleNamespace(check_auth=check_auth, read_json=read_json, adapter=_adapter, drain=drain,
                                          observe=observe, metrics=metrics)),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/models/{model_id:path}", model_route, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]

    async def not_found(request, exc):
        code = getattr(exc, "status_code", 404)
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}",
                                       "type": "invalid_request_error", "param": None, "code": str(code)}}, status_code=code)

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.state.gateway = gw
    return app
