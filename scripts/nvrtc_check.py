"""Compile mlxb's CUDA kernel sources with NVRTC on a machine without a GPU (a syntax and type check only:
nothing runs). MLX builds the same source at run time; this wraps it the way MLX's ``cuda_kernel`` does
(signature from the input and output names, template constants), with a small stand-in for MLX's device
header (Shape/Strides arrays).

Setup (once, in a scratch venv): ``pip install "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*"``,
and CCCL's headers (``mlx/include/cccl`` inside the mlx-cuda-13 wheel).

    python scripts/nvrtc_check.py --nvrtc .../libnvrtc.so.13 --include .../nvidia/cu13/include --include .../cccl
"""
import argparse
import ctypes
import sys

sys.path.insert(0, ".")
from mlxb.kernels import dense_attention as da  # noqa: E402
from mlxb.kernels import quantized_attention as qa  # noqa: E402

PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu { using Shape = cuda::std::array<int32_t, 8>; using Strides = cuda::std::array<int64_t, 8>; }
"""
CTYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "uint32": "uint32_t", "bool": "bool"}


def wrap(name, inputs, outputs, source, header, consts):
    sig = []
    for n, t in inputs:
        sig.append(f"const {CTYPES[t]}* {n}")
        if n + "_shape" in source:
            sig.append(f"const __grid_constant__ Shape {n}_shape")
        if n + "_strides" in source:
            sig.append(f"const __grid_constant__ Strides {n}_strides")
    sig += [f"{CTYPES[t]}* {n}" for n, t in outputs]
    body = "".join(f"  using {k} = {CTYPES[v]};\n" if isinstance(v, str) else
                   f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                   for k, v in consts.items())
    return (PRELUDE + header + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n__global__ void "
            + name + "(" + ", ".join(sig) + ") {\n" + body + source + "\n}\n}\n")


def compile_one(lib, src, name, includes):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17"] + [b"-I" + i.encode() for i in includes]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    return rc, log.value.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", required=True)
    ap.add_argument("--include", action="append", default=[])
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    bad = 0
    ins = [("q", "bfloat16"), ("kw", "uint32"), ("ks", "bfloat16"), ("kb", "bfloat16"), ("vw", "uint32"),
           ("vs", "bfloat16"), ("vb", "bfloat16"), ("mask", "bool")]
    for T in ("bfloat16", "float32", "float16"):
        for D, R, bits, G, C in ((128, 4, 8, 64, 256), (128, 8, 4, 32, 64), (64, 1, 8, 32, 128), (256, 8, 4, 64, 256)):
            i = [(n, T if t == "bfloat16" else t) for n, t in ins]
            consts = dict(T=T, D=D, R=R, BITS=bits, G=G, C=C, NT=qa.NT, HAS_MASK=True, SCALE_BITS=1040187392)
            src = wrap("part", i, [("o_part", "float32"), ("m_part", "float32"), ("l_part", "float32")],
                       qa._PART, qa._HEADER, consts)
            rc, log = compile_one(lib, src, "part.cu", a.include)
            print(T, D, R, bits, G, C, "part", "ok" if rc == 0 else "FAILED", log.strip()[:2000])
            bad += rc != 0
        src = wrap("join", [("o_part", "float32"), ("m_part", "float32"), ("l_part", "float32")], [("out", T)],
                   qa._JOIN, qa._HEADER, dict(T=T))
        rc, log = compile_one(lib, src, "join.cu", a.include)
        print(T, "join", "ok" if rc == 0 else "FAILED", log.strip()[:2000])
        bad += rc != 0
    # the full-precision kernel (dense_attention): keys/values in the cache's dtype, a float32 prefix's values
    for T in ("bfloat16", "float32", "float16"):
        for D, G, L, C, prefix, flags in ((128, 4, 1, 256, True, True), (128, 8, 1, 64, False, False),
                                          (64, 1, 1, 128, True, False), (96, 3, 1, 128, False, False),
                                          (256, 4, 4, 256, True, True), (32, 2, 8, 64, False, False), (128, 4, 5, 128, True, False)):
            i = [("q", T), ("keys", T), ("values", T), ("mask", "bool"), ("pkeys", T), ("pvalues", "float32"),
                 ("share", "bool"), ("plan", "bool")]
            # the chunk and the flags are read at run time from the plan input's shape (prefix, flags: not compiled)
            consts = dict(D=D, G=G, L=L, CMAX=da.chunk_max(G * L, D), NT=da.NT, SCALE_BITS=1040187392, TQ=T, TK=T,
                          TV=T, TPK=T, TPV="float32")
            src = wrap("dpart", i, [("o_part", "float32"), ("m_part", "float32"), ("l_part", "float32")],
                       da._PART, da._HEADER, consts)
            rc, log = compile_one(lib, src, "dpart.cu", a.include)
            print(T, D, G, L, C, prefix, flags, "dense part", "ok" if rc == 0 else "FAILED", log.strip()[:2000])
            bad += rc != 0
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
