// The AVX-512 decode kernel, included once by paged_attention_cpu.cpp under
// `#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")` in namespace
// cpu_avx512 (no include guard, no #include: the includer provides Params, Scratch,
// Kind, Storage and the common header).
//
// Why a kernel of its own rather than the generic 8-lane one at 16 lanes: at long
// context the decode step is a stream, and the generic kernel spends more time
// widening rows into scratch and summing each dot product across lanes than DRAM
// takes to deliver them. Here
// - K and V rows are widened in registers (bf16: a zero-extend and a shift; fp16:
//   vcvtph2ps) straight into the FMAs, never stored;
// - the query heads of a GQA group share each widened K vector (QK) and each
//   widened V vector (P·V), four heads and four 16-float columns at a time, so
//   the accumulators stay in registers for a whole 16-token chunk;
// - the 16 dot products of a chunk are summed across lanes together by a
//   transposing tree (15 adds) instead of one 16-lane reduction per token;
// - the rows of the next chunk (all of this thread's kv heads, adjacent in a
//   page) are prefetched while this one computes.
// Needs head_dim % 16 == 0 (64, 128, 256: every model that matters); other head
// sizes use the AVX2 kernel.

constexpr int64_t kTile = 16;  // tokens per inner chunk: one score vector
constexpr int64_t kGroupTile = 4;  // query heads sharing a widened K or V vector

template <Kind K>
KVSTORE_INLINE __m512 load_row16(const typename Storage<K>::type* p) {
  if constexpr (K == Kind::F32) {
    return _mm512_loadu_ps(p);
  } else if constexpr (K == Kind::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (K == Kind::FP8) {
    // e4m3 / 256 as half precision (fp8_e4m3_to_fp16_bits), three integer ops: sign
    // extension puts the sign in bits 15 and 14 after the shift, the mask clears 14.
    // The caller's scale carries the factor 256. NaN bytes stay NaN.
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                       _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    const __mmask16 nan =
        _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
    return _mm512_mask_blend_ps(nan, _mm512_cvtph_ps(h), _mm512_set1_ps(__builtin_nanf("")));
  } else {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// r[j] = sum of the 16 lanes of a[j], j < 16.
KVSTORE_INLINE __m512 transpose_sum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  // b[i]: lanes 0-7 partial sums of a[2i], lanes 8-15 of a[2i+1].
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  // c[i]: 128-bit lane k holds four partial sums of a[4i + k].
  const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
  // e: lane 4k + m holds the sum of a[4m + k].
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, e);
}

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

// dots[g * 16 + j] = q_g · k_j (16 lanes, to be summed) for GT query heads and n tokens.
template <Kind K, int GT>
KVSTORE_INLINE void qk_tile(const float* __restrict q, const typename Storage<K>::type* const* rows,
                            int64_t n, int64_t D, __m512* __restrict dots) {
  for (int64_t j = 0; j < n; ++j) {
    const typename Storage<K>::type* k = rows[j];
    __m512 acc[GT];
    for (int g = 0; g < GT; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 kv = load_row16<K>(k + d);
      for (int g = 0; g < GT; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < GT; ++g) dots[g * kTile + j] = acc[g];
  }
}

// acc[g][d] += sum_j p[g * 16 + j] * v_j[d] for GT query heads, C columns of 16 at a time.
template <Kind K, int GT, int C>
KVSTORE_INLINE void pv_tile(float* __restrict acc, const float* __restrict p,
                            const typename Storage<K>::type* const* rows, int64_t n, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 16 * C) {
    __m512 a[GT][C];
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
    }
    for (int64_t j = 0; j < n; ++j) {
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load_row16<K>(rows[j] + d0 + 16 * c);
      for (int g = 0; g < GT; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g * kTile + j]);
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pj, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < GT; ++g) {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
    }
  }
}

