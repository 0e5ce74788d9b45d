// The AVX-512 decode kernel, included by paged_attention_cpu.cpp under
// `#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")` in namespace
// cpu_avx512, and once more with avx512bf16 and KVSTORE_DPBF16=1 in namespace
// cpu_avx512bf16 (no include guard, no #include: the includer provides Params, Scratch,
// Kind, Storage and the common header). That second build decodes bfloat16 queries
// token-major (paged_attention_cpu_token_major.h, included at the end), with vdpbf16ps
// over bfloat16 and fp8 caches, and uses this file's helpers only: the head-major
// kernel (this file's tiles, walked by paged_attention_cpu_head_major.h) runs in the
// first build (no AVX512-BF16, or fp32/fp16 queries). paged_attention_cpu_avx2.h is
// the same kernel on 8 lanes.
//
// At long context a decode step is a stream over the KV pages: the kernel must consume
// bytes faster than DRAM delivers them (measured: the previous kernel ran at about 6
// bytes per cycle on L2-resident KV, less than one core's share of the stream). So
// - rows go from memory straight into the FMAs, never through scratch: bfloat16 is
//   split into its even and odd elements (a shift and a mask of 32-bit lanes, two
//   integer ops per 64 bytes) instead of being widened in order, and q and the output
//   accumulators are kept in that even/odd order, which a dot product does not see;
// - e4m3 bytes become fp32 with three integer ops per 16 (sign-extend, shift, mask: the
//   exponent and mantissa land in fp32's fields, so every value, subnormals included,
//   is exact times 2^-120) and one multiply by 2^120 (fp8x16 says why); the (block,
//   head) scales multiply the 16 scores of a tile and the probabilities, never the
//   rows; NaN bytes are found by an unsigned max over the tile's bytes, two ops per 64;
// - the query heads of a GQA group share each loaded K and V vector (tiles of four
//   heads), so every KV line is loaded from memory once per step;
// - the 16 dot products of a tile are summed across lanes together by a transposing
//   tree instead of one 16-lane reduction per token;
// - the next tile's rows of the head being computed are prefetched a row at a time
//   all through this tile's work on it (LineStream: pages are scattered, the
//   hardware prefetchers cannot cross to the next block), and rows are located by
//   walking the block table, not by a division per token. _MM_HINT_T1 measured best
//   (T0, NTA: 1.5-2x slower; none: 2-3x).
// Needs head_dim % 16 == 0 (% 32 for bfloat16 caches); other head sizes use the AVX2
// kernels.

#include "paged_attention_cpu_rows.h"

using DotVec = __m512;  // a tile's dot accumulators (paged_attention_cpu_head_major.h)

// Whether q·k runs on vdpbf16ps (the token-major kernel): a bfloat16 query, a bfloat16
// or fp8 cache (fp8 rows become bfloat16 by table lookup, fp8_to_bf16x64), and this
// build has it.
template <Kind K, Kind C>
constexpr bool kDot = KVSTORE_DPBF16 && K == Kind::BF16 && (C == Kind::BF16 || C == Kind::FP8);

// The order of q and of the output accumulators within each 32 (bfloat16) or 64 (fp8
// looked up as bfloat16) elements of a row: the order the rows' elements come out of
// the registers they are loaded into, which a dot product does not see.
enum class Order { Natural, EvenOdd, DotBf16, DotFp8 };
template <Kind K, Kind C>
constexpr Order kOrder = kDot<K, C> ? (C == Kind::FP8 ? Order::DotFp8 : Order::DotBf16)
                         : C == Kind::BF16 ? Order::EvenOdd
                                           : Order::Natural;

// Element of a row at position `a` of order O.
template <Order O>
KVSTORE_INLINE int64_t row_element(int64_t a) {
  if constexpr (O == Order::EvenOdd) {
    // Each 32 elements as their 16 even ones, then their 16 odd ones.
    const int64_t c = a & ~int64_t{31}, r = a & 31;
    return c + 2 * (r & 15) + (r >> 4);
  } else if constexpr (O == Order::DotBf16 || O == Order::DotFp8) {
    // P·V on vdpbf16ps (interleave_rows, token-major): each 64 as four vectors of 16, the words of two
    // tokens' rows interleaved by vpunpckl/hwd (lane 4L + i of the low one is word
    // 8L + i of the rows, of the high one word 8L + 4 + i), from two 32-element loads
    // (bfloat16) or from fp8_to_bf16x64's a and b (word w of a is element
    // 16 (w / 8) + w % 8, of b that + 8).
    const int64_t c = a & ~int64_t{63}, r = a & 15, part = (a & 63) >> 4;
    const int64_t w = 8 * (r >> 2) + (r & 3) + 4 * (part & 1);
    if constexpr (O == Order::DotBf16) return c + 32 * (part >> 1) + w;
    return c + 16 * (w >> 3) + (w & 7) + 8 * (part >> 1);
  } else {
    return a;
  }
}

