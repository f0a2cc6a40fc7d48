"""Shared CLI pieces: option aliases, the console, and the one place errors are formatted."""

from __future__ import annotations

import contextlib
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
    """The Rich progress bar every long-running command uses, on stderr (stdout keeps tables and --json).
    Where stderr is no terminal (a log file, a pipe, a remote run) Rich draws nothing until the end, so
    there a plain line is written whenever a task's text changes, at most every 15 s otherwise."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cls = Progress if err_console.is_terminal else _log_progress_class()
    return cls(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               console=err_console, transient=transient)


@contextlib.contextmanager
def status(text: str):
    """A spinner with a changing text on stderr; where stderr is no terminal, one line per text."""
    if err_console.is_terminal:
        with err_console.status(text) as st:
            yield st
    else:
        yield _LineStatus(text)


class _LineStatus:
    def __init__(self, text: str):
        import time

        self.t0 = time.monotonic()
        self.update(text)

    def update(self, text: str) -> None:
        import sys
        import time

        print(f"{text} [{time.monotonic() - self.t0:.0f} s]", file=sys.stderr, flush=True)


def _log_progress_class():
    import sys
    import time

    from rich.progress import Progress

    class LogProgress(Progress):
        """Progress for a console that is no terminal: one line per change of text, or every ``EVERY`` s."""

        EVERY = 15.0

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._said: dict = {}

        def add_task(self, *a, **k):
            task_id = super().add_task(*a, **k)
            self._say(task_id)
            return task_id

        def update(self, task_id, **kw):
            super().update(task_id, **kw)
            self._say(task_id)

        def advance(self, task_id, advance: float = 1) -> None:
            super().advance(task_id, advance)
            self._say(task_id)

        def _say(self, task_id) -> None:
            t = self._tasks.get(task_id)
            if t is None:
                return
            now = time.monotonic()
            text, when = self._said.get(task_id, (None, float("-inf")))
            if t.description == text and now - when < self.EVERY and not t.finished:
                return
            self._said[task_id] = (t.description, now)
            total = f"/{t.total:g}" if t.total is not None else ""
            print(f"{t.description} {t.completed:g}{total} [{t.elapsed or 0.0:.0f} s]", file=sys.stderr, flush=True)

    return LogProgress


KV_ATTENTION_HELP = ("How decode attention reads the batch's KV: 'mlx-lm' (MLX's attention, and mlx-lm's two quantized "
                     "matmuls under --kv-bits; exact against mlx-lm) or 'fused' (mlxb's split-key CUDA kernels: the "
                     "packed cache read in place under --kv-bits, and masked full-precision batches and shared "
                     "prefixes in one pass; CUDA only, not bit-equal to mlx-lm; see docs/cuda.md) or 'auto' "
                     "(fused on a CUDA device whose start-up self-checks pass, else mlx-lm: Metal and CPU always "
                     "read with mlx-lm). Default: $MLXB_KV_ATTENTION, else auto.")
KV_ATTENTION_DEFAULT = os.environ.get("MLXB_KV_ATTENTION", "auto")


def apply_kv_attention(mode: str) -> str:
    """Select the decode attention read; a bad mode or backend is a CLI error naming the fix. Returns the mode
    in effect ('auto' resolved)."""
    from mlxb.errors import ValidationError
    from mlxb.kernels.quantized_attention import set_kv_attention

    try:
        return set_kv_attention(mode)
    except ValueError as e:
        raise ValidationError(str(e), param="kv_attention") from None


@contextlib.contextmanager
def sigterm_as_exit():
    """SIGTERM (``kill``, ``timeout``) raises SystemExit in the main thread while the block runs, so its
    ``finally`` clauses stop the servers it started and keep what it measured; Python's default would end the
    process on the spot and leave them running."""
    import signal
    import sys

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: leave the process's handler alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
