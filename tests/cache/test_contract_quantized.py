"""The cache contract for quantized layers (``--kv-bits``): quantized full attention and quantized sliding-window
rings survive merge, extend, filter, the cohort roll and extraction bit for bit (split from test_contract.py)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from mlxb.cache.protocol import ROW_OPS, layer_kind, nbytes
from tests.cache.test_contract import H, W, kv_solo

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
