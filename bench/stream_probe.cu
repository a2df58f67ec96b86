// A weight-streaming persistent decode kernel, as a probe: can one launch for all layers keep HBM
// busy through the dependency points of a batch-1 decode step? (kernels/small_matmul/NOTES.md,
// "Stop 20", has the design and the measurements.) One CTA per SM. Warp 8 is the producer: lane 0
// claims a slot of a shared-memory ring (an mbarrier pair per slot) and the warp's lanes bulk-copy
// the chunk's weight rows into it (cp.async.bulk, one per row). It streams the CTA's share of every
// weight matrix, layer after layer, and never waits on an activation, only on a free slot. Warps 0-7
// consume: at each op they wait for its input (a counter every CTA bumps when its rows of the
// previous op are written, or tagged values: mode bit 3), stage the input vector in shared memory,
// and reduce their rows chunk by chunk in a fixed order, on tensor cores or CUDA cores (bit 4).
//
// Per layer (Qwen2 shapes): qkv = rmsnorm(h) Wqkv^T + b; attention over the cache and the new token
// (mode bit 6: two steps with no weights; without it o's input is q, the first H values of qkv);
// h += attn Wo^T; act = silu(g) * u with [g; u] = rmsnorm(h) Wgu^T; h += act Wd^T. Batch 1 only.
#include <cuda_bf16.h>
#ifdef __CUDACC_RTC__  // NVRTC has no <stdint.h>
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
#else
#include <stdint.h>
#endif

#define NUM_CONSUMER_WARPS 8
#ifndef CONSUMER_CUDA_CORES  // -DCONSUMER_CUDA_CORES=1: the CUDA-core consumers (mode bit 4)
#define CONSUMER_CUDA_CORES 0
#endif

#define MAX_OWN_ROWS 16  // rows of an op one CTA owns: ceil(units / CTAs) at most

struct Shapes {
  int layers, hidden, inter, qkv_rows;
  int kc_qo, kc_gu, kc_down;  // columns per chunk: qkv and o (8 rows), gate_up (8 gate + 8 up rows), down
  int prefetch;  // mode bit 5: chunks ahead of the producer asked of the L2
  int mode;      // bit 0: wait at dependencies (else wrong results); bit 1: skip the dot products;
             // bit 2: one contiguous copy per chunk (timing only: packed weights);
             // bit 3: activations carry their own ready tag (below) instead of counters and fences;
             // bit 4: dot products on CUDA cores, a warp per row (else tensor cores, k split over warps):
             //        a separate build, -DCONSUMER_CUDA_CORES=1, which the host picks by this bit;
             // bit 5: the producer also prefetches into the L2 `prefetch` chunks ahead;
             // bit 6: attention between qkv and o (else o reads q);
             // bit 7: publish with one red.release.gpu instead of fence.acq_rel.gpu + red.relaxed.gpu;
             // bit 8: the norm's weights loaded before the dependency wait;
             // bit 9: attention's merge folded into o's staging (with bit 6);
             // bit 10: the consumers only walk the ring (timing only, with bit 1 and without bit 0);
             // bit 11: with bit 2, the weights are packed in stream order (host: pack_weights), so one
             //         copy per chunk lands the right rows: correct sums (CUDA-core consumers only)
  int in_flight;  // chunks the producer keeps issued but not landed, at most (0: the whole ring)
};

#define NEG_INF (-__int_as_float(0x7f800000))

// Start of part i of n units cut into `parts` near-equal parts (every op, position range and output
// range here is shared out across CTAs this way).
__device__ __forceinline__ int share_start(int i, int n, int parts) { return (int)((long long)i * n / parts); }

