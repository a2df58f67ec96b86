// stream_mlp: the fused MLP's slice kernel (kernels/fused_mlp) with its weights streamed through a
// ring of shared-memory slots by bulk copies (TMA), one CTA per SM.
//
// Why: the Triton slice kernel (triton_kernel.py) streams gate/up, then down, each through
// cp.async tiles of one program, and lost to the chain at Qwen2.5-1.5B (816 against 837 tok/s,
// docs/performance.md "Stop 19"): its down rows only start after the gate/up loop, and
// one program streams 16-26 GB/s. Here a producer thread streams the CTA's gate/up rows and then
// its down rows without a pause (weights depend on no kernel), at the copy bandwidth (NOTES, stops
// 20 and 23), while the consumers compute. The gate_up -> down boundary, down's k split and its
// wave tail are gone: a CTA's down rows need only the act values it computed itself.
//
// Layout (grid = G CTAs, 9 warps each; CTA b owns intermediate rows [b I / G, (b + 1) I / G)):
//   phase 1 (gate/up): chunks of cu (gate row, up row) pairs, two bulk copies a chunk; consumer
//     groups of cu warps, warp i of a group takes the chunk's pair i: act = silu(gate) * up with
//     stream_linear's arithmetic, rounded to the model dtype, kept in shared memory.
//   phase 2 (down): chunks of 2 cu rows of down_t (the down weight transposed, [I, H], so the
//     CTA's rows are one contiguous block); every consumer thread owns 8 output columns (or more
//     groups of 8 when H > 2048) and adds act[m][r] * down_t[r][cols] for r in order.
//   The ring's slots are shared by the two phases; a slot's use count (and so its mbarrier parity)
//   follows from the chunk schedule alone (slot_uses_in_phase1), which producer and consumers
//   compute the same way. An empty barrier takes 8 arrivals a use: one per warp in phase 2,
//   8 / cu per warp of the group in phase 1.
//   Output: this CTA's float32 partial part[b, m, :] (the sum over its rows); triton_kernel.py's
//   _mlp_reduce_kernel sums the G partials in one fixed order and adds the residual.
//
// Bits: a column's sum is one fmaf chain over the CTA's rows in order, per row m, so nothing
// depends on M: row m of a verify step equals the decode step's row bit for bit
// (tests/kernels/test_fused_mlp.py). COL_GROUPS (a -D switch, ceil(H / 2048)) sizes the
// accumulators [COL_GROUPS][MB][8] per thread.
#include "stream_common.cuh"   // scalar_t, unpack8, dot_row_pair, row_scales, silu_mul_rounded, mbar_*, bulk_copy

#ifndef COL_GROUPS
#define COL_GROUPS 1
#endif
#define CONSUMER_THREADS (CONSUMER_WARPS * 32)

struct MlpArgs {
  const scalar_t* gate_up;    // [2I, H]: gate rows, then up rows
  const scalar_t* down_t;     // [I, H]
  const scalar_t* x;          // [M, H]: norm_weight * h
  const float* row_sumsq;     // [P, M]: h's sums of squares, in parts
  float* part;                // [G, M, H]: this CTA's partial sums of act down_t
  int M, H, I, P;
  float eps;
  int chunk_units, num_slots, use_pdl, stage_x;
  long long* trace;           // null, or kernels._trace rows: [G, 4] from trace_row (START, WAITED, END, SM)
  int trace_row;
};

// How many times phase 1 fills `slot`: chunk c goes to group c % groups, as its chunk j = c / groups,
// into the group's slot j % per_group (stream_linear's single-consumer rings per group).
__device__ __forceinline__ int slot_uses_in_phase1(int slot, int chunks, int groups, int per_group) {
  const int g = slot / per_group, local = slot % per_group;
  if (g >= groups || chunks <= g) return 0;
  const int group_chunks = (chunks - g + groups - 1) / groups;
  return group_chunks > local ? (group_chunks - local + per_group - 1) / per_group : 0;
}

template <int MB>
__device__ __forceinline__ void stream_mlp_body(const MlpArgs& a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int H = a.H, M = a.M, I = a.I;
  const int cu = a.chunk_units, S = a.num_slots;
  const size_t row_bytes = (size_t)H * sizeof(scalar_t);
  const size_t slot_bytes = 2 * (size_t)cu * row_bytes;   // cu gate + cu up rows, or 2 cu down rows
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)S * slot_bytes);
  uint64_t* empty = full + S;
  // after the ring: 256 B of mbarriers (16 slots at most), act [rows of this CTA, M] f32, x [M, H]
  float* act = reinterpret_cast<float*>(full + 32);
  const int max_rows = (I + gridDim.x - 1) / gridDim.x;
  scalar_t* x_staged = reinterpret_cast<scalar_t*>(act + ((size_t)max_rows * M + 3) / 4 * 4);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  long long* mark = a.trace != nullptr ? a.trace + (size_t)(a.trace_row + blockIdx.x) * 4 : nullptr;
  if (mark != nullptr && tid == 0) {
    mark[0] = global_timer();
    mark[3] = sm_id();
  }
  const int G = gridDim.x, b = blockIdx.x;
  const int r0 = (int)((long long)b * I / G), r1 = (int)((long long)(b + 1) * I / G);
  const int rows = r1 - r0;
  const int chunks1 = (rows + cu - 1) / cu;              // gate/up pairs, cu a chunk
  const int chunks2 = (rows + 2 * cu - 1) / (2 * cu);    // down rows, 2 cu a chunk
  const int groups = min(CONSUMER_WARPS / cu, S);
  const int per_group = S / groups;

  if (tid == 0) init_ring(full, empty, S, CONSUMER_WARPS);
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // the producer: weights only, so no wait on the kernel before
    if (lane) return;
