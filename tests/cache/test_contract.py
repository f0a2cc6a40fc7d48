"""One contract over every cache kind the engine joins (full, latent, rotating incl. wrap, SSM).

Synthetic arrays only: each row's values encode (row, position) so any misplaced column shows.
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxb.cache.protocol import ROW_OPS, layer_kind, nbytes

H, D, W = 2, 4, 8  # heads, head dim, sliding window
D_ = D


def kv_solo(row: int, length: int, cls=KVCache, **kw):
    c = cls(**kw)
    for pos in range(length):  # one token at a time, like decode (wraps rotating rings)
        k = mx.full((1, H, 1, D), row * 1000 + pos, dtype=mx.float32)
        c.update_and_fetch(k, k + 0.5)
    return c


def ssm_solo(row: int):
    c = ArraysCache(2)
    c[0] = mx.full((1, 3, 5), float(row))
    c[1] = mx.full((1, 2, 4, 4), float(row) + 0.25)
    return c


def solo_values(kind, c):
    if kind == "ssm":
        return [mx.array(a) for a in c.cache]
    if kind == "rotating":
        k = c._temporal_order(c.keys)[..., -c.size():, :] if c.keys is not None else None
        return [k]
    return [c.keys[..., : c.offset, :]]


def make(kind, row, length):
    if kind in ("full", "latent"):
        return kv_solo(row, length)
    if kind == "rotating":
        return kv_solo(row, length, RotatingKVCache, max_size=W)
    return ssm_solo(row)


KINDS = ["full", "latent", "rotating", "ssm"]
LENGTHS = [5, 3, 12, 7]  # 12 > W: that row's ring has wrapped


def same(a, b):
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b))


@pytest.mark.parametrize("kind", KINDS)
def test_layer_kind_by_capability(kind):
    c = make(kind, 0, 2)
    assert layer_kind(c, latent=kind == "latent") == kind


@pytest.mark.parametrize("kind", KINDS)
def test_extract_after_merge_is_identity(kind):
    ops = ROW_OPS[kind]
    solos = [make(kind, i, n) for i, n in enumerate(LENGTHS)]
    batch = ops.to_batch(solos)
    for i, s in enumerate(solos):
        assert same(solo_values(kind, ops.extract(batch, i)), solo_values(kind, s)), f"row {i}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["extend", "merge"])
def test_extract_after_join_is_identity(kind, mode):
    ops = ROW_OPS[kind]
    solos = [make(kind, i, n) for i, n in enumerate(LENGTHS)]
    batch = ops.to_batch(solos[:1])
    for s in solos[1:]:
        batch = ops.join(batch, s, mode)
    for i, s in enumerate(solos):
        assert same(solo_values(kind, ops.extract(batch, i)), solo_values(kind, s)), f"row {i}"


@pytest.mark.parametrize("kind", KINDS)
def test_filter_keeps_order_and_shrinks_bytes(kind):
    ops = ROW_OPS[kind]
    solos = [make(kind, i, n) for i, n in enumerate(LENGTHS)]
    batch = ops.to_batch(solos)
    before = nbytes(batch)
    batch = ops.filter(batch, [3, 1])
    assert nbytes(batch) < before
    for j, i in enumerate([3, 1]):
        assert same(solo_values(kind, ops.extract(batch, j)), solo_values(kind, solos[i]))


def test_full_filter_trims_shared_left_padding():
    ops = ROW_OPS["full"]
    batch = ops.to_batch([kv_solo(0, 10), kv_solo(1, 4), kv_solo(2, 6)])
    assert batch.left_padding.tolist() == [0, 6, 4] and batch._idx == 10
    batch = ops.filter(batch, [1, 2])
    assert batch.left_padding.tolist() == [2, 0]  # 4 shared columns removed
    assert batch._idx == 6 and batch.keys.shape[2] == 6
    assert batch.offset.tolist() == [4, 6]  # absolute positions (RoPE) unchanged


def test_full_filter_without_trim_is_the_planted_bug():
    ops = ROW_OPS["full"]
    batch = ops.to_batch([kv_solo(0, 10), kv_solo(1, 4)])
    batch = ops.filter(batch, [1], trim_padding=False)
    assert batch.left_padding.tolist() == [6]


@pytest.mark.parametrize("kind", ["full", "rotating", "ssm"])
def test_join_with_empty_sides(kind):
    ops = ROW_OPS[kind]
    if kind == "ssm":
        empty = ArraysCache(2)
        batch = ops.to_batch([empty])
        batch = ops.join(batch, ssm_solo(1))
        assert same(solo_values(kind, ops.extract(batch, 1)), solo_values(kind, ssm_solo(1)))
        assert mx.array_equal(ops.extract(batch, 0).cache[0], mx.zeros((1, 3, 5))).item()
        return
    cls = (KVCache, {}) if kind == "full" else (RotatingKVCache, {"max_size": W})
    empty = cls[0](**cls[1])
    batch = ops.to_batch([empty])
    batch = ops.join(batch, make(kind, 1, 3), "extend")
    assert same(solo_values(kind, ops.extract(batch, 1)), solo_values(kind, make(kind, 1, 3)))
    batch2 = ops.to_batch([make(kind, 2, 4)])
    batch2 = ops.join(batch2, cls[0](**cls[1]), "extend")
    assert same(solo_values(kind, ops.extract(batch2, 0)), solo_values(kind, make(kind, 2, 4)))


def test_full_extend_pads_only_the_shorter_side():
    ops = ROW_OPS["full"]
    batch = ops.to_batch([kv_solo(0, 9)])
    batch = ops.join(batch, kv_solo(1, 4), "extend")
    assert batch.left_padding.tolist() == [0, 5]
    assert batch.offset.tolist() == [9, 4]


@pytest.mark.parametrize("lengths", [[5, 3, 12, 7], [6, 6, 6], [0, 4, 9], [11]])
def test_full_merge_and_cohort_roll_equal_mlx_lm_bit_for_bit(lengths):
    """The batch cache's own merge / right-padded cohort step / finalize (contiguous copies only)
    give exactly mlx-lm's BatchKVCache arrays, offsets and paddings."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxb.cache.protocol import AlignedBatchKVCache

    def run(cls):
        c = cls.merge([kv_solo(r, n) for r, n in enumerate(lengths)])
        suffix = [3 + (r * 5) % 7 for r in range(len(lengths))]  # right-padded suffixes of unequal length
        width = max(suffix)
        c.prepare(lengths=suffix, right_padding=[width - n for n in suffix])
        k = mx.arange(len(lengths) * H * width * D, dtype=mx.float32).reshape(len(lengths), H, width, D)
        c.update_and_fetch(k, -k)
        c.finalize()
        return c

    ours, ref = run(AlignedBatchKVCache), run(BatchKVCache)
    assert type(ours) is AlignedBatchKVCache
    for a in ("keys", "values", "offset", "left_padding"):
        x, y = getattr(ours, a), getattr(ref, a)
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item(), a
    assert ours._idx == ref._idx


