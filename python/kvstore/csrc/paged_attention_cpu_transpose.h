// The transposing tree that sums 16 dot vectors at once, shared by the AVX-512 decode
// kernels (included by paged_attention_cpu_avx512.h inside its namespaces, under their
// target pragmas) and benches/attention_hot.cpp, which times it: no include guard, no
// #include (the includer provides <immintrin.h> and KVSTORE_INLINE).

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
