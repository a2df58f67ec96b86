// Device helpers shared by the bulk-copy streaming kernels (stream_linear.cu, kernels/fused_mlp/
// stream_mlp.cu): 16-bit values as raw bits, the lane-strided row dot product whose order defines
// the bits, and the timer and SM id that kernels._trace rows record.
//
// No headers: NVRTC has no C library, and cuda_bf16.h / cuda_fp16.h are not on its path
// everywhere, so the 16-bit values are raw bits converted with PTX.
#pragma once

typedef unsigned long long uint64_t;
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
typedef uint16_t scalar_t;   // bf16 bits, or f16 bits with -DSCALAR_F16

#define CONSUMER_WARPS 8
#define THREADS ((CONSUMER_WARPS + 1) * 32)

__device__ __forceinline__ float to_float(uint16_t v) {
#ifdef SCALAR_F16
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
#else
  return __uint_as_float((uint32_t)v << 16);
#endif
}
__device__ __forceinline__ uint16_t to_scalar(float v) {  // round to nearest even
  uint16_t h;
#ifdef SCALAR_F16
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
  return h;
}
__device__ __forceinline__ float round_to_scalar(float v) { return to_float(to_scalar(v)); }

// 8 values from one 16-byte word, by bit operations on its four 32-bit lanes: taking the word's
// address to index it as 16-bit values made the compiler split the load into eight 2-byte loads
// (2.6x slower as a whole, bench/stream_linear.py)
__device__ __forceinline__ void unpack2(uint32_t r, float* out) {
#ifdef SCALAR_F16
  out[0] = to_float((uint16_t)(r & 0xffffu));
  out[1] = to_float((uint16_t)(r >> 16));
#else
  out[0] = __uint_as_float(r << 16);
  out[1] = __uint_as_float(r & 0xffff0000u);
#endif
}
__device__ __forceinline__ void unpack8(const uint4& raw, float* out) {
  unpack2(raw.x, out);
  unpack2(raw.y, out + 2);
  unpack2(raw.z, out + 4);
  unpack2(raw.w, out + 6);
}

#include "bulk_ring.cuh"   // mbar_*, bulk_copy, smem_addr
__device__ __forceinline__ long long global_timer() {  // ns, one clock for every SM
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// the same once `after` is computed (its operand orders the read after it), for the phase marks
__device__ __forceinline__ long long global_timer_after(float after) {
  long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t) : "f"(after) : "memory");
  return t;
}
// PHASE_MARKS (KernelOptions.stream_phase_marks): four phase times as 16 bits of ns each after
// `waited` (65535: not reached), packed for the trace's SM slot, as bench/timeline.py's phase_table reads it
__device__ __forceinline__ long long pack_phases(const long long (&phase)[4], long long waited) {
  long long packed = 0;
  for (int i = 0; i < 4; ++i) packed |= (phase[i] ? min(max(phase[i] - waited, 0ll), 65535ll) : 65535ll) << (16 * i);
  return packed;
}
__device__ __forceinline__ long long sm_id() {
  unsigned s;
  asm volatile("mov.u32 %0, %smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ void consumers_sync() {  // the 256 consumer threads only
  asm volatile("bar.sync 1, %0;" ::"n"(CONSUMER_WARPS * 32) : "memory");
}

// acc[r][m] = rows[r] . x[m] for r < R, m < M, on lane 0 after the butterfly (every lane holds a
// sum; lane 0's order is the defined one). rows: R rows of K values in shared memory; x: [M, K] in
// global or shared memory. With R = 2 (gate and up, or a rope pair) each x piece is read once for
// both rows and the two chains of fused multiply-adds interleave, so a warp waits on half the
// latency (a pair took 1.6 us of a decode qkv's 3.9 one after the other). Every sum
// takes the same operations in the same order whatever R is: the same bits.
template <int MB, int R>
__device__ __forceinline__ void dot_rows(const scalar_t* const (&rows)[R], const scalar_t* x, int M, int K, int lane,
                                         float (&acc)[R][MB]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MB; ++m) acc[r][m] = 0.f;
#pragma unroll (R == 1 ? 4 : 2)
  for (int k = lane * 8; k < K; k += 256) {
    float w[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) unpack8(*reinterpret_cast<const uint4*>(rows[r] + k), w[r]);
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        float xv[8];
        unpack8(*reinterpret_cast<const uint4*>(x + (size_t)m * K + k), xv);
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int r = 0; r < R; ++r) acc[r][m] = __fmaf_rn(w[r][j], xv[j], acc[r][m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int offset = 16; offset >= 1; offset >>= 1)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r][m] = __fadd_rn(acc[r][m], __shfl_xor_sync(0xffffffffu, acc[r][m], offset));
  }
}

// acc[m] = row . x[m] (dot_rows of one row)
template <int MB>
__device__ __forceinline__ void dot_row(const scalar_t* row, const scalar_t* x, int M, int K, int lane, float* acc) {
  const scalar_t* rows[1] = {row};
  float sums[1][MB];
  dot_rows<MB, 1>(rows, x, M, K, lane, sums);
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m] = sums[0][m];
}

