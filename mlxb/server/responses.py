"""OpenAI's Responses API (``POST /v1/responses``) over the chat path.

A request is translated into a chat-completions body (so validation, the chat template, tools,
structured outputs and sampling are the chat path's own), and the chat output is shaped back into a
``response`` object, or, streaming, into the API's typed events (``response.created`` ...
``response.output_text.delta`` ... ``response.completed``).

Stateless: nothing is stored, so ``previous_response_id`` and ``conversation`` are refused (send the
whole conversation as ``input``, as agents with ``store: false`` do); the prompt cache still reuses the
shared prefix of consecutive turns. Input items: messages (``input_text`` / ``output_text`` parts),
``function_call`` and ``function_call_output``; ``reasoning`` items are dropped (no reasoning is kept).
Tools: ``function`` tools only.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from mlxb.errors import MlxbError
from mlxb.server.translate import bad as _bad, function_tools, join_text

STATEFUL = {"previous_response_id": "previous_response_id (a stored earlier response)",
            "conversation": "conversation (a stored conversation)",
            "prompt": "prompt (a stored prompt template)"}
ROLES = ("user", "assistant", "system", "developer")


def _text(content: Any, where: str) -> str:
    """A message's content: a string or text parts (``input_text``, ``output_text``, ``text``)."""
    return join_text(content, f"{where}.content", "input", ("input_text", "output_text", "text"))


def _messages(body: dict) -> list[dict]:
    msgs: list[dict] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            _bad("instructions must be a string", "instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        _bad("input must be a string or a non-empty list of input items", "input")
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            _bad(f"{where} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ROLES:
                _bad(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", "input")
            msgs.append({"role": role, "content": _text(it.get("content", ""), where)})
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(it.get("name"), str) or not isinstance(it.get("call_id"), str):
                _bad(f"{where}: a {kind} needs name and call_id", "input")
            args = it.get("arguments", "{}") if kind == "function_call" else json.dumps({"input": it.get("input", "")})
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant":  # the turn's text and its (parallel) calls:
                last.setdefault("tool_calls", []).append(call)    # one assistant message, as in chat
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str):
                _bad(f"{where}: a {kind} needs call_id", "input")
            out = it.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"],
                         "content": out if isinstance(out, str) else _text(out, where)})
        elif kind == "reasoning":
            continue  # no reasoning is kept between turns here
        else:
            _bad(f"{where}: input items of type {kind!r} are not supported (messages, function_call, "
                 "function_call_output, custom_tool_call, custom_tool_call_output)", "input")
    return msgs


FREEFORM = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
            "additionalProperties": False}  # a custom tool's raw text, as the one argument of a function


def _tool(i: int, t: Any) -> dict:
    kind = t.get("type") if isinstance(t, dict) else t
    if kind == "custom" and isinstance(t.get("name"), str):  # freeform input (Codex's apply_patch): one string
        note = "Its whole input is free text, given as the string argument `input`."
        return {"name": t["name"], "description": f"{t.get('description', '')} {note}".strip(), "parameters": FREEFORM}
    if kind != "function":
        _bad(f"tools[{i}]: only function and custom tools are served here (got {kind!r})", "tools")
    return {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}


def _custom_names(body: dict) -> set:
    return {t["name"] for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "custom"}


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": choice.get("name")}}
    _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")


def _format(text: Any) -> Optional[dict]:
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    _bad(f"text.format.type {fmt.get('type')!r}: use text, json_object or json_schema", "text")


