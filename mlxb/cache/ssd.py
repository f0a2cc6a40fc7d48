"""SSD tier of the prompt cache: entries evicted from RAM, written in the background, kept across
restarts.

Layout under the cache directory (one folder per namespace, named by its hash)::

    <dir>/<sha256(namespace)[:16]>/<sha256(tokens)[:32]>.safetensors   mlx-lm's save_prompt_cache format
    <dir>/<sha256(namespace)[:16]>/<sha256(tokens)[:32]>.json          header: namespace, fingerprint,
                                                                       tokens, kinds, bytes, sha256

The header is written last (both files via a temporary name and ``os.replace``), so a header on
disk means a complete payload was there. Loading checks the header (version, namespace, token hash,
layer kinds), the payload's size and sha256, and the layer classes: a corrupt, truncated or
foreign file is skipped with a warning, removed from the index and never served.

Writes run on one background thread fed by a bounded queue; a spill that finds the queue full is
dropped (counted), so the engine thread never waits on the disk. ``flush()`` drains the queue
(graceful shutdown). The disk index is a ``PrefixCache`` whose entries are file paths, capped by
``max_bytes`` (LRU; evicted files are deleted).

Checksums off the engine thread: a payload's sha256 is computed once per process and file version
(size, mtime, inode) and remembered: when this process writes the file, or when ``prefetch`` (called as
a request arrives, before the engine admits it) verifies it on a reader thread. A restore on the engine
thread then hashes only a file it has not seen in that version. Hashing every restore there held every
running row: in an H100 served run with SSD restores, 17% of the engine thread's samples were restores
and 11% the hash alone (py-spy, ``reports/h100/session68``). A file changed on disk after it was verified
changes its stat and is hashed again; one changed with its size, mtime and inode all kept is not detected
until the next process.

Free space: the tier never fills the disk it lives on. Before each write it checks the filesystem's free
bytes (``shutil.disk_usage``); when the payload would leave less than ``reserve_bytes`` free (default: 2% of
the filesystem, between 2 and 10 GiB), it first evicts its own oldest files, and if that is not enough
it skips the write (counted as ``skipped_full``). The byte cap alone did not do it: two servers on one
64 GB disk, each with a 32 GB cap beside a 16 GB model, filled it and took the machine's other work down
with them (H100, stops 68 and 69).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from mlxb.cache.prefix import PrefixCache, PrefixEntry, PrefixMatch

log = logging.getLogger("mlxb.prompt_cache")
VERSION = 1


def tokens_hash(tokens) -> str:
    return hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_atomically(path: Path, save: Callable[[str, object], None], prepared) -> None:
    """``save(tmp, prepared)`` to a temporary name beside ``path``, synced, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    try:
        save(str(tmp), prepared)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write (disk full, say) leaves no partial file behind
        raise


