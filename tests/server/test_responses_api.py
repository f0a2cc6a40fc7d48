"""POST /v1/responses through the official openai SDK (tiny-llama, random weights, greedy)."""

import json

import httpx
import openai
import pytest


@pytest.fixture
def sdk(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


ENUM_TOOL = {"type": "function", "name": "pick", "description": "pick a side",
             "parameters": {"type": "object", "properties": {"side": {"type": "string", "enum": ["left", "right"]}},
                            "required": ["side"], "additionalProperties": False}}


def chat_text(sdk, messages, n, **kw):
    return sdk.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=n, **kw).choices[0].message.content


def test_text_response_is_the_chat_paths_output_for_the_same_conversation(sdk):
    r = sdk.responses.create(model="tiny-llama", instructions="Answer briefly.", max_output_tokens=10,
                             input=[{"role": "user", "content": [{"type": "input_text", "text": "Write a function."}]}])
    want = chat_text(sdk, [{"role": "system", "content": "Answer briefly."},
                           {"role": "user", "content": "Write a function."}], 10)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 10 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_events_in_order_and_their_deltas_make_the_text(sdk):
    kw = dict(model="tiny-llama", input="Write a function.", max_output_tokens=8)
    full = sdk.responses.create(**kw)
    evs = list(sdk.responses.create(stream=True, **kw))
    kinds = [e.type for e in evs]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == full.output_text and evs[-1].response.output_text == text
    assert evs[-1].response.usage.output_tokens == 8


def test_a_required_function_tool_comes_back_as_a_function_call_item(sdk):
    r = sdk.responses.create(model="tiny-llama", input="Which side?", tools=[ENUM_TOOL], tool_choice="required",
                             max_output_tokens=60, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick" and calls[0].call_id
    assert json.loads(calls[0].arguments)["side"] in ("left", "right")
    evs = list(sdk.responses.create(model="tiny-llama", input="Which side?", tools=[ENUM_TOOL], tool_choice="required",
                                    max_output_tokens=60, stream=True, parallel_tool_calls=False))
    done = [e for e in evs if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments and done[0].name == "pick"
    assert evs[-1].response.output[-1].type == "function_call"


def test_a_tool_round_trip_is_the_chat_paths_tool_messages(sdk):
    args = json.dumps({"side": "left"})
    r = sdk.responses.create(model="tiny-llama", tools=[ENUM_TOOL], max_output_tokens=8, input=[
        {"role": "user", "content": "Which side?"},
        {"type": "function_call", "call_id": "call_1", "name": "pick", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "left it is"}])
    chat_tools = [{"type": "function", "function": {k: ENUM_TOOL[k] for k in ("name", "description", "parameters")}}]
    want = chat_text(sdk, [{"role": "user", "content": "Which side?"},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "call_1", "type": "function", "function": {"name": "pick", "arguments": args}}]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "left it is"}], 8, tools=chat_tools)
    assert r.output_text == want


def test_json_schema_format_and_logprobs(sdk):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = sdk.responses.create(model="tiny-llama", input="Answer in JSON.", max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "a", "schema": schema}},
                             include=["message.output_text.logprobs"], top_logprobs=2)
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    lps = r.output[0].content[0].logprobs
    assert lps and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in lps)


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
    ({"model": "no-such-model"}, "model"),
])
def test_what_it_cannot_do_is_a_4xx_naming_the_field(live, extra, param):
    body = {"model": "tiny-llama", "input": "hi", "max_output_tokens": 2, **extra}
    r = httpx.post(live.url + "/v1/responses", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "apply a patch"}


def test_custom_tools_round_trip_as_freeform_calls(sdk):
    """Codex-style custom tools: in history a custom_tool_call / custom_tool_call_output pair is the chat
    path's tool call with one string argument; the model's calls come back as custom_tool_call items."""
    from mlxb.server.responses import FREEFORM

    r = sdk.responses.create(model="tiny-llama", tools=[PATCH_TOOL], max_output_tokens=8, input=[
        {"role": "user", "content": "Fix it."},
        {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_9", "output": "applied"}])
    fn = {"name": "apply_patch", "description": "apply a patch Its whole input is free text, given as the string "
                                                "argument `input`.", "parameters": FREEFORM}
    want = chat_text(sdk, [{"role": "user", "content": "Fix it."},
                           {"role": "assistant", "content": None, "tool_calls": [
                               {"id": "call_9", "type": "function",
                                "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch"})}}]},
                           {"role": "tool", "tool_call_id": "call_9", "content": "applied"}], 8,
                     tools=[{"type": "function", "function": fn}])
    assert r.output_text == want


def test_a_custom_tool_call_is_shaped_as_its_input_text(live):
    from mlxb.server.responses import Builder, to_chat
    from mlxb.server.toolcalls import ToolCallStream

    body, echo = to_chat({"model": "tiny-llama", "input": "x", "tools": [PATCH_TOOL, ENUM_TOOL], "stream": True})
    fmt = live.gw.tool_format
    b = Builder(echo, "tiny-llama", ToolCallStream(fmt, body["tools"]))
    text = (f'{fmt.start}\n{{"name": "apply_patch", "arguments": {{"input": "*** Begin Patch\\nok"}}}}\n{fmt.end}'
            f'{fmt.start}\n{{"name": "pick", "arguments": {{"side": "left"}}}}\n{fmt.end}')
    evs = b.start() + b.feed(text[:17]) + b.feed(text[17:]) + b.finish("stop", {"prompt_tokens": 3, "completion_tokens": 9,
                                                                                 "total_tokens": 12})
    kinds = [e["type"] for e in evs]
    assert "response.custom_tool_call_input.done" in kinds and "response.function_call_arguments.done" in kinds
    out = b.response()["output"]
    assert [o["type"] for o in out] == ["custom_tool_call", "function_call"]
    assert out[0]["input"] == "*** Begin Patch\nok" and out[0]["name"] == "apply_patch"
    assert json.loads(out[1]["arguments"]) == {"side": "left"} and b.status == "completed"
    assert "custom_tools" not in b.response()
