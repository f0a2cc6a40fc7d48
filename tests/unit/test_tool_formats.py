"""Tool-call formats without a model: every family's template writes calls its parser reads back (whole
and streamed character by character); forced-call grammars yield only valid calls and reject invalid
ones; special tokens are matched as tokens."""

import json
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from mlxb.constrain.forced import Lark, forced_calls
from mlxb.constrain.toolprompt import TemplateTools
from mlxb.constrain.tools import HARMONY_STARTS, ToolFormat, parse_harmony, parse_llama3_json
from mlxb.server.toolcalls import ToolCallStream, split
from tests.tool_templates import FAMILIES, family_folder

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                                       "maximum": 7},
                                     "unit": {"enum": ["c", "f"]}, "note": {"type": "string", "maxLength": 6}},
    "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
         {"id": "b", "type": "function", "function": {"name": "search", "arguments": {"q": "rain"}}}]


@pytest.fixture(scope="module")
def base():
    from mlxb.models import load_model

    return Path(load_model("tiny-llama", lazy=True)[3])


@pytest.fixture(scope="module")
def tokenizers(base, tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    root = tmp_path_factory.mktemp("fam")
    return {f: load(family_folder(base, root, f)) for f in list(FAMILIES) + ["plain"]}


@pytest.fixture(scope="module")
def grammars(tokenizers):
    from mlxb.constrain.grammar import Grammars

    tok = tokenizers["json_tools"]
    return Grammars(tok, len(tok._tokenizer), sorted(tok.eos_token_ids))


def _calls(got):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_template_writes_calls_its_parser_reads_back(tokenizers, family):
    tok = tokenizers[family]
    fmt = ToolFormat.of(tok)
    assert fmt.on and fmt.forcible, family
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": CALLS}],
                                   tools=TOOLS, tokenize=False)
    reply = text.split("<|im_start|>assistant\n")[-1].split("<|im_end|>")[0]
    want = [("get_weather", {"city": "Paris", "days": 2}), ("search", {"q": "rain"})]
    body, got = split(fmt, TOOLS, reply)
    assert body is None and _calls(got) == want
    s, events = ToolCallStream(fmt, TOOLS), []
    for ch in reply:
        events += s.feed(ch)
    events += s.finish()
    assert _calls([c for kind, v in events if kind == "calls" for c in v]) == want
    assert not "".join(v for kind, v in events if kind == "content").strip()
    one = split(fmt, TOOLS, reply, max_calls=1)[1]  # parallel_tool_calls false
    assert _calls(one) == want[:1]


def test_a_plain_template_is_probed_as_dropping_tools(tokenizers):
    tt = TemplateTools.probe(tokenizers["plain"])
    assert (tt.renders_tools, tt.renders_calls, tt.accepts_tool_turns, tt.mode) == (False, False, False, "addendum")
    assert TemplateTools.probe(tokenizers["plain"], tool_prompt=False).mode == "dropped"
    full = TemplateTools.probe(tokenizers["json_tools"])
    assert (full.renders_tools, full.renders_calls, full.accepts_tool_turns, full.mode) == (True, True, True, "template")
    assert ToolFormat.of(tokenizers["plain"]).on is False


def test_llama3_json_calls_parse_with_a_python_tag_and_semicolons():
    assert parse_llama3_json('<|python_tag|>{"name": "f", "parameters": {"a": 1}}') == {"name": "f", "arguments": {"a": 1}}
    two = parse_llama3_json('{"name": "f", "parameters": {}}; {"name": "g", "arguments": "{\\"b\\": 2}"}')
    assert two == [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]
    with pytest.raises(ValueError):
        parse_llama3_json('{"parameters": {}}')


def test_harmony_calls_are_read_as_gpt_oss_writes_them():
    fmt = ToolFormat(parse_harmony, HARMONY_STARTS[1], "<|call|>", "harmony", "harmony", "mlxb", starts=HARMONY_STARTS)
    # after the analysis channel, a call in the channel header; <|call|> is the stop token, so not in the text
    text = ('<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 3}')
    body, calls = split(fmt, TOOLS, text)
    assert _calls(calls) == [("get_weather", {"city": "Oslo", "days": 3})]
    assert body == "<|channel|>analysis<|message|>Need weather.<|end|>"
    s, events = ToolCallStream(fmt, TOOLS), []
    for ch in text:
        events += s.feed(ch)
    events += s.finish()
    assert [c for kind, v in events if kind == "calls" for c in v][0]["function"]["name"] == "get_weather"
    assert "".join(v for kind, v in events if kind == "content") == body
    # the recipient right after the generation prompt's <|start|>assistant (the role header)
    body, calls = split(fmt, TOOLS, ' to=functions.search<|channel|>commentary json<|message|>{"q": "rain"}<|call|>')
    assert body is None and _calls(calls) == [("search", {"q": "rain"})]
    # a final answer is no call; a call whose arguments are not JSON comes back as text
    assert split(fmt, TOOLS, "<|channel|>final<|message|>Sunny.") == ("<|channel|>final<|message|>Sunny.", [])
    body, calls = split(fmt, TOOLS, "<|channel|>commentary to=functions.search <|message|>not json<|call|>")
    assert not calls and "not json" in body
    with pytest.raises(ValueError):
        parse_harmony('search <|channel|>analysis<|start|>x<|message|>{}')


