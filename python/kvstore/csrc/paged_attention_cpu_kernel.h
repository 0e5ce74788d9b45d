// The hot loops of the CPU paged attention, included twice by
// paged_attention_cpu.cpp: once for baseline x86-64 (or any other CPU) and once
// under `#pragma GCC target("avx2,fma,f16c")` with KVSTORE_F16C=1, each time in
// its own namespace. No include guard on purpose; no #include either (the
// includer provides Params, Scratch, Kind, Storage, v8f and the common header).
//
// Every helper is forced inline, so it is compiled for the target of the kernel
// that calls it.

KVSTORE_INLINE v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
KVSTORE_INLINE void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof(v)); }
KVSTORE_INLINE v8f splat8(float x) { return v8f{x, x, x, x, x, x, x, x}; }
KVSTORE_INLINE float hsum8(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
KVSTORE_INLINE float hmax8(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

template <Kind K>
KVSTORE_INLINE float widen1(typename Storage<K>::type x) {
  if constexpr (K == Kind::F32) {
    return x;
  } else if constexpr (K == Kind::F16) {
    return fp16_bits_to_float(x);
  } else {
    return bf16_bits_to_float(x);
  }
}

// Eight 16-bit floats to fp32: bfloat16 is a shift; float16 is one F16C instruction
// where the CPU has it, else fp16_bits_to_float (paged_attention_common.h) lane-wise.
// Both are exact for subnormals, inf and NaN.
template <Kind K>
KVSTORE_INLINE v8f widen8(const uint16_t* p) {
#if KVSTORE_F16C
  if constexpr (K == Kind::F16) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return reinterpret_cast<const v8f&>(f);
  }
#endif
  v8h h;
  __builtin_memcpy(&h, p, sizeof(h));
  const v8u w = __builtin_convertvector(h, v8u) << 16;
  if constexpr (K == Kind::BF16) {
    return reinterpret_cast<const v8f&>(w);
  } else {
    const v8u sign = w & 0x80000000u;
    const v8u two_w = w + w;
    const v8u norm_bits = (two_w >> 4) + (0xE0u << 23);
    const v8f norm = reinterpret_cast<const v8f&>(norm_bits) * 0x1.0p-112f;
    const v8u denorm_bits = (two_w >> 17) | (126u << 23);
    const v8f denorm = reinterpret_cast<const v8f&>(denorm_bits) - 0.5f;
    const v8u bits = two_w < (1u << 27) ? reinterpret_cast<const v8u&>(denorm)
                                        : reinterpret_cast<const v8u&>(norm);
    const v8u out = sign | bits;
    return reinterpret_cast<const v8f&>(out);
  }
}

template <Kind K>
KVSTORE_INLINE void widen(const typename Storage<K>::type* __restrict src, float* __restrict dst,
                          int64_t n) {
  int64_t i = 0;
  if constexpr (K != Kind::F32) {
    for (; i + kLanes <= n; i += kLanes) store8(dst + i, widen8<K>(src + i));
  }
  for (; i < n; ++i) dst[i] = widen1<K>(src[i]);
}

// e4m3 bytes to fp32 times `scale256` (the block's scale times 256): each byte
// becomes the half-precision pattern of its value / 256 (fp8_e4m3_to_fp16_bits),
// widened like float16 above; NaN bytes stay NaN. Exact up to the one rounding of
// the product, the rounding of the reference's dequantization.
KVSTORE_INLINE void widen_fp8(const uint8_t* __restrict src, float* __restrict dst, int64_t n,
                              float scale256) {
  typedef uint8_t v8b __attribute__((vector_size(8)));
  typedef int16_t v8s __attribute__((vector_size(16)));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    v8b b;
    __builtin_memcpy(&b, src + i, sizeof(b));
    const v8h x = __builtin_convertvector(b, v8h);
    const v8h bits = ((x & 0x7F) << 7) | ((x & 0x80) << 8);
    uint16_t tmp[kLanes];
    __builtin_memcpy(tmp, &bits, sizeof(tmp));
    const v8f f = widen8<Kind::F16>(tmp) * scale256;
    const v8s nan16 = (x & 0x7F) == 0x7F;
    const v8i nan = __builtin_convertvector(nan16, v8i);
    store8(dst + i, nan ? splat8(__builtin_nanf("")) : f);
  }
  for (; i < n; ++i) {
    dst[i] = fp8_is_nan(src[i]) ? __builtin_nanf("")
                                : fp16_bits_to_float(fp8_e4m3_to_fp16_bits(src[i])) * scale256;
  }
}

