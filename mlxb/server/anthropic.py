"""Anthropic's Messages API (``POST /v1/messages``) over the chat path, for agents built on it.

The request becomes a chat-completions body (``system`` a system message; ``tool_use`` blocks an
assistant message's ``tool_calls``; ``tool_result`` blocks ``tool`` messages; ``tools`` with
``input_schema`` function tools; ``tool_choice`` auto / any / tool / none), so validation, the chat
template, tool parsing, grammars, sampling, batching and the prompt cache are the chat path's. The
chat output comes back as a ``message`` with ``text`` and ``tool_use`` blocks, or, streaming, as the
API's events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors use Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``),
which its clients parse. ``cache_control`` marks are accepted and ignored: the prompt cache reuses any
shared prefix by itself, and ``usage.cache_read_input_tokens`` says how much it reused.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from mlxb.errors import MlxbError
from mlxb.server.translate import bad as _bad, function_tools, join_text

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(e: MlxbError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


def _text_of(content: Any, where: str) -> str:
    return join_text(content, where, "messages")


def _system(system: Any) -> Optional[dict]:
    if system in (None, "", []):
        return None
    if isinstance(system, str):
        return {"role": "system", "content": system}
    if isinstance(system, list):
        parts = []
        for j, b in enumerate(system):
            if not (isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)):
                _bad(f"system[{j}]: only text blocks are supported", "system")
            parts.append(b["text"])
        return {"role": "system", "content": "\n\n".join(parts)}
    _bad("system must be a string or a list of text blocks", "system")


def _messages(body: dict) -> list[dict]:
    msgs = [m for m in [_system(body.get("system"))] if m]
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        _bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            _bad(f"{where}.role {role!r} must be user or assistant (the system prompt goes in system)", "messages")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            _bad(f"{where}.content must be a string or a list of content blocks", "messages")
        text, calls, results = [], [], []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                text.append(b.get("text", ""))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    _bad(f"{at}: a tool_use block needs id and name", "messages")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    _bad(f"{at}: a tool_result block needs tool_use_id", "messages")
                out = _text_of(b.get("content", ""), f"{at}.content")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": ("Error: " + out) if b.get("is_error") else out})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # no reasoning is kept between turns here
            else:
                _bad(f"{at}: {kind!r} blocks are not supported in {role} messages (text, tool_use from the "
                     "assistant, tool_result from the user)", "messages")
        msgs.extend(results)  # the results answer the previous assistant turn's calls, before any new text
        if text or calls or not results:
            msg = {"role": role, "content": "".join(text) if text else (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    return msgs


def _tool(i: int, t: Any) -> dict:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str) or (t.get("type") not in (None, "custom")):
        _bad(f"tools[{i}]: only client tools with name and input_schema are served here "
             f"(got type {t.get('type') if isinstance(t, dict) else t!r})", "tools")
    return {"name": t["name"], **({"description": t["description"]} if t.get("description") else {}),
            "parameters": t.get("input_schema", {"type": "object"})}  # chat's key order: the template renders it


def _tool_choice(tc: Any) -> Any:
    if tc is None:
        return None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(tc.get("name"), str):
        return {"type": "function", "function": {"name": tc["name"]}}
    _bad("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}", "tool_choice")


def to_chat(body: Any, count_only: bool = False) -> dict:
    """A Messages request as a chat body; ``count_only`` (``count_tokens``) needs no ``max_tokens``."""
    if not isinstance(body, dict):
        _bad("the request body must be a JSON object", "body")
    if count_only:
        body = {**body, "max_tokens": 1}
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        _bad("max_tokens is required (an integer)", "max_tokens")
    chat = {"messages": _messages(body), "model": body.get("model"), "max_tokens": body["max_tokens"],
            "stream": bool(body.get("stream", False))}
    for key in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "cache_prompt", "adapters"):  # the last four: mlxb's
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = function_tools(body.get("tools"), _tool)
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
            if isinstance(body["tool_choice"], dict) and body["tool_choice"].get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
    elif (body.get("tool_choice") or {}).get("type") not in (None, "auto", "none"):
        _bad("tool_choice needs tools", "tool_choice")
    return chat


class Builder:
    """The message and its stream events, fed with the chat output as it comes."""

    def __init__(self, model: str, calls=None, prompt_tokens: int = 0):
        self.model, self.calls = model, calls  # calls: a ToolCallStream, or None
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.content: list[dict] = []
        self.open: Optional[int] = None  # index of the open text block
        self.prompt_tokens = prompt_tokens
        self.stop_reason = self.stop_sequence = None
        self.usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}

    def message(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence, "usage": self.usage}

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {**self.message(), "content": []}}, {"type": "ping"}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        return [{"type": "content_block_stop", "index": i}]

    def _text(self, text: str) -> list[dict]:
        if not text:
            return []
        evs = []
        if self.open is None:
            self.content.append({"type": "text", "text": ""})
            self.open = len(self.content) - 1
            evs.append({"type": "content_block_start", "index": self.open, "content_block": {"type": "text", "text": ""}})
        self.content[self.open]["text"] += text
        return evs + [{"type": "content_block_delta", "index": self.open, "delta": {"type": "text_delta", "text": text}}]

    def _calls(self, calls: list[dict]) -> list[dict]:
        evs = self._close()
        for c in calls:
            args = c["function"]["arguments"]
            try:
                inp = json.loads(args) if args else {}
            except ValueError:
                inp = {}
            block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": c["function"]["name"], "input": inp}
            self.content.append(block)
            i = len(self.content) - 1
            evs += [{"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                    {"type": "content_block_delta", "index": i,
                     "delta": {"type": "input_json_delta", "partial_json": json.dumps(inp)}},
                    {"type": "content_block_stop", "index": i}]
        return evs

    def _parts(self, parts) -> list[dict]:
        evs: list[dict] = []
        for kind, v in parts:
            evs += self._text(v) if kind == "content" else self._calls(v)
        return evs

    def feed(self, text: str) -> list[dict]:
        return self._parts(self.calls.feed(text) if self.calls is not None else [("content", text)])

    def finish(self, reason: Optional[str], usage: Optional[dict], stop_sequence: Optional[str] = None) -> list[dict]:
        evs = self._parts(self.calls.finish(reason == "length")) if self.calls is not None else []
        evs += self._close()
        if usage:
            cached = usage.get("cached_tokens", 0)
            self.usage = {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                          "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
        if reason == "length":
            self.stop_reason = "max_tokens"
        elif any(b["type"] == "tool_use" for b in self.content):
            self.stop_reason = "tool_use"
        elif stop_sequence:
            self.stop_reason, self.stop_sequence = "stop_sequence", stop_sequence
        else:
            self.stop_reason = "end_turn"
        return evs + [{"type": "message_delta", "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                       "usage": self.usage}, {"type": "message_stop"}]
