"""Parity gates: a case protocol, the engine driver, goldens and comparison (see ``mlxb parity``)."""