// One 16-token chunk of one kv head for GT query heads (state index i0 .. i0 + GT - 1).
// fp8 (K == FP8): kscale/vscale hold each token's (block, head) scale times 256. The
// K scale multiplies the 16 summed scores at once; the V scale multiplies the
// probabilities fed to P·V (not their sum): rows are never scaled one by one.
template <Kind K, int GT>
KVSTORE_INLINE void attend_tile(const Scratch& w, int64_t i0, int64_t D,
                                const typename Storage<K>::type* const* krows,
                                const typename Storage<K>::type* const* vrows, int64_t n,
                                __m512* dots, const float* kscale, const float* vscale) {
  qk_tile<K, GT>(w.q + i0 * D, krows, n, D, dots);
  float* p = w.scores;  // [GT, 16]
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  for (int g = 0; g < GT; ++g) {
    const int64_t i = i0 + g;
    // Lanes past n hold -inf: their exp is 0 (the stale dots there are never read).
    __m512 raw = transpose_sum16(dots + g * kTile);
    if constexpr (K == Kind::FP8) raw = _mm512_mul_ps(raw, _mm512_loadu_ps(kscale));
    const __m512 sc = _mm512_mask_blend_ps(valid, neg_inf, raw);
    const SoftmaxMerge mg = softmax_merge(w.m[i], _mm512_reduce_max_ps(sc));
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(mg.max)));
    if constexpr (K == Kind::FP8) {
      _mm512_storeu_ps(p + g * kTile, _mm512_mul_ps(e, _mm512_loadu_ps(vscale)));
    } else {
      _mm512_storeu_ps(p + g * kTile, e);
    }
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
    pv_tile<K, GT, 4>(acc, p, vrows, n, D);
  } else if (D % 32 == 0) {
    pv_tile<K, GT, 2>(acc, p, vrows, n, D);
  } else {
    pv_tile<K, GT, 1>(acc, p, vrows, n, D);
  }
}

KVSTORE_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <Kind K>
KVSTORE_INLINE float widen_scalar(typename Storage<K>::type x) {
  if constexpr (K == Kind::F32) {
    return x;
  } else if constexpr (K == Kind::F16) {
    return fp16_bits_to_float(x);
  } else {
    return bf16_bits_to_float(x);
  }
}

template <Kind K>
KVSTORE_INLINE void store_scalar(void* out, int64_t i, float v) {
  if constexpr (K == Kind::F32) {
    static_cast<float*>(out)[i] = v;
  } else if constexpr (K == Kind::F16) {
    static_cast<c10::Half*>(out)[i] = c10::Half(v);
  } else {
    static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(v);
  }
}

