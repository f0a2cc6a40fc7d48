"""One contract over every cache kind the engine joins (full, latent, rotating incl. wrap, SSM).

Synthetic arrays only: each row's values encode (row, position) so any misplaced column shows.
"""

import mlx.core as mx
import numpy as np
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


# ---- quantized full attention (--kv-bits) --------------------------------------------------------
QD = 64  # head dim: a multiple of the group size


def q_solo(row: int, length: int, bits: int = 4):
    from mlx_lm.models.cache import QuantizedKVCache

    c = QuantizedKVCache(group_size=32, bits=bits)
    for pos in range(length):
        k = mx.random.normal((1, H, 1, QD), key=mx.random.key(row * 1000 + pos))
        c.update_and_fetch(k, k * 0.5)
    return c


def q_same(a, b):
    n = a.offset
    return n == b.offset and all(mx.array_equal(x[..., :n, :], y[..., :n, :]).item()
                                 for t in ("keys", "values") for x, y in zip(getattr(a, t), getattr(b, t)))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_rows_survive_merge_extend_filter_and_cohort_roll_bit_for_bit(bits):
    from mlxb.cache.quantized import BatchQuantizedKVCache

    solos = [q_solo(r, n, bits) for r, n in enumerate([5, 3, 12, 0])]
    ops = ROW_OPS["full"]
    b = ops.to_batch(solos[:2])
    assert isinstance(b, BatchQuantizedKVCache) and (b.bits, b.group_size) == (bits, 32)
    b = ops.join_batch(b, ops.to_batch(solos[2:]), "extend")  # the longer cohort pads the batch
    for i, s in enumerate(solos[:3]):
        assert q_same(ops.extract(b, i), s), i
    b = ops.filter(b, [2, 0])
    assert q_same(ops.extract(b, 0), solos[2]) and q_same(ops.extract(b, 1), solos[0])
    assert min(b.left_padding.tolist()) == 0  # filter trimmed the shared padding
    merged = ops.join_batch(ops.to_batch([solos[1]]), ops.to_batch([solos[0]]), "merge")
    assert q_same(ops.extract(merged, 0), solos[1]) and q_same(ops.extract(merged, 1), solos[0])
    # a cohort step: right-padded suffixes rolled to left padding keep every row's tokens in order
    c = ops.to_batch([q_solo(7, 6, bits), q_solo(8, 2, bits)])
    suffix = [3, 5]
    c.prepare(lengths=suffix, right_padding=[5 - n for n in suffix])
    k = mx.random.normal((2, H, 5, QD), key=mx.random.key(3))
    c.update_and_fetch(k, k)
    c.finalize()
    for i, (n0, n) in enumerate(zip([6, 2], suffix)):
        row = ops.extract(c, i)
        ref = q_solo(7 + i, n0, bits)
        ref.update_and_fetch(k[i : i + 1, :, :n], k[i : i + 1, :, :n])
        assert q_same(row, ref), i


def test_quantized_and_plain_rows_never_share_a_layer():
    with pytest.raises(ValueError, match="cannot share"):
        ROW_OPS["full"].to_batch([q_solo(0, 3), kv_solo(1, 3)])


# ---- quantized sliding-window rings (--kv-bits on rotating layers) --------------------------------
def qring(row: int, length: int, bits: int = 4, chunk: int = 1):
    """A quantized ring of window W fed ``length`` tokens, ``chunk`` at a time (1: in-place writes that
    wrap; more: mlx-lm's concatenating prefill with its trim)."""
    from mlxb.cache.quantized_ring import QuantizedRotatingKVCache

    c = QuantizedRotatingKVCache(W, 0, 32, bits)
    for pos in range(0, length, chunk):
        n = min(chunk, length - pos)
        k = mx.concatenate([mx.random.normal((1, H, 1, QD), key=mx.random.key(row * 1000 + pos + j)) for j in range(n)], 2)
        c.update_and_fetch(k, k * 0.5)
    return c


def ring_view(c):
    """Each lane's K and V parts in temporal order, the last ``size()`` tokens (what attention reads)."""
    out = []
    for lane in c.lanes:
        if lane.keys is None or lane.size() == 0:  # an empty row extracted from a batch holds 0-width parts
            out.append(None)
            continue
        out += [lane._temporal_order(a)[..., -lane.size():, :] for a in (lane.keys, lane.values)]
    return out


def ring_same(a, b):
    va, vb = ring_view(a), ring_view(b)
    return len(va) == len(vb) and a.offset == b.offset and all(
        (x is None and y is None) or (x is not None and y is not None and x.shape == y.shape and mx.array_equal(x, y).item())
        for x, y in zip(va, vb))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", ["extend", "merge"])
