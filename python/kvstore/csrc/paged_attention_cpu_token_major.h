// The token-major decode kernel: bfloat16 queries over bfloat16 or fp8 (e4m3, a scale
// per block and kv head) caches on AVX512-BF16 (vdpbf16ps), head_dim % 64 == 0. Included by paged_attention_avx512.h's
// AVX512-BF16 build (KVSTORE_DPBF16=1), whose helpers it uses.
//
// Why token-major: at long context a decode step streams the KV pages from DRAM, and
// how fast it streams depends on the order of the loads. A pool block is
// [tokens][kv heads][head_dim]; walking it head by head (one head's rows of 16 tokens,
// then the next head's) touches a row every H * D elements, and the software prefetches
// of the next block could not make up for it: benches/attention_access.cpp, the loads
// alone over a 32K pool, read at 0.28-0.32 of a read stream that way and at 0.59-0.72
// reading each block in address order on huge pages. So here each tile's K and V bytes
// are read once, in address order: token by token, every kv head of the unit group
// (and every query head of its GQA group) before the next token.
// - q·k: per pair of tokens and kv head, the two K rows are loaded once and dotted with
//   the group's query heads (q from L1: with every head's q live at once it cannot stay
//   in registers; each q vector loaded serves both tokens), so a token pair's rows go
//   head by head; the 16-lane dot vectors of 16 (token, query head) pairs are summed by
//   one transposing tree into a row of scores S[token][query head];
// - the online softmax runs on those rows, 16 query heads per vector: one max, exp
//   and rescale decision per 16 heads and token instead of per head;
// - P·V: per pass of 8 tokens (4 pairs) and kv head, each pair's V rows are
//   interleaved word by word (vdpbf16ps takes bfloat16 pairs) and added into the
//   group's accumulators, which live in L1 (every head's accumulators do not fit in
//   registers) and are loaded and stored once per pass; each pair's probabilities are
//   rounded to bfloat16 as one 32-bit word. Within a pass V goes head by head over 8
//   tokens, not strictly in address order: with one pair per pass (strict order) the
//   accumulators' stores made the step 1.4-1.7x slower with the KV in L2;
// - the next tile's rows go to L2 by software prefetch (_MM_HINT_T1), one head's row
//   per head step, K during q·k and V during P·V (a token's whole rows at once
//   filled the miss buffers: 32K from DRAM, CPU time 10.0-10.5 -> 8.3-8.9 ms).
// Measured against the head-major kernel (benches/README.md, 2026-11-24 decode4 and
// "A quiet run, 2026-11-24 (third)"): under load on par from DRAM with huge pages and
// slower with the KV in L2; on a quiet machine 1.12-1.24x faster at 32K from DRAM
// (batch 1 and 16, 4 KiB and huge pages). Over fp8 caches the first version of this
// order was 0.93x of the head-major kernel; with q·k two tokens per q load and D 128
// unrolled it is 1.10x faster in L2 and 1.12-1.15x from DRAM (one thread, 32K, CPU time:
// 4.86 against 5.38-5.41 ms, 6.27-6.54 against 7.00-7.53; benches/README.md, "fp8
// token-major"). fp8 rows are looked up as bfloat16 in registers (fp8_bytes_to_bf16;
// why not shifts: paged_attention_cpu_fp8_bf16.h), and their scales multiply the
// scores and the probabilities, one per token and kv head (lane_scales).
// The accumulators and q keep the element orders of Order::DotBf16 / DotFp8 and
// dot_q_element, which write_unit_outputs (paged_attention_cpu_avx512.h) reads.

// Token pairs whose P·V goes through the accumulators at once (see pv_heads). Measured,
// one thread, 32K, GQA 4, D 128, KV in L2 (CPU ms per step): 1 pair 7.1-8.7, 2 pairs
// 7.4-7.6, 4 pairs 5.5-6.5 (the head-major kernel: 5.0-5.2).
constexpr int kPairsPerPass = 4;

static_assert(kTile == kTokenTile, "tm_floats sizes the buffers for this tile");

