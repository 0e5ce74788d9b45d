// The memory side of a paged decode step alone: the loads and software prefetches of
// the AVX-512 kernel (python/kvstore/csrc/paged_attention_cpu_avx512.h) over a 32K-token
// bfloat16 pool (H 8 kv heads, D 128, block 16, blocks at random addresses), with no
// arithmetic, against a read-only stream on the same threads. If the access pattern
// alone reads at about the kernel's ratio, the pattern binds the step, not the math.
//
//   g++ -O3 -march=native -fopenmp benches/attention_access.cpp -o /tmp/attention_access
//   /tmp/attention_access [threads] [huge] [rounds] [distance]
//
// threads: 2 (the bench's); huge: 1 for a pool on transparent huge pages; rounds: 9;
// distance: 1 (tiles ahead that are prefetched, the kernel's).
// Printed with the pages the pool got on THP (AnonHugePages of the process: the pool is
// 128 MiB, the stream's buffer is on 4 KiB pages).
// Each round: the stream (fastest of 3 passes over a 1 GiB buffer, 64 MiB per timed
// call, as bench_attention.py), then each pattern (fastest of 5 steps); printed: the
// median over rounds of each pattern's bytes per second over the round's stream.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {
constexpr int kBlock = 16, kHeads = 8, kTile = 16;
constexpr size_t kRow = 128 * 2, kToken = kHeads * kRow, kBlockBytes = kBlock * kToken;
constexpr int kTokens = 32768, kParts = 16;  // split-K as the kernel cuts a 32K step

// The order of one head step's 16 prefetches into the next tile (one row of 256 bytes
// each): the kernel's old one (that head's rows of the 16 tokens, one from every 2 KiB),
// the tile's rows in address order (16 per head step), or none; Linear reads the block
// itself in address order too (K, then V: not the kernel's order, which goes head by
// head), prefetching the same way: what the hardware prefetchers add when the reads
// themselves are sequential.
// LinearBare reads in address order with no software prefetch: what the hardware
// prefetchers alone give a token-major kernel.
// Window2/4/8 read the block head by head within windows of that many tokens (a kernel
// that keeps a head's accumulators in registers over a window) and prefetch in address
// order: between Linear (a window of 1) and the kernel's order (16).
enum class Pattern { HeadRows, AddressOrder, None, Linear, LinearBare, Window2, Window4, Window8 };
constexpr Pattern kPatterns[] = {Pattern::HeadRows, Pattern::AddressOrder, Pattern::None,
                                 Pattern::Linear,   Pattern::LinearBare,   Pattern::Window2,
                                 Pattern::Window4,  Pattern::Window8};
constexpr int kNumPatterns = 8;
int window(Pattern p) {
  return p == Pattern::Window2 ? 2 : p == Pattern::Window4 ? 4 : p == Pattern::Window8 ? 8 : 0;
}
const char* name(Pattern p) {
  switch (p) {
    case Pattern::HeadRows: return "head rows (kernel)";
    case Pattern::AddressOrder: return "address order";
    case Pattern::None: return "no prefetch";
    case Pattern::Linear: return "linear reads";
    case Pattern::LinearBare: return "linear, no prefetch";
    case Pattern::Window2: return "windows of 2 tokens";
    case Pattern::Window4: return "windows of 4 tokens";
    default: return "windows of 8 tokens";
  }
}
int distance = 1;  // tiles ahead that are prefetched

struct Pool {
  char* k;
  char* v;
  std::vector<int> table;
};

char* alloc(size_t n, bool huge) {
  char* p = static_cast<char*>(aligned_alloc(huge ? 1 << 21 : 4096, n));
  if (huge) madvise(p, n, MADV_HUGEPAGE);
  memset(p, 1, n);
  return p;
}

__m512i read_row(const char* p, __m512i a) {
  for (size_t i = 0; i < kRow; i += 64) a = _mm512_add_epi32(a, _mm512_loadu_si512(p + i));
  return a;
}

