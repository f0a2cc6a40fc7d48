"""Tools on every chat-template family, through the openai SDK against a live server.

Each family's folder is tiny-llama's weights under a template written in that family's shape
(``tests/tool_templates.py``), so mlx-lm picks that family's parser. The weights are random: the model
never calls a tool by itself, so every call here comes from the forced-call grammar, written in the
family's own format and read back by its parser (``plain``: a template without tools, where mlxb adds
them to the system turn and forces calls as JSON in ``<tool_call>`` tags).
"""

import json
from pathlib import Path

import jsonschema
import pytest
from openai import OpenAI

from mlxb.models import load_model
from tests.server.conftest import LiveServer
from tests.tool_templates import FAMILIES, family_folder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 10},
                                                                     "top": {"type": "boolean"}},
                                     "required": ["q"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
MODEL = "default_model"  # any client's placeholder: the one served model
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "snow, -3C"},
    {"role": "user", "content": "and in Bergen?"},
]


@pytest.fixture(scope="module", params=sorted(FAMILIES) + ["plain"])
def family(request, tmp_path_factory):
    path = load_model("tiny-llama", lazy=True)[3]
    folder = family_folder(Path(path), tmp_path_factory.mktemp("tpl"), request.param)
    srv = LiveServer(model=str(folder), batch=4, default_max_tokens=16, warmup=False, prompt_cache=False)
    yield request.param, srv, OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    srv.stop()


def _valid(call):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert call.type == "function" and call.function.name in by_name and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_models_card_names_the_format(family):
    name, srv, oai = family
    card = next(m for m in oai.models.list().model_dump()["data"] if m["id"] == srv.gw.model_name)
    if name == "plain":
        assert card["tool_parser"] == "json_tools" and card["tool_prompt"] == "addendum"
        assert card["tools_in_template"] is False
    else:
        parser = {"laguna": "glm47", "mistral_args": "mistral"}.get(name, name)
        assert card["tool_parser"] == parser and card["tool_prompt"] == "template"
        assert card["forced_tool_calls"] == name if name != "laguna" else "glm47"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_forced_single_call_is_valid(family, choice):
    _, _, oai = family
    r = oai.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice=choice,
                                    parallel_tool_calls=False, max_tokens=160, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None and len(c.message.tool_calls) == 1, c.message
    _valid(c.message.tool_calls[0])
    if isinstance(choice, dict):
        assert c.message.tool_calls[0].function.name == "search"


def test_streamed_calls_reassemble_to_the_whole_answer(family):
    _, _, oai = family
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1000, seed=5)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls: dict = {}
    reason = None
    for ch in oai.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        for tc in ch.choices[0].delta.tool_calls or []:
            got = calls.setdefault(tc.index, {"name": None, "args": ""})
            got["name"] = tc.function.name or got["name"]
            got["args"] += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    assert reason == whole.finish_reason
    want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
    assert [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)] == want
    assert want and sorted(calls) == list(range(len(want)))
    for c in whole.message.tool_calls:
        _valid(c)


def test_parallel_calls_are_each_valid(family):
    """Under "required" the grammar allows 1 to 8 calls (random weights rarely end early, so the row
    writes several); room enough for all 8, so the turn always ends with its calls."""
    _, _, oai = family
    r = oai.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="required",
                                    max_tokens=1000, temperature=1.0, seed=11)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= 8, c
    for call in c.message.tool_calls:
        _valid(call)
    assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


# ---- a template without tools: mlxb adds them ---------------------------------------------------------
@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory):
    return family_folder(Path(load_model("tiny-llama", lazy=True)[3]), tmp_path_factory.mktemp("plain"), "plain")


def _prompt(gw, messages, **kw):
    from mlxb.engine.gateway import GenerationInput

    return gw.tokenizer.decode(gw.tokenize(GenerationInput(messages=messages, tools=TOOLS, **kw)))


