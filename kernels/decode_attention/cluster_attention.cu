// Decode and fused-verify attention in one launch (sm_90): the key splits of a KV head form a
// thread-block cluster, and the splits merge through distributed shared memory instead of a second
// launch. Python side, shapes and when it runs: kernels/decode_attention/cluster_kernel.py.
//
// Grid: CLUSTER CTAs for each (batch, KV head), one cluster each. CTA `rank` owns cache rows
// [rank * L, rank * L + L) (L = keys_per_cta, a multiple of KEY_BLOCK fixed by the cache capacity,
// never by seq_len or Q: a lane's bits must not depend on the step's width).
//   1. Its K/V rows below seq_len go to shared memory by cp.async: with `early` (settled rows,
//      kernels._pdl) the rows before the step's Q new ones before griddepcontrol.wait, the new rows
//      and q after it. Rows past seq_len up to the key block's end are zeroed (a masked key's
//      probability is 0, and 0 * NaN would not be).
//   2. Four warps run the online softmax on the tensor cores (mma.sync m16n8k16, fp32
//      accumulation). The query rows are r = g * Q + lane for the G heads of the group, in m-tiles
//      of 16; a warp's task is one m-tile and one D_SLICE of output columns, and computes that
//      tile's scores over all the CTA's keys itself (the column slices repeat the score products:
//      warps splitting the keys instead, with their partials merged in shared memory, measured the
//      same). A decode step's m-tile has G <= 8 real rows: rows g + 8 skip the
//      softmax (a warp-uniform branch; their q rows are zero, so their probabilities pack as zeros).
//   3. CTA `rank` owns the merge of columns [rank * D / CLUSTER, ...) of every row. Each CTA
//      stores its partial (running max m, sum l, unnormalised output acc) per row straight into
//      the owners' shared memory by st.async (slot = its rank), each store counting its bytes on
//      the owner's mbarrier; an owner waits until all CLUSTER slots have landed, merges its
//      columns over them in rank order and writes the output. No cluster-wide barrier after the
//      work: a CTA waits only for the data it merges (a barrier.cluster there took 1.1 us against
//      0.26 for the mbarrier), and leaves when done, since nobody touches its
//      memory after that. (A barrier arrive at the start, waited on before the first remote store,
//      makes sure every CTA of the cluster runs, with its mbarrier set up, before it is written to.)
// Bits: every row's arithmetic is the same whatever Q, seq_len or the row's place in its m-tile
// (the tensor cores compute each output element from its own row; the row reductions run the
// same shuffle order for every row), and key blocks past a lane's last visible key add exact zeros
// (alpha = exp2(0) = 1, p = 0). So a decode lane equals its verify lane bit for bit
// (tests/kernels/test_decode_attention_cluster.py checks it on the GPU).
#include "stream_common.cuh"   // 16-bit scalar_t, to_scalar, global_timer, sm_id, smem_addr

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=... -DGROUP=... -DCLUSTER=..."
#endif
#define WARPS 4
#define ATT_THREADS (WARPS * 32)
#ifndef KEY_BLOCK
#define KEY_BLOCK 32                 // keys a step of the online softmax takes (32 or 64)
#endif
#define KEY_TILES (KEY_BLOCK / 8)    // the scores' n-tiles of 8 keys
#define D_SLICE 32                   // output columns of a warp task
#define SLICES (HEAD_DIM / D_SLICE)
#define PITCH (HEAD_DIM + 8)         // a row in shared memory, in 16-bit values: 16 B of padding puts
                                     // the eight rows an ldmatrix phase reads on distinct banks
#define MERGE_COLS (HEAD_DIM / CLUSTER)
#ifdef SCALAR_F16
#define MMA_TYPES "f16.f16"
#define CVT_PAIR "cvt.rn.f16x2.f32"
#else
#define MMA_TYPES "bf16.bf16"
#define CVT_PAIR "cvt.rn.bf16x2.f32"
#endif