// Element of q's bfloat16 word `a` for vdpbf16ps (kDot): bfloat16 caches in natural
// order; fp8 in the word order of fp8_to_bf16x64 (A's 32 words, then B's).
template <Kind C>
KVSTORE_INLINE int64_t dot_q_element(int64_t a) {
  if constexpr (C == Kind::FP8) {
    const int64_t c = a & ~int64_t{63}, r = a & 63;
    const int64_t w = r & 31;
    return c + 16 * (w >> 3) + (w & 7) + (r >> 5) * 8;
  } else {
    return a;
  }
}

KVSTORE_INLINE __m512 bf16_even(__m512i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}
KVSTORE_INLINE __m512 bf16_odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 16 e4m3 bytes to fp32: sign extension puts the sign in bit 31 after the shift by 20,
// the mask keeps it and the 7 bits of exponent and mantissa (bits 20-26), which makes
// the value times 2^-120, and the multiply by 2^120 makes it the value. Exact for every
// byte; a NaN byte becomes 480: the caller checks for NaN bytes separately.
// The multiply is what keeps the rest of the step out of fp32's subnormal range: with
// the rows left at 2^-120 (and the factor applied to the scores and the outputs, as
// before), most products of P·V and many of q·k were subnormal, which Intel cores
// compute in microcode (AMD's in hardware): on a Xeon (AVX-512 without BF16), 8K tokens,
// the fp8 step took 20.3 ms against 2.2 ms with FTZ/DAZ set, 5.6x slower than bfloat16.
// Only e4m3 subnormals (below 2^-6, after the per-block scale a few in 10^4 of KV-like
// values) are still subnormal fp32 on the way in, so under denormals-are-zero
// (torch.set_flush_denormal(True)) they read as 0, as they did before.
KVSTORE_INLINE __m512 fp8x16(const uint8_t* p) {
  const __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 scaled = _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u))));
  return _mm512_mul_ps(scaled, _mm512_set1_ps(0x1p120f));
}

#if KVSTORE_DPBF16
#include "paged_attention_cpu_fp8_bf16.h"
#endif

// 16 elements of a row or a query widened to fp32, in order (bfloat16 caches are read
// even/odd instead, bf16_even and bf16_odd; bfloat16 here is a query's).
template <Kind C>
KVSTORE_INLINE __m512 load_row16(const typename Storage<C>::type* p) {
  if constexpr (C == Kind::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (C == Kind::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (C == Kind::BF16) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  } else {
    return fp8x16(p);
  }
}

#include "paged_attention_cpu_transpose.h"

// exp(x) for x <= 0 on 16 lanes: the Cephes polynomial of exp8_nonpositive. Underflows
// to 0 below -87.3 (-inf included); a NaN stays a NaN.
KVSTORE_INLINE __m512 exp16_nonpositive(__m512 x) {
  // vmaxps returns its second operand when either is NaN: x's NaN goes through.
  const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  // 2^fx by scalef (fx >= -126 here); NaN lanes stay NaN through y.
  const __m512 out = _mm512_scalef_ps(y, fx);
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(under, out, _mm512_setzero_ps());
}

// dots[g * 16 + j] = q_g · k_j (16 lanes, to be summed) for GT query heads and the
// tile's tokens; asks for `per_token` of the next tile's lines per token.
template <Kind K, Kind C, int GT>
KVSTORE_INLINE void qk_tile(const float* __restrict q, const TileRows<C>& t, int64_t D,
                            LineStream& next, int64_t per_token, __m512* __restrict dots) {
  for (int64_t j = 0; j < t.n; ++j) {
    next.issue(per_token);
    const auto* k = t.k[j];
    __m512 acc[GT], acc2[GT];
    for (int g = 0; g < GT; ++g) acc[g] = acc2[g] = _mm512_setzero_ps();
    if constexpr (C == Kind::BF16) {
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i kv = _mm512_loadu_si512(k + d);
        const __m512 ke = bf16_even(kv), ko = bf16_odd(kv);
        for (int g = 0; g < GT; ++g) {
          acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), ke, acc[g]);
          acc2[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d + 16), ko, acc2[g]);
        }
      }
    } else {
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 kv = load_row16<C>(k + d);
        for (int g = 0; g < GT; ++g) {
          acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, acc[g]);
        }
      }
    }
    for (int g = 0; g < GT; ++g) dots[g * kTile + j] = _mm512_add_ps(acc[g], acc2[g]);
  }
}

