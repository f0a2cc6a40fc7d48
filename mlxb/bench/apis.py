"""The load client's endpoints: a chat payload shaped for OpenAI chat, OpenAI Responses or Anthropic
Messages, and each one's stream events read back as text pieces, usage and errors."""

from __future__ import annotations

from typing import Optional

APIS = ("chat", "responses", "messages")  # the endpoint a chat payload goes to (OpenAI chat, OpenAI Responses, Anthropic)
PASSTHROUGH = ("temperature", "top_p", "seed", "ignore_eos", "cache_prompt", "adapters")


def shaped(payload: dict, api: str) -> tuple[str, dict]:
    """(path, streaming body) of a chat-style ``payload`` for ``api``; completions payloads stay as they are."""
    if "messages" not in payload or api == "chat":
        chat = "messages" in payload
        return ("/chat/completions" if chat else "/completions"), dict(payload, stream=True,
                                                                      stream_options={"include_usage": True})
    keep = {k: payload[k] for k in PASSTHROUGH + ("model",) if k in payload}
    if api == "responses":
        return "/responses", {**keep, "input": payload["messages"], "max_output_tokens": payload.get("max_tokens"),
                              "stream": True}
    system = "\n\n".join(m["content"] for m in payload["messages"] if m["role"] == "system")
    rest = [m for m in payload["messages"] if m["role"] != "system"]
    return "/messages", {**keep, **({"system": system} if system else {}), "messages": rest,
                         "max_tokens": payload.get("max_tokens") or 256, "stream": True}


def piece_and_usage(api: str, chat: bool, chunk: dict, res) -> tuple[list[str], Optional[dict], Optional[str]]:
    """One SSE payload: (text pieces, usage as prompt/completion/cached tokens, error)."""
    kind = chunk.get("type")
    if api == "responses":
        if kind == "response.output_text.delta":
            return [chunk.get("delta", "")], None, None
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            r = chunk.get("response") or {}
            u = r.get("usage") or {}
            usage = {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens"),
                     "prompt_tokens_details": {"cached_tokens": (u.get("input_tokens_details") or {}).get("cached_tokens")}}
            return [], usage, (str(r.get("error"))[:300] if kind == "response.failed" else None)
        return [], None, (str(chunk.get("message") or chunk)[:300] if kind == "error" else None)
    if api == "messages":
        if kind == "content_block_delta" and (chunk.get("delta") or {}).get("type") == "text_delta":
            return [chunk["delta"].get("text", "")], None, None
        if kind == "message_delta":
            u = chunk.get("usage") or {}
            cached = u.get("cache_read_input_tokens") or 0
            return [], {"prompt_tokens": (u.get("input_tokens") or 0) + cached, "completion_tokens": u.get("output_tokens"),
                        "prompt_tokens_details": {"cached_tokens": cached}}, None
        return [], None, (str(chunk.get("error"))[:300] if kind == "error" else None)
    if chunk.get("error"):
        return [], None, str(chunk["error"])[:300]
    pieces = []
    for ch in chunk.get("choices") or []:
        lp = ch.get("logprobs") or {}
        for entry in (lp.get("content") or []) if isinstance(lp, dict) else []:
            res.logprob_tokens += 1
            k = len(entry.get("top_logprobs") or [])
            res.min_top_logprobs = k if res.min_top_logprobs is None else min(res.min_top_logprobs, k)
        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        if piece:
            pieces.append(piece)
    return pieces, chunk.get("usage"), None
