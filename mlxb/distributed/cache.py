"""The prompt cache under ``--tp``: rank 0 decides, every rank keeps its own shard of each entry.

Rank 0's ``PromptCache`` (``MirroredPromptCache``) makes every decision: lookups, LRU, the budget,
memory pressure. Each entry it stores gets an id, and the other ranks are told, in the words of the
next message (``mlxb.distributed.leader``), where their copy of the same snapshot comes from and when to drop it:

* ``PUT id src index tokens``: snapshot single-row caches of this rank into entry ``id``. The source
  is a row's prefill caches (``SRC_ROW``, its key: a chunk-boundary snapshot), a cohort row extracted
  during the last cohort prefill (``SRC_COHORT``: followers extract every cohort row when rank 0
  announces snapshots) or a finishing row extracted before the filter that retires it
  (``SRC_EXTRACT``, after ``EXTRACT``). A full-attention source holding more than ``tokens`` is
  trimmed first, as rank 0 trims a finished row's lookahead token.
* ``SEED key id n``: a new row starts from entry ``id``'s first ``n`` tokens (``lend``).
* ``FREE id``: the entry left rank 0's index (eviction, a longer entry covering it, a reset); sent with
  the next decode step, because rank 0 may still lend from it in the iteration it left.

The SSD tier is mirrored too. Every rank keeps its shard of an entry in its own folder
(``<dir>/tp<N>-rank<r>/``, the same file names on every rank), and rank 0's disk index decides:

* ``SPILL id name``: entry ``id`` left rank 0's RAM for its SSD tier: write this rank's shard under
  ``name`` (six words: the namespace's folder hash and the token hash), in the background.
* ``RESTORE id name``: rank 0 reads ``name`` back into entry ``id``; every rank reads its own shard
  (after its writer has finished) and the ranks then count who succeeded (``Link.agree``). Only if all
  did is the entry kept; otherwise every rank drops it and rank 0 deletes the file (a miss, not a fork).
* ``DISK_DROP name``: rank 0's disk index let the file go (its byte cap, a bad file): delete it.

A graceful stop spills rank 0's RAM tier before ``STOP`` (``TPRunner.before_stop``) and the followers
finish their writes before they exit, so a restart of every rank finds each shard of every entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from pathlib import Path
from typing import Optional

import mlx.core as mx

from mlxb.cache import snapshot as snap
from mlxb.cache.prompt_cache import PromptCache, prepare_payload, write_payload
from mlxb.cache.ssd import file_sha256, tokens_hash, write_atomically
from mlxb.distributed.protocol import DISK_DROP, PUT, RESTORE, SPILL, SRC_COHORT, SRC_EXTRACT, SRC_ROW  # noqa: F401

log = logging.getLogger("mlxb.prompt_cache")


def rank_dir(root, size: int, rank: int) -> Path:
    return Path(root) / f"tp{size}-rank{rank}"


def name_words(namespace: str, tokens) -> list[int]:
    """A disk entry's name as six int32 words: its folder (namespace hash) and file (token hash)."""
    raw = bytes.fromhex(hashlib.sha256(namespace.encode()).hexdigest()[:16] + tokens_hash(tokens)[:32])
    return list(struct.unpack("<6i", raw))


def name_path(root: Path, words) -> Path:
    h = struct.pack("<6i", *words).hex()
    return root / h[:16] / f"{h[16:]}.safetensors"


class MirroredPromptCache(PromptCache):
    """Rank 0's prompt cache under ``--tp``; ``runner`` (the ``TPRunner``) carries the words."""

    def __init__(self, *args, runner, **kw):
        if kw.get("disk_dir") is not None:
            kw["disk_dir"] = rank_dir(kw["disk_dir"], runner.link.size, 0)
        super().__init__(*args, **kw)
        self.runner = runner
        self._next = 0
        self.ram.on_remove = self._removed
        if self.disk is not None:  # the followers delete what rank 0's disk index lets go
            dropped = self.disk.index.on_evict

            def evicted(entry):  # NOTE: on rank 0's writer thread
                dropped(entry)
                self.runner.queue_async([DISK_DROP, *name_words(entry.namespace, entry.tokens)])

            self.disk.index.on_evict = evicted
            forget = self.disk.forget

            def forgotten(entry, reason):
                forget(entry, reason)
                self.runner.queue_async([DISK_DROP, *name_words(entry.namespace, entry.tokens)])

            self.disk.forget = forgotten
            runner.before_stop.append(self._spill_ram)

    def _probe_shapes(self, model) -> list:
        # NOTE: no probe forward here: on rank 0 alone its all_sums would pair with the other ranks'
        # message collectives and the ranks would fall out of step. Files read back from the SSD tier
        # are still checked by fingerprint (of this rank's shard), layer kinds, classes and lengths.
        return []

    def put(self, tokens, layers: list, *, copy: bool = True, adapter: int = -1):
        src = self.runner.cache_source(layers)
        entry = super().put(tokens, layers, copy=copy, adapter=adapter)
        if entry is not None and getattr(entry, "tp_id", None) is None:
            if src is None:
                raise RuntimeError("a prompt-cache snapshot whose source the other ranks cannot name")
            entry.tp_id = self._next
            self._next += 1
            self.runner.queue_cache_op(PUT, entry.tp_id, *src, len(entry.tokens))
            if entry not in self.ram:  # larger than the RAM tier: usable by this iteration only
                self.runner.queue_cache_free_later(entry.tp_id)
        return entry

    def put_many(self, items: list, *, copy: bool = True) -> list:
        """One at a time: ``put`` names each snapshot's source to the other ranks as it is stored."""
        return [self.put(tokens, layers, copy=copy, adapter=adapter) for tokens, layers, adapter in items]

    def _spill(self, entry, block: bool = False) -> None:
        if self.disk is not None and self.disk.spill(entry, self.kinds, self.fingerprint, block=block):
            if getattr(entry, "tp_id", None) is not None:
                self.runner.queue_cache_op(SPILL, entry.tp_id, *name_words(entry.namespace, entry.tokens))

    def _spill_ram(self) -> None:
        """Before STOP: every RAM entry to the SSD tier, on every rank."""
        for e in self.ram.entries():
            self._spill(e, block=True)

    def close(self, timeout: float = 60.0) -> None:
        if self.disk is not None:  # the RAM tier went to disk before STOP (_spill_ram)
            self.disk.close(timeout)

    def _restore(self, far):
        entry = far.entry
        if not isinstance(entry.layers, (str, Path)):  # still queued for writing: the followers wrote theirs
            self.disk.flush()  # (their writers run in the same order); read it back from the files
            far = self.disk.index.match(entry.namespace, entry.tokens, far.num_tokens)
            if far is None or far.num_tokens == 0:
                return None
            entry = far.entry
        eid, self._next = self._next, self._next + 1
        got, everyone = self.runner.restore((RESTORE, eid, *name_words(entry.namespace, entry.tokens)),
                                            lambda: super(MirroredPromptCache, self)._restore(far))
        if got is None:
            return None
        if not everyone:  # another rank could not read its shard: nobody keeps the entry
            if got.entry in self.ram:
                self.ram.remove(got.entry)
            self.counters["ssd_hits"] -= 1
            self.disk.forget(entry, "another rank could not read its shard of this entry")
            return None
        got.entry.tp_id = eid
        if got.entry not in self.ram:  # larger than the RAM tier: this iteration's rows only
            self.runner.queue_cache_free_later(eid)
        return got

    def _removed(self, entry) -> None:
        # NOTE: freed with the iteration's decode step, not now: rank 0 may still lend from an entry
        # that left the index this iteration (held since admission, or a leader's fresh snapshot)
        if getattr(entry, "tp_id", None) is not None:
            self.runner.queue_cache_free_later(entry.tp_id)


