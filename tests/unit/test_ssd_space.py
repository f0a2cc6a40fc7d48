"""The SSD tier never fills its filesystem: writes leave ``reserve_bytes`` free (model-free: a fake
filesystem whose free bytes shrink with every file written)."""

from pathlib import Path

import pytest

from mlxb.cache.prefix import PrefixEntry
from mlxb.cache.ssd import DiskTier, default_reserve

NS = "ns"
GIB = 1 << 30


class FakeDisk:
    """``disk_usage`` for a filesystem of ``total`` bytes whose used bytes are the tier's files plus ``other``."""

    def __init__(self, root: Path, total: int, other: int):
        self.root, self.total, self.other = root, total, other

    def __call__(self, path):
        used = self.other + sum(f.stat().st_size for f in self.root.rglob("*.bin"))
        return self.total, used, self.total - used


def save(path, payload: bytes):
    Path(path).write_bytes(payload)


def tier(tmp_path, disk, reserve):
    return DiskTier(tmp_path, max_bytes=1 << 40, trimmable={NS: True}, save=save, prepare=lambda b: b,
                    reserve_bytes=reserve, disk_usage=disk)


def spill(t: DiskTier, first: int, nbytes: int):
    entry = PrefixEntry(NS, tuple(range(first, first + 4)), b"x" * nbytes, nbytes)
    assert t.spill(entry, ["kv"], "fp")
    assert t.flush(10)


@pytest.fixture(autouse=True)
def bin_payloads(monkeypatch):
    # the fake filesystem counts payload files by suffix
    from mlxb.cache import ssd

    orig = ssd.DiskTier._paths

    def paths(self, namespace, tokens):
        payload, header = orig(self, namespace, tokens)
        return payload.with_suffix(".bin"), header

    monkeypatch.setattr(ssd.DiskTier, "_paths", paths)


def test_a_write_that_would_leave_less_than_the_reserve_evicts_the_oldest_files_first(tmp_path):
    disk = FakeDisk(tmp_path, total=10_000, other=5_000)  # 5,000 free
    t = tier(tmp_path, disk, reserve=2_000)
    spill(t, 0, 1_000)
    spill(t, 10, 1_000)  # 3,000 free: the next 1,000 would leave 2,000, on the reserve
    spill(t, 20, 1_000)
    assert t.num_entries == 3 and t.counters["evicted_for_space"] == 0
    spill(t, 30, 1_000)  # would leave 1,000: the oldest file goes first, then it is written
    assert t.counters["evicted_for_space"] == 1 and t.counters["writes"] == 4 and t.num_entries == 3
    assert t.match(NS, (0, 1, 2, 3), 4) is None and t.match(NS, (30, 31, 32, 33), 4) is not None
    assert disk(tmp_path)[2] >= 2_000
    t.close()


def test_a_write_with_no_room_left_is_skipped_and_leaves_no_file(tmp_path, caplog):
    disk = FakeDisk(tmp_path, total=10_000, other=7_500)  # 2,500 free, nothing of the tier's own to evict
    t = tier(tmp_path, disk, reserve=2_000)
    spill(t, 0, 1_000)
    assert t.counters["skipped_full"] == 1 and t.counters["writes"] == 0 and t.num_entries == 0
    assert not list(tmp_path.rglob("*.bin")) and not list(tmp_path.rglob("*.json"))
    assert "skips writes" in caplog.text and "--prompt-cache-disk-bytes" in caplog.text
    disk.other = 2_000  # space came back: writes resume
    spill(t, 10, 1_000)
    assert t.counters["writes"] == 1 and t.num_entries == 1
    t.close()


def test_a_failed_save_leaves_no_partial_file(tmp_path):
    def full(path, payload):
        Path(path).write_bytes(payload[:10])
        raise OSError(28, "No space left on device")

    t = DiskTier(tmp_path, max_bytes=1 << 40, trimmable={NS: True}, save=full, prepare=lambda b: b)
    entry = PrefixEntry(NS, (1, 2, 3), b"x" * 100, 100)
    t.spill(entry, ["kv"], "fp")
    assert t.flush(10)
    assert t.counters["write_errors"] == 1 and t.num_entries == 0
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
    t.close()


def test_the_default_reserve_is_2_percent_between_2_and_10_gib():
    assert default_reserve(10 * GIB) == 2 * GIB  # a small disk: the floor
    assert default_reserve(300 * GIB) == 6 * GIB
    assert default_reserve(2000 * GIB) == 10 * GIB  # a large laptop disk with little free still takes writes