// acc[g][d] += sum_j p[g * 16 + j] * v_j[d] for GT query heads, CB columns of 16 at a
// time (bfloat16: CB / 2 loads of 32 elements, split even/odd); asks for one of the
// next tile's lines per row and 16 * CB columns.
template <Kind K, Kind C, int GT, int CB>
KVSTORE_INLINE void pv_tile(float* __restrict acc, const float* __restrict p,
                            const TileRows<C>& t, int64_t D, LineStream& next) {
  for (int64_t d0 = 0; d0 < D; d0 += 16 * CB) {
    __m512 a[GT][CB];
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < CB; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
    }
    for (int64_t j = 0; j < t.n; ++j) {
      next.issue(1);
      __m512 v[CB];
      if constexpr (C == Kind::BF16) {
        for (int c = 0; c < CB; c += 2) {
          const __m512i x = _mm512_loadu_si512(t.v[j] + d0 + 16 * c);
          v[c] = bf16_even(x);
          v[c + 1] = bf16_odd(x);
        }
      } else {
        for (int c = 0; c < CB; ++c) v[c] = load_row16<C>(t.v[j] + d0 + 16 * c);
      }
      for (int g = 0; g < GT; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kTile + j]);
        for (int c = 0; c < CB; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < CB; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
    }
  }
}

// One tile of one kv head for GT query heads (state index i0 .. i0 + GT - 1).
template <Kind K, Kind C, int GT>
KVSTORE_INLINE void attend_tile(const Scratch& w, int64_t i0, int64_t D, const TileRows<C>& t,
                                LineStream& next, LineShare share, __m512* dots) {
  qk_tile<K, C, GT>(w.q + i0 * D, t, D, next, share.per_token, dots);
  float* p = w.scores;  // [GT, 16]
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __mmask16 valid = static_cast<__mmask16>((1u << t.n) - 1u);
  for (int g = 0; g < GT; ++g) {
    const int64_t i = i0 + g;
    next.issue(share.per_head);
    // Lanes past n hold -inf: their exp is 0 (the stale dots there are summed, never used).
    __m512 raw = transpose_sum16(dots + g * kTile);
    if constexpr (C == Kind::FP8) {
      raw = _mm512_mul_ps(raw, _mm512_load_ps(t.kmul));
    }
    const __m512 sc = _mm512_mask_blend_ps(valid, neg_inf, raw);
    // Once the running max is reached, most tiles do not raise it: skip softmax_merge's
    // two scalar expf then (a sixth of the step's time at 32K), exp(0) being 1 exactly.
    const float tile_max = _mm512_reduce_max_ps(sc);
    const SoftmaxMerge mg =
        tile_max <= w.m[i] ? SoftmaxMerge{w.m[i], 1.f, 0.f} : softmax_merge(w.m[i], tile_max);
    // Every score so far -inf: subtract 0, not -inf (exp(-inf + inf) is NaN), so these
    // tokens weigh 0 (paged_attention_cpu_kernel.h, attend_units).
    const float shift = mg.max == -__builtin_inff() ? 0.f : mg.max;
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(shift)));
    const __m512 pv = C == Kind::FP8 ? _mm512_mul_ps(e, _mm512_load_ps(t.vmul)) : e;
    _mm512_storeu_ps(p + g * kTile, pv);
    float* acc = w.acc + i * D;
    if (mg.scale_a != 1.f) {
      const __m512 s = _mm512_set1_ps(mg.scale_a);
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), s));
      }
    }
    w.l[i] = w.l[i] * mg.scale_a + _mm512_reduce_add_ps(e);
    w.m[i] = mg.max;
  }
  float* acc = w.acc + i0 * D;
  if (D % 64 == 0) {
    pv_tile<K, C, GT, 4>(acc, p, t, D, next);
  } else if (D % 32 == 0) {
    pv_tile<K, C, GT, 2>(acc, p, t, D, next);
  } else if constexpr (C != Kind::BF16) {
    pv_tile<K, C, GT, 1>(acc, p, t, D, next);
  }
}

