"""The official openai SDK against a live server on 127.0.0.1 (tiny-llama, random weights)."""

import threading
import time

import httpx
import openai
import pytest


@pytest.fixture
def sdk(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


MSG = [{"role": "user", "content": "Write a function."}]


def test_chat_non_streaming(sdk):
    r = sdk.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=8,
                                    extra_body={"cache_prompt": False})  # opted out: nothing reused
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_with_usage(sdk):
    chunks = list(sdk.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=6, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_streaming_equals_non_streaming_greedy(sdk):
    a = sdk.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=10).choices[0].message.content
    b = "".join(c.choices[0].delta.content or "" for c in
                sdk.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=10, stream=True) if c.choices)
    assert a == b


def test_completions_and_logprobs(sdk):
    r = sdk.completions.create(model="tiny-llama", prompt="def f(x):", max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(len(t) >= 1 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    s = list(sdk.completions.create(model="tiny-llama", prompt="def f(x):", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == sdk.completions.create(
        model="tiny-llama", prompt="def f(x):", max_tokens=4).choices[0].text


def test_chat_logprobs(sdk):
    r = sdk.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_models_offline(sdk):
    ids = [m.id for m in sdk.models.list().data]
    assert "tiny-llama" in ids
    for i in ids:  # every listed id (a folder path too) is retrievable, and nothing else is
        assert sdk.models.retrieve(i).id == i
    with pytest.raises(openai.NotFoundError, match="not served here"):
        sdk.models.retrieve("no-such-model")


def test_eight_concurrent_streams_batch(sdk, live):
    seen = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=live.url) as c:
            while not stop.is_set():
                seen.append(c.get("/stats").json()["batch"])
                time.sleep(0.02)

    results = [None] * 8

    def one(i):
        s = sdk.chat.completions.create(model="tiny-llama", max_tokens=48, stream=True,
                                        messages=[{"role": "user", "content": f"agent {i}"}])
        results[i] = "".join(c.choices[0].delta.content or "" for c in s if c.choices)

    t = threading.Thread(target=poll)
    t.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    t.join()
    assert all(results)
    assert max(s["active_rows"] for s in seen) >= 4
    assert any(s["batched"] for s in seen)
    assert seen[-1]["mode"] == "batch"


def test_n_choices_are_rows_with_offset_seeds(sdk):
    """n=3 with a seed: three choices, choice i is what n=1 with seed + i gives; usage counts the prompt once."""
    kw = dict(model="tiny-llama", messages=MSG, max_tokens=12, temperature=1.0)
    r = sdk.chat.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    solo = [sdk.chat.completions.create(seed=11 + i, **kw).choices[0].message.content for i in range(3)]
    assert texts == solo and len(set(texts)) > 1
    one = sdk.chat.completions.create(seed=11, **kw)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == 3 * 12 == r.usage.total_tokens - r.usage.prompt_tokens


def test_n_choices_stream_with_their_indexes_and_one_done(sdk):
    chunks = list(sdk.completions.create(model="tiny-llama", prompt="Once", max_tokens=5, n=2, stream=True, seed=4,
                                         temperature=1.0, stream_options={"include_usage": True}))
    by = {0: "", 1: ""}
    finals = []
    for c in chunks:
        for ch in c.choices:
            by[ch.index] += ch.text
            if ch.finish_reason:
                finals.append(ch.index)
    assert sorted(finals) == [0, 1] and all(by.values())
    assert chunks[-1].usage.completion_tokens == 10
    single = [sdk.completions.create(model="tiny-llama", prompt="Once", max_tokens=5, seed=4 + i,
                                     temperature=1.0).choices[0].text for i in range(2)]
    assert [by[0], by[1]] == single


@pytest.mark.parametrize("body,param", [({"n": 0}, "n"), ({"n": 17}, "n"), ({"echo": "yes"}, "echo"),
                                        ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")])
def test_unsupported_or_bad_choice_fields_are_a_400_naming_them(live, body, param):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_completions_batch_of_prompts_comes_back_prompt_by_prompt(sdk):
    """OpenAI's legacy batch: a list of prompts (strings or token ids), n choices each; every choice
    is what that prompt gives alone, and usage counts each prompt once."""
    prompts = ["def add(a, b):", [5, 6, 7, 8], "import os"]
    r = sdk.completions.create(model="tiny-llama", prompt=prompts, max_tokens=6, n=2, temperature=0.0, logprobs=1)
    assert [c.index for c in r.choices] == list(range(6))
    alone = [sdk.completions.create(model="tiny-llama", prompt=p, max_tokens=6, logprobs=1) for p in prompts]
    for k, a in enumerate(alone):
        for j in range(2):
            c = r.choices[2 * k + j]
            assert c.text == a.choices[0].text  # greedy: both choices of a prompt equal it alone
            lp = c.logprobs
            assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 6 * 6
    s = list(sdk.completions.create(model="tiny-llama", prompt=prompts[:2], max_tokens=4, stream=True,
                                    stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for ch in s:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == {0: alone[0].choices[0].text[:len(texts[0])], 1: alone[1].choices[0].text[:len(texts[1])]}
    assert texts[0] and texts[1] and s[-1].usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens


@pytest.mark.parametrize("prompt", [["a", 3], [[1, "x"]], [[]], 5, ["a"] * 17])
def test_bad_completion_prompts_are_a_400_naming_prompt(live, prompt):
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(live, sdk):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0. The prompt comes
    back with every token's logprob (the first has none) equal to one plain forward of mlx-lm's model
    over the prompt, and the top alternatives hold the best token there."""
    import mlx.core as mx

    text = "def add(a, b):\n    return a + b\n" * 4
    r = sdk.completions.create(model="tiny-llama", prompt=text, max_tokens=0, echo=True, logprobs=3)
    c = r.choices[0]
    ids = live.gw.tokenizer.encode(text)
    assert c.text == text and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [live.gw.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    with live.gw.engine.device_lock:  # the reference forward must not run beside the engine thread's
        logits = live.gw.engine.model(mx.array(ids)[None])[0].astype(mx.float32)
        ref = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        best = [live.gw.tokenizer.decode([int(mx.argmax(ref[i]).item())]) for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-4
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) <= 3 and best[i] in top and max(top.values()) == pytest.approx(ref[i].max().item(), abs=1e-4)


def test_echo_with_generation_prepends_the_prompt_and_keeps_the_continuation(sdk):
    """echo with max_tokens > 0: the prompt, then what the same request gives without echo (greedy),
    the logprobs of prompt and completion in one block whose offsets index the returned text; batches
    and streams too."""
    prompt = "import numpy as np\n"
    plain = sdk.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, logprobs=1)
    r = sdk.completions.create(model="tiny-llama", prompt=prompt, max_tokens=6, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(prompt) and c.text[len(prompt):].lstrip(" ") == plain.choices[0].text.lstrip(" ")
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 6 and lp.token_logprobs[0] is None
    assert lp.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    for tok, off in zip(lp.tokens[n_prompt:], lp.text_offset[n_prompt:]):
        assert c.text[off:off + len(tok)] == tok  # the offsets index the echoed text
    chunks = list(sdk.completions.create(model="tiny-llama", prompt=[prompt, [5, 6, 7]], max_tokens=4, echo=True,
                                         stream=True))
    texts = {0: "", 1: ""}
    for ch in chunks:
        for x in ch.choices:
            texts[x.index] += x.text
    batch = sdk.completions.create(model="tiny-llama", prompt=[prompt, [5, 6, 7]], max_tokens=4, echo=True)
    assert texts == {x.index: x.text for x in batch.choices} and texts[0].startswith(prompt)


def test_echo_rules_are_clear_400s(live):
    """max_tokens 0 only scores with echo; echo belongs to completions; a bad value names the field."""
    for path, body, param in [("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
                              ("/v1/completions", {"prompt": "x", "echo": 1}, "echo")]:
        r = httpx.post(live.url + path, json={"model": "tiny-llama", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_scoring_between_iterations_leaves_decoding_rows_alone(sdk):
    """Prompt scoring runs on the engine thread between iterations: rows decoding meanwhile give what
    they give without it, and every score matches the same request scored alone."""
    import concurrent.futures as cf

    prompts = [f"class Model{i}:\n    def forward(self, x):\n" for i in range(3)]
    alone_rows = [sdk.completions.create(model="tiny-llama", prompt=p, max_tokens=24).choices[0].text for p in prompts]
    alone_score = sdk.completions.create(model="tiny-llama", prompt="x = [1, 2, 3]\n" * 6, max_tokens=0, echo=True,
                                         logprobs=1).choices[0].logprobs.token_logprobs
    with cf.ThreadPoolExecutor(6) as ex:
        rows = [ex.submit(lambda p=p: sdk.completions.create(model="tiny-llama", prompt=p, max_tokens=24)) for p in prompts]
        scores = [ex.submit(lambda: sdk.completions.create(model="tiny-llama", prompt="x = [1, 2, 3]\n" * 6, max_tokens=0,
                                                           echo=True, logprobs=1)) for _ in range(3)]
        assert [f.result().choices[0].text for f in rows] == alone_rows
        assert all(f.result().choices[0].logprobs.token_logprobs == alone_score for f in scores)


def test_a_failing_engine_thread_job_reaches_its_caller_and_the_engine_goes_on(live, sdk):
    """Work handed to the engine thread (prompt scoring) that raises fails its own future only."""
    from concurrent.futures import Future

    fut: Future = Future()
    live.gw.engine._inbox.put(("call", lambda: 1 / 0, fut))
    with pytest.raises(ZeroDivisionError):
        fut.result(30)
    assert live.gw.engine.alive
    assert sdk.completions.create(model="tiny-llama", prompt="ok", max_tokens=2).usage.completion_tokens == 2
