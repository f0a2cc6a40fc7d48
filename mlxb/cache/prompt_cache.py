"""The prompt cache for one served model: a RAM trie of KV snapshots over an optional SSD tier.

Lives on the engine thread (the single owner of cache mutations; the SSD writer only reads entries
that are already evaluated). The scheduler never sees it: it asks the engine for a token count.

* ``lookup(tokens, limit)`` the longest usable prefix in RAM, else on SSD (restored into RAM);
  the returned entry is held by the caller, so a later eviction cannot take it away.
* ``lend(match)`` per-layer single-row caches for a row starting from that prefix (no copy).
* ``put(tokens, layers)`` snapshot a row's caches under ``tokens`` (compact copies).
* ``evict(n)`` free RAM bytes for live rows (one memory ceiling); evicted entries spill to SSD.
* ``close()`` persist every RAM entry to SSD and wait for the writer (graceful shutdown).

The namespace is ``fingerprint|dtype|kv=<scheme>|adapter=<name>``: a different model, precision,
KV scheme or adapter never shares an entry.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, load_prompt_cache

from mlxb.cache import snapshot as snap
from mlxb.cache.allocator import clear_pool, trim_allocator_cache
from mlxb.cache.prefix import PrefixCache, PrefixEntry, PrefixMatch
from mlxb.cache.ssd import DiskTier

log = logging.getLogger("mlxb.prompt_cache")
_CLASSES = {"full": KVCache, "latent": KVCache, "rotating": RotatingKVCache, "ssm": ArraysCache}


def model_fingerprint(model) -> str:
    """Content hash of a model: its config, every parameter's name/shape/dtype and a sample of values."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    args = getattr(model, "args", None)
    h.update(repr(sorted(vars(args).items()) if args is not None else type(model).__name__).encode())
    params = tree_flatten(model.parameters())
    for i, (name, a) in enumerate(params):
        h.update(f"{name}:{a.shape}:{a.dtype}".encode())
        if i % max(1, len(params) // 16) == 0:
            h.update(bytes(memoryview(a.reshape(-1)[:64].astype(mx.float32))))
    return h.hexdigest()[:24]


def model_dtype(model) -> str:
    from mlx.utils import tree_flatten

    for _, a in tree_flatten(model.parameters()):
        if mx.issubdtype(a.dtype, mx.floating):
            return str(a.dtype).replace("mlx.core.", "")
    return "unknown"


_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int8": "I8", "int16": "I16",
              "int32": "I32", "int64": "I64", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
              "bool": "BOOL"}


def prepare_payload(layers: list) -> tuple[dict, dict]:
    """On the engine thread: an entry as mlx-lm's ``save_prompt_cache`` lays it out (flattened states,
    scalars as arrays, class names in the metadata), each tensor as a zero-copy buffer."""
    from mlx.utils import tree_flatten

    scalars = [""]
    tensors = {}
    for key, v in tree_flatten([c.state for c in layers]):
        if isinstance(v, mx.array):
            arr = v
        elif isinstance(v, (bool, int, float)):
            scalars.append((key, "scalar"))
            arr = mx.array(v)
        elif v is None:
            scalars.append((key, "none"))
            arr = mx.array([])
        elif isinstance(v, str):  # CacheList members' class names (quantized rings)
            scalars.append((key, "string"))
            arr = mx.array([ord(ch) for ch in v])
        else:
            raise ValueError(f"cache state is not serializable: {type(v).__name__}")
        tensors[key] = mx.contiguous(arr)
    mx.eval(list(tensors.values()))  # one wait for the whole entry, not one per tensor
    meta = dict(tree_flatten([{}, [type(c).__name__ for c in layers], scalars]))
    return tensors, {k: str(v) for k, v in meta.items()}


def write_payload(path: str, payload: tuple[dict, dict]) -> None:
    """On the writer thread: a safetensors file written with plain file writes (which release the GIL,
    so the engine thread keeps stepping while a large entry goes to disk); ``mx.load`` reads it."""
    import json
    import struct

    tensors, meta = payload
    header, views, offset = {"__metadata__": meta}, [], 0
    for key, arr in tensors.items():
        view = memoryview(arr).cast("B")
        header[key] = {"dtype": _ST_DTYPES[str(arr.dtype).replace("mlx.core.", "")], "shape": list(arr.shape),
                       "data_offsets": [offset, offset + view.nbytes]}
        views.append(view)
        offset += view.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for view in views:
            f.write(view)


