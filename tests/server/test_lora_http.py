"""LoRA adapters served per request through the openai SDK: two adapters and the base answered
concurrently in one batch, each equal to the same request alone; /v1/models lists ``base:adapter`` ids;
mlx-lm's ``adapters`` field selects by name; an unknown adapter is a 404 naming it."""

import threading

import httpx
import openai
import pytest

from mlxb.models.adapters import build_adapter
from mlxb.models import load_model
from tests.server.conftest import LiveServer

MSG = [{"role": "user", "content": "Review this diff."}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    build_adapter(load_model("tiny-llama")[0], d / "coder", rank=8, seed=1)
    build_adapter(load_model("tiny-llama")[0], d / "review", rank=4, seed=2)
    s = LiveServer(batch=8, default_max_tokens=12, warmup=False, prompt_cache_dir=str(d / "ssd"),
                   adapters={"coder": str(d / "coder"), "review": str(d / "review")})
    yield s
    s.stop()


def test_adapters_and_base_concurrently_each_as_alone(srv):
    sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    ids = [m.id for m in sdk.models.list().data]
    assert {"tiny-llama", "tiny-llama:coder", "tiny-llama:review"} <= set(ids)
    models = ["tiny-llama", "tiny-llama:coder", "tiny-llama:review"] * 2
    alone = {m: sdk.chat.completions.create(model=m, messages=MSG, max_tokens=12).choices[0].message.content
             for m in models[:3]}
    assert len(set(alone.values())) == 3  # each adapter changes the text
    got = [None] * len(models)

    def ask(i):
        got[i] = sdk.chat.completions.create(model=models[i], messages=MSG, max_tokens=12).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [alone[m] for m in models]
    by_field = httpx.post(srv.url + "/v1/chat/completions",
                          json={"messages": MSG, "max_tokens": 12, "adapters": "review"}).json()
    assert by_field["choices"][0]["message"]["content"] == alone["tiny-llama:review"]
    lora = httpx.get(srv.url + "/stats").json()["engine"]["lora"]
    assert [a["name"] for a in lora["adapters"]] == ["coder", "review"] and all(a["sha256"] for a in lora["adapters"])


@pytest.mark.parametrize("body,param", [({"model": "tiny-llama:nope"}, "model"), ({"adapters": "nope"}, "adapters")])
def test_an_unknown_adapter_is_a_404_naming_it(srv, body, param):
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, **body})
    assert r.status_code == 404 and r.json()["error"]["param"] == param and "nope" in r.json()["error"]["message"]


def test_prompt_cache_is_per_adapter(srv):
    """A long shared prompt cached by the base is not reused by an adapter's row (its KV differs); the
    adapter's own repeat reuses its entry and answers as before."""
    sys_prompt = "You are a careful reviewer of large diffs. " * 12
    msgs = [{"role": "system", "content": sys_prompt}, {"role": "user", "content": "Look at file A."}]

    def ask(model):
        r = httpx.post(srv.url + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 6}).json()
        return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    base_text, _ = ask("tiny-llama")
    _, base_again = ask("tiny-llama")
    first, cached_first = ask("tiny-llama:coder")
    again, cached_again = ask("tiny-llama:coder")
    # the base's entry is not the adapter's (it may reuse a few template tokens of its own earlier rows)
    assert base_again > 100 and cached_first < 20
    assert cached_again == base_again and again == first
    assert first != base_text
