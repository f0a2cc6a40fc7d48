"""The reference side of parity: drives mlx-lm only (installed as ``mlxb.oracle``)."""