// Tagged activations, as NCCL's LL protocol: each value travels with the tag of the op that wrote it
// in one 64-bit word (a 64-bit access is single-copy atomic), so a reader spins on the value
// itself: no fence before a counter, no counter round trip before reading the data.
__device__ __forceinline__ float ld_tagged(const uint64_t* p, uint32_t tag) {
  uint64_t v;
  for (uint32_t spins = 0;; ++spins) {
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    if ((uint32_t)(v >> 32) == tag) break;
    if (spins == (1u << 26)) __trap();  // a wrong tag would hang the GPU: fail the launch instead
  }
  return __uint_as_float((uint32_t)v);
}
__device__ __forceinline__ void st_tagged(uint64_t* p, float value, uint32_t tag) {
  const uint64_t v = ((uint64_t)tag << 32) | __float_as_uint(value);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

#include "bulk_ring.cuh"   // kernels/stream_linear: mbar_*, bulk_copy, smem_addr
__device__ __forceinline__ void consumers_sync() {  // the 256 consumer threads only
  asm volatile("bar.sync 1, %0;" ::"n"(NUM_CONSUMER_WARPS * 32) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Op t of a layer: 0 qkv, 1 o, 2 gate_up, 3 down. A unit is an output row, except for gate_up,
// where it is one intermediate index: its gate row and its up row travel in the same chunk, and
// the warp that owns the index computes both dot products and act.
struct Op {
  int units, k, kc;
};
__device__ __forceinline__ Op op_of(const Shapes& s, int t) {
  if (t == 0) return {s.qkv_rows, s.hidden, s.kc_qo};
  if (t == 1) return {s.hidden, s.hidden, s.kc_qo};
  if (t == 2) return {s.inter, s.hidden, s.kc_gu};
  return {s.hidden, s.inter, s.kc_down};
}
// Weight row r of a chunk of the group starting at unit g0 with n units (gate_up: n gate rows, then n up rows).
__device__ __forceinline__ int row_of(int t, int g0, int n, int r, int inter) {
  if (t != 2) return g0 + r;
  return r < n ? g0 + r : inter + g0 + (r - n);
}

// The producer's walk over a CTA's chunks, in stream order: layer, op, group of 8 units [lo, hi),
// k chunk. Every op has at least one unit per CTA (the host checks units >= CTAs).
struct ChunkCursor {
  int layer, t, g0, k0, lo, hi;
  Op op;
  __device__ void start_op(const Shapes& s, int c, int G) {
    op = op_of(s, t);
    lo = share_start(c, op.units, G);
    hi = share_start(c + 1, op.units, G);
    g0 = lo;
    k0 = 0;
  }
  __device__ void start(const Shapes& s, int c, int G) {
    layer = 0;
    t = 0;
    start_op(s, c, G);
  }
  __device__ bool done(const Shapes& s) const { return layer >= s.layers; }
  __device__ void next(const Shapes& s, int c, int G) {
    if (done(s)) return;
    if ((k0 += op.kc) < op.k) return;
    k0 = 0;
    if ((g0 += 8) < hi) return;
    if (++t == 4) {
      t = 0;
      ++layer;
    }
    if (!done(s)) start_op(s, c, G);
  }
};

__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// d += A B with A the token rows (row 0 here: a0 = k 0-1 of the lane's pair, a2 = k 8-9) and B
// eight weight rows (b0 = k 0-7, b1 = k 8-15, as ldmatrix hands them out)
__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
// Tensor-core dot products of one chunk: this warp's k-range [kb, kb + kc/8) of 8 weight rows
// (row pitch `pitch`: kc*2 + 16 bytes, so ldmatrix's 8 rows fall in 8 different bank groups) with x.
// Measured slower than the CUDA-core consumers (dot_chunk): 46.6-48.6 us a layer against 38.0-40.2
// (stop 20); kept because token rows as A's rows would give verify rows (M <= 16) for free.
__device__ __forceinline__ void mma_chunk(uint32_t rows_addr, int pitch, const __nv_bfloat16* x, int kc, int warp,
                                          int lane, float (*d)[4]) {
  const int kw = kc / NUM_CONSUMER_WARPS, kb = warp * kw;
  const uint32_t addr = rows_addr + (lane % 8) * pitch + (kb + (lane / 8) * 8) * 2;
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x + kb);
  for (int k = 0; k < kw; k += 32) {
    uint32_t b[4];
    ldmatrix_x4(b, addr + k * 2);
    uint32_t a[4] = {0u, 0u, 0u, 0u};
    if (lane < 4) {
      a[0] = x32[k / 2 + lane];
      a[1] = x32[(k + 8) / 2 + lane];
      a[2] = x32[(k + 16) / 2 + lane];
      a[3] = x32[(k + 24) / 2 + lane];
    }
    // four accumulator sets, so consecutive mma.sync do not wait on each other (measured: no gain)
    mma_bf16(d[0], a[0], a[1], b[0], b[1]);
    mma_bf16(d[1], a[2], a[3], b[2], b[3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // rotate the sets (register moves; a runtime index spilled them)
      const float t0 = d[0][j], t1 = d[1][j];
      d[0][j] = d[2][j];
      d[1][j] = d[3][j];
      d[2][j] = t0;
      d[3][j] = t1;
    }
  }
}

// Attention (mode bit 6), two steps between qkv and o, no weights streamed. Shapes: head_dim 128;
// the K/V cache [layers][kv_heads][s_max][128] bf16, roped keys; the new token sits at context - 1
// and comes from qkv (its k roped here and rounded to bf16, as the cache stores it).
struct Attn {
  __nv_bfloat16* k_cache;  // read, and written at the new token's position
  __nv_bfloat16* v_cache;
  float* part;                // [CTAs][heads per kv head][128 + 2]: acc, then max and sum
  __nv_bfloat16* out;         // [q_heads * 128]
  const float* cos;           // [64]: the new position's rotate-half rows
  const float* sin;
  int context, s_max, q_heads, kv_heads;
};
#define HEAD_DIM 128

__device__ __forceinline__ void load_bf16x2(const __nv_bfloat16* p, float* out) {  // 2 values, from L2
  const uint32_t u = __ldcg(reinterpret_cast<const unsigned int*>(p));
  out[0] = __uint_as_float(u << 16);
  out[1] = __uint_as_float(u & 0xffff0000u);
}
// This lane's 4 dims of a head: d0 = 2 lane, d0 + 1 and their rotate-half partners + 64.
__device__ __forceinline__ void load_head_dims(const __nv_bfloat16* head, int lane, float* v4) {
  load_bf16x2(head + 2 * lane, v4);
  load_bf16x2(head + 64 + 2 * lane, v4 + 2);
}
__device__ __forceinline__ void rope4(float* v4, const Attn& a, int lane) {
  const int i = 2 * lane;
  const float c0 = a.cos[i], c1 = a.cos[i + 1], s0 = a.sin[i], s1 = a.sin[i + 1];
  const float x0 = v4[0], x1 = v4[1], y0 = v4[2], y1 = v4[3];
  v4[0] = x0 * c0 - y0 * s0;
  v4[1] = x1 * c1 - y1 * s1;
  v4[2] = y0 * c0 + x0 * s0;
  v4[3] = y1 * c1 + x1 * s1;
}
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The new token's k (roped, rounded to bf16 as the cache stores it) and v for kv head g, from qkv.
__device__ __forceinline__ void load_new_token(const Attn& a, const __nv_bfloat16* qkv, int g, int lane, float* k_new,
                                               float* v_new) {
  load_head_dims(qkv + (a.q_heads + g) * HEAD_DIM, lane, k_new);
  rope4(k_new, a, lane);
#pragma unroll
  for (int i = 0; i < 4; ++i) k_new[i] = round_bf16(k_new[i]);
  load_head_dims(qkv + (a.q_heads + a.kv_heads + g) * HEAD_DIM, lane, v_new);
}
// Positions [batch, min(batch + N, end)) of one kv head (cache rows at head_base), every load issued
// before the first use: a load per dependent iteration would pay a memory round trip (1-2 us under
// a saturated HBM) per position. Position new_pos (-1: none in range) comes from registers.
template <int N>
__device__ __forceinline__ void load_kv_batch(const Attn& a, size_t head_base, int batch, int end, int new_pos,
                                              int lane, const float* k_new, const float* v_new, float (*k)[4],
                                              float (*v)[4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int pos = batch + i;
    if (pos >= end) break;
    if (pos == new_pos) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        k[i][e] = k_new[e];
        v[i][e] = v_new[e];
      }
    } else {
      load_head_dims(a.k_cache + head_base + (size_t)pos * HEAD_DIM, lane, k[i]);
      load_head_dims(a.v_cache + head_base + (size_t)pos * HEAD_DIM, lane, v[i]);
    }
  }
}
// One position of an online softmax over a head: the score (the lanes' 4 dims each, summed by a
// butterfly), then the running max, sum and weighted values.
__device__ __forceinline__ void online_softmax_step(const float* q, const float* k, const float* v, float scale,
                                                    float& m, float& sum, float* acc) {
  float score = (q[0] * k[0] + q[1] * k[1]) + (q[2] * k[2] + q[3] * k[3]);
  for (int o = 16; o; o >>= 1) score += __shfl_xor_sync(0xffffffff, score, o);
  score *= scale;
  const float m_new = fmaxf(m, score), corr = expf(m - m_new), p = expf(score - m_new);
  sum = sum * corr + p;
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] = acc[e] * corr + p * v[e];
  m = m_new;
}
// The new token's k and v into the cache at position S - 1, for the steps after this one.
__device__ __forceinline__ void write_new_token(const Attn& a, size_t head_base, int lane, const float* k_new,
                                                const float* v_new) {
  __nv_bfloat16* kc = a.k_cache + head_base + (size_t)(a.context - 1) * HEAD_DIM;
  __nv_bfloat16* vc = a.v_cache + head_base + (size_t)(a.context - 1) * HEAD_DIM;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int dim = (i < 2 ? 0 : 64) + 2 * lane + (i & 1);
    kc[dim] = __float2bfloat16(k_new[i]);
    vc[dim] = __float2bfloat16(v_new[i]);
  }
}