@pytest.mark.parametrize("lengths", [[5, 3, 12, 7], [6, 6, 6], [0, 4, 9], [11]])
def test_a_merge_with_room_steps_in_place_and_equals_mlx_lm_where_rows_hold_tokens(lengths):
    """``merge(room=...)`` (a cohort's buffer with space for its bodies, held-back tokens and the roll's wrap): the
    cohort step writes in place (the buffer is not regrown: the same capacity after it) and the rows' keys, values,
    offsets and paddings equal mlx-lm's BatchKVCache up to the write position, with zeros in the padding."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxb.cache.protocol import AlignedBatchKVCache

    suffix = [3 + (r * 5) % 7 for r in range(len(lengths))]
    width = max(suffix)
    room = 2 * width - min(suffix) + 1

    def run(cls, **kw):
        c = cls.merge([kv_solo(r, n) for r, n in enumerate(lengths)], **kw)
        cap = c.keys.shape[2]
        c.prepare(lengths=suffix, right_padding=[width - n for n in suffix])
        k = mx.arange(len(lengths) * H * width * D, dtype=mx.float32).reshape(len(lengths), H, width, D) + 1
        c.update_and_fetch(k, -k)
        c.finalize()
        c.update_and_fetch(k[:, :, :1], -k[:, :, :1])  # the held-back tokens' step
        return c, cap

    (ours, cap), (ref, _) = run(AlignedBatchKVCache, room=room), run(BatchKVCache)
    assert cap == max(lengths) + room and ours.keys.shape[2] == cap  # never regrown
    assert ours._idx == ref._idx
    for a in ("offset", "left_padding"):
        assert mx.array_equal(getattr(ours, a), getattr(ref, a)).item(), a
    n = ours._idx
    for a in ("keys", "values"):
        x, y = getattr(ours, a)[..., :n, :], getattr(ref, a)[..., :n, :]
        assert mx.array_equal(x, y).item(), a
    pad = ours.left_padding.tolist()
    for r, p in enumerate(pad):
        assert not mx.any(ours.keys[r, :, :p]).item()  # what the roll wrapped to the front: never written


@pytest.mark.parametrize("stepped", ["joining", "batch"])
@pytest.mark.parametrize("a,b", [([9, 4], [3, 12, 7]), ([5, 5], [5]), ([12], [2, 3]), ([3, 8], [14])])
def test_extend_equals_mlx_lm_bit_for_bit(a, b, stepped):
    """A join's extend (both sides written once into one buffer where one needs padding) gives exactly mlx-lm's
    BatchKVCache arrays, offsets, paddings and write position, the capacity left after the rows included.
    ``stepped``: which side ran a decode step (capacity past its rows). A running batch with that capacity and
    a cohort with longer rows is the agent loop's join: mlx-lm trims the batch's spare tail there."""
    from mlx_lm.models.cache import BatchKVCache

    from mlxb.cache.protocol import AlignedBatchKVCache

    def run(cls):
        x = cls.merge([kv_solo(r, n) for r, n in enumerate(a)])
        y = cls.merge([kv_solo(10 + r, n) for r, n in enumerate(b)])
        side, rows = (y, len(b)) if stepped == "joining" else (x, len(a))
        step = mx.ones((rows, H, 1, D))
        side.update_and_fetch(step, -step)
        x.extend(y)
        return x

    ours, ref = run(AlignedBatchKVCache), run(BatchKVCache)
    for attr in ("keys", "values", "offset", "left_padding"):
        p, q = getattr(ours, attr), getattr(ref, attr)
        assert p.shape == q.shape and mx.array_equal(p, q).item(), attr
    assert ours._idx == ref._idx


def test_roll_rows_equals_mlx_lms_dynamic_roll_for_any_shifts():
    """The cohort's roll (several runs of equal shifts placed into one buffer, one run concatenated) gives
    mlx-lm's ``dynamic_roll`` bit for bit, whatever lies in the wrapped tail, shifts past the length included."""
    import numpy as np
    from mlx_lm.models.cache import dynamic_roll

    from mlxb.cache.dense import roll_rows

    rng = np.random.default_rng(0)
    for trial in range(60):
        B, N = int(rng.integers(1, 7)), int(rng.integers(1, 20))
        x = mx.array(rng.standard_normal((B, 2, N, 3)).astype(np.float32))
        shifts = [int(v) for v in rng.integers(0, N + 3, size=B)]
        if trial % 3 == 0:
            shifts = sorted(shifts)  # runs of equal shifts
        assert mx.array_equal(roll_rows(x, shifts), dynamic_roll(x, mx.array(shifts)[:, None], axis=2)).item()
