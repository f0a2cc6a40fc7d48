"""``MLXB_TRACE`` on a served request: its submit event carries its path from the server's handler (``recv``)
through tokenization (``prep``, ``made``) to the engine (``t``), on the chat and the Anthropic routes, and
``scripts/trace_summary.py`` reports each leg."""

import json

import httpx

from mlxb.engine.trace import IterationTrace
from scripts.trace_summary import summarize
from tests.server.conftest import LiveServer


def test_a_served_request_traces_its_path_to_the_engine(tmp_path):
    srv = LiveServer(batch=4, default_max_tokens=4, warmup=False)
    path = tmp_path / "trace.jsonl"
    try:
        srv.gw.engine.trace = IterationTrace(str(path))
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello there"}],
                                                     "max_tokens": 3})
            assert r.status_code == 200, r.text
            r = c.post("/v1/messages", json={"model": "tiny-llama", "max_tokens": 3,
                                             "messages": [{"role": "user", "content": "and again"}]})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
        srv.gw.engine.trace.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    subs = [d for d in lines if d.get("event") == "submit"]
    assert len(subs) == 2
    for e in subs:
        assert e["recv"] <= e["prep"] <= e["made"] <= e["t"], e
    s = summarize(lines)
    for k in ("recv_to_prep_ms", "prep_to_made_ms", "recv_to_engine_ms"):
        assert s[k]["n"] == 2 and s[k]["p50"] >= 0, (k, s[k])
    assert s["recv_to_engine_ms"]["max"] >= s["prep_to_made_ms"]["max"]
