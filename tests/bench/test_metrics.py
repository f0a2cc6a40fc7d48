"""Load-client metrics, arrivals, matrix parsing, Parquet store and report rendering (no model)."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mlxb.bench import load as L
from mlxb.bench.matrix import parse
from mlxb.bench.report import ab_table, render
from mlxb.bench.store import LABEL_KEYS, read_requests, read_summaries, write_run
from mlxb.errors import ValidationError


def result(i, start, ttft, itls, n, ok=True):
    r = L.RequestResult(i, start, ok=ok, ttft=ttft, itls=list(itls), completion_tokens=n, prompt_tokens=10)
    r.e2el = ttft + sum(itls)
    r.end = start + r.e2el
    return r


def test_metrics_from_synthetic_timeline_are_exact():
    a = result(0, 0.0, 0.5, [0.1, 0.1, 0.2], 4)  # ends at 0.9
    b = result(1, 0.5, 1.0, [0.25, 0.25], 3)  # ends at 2.0
    c = L.RequestResult(2, 0.2, ok=False, error="HTTP 400: bad", end=0.3)
    s = L.summarize([a, b, c])
    assert s["requests"] == 3 and s["completed"] == 2 and s["failed"] == 1
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["wall_s"] == pytest.approx(2.0)  # first send 0.0 to last byte 2.0
    assert s["output_tokens"] == 7 and s["output_throughput"] == pytest.approx(3.5)  # 7 / 2.0, not a sum of rates
    assert s["request_throughput"] == pytest.approx(1.0)
    assert a.tpot == pytest.approx(0.4 / 3) and b.tpot == pytest.approx(0.25)
    assert s["mean_ttft"] == pytest.approx(0.75) and s["p50_ttft"] == pytest.approx(0.75)
    assert s["p99_ttft"] == pytest.approx(0.5 + 0.99 * 0.5)
    assert s["p50_itl"] == pytest.approx(0.2)  # itls pooled: 0.1 0.1 0.2 0.25 0.25
    assert s["p95_e2el"] == pytest.approx(np.percentile([0.9, 1.5], 95))


def test_open_loop_arrivals_rate_and_burstiness():
    for shape in (1.0, 0.25, 4.0):
        gaps = np.array(L.arrival_gaps(rate=8.0, burstiness=shape, n=40000, seed=3))
        assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
        cv2 = gaps.var() / gaps.mean() ** 2  # gamma: CV^2 = 1 / shape (Poisson: 1)
        assert cv2 == pytest.approx(1 / shape, rel=0.08)
    with pytest.raises(ValueError):
        L.arrival_gaps(0, 1, 3)


def test_knee_stops_at_first_breach():
    assert L.knee([(1, 0.1), (2, 0.3), (4, 0.9), (8, 3.0), (16, 0.5)], 1.0) == 4
    assert L.knee([(1, 5.0)], 1.0) is None
    # a repeat where every request failed has no p95: it counts as a breach, never a crash
    assert L.knee([(8, 0.5), (8, None), (32, 0.4)], 1.0) is None
    assert L.knee([(4, 0.5), (8, None)], 1.0) == 4


def test_matrix_parses_and_rejects_bad_files_naming_the_line(tmp_path):
    m = parse("matrices/features.toml")
    assert [c.name for c in m.cells] == ["plain", "agents", "multi-turn", "agent-loop", "sampling", "logprobs", "mixed", "long", "json",
                                         "kv4", "spec", "lora"]
    assert [(c.adapters, c.adapter_rank) for c in m.cells if c.adapters] == [(4, 8)]
    h = parse("matrices/lora-h200.toml")
    assert [(c.name, c.adapters, c.adapter_rank, c.concurrency) for c in h.cells] == [
        ("lora16", 4, 16, [8]), ("base8", 0, 8, [8]), ("lora16x32", 4, 16, [32]), ("base32", 0, 8, [32])]
    assert all(c.concurrency == [1, 4, 8] for c in m.cells)
    assert [c.server_args for c in m.cells if c.server_args] == [["--kv-bits", "4", "--quantized-kv-start", "0"],
                                                                 ["--draft-model", "tiny-llama", "--num-draft-tokens", "4"]]
    bad = tmp_path / "m.toml"
    cases = [
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\n\n[[cell]]\nname = "b"\ndataset = "random"\nfoo = 1\n',
         r"m.toml:7: cell 'b': unknown key\(s\) foo"),
        ('[[cell]]\nname = "a"\ndataset = "shared-prefix"\nsystem_len = 8\n', "needs question_len"),
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\ngates = ["vibes"]\n', "unknown gate"),
        ('[[cell]]\nname = "a"\ndataset = "rand"\n', "dataset 'rand' is not one of"),
        ('[[cell]\nname = "a"\n', "line 1"),
        ('[defaults]\nrepeats = 2\n', "no \\[\\[cell\\]\\] entries"),
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\nserver_args = ["--batch", "1"]\n',
         "server_args --batch not allowed"),
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\nadapters = -1\n', "adapters must be an integer"),
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\nadapters = 2\nadapter_rank = 0\n', "adapter_rank must"),
        ('[[cell]]\nname = "a"\ndataset = "random"\ninput_len = 8\nadapter_rank = 16\n', "with adapters set"),
    ]
    for text, msg in cases:
        bad.write_text(text)
        with pytest.raises(ValidationError, match=msg):
            parse(bad)


def _fixture_run(tmp_path):
    lab = {k: f"v-{k}" for k in LABEL_KEYS} | {"memory_gb": 16.0, "run_id": "fixture-run"}
    summ, reqs = [], []
    rng = np.random.default_rng(0)
    for conc in (1, 4):
        for rep in range(3):
            for stack, speed in (("mlxb", 2.0), ("mlx-lm", 1.0)):
                ttfts = rng.uniform(0.1, 0.2, size=8) / speed
                summ.append({"cell": "plain", "stack": stack, "concurrency": conc, "repeat": rep, "status": "ok",
                             "output_throughput": 100.0 * speed * conc + rep, "p50_ttft": float(np.median(ttfts)),
                             "p95_ttft": float(np.percentile(ttfts, 95)), "p50_tpot": 0.01, "p95_itl": 0.02,
                             "failed": 0})
                reqs += [{"cell": "plain", "stack": stack, "concurrency": conc, "repeat": rep, "ok": True, "ttft": t,
                          "itls": [0.01, 0.02]} for t in ttfts]
    summ.append({"cell": "logprobs", "stack": "mlx-lm", "concurrency": 1, "repeat": 0, "status": "unsupported",
                 "reason": "HTTP 400: logprobs not supported"})
    return write_run(tmp_path, lab, reqs, summ), lab


def test_parquet_round_trip_keeps_schema_and_labels(tmp_path):
    out, lab = _fixture_run(tmp_path)
    s = read_summaries([tmp_path])
    r = read_requests([tmp_path])
    assert len(s) == 13 and len(r) == 96
    for k, v in lab.items():
        assert (s[k] == v).all() and (r[k] == v).all()  # every row carries every label
    assert s["output_throughput"].dtype == np.float64 and s["concurrency"].dtype == np.int64
    assert json.loads(r["itls"].iloc[0]) == [0.01, 0.02]
    assert json.loads((out / "summary.json").read_text())["labels"]["run_id"] == "fixture-run"
    with pytest.raises(ValidationError, match="no summary.parquet"):
        read_summaries([tmp_path / "nothing"])


def test_report_renders_plots_ab_table_and_unsupported(tmp_path):
    _fixture_run(tmp_path)
    s, r = read_summaries([tmp_path]), read_requests([tmp_path])
    ab = ab_table(s, r)
    assert {(x["cell"], x["concurrency"]) for x in ab} == {("plain", 1), ("plain", 4)}
    for x in ab:
        assert x["tps_ratio"] > 1.8 and x["tps_lo"] > 1 and x["tps_verdict"] == "faster"
        assert x["ttft_ratio"] < 0.7 and x["ttft_verdict"] == "faster"  # lower TTFT is faster
    html = render(s, r, tmp_path / "r.html").read_text()
    assert html.count("data:image/png;base64,") == 1  # one plot per measured cell
    assert "faster" in html and "v-machine_key" in html and "logprobs not supported" in html
    md = render(s, r, tmp_path / "r.md").read_text()
    assert "| plain | 4 | mlx-lm |" in md and "unsupported" not in md.split("## Unsupported")[0].split("## A/B")[0]


def test_verdict_indistinguishable_when_ci_straddles_one(tmp_path):
    rows = [{"cell": "c", "stack": st, "concurrency": 1, "repeat": i, "status": "ok", "output_throughput": v}
            for i, (a, b) in enumerate([(10, 11), (12, 10), (11, 12)]) for st, v in (("mlxb", a), ("mlx-lm", b))]
    ab = ab_table(pd.DataFrame(rows), pd.DataFrame())
    assert ab[0]["tps_verdict"] == "indistinguishable"


def test_cell_server_args_reach_both_stacks():
    from mlxb.bench.servers import command
    from mlxb.commands.bench import _resolved_args

    args = _resolved_args(["--draft-model", "tiny-llama", "--num-draft-tokens", "4"], None)
    assert args[0] == "--draft-model" and args[1].startswith("/") and args[2:] == ["--num-draft-tokens", "4"]

    for stack in ("mlxb", "mlx-lm"):
        cmd = command(stack, "/m", 1234, 8, 2048, 64, "/tmp/pc", ("--kv-bits", "4"))
        assert cmd[-2:] == ["--kv-bits", "4"] and "--port" in cmd


def test_result_file_names_a_model_folder_by_its_last_part():
    from mlxb.bench.store import result_file

    p = result_file("kv", "/var/tmp/synth-llama-8b/")
    assert p.parent == Path("reports/results") and p.name.startswith("kv-synth-llama-8b-") and p.suffix == ".json"
    assert result_file("engine", "synth-llama-30m").name.startswith("engine-synth-llama-30m-")


def test_report_opens_with_the_headline_and_keeps_one_colour_per_stack(tmp_path):
    """Issue 49: the verdicts come before the tables; a stack has one colour in every panel of every plot."""
    import matplotlib.pyplot as plt

    from mlxb.bench.report import figures, stack_colors

    _fixture_run(tmp_path)
    s, r = read_summaries([tmp_path]), read_requests([tmp_path])
    html = render(s, r, tmp_path / "r.html").read_text()
    head = html.index('id="headline"')
    assert head < html.index("<h2>Labels</h2>") < html.index("<h2>A/B")
    assert "plain</b>, 4 clients, against mlx-lm: tok/s" in html and "(faster)" in html[head:html.index("<h2>Labels")]
    md = render(s, r, tmp_path / "r.md").read_text()
    assert md.index("## Headline") < md.index("## Labels") and "- **plain**, 1 clients, against mlx-lm" in md

    colors = stack_colors(s["stack"].unique())
    assert colors["mlxb"] != colors["mlx-lm"]
    two = pd.concat([s, s.assign(cell="other")])
    seen = {}
    for _, fig in figures(two):
        for ax in fig.axes:
            for line in ax.get_lines():
                stack = line.get_label().split(" ")[0]
                seen.setdefault(stack, set()).add(line.get_color())
        plt.close(fig)
    assert seen == {"mlxb": {colors["mlxb"]}, "mlx-lm": {colors["mlx-lm"]}}


class _Tok:
    """Stands in for a tokenizer: decoding ids gives distinct words, so text differs with the seed."""

    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_agent_loop_resends_the_conversation_with_tool_calls_and_results():
    import asyncio

    ds = L.agent_loop_dataset(_Tok(), agents=2, turns=3, system_len=5, task_len=3, tool_len=4, output_len=7,
                              vocab=1000, seed=11)
    assert len(ds) == 6 and ds.name == "agent-loop"
    sent = []

    async def send(p, i):
        sent.append(p)
        return L.RequestResult(i, 0.0, ok=True, ttft=0.1 * len(sent), e2el=1.0, completion_tokens=7, end=1.0,
                               text=f"reply {i}")

    res = asyncio.run(L._conversations(send, ds, concurrency=2, n_requests=6, on_done=None))
    assert sorted(r.turn for r in res) == [0, 0, 1, 1, 2, 2]
    assert all(p["tools"] == L.AGENT_TOOLS and p["max_tokens"] == 7 for p in sent)
    last = max(sent, key=lambda p: len(p["messages"]))["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[2]["tool_calls"][0]["id"] == last[3]["tool_call_id"] and last[2]["content"].startswith("reply")
    assert json.loads(last[2]["tool_calls"][0]["function"]["arguments"])  # a JSON string, as OpenAI sends it
    systems = {p["messages"][0]["content"] for p in sent}
    assert len(systems) == 1  # one shared system prompt
    s = L.summarize(res)
    assert s["turns_later"] == 4 and s["failed_turns"] == 0 and s["p95_ttft_later"] is not None
    other = L.agent_loop_dataset(_Tok(), 2, 3, 5, 3, 4, 7, 1000, seed=12)
    assert other.conversations[0]["messages"][0]["content"] not in systems  # a new seed: new text


def test_first_wave_and_warm_rows_get_their_own_verdicts():
    """Issue 46: a fresh server's first wave (compiles, cold caches) and warm rounds are reported apart."""
    from mlxb.bench.report import headline

    rows = [{"cell": "c", "stack": st, "concurrency": 8, "repeat": i, "status": "ok", "output_throughput": v,
             "wave": "first" if i == 0 else "warm"}
            for i, (a, b) in enumerate([(100, 10), (100, 90), (101, 91)]) for st, v in (("mlxb", a), ("mlx-lm", b))]
    ab = ab_table(pd.DataFrame(rows), pd.DataFrame())
    by = {r["wave"]: r for r in ab}
    assert set(by) == {"first", "warm"} and by["first"]["tps_ratio"] == 10.0 and 1.1 < by["warm"]["tps_ratio"] < 1.12
    assert [h["cell"] for h in headline(ab)] == ["c (first wave)", "c (warm wave)"]


