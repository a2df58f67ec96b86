// stream_linear: a few-row linear (decode and verify) whose weights stream through a ring of shared
// memory slots filled by bulk copies (TMA), one CTA per SM.
//
// Why: at batch 1 a projection is a weight stream. The Triton tiles (kernels/small_matmul) stream
// 16-26 GB/s per program through cp.async (docs/performance.md, stop 15). One producer
// thread per SM issuing bulk copies of contiguous 8-32 KB chunks pulls the copy bandwidth or more
// (NOTES, stop 20). Weight rows are contiguous in nn.Linear's layout, so a chunk of whole rows is
// one copy, no repacking. Measured (NOTES, stop 23): alone, Qwen2.5-1.5B's gate_up 16.2 us against
// the Triton tiles' 19.8 and its lm_head 112 against 122. In whole decode steps, once the folded
// norm's parts loaded in flight together (stream_common.cuh, row_scales), Qwen2.5-1.5B's gate_up
// gained: 860 against 834 tok/s (NOTES, stop 25), so kernels/small_matmul's table routes that
// weight here; the others stay on the Triton tiles.
//
// Layout (grid = G CTAs, 9 warps each):
//   units: output rows (plain), (gate row u, up row N + u) pairs (gated), or with rope (-DWITH_ROPE
//   build, the q/k/v projection) the (d, d + D/2) row pairs of each head; CTA b owns units
//   [b * U / G, (b + 1) * U / G) (with rope rounded to whole chunks, which never span two heads),
//   in chunks of chunk_units units.
//   warp 8, lane 0: the producer. It streams the CTA's chunks into num_slots slots and never
//   waits on the previous kernel: weights depend on no kernel, so under programmatic dependent
//   launch the ring fills while the kernel before is still running.
//   warps 0-7: consumers, in min(8 / chunk_units, num_slots) groups of chunk_units warps; group g
//   takes chunks g, g + groups, ... through slots of its own; warp i of a group takes the chunk's
//   unit i. They wait for the previous kernel (griddepcontrol.wait) before reading x, the
//   residual or the norm sums; x is then copied into shared memory when small (stage_x).
//
// Bits: a row's sum is one lane-strided fmaf chain per lane (k = 8 lane + 256 i + j, in order),
// then a fixed butterfly; lane 0's value is used. Nothing depends on M or on other rows, so row m
// of a verify step equals the decode step's row bit for bit (tests/kernels/test_stream_linear.py).
// Every M bucket (MB) compiles the same per-row instruction sequence.
#include "stream_common.cuh"   // scalar_t, unpack8, dot_row, mbar_*, bulk_copy, timers

struct Args {
  const scalar_t* weight;     // [rows, K]: rows = N, or 2N (gate rows, then up rows) when gated
  const scalar_t* x;          // [M, K]
  const scalar_t* bias;       // [N] or null
  const float* row_sumsq;     // [P, M] or null: x = norm_weight * h, scale by rsqrt(sum / K + eps)
  const scalar_t* residual;   // [M, N] or null
  const scalar_t* emit_weight;  // [N] or null: also write NormInputs of out
  scalar_t* out;              // [M, N]
  scalar_t* weighted;         // [M, N] (emit): emit_weight * out
  float* sumsq_parts;         // [G, M] (emit): this CTA's sum of out^2 over its units, in unit order
  int M, N, K, P;
  float eps;
  int gated, chunk_units, num_slots, use_pdl;
  int stage_x;                // copy x into shared memory after the wait (M * K small enough)
  long long* trace;           // null, or kernels._trace rows: [G, 4] from trace_row (START, WAITED, END, SM)
  int trace_row;
#ifdef WITH_ROPE
  // rope (the q/k/v projection of a decode or verify step; rope_cos null: none). Units are then the
  // (d, d + D/2) row pairs of each head, N of them (weight [2N, K]); rows m = b T + t.
  const float* rope_cos;      // [T, D] f32
  const float* rope_sin;      // [T, D] f32
  const long long* positions; // [T] cache rows
  scalar_t* q_out;            // [B, Hq, T, D] (strided)
  scalar_t* k_cache;          // [B, Hkv, S_max, D] (strided)
  scalar_t* v_cache;
  long long q_stride_b, q_stride_h, q_stride_t, c_stride_b, c_stride_h, c_stride_n;
  int T, heads, kv_heads, head_dim;
  int rope_early;             // the tables and positions were written two or more launches back:
                              // read them before griddepcontrol.wait (kernels._pdl, "Settled inputs")
#endif
};

#ifdef WITH_ROPE