struct Args {                        // kernels/decode_attention/cluster_kernel.py's _Args, field for field
  const scalar_t* q;                 // [B, Hq, Q, D]
  const scalar_t* k;                 // [B, Hkv, S_max, D]
  const scalar_t* v;
  const long long* seq_len;          // [B]: valid rows including the Q new ones
  scalar_t* out;                     // [B, Hq, Q, D] (any strides)
  long long q_sb, q_sh, q_sq, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, o_sb, o_sh, o_sq;   // in elements
  int h_kv, q_rows, keys_per_cta, use_pdl, trigger, early;
  float qk_scale;                    // softmax scale * log2(e)
  long long* trace;                  // null, or kernels._trace rows: one per CTA from trace_row
  int trace_row;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const scalar_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const scalar_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)) : "memory");
}
// c[16 x 8] += a[16 x 16] . b[16 x 8] in fp32 (fragments as the PTX ISA lays them out)
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPES ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {  // lo in the low 16 bits, rounded to nearest
  uint32_t r;
  asm(CVT_PAIR " %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float exp2_approx(float x) {  // exp2(-inf) = +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {  // L2 only: rows the kernel before wrote
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
__device__ __forceinline__ long long load_cg(const long long* p) {
  long long v;
  asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// barrier.cluster: every thread of every CTA of the cluster arrives, then waits for all arrivals (once, at the start)
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" :::); }
__device__ __forceinline__ void cluster_wait_acquire() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_address(const void* p, uint32_t rank) {  // p in CTA `rank`
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}
// p[0..1] in CTA `rank`, counted as 8 bytes on that CTA's mbarrier `bar` once they land
__device__ __forceinline__ void push_pair(float* p, uint32_t rank, float x, float y, uint64_t* bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
               ::"r"(cluster_address(p, rank)), "r"(__float_as_uint(x)), "r"(__float_as_uint(y)),
               "r"(cluster_address(bar, rank)) : "memory");
}
// PHASE_MARKS (KernelOptions.stream_phase_marks, kernels/options.py): thread 0's phases after its wait,
// in the trace's SM slot. stream_phase_marks=1 marks staged, pushed, landed, merged (PHASE); =2 adds
// PHASE_DETAIL and marks the compute instead: cluster joined, first and last key block's softmax,
// pushed (DETAIL; DETAIL_AFTER reads the timer once `value` is computed). Off, each is an empty
// statement, so that `if (c) DETAIL_AFTER(...)` never takes the next statement as its body.
#ifdef PHASE_MARKS
#define MARK(i, time) { if (mark != nullptr && tid == 0) phase[i] = (time); }
#else
#define MARK(i, time) {}
#endif
#ifdef PHASE_DETAIL
#define PHASE(i) {}
#define DETAIL(i) MARK(i, global_timer())
#define DETAIL_AFTER(i, value) MARK(i, global_timer_after(value))
#else
#define PHASE(i) MARK(i, global_timer())
#define DETAIL(i) {}
#define DETAIL_AFTER(i, value) {}
#endif

// rows [first, last) of one KV head's K and V into k_s / v_s (row i of the CTA at i * PITCH)
__device__ __forceinline__ void stage_kv(scalar_t* k_s, scalar_t* v_s, const scalar_t* k_head, const scalar_t* v_head,
                                         const Args& a, int cta_start, int first, int last, int tid) {
  constexpr int CHUNKS = HEAD_DIM * 2 / 16;   // 16-byte pieces a row
  const int count = (last - first) * CHUNKS;
#pragma unroll 1   // rolled, as every staging loop: see the note on code size at the kernel
  for (int i = tid; i < count; i += ATT_THREADS) {
    const int row = first + i / CHUNKS, c = (i % CHUNKS) * 8;
    const size_t at = (size_t)(row - cta_start) * PITCH + c;
    cp_async16(k_s + at, k_head + (size_t)row * a.k_sn + c);
    cp_async16(v_s + at, v_head + (size_t)row * a.v_sn + c);
  }
}

// rows [first, last) of a [rows, PITCH] tile zeroed
__device__ __forceinline__ void zero_rows(scalar_t* tile, int first, int last, int tid) {
  constexpr int WORDS = PITCH * 2 / 16;
  uint4* base = reinterpret_cast<uint4*>(tile + (size_t)first * PITCH);
#pragma unroll 1   // rolled: code size
  for (int i = tid; i < (last - first) * WORDS; i += ATT_THREADS) base[i] = make_uint4(0u, 0u, 0u, 0u);
}

// Code size: the kernel runs once a layer on each of its SMs, between other kernels, so its
// instructions come in cold every time. The compiler unrolled the staging loops (most run zero or one
// round) four times, with remainders: 2072 SASS instructions, 1416 with them rolled, and whole steps
// ran 1.5% faster. Keep loops that run once rolled; unroll only the compute.
extern "C" __global__ void __launch_bounds__(ATT_THREADS) cluster_attention(const Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  long long* mark = a.trace != nullptr ? a.trace + (size_t)(a.trace_row + blockIdx.x) * 4 : nullptr;
  if (mark != nullptr && tid == 0) {
    mark[0] = global_timer();
    mark[3] = sm_id();
  }
  if (a.use_pdl && a.trigger == 0) asm volatile("griddepcontrol.launch_dependents;" :::);
#ifdef PHASE_MARKS
  long long phase[4] = {0, 0, 0, 0};
#endif

  const uint32_t rank = cluster_rank();
  const int head_group = blockIdx.x / CLUSTER, b = head_group / a.h_kv, kvh = head_group % a.h_kv;
  const int Q = a.q_rows, rows = GROUP * Q, m_tiles = (rows + 15) / 16, L = a.keys_per_cta;
  const int cta_start = (int)rank * L;
  scalar_t* k_s = reinterpret_cast<scalar_t*>(smem);      // [L, PITCH]
  scalar_t* v_s = k_s + (size_t)L * PITCH;                 // [L, PITCH]
  scalar_t* q_s = v_s + (size_t)L * PITCH;                 // [m_tiles * 16, PITCH]
  // what the CTAs push here: acc [CLUSTER, rows, MERGE_COLS] of this CTA's columns, (m, l) [CLUSTER, rows]
  float* recv_acc = reinterpret_cast<float*>(q_s + (size_t)m_tiles * 16 * PITCH);
  float* recv_ml = recv_acc + (size_t)CLUSTER * rows * MERGE_COLS;
  uint64_t* recv_bar = reinterpret_cast<uint64_t*>(recv_ml + (size_t)CLUSTER * rows * 2);
  const scalar_t* k_head = a.k + b * a.k_sb + kvh * a.k_sh;
  const scalar_t* v_head = a.v + b * a.v_sb + kvh * a.v_sh;

  if (tid == 0) {  // the pushes land on recv_bar: one arrival (here) and the bytes every CTA sends
    mbar_init(recv_bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    mbar_expect_tx(recv_bar, (uint32_t)(CLUSTER * rows * (MERGE_COLS + 2) * 4));
  }
  cluster_arrive_relaxed();   // this CTA runs (waited on before the first remote store)
  zero_rows(q_s, rows, m_tiles * 16, tid);                 // the last m-tile's padding rows
  int seq_len = 0;
  if (a.early) {  // settled: the lengths and the rows before the step's new ones, before the wait
    seq_len = (int)load_cg(a.seq_len + b);
    stage_kv(k_s, v_s, k_head, v_head, a, cta_start, cta_start, max(cta_start, min(cta_start + L, seq_len - Q)), tid);
  }
  if (a.use_pdl) {  // q and the new rows come from the kernel before
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (a.trigger == 1) asm volatile("griddepcontrol.launch_dependents;" :::);
  }
  if (mark != nullptr && tid == 0) mark[1] = global_timer();
  if (!a.early) seq_len = (int)load_cg(a.seq_len + b);
  const int n_keys = max(0, min(L, seq_len - cta_start));  // this CTA's rows below seq_len
  const int n_blocks = (n_keys + KEY_BLOCK - 1) / KEY_BLOCK;
  const int fresh_from = a.early ? max(cta_start, min(cta_start + L, seq_len - Q)) : cta_start;
  stage_kv(k_s, v_s, k_head, v_head, a, cta_start, fresh_from, cta_start + n_keys, tid);
  {  // the q rows of the group's heads: row r = g * Q + lane
    constexpr int CHUNKS = HEAD_DIM * 2 / 16;
#pragma unroll 1   // rolled: code size
    for (int i = tid; i < rows * CHUNKS; i += ATT_THREADS) {
      const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
      cp_async16(q_s + (size_t)r * PITCH + c, a.q + b * a.q_sb + (kvh * GROUP + r / Q) * a.q_sh + (r % Q) * a.q_sq + c);
    }
  }
  zero_rows(k_s, n_keys, n_blocks * KEY_BLOCK, tid);
  zero_rows(v_s, n_keys, n_blocks * KEY_BLOCK, tid);
  cp_async_wait_all();
  __syncthreads();
  PHASE(0)
  cluster_wait_acquire();     // every CTA of the cluster runs, its recv_bar set up: it may be pushed to
  DETAIL(0)

  const int g = lane / 4, t = lane % 4;   // the mma fragments' row group and column pair
  for (int task = warp; task < m_tiles * SLICES; task += WARPS) {
    const int mt = task / SLICES, ds = task % SLICES;
    uint32_t qa[HEAD_DIM / 16][4];       // the m-tile's q as A fragments, one per 16 columns
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks)
      ldmatrix_x4(qa[ks], q_s + (size_t)(mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PITCH + ks * 16 + (lane >> 4) * 8);
    int limit[2];                        // the last cache row rows g and g + 8 of the tile see
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = mt * 16 + g + 8 * i;
      limit[i] = r < rows ? seq_len - Q + r % Q : -1;
    }
    const bool upper_real = mt * 16 + 8 < rows;   // false: rows g + 8 are padding (every decode step)
    float m_i[2] = {-1.0e30f, -1.0e30f};  // finite: a row that sees nothing stays NaN-free
    float l_i[2] = {0.f, 0.f};
    float acc[4][4];                      // [n-tile of 8 columns][fragment]
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[n][j] = 0.f;

    for (int blk = 0; blk < n_blocks; ++blk) {
      const int k0 = blk * KEY_BLOCK;
      float s[KEY_TILES][4];              // scores: [n-tile of 8 keys][fragment]
#pragma unroll
      for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[n][j] = 0.f;
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
#pragma unroll
        for (int np = 0; np < KEY_TILES / 2; ++np) {  // keys k0 + 16 np .. + 15 as two n-tiles
          uint32_t kb[4];
          ldmatrix_x4(kb, k_s + (size_t)(k0 + np * 16 + (lane & 7) + (lane >> 4) * 8) * PITCH + ks * 16 +
                              ((lane >> 3) & 1) * 8);
          mma_16816(s[2 * np], qa[ks], kb[0], kb[1]);
          mma_16816(s[2 * np + 1], qa[ks], kb[2], kb[3]);
        }
      }
      float m_new[2], alpha[2] = {1.f, 1.f}, row_sum[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (i == 1 && !upper_real) break;        // padding rows: their scores stay 0, their outputs unread
        float mx = -__int_as_float(0x7f800000);
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int key = cta_start + k0 + n * 8 + 2 * t + j;
            float& v = s[n][2 * i + j];
            v = key <= limit[i] ? v * a.qk_scale : -__int_as_float(0x7f800000);
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        m_new[i] = fmaxf(m_i[i], mx);
        alpha[i] = exp2_approx(m_i[i] - m_new[i]);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < KEY_TILES; ++n)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            float& v = s[n][2 * i + j];
            v = exp2_approx(v - m_new[i]);
            sum = __fadd_rn(sum, v);
          }
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
        sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
        row_sum[i] = sum;
        l_i[i] = __fmaf_rn(l_i[i], alpha[i], row_sum[i]);
        m_i[i] = m_new[i];
      }
      if (blk == 0) DETAIL_AFTER(1, l_i[0] + l_i[1])
      if (blk == n_blocks - 1) DETAIL_AFTER(2, l_i[0] + l_i[1])
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[n][j] = __fmul_rn(acc[n][j], alpha[j >> 1]);
#pragma unroll
      for (int kk = 0; kk < KEY_TILES / 2; ++kk) {  // keys k0 + 16 kk .. + 15: the probabilities as an A fragment
        const uint32_t pa[4] = {pack_pair(s[2 * kk][0], s[2 * kk][1]), pack_pair(s[2 * kk][2], s[2 * kk][3]),
                                pack_pair(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack_pair(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < 2; ++dp) {  // columns ds * D_SLICE + 16 dp .. + 15 as two n-tiles
          uint32_t vb[4];
          ldmatrix_x4_trans(vb, v_s + (size_t)(k0 + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PITCH +
                                    ds * D_SLICE + dp * 16 + (lane >> 4) * 8);
          mma_16816(acc[2 * dp], pa, vb[0], vb[1]);
          mma_16816(acc[2 * dp + 1], pa, vb[2], vb[3]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {         // the partial of rows g and g + 8, to the owners of its columns
      const int r = mt * 16 + g + 8 * i;
      if (r < rows) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const int col = ds * D_SLICE + n * 8 + 2 * t;   // and col + 1: MERGE_COLS is even
          push_pair(recv_acc + ((size_t)rank * rows + r) * MERGE_COLS + col % MERGE_COLS, col / MERGE_COLS,
                    acc[n][2 * i], acc[n][2 * i + 1], recv_bar);
        }
        if (ds == 0)                      // (m, l) to every owner, the row's four lanes taking turns
          for (int owner = t; owner < CLUSTER; owner += 4)
            push_pair(recv_ml + ((size_t)rank * rows + r) * 2, owner, m_i[i], l_i[i], recv_bar);
      }
    }
  }
  PHASE(1)
  DETAIL(3)
  mbar_wait<true>(recv_bar, 0);           // every CTA's partials for this CTA's columns have landed
  PHASE(2)
  if (a.use_pdl && a.trigger == 2) asm volatile("griddepcontrol.launch_dependents;" :::);
  for (int e = tid; e < rows * MERGE_COLS; e += ATT_THREADS) {
    const int r = e / MERGE_COLS, c = (int)rank * MERGE_COLS + e % MERGE_COLS;
    float ms[CLUSTER], ls[CLUSTER], as[CLUSTER];
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      ms[s] = recv_ml[((size_t)s * rows + r) * 2];
      ls[s] = recv_ml[((size_t)s * rows + r) * 2 + 1];
      as[s] = recv_acc[((size_t)s * rows + r) * MERGE_COLS + e % MERGE_COLS];
    }
    float m = ms[0];
#pragma unroll
    for (int s = 1; s < CLUSTER; ++s) m = fmaxf(m, ms[s]);
    float num = 0.f, den = 0.f;          // splits a row does not see have l = 0 and weight 0
#pragma unroll
    for (int s = 0; s < CLUSTER; ++s) {
      const float w = exp2_approx(ms[s] - m);
      num = __fmaf_rn(w, as[s], num);
      den = __fmaf_rn(w, ls[s], den);
    }
    const float o = den > 0.f ? __fdiv_rn(num, den) : 0.f;
    a.out[b * a.o_sb + (kvh * GROUP + r / Q) * a.o_sh + (r % Q) * a.o_sq + c] = to_scalar(o);
  }
  PHASE(3)
  if (mark != nullptr && tid == 0) {
    mark[2] = global_timer();
#ifdef PHASE_MARKS  // 16 bits of ns after the wait each: staged, partials pushed, partials landed, merged
    mark[3] = pack_phases(phase, mark[1]);
#endif
  }
}
