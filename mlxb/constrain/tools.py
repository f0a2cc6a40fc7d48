"""The agent API's input side: chat history with tool turns, declared tools, and what constrains a row.

* ``normalize_messages`` checks roles and tool turns the way OpenAI's API defines them and hands the
  chat template what Hugging Face templates expect: an assistant turn's ``tool_calls`` with
  ``function.arguments`` as an object (a JSON string is parsed), ``content`` "" instead of null,
  ``tool`` turns with their ``tool_call_id``; ``developer`` is rendered as ``system``.
* ``ToolFormat`` is how the model writes a call: mlx-lm's own parser for the chat template
  (``TokenizerWrapper.tool_parser`` / ``tool_call_start`` / ``tool_call_end``), mlxb's parsers for
  Llama 3's JSON calls and gpt-oss's harmony calls, or none; ``ToolFormat.json_tools()`` is the form asked of the rest.
* ``constraint_grammar`` turns ``response_format``, ``structured_outputs`` (vLLM's extension:
  json / regex / grammar / choice) and a forced ``tool_choice`` into one llguidance grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mlxb.errors import ValidationError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(msg: str, param: str):
    raise ValidationError(msg, param=param)


def normalize_messages(msgs: Any) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            _bad(f"{where} must be an object", where)
        role = m.get("role")
        if not isinstance(role, str):
            _bad(f"{where} needs a string 'role'", f"{where}.role")
        if role not in ROLES:
            _bad(f"{where}.role {role!r} is not one of {', '.join(ROLES)}", f"{where}.role")
        m = dict(m, role="system" if role == "developer" else role)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                       for p in content):
                _bad(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p.get("text", "") for p in content)
        elif content is not None and not isinstance(content, str):
            _bad(f"{where}.content must be a string, a list of text parts, or null", f"{where}.content")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            _bad(f"{where}: only assistant turns carry tool_calls", f"{where}.tool_calls")
        if role == "assistant" and calls:
            m["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif calls is not None:
            m.pop("tool_calls")  # an empty list
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            _bad(f"{where}.content is required for a {role} turn", f"{where}.content")
        if role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                _bad(f"{where}.tool_call_id is required for a tool turn (the id of the call it answers)",
                     f"{where}.tool_call_id")
        m["content"] = content if content is not None else ""
        out.append(m)
    return out


def _tool_call(c: Any, where: str) -> dict:
    if not isinstance(c, dict):
        _bad(f"{where} must be an object", where)
    fn = c.get("function")
    if c.get("type", "function") != "function" or not isinstance(fn, dict):
        _bad(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            _bad(f"{where}.function.arguments is not valid JSON: {e}", f"{where}.function.arguments")
    if not isinstance(args, dict):
        _bad(f"{where}.function.arguments must be a JSON object (or its string)", f"{where}.function.arguments")
    # NOTE: templates read tool_call.function.name / .arguments, some read tool_call.name directly
    return {"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": args},
            "name": name, "arguments": args}


def validate_tools(tools: Any) -> Optional[list[dict]]:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        _bad("tools must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            _bad(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = t["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            _bad(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            _bad(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
        out.append(t)
    return out


def tool_choice_mode(choice: Any, tools: Optional[list[dict]]) -> tuple[str, Optional[str]]:
    """('none' | 'auto' | 'required', forced function name or None)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
                 "tool_choice")
        if choice != "none" and not tools:
            _bad(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not tools:
            _bad("tool_choice names a function but no tools are declared", "tool_choice")
        if name not in [t["function"]["name"] for t in tools]:
            _bad(f"tool_choice names {name!r}, which is not among the declared tools", "tool_choice")
        return "required", name
    _bad("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
         "tool_choice")


def parse_llama3_json(text: str, tools: Any = None):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), several
    separated by ``;``, optionally after ``<|python_tag|>``. mlx-lm ships no parser for this format."""
    text = text.strip()
    if text.startswith("<|python_tag|>"):
        text = text[len("<|python_tag|>"):]
    dec, pos, calls = json.JSONDecoder(), 0, []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text):
            break
        obj, pos = dec.raw_decode(text, pos)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError(f"not a Llama 3 tool call: {obj!r}")
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append({"name": obj["name"], "arguments": json.loads(args) if isinstance(args, str) else args})
    if not calls:
        raise ValueError("no tool call")
    return calls[0] if len(calls) == 1 else calls


_HARMONY_NAME = re.compile(r"[A-Za-z0-9_\-]+")
_HARMONY_HEAD = re.compile(r"\s*(<\|channel\|>\s*\w+)?\s*(<\|constrain\|>)?\s*(json)?\s*")
# a harmony call opens in the channel header (how gpt-oss writes it) or in the role header (how its
# template writes earlier calls); after the generation prompt's <|start|>assistant only the recipient is left
HARMONY_STARTS = ("<|start|>assistant<|channel|>commentary to=functions.", "<|channel|>commentary to=functions.",
                  "<|start|>assistant to=functions.", " to=functions.")


def parse_harmony(text: str, tools: Any = None):
    """gpt-oss's harmony call, the text after ``to=functions.``: ``NAME`` then the rest of the header
    (``<|channel|>commentary``, ``<|constrain|>json`` or ``json``, in either order of the two headers)
    then ``<|message|>`` and the JSON arguments; the ``<|call|>`` that ends it is the turn's stop token.
    mlx-lm ships no parser for this format."""
    m = _HARMONY_NAME.match(text)
    if not m:
        raise ValueError(f"no function name in {text[:40]!r}")
    head, sep, body = text[m.end():].partition("<|message|>")
    if not sep or not _HARMONY_HEAD.fullmatch(head):
        raise ValueError(f"not a harmony call header: {head[:40]!r}")
    body = body.strip()
    args = json.loads(body) if body else {}
    if not isinstance(args, dict):
        raise ValueError(f"harmony call arguments are not an object: {body[:40]!r}")
    return {"name": m.group(0), "arguments": args}


def _is_harmony(template: Any) -> bool:
    return isinstance(template, str) and all(k in template for k in ("<|channel|>", "<|message|>", "functions."))


def _is_llama3_json(template: Any) -> bool:
    return isinstance(template, str) and "tool_call" in template and '"parameters": ' in template \
        and '{"name": "' in template


@dataclass
class ToolFormat:
    """How this model's chat template writes tool calls: a parser (mlx-lm's for the template, or
    mlxb's own for a format mlx-lm lacks), the span's tags, and the forced-call writer
    (``mlxb.constrain.forced``). ``parser`` None: no format is known (calls come back as text).
    ``keep_start``: the start tag is part of the call (Llama 3's ``{"name"``), handed to the parser."""

    parser: Optional[Callable[[str, Any], Any]]
    start: Optional[str]
    end: Optional[str]
    name: Optional[str]
    writer: Optional[str] = None
    source: str = "mlx-lm"
    keep_start: bool = False
    starts: tuple = ()  # other spellings of the start tag (harmony: the recipient in either header)

    @classmethod
    def of(cls, tokenizer) -> "ToolFormat":
        parser = getattr(tokenizer, "tool_parser", None)
        start = getattr(tokenizer, "tool_call_start", None)
        template = getattr(tokenizer, "chat_template", None)
        if parser is None or not start:
            if _is_llama3_json(template):
                return cls(parse_llama3_json, '{"name"', "", "llama3_json", "llama3_json", "mlxb", keep_start=True)
            if _is_harmony(template):
                return cls(parse_harmony, HARMONY_STARTS[1], "<|call|>", "harmony", "harmony", "mlxb",
                           starts=HARMONY_STARTS)
            return cls(None, None, None, None)
        mod = (getattr(parser, "__module__", "") or "").rsplit(".", 1)[-1] or None
        from mlxb.constrain.forced import WRITERS

        writer = "mistral_args" if mod == "mistral" and isinstance(template, str) and "[ARGS]" in template else mod
        return cls(parser, start, getattr(tokenizer, "tool_call_end", None) or "", mod,
                   writer if writer in WRITERS else None)

    @classmethod
    def json_tools(cls) -> "ToolFormat":
        """The JSON-in-tags form (mlx-lm's json_tools parser): what mlxb asks of a model whose template
        has no tool format of its own, and what a forced call falls back to."""
        from mlx_lm.tool_parsers import json_tools as jt

        return cls(jt.parse_tool_call, jt.tool_call_start, jt.tool_call_end, "json_tools", "json_tools", "mlxb")

    @property
    def all_starts(self) -> tuple:
        return tuple(dict.fromkeys((self.start,) + self.starts)) if self.start else ()

    @property
    def on(self) -> bool:
        return self.parser is not None

    @property
    def forcible(self) -> bool:
        return self.on and self.writer is not None


def constraint_grammar(grammars, *, response_format: Any = None, structured: Any = None,
                       tools: Optional[list[dict]] = None, choice: tuple[str, Optional[str]] = ("none", None),
                       fmt: Optional[ToolFormat] = None, parallel: bool = True) -> Optional[tuple[str, str]]:
    """(grammar, kind) for this request, or None when nothing constrains it. Raises ValidationError
    (OpenAI 400) for a bad format or grammar, before any row exists."""
    asks = []
    if response_format is not None:
        if not isinstance(response_format, dict) or "type" not in response_format:
            _bad("response_format must be an object with a 'type'", "response_format")
        rtype = response_format["type"]
        if rtype == "json_object":
            asks.append(("json_object", lambda: grammars.from_schema({"type": "object"}, "response_format")))
        elif rtype == "json_schema":
            js = response_format.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                _bad("response_format.json_schema must be an object with a 'schema'", "response_format.json_schema")
            schema = js.get("schema", {"type": "object"})
            asks.append(("json_schema", lambda: grammars.from_schema(schema, "response_format.json_schema.schema")))
        elif rtype != "text":
            _bad(f"response_format.type {rtype!r} is not one of text, json_object, json_schema", "response_format.type")
    if structured is not None:
        if not isinstance(structured, dict):
            _bad("structured_outputs must be an object with one of json, regex, grammar, choice", "structured_outputs")
        keys = [k for k in ("json", "regex", "grammar", "choice") if structured.get(k) is not None]
        if len(keys) != 1:
            _bad("structured_outputs needs exactly one of json, regex, grammar, choice", "structured_outputs")
        k = keys[0]
        v, param = structured[k], f"structured_outputs.{k}"
        make = {"json": lambda: grammars.from_schema(v, param), "regex": lambda: grammars.from_regex(v, param),
                "grammar": lambda: grammars.from_lark(v, param), "choice": lambda: grammars.from_choice(v, param)}[k]
        asks.append((k, make))
    mode, name = choice
    if mode == "required":
        if fmt is None or not fmt.forcible:
            _bad(f"no forced-call grammar for the {fmt.name if fmt else 'unknown'} tool format", "tool_choice")
        asks.append(("tool_call", lambda: grammars.tool_calls(tools, fmt, name, parallel, "tool_choice")))
    if not asks:
        return None
    if len(asks) > 1:
        _bad("give only one of response_format (json), structured_outputs and a forced tool_choice",
             "response_format")
    kind, make = asks[0]
    param = {"json_object": "response_format", "json_schema": "response_format.json_schema",
             "tool_call": "tool_choice"}.get(kind, f"structured_outputs.{kind}")
    return grammars.validate(make(), param), kind