// The same work units and outputs as attend_units in paged_attention_cpu_kernel.h;
// K: query and output dtype, C: cache dtype (K, or FP8 with per-(block, head) scales).
template <Kind K, Kind C>
KVSTORE_INLINE void attend_units(const Params& p, const Scratch& w, int64_t begin, int64_t end) {
  using T = typename Storage<C>::type;
  using TQ = typename Storage<K>::type;
  const int64_t D = p.head_dim, G = p.group, H = p.num_kv_heads, P = p.num_partitions;
  const int64_t row_stride = H * D;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  // The 16-lane dot accumulators of a tile: [kGroupTile, 16] vectors (4 KiB), aligned.
  alignas(64) __m512 dots[kGroupTile * kTile];
  for (auto& d : dots) d = _mm512_setzero_ps();  // lanes past a short chunk: read, never used
  const T* krows[kTile];
  const T* vrows[kTile];
  alignas(64) float kscale[kTile] = {};
  alignas(64) float vscale[kTile] = {};
  for (int64_t unit = begin; unit < end;) {
    const int64_t s = unit / (P * H);
    const int64_t part = (unit / H) % P;
    const int64_t h0 = unit % H;
    const int64_t h1 = min64(H, h0 + (end - unit));
    unit += h1 - h0;
    const int64_t len = p.seq_lens[s];
    const int64_t start = part * p.partition_tokens;
    const int64_t stop = min64(len, start + p.partition_tokens);
    const int32_t* table = p.block_tables + s * p.table_stride;

    const int64_t heads = (h1 - h0) * G;
    const TQ* q = static_cast<const TQ*>(p.query) + (s * p.num_heads + h0 * G) * D;
    for (int64_t i = 0; i < heads * D; ++i) w.q[i] = widen_scalar<K>(q[i]) * p.scale;
    for (int64_t i = 0; i < heads * D; ++i) w.acc[i] = 0.f;
    for (int64_t i = 0; i < heads; ++i) {
      w.m[i] = -__builtin_inff();
      w.l[i] = 0.f;
    }
    const int64_t span = (h1 - h0) * D * static_cast<int64_t>(sizeof(T));

    for (int64_t c0 = start; c0 < stop; c0 += kTile) {
      const int64_t n = min64(kTile, stop - c0);
      int64_t koff[kTile], voff[kTile];
      [[maybe_unused]] int64_t blk[kTile];
      for (int64_t j = 0; j < n; ++j) {
        if constexpr (C == Kind::FP8) blk[j] = table[(c0 + j) / p.block_size];
        koff[j] = token_row_offset(table, c0 + j, p.block_size, p.k_block_stride, row_stride, 0, D);
        voff[j] = token_row_offset(table, c0 + j, p.block_size, p.v_block_stride, row_stride, 0, D);
      }
      // The next chunk's rows of heads h0 .. h1 - 1 (adjacent in memory) into L2 while
      // this one computes: pages are scattered, so the hardware prefetchers cannot guess
      // across a block boundary.
      const int64_t next_n = min64(kTile, stop - (c0 + kTile));
      for (int64_t j = 0; j < next_n; ++j) {
        const int64_t t = c0 + kTile + j;
        const char* kp = reinterpret_cast<const char*>(
            kc + token_row_offset(table, t, p.block_size, p.k_block_stride, row_stride, h0, D));
        const char* vp = reinterpret_cast<const char*>(
            vc + token_row_offset(table, t, p.block_size, p.v_block_stride, row_stride, h0, D));
        for (int64_t b = 0; b < span; b += 64) {
          _mm_prefetch(kp + b, _MM_HINT_T1);
          _mm_prefetch(vp + b, _MM_HINT_T1);
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t j = 0; j < n; ++j) {
          krows[j] = kc + koff[j] + h * D;
          vrows[j] = vc + voff[j] + h * D;
          if constexpr (C == Kind::FP8) {
            kscale[j] = p.key_scales[blk[j] * p.k_scale_stride + h] * 256.f;
            vscale[j] = p.value_scales[blk[j] * p.v_scale_stride + h] * 256.f;
          }
        }
        int64_t g = 0;
        const int64_t i_h = (h - h0) * G;
        for (; g + kGroupTile <= G; g += kGroupTile) {
          attend_tile<C, kGroupTile>(w, i_h + g, D, krows, vrows, n, dots, kscale, vscale);
        }
        switch (G - g) {
          case 3: attend_tile<C, 3>(w, i_h + g, D, krows, vrows, n, dots, kscale, vscale); break;
          case 2: attend_tile<C, 2>(w, i_h + g, D, krows, vrows, n, dots, kscale, vscale); break;
          case 1: attend_tile<C, 1>(w, i_h + g, D, krows, vrows, n, dots, kscale, vscale); break;
          default: break;
        }
      }
    }

    for (int64_t i = 0; i < heads; ++i) {
      const int64_t head = h0 * G + i;
      const float* acc = w.acc + i * D;
      if (P == 1) {
        // An empty sequence (len 0) attends to nothing: its output is 0.
        const float inv = w.l[i] > 0.f ? 1.f / w.l[i] : 0.f;
        const int64_t o = (s * p.num_heads + head) * D;
        for (int64_t d = 0; d < D; ++d) store_scalar<K>(p.out, o + d, acc[d] * inv);
      } else {
        const int64_t pi = (s * p.num_heads + head) * P + part;
        for (int64_t d = 0; d < D; ++d) p.part_out[pi * D + d] = acc[d];
        p.part_max[pi] = w.m[i];
        p.part_sum[pi] = w.l[i];
      }
    }
  }
}
