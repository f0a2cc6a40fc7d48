"""Raw HTTP: SSE framing, the bad-request battery, disconnects, health and metrics."""

import json
import threading

import httpx
import pytest

from tests.server.conftest import LiveServer

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
M = [{"role": "user", "content": "hi"}]


def test_sse_framing_matches_mlx_lm_server(client):
    with client.stream("POST", CHAT, json={"messages": M, "max_tokens": 5, "stream": True,
                                           "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    deltas = payloads[:-2]
    assert all(p["object"] == "chat.completion.chunk" and p["choices"][0]["finish_reason"] is None for p in deltas)
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5


BAD = [
    # (name, path, body (bytes or json), headers, status, param)
    ("malformed json", CHAT, b"{not json", {}, 400, None),
    ("body not object", CHAT, [1, 2], {}, 400, None),
    ("missing messages", CHAT, {"max_tokens": 3}, {}, 400, "messages"),
    ("messages not list", CHAT, {"messages": "hi"}, {}, 400, "messages"),
    ("empty messages", CHAT, {"messages": []}, {}, 400, "messages"),
    ("message without role", CHAT, {"messages": [{"content": "x"}]}, {}, 400, "messages[0].role"),
    ("missing prompt", COMP, {"max_tokens": 3}, {}, 400, "prompt"),
    ("prompt wrong type", COMP, {"prompt": 5}, {}, 400, "prompt"),
    ("max_tokens string", CHAT, {"messages": M, "max_tokens": "x"}, {}, 400, "max_tokens"),
    ("max_tokens zero", CHAT, {"messages": M, "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens bool", CHAT, {"messages": M, "max_tokens": True}, {}, 400, "max_tokens"),
    ("temperature negative", CHAT, {"messages": M, "temperature": -1}, {}, 400, "temperature"),
    ("temperature string", CHAT, {"messages": M, "temperature": "hot"}, {}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": M, "top_p": 0}, {}, 400, "top_p"),
    ("top_k negative", CHAT, {"messages": M, "top_k": -2}, {}, 400, "top_k"),
    ("min_p above one", CHAT, {"messages": M, "min_p": 2}, {}, 400, "min_p"),
    ("xtc threshold", CHAT, {"messages": M, "xtc_threshold": 0.9}, {}, 400, "xtc_threshold"),
    ("repetition penalty zero", CHAT, {"messages": M, "repetition_penalty": 0}, {}, 400, "repetition_penalty"),
    ("context size zero", CHAT, {"messages": M, "repetition_context_size": 0}, {}, 400, "repetition_context_size"),
    ("logit_bias bad key", CHAT, {"messages": M, "logit_bias": {"abc": 1}}, {}, 400, "logit_bias"),
    ("logit_bias out of vocab", CHAT, {"messages": M, "logit_bias": {"999999": 1}}, {}, 400, "logit_bias"),
    ("top_logprobs too many", CHAT, {"messages": M, "logprobs": True, "top_logprobs": 99}, {}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": M, "top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("seed string", CHAT, {"messages": M, "seed": "x"}, {}, 400, "seed"),
    ("stop wrong type", CHAT, {"messages": M, "stop": 5}, {}, 400, "stop"),
    ("stream wrong type", CHAT, {"messages": M, "stream": "yes"}, {}, 400, "stream"),
    ("malformed tool", CHAT, {"messages": M, "tools": [{"type": "function"}]}, {}, 400, "tools[0]"),
    ("unknown response_format", CHAT, {"messages": M, "response_format": {"type": "yaml"}}, {}, 400, "response_format.type"),
    ("draft_model unsupported", CHAT, {"messages": M, "draft_model": "x"}, {}, 400, "draft_model"),
    ("context limit", COMP, {"prompt": [5] * 10, "max_tokens": 5000}, {}, 400, "max_tokens"),
    ("token id out of vocab", COMP, {"prompt": [5, 99999]}, {}, 400, "prompt"),
    ("unknown model", CHAT, {"messages": M, "model": "gpt-9"}, {}, 404, "model"),
    ("body too large", CHAT, {"messages": [{"role": "user", "content": "x" * 70000}]}, {}, 413, None),
]


def test_bad_request_battery_with_concurrent_good_stream(live, client):
    good = {}

    def stream():
        with httpx.Client(base_url=live.url, timeout=60) as c:
            with c.stream("POST", CHAT, json={"messages": M, "max_tokens": 40, "stream": True}) as r:
                good["text"] = r.read().decode()
                good["status"] = r.status_code

    t = threading.Thread(target=stream)
    t.start()
    failures = []
    for name, path, body, headers, status, param in BAD:
        if isinstance(body, bytes):
            r = client.post(path, content=body, headers={"content-type": "application/json", **headers})
        else:
            r = client.post(path, json=body, headers=headers)
        try:
            e = r.json()["error"]
            ok = r.status_code == status and set(e) == {"message", "type", "param", "code"} and e["message"]
            ok = ok and (param is None or e["param"] == param)
        except Exception:
            ok = False
        if not ok:
            failures.append((name, r.status_code, r.text[:200]))
    t.join()
    assert not failures, failures
    assert len(BAD) >= 20
    assert good["status"] == 200 and good["text"].endswith("data: [DONE]\n\n") and '"finish_reason": "length"' in good["text"]


def test_api_key_401():
    srv = LiveServer(batch=2, api_key="sekret")
    try:
        with httpx.Client(base_url=srv.url) as c:
            r = c.post(CHAT, json={"messages": M, "max_tokens": 2})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = c.post(CHAT, json={"messages": M, "max_tokens": 2}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            r = c.post(CHAT, json={"messages": M, "max_tokens": 2}, headers={"Authorization": "Bearer sekret"})
            assert r.status_code == 200
    finally:
        srv.stop()


def test_kv_budget_alone_400_names_number():
    srv = LiveServer(batch=2, kv_budget=50_000)
    try:
        with httpx.Client(base_url=srv.url) as c:
            r = c.post(COMP, json={"prompt": [5] * 100, "max_tokens": 200})
            assert r.status_code == 400 and "raise --kv-budget to at least" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_disconnect_frees_row(live):
    import time

    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", CHAT, json={"messages": M, "max_tokens": 3000, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(100):
            if c.get("/stats").json()["batch"]["active_rows"] == 0:
                break
            time.sleep(0.05)
        assert c.get("/stats").json()["batch"]["active_rows"] == 0


def test_metrics_and_stats_shape(client):
    client.post(CHAT, json={"messages": M, "max_tokens": 2})
    m = client.get("/metrics").text
    for name in ("mlxb_requests_total", "mlxb_generated_tokens_total", "mlxb_time_to_first_token_seconds_bucket",
                 "mlxb_inter_token_latency_seconds_bucket", "mlxb_active_rows", "mlxb_kv_bytes"):
        assert name in m
    b = client.get("/stats").json()["batch"]
    assert set(b) == {"configured", "mode", "batched", "active_rows", "pending_rows", "submitted_rows", "kv_bytes",
                      "kv_budget_bytes"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_503_when_engine_thread_dies():
    import time

    srv = LiveServer(batch=2)
    try:
        with httpx.Client(base_url=srv.url) as c:
            assert c.get("/health").status_code == 200
            srv.gw.engine.kill_for_test()
            t0 = time.monotonic()
            while c.get("/health").status_code != 503:
                assert time.monotonic() - t0 < 1.0
                time.sleep(0.02)
            r = c.post(CHAT, json={"messages": M, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        srv.stop()


def test_health_degraded_while_forwards_fail_and_back_after():
    """Per-row containment keeps the engine thread alive when forwards raise; /health must still say so
    (mlxb.engine.device_health), and recover once forwards succeed again."""
    from mlxb.engine.device_health import DeviceHealth

    srv = LiveServer(batch=2)
    runner = srv.gw.engine.runner
    real = runner.decode_step
    srv.gw.engine.device_health = DeviceHealth(window=8, min_failures=4)  # not the warm-up's 30 good forwards

    def broken():
        raise RuntimeError("planted device failure")

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            runner.decode_step = broken
            for _ in range(4):
                r = c.post(CHAT, json={"messages": M, "max_tokens": 4})
                assert r.status_code >= 500
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "degraded"
            assert "planted device failure" in h.json()["reason"]
            assert c.get("/stats").json()["engine"]["failed_forwards"] >= 4
            runner.decode_step = real
            r = c.post(CHAT, json={"messages": M, "max_tokens": 12})
            assert r.status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        srv.stop()
