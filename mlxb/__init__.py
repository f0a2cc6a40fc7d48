"""mlxb: continuous-batching LLM serving on MLX, gated for correctness and measured for speed."""

__version__ = "0.1.0"
