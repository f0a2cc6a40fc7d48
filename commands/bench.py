"""`mlxb bench ...`: benchmark commands."""

import typer

import json
from pathlib import Path
from typing import Optional

from rich.table import Table

from mlxb.commands._common import (KV_ATTENTION_DEFAULT, KV_ATTENTION_HELP, DtypeOpt, ModelOpt, apply_kv_attention, cli_errors,
                                   console, progress, sigterm_as_exit, status)

from mlxb.commands.bench_stacks import _print_summary, _resolved_args, _run_seed, _run_stacks, _tokenizer_and_path  # noqa: F401

app = typer.Typer(help="Benchmarks: engine (in-process), load and features (live SSE).", no_args_is_help=True)


PEERS = ("mlx-lm", "mlxb-spec-off", "mlxb-share-off", "mlxb-prep-inline", "mlxb-fused-off", "mlxb-gil-0.5ms")  # stacks --peer starts beside mlxb (mlxb.bench.servers)


@app.command("load")
@cli_errors
def load(
    base_url: Optional[str] = typer.Option(None, "--base-url", help="A running OpenAI-compatible server (.../v1). Default: start `mlxb serve` on --model."),
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    stack: str = typer.Option("mlxb", "--stack", help="Name recorded for the --base-url stack."),
    peer: Optional[str] = typer.Option(None, "--peer", help="Also start this stack on the same model folder and run the identical load, A/B alternated: mlx-lm (mlx_lm.server) mlxb-spec-off (mlxb serve --spec off: speculation on against off) mlxb-share-off (mlxb serve --no-share-prefix: shared-prefix KV on against off) mlxb-prep-inline (mlxb serve --prep-threads 0: requests tokenized on the event loop) mlxb-fused-off (mlxb serve --kv-attention mlx-lm, against the fused kernels that MLXB_KV_ATTENTION=fused gives the mlxb stack) or mlxb-gil-0.5ms (mlxb serve --switch-interval-ms 0.5: the GIL handed between threads every 0.5 ms)."),
    dataset: str = typer.Option("random", "--dataset", help="random | shared-prefix | multi-turn | agent-loop | FILE.jsonl"),
    concurrency: str = typer.Option("1,2,4,8", "--concurrency", help="Closed loop: comma-separated concurrency levels."),
    requests: int = typer.Option(16, "--requests", min=1, help="Closed loop: requests per level."),
    rate: Optional[float] = typer.Option(None, "--rate", help="Open loop: requests per second (Poisson/gamma arrivals)."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Open loop: gamma shape (1 = Poisson, <1 burstier)."),
    duration: float = typer.Option(20.0, "--duration", help="Open loop: seconds of arrivals."),
    input_len: int = typer.Option(128, "--input-len", min=1),
    output_len: int = typer.Option(64, "--output-len", min=1),
    system_len: int = typer.Option(1024, "--system-len", help="shared-prefix: system prompt tokens."),
    groups: int = typer.Option(1, "--groups", help="shared-prefix: distinct system prompts."),
    turns: int = typer.Option(4, "--turns", min=1, help="multi-turn, agent-loop: requests per conversation."),
    tool_len: int = typer.Option(80, "--tool-len", min=1, help="agent-loop: tokens of each tool result."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Text seed (default: a fresh one per run, printed)."),
    repeats: int = typer.Option(1, "--repeats", min=1),
    batch: int = typer.Option(8, "--batch", help="--batch / --decode-concurrency given to servers this command starts."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly output-len tokens (mlxb honours it; mlx_lm.server has no such field)."),
    ttft_threshold: float = typer.Option(2.0, "--ttft-threshold", help="Saturation knee: highest load with p95 TTFT under this (s)."),
    api_key: Optional[str] = typer.Option(None, "--api-key"),
    api: str = typer.Option("chat", "--api", help="Endpoint for chat payloads: chat (/v1/chat/completions), responses (/v1/responses) or messages (Anthropic's /v1/messages)."),
    one_server: bool = typer.Option(False, "--one-server", help="Start one stack at a time (every repeat of mlxb, then every repeat of --peer, on the same text) instead of both up front, A/B alternated: for a model whose two servers do not fit the device together."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0, help="Sent with every request (agent clients sample; default: the servers' own, greedy on both mlxb and mlx_lm.server)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Sent with every request, as --temperature."),
    forced_tools: int = typer.Option(0, "--forced-tools", min=0, help="random: every K-th request carries tools, run twice: tool_choice auto (no grammar), then required (a forced call, a grammar row); rows report the TPOT of the requests without tools (p50_tpot_free)."),
) -> None:
    """Load an OpenAI-compatible server over streaming SSE; optionally the same load on mlx_lm.server."""
    import asyncio

    from mlxb.bench import load as L
    from mlxb.bench.matrix import Cell, Matrix
    from mlxb.bench.store import labels, write_run
    from mlxb.errors import ValidationError

    if peer and peer not in PEERS:
        raise ValidationError(f"--peer {peer!r}: the supported peers are {', '.join(PEERS)}")
    if api not in L.APIS:
        raise ValidationError(f"--api {api!r}: use one of {', '.join(L.APIS)}")
    if peer == "mlx-lm" and api != "chat":
        raise ValidationError(f"--api {api}: mlx_lm.server serves chat and completions only; drop --peer or use --api chat")
    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError:
        raise ValidationError(f"--concurrency {concurrency!r}: give integers, e.g. 1,2,4,8") from None
    spec, path, tok, vocab = _tokenizer_and_path(model, dtype)
    if rate is not None:  # open loop: one stack, one run
        if peer:
            raise ValidationError("--rate (open loop) runs one stack; drop --peer or use closed loop")
        if not base_url:
            raise ValidationError("--rate needs --base-url of a running server")
        if dataset.endswith(".jsonl"):
            ds = L.jsonl_dataset(dataset, default_max_tokens=output_len)
        else:
            ds = L.random_dataset(tok, max(1, int(rate * duration * 2)), input_len, output_len, vocab, _run_seed(seed))
        with status(f"open loop: {rate}/s for {duration}s ..."):
            res = asyncio.run(L.run_load(base_url, str(path), ds, rate=rate, burstiness=burstiness, duration=duration,
                                         ignore_eos=ignore_eos, api_key=api_key, api=api))
        s = L.summarize(res)
        row = {"cell": f"open-{dataset}", "stack": stack, "concurrency": 0, "repeat": 0, "rate": rate,
               "burstiness": burstiness, "status": "ok" if s["failed"] == 0 else "errors", **s}
        out = write_run(Path("reports/results"), labels(spec.name, dtype or spec.dtype, "load"),
                        [{"cell": row["cell"], "stack": stack, **r.to_row()} for r in res], [row])
        _print_summary([row])
        console.print(f"wrote {out}")
        return
    if dataset.endswith(".jsonl"):
        raise ValidationError("closed loop with a JSONL file: use --rate for files, or --dataset random|shared-prefix|multi-turn")
    if dataset == "random":
        cell = Cell("load-random", "random", {"input_len": input_len}, concurrency=levels, output_len=output_len)
    elif dataset == "shared-prefix":
        cell = Cell("load-shared-prefix", "shared-prefix", {"system_len": system_len, "question_len": 64, "groups": groups},
                    concurrency=levels, output_len=output_len)
    elif dataset == "multi-turn":
        cell = Cell("load-multi-turn", "multi-turn", {"system_len": system_len, "turn_len": 64, "turns": turns},
                    concurrency=levels, output_len=output_len)
    elif dataset == "agent-loop":  # C agents x K turns: --concurrency agents, each its own conversation
        cell = Cell("load-agent-loop", "agent-loop", {"system_len": system_len, "turn_len": input_len,
                                                       "tool_len": tool_len, "turns": turns},
                    concurrency=levels, output_len=output_len)
    else:
        raise ValidationError(f"--dataset {dataset!r}: use random, shared-prefix, multi-turn, agent-loop or a .jsonl file")
    cell.requests = requests
    cell.params.update({k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None})
    cells = [cell]
    if forced_tools:
        if dataset != "random":
            raise ValidationError("--forced-tools goes with --dataset random")
        cells = [Cell(f"{cell.name}-{name}{forced_tools}", "random", dict(cell.lengths),
                      params={**cell.params, "forced_every": forced_tools, "forced_choice": choice}, concurrency=levels,
                      output_len=output_len, requests=requests) for name, choice in (("tools", "auto"), ("forced", "required"))]
    if dataset == "agent-loop":
        cell.requests, cell.requests_per_slot = None, turns  # every agent runs its whole loop
    if api != "chat":
        for c in cells:
            c.name += f"-{api}"
    rows = _run_stacks(Matrix("cli", cells, repeats), spec, path, tok, vocab, base_url, peer, batch, 1.0, None,
                       dtype, "load", api=api, seed=seed, one_server=one_server)
    for st in sorted({r["stack"] for r in rows}):
        pts = [(r["concurrency"], r.get("p95_ttft")) for r in rows if r["stack"] == st and r["status"] != "unsupported"]
        console.print(f"saturation knee for {st} (p95 TTFT <= {ttft_threshold}s): concurrency {L.knee(pts, ttft_threshold)}")


@app.command("features")
@cli_errors
def features(
    matrix: Path = typer.Option(Path("matrices/features.toml"), "--matrix", help="Feature matrix TOML."),
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    peer: Optional[str] = typer.Option(None, "--peer", help="Peer stack started on the same folder: mlx-lm, mlxb-spec-off (speculation on against off) mlxb-share-off (shared-prefix KV on against off) mlxb-prep-inline (--prep-threads 0), mlxb-fused-off (--kv-attention mlx-lm) or mlxb-gil-0.5ms (--switch-interval-ms 0.5)."),
    cells: Optional[list[str]] = typer.Option(None, "--cell", help="Only these cells (repeatable)."),
    scale: float = typer.Option(1.0, "--scale", help="Multiply the matrix's prompt lengths (e.g. 0.25 on a small CPU); recorded in every row."),
    repeats: Optional[int] = typer.Option(None, "--repeats", min=1, help="Override the matrix's repeats."),
    batch: int = typer.Option(8, "--batch"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Text seed (default: a fresh one per run, printed)."),
    one_server: bool = typer.Option(False, "--one-server", help="Start one stack at a time (every repeat of mlxb, then every repeat of --peer, on the same text) instead of both up front, A/B alternated: for a model whose two servers do not fit the device together."),
) -> None:
    """Run the composition matrix against `mlxb serve` (and a peer), storing labelled Parquet results."""
    from mlxb.bench.matrix import parse
    from mlxb.errors import ValidationError

    if peer and peer not in PEERS:
        raise ValidationError(f"--peer {peer!r}: the supported peers are {', '.join(PEERS)}")
    m = parse(matrix)
    if repeats:
        m.repeats = repeats
    unknown = [c for c in cells or [] if c not in {x.name for x in m.cells}]
    if unknown:
        raise ValidationError(f"--cell {', '.join(unknown)}: not in {matrix} (cells: {', '.join(x.name for x in m.cells)})")
    spec, path, tok, vocab = _tokenizer_and_path(model, dtype)
    _run_stacks(m, spec, path, tok, vocab, None, peer, batch, scale, cells, dtype, "features", seed=seed,
                one_server=one_server)


@app.command("restart")
@cli_errors
def restart(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    prompt_len: int = typer.Option(2048, "--prompt-len", min=2, help="Tokens of the repeated prompt."),
    output_len: int = typer.Option(16, "--output-len", min=1),
    repeats: int = typer.Option(3, "--repeats", min=1),
    batch: int = typer.Option(8, "--batch"),
) -> None:
    """Prompt cache across a restart: TTFT cold, repeated, and after a graceful restart (SSD tier)."""
    from mlxb.bench.restart import run
    from mlxb.bench.store import labels, write_run

    spec, path, tok, vocab = _tokenizer_and_path(model, dtype)
    with progress() as prog, sigterm_as_exit():  # a kill stops the servers it started
        task = prog.add_task("restart", total=repeats)
        req_rows, summ = run(str(path), tok, vocab, prompt_len=prompt_len, output_len=output_len, repeats=repeats,
                             batch=batch, progress=lambda d, done, total: prog.update(task, completed=done))
    out = write_run(Path("reports/results"), labels(spec.name, dtype or spec.dtype, "restart"), req_rows, summ)
    t = Table(title=f"TTFT of a {prompt_len}-token prompt: cold, repeated, after a restart (SSD tier)")
    for c in ("repeat", "cold s", "repeat s", "after restart s", "cached after restart", "restart / cold"):
        t.add_column(c)
    for rep in range(repeats):
        by = {r["stack"]: r for r in summ if r["repeat"] == rep}
        c, w, a = (by[k]["p50_ttft"] for k in ("cold", "repeat", "after-restart"))
        ratio = f"{a / c:.3f}" if a and c else "-"
        t.add_row(str(rep), f"{c:.3f}" if c else "-", f"{w:.3f}" if w else "-", f"{a:.3f}" if a else "-",
                  str(by["after-restart"]["cached_tokens"]), ratio)
    console.print(t)
    console.print(f"wrote {out}")


@app.command("engine")
@cli_errors
def engine(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    batches: str = typer.Option("1,2,4,8", "--batches", help="Comma-separated batch sizes for the aggregate arm."),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1),
    gen: int = typer.Option(128, "--gen", min=2, help="Tokens generated per row (EOS ignored)."),
    repeats: int = typer.Option(3, "--repeats", min=1),
    prefill_len: int = typer.Option(512, "--prefill-len", min=2),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON result file (default reports/results/engine-<model>-<time>.json)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel: run `mlxb bench tp` (our engine over N ranks vs one device; start every rank under mlx.launch)."),
    adapters: int = typer.Option(0, "--adapters", min=0, max=64, help="LoRA: run `mlxb bench lora` with this many random-weight adapters mixed (vs no adapter, one adapter, and mlx-lm's fused model)."),
    compile_decode: bool = typer.Option(False, "--compile-decode", help="Also run a second engine with --compile-batch (compiled lone-row and batch steps), interleaved with our plain engine and mlx-lm."),
    skinny_matmul: bool = typer.Option(False, "--skinny-matmul", help="CUDA only: each aggregate arm at B>1 (B>=MLXB_SKINNY_MIN_ROWS; at 1 also B=1 decode arms) also runs our engine with serve's --skinny-matmul on the same prompts."),
    fuse_projections: bool = typer.Option(False, "--fuse-projections", help="Each aggregate arm (B=1 too) also runs our engine with serve's --fuse-projections on the same prompts."),
    served: bool = typer.Option(False, "--served", help="Also start `mlxb serve --no-prompt-cache` on the same folder and send each B=1 prompt there: rows b1_served_* (served over in-process)."),
    kv_attention: str = typer.Option(KV_ATTENTION_DEFAULT, "--kv-attention", help=KV_ATTENTION_HELP + " Our engine's arms only; mlx-lm's keep MLX's read."),
    prefill_step_size: int = typer.Option(2048, "--prefill-step-size", min=1, help="Our engine: as serve's (the most prompt tokens of joiner prefill between two decode steps)."),
    prefill_burst: Optional[int] = typer.Option(None, "--prefill-burst", min=1, help="Our engine: as serve's (prompt tokens one idle iteration may prefill; default 8 x --prefill-step-size)."),
) -> None:
    """In-process benchmark: our engine vs mlx-lm (stream_generate, BatchGenerator) on the same model."""
    kv_attention = apply_kv_attention(kv_attention)  # 'auto' resolved: the label says what ran
    if adapters and tp > 1:
        from mlxb.errors import ValidationError

        raise ValidationError("--adapters and --tp measure different things; give one of them")
    if adapters:
        from mlxb.commands.bench_self import lora_bench

        return lora_bench.__wrapped__(model=model, adapters=adapters, rank=8,
                                      batches=batches if batches != "1,2,4,8" else "8,32", context=prompt_len,
                                      gen=gen, repeats=repeats, out=out)
    if tp > 1:
        from mlxb.commands.bench_self import tp_bench

        return tp_bench.__wrapped__(model=model, dtype=dtype, tp=tp, batches=batches, prompt_len=prompt_len, gen=gen,
                                    repeats=repeats, prefill_len=prefill_len, out=out)
    from mlxb.bench.engine import run
    from mlxb.bench.store import json_labels
    from mlxb.errors import ValidationError
    from mlxb.models import load_model

    try:
        bs = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise ValidationError(f"--batches {batches!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    m, tok, spec, path = load_model(model, dtype)
    if compile_decode:
        from mlxb.engine.build import check_compile_decode

        check_compile_decode(m, batch=2)
    if skinny_matmul:
        from mlxb.engine.build import use_skinny_matmul
        from mlxb.kernels import skinny

        use_skinny_matmul(m)  # refuses off CUDA, checks the kernel; the arms switch it on and off
        skinny.uninstall(m)
    if fuse_projections:
        from mlxb.engine.build import use_fused_projections
        from mlxb.models.fuse import unfuse

        use_fused_projections(m)  # refuses a model with nothing to fuse; the arms switch it on and off
        unfuse(m)
    srv = None
    if served:
        from mlxb.bench import servers

        with status("starting mlxb serve for the served arm ..."):
            srv = servers.start("mlxb", str(path), batch=max(bs), max_tokens=max(512, gen),
                                extra=("--no-prompt-cache",))  # the folder of this dtype: no --dtype
    try:
        with status("benchmarking ...") as st:
            res = run(m, tok, batches=bs, prompt_len=prompt_len, gen=gen, repeats=repeats, prefill_len=prefill_len,
                      progress=lambda s: st.update(f"benchmarking: {s}"), compile_decode=compile_decode,
                      skinny=skinny_matmul, fused=fuse_projections,
                      served=(srv.base_url, srv.model_name) if srv else None,
                      prefill_chunk=prefill_step_size, prefill_burst=prefill_burst)
    finally:
        if srv is not None:
            srv.stop()
    res["labels"] = json_labels(spec.name, spec.dtype, kv_attention=kv_attention)
    t = Table(title=f"mlxb bench engine — {spec.name} on {res['labels']['machine_key']} (ratio = ours / mlx-lm)")
    for c in ("metric", "B", "ours (median)", "mlx-lm (median)", "ratio min", "ratio median", "ratio max"):
        t.add_column(c)
    f = lambda v, n: "-" if v is None else f"{v:.{n}f}"  # noqa: E731
    for r in res["summary"]:
        peer = f(r["peer_median"], 1) if not r.get("peer_failed") else f"failed x{r['peer_failed']}"
        t.add_row(r["metric"].removesuffix("_tps").replace("_", " "), str(r["B"]), f(r["ours_median"], 1), peer,
                  f(r["ratio_min"], 3), f(r["ratio_median"], 3), f(r["ratio_max"], 3))
    console.print(t)
    for r in res["summary"]:
        if r.get("peer_failed"):
            console.print(f"mlx-lm failed {r['metric']} at B={r['B']} in {r['peer_failed']} repeat(s): {r['peer_failed_reason']}")
    if compile_decode:
        console.print("compiled over plain: --compile-decode against our plain step (those rows' mlx-lm column is "
                      "our plain engine), interleaved in the same repeats")
    agg = [r for r in res["rows"] if r["metric"] in ("aggregate_tps", "aggregate_ragged_tps")]
    if agg:
        tt = Table(title="where our time goes (last repeat; ms per decode step, host side)")
        for c in ("B", "wall s", "peer wall s", "all first tokens s", "peer first s", "steps", "build", "launch",
                  "wait (device)", "emit", "deliver", "prefill s"):
            tt.add_column(c)
        last = {(r["metric"] != "aggregate_tps", r["B"]): r for r in agg}
        for (ragged, B), r in sorted(last.items()):
            st = r["ours_step_timing"]
            tt.add_row(f"{B} ragged" if ragged else str(B), f"{r['ours_wall_s']:.3f}", f(r["peer_wall_s"], 3), f"{r['ours_all_first_s']:.3f}",
                       f(r["peer_first_s"], 3), str(st["steps"]), f"{st['build_ms']:.2f}", f"{st['launch_ms']:.2f}",
                       f"{st['wait_ms']:.2f}", f"{st['emit_ms']:.2f}", f"{st['deliver_ms']:.2f}",
                       f"{st['prefill_s_total']:.3f}")
        console.print(tt)
    from mlxb.bench.store import result_file

    out = out or result_file("engine", spec.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    sj = res["late_joiner_stall"]

    def s4(x):
        return "n/a" if x is None else f"{x:.4f}s"

    if "error" in sj:
        console.print(f"[red]late-joiner measurement failed:[/] {sj['error']}")
    else:
        console.print(f"late joiner ({sj['joiner_prompt']} prompt tokens, chunk {sj['chunk']}, "
                      f"{sj['prefill_iterations']} prefill iterations; last of {len(sj['joiners'])} joiners): running "
                      f"row's gap before {s4(sj['median_gap_before_s'])}, max during the join "
                      f"{s4(sj['max_gap_during_s'])}; one chunk's prefill {s4(sj['mean_chunk_prefill_s'])}, whole prompt "
                      f"{s4(sj['whole_prefill_s'])} (every joiner's max gap: "
                      f"{', '.join(s4(j['max_gap_during_s']) for j in sj['joiners'])})")
    console.print(f"wrote {out}")


from mlxb.commands import bench_self  # noqa: E402  (our engine against itself: spec, kv, lora, tp)

app.command("spec")(bench_self.spec_bench)
app.command("kv")(bench_self.kv)
app.command("lora")(bench_self.lora_bench)
app.command("tp")(bench_self.tp_bench)
app.command("shared")(bench_self.shared)
