// The instruction side of a bfloat16 paged decode step alone: the loops of the
// token-major kernel (python/kvstore/csrc/paged_attention_cpu_token_major.h) over one
// tile in L1 (16 tokens x 8 kv heads x D 128, GQA 4), one thread, in nanoseconds of
// thread CPU time per token and kv head (fastest of 20 timed runs of 2000 tiles). A
// token and kv head costs 32 vdpbf16ps (16 for q·k, 16 for P·V); the first line is
// their floor with every operand in registers, the others say what the kernel's loads,
// transposes and stores add to them. No hardware counters on this VM: this is how the
// kernel's pieces were weighed (benches/README.md, "the token-major kernel's
// instructions").
//
//   g++ -O3 -march=native benches/attention_hot.cpp -o /tmp/attention_hot && /tmp/attention_hot
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

// The results go here (external linkage): otherwise the loops are dead code.
__m512 sink;

namespace {
constexpr int H = 8, G = 4, D = 128, T = 16;
alignas(64) uint16_t K[T * H * D], Q[H * G * D];
alignas(64) uint8_t K8[T * H * D];  // the same tile in e4m3 (fp8 caches)
alignas(64) float S[T * H * G], ACC[H * G * D];
alignas(64) uint32_t PR[T / 2 * H * G];

double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

#define KVSTORE_INLINE inline __attribute__((always_inline))
#include "../python/kvstore/csrc/paged_attention_cpu_transpose.h"
#include "../python/kvstore/csrc/paged_attention_cpu_fp8_bf16.h"

enum Mode {
  kDotsOnly,
  kQkOneToken,
  kQkTwoTokens,
  kQkOneTokenFlush,
  kQkTwoTokensFlush,
  kPv,
  kQkFp8,
  kQkFp8Flush,
  kPvFp8,
};
const char* name(int m) {
  switch (m) {
    case kDotsOnly: return "32 vdpbf16ps, operands in registers";
    case kQkOneToken: return "q.k, one token per q load (20 loads / 16 dp)";
    case kQkTwoTokens: return "q.k, two tokens per q load (12 loads / 16 dp)";
    case kQkOneTokenFlush: return "  the same + dots through L1 + transpose_sum16";
    case kQkTwoTokensFlush: return "  the same + dots through L1 + transpose_sum16";
    case kPv: return "P.V, passes of 4 token pairs, accumulators in L1";
    case kQkFp8: return "fp8: q.k, two tokens per q load, rows looked up";
    case kQkFp8Flush: return "  the same + dots through L1 + transpose_sum16";
    default: return "fp8: P.V as above, byte pairs looked up";
  }
}

// The dot vectors of 16 (token, query head) pairs summed into one row of scores.
void flush(const __m512* dots, float* row) { _mm512_store_ps(row, transpose_sum16(dots)); }

template <int M>
__attribute__((noinline)) void tiles(int reps) {
  __m512 tot = _mm512_setzero_ps();
  alignas(64) __m512 d0[16], d1[16];
  for (int r = 0; r < reps; ++r) {
    asm volatile("" ::: "memory");  // the tile may have changed: no hoisting out of reps
    if constexpr (M == kDotsOnly) {
      __m512 a[8];
      for (auto& x : a) x = _mm512_setzero_ps();
      __m512i x = _mm512_set1_epi32(0x3f803f80 + (r & 1)), y = _mm512_set1_epi32(0x3f003f00);
      for (int th = 0; th < T * H; ++th) {
        _Pragma("GCC unroll 32") for (int i = 0; i < 32; ++i) {
          a[i & 7] = _mm512_dpbf16_ps(a[i & 7], (__m512bh)x, (__m512bh)y);
        }
        asm volatile("" : "+v"(x));  // keeps the loop from being folded
      }
      for (auto& v : a) tot = _mm512_add_ps(tot, v);
    } else if constexpr (M == kQkOneToken || M == kQkOneTokenFlush) {
      for (int j = 0; j < T; ++j) {
        for (int h = 0; h < H; ++h) {
          const uint16_t* k = K + (j * H + h) * D;
          const uint16_t* q = Q + h * G * D;
          __m512 a[G], b[G];
          for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
          for (int d = 0; d < D; d += 64) {
            const __m512i ka = _mm512_load_si512(k + d), kb = _mm512_load_si512(k + d + 32);
            for (int g = 0; g < G; ++g) {
              a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)_mm512_load_si512(q + g * D + d), (__m512bh)ka);
              b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)_mm512_load_si512(q + g * D + d + 32), (__m512bh)kb);
            }
          }
          for (int g = 0; g < G; ++g) d0[(h & 3) * G + g] = _mm512_add_ps(a[g], b[g]);
          if (M == kQkOneTokenFlush && (h & 3) == 3) flush(d0, S + j * H * G + (h >> 2) * 16);
          if (M == kQkOneToken) {
            for (int g = 0; g < G; ++g) tot = _mm512_add_ps(tot, d0[(h & 3) * G + g]);
          }
        }
      }
    } else if constexpr (M == kQkFp8 || M == kQkFp8Flush) {
      // As the token-major kernel's qk_heads2 over fp8 rows: 64 bytes of each of the
      // two rows looked up as bfloat16, each q vector loaded once for both.
      for (int j = 0; j < T; j += 2) {
        for (int h = 0; h < H; ++h) {
          const uint8_t* k0 = K8 + (j * H + h) * D;
          const uint8_t* k1 = k0 + H * D;
          const uint16_t* q = Q + h * G * D;
          __m512 a[G], b[G];
          for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
          for (int d = 0; d < D; d += 64) {
            __m512i x0[2], x1[2];
            fp8_to_bf16x64(k0 + d, x0[0], x0[1]);
            fp8_to_bf16x64(k1 + d, x1[0], x1[1]);
            for (int c = 0; c < 2; ++c) {
              for (int g = 0; g < G; ++g) {
                const __m512i qq = _mm512_load_si512(q + g * D + d + 32 * c);
                a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)qq, (__m512bh)x0[c]);
                b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)qq, (__m512bh)x1[c]);
              }
            }
          }
          for (int g = 0; g < G; ++g) {
            d0[(h & 3) * G + g] = a[g];
            d1[(h & 3) * G + g] = b[g];
          }
          if (M == kQkFp8Flush && (h & 3) == 3) {
            flush(d0, S + j * H * G + (h >> 2) * 16);
            flush(d1, S + (j + 1) * H * G + (h >> 2) * 16);
          }
          if (M == kQkFp8) {
            for (int g = 0; g < G; ++g) tot = _mm512_add_ps(tot, _mm512_add_ps(a[g], b[g]));
          }
        }
      }
    } else if constexpr (M == kQkTwoTokens || M == kQkTwoTokensFlush) {
      for (int j = 0; j < T; j += 2) {
        for (int h = 0; h < H; ++h) {
          const uint16_t* k0 = K + (j * H + h) * D;
          const uint16_t* k1 = k0 + H * D;
          const uint16_t* q = Q + h * G * D;
          __m512 a[G], b[G];
          for (int g = 0; g < G; ++g) a[g] = b[g] = _mm512_setzero_ps();
          for (int d = 0; d < D; d += 32) {
            const __m512i x0 = _mm512_load_si512(k0 + d), x1 = _mm512_load_si512(k1 + d);
            for (int g = 0; g < G; ++g) {
              const __m512i qq = _mm512_load_si512(q + g * D + d);
              a[g] = _mm512_dpbf16_ps(a[g], (__m512bh)qq, (__m512bh)x0);
              b[g] = _mm512_dpbf16_ps(b[g], (__m512bh)qq, (__m512bh)x1);
            }
          }
          for (int g = 0; g < G; ++g) {
            d0[(h & 3) * G + g] = a[g];
            d1[(h & 3) * G + g] = b[g];
          }
          if (M == kQkTwoTokensFlush && (h & 3) == 3) {
            flush(d0, S + j * H * G + (h >> 2) * 16);
            flush(d1, S + (j + 1) * H * G + (h >> 2) * 16);
          }
          if (M == kQkTwoTokens) {
            for (int g = 0; g < G; ++g) tot = _mm512_add_ps(tot, _mm512_add_ps(a[g], b[g]));
          }
        }
      }
    } else {
      // Per pass of 8 tokens and kv head: each pair's rows interleaved word by word,
      // each query head's 64 accumulators of a half row loaded, 16 vdpbf16ps, stored.
      for (int j = 0; j < T; j += 8) {
        for (int h = 0; h < H; ++h) {
          for (int c0 = 0; c0 < D; c0 += 64) {
            __m512i u[4][4];
            for (int i = 0; i < 4; ++i) {
              if constexpr (M == kPvFp8) {
                // The two rows' bytes interleaved, then looked up (interleave_rows).
                const uint8_t* x = K8 + ((j + 2 * i) * H + h) * D + c0;
                const __m512i xb = _mm512_load_si512(x), yb = _mm512_load_si512(x + H * D);
                fp8_bytes_to_bf16(_mm512_unpacklo_epi8(xb, yb), u[i][0], u[i][1]);
                fp8_bytes_to_bf16(_mm512_unpackhi_epi8(xb, yb), u[i][2], u[i][3]);
              } else {
                const uint16_t* x = K + ((j + 2 * i) * H + h) * D + c0;
                const uint16_t* y = x + H * D;
                const __m512i x0 = _mm512_load_si512(x), x1 = _mm512_load_si512(x + 32);
                const __m512i y0 = _mm512_load_si512(y), y1 = _mm512_load_si512(y + 32);
                u[i][0] = _mm512_unpacklo_epi16(x0, y0);
                u[i][1] = _mm512_unpackhi_epi16(x0, y0);
                u[i][2] = _mm512_unpacklo_epi16(x1, y1);
                u[i][3] = _mm512_unpackhi_epi16(x1, y1);
              }
            }
            for (int g = 0; g < G; ++g) {
              float* acc = ACC + (h * G + g) * D + c0;
              __m512 a[4];
              for (int c = 0; c < 4; ++c) a[c] = _mm512_load_ps(acc + 16 * c);
              for (int i = 0; i < 4; ++i) {
                const __m512i pp = _mm512_set1_epi32(static_cast<int>(PR[(j / 2 + i) * H * G + h * G + g]));
                for (int c = 0; c < 4; ++c) a[c] = _mm512_dpbf16_ps(a[c], (__m512bh)pp, (__m512bh)u[i][c]);
              }
              for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + 16 * c, a[c]);
            }
          }
        }
      }
    }
  }
  sink = tot;
}

template <int M>
void report() {
  constexpr int reps = 2000;
  double best = 1e9;
  for (int i = 0; i < 20; ++i) {
    const double t0 = thread_seconds();
    tiles<M>(reps);
    best = std::min(best, thread_seconds() - t0);
  }
  printf("  %-52s %5.2f ns\n", name(M), best / (double(reps) * T * H) * 1e9);
}
}  // namespace

int main() {
  memset(K, 0x3f, sizeof K);  // bfloat16 0.75: normal numbers (no denormal paths)
  memset(K8, 0x38, sizeof K8);  // e4m3 1.0
  memset(Q, 0x3f, sizeof Q);
  memset(PR, 0x3c, sizeof PR);
  printf("per token and kv head (GQA 4, D 128, one tile in L1, one thread):\n");
  report<kDotsOnly>();
  report<kQkOneToken>();
  report<kQkOneTokenFlush>();
  report<kQkTwoTokens>();
  report<kQkTwoTokensFlush>();
  report<kPv>();
  report<kQkFp8>();
  report<kQkFp8Flush>();
  report<kPvFp8>();
  return 0;
}