def default_reserve(total_bytes: int) -> int:
    """Free bytes the SSD tier leaves on its filesystem: 2% of it, at least 2 GiB and at most 10 GiB (a share
    alone would keep a 2 TB laptop disk with 60 GB free from ever writing)."""
    return min(max(2 << 30, total_bytes // 50), 10 << 30)


class DiskTier:
    def __init__(self, root: str | Path, max_bytes: int, *, trimmable: dict[str, bool],
                 save: Callable[[str, object], None], prepare: Callable[[list], object] = lambda layers: layers,
                 max_queue: int = 64, reserve_bytes: Optional[int] = None,
                 disk_usage: Callable[[Path], tuple] = shutil.disk_usage):
        """``trimmable``: namespace -> reuse rule (only these namespaces are indexed);
        ``prepare(layers)`` runs on the caller's (engine) thread when an entry is spilled and
        ``save(path, prepared)`` writes it on the writer thread. ``reserve_bytes``: free bytes every write
        leaves on the filesystem (default ``default_reserve``); ``disk_usage(path)`` -> (total, used, free)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._disk_usage = disk_usage
        self.reserve_bytes = default_reserve(disk_usage(self.root)[0]) if reserve_bytes is None else reserve_bytes
        self._full_warned = False
        self.index = PrefixCache(max_bytes, on_evict=self._delete)
        # queued, not yet written: still served (from their RAM layers) so a spill never loses a hit
        self._pending = PrefixCache(1 << 62)
        for ns, trim in trimmable.items():
            self.index.add_namespace(ns, trim)
            self._pending.add_namespace(ns, trim)
        self._save, self._prepare = save, prepare
        self._verified: dict[str, tuple] = {}  # payload path -> (stat key, header sha256) hashed in this process
        self._reads: queue.Queue = queue.Queue(maxsize=max_queue)  # paths to verify ahead of a restore
        self._reading: dict[str, threading.Event] = {}  # path -> set when the reader is done with it
        self._reader: Optional[threading.Thread] = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()  # guards the index between the writer and the engine thread
        self.counters = {"spills": 0, "spill_dropped": 0, "writes": 0, "write_errors": 0, "restores": 0,
                         "corrupt_skipped": 0, "load_s": 0.0, "hashed": 0, "prefetched": 0,
                         "skipped_full": 0, "evicted_for_space": 0, "prepare_s": 0.0, "write_s": 0.0}
        self.scan()
        self._writer = threading.Thread(target=self._write_loop, name="mlxb-ssd-writer", daemon=True)
        self._writer.start()

    # ---- index -----------------------------------------------------------------------------
    def _dir(self, namespace: str) -> Path:
        return self.root / hashlib.sha256(namespace.encode()).hexdigest()[:16]

    def _paths(self, namespace: str, tokens) -> tuple[Path, Path]:
        stem = self._dir(namespace) / tokens_hash(tokens)[:32]
        return stem.with_suffix(".safetensors"), stem.with_suffix(".json")

    def scan(self) -> int:
        """Index every header under the root whose namespace is known; returns how many."""
        found = 0
        for header in sorted(self.root.glob("*/*.json"), key=lambda p: p.stat().st_mtime):
            try:
                h = json.loads(header.read_text())
                ns, tokens = h["namespace"], h["tokens"]
                if h.get("version") != VERSION or ns not in self.index._trimmable:
                    continue
                if tokens_hash(tokens) != h["tokens_sha256"]:
                    raise ValueError("token hash mismatch")
                payload = header.with_suffix(".safetensors")
                with self._lock:
                    self.index.insert(ns, tokens, str(payload), int(h["nbytes"]))
                found += 1
            except Exception as e:  # unreadable header: skip it, never fail start-up
                self.counters["corrupt_skipped"] += 1
                log.warning("prompt cache: skipping unreadable SSD header %s (%s)", header, e)
        return found

    def match(self, namespace: str, tokens, limit: int) -> Optional[PrefixMatch]:
        """Longest usable prefix on disk or in the write queue (a queued entry's ``layers`` are
        still the RAM caches, a written one's a file path)."""
        with self._lock:
            on_disk = self.index.match(namespace, tokens, limit)
            queued = self._pending.match(namespace, tokens, limit)
        if queued is not None and (on_disk is None or queued.num_tokens > on_disk.num_tokens):
            return queued
        return on_disk

    def shared_depth(self, namespace: str, tokens, limit: int) -> int:
        with self._lock:
            return max(self.index.shared_depth(namespace, tokens, limit), self._pending.shared_depth(namespace, tokens, limit))

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    @property
    def num_entries(self) -> int:
        return self.index.num_entries

    def _delete(self, entry: PrefixEntry) -> None:
        for p in (Path(entry.layers).with_suffix(".json"), Path(entry.layers)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def forget(self, entry: PrefixEntry, reason: str) -> None:
        """Drop a bad file from the index and the disk (it was corrupt or foreign)."""
        self.counters["corrupt_skipped"] += 1
        log.warning("prompt cache: skipping SSD entry %s: %s", entry.layers, reason)
        with self._lock:
            self.index.remove(entry)
        self._delete(entry)

    # ---- writes ----------------------------------------------------------------------------
    def spill(self, entry: PrefixEntry, kinds: list, fingerprint: str, block: bool = False) -> bool:
        """Queue ``entry`` (RAM layers, already evaluated) for writing; never blocks unless ``block``
        (shutdown)."""
        with self._lock:
            found = self.index.match(entry.namespace, entry.tokens, touch=False)
            if found is not None and found.entry.num_tokens == entry.num_tokens:
                return True  # already on disk
        with self._lock:
            queued = self._pending.insert(entry.namespace, entry.tokens, entry.layers, 0)
        t0 = time.perf_counter()
        prepared = self._prepare(entry.layers)  # on the engine thread (a device-to-host read on a GPU)
        self.counters["prepare_s"] += time.perf_counter() - t0
        try:
            self._queue.put((entry, prepared, list(kinds), fingerprint), block=block,
                            timeout=60 if block else None)
        except queue.Full:
            self.counters["spill_dropped"] += 1
            with self._lock:
                if queued is not None and queued.layers is entry.layers:
                    self._pending.remove(queued)
            return False
        self.counters["spills"] += 1
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                t0 = time.perf_counter()
                self._write(*item)
                self.counters["write_s"] += time.perf_counter() - t0
            except Exception as e:
                self.counters["write_errors"] += 1
                log.warning("prompt cache: SSD write failed: %s", e)
            finally:
                if item is not None:
                    self._unqueue(item[0])
                self._queue.task_done()

    def _room_for(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` leaves ``reserve_bytes`` free, after evicting this tier's own
        oldest files if it would not."""
        short = nbytes + self.reserve_bytes - self._disk_usage(self.root)[2]
        if short > 0:
            with self._lock:
                before = self.index.num_evictions
                self.index.evict(short)
                self.counters["evicted_for_space"] += self.index.num_evictions - before
            short = nbytes + self.reserve_bytes - self._disk_usage(self.root)[2]
        if short <= 0:
            self._full_warned = False
            return True
        self.counters["skipped_full"] += 1
        if not self._full_warned:  # once per episode: the disk stays full for many writes
            self._full_warned = True
            log.warning("prompt cache: SSD tier skips writes: %s would leave less than %.1f GiB free on %s "
                        "(--prompt-cache-disk-bytes caps the tier; 0 turns it off)",
                        _gib(nbytes), self.reserve_bytes / 2**30, self.root)
        return False

    def _write(self, entry: PrefixEntry, prepared, kinds: list, fingerprint: str) -> None:
        if not self._room_for(entry.nbytes):
            return
        payload, header = self._paths(entry.namespace, entry.tokens)
        write_atomically(payload, self._save, prepared)
        size = payload.stat().st_size
        digest = file_sha256(payload)  # of the bytes on disk, read back after the sync
        h = {"version": VERSION, "namespace": entry.namespace, "fingerprint": fingerprint,
             "tokens": list(entry.tokens), "tokens_sha256": tokens_hash(entry.tokens), "num_tokens": entry.num_tokens,
             "kinds": kinds, "nbytes": size, "sha256": digest, "created": time.time()}
        self._verified[str(payload)] = (_stat_key(payload), digest)
        htmp = header.with_name(header.stem + ".tmp.json")
        htmp.write_text(json.dumps(h))
        os.replace(htmp, header)
        with self._lock:
            self.index.insert(entry.namespace, entry.tokens, str(payload), size)
        self.counters["writes"] += 1

    def _unqueue(self, entry: PrefixEntry) -> None:
        with self._lock:
            found = self._pending.match(entry.namespace, entry.tokens, touch=False)
            if found is not None and found.entry.tokens == entry.tokens:
                self._pending.remove(found.entry)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk; False on timeout."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._writer.join(timeout)
        if self._reader is not None:
            self._reads.put(None)
            self._reader.join(timeout)

    # ---- reads -----------------------------------------------------------------------------
    def read_header(self, entry: PrefixEntry) -> dict:
        """The entry's header, after checking it and its payload (size, and sha256 unless this process already
        hashed this version of the file); raises ValueError (or OSError) for a bad file."""
        path = Path(entry.layers)
        h = json.loads(path.with_suffix(".json").read_text())
        if h.get("version") != VERSION or h.get("namespace") != entry.namespace:
            raise ValueError("header belongs to another namespace")
        if h.get("tokens_sha256") != tokens_hash(entry.tokens):
            raise ValueError("token ids differ from the index")
        key = _stat_key(path)
        if key[0] != h["nbytes"]:
            raise ValueError(f"payload is {key[0]} bytes, header says {h['nbytes']} (truncated?)")
        busy = self._reading.get(str(path))
        if busy is not None and threading.current_thread() is not self._reader:
            busy.wait(60)  # the reader is hashing this file now: wait for it rather than hash it twice
        if self._verified.get(str(path)) != (key, h["sha256"]):
            self.counters["hashed"] += 1
            if file_sha256(path) != h["sha256"]:
                self._verified.pop(str(path), None)
                raise ValueError("payload checksum mismatch (corrupt)")
            self._verified[str(path)] = (key, h["sha256"])
        return h

    def prefetch(self, namespace: str, tokens, limit: int) -> bool:
        """Verify the longest written file that could serve ``tokens[:limit]`` on a reader thread, ahead of the
        engine's restore (which then skips the hash; the read also leaves the file in the OS page cache). Never
        blocks: a full queue drops the request. Returns whether a file was queued."""
        with self._lock:
            if namespace not in self.index._trimmable:
                return False
            m = self.index.match(namespace, tokens, limit, touch=False)
        if m is None or not isinstance(m.entry.layers, (str, Path)):
            return False
        path = str(m.entry.layers)
        if path in self._reading or path in self._verified:  # a changed file is hashed again at its restore
            return False
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="mlxb-ssd-reader", daemon=True)
            self._reader.start()
        self._reading[path] = threading.Event()
        try:
            self._reads.put_nowait(m.entry)
        except queue.Full:
            self._reading.pop(path).set()
            return False
        return True

    def _read_loop(self) -> None:
        while True:
            entry = self._reads.get()
            if entry is None:
                return
            try:
                self.read_header(entry)
                self.counters["prefetched"] += 1
            except Exception:  # the engine's restore finds it again, warns and drops it
                pass
            finally:
                done = self._reading.pop(str(entry.layers), None)
                if done is not None:
                    done.set()


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
