"""Device-specific kernels, each behind a capability check with MLX's own path as the fallback."""


def cuda_gpu() -> bool:
    """MLX runs on a CUDA GPU here (the custom ``mx.fast.cuda_kernel`` paths and CUDA-only dispatch)."""
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)
