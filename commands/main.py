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
    """Re-exec once with OpenBLAS preloaded on Linux and its idle threads' spin shortened (see mlxb.doctor
    for the measurements)."""
    from mlxb.doctor import blas_preload_path, reexec_env

    env = reexec_env(dict(os.environ), blas_preload_path())
    if env is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, "-m", "mlxb.commands.main", *sys.argv[1:]], env)
    except OSError:
        return  # keep going with the bundled BLAS


def main() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # keep tokenizer-loading chatter off the CLI
    from mlxb.doctor import graph_check_env

    graph_check_env(os.environ)  # before any GPU operation (see there)
    _maybe_reexec_with_openblas()
    app(prog_name="mlxb")


if __name__ == "__main__":
    main()
