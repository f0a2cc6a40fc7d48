"""`mlxb bench ...`: benchmark commands."""

import typer

from mlxb.commands._common import not_implemented

app = typer.Typer(help="Benchmarks: engine (in-process), load and features (live SSE).", no_args_is_help=True)


@app.command("load")
def load() -> None:
    """Load client against an OpenAI-compatible server (not implemented yet)."""
    not_implemented("bench load", "issue 6")


@app.command("features")
def features() -> None:
    """Feature matrix vs a peer stack (not implemented yet)."""
    not_implemented("bench features", "issue 6")