// One partition: tile by tile (one block), head by head, K rows then V rows, each row
// read while one row of the next tile is prefetched (as qk_tile and pv_tile_dot do).
__m512i partition(const Pool& pool, int part, Pattern pat, __m512i a) {
  const int per = kTokens / kParts / kBlock;
  for (int b = part * per; b < (part + 1) * per; ++b) {
    const char* k = pool.k + size_t(pool.table[b]) * kBlockBytes;
    const char* v = pool.v + size_t(pool.table[b]) * kBlockBytes;
    const bool more = b + distance < (part + 1) * per;
    const char* nk = more ? pool.k + size_t(pool.table[b + distance]) * kBlockBytes : nullptr;
    const char* nv = more ? pool.v + size_t(pool.table[b + distance]) * kBlockBytes : nullptr;
    if (pat == Pattern::Linear || pat == Pattern::LinearBare) {
      if (pat == Pattern::LinearBare) nk = nv = nullptr;
      for (size_t at = 0; at < kBlockBytes; at += kRow) {
        for (size_t l = 0; nk && l < kRow; l += 64) _mm_prefetch(nk + at + l, _MM_HINT_T1);
        a = read_row(k + at, a);
      }
      for (size_t at = 0; at < kBlockBytes; at += kRow) {
        for (size_t l = 0; nv && l < kRow; l += 64) _mm_prefetch(nv + at + l, _MM_HINT_T1);
        a = read_row(v + at, a);
      }
      continue;
    }
    if (const int w = window(pat); w > 0) {
      for (int pass = 0; pass < 2; ++pass) {
        const char* cur = pass == 0 ? k : v;
        const char* next = pass == 0 ? nk : nv;
        size_t at = 0;  // the next block's bytes prefetched so far, in address order
        for (int j0 = 0; j0 < kTile; j0 += w) {
          for (int h = 0; h < kHeads; ++h) {
            for (int j = j0; j < j0 + w; ++j) {
              for (size_t l = 0; next && l < kRow; l += 64, at += 64) _mm_prefetch(next + at, _MM_HINT_T1);
              a = read_row(cur + j * kToken + h * kRow, a);
            }
          }
        }
      }
      continue;
    }
    for (int h = 0; h < kHeads; ++h) {
      for (int pass = 0; pass < 2; ++pass) {
        const char* cur = pass == 0 ? k : v;
        const char* next = pass == 0 ? nk : nv;
        for (int j = 0; j < kTile; ++j) {
          if (next && pat != Pattern::None) {
            const size_t at = pat == Pattern::HeadRows ? j * kToken + h * kRow
                                                       : (h * kTile + j) * kRow;
            for (size_t l = 0; l < kRow; l += 64) _mm_prefetch(next + at + l, _MM_HINT_T1);
          }
          a = read_row(cur + j * kToken + h * kRow, a);
        }
      }
    }
  }
  return a;
}

__m512i sink[64];

double step(const Pool& pool, Pattern pat, int threads) {
  std::atomic<int> next{0};
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    for (int i; (i = next.fetch_add(1)) < kParts;) sink[t] = partition(pool, i, pat, sink[t]);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double stream_call(const char* buf, size_t n, int threads) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const size_t share = n / threads;
    __m512i a = sink[t];
    for (size_t i = t * share; i < (t + 1) * share; i += 64) a = _mm512_add_epi32(a, _mm512_load_si512(buf + i));
    sink[t] = a;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The process's memory on transparent huge pages, in MiB (what `huge` was granted).
long anon_huge_mib() {
  FILE* f = fopen("/proc/self/smaps_rollup", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kib = -1;
  while (fgets(line, sizeof(line), f) != nullptr) {
    if (sscanf(line, "AnonHugePages: %ld kB", &kib) == 1) break;
  }
  fclose(f);
  return kib < 0 ? -1 : kib / 1024;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const bool huge = argc > 2 && atoi(argv[2]) != 0;
  const int rounds = argc > 3 ? atoi(argv[3]) : 9;
  distance = argc > 4 ? atoi(argv[4]) : 1;
  const int blocks = kTokens / kBlock;
  Pool pool{alloc(size_t(blocks) * kBlockBytes, huge), alloc(size_t(blocks) * kBlockBytes, huge), {}};
  pool.table.resize(blocks);
  for (int i = 0; i < blocks; ++i) pool.table[i] = i;
  std::shuffle(pool.table.begin(), pool.table.end(), std::mt19937(0));
  const size_t stream_bytes = size_t(1) << 30, slice = size_t(64) << 20;
  char* buf = alloc(stream_bytes, false);
  std::vector<double> streams, ratio[kNumPatterns];
  for (int r = 0; r < rounds; ++r) {
    double s = 1e9;
    for (int pass = 0; pass < 3; ++pass) {
      for (size_t o = 0; o < stream_bytes; o += slice) s = std::min(s, stream_call(buf + o, slice, threads));
    }
    streams.push_back(slice / s);
    for (int p = 0; p < kNumPatterns; ++p) {
      double t = 1e9;
      for (int i = 0; i < 5; ++i) t = std::min(t, step(pool, kPatterns[p], threads));
      ratio[p].push_back(2.0 * blocks * kBlockBytes / t / streams.back());
    }
  }
  printf("%d threads, %s pages (%ld MiB on THP), %d tile(s) ahead: stream median %.1f GB/s (fastest %.1f)\n",
         threads, huge ? "huge" : "4 KiB", anon_huge_mib(), distance,
         median(streams) / 1e9, *std::max_element(streams.begin(), streams.end()) / 1e9);
  for (int p = 0; p < kNumPatterns; ++p) {
    printf("  %-20s %.2f of the stream (median of %d rounds)\n", name(kPatterns[p]), median(ratio[p]), rounds);
  }
  return 0;
}