def test_forced_tool_rows_and_their_control_mark_the_same_positions():
    """bench load --forced-tools K: every K-th request carries the tools, forced or auto (the control); the
    free rows' TPOT covers only requests without tools, in both runs."""
    from mlxb.bench import load as L
    from mlxb.models import load_model

    tok = load_model("tiny-llama", lazy=True)[1]
    forced = L.random_dataset(tok, 6, 16, 8, 1000, seed=1, forced_every=2)
    auto = L.random_dataset(tok, 6, 16, 8, 1000, seed=1, forced_every=2, tool_choice="auto")
    assert [p.get("tool_choice") for p in forced.payloads] == [None, "required"] * 3
    assert [p.get("tool_choice") for p in auto.payloads] == [None, "auto"] * 3
    assert [p["messages"] for p in forced.payloads] == [p["messages"] for p in auto.payloads]
    rs = []
    for i, (tpot, tools, constrained) in enumerate([(0.01, False, False), (0.05, True, True), (0.03, True, False)]):
        r = L.RequestResult(i, 0.0, ok=True, ttft=0.1, e2el=0.1 + tpot * 9, completion_tokens=10, end=1.0)
        r.tools, r.constrained = tools, constrained
        r.itls = [tpot] * 8 + [tpot * 10]  # one stall (a later arrival's prefill) among steady gaps
        rs.append(r)
    s = L.summarize(rs)
    assert s["constrained"] == 1 and s["p50_tpot_free"] == pytest.approx(0.01)
    assert s["p50_itl_free"] == pytest.approx(0.01) and s["p50_itl"] == pytest.approx(0.03)  # the free rows' gaps only


