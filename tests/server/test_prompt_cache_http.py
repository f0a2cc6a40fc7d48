"""The prompt cache through HTTP: cached_tokens in OpenAI's usage shape (JSON and the final SSE
chunk), the opt-out field, /stats and /metrics, and a restart that hits the SSD tier."""

import json

import httpx
import pytest

from tests.server.conftest import LiveServer

SYSTEM = "You are a careful coding agent. " * 30  # a long shared system prompt


def chat(client, user, **extra):
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": 6, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def cached_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    srv = LiveServer(batch=4, default_max_tokens=8, prompt_cache_dir=str(d))
    yield srv, d
    srv.stop()


def test_repeat_and_shared_prefix_report_cached_tokens(cached_server):
    srv, _ = cached_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        first = chat(c, "write a parser")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = chat(c, "write a parser")
        n = again["usage"]["prompt_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1  # all but the last token
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        other = chat(c, "now write tests for it")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 200  # the shared system prompt
        off = chat(c, "write a parser", cache_prompt=False)
        assert off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        with c.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "write a parser"}],
                "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(e[6:]) for e in r.read().decode().split("\n\n") if e and e != "data: [DONE]"]
        usage = events[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        stats = c.get("/stats").json()["prompt_cache"]
        assert stats["enabled"] and stats["hits"] >= 3 and stats["ram_entries"] >= 1
        assert stats["reuse"] == {"full": "any prefix length (trimmed)"}
        metrics = c.get("/metrics").text
        assert 'mlxb_prompt_cache{stat="hits"}' in metrics and 'mlxb_prompt_cache{stat="ram_bytes"}' in metrics


def test_restart_hits_the_ssd_tier(cached_server, tmp_path):
    srv, _ = cached_server
    d = str(tmp_path / "restart")
    a = LiveServer(batch=4, default_max_tokens=8, prompt_cache_dir=d)
    try:
        with httpx.Client(base_url=a.url, timeout=60) as c:
            cold = chat(c, "remember this conversation")
    finally:
        a.stop()  # graceful: RAM entries are written to the SSD tier
    b = LiveServer(batch=4, default_max_tokens=8, prompt_cache_dir=d)
    try:
        with httpx.Client(base_url=b.url, timeout=60) as c:
            warm = chat(c, "remember this conversation")
            stats = c.get("/stats").json()["prompt_cache"]
    finally:
        b.stop()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert stats["ssd_restores"] == 1 and stats["ssd_hits"] == 1


def test_no_prompt_cache_turns_it_off(tmp_path):
    srv = LiveServer(batch=4, default_max_tokens=4, prompt_cache=False)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            chat(c, "x")
            again = chat(c, "x")
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert c.get("/stats").json()["prompt_cache"] == {"enabled": False}
    finally:
        srv.stop()


@pytest.mark.parametrize("model", ["tiny-qwen3.5", "tiny-gemma3"])
def test_exact_snapshot_models_reuse_a_system_prompt_from_the_first_agent_on(model, tmp_path):
    """Recurrent (qwen3.5) and sliding-window (gemma3) layers reuse only exact snapshot lengths. The gateway
    marks where the system messages end (the prefix this chat shares with any other user turn), the first
    agent's prefill snapshots there, and the second agent, with another question, starts from it. Through
    the ``openai`` SDK. The mark is the common prefix of the two agents' prompts, not past it."""
    from openai import OpenAI

    from mlxb.engine.gateway import GenerationInput

    srv = LiveServer(model=model, batch=4, default_max_tokens=6, prompt_cache_dir=str(tmp_path), prefill_chunk=2048)
    try:
        gw = srv.gw
        msgs = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        a, b = gw.tokenize(GenerationInput(messages=msgs("write a parser"))), gw.tokenize(
            GenerationInput(messages=msgs("now write tests for it")))
        shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        mark = gw.system_mark(GenerationInput(messages=msgs("write a parser")), a)
        assert mark and 32 <= mark[0] <= shared
        calls, real = [], gw.tokenizer.apply_chat_template
        gw.tokenizer.apply_chat_template = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:  # the same system prompt again: its prefix is remembered, not rendered anew
            assert gw.system_mark(GenerationInput(messages=msgs("now write tests for it")), b) == mark and not calls
            gw._system_prefixes.clear()  # the control: forgotten, it is rendered again
            assert gw.system_mark(GenerationInput(messages=msgs("now write tests for it")), b) == mark and calls
        finally:
            gw.tokenizer.apply_chat_template = real
        assert gw.system_mark(GenerationInput(messages=msgs("x"), cache_prompt=False), a) == []
        assert gw.system_mark(GenerationInput(messages=[{"role": "user", "content": "hi " * 50}]), a) == []
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        first = client.chat.completions.create(model=gw.model_name, messages=msgs("write a parser"), max_tokens=4)
        second = client.chat.completions.create(model=gw.model_name, messages=msgs("now write tests for it"), max_tokens=4)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens == mark[0]
    finally:
        srv.stop()


def test_a_resent_reply_continues_from_the_cached_turn(cached_server):
    """Issue 46: turn 2 resends turn 1's reply as an assistant message; its prompt starts with turn 1's prompt and
    the ids turn 1 generated, so the cache covers both (tests/tiny/test_replies.py shows the ids are taken
    even where the reply's text tokenizes otherwise)."""
    srv, _ = cached_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the failing tests"}]
        one = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "ignore_eos": True}).json()
        reply = one["choices"][0]["message"]["content"]
        assert c.get("/stats").json()["prompt_cache"]["reply_ids"]["remembered"] >= 1  # keyed by text: a repeat counts once
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "fix the first one"}]
        two = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4}).json()
        p1, g1 = one["usage"]["prompt_tokens"], one["usage"]["completion_tokens"]
        assert g1 == 6 and two["usage"]["prompt_tokens_details"]["cached_tokens"] >= p1 + g1
        assert c.get("/stats").json()["prompt_cache"]["reply_ids"]["prompts_spliced"] >= 1


def test_every_resent_reply_continues_from_its_cached_turn(cached_server):
    """Issue 46: a reply's text is what the server streamed, and mlx-lm's streaming detokenizers drop the space
    that opens a first token; the reply is remembered by that text too, so every conversation's turn 2 starts from
    turn 1's prompt and generated ids (keyed by ``decode(ids)`` alone, about half of these replies were not found)."""
    srv, _ = cached_server
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for k in range(10):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {k}: read file {k * 7}"}]
            one = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "ignore_eos": True,
                                                      "temperature": 1.0, "seed": k}).json()
            reply = one["choices"][0]["message"]["content"]
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
            two = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
            p1, g1 = one["usage"]["prompt_tokens"], one["usage"]["completion_tokens"]
            assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= p1 + g1, (k, repr(reply))
