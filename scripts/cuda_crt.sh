#!/usr/bin/env bash
# MLX CUDA's JIT-compiled quantized matmuls (qmm_sm90_*) include <crt/mma.h>; the H200 image's pip CUDA
# headers lack it ("cannot open source file crt/mma.h"). Add the missing crt headers from the matching
# nvidia-cuda-crt wheel (carried in .whl/b/crt, see h200.sh), never overwriting a header that is there.
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
inc=$sp/nvidia/cu13/include
[ -f "$inc/crt/mma.h" ] && { echo "crt/mma.h present"; exit 0; }
v=$(python3 -c "import importlib.metadata as m
for n in ('nvidia-cuda-nvrtc', 'nvidia-cuda-nvrtc-cu13', 'nvidia-cuda-runtime'):
    try: print(m.version(n)); break
    except Exception: pass" 2>/dev/null)
w=$(ls .whl/b/crt/nvidia_cuda_crt-${v%.*}.*.whl 2>/dev/null | head -1)
[ -z "$w" ] && w=$(ls .whl/b/crt/*.whl 2>/dev/null | head -1)
[ -z "$w" ] && { echo "no crt wheel carried"; exit 0; }
python3 - "$w" "$sp" <<'PY'
import os, sys, zipfile
z, root = zipfile.ZipFile(sys.argv[1]), sys.argv[2]
added = [n for n in z.namelist() if "/include/crt/" in n and not n.endswith("/") and not os.path.exists(os.path.join(root, n))]
for n in added:
    z.extract(n, root)
print(f"added {len(added)} crt headers from {os.path.basename(sys.argv[1])}")
PY
echo "nvrtc $v"