def test_json_results_carry_the_commit_machine_and_model(monkeypatch):
    """bench engine / spec / kv JSON results name the code they measured (the lent GPU machines pass it through
    MLXB_GIT_COMMIT, their tree's history being stale), besides the machine and the model."""
    from mlxb.bench.store import json_labels

    monkeypatch.setenv("MLXB_GIT_COMMIT", "abc1234")
    lab = json_labels("tiny-llama", "float32", kv_attention="fused")
    assert lab["git_commit"] == "abc1234" and lab["model"] == "tiny-llama" and lab["kv_attention"] == "fused"
    assert lab["machine_key"] and lab["versions"]["mlx"] and lab["date"].startswith("20")


def test_each_cell_level_and_repeat_draws_its_own_prompt_text(tiny_models):
    """Two cells run one after the other on one server (the forced-tools A/B) must not send the same text:
    the second would replay the first from the prompt cache. Every stack still gets the same text."""
    from mlxb.bench.features import dataset_for, text_seed
    from mlxb.bench.matrix import Cell

    _, tok, *_ = tiny_models("tiny-llama")
    lengths = {"input_len": 40}
    auto = Cell("load-random-tools2", "random", lengths, params={"forced_every": 2, "forced_choice": "auto"})
    forced = Cell("load-random-forced2", "random", lengths, params={"forced_every": 2, "forced_choice": "required"})

    def text(cell, rep=0, conc=8, seed=7):
        ds = dataset_for(cell, tok, 4, 8000, 1.0, text_seed(seed, cell.name, rep, conc))
        return [json.dumps(p.get("messages") or p.get("prompt")) for p in ds.payloads]  # the text, not the fields

    assert text(auto) == text(auto)  # deterministic: the same for every stack of a run
    assert text(auto) != text(forced)
    assert text(auto) != text(auto, rep=1) and text(auto) != text(auto, conc=32) and text(auto) != text(auto, seed=8)


