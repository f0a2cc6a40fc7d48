"""Load client against live servers: unsupported cells recorded, and `mlxb bench load` end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from mlxb.bench.features import Target, run_matrix
from mlxb.bench.matrix import Cell, Matrix

ROOT = Path(__file__).resolve().parents[2]


def test_run_matrix_records_unsupported_and_gates(live):
    tok = live.gw.tokenizer
    cells = [
        Cell("plain", "random", {"input_len": 16}, concurrency=[2], requests_per_slot=1, output_len=4),
        Cell("draft", "random", {"input_len": 16}, params={"draft_model": "x"},
             concurrency=[2], requests_per_slot=1, output_len=4),
        Cell("json", "random", {"input_len": 16}, params={"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
                       "additionalProperties": False}}}},
             gates=["json_schema_valid"], concurrency=[2], requests_per_slot=1, output_len=16),
        Cell("logprobs", "random", {"input_len": 16}, params={"logprobs": True, "top_logprobs": 5},
             gates=["top_logprobs_5"], concurrency=[2], requests_per_slot=1, output_len=4),
    ]
    t = Target("mlxb", live.url + "/v1", "tiny-llama")
    reqs, summ = run_matrix(Matrix("t", cells, repeats=1), [t], tok, 8192)
    by = {s["cell"]: s for s in summ}
    assert by["plain"]["status"] == "ok" and by["plain"]["output_tokens"] == 8
    assert by["draft"]["status"] == "unsupported" and "draft_model" in by["draft"]["reason"]
    assert by["json"]["status"] == "ok" and by["json"]["gate_json_schema_valid"] is True
    assert by["logprobs"]["status"] == "ok" and by["logprobs"]["gate_top_logprobs_5"] is True
    assert all(r["ok"] for r in reqs) and len(reqs) == 6


def test_agent_loop_cell_runs_each_agents_turns_and_reuses_its_conversation(live):
    """The agent-loop dataset against a live server: every turn answers, later turns start from the cached
    conversation, and rows say which wave (first on these servers, or warm) and which text seed they ran."""
    tok = live.gw.tokenizer
    cell = Cell("agent-loop", "agent-loop", {"system_len": 48, "turn_len": 12, "tool_len": 16, "turns": 3},
                concurrency=[2], requests_per_slot=3, output_len=6)
    t = Target("mlxb", live.url + "/v1", "tiny-llama")
    reqs, summ = run_matrix(Matrix("t", [cell], repeats=2), [t], tok, 8192, seed=5)
    assert [(s["status"], s["wave"], s["seed"]) for s in summ] == [("ok", "first", 5), ("ok", "warm", 5)]
    assert all(s["requests"] == 6 and s["turns_later"] == 4 and s["failed_turns"] == 0 for s in summ)
    assert sorted(r["turn"] for r in reqs if r["repeat"] == 0) == [0, 0, 1, 1, 2, 2]
    later = [r for r in reqs if r["turn"] >= 1]
    # each later turn resends its conversation: most of it comes from the prompt cache
    assert all(r["cached_tokens"] >= r["prompt_tokens"] // 2 for r in later), [(r["cached_tokens"], r["prompt_tokens"]) for r in later]


@pytest.mark.full
def test_bench_load_cli_against_mlxb_and_mlx_lm(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    r = subprocess.run([sys.executable, "-m", "mlxb.commands.main", "bench", "load", "-m", "tiny-llama", "--peer",
                        "mlx-lm", "--concurrency", "1,2", "--requests", "4", "--input-len", "32", "--output-len", "8"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "saturation knee for mlxb" in r.stdout and "saturation knee for mlx-lm" in r.stdout
    runs = list((tmp_path / "reports" / "results").iterdir())
    assert len(runs) == 1
    s = pd.read_parquet(runs[0] / "summary.parquet")
    assert set(s["stack"]) == {"mlxb", "mlx-lm"} and sorted(set(s["concurrency"])) == [1, 2]
    assert (s["status"] == "ok").all() and (s["failed"] == 0).all()
    assert (s.loc[s["stack"] == "mlxb", "output_tokens"] == 32).all()  # ignore_eos: exactly 4 x 8
    assert s["machine_key"].nunique() == 1 and s["git_commit"].notna().all()
    kept = json.loads((runs[0] / "server-stats.json").read_text())  # mlxb's /stats as it stopped; the peer has none
    assert [k["stack"] for k in kept] == ["mlxb"]
    assert {"batch", "prompt_cache", "shared_prefix", "engine"} <= set(kept[0]["stats"]) and kept[0]["stats"]["alive"]
    rep = subprocess.run([sys.executable, "-m", "mlxb.commands.main", "report", "--out", "r.html"], capture_output=True,
                         text=True, cwd=tmp_path, env=env)
    assert rep.returncode == 0 and "data:image/png" in (tmp_path / "r.html").read_text()


def test_served_arm_times_the_same_tokens_as_the_in_process_arm(live):
    """`bench engine --served`: the B=1 prompt through a live server, exactly gen tokens, rates from token 0 and 1,
    and rows of served over in-process next to the usual ones; a server that refuses the request is an error."""
    import pytest

    from mlxb.bench.engine import _prompts, run
    from mlxb.bench.served import served_single

    gw = live.gw
    url = live.url + "/v1"
    p = _prompts(1, 16, 8192, 3)[0]
    one = served_single(url, "tiny-llama", p, 12)
    assert one["tokens"] == 12 and one["wall"] > one["ttft"] > 0
    assert one["decode"] > 0 and one["decode_from1"] > 0
    with pytest.raises(RuntimeError, match="404"):
        served_single(url, "no-such-model", p, 12)
    res = run(gw.engine.model, gw.tokenizer, batches=(1,), prompt_len=16, gen=8, repeats=1, prefill_len=32,
              served=(url, "tiny-llama"))
    got = {r["metric"]: r for r in res["rows"]}
    for name in ("b1_served_decode_tps", "b1_served_decode_from1_tps", "b1_served_request_per_s"):
        assert got[name]["peer_name"] == "mlxb in-process" and got[name]["ours"] > 0 and got[name]["peer"] > 0
    assert got["b1_decode_tps"]["peer_name"] == "mlx_lm.stream_generate" and res["config"]["served"] is True


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


@pytest.mark.full
def test_a_killed_bench_keeps_finished_phases_and_stops_its_servers(tmp_path):
    """SIGTERM (what `timeout` and `kill` send) in the middle of `mlxb bench load`: the server it started is
    stopped, and the phases that finished are on disk, marked incomplete (Python's default would leave both
    the server running and nothing written)."""
    import json
    import signal
    import time

    import pytest

    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the bench's server process")
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.Popen([sys.executable, "-m", "mlxb.commands.main", "bench", "load", "-m", "tiny-llama",
                          "--concurrency", "1,2,4,8", "--requests", "4", "--input-len", "32", "--output-len", "64",
                          "--repeats", "4"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "reports" / "results").glob("*/summary.json")):
            assert p.poll() is None, p.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no phase finished in 240 s"
            time.sleep(0.2)
        servers = _children(p.pid)
        assert servers, "the bench should have a server child while it runs"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 128 + signal.SIGTERM
    for pid in servers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    (run,) = list((tmp_path / "reports" / "results").iterdir())
    got = json.loads((run / "summary.json").read_text())
    assert got["complete"] is False and 1 <= len(got["summary"]) < 16  # 4 levels x 4 repeats when complete
    s = pd.read_parquet(run / "summary.parquet")
    assert (~s["complete"]).all() and (s["status"] == "ok").all() and len(s) == len(got["summary"])
