// CUDA implementations of kvstore::paged_attention (decode: one query token per
// sequence) and kvstore::write_kv.
//
// paged_attention runs in two kernels, as vLLM's "v2" does:
// 1. grid (kv head x query-head tile, sequence, partition): each CTA attends one
//    kv head's group of up to G query heads (G = 4 for groups up to 4, else 8) over
//    one partition of the context. K and V rows are fetched once per CTA and used by
//    every query head of the tile (GQA). Scores go to shared memory, then softmax
//    statistics, then P·V, all in fp32.
// 2. when the context spans more than one partition, a reduce kernel merges the
//    partitions' (max, sum, unnormalised output) in fp32 with softmax_merge, the
//    same helper the CPU kernel uses (paged_attention_common.h).
//
// Decode reads every KV byte once and does little arithmetic on it, so the step is
// bound by how many bytes are in flight: each thread issues the loads of
// kUnrollRows rows before it uses any, the partition's block ids (and fp8 scales)
// are read into shared memory once instead of one dependent load per row, and the
// partition size shrinks (down to kMinPartitionTokens) until the grid fills the
// device several times over, so that a short context or a small batch still
// keeps every SM reading.
//
// Past the bytes in flight, what bounds the step is the instructions per row (an
// H200 issues about 1 T warp instructions a second), so:
// - each thread keeps its columns of a 4-head tile's queries in registers (an 8-head
//   tile reads them from shared memory: 64 more registers would cost a CTA per SM);
// - the tile's per-head partial scores are summed across a row's threads in one
//   transposed butterfly (log2(G) exchanges of halves, then a plain sum:
//   G - 1 + log2(row threads / G) shuffles where one reduction per head took
//   G * log2(row threads), 5 against 16 for 4 heads over 16 threads);
// - the tile width is a template parameter, so a GQA group of 4 holds 4 heads'
//   accumulators, not 8, and fits one more CTA per SM;
// - a row's block is a shift of its token for power-of-two block sizes, not a
//   division;
// - the first V rows are loaded before the softmax, not after it.
#include "checks.h"
#include "paged_attention_common.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kvstore {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// Query heads per CTA, G: the whole GQA group up to 8, as a tile of 4 or 8.
constexpr int kMaxGroupTile = 8;
// Tokens per split-K partition: the largest (what shared memory is sized for) and
// the smallest the host picks (partition_tokens).
constexpr int kMaxPartitionTokens = 512;
constexpr int kMinPartitionTokens = 64;
// Bytes of rows a thread loads per step, all in flight together: kUnrollRows = this
// over the bytes of one load, 8 rows of a 16-bit or float32 cache, 16 of fp8. (Two
// steps' rows per thread, one step's loads in flight while the other's rows are
// computed on, was slower on an H200 at either size: the registers it takes cost
// CTAs per SM; benches/README.md.)
constexpr int kStepBytes = 128;
constexpr int kCtasPerSm = 4;   // the grid the partition size aims for, per SM

__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

// Calls f(T{}) with T the CUDA type of a float16, bfloat16 or float32 dtype (the
// checks have already refused any other).
template <typename F>
void dispatch_dtype(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(float{});
    case at::kHalf:
      return f(__half{});
    case at::kBFloat16:
      return f(__nv_bfloat16{});
    default:
      TORCH_CHECK(false, op, ": expected dtype float16, bfloat16 or float32, got ", dtype);
  }
}

// How one load of T (16 bytes; 8 for fp8) becomes floats, and back.
template <typename T>
struct Vec16;

