"""Shared-prefix KV as served: on by default, visible in /stats and /metrics, off with --no-share-prefix."""

import concurrent.futures as cf
import random
import time

import httpx

from tests.server.conftest import LiveServer


def _system(words=900, seed=3):
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "kappa", "omega", "tool", "file"]) for _ in range(words))


def _fleet(url, n=6):
    """n agents with one long system prompt at once; the most rows /stats saw sharing while they ran."""
    sysmsg = _system()

    def ask(i):
        with httpx.Client(base_url=url, timeout=120) as c:
            return c.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 48, "messages": [
                {"role": "system", "content": sysmsg}, {"role": "user", "content": f"task {i}: check file {i * 7}"}]})

    best = {}
    with cf.ThreadPoolExecutor(n) as ex, httpx.Client(base_url=url, timeout=30) as c:
        futs = [ex.submit(ask, i) for i in range(n)]
        while not all(f.done() for f in futs):
            s = c.get("/stats").json()["shared_prefix"]
            if s.get("rows_sharing", 0) > best.get("rows_sharing", -1):
                best = s
            time.sleep(0.02)
        codes = [f.result().status_code for f in futs]
        after = c.get("/stats").json()["shared_prefix"]
        metrics = c.get("/metrics").text
    return codes, best, after, metrics


def test_agents_sharing_a_system_prompt_read_one_copy_and_the_flag_turns_it_off():
    on = LiveServer(batch=8, default_max_tokens=48, warmup=False)
    try:
        codes, best, after, metrics = _fleet(on.url)
    finally:
        on.stop()
    assert codes == [200] * 6
    assert best["active"] and best["rows_sharing"] >= 2 and best["prefix_tokens"] >= 256
    assert best["bytes_saved"] > 0 and best["shared_bytes"] > 0
    assert after["rows_sharing"] == 0 and after["prefix_tokens"] == 0  # freed with its last reader
    assert 'mlxb_shared_prefix{stat="rows_shared"}' in metrics
    off = LiveServer(batch=8, default_max_tokens=48, warmup=False, share_prefix=False)
    try:
        codes, best, _, _ = _fleet(off.url)
    finally:
        off.stop()
    assert codes == [200] * 6
    assert best["active"] is False and "--no-share-prefix" in best["off_reason"]
