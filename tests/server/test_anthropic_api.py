"""POST /v1/messages through the official anthropic SDK (tiny-llama, random weights, greedy)."""

import json

import anthropic
import httpx
import openai
import pytest


@pytest.fixture
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused")


@pytest.fixture
def sdk(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


PICK = {"name": "pick", "description": "pick a side",
        "input_schema": {"type": "object", "properties": {"side": {"type": "string", "enum": ["left", "right"]}},
                         "required": ["side"], "additionalProperties": False}}
CHAT_PICK = [{"type": "function", "function": {"name": "pick", "description": "pick a side",
                                               "parameters": PICK["input_schema"]}}]


def chat(sdk, messages, n, **kw):
    return sdk.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=n, **kw)


def test_a_message_is_the_chat_paths_output_with_anthropic_usage(claude, sdk):
    m = claude.messages.create(model="tiny-llama", max_tokens=10, system=[{"type": "text", "text": "Be brief."}],
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Write a function.",
                                                                       "cache_control": {"type": "ephemeral"}}]}])
    c = chat(sdk, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a function."}], 10)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert total == c.usage.prompt_tokens and m.usage.input_tokens >= 0


def test_stream_events_and_the_sdks_final_message(claude):
    kw = dict(model="tiny-llama", max_tokens=8, messages=[{"role": "user", "content": "Write a function."}])
    full = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds its own 'text' events
    assert raw[0] == "message_start" and raw[1] == "content_block_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert "content_block_stop" in raw and final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_tool_use_then_tool_result_round_trip(claude, sdk):
    m = claude.messages.create(model="tiny-llama", max_tokens=60, tools=[PICK], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               messages=[{"role": "user", "content": "Which side?"}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "pick"
    assert uses[0].input["side"] in ("left", "right") and uses[0].id.startswith("toolu_")
    with claude.messages.stream(model="tiny-llama", max_tokens=60, tools=[PICK], tool_choice={"type": "tool", "name": "pick", "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Which side?"}]) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content][-1] == "tool_use" and streamed.content[-1].input == uses[0].input
    after = claude.messages.create(model="tiny-llama", max_tokens=8, tools=[PICK], messages=[
        {"role": "user", "content": "Which side?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "pick", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]}])
    want = chat(sdk, [{"role": "user", "content": "Which side?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "toolu_1", "type": "function",
                           "function": {"name": "pick", "arguments": json.dumps(uses[0].input)}}]},
                      {"role": "tool", "tool_call_id": "toolu_1", "content": "done"}], 8, tools=CHAT_PICK)
    assert after.content[0].text == want.choices[0].message.content


def test_a_stop_sequence_is_named(claude):
    base = claude.messages.create(model="tiny-llama", max_tokens=24, messages=[{"role": "user", "content": "hi"}])
    text = base.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    m = claude.messages.create(model="tiny-llama", max_tokens=24, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "hi"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "x"}]},  # no max_tokens
    {"max_tokens": 4, "messages": []},
    {"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
    {"max_tokens": 4, "model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
])
def test_bad_requests_are_4xx_in_anthropics_error_shape(live, body):
    r = httpx.post(live.url + "/v1/messages", json={"model": "tiny-llama", **body})
    assert r.status_code in (400, 404), r.text
    e = r.json()
    assert e["type"] == "error" and e["error"]["type"] in ("invalid_request_error", "not_found_error") and e["error"]["message"]


def test_count_tokens_is_what_the_message_uses(claude):
    kw = dict(model="tiny-llama", system="Be brief.", tools=[PICK], messages=[{"role": "user", "content": "Which side?"}])
    n = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=2, **kw)
    assert n > 10 and n == m.usage.input_tokens + m.usage.cache_read_input_tokens


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_load_client_streams_the_agent_apis_like_chat(live, api):
    """`mlxb bench load --api`: the same payloads through /v1/responses or /v1/messages give the chat
    endpoint's text, token counts and cached tokens (greedy, ignore_eos)."""
    import asyncio

    from mlxb.bench import load as L

    ds = L.Dataset("t", [{"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": f"Question {i}?"}], "max_tokens": 12} for i in range(3)])
    runs = {a: asyncio.run(L.run_load(live.url + "/v1", "tiny-llama", ds, concurrency=1, n_requests=3,
                                      ignore_eos=True, api=a)) for a in ("chat", api)}
    for a, b in zip(runs["chat"], runs[api]):
        assert a.ok and b.ok, (a.error, b.error)
        assert b.text == a.text and b.completion_tokens == a.completion_tokens == 12
        assert b.prompt_tokens == a.prompt_tokens and b.ttft is not None and len(b.itls) >= 10
