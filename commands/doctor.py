"""`mlxb doctor`: versions, device, machine key, memory and the BLAS MLX really uses."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from mlxb.commands._common import JsonOpt, cli_errors, console


@cli_errors
def doctor(
    json_out: JsonOpt = False,
    quick: bool = typer.Option(False, "--quick", help="Skip the matmul measurement."),
) -> None:
    """Show what a user needs when numbers look wrong."""
    from mlxb.doctor import report

    facts = report(measure=not quick)
    if json_out:
        console.print_json(json.dumps(facts))
        return
    t = Table(title="mlxb doctor", show_header=False)
    for k, v in facts.items():
        if k == "advice":
            continue
        t.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    console.print(t)
    for line in facts["advice"]:
        console.print(f"[yellow]advice:[/] {line}")