def test_a_template_without_tools_gets_them_in_the_system_turn_unless_turned_off(plain_folder):
    on = LiveServer(model=str(plain_folder), batch=2, warmup=False, prompt_cache=False)
    off = LiveServer(model=str(plain_folder), batch=2, warmup=False, prompt_cache=False, tool_prompt=False)
    try:
        text = _prompt(on.gw, HISTORY)
        assert '"name": "get_weather"' in text and "<tool_call>" in text  # the schemas and the call form
        assert text.index("# Tools") < text.index("What is the weather")  # in the system turn, in front
        assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' in text  # the earlier call
        assert "<tool_response>\nsnow, -3C\n</tool_response>" in text  # the tool turn, as a user turn
        assert "# Tools" not in _prompt(on.gw, ASK, tool_choice="none")
        with pytest.raises(Exception, match="chat template failed"):  # off: the template refuses the tool turn
            _prompt(off.gw, HISTORY)
        assert "get_weather" not in _prompt(off.gw, ASK)
        assert off.gw.tool_card()["tool_prompt"] == "dropped" and "drops tools" in off.gw.tool_summary()
        sys_first = [{"role": "system", "content": "Be brief."}] + ASK
        assert _prompt(on.gw, sys_first).count("<|im_start|>system") == 1  # appended to the system turn
    finally:
        on.stop()
        off.stop()


def test_mixed_rows_on_a_template_without_tools_share_steps_and_are_all_valid(plain_folder):
    import concurrent.futures as cf

    srv = LiveServer(model=str(plain_folder), batch=8, warmup=False, prompt_cache=False)
    oai = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    steps0 = srv.gw.engine.counters["batched_steps"]
    person = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["age"], "additionalProperties": False}

    def one(i):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": f"task {i}"}], max_tokens=120, seed=i)
        if i % 3 == 0:
            kw.update(tools=TOOLS, tool_choice="required" if i % 2 else {"type": "function", "function": {"name": "search"}},
                      parallel_tool_calls=False)
        elif i % 3 == 1:
            kw.update(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
        return i, oai.chat.completions.create(**kw).choices[0]

    try:
        with cf.ThreadPoolExecutor(8) as ex:
            results = list(ex.map(one, range(8)))
    finally:
        srv.stop()
    for i, c in results:
        if i % 3 == 0:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
            _valid(c.message.tool_calls[0])
        elif i % 3 == 1:
            jsonschema.validate(json.loads(c.message.content), person)
        else:
            assert c.finish_reason == "length" and c.message.tool_calls is None
    assert srv.gw.engine.counters["batched_steps"] > steps0


@pytest.mark.full
@pytest.mark.parametrize("template", ["own", "plain"])
def test_forced_calls_compose_with_a_quantized_folder_kv8_speculation_and_the_prompt_cache(tmp_path, template):
    """A folder mlx-lm's own converter quantized (with the chat_template.jinja it writes), KV8, prompt-lookup
    speculation and the prompt cache on: forced-call, schema and free rows batched over two rounds."""
    import concurrent.futures as cf

    from mlx_lm import convert

    from tests.tool_templates import PLAIN, folder_with_template

    q = tmp_path / "q"
    convert(str(load_model("tiny-llama", lazy=True)[3]), mlx_path=str(q), quantize=True)
    folder = q if template == "own" else folder_with_template(q, tmp_path / "plain", PLAIN)
    person = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["age"], "additionalProperties": False}
    srv = LiveServer(model=str(folder), batch=4, warmup=False, kv_bits=8, kv_group_size=32, spec="lookup",
                     spec_max_batch=4)
    oai = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def one(i):
        kw = dict(model=MODEL, max_tokens=80, seed=i, messages=[{"role": "system", "content": "shared prompt " * 20},
                                                              {"role": "user", "content": f"task {i % 2}"}])
        if i % 3 == 0:
            kw.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        elif i % 3 == 1:
            kw.update(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": person}})
        return i, oai.chat.completions.create(**kw).choices[0]

    try:
        assert srv.gw.tool_card()["tool_prompt"] == ("template" if template == "own" else "addendum")
        assert srv.gw.engine.kv_scheme is not None and srv.gw.engine.spec_stats()["active"]
        for _ in range(2):
            with cf.ThreadPoolExecutor(6) as ex:
                for i, c in ex.map(one, range(6)):
                    if i % 3 == 0:
                        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
                        _valid(c.message.tool_calls[0])
                    elif i % 3 == 1:
                        jsonschema.validate(json.loads(c.message.content), person)
        assert srv.gw.engine.counters["batched_steps"] > 0
    finally:
        srv.stop()