// Step 1: CTA c takes kv head c / J and the J-th share of the positions (J = CTAs / kv_heads); warp
// w < heads per kv head runs one q head over them with an online softmax and writes its partial.
__device__ __forceinline__ void attention_partials(const Attn& a, const __nv_bfloat16* qkv, int layer, int c, int G,
                                                   int warp, int lane) {
  const int R = a.q_heads / a.kv_heads, J = G / a.kv_heads, S = a.context;
  if (c >= J * a.kv_heads || warp >= R) return;
  const int g = c / J, j = c % J, h = g * R + warp;
  const int p0 = share_start(j, S, J), p1 = share_start(j + 1, S, J);
  float q[4], k_new[4], v_new[4];
  load_head_dims(qkv + h * HEAD_DIM, lane, q);
  rope4(q, a, lane);
  const bool has_new = p1 == S;  // the share that holds the new token
  if (has_new) load_new_token(a, qkv, g, lane, k_new, v_new);
  const size_t head_base = (size_t)(layer * a.kv_heads + g) * a.s_max * HEAD_DIM;
  const float scale = rsqrtf((float)HEAD_DIM);
  float m = NEG_INF, sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  // Positions in batches of 4 (8 spilled: 9 warps leave 168 registers a thread)
  for (int batch = p0; batch < p1; batch += 4) {
    float k[4][4], v[4][4];
    load_kv_batch<4>(a, head_base, batch, p1, has_new ? S - 1 : -1, lane, k_new, v_new, k, v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (batch + i >= p1) break;
      online_softmax_step(q, k[i], v[i], scale, m, sum, acc);
    }
  }
  float* out = a.part + ((size_t)c * R + warp) * (HEAD_DIM + 2);
  out[2 * lane] = acc[0];
  out[2 * lane + 1] = acc[1];
  out[64 + 2 * lane] = acc[2];
  out[64 + 2 * lane + 1] = acc[3];
  if (lane == 0) {
    out[HEAD_DIM] = m;
    out[HEAD_DIM + 1] = sum;
  }
  if (has_new && warp == 0) write_new_token(a, head_base, lane, k_new, v_new);
}

// Step 2: the CTA's share of the q_heads * 128 outputs, a warp per output, lanes over the J partials
// (at most 96) in a fixed order; out = bf16(sum_j acc_j e^(m_j - M) / sum_j l_j e^(m_j - M)).
__device__ __forceinline__ void attention_merge(const Attn& a, int c, int G, int warp, int lane) {
  const int R = a.q_heads / a.kv_heads, J = G / a.kv_heads, units = a.q_heads * HEAD_DIM;
  const int lo = share_start(c, units, G), hi = share_start(c + 1, units, G);
  for (int u = lo + warp; u < hi; u += NUM_CONSUMER_WARPS) {
    const int h = u / HEAD_DIM, d = u % HEAD_DIM, g = h / R, hr = h % R;
    float mj[3], lj[3], aj[3], M = NEG_INF;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int j = lane + 32 * i;
      mj[i] = NEG_INF;
      lj[i] = aj[i] = 0.f;
      if (j < J) {
        const float* pp = a.part + ((size_t)(g * J + j) * R + hr) * (HEAD_DIM + 2);
        mj[i] = __ldcg(pp + HEAD_DIM);
        lj[i] = __ldcg(pp + HEAD_DIM + 1);
        aj[i] = __ldcg(pp + d);
        M = fmaxf(M, mj[i]);
      }
    }
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffff, M, o));
    float L = 0.f, A = 0.f;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const float w = lane + 32 * i < J ? expf(mj[i] - M) : 0.f;
      L += lj[i] * w;
      A += aj[i] * w;
    }
    for (int o = 16; o; o >>= 1) {
      L += __shfl_xor_sync(0xffffffff, L, o);
      A += __shfl_xor_sync(0xffffffff, A, o);
    }
    if (lane == 0) a.out[u] = __float2bfloat16(A / L);
  }
}

