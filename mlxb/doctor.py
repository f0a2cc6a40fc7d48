"""Machine facts for ``mlxb doctor``, golden machine keys and benchmark labels.

On Linux the ``mlx[cpu]`` wheel bundles reference (netlib) BLAS. Measured on the 2-core x86_64
machines this project is developed on, a 512x512x1536 fp32 matmul ran at 4.1 GFLOP/s with it and
32.5 GFLOP/s with Debian's OpenBLAS preloaded (8x). The CLI therefore re-executes itself with
OpenBLAS preloaded when the library is installed (``blas_preload_path``); ``MLXB_BLAS_PRELOAD=0``
turns that off. BLAS changes numerics, so the machine key names the BLAS in use.

OpenBLAS's worker threads spin for ``2**OPENBLAS_THREAD_TIMEOUT`` cycles after each call before they sleep
(default 28, about 0.1 s). MLX runs quantized KV reads on a second CPU stream (``mlxb.kernels.split_read``),
and on a 2-core machine those spinning workers take its core at random. On an AMD EPYC with OpenBLAS 0.3.21,
``mlxb bench kv -m synth-llama-30m --kv-bits 8 --batches 8`` (1k-token rows, two runs of each, interleaved;
``reports/cpu/blas-timeout/``) gave KV8 over full width 0.82-1.00 at the default and 1.07-1.11 at 12, and the
full-width arm 132-134 against 137-138 tok/s. So the re-exec also sets ``OPENBLAS_THREAD_TIMEOUT``
(``BLAS_THREAD_TIMEOUT``) unless it is set already. It changes when the workers sleep, not what they compute.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from typing import Optional

OPENBLAS_CANDIDATES = [
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
]


BLAS_THREAD_TIMEOUT = "12"  # 2**12 cycles of spinning, a few microseconds (module notes)


def blas_preload_path() -> str | None:
    """The OpenBLAS to preload on Linux, or None (not Linux, not installed, or disabled)."""
    if sys.platform != "linux" or os.environ.get("MLXB_BLAS_PRELOAD", "1") == "0":
        return None
    return installed_openblas()


def installed_openblas() -> str | None:
    """The first of ``OPENBLAS_CANDIDATES`` present on this machine, or None."""
    return next((p for p in OPENBLAS_CANDIDATES if os.path.exists(p)), None)


def reexec_env(environ: dict, lib: Optional[str]) -> Optional[dict]:
    """The environment to re-exec the CLI with (OpenBLAS ``lib`` preloaded, its thread timeout set), or None
    when there is nothing to change or this process is already the re-exec."""
    if lib is None or environ.get("_MLXB_REEXEC") == "1":
        return None
    preloaded = lib in re.split(r"[: ]", environ.get("LD_PRELOAD", ""))
    if preloaded and "OPENBLAS_THREAD_TIMEOUT" in environ:
        return None
    env = dict(environ, _MLXB_REEXEC="1")
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", BLAS_THREAD_TIMEOUT)
    if not preloaded:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, environ.get("LD_PRELOAD", "")) if p)
    return env


GRAPH_CHECK_ENV = "MLX_ENABLE_CACHE_THRASHING_CHECK"
_GRAPH_CHECK_MARK = "_MLXB_GRAPH_CHECK"  # set with it: the value is mlxb's default, not the user's


def graph_check_env(environ) -> str:
    """Turn MLX's CUDA graph-cache thrashing check off in ``environ`` unless the user set it; returns what is in
    effect. MLX keeps executable CUDA graphs in an LRU cache keyed by topology (``MLX_CUDA_GRAPH_CACHE_SIZE``);
    with the check on, once a process's lifetime misses pass twice the capacity every further miss throws on the
    evaluating thread and leaves that stream's encoder unusable (scripts/graph_cache_probe.py). A server's batch
    sizes, verify widths and prompt lengths make new topologies for as long as it runs, so with the check off a
    miss costs one graph instantiation, never the engine. MLX reads the variable when a stream's encoder is made,
    so this runs before the first GPU operation (the CLI's start; ``build_gateway`` for library users). Any
    backend: the variable means nothing off CUDA."""
    if GRAPH_CHECK_ENV in environ and environ.get(_GRAPH_CHECK_MARK) != "1":
        return f"{GRAPH_CHECK_ENV}={environ[GRAPH_CHECK_ENV]} (from the environment)"
    environ[GRAPH_CHECK_ENV], environ[_GRAPH_CHECK_MARK] = "0", "1"
    return f"{GRAPH_CHECK_ENV}=0"


def loaded_blas() -> str:
    """Name of the BLAS library mapped into this process (after mlx is imported)."""
    if sys.platform == "darwin":
        return "accelerate"
    libs = []
    try:
        for line in open("/proc/self/maps"):
            path = line.split()[-1]
            low = path.lower()
            # numpy/scipy wheels map their own OpenBLAS; it is not the one MLX calls
            if "blas" in low and ".so" in low and "numpy" not in low and "scipy" not in low:
                libs.append(path)
    except OSError:
        return "unknown"
    if any("openblas" in p for p in libs):
        return "openblas"
    if any("mlx_cpu.libs" in p for p in libs):
        return "netlib"
    return os.path.basename(libs[0]) if libs else "none"


def blas_core() -> Optional[str]:
    """OpenBLAS's kernel set and build (``openblas_get_corename`` / ``openblas_get_config``), e.g.
    'Haswell / OpenBLAS 0.3.21 DYNAMIC_ARCH ...': two machines under one key can pick different kernels,
    whose float sums differ in the last bits. None for other BLAS libraries."""
    import ctypes

    try:
        for line in open("/proc/self/maps"):
            path = line.split()[-1]
            if "openblas" in path.lower() and ".so" in path and "numpy" not in path and "scipy" not in path:
                lib = ctypes.CDLL(path)
                lib.openblas_get_corename.restype = ctypes.c_char_p
                lib.openblas_get_config.restype = ctypes.c_char_p
                return f"{lib.openblas_get_corename().decode()} / {lib.openblas_get_config().decode().strip()}"
    except (OSError, AttributeError):
        return None
    return None


def cpu_model() -> str:
    if sys.platform == "darwin":
        import subprocess

        try:
            return subprocess.check_output(["sysctl", "-n", "machdep.cpu.brand_string"], text=True).strip()
        except Exception:
            return platform.processor() or "apple"
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _slug(s: str) -> str:
    s = re.sub(r"\(r\)|\(tm\)|cpu|processor|@.*$", "", s.lower())
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-")[:40] or "unknown"


def device_info() -> dict:
    import mlx.core as mx

    dev = mx.default_device()
    info = {"device": str(dev), "backend": "cpu"}
    if dev.type == mx.gpu:
        if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            info["backend"] = "cuda"
        elif mx.metal.is_available():
            info["backend"] = "metal"
        try:
            di = mx.device_info()
            info["gpu_name"] = di.get("device_name") or di.get("architecture", "")
        except Exception:
            pass
    return info


def machine_key() -> str:
    """Key under which this machine's goldens live, e.g. ``cpu-x86_64-intel-xeon-netlib``
    (``MLXB_MACHINE_KEY`` overrides it: a lab's own name for a machine, or a key with no goldens)."""
    if os.environ.get("MLXB_MACHINE_KEY"):
        return os.environ["MLXB_MACHINE_KEY"]
    import mlx.core  # noqa: F401  (maps the BLAS into the process so loaded_blas can name it)

    dev = device_info()
    if dev["backend"] == "cuda":
        return "cuda-" + _slug(dev.get("gpu_name", "gpu")).replace("nvidia-", "")
    if dev["backend"] == "metal":
        return "apple-" + _slug(cpu_model()).replace("apple-", "")
    return f"cpu-{platform.machine()}-{_slug(cpu_model())}-{loaded_blas()}"


def matmul_gflops(m: int = 512, k: int = 1536, n: int = 512, reps: int = 10) -> float:
    import mlx.core as mx

    a = mx.random.normal((m, k))
    b = mx.random.normal((k, n))
    mx.eval(a, b)
    for _ in range(2):
        mx.eval(a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * m * k * n / ((time.perf_counter() - t) / reps) / 1e9


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "mlxb", "transformers"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def report(measure: bool = True) -> dict:
    """Everything ``mlxb doctor`` prints, as data."""
    import mlx.core as mx  # noqa: F401  (loads the BLAS so loaded_blas can see it)

    facts = {
        "versions": versions(),
        **device_info(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": round(memory_bytes() / 2**30, 1),
        "blas": loaded_blas(),
        "blas_core": blas_core(),
        "machine_key": machine_key(),
    }
    if facts["blas"] == "openblas":  # when its idle workers sleep (module notes); unset: OpenBLAS's default, 28
        facts["openblas_thread_timeout"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        facts["cuda_graph_check"] = graph_check_env(os.environ)  # what this process runs with (the CLI set it)
    from mlxb.models.synth import mlxb_home

    facts["mlxb_home"] = str(mlxb_home())
    if measure:
        facts["matmul_gflops_512x1536x512_fp32"] = round(matmul_gflops(), 2)
    facts["advice"] = blas_advice(facts["blas"], dict(os.environ), installed_openblas())
    return facts


def blas_advice(blas: str, environ: dict, candidate: Optional[str]) -> list[str]:
    """What ``mlxb doctor`` tells a machine about its BLAS (``candidate``: an installed OpenBLAS, if any)."""
    advice = []
    if blas == "netlib":
        if candidate and environ.get("MLXB_BLAS_PRELOAD") == "0":
            advice.append("OpenBLAS is installed but MLXB_BLAS_PRELOAD=0 keeps the slow netlib BLAS; unset it.")
        elif candidate:
            advice.append(f"netlib BLAS is loaded although OpenBLAS is installed; run through the `mlxb` CLI, or set LD_PRELOAD={candidate}")
        else:
            advice.append(
                "MLX is using the bundled reference (netlib) BLAS, ~8x slower for matmuls here. Install OpenBLAS "
                "(Debian/Ubuntu: apt-get install libopenblas0-pthread); the mlxb CLI then preloads it itself."
            )
    elif blas == "openblas" and "OPENBLAS_THREAD_TIMEOUT" not in environ:
        advice.append(f"OpenBLAS is loaded with its default thread timeout: its idle workers spin and take the core of "
                      f"MLX's second CPU stream (quantized KV reads). Run through the `mlxb` CLI, or set "
                      f"OPENBLAS_THREAD_TIMEOUT={BLAS_THREAD_TIMEOUT} before the process starts.")
    return advice
