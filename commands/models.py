"""`mlxb models`: list presets and aliases; build a preset as a folder."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from mlxb.commands._common import DtypeOpt, cli_errors, console, status

app = typer.Typer(help="List synthetic presets and aliases; build a preset as an mlx-lm folder.", invoke_without_command=True)


@app.callback()
def models(ctx: typer.Context) -> None:
    """List synthetic presets (random weights!) and aliases for real models."""
    if ctx.invoked_subcommand is not None:
        return
    from mlxb.models.presets import ALIASES, DEFAULT_MODEL, PRESETS

    t = Table(title="Synthetic presets — real mlx-lm architectures with RANDOM weights (text is meaningless)")
    for col in ("name", "architecture", "stands for", "dtype", "params"):
        t.add_column(col)
    for p in PRESETS.values():
        c = p.config
        n = _param_estimate(c)
        t.add_row(p.name + (" (default)" if p.name == DEFAULT_MODEL else ""), c["model_type"], p.stands_for, p.dtype, n)
    console.print(t)
    a = Table(title="Aliases for real models (need a network the first time)")
    a.add_column("alias")
    a.add_column("Hugging Face id")
    for k, v in ALIASES.items():
        a.add_row(k, v)
    console.print(a)
    console.print("Also accepted: a local mlx-lm folder or any Hugging Face id (org/name).")


def _param_estimate(c: dict) -> str:
    h, layers, ffn, v = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    n = layers * (4 * h * h + 3 * h * ffn) + v * h * (1 if c.get("tie_word_embeddings", True) else 2)
    return f"~{n / 1e6:.1f}M" if n < 1e9 else f"~{n / 1e9:.1f}B"


@app.command("build")
@cli_errors
def build(
    name: str = typer.Argument(..., help="Preset name, e.g. synth-llama-8b"),
    out: Path = typer.Option(None, "--out", help="Folder to write (default: the MLXB_HOME cache)."),
    dtype: DtypeOpt = None,
) -> None:
    """Write a preset as an ordinary (sharded) mlx-lm folder that mlx_lm.server can open."""
    from mlxb.models.registry import resolve_model
    from mlxb.models.presets import PRESETS
    from mlxb.models.synth import ensure_preset, write_folder
    from mlxb.errors import ValidationError

    spec = resolve_model(name, dtype)
    if spec.kind != "preset":
        raise ValidationError(f"{name!r} is not a synthetic preset; `mlxb models` lists them")
    with status(f"building {name} ..."):
        path = write_folder(PRESETS[name], out, spec.dtype) if out else ensure_preset(PRESETS[name], spec.dtype)
    console.print(f"[green]built[/] {name} ({spec.dtype}) at {path}")


@app.command("build-adapter")
@cli_errors
def build_adapter(
    name: str = typer.Argument(..., help="Adapter name (for messages; serve it with --adapters NAME=FOLDER)."),
    base: str = typer.Option("tiny-llama", "--base", help="Base model: preset, folder or HF id."),
    rank: int = typer.Option(8, "--rank", min=1, max=256),
    num_layers: int = typer.Option(-1, "--num-layers", help="LoRA on the last N layers (-1: all), as mlx_lm.lora."),
    scale: float = typer.Option(20.0, "--scale"),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(..., "--out", help="Adapter folder to write."),
) -> None:
    """Write a random-weight LoRA adapter in mlx-lm's format (mlx_lm.generate --adapter-path, mlx_lm.fuse and
    mlxb serve --adapters read it)."""
    from mlxb.models.adapters import build_adapter as write
    from mlxb.models.registry import load_model

    with status(f"building adapter {name} ..."):
        m, *_ = load_model(base, lazy=True)
        path = write(m, out, rank=rank, num_layers=num_layers, scale=scale, seed=seed)
    console.print(f"[green]built[/] adapter {name} (rank {rank}, random weights) for {base} at {path}")