def test_quantized_rings_survive_join_decode_filter_and_extract_bit_for_bit(bits, mode):
    """Rows of 5, 3, 12 (wrapped) and 0 tokens, one prefilled in chunks: joined, stepped together past
    the window (every ring wraps in the batch), filtered, extracted: each row is the ring it would be
    alone, bit for bit, and nothing was dequantized (the parts stay uint32 / float)."""
    from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache

    solos = [qring(0, 5, bits), qring(1, 3, bits), qring(2, 12, bits), qring(3, 0, bits), qring(4, 11, bits, chunk=4)]
    ops = ROW_OPS["rotating"]
    assert all(layer_kind(s) == "rotating" for s in solos)
    b = ops.to_batch(solos[:2])
    assert isinstance(b, BatchQuantizedRotatingKVCache) and (b.bits, b.group_size) == (bits, 32)
    b = ops.join_batch(b, ops.to_batch(solos[2:]), mode)
    for i, s in enumerate(solos):
        assert ring_same(ops.extract(b, i), s), i
    assert b.keys[0].dtype == mx.uint32 and b.keys[1].dtype == mx.float32
    for step in range(W + 3):  # decode: every row wraps inside the batch
        ks = mx.concatenate([mx.random.normal((1, H, 1, QD), key=mx.random.key(90000 + 10 * step + i))
                             for i in range(len(solos))])
        b.update_and_fetch(ks, ks * 0.5)
        for i, s in enumerate(solos):
            s.update_and_fetch(ks[i : i + 1], ks[i : i + 1] * 0.5)
    for i, s in enumerate(solos):
        assert ring_same(ops.extract(b, i), s), i
    before = nbytes(b)
    b = ops.filter(b, [4, 2, 0])
    assert nbytes(b) < before
    for j, i in enumerate([4, 2, 0]):
        assert ring_same(ops.extract(b, j), solos[i]), i


def test_quantized_ring_cohort_roll_and_conversion_from_a_plain_ring():
    """A right-padded cohort step rolled to left padding keeps every row's tokens in order; a plain
    ring converted later (``from_plain``, single-row and batch) equals a ring quantized from the start."""
    from mlxb.cache.quantized_ring import BatchQuantizedRotatingKVCache, QuantizedRotatingKVCache

    ops = ROW_OPS["rotating"]
    c = ops.to_batch([qring(7, 6), qring(8, 2)])
    suffix = [3, 5]
    c.prepare(lengths=suffix, right_padding=[5 - n for n in suffix])
    k = mx.random.normal((2, H, 5, QD), key=mx.random.key(3))
    c.update_and_fetch(k, k * 0.5)
    c.finalize()
    for i, (n0, n) in enumerate(zip([6, 2], suffix)):
        ref = qring(7 + i, n0)
        ref.update_and_fetch(k[i : i + 1, :, :n], k[i : i + 1, :, :n] * 0.5)
        assert ring_same(ops.extract(c, i), ref), i
    plain = []
    for r, n in enumerate([11, 4]):
        p = RotatingKVCache(max_size=W)
        for pos in range(n):
            x = mx.random.normal((1, H, 1, QD), key=mx.random.key(r * 1000 + pos))
            p.update_and_fetch(x, x * 0.5)
        plain.append(p)
    for r, p in enumerate(plain):
        assert ring_same(QuantizedRotatingKVCache.from_plain(p, 32, 4), qring(r, [11, 4][r])), r
    batch = BatchQuantizedRotatingKVCache.from_plain(ROW_OPS["rotating"].to_batch(plain), 32, 4)
    for r in range(2):
        assert ring_same(ops.extract(batch, r), qring(r, [11, 4][r])), r


def test_quantized_ring_is_stored_as_mlx_lm_classes_and_comes_back(tmp_path):
    """The prompt cache's stored form (the SSD tier saves by class name) round-trips bit for bit."""
    from mlx_lm.models.cache import load_prompt_cache

    from mlxb.cache import snapshot as snap
    from mlxb.cache.prompt_cache import prepare_payload, write_payload

    ring = qring(5, 13, bits=8)
    stored = snap.snapshot(ring, "rotating")
    assert snap.is_stored_ring(stored) and snap.num_tokens(stored, "rotating") == 13
    f = str(tmp_path / "e.safetensors")
    write_payload(f, prepare_payload([stored]))
    (back,) = load_prompt_cache(f)
    assert snap.is_stored_ring(back) and snap.layer_nbytes(back) == ring.nbytes
    lent = snap.lend(back, "rotating", None)
    assert (lent.bits, lent.group_size) == (8, 32) and ring_same(lent, ring)


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