// acc1[m] = row1 . x[m], acc2[m] = row2 . x[m] in one pass (dot_rows of two rows)
template <int MB>
__device__ __forceinline__ void dot_row_pair(const scalar_t* row1, const scalar_t* row2, const scalar_t* x, int M,
                                             int K, int lane, float* acc1, float* acc2) {
  const scalar_t* rows[2] = {row1, row2};
  float sums[2][MB];
  dot_rows<MB, 2>(rows, x, M, K, lane, sums);
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    acc1[m] = sums[0][m];
    acc2[m] = sums[1][m];
  }
}

// scale[m]: the folded RMSNorm's row scale rsqrt(sum of h^2 / K + eps), or 1 without row_sumsq
// ([P, M] f32: one part per CTA or program of the kernel before, up to a few hundred). The parts are
// summed across the lanes, each lane's in order, then lane 0's butterfly; every lane gets the same
// value. A lane's first 16 / MB parts of a row are loaded before any is added: a loop of dependent
// adds issued one L2 round trip per part (6 for the 192 parts of o's gemv, about 3 us under a full
// memory system). The order of the adds is the same either way.
template <int MB>
__device__ __forceinline__ void row_scales(const float* row_sumsq, int P, int M, int K, float eps, int lane,
                                           float* scale) {
  constexpr int PARTS_IN_FLIGHT = MB >= 16 ? 1 : 16 / MB;   // 16 registers of loads in flight
  float first[MB][PARTS_IN_FLIGHT];
#pragma unroll
  for (int m = 0; m < MB; ++m) {
#pragma unroll
    for (int i = 0; i < PARTS_IN_FLIGHT; ++i) {
      const int p = lane + 32 * i;
      first[m][i] = row_sumsq != nullptr && m < M && p < P ? row_sumsq[(size_t)p * M + m] : 0.f;
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    scale[m] = 1.f;
    if (row_sumsq != nullptr && m < M) {
      float total = 0.f;
#pragma unroll
      for (int i = 0; i < PARTS_IN_FLIGHT; ++i)
        if (lane + 32 * i < P) total = __fadd_rn(total, first[m][i]);
#pragma unroll 1   // rolled: code size (see stage_x_and_row_scales)
      for (int p = lane + 32 * PARTS_IN_FLIGHT; p < P; p += 32) total = __fadd_rn(total, row_sumsq[(size_t)p * M + m]);
#pragma unroll
      for (int offset = 16; offset >= 1; offset >>= 1) total = __fadd_rn(total, __shfl_xor_sync(0xffffffffu, total, offset));
      total = __shfl_sync(0xffffffffu, total, 0);
      scale[m] = rsqrtf(__fadd_rn(__fdiv_rn(total, (float)K), eps));
    }
  }
}

// silu(gate) * up for a gate and an up already rounded to the model dtype: silu(gate) and the
// product rounded as the reference (kernels.small_matmul.reference) rounds them
__device__ __forceinline__ float silu_mul_rounded(float gate, float up) {
  const float silu = round_to_scalar(__fdiv_rn(gate, __fadd_rn(1.f, expf(-gate))));
  return round_to_scalar(__fmul_rn(silu, up));
}

// The consumers' start once the kernel before is done: x [M, K] copied into shared memory when
// `stage` (the dot products' loads then stay off the L2, which the stream keeps busy), and the
// norm's row scales. A thread's first 16-byte piece of x is in flight while the scales' parts load,
// so the two cost one L2 round trip, not two. Returns the x to read (staged or global).
// Code size: this runs once a launch, cold (a decode qkv's CTA runs its whole body once or twice a
// layer). Its loops that run no round at decode stay rolled: the code from the wait to x staged went
// from 628 SASS instructions to 359, and whole steps from 966 to 969 tok/s.
template <int MB>
__device__ __forceinline__ const scalar_t* stage_x_and_row_scales(const scalar_t* x, scalar_t* x_staged, bool stage,
                                                                  int M, int K, const float* row_sumsq, int P,
                                                                  float eps, int tid, int lane, float* scale) {
  const int n16 = stage ? M * K / 8 : 0;
  uint4 piece;
  if (tid < n16) piece = reinterpret_cast<const uint4*>(x)[tid];
  row_scales<MB>(row_sumsq, P, M, K, eps, lane, scale);
  if (!stage) return x;
  if (tid < n16) reinterpret_cast<uint4*>(x_staged)[tid] = piece;
#pragma unroll 1   // rolled: code size
  for (int i = tid + CONSUMER_WARPS * 32; i < n16; i += CONSUMER_WARPS * 32)
    reinterpret_cast<uint4*>(x_staged)[i] = reinterpret_cast<const uint4*>(x)[i];
  consumers_sync();
  return x_staged;
}

// The ring's mbarriers, by thread 0 before the CTA's first barrier: `full` completes once a slot's
// copies landed (one arrival: the producer's expect_tx), `empty` once `empty_arrivals` consumer
// arrivals released it.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int slots, uint32_t empty_arrivals) {
  for (int i = 0; i < slots; ++i) { mbar_init(&full[i], 1); mbar_init(&empty[i], empty_arrivals); }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The producer's L2 policy: weights are read once per step, so they go first when the L2 evicts
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
