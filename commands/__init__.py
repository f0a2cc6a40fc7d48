"""Thin Typer adapters over the mlxb library (installed as ``mlxb.commands``)."""