// Mode bit 9: attention with the merge folded into o's staging (no merge step, no sync for it).
// Step 1 runs on FOLD_SHARES CTAs per kv head only: CTA c = g FOLD_SHARES + j takes kv head g and
// the j-th share of the positions; its 8 warps split the share and each runs all FOLD_R q heads of
// the group over its positions (q for every head in registers), then the CTA merges its warps in
// shared memory, one head at a time, into one partial per (head, share). o's staging then merges
// the q_heads x FOLD_SHARES partials itself: every CTA reads them all (50 KB at Qwen2.5-1.5B), one
// round trip, instead of a merge step's wait, round trips and publish.
#define FOLD_SHARES 8
#ifndef FOLD_BATCH
#define FOLD_BATCH 4  // positions whose loads are issued together (2 spilled)
#endif
#define FOLD_R 6  // q heads per kv head (Qwen2.5-1.5B: 12 / 2); the host checks
__device__ __forceinline__ void attention_partials_folded(const Attn& a, const __nv_bfloat16* qkv, int layer, int c,
                                                          int warp, int lane, float* scratch /* [8][130] */) {
  const int S = a.context;
  if (c >= FOLD_SHARES * a.kv_heads) return;  // the whole CTA: the barriers below stay uniform
  const int g = c / FOLD_SHARES, j = c % FOLD_SHARES;
  const int p0 = share_start(j, S, FOLD_SHARES), p1 = share_start(j + 1, S, FOLD_SHARES);
  const int w0 = p0 + share_start(warp, p1 - p0, NUM_CONSUMER_WARPS);
  const int w1 = p0 + share_start(warp + 1, p1 - p0, NUM_CONSUMER_WARPS);
  float q[FOLD_R][4], k_new[4], v_new[4];
#pragma unroll
  for (int r = 0; r < FOLD_R; ++r) {
    load_head_dims(qkv + (g * FOLD_R + r) * HEAD_DIM, lane, q[r]);
    rope4(q[r], a, lane);
  }
  const bool has_new = p1 == S;
  if (has_new) load_new_token(a, qkv, g, lane, k_new, v_new);
  const size_t head_base = (size_t)(layer * a.kv_heads + g) * a.s_max * HEAD_DIM;
  const float scale = rsqrtf((float)HEAD_DIM);
  float m[FOLD_R], sum[FOLD_R], acc[FOLD_R][4];
#pragma unroll
  for (int r = 0; r < FOLD_R; ++r) {
    m[r] = NEG_INF;
    sum[r] = 0.f;
    acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.f;
  }
  for (int batch = w0; batch < w1; batch += FOLD_BATCH) {
    float k[FOLD_BATCH][4], v[FOLD_BATCH][4];
    load_kv_batch<FOLD_BATCH>(a, head_base, batch, w1, has_new ? S - 1 : -1, lane, k_new, v_new, k, v);
#pragma unroll
    for (int i = 0; i < FOLD_BATCH; ++i) {
      if (batch + i >= w1) break;
#pragma unroll
      for (int r = 0; r < FOLD_R; ++r) online_softmax_step(q[r], k[i], v[i], scale, m[r], sum[r], acc[r]);
    }
  }
  // the CTA's 8 warp partials of each head into one (fixed order: warp 0 to 7)
#pragma unroll
  for (int r = 0; r < FOLD_R; ++r) {
    float* mine = scratch + warp * (HEAD_DIM + 2);
    mine[2 * lane] = acc[r][0];
    mine[2 * lane + 1] = acc[r][1];
    mine[64 + 2 * lane] = acc[r][2];
    mine[64 + 2 * lane + 1] = acc[r][3];
    if (lane == 0) {
      mine[HEAD_DIM] = m[r];
      mine[HEAD_DIM + 1] = sum[r];
    }
    consumers_sync();
    const int tid = warp * 32 + lane;
    if (tid < HEAD_DIM) {
      float M = NEG_INF;
      for (int w = 0; w < NUM_CONSUMER_WARPS; ++w) M = fmaxf(M, scratch[w * (HEAD_DIM + 2) + HEAD_DIM]);
      float A = 0.f, L = 0.f;
      for (int w = 0; w < NUM_CONSUMER_WARPS; ++w) {
        const float* pw = scratch + w * (HEAD_DIM + 2);
        const float e = pw[HEAD_DIM] == NEG_INF ? 0.f : expf(pw[HEAD_DIM] - M);
        A += pw[tid] * e;
        L += pw[HEAD_DIM + 1] * e;
      }
      float* out = a.part + ((size_t)(g * FOLD_SHARES + j) * FOLD_R + r) * (HEAD_DIM + 2);
      out[tid] = A;
      if (tid == 0) {
        out[HEAD_DIM] = M;
        out[HEAD_DIM + 1] = L;
      }
    }
    consumers_sync();
  }
  if (has_new && warp == 0) write_new_token(a, head_base, lane, k_new, v_new);
}

