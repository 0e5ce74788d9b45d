// The AVX2 decode kernel, included by paged_attention_cpu.cpp under
// `#pragma GCC target("avx2,fma,f16c")` in namespace cpu_avx2, after the generic kernel
// (paged_attention_cpu_kernel.h), whose exp8_nonpositive, hsum8, hmax8 and min64 it
// uses (no include guard, no #include of its own but the shared parts: the includer
// provides Params, Scratch, Kind, Storage, store_out and the common header).
//
// paged_attention_cpu_avx512.h's head-major design on 8 lanes, for the same reason: at
// long context a step is a stream over the KV pages, and the generic kernel, which first
// widens each K and V row into scratch and then computes from there, ran at 0.27-0.28 of
// the read stream on the Xeon (bfloat16, 1K and 32K tokens, two threads), bound by its
// instructions. Here
// - rows go from memory straight into the FMAs: bfloat16 is split into its even and odd
//   elements, 16 at a time (a shift and a mask of 32-bit lanes), and q and the output
//   accumulators are kept in that even/odd order; e4m3 bytes become fp32 with
//   paged_attention_cpu_avx512.h's three integer ops and one multiply (fp8x16 there says
//   why the multiply by 2^120 keeps the step out of fp32's subnormals);
// - the query heads of a GQA group share each loaded K and V vector (tiles of four);
// - a tile's 16 tokens are two score vectors, each summed across lanes by a transposing
//   tree of horizontal adds;
// - the next tile's rows are prefetched all through this tile (LineStream,
//   paged_attention_cpu_rows.h), and the units are walked by
//   paged_attention_cpu_head_major.h, as in the AVX-512 kernel.
// Needs head_dim % 16 == 0; other head sizes use the generic kernel.

#include "paged_attention_cpu_rows.h"

using DotVec = __m256;  // a tile's dot accumulators (paged_attention_cpu_head_major.h)

// Whether q·k runs on vdpbf16ps: never on AVX2 (paged_attention_cpu_head_major.h asks).
template <Kind K, Kind C>
constexpr bool kDot = false;