class FollowerStore:
    """A follower's copies of rank 0's entries (its shard of each), by id."""

    def __init__(self, kinds: list, disk: Optional["FollowerDisk"] = None):
        self.kinds = list(kinds)
        self.disk = disk
        self.entries: dict[int, list] = {}
        self.cohort: dict[int, list] = {}  # cohort row index -> its caches, from the last cohort prefill
        self.extracted: list = []  # the last EXTRACT's single-row caches

    def put(self, eid: int, src: int, index: int, tokens: int, rows: dict) -> None:
        layers = (rows[index].solo if src == SRC_ROW else self.cohort[index] if src == SRC_COHORT
                  else self.extracted[index])
        for c, k in zip(layers, self.kinds):
            if k in ("full", "latent") and c.offset > tokens:
                c.trim(c.offset - tokens)
        copy = [snap.snapshot(c, k) for c, k in zip(layers, self.kinds)]
        mx.eval([snap.arrays(c) for c in copy])
        self.entries[eid] = copy

    def lend(self, eid: int, n: int) -> list:
        return [snap.lend(c, k, n if k in ("full", "latent") else None) for c, k in zip(self.entries[eid], self.kinds)]

    def spill(self, eid: int, words) -> None:
        if self.disk is not None and eid in self.entries:
            self.disk.write(name_path(self.disk.root, words), self.entries[eid])

    def restore(self, eid: int, words, link) -> None:
        layers = self.disk.read(name_path(self.disk.root, words)) if self.disk is not None else None
        if link.agree(layers is not None) == link.size and layers is not None:
            self.entries[eid] = layers

    def drop(self, words) -> None:
        if self.disk is not None:
            self.disk.delete(name_path(self.disk.root, words))



class FollowerDisk:
    """A follower's shard files: written in the background in the order rank 0 spilled them, each with
    a header (size, sha256) written last; read back only when whole."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._loop, name="mlxb-tp-ssd-writer", daemon=True)
        self._writer.start()

    def write(self, path: Path, layers: list) -> None:
        self._queue.put((path, prepare_payload(layers)))

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                path, payload = item
                write_atomically(path, write_payload, payload)
                head = path.with_suffix(".json")
                head.with_name(head.stem + ".tmp.json").write_text(json.dumps(
                    {"nbytes": path.stat().st_size, "sha256": file_sha256(path)}))
                os.replace(head.with_name(head.stem + ".tmp.json"), head)
            except Exception as e:  # the restore's agreement turns a missing shard into a miss
                log.warning("prompt cache: SSD write of a tensor-parallel shard failed: %s", e)
            finally:
                self._queue.task_done()

    def read(self, path: Path) -> Optional[list]:
        from mlx_lm.models.cache import load_prompt_cache

        self._queue.join()  # rank 0 read its file only after writing it; so do we
        try:
            h = json.loads(path.with_suffix(".json").read_text())
            if path.stat().st_size != h["nbytes"] or file_sha256(path) != h["sha256"]:
                raise ValueError("payload size or checksum differs from its header")
            layers = load_prompt_cache(str(path))
            mx.eval([snap.arrays(c) for c in layers])
            return layers
        except Exception as e:
            log.warning("prompt cache: cannot read tensor-parallel shard %s (%s)", path, e)
            self.delete(path)
            return None

    def delete(self, path: Path) -> None:
        self._queue.join()
        for p in (path.with_suffix(".json"), path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def close(self, timeout: float = 60.0) -> None:
        self._queue.put(None)
        self._writer.join(timeout)