// o's input when folded: x[u] = bf16(sum_j acc_j[u] w_j / sum_j l_j w_j), w_j = e^(m_j - M) over
// the FOLD_SHARES partials of u's head, in two passes of loads. Through shared memory `wts`
// (q_heads * (3 FOLD_SHARES + 1) floats): the partials' m and l, then the weights w [heads]
// [FOLD_SHARES] and L = sum_j l_j w_j [heads].
__device__ __forceinline__ void stage_folded_attention(const Attn& a, __nv_bfloat16* x, float* wts, int tid) {
  constexpr int T = NUM_CONSUMER_WARPS * 32, PER = 3;  // outputs per thread and pass: q_heads * 128 <= 6 T
  const int units = a.q_heads * HEAD_DIM, pairs = a.q_heads * FOLD_SHARES;
  for (int pass = 0; pass < 2; ++pass) {  // two passes of 3 outputs a thread (6 in one spilled)
    float av[PER][FOLD_SHARES];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int u = tid + (pass * PER + i) * T, h = u / HEAD_DIM, d = u % HEAD_DIM, g = h / FOLD_R, r = h % FOLD_R;
#pragma unroll
      for (int jj = 0; jj < FOLD_SHARES; ++jj)
        av[i][jj] = u < units ? __ldcg(a.part + ((size_t)(g * FOLD_SHARES + jj) * FOLD_R + r) * (HEAD_DIM + 2) + d) : 0.f;
    }
    if (pass == 0) {  // with the first pass's loads in flight: the weights
      if (tid < pairs) {  // pair tid = (head, share): its max and sum
        const int h = tid / FOLD_SHARES, jj = tid % FOLD_SHARES, g = h / FOLD_R, r = h % FOLD_R;
        const float* pp = a.part + ((size_t)(g * FOLD_SHARES + jj) * FOLD_R + r) * (HEAD_DIM + 2);
        wts[tid] = __ldcg(pp + HEAD_DIM);
        wts[pairs + tid] = __ldcg(pp + HEAD_DIM + 1);
      }
      consumers_sync();
      if (tid < a.q_heads) {  // per head: the weights e^(m_j - M), then sum_j l_j w_j
        float M = NEG_INF, L = 0.f;
        for (int jj = 0; jj < FOLD_SHARES; ++jj) M = fmaxf(M, wts[tid * FOLD_SHARES + jj]);
        for (int jj = 0; jj < FOLD_SHARES; ++jj) {
          const float w = expf(wts[tid * FOLD_SHARES + jj] - M);
          L += wts[pairs + tid * FOLD_SHARES + jj] * w;
          wts[2 * pairs + tid * FOLD_SHARES + jj] = w;
        }
        wts[3 * pairs + tid] = L;
      }
      consumers_sync();
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int u = tid + (pass * PER + i) * T, h = u / HEAD_DIM;
      if (u >= units) break;
      float A = 0.f;
#pragma unroll
      for (int jj = 0; jj < FOLD_SHARES; ++jj) A += av[i][jj] * wts[2 * pairs + h * FOLD_SHARES + jj];
      x[u] = __float2bfloat16(A / wts[3 * pairs + h]);
    }
  }
}

// CUDA-core dot products (mode bit 4): a warp per weight row, eight independent sums per lane (one
// per bf16 position of a 16-byte vector; a single accumulator was slower, stop 20's first runs).
__device__ __forceinline__ void dot_chunk(const uint8_t* row, const __nv_bfloat16* x, int kc, int lane, float* a8) {
  const uint4* wv = reinterpret_cast<const uint4*>(row);
  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll 4
  for (int v = lane; v < kc / 8; v += 32) {
    const uint4 a = wv[v], b = xv[v];
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      a8[2 * j] = fmaf(__uint_as_float(aw[j] << 16), __uint_as_float(bw[j] << 16), a8[2 * j]);
      a8[2 * j + 1] = fmaf(__uint_as_float(aw[j] & 0xffff0000u), __uint_as_float(bw[j] & 0xffff0000u), a8[2 * j + 1]);
    }
  }
}
__device__ __forceinline__ float finish_dot(const float* a8) {  // fixed order: lane sums, then the butterfly
  float acc = ((a8[0] + a8[1]) + (a8[2] + a8[3])) + ((a8[4] + a8[5]) + (a8[6] + a8[7]));
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  return acc;
}