KVSTORE_INLINE __m256 bf16_even8(__m256i x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
KVSTORE_INLINE __m256 bf16_odd8(__m256i x) {
  return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 e4m3 bytes to fp32, exact for every byte (fp8x16 in paged_attention_cpu_avx512.h on
// 8 lanes); a NaN byte becomes 480: the caller checks for NaN bytes separately.
KVSTORE_INLINE __m256 fp8x8(const uint8_t* p) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 scaled = _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
  return _mm256_mul_ps(scaled, _mm256_set1_ps(0x1p120f));
}

// 8 elements of a row or a query widened to fp32, in order (bfloat16 caches are read
// even/odd instead; bfloat16 here is a query's).
template <Kind C>
KVSTORE_INLINE __m256 load_row8(const typename Storage<C>::type* p) {
  if constexpr (C == Kind::F32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (C == Kind::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (C == Kind::BF16) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  } else {
    return fp8x8(p);
  }
}

// Lane j of the result: the sum of a[j]'s 8 lanes, for j < 8.
KVSTORE_INLINE __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  // u0: lanes 0-3 the low halves' sums of a[0..3], lanes 4-7 their high halves'.
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// K row k's elements d .. d + 15 as two vectors (bfloat16: its even, then its odd ones).
template <Kind C>
KVSTORE_INLINE void load_k16(const typename Storage<C>::type* k, int64_t d, __m256& k0,
                             __m256& k1) {
  if constexpr (C == Kind::BF16) {
    const __m256i kv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + d));
    k0 = bf16_even8(kv);
    k1 = bf16_odd8(kv);
  } else {
    k0 = load_row8<C>(k + d);
    k1 = load_row8<C>(k + d + 8);
  }
}

// dots[g * 16 + j + n] = q_g · k_{j+n} (8 lanes, to be summed) for GT query heads and NT
// tokens from j; asks for `per_token` of the next tile's lines per token. Two tokens
// share each load of q: with one, q·k issued 9 loads per 8 FMAs and the step ran 4-5%
// slower on the Xeon (8K tokens in L2, one thread).
template <Kind C, int GT, int NT>
KVSTORE_INLINE void qk_tokens(const float* __restrict q, const TileRows<C>& t, int64_t j,
                              int64_t D, LineStream& next, int64_t per_token,
                              __m256* __restrict dots) {
  next.issue(NT * per_token);
  __m256 acc[NT][GT];
  for (int n = 0; n < NT; ++n) {
    for (int g = 0; g < GT; ++g) acc[n][g] = _mm256_setzero_ps();
  }
  for (int64_t d = 0; d < D; d += 16) {
    __m256 k0[NT], k1[NT];
    for (int n = 0; n < NT; ++n) load_k16<C>(t.k[j + n], d, k0[n], k1[n]);
    for (int g = 0; g < GT; ++g) {
      const __m256 qe = _mm256_loadu_ps(q + g * D + d), qo = _mm256_loadu_ps(q + g * D + d + 8);
      for (int n = 0; n < NT; ++n) {
        acc[n][g] = _mm256_fmadd_ps(qo, k1[n], _mm256_fmadd_ps(qe, k0[n], acc[n][g]));
      }
    }
  }
  for (int n = 0; n < NT; ++n) {
    for (int g = 0; g < GT; ++g) dots[g * kTile + j + n] = acc[n][g];
  }
}

// The tile's q·k, two tokens at a time.
template <Kind C, int GT>
KVSTORE_INLINE void qk_tile(const float* __restrict q, const TileRows<C>& t, int64_t D,
                            LineStream& next, int64_t per_token, __m256* __restrict dots) {
  int64_t j = 0;
  for (; j + 2 <= t.n; j += 2) qk_tokens<C, GT, 2>(q, t, j, D, next, per_token, dots);
  if (j < t.n) qk_tokens<C, GT, 1>(q, t, j, D, next, per_token, dots);
}

// acc[g][d] += sum_j p[g * 16 + j] * v_j[d] for GT query heads, CB columns of 8 at a
// time (bfloat16: CB / 2 loads of 16 elements, split even/odd); asks for one of the next
// tile's lines per row and 8 * CB columns.
template <Kind K, Kind C, int GT, int CB>
KVSTORE_INLINE void pv_tile(float* __restrict acc, const float* __restrict p,
                            const TileRows<C>& t, int64_t D, LineStream& next) {
  static_assert(CB % 2 == 0, "bfloat16 rows go 16 elements at a time");
  for (int64_t d0 = 0; d0 < D; d0 += 8 * CB) {
    __m256 a[GT][CB];
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < CB; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + d0 + 8 * c);
    }
    for (int64_t j = 0; j < t.n; ++j) {
      next.issue(1);
      __m256 v[CB];
      if constexpr (C == Kind::BF16) {
        for (int c = 0; c < CB; c += 2) {
          const auto* row = reinterpret_cast<const __m256i*>(t.v[j] + d0 + 8 * c);
          const __m256i x = _mm256_loadu_si256(row);
          v[c] = bf16_even8(x);
          v[c + 1] = bf16_odd8(x);
        }
      } else {
        for (int c = 0; c < CB; ++c) v[c] = load_row8<C>(t.v[j] + d0 + 8 * c);
      }
      for (int g = 0; g < GT; ++g) {
        const __m256 pj = _mm256_broadcast_ss(p + g * kTile + j);
        for (int c = 0; c < CB; ++c) a[g][c] = _mm256_fmadd_ps(pj, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < CB; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[g][c]);
    }
  }
}

