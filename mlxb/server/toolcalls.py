"""The agent API's output side: the model's text split into content and OpenAI ``tool_calls``.

The format parser is mlx-lm's (``TokenizerWrapper.tool_parser``, with the template's start and end
tags); this module only finds the tagged spans, also across streaming deltas (a tag split over two
chunks is held back until it is whole), and shapes the calls: ``{"id", "type": "function",
"function": {"name", "arguments": "<JSON string>"}}``. A span the parser rejects, or one left open
at the end, comes back as plain content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from mlxb.constrain.tools import ToolFormat


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _shape(parsed: Any) -> list[dict]:
    items = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for p in items:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise ValueError(f"not a tool call: {p!r}")
        args = p.get("arguments", {})
        out.append({"id": _call_id(), "type": "function",
                    "function": {"name": p["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


class ToolCallStream:
    """Feed text deltas; get ("content", str) and ("calls", [call, ...]) events in order."""

    def __init__(self, fmt: ToolFormat, tools: Optional[list[dict]], max_calls: Optional[int] = None):
        assert fmt.on
        self.fmt, self.tools, self.max_calls = fmt, tools, max_calls
        self.buf = ""
        self.in_call = False
        self.opened = fmt.start  # the spelling of the start tag that opened the current span
        self.num_calls = 0

    def _parse(self, span: str) -> Optional[list[dict]]:
        """The calls in one tagged span, numbered on from the calls before (``index``), or None."""
        try:
            calls = _shape(self.fmt.parser(self.opened + span if self.fmt.keep_start else span, self.tools))
        except Exception:
            return None
        if self.max_calls is not None:  # parallel_tool_calls false: the first call only
            calls = calls[:max(0, self.max_calls - self.num_calls)]
        for c in calls:
            c["index"] = self.num_calls
            self.num_calls += 1
        return calls

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        events: list[tuple[str, Any]] = []
        starts, end = self.fmt.all_starts, self.fmt.end
        while True:
            if not self.in_call:
                # the earliest start tag (the longest spelling where two begin at the same place)
                hits = [(i, -len(s), s) for s in starts for i in [self.buf.find(s)] if i >= 0]
                if not hits:
                    keep = max((k for s in starts for k in range(min(len(s) - 1, len(self.buf)), 0, -1)
                                if s.startswith(self.buf[-k:])), default=0)
                    emit, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if emit:
                        events.append(("content", emit))
                    return events
                i, _, start = min(hits)
                if i > 0:
                    events.append(("content", self.buf[:i]))
                self.buf, self.in_call, self.opened = self.buf[i + len(start):], True, start
            else:
                j = self.buf.find(end) if end else -1
                if j < 0:
                    return events
                span, self.buf, self.in_call = self.buf[:j], self.buf[j + len(end):], False
                calls = self._parse(span)
                if calls is None:
                    events.append(("content", self.opened + span + end))
                elif calls:
                    events.append(("calls", calls))

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The rest. A span left open is parsed as it is (a format without an end tag, or a model that
        ended the turn instead of writing it), unless ``cut`` (the row hit max_tokens) and the format has
        an end tag: a call cut short is content, not a call with arguments missing."""
        events: list[tuple[str, Any]] = []
        if self.in_call:
            calls = self._parse(self.buf) if self.buf.strip() and not (cut and self.fmt.end) else None
            if calls is None:
                events.append(("content", self.opened + self.buf))
            elif calls:
                events.append(("calls", calls))
        elif self.buf:
            events.append(("content", self.buf))
        self.buf, self.in_call = "", False
        return events


def split(fmt: ToolFormat, tools: Optional[list[dict]], text: str,
          max_calls: Optional[int] = None, cut: bool = False) -> tuple[Optional[str], list[dict]]:
    """Whole output -> (content or None, tool calls)."""
    s = ToolCallStream(fmt, tools, max_calls)
    content, calls = [], []
    for kind, v in s.feed(text) + s.finish(cut):
        if kind == "content":
            content.append(v)
        else:
            calls.extend({k: x for k, x in c.items() if k != "index"} for c in v)
    body = "".join(content)
    if calls and not body.strip():
        return None, calls
    return body, calls