template <>
struct Vec16<float> {
  using Raw = uint4;
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void to_float(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
  __device__ __forceinline__ static float load1(const float* p) { return *p; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
};

template <>
struct Vec16<__half> {
  using Raw = uint4;
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void to_float(const uint4& raw, float* out) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Vec16<__nv_bfloat16> {
  using Raw = uint4;
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void to_float(const uint4& raw, float* out) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static float load1(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};

// fp8 caches: e4m3 bytes, 8 per load (so a row maps onto threads as a 16-bit row
// does, and the P·V accumulators stay in registers), converted exactly: by the
// hardware on sm_89 and later, else with the helper shared with the CPU kernels
// (paged_attention_common.h). The (block, head) scale is applied to the scores (K)
// and to the probabilities (V), as on the CPU, not per element.
struct Fp8 {
  uint8_t bits;
};

template <>
struct Vec16<Fp8> {
  using Raw = uint2;
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void to_float(const uint2& raw, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // The hardware's e4m3x2 -> f16x2 (exact: every e4m3 value, NaN included, is a
    // half), two bytes per instruction, byte 2i to out[2i].
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
#else
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = fp8_e4m3_bits_to_float(b[i]);
#endif
  }
};

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// Sums each of v[0..N) over the threads of a row: the 2 * kMask lanes that differ
// only in the bits below 2 * kMask (call it with kMask = half the row). At each of
// the first log2(N) levels a thread keeps one half of its values and sends the other
// half to its partner, which keeps the opposite half, so each level halves the values
// and costs N/2 shuffles; the remaining levels sum the one value left. Afterwards
// v[0] of a thread holds the full sum of value number `tl / (2 * kMask / N)` (tl: its
// lane within the row).
template <int kMask, int N, int M>
__device__ __forceinline__ void row_sum_transposed(float (&v)[M], int tl) {
  static_assert((N & (N - 1)) == 0, "halves all the way down: N a power of two");
  if constexpr (kMask > 0) {
    if constexpr (N > 1) {
      constexpr int h = N / 2;
      const bool upper = (tl & kMask) != 0;
#pragma unroll
      for (int j = 0; j < h; ++j) {
        const float send = upper ? v[j] : v[j + h];
        const float keep = upper ? v[j + h] : v[j];
        v[j] = keep + __shfl_xor_sync(0xffffffffu, send, kMask);
      }
      row_sum_transposed<kMask / 2, h>(v, tl);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kMask);
      row_sum_transposed<kMask / 2, 1>(v, tl);
    }
  }
}

struct KernelArgs {
  void* out;          // [S, NH, D] (T)
  float* part_out;    // [S, NH, P, D]
  float* part_max;    // [S, NH, P]
  float* part_sum;    // [S, NH, P]
  const void* query;  // [S, NH, D] packed (T)
  const void* key_cache;
  const void* value_cache;
  int64_t k_block_stride;  // elements
  int64_t v_block_stride;
  const float* key_scales;  // fp8 caches only: [num_blocks, num_kv_heads], block stride below
  const float* value_scales;
  int64_t k_scale_stride;
  int64_t v_scale_stride;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int num_heads;
  int num_kv_heads;
  int group;
  int group_tiles;
  int block_size;
  int block_shift;  // log2(block_size) where it is a power of two, else -1
  int num_partitions;
  int partition_tokens;
  float scale;
};

// T: query and output type; C: cache type (T, or Fp8 with scales in `a`); G: the
// query heads of a CTA's tile.
template <typename T, typename C, int D, int G>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const KernelArgs a) {
  using V = Vec16<T>;
  using VC = Vec16<C>;
  using Raw = typename VC::Raw;
  constexpr bool kFp8 = std::is_same_v<C, Fp8>;
  constexpr int kVec = VC::kElems;        // cache elements per load
  static_assert(D % kVec == 0, "a row must be whole loads");
  constexpr int kRowVecs = D / kVec;      // loads per K/V row
  constexpr int kTG = kRowVecs >= 32 ? 32 : next_pow2(kRowVecs);  // threads per row
  constexpr int kVecsPerThread = (kRowVecs + kTG - 1) / kTG;
  constexpr int kRowsPerPass = kThreads / kTG;
  constexpr int kUnrollRows = kStepBytes / static_cast<int>(sizeof(Raw));
  constexpr int kRowsPerStep = kRowsPerPass * kUnrollRows;
  static_assert(G <= kTG, "the transposed sum needs a thread per head in a row");
  constexpr int kLanesPerHead = kTG / G;  // threads of a row that end with one head's sum
  // A partition's block ids: at most one per token, plus one where it starts inside
  // a block.
  constexpr int kMaxPartitionBlocks = kMaxPartitionTokens + 1;

  const int kv_head = blockIdx.x / a.group_tiles;
  const int g0 = (blockIdx.x % a.group_tiles) * G;
  const int gcount = min(G, a.group - g0);
  const int head0 = kv_head * a.group + g0;  // first query head of this CTA
  const int s = blockIdx.y;
  const int part = blockIdx.z;
  // Lengths are clamped to what the block table can address: a bad length reads
  // nothing outside the table (block ids themselves are not checked on the GPU).
  const int max_len = static_cast<int>(a.table_stride) * a.block_size;
  const int len = max(0, min(a.seq_lens[s], max_len));
  const int start = part * a.partition_tokens;
  // A partition past the end has nothing to do; the reduce kernel skips it.
  if (a.num_partitions > 1 && start >= len) return;
  const int n = max(0, min(len - start, a.partition_tokens));

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int tg = tid / kTG;  // row handled by this thread in a pass
  const int tl = tid % kTG;  // this thread's loads in the row: tl, tl + kTG, ...

  __shared__ __align__(16) float q_s[G][D];
  __shared__ __align__(16) float out_s[G][D];
  __shared__ float logits[G][kMaxPartitionTokens];
  __shared__ float stat_max[G];
  __shared__ float stat_sum[G];
  __shared__ int32_t blocks_s[kMaxPartitionBlocks];
  __shared__ float k_scale_s[kFp8 ? kMaxPartitionBlocks : 1];
  __shared__ float v_scale_s[kFp8 ? kMaxPartitionBlocks : 1];

  const int32_t* table = a.block_tables + int64_t(s) * a.table_stride;
  const int first_block = start / a.block_size;
  const int num_blocks = n > 0 ? (start + n - 1) / a.block_size - first_block + 1 : 0;
  for (int i = tid; i < num_blocks; i += kThreads) {
    const int32_t blk = table[first_block + i];
    blocks_s[i] = blk;
    if constexpr (kFp8) {
      k_scale_s[i] = a.key_scales[int64_t(blk) * a.k_scale_stride + kv_head];
      v_scale_s[i] = a.value_scales[int64_t(blk) * a.v_scale_stride + kv_head];
    }
  }
  const T* query = static_cast<const T*>(a.query);
  for (int i = tid; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    q_s[g][d] = g < gcount ? V::load1(query + (int64_t(s) * a.num_heads + head0 + g) * D + d) *
                                 a.scale
                           : 0.f;
    out_s[g][d] = 0.f;
  }
  __syncthreads();

  // This thread's columns of the tile's queries (zeros past the row and for heads
  // past the group), read once into registers for a tile of 4; a tile of 8 reads them
  // from shared memory for each row, as 64 more registers would cost it a CTA per SM.
  constexpr bool kQInRegisters = G <= 4;
  float qr[kQInRegisters ? G : 1][kVecsPerThread][kVec];
#pragma unroll
  for (int g = 0; g < (kQInRegisters ? G : 1); ++g)
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v) {
      const int vi = tl + v * kTG;
#pragma unroll
      for (int i = 0; i < kVec; ++i) qr[g][v][i] = vi < kRowVecs ? q_s[g][vi * kVec + i] : 0.f;
    }

  const int64_t row_stride = int64_t(a.num_kv_heads) * D;
  const C* kc = static_cast<const C*>(a.key_cache);
  const C* vc = static_cast<const C*>(a.value_cache);
  // Partition token t: its index into blocks_s, and its row in a cache.
  // A shift, not a division, for the usual power-of-two block sizes: this runs for
  // every row a thread loads.
  const auto block_of = [&](int token) {
    return a.block_shift >= 0 ? token >> a.block_shift : token / a.block_size;
  };
  const auto block_index = [&](int t) { return block_of(start + t) - first_block; };
  const auto row = [&](const C* cache, int64_t block_stride, int t) {
    const int b = block_index(t);
    const int off = (start + t) - (first_block + b) * a.block_size;
    return reinterpret_cast<const Raw*>(cache + int64_t(blocks_s[b]) * block_stride +
                                        off * row_stride + int64_t(kv_head) * D);
  };
  // The loads of a step's rows, all issued before any is used; rows past n and a
  // row's loads past its end load nothing (zeros).
  using Rows = Raw[kUnrollRows][kVecsPerThread];
  const auto load_rows = [&](const C* cache, int64_t block_stride, int t0, Rows& raw) {
#pragma unroll
    for (int r = 0; r < kUnrollRows; ++r) {
      const int t = t0 + r * kRowsPerPass + tg;
#pragma unroll
      for (int v = 0; v < kVecsPerThread; ++v) {
        const int vi = tl + v * kTG;
        raw[r][v] = Raw{};
        if (t < n && vi < kRowVecs) raw[r][v] = __ldg(row(cache, block_stride, t) + vi);
      }
    }
  };

  // 1. Scores. The shuffles below see full warps: every thread runs the same steps.
  const auto scores = [&](const Rows& raw, int t0) {
#pragma unroll
    for (int r = 0; r < kUnrollRows; ++r) {
      const int t = t0 + r * kRowsPerPass + tg;
      float k[kVecsPerThread][kVec];
#pragma unroll
      for (int v = 0; v < kVecsPerThread; ++v) VC::to_float(raw[r][v], k[v]);
      // Query heads past the group (gcount, the same for the whole CTA) are skipped,
      // not computed on zeros: a group of 1 in a tile of 4 does a quarter of the work.
      float dots[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        dots[g] = 0.f;
        if (g >= gcount) continue;
#pragma unroll
        for (int v = 0; v < kVecsPerThread; ++v) {
          if constexpr (kQInRegisters) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) dots[g] = fmaf(qr[g][v][i], k[v][i], dots[g]);
          } else {
            const int vi = tl + v * kTG;
            if (vi >= kRowVecs) continue;
#pragma unroll
            for (int i = 0; i < kVec; i += 4) {
              const float4 qv = *reinterpret_cast<const float4*>(&q_s[g][vi * kVec + i]);
              dots[g] = fmaf(qv.x, k[v][i], dots[g]);
              dots[g] = fmaf(qv.y, k[v][i + 1], dots[g]);
              dots[g] = fmaf(qv.z, k[v][i + 2], dots[g]);
              dots[g] = fmaf(qv.w, k[v][i + 3], dots[g]);
            }
          }
        }
      }
      row_sum_transposed<kTG / 2, G>(dots, tl);
      const int head = tl / kLanesPerHead;
      if (t < n && tl % kLanesPerHead == 0 && head < gcount) {
        float ks = 1.f;
        if constexpr (kFp8) ks = k_scale_s[block_index(t)];
        logits[head][t] = dots[0] * ks;
      }
    }
  };
  for (int t0 = 0; t0 < n; t0 += kRowsPerStep) {
    Rows raw;
    load_rows(kc, a.k_block_stride, t0, raw);
    scores(raw, t0);
  }
  // The first V rows' loads go out now, so that they are in flight during the
  // softmax instead of after it.
  Rows vraw;
  load_rows(vc, a.v_block_stride, 0, vraw);
  __syncthreads();

  // 2. Softmax statistics of each query head (one warp per head); logits become
  // exp(score - max).
  for (int g = warp; g < gcount; g += kWarps) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) m = fmaxf(m, logits[g][i]);
    m = warp_max(m);
    // Every score -inf (K at -inf, or q·k past fp32's range): subtract 0, not -inf
    // (exp(-inf + inf) is NaN), so these tokens weigh 0 and the sum stays 0.
    const float shift = m == -INFINITY ? 0.f : m;
    float sum = 0.f;
    for (int i = lane; i < n; i += 32) {
      const float e = expf(logits[g][i] - shift);
      logits[g][i] = e;
      sum += e;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      stat_max[g] = m;
      stat_sum[g] = sum;
    }
  }
  __syncthreads();

  // 3. P·V: each V row is loaded once and feeds every query head of the tile.
  float acc[G][kVecsPerThread][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v)
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[g][v][i] = 0.f;

  const auto pv = [&](const Rows& raw, int t0) {
#pragma unroll
    for (int r = 0; r < kUnrollRows; ++r) {
      const int t = t0 + r * kRowsPerPass + tg;
      if (t >= n) continue;  // no shuffles in this loop: divergence is fine
      float val[kVecsPerThread][kVec];
#pragma unroll
      for (int v = 0; v < kVecsPerThread; ++v) VC::to_float(raw[r][v], val[v]);
      float vs = 1.f;
      if constexpr (kFp8) vs = v_scale_s[block_index(t)];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= gcount) continue;
        const float p = logits[g][t] * vs;
#pragma unroll
        for (int v = 0; v < kVecsPerThread; ++v)
#pragma unroll
          for (int i = 0; i < kVec; ++i) acc[g][v][i] += p * val[v][i];
      }
    }
  };
  for (int t0 = 0; t0 < n; t0 += kRowsPerStep) {
    if (t0 > 0) load_rows(vc, a.v_block_stride, t0, vraw);
    pv(vraw, t0);
  }

  // Rows of one warp share the lane -> column mapping: sum them with shuffles,
  // then add the warps one after another (a fixed order: deterministic output).
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int v = 0; v < kVecsPerThread; ++v)
#pragma unroll
      for (int i = 0; i < kVec; ++i)