// out0[g], out1[g] = 16-lane partial dots of the GT query heads at q (stride D,
// bfloat16 words in dot_q_element order) with the K rows k0 and k1 of two tokens. Each
// q vector is loaded once for both rows: one token at a time, q·k took 20 64-byte loads
// per 16 vdpbf16ps and waited on the load ports (a 64-byte load takes both of Zen 4's);
// two take 12 per 16 (benches/attention_hot.cpp: 5.8 -> 4.3 ns per token and kv head).
template <Kind C, int GT>
KVSTORE_INLINE void qk_heads2(const uint16_t* __restrict q, const typename Storage<C>::type* k0,
                              const typename Storage<C>::type* k1, int64_t D,
                              __m512* __restrict out0, __m512* __restrict out1) {
  __m512 a[GT], b[GT];
  for (int g = 0; g < GT; ++g) a[g] = b[g] = _mm512_setzero_ps();
  if constexpr (C == Kind::FP8) {
    // 64 e4m3 bytes of each row looked up as bfloat16 (fp8_to_bf16x64: q is in its word
    // order), then as the bfloat16 rows: each q vector serves both tokens.
    for (int64_t d = 0; d < D; d += 64) {
      __m512i x0[2], x1[2];
      fp8_to_bf16x64(k0 + d, x0[0], x0[1]);
      fp8_to_bf16x64(k1 + d, x1[0], x1[1]);
      for (int h = 0; h < 2; ++h) {
        for (int g = 0; g < GT; ++g) {
          const __m512i qq = _mm512_loadu_si512(q + g * D + d + 32 * h);
          a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)qq, (__m512bh)x0[h]);
          b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)qq, (__m512bh)x1[h]);
        }
      }
    }
  } else {
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i x0 = _mm512_loadu_si512(k0 + d);
      const __m512i x1 = _mm512_loadu_si512(k1 + d);
      for (int g = 0; g < GT; ++g) {
        const __m512i qq = _mm512_loadu_si512(q + g * D + d);
        a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)qq, (__m512bh)x0);
        b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)qq, (__m512bh)x1);
      }
    }
  }
  for (int g = 0; g < GT; ++g) {
    out0[g] = a[g];
    out1[g] = b[g];
  }
}

// The rows of tokens j and j1 interleaved word by word, 64 columns from d0: the bfloat16
// pairs vdpbf16ps takes, in Order::DotBf16 (bfloat16 rows) or Order::DotFp8 (e4m3
// rows: their bytes interleaved, then looked up, as pv_tile_dot does).
template <Kind C>
KVSTORE_INLINE void interleave_rows(const typename Storage<C>::type* vj,
                                    const typename Storage<C>::type* vj1, int64_t d0, __m512i* u) {
  if constexpr (C == Kind::FP8) {
    const __m512i x = _mm512_loadu_si512(vj + d0);
    const __m512i y = _mm512_loadu_si512(vj1 + d0);
    fp8_bytes_to_bf16(_mm512_unpacklo_epi8(x, y), u[0], u[1]);
    fp8_bytes_to_bf16(_mm512_unpackhi_epi8(x, y), u[2], u[3]);
  } else {
    const __m512i x0 = _mm512_loadu_si512(vj + d0);
    const __m512i x1 = _mm512_loadu_si512(vj + d0 + 32);
    const __m512i y0 = _mm512_loadu_si512(vj1 + d0);
    const __m512i y1 = _mm512_loadu_si512(vj1 + d0 + 32);
    u[0] = _mm512_unpacklo_epi16(x0, y0);
    u[1] = _mm512_unpackhi_epi16(x0, y0);
    u[2] = _mm512_unpacklo_epi16(x1, y1);
    u[3] = _mm512_unpackhi_epi16(x1, y1);
  }
}

// acc[g][.] += sum over NP token pairs i of p_2i v_2i + p_2i+1 v_2i+1 for GT query heads
// (accumulators at stride D): v[2i], v[2i + 1] the pair's rows of this kv head,
// pairs[i][g] its (p, p) bfloat16 words. Each accumulator is loaded and stored once per
// NP pairs: with every head's accumulators in L1, their stores are what P·V costs.
template <Kind C, int GT, int NP>
KVSTORE_INLINE void pv_heads(float* __restrict acc, const uint32_t* const* pairs,
                             const typename Storage<C>::type* const* v, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512i u[NP][4];
    for (int i = 0; i < NP; ++i) interleave_rows<C>(v[2 * i], v[2 * i + 1], d0, u[i]);
    for (int g = 0; g < GT; ++g) {
      float* a = acc + g * D + d0;
      __m512 r[4];
      for (int c = 0; c < 4; ++c) r[c] = _mm512_loadu_ps(a + 16 * c);
      for (int i = 0; i < NP; ++i) {
        const __m512i pp = _mm512_set1_epi32(static_cast<int>(pairs[i][g]));
        for (int c = 0; c < 4; ++c) r[c] = _mm512_dpbf16_ps(r[c], (__m512bh)pp, (__m512bh)u[i][c]);
      }
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(a + 16 * c, r[c]);
    }
  }
}

