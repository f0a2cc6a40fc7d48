"""Tensor parallel (--tp 2) with the prompt cache, on this CPU: the prefix parity case with every rank lending
from its own copy of rank 0's entries, the SSD tier's shards across restarts, and snapshot marks on a recurrent
model. Two local processes under ``mlx.launch --backend ring`` (helpers in ``tests/tp/test_tp.py``)."""

import json
import subprocess

import httpx
import pytest

from tests.tp.test_tp import LAUNCH, MLXB, ENV, SYSTEM, _json, _one_by_one, _one_process, _reap, _sharded, _start, _stop
from tests.server.test_serve_cli import free_port

pytestmark = pytest.mark.slow  # two processes under mlx.launch: the slow tier


@pytest.mark.parametrize("model,fault", [("tiny-llama", None), ("tiny-qwen3.5", None), ("tiny-llama", "prefix_off_by_one")])
def test_tp2_parity_prefix_case_prompt_cache_mirrored_on_every_rank(model, fault):
    """The prefix case sharded: multi-turn reuse, a leader's snapshot continued by a cohort, cached
    prefixes of different lengths, each rank lending from its own copy of rank 0's entries. tiny-llama
    stores finished rows (extracted before the filter), tiny-qwen3.5 (recurrent layers: exact lengths)
    its cohort rows' snapshots. The cached-token counts must equal the plan's; a planted off-by-one fails."""
    extra = ["--plant-fault", fault] if fault else []
    p = subprocess.run(LAUNCH + MLXB + ["parity", "-m", model, "--tp", "2", "--b", "3", "--case", "prefix",
                                        "--against", "live", "--json", *extra],
                       capture_output=True, text=True, timeout=300, env=ENV)
    d = _json(p.stdout)
    r = d["results"][0]
    assert r["case"] == f"{model} prefix-b3" and r["steps"] == 49 and r["error"] is None
    if fault:
        assert not d["ok"] and any(row["first_divergence"] for row in r["rows"])
    else:
        assert d["ok"] and r["schedule_mismatch"] is None, json.dumps(d)[:1500]


def _ask(url: str, task: str) -> tuple:
    r = httpx.post(url + "/v1/completions", json={"prompt": SYSTEM + task, "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tp2_ssd_tier_every_rank_keeps_its_shard_across_restarts(tmp_path):
    """--tp 2 with the SSD tier: a graceful stop writes each rank's shard of every RAM entry under the same
    name in its own folder; a restart of both ranks serves the shared system prompt from disk with the
    same text; with rank 1's shards corrupted, the ranks agree on a miss (same text, nothing cached,
    rank 0 drops its file) instead of one rank serving a prefix the other lacks."""
    d = tmp_path / "ssd"
    agents = _sharded(["--prompt-cache-dir", str(d)], _one_by_one)
    names = [sorted(p.relative_to(d / f"tp2-rank{r}") for p in (d / f"tp2-rank{r}").glob("*/*.safetensors"))
             for r in (0, 1)]
    assert names[0] and names[0] == names[1]
    assert len(list((d / "tp2-rank1").glob("*/*.json"))) == len(names[1])  # each shard's header, written last
    proc, url = _start(free_port(), "--prompt-cache-dir", str(d))
    try:
        text, cached = _ask(url, "List the files.")
        assert text == agents[0][0] and cached > 100
        pc = httpx.get(url + "/stats").json()["prompt_cache"]
        assert pc["ssd_hits"] >= 1 and pc["ssd_restores"] >= 1
        _stop(proc)
    finally:
        _reap(proc)
    for p in (d / "tp2-rank1").glob("*/*.safetensors"):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    proc, url = _start(free_port(), "--prompt-cache-dir", str(d))
    try:
        text, cached = _ask(url, "List the files.")
        assert text == agents[0][0] and cached == 0
        assert httpx.get(url + "/stats").json()["prompt_cache"]["ssd_corrupt_skipped"] >= 1
        assert _ask(url, "List the files.") == (text, agents[2][1])  # the RAM tier, mirrored, still works
        _stop(proc)
    finally:
        _reap(proc)


def test_tp2_snapshot_marks_on_a_recurrent_model_same_as_one_process(tmp_path):
    """tiny-qwen3.5 (recurrent layers: exact snapshots only) served sharded: chats that share a system prompt, one
    after another. The gateway's system mark makes rank 0 and the follower snapshot there, so the second chat
    reuses the system prompt; text and cached-token counts equal one process's, and both count one mark."""
    system = "You are a careful coding agent working in a large repository. " * 12

    def chats(url):
        out = []
        for q in ("List the files.", "Read main.py.", "List the files."):
            r = httpx.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}],
                "max_tokens": 10, "temperature": 0, "ignore_eos": True}, timeout=120)
            assert r.status_code == 200, r.text
            j = r.json()
            out.append((j["choices"][0]["message"]["content"], j["usage"]["prompt_tokens_details"]["cached_tokens"]))
        return out, httpx.get(url + "/stats").json()["prompt_cache"]["mark_snapshots"]

    sharded = _sharded(["-m", "tiny-qwen3.5", "--prompt-cache-dir", str(tmp_path / "tp")], chats)
    single = _one_process(["-m", "tiny-qwen3.5", "--prompt-cache-dir", str(tmp_path / "one")], chats)
    cached, marks = [c for _, c in sharded[0]], sharded[1]
    assert cached[0] == 0 and cached[1] > 200 and marks == 1
    assert sharded == single
