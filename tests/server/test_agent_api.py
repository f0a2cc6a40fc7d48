"""Tools and structured outputs against a live server (random-weight tiny-llama: the model never chooses
to call a tool or write JSON by itself, so every valid call or document here comes from the grammar)."""

import concurrent.futures as cf
import json
import re

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 10}},
                                     "required": ["q"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


@pytest.fixture
def oai(live):
    return OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _check_call(call, tools):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.function.name in by_name and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_models_say_which_tool_parser(client):
    data = client.get("/v1/models").json()["data"]
    assert data[0]["tool_parser"] == "json_tools"  # the synthetic ChatML template writes <tool_call> JSON


def test_tool_call_history_renders_and_answers(oai):
    r = oai.chat.completions.create(model="tiny-llama", messages=HISTORY, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_forced_tool_call_is_a_valid_call(oai, choice):
    r = oai.chat.completions.create(model="tiny-llama", messages=HISTORY + [{"role": "user", "content": "and Rome?"}],
                                    tools=[WEATHER, SEARCH], tool_choice=choice, max_tokens=120,
                                    parallel_tool_calls=False)
    msg = r.choices[0]
    assert msg.finish_reason == "tool_calls", msg
    assert msg.message.content is None and len(msg.message.tool_calls) == 1
    _check_call(msg.message.tool_calls[0], [WEATHER, SEARCH])
    if isinstance(choice, dict):
        assert msg.message.tool_calls[0].function.name == "search"


def test_streamed_tool_call_reassembles_to_the_same_call(oai):
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
              tool_choice="required", max_tokens=120, seed=3, parallel_tool_calls=False)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    name, args, index, reason = None, "", set(), None
    for ch in oai.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            index.add(tc.index)
            name = tc.function.name or name
            args += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    assert index == {0} and reason == "tool_calls"
    assert (name, json.loads(args)) == (whole.function.name, json.loads(whole.function.arguments))


def test_parse_with_a_pydantic_model(oai):
    class Person(BaseModel):  # bounded: a random-weight model would otherwise write a name until max_tokens
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    r = parse(model="tiny-llama", messages=[{"role": "user", "content": "a person"}], response_format=Person,
              max_tokens=200)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person), r.choices[0].message.content


def test_json_schema_json_object_regex_choice_and_lark(live, client):
    def ask(extra, max_tokens=160):
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, **extra}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        return c["message"]["content"]

    doc = json.loads(ask({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}}))
    jsonschema.validate(doc, PERSON)
    # any object: random weights would write one key forever, so logit_bias (applied before the grammar's
    # mask) favours closing it; the grammar still decides what is allowed
    close = {str(t): 30 for t in live.gw.tokenizer.encode("}", add_special_tokens=False)}
    assert isinstance(json.loads(ask({"response_format": {"type": "json_object"}, "logit_bias": close})), dict)
    assert re.fullmatch(r"[a-c]{2,4}-\d{3}", ask({"structured_outputs": {"regex": r"[a-c]{2,4}-\d{3}"}}))
    assert ask({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}) in ("yes", "no", "maybe")
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'
    assert re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", ask({"structured_outputs": {"grammar": lark}}, 40))


def test_eight_mixed_rows_in_flight_are_all_valid(live, client):
    """Constrained and unconstrained rows decode together; each constrained one is valid."""
    steps0 = live.gw.engine.counters["batched_steps"]

    def one(i):
        kind = i % 4
        body = {"messages": [{"role": "user", "content": f"task {i}"}], "max_tokens": 96, "seed": i,
                "temperature": 0.8 if i % 2 else 0.0}
        if kind == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        elif kind == 1:
            body["structured_outputs"] = {"regex": r"(ab|cd){1,3}!"}
        elif kind == 2:
            body.update(tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False)
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return kind, r.json()["choices"][0]

    with cf.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    for kind, c in results:
        if kind == 0:
            jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
        elif kind == 1:
            assert re.fullmatch(r"(ab|cd){1,3}!", c["message"]["content"])
        elif kind == 2:
            assert c["finish_reason"] == "tool_calls"
            call = c["message"]["tool_calls"][0]
            by = {"get_weather": WEATHER, "search": SEARCH}
            jsonschema.validate(json.loads(call["function"]["arguments"]), by[call["function"]["name"]]["function"]["parameters"])
        else:
            assert c["finish_reason"] == "length"  # unconstrained neighbours run to max_tokens
    assert live.gw.engine.counters["batched_steps"] > steps0  # they shared decode steps


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "response_format.json_schema"),
])
def test_bad_agent_input_is_a_400_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err


def test_openai_sdk_raises_bad_request_for_an_unknown_role(oai):
    with pytest.raises(BadRequestError):
        oai.chat.completions.create(model="tiny-llama", messages=[{"role": "wizard", "content": "hi"}], max_tokens=4)


def test_constrained_logprobs_are_of_the_masked_distribution_and_stop_strings_apply(client):
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "logprobs": True, "top_logprobs": 5,
            "structured_outputs": {"regex": "(ab |cd ){6}"}}
    r = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert re.fullmatch("(ab |cd ){6}", r["message"]["content"]) and r["finish_reason"] == "stop"
    for e in r["logprobs"]["content"]:
        # only allowed tokens have probability: every finite alternative is a piece of the pattern
        assert e["logprob"] > -9999.0
        for alt in e["top_logprobs"]:
            assert alt["logprob"] == -9999.0 or re.fullmatch(r"[abcd ]*", alt["token"]), alt
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": 0, "stop": ["cd"]})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and "cd" not in c["message"]["content"]
    assert re.fullmatch("(ab )*(ab?)?", c["message"]["content"]), c