// Whether any of the tile's e4m3 bytes of this head is a NaN (0x7f or 0xff): an
// unsigned max of the bytes without their sign, compared once.
KVSTORE_INLINE bool fp8_tile_has_nan(const TileRows<Kind::FP8>& t, int64_t D) {
  const __m512i low7 = _mm512_set1_epi8(0x7F);
  __m512i mx = _mm512_setzero_si512();
  const __mmask64 tail = D % 64 == 0 ? ~__mmask64{0} : (__mmask64{1} << (D % 64)) - 1;
  for (int64_t j = 0; j < t.n; ++j) {
    int64_t d = 0;
    for (; d + 64 <= D; d += 64) {
      mx = _mm512_max_epu8(mx, _mm512_and_si512(_mm512_loadu_si512(t.k[j] + d), low7));
      mx = _mm512_max_epu8(mx, _mm512_and_si512(_mm512_loadu_si512(t.v[j] + d), low7));
    }
    if (d < D) {
      mx = _mm512_max_epu8(mx, _mm512_and_si512(_mm512_maskz_loadu_epi8(tail, t.k[j] + d), low7));
      mx = _mm512_max_epu8(mx, _mm512_and_si512(_mm512_maskz_loadu_epi8(tail, t.v[j] + d), low7));
    }
  }
  return _mm512_cmpeq_epi8_mask(mx, low7) != 0;
}

