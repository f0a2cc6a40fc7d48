"""The agent APIs' routes (``/v1/responses``; Anthropic's ``/v1/messages`` and ``count_tokens``): each
request translated onto the chat path (``mlxb.server.responses``, ``mlxb.server.anthropic``), its output
shaped back into that API's objects or typed stream events. ``h`` carries the app's shared helpers
(auth, body reading, adapter choice, draining a stream, metrics)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlxb.errors import MlxbError
from mlxb.server import anthropic as A
from mlxb.server import protocol as P
from mlxb.server import responses as R
from mlxb.server.toolcalls import ToolCallStream


def agent_routes(gw, h) -> list[Route]:
    async def begin(request: Request, kind: str, translate, error_body):
        """Auth, body, translation onto the chat path and submission: (row, stream, options, what the
        translation returned besides the chat body), or the error as a response in the API's own shape."""
        received = time.perf_counter()
        try:
            h.check_auth(request)
            body, extra = translate(await h.read_json(request))
            inp, opts = P.parse(body, chat=True, default_max_tokens=gw.default_max_tokens)
            inp.adapter, inp.received = h.adapter(opts), received
            req, stream = await gw.submit_async(inp, asyncio.get_running_loop())
        except MlxbError as e:
            h.metrics.requests.labels(kind, f"http_{e.status}").inc()
            return JSONResponse(error_body(e), status_code=e.status)
        except ClientDisconnect:
            return Response(status_code=499)
        h.metrics.prompt_tokens.inc(req.num_prompt_tokens)
        return req, stream, opts, extra

    def tool_stream(req, opts):
        if not opts["tools"] or req.tool_format is None:
            return None
        return ToolCallStream(req.tool_format, opts["tools"], None if opts["parallel_tool_calls"] else 1)

    def typed_sse(req, stream, first: list, step, kind: str):
        """Server-sent typed events (``event: TYPE``): ``first``, then ``step(output)``'s for each output."""
        async def gen():
            finished = False
            try:
                for ev in first:
                    yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"
                async for out in stream:
                    h.observe(out, None)
                    evs = step(out)
                    finished = out.finish_reason is not None
                    for ev in evs:
                        yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"
            finally:
                if not finished:  # the client went away mid-stream: free the row within one step
                    gw.cancel(req.request_id)
                    h.metrics.requests.labels(kind, "disconnected").inc()

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def engine_error(last) -> Optional[MlxbError]:
        if last.finish_reason != "error":
            return None
        return last.error if isinstance(last.error, MlxbError) else MlxbError(str(last.error))

    async def responses_route(request: Request):
        """POST /v1/responses: OpenAI's Responses API over the chat path (``mlxb.server.responses``)."""
        got = await begin(request, "responses", R.to_chat, P.error_body)
        if isinstance(got, Response):
            return got
        req, stream, opts, echo = got
        b = R.Builder(echo, opts["model"] or gw.model_name, tool_stream(req, opts))

        def lps(out):
            return P.logprobs_chat(gw.tokenizer, [out])["content"] if opts["logprobs"] and out.logprob else []

        def end(last):
            h.metrics.requests.labels("responses", last.finish_reason or "error").inc()
            return b.finish(last.finish_reason, last.usage, engine_error(last))

        if not echo["stream"]:
            outs, last = await h.drain(req, stream)
            for o in outs:
                b.feed(o.text or "", lps(o))
            end(last)
            return JSONResponse(b.response(), status_code=500 if b.status == "failed" else 200)
        return typed_sse(req, stream, b.start(),
                         lambda out: b.feed(out.text or "", lps(out)) + (end(out) if out.finish_reason else []),
                         "responses")

    async def messages_route(request: Request):
        """POST /v1/messages: Anthropic's Messages API over the chat path (``mlxb.server.anthropic``)."""
        got = await begin(request, "messages", lambda body: (A.to_chat(body), None), A.error_body)
        if isinstance(got, Response):
            return got
        req, stream, opts, _ = got
        b = A.Builder(opts["model"] or gw.model_name, tool_stream(req, opts), req.num_prompt_tokens)

        def end(last):
            h.metrics.requests.labels("messages", last.finish_reason or "error").inc()
            e = engine_error(last)
            if e is not None:
                return [A.error_body(e)]
            return b.finish(last.finish_reason, last.usage, last.stop_sequence)

        if not opts["stream"]:
            outs, last = await h.drain(req, stream)
            for o in outs:
                b.feed(o.text or "")
            e = engine_error(last)
            if e is not None:
                h.metrics.requests.labels("messages", "error").inc()
                return JSONResponse(A.error_body(e), status_code=500 if e.status < 500 else e.status)
            end(last)
            return JSONResponse(b.message())
        return typed_sse(req, stream, b.start(),
                         lambda out: b.feed(out.text or "") + (end(out) if out.finish_reason else []), "messages")

    async def count_tokens_route(request: Request):
        """POST /v1/messages/count_tokens: the prompt's tokens under the chat template, tools included."""
        try:
            h.check_auth(request)
            inp, opts = P.parse(A.to_chat(await h.read_json(request), count_only=True), chat=True,
                                default_max_tokens=gw.default_max_tokens)
            h.adapter(opts)
            return JSONResponse({"input_tokens": len(gw.tokenize(inp))})
        except MlxbError as e:
            return JSONResponse(A.error_body(e), status_code=e.status)

    return [Route("/v1/responses", responses_route, methods=["POST"]),
            Route("/v1/messages", messages_route, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens_route, methods=["POST"])]