extern "C" __global__ void __launch_bounds__((NUM_CONSUMER_WARPS + 1) * 32, 1)
stream_layers(const int64_t* __restrict__ weights,  // [layers][4] bf16 [N, K] row-major
              const int64_t* __restrict__ norms,    // [layers][2] bf16 [hidden]
              const int64_t* __restrict__ biases,   // [layers]    bf16 [qkv_rows]
              float* h, __nv_bfloat16* qkv, __nv_bfloat16* act, unsigned* counters,
              int layers, int hidden, int inter, int qkv_rows, int kc_qo, int kc_gu, int kc_down, int mode,
              int num_slots, int slot_bytes, int64_t* prof,
              uint64_t* h_ll, uint64_t* qkv_ll, uint64_t* act_ll, uint32_t seq, int prefetch,
              int64_t* trace, int trace_layer, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache,
              float* attn_part, __nv_bfloat16* attn_out, const float* rope_cos, const float* rope_sin,
              int context, int s_max, int q_heads, int kv_heads, int in_flight) {
  // mode bit 6: the layer's attention as two steps between qkv and o (else o reads q)
  const Attn attn{k_cache, v_cache, attn_part, attn_out, rope_cos, rope_sin, context, s_max, q_heads, kv_heads};
  const bool with_attention = mode & 64;
  const bool fold = with_attention && (mode & 512);
  // mode bit 10, timing only, with bits 1 (no arithmetic) and 0 off (no waits): the consumers only
  // walk the ring, no staging, attention or publish: what the stream costs with nothing between chunks
  const bool bare = mode & 1024;
  const int steps = with_attention ? 6 : 4;  // per layer: qkv, [attention, merge,] o, gate_up, down
  // weighted op t (0 qkv, 1 o, 2 gate_up, 3 down) <-> step; attention is t -1, its merge -2
  const auto step_of = [&](int t) { return with_attention && t > 0 ? t + 2 : t; };
  // tagged mode: op t of layer l writes tag base + 4 l + t + 1; h enters with tag base
  const bool ll = mode & 8;
  // mode bit 4 picks the build: both consumers in one kernel overran the 168 registers a thread
  // that 9 warps leave (3 warps on one scheduler's 16K) and spilled
  constexpr bool cuda_cores = CONSUMER_CUDA_CORES;
  const uint32_t base = seq * (uint32_t)layers * 4u;
  const Shapes s{layers, hidden, inter, qkv_rows, kc_qo, kc_gu, kc_down, prefetch, mode, in_flight};
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;                                                                   // num_slots x slot_bytes
  __nv_bfloat16* x = reinterpret_cast<__nv_bfloat16*>(ring + (size_t)num_slots * slot_bytes);  // [max K]
  const int max_k = s.inter > s.hidden ? s.inter : s.hidden;
  uint64_t* full = reinterpret_cast<uint64_t*>(x + ((max_k + 63) / 64) * 64);
  uint64_t* empty = full + num_slots;
  float* partial = reinterpret_cast<float*>(empty + num_slots);  // [8] norm partial sums
  float* own_h = partial + 8;                                    // [MAX_OWN_ROWS] this CTA's rows of h
  float* own_bias = own_h + MAX_OWN_ROWS;                        // [MAX_OWN_ROWS] this layer's qkv bias rows
                                                                 // then [2][2][warps][8] per-warp row sums
  float* fold_wts = partial + 296;  // [400]: the folded merge's per-head weights (mode bit 9)
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int G = gridDim.x, c = blockIdx.x;
  const int h_lo = share_start(c, s.hidden, G), h_hi = share_start(c + 1, s.hidden, G);
  for (int i = tid; i < h_hi - h_lo; i += blockDim.x) own_h[i] = h[h_lo + i];
  long long t_start = clock64(), t_wait = 0, t_dep = 0, t_stage = 0, t_fence = 0;
  // Timeline of one layer on CTAs 0 and G/2, in this SM's clock64 cycles: per op, [0] the producer
  // reaches the op's first chunk, [1] it has issued the op's last copies, [2] the consumers start
  // the op, [3] its input is ready, [4] staged, [5] the first chunk has arrived, [6] the rows are
  // written, [7] published; per group gi < 4 of 8 units, [8 + 2 gi] its first chunk has arrived and
  // [9 + 2 gi] its rows are written. trace: [2][6 steps][16] (steps 1 and 2: attention, when on).
  int64_t* my_trace = trace && (c == 0 || c == G / 2) ? trace + (c == 0 ? 0 : 96) : nullptr;
#define TRACE(layer, step, event) \
  if (my_trace && (layer) == trace_layer) my_trace[(step) * 16 + (event)] = clock64()

  if (tid == 0) {
    for (int i = 0; i < num_slots; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], NUM_CONSUMER_WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == NUM_CONSUMER_WARPS) {  // producer: lane 0 claims a slot, lane r copies row r of it
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    ChunkCursor cur;
    cur.start(s, c, G);
    ChunkCursor ahead = cur;  // the chunk `prefetch` places ahead: asked of the L2 (mode bit 5)
    for (int i = 0; i < s.prefetch; ++i) ahead.next(s, c, G);
    for (uint32_t it = 0; !cur.done(s); ++it, cur.next(s, c, G)) {
      if (ahead.layer < s.layers && (s.mode & 32)) {  // HBM keeps working while the ring is full
        const int n = min(8, ahead.hi - ahead.g0);
        if (lane < (ahead.t == 2 ? 2 * n : n))
          prefetch_l2(reinterpret_cast<const __nv_bfloat16*>(weights[ahead.layer * 4 + ahead.t]) +
                          (long long)row_of(ahead.t, ahead.g0, n, lane, s.inter) * ahead.op.k + ahead.k0,
                      ahead.op.kc * 2);
        ahead.next(s, c, G);
      }
      const Op op = cur.op;
      const int t = cur.t, g0 = cur.g0, k0 = cur.k0;
      const auto* w = reinterpret_cast<const __nv_bfloat16*>(weights[cur.layer * 4 + t]);
      const int n = min(8, cur.hi - g0), rows = t == 2 ? 2 * n : n;
      const int slot = it % num_slots;
      if (lane == 0) {
        if (g0 == cur.lo && k0 == 0) TRACE(cur.layer, step_of(t), 0);
        const long long t0 = clock64();
        mbar_wait(&empty[slot], ((it / num_slots) & 1) ^ 1);
        // At most s.in_flight chunks issued and not landed: the chunk that many places back must
        // have landed first. The ring still fills during a stall (landed chunks do not count), but
        // fewer bytes queue in the memory system ahead of the consumers' latency-bound loads (the
        // input after each dependency, the counters, the fence). Its full barrier cannot have
        // moved on a phase: its slot's next chunk is after this one.
        if (s.in_flight > 0 && s.in_flight < num_slots && it >= (uint32_t)s.in_flight) {
          const uint32_t back = it - s.in_flight;
          mbar_wait(&full[back % num_slots], (back / num_slots) & 1);
        }
        t_wait += clock64() - t0;
        mbar_expect_tx(&full[slot], rows * op.kc * 2);
      }
      __syncwarp();
      if (s.mode & 4) {
        if (lane == 0)
          // the packed layout (host: pack_weights): a CTA's chunks in stream order, each rows x kc
          bulk_copy(ring + slot * slot_bytes, w + (long long)(t == 2 ? 2 : 1) * g0 * op.k + (long long)k0 * rows,
                    rows * op.kc * 2, &full[slot], policy);
      } else if (lane < rows) {
        const int dst_row = (t == 2 && lane >= n) ? 8 + lane - n : lane;  // up rows from row 8
        bulk_copy(ring + slot * slot_bytes + dst_row * (op.kc * 2 + 16),
                  w + (long long)row_of(t, g0, n, lane, s.inter) * op.k + k0, op.kc * 2, &full[slot], policy);
      }
      if (lane == 0 && g0 + 8 >= cur.hi && k0 + op.kc >= op.k) TRACE(cur.layer, step_of(t), 1);
    }
    if (lane == 0) {
      prof[c * 8 + 0] = clock64() - t_start;
      prof[c * 8 + 1] = t_wait;
    }
    return;
  }

  // consumers
  uint32_t it = 0;
  int parity = 0;
  for (int l = 0; l < s.layers; ++l)
    for (int step = 0; step < steps; ++step) {
      const int t = !with_attention ? step : step == 0 ? 0 : step >= 3 ? step - 2 : -step;  // step_of's inverse
      const Op op = op_of(s, t < 0 ? 0 : t);
      const int lo = share_start(c, op.units, G), hi = share_start(c + 1, op.units, G);
      const long long t0 = clock64();
      if (tid == 0) TRACE(l, step, 2);
      if (t == 0 && tid < hi - lo)  // the bias rows, loaded while the waits below run
        own_bias[tid] = __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(biases[l])[lo + tid]);
      // mode bit 8: the norm's weights too (thread tid's k = tid + 256 i), so the staging after the
      // wait pays one round trip (h) instead of two (h, then the weights: an HBM miss, as the
      // stream evicts them)
      uint32_t nw_early[4] = {0u, 0u, 0u, 0u};  // bf16 pairs: i = 2 j (low half), 2 j + 1 (high)
      if ((s.mode & 256) && (t == 0 || t == 2)) {
        const auto* nw = reinterpret_cast<const unsigned short*>(norms[l * 2 + t / 2]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k0 = tid + 2 * j * NUM_CONSUMER_WARPS * 32, k1 = k0 + NUM_CONSUMER_WARPS * 32;
          const uint32_t lo16 = k0 < s.hidden ? __ldg(nw + k0) : 0u, hi16 = k1 < s.hidden ? __ldg(nw + k1) : 0u;
          nw_early[j] = lo16 | (hi16 << 16);
        }
      }
      // wait for this op's input: every CTA's rows of the op before it
      if (fold && step == 2) continue;  // no merge step: o merges the partials itself
      const int dep = fold && step == 3 ? l * steps + 1 : l * steps + step - 1;
      if (dep >= 0 && (s.mode & 1) && !ll) {
        if (tid == 0)
          for (uint32_t spins = 0; load_acquire(&counters[dep]) < (unsigned)G; ++spins)
            if (spins == (1u << 26)) __trap();  // fail the launch rather than hang the GPU
        consumers_sync();
      }
      const long long t1 = clock64();
      t_dep += t1 - t0;
      if (tid == 0) TRACE(l, step, 3);
      if (t == -1) {
        if (bare) {
        } else if (fold) {
          attention_partials_folded(attn, qkv, l, c, warp, lane, reinterpret_cast<float*>(x));
        } else {
          attention_partials(attn, qkv, l, c, G, warp, lane);
        }
      } else if (t == -2) {
        if (!bare) attention_merge(attn, c, G, warp, lane);
      } else {
        // stage the input vector in shared memory (bf16)
        if (bare) {
        } else if (t == 0 || t == 2) {  // rmsnorm(h) * weight; h read once (hidden <= 8 * 256)
          const auto* nw = reinterpret_cast<const __nv_bfloat16*>(norms[l * 2 + t / 2]);
          float hv[8], ss = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int k = tid + i * NUM_CONSUMER_WARPS * 32;
            hv[i] = k >= s.hidden ? 0.f
                    : ll      ? ld_tagged(h_ll + k, t == 0 ? base + 4 * l : base + 4 * l + 2)
                              : __ldcg(h + k);
            ss = fmaf(hv[i], hv[i], ss);
          }
          for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
          if (lane == 0) partial[warp] = ss;
          consumers_sync();
          float total = 0.f;
          for (int i = 0; i < NUM_CONSUMER_WARPS; ++i) total += partial[i];
          const float inv = rsqrtf(total / s.hidden + 1e-6f);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int k = tid + i * NUM_CONSUMER_WARPS * 32;
            const float wk = (s.mode & 256) ? __uint_as_float(i & 1 ? nw_early[i / 2] & 0xffff0000u : nw_early[i / 2] << 16)
                                            : k < s.hidden ? __bfloat162float(nw[k]) : 0.f;
            if (k < s.hidden) x[k] = __float2bfloat16(hv[i] * inv * wk);
          }
        } else if (fold && t == 1) {
          stage_folded_attention(attn, x, fold_wts, tid);
        } else if (ll) {
          const uint64_t* src = t == 1 ? qkv_ll : act_ll;
          for (int k = tid; k < op.k; k += NUM_CONSUMER_WARPS * 32)
            x[k] = __float2bfloat16(ld_tagged(src + k, base + 4 * l + t));
        } else {
          const __nv_bfloat16* src = t == 1 ? (with_attention ? attn_out : qkv) : act;
          for (int v = tid; v < op.k / 8; v += NUM_CONSUMER_WARPS * 32)
            reinterpret_cast<uint4*>(x)[v] = __ldcg(reinterpret_cast<const uint4*>(src) + v);
        }
        consumers_sync();
        t_stage += clock64() - t1;
        if (tid == 0) TRACE(l, step, 4);

        for (int g0 = lo; g0 < hi; g0 += 8) {
          const int n = min(8, hi - g0);
          float d[4][4] = {}, e[4][4] = {};  // tensor cores: gate (or the op's rows), up; four sets each
          float a8[8] = {}, u8[8] = {};      // CUDA cores: this warp's row, its up row
          // row pitch in the slot: padded for ldmatrix, or as packed chunks land (mode bit 11)
          const bool packed = s.mode & 2048;
          const int pitch = packed ? op.kc * 2 : op.kc * 2 + 16;
          for (int k0 = 0; k0 < op.k; k0 += op.kc, ++it) {
            const int slot = it % num_slots;
            const long long t2 = clock64();
            mbar_wait(&full[slot], (it / num_slots) & 1);
            t_wait += clock64() - t2;
            if (tid == 0 && g0 == lo && k0 == 0) TRACE(l, step, 5);
            if (tid == 0 && k0 == 0 && g0 - lo < 32) TRACE(l, step, 8 + 2 * ((g0 - lo) / 8));
            if constexpr (cuda_cores) {
              if (warp < n && (s.mode & 2) == 0) {
                const uint8_t* rows = ring + slot * slot_bytes;
                dot_chunk(rows + warp * pitch, x + k0, op.kc, lane, a8);
                if (t == 2) dot_chunk(rows + ((packed ? n : 8) + warp) * pitch, x + k0, op.kc, lane, u8);
              }
            } else if ((s.mode & 2) == 0) {
              const uint32_t rows_addr = smem_addr(ring + slot * slot_bytes);
              mma_chunk(rows_addr, pitch, x + k0, op.kc, warp, lane, d);
              if (t == 2) mma_chunk(rows_addr + 8 * pitch, pitch, x + k0, op.kc, warp, lane, e);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
          }
          int out = -1;  // which of the group's n rows this thread writes
          float acc = 0.f, up = 0.f;
          if constexpr (cuda_cores) {
            acc = finish_dot(a8);
            up = finish_dot(u8);
            if (warp < n && lane == 0) out = warp;
          } else {
            // D row 0 (the token) sits in lanes 0-3: columns (weight rows) 2*lane and 2*lane + 1
            float* red = partial + 8 + 2 * MAX_OWN_ROWS + parity * 2 * NUM_CONSUMER_WARPS * 8;  // [2][warps][8]
            if (lane < 4) {
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                red[warp * 8 + 2 * lane + j] = (d[0][j] + d[1][j]) + (d[2][j] + d[3][j]);
                red[(NUM_CONSUMER_WARPS + warp) * 8 + 2 * lane + j] = (e[0][j] + e[1][j]) + (e[2][j] + e[3][j]);
              }
            }
            consumers_sync();
            if (tid < n) {  // the warps' k-ranges summed in warp order
              for (int w = 0; w < NUM_CONSUMER_WARPS; ++w) {
                acc += red[w * 8 + tid];
                up += red[(NUM_CONSUMER_WARPS + w) * 8 + tid];
              }
              out = tid;
            }
            parity ^= 1;  // the other half of red next group: no second barrier
          }
          if (out >= 0) {
            const int row = g0 + out;
            const uint32_t tag = base + 4 * l + t + 1;
            if (t == 0 || t == 2) {
              const __nv_bfloat16 v = __float2bfloat16(t == 0 ? acc + own_bias[row - lo] : acc / (1.f + __expf(-acc)) * up);
              if (ll)
                st_tagged((t == 0 ? qkv_ll : act_ll) + row, __bfloat162float(v), tag);
              else
                (t == 0 ? qkv : act)[row] = v;
            } else {  // o, down: this CTA owns these rows of h
              own_h[row - lo] += acc;
              if (ll)
                st_tagged(h_ll + row, own_h[row - lo], tag);
              else
                h[row] = own_h[row - lo];
            }
          }
          if (tid == 0 && g0 - lo < 32) TRACE(l, step, 9 + 2 * ((g0 - lo) / 8));
        }
      }  // the weighted op
      // publish this CTA's rows of op t: the barrier orders the warps' stores before the release
      if (tid == 0) TRACE(l, step, 6);
      consumers_sync();
      if (tid == 0 && !ll && !bare) {  // as CUTLASS's GenericBarrier: a gpu-scope fence, then the add
        const long long t3 = clock64();
        if (s.mode & 128) {  // one release add (cumulative: covers the stores the barrier ordered before it)
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&counters[l * steps + step]) : "memory");
          t_fence += clock64() - t3;
        } else {
          asm volatile("fence.acq_rel.gpu;" ::: "memory");
          t_fence += clock64() - t3;
          asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(&counters[l * steps + step]) : "memory");
        }
      }
      if (tid == 0) TRACE(l, step, 7);
    }
  if (tid == 0) {
    prof[c * 8 + 2] = clock64() - t_start;
    prof[c * 8 + 3] = t_wait;
    prof[c * 8 + 4] = t_dep;
    prof[c * 8 + 5] = t_stage;
    prof[c * 8 + 6] = t_fence;
  }
