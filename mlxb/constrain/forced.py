"""Forced tool calls as a grammar, written in the model's own tool-call format.

``tool_choice: "required"`` (or a named function) constrains decoding to calls of the declared tools.
The calls are written the way this model's chat template writes them, so mlx-lm's parser for that
format reads them back (``mlxb.server.toolcalls``) and the model stays on text it was trained on.
A model whose template has no format mlx-lm knows gets the JSON-in-tags form (``json_tools``: the
``<tool_call>{"name", "arguments"}</tool_call>`` shape Hermes and Qwen templates use); its output is
parsed with the same parser, whatever the template.

Each writer builds a Lark grammar for llguidance:

* formats whose arguments are a JSON object (json_tools, mistral, kimi_k2, kimi_k3, llama3_json, harmony)
  embed the function's JSON Schema with ``%json``;
* formats that write one argument per tag (qwen3_coder, glm47 / laguna, longcat, minimax_m2,
  minicpm5, muse_spark, gemma4, function_gemma) and pythonic keyword calls go property by property
  in the schema's order: required properties always, optional ones optionally, each value as the
  format writes it: a string property as raw text (no ``<``, no newline; ``enum``, ``const``,
  ``minLength`` and ``maxLength`` are enforced), every other value as JSON for its own subschema.
  Properties not declared under ``properties`` cannot be written in these formats.

``parallel`` allows one or more calls (the model ends the turn after any of them); ``False`` allows
exactly one. A special token of the vocabulary (``<|tool_call_start|>``, ``[TOOL_CALLS]``, ...) is
matched as that token, not spelled out in pieces.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

JSON_COMPACT = {"whitespace_flexible": False}

# formats whose calls are written one per tagged span ("each") or together in one span ("section")
EACH, SECTION = "each", "section"


class Lark:
    """A grammar under construction: literals (special-token aware), rules, ``%json`` values."""

    def __init__(self, specials: frozenset = frozenset()):
        self.rules: list[str] = []
        self.n = 0
        self.specials = specials  # the text of every special token: written as <|...|> / <[id]> tokens

    def new(self, body: str, prefix: str = "r") -> str:
        self.n += 1
        name = f"{prefix}{self.n}"
        self.rules.append(f"{name}: {body}")
        return name

    def lit(self, text: str) -> str:
        """``text`` as a sequence of quoted literals and special tokens (empty text: nothing)."""
        parts, rest = [], text
        while rest:
            hit = min(((rest.find(s), s) for s in self.specials if s and s in rest), default=None)
            if hit is None:
                parts.append(_q(rest))
                break
            i, s = hit
            if i:
                parts.append(_q(rest[:i]))
            parts.append(s)
            rest = rest[i + len(s):]
        return " ".join(parts) if parts else '""'

    def json(self, schema: dict) -> str:
        schema = dict(schema) if isinstance(schema, dict) else {}
        schema["x-guidance"] = JSON_COMPACT
        return self.new(f"%json {json.dumps(schema, ensure_ascii=False)}", "j")

    def raw_string(self, prop: dict, stop: str = "<") -> str:
        """A string property written as plain text: its enum / const, or characters up to its length."""
        options = prop.get("enum") if isinstance(prop.get("enum"), list) else (
            [prop["const"]] if "const" in prop else None)
        if options is not None and all(isinstance(o, str) for o in options):
            return self.new(" | ".join(self.lit(o) if o else '""' for o in options), "e")
        lo = int(prop.get("minLength", 0) or 0)
        hi = prop.get("maxLength")
        count = f"{{{lo},{int(hi)}}}" if isinstance(hi, int) else (f"{{{lo},}}" if lo else "*")
        cls = "[^" + "".join("\\" + c if c in "]\\^-" else c for c in stop) + "\\n]"
        return self.new(f"/{cls}{count}/", "s")

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}"] + self.rules) + "\n"


def _q(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _is_string(prop: dict) -> bool:
    return isinstance(prop, dict) and (prop.get("type") == "string" or (
        "type" not in prop and isinstance(prop.get("enum"), list) and prop["enum"]
        and all(isinstance(o, str) for o in prop["enum"])))


def _props(params: dict) -> list[tuple[str, dict, bool]]:
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict):
        return []
    required = set(params.get("required") or [])
    return [(k, v if isinstance(v, dict) else {}, k in required) for k, v in props.items()]


def _kw_args(g: Lark, params: dict, value: Callable[[str, dict], str], sep: str) -> str:
    """Keyword arguments in schema order with ``sep`` between the present ones: required always,
    optional ones optionally. ``rest(i, lead)``: the arguments from the i-th on, ``lead`` when one was
    written before (so the next present one needs ``sep``)."""
    items = [(value(k, p), req) for k, p, req in _props(params)]
    memo: dict = {}

    def rest(i: int, lead: bool) -> str:
        if i == len(items):
            return '""'
        if (i, lead) not in memo:
            item, req = items[i]
            present = f"{g.lit(sep) + ' ' if lead else ''}{item} {rest(i + 1, True)}"
            memo[i, lead] = g.new(present if req else f"{present} | {rest(i + 1, lead)}", "a")
        return memo[i, lead]

    return rest(0, False)


def _tag_args(g: Lark, params: dict, open_: Callable[[str], str], close: str, strings: str = "raw") -> str:
    """One tag pair per argument (XML-like formats): ``open_(name)`` value ``close``, in schema order."""
    parts = []
    for k, p, req in _props(params):
        v = g.raw_string(p) if (strings == "raw" and _is_string(p)) else g.json(p)
        item = g.new(f"{g.lit(open_(k))} {v} {g.lit(close)}", "p")
        parts.append(item if req else f"{item}?")
    return " ".join(parts) if parts else '""'


# ---- one call, per format ------------------------------------------------------------------------
def _json_tools(g, name, params, i):
    obj = {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
           "required": ["name", "arguments"], "additionalProperties": False}
    return f"{g.lit(chr(10))} {g.json(obj)} {g.lit(chr(10))}"


def _llama3_json(g, name, params, i):
    return f"{g.lit('{' + _q('name') + ': ' + _q(name) + ', ' + _q('parameters') + ': ')} {g.json(params)} {g.lit('}')}"


def _harmony(g, name, params, i):  # after "<|channel|>commentary to=functions."; <|call|> ends the turn
    return f"{g.lit(name + ' <|constrain|>json<|message|>')} {g.json(params)}"


def _mistral_json(g, name, params, i):
    return f"{g.lit('{' + _q('name') + ': ' + _q(name) + ', ' + _q('arguments') + ': ')} {g.json(params)} {g.lit('}')}"


def _mistral_args(g, name, params, i):
    return f"{g.lit(name + '[ARGS]')} {g.json(params)}"


def _qwen3_coder(g, name, params, i):
    args = _tag_args(g, params, lambda k: f"<parameter={k}>\n", "\n</parameter>\n")
    return f"{g.lit(chr(10) + '<function=' + name + '>' + chr(10))} {args} {g.lit('</function>' + chr(10))}"


def _glm47(g, name, params, i):
    return f"{g.lit(name)} {_tag_args(g, params, lambda k: f'<arg_key>{k}</arg_key><arg_value>', '</arg_value>')}"


def _longcat(g, name, params, i):
    return f"{g.lit(name)} " + _tag_args(g, params, lambda k: f"<longcat_arg_key>{k}</longcat_arg_key><longcat_arg_value>",
                                         "</longcat_arg_value>")


def _minimax(g, name, params, i):
    args = _tag_args(g, params, lambda k: f'<parameter name="{k}">', "</parameter>")
    return f"{g.lit(chr(10) + '<invoke name=' + _q(name) + '>')} {args} {g.lit('</invoke>')}"


def _minicpm5(g, name, params, i):  # the span opens inside the tag: <function name= "fn"> ... </function>
    args = _tag_args(g, params, lambda k: f'<param name="{k}">', "</param>")
    return f"{g.lit(_q(name) + '>')} {args}"


def _muse_spark(g, name, params, i):  # values are read as JSON first: strings go as JSON strings
    args = _tag_args(g, params, lambda k: f'<atem:parameter name="{k}">', "</atem:parameter>", strings="json")
    return f"{g.lit('<atem:invoke name=' + _q(name) + '>')} {args} {g.lit('</atem:invoke>')}"


def _kimi_k2(g, name, params, i):
    return (f"{g.lit('<|tool_call_begin|>functions.' + name + ':' + str(i) + '<|tool_call_argument_begin|>')} "
            f"{g.json(params)} {g.lit('<|tool_call_end|>')}")


def _kimi_k3(g, name, params, i):
    head = f'<|open|>call tool="{name}" index="{i + 1}"<|sep|><|open|>json type="object"<|sep|>'
    return f"{g.lit(head)} {g.json(params)} {g.lit('<|close|>json<|sep|><|close|>call<|sep|>')}"


def _pythonic(g, name, params, i):
    args = _kw_args(g, params, lambda k, p: g.new(f"{g.lit(k + '=')} {g.json(p)}", "k"), ", ")
    return f"{g.lit(name + '(')} {args} {g.lit(')')}"


def _gemma_call(quote: str):
    """Gemma's ``call:name{key:value,...}``: string values between ``quote`` tags (``<|"|>`` in Gemma 4,
    ``<escape>`` in FunctionGemma), every other value as JSON."""
    def write(g, name, params, i):
        def value(k, p):
            v = f"{g.lit(quote)} {g.raw_string(p)} {g.lit(quote)}" if _is_string(p) else g.json(p)
            return g.new(f"{g.lit(k + ':')} {v}", "k")

        return f"{g.lit('call:' + name + '{')} {_kw_args(g, params, value, ',')} {g.lit('}')}"

    return write


# name -> (layout, one call's writer, separator between calls)
# "each": start tag + call + end tag per call, calls separated by sep; "section": start tag + calls joined by
# sep + end tag.
WRITERS: dict[str, tuple] = {
    "json_tools": (EACH, _json_tools, "\n"),
    "qwen3_coder": (EACH, _qwen3_coder, "\n"),
    "glm47": (EACH, _glm47, "\n"),
    "laguna": (EACH, _glm47, "\n"),
    "longcat": (EACH, _longcat, "\n"),
    "minicpm5": (EACH, _minicpm5, ""),
    "function_gemma": (EACH, _gemma_call("<escape>"), ""),
    "gemma4": (EACH, _gemma_call('<|"|>'), ""),
    "minimax_m2": (SECTION, _minimax, ""),
    "muse_spark": (SECTION, _muse_spark, ""),
    "kimi_k2": (SECTION, _kimi_k2, ""),
    "kimi_k3": (SECTION, _kimi_k3, ""),
    "pythonic": (SECTION, _pythonic, ", "),
    "mistral": (SECTION, _mistral_json, ", "),  # [TOOL_CALLS][{...}, {...}]
    "mistral_args": (SECTION, _mistral_args, "[TOOL_CALLS]"),  # [TOOL_CALLS]name[ARGS]{...}
    "llama3_json": (SECTION, _llama3_json, "; "),
    "harmony": (EACH, _harmony, "<|start|>assistant"),  # each call its own message
}


def forced_calls(tools: list[dict], only: Optional[str], fmt_name: str, start: str, end: str, parallel: bool,
                 specials: frozenset = frozenset(), max_calls: int = 8) -> Optional[str]:
    """The Lark grammar of forced calls in format ``fmt_name`` (None: no writer for that format).
    ``only``: the named function; ``parallel``: 1..``max_calls`` calls, else exactly one."""
    if fmt_name not in WRITERS:
        return None
    layout, write, sep = WRITERS[fmt_name]
    g = Lark(specials)
    fns = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    n = max_calls if parallel else 1

    def call(i: int) -> str:
        return g.new(" | ".join(write(g, f["name"], f.get("parameters") or {"type": "object"}, i) for f in fns), "c")

    if fmt_name in ("pythonic", "mistral"):  # one bracketed list after the tag
        start, end = start + "[", "]" + end
    if layout == EACH:
        one = [g.new(f"{g.lit(start)} {call(i)} {g.lit(end)}", "t") for i in range(n)]
    else:
        one = [call(i) for i in range(n)]
    # call 0, then optionally call 1 after a separator, and so on: an index per position (kimi ids count)
    tail = None
    for i in range(n - 1, -1, -1):
        tail = one[i] if tail is None else g.new(f"{one[i]} ({g.lit(sep) if sep else ''} {tail})?", "n")
    body = tail if layout == EACH else f"{g.lit(start)} {tail} {g.lit(end)}"
    return g.text(body)