// One tile of one kv head for GT query heads (state index i0 .. i0 + GT - 1): the AVX-512
// kernel's attend_tile with the tile's 16 scores in two vectors of 8.
template <Kind K, Kind C, int GT>
KVSTORE_INLINE void attend_tile(const Scratch& w, int64_t i0, int64_t D, const TileRows<C>& t,
                                LineStream& next, LineShare share, __m256* dots) {
  qk_tile<C, GT>(w.q + i0 * D, t, D, next, share.per_token, dots);
  float* p = w.scores;  // [GT, 16]
  const __m256 neg_inf = _mm256_set1_ps(-__builtin_inff());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  // Lanes past n hold -inf: their exp is 0 (the stale dots there are summed, never used).
  const __m256i n = _mm256_set1_epi32(static_cast<int>(t.n));
  const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lane));
  const __m256 valid1 =
      _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_sub_epi32(n, _mm256_set1_epi32(8)), lane));
  for (int g = 0; g < GT; ++g) {
    const int64_t i = i0 + g;
    next.issue(share.per_head);
    __m256 raw0 = transpose_sum8(dots + g * kTile), raw1 = transpose_sum8(dots + g * kTile + 8);
    if constexpr (C == Kind::FP8) {
      raw0 = _mm256_mul_ps(raw0, _mm256_load_ps(t.kmul));
      raw1 = _mm256_mul_ps(raw1, _mm256_load_ps(t.kmul + 8));
    }
    const __m256 sc0 = _mm256_blendv_ps(neg_inf, raw0, valid0);
    const __m256 sc1 = _mm256_blendv_ps(neg_inf, raw1, valid1);
    // Most tiles do not raise the running max once it is reached: skip softmax_merge's
    // two scalar expf then, exp(0) being 1 exactly.
    const float tile_max = hmax8(_mm256_max_ps(sc0, sc1));
    const SoftmaxMerge mg =
        tile_max <= w.m[i] ? SoftmaxMerge{w.m[i], 1.f, 0.f} : softmax_merge(w.m[i], tile_max);
    // Every score so far -inf: subtract 0, not -inf (exp(-inf + inf) is NaN), so these
    // tokens weigh 0 (paged_attention_cpu_kernel.h, attend_units).
    const __m256 mx = _mm256_set1_ps(mg.max == -__builtin_inff() ? 0.f : mg.max);
    const __m256 e0 = exp8_nonpositive(_mm256_sub_ps(sc0, mx));
    const __m256 e1 = exp8_nonpositive(_mm256_sub_ps(sc1, mx));
    if constexpr (C == Kind::FP8) {
      _mm256_storeu_ps(p + g * kTile, _mm256_mul_ps(e0, _mm256_load_ps(t.vmul)));
      _mm256_storeu_ps(p + g * kTile + 8, _mm256_mul_ps(e1, _mm256_load_ps(t.vmul + 8)));
    } else {
      _mm256_storeu_ps(p + g * kTile, e0);
      _mm256_storeu_ps(p + g * kTile + 8, e1);
    }
    float* acc = w.acc + i * D;
    if (mg.scale_a != 1.f) {
      const __m256 s = _mm256_set1_ps(mg.scale_a);
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), s));
      }
    }
    w.l[i] = w.l[i] * mg.scale_a + hsum8(_mm256_add_ps(e0, e1));
    w.m[i] = mg.max;
  }
  float* acc = w.acc + i0 * D;
  // GT * CB accumulators, CB row vectors and the broadcast probability must fit the 16
  // ymm registers: 13 at GT 2 and CB 4, 17 (spills) at GT 3; CB 4 steps 32 columns.
  if (GT <= 2 && D % 32 == 0) {
    pv_tile<K, C, GT, 4>(acc, p, t, D, next);
  } else {
    pv_tile<K, C, GT, 2>(acc, p, t, D, next);
  }
}

// Whether any of the tile's e4m3 bytes of this head is a NaN (0x7f or 0xff): an
// unsigned max of the bytes without their sign, compared once.
KVSTORE_INLINE bool fp8_tile_has_nan(const TileRows<Kind::FP8>& t, int64_t D) {
  const __m256i low7 = _mm256_set1_epi8(0x7F);
  __m256i mx = _mm256_setzero_si256();
  __m128i mx16 = _mm_setzero_si128();
  for (int64_t j = 0; j < t.n; ++j) {
    int64_t d = 0;
    for (; d + 32 <= D; d += 32) {
      const auto* k = reinterpret_cast<const __m256i*>(t.k[j] + d);
      const auto* v = reinterpret_cast<const __m256i*>(t.v[j] + d);
      mx = _mm256_max_epu8(mx, _mm256_and_si256(_mm256_loadu_si256(k), low7));
      mx = _mm256_max_epu8(mx, _mm256_and_si256(_mm256_loadu_si256(v), low7));
    }
    if (d < D) {  // the last 16 (D % 16 == 0)
      const auto* k = reinterpret_cast<const __m128i*>(t.k[j] + d);
      const auto* v = reinterpret_cast<const __m128i*>(t.v[j] + d);
      mx16 = _mm_max_epu8(mx16, _mm_and_si128(_mm_loadu_si128(k), _mm256_castsi256_si128(low7)));
      mx16 = _mm_max_epu8(mx16, _mm_and_si128(_mm_loadu_si128(v), _mm256_castsi256_si128(low7)));
    }
  }
  mx16 = _mm_max_epu8(mx16, _mm256_castsi256_si128(mx));
  mx16 = _mm_max_epu8(mx16, _mm256_extracti128_si256(mx, 1));
  return _mm_movemask_epi8(_mm_cmpeq_epi8(mx16, _mm256_castsi256_si128(low7))) != 0;
}