// What the rope epilogue of one unit reads besides the sums, for row m = lane: the pair's bias and
// the rope tables at t and the cache row. Loaded ahead of the sums (before the wait on the kernel
// before when those inputs are settled), so that their round trips overlap the weight copies
// instead of following the dot products. Kept as loaded: a conversion here (the tables' rounding
// to the model dtype, the bias's widening) would make the warp wait for the loads before its
// griddepcontrol.wait (NOTES stop 27); rope_epilogue converts them.
struct RopeInputs {
  scalar_t bias1, bias2;
  float cos1, cos2, sin1, sin2;
  long long position;
};

__device__ __forceinline__ RopeInputs load_rope_inputs(const Args& a, int unit, int lane) {
  RopeInputs in = {0, 0, 1.f, 1.f, 0.f, 0.f, 0};
  if (lane >= a.M) return in;
  const int D = a.head_dim, half = D / 2, head = unit / half, d = unit % half;
  const int row = head * D + d, t = lane % a.T;
  if (a.bias != nullptr) {
    in.bias1 = a.bias[row];
    in.bias2 = a.bias[row + half];
  }
  if (head < a.heads + a.kv_heads) {
    const float* cos_t = a.rope_cos + (size_t)t * D;
    const float* sin_t = a.rope_sin + (size_t)t * D;
    in.cos1 = cos_t[d];
    in.cos2 = cos_t[d + half];
    in.sin1 = sin_t[d];
    in.sin2 = sin_t[d + half];
  }
  if (head >= a.heads) in.position = a.positions[t];
  return in;
}

// The rope epilogue of unit `unit` (rows d and d + D/2 of head `unit / (D/2)`) for row m = lane
// (every lane holds the butterfly's sums, bit for bit the same): what kernels.rope_cache does after
// the projection, with kernels.small_matmul's rounding (sum * scale + bias, rounded; the tables
// rounded to the model dtype; the fused multiply-adds of rope_cache's rotate_with), so the fused
// route gives the bits of this kernel's plain projection followed by kernels.rope_cache.
template <int MB>
__device__ __forceinline__ void rope_epilogue(const Args& a, int unit, int lane, const float* first,
                                              const float* second, const float* scale, const RopeInputs& in) {
  float s1 = 0.f, s2 = 0.f, sc = 1.f;
#pragma unroll
  for (int m = 0; m < MB; ++m)
    if (m == lane) { s1 = first[m]; s2 = second[m]; sc = scale[m]; }
  if (lane >= a.M) return;
  const int D = a.head_dim, half = D / 2, head = unit / half, d = unit % half;
  const int t = lane % a.T, b = lane / a.T;
  float v1 = __fmul_rn(s1, sc), v2 = __fmul_rn(s2, sc);
  if (a.bias != nullptr) {
    v1 = __fadd_rn(v1, to_float(in.bias1));
    v2 = __fadd_rn(v2, to_float(in.bias2));
  }
  v1 = round_to_scalar(v1);
  v2 = round_to_scalar(v2);
  if (head < a.heads + a.kv_heads) {   // q and k rotate ("rotate half"); v is stored as it is
    // the tables rounded to the model dtype, as the eager tables are
    const float cos1 = round_to_scalar(in.cos1), cos2 = round_to_scalar(in.cos2);
    const float sin1 = round_to_scalar(in.sin1), sin2 = round_to_scalar(in.sin2);
    const float y1 = __fmaf_rn(v1, cos1, -__fmul_rn(v2, sin1));
    const float y2 = __fmaf_rn(v2, cos2, __fmul_rn(v1, sin2));
    v1 = y1;
    v2 = y2;
  }
  scalar_t* dst;
  if (head < a.heads) {
    dst = a.q_out + b * a.q_stride_b + head * a.q_stride_h + t * a.q_stride_t + d;
  } else {
    const long long cache_row = b * a.c_stride_b + in.position * a.c_stride_n + d;
    dst = head < a.heads + a.kv_heads ? a.k_cache + cache_row + (head - a.heads) * a.c_stride_h
                                      : a.v_cache + cache_row + (head - a.heads - a.kv_heads) * a.c_stride_h;
  }
  dst[0] = to_scalar(v1);
  dst[half] = to_scalar(v2);
}
#endif  // WITH_ROPE

