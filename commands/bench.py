"""`mlxb bench ...`: benchmark commands."""

import typer

import json
import time
from pathlib import Path
from typing import Optional

from rich.table import Table

from mlxb.commands._common import DtypeOpt, ModelOpt, cli_errors, console, not_implemented

app = typer.Typer(help="Benchmarks: engine (in-process), load and features (live SSE).", no_args_is_help=True)


@app.command("load")
def load() -> None:
    """Load client against an OpenAI-compatible server (not implemented yet)."""
    not_implemented("bench load", "issue 6")


@app.command("features")
def features() -> None:
    """Feature matrix vs a peer stack (not implemented yet)."""
    not_implemented("bench features", "issue 6")


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
) -> None:
    """In-process benchmark: our engine vs mlx-lm (stream_generate, BatchGenerator) on the same model."""
    from mlxb.bench.engine import run
    from mlxb.doctor import report
    from mlxb.errors import ValidationError
    from mlxb.models import load_model

    try:
        bs = tuple(int(b) for b in batches.split(","))
    except ValueError:
        raise ValidationError(f"--batches {batches!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    m, tok, spec, path = load_model(model, dtype)
    with console.status("benchmarking ...") as status:
        res = run(m, tok, batches=bs, prompt_len=prompt_len, gen=gen, repeats=repeats, prefill_len=prefill_len,
                  progress=lambda s: status.update(f"benchmarking: {s}"))
    res["labels"] = {**report(measure=False), "model": spec.name, "dtype": spec.dtype,
                     "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    t = Table(title=f"mlxb bench engine — {spec.name} on {res['labels']['machine_key']} (ratio = ours / mlx-lm)")
    for c in ("metric", "B", "ours (median)", "mlx-lm (median)", "ratio min", "ratio median", "ratio max"):
        t.add_column(c)
    for r in res["summary"]:
        t.add_row(r["metric"], str(r["B"]), f"{r['ours_median']:.1f}", f"{r['peer_median']:.1f}",
                  f"{r['ratio_min']:.3f}", f"{r['ratio_median']:.3f}", f"{r['ratio_max']:.3f}")
    console.print(t)
    out = out or Path("reports/results") / f"engine-{spec.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, default=str))
    console.print(f"wrote {out}")
