"""The SSD tier's pieces under --tp that need no second process: entry names as message words, and a
follower's shard files (written in order, read back only when whole, a truncated one refused and removed)."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxb.cache.ssd import tokens_hash
from mlxb.distributed.cache import FollowerDisk, name_path, name_words, rank_dir


def test_entry_names_travel_as_six_words_and_map_to_the_same_file_on_every_rank(tmp_path):
    words = name_words("fp|float32|kv=none|adapter=none", list(range(40)))
    assert len(words) == 6 and all(-2**31 <= w < 2**31 for w in words)
    p0, p1 = (name_path(rank_dir(tmp_path, 2, r), words) for r in (0, 1))
    assert p0.relative_to(tmp_path / "tp2-rank0") == p1.relative_to(tmp_path / "tp2-rank1")
    assert p0.stem == tokens_hash(list(range(40)))[:32]
    assert name_words("fp|float32|kv=none|adapter=none", list(range(41))) != words


def _layers(n):
    c = KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    mx.eval(c.state)
    return [c]


def test_follower_shards_round_trip_and_a_truncated_one_is_refused(tmp_path):
    disk = FollowerDisk(tmp_path)
    try:
        layers = _layers(12)
        good, bad = tmp_path / "a" / "good.safetensors", tmp_path / "a" / "bad.safetensors"
        disk.write(good, layers)
        disk.write(bad, _layers(5))
        back = disk.read(good)  # waits for the writer first
        assert back is not None and back[0].offset == 12
        assert mx.array_equal(back[0].state[0], layers[0].state[0]).item()
        bad.write_bytes(bad.read_bytes()[:100])
        assert disk.read(bad) is None and not bad.exists() and not bad.with_suffix(".json").exists()
        assert disk.read(tmp_path / "a" / "missing.safetensors") is None
        disk.delete(good)
        assert not good.exists()
    finally:
        disk.close()
