"""The prompt cache on a real model's caches: snapshots stay immutable while rows borrow them, the
SSD tier round-trips bit for bit, survives a restart, and skips corrupt or foreign files."""

import json
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxb.cache import snapshot as snap
from mlxb.cache.prompt_cache import PromptCache
from mlxb.cache.protocol import layer_kinds


def prefill(model, ids, caches=None):
    caches = caches if caches is not None else make_prompt_cache(model)
    model(mx.array(ids)[None], cache=caches)
    mx.eval([c.state for c in caches])
    return caches


def as_np(layers):
    return [np.array(a.astype(mx.float32)) for c in layers for a in snap.arrays(c)]


def same(a, b):
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def ids(n, seed=0):
    return np.random.default_rng(seed).integers(3, 8000, size=n).tolist()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3.5"])
def test_borrowed_snapshot_is_never_mutated_and_continues_like_a_fresh_prefill(name, tiny_models, tmp_path):
    model, *_ = tiny_models(name)
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30)
    p = ids(90)  # past the Gemma window: the ring has wrapped
    entry = pc.put(p[:80], prefill(model, p[:80]))
    before = as_np(entry.layers)
    m = pc.lookup(p, len(p) - 1)
    assert m.entry is entry and m.num_tokens == 80
    borrowed = prefill(model, p[80:89], pc.lend(m))  # the row writes into its own arrays
    assert same(as_np(entry.layers), before)
    fresh = prefill(model, p[80:89], prefill(model, p[:80]))
    out_b = model(mx.array(p[89:])[None], cache=borrowed)
    out_f = model(mx.array(p[89:])[None], cache=fresh)
    assert np.array_equal(np.array(out_b), np.array(out_f))


def test_trimmed_borrow_equals_the_shorter_prefill(tiny_models):
    model, *_ = tiny_models("tiny-llama")
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30)
    p = ids(60, 1)
    pc.put(p, prefill(model, p))
    q = p[:30] + ids(10, 2)
    m = pc.lookup(q, len(q) - 1)
    assert m.num_tokens == 30
    a = model(mx.array(q[30:])[None], cache=pc.lend(m))
    b = model(mx.array(q[30:])[None], cache=prefill(model, q[:30]))
    assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3.5"])
