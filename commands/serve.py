"""`mlxb serve` (placeholder until the server issue lands)."""

from mlxb.commands._common import not_implemented


def serve() -> None:
    """OpenAI-compatible server over the engine (not implemented yet)."""
    not_implemented("serve", "issue 4")