def test_a_bench_server_removes_the_private_ssd_tier_it_was_given_and_keeps_a_named_one(tmp_path, monkeypatch):
    """A private SSD folder per start (no earlier run's files) is deleted when that server stops: an 8B model's
    tier holds tens of GB, and two such servers filled a 64 GB disk (H100, stop 69). A named folder stays."""
    import subprocess
    import sys

    from mlxb.bench import servers

    answer = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
              "    def log_message(self, *a): pass\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    real = subprocess.Popen
    seen = []

    def fake(cmd, **kw):  # the command as built, served by a stand-in that answers /v1/models
        seen.append(cmd)
        return real([sys.executable, "-c", answer, cmd[cmd.index("--port") + 1]], **kw)

    monkeypatch.setattr(servers.subprocess, "Popen", fake)
    srv = servers.start("mlxb-spec-off", "/m", ready_timeout=30)
    d = Path(seen[-1][seen[-1].index("--prompt-cache-dir") + 1])
    (d / "payload.safetensors").write_bytes(b"x")
    assert d.is_dir() and srv.owned_dir == str(d)
    srv.stop()
    assert not d.exists()
    named = tmp_path / "ssd"
    named.mkdir()
    srv = servers.start("mlxb", "/m", ready_timeout=30, prompt_cache_dir=str(named))
    srv.stop()
    assert named.is_dir() and srv.owned_dir is None
