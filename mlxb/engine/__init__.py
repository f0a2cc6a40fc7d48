"""The engine: gateway -> scheduler (pure) -> runner (the only model caller)."""
