"""Fused decode attention over full-precision KV for MLX's CUDA backend (``--kv-attention fused``).

MLX's CUDA attention takes its fused vector kernel only for calls without an array mask. A batch whose rows
have different lengths (left padding, speculative holes) always carries a boolean mask, so every decode step
of a continuous batch on CUDA runs MLX's unfused fallback: a batched product for the scores, the mask, a
softmax and a second product, per layer, with the scores through memory between them. On the H200 that read
cost 2.55 ms per 8B-shaped layer at B=32 over 8k keys, and copies of a 6k-token prefix for 32 rows made a
decode step 75 ms (reports/h100/session58/shared).

This is the split-key pass of ``quantized_attention`` for bf16/fp16/fp32 caches:

* ``mlxb_dattn_part``: one thread block per (chunk of ``C`` keys, KV head, row). A warp scores a key for every
  query head of its KV head (lanes across the head dimension, so the key's row is read coalesced), masked keys
  are skipped without being read, the chunk keeps its max and exp-sum, and the threads sum the values weighted
  by the chunk's probabilities. Queries, keys and values are read through their strides, so the model's
  transposed queries and the batch cache's view of its buffer (``keys[..., :idx, :]``) are read in place, never
  copied.
* A shared prefix (``mlxb.cache.shared``: one [1, H, P, D] copy read by every row whose flag is set) is just
  more chunks: the block of a prefix chunk reads the one copy; rows that do not share skip it.
* ``mlxb_qattn_join`` (``quantized_attention``'s): per (row, query head), rescale the chunks' partial sums
  by their maxima and divide by the total, in float32; rounded to the queries' dtype once.

It sums in float32 and in another order than MLX's kernels, so it is not bit-equal to mlx-lm's read (closer
to float32 attention: measured on an H100, docs/cuda.md): the library keeps MLX's read unless
``--kv-attention fused`` or the CLI's default ``auto`` on a CUDA device turns it on, and ``self_check`` compares it with MLX's float32 attention on
the device before any request can reach it. Up to 8 queries per row (a decode step, or a verify step's pending
token and drafts), grouped-query ratios up to 8,
head sizes 32/64/96/128/256, boolean masks as wide as the keys, MLX's causal string (or none); anything else keeps MLX's path. The
wrap of ``mx.fast.scaled_dot_product_attention`` is process-wide, but it routes only the forwards the engine builds
(``ours``, around ``Runner.fwd``), so mlx-lm's own models and caches in the same process keep MLX's read.
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from typing import Optional

import mlx.core as mx

from mlxb.kernels import cuda_gpu, kernel_name
from mlxb.kernels.dense_attention_source import PART as _PART  # the kernel body (CUDA source)
from mlxb.kernels.split_key import HEADER as _HEADER, JOIN as _JOIN, chunk_for

HEAD_DIMS = (32, 64, 96, 128, 256)  # multiples of the warp: a lane per 32nd dim when scoring
MAX_GROUP = 8  # query heads per KV head
MAX_QUERIES = 8  # per row: a decode step (1), a verify step (the pending token and up to 7 drafts)
MAX_ROWS = 32  # query rows per KV head in one block (heads x queries): registers and shared memory
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
NT = 128

_ORIGINAL = None  # MLX's (or the previous wrapper's) attention while ours is installed
_ON = False
_OURS = threading.local()  # set while this thread builds one of the engine's own forwards (``ours``)
_KERNELS: dict = {}
_DUMMY: dict = {}

INPUTS = ["q", "keys", "values", "mask", "pkeys", "pvalues", "share", "plan"]


def _kernels():
    if not _KERNELS:
        _KERNELS["part"] = mx.fast.cuda_kernel(
            name=kernel_name("mlxb_dattn_part", _HEADER, _PART), input_names=INPUTS, output_names=["o_part", "m_part", "l_part"],
            source=_PART, header=_HEADER, ensure_row_contiguous=False)
        _KERNELS["join"] = mx.fast.cuda_kernel(
            name=kernel_name("mlxb_dattn_join", _HEADER, _JOIN), input_names=["o_part", "m_part", "l_part"], output_names=["out"],
            source=_JOIN, header=_HEADER)
    return _KERNELS


def supports(q, k, v, mask) -> bool:
    """L <= MAX_QUERIES queries per row (a decode step, or a verify step's pending token and drafts) over
    [B, Hkv, N, D] keys and values of one float dtype, grouped-query ratio up to 8 (at most MAX_ROWS query rows per
    KV head), and a boolean mask [B|1, 1, L|1, N], MLX's bottom-right "causal", or none."""
    if not (isinstance(k, mx.array) and isinstance(v, mx.array)) or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    B, hq, L, D = q.shape
    if not 1 <= L <= MAX_QUERIES or D not in HEAD_DIMS or k.shape[-1] != D or v.shape[-1] != D or k.shape[:3] != v.shape[:3]:
        return False
    if k.shape[0] != B or hq % k.shape[1] or hq // k.shape[1] > MAX_GROUP or hq // k.shape[1] * L > MAX_ROWS:
        return False
    if smem_floats(hq // k.shape[1] * L, D, 64) > SMEM_FLOATS:  # a block's shared arrays at the smallest chunk
        return False
    if k.shape[2] < L or k.dtype not in FLOATS or q.dtype not in FLOATS:
        return False
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    return (isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[-1] == k.shape[2]
            and mask.shape[-2] in (1, L) and mask.shape[1] == 1 and mask.shape[0] in (1, B))


def supports_shared(q, own_k, own_v, prefix_k, prefix_v, mask) -> bool:
    """``supports`` for a shared-prefix layer: the prefix one [1, Hkv, P, D] copy of the own keys' heads."""
    return (supports(q, own_k, own_v, mask) and isinstance(prefix_k, mx.array) and prefix_k.ndim == 4
            and prefix_k.shape[0] == 1 and prefix_k.shape[1] == own_k.shape[1] and prefix_k.shape[-1] == own_k.shape[-1]
            and prefix_v.shape[:3] == prefix_k.shape[:3] and prefix_v.shape[-1] == own_v.shape[-1])


def smem_floats(rows: int, D: int, C: int) -> int:
    """The part kernel's static shared arrays, in floats: queries and the value pass's partial sums (rows x D
    each, the latter once per key slot), the chunk's probabilities (rows x C) and two per-row statistics."""
    slots = max(1, NT // D)
    return rows * D * (1 + slots) + rows * C + 2 * rows


SMEM_FLOATS = 48 * 1024 // 4  # CUDA's static shared memory per block


def chunk_max(rows: int, D: int) -> int:
    """The largest chunk of keys (256/128/64) whose shared arrays fit a block for ``rows`` query rows."""
    C = 256
    while C > 64 and smem_floats(rows, D, C) > SMEM_FLOATS:
        C //= 2
    return C


def launch_plan(B: int, hq: int, hkv: int, L: int, n: int, p: int, D: int, has_mask: bool, causal: bool,
                share_flags: bool, scale: float, dtype, kv_dtypes: Optional[tuple] = None) -> tuple[dict, dict]:
    """Template constants, grids (in threads, as ``cuda_kernel`` takes them), output shapes of the two kernels and
    the part kernel's ``plan`` (the shape of its plan input: the chunk of keys and the flags) for B rows of L queries
    over ``n`` own keys and a ``p``-key shared prefix; shared by ``fused_decode``, the warm-up and the CPU emulation
    test.

    The template holds only what the compiled code must know (head size, group, queries, the largest chunk, the
    element types of every float input: MLX names a compiled kernel by its template alone, so a kernel compiled for
    float32 inputs (the start-up self-check) would otherwise be reused for bfloat16 ones); the chunk and the flags
    vary per call without a new compile. ``kv_dtypes``: (keys, values, prefix keys, prefix values), default
    ``dtype``."""
    R = hq // hkv * L
    cmax = chunk_max(R, D)
    C = min(chunk_for(B * hkv, n + p), cmax)
    nc = math.ceil(p / C) + math.ceil(n / C)
    scale_bits = struct.unpack("<i", struct.pack("<f", float(scale)))[0]
    tk, tv, tpk, tpv = kv_dtypes or (dtype,) * 4
    part = dict(template=[("D", D), ("G", hq // hkv), ("L", L), ("CMAX", cmax), ("NT", NT), ("SCALE_BITS", scale_bits),
                          ("TQ", dtype), ("TK", tk), ("TV", tv), ("TPK", tpk), ("TPV", tpv)],
                grid=(nc * NT, hkv, B), threadgroup=(NT, 1, 1),
                output_shapes=[(B, hq * L, nc, D), (B, hq * L, nc), (B, hq * L, nc)])
    flags = int(has_mask) | 2 * int(causal) | 4 * int(p > 0) | 8 * int(share_flags)
    part["plan"] = (C, 1 + flags)
    join = dict(template=[("T", dtype)], grid=(B * hq * L * D, 1, 1), threadgroup=(D, 1, 1),
                output_shapes=[(B, hq, L, D)])
    return part, join


def kernel_inputs(q, k, v, mask, prefix: Optional[tuple]) -> tuple[list, bool, bool, bool, int]:
    """The part kernel's inputs (unused ones as one-element stand-ins), whether it masks, whether it is causal,
    whether it reads rows' share flags, and the prefix length."""
    B, L, n = q.shape[0], q.shape[2], k.shape[2]
    if "bool" not in _DUMMY:
        _DUMMY["bool"] = mx.array([True])
    D = q.shape[-1]
    if D not in _DUMMY:
        _DUMMY[D] = mx.zeros((1, 1, 1, D))
    has_mask = isinstance(mask, mx.array)
    causal = isinstance(mask, str) and L > 1  # one query sees every key: causal is no mask
    m2 = _flat_mask(mask, B, L, n) if has_mask else _DUMMY["bool"]
    if prefix is None:
        pk = pv = _DUMMY[D]
        share, p = None, 0
    else:
        pk, pv, share = prefix
        p = pk.shape[2]
    flags = share is not None
    # every input is handed over as it lies (ensure_row_contiguous=False): q, k, v and the prefix are read through
    # their strides, the mask is flattened above, and the share flags are made contiguous here
    return [q, k, v, m2, pk, pv, _once("share", share, mx.contiguous) if flags else _DUMMY["bool"]], has_mask, causal, flags, p


def _once(name: str, a, make, shape: tuple = ()):
    """``make(a)``, made once for the same array object and ``shape`` (every layer of a forward is handed the same
    one); only the latest is kept."""
    last = _DUMMY.get(name)
    if last is None or last[0] is not a or last[1] != shape:
        last = _DUMMY[name] = (a, shape, make(a))
    return last[2]


def _flat_mask(mask, B: int, L: int, n: int):
    """The mask as the kernel reads it, [B, L, n] contiguous: made once per forward (every layer of a model is
    handed the same mask array), not once per layer."""
    return _once("mask", mask, lambda m: mx.contiguous(mx.broadcast_to(m, (B, 1, L, n)).reshape(B, L, n)), (B, L, n))


def fused_decode(q, k, v, scale: float, mask=None, prefix: Optional[tuple] = None):
    """Attention of L queries per row: q [B, Hq, L, D] over k/v [B, Hkv, N, D] (strided views are read in place),
    ``mask`` a bool [B|1, 1, L|1, N], "causal" (the queries are the last L keys) or None, and ``prefix`` = (keys
    [1, Hkv, P, D], values, share flags [B] bool or None for every row) read by the rows that share it.
    Returns [B, Hq, L, D]."""
    B, hq, L, D = q.shape
    inputs, has_mask, causal, flags, p = kernel_inputs(q, k, v, mask, prefix)
    part, join = launch_plan(B, hq, k.shape[1], L, k.shape[2], p, D, has_mask, causal, flags, scale, q.dtype,
                             (k.dtype, v.dtype, inputs[4].dtype, inputs[5].dtype))
    plan = part.pop("plan")
    if ("plan", plan) not in _DUMMY:
        _DUMMY[("plan", plan)] = mx.zeros(plan, dtype=mx.bool_)
    kern = _kernels()
    o_part, m_part, l_part = kern["part"](inputs=inputs + [_DUMMY[("plan", plan)]], output_dtypes=[mx.float32] * 3,
                                          **part)
    (out,) = kern["join"](inputs=[o_part, m_part, l_part], output_dtypes=[q.dtype], **join)
    return out


def reference(q, k, v, scale: float, mask=None, prefix: Optional[tuple] = None):
    """The same attention in float32 through plain ops (the self-check's and the tests' reference)."""
    f = mx.float32
    q, k, v = q.astype(f), k.astype(f), v.astype(f)
    B, hq, L, D = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if isinstance(mask, mx.array):
        keep = mx.broadcast_to(mask, (B, 1, L, n))
    elif isinstance(mask, str):  # MLX's bottom-right causal: query i sees keys up to n - L + i
        keep = mx.broadcast_to((mx.arange(n)[None] <= (n - L + mx.arange(L))[:, None])[None, None], (B, 1, L, n))
    else:
        keep = mx.ones((B, 1, L, n), dtype=mx.bool_)
    if prefix is not None:
        pk, pv, share = prefix
        P = pk.shape[2]
        k = mx.concatenate([mx.broadcast_to(pk.astype(f), (B, hkv, P, D)), k], axis=2)
        v = mx.concatenate([mx.broadcast_to(pv.astype(f), (B, hkv, P, D)), v], axis=2)
        flags = mx.ones((B,), dtype=mx.bool_) if share is None else share
        keep = mx.concatenate([mx.broadcast_to(flags[:, None, None, None], (B, 1, L, P)), keep], axis=-1)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=keep) if _ORIGINAL is None else \
        _ORIGINAL(q, k, v, scale=scale, mask=keep)


def self_check(tol: float = 1e-4) -> float:
    """The kernel on small float32 cases (left padding, an unwritten buffer tail read through a strided view,
    several chunks, grouped queries, a shared prefix that one row does not read, a verify step's 5 causal queries)
    against ``reference`` on this
    device. Raises ValueError naming the fix if it fails to compile or disagrees; returns the max difference."""
    err = 0.0
    for B, hq, hkv, D, n, width, P, L, seed in ((2, 8, 2, 128, 300, 384, 0, 1, 11), (3, 4, 4, 64, 90, 128, 200, 1, 12),
                                                (2, 8, 2, 128, 150, 256, 100, 5, 13)):
        ks = mx.random.split(mx.random.key(seed), 6)
        q = mx.random.normal((B, hq, L, D), key=ks[0])
        kb = mx.random.normal((B, hkv, width, D), key=ks[1])
        vb = mx.random.normal((B, hkv, width, D), key=ks[2])
        k, v = kb[:, :, :n], vb[:, :, :n]  # a view of a wider buffer, as the batch caches hand it over
        pos = mx.arange(n)
        left = mx.array([(i * 37) % (n // 2) for i in range(B)])
        mask = (pos[None, None] >= left[:, None, None]) & (pos[None, None] <= (n - L + mx.arange(L))[None, :, None])
        mask = mask.reshape(B, 1, L, n)  # left padding, and causal among a verify step's queries
        prefix = None
        if P:
            prefix = (mx.random.normal((1, hkv, P, D), key=ks[3]), mx.random.normal((1, hkv, P, D), key=ks[4]),
                      mx.array([i != 1 for i in range(B)]))
        try:
            got = fused_decode(q, k, v, D ** -0.5, mask, prefix)
            want = reference(q, k, v, D ** -0.5, mask, prefix)
            err = max(err, mx.abs(got - want).max().item())
        except Exception as e:  # a compile or launch failure on this device
            raise ValueError(f"--kv-attention fused: the dense decode kernel failed on this device ({e}); "
                             "use --kv-attention mlx-lm") from e
    if not err <= tol:
        raise ValueError(f"--kv-attention fused: the dense decode kernel disagrees with float32 attention on this "
                         f"device (max |diff| {err:.3g} > {tol:g}); use --kv-attention mlx-lm")
    return err


def takes(q, mask) -> bool:
    """Calls MLX's own CUDA attention would not read in one pass: an array mask (its vector kernel takes none), or
    4+ causal queries (it takes fewer than 4). Unmasked decode and short causal calls keep its vector kernel."""
    return isinstance(mask, mx.array) or (isinstance(mask, str) and q.shape[2] >= 4)


_SEEN: set = set()  # (Hq, Hkv, D, q/k/v dtypes, scale) of the engine's calls that took the kernel


def _dispatch(q, k, v, *, scale, mask=None, sinks=None, **kw):
    if active() and sinks is None and not kw and takes(q, mask) and supports(q, k, v, mask):
        _SEEN.add((q.shape[1], k.shape[1], q.shape[-1], q.dtype, k.dtype, v.dtype, float(scale)))
        return fused_decode(q, k, v, scale, mask)
    return _ORIGINAL(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


def warm_variants(prefix: bool = False, queries: int = MAX_QUERIES) -> int:
    """Compile, before traffic, the kernel for each query count up to ``queries`` (1: decode; a verify step's pending
    token and drafts) for each attention shape the engine's forwards have sent (``_SEEN``, filled by the start-up
    warm-up), and with a shared prefix too where ``prefix``. A variant not made here cost the request that first
    needed it 1.2-2.2 s on an H100 (the agent loop, stop 65: about 1.2 s a variant even in a second process, so
    MLX's on-disk cache of compiled kernels saves little of it). Returns the variants run."""
    ran = []
    for hq, hkv, D, tq, tk, tv, scale in sorted(_SEEN, key=str):
        for L in range(1, min(queries, MAX_QUERIES) + 1):
            q = mx.zeros((1, hq, L, D), dtype=tq)
            k, v = mx.zeros((1, hkv, L, D), dtype=tk), mx.zeros((1, hkv, L, D), dtype=tv)
            mask = mx.ones((1, 1, L, L), dtype=mx.bool_)
            if not supports(q, k, v, mask):
                continue
            ran.append(fused_decode(q, k, v, scale, mask))
            if prefix:  # the shared prefix's copy in the keys' and the values' dtypes
                ran.append(fused_decode(q, k, v, scale, mask, (k, v, mx.ones((1,), dtype=mx.bool_))))
    mx.eval(ran)
    return len(ran)


def enabled() -> bool:
    """Whether ``--kv-attention fused`` is on in this process (the engine's forwards may take the kernel)."""
    return _ON


def active() -> bool:
    """Whether this attention call takes the kernel: ``--kv-attention fused`` is on and the call belongs to one of
    the engine's forwards (``ours``), so mlx-lm code in the same process (the peer arm of ``bench engine``, a
    parity oracle) keeps MLX's read."""
    return _ON and getattr(_OURS, "on", False)


@contextlib.contextmanager
def ours():
    """Mark the forward this thread builds inside the block as the engine's (see ``active``)."""
    if not _ON:
        yield
        return
    before = getattr(_OURS, "on", False)
    _OURS.on = True
    try:
        yield
    finally:
        _OURS.on = before


def set_enabled(on: bool) -> None:
    """Turn the kernel on (after ``self_check``; CUDA only) or off. The wrap stays installed once made; off, it
    passes every call through."""
    global _ON, _ORIGINAL
    if on:
        if not cuda_gpu():
            raise ValueError("--kv-attention fused needs MLX's CUDA backend (a CUDA GPU as the default device); "
                             "on this backend use --kv-attention mlx-lm")
        if _ORIGINAL is None:
            _ORIGINAL = mx.fast.scaled_dot_product_attention
            mx.fast.scaled_dot_product_attention = _dispatch
        _ON = False  # until the check passes
        self_check()
    _ON = on
