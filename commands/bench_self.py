"""`mlxb bench spec`, `kv` and `shared`: our engine against itself in one process (speculation against plain
decoding; quantized KV against full width; shared-prefix KV against copies), results as labelled JSON (Parquet for
``shared``) under reports/results/."""

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from mlxb.commands._common import KV_ATTENTION_DEFAULT, KV_ATTENTION_HELP, DtypeOpt, ModelOpt, apply_kv_attention, cli_errors, console, status


def _write(res: dict, kind: str, spec, out: Optional[Path], quiet: bool = False) -> None:
    """Label the result (machine, versions, model, date) and write it (``quiet``: a partial result, rewritten as
    the run goes on)."""
    from mlxb.bench.store import json_labels, result_file

    res["labels"] = json_labels(spec.name, spec.dtype)
    out = out or result_file(kind, spec.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    if not quiet:
        console.print(f"wrote {out}")


def _ints(text: str, flag: str, example: str) -> tuple:
    from mlxb.errors import ValidationError

    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise ValidationError(f"{flag} takes comma-separated integers, e.g. {example}") from None


@cli_errors
def spec_bench(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    spec: str = typer.Option("lookup", "--spec", help="Proposer: lookup (prompt lookup) or draft (--draft-model)."),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Draft model for --spec draft (the target's own name gives the self-draft ceiling)."),
    num_draft_tokens: int = typer.Option(4, "--num-draft-tokens", min=1, max=32),
    lookup_ngram: int = typer.Option(3, "--lookup-ngram", min=1, max=16),
    spec_max_batch: int = typer.Option(64, "--spec-max-batch", min=1, help="Speculate up to this many rows (the bench default measures every B)."),
    spec_pipeline: str = typer.Option("off", "--spec-pipeline", help="As serve --spec-pipeline (off, auto, on)."),
    spec_fixed: bool = typer.Option(False, "--spec-fixed", help="Draft --num-draft-tokens every step (no adaptation or pauses), as serve --spec-fixed."),
    batches: str = typer.Option("1,8", "--batches"),
    regimes: str = typer.Option("repetitive,random", "--regimes", help="Prompt regimes: repetitive, random, looping (the prompt ends in the model's own greedy output, where random-weight models loop), replay (the mechanism at a chosen acceptance: drafts are the row's own greedy continuation, each token wrong with probability --replay-miss)."),
    replay_miss: str = typer.Option("0.1", "--replay-miss", help="The replay regime's chance that a draft token is wrong (with --fixed-k: a comma-separated list)."),
    fixed_k: Optional[str] = typer.Option(None, "--fixed-k", help="Sweep: the controller against these fixed draft lengths (e.g. 2,4,8) at each --replay-miss, replay proposer, one process."),
    context: int = typer.Option(512, "--context", min=8, help="Prompt tokens per row."),
    gen: int = typer.Option(64, "--gen", min=2),
    repeats: int = typer.Option(2, "--repeats", min=1),
    skinny_matmul: bool = typer.Option(False, "--skinny-matmul", help="Both engines with serve's --skinny-matmul (CUDA only)."),
    fuse_projections: bool = typer.Option(False, "--fuse-projections", help="Both engines with serve's --fuse-projections."),
    out: Optional[Path] = typer.Option(None, "--out"),
) -> None:
    """Speculative decoding vs plain decoding on our engine: decode tok/s ratios with the acceptance."""
    from mlxb.bench.spec import ALL_REGIMES, run
    from mlxb.engine.build import build_spec, choose_attention_kernels, use_fused_projections, use_skinny_matmul
    from mlxb.models import load_model

    choose_attention_kernels(None)  # as serve: on CUDA, no cuDNN graph built per verify shape (0.1-1 s each)

    bs = _ints(batches, "--batches", "1,8")
    try:
        misses = tuple(float(x) for x in replay_miss.split(","))
    except ValueError:
        raise typer.BadParameter(f"{replay_miss!r}: give numbers in [0, 1], e.g. 0,0.1,0.3", param_hint="--replay-miss") from None
    if not misses or not all(0.0 <= x <= 1.0 for x in misses):
        raise typer.BadParameter(f"{replay_miss!r}: each value must be in [0, 1]", param_hint="--replay-miss")
    if len(misses) > 1 and not fixed_k:
        raise typer.BadParameter("several values go with --fixed-k (the sweep)", param_hint="--replay-miss")
    if fixed_k:
        return _spec_sweep(model, dtype, spec, draft_model, num_draft_tokens, lookup_ngram, spec_max_batch,
                           spec_pipeline, _ints(fixed_k, "--fixed-k", "2,4,8"), misses, bs, context, gen, repeats, out)
    bad = [g for g in regimes.split(",") if g not in ALL_REGIMES]
    if bad:
        raise typer.BadParameter(f"{bad[0]!r}: choose from {', '.join(ALL_REGIMES)}", param_hint="--regimes")
    m, tok, mspec, path = load_model(model, dtype)
    cfg = build_spec(m, tok, "draft" if draft_model and spec == "lookup" else spec, num_draft_tokens, lookup_ngram,
                     draft_model, dtype, spec_max_batch, adaptive=not spec_fixed, pipeline=spec_pipeline)
    if fuse_projections:
        use_fused_projections(m)
    if skinny_matmul:
        use_skinny_matmul(m, cfg)
    with status("benchmarking ...") as st:
        res = run(m, tok, spec=cfg, batches=bs, regimes=tuple(regimes.split(",")), context=context, gen=gen,
                  repeats=repeats, progress=lambda s: st.update(f"benchmarking: {s}"), replay_miss=misses[0])
    res["config"]["skinny_matmul"] = skinny_matmul
    res["config"]["fuse_projections"] = fuse_projections
    what = (f"draft {cfg.draft_name}" if cfg.method == "draft" else "lookup") + (" --spec-fixed" if spec_fixed else "")
    what += f" --spec-pipeline {spec_pipeline}" if spec_pipeline != "off" else ""
    what += " --skinny-matmul" if skinny_matmul else ""
    what += " --fuse-projections" if fuse_projections else ""
    t = Table(title=f"decode tok/s, --spec {what} vs plain ({context}-token prompts, same run) — {mspec.name}")
    for c in ("regime", "B", "plain tok/s", "spec tok/s", "ratio min", "ratio median", "ratio max", "acceptance",
              "guesses kept/dropped"):
        t.add_column(c)
    for r in res["summary"]:
        acc = "no drafts" if r["acceptance"] is None else f"{r['acceptance']:.0%} of {r['drafted']}"
        t.add_row(r["regime"], str(r["B"]), f"{r['plain_tps']:.1f}", f"{r['spec_tps']:.1f}", f"{r['ratio_min']:.3f}",
                  f"{r['ratio_median']:.3f}", f"{r['ratio_max']:.3f}", acc, f"{r['pipelined_kept']}/{r['pipelined_dropped']}")
    console.print(t)
    _write(res, "spec", mspec, out)


def _spec_sweep(model, dtype, spec, draft_model, k, ngram, max_batch, pipeline, fixed, misses, bs, context, gen,
                repeats, out) -> None:
    from mlxb.bench.spec_sweep import sweep
    from mlxb.engine.build import build_spec, choose_attention_kernels
    from mlxb.models import load_model

    choose_attention_kernels(None)  # as serve (see spec_bench)

    m, tok, mspec, _ = load_model(model, dtype)
    cfg = build_spec(m, tok, "draft" if draft_model and spec == "lookup" else spec, k, ngram, draft_model, dtype,
                     max_batch, adaptive=True, pipeline=pipeline)
    if out is None:  # one file for the partial results and the whole
        from mlxb.bench.store import result_file

        out = result_file("spec-sweep", mspec.name)
    with status("sweeping ...") as st:
        res = sweep(m, tok, spec=cfg, fixed=tuple(fixed), misses=misses, batches=bs, context=context, gen=gen,
                    repeats=repeats, progress=lambda s: st.update(f"sweeping: {s}"),
                    checkpoint=lambda part: _write(part, "spec-sweep", mspec, out, quiet=True))
    arms = ["auto", *[f"fixed{x}" for x in fixed]]
    t = Table(title=f"decode tok/s over plain, replay proposer (draft tokens wrong with probability P), "
                    f"controller up to K={k} vs fixed K — {mspec.name}, {context}-token prompts, {repeats} repeats")
    for c in ("B", "P", *arms, "best fixed", "auto / max(best, 1)"):
        t.add_column(c)
    for r in res["summary"]:
        def cell(a, r=r):
            m = r["arms"].get(a)
            if m is None:
                return "-"
            if m["ratio_median"] is None:
                return f"failed ({m['failed']})"
            return f"{m['ratio_median']:.3f} ({m['ratio_min']:.2f}-{m['ratio_max']:.2f})"

        t.add_row(str(r["B"]), f"{r['miss']:g}", *[cell(a) for a in arms], r["best_fixed"] or "-",
                  "-" if r["auto_vs_best"] is None else f"{r['auto_vs_best']:.3f}")
    console.print(t)
    _write(res, "spec-sweep", mspec, out)


@cli_errors
def kv(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    kv_bits: str = typer.Option("8,4", "--kv-bits", help="Comma-separated schemes to compare with full width."),
    kv_group_size: int = typer.Option(64, "--kv-group-size"),
    batches: str = typer.Option("8,32", "--batches"),
    context: int = typer.Option(1024, "--context", min=1, help="Prompt tokens per row in the decode arm."),
    gen: int = typer.Option(64, "--gen", min=2),
    repeats: int = typer.Option(2, "--repeats", min=1),
    admit_context: int = typer.Option(4096, "--admit-context", min=1, help="Context of the admission count."),
    prefill_chunk: int = typer.Option(2048, "--prefill-chunk", min=16),
    quantized_kv_start: int = typer.Option(0, "--quantized-kv-start", min=0),
    kv_attention: str = typer.Option(KV_ATTENTION_DEFAULT, "--kv-attention", help=KV_ATTENTION_HELP),
    out: Optional[Path] = typer.Option(None, "--out"),
) -> None:
    """Quantized KV vs full width on our engine: rows admitted under one --kv-budget, decode tok/s (ratios)."""
    from mlxb.bench.kv import run
    from mlxb.errors import ValidationError
    from mlxb.models import load_model

    bits, bs = _ints(kv_bits, "--kv-bits", "8,4"), _ints(batches, "--batches", "8,32")
    kv_attention = apply_kv_attention(kv_attention)  # 'auto' resolved
    m, tok, spec, path = load_model(model, dtype)
    with status("benchmarking ...") as st:
        try:
            res = run(m, tok, bits=bits, group_size=kv_group_size, batches=bs, context=context, gen=gen,
                      repeats=repeats, admit_context=admit_context, prefill_chunk=prefill_chunk,
                      kv_start=quantized_kv_start,
                      progress=lambda s: st.update(f"benchmarking: {s}"),
                      on_row=lambda r: console.print(f"B={r['B']} {r['scheme']} repeat {r['repeat'] + 1}: full width "
                                                     f"{r['full_tps']:.1f} tok/s, {r['scheme']} {r['quant_tps']:.1f} tok/s, "
                                                     f"{r['ratio']:.3f}x", highlight=False))
        except ValueError as e:
            raise ValidationError(str(e), param="kv_group_size") from None
    t = Table(title=f"rows admitted under one --kv-budget at {admit_context} tokens — {spec.name}")
    for c in ("scheme", "bytes per row", "rows", "vs full width"):
        t.add_column(c)
    for r in res["admission"]:
        t.add_row(r["scheme"], f"{r['row_bytes']:,}", str(r["rows_admitted"]), f"{r['ratio_vs_full']:.2f}x")
    console.print(t)
    t = Table(title=f"decode tok/s at {context}-token rows (ratio = quantized / full width, same run)")
    for c in ("B", "scheme", "full tok/s", "quantized tok/s", "ratio min", "ratio median", "ratio max"):
        t.add_column(c)
    for r in res["summary"]:
        t.add_row(str(r["B"]), r["scheme"], f"{r['full_tps']:.1f}", f"{r['quant_tps']:.1f}", f"{r['ratio_min']:.3f}",
                  f"{r['ratio_median']:.3f}", f"{r['ratio_max']:.3f}")
    console.print(t)
    _write(res, "kv", spec, out)


@cli_errors
def lora_bench(
    model: ModelOpt = None,
    adapters: int = typer.Option(4, "--adapters", min=1, max=64, help="Random-weight adapters mixed in the batch."),
    rank: int = typer.Option(8, "--rank", min=1, max=256),
    batches: str = typer.Option("8,32", "--batches"),
    context: int = typer.Option(256, "--context", min=1),
    gen: int = typer.Option(64, "--gen", min=2),
    repeats: int = typer.Option(2, "--repeats", min=1),
    lora_path: Optional[str] = typer.Option(None, "--lora-path", help="exact | stacked | fused | concat | auto (as mlxb serve --lora-path)."),
    out: Optional[Path] = typer.Option(None, "--out"),
) -> None:
    """LoRA per row on our engine: N adapters mixed vs the base, one adapter vs mlx-lm's fused model (ratios)."""
    from mlxb.bench.lora import run
    from mlxb.models.registry import model_path, resolve_model

    bs = _ints(batches, "--batches", "8,32")
    spec = resolve_model(model)
    source = spec.source if spec.kind == "preset" else str(model_path(spec))
    with status("benchmarking ...") as st:
        res = run(source, adapters=adapters, rank=rank, batches=bs, context=context, gen=gen, repeats=repeats,
                  progress=lambda s: st.update(f"benchmarking: {s}"), lora_path=lora_path)
    t = Table(title=f"decode tok/s, {adapters} LoRA adapters (rank {rank}, random weights), {context}-token rows, "
                    f"same run — {spec.name}")
    for c in ("B", "base", "mixed", "one", "fused", "mixed/base (min med max)", "one/fused (min med max)",
              "mixed/fused (min med max)"):
        t.add_column(c)
    for r in res["summary"]:
        t.add_row(str(r["B"]), *(f"{r[k + '_tps']:.1f}" for k in ("base", "mixed", "one", "fused")),
                  *(" ".join(f"{r[q + '_' + f]:.3f}" for f in ("min", "median", "max"))
                    for q in ("mixed_vs_base", "one_vs_fused", "mixed_vs_fused")))
    console.print(t)
    c = res["config"]
    console.print(f"LoRA path: {c['lora_path']}" + (f", one-launch expand: {c['concat_kernel']}" if c["lora_path"] == "concat" else ""))
    _write(res, "lora", spec, out)


@cli_errors
def tp_bench(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    tp: int = typer.Option(2, "--tp", min=2, help="Ranks (start every rank under mlx.launch with this same command)."),
    batches: str = typer.Option("1,32,64", "--batches", help="Batch sizes: 1 gives the B=1 decode arm, the others aggregates."),
    prompt_len: int = typer.Option(64, "--prompt-len", min=1),
    gen: int = typer.Option(128, "--gen", min=2),
    repeats: int = typer.Option(3, "--repeats", min=1),
    prefill_len: int = typer.Option(512, "--prefill-len", min=2),
    out: Optional[Path] = typer.Option(None, "--out", help="JSON result (default reports/results/tp-<model>-<time>.json)."),
) -> None:
    """Tensor parallel: our engine sharded over --tp ranks vs our engine on rank 0's device alone, one run."""
    from mlxb.bench.tp import allreduce_cost, model_shape, run
    from mlxb.distributed.leader import Link, init_group, shard_model
    from mlxb.distributed.follower import run_follower
    from mlxb.models import load_model

    bs = _ints(batches, "--batches", "1,32,64")
    link = Link(init_group(tp))
    sharded, tok, spec, _ = load_model(model, dtype, lazy=True)
    hidden, layers, dt = model_shape(sharded)
    cost = allreduce_cost(link, hidden, layers, dt, sorted(set(bs)))  # every rank, before the engines
    shard_model(sharded, link.group, spec.name)
    if link.rank != 0:
        raise typer.Exit(run_follower(sharded, link))
    full = load_model(model, dtype)[0]
    with status("benchmarking ...") as st:
        res = run(full, sharded, tok, link, batches=bs, prompt_len=prompt_len, gen=gen, repeats=repeats,
                  prefill_len=prefill_len, progress=lambda s: st.update(f"benchmarking: {s}"))
    res["allreduce"] = cost
    t = Table(title=f"mlxb bench tp — {spec.name}, TP={tp} vs one device (ratio = TP{tp} / TP1)")
    for c in ("metric", "B", f"TP{tp} (median)", "TP1 (median)", "ratio min", "ratio median", "ratio max"):
        t.add_column(c)
    for r in res["summary"]:
        t.add_row(r["metric"].removesuffix("_tps").replace("_", " "), str(r["B"]), f"{r['tp_median']:.1f}",
                  f"{r['one_median']:.1f}", f"{r['ratio_min']:.3f}", f"{r['ratio_median']:.3f}", f"{r['ratio_max']:.3f}")
    console.print(t)
    for c in cost:
        console.print(f"all_sum [B={c['B']}, 1, {hidden}] ({c['bytes']} bytes): {c['one_ms']:.3f} ms each, "
                      f"{c['per_step_ms']:.2f} ms per decode step ({c['reduces_per_step']} reductions)")
    _write(res, f"tp{tp}", spec, out)


@cli_errors
def shared(
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    rows: int = typer.Option(16, "--rows", min=2, help="Rows whose prompts open with one prefix."),
    prefix: int = typer.Option(2048, "--prefix", min=2, help="Tokens of the common prefix."),
    own: int = typer.Option(32, "--own", min=1, help="Tokens of each row's own after the prefix."),
    gen: int = typer.Option(32, "--gen", min=2, help="Decode steps timed per arm."),
    plain_rows: int = typer.Option(8, "--plain-rows", min=1, help="Rows of the cell with nothing in common."),
    repeats: int = typer.Option(3, "--repeats", min=1),
    share_min: int = typer.Option(256, "--share-min-tokens", min=1, help="As serve's --share-min-tokens."),
    budget_rows: float = typer.Option(0, "--budget-rows", min=0, help="Also run the engine as served under a --kv-budget "
                                      "of this many whole rows' KV, all --rows requests sent at once: peak rows decoding "
                                      "together, copies against sharing (0: skip)."),
    f32_arm: bool = typer.Option(False, "--f32-arm", help="Also run the shared prefix with a float32 copy of its "
                                 "values (serve's --share-f32-values): arm shared-f32 of the fleet cell."),
    cells: str = typer.Option("fleet,unshared,b1", "--cells", help="Cells to run: fleet, unshared, b1."),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default reports/results/)."),
) -> None:
    """In-process: shared-prefix KV against every row's own copy (KV bytes and decode step time), on the same
    prompts, fresh each repeat; plus rows with nothing in common and a lone row (no regression expected)."""
    from mlxb.bench.shared import run, summarize
    from mlxb.bench.store import labels, write_run
    from mlxb.cache.protocol import layer_kinds
    from mlxb.models import load_model

    def _cells(v: str) -> tuple:
        from mlxb.errors import ValidationError

        names = tuple(c.strip() for c in v.split(",") if c.strip())
        bad = [c for c in names if c not in ("fleet", "unshared", "b1")]
        if bad or not names:
            raise ValidationError(f"--cells {v!r}: name some of fleet, unshared, b1", param="cells")
        return names

    m, tok, spec, _ = load_model(model, dtype)
    with status("benchmarking shared-prefix KV ...") as st:
        res = run(m, layer_kinds(m), rows=rows, prefix=prefix, own=own, gen=gen, plain_rows=plain_rows,
                  repeats=repeats, share_min=share_min, f32_arm=f32_arm, cells=_cells(cells), vocab=min(8000, len(getattr(tok, "vocab", {})) or 8000),
                  progress=lambda s: st.update(f"shared-prefix KV: {s}"))
    summ = summarize(res)
    adm = []
    if budget_rows:
        from mlxb.bench.shared import admission

        with status("admission under one --kv-budget ...") as st:
            adm = admission(m, tok, rows=rows, prefix=prefix, own=own, gen=gen, budget_rows=budget_rows,
                            share_min=share_min, progress=lambda s: st.update(s))
        res += [{"cell": "admission", **a} for a in adm]
    lab = labels(spec.name, spec.dtype, "shared")
    path = write_run(out or Path("reports/results"), lab, res, summ)
    t = Table(title=f"mlxb bench shared — {spec.name} on {lab['machine_key']} (copies / shared: > 1 favours sharing)")
    for c in ("cell", "rows", "step ms shared", "step ms copies", "step speed-up median (min-max)", "KV MB shared",
              "KV MB copies", "KV ratio"):
        t.add_column(c)
    for s in summ:
        t.add_row(s["cell"], str(s["rows"]), f"{s['step_ms_shared']:.2f}", f"{s['step_ms_copies']:.2f}",
                  f"{s['speedup_median']:.3f} ({s['speedup_min']:.3f}-{s['speedup_max']:.3f})",
                  f"{s['kv_bytes_shared'] / 1e6:.1f}", f"{s['kv_bytes_copies'] / 1e6:.1f}", f"{s['kv_ratio_median']:.2f}")
    console.print(t)
    for a in adm:
        console.print(f"admission under --kv-budget {a['budget_bytes'] / 1e9:.2f} GB ({a['budget_rows']:g} whole rows), "
                      f"{a['rows']} requests: {a['arm']} peaked at {a['peak_running']} rows decoding together, "
                      f"{a['tok_s']:.1f} tok/s, peak KV {a['peak_kv_bytes'] / 1e6:.1f} MB")
    console.print(f"rows: {path}")