template <int MB>
__device__ __forceinline__ void stream_linear_body(const Args& a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int K = a.K, M = a.M, N = a.N;
  const int cu = a.chunk_units, S = a.num_slots;
  const size_t part_bytes = (size_t)cu * K * sizeof(scalar_t);    // one row block of a slot
  // rope code only in the -DWITH_ROPE build: the other projections' kernels compile as they did
  // before it (their registers, and the bits the GPU tests checked)
#ifdef WITH_ROPE
  const bool rope = a.rope_cos != nullptr;
  const bool paired = a.gated || rope;   // two row blocks a chunk
#define PAIRED paired
#else
#define PAIRED a.gated
#endif
  const size_t slot_bytes = part_bytes * (PAIRED ? 2 : 1);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + (size_t)S * slot_bytes);
  uint64_t* empty = full + S;
  // after the ring: 256 B of mbarriers (16 slots at most), the squares, then the staged x
  float* unit_sq = reinterpret_cast<float*>(full + 32);            // [units of this CTA, M] (emit)
  const int max_units = (N + gridDim.x - 1) / gridDim.x;
  const size_t sq_bytes = a.emit_weight != nullptr ? ((size_t)max_units * M * 4 + 15) / 16 * 16 : 0;
  scalar_t* x_staged = reinterpret_cast<scalar_t*>(reinterpret_cast<uint8_t*>(unit_sq) + sq_bytes);  // [M, K]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  long long* mark = a.trace != nullptr ? a.trace + (size_t)(a.trace_row + blockIdx.x) * 4 : nullptr;
  if (mark != nullptr && tid == 0) {
    mark[0] = global_timer();
    mark[3] = sm_id();
  }
  const int G = gridDim.x, b = blockIdx.x;
#ifdef WITH_ROPE
  // a CTA's units; with rope whole chunks, so that a chunk's pairs never span two heads (cu divides D/2)
  const int grain = rope ? cu : 1;
  const int u0 = (int)((long long)b * (N / grain) / G) * grain, u1 = (int)((long long)(b + 1) * (N / grain) / G) * grain;
#else
  const int u0 = (int)((long long)b * N / G), u1 = (int)((long long)(b + 1) * N / G);
#endif
  const int num_chunks = (u1 - u0 + cu - 1) / cu;
  // Each group owns S / groups slots of its own, a single-consumer ring: chunk c goes to group
  // c % groups, as that group's chunk j = c / groups, into its slot j % per_group. Groups sharing
  // slots would break the parity waits: a parity tells only adjacent phases of a slot apart, and
  // copies may land, and groups may finish, out of order (the shared ring faulted on the H200).
  // No more groups than slots; the warps of further groups idle.
  const int groups = min(CONSUMER_WARPS / cu, S);
  const int per_group = S / groups;

#ifdef TRIGGER_AT_START  // (trigger 0, kernels._pdl) the next launch may start now and fill its own ring
  if (a.use_pdl) asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  if (tid == 0) init_ring(full, empty, S, cu);
  __syncthreads();

  if (warp == CONSUMER_WARPS) {  // the producer: weights only, so no wait on the kernel before
    if (lane) return;
#ifdef PRODUCER_TRIGGER  // (a probe's switch, launch_switches) the dependents may launch from the start
    if (a.use_pdl) asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
    const uint64_t policy = evict_first_policy();
    for (int c = 0; c < num_chunks; ++c) {
      const int j = c / groups, slot = (c % groups) * per_group + j % per_group;
      const int first = u0 + c * cu, count = min(cu, u1 - first);
      const uint32_t bytes = (uint32_t)count * K * sizeof(scalar_t);
      mbar_wait(&empty[slot], ((j / per_group) & 1) ^ 1);
      mbar_expect_tx(&full[slot], PAIRED ? 2 * bytes : bytes);
      uint8_t* dst = smem + (size_t)slot * slot_bytes;
#ifdef WITH_ROPE
      // the chunk's first rows: gate or plain rows `first..`, or dims d.. of a head; then their partners
      const int half = a.head_dim / 2;
      const size_t row = rope ? (size_t)(first / half) * a.head_dim + first % half : (size_t)first;
      bulk_copy(dst, a.weight + row * K, bytes, &full[slot], policy);
      if (paired) {
        const size_t partner = rope ? row + half : (size_t)(N + first);
        bulk_copy(dst + part_bytes, a.weight + partner * K, bytes, &full[slot], policy);
      }
#else
      bulk_copy(dst, a.weight + (size_t)first * K, bytes, &full[slot], policy);
      if (a.gated) bulk_copy(dst + part_bytes, a.weight + (size_t)(N + first) * K, bytes, &full[slot], policy);
#endif
    }
    return;
  }

#ifdef WITH_ROPE
  // rope: the first chunk's epilogue inputs, before the wait when settled (the bias always is)
  RopeInputs first_inputs;
  if (rope && warp / cu < groups && warp / cu < num_chunks && a.rope_early)
    first_inputs = load_rope_inputs(a, u0 + (warp / cu) * cu + warp % cu, lane);