def test_ssd_round_trip_is_bit_identical_and_survives_a_restart(name, tiny_models, tmp_path):
    model, *_ = tiny_models(name)
    kinds = layer_kinds(model)
    pc = PromptCache(model, kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    p = ids(90, 3)
    entry = pc.put(p[:89], prefill(model, p[:89]))
    want = as_np(entry.layers)
    pc.close()  # graceful shutdown writes RAM entries to disk
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 1
    again = PromptCache(model, kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert again.ram.num_entries == 0 and again.disk.num_entries == 1
    m = again.lookup(p, 89)
    assert m is not None and m.num_tokens == 89 and again.counters["ssd_hits"] == 1
    assert same(as_np(m.entry.layers), want)
    assert again.ram.num_entries == 1  # restored into RAM: the next hit is a RAM hit
    again.lookup(p, 89)
    assert again.counters["ram_hits"] == 1
    again.close()


def _one_file(model, tmp_path, seed=4):
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    p = ids(40, seed)
    pc.put(p, prefill(model, p))
    pc.close()
    return p, next(tmp_path.glob("*/*.safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_corrupt_or_truncated_files_are_skipped_never_served(damage, tiny_models, tmp_path, caplog):
    model, *_ = tiny_models("tiny-llama")
    p, payload = _one_file(model, tmp_path)
    if damage == "flip":
        raw = bytearray(payload.read_bytes())
        raw[-5] ^= 0xFF
        payload.write_bytes(bytes(raw))
    elif damage == "truncate":
        payload.write_bytes(payload.read_bytes()[:-100])
    else:
        payload.with_suffix(".json").write_text("{not json")
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert pc.lookup(p + [5], len(p)) is None  # a miss, not wrong KV and not a crash
    assert pc.stats()["ssd_corrupt_skipped"] == 1 and "skipping" in caplog.text
    assert pc.disk.num_entries == 0
    pc.close()


def test_a_file_from_another_model_is_skipped(tiny_models, tmp_path):
    llama, *_ = tiny_models("tiny-llama")
    minicpm, *_ = tiny_models("tiny-minicpm")
    p, payload = _one_file(minicpm, tmp_path)
    pc = PromptCache(llama, layer_kinds(llama), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert pc.disk.num_entries == 0  # another namespace: never indexed for this model
    # a forged header claiming this model's namespace: the layer shapes give it away
    h = json.loads(payload.with_suffix(".json").read_text())
    h["namespace"] = pc.namespace
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / payload.name).write_bytes(payload.read_bytes())
    (forged / payload.with_suffix(".json").name).write_text(json.dumps(h))
    pc2 = PromptCache(llama, layer_kinds(llama), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert pc2.disk.num_entries == 1
    assert pc2.lookup(p + [5], len(p)) is None and pc2.stats()["ssd_corrupt_skipped"] == 1
    pc.close()
    pc2.close()


def test_lookups_while_the_writer_spills(tiny_models, tmp_path):
    model, *_ = tiny_models("tiny-llama")
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    prompts = [ids(48, 10 + i) for i in range(12)]
    for p in prompts:
        pc.put(p, prefill(model, p))
    pc.spill_all()  # queued on this (the engine's) thread; the writer thread writes them meanwhile
    hits = 0
    for _ in range(5):
        for p in prompts:
            m = pc.lookup(p + [7], len(p))
            hits += m is not None and m.num_tokens == len(p)
    assert pc.disk.flush(30)
    assert pc.disk.counters["write_errors"] == 0
    assert pc.disk.num_entries == 12
    # every lookup found its prefix, in RAM or restored from disk
    assert hits == 60
    pc.close()


def test_budget_eviction_spills_to_disk(tiny_models, tmp_path):
    model, *_ = tiny_models("tiny-llama")
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    p = ids(64, 20)
    pc.put(p, prefill(model, p))
    freed = pc.evict(1)
    assert freed > 0 and pc.nbytes == 0 and pc.ram.num_evictions == 1
    assert pc.disk.flush(30) and pc.disk.num_entries == 1
    assert pc.lookup(p + [9], len(p)).num_tokens == len(p)
    pc.close()


def _wait_reader(pc, timeout=30.0):
    import time
    end = time.monotonic() + timeout
    while (pc.disk._reading or not pc.disk._reads.empty()) and time.monotonic() < end:
        time.sleep(0.01)
    assert not pc.disk._reading


def test_each_file_version_is_hashed_once_and_prefetch_moves_it_off_the_restore(tiny_models, tmp_path):
    model, *_ = tiny_models("tiny-llama")
    kinds = layer_kinds(model)
    pc = PromptCache(model, kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    p = ids(64, 21)
    want = as_np(pc.put(p, prefill(model, p)).layers)
    assert pc.evict(1) > 0 and pc.disk.flush(30)  # spilled and written by this process
    m = pc.lookup(p + [9], len(p))
    assert m.num_tokens == len(p) and same(as_np(m.entry.layers), want)
    assert pc.disk.counters["hashed"] == 0  # the writer hashed what it wrote: the restore does not again
    pc.close()
    # a restart: the file is unknown to the new process; the prefetch hashes it on the reader thread
    again = PromptCache(model, kinds, max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert again.prefetch(p + [9], len(p))
    _wait_reader(again)
    assert again.disk.counters["prefetched"] == 1 and again.disk.counters["hashed"] == 1
    assert not again.prefetch(p + [9], len(p))  # already verified: not queued twice
    m = again.lookup(p + [9], len(p))
    assert m.num_tokens == len(p) and same(as_np(m.entry.layers), want)
    assert again.disk.counters["hashed"] == 1 and again.disk.counters["restores"] == 1
    again.close()


@pytest.mark.parametrize("when", ["after", "before"])
def test_a_file_damaged_around_its_prefetch_is_never_served(when, tiny_models, tmp_path, caplog):
    import os
    model, *_ = tiny_models("tiny-llama")
    p, payload = _one_file(model, tmp_path, seed=22)

    def damage():
        st = os.stat(payload)
        raw = bytearray(payload.read_bytes())
        raw[-5] ^= 0xFF
        payload.write_bytes(bytes(raw))  # same size; a new mtime, set apart from a coarse clock's tick
        os.utime(payload, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))

    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    if when == "before":
        damage()
    assert pc.prefetch(p + [5], len(p))
    _wait_reader(pc)
    if when == "after":  # verified, then changed on disk: its stat differs, so the restore hashes it again
        assert pc.disk.counters["prefetched"] == 1
        damage()
    assert pc.lookup(p + [5], len(p)) is None  # a miss, not wrong KV
    assert pc.stats()["ssd_corrupt_skipped"] == 1 and "checksum" in caplog.text
    pc.close()


def test_a_restore_waits_for_the_reader_instead_of_hashing_the_file_twice(tiny_models, tmp_path, monkeypatch):
    import time
    from mlxb.cache import ssd

    model, *_ = tiny_models("tiny-llama")
    p, payload = _one_file(model, tmp_path, seed=23)
    calls, real = [], ssd.file_sha256

    def slow(path):  # the reader is still hashing when the engine's restore comes
        calls.append(str(path))
        time.sleep(0.3)
        return real(path)

    monkeypatch.setattr(ssd, "file_sha256", slow)
    pc = PromptCache(model, layer_kinds(model), max_bytes=1 << 30, disk_dir=tmp_path, disk_bytes=1 << 30)
    assert pc.prefetch(p + [5], len(p))
    m = pc.lookup(p + [5], len(p))
    assert m is not None and m.num_tokens == len(p)
    assert calls == [str(payload)] and pc.disk.counters["hashed"] == 1
    pc.close()
