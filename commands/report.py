"""`mlxb report`: render stored benchmark results (Parquet) to HTML or Markdown."""

from __future__ import annotations

from pathlib import Path

import typer

from mlxb.commands._common import cli_errors, console


@cli_errors
def report(
    paths: list[Path] = typer.Argument(None, help="Result folders or summary.parquet files (default: reports/results)."),
    out: Path = typer.Option(Path("reports/report.html"), "--out", help="Output file: .html (with plots) or .md."),
    title: str = typer.Option("mlxb benchmark report", "--title"),
) -> None:
    """Plots of TTFT and aggregate tok/s against concurrency, A/B ratios with bootstrap CIs, run labels."""
    from mlxb.bench.report import render
    from mlxb.bench.store import read_requests, read_summaries
    from mlxb.errors import ValidationError

    if out.suffix not in (".html", ".md"):
        raise ValidationError(f"--out {out}: use a .html or .md file name")
    paths = paths or [Path("reports/results")]
    summ = read_summaries(paths)
    reqs = read_requests(paths)
    render(summ, reqs, out, title)
    console.print(f"wrote {out} ({len(summ)} summary rows, {len(reqs)} requests)")
