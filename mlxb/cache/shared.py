"""Shared-prefix KV: one copy of a prompt prefix per layer, read once per step by every row that uses it.

A fleet of agents is many rows whose prompts open with the same long prefix (system prompt, tool schemas).
Without sharing each row holds a copy of that prefix in the batch buffer and every step reads all copies.

Layout (one full-attention layer):

* ``SharedPrefix``: the prefix's keys and values, ``[1, H, P, D]``, written once and never mutated; its
  token ids say which prompts it serves.
* ``SharedBatchKVCache``: an ``AlignedBatchKVCache`` (left-padded, mlx-lm's row operations) that holds each
  row's *own* tokens only. A sharing row's first ``P`` tokens count as left padding (they are masked in the
  row's own buffer and are dropped by the next trim); its ``offset`` (RoPE position) stays the true position,
  ``P`` + own tokens. ``share`` (host list, one flag per row) says which rows read the prefix.

Attention over shared + own (``cascade_attention``): the queries of every row are scored against the prefix
keys in one matrix product (the prefix is read once for all rows), each row's queries against its own keys
as before; the two score blocks are joined per row (non-sharing rows see the prefix block masked) and
normalised by one softmax, which is the log-sum-exp merge of the two partial softmaxes; the weighted sum is
the prefix part plus the own part, each summed in float32 and rounded to the input dtype once. It mirrors
MLX's unfused attention (scores in the input dtype, a precise softmax, masked scores at the dtype's minimum,
a product that accumulates in float32), so the only difference from attention over a copied prefix is the
order of the float32 sum: logits agree with mlx-lm's to the last bits (the ``shared`` parity case states the
envelope).

The layer hands attention a ``SharedKV`` (own keys, prefix keys, share flags) in place of its keys; the
dispatcher ``install()`` puts in front of ``mx.fast.scaled_dot_product_attention`` (mlx-lm's attention calls it
by attribute) routes only such calls; every other call, mlx-lm's own caches in the same process included,
goes to MLX unchanged. Models whose attention does not go through that function (scores computed by hand)
cannot read a shared layer: ``probe`` finds that at start-up and sharing stays off for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlxb.cache.dense import AlignedBatchKVCache
from mlxb.cache.holes import compact
from mlxb.kernels import dense_attention


@dataclass(eq=False)
class SharedPrefix:
    """One layer's copy of a shared prefix (never mutated; freed when no layer references it)."""

    keys: mx.array  # [1, H, P, Dk]
    values: mx.array  # [1, H, P, Dv]
    values32: Optional[mx.array] = None  # the values in float32 for the weighted sum (half-precision models)
    # keep that float32 copy: made once here instead of cast at every step (a step then reads 2 bytes a value
    # more instead of casting them all), at twice the values' memory. Without it the cascade casts per step;
    # the float32 values are the same, so the results are the same bits
    keep_f32: bool = True

    def __post_init__(self):
        if self.values.dtype != mx.float32 and self.keep_f32:
            self.values32 = mx.contiguous(self.values.astype(mx.float32))

    @property
    def n(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (self.values32.nbytes if self.values32 is not None else 0)


class SharedKV(tuple):
    """(own [B, H, T, D], prefix [1, H, P, D], share [B] bool or None when every row shares): what a shared
    layer hands attention."""


class SharedBatchKVCache(AlignedBatchKVCache):
    """A full-attention batch layer whose sharing rows read one ``SharedPrefix`` (see the module notes)."""

    # while rows read a prefix, the own buffer grows in steps of 64 tokens, not mlx-lm's 256: a reader's own part is
    # short (its task, its reply), so at 256 the unused columns would outweigh it, and admission charges every
    # reader that width. With no prefix it grows as mlx-lm's does (a smaller step regrows, and copies, 4x as often)
    OWN_STEP = 64
    prefix: Optional[SharedPrefix] = None
    share: list = []  # host flags, one per row
    _share_arr: Optional[mx.array] = None
    offset_fault = 0  # planted fault (parity negative control): sharing rows' positions off by this

    @classmethod
    def wrap(cls, c: AlignedBatchKVCache) -> "SharedBatchKVCache":
        """The same rows (no copy) as a shared layer with no prefix yet."""
        s = cls.__new__(cls)
        s.__dict__.update(c.__dict__)
        s.share = [False] * int(c.offset.shape[0])
        s.prefix, s._share_arr = None, None
        return s

    @property
    def step(self) -> int:
        return self.OWN_STEP if self.prefix is not None else AlignedBatchKVCache.step

    @property
    def sharing(self) -> bool:
        return self.prefix is not None and any(self.share)

    def _flags(self) -> Optional[mx.array]:
        """The rows' flags as an array, or None when every row reads the prefix (no mask to apply)."""
        if all(self.share):
            return None
        if self._share_arr is None or self._share_arr.shape[0] != len(self.share):
            self._share_arr = mx.array(self.share, dtype=mx.bool_)
        return self._share_arr

    def update_and_fetch(self, keys, values):
        k, v = super().update_and_fetch(keys, values)
        if not self.sharing:
            return k, v
        flags = self._flags()
        vp = self.prefix.values if self.prefix.values32 is None else self.prefix.values32
        return SharedKV((k, self.prefix.keys, flags)), SharedKV((v, vp, flags))

    # ---- sharing ---------------------------------------------------------------------------
    def share_rows(self, rows: list[int], prefix: SharedPrefix) -> None:
        """Rows ``rows`` (whose first ``prefix.n`` cached tokens are the prefix's) read ``prefix`` from now
        on: those tokens become left padding and the padding every row then has leaves the buffer."""
        if not rows:
            return
        if self.prefix is not None and self.prefix is not prefix and self.sharing:
            raise ValueError("a batch layer shares one prefix at a time")
        compact(self)
        lp = self.left_padding.tolist()
        for i in rows:
            if self.share[i]:
                raise ValueError(f"row {i} already reads the shared prefix")
            lp[i] += prefix.n
            self.share[i] = True
        self.prefix, self._share_arr = prefix, None
        if self.offset_fault:
            self.offset = self.offset - mx.array([self.offset_fault if i in rows else 0 for i in range(len(lp))])
        self.left_padding = mx.array(lp)
        self._trim(min(lp))

    def unshare(self) -> "AlignedBatchKVCache":
        """Every row's whole history in an ordinary batch layer (a copy)."""
        rows = [self.extract(i) for i in range(len(self.share))]
        return AlignedBatchKVCache.merge(rows)

    def _trim(self, m: int) -> None:
        if m <= 0 or self.keys is None:
            return
        self.keys = mx.contiguous(self.keys[..., m:, :])
        self.values = mx.contiguous(self.values[..., m:, :])
        self._idx -= m
        self.left_padding = self.left_padding - m

    # ---- row operations --------------------------------------------------------------------
    def filter(self, batch_indices):
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        super().filter(batch_indices)
        self.share = [self.share[i] for i in keep]
        self._share_arr = None
        if not any(self.share):
            self.prefix = None  # the last row that read it left: the prefix is freed with its references

    def extend(self, other):
        theirs = list(getattr(other, "share", None) or [False] * int(other.offset.shape[0]))
        if any(theirs) and self.sharing and other.prefix is not self.prefix:
            raise ValueError("rows of different shared prefixes cannot share one batch layer")
        super().extend(other)
        if any(theirs):
            self.prefix = other.prefix
        self.share = list(self.share) + theirs
        self._share_arr = None

    def extract(self, idx):
        c = super().extract(idx)
        if self.share[idx]:
            c.keys = mx.concatenate([self.prefix.keys, c.keys], axis=2)
            c.values = mx.concatenate([self.prefix.values, c.values], axis=2)
            c.offset = c.keys.shape[2]
        return c

    @property
    def nbytes(self) -> int:
        own = 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
        return own + (self.prefix.nbytes if self.sharing else 0)

    @property
    def shared_bytes(self) -> int:
        return self.prefix.nbytes if self.sharing else 0


def prefix_of(c: AlignedBatchKVCache, row: int, n: int, keep_f32: bool = True) -> SharedPrefix:
    """Row ``row``'s first ``n`` cached tokens as a prefix of their own (a copy, so the batch buffer can
    drop them)."""
    compact(c)
    p = int(c.left_padding[row].item())
    k = mx.contiguous(c.keys[row : row + 1, :, p : p + n])
    v = mx.contiguous(c.values[row : row + 1, :, p : p + n])
    return SharedPrefix(k, v, keep_f32=keep_f32)


# ---- attention -----------------------------------------------------------------------------
def cascade_attention(q: mx.array, keys: SharedKV, values: SharedKV, scale: float, mask=None,
                      merge_fault: bool = False) -> mx.array:
    """Attention of ``q`` [B, Hq, N, D] over a shared prefix (rows with their flag set; every row when the flags
    are None) and each row's own keys (``mask``: None, "causal" or the own keys' [B, 1|Hq, N, T] mask), as one
    softmax per row. The prefix operand is broadcast over the rows (one [1, H, P, D] array, stride 0), so the
    products read it once per step whatever the number of rows. ``merge_fault`` (parity negative control
    only): the two blocks normalised apart and summed, the log-sum-exp weighting dropped."""
    ks, kp, share = keys
    vs, vp = values[0], values[1]
    B, Hq, N, D = q.shape
    H, T, P = ks.shape[1], ks.shape[2], kp.shape[2]
    G = Hq // H
    dt = q.dtype
    q = (q * mx.array(scale, dtype=dt)).reshape(B, H, G * N, D)
    low = mx.array(mx.finfo(dt).min, dtype=dt)
    sp = q @ kp.swapaxes(-1, -2)  # [B, H, G*N, P]
    if share is not None:
        sp = mx.where(share[:, None, None, None], sp, low)
    ss = q @ ks.swapaxes(-1, -2)  # [B, H, G*N, T]
    if isinstance(mask, str):
        mask = (mx.arange(T - N, T)[:, None] >= mx.arange(T)[None])[None, None]
    if mask is not None:
        m = mask.reshape(mask.shape[0], H, G, N, T) if mask.shape[1] == Hq else mx.expand_dims(mask, 2)
        ss = ss.reshape(B, H, G, N, T)
        ss = (mx.where(m, ss, low) if m.dtype == mx.bool_ else ss + m.astype(dt)).reshape(B, H, G * N, T)
    if merge_fault:
        pp, ps = mx.softmax(sp, axis=-1, precise=True), mx.softmax(ss, axis=-1, precise=True)
    else:
        probs = mx.softmax(mx.concatenate([sp, ss], axis=-1), axis=-1, precise=True)
        pp, ps = probs[..., :P], probs[..., P:]
    if dt == mx.float32:
        out = pp @ vp + ps @ vs
    else:  # the two partial sums in float32, rounded to the input dtype once, as the single product over copies is
        f32 = mx.float32
        out = (pp.astype(f32) @ vp.astype(f32) + ps.astype(f32) @ vs.astype(f32)).astype(dt)  # vp: float32 already
    return out.reshape(B, Hq, N, -1)


_PREVIOUS = None
MERGE_FAULT = False  # parity negative control only (``mlxb parity --fault shared_merge``)


def _dispatch(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if isinstance(k, SharedKV):
        if sinks is not None or kw:
            raise ValueError("a shared-prefix layer cannot serve attention with sinks")
        if dense_attention.active() and not MERGE_FAULT and dense_attention.supports_shared(q, k[0], v[0], k[1], v[1], mask):
            # --kv-attention fused (CUDA): the prefix's chunks and the own keys' in one split-key pass
            return dense_attention.fused_decode(q, k[0], v[0], scale, mask, prefix=(k[1], v[1], k[2]))
        return cascade_attention(q, k, v, scale, mask, MERGE_FAULT)
    return _PREVIOUS(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


def install() -> None:
    """Route attention over shared layers through ``cascade_attention`` (idempotent, process-wide)."""
    global _PREVIOUS
    if _PREVIOUS is None:
        _PREVIOUS = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _dispatch


def installed() -> bool:
    return _PREVIOUS is not None