KVSTORE_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// 64 accumulators of a dot order (DotBf16 or DotFp8) as four vectors of 16 in natural
// order: two-source permutes (DotBf16: each 16 from two of the vectors), or a transpose
// of the vectors' 4-float quarters (DotFp8: each 16 from all four). row_element's inverse.
template <Order O>
KVSTORE_INLINE void natural_x64(const float* acc, __m512 (&out)[4]) {
  const __m512 v0 = _mm512_loadu_ps(acc), v1 = _mm512_loadu_ps(acc + 16);
  const __m512 v2 = _mm512_loadu_ps(acc + 32), v3 = _mm512_loadu_ps(acc + 48);
  if constexpr (O == Order::DotBf16) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    out[0] = _mm512_permutex2var_ps(v0, lo, v1);
    out[1] = _mm512_permutex2var_ps(v0, hi, v1);
    out[2] = _mm512_permutex2var_ps(v2, lo, v3);
    out[3] = _mm512_permutex2var_ps(v2, hi, v3);
  } else {
    static_assert(O == Order::DotFp8);
    const __m512 t0 = _mm512_shuffle_f32x4(v0, v1, 0x44);
    const __m512 t1 = _mm512_shuffle_f32x4(v0, v1, 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(v2, v3, 0x44);
    const __m512 t3 = _mm512_shuffle_f32x4(v2, v3, 0xEE);
    out[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
    out[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
    out[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
    out[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
  }
}

// 16 floats to bfloat16 as c10::BFloat16(float) rounds them (to nearest, ties to even;
// NaN as 0x7FC0), so the vector path writes the scalar one's bits.
KVSTORE_INLINE __m256i bf16_round_x16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The `n` query elements at q (whole heads, D a multiple of 16, of 32 for bfloat16
// caches), times `scale`, into `out` in the element order kOrder<K, C>: 16 at a time.
// Was element by element with i / D and i % D, a 64-bit division each, which Intel
// cores take 40-90 cycles for: a 16-token step on a Xeon took 78 us, most of it here.
template <Kind K, Kind C>
KVSTORE_INLINE void load_q(const typename Storage<K>::type* q, float* out, int64_t n,
                           float scale) {
  const __m512 mul = _mm512_set1_ps(scale);
  if constexpr (kOrder<K, C> == Order::EvenOdd) {
    // bfloat16 caches (so bfloat16 queries): each 32 as their 16 even, then 16 odd.
    static_assert(K == Kind::BF16);
    for (int64_t i = 0; i < n; i += 32) {
      const __m512i x = _mm512_loadu_si512(q + i);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(bf16_even(x), mul));
      _mm512_storeu_ps(out + i + 16, _mm512_mul_ps(bf16_odd(x), mul));
    }
  } else {
    static_assert(kOrder<K, C> == Order::Natural);
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(out + i, _mm512_mul_ps(load_row16<K>(q + i), mul));
  }
}

// 32 accumulators of order kOrder<K, C> (EvenOdd: 16 even, then 16 odd; Natural) as
// two vectors of 16 in natural order. row_element's inverse.
template <Kind K, Kind C>
KVSTORE_INLINE void natural_x32(const float* acc, __m512 (&out)[2]) {
  const __m512 a = _mm512_loadu_ps(acc), b = _mm512_loadu_ps(acc + 16);
  if constexpr (kOrder<K, C> == Order::EvenOdd) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi =
        _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    out[0] = _mm512_permutex2var_ps(a, lo, b);
    out[1] = _mm512_permutex2var_ps(a, hi, b);
  } else {
    static_assert(kOrder<K, C> == Order::Natural);
    out[0] = a;
    out[1] = b;
  }
}

// Vectors of accumulators natural_cols puts in natural order at once: 64 columns in the
// token-major kernel's orders, 32 in this kernel's.
template <Kind K, Kind C>
constexpr int kNaturalVecs = kDot<K, C> ? 4 : 2;

template <Kind K, Kind C>
KVSTORE_INLINE void natural_cols(const float* acc, __m512 (&out)[kNaturalVecs<K, C>]) {
  if constexpr (kDot<K, C>) {
    natural_x64<kOrder<K, C>>(acc, out);
  } else {
    natural_x32<K, C>(acc, out);
  }
}

// Writes the outputs of one unit group (sequence s, partition part, query heads from
// h0 * group, `heads` of them) from w's accumulators (element order kOrder<K, C>): the
// normalised output, or the partition's partials when the step is split.
template <Kind K, Kind C>
KVSTORE_INLINE void write_unit_outputs(const Params& p, const Scratch& w, int64_t s, int64_t part,
                                       int64_t h0, int64_t heads) {
  const int64_t D = p.head_dim, G = p.group, P = p.num_partitions;
  constexpr int kVecs = kNaturalVecs<K, C>;
  if constexpr (K != Kind::F16) {
    if (D % (16 * kVecs) == 0) {
      // 16 outputs at a time (element by element, c10's rounding and the permuted stores
      // took about half a short step of the token-major kernel, a third of a 16-token
      // step of this one); float16 stays on the scalar path below.
      for (int64_t i = 0; i < heads; ++i) {
        const int64_t head = h0 * G + i;
        const float* acc = w.acc + i * D;
        __m512 v[kVecs];
        if (P == 1) {
          const __m512 inv = _mm512_set1_ps(w.l[i] > 0.f ? 1.f / w.l[i] : 0.f);
          const int64_t o = (s * p.num_heads + head) * D;
          for (int64_t c = 0; c < D; c += 16 * kVecs) {
            natural_cols<K, C>(acc + c, v);
            for (int j = 0; j < kVecs; ++j) {
              const __m512 x = _mm512_mul_ps(v[j], inv);
              if constexpr (K == Kind::F32) {
                _mm512_storeu_ps(static_cast<float*>(p.out) + o + c + 16 * j, x);
              } else {
                _mm256_storeu_si256(
                    reinterpret_cast<__m256i*>(static_cast<c10::BFloat16*>(p.out) + o + c + 16 * j),
                    bf16_round_x16(x));
              }
            }
          }
        } else {
          const int64_t pi = (s * p.num_heads + head) * P + part;
          for (int64_t c = 0; c < D; c += 16 * kVecs) {
            natural_cols<K, C>(acc + c, v);
            for (int j = 0; j < kVecs; ++j) _mm512_storeu_ps(p.part_out + pi * D + c + 16 * j, v[j]);
          }
          p.part_max[pi] = w.m[i];
          p.part_sum[pi] = w.l[i];
        }
      }
      return;
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const int64_t head = h0 * G + i;
    const float* acc = w.acc + i * D;
    if (P == 1) {
      // An empty sequence (len 0) attends to nothing: its output is 0.
      const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
      const int64_t o = (s * p.num_heads + head) * D;
      for (int64_t a = 0; a < D; ++a) {
        store_out<K>(p.out, o + row_element<kOrder<K, C>>(a), acc[a] * inv);
      }
    } else {
      const int64_t pi = (s * p.num_heads + head) * P + part;
      for (int64_t a = 0; a < D; ++a) {
        p.part_out[pi * D + row_element<kOrder<K, C>>(a)] = acc[a];
      }
      p.part_max[pi] = w.m[i];
      p.part_sum[pi] = w.l[i];
    }
  }
}

#include "paged_attention_cpu_head_major.h"

#if KVSTORE_DPBF16
#include "paged_attention_cpu_token_major.h"
#endif
