"""Content hashes of a model folder's weights (order-independent), for pinning presets in tests."""

from __future__ import annotations

import hashlib
from pathlib import Path


def weights_sha256(folder: str | Path) -> str:
    import mlx.core as mx
    import numpy as np

    h = hashlib.sha256()
    arrays = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        arrays.update(mx.load(str(f)))
    for name in sorted(arrays):
        a = arrays[name]
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(np.array(a.astype(mx.float32)).tobytes())
    return h.hexdigest()