#pragma unroll
        for (int mask = kTG; mask < 32; mask <<= 1) {
          acc[g][v][i] += __shfl_xor_sync(0xffffffffu, acc[g][v][i], mask);
        }
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w && lane < kTG) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int v = 0; v < kVecsPerThread; ++v) {
          const int vi = tl + v * kTG;
          if (g < gcount && vi < kRowVecs) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) out_s[g][vi * kVec + i] += acc[g][v][i];
          }
        }
    }
    __syncthreads();
  }

  // 4. Output: normalised when this is the only partition, else a partial.
  for (int i = tid; i < gcount * D; i += kThreads) {
    const int g = i / D, d = i % D;
    const int64_t sh = int64_t(s) * a.num_heads + head0 + g;
    if (a.num_partitions == 1) {
      const float sum = stat_sum[g];
      static_cast<T*>(a.out)[sh * D + d] = V::from_float(sum > 0.f ? out_s[g][d] / sum : 0.f);
    } else {
      const int64_t pi = sh * a.num_partitions + part;
      a.part_out[pi * D + d] = out_s[g][d];
      if (d == 0) {
        a.part_max[pi] = stat_max[g];
        a.part_sum[pi] = stat_sum[g];
      }
    }
  }
}

// Merges the partitions of one (head, sequence) per CTA, in fp32.
template <typename T>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce_kernel(const KernelArgs a,
                                                                          int head_dim) {
  using V = Vec16<T>;
  const int head = blockIdx.x, s = blockIdx.y;
  const int max_len = static_cast<int>(a.table_stride) * a.block_size;
  const int len = max(0, min(a.seq_lens[s], max_len));
  const int parts = min(a.num_partitions, static_cast<int>(ceil_div(len, a.partition_tokens)));
  const int64_t sh = int64_t(s) * a.num_heads + head;
  const int64_t base = sh * a.num_partitions;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float m = -INFINITY, l = 0.f, acc = 0.f;
    for (int p = 0; p < parts; ++p) {
      // A partition whose every score is -inf adds nothing (its sum and output are 0).
      if (a.part_max[base + p] == -INFINITY) continue;
      const SoftmaxMerge mg = softmax_merge(m, a.part_max[base + p]);
      acc = acc * mg.scale_a + a.part_out[(base + p) * head_dim + d] * mg.scale_b;
      l = l * mg.scale_a + a.part_sum[base + p] * mg.scale_b;
      m = mg.max;
    }
    static_cast<T*>(a.out)[sh * head_dim + d] = V::from_float(l > 0.f ? acc / l : 0.f);
  }
}

