"""The cache contract for speculative rollback: rejected entries as masked holes, compaction into the
left padding, and the trimmed compaction of adaptive speculation (split from test_contract.py, whose
row helpers it uses)."""

import mlx.core as mx
import numpy as np
import pytest

from mlxb.cache.protocol import ROW_OPS
from tests.cache.test_contract import D_, H, kv_solo, same
from tests.cache.test_contract_quantized import QD, q_same, q_solo


# ---- speculative rollback: rejected entries as holes (mlxb/cache/holes.py) -------------------------
@pytest.mark.parametrize("quantized", [False, True])
def test_holes_hide_rejected_entries_and_compaction_gives_each_row_back(quantized):
    """Rows write 1 + W entries, keep 1 + a_i: after marking holes, the attention mask hides exactly the
    rejected columns, and extract (which compacts) gives each row as if only its kept entries had been
    written, bit for bit; the RoPE offsets count kept entries only."""
    from mlxb.cache.holes import mark_holes

    lengths, kept, W = [5, 3, 9], [2, 0, 3], 3
    mk = (lambda r, n: q_solo(r, n)) if quantized else (lambda r, n: kv_solo(r, n))
    solos = [mk(r, n) for r, n in enumerate(lengths)]
    ops = ROW_OPS["full"]
    b = ops.to_batch(solos)
    D = QD if quantized else D_
    step = mx.stack([mx.random.normal((H, 1 + W, D), key=mx.random.key(50 + r)) for r in range(3)])
    b.update_and_fetch(step, step * 0.5)
    mark_holes(b, [W - a for a in kept])
    assert b.offset.tolist() == [n + 1 + a for n, a in zip(lengths, kept)]
    mask = b.make_mask(1)
    width = b._idx + 1
    for r, (n, a) in enumerate(zip(lengths, kept)):
        visible = np.array(mask[r, 0, 0]).tolist()
        want = [False] * (width - 1 - (n + 1 + W)) + [True] * (n + 1 + a) + [False] * (W - a) + [True]
        assert visible == want, r
    rows_back(b, lengths, kept, step, mk, quantized)


def rows_back(b, lengths, kept, step, mk, quantized) -> None:
    """Each row extracted from ``b`` equals its solo cache (``mk``) that wrote only its kept entries."""
    for r, (n, a) in enumerate(zip(lengths, kept)):
        ref = mk(r, n)
        ref.update_and_fetch(step[r : r + 1, :, : 1 + a], step[r : r + 1, :, : 1 + a] * 0.5)
        got = ROW_OPS["full"].extract(b, r)
        if quantized:
            assert q_same(got, ref), r
        else:
            assert same([got.keys[..., : got.offset, :]], [ref.keys[..., : ref.offset, :]]), r
            assert same([got.values[..., : got.offset, :]], [ref.values[..., : ref.offset, :]]), r


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("lengths,kept,W,m", [([4, 4, 4], [1, 1, 1], 3, 2), ([5, 5, 7], [1, 2, 0], 2, 2),
                                              ([5, 3, 9], [2, 0, 3], 3, 0)])
def test_trimmed_compaction_drops_only_the_padding_every_row_shares(quantized, lengths, kept, W, m):
    """Compaction with ``trim`` (adaptive speculation before plain steps) also drops the ``m`` columns
    that are padding or holes in every row: the buffer index goes back by ``m``, a batch whose rows kept
    as many entries has no padding left, each row's visible keys are those of the untrimmed compaction,
    and extract gives each row back bit for bit."""
    from mlxb.cache.holes import compact, compaction, mark_holes

    mk = (lambda r, n: q_solo(r, n)) if quantized else (lambda r, n: kv_solo(r, n))
    ops = ROW_OPS["full"]
    D = QD if quantized else D_
    step = mx.stack([mx.random.normal((H, 1 + W, D), key=mx.random.key(70 + r)) for r in range(3)])
    built = []
    for trim in (False, True):
        b = ops.to_batch([mk(r, n) for r, n in enumerate(lengths)])
        b.update_and_fetch(step, step * 0.5)
        mark_holes(b, [W - a for a in kept])
        plan = compaction(b, trim=trim)
        assert plan[2] == (m if trim else 0)
        compact(b, plan)
        built.append(b)
    plain, trimmed = built
    assert trimmed._idx == plain._idx - m
    assert (np.array(trimmed.left_padding) == np.array(plain.left_padding) - m).all()
    if len(set(n + a for n, a in zip(lengths, kept))) == 1:
        assert np.array(trimmed.left_padding).max() == 0  # equal rows: no padding left (aligned again)
    assert (np.array(trimmed.make_mask(1, return_array=True))[..., :] ==
            np.array(plain.make_mask(1, return_array=True))[..., m:]).all()
    rows_back(trimmed, lengths, kept, step, mk, quantized)