// 8 floats to bfloat16 as c10::BFloat16(float) rounds them (to nearest, ties to even;
// NaN as 0x7FC0), so the vector path writes the scalar one's bits.
KVSTORE_INLINE __m128i bf16_round_x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // Words 0-3 and 4-7 land in the low quadwords of the two 128-bit lanes (every word
  // fits: no saturation), which the permute puts side by side.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// The `n` query elements at q (whole heads, D a multiple of 16), times `scale`, into
// `out` in the accumulators' order (natural_x16).
template <Kind K, Kind C>
KVSTORE_INLINE void load_q(const typename Storage<K>::type* q, float* out, int64_t n,
                           float scale) {
  const __m256 mul = _mm256_set1_ps(scale);
  if constexpr (C == Kind::BF16) {
    static_assert(K == Kind::BF16);
    for (int64_t i = 0; i < n; i += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(bf16_even8(x), mul));
      _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(bf16_odd8(x), mul));
    }
  } else {
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_storeu_ps(out + i, _mm256_mul_ps(load_row8<K>(q + i), mul));
    }
  }
}

// 16 accumulators as two vectors of 8 in row order: bfloat16 caches keep each 16 as
// their 8 even elements, then their 8 odd ones (bf16_even8, bf16_odd8; a dot product does
// not see the order).
template <Kind C>
KVSTORE_INLINE void natural_x16(const float* acc, __m256 (&out)[2]) {
  const __m256 a = _mm256_loadu_ps(acc), b = _mm256_loadu_ps(acc + 8);
  if constexpr (C == Kind::BF16) {
    // a: the even elements, b: the odd ones; unpack interleaves them within 128-bit lanes.
    const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
    out[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
    out[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
  } else {
    out[0] = a;
    out[1] = b;
  }
}

// Writes the outputs of one unit group (sequence s, partition part, query heads from
// h0 * group, `heads` of them) from w's accumulators: the normalised output, or the
// partition's partials when the step is split. float16 outputs go element by element
// (c10::Half's rounding), the others 8 at a time.
template <Kind K, Kind C>
KVSTORE_INLINE void write_unit_outputs(const Params& p, const Scratch& w, int64_t s, int64_t part,
                                       int64_t h0, int64_t heads) {
  const int64_t D = p.head_dim, G = p.group, P = p.num_partitions;
  for (int64_t i = 0; i < heads; ++i) {
    const int64_t head = h0 * G + i;
    const float* acc = w.acc + i * D;
    if (P == 1) {
      // An empty sequence (len 0) attends to nothing: its output is 0.
      const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
      const int64_t o = (s * p.num_heads + head) * D;
      if constexpr (K == Kind::F16) {
        static_assert(C != Kind::BF16, "float16 queries: the accumulators are in row order");
        for (int64_t a = 0; a < D; ++a) store_out<K>(p.out, o + a, acc[a] * inv);
      } else {
        __m256 v[2];
        for (int64_t c = 0; c < D; c += 16) {
          natural_x16<C>(acc + c, v);
          for (int j = 0; j < 2; ++j) {
            const __m256 x = _mm256_mul_ps(v[j], _mm256_set1_ps(inv));
            if constexpr (K == Kind::F32) {
              _mm256_storeu_ps(static_cast<float*>(p.out) + o + c + 8 * j, x);
            } else {
              _mm_storeu_si128(
                  reinterpret_cast<__m128i*>(static_cast<c10::BFloat16*>(p.out) + o + c + 8 * j),
                  bf16_round_x8(x));
            }
          }
        }
      }
    } else {
      const int64_t pi = (s * p.num_heads + head) * P + part;
      __m256 v[2];
      for (int64_t c = 0; c < D; c += 16) {
        natural_x16<C>(acc + c, v);
        _mm256_storeu_ps(p.part_out + pi * D + c, v[0]);
        _mm256_storeu_ps(p.part_out + pi * D + c + 8, v[1]);
      }
      p.part_max[pi] = w.m[i];
      p.part_sum[pi] = w.l[i];
    }
  }
}

#include "paged_attention_cpu_head_major.h"