// The tile width: 4 query heads for GQA groups up to 4 (1, 2 and 3 skip the heads
// they lack), else 8, in as many tiles as the group needs.
int group_tile(int64_t group) { return group <= 4 ? 4 : kMaxGroupTile; }

template <typename T, typename C, int D>
void launch_attention(const KernelArgs& a, int num_seqs, cudaStream_t stream) {
  const dim3 grid(a.num_kv_heads * a.group_tiles, num_seqs, a.num_partitions);
  if (group_tile(a.group) == 4) {
    paged_attention_kernel<T, C, D, 4><<<grid, kThreads, 0, stream>>>(a);
  } else {
    paged_attention_kernel<T, C, D, kMaxGroupTile><<<grid, kThreads, 0, stream>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename C>
void launch_for_head_dim(const KernelArgs& a, int num_seqs, int head_dim, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return launch_attention<T, C, 64>(a, num_seqs, stream);
    case 80:
      return launch_attention<T, C, 80>(a, num_seqs, stream);
    case 96:
      return launch_attention<T, C, 96>(a, num_seqs, stream);
    case 128:
      return launch_attention<T, C, 128>(a, num_seqs, stream);
    case 256:
      return launch_attention<T, C, 256>(a, num_seqs, stream);
    default:
      TORCH_CHECK(false, "kvstore.paged_attention: head_dim: expected one of 64, 80, 96, 128, "
                  "256 on CUDA, got ", head_dim);
  }
}

void check_16_byte_rows(const at::Tensor& cache, const char* what) {
  const int64_t elem = cache.element_size();
  const auto addr = reinterpret_cast<uintptr_t>(cache.data_ptr());
  TORCH_CHECK(addr % 16 == 0 && (cache.stride(0) * elem) % 16 == 0 &&
                  (cache.size(3) * elem) % 16 == 0,
              "kvstore.paged_attention: ", what, ": expected 16-byte aligned rows on CUDA "
              "(address, block stride and head_dim * itemsize multiples of 16), got address ",
              addr, ", block stride ", cache.stride(0), ", head_dim ", cache.size(3),
              ", itemsize ", elem);
}

// Tokens per partition: the largest power of two up to kMaxPartitionTokens whose grid
// (`ctas_per_partition` CTAs for each partition of `max_len` tokens) still fills
// every SM kCtasPerSm times, and not below kMinPartitionTokens. More partitions
// cost a longer merge, fewer leave SMs idle.
int partition_tokens(int64_t max_len, int64_t ctas_per_partition, int sms) {
  int tokens = kMaxPartitionTokens;
  while (tokens > kMinPartitionTokens &&
         ctas_per_partition * ceil_div(max_len, tokens) < int64_t{kCtasPerSm} * sms) {
    tokens /= 2;
  }
  return tokens;
}

// Both ops: `key_scales` and `value_scales` are defined for fp8 caches only.
at::Tensor paged_attention_impl(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& key_scales,
                                const at::Tensor& value_scales, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale) {
  const bool fp8 = key_scales.defined();
  const PagedAttentionDims dims =
      check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, fp8);
  if (fp8) {
    check_scales(key_scales, key_cache, "kvstore.paged_attention", "key_scales");
    check_scales(value_scales, value_cache, "kvstore.paged_attention", "value_scales");
  }
  check_16_byte_rows(key_cache, "key_cache");
  check_16_byte_rows(value_cache, "value_cache");
  TORCH_CHECK(dims.max_blocks * dims.block_size < (int64_t{1} << 31),
              "kvstore.paged_attention: block_tables: expected max_blocks * block_size below "
              "2^31 on CUDA, got ", dims.max_blocks * dims.block_size);
  TORCH_CHECK(dims.num_seqs <= 65535, "kvstore.paged_attention: query: expected at most 65535 "
              "sequences on CUDA (a grid dimension), got ", dims.num_seqs);
  const c10::cuda::CUDAGuard guard(query.device());
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty({dims.num_seqs, dims.num_heads, dims.head_dim}, q.options());
  if (dims.num_seqs == 0 || dims.num_heads == 0) return out;

  // The partition count comes from the table width, an upper bound of every length
  // that needs no device-to-host copy of seq_lens.
  const int64_t max_len = dims.max_blocks * dims.block_size;
  const int group_tiles = static_cast<int>(ceil_div(dims.group, group_tile(dims.group)));
  const int partition = partition_tokens(max_len, dims.num_kv_heads * group_tiles * dims.num_seqs,
                                         at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const int num_partitions = static_cast<int>(std::max<int64_t>(1, ceil_div(max_len, partition)));
  at::Tensor part_out, part_stats;
  KernelArgs a{};
  if (num_partitions > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_out = at::empty({dims.num_seqs, dims.num_heads, num_partitions, dims.head_dim}, f32);
    part_stats = at::empty({2, dims.num_seqs, dims.num_heads, num_partitions}, f32);
    a.part_out = part_out.data_ptr<float>();
    a.part_max = part_stats[0].data_ptr<float>();
    a.part_sum = part_stats[1].data_ptr<float>();
  }
  a.out = out.data_ptr();
  a.query = q.data_ptr();
  a.key_cache = key_cache.data_ptr();
  a.value_cache = value_cache.data_ptr();
  a.k_block_stride = key_cache.stride(0);
  a.v_block_stride = value_cache.stride(0);
  if (fp8) {
    a.key_scales = key_scales.data_ptr<float>();
    a.value_scales = value_scales.data_ptr<float>();
    a.k_scale_stride = key_scales.stride(0);
    a.v_scale_stride = value_scales.stride(0);
  }
  a.block_tables = tables.data_ptr<int32_t>();
  a.table_stride = dims.max_blocks;
  a.seq_lens = lens.data_ptr<int32_t>();
  a.num_heads = static_cast<int>(dims.num_heads);
  a.num_kv_heads = static_cast<int>(dims.num_kv_heads);
  a.group = static_cast<int>(dims.group);
  a.group_tiles = group_tiles;
  a.block_size = static_cast<int>(dims.block_size);
  a.block_shift = (a.block_size & (a.block_size - 1)) == 0 ? __builtin_ctz(a.block_size) : -1;
  a.num_partitions = num_partitions;
  a.partition_tokens = partition;
  a.scale = static_cast<float>(scale);

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int num_seqs = static_cast<int>(dims.num_seqs);
  const int head_dim = static_cast<int>(dims.head_dim);
  dispatch_dtype(q.scalar_type(), "kvstore.paged_attention", [&](auto tag) {
    using T = decltype(tag);
    if (fp8) {
      launch_for_head_dim<T, Fp8>(a, num_seqs, head_dim, stream);
    } else {
      launch_for_head_dim<T, T>(a, num_seqs, head_dim, stream);
    }
    if (num_partitions > 1) {
      const dim3 grid(a.num_heads, num_seqs);
      paged_attention_reduce_kernel<T><<<grid, kThreads, 0, stream>>>(a, head_dim);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                const at::Tensor& value_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, double scale) {
  return paged_attention_impl(query, key_cache, value_cache, at::Tensor(), at::Tensor(),
                              block_tables, seq_lens, scale);
}

at::Tensor paged_attention_fp8_cuda(const at::Tensor& query, const at::Tensor& key_cache,
                                    const at::Tensor& value_cache, const at::Tensor& key_scales,
                                    const at::Tensor& value_scales,
                                    const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                    double scale) {
  return paged_attention_impl(query, key_cache, value_cache, key_scales, value_scales,
                              block_tables, seq_lens, scale);
}

template <typename T>
__global__ void write_kv_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                T* __restrict__ key_cache, T* __restrict__ value_cache,
                                const int64_t* __restrict__ slots, int64_t k_stride0,
                                int64_t k_stride1, int64_t v_stride0, int64_t v_stride1,
                                int64_t k_block_stride, int64_t v_block_stride, int heads,
                                int head_dim, int block_size, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  // Negative: skipped by contract. Past the end: ignored, since checking it on the
  // host would need a device-to-host copy (the CPU op raises instead).
  if (slot < 0 || slot >= num_slots) return;
  const int64_t blk = slot / block_size, off = slot % block_size;
  const int64_t row = int64_t(heads) * head_dim;
  for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
    const int h = i / head_dim, d = i % head_dim;
    key_cache[blk * k_block_stride + off * row + i] = key[t * k_stride0 + h * k_stride1 + d];
    value_cache[blk * v_block_stride + off * row + i] = value[t * v_stride0 + h * v_stride1 + d];
  }
}

void write_kv_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                   at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const WriteKVDims dims = check_write_kv(key, value, key_cache, value_cache, slot_mapping);
  if (dims.num_tokens == 0) return;
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(256, dims.num_kv_heads * dims.head_dim));
  dispatch_dtype(key_cache.scalar_type(), "kvstore.write_kv", [&](auto tag) {
    using T = decltype(tag);
    write_kv_kernel<T><<<dims.num_tokens, std::max(threads, 32), 0, stream>>>(
        static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
        static_cast<T*>(key_cache.data_ptr()), static_cast<T*>(value_cache.data_ptr()),
        slots.data_ptr<int64_t>(), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), key_cache.stride(0), value_cache.stride(0),
        static_cast<int>(dims.num_kv_heads), static_cast<int>(dims.head_dim),
        static_cast<int>(dims.block_size), dims.num_blocks * dims.block_size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// fp8 quantization, one CTA per (kv head, K or V): the CTA owns that head's scales
// and rows, so it walks the tokens in order and a block's tokens are quantized,
// and its scale grown, in the order the CPU op follows (fp8_scale_for). Sequential
// over tokens: a prefill of T tokens is T steps of one CTA per head.
template <typename T>
__global__ void __launch_bounds__(kThreads) write_kv_fp8_kernel(
    const T* __restrict__ key, const T* __restrict__ value, uint8_t* key_cache,
    uint8_t* value_cache, float* key_scales, float* value_scales,
    const int64_t* __restrict__ slots, int64_t num_tokens, int64_t k_stride0, int64_t k_stride1,
    int64_t v_stride0, int64_t v_stride1, int64_t k_block_stride, int64_t v_block_stride,
    int64_t k_scale_stride, int64_t v_scale_stride, int heads, int head_dim, int block_size,
    int64_t num_slots) {
  using V = Vec16<T>;
  const int h = blockIdx.x;
  const bool is_v = blockIdx.y == 1;
  const T* src = is_v ? value : key;
  const int64_t stride0 = is_v ? v_stride0 : k_stride0, stride1 = is_v ? v_stride1 : k_stride1;
  uint8_t* cache = is_v ? value_cache : key_cache;
  const int64_t block_stride = is_v ? v_block_stride : k_block_stride;
  float* scales = is_v ? value_scales : key_scales;
  const int64_t scale_stride = is_v ? v_scale_stride : k_scale_stride;
  const int64_t row = int64_t(heads) * head_dim;
  __shared__ float warp_amax[kWarps];
  __shared__ float old_scale, new_scale;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) continue;  // the same for every thread
    const int64_t blk = slot / block_size, off = slot % block_size;
    const T* x = src + t * stride0 + h * stride1;
    float m = 0.f;
    for (int d = tid; d < head_dim; d += kThreads) m = fmaxf(m, fabsf(V::load1(x + d)));
    m = warp_max(m);
    if (lane == 0) warp_amax[warp] = m;
    __syncthreads();
    if (tid == 0) {
      float amax = 0.f;
      for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
      float* s = scales + blk * scale_stride + h;
      old_scale = *s;
      new_scale = fp8_scale_for(old_scale, amax, off);
      *s = new_scale;
    }
    __syncthreads();
    const float old = old_scale, now = new_scale;
    uint8_t* base = cache + blk * block_stride + int64_t(h) * head_dim;
    if (off > 0 && now != old && old > 0.f) {
      // The block's earlier tokens move to the grown scale.
      for (int64_t i = tid; i < off * head_dim; i += kThreads) {
        uint8_t* b = base + (i / head_dim) * row + i % head_dim;
        *b = fp8_quantize(fp8_e4m3_bits_to_float(*b) * old, now);
      }
    }
    for (int d = tid; d < head_dim; d += kThreads) {
      base[off * row + d] = fp8_quantize(V::load1(x + d), now);
    }
    __syncthreads();  // this token's rows and scale before the next token reads them
  }
}

void write_kv_fp8_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                       const at::Tensor& slot_mapping) {
  const WriteKVDims dims =
      check_write_kv(key, value, key_cache, value_cache, slot_mapping, /*fp8=*/true);
  check_scales(key_scales, key_cache, "kvstore.write_kv", "key_scales");
  check_scales(value_scales, value_cache, "kvstore.write_kv", "value_scales");
  check_written_blocks(key_scales, value_scales, dims.num_kv_heads, "kvstore.write_kv",
                       "key_scales", "value_scales");
  if (dims.num_tokens == 0 || dims.num_kv_heads == 0) return;
  TORCH_CHECK(dims.num_kv_heads <= 65535, "kvstore.write_kv: expected at most 65535 kv heads "
              "on CUDA (a grid dimension), got ", dims.num_kv_heads);
  const c10::cuda::CUDAGuard guard(key.device());
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_dtype(k.scalar_type(), "kvstore.write_kv", [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(dims.num_kv_heads), 2);
    write_kv_fp8_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<const T*>(k.data_ptr()), static_cast<const T*>(v.data_ptr()),
        static_cast<uint8_t*>(key_cache.data_ptr()), static_cast<uint8_t*>(value_cache.data_ptr()),
        key_scales.data_ptr<float>(), value_scales.data_ptr<float>(), slots.data_ptr<int64_t>(),
        dims.num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_cache.stride(0),
        value_cache.stride(0), key_scales.stride(0), value_scales.stride(0),
        static_cast<int>(dims.num_kv_heads), static_cast<int>(dims.head_dim),
        static_cast<int>(dims.block_size), dims.num_blocks * dims.block_size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace kvstore

TORCH_LIBRARY_IMPL(kvstore, CUDA, m) {
  m.impl("paged_attention", &kvstore::paged_attention_cuda);
  m.impl("write_kv", &kvstore::write_kv_cuda);
  m.impl("paged_attention_fp8", &kvstore::paged_attention_fp8_cuda);
  m.impl("write_kv_fp8", &kvstore::write_kv_fp8_cuda);
}