KVSTORE_INLINE int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// exp(x) for x <= 0 (scores minus the running max) on eight lanes: Cephes'
// single-precision polynomial, within 2 ulp of expf (libm's expf is an opaque call
// that GCC only vectorises under -ffast-math). Underflows to 0 below -87.3 (-inf
// included) and keeps NaN a NaN.
KVSTORE_INLINE v8f exp8_nonpositive(v8f x) {
  const v8i nan = x != x;
  const v8i under = x < -87.3f;
  const v8f xc = under ? splat8(-87.3f) : x;
  // floor(xc * log2(e) + 0.5) by truncation and fix-up (cvttps2dq exists on every
  // x86-64; roundps only from SSE4.1 on).
  const v8f t = xc * 1.44269504088896341f + 0.5f;
  v8i n = __builtin_convertvector(t, v8i);
  n += __builtin_convertvector(n, v8f) > t;  // a true compare is -1
  const v8f fx = __builtin_convertvector(n, v8f);
  v8f r = xc - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  v8f y = splat8(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  // n >= -126 here, so 2^n is a normal float.
  const v8i pow2_bits = (n + 127) << 23;
  const v8f scaled = y * reinterpret_cast<const v8f&>(pow2_bits);
  const v8f zeroed = under ? splat8(0.0f) : scaled;
  return nan ? x : zeroed;
}

// Scores of one query head against four rows at once: four independent
// accumulators hide the FMA latency, and q is loaded once for the four.
KVSTORE_INLINE void dot4(const float* __restrict q, const float* __restrict k0,
                         const float* __restrict k1, const float* __restrict k2,
                         const float* __restrict k3, int64_t n, float* __restrict out) {
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const v8f qv = load8(q + d);
    a0 += qv * load8(k0 + d);
    a1 += qv * load8(k1 + d);
    a2 += qv * load8(k2 + d);
    a3 += qv * load8(k3 + d);
  }
  float s0 = hsum8(a0), s1 = hsum8(a1), s2 = hsum8(a2), s3 = hsum8(a3);
  for (; d < n; ++d) {
    s0 += q[d] * k0[d];
    s1 += q[d] * k1[d];
    s2 += q[d] * k2[d];
    s3 += q[d] * k3[d];
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

KVSTORE_INLINE float dot1(const float* __restrict q, const float* __restrict k, int64_t n) {
  v8f a = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) a += load8(q + d) * load8(k + d);
  float s = hsum8(a);
  for (; d < n; ++d) s += q[d] * k[d];
  return s;
}

// acc[d0, d0 + 8V) += sum_j p[j] * v_j[d0, d0 + 8V): V accumulator vectors stay in
// registers across the chunk's tokens instead of a load and a store per FMA.
template <int V>
KVSTORE_INLINE void pv_columns(float* __restrict acc, const float* const* __restrict rows,
                               const float* __restrict p, int64_t n, int64_t d0) {
  v8f a[V];
  for (int i = 0; i < V; ++i) a[i] = load8(acc + d0 + i * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const v8f pj = splat8(p[j]);
    const float* v = rows[j] + d0;
    for (int i = 0; i < V; ++i) a[i] += pj * load8(v + i * kLanes);
  }
  for (int i = 0; i < V; ++i) store8(acc + d0 + i * kLanes, a[i]);
}

KVSTORE_INLINE void accumulate_pv(float* __restrict acc, const float* const* __restrict rows,
                                  const float* __restrict p, int64_t n, int64_t dim) {
  int64_t d = 0;
  for (; d + 4 * kLanes <= dim; d += 4 * kLanes) pv_columns<4>(acc, rows, p, n, d);
  for (; d + kLanes <= dim; d += kLanes) pv_columns<1>(acc, rows, p, n, d);
  for (; d < dim; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < n; ++j) a += p[j] * rows[j][d];
    acc[d] = a;
  }
}

// Eight outputs from out + i on: bfloat16 rounded to nearest even (NaN: 0x7FC0), as
// c10::BFloat16 rounds, eight lanes at once; float16 through c10::Half one by one.
template <Kind K>
KVSTORE_INLINE void store_out8(void* out, int64_t i, v8f v) {
  if constexpr (K == Kind::F32) {
    store8(static_cast<float*>(out) + i, v);
  } else if constexpr (K == Kind::BF16) {
    const v8u u = reinterpret_cast<const v8u&>(v);
    const v8u rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const v8u bits = v != v ? v8u{} + 0x7FC0u : rounded;
    const v8h h = __builtin_convertvector(bits, v8h);
    __builtin_memcpy(static_cast<uint16_t*>(out) + i, &h, sizeof(h));
  } else {
    for (int64_t l = 0; l < kLanes; ++l) store_out<K>(out, i + l, v[l]);
  }
}