#undef TRACE
}

// The bulk-copy ring alone: each CTA streams its contiguous share of `src` through num_slots slots
// of chunk bytes; the consumer warps only wait for each slot and free it (sum one word so the
// reads are not dead). Measures what one producer thread per SM can pull through TMA.
extern "C" __global__ void __launch_bounds__((NUM_CONSUMER_WARPS + 1) * 32, 1)
ring_only(const uint8_t* src, long long bytes_per_cta, int chunk, int num_slots, float* sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)num_slots * chunk);
  uint64_t* empty = full + num_slots;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    for (int i = 0; i < num_slots; ++i) { mbar_init(&full[i], 1); mbar_init(&empty[i], NUM_CONSUMER_WARPS); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const uint8_t* base = src + blockIdx.x * bytes_per_cta;
  const int n = (int)(bytes_per_cta / chunk);
  if (warp == NUM_CONSUMER_WARPS) {
    if (lane) return;
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int it = 0; it < n; ++it) {
      const int slot = it % num_slots;
      mbar_wait(&empty[slot], ((it / num_slots) & 1) ^ 1);
      mbar_expect_tx(&full[slot], chunk);
      bulk_copy(smem + (size_t)slot * chunk, base + (long long)it * chunk, chunk, &full[slot], policy);
    }
    return;
  }
  float acc = 0.f;
  for (int it = 0; it < n; ++it) {
    const int slot = it % num_slots;
    mbar_wait(&full[slot], (it / num_slots) & 1);
    acc += reinterpret_cast<const float*>(smem + (size_t)slot * chunk)[tid];
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
  if (acc == 12345.f) sink[0] = acc;
}