// Per-thread buffers of the token-major kernel, carved from Scratch::tm (64-byte aligned,
// tm_floats(NH) floats). NQp: query heads rounded up to whole score vectors.
struct TokenMajorBuffers {
  float* scores;    // [kTile, NQp]: scaled q·k, then exp(s - max)
  uint32_t* pairs;  // [kTile / 2, NQp]: bfloat16 probability pairs of tokens 2i, 2i + 1
  // fp8: where a score vector's lanes find their (block, kv head) scale. Chunk c's
  // lanes are the query heads 16 c .. 16 c + 15, of kv heads from first[c]: lane i
  // takes scale idx[16 c + i] of the 16 loaded from first[c] (mask[c]: the kv heads that
  // exist, so a load never leaves the unit group's heads).
  int32_t* idx;     // [NQp]
  int32_t* first;   // [NQp / 16]
  uint32_t* mask;   // [NQp / 16]
};

// The (block, kv head) scales of one token over score chunk c's 16 query heads:
// `scales` points at the token's block's scale of kv head h0.
KVSTORE_INLINE __m512 lane_scales(const float* scales, const TokenMajorBuffers& b, int64_t c) {
  const __m512 s = _mm512_maskz_loadu_ps(static_cast<__mmask16>(b.mask[c]), scales + b.first[c]);
  return _mm512_permutexvar_ps(_mm512_load_si512(b.idx + c * kHeadLanes), s);
}

// The 16 dot vectors at dots[0 .. nd) summed into scores row[0 .. 16) times mul (lanes
// past nd: 0).
KVSTORE_INLINE void flush_dots(__m512* dots, int64_t nd, float* row, __m512 mul) {
  for (int64_t i = nd; i < kHeadLanes; ++i) dots[i] = _mm512_setzero_ps();
  _mm512_store_ps(row, _mm512_mul_ps(transpose_sum16(dots), mul));
}

