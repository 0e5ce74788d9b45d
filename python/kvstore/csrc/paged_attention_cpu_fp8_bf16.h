// e4m3 bytes to bfloat16 by table lookup, for vdpbf16ps over fp8 caches: shared by the
// AVX-512 decode kernels (included by paged_attention_cpu_avx512.h in its AVX512-BF16
// build, under its target pragmas: avx512bf16 and avx512vbmi for vpermi2b) and
// benches/attention_hot.cpp, which times it: no include guard, no #include (the
// includer provides <immintrin.h>, <cstdint> and KVSTORE_INLINE).
//
// Why a table, not shifts: ((b & 0x7f) << 4) | ((b & 0x80) << 8) is the bfloat16 of
// the e4m3 value times 2^-120, but its e4m3 subnormals (and the products of small
// values with q) are bfloat16/fp32 subnormals, and vdpbf16ps treats subnormal inputs
// and results as zero (DAZ and FTZ implied, measured on this EPYC): a value up to
// 2^-6 * scale would be lost. Looked up, every e4m3 value is a bfloat16 normal.

// The bfloat16 bits of e4m3 magnitudes 0 .. 127, exact (subnormals m * 2^-9 are
// bfloat16 normals; 0x7f is NaN).
constexpr uint16_t fp8_bf16_bits(int m) {
  if (m == 0x7F) return 0x7FC0;
  const int e = m >> 3, man = m & 7;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (man << 4));
  if (man == 0) return 0;
  const int k = man >= 4 ? 2 : man >= 2 ? 1 : 0;  // man = 2^k * (1 + f)
  return static_cast<uint16_t>(((k - 9 + 127) << 7) | ((man - (1 << k)) << (7 - k)));
}

struct Fp8Tables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
};
constexpr Fp8Tables make_fp8_tables() {
  Fp8Tables t{};
  for (int m = 0; m < 128; ++m) {
    t.lo[m] = static_cast<uint8_t>(fp8_bf16_bits(m) & 0xFF);
    t.hi[m] = static_cast<uint8_t>(fp8_bf16_bits(m) >> 8);
  }
  return t;
}
constexpr Fp8Tables kFp8Tables = make_fp8_tables();

// 64 e4m3 bytes to 64 bfloat16, exactly (NaN included), in two vectors: a 128-entry
// byte table lookup (vpermi2b) each for the low and the high byte of the magnitude's
// bfloat16, the sign into the high byte, and the bytes interleaved into words. Word w
// of a is byte 16 (w / 8) + w % 8 of x, of b that + 8 (the 128-bit lanes of vpunpck).
KVSTORE_INLINE void fp8_bytes_to_bf16(__m512i x, __m512i& a, __m512i& b) {
  const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Tables.lo), x,
                                              _mm512_load_si512(kFp8Tables.lo + 64));
  __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Tables.hi), x,
                                        _mm512_load_si512(kFp8Tables.hi + 64));
  hi = _mm512_ternarylogic_epi32(hi, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}
KVSTORE_INLINE void fp8_to_bf16x64(const uint8_t* p, __m512i& a, __m512i& b) {
  fp8_bytes_to_bf16(_mm512_loadu_si512(p), a, b);
}
