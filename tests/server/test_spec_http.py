"""--spec lookup through the HTTP API: the openai SDK's extra_body carries num_draft_tokens, usage
reports draft and accepted tokens, /stats the acceptance; a bad num_draft_tokens is a 400."""

import concurrent.futures as cf

import httpx
import pytest

from tests.server.conftest import LiveServer


@pytest.fixture(scope="module")
def spec_server():
    srv = LiveServer(batch=4, default_max_tokens=24, spec="lookup", num_draft_tokens=4, spec_max_batch=4, warmup=False)
    yield srv
    srv.stop()


def test_concurrent_requests_speculate_and_report_usage(spec_server):
    from openai import OpenAI

    sdk = OpenAI(base_url=spec_server.url + "/v1", api_key="x")
    text = "the cat sat on the mat and the cat sat on the mat and the cat sat on the mat " * 3

    def ask(k):
        return sdk.completions.create(model="tiny-llama", prompt=text, max_tokens=24, temperature=0,
                                      extra_body={"num_draft_tokens": k, "ignore_eos": True})

    with cf.ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(ask, [4, 4, 2]))
    plain = ask(0)
    assert all(o.choices[0].text == plain.choices[0].text for o in outs)  # greedy: speculation changes no token
    assert plain.usage.model_dump().get("draft_tokens") is None  # 0 turns it off for that request
    usage = [o.usage.model_dump() for o in outs]
    assert all(u["draft_tokens"] >= u["accepted_tokens"] >= 0 for u in usage)
    st = httpx.get(spec_server.url + "/stats").json()["engine"]["speculation"]
    # a row that asked for no drafts is never in a verify step's batch (MLXB_SPEC_BATCH=every, docs/speculation.md),
    # so the speculating requests run together and without one
    assert st["method"] == "lookup" and st["active"] and st["drafted"] == sum(u["draft_tokens"] for u in usage) > 0


@pytest.mark.parametrize("bad", [-1, 33, "4", True])
def test_bad_num_draft_tokens_is_a_400(spec_server, bad):
    r = httpx.post(spec_server.url + "/v1/completions", json={"prompt": "hi", "num_draft_tokens": bad}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_draft_tokens"


def test_lookup_speculation_is_the_default_and_off_turns_it_off():
    """With no --spec flag the batch lane speculates with prompt lookup over every batch size (the controller
    decides per step); --spec off leaves the runner without a proposer; --spec off with a draft model is
    refused with a message naming both flags."""
    from mlxb.engine.build import build_gateway
    from mlxb.errors import ValidationError

    on = build_gateway("tiny-llama", batch=4, warmup=False, prompt_cache=False)
    try:
        st = on.engine.spec_stats()
        assert st is not None and st["method"] == "lookup" and st["active"] and st["max_batch"] == 4
    finally:
        on.engine.shutdown()
    off = build_gateway("tiny-llama", batch=4, warmup=False, prompt_cache=False, spec="off")
    try:
        assert off.engine.spec_stats() is None and off.engine.runner.proposer is None
    finally:
        off.engine.shutdown()
    with pytest.raises(ValidationError, match="--spec off"):
        build_gateway("tiny-llama", batch=4, warmup=False, prompt_cache=False, spec="off", draft_model="tiny-llama")
