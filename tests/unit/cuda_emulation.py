"""Run a ``mx.fast.cuda_kernel`` source on the CPU: the kernel body is compiled as C++ (g++, C++20) with a
small stand-in for the CUDA built-ins it uses. A launch makes ``NT`` OS threads, which run the blocks one at a
time, each thread its lane of every block (``__syncthreads`` is a block barrier, ``__shfl_xor_sync`` a warp
barrier over an exchange buffer, ``__shared__`` arrays are static). It checks the kernel's indexing and
arithmetic, not its speed or the GPU's memory model. Element type ``T`` is float. As MLX's ``cuda_kernel``, inputs
are made row-contiguous unless ``ensure_row_contiguous=False``, which hands every input over as it lies (a numpy
view keeps its strides); ``<name>_strides`` in the source passes an input's strides, in elements."""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>
namespace cuda { namespace std { using ::std::numeric_limits; } }
struct dim3_ { int x = 0, y = 0, z = 0; };
thread_local dim3_ threadIdx, blockIdx;
static dim3_ gridDim;
struct uint4 { uint32_t x, y, z, w; };
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[32];
static float g_x[32][32];
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_x[w][l] = v; g_warp[w]->arrive_and_wait();
  float r = g_x[w][l ^ o]; g_warp[w]->arrive_and_wait();
  return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
#define __shared__ static
#define __global__
#define __device__
#define __forceinline__ inline
#define __grid_constant__
"""

LAUNCH = r"""
extern "C" void launch(void** args, int gx, int gy, int gz, int tx) {
  std::barrier<> block(tx);
  std::vector<std::barrier<>*> warps;
  for (int w = 0; w < (tx + 31) / 32; ++w) { g_warp[w] = new std::barrier<>(tx - w * 32 < 32 ? tx - w * 32 : 32); }
  g_block = &block;
  gridDim = {gx, gy, gz};
  // tx threads for the whole grid, each running its lane of every block in turn; a barrier after each
  // block, so blocks still run one at a time (their __shared__ arrays are statics)
  std::vector<std::thread> ts;
  for (int t = 0; t < tx; ++t) ts.emplace_back([=, &block]() {
    for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
      blockIdx = {x, y, z}; threadIdx = {t, 0, 0}; CALL; block.arrive_and_wait();
    }
  });
  for (auto& th : ts) th.join();
  for (int w = 0; w < (tx + 31) / 32; ++w) delete g_warp[w];
}
"""

CTYPES = {np.float32: "float", np.uint32: "uint32_t", np.int32: "int32_t", np.bool_: "bool"}


class EmulatedKernel:
    """``inputs``/``outputs``: (name, numpy dtype); ``consts``: template constants (int, bool, or 'float' for T)."""

    def __init__(self, name: str, inputs, outputs, source: str, header: str, consts: dict,
                 ensure_row_contiguous: bool = True):
        if shutil.which("g++") is None:
            raise RuntimeError("g++ is needed to emulate CUDA kernels on the CPU")
        params, call, self.slots = [], [], []
        for n, dt in inputs:
            params.append(f"const {CTYPES[dt]}* {n}")
            call.append(f"(const {CTYPES[dt]}*)args[{len(self.slots)}]")
            self.slots.append(("in", n))
            if n + "_shape" in source:
                params.append(f"Shape {n}_shape")
                call.append(f"*(Shape*)args[{len(self.slots)}]")
                self.slots.append(("shape", n))
            if n + "_strides" in source:  # read through its strides: handed over as it is (a view stays a view)
                params.append(f"Strides {n}_strides")
                call.append(f"*(Strides*)args[{len(self.slots)}]")
                self.slots.append(("strides", n))
        for n, dt in outputs:
            params.append(f"{CTYPES[dt]}* {n}")
            call.append(f"({CTYPES[dt]}*)args[{len(self.slots)}]")
            self.slots.append(("out", n))
        consts_src = "".join(f"  using {k} = float;\n" if v == "float" else
                             f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                             for k, v in consts.items())
        src = (PRELUDE + header + f"void {name}(" + ", ".join(params) + ") {\n" + consts_src + source + "\n}\n"
               + LAUNCH.replace("CALL", f"{name}(" + ", ".join(call) + ")"))
        key = hashlib.sha256(src.encode()).hexdigest()[:16]
        d = Path(tempfile.gettempdir()) / "mlxb-cuda-emulation"
        d.mkdir(exist_ok=True)
        so = d / f"{name}-{key}.so"
        if not so.exists():
            cpp = d / f"{name}-{key}.cpp"
            cpp.write_text(src)
            r = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "-o", str(so), str(cpp)],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"g++ failed on the emulated kernel {name}:\n{r.stderr[:4000]}")
        self.lib = ctypes.CDLL(str(so))
        self.outputs = outputs
        self.as_is = not ensure_row_contiguous  # MLX's cuda_kernel then hands every input over as it lies

    def __call__(self, inputs: dict, output_shapes: dict, grid, threadgroup) -> dict:
        keep, ptrs = [], []
        outs = {n: np.zeros(output_shapes[n], dtype=dt) for n, dt in self.outputs}
        strided = {n for kind, n in self.slots if kind == "strides"}
        for kind, n in self.slots:
            if kind == "in":
                a = inputs[n] if (n in strided or self.as_is) else np.ascontiguousarray(inputs[n])
            elif kind == "shape":
                s = list(inputs[n].shape) + [0] * (8 - inputs[n].ndim)
                a = np.array(s, dtype=np.int32)
            elif kind == "strides":
                s = [st // inputs[n].itemsize for st in inputs[n].strides] + [0] * (8 - inputs[n].ndim)
                a = np.array(s, dtype=np.int64)
            else:
                a = outs[n]
            keep.append(a)
            ptrs.append(a.ctypes.data_as(ctypes.c_void_p))
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        gx, gy, gz = grid
        tx = threadgroup[0]
        self.lib.launch(arr, ctypes.c_int(gx // tx), ctypes.c_int(gy), ctypes.c_int(gz), ctypes.c_int(tx))
        return outs