// The same work units and outputs as attend_rows<BF16, C> (paged_attention_cpu_head_major.h),
// C: the cache, bfloat16 or fp8 (e4m3 looked up as bfloat16 in registers; the scales
// multiply the scores and the probabilities, one per token and kv head, never the rows).
// DC: head_dim known at compile time (0: at run time).
template <Kind C, int DC>
KVSTORE_INLINE void attend_units_token_major_d(const Params& p, const Scratch& w, int64_t begin,
                                             int64_t end) {
  using T = typename Storage<C>::type;  // the cache's bit patterns (the query: bfloat16)
  constexpr bool kFp8 = C == Kind::FP8;
  const int64_t D = DC > 0 ? DC : p.head_dim, G = p.group, H = p.num_kv_heads, P = p.num_partitions;
  const int64_t row_stride = H * D;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  // 16 dot vectors and up to 3 more from a group of query heads that crosses 16.
  alignas(64) __m512 dots0[kHeadLanes + kGroupTile], dots1[kHeadLanes + kGroupTile];
  int64_t blk[kTile], off[kTile], next_blk[kTile], next_off[kTile];
  auto* tm_base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(w.tm) + 63) & ~uintptr_t{63});
  for (int64_t unit = begin; unit < end;) {
    const UnitRun u = unit_run(p, unit, end);
    const int64_t s = u.s, part = u.part, h0 = u.h0, h1 = u.h1, start = u.start, stop = u.stop;
    const int32_t* table = u.table;
    unit += h1 - h0;
    const int64_t HH = h1 - h0;
    const int64_t heads = HH * G;
    const int64_t nqp = head_lanes_up(heads);
    const int64_t chunks = nqp / kHeadLanes;
    TokenMajorBuffers b{tm_base, reinterpret_cast<uint32_t*>(tm_base + kTile * nqp),
                        reinterpret_cast<int32_t*>(tm_base + (kTile + kTile / 2) * nqp),
                        reinterpret_cast<int32_t*>(tm_base + (kTile + kTile / 2 + 1) * nqp),
                        reinterpret_cast<uint32_t*>(tm_base + (kTile + kTile / 2 + 1) * nqp + chunks)};
    if constexpr (kFp8) {
      for (int64_t c = 0; c < chunks; ++c) {
        // Lanes past the group's heads take its last kv head: a finite scale for a
        // score nobody reads.
        const int64_t first = min64(c * kHeadLanes, heads - 1) / G;
        const int64_t last = min64(c * kHeadLanes + kHeadLanes - 1, heads - 1) / G;
        b.first[c] = static_cast<int32_t>(first);
        b.mask[c] = (1u << (last - first + 1)) - 1u;
        for (int64_t i = 0; i < kHeadLanes; ++i) {
          b.idx[c * kHeadLanes + i] = static_cast<int32_t>(min64(c * kHeadLanes + i, heads - 1) / G - first);
        }
      }
    }
    const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));

    const auto* q = static_cast<const uint16_t*>(p.query) + (s * p.num_heads + h0 * G) * D;
    auto* qb = reinterpret_cast<uint16_t*>(w.q);
    // Head by head, not i / D and i % D per element (a 64-bit division each).
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t a = 0; a < D; ++a) qb[h * D + a] = q[h * D + dot_q_element<C>(a)];
    }
    for (int64_t i = 0; i < heads * D; ++i) w.acc[i] = 0.f;
    for (int64_t i = 0; i < heads; ++i) {
      w.m[i] = -__builtin_inff();
      w.l[i] = 0.f;
    }
    const __m512 mul = _mm512_set1_ps(p.scale);  // bfloat16: q is not pre-scaled
    const float* kscales = kFp8 ? p.key_scales + h0 : nullptr;
    const float* vscales = kFp8 ? p.value_scales + h0 : nullptr;

    TokenCursor cur{table, p.block_size, start / p.block_size, start % p.block_size};
    const int64_t first_n = min64(kTile, stop - start);
    for (int64_t j = 0; j < first_n; ++j) cur.next(next_blk[j], next_off[j]);
    for (int64_t c0 = start; c0 < stop; c0 += kTile) {
      const int64_t n = min64(kTile, stop - c0);
      const int64_t next_n = c0 + kTile < stop ? min64(kTile, stop - (c0 + kTile)) : 0;
      for (int64_t j = 0; j < n; ++j) {
        blk[j] = next_blk[j];
        off[j] = next_off[j];
      }
      for (int64_t j = 0; j < next_n; ++j) cur.next(next_blk[j], next_off[j]);

      // What multiplies token j's scores of chunk c: the softmax scale, and fp8's K scale.
      const auto kmul = [&](int64_t j, int64_t c) {
        if constexpr (kFp8) {
          return _mm512_mul_ps(mul, lane_scales(kscales + blk[j] * p.k_scale_stride, b, c));
        } else {
          (void)j;
          (void)c;
          return mul;
        }
      };
      // q·k, two tokens at a time (see qk_heads2), each pair's rows head by head.
      for (int64_t j = 0; j < n; j += 2) {
        // An odd tile's last token pairs with itself; its twin's scores go to row n,
        // which the softmax does not read (n < kTile then).
        const int64_t j1 = j + 1 < n ? j + 1 : j;
        // The next tile's tokens j and j + 1, a head's rows per head step (a burst of
        // whole tokens' rows would fill the core's miss buffers and hold up the loads).
        const char* nk[2];
        for (int64_t x = 0; x < 2; ++x) {
          nk[x] = j + x < next_n ? reinterpret_cast<const char*>(kc + next_blk[j + x] * p.k_block_stride +
                                                                 next_off[j + x] * row_stride + h0 * D)
                                 : nullptr;
        }
        const T* k0 = kc + blk[j] * p.k_block_stride + off[j] * row_stride + h0 * D;
        const T* k1 = kc + blk[j1] * p.k_block_stride + off[j1] * row_stride + h0 * D;
        float* srow0 = b.scores + j * nqp;
        float* srow1 = b.scores + (j + 1) * nqp;
        int64_t nd = 0, chunk = 0;
        for (int64_t hh = 0; hh < HH; ++hh) {
          for (int64_t x = 0; x < 2; ++x) {
            if (nk[x] != nullptr) {
              for (int64_t y = 0; y < row_bytes; y += 64) _mm_prefetch(nk[x] + hh * row_bytes + y, _MM_HINT_T1);
            }
          }
          const uint16_t* qh = qb + hh * G * D;
          const T* kh0 = k0 + hh * D;
          const T* kh1 = k1 + hh * D;
          for (int64_t g = 0; g < G; g += kGroupTile) {
            switch (min64(kGroupTile, G - g)) {
              case 4: qk_heads2<C, 4>(qh + g * D, kh0, kh1, D, dots0 + nd, dots1 + nd); nd += 4; break;
              case 3: qk_heads2<C, 3>(qh + g * D, kh0, kh1, D, dots0 + nd, dots1 + nd); nd += 3; break;
              case 2: qk_heads2<C, 2>(qh + g * D, kh0, kh1, D, dots0 + nd, dots1 + nd); nd += 2; break;
              default: qk_heads2<C, 1>(qh + g * D, kh0, kh1, D, dots0 + nd, dots1 + nd); nd += 1; break;
            }
            if (nd >= kHeadLanes) {
              flush_dots(dots0, kHeadLanes, srow0 + chunk * kHeadLanes, kmul(j, chunk));
              flush_dots(dots1, kHeadLanes, srow1 + chunk * kHeadLanes, kmul(j1, chunk));
              ++chunk;
              nd -= kHeadLanes;
              for (int64_t i = 0; i < nd; ++i) {
                dots0[i] = dots0[kHeadLanes + i];
                dots1[i] = dots1[kHeadLanes + i];
              }
            }
          }
        }
        if (nd > 0) {
          flush_dots(dots0, nd, srow0 + chunk * kHeadLanes, kmul(j, chunk));
          flush_dots(dots1, nd, srow1 + chunk * kHeadLanes, kmul(j1, chunk));
        }
      }

      // Online softmax, 16 query heads per vector: scores become exp(s - max), the
      // running sums and accumulators are rescaled where the max rose.
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t q0 = c * kHeadLanes;
        const __mmask16 live = static_cast<__mmask16>(
            heads - q0 >= kHeadLanes ? 0xFFFFu : (1u << (heads - q0)) - 1u);
        __m512 tmax = _mm512_load_ps(b.scores + q0);
        for (int64_t j = 1; j < n; ++j) tmax = _mm512_max_ps(_mm512_load_ps(b.scores + j * nqp + q0), tmax);
        const __m512 m_old = _mm512_maskz_loadu_ps(live, w.m + q0);
        // vmaxps gives its second operand where either is a NaN: a NaN tile max stays.
        const __m512 m_new = _mm512_max_ps(m_old, tmax);
        const __mmask16 rose = _mm512_mask_cmp_ps_mask(live, m_new, m_old, _CMP_NEQ_UQ);
        __m512 scale_a = _mm512_set1_ps(1.f);
        if (rose != 0) {
          // m_old = -inf (first tile): exp(-inf) = 0; the accumulators are 0 then anyway.
          scale_a = _mm512_mask_blend_ps(rose, scale_a,
                                         exp16_nonpositive(_mm512_sub_ps(m_old, m_new)));
          alignas(64) float sa[kHeadLanes];
          _mm512_store_ps(sa, scale_a);
          for (uint32_t r = rose; r != 0; r &= r - 1) {
            const int64_t i = __builtin_ctz(r);
            float* acc = w.acc + (q0 + i) * D;
            const __m512 sv = _mm512_set1_ps(sa[i]);
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), sv));
          }
        }
        // Heads whose every score so far is -inf keep a -inf max: subtract 0 there, not
        // -inf (exp(-inf + inf) is NaN), so these tokens weigh 0 (as in attend_units).
        const __mmask16 all_ninf = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
        const __m512 shift = _mm512_mask_blend_ps(all_ninf, m_new, _mm512_setzero_ps());
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 2) {
          const __m512 e0 = exp16_nonpositive(_mm512_sub_ps(_mm512_load_ps(b.scores + j * nqp + q0), shift));
          const __m512 e1 = j + 1 < n ? exp16_nonpositive(_mm512_sub_ps(
                                            _mm512_load_ps(b.scores + (j + 1) * nqp + q0), shift))
                                      : _mm512_setzero_ps();
          sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
          __m512 p0 = e0, p1 = e1;
          if constexpr (kFp8) {
            // The V scales go on the probabilities (the sum stays unscaled).
            p0 = _mm512_mul_ps(e0, lane_scales(vscales + blk[j] * p.v_scale_stride, b, c));
            if (j + 1 < n) p1 = _mm512_mul_ps(e1, lane_scales(vscales + blk[j + 1] * p.v_scale_stride, b, c));
          }
          const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p0));
          const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(p1));
          _mm512_store_si512(b.pairs + (j / 2) * nqp + q0, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        // Pairs past the tile's last token: probability 0 (P·V's passes may reach them).
        for (int64_t j = ceil_div(n, 2); j < kTile / 2; ++j) {
          _mm512_store_si512(b.pairs + j * nqp + q0, _mm512_setzero_si512());
        }
        const __m512 l_old = _mm512_maskz_loadu_ps(live, w.l + q0);
        _mm512_mask_storeu_ps(w.l + q0, live, _mm512_fmadd_ps(l_old, scale_a, sum));
        _mm512_mask_storeu_ps(w.m + q0, live, m_new);
      }

      // P·V, kPairsPerPass pairs of tokens at a time (then single pairs), each token's
      // rows in address order.
      for (int64_t j = 0; j < n;) {
        // Tokens past n in a pass: row n - 1 at probability 0.
        const int64_t np = n - j > 2 ? kPairsPerPass : 1;
        const T* v[2 * kPairsPerPass];
        const char* nv[2 * kPairsPerPass];  // the next tile's rows of the same tokens
        const uint32_t* pr[kPairsPerPass];
        for (int64_t x = 0; x < 2 * np; ++x) {
          const int64_t jx = min64(j + x, n - 1);
          v[x] = vc + blk[jx] * p.v_block_stride + off[jx] * row_stride + h0 * D;
          nv[x] = j + x < next_n ? reinterpret_cast<const char*>(vc + next_blk[j + x] * p.v_block_stride +
                                                                 next_off[j + x] * row_stride + h0 * D)
                                 : nullptr;
        }
        for (int64_t i = 0; i < np; ++i) pr[i] = b.pairs + (j / 2 + i) * nqp;
        for (int64_t hh = 0; hh < HH; ++hh) {
          const T* vh[2 * kPairsPerPass];
          for (int64_t x = 0; x < 2 * np; ++x) {
            vh[x] = v[x] + hh * D;
            if (nv[x] != nullptr) {
              for (int64_t y = 0; y < row_bytes; y += 64) _mm_prefetch(nv[x] + hh * row_bytes + y, _MM_HINT_T1);
            }
          }
          for (int64_t g = 0; g < G; g += kGroupTile) {
            const int64_t i = hh * G + g;
            const uint32_t* pri[kPairsPerPass];
            for (int64_t y = 0; y < np; ++y) pri[y] = pr[y] + i;
            float* acc = w.acc + i * D;
            if (np == kPairsPerPass) {
              switch (min64(kGroupTile, G - g)) {
                case 4: pv_heads<C, 4, kPairsPerPass>(acc, pri, vh, D); break;
                case 3: pv_heads<C, 3, kPairsPerPass>(acc, pri, vh, D); break;
                case 2: pv_heads<C, 2, kPairsPerPass>(acc, pri, vh, D); break;
                default: pv_heads<C, 1, kPairsPerPass>(acc, pri, vh, D); break;
              }
            } else {
              switch (min64(kGroupTile, G - g)) {
                case 4: pv_heads<C, 4, 1>(acc, pri, vh, D); break;
                case 3: pv_heads<C, 3, 1>(acc, pri, vh, D); break;
                case 2: pv_heads<C, 2, 1>(acc, pri, vh, D); break;
                default: pv_heads<C, 1, 1>(acc, pri, vh, D); break;
              }
            }
          }
        }
        j += 2 * np;
      }
    }
    write_unit_outputs<Kind::BF16, C>(p, w, s, part, h0, heads);
  }
}

// Head size 128 known at compile time: the loops over a row unroll and their pointers
// fold into addressing, 1.2x faster with the KV in L2 (one thread, 32K, GQA 4: 5.3 ->
// 4.3-4.5 ms); other head sizes take D at run time.
template <Kind C>
KVSTORE_INLINE void attend_units_token_major(const Params& p, const Scratch& w, int64_t begin,
                                             int64_t end) {
  if (p.head_dim == 128) {
    attend_units_token_major_d<C, 128>(p, w, begin, end);
  } else {
    attend_units_token_major_d<C, 0>(p, w, begin, end);
  }
}