def _sample(grammars, lark: str, rng: random.Random, limit: int = 400) -> str:
    """A random string of the grammar: each step a random allowed token, until only the end remains."""
    import llguidance

    m = llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    out = []
    eos = set(grammars.eos_ids)
    for _ in range(limit):
        if m.is_stopped():
            break
        mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
        allowed = [t for t in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
                   if t < grammars.n_vocab]
        choices = [t for t in allowed if t not in eos] or allowed
        if m.is_accepting() and rng.random() < 0.3 or not choices:
            break
        t = int(rng.choice(choices))
        assert m.consume_token(t), m.get_error()
        out.append(t)
    assert m.is_accepting(), "the sample did not finish inside the limit"
    return grammars.hf.decode(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forced_grammars_yield_only_valid_calls(tokenizers, grammars, family):
    fmt = ToolFormat.of(tokenizers[family])
    start = "" if fmt.keep_start else fmt.start
    by = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    rng = random.Random(family)
    for only, parallel in ((None, False), ("search", False), (None, True)):
        lark = forced_calls(TOOLS, only, fmt.writer, start, fmt.end, parallel, grammars.specials, max_calls=3)
        for _ in range(3):
            text = _sample(grammars, lark, rng)
            body, calls = split(fmt, TOOLS, text)
            assert calls and (parallel or len(calls) == 1), (family, text)
            assert body is None or not body.strip(), (family, text)
            for name, args in _calls(calls):
                assert only in (None, name), (family, text)
                jsonschema.validate(args, by[name])


def _accepts(grammars, lark: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    for t in grammars.hf.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


@pytest.mark.parametrize("family,good,bad", [
    ("json_tools", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":3}}\n</tool_call>',
     ['<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',  # a required one missing
      '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","days":9}}\n</tool_call>']),  # past maximum
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>",
     ["<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo-Bergen\n</parameter>\n<parameter=days>\n3\n"
      "</parameter>\n</function>\n</tool_call>"]),  # over maxLength
    ("pythonic", '<|tool_call_start|>[get_weather(city="Oslo", days=3, unit="f")]<|tool_call_end|>',
     ['<|tool_call_start|>[get_weather(days=3)]<|tool_call_end|>',
      '<|tool_call_start|>[get_weather(city="Oslo", days=3, unit="k")]<|tool_call_end|>']),  # not in the enum
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo","days":3}'
                '<|call|>',
     ['<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>',
      '<|channel|>commentary to=functions.get_weather json<|message|>{"city":"Oslo","days":3}<|call|>']),  # header
    ("gemma4", '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:3}<tool_call|>',
     ['<|tool_call>call:get_weather{days:3,city:<|"|>Oslo<|"|>}<tool_call|>',  # out of the schema's order
      '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,,days:3}<tool_call|>']),  # a stray separator
])
def test_forced_grammars_accept_a_valid_call_and_reject_invalid_ones(tokenizers, grammars, family, good, bad):
    fmt = ToolFormat.of(tokenizers[family])
    lark = forced_calls(TOOLS, None, fmt.writer, fmt.start, fmt.end, False, grammars.specials)
    assert _accepts(grammars, lark, good)
    for text in bad:
        assert not _accepts(grammars, lark, text), text
    named = forced_calls(TOOLS, "search", fmt.writer, fmt.start, fmt.end, False, grammars.specials)
    assert not _accepts(grammars, named, good)  # the other function under a named choice


def test_special_tokens_are_written_as_tokens():
    g = Lark(frozenset({"<|im_end|>", "[TOOL_CALLS]"}))
    assert g.lit("[TOOL_CALLS]x<|im_end|>") == '[TOOL_CALLS] "x" <|im_end|>'
    assert g.lit('a"b') == '"a\\"b"'


def test_a_format_without_a_writer_is_not_forcible_and_falls_back_to_json_in_tags():
    fmt = ToolFormat(lambda s, t: None, "<x>", "</x>", "unknown_format")
    assert fmt.on and not fmt.forcible
    assert forced_calls(TOOLS, None, "unknown_format", "<x>", "</x>", False) is None
    assert ToolFormat.json_tools().forcible
