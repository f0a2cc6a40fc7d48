"""The CUDA source of ``dense_attention``'s split-key pass (``mlxb_dattn_part``), kept apart from the host code
that plans, launches, checks and routes it (``mlxb.kernels.dense_attention``). One thread block per (chunk of keys,
KV head, row); a shared prefix is more chunks; the partial sums go to ``split_key``'s join. The CPU emulation in
the tests runs this same text."""

from mlxb.kernels.split_key import CHUNK_STATS, WRITE_PARTS

PART = r"""
  // the call's chunk of keys and flags come through the plan input's shape, not as template constants: one
  // compiled variant serves every batch size, key count, mask kind and prefix (each variant costs a compile)
  const int C = plan_shape[0];             // keys per block, at most CMAX
  const int FL = plan_shape[1] - 1;
  const bool HAS_MASK = FL & 1, CAUSAL = FL & 2, HAS_PREFIX = FL & 4, SHARE_FLAGS = FL & 8;
  constexpr int R = G * L;                 // query rows per KV head: its G query heads x the row's L queries
  constexpr int NW = NT / 32;              // warps: each scores one key at a time
  constexpr int DL = D / 32;               // dims per lane in the score pass
  constexpr int TPS = NT < D ? NT : D;     // threads per key slot in the value pass
  constexpr int J = NT / TPS;              // key slots in the value pass
  constexpr int DT = D / TPS;              // dims per thread in the value pass
  __shared__ float qs[R * D];
  __shared__ float red[J * R * D];
  __shared__ float ps[R][CMAX];
  __shared__ float mstat[R], lstat[R];
  const float scale = __int_as_float(SCALE_BITS);
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int Hkv = keys_shape[1], N = keys_shape[2];
  const int P = HAS_PREFIX ? pkeys_shape[2] : 0;
  const int NCP = (P + C - 1) / C;
  const int NC = NCP + (N + C - 1) / C;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const size_t hq0 = ((size_t)b * Hkv + h) * R;  // this KV head's first query row (b, head, query), flattened
  const bool pre = c < NCP;                      // a chunk of the shared prefix
  const int k0 = (pre ? c : c - NCP) * C;
  const int n = pre ? P : N;

  if (pre && SHARE_FLAGS && !share[b]) {  // this row does not read the prefix: an empty chunk
    for (int i = t; i < R * D; i += NT) o_part[((hq0 + i / D) * NC + c) * D + i % D] = 0.f;
    if (t < R) { m_part[(hq0 + t) * NC + c] = MLXB_NEG_INF; l_part[(hq0 + t) * NC + c] = 0.f; }
    return;
  }
  // element offsets: this (row, KV head) of the own keys, this KV head of the prefix (one copy for every row)
  const int64_t kh = (int64_t)b * keys_strides[0] + (int64_t)h * keys_strides[1];
  const int64_t vh = (int64_t)b * values_strides[0] + (int64_t)h * values_strides[1];
  const int64_t pkh = HAS_PREFIX ? (int64_t)h * pkeys_strides[1] : 0;
  const int64_t pvh = HAS_PREFIX ? (int64_t)h * pvalues_strides[1] : 0;

  for (int i = t; i < R * D; i += NT) {  // query row r = (head g of this KV head, query j), read through q's strides
    const int r = i / D, d = i % D, g = r / L, j = r % L;
    qs[i] = static_cast<float>(q[(int64_t)b * q_strides[0] + (int64_t)(h * G + g) * q_strides[1]
                                 + (int64_t)j * q_strides[2] + (int64_t)d * q_strides[3]]) * scale;
  }
  __syncthreads();

  // phase 1: scores; a warp per key, its lanes across the head dimension
  for (int kk = warp; kk < C; kk += NW) {
    const int k = k0 + kk;
    bool see[L];  // which of the row's queries see key k: the prefix all; own keys by the mask and causality
    bool live = false;
#pragma unroll
    for (int i = 0; i < L; ++i) {
      see[i] = k < n;
      if (see[i] && !pre && HAS_MASK) see[i] = mask[((size_t)b * L + i) * N + k];
      if (see[i] && !pre && CAUSAL) see[i] = k <= N - L + i;
      live = live || see[i];
    }
    float dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) dot[r] = 0.f;
    if (live) {  // the same for the whole warp
#pragma unroll
      for (int i = 0; i < DL; ++i) {
        const int d = lane + 32 * i;
        const float x = pre
            ? static_cast<float>(pkeys[pkh + (int64_t)k * pkeys_strides[2] + (int64_t)d * pkeys_strides[3]])
            : static_cast<float>(keys[kh + (int64_t)k * keys_strides[2] + (int64_t)d * keys_strides[3]]);
#pragma unroll
        for (int r = 0; r < R; ++r) dot[r] += qs[r * D + d] * x;
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
        for (int o = 16; o > 0; o >>= 1) dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < R; ++r) ps[r][kk] = see[r % L] ? dot[r] : MLXB_NEG_INF;
    }
  }
  __syncthreads();

""" + CHUNK_STATS + r"""
  // phase 3: probability-weighted values; consecutive threads own consecutive dims (coalesced rows)
  const int j = t / TPS, dl = t % TPS;
  float acc[R][DT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int x = 0; x < DT; ++x) acc[r][x] = 0.f;
  for (int kk = j; j < J && kk < C; kk += J) {  // (D = 96: the threads past J slots of D sit this out)
    const int k = k0 + kk;
    if (k >= n) break;
    float p[R];
    bool any = false;
#pragma unroll
    for (int r = 0; r < R; ++r) { p[r] = ps[r][kk]; any = any || p[r] != 0.f; }
    if (!any) continue;
#pragma unroll
    for (int x = 0; x < DT; ++x) {
      const int d = dl + x * TPS;
      const float v = pre
          ? static_cast<float>(pvalues[pvh + (int64_t)k * pvalues_strides[2] + (int64_t)d * pvalues_strides[3]])
          : static_cast<float>(values[vh + (int64_t)k * values_strides[2] + (int64_t)d * values_strides[3]]);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][x] += p[r] * v;
    }
  }
  if (j < J) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int x = 0; x < DT; ++x) red[(j * R + r) * D + dl + x * TPS] = acc[r][x];
  }
  __syncthreads();
""" + WRITE_PARTS + r"""
"""
