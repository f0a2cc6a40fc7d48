"""Pieces shared by mlxb's split-key decode attention kernels (``quantized_attention`` over packed KV,
``dense_attention`` over full-precision KV): a chunk of keys per thread block keeps its scores' max and
exp-sum (``CHUNK_STATS``), and ``JOIN`` combines the chunks of each (row, query) by their maxima in float32."""

from __future__ import annotations

import math

HEADER = r"""
#define MLXB_NEG_INF (-cuda::std::numeric_limits<float>::infinity())
"""

# Per query row r (R rows per block), the max of the chunk's scores ps[r][:C], the
# scores turned into exp(s - max) in place, and their sum, one warp per row (mstat, lstat).
CHUNK_STATS = r"""
  // phase 2: the chunk's max and exp-sum per query head (one warp per head)
  for (int r = warp; r < R; r += NT / 32) {
    float m = MLXB_NEG_INF;
    for (int k = lane; k < C; k += 32) m = fmaxf(m, ps[r][k]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    for (int k = lane; k < C; k += 32) {
      const float p = (m == MLXB_NEG_INF) ? 0.f : expf(ps[r][k] - m);
      ps[r][k] = p;
      l += p;
    }
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) { mstat[r] = m; lstat[r] = l; }
  }
  __syncthreads();

"""

# The block's outputs: query row r's partial sum (the value pass's J key slots added up from red[J][R][D]), max and
# exp-sum for chunk c, at row hq0 + r of the (row, query) rows the join reads.
WRITE_PARTS = r"""
  for (int i = t; i < R * D; i += NT) {
    float s = 0.f;
    for (int jj = 0; jj < J; ++jj) s += red[jj * R * D + i];
    const int r = i / D, d = i % D;
    o_part[((hq0 + r) * NC + c) * D + d] = s;
  }
  if (t < R) {
    m_part[(hq0 + t) * NC + c] = mstat[t];
    l_part[(hq0 + t) * NC + c] = lstat[t];
  }
"""

JOIN = r"""
  const int bh = blockIdx.x, d = threadIdx.x;
  const int NC = m_part_shape[2];
  const int D = o_part_shape[3];
  float M = MLXB_NEG_INF;
  for (int c = 0; c < NC; ++c) M = fmaxf(M, m_part[(size_t)bh * NC + c]);
  float num = 0.f, den = 0.f;
  if (M != MLXB_NEG_INF) {
    for (int c = 0; c < NC; ++c) {
      const float w = expf(m_part[(size_t)bh * NC + c] - M);
      num += w * o_part[((size_t)bh * NC + c) * D + d];
      den += w * l_part[(size_t)bh * NC + c];
    }
  }
  out[(size_t)bh * D + d] = static_cast<T>(den > 0.f ? num / den : 0.f);
"""


def chunk_for(blocks_per_chunk: int, n: int) -> int:
    """Keys per block: the largest of 256/128/64 that still gives the GPU a few blocks per SM."""
    for c in (256, 128):
        if blocks_per_chunk * math.ceil(n / c) >= 512:
            return c
    return 64