#ifdef PRODUCER_TRIGGER  // (a probe's switch, launch_switches) the dependents may launch from the start
    if (a.use_pdl) asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    const uint64_t policy = evict_first_policy();
    for (int c = 0; c < chunks1; ++c) {
      const int j = c / groups, slot = (c % groups) * per_group + j % per_group;
      const int first = r0 + c * cu, count = min(cu, r1 - first);
      const uint32_t bytes = (uint32_t)(count * row_bytes);
      mbar_wait(&empty[slot], ((j / per_group) & 1) ^ 1);
      mbar_expect_tx(&full[slot], 2 * bytes);
      uint8_t* dst = smem + (size_t)slot * slot_bytes;
      bulk_copy(dst, a.gate_up + (size_t)first * H, bytes, &full[slot], policy);
      bulk_copy(dst + cu * row_bytes, a.gate_up + (size_t)(I + first) * H, bytes, &full[slot], policy);
    }
    for (int d = 0; d < chunks2; ++d) {
      const int slot = d % S, use = slot_uses_in_phase1(slot, chunks1, groups, per_group) + d / S;
      const int first = r0 + d * 2 * cu, count = min(2 * cu, r1 - first);
      const uint32_t bytes = (uint32_t)(count * row_bytes);
      mbar_wait(&empty[slot], (use & 1) ^ 1);
      mbar_expect_tx(&full[slot], bytes);
      bulk_copy(smem + (size_t)slot * slot_bytes, a.down_t + (size_t)first * H, bytes, &full[slot], policy);
    }
    return;
  }

  if (a.use_pdl) {  // x and the norm sums come from the kernels before
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
  }
  if (mark != nullptr && tid == 0) mark[1] = global_timer();
  float scale[MB];
  const scalar_t* x = stage_x_and_row_scales<MB>(a.x, x_staged, a.stage_x, M, H, a.row_sumsq, a.P, a.eps, tid, lane,
                                                 scale);

  // phase 1: act[r][m] for the CTA's rows, stream_linear's gated arithmetic
  const int group = warp / cu, index = warp % cu;
  for (int c = group; group < groups && c < chunks1; c += groups) {
    const int j = c / groups, slot = group * per_group + j % per_group;
    const int row = c * cu + index;   // within the CTA's rows
    mbar_wait(&full[slot], (j / per_group) & 1);
    if (row < rows) {
      const scalar_t* w = reinterpret_cast<const scalar_t*>(smem + (size_t)slot * slot_bytes);
      float gate[MB], up[MB];
      dot_row_pair<MB>(w + (size_t)index * H, w + (size_t)(cu + index) * H, x, M, H, lane, gate, up);
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          if (m < M) {
            const float g = round_to_scalar(__fmul_rn(gate[m], scale[m]));
            act[(size_t)row * M + m] = silu_mul_rounded(g, round_to_scalar(__fmul_rn(up[m], scale[m])));
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;"
                                ::"r"(smem_addr(&empty[slot])), "r"(CONSUMER_WARPS / cu) : "memory");
  }
  consumers_sync();   // every act value of the CTA written

  // phase 2: part[m][cols] = sum over the CTA's rows r, in order, of act[r][m] * down_t[r][cols]
  float acc[COL_GROUPS][MB][8];
#pragma unroll
  for (int g = 0; g < COL_GROUPS; ++g)
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][m][j] = 0.f;
  const int col_groups = H / 8;
  for (int d = 0; d < chunks2; ++d) {
    const int slot = d % S, use = slot_uses_in_phase1(slot, chunks1, groups, per_group) + d / S;
    const int first = d * 2 * cu, count = min(2 * cu, rows - first);
    mbar_wait(&full[slot], use & 1);
    const scalar_t* w = reinterpret_cast<const scalar_t*>(smem + (size_t)slot * slot_bytes);
    for (int r = 0; r < count; ++r) {
      const float* act_r = act + (size_t)(first + r) * M;
#pragma unroll
      for (int g = 0; g < COL_GROUPS; ++g) {
        const int cg = tid + g * CONSUMER_THREADS;
        if (cg < col_groups) {
          float wv[8];
          unpack8(*reinterpret_cast<const uint4*>(w + (size_t)r * H + cg * 8), wv);
#pragma unroll
          for (int m = 0; m < MB; ++m) {
            if (m < M) {
              const float av = act_r[m];
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[g][m][j] = __fmaf_rn(av, wv[j], acc[g][m][j]);
            }
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
  }
#pragma unroll
  for (int g = 0; g < COL_GROUPS; ++g) {
    const int cg = tid + g * CONSUMER_THREADS;
    if (cg < col_groups) {
#pragma unroll
      for (int m = 0; m < MB; ++m) {
        if (m < M) {
          float4* dst = reinterpret_cast<float4*>(a.part + ((size_t)b * M + m) * H + cg * 8);
          dst[0] = make_float4(acc[g][m][0], acc[g][m][1], acc[g][m][2], acc[g][m][3]);
          dst[1] = make_float4(acc[g][m][4], acc[g][m][5], acc[g][m][6], acc[g][m][7]);
        }
      }
    }
  }
  if (mark != nullptr) {  // END once every consumer is done
    consumers_sync();
    if (tid == 0) mark[2] = global_timer();
  }
}

#define STREAM_MLP_KERNEL(MB)                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS, MB <= 8 ? 2 : 1) stream_mlp_m##MB(const MlpArgs a) { \
    stream_mlp_body<MB>(a);                                                                 \
  }
STREAM_MLP_KERNEL(1)
STREAM_MLP_KERNEL(2)
STREAM_MLP_KERNEL(4)
STREAM_MLP_KERNEL(8)
STREAM_MLP_KERNEL(17)
STREAM_MLP_KERNEL(32)
