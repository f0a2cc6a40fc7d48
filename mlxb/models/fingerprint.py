"""Content hashes of a model folder.

``weights_sha256`` hashes every tensor's values (order-independent; pins presets in tests).
``folder_fingerprint`` names a folder by what it holds, config plus the bytes of its weight files, so
goldens follow a model wherever its folder lives: moved, renamed or downloaded again. Hashing a large
model reads every byte once; the result is remembered per file (path, size, mtime) under MLXB_HOME.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Optional

_ST_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


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


def _file_sha256(path: Path, memo: dict) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key not in memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
        memo[key] = h.hexdigest()
    return memo[key]


def _memo_path() -> Path:
    from mlxb.models.synth import mlxb_home

    return mlxb_home() / "fingerprints.json"


def folder_fingerprint(folder: str | Path) -> str:
    """sha256 over the canonical config.json and each weight file's sha256 (by file name)."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors weights")
    memo_file = _memo_path()
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    n = len(memo)
    h = hashlib.sha256(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    for f in files:
        h.update(f"{f.name}:{_file_sha256(f, memo)}".encode())
    if len(memo) != n:
        try:
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            tmp.replace(memo_file)
        except OSError:
            pass  # a read-only home only costs a re-hash next time
    return h.hexdigest()


def safetensors_float_dtype(folder: str | Path) -> Optional[str]:
    """The floating dtype most of a folder's tensors are stored in (read from the file headers only)."""
    counts: dict[str, int] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype") in _ST_FLOATS:
                counts[_ST_FLOATS[info["dtype"]]] = counts.get(_ST_FLOATS[info["dtype"]], 0) + 1
    return max(counts, key=counts.get) if counts else None
