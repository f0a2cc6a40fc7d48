"""Device-specific kernels, each behind a capability check with MLX's own path as the fallback."""


def cuda_gpu() -> bool:
    """MLX runs on a CUDA GPU here (the custom ``mx.fast.cuda_kernel`` paths and CUDA-only dispatch)."""
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available() and mx.default_device() == mx.gpu)


def kernel_name(base: str, *sources: str) -> str:
    """The name to give ``mx.fast.cuda_kernel``: ``base`` and a short hash of the kernel's source. MLX keys its
    compiled kernels, in memory and in its on-disk cache (``MLX_PTX_CACHE_DIR``, by default under the temporary
    directory), by the name and template constants alone: a kernel whose source changed between mlxb versions
    would otherwise load the old compiled code."""
    import hashlib

    return f"{base}_{hashlib.sha256(''.join(sources).encode()).hexdigest()[:10]}"