// The normalised outputs of the (sequence, query head) pairs [begin, end) of a split
// step, from their partitions' partials. Each pair's partitions fold in order through
// softmax_merge (as on CUDA); a partition's weight in the sum is its own scale times
// the rescales of every later fold (`coef` and `later`: P floats each, the caller's),
// so the rows are summed once, eight columns at a time, not rescaled fold by fold.
template <Kind K>
void merge_partitions(const Params& p, int64_t begin, int64_t end, float* coef, float* later) {
  const int64_t D = p.head_dim, P = p.num_partitions;
  for (int64_t sh = begin; sh < end; ++sh) {
    float m = -__builtin_inff(), l = 0.f;
    for (int64_t part = 0; part < P; ++part) {
      const int64_t pi = sh * P + part;
      coef[part] = 0.f;
      later[part] = 1.f;
      // Past the end of this sequence, or every score of the partition -inf: it adds
      // nothing (its sum is 0), and a -inf max must not reach softmax_merge's expf.
      if (p.part_sum[pi] == 0.f || p.part_max[pi] == -__builtin_inff()) continue;
      const SoftmaxMerge mg = softmax_merge(m, p.part_max[pi]);
      coef[part] = mg.scale_b;
      later[part] = mg.scale_a;  // what this fold does to the partitions before it
      l = l * mg.scale_a + p.part_sum[pi] * mg.scale_b;
      m = mg.max;
    }
    float run = 1.f;
    for (int64_t part = P - 1; part >= 0; --part) {
      coef[part] *= run;
      run *= later[part];
    }
    // An empty sequence (len 0) attends to nothing: its output is 0.
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float* po = p.part_out + sh * P * D;
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes) {
      v8f acc = {};
      for (int64_t part = 0; part < P; ++part) {
        if (coef[part] != 0.f) acc += load8(po + part * D + d) * coef[part];
      }
      store_out8<K>(p.out, sh * D + d, acc * inv);
    }
    for (; d < D; ++d) {
      float acc = 0.f;
      for (int64_t part = 0; part < P; ++part) {
        if (coef[part] != 0.f) acc += po[part * D + d] * coef[part];
      }
      store_out<K>(p.out, sh * D + d, acc * inv);
    }
  }
}