#endif
  if (a.use_pdl) {  // x, the residual and the norm sums come from the kernels before
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifndef TRIGGER_AT_START
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
  }
  if (mark != nullptr && tid == 0) mark[1] = global_timer();
  float scale[MB];
  const scalar_t* x = stage_x_and_row_scales<MB>(a.x, x_staged, a.stage_x, M, K, a.row_sumsq, a.P, a.eps, tid, lane,
                                                 scale);
#ifdef PHASE_MARKS  // (a probe's switch, launch_switches) thread 0's phases after its wait, in ns, in mark[3]
  long long phase[4] = {0, 0, 0, 0};
  if (mark != nullptr && tid == 0) phase[0] = global_timer_after(scale[0] + to_float(x[0]));
#endif

  const int group = warp / cu, index = warp % cu;
  for (int c = group; group < groups && c < num_chunks; c += groups) {
    const int j = c / groups, slot = group * per_group + j % per_group;
    const int unit = u0 + c * cu + index;
#ifdef WITH_ROPE
    RopeInputs inputs;   // issued before the wait for the weights
    if (rope && unit < u1) inputs = c == group && a.rope_early ? first_inputs : load_rope_inputs(a, unit, lane);
#endif
    mbar_wait(&full[slot], (j / per_group) & 1);
#ifdef PHASE_MARKS
    if (mark != nullptr && tid == 0 && c == group) phase[1] = global_timer();
#endif
    if (unit < u1) {
      const scalar_t* rows = reinterpret_cast<const scalar_t*>(smem + (size_t)slot * slot_bytes);
      float acc[MB], up[MB];
      if (PAIRED)   // x staged or global: the same arithmetic
        dot_row_pair<MB>(rows + (size_t)index * K, rows + (size_t)(cu + index) * K, x, M, K, lane, acc, up);
      else
        dot_row<MB>(rows + (size_t)index * K, x, M, K, lane, acc);
#ifdef PHASE_MARKS
      if (mark != nullptr && tid == 0 && c == group) phase[2] = global_timer_after(acc[0] + (PAIRED ? up[0] : 0.f));
#endif
#ifdef WITH_ROPE
      if (rope) {
        rope_epilogue<MB>(a, unit, lane, acc, up, scale, inputs);
      } else
#endif
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < MB; ++m) {
          if (m < M) {
            float v = __fmul_rn(acc[m], scale[m]);
            if (a.bias != nullptr) v = __fadd_rn(v, to_float(a.bias[unit]));
            v = round_to_scalar(v);
            if (a.gated) v = silu_mul_rounded(v, round_to_scalar(__fmul_rn(up[m], scale[m])));
            if (a.residual != nullptr) v = round_to_scalar(__fadd_rn(v, to_float(a.residual[(size_t)m * N + unit])));
            a.out[(size_t)m * N + unit] = to_scalar(v);
            if (a.emit_weight != nullptr) {
              a.weighted[(size_t)m * N + unit] = to_scalar(__fmul_rn(v, to_float(a.emit_weight[unit])));
              unit_sq[(size_t)(unit - u0) * M + m] = __fmul_rn(v, v);
            }
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
#ifdef PHASE_MARKS
    if (mark != nullptr && tid == 0 && c == group) phase[3] = global_timer();
#endif
  }
#ifdef PHASE_MARKS  // x staged and scaled | first chunk's weights there << 16 | its dot products << 32 | its
                    // epilogue issued << 48 (in the trace's SM slot)
  if (mark != nullptr && tid == 0) mark[3] = pack_phases(phase, mark[1]);
#endif

  if (a.emit_weight != nullptr) {  // this CTA's part of the sums of squares, in unit order
    consumers_sync();
    if (tid < M) {
      float total = 0.f;
#pragma unroll 1   // rolled: code size
      for (int u = 0; u < u1 - u0; ++u) total = __fadd_rn(total, unit_sq[(size_t)u * M + tid]);
      a.sumsq_parts[(size_t)b * M + tid] = total;
    }
  }
  if (mark != nullptr) {  // END once every consumer is done
    consumers_sync();
    if (tid == 0) mark[2] = global_timer();
  }
}

#undef PAIRED

#define STREAM_LINEAR_KERNEL(MB)                                                             \
  extern "C" __global__ void __launch_bounds__(THREADS, MB <= 8 ? 2 : 1) stream_linear_m##MB(const Args a) { \
    stream_linear_body<MB>(a);                                                                 \
  }
STREAM_LINEAR_KERNEL(1)
STREAM_LINEAR_KERNEL(2)
STREAM_LINEAR_KERNEL(4)
STREAM_LINEAR_KERNEL(8)
STREAM_LINEAR_KERNEL(17)
STREAM_LINEAR_KERNEL(32)