class PromptCache:
    def __init__(self, model, kinds: list[str], *, max_bytes: int, max_entries: Optional[int] = None,
                 disk_dir: Optional[str | Path] = None, disk_bytes: int = 0, kv_scheme: str = "none",
                 adapter: str = "none", memory_limit: Optional[int] = None):
        """``memory_limit``: device bytes in use (MLX active memory) above which RAM entries are
        evicted (spilled) after every insert, whatever ``max_bytes`` allows."""
        self.kinds = list(kinds)
        self.trimmable = all(k in ("full", "latent") for k in self.kinds)
        self.fingerprint = model_fingerprint(model)
        base = f"{self.fingerprint}|{model_dtype(model)}|kv={kv_scheme}|adapter="
        self.namespace = base + adapter
        # --adapters: each LoRA adapter's rows reuse only their own adapter's KV (slot i -> namespace i)
        lora = getattr(model, "mlxb_lora", None)
        self.adapter_namespaces = [f"{base}{n}@{d}" for n, d in zip(lora.names, lora.digests)] if lora else []
        self.ram = PrefixCache(max_bytes, max_entries, on_evict=self._spill)
        self.memory_limit = memory_limit
        self.num_pressure_evictions = 0
        self.num_pool_trims = 0  # MLX free-buffer pool returned under pressure (``relieve_pressure``)
        for ns in [self.namespace, *self.adapter_namespaces]:
            self.ram.add_namespace(ns, self.trimmable)
        self.disk: Optional[DiskTier] = None
        if disk_dir is not None and disk_bytes > 0:
            self.disk = DiskTier(disk_dir, disk_bytes,
                                 trimmable={ns: self.trimmable for ns in [self.namespace, *self.adapter_namespaces]},
                                 save=write_payload, prepare=prepare_payload)
        self._shapes = self._probe_shapes(model)
        self.counters = {"lookups": 0, "hits": 0, "misses": 0, "cached_tokens": 0, "inserts": 0,
                         "ram_hits": 0, "ssd_hits": 0, "mark_snapshots": 0}

    def _probe_shapes(self, model) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        from mlxb.cache.protocol import base_forward

        caches = make_prompt_cache(model)
        base_forward(model)
        model(mx.array([[0]]), cache=caches)
        mx.eval([c.state for c in caches])
        return [self._layer_shape(c, k) for c, k in zip(caches, self.kinds)]

    @staticmethod
    def _layer_shape(c, kind: str):
        if kind == "ssm":
            return [None if a is None else tuple(a.shape[1:]) for a in c.cache]
        return (c.keys.shape[1], c.keys.shape[3], c.values.shape[3], str(c.keys.dtype))

    # ---- lookups -----------------------------------------------------------------------------
    def ns(self, adapter: int = -1) -> str:
        """The namespace of rows with LoRA adapter slot ``adapter`` (-1: the base model)."""
        return self.namespace if adapter < 0 else self.adapter_namespaces[adapter]

    def lookup(self, tokens, limit: int, adapter: int = -1) -> Optional[PrefixMatch]:
        """Longest usable cached prefix of ``tokens[:limit]`` (RAM first, then SSD)."""
        self.counters["lookups"] += 1
        ns = self.ns(adapter)
        best = self.ram.match(ns, tokens, limit)
        far = self.disk.match(ns, tokens, limit) if self.disk is not None else None
        restored = None
        if far is not None and (best is None or far.num_tokens > best.num_tokens):
            restored = self._restore(far)  # counts ssd_hits; None if the file was bad
        if restored is not None:
            best = restored
        elif best is not None:
            self.counters["ram_hits"] += 1
        if best is None:
            self.counters["misses"] += 1
        else:
            self.counters["hits"] += 1
            self.counters["cached_tokens"] += best.num_tokens
        return best

    def prefetch(self, tokens, limit: int, adapter: int = -1) -> bool:
        """Have the SSD tier verify the file a later ``lookup`` of these tokens may restore, on its reader thread
        (any thread may call this; it never blocks). Whether a file was queued."""
        return self.disk is not None and self.disk.prefetch(self.ns(adapter), tokens, limit)

    def shared_prefix(self, tokens, limit: int, adapter: int = -1) -> int:
        """How many leading tokens of ``tokens[:limit]`` a cached prompt shares (RAM or SSD), snapshot or not."""
        ns = self.ns(adapter)
        far = self.disk.shared_depth(ns, tokens, limit) if self.disk is not None else 0
        return max(self.ram.shared_depth(ns, tokens, limit), far)

    def _restore(self, far: PrefixMatch) -> Optional[PrefixMatch]:
        """Load an SSD entry into RAM; a bad file is skipped (warned and dropped), never served."""
        t0 = time.perf_counter()
        entry = far.entry
        if not isinstance(entry.layers, (str, Path)):  # still queued for writing: its RAM layers
            ram = self.ram.insert(entry.namespace, entry.tokens, entry.layers,
                                  sum(snap.layer_nbytes(c) for c in entry.layers))
            self.counters["ssd_hits"] += 1
            return PrefixMatch(ram or entry, far.num_tokens)
        try:
            h = self.disk.read_header(entry)
            if h.get("fingerprint") != self.fingerprint or h.get("kinds") != self.kinds:
                raise ValueError("written for another model (fingerprint or layer kinds differ)")
            layers = load_prompt_cache(entry.layers)
            self._check_layers(layers, entry.num_tokens)
            mx.eval([snap.arrays(c) for c in layers])
        except Exception as e:
            self.disk.forget(entry, str(e))
            return None
        finally:
            self.disk.counters["load_s"] += time.perf_counter() - t0
        self.disk.counters["restores"] += 1
        self.counters["ssd_hits"] += 1
        ram = self.ram.insert(entry.namespace, entry.tokens, layers, sum(snap.layer_nbytes(c) for c in layers))
        return PrefixMatch(ram or PrefixEntry(entry.namespace, entry.tokens, layers, 0), far.num_tokens)

    def _check_layers(self, layers: list, num_tokens: int) -> None:
        if len(layers) != len(self.kinds):
            raise ValueError(f"{len(layers)} layers, this model has {len(self.kinds)} (another model's file?)")
        for i, (c, k) in enumerate(zip(layers, self.kinds)):
            shape = self._shapes[i] if i < len(self._shapes) else None  # none probed under --tp (no forward)
            if k in ("full", "rotating") and (isinstance(c, QuantizedKVCache) or snap.is_stored_ring(c)):
                # --kv-bits: heads and dtype (the namespace names the scheme)
                head = c.caches[0] if snap.is_stored_ring(c) else c
                parts = [r.keys for r in c.caches[:3]] if snap.is_stored_ring(c) else head.keys
                if shape is not None and (parts[0].shape[1], str(parts[1].dtype)) != (shape[0], shape[3]):
                    raise ValueError(f"layer {i} is a quantized cache of another shape (another model's file?)")
                c = head
            elif not isinstance(c, _CLASSES[k]):
                raise ValueError(f"layer {i} is {type(c).__name__}, expected a {k} cache (another model's file?)")
            elif shape is not None and self._layer_shape(c, k) != shape:
                raise ValueError(f"layer {i} has shapes {self._layer_shape(c, k)}, this model needs {shape}")
            if k != "ssm" and c.offset != num_tokens:
                raise ValueError(f"layer {i} holds {c.offset} tokens, the header says {num_tokens}")

    def lend(self, match: PrefixMatch) -> list:
        return [snap.lend(c, k, match.num_tokens if k in ("full", "latent") else None)
                for c, k in zip(match.entry.layers, self.kinds)]

    # ---- writes ------------------------------------------------------------------------------
    def put(self, tokens, layers: list, *, copy: bool = True, adapter: int = -1) -> Optional[PrefixEntry]:
        """Snapshot single-row ``layers`` (holding exactly ``tokens``) into the RAM tier."""
        return self._store([(tokens, layers, adapter)], copy)[0]

    def put_many(self, items: list, *, copy: bool = True) -> list:
        """``put`` for several ``(tokens, layers, adapter)`` at once: every snapshot is evaluated in one
        ``mx.eval``. Rows retiring on one step did one evaluation each: on an H100 the step that retired 15
        agents spent 124 ms storing them, ~8 ms a row (``reports/h100/session68``)."""
        return self._store(items, copy)

    def _store(self, items: list, copy: bool) -> list:
        out: list = [None] * len(items)
        todo = []
        for i, (tokens, layers, adapter) in enumerate(items):
            if not tokens:
                continue
            ns = self.ns(adapter)
            found = self.ram.match(ns, tokens, touch=False)
            if found is not None and found.num_tokens == len(tokens) and (
                    self.trimmable or found.entry.num_tokens == len(tokens)):
                self.ram.match(ns, tokens)  # already covered: refresh its LRU slot
                out[i] = found.entry
                continue
            if copy:
                layers = [snap.snapshot(c, k) for c, k in zip(layers, self.kinds)]
            todo.append((i, ns, tokens, layers))
        mx.eval([snap.arrays(c) for *_, layers in todo for c in layers])
        for i, ns, tokens, layers in todo:
            self.counters["inserts"] += 1
            nbytes = sum(snap.layer_nbytes(c) for c in layers)
            entry = self.ram.insert(ns, tokens, layers, nbytes)
            # over the RAM cap alone (already handed to the SSD tier): still usable by this iteration's rows
            out[i] = entry if entry is not None else PrefixEntry(ns, tuple(tokens), layers, nbytes)
        return out

    def _spill(self, entry: PrefixEntry, block: bool = False) -> None:
        if self.disk is not None:
            self.disk.spill(entry, self.kinds, self.fingerprint, block=block)

    def evict(self, num_bytes: int) -> int:
        return self.ram.evict(num_bytes)

    def relieve_pressure(self) -> int:
        """Keep device memory under ``memory_limit``: while the arrays in use exceed it, return MLX's
        cached free buffers and evict entries. Returns the entry bytes freed.

        Where only the arrays in use plus MLX's free-buffer pool pass the limit, the pool is trimmed only
        once it outgrows the allocator's slack (``trim_allocator_cache``): MLX reuses those buffers itself
        and returns them when an allocation needs the room. Clearing the pool on every insert past the limit
        (each retiring row stores one) cost an H100 32-agent loop its warm repeat: retirements grew to
        300-400 ms and the steps after each paid again to allocate (``reports/h100/session60``)."""
        if self.memory_limit is None:
            return 0
        active = mx.get_active_memory()
        if active + mx.get_cache_memory() <= self.memory_limit:
            return 0
        if active <= self.memory_limit:
            self.num_pool_trims += trim_allocator_cache()
            return 0
        clear_pool()
        over = mx.get_active_memory() - self.memory_limit
        if over <= 0 or self.ram.total_bytes == 0:
            return 0
        self.num_pressure_evictions += 1
        return self.ram.evict(over)

    @property
    def nbytes(self) -> int:
        return self.ram.total_bytes

    def reset(self) -> None:
        """Forget every RAM entry without spilling it and zero the counters (after the warm-up)."""
        for e in self.ram.entries():
            self.ram.remove(e)
        self.ram.num_evictions = 0
        self.num_pressure_evictions = 0
        self.num_pool_trims = 0
        for k in self.counters:
            self.counters[k] = 0

    def spill_all(self) -> None:
        """Move every RAM entry to the SSD tier (written in the background) and empty RAM."""
        self.ram.clear()

    def close(self, timeout: float = 60.0) -> None:
        """Graceful shutdown: write RAM entries not yet on disk, then wait for the writer."""
        if self.disk is None:
            return
        for e in self.ram.entries():
            self._spill(e, block=True)
        self.disk.close(timeout)

    def stats(self) -> dict:
        out = {"enabled": True, "namespace": self.namespace, **self.counters,
               "ram_bytes": self.ram.total_bytes, "ram_entries": self.ram.num_entries,
               "ram_max_bytes": self.ram.max_bytes, "evictions": self.ram.num_evictions,
               "memory_pressure_evictions": self.num_pressure_evictions,
               "memory_pressure_pool_trims": self.num_pool_trims,
               "reuse": {k: snap.REUSE[k] for k in sorted(set(self.kinds))}}
        if self.disk is not None:
            out.update({"ssd_dir": str(self.disk.root), "ssd_bytes": self.disk.total_bytes,
                        "ssd_entries": self.disk.num_entries, "ssd_max_bytes": self.disk.index.max_bytes,
                        **{f"ssd_{k}": v for k, v in self.disk.counters.items()}})
        return out