// Work units [begin, end), numbered (sequence, partition, kv head) with the head
// fastest. Consecutive units of one (sequence, partition) run together, chunk by
// chunk: the rows of all their heads for a chunk's tokens are adjacent in a page
// ([B, H, D] blocks), so each page is visited once while it is hot (in the TLB,
// in the prefetchers' stream) instead of once per head.
// K: the dtype of query and output; C: that of the caches, K or FP8 (e4m3 bytes
// whose rows are dequantized with their (block, kv head) scale while widened).
template <Kind K, Kind C>
KVSTORE_INLINE void attend_units(const Params& p, const Scratch& w, int64_t begin, int64_t end) {
  using T = typename Storage<C>::type;
  using TQ = typename Storage<K>::type;
  const int64_t D = p.head_dim, G = p.group, H = p.num_kv_heads, P = p.num_partitions;
  const int64_t row_stride = H * D;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  for (int64_t unit = begin; unit < end;) {
    const UnitRun u = unit_run(p, unit, end);
    const int64_t s = u.s, part = u.part, h0 = u.h0, h1 = u.h1, start = u.start, stop = u.stop;
    const int32_t* table = u.table;
    unit += h1 - h0;

    // Query heads h0 * G .. h1 * G - 1, pre-scaled; state index (h - h0) * G + g.
    const int64_t heads = (h1 - h0) * G;
    const TQ* q = static_cast<const TQ*>(p.query) + (s * p.num_heads + h0 * G) * D;
    for (int64_t i = 0; i < heads * D; ++i) w.q[i] = widen1<K>(q[i]) * p.scale;
    for (int64_t i = 0; i < heads * D; ++i) w.acc[i] = 0.f;
    for (int64_t i = 0; i < heads; ++i) {
      w.m[i] = -__builtin_inff();
      w.l[i] = 0.f;
    }

    for (int64_t c0 = start; c0 < stop; c0 += kChunk) {
      const int64_t n = min64(kChunk, stop - c0);
      for (int64_t j = 0; j < n; ++j) {
        // Row of head 0; head h is h * D further.
        w.koff[j] = token_row_offset(table, c0 + j, p.block_size, p.k_block_stride, row_stride,
                                     0, D);
        w.voff[j] = token_row_offset(table, c0 + j, p.block_size, p.v_block_stride, row_stride,
                                     0, D);
      }
      // Ask for the next chunk's rows (of heads h0 .. h1 - 1, adjacent in memory) while
      // this one computes: pages are scattered, so the hardware prefetchers cannot guess.
      const int64_t next_n = min64(kChunk, stop - (c0 + kChunk));
      const int64_t span = (h1 - h0) * D * static_cast<int64_t>(sizeof(T));
      for (int64_t j = 0; j < next_n; ++j) {
        const int64_t t = c0 + kChunk + j;
        const char* kp = reinterpret_cast<const char*>(
            kc + token_row_offset(table, t, p.block_size, p.k_block_stride, row_stride, h0, D));
        const char* vp = reinterpret_cast<const char*>(
            vc + token_row_offset(table, t, p.block_size, p.v_block_stride, row_stride, h0, D));
        for (int64_t b = 0; b < span; b += 64) {
          __builtin_prefetch(kp + b, 0, 2);
          __builtin_prefetch(vp + b, 0, 2);
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t j = 0; j < n; ++j) {
          const T* krow = kc + w.koff[j] + h * D;
          const T* vrow = vc + w.voff[j] + h * D;
          if constexpr (C == Kind::F32) {
            w.krows[j] = krow;
            w.vrows[j] = vrow;
          } else if constexpr (C == Kind::FP8) {
            const int64_t blk = table[(c0 + j) / p.block_size];
            widen_fp8(krow, w.kf + j * D, D, p.key_scales[blk * p.k_scale_stride + h] * 256.f);
            widen_fp8(vrow, w.vf + j * D, D, p.value_scales[blk * p.v_scale_stride + h] * 256.f);
            w.krows[j] = w.kf + j * D;
            w.vrows[j] = w.vf + j * D;
          } else {
            widen<C>(krow, w.kf + j * D, D);
            widen<C>(vrow, w.vf + j * D, D);
            w.krows[j] = w.kf + j * D;
            w.vrows[j] = w.vf + j * D;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = (h - h0) * G + g;
          const float* qg = w.q + i * D;
          float* sc = w.scores + g * kChunk;
          int64_t j = 0;
          for (; j + 4 <= n; j += 4) {
            dot4(qg, w.krows[j], w.krows[j + 1], w.krows[j + 2], w.krows[j + 3], D, sc + j);
          }
          for (; j < n; ++j) sc[j] = dot1(qg, w.krows[j], D);

          // Lanes past n hold -inf: their exp is 0, so whole vectors can be used.
          for (int64_t t = n; t < kChunk; ++t) sc[t] = -__builtin_inff();
          v8f vmax = load8(sc);
          for (int64_t t = kLanes; t < kChunk; t += kLanes) {
            const v8f x = load8(sc + t);
            vmax = x > vmax ? x : vmax;
          }
          const SoftmaxMerge mg = softmax_merge(w.m[i], hmax8(vmax));
          // While every score so far is -inf (K at -inf, or q·k past fp32's range) the
          // max is -inf too, and exp(s - max) would be exp(-inf + inf) = NaN: subtract
          // 0 then, so these tokens weigh 0 as in the softmax (FlashAttention's rule).
          const float shift = mg.max == -__builtin_inff() ? 0.f : mg.max;
          v8f vsum = {};
          for (int64_t t = 0; t < kChunk; t += kLanes) {
            const v8f e = exp8_nonpositive(load8(sc + t) - shift);
            store8(sc + t, e);
            vsum += e;
          }
          float* acc = w.acc + i * D;
          if (mg.scale_a != 1.f) {
            for (int64_t d = 0; d < D; ++d) acc[d] *= mg.scale_a;
          }
          w.l[i] = w.l[i] * mg.scale_a + hsum8(vsum);
          w.m[i] = mg.max;
          accumulate_pv(acc, w.vrows, sc, n, D);
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
        for (int64_t d = 0; d < D; ++d) store_out<K>(p.out, o + d, acc[d] * inv);
      } else {
        const int64_t pi = (s * p.num_heads + head) * P + part;
        for (int64_t d = 0; d < D; ++d) p.part_out[pi * D + d] = acc[d];
        p.part_max[pi] = w.m[i];
        p.part_sum[pi] = w.l[i];
      }
    }
  }
}
