"""Shared CLI pieces: option aliases, the console, and the one place errors are formatted."""

from __future__ import annotations

import functools
import os
from typing import Annotated, Optional

import typer
from rich.console import Console

from mlxb.errors import MlxbError

console = Console()
err_console = Console(stderr=True)

ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", "-m", help="Preset (tiny-llama, ...), alias, local mlx-lm folder or HF id. Default: tiny-llama."),
]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (presets default to their own).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


def cli_errors(fn):
    """Format user errors once: a red message that says what to do next, exit status 2.

    ``MLXB_DEBUG=1`` re-raises so the traceback shows.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MlxbError as e:
            if os.environ.get("MLXB_DEBUG") == "1":
                raise
            err_console.print(f"[bold red]error:[/] {e.message}")
            raise typer.Exit(2)
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130)

    return wrapper


def not_implemented(name: str, issue: str) -> None:
    err_console.print(f"[bold red]error:[/] `mlxb {name}` is not implemented yet ({issue}); see `mlxb --help` for what works today")
    raise typer.Exit(2)


def progress(transient: bool = False):
    """The Rich progress bar every long-running command uses."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=transient)


KV_ATTENTION_HELP = ("How quantized KV (--kv-bits) is read at decode: 'mlx-lm' (its two quantized matmuls; exact "
                     "against mlx-lm) or 'fused' (mlxb's one-pass CUDA kernel over the packed cache; CUDA only, "
                     "not bit-equal to mlx-lm; see the README).")


def apply_kv_attention(mode: str) -> None:
    """Select the quantized-KV read; a bad mode or backend is a CLI error naming the fix."""
    from mlxb.errors import ValidationError
    from mlxb.kernels.quantized_attention import set_kv_attention

    try:
        set_kv_attention(mode)
    except ValueError as e:
        raise ValidationError(str(e), param="kv_attention") from None
