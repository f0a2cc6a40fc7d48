"""What the Responses and Messages adapters share when they turn a request into a chat body."""

from __future__ import annotations

from typing import Any, Optional

from mlxb.errors import ValidationError


def bad(msg: str, param: str):
    raise ValidationError(msg, param=param)


def join_text(content: Any, where: str, param: str, kinds: tuple = ("text",)) -> str:
    """A string, or a list of text parts of ``kinds`` (``refusal`` parts give their refusal text), as one
    string; any other part is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        bad(f"{where} must be a string or a list of text parts", param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal":
            out.append(part.get("refusal", ""))
        else:
            bad(f"{where}[{j}]: only text parts are supported (got {kind!r})", param)
    return "".join(out)


def function_tools(tools: Any, shape) -> Optional[list[dict]]:
    """``tools`` as chat function tools, each through ``shape(i, tool) -> function dict`` (which refuses
    what it cannot serve)."""
    if tools in (None, []):
        return None
    if not isinstance(tools, list):
        bad("tools must be a list", "tools")
    return [{"type": "function", "function": shape(i, t)} for i, t in enumerate(tools)]
