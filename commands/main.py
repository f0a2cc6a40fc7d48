"""The ``mlxb`` composition root: one Typer app, each command a thin module."""

from __future__ import annotations

import os
import sys

import typer

from mlxb.commands import bench, doctor, generate, models, parity, report, serve

app = typer.Typer(
    name="mlxb",
    help="Serve local LLMs on MLX with continuous batching; gate every mechanism for parity, measure it for speed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("serve")(serve.serve)
app.command("generate")(generate.generate)
app.command("parity")(parity.parity)
app.command("golden-gen")(parity.golden_gen)
app.add_typer(bench.app, name="bench")
app.command("report")(report.report)
app.add_typer(models.app, name="models")
app.command("doctor")(doctor.doctor)


def _maybe_reexec_with_openblas() -> None:
    """Re-exec once with OpenBLAS preloaded on Linux (see mlxb.doctor for the measurement)."""
    from mlxb.doctor import blas_preload_path

    lib = blas_preload_path()
    if lib is None or os.environ.get("_MLXB_REEXEC") == "1" or lib in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ, _MLXB_REEXEC="1")
    env["LD_PRELOAD"] = ":".join(p for p in (lib, os.environ.get("LD_PRELOAD", "")) if p)
    try:
        os.execve(sys.executable, [sys.executable, "-m", "mlxb.commands.main", *sys.argv[1:]], env)
    except OSError:
        return  # keep going with the bundled BLAS


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep tokenizer-loading chatter off the CLI
    _maybe_reexec_with_openblas()
    app(prog_name="mlxb")


if __name__ == "__main__":
    main()