def to_chat(body: Any) -> tuple[dict, dict]:
    """A Responses request as a chat-completions body, and what the response echoes back."""
    if not isinstance(body, dict):
        _bad("the request body must be a JSON object", "body")
    for key, what in STATEFUL.items():
        if body.get(key) not in (None, ""):
            raise MlxbError(f"{key}: {what} is not kept by mlxb (it stores nothing); send the whole conversation "
                            "in input instead", param=key, code="unsupported_field")
    if body.get("background"):
        raise MlxbError("background: background responses are not supported by mlxb; remove the field",
                        param="background", code="unsupported_field")
    include = body.get("include") or []
    logprobs = "message.output_text.logprobs" in include
    chat = {"messages": _messages(body), "model": body.get("model"), "stream": bool(body.get("stream", False))}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("top_k", "top_k"), ("min_p", "min_p"), ("stop", "stop"),
                     ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                     ("repetition_penalty", "repetition_penalty"), ("cache_prompt", "cache_prompt"),
                     ("ignore_eos", "ignore_eos"),
                     ("chat_template_kwargs", "chat_template_kwargs"), ("adapters", "adapters")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = function_tools(body.get("tools"), _tool)
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        if body.get("parallel_tool_calls") is not None:
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    elif body.get("tool_choice") not in (None, "auto", "none"):
        _bad("tool_choice needs tools", "tool_choice")
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = int(body.get("top_logprobs") or 0)
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "metadata": body.get("metadata") or {}, "text": body.get("text") or {"format": {"type": "text"}},
            "store": False, "stream": chat["stream"], "user": body.get("user"), "custom_tools": _custom_names(body)}
    return chat, echo


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Builder:
    """The response object and its stream events, fed with the chat output as it comes."""

    def __init__(self, echo: dict, model: str, calls=None):
        self.echo, self.model, self.calls = echo, model, calls  # calls: a ToolCallStream, or None
        self.id, self.created = _new("resp"), int(time.time())
        self.output: list[dict] = []
        self.msg: Optional[dict] = None  # the open message item
        self.seq = 0
        self.status, self.usage, self.incomplete, self.error = "in_progress", None, None, None

    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "model": self.model, "output": self.output, "usage": self.usage, "error": self.error,
                "incomplete_details": self.incomplete, "output_text": self.output_text(),
                **{k: v for k, v in self.echo.items() if k not in ("stream", "custom_tools")}}

    def output_text(self) -> str:
        return "".join(p["text"] for it in self.output if it["type"] == "message" for p in it["content"])

    def start(self) -> list[dict]:
        snap = self.response()
        return [self._ev("response.created", response=snap), self._ev("response.in_progress", response=snap)]

    def _open_message(self) -> list[dict]:
        self.msg = {"id": _new("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.output.append(self.msg)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.msg["content"].append(part)
        i = len(self.output) - 1
        return [self._ev("response.output_item.added", output_index=i, item={**self.msg, "content": []}),
                self._ev("response.content_part.added", item_id=self.msg["id"], output_index=i, content_index=0,
                         part={**part, "logprobs": []})]

    def _close_message(self) -> list[dict]:
        if self.msg is None:
            return []
        m, i = self.msg, self.output.index(self.msg)
        part = m["content"][0]
        m["status"] = "completed" if self.status != "incomplete" else "incomplete"
        self.msg = None
        return [self._ev("response.output_text.done", item_id=m["id"], output_index=i, content_index=0,
                         text=part["text"], logprobs=part["logprobs"]),
                self._ev("response.content_part.done", item_id=m["id"], output_index=i, content_index=0, part=part),
                self._ev("response.output_item.done", output_index=i, item=m)]

    def _text(self, text: str, lps: list) -> list[dict]:
        if not text and not lps:
            return []
        evs = self._open_message() if self.msg is None else []
        part = self.msg["content"][0]
        part["text"] += text
        part["logprobs"] += lps
        evs.append(self._ev("response.output_text.delta", item_id=self.msg["id"], output_index=len(self.output) - 1,
                            content_index=0, delta=text, logprobs=lps))
        return evs

    def _calls(self, calls: list[dict]) -> list[dict]:
        evs = self._close_message()
        for c in calls:
            name, args = c["function"]["name"], c["function"]["arguments"]
            if name in self.echo.get("custom_tools", ()):
                evs += self._custom_call(c["id"], name, args)
                continue
            item = {"id": _new("fc"), "type": "function_call", "status": "completed", "call_id": c["id"],
                    "name": name, "arguments": args}
            self.output.append(item)
            i = len(self.output) - 1
            evs += [self._ev("response.output_item.added", output_index=i,
                             item={**item, "arguments": "", "status": "in_progress"}),
                    self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                             delta=item["arguments"]),
                    self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                             arguments=item["arguments"], name=item["name"]),
                    self._ev("response.output_item.done", output_index=i, item=item)]
        return evs

    def _custom_call(self, call_id: str, name: str, args: str) -> list[dict]:
        """A custom tool's call: its ``input`` text, not JSON arguments."""
        try:
            text = json.loads(args).get("input", args) if args else ""
        except (ValueError, AttributeError):
            text = args
        item = {"id": _new("ctc"), "type": "custom_tool_call", "status": "completed", "call_id": call_id, "name": name,
                "input": text if isinstance(text, str) else json.dumps(text)}
        self.output.append(item)
        i = len(self.output) - 1
        return [self._ev("response.output_item.added", output_index=i, item={**item, "input": "", "status": "in_progress"}),
                self._ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=i, delta=item["input"]),
                self._ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=i, input=item["input"]),
                self._ev("response.output_item.done", output_index=i, item=item)]

    def feed(self, text: str, lps: Optional[list] = None) -> list[dict]:
        parts = self.calls.feed(text) if self.calls is not None else [("content", text)]
        return self._parts(parts, lps or [])

    def _parts(self, parts, lps) -> list[dict]:
        evs: list[dict] = []
        for kind, v in parts:
            evs += self._text(v, lps) if kind == "content" else self._calls(v)
            lps = []
        if lps:  # a token whose text is held back (a possible tool tag): its logprob still counts
            evs += self._text("", lps)
        return evs

    def finish(self, reason: Optional[str], usage: Optional[dict], error: Optional[MlxbError] = None) -> list[dict]:
        evs = self._parts(self.calls.finish(reason == "length"), []) if self.calls is not None else []
        if usage:
            self.usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                          "total_tokens": usage["total_tokens"],
                          "input_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0), "cache_write_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}
        if error is not None or reason == "error":
            self.status = "failed"
            self.error = {"code": getattr(error, "code", None) or "server_error",
                          "message": getattr(error, "message", None) or str(error)}
        elif reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        evs += self._close_message()
        kind = {"failed": "response.failed", "incomplete": "response.incomplete"}.get(self.status, "response.completed")
        return evs + [self._ev(kind, response=self.response())]
