// CPU implementations of kvstore::paged_attention and kvstore::write_kv.
//
// Four builds of the decode kernel, picked at run time (cpu_isa): AVX-512 with
// AVX512-BF16 (vdpbf16ps for bfloat16 queries), AVX-512 (paged_attention_cpu_avx512.h:
// rows converted in registers, 16 lanes), AVX2 (paged_attention_cpu_avx2.h: the same on
// 8 lanes; both walk their units by paged_attention_cpu_head_major.h), and the generic
// 8-lane kernel (paged_attention_cpu_kernel.h) for baseline x86-64 and for head sizes the
// AVX2 one does not take.
//
// Decode attention is a stream over the KV pages, so the kernel is shaped to
// read each page once and keep every core busy:
// - a work unit is (sequence, partition, kv head): the query heads of a GQA
//   group are processed together, so K and V of a kv head are read once for
//   the whole group; the kv heads of a work item go chunk by chunk side by
//   side, so each page is visited once;
// - a step is cut into work items (sequence, partition, group of kv heads), several
//   per thread: long contexts are split into partitions (split-K) whose partial
//   softmax states are merged in fp32 (softmax_merge, shared with the CUDA kernel) by
//   the thread that completes the last outstanding partition of a (sequence, group of
//   kv heads), and the threads take items as they finish, so a descheduled thread on
//   a busy host does not hold the step up by a whole share;
// - tokens go by chunks: the generic kernel widens K and V rows to fp32 once into
//   L1-sized scratch, then scores, the online softmax (one rescale per chunk,
//   not per token) and the P·V accumulation run on 8-lane fp32 vectors.
#include "checks.h"
#include "paged_attention_common.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// The generic kernel is compiled twice, for AVX2+FMA+F16C and for baseline x86-64, the
// AVX2 and AVX-512 kernels once each, and `cpu_isa()` picks on the running CPU: the build runs on any
// x86-64 (which -march=native would not promise) and uses the widest vectors there are.
#define KVSTORE_X86_DISPATCH 1
#include <immintrin.h>
#else
#define KVSTORE_X86_DISPATCH 0
#endif

// The generic vectors below are passed by value only between always-inline helpers,
// so GCC's note that their ABI depends on AVX being enabled does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"

#define KVSTORE_INLINE inline __attribute__((always_inline))

namespace kvstore {
namespace {

// Tokens processed together; K and V of a chunk (2 * 32 * head_dim fp32) stay in L1.
constexpr int64_t kChunk = 32;
// Smallest span of a split-K partition: below it, merging partials costs more than it
// saves.
constexpr int64_t kMinPartitionTokens = 256;
// Work items per thread a step is cut into where it can be (split-K for long contexts):
// enough that a thread descheduled for a while delays the step by little.
constexpr int64_t kItemsPerThread = 8;
// K and V elements a thread should get before a call is worth splitting across threads:
// below, a step runs on the calling thread alone. Measured (2-vCPU EPYC, bfloat16, GQA 4,
// D 128, one sequence, fastest calls): two threads beat one from 128 tokens (256K
// elements, 1.17x) up, 1.2-1.6x from 256 to 2K tokens; medians under a load average of
// 5-7 favour one thread up to 1K (a helper that is descheduled holds its item up).
constexpr int64_t kMinParallelElements = int64_t{1} << 18;
// K and V elements up to which a step's helper is one of OpenMP's team (at::parallel_for,
// the threads torch's own ops use, which spin a while between ops and start at once)
// rather than ATen's inter-op pool (a sleeping thread, woken through the kernel): 0, so
// none by default. Measured (2-vCPU EPYC, bfloat16, GQA 4, D 128, one sequence): on a
// quiet host the team is 1.1-1.25x faster up to 4K tokens (1K: 70-75 us against 84-92,
// where the pool's helper often joins after the caller has taken every item), no faster
// from 8K; with two busy loops beside it, its closing barrier waits whole time slices
// for a descheduled thread (p99 of a 1K step 4-8 ms, against 0.2 ms through the pool).
// $KVSTORE_TEAM_MAX_ELEMENTS opts in, for cores dedicated to the model.
constexpr int64_t kMaxTeamElements = 0;

// Eight fp32 lanes as a GCC/Clang generic vector: plain arithmetic on it compiles to
// one AVX2 instruction (or two SSE2 ones in the baseline build), so the inner loops do
// not depend on the auto-vectoriser's mood, and no intrinsics tie the source to x86.
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
constexpr int64_t kLanes = 8;
static_assert(kChunk % kLanes == 0, "a chunk is a whole number of vectors");

// FP8: float8_e4m3fn caches (bytes) with fp32 scales per (block, kv head).
enum class Kind { F32, F16, BF16, FP8 };

template <Kind K>
struct Storage {
  using type = uint16_t;  // float16 / bfloat16 bit patterns
};
template <>
struct Storage<Kind::F32> {
  using type = float;
};
template <>
struct Storage<Kind::FP8> {
  using type = uint8_t;  // e4m3 bit patterns
};

struct Params {
  const void* query;  // [num_seqs, num_heads, head_dim], packed
  const void* key_cache;
  const void* value_cache;
  int64_t k_block_stride;  // elements
  int64_t v_block_stride;
  const float* key_scales;    // fp8 only: [num_blocks, num_kv_heads], block stride below
  const float* value_scales;
  int64_t k_scale_stride;
  int64_t v_scale_stride;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t group;
  float scale;
  int64_t partition_tokens;
  int64_t num_partitions;
  void* out;         // [num_seqs, num_heads, head_dim] when num_partitions == 1
  float* part_out;   // [num_seqs, num_heads, num_partitions, head_dim], unnormalised
  float* part_max;   // [num_seqs, num_heads, num_partitions]
  float* part_sum;   // [num_seqs, num_heads, num_partitions]
};

// The token-major kernel (paged_attention_cpu_token_major.h): query heads per score
// vector, tokens per tile, and the floats of its per-thread buffers for `heads` query
// heads (TokenMajorBuffers, and 64 bytes of alignment slack). Outside the kernels'
// target pragmas: the caller runs on any x86-64.
constexpr int64_t kHeadLanes = 16;
constexpr int64_t kTokenTile = 16;
inline int64_t head_lanes_up(int64_t n) { return ceil_div(n, kHeadLanes) * kHeadLanes; }
inline int64_t tm_floats(int64_t heads) {
  return (kTokenTile + kTokenTile / 2 + 2) * head_lanes_up(heads) + 16;
}

// A run of work units of one step (a unit is a sequence, a partition and a kv head,
// the kv head fastest): sequence s, partition part, kv heads h0 .. h1 - 1 (to the last
// head, or to `end`), the partition's tokens start .. stop and the sequence's block
// table. Every kernel walks its units through this. Outside the kernels' target
// pragmas: the caller runs on any x86-64.
struct UnitRun {
  int64_t s, part, h0, h1, start, stop;
  const int32_t* table;
};
inline UnitRun unit_run(const Params& p, int64_t unit, int64_t end) {
  const int64_t H = p.num_kv_heads, P = p.num_partitions;
  UnitRun u{};
  u.s = unit / (P * H);
  u.part = (unit / H) % P;
  u.h0 = unit % H;
  u.h1 = std::min(H, u.h0 + (end - unit));
  u.start = u.part * p.partition_tokens;
  u.stop = std::min<int64_t>(p.seq_lens[u.s], u.start + p.partition_tokens);
  u.table = p.block_tables + u.s * p.table_stride;
  return u;
}

// One output element, rounded as c10 rounds (every kernel's scalar path). Outside the
// kernels' target pragmas: scalar code, inlined into each.
template <Kind K>
KVSTORE_INLINE void store_out(void* out, int64_t i, float v) {
  if constexpr (K == Kind::F32) {
    static_cast<float*>(out)[i] = v;
  } else if constexpr (K == Kind::F16) {
    static_cast<c10::Half*>(out)[i] = c10::Half(v);
  } else {
    static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(v);
  }
}

// Per-thread scratch, allocated once per thread outside the kernels.
struct Scratch {
  float* q;       // [num_kv_heads * group, head_dim], pre-scaled
  float* acc;     // [num_kv_heads * group, head_dim]
  float* m;       // [num_kv_heads * group]
  float* l;       // [num_kv_heads * group]
  float* kf;      // [kChunk, head_dim]
  float* vf;      // [kChunk, head_dim]
  float* scores;  // [group, kChunk]
  int64_t* koff;  // [kChunk] element offset of each token's K row (head 0)
  int64_t* voff;  // [kChunk]
  const float** krows;  // [kChunk]
  const float** vrows;  // [kChunk]
  float* tm;            // the token-major kernel's buffers (tm_floats)
};

namespace cpu_base {
#define KVSTORE_F16C 0
#include "paged_attention_cpu_kernel.h"
#undef KVSTORE_F16C
}  // namespace cpu_base

#if KVSTORE_X86_DISPATCH
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace cpu_avx2 {
#define KVSTORE_F16C 1
#include "paged_attention_cpu_kernel.h"
#undef KVSTORE_F16C
#include "paged_attention_cpu_avx2.h"
}  // namespace cpu_avx2
#pragma GCC pop_options
#endif

using AttendFn = void (*)(const Params&, const Scratch&, int64_t, int64_t);

template <Kind K, Kind C>
void attend_base(const Params& p, const Scratch& w, int64_t b, int64_t e) {
  cpu_base::attend_units<K, C>(p, w, b, e);
}

#if KVSTORE_X86_DISPATCH
// (#pragma does not expand macros: the pragmas below spell the list out.)
#define KVSTORE_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")  // KVSTORE_AVX512
namespace cpu_avx512 {
#define KVSTORE_DPBF16 0
#include "paged_attention_cpu_avx512.h"
#undef KVSTORE_DPBF16
}  // namespace cpu_avx512
#pragma GCC pop_options

// The same kernel with q·k on vdpbf16ps (AVX512-BF16) for bfloat16 queries over bfloat16
// or fp8 caches (fp8 looked up as bfloat16 with AVX512-VBMI's vpermi2b).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16,avx512vbmi")
namespace cpu_avx512bf16 {
#define KVSTORE_DPBF16 1
#include "paged_attention_cpu_avx512.h"
#undef KVSTORE_DPBF16
}  // namespace cpu_avx512bf16
#pragma GCC pop_options

template <Kind K, Kind C>
__attribute__((target(KVSTORE_AVX512))) void attend_avx512(const Params& p, const Scratch& w,
                                                           int64_t b, int64_t e) {
  cpu_avx512::attend_rows<K, C>(p, w, b, e);
}

template <Kind C>
__attribute__((target(KVSTORE_AVX512 ",avx512bf16,avx512vbmi"))) void attend_avx512bf16(
    const Params& p, const Scratch& w, int64_t b, int64_t e) {
  // bfloat16 and fp8 caches stream token-major (paged_attention_cpu_token_major.h says why).
  cpu_avx512bf16::attend_units_token_major<C>(p, w, b, e);
}

template <Kind K, Kind C>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const Params& p, const Scratch& w,
                                                          int64_t b, int64_t e) {
  cpu_avx2::attend_rows<K, C>(p, w, b, e);
}

template <Kind K, Kind C>
__attribute__((target("avx2,fma,f16c"))) void attend_avx2_generic(const Params& p,
                                                                  const Scratch& w, int64_t b,
                                                                  int64_t e) {
  cpu_avx2::attend_units<K, C>(p, w, b, e);
}

template <Kind K>
__attribute__((target("avx2,fma,f16c"))) void merge_avx2(const Params& p, int64_t begin,
                                                         int64_t end, float* coef, float* later) {
  cpu_avx2::merge_partitions<K>(p, begin, end, coef, later);
}
#endif

// The widest kernels the CPU runs: AVX-512 (F, BW, VL, DQ) with or without AVX512-BF16
// (and VBMI),
// else AVX2 with FMA and F16C, else the baseline. ATEN_CPU_CAPABILITY=default, =avx2 or
// =avx512 caps the choice (as it does for ATen's own kernels; avx512 leaves out
// AVX512-BF16): the tests use it to check every build.
enum class Isa { Base, Avx2, Avx512, Avx512Bf16 };

Isa cpu_isa() {
#if KVSTORE_X86_DISPATCH
  static const Isa isa = [] {
    const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
    const auto capped = [cap](const char* name) { return cap != nullptr && std::strcmp(cap, name) == 0; };
    if (capped("default")) return Isa::Base;
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c"))) {
      return Isa::Base;
    }
    if (capped("avx2")) return Isa::Avx2;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))) {
      return Isa::Avx2;
    }
    if (capped("avx512") || !__builtin_cpu_supports("avx512bf16") ||
        !__builtin_cpu_supports("avx512vbmi")) {
      return Isa::Avx512;
    }
    return Isa::Avx512Bf16;
  }();
  return isa;
#else
  return Isa::Base;
#endif
}

// A kernel and the name last_cpu_kernel reports for it.
struct Kernel {
  AttendFn fn;
  const char* isa;
  bool token_major = false;  // paged_attention_cpu_token_major.h's
};

template <Kind K, Kind C>
Kernel kernel_for_isa(int64_t head_dim) {
#if KVSTORE_X86_DISPATCH
  const Isa isa = cpu_isa();
  // The AVX-512 kernel reads whole 16-float columns, bfloat16 rows 32 elements at once.
  const bool fits = head_dim % (C == Kind::BF16 ? 32 : 16) == 0;
  if constexpr (K == Kind::BF16 && (C == Kind::BF16 || C == Kind::FP8)) {
    // P·V (and fp8's lookup) go 64 columns at a time.
    if (isa == Isa::Avx512Bf16 && head_dim % 64 == 0) {
      return {&attend_avx512bf16<C>, "avx512_bf16", true};
    }
  }
  if ((isa == Isa::Avx512 || isa == Isa::Avx512Bf16) && fits) return {&attend_avx512<K, C>, "avx512"};
  // The AVX2 kernel reads rows 16 elements at a time; other head sizes go through the
  // generic kernel's scratch.
  if (isa != Isa::Base) {
    return head_dim % 16 == 0 ? Kernel{&attend_avx2<K, C>, "avx2"}
                              : Kernel{&attend_avx2_generic<K, C>, "avx2_generic"};
  }
#else
  (void)head_dim;
#endif
  return {&attend_base<K, C>, "base"};
}

// The kernel for query dtype `dtype` over caches of that dtype, or over fp8 caches.
Kernel kernel_for(at::ScalarType dtype, int64_t head_dim, bool fp8) {
  if (dtype == at::kFloat) {
    return fp8 ? kernel_for_isa<Kind::F32, Kind::FP8>(head_dim)
               : kernel_for_isa<Kind::F32, Kind::F32>(head_dim);
  }
  if (dtype == at::kHalf) {
    return fp8 ? kernel_for_isa<Kind::F16, Kind::FP8>(head_dim)
               : kernel_for_isa<Kind::F16, Kind::F16>(head_dim);
  }
  return fp8 ? kernel_for_isa<Kind::BF16, Kind::FP8>(head_dim)
             : kernel_for_isa<Kind::BF16, Kind::BF16>(head_dim);
}

// What the calling thread's last paged_attention call ran (last_cpu_kernel): so that a
// test can tell that the fast kernel, and split-K, ran, not only that the result is right.
struct LastKernel {
  const char* isa = "none";
  int64_t partitions = 0;
  int64_t partition_tokens = 0;
  int64_t threads = 0;
};
thread_local LastKernel last_kernel;

// $name as a positive integer (read on each call), else `fallback` (unset, empty, or
// not a positive number).
int64_t positive_env(const char* name, int64_t fallback) {
  const char* env = std::getenv(name);
  const long long v = env == nullptr ? 0 : std::atoll(env);
  return v > 0 ? v : fallback;
}

// kMinPartitionTokens, or $KVSTORE_SPLIT_MIN_TOKENS rounded up to a whole chunk: the
// tests lower it so that short contexts run through split-K too.
int64_t min_partition_tokens() {
  const int64_t v = positive_env("KVSTORE_SPLIT_MIN_TOKENS", 0);
  return v > 0 ? ceil_div(v, kChunk) * kChunk : kMinPartitionTokens;
}

// kMinParallelElements, or $KVSTORE_PARALLEL_MIN_ELEMENTS: 1 runs even a short step on
// every thread (how the threshold above is measured).
int64_t min_parallel_elements() {
  return positive_env("KVSTORE_PARALLEL_MIN_ELEMENTS", kMinParallelElements);
}

// kMaxTeamElements, or $KVSTORE_TEAM_MAX_ELEMENTS (the tests set it to reach both ways).
int64_t max_team_elements() {
  return positive_env("KVSTORE_TEAM_MAX_ELEMENTS", kMaxTeamElements);
}

// Runs `items` work items on the calling thread and up to `workers - 1` helpers from
// ATen's inter-op pool, or, where asked (`team`, kMaxTeamElements), on OpenMP's team
// through at::parallel_for. `body(claim)` takes items while `claim(i)` gives one.
//
// Not at::parallel_for by default: its parallel region ends in a barrier that waits for every
// thread of the team, also one that the OS has not scheduled yet, so on a busy host a
// decode step of a millisecond waited for a whole scheduler time slice (measured: every
// 8K-token step took 20 ms on two threads under a load average of 5, 2 ms on one).
// Here items go to whichever thread asks next, and the caller waits only for items a
// helper has taken: a helper that starts late finds none left and never touches the
// step's data (the shared state it holds outlives the call; `body` is never run by it
// then). Returns the number of threads that ran items, the caller included: a helper
// the OS started after the last item was taken does not count.
int64_t run_items(int64_t items, int64_t workers, bool team,
                  const std::function<void(const std::function<bool(int64_t&)>&)>& body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<int64_t> ran{0};  // threads that took an item
    int64_t items = 0;
    // Set to the caller's body; run by a helper only for an item it has claimed, which
    // the caller waits for, so the references it captures are alive then.
    std::function<void(const std::function<bool(int64_t&)>&)> body;
  };
  auto shared = std::make_shared<Shared>();
  shared->items = items;
  shared->body = body;
  const auto work = [](Shared& st) {
    const int64_t first = st.next.fetch_add(1);
    if (first >= st.items) return;  // nothing left: do not touch the step's data
    // Before the item's `done`, which the caller waits for: the count is final then.
    st.ran.fetch_add(1);
    bool given = false;
    st.body([&st, first, &given](int64_t& i) {
      if (!given) {
        given = true;
        i = first;
        return true;
      }
      st.done.fetch_add(1);  // the item the body just finished
      i = st.next.fetch_add(1);
      return i < st.items;
    });
  };
  if (team && workers > 1) {
    // Asked for (kMaxTeamElements): the team's threads take items the same way.
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { work(*shared); });
    return shared->ran.load();
  }
  for (int64_t h = 1; h < workers; ++h) at::launch([shared, work] { work(*shared); });
  work(*shared);
  // Every item is taken now; wait for those helpers still run.
  while (shared->done.load() < items) std::this_thread::yield();
  return shared->ran.load();
}

// The merge of the (sequence, query head) pairs [begin, end) of a split step
// (merge_partitions in paged_attention_cpu_kernel.h), `weights` its 2 * num_partitions
// floats of scratch: the AVX2 build wherever the CPU has it, AVX-512 ones included.
template <Kind K>
void merge_pairs(const Params& p, int64_t begin, int64_t end, float* weights) {
  float* coef = weights;
  float* later = coef + p.num_partitions;
#if KVSTORE_X86_DISPATCH
  if (cpu_isa() != Isa::Base) {
    merge_avx2<K>(p, begin, end, coef, later);
    return;
  }
#endif
  cpu_base::merge_partitions<K>(p, begin, end, coef, later);
}
using MergeFn = void (*)(const Params&, int64_t, int64_t, float*);

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
  const at::Tensor q = query.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();

  // Validate every length and every block id the kernel will touch before any work,
  // so a bad table is an error, never a read outside the caches.
  int64_t max_len = 0;
  for (int64_t s = 0; s < dims.num_seqs; ++s) {
    const int64_t len = len_ptr[s];
    TORCH_CHECK(len >= 0 && len <= dims.max_blocks * dims.block_size,
                "kvstore.paged_attention: seq_lens[", s, "]: expected 0 to ",
                dims.max_blocks * dims.block_size, " (max_blocks * block_size), got ", len);
    max_len = std::max(max_len, len);
    for (int64_t b = 0; b < ceil_div(len, dims.block_size); ++b) {
      const int64_t blk = tab[s * dims.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < dims.num_blocks, "kvstore.paged_attention: block_tables[",
                  s, ", ", b, "]: expected a block id in [0, ", dims.num_blocks, "), got ", blk);
    }
  }

  at::Tensor out = at::empty({dims.num_seqs, dims.num_heads, dims.head_dim}, q.options());
  if (dims.num_seqs == 0 || dims.num_heads == 0 || dims.head_dim == 0) return out;

  // Threads: one per kMinParallelElements of K and V, so a short step runs on the
  // calling thread alone and pays no wake-up of a helper.
  const int64_t H = dims.num_kv_heads;
  const int64_t elements = 2 * dims.num_seqs * std::max<int64_t>(max_len, 1) * H * dims.head_dim;
  const int64_t threads = std::min<int64_t>(
      at::get_num_threads(), std::max<int64_t>(1, elements / min_parallel_elements()));
  // Work items (sequence, partition, group of kv heads), at least kItemsPerThread per
  // thread where the step allows, taken one by one by the threads (items): sequences
  // first, then split-K partitions of long contexts, then kv heads (a group's rows of
  // a token are adjacent, so fewer groups visit each page fewer times; the token-major
  // kernel's items keep every head, see whole_heads). On one thread a
  // step is one item per sequence: partitions would only add a merge (unless
  // $KVSTORE_SPLIT_MIN_TOKENS asks for them, as the tests of split-K do).
  const char* split_env = std::getenv("KVSTORE_SPLIT_MIN_TOKENS");
  const bool forced_split = split_env != nullptr && *split_env != '\0';
  const int64_t want = forced_split ? kItemsPerThread * at::get_num_threads()
                       : threads > 1  ? kItemsPerThread * threads
                                      : 1;
  int64_t parts = 1;
  int64_t partition_tokens = std::max<int64_t>(max_len, 1);
  const int64_t min_part = min_partition_tokens();
  if (dims.num_seqs < want && max_len > min_part) {
    parts = std::min(ceil_div(want, dims.num_seqs), ceil_div(max_len, min_part));
    partition_tokens = ceil_div(ceil_div(max_len, parts), kChunk) * kChunk;
    parts = ceil_div(max_len, partition_tokens);
  }
  const auto kind = q.scalar_type();
  const Kernel kernel = kernel_for(kind, dims.head_dim, fp8);
  // The token-major kernel reads every kv head of a token at once: an item of fewer
  // heads reads the same pages for less work (one head of 256 tokens took 2.2x the
  // time per head of all eight), so its items are whole sequences' partitions.
  const bool whole_heads = kernel.token_major;
  const int64_t heads_per_item =
      whole_heads ? H
                  : ceil_div(H, std::min(H, std::max<int64_t>(
                                                1, ceil_div(want, dims.num_seqs * parts))));
  const int64_t head_groups = ceil_div(H, heads_per_item);
  const int64_t items = dims.num_seqs * parts * head_groups;

  Params p{};
  p.query = q.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_block_stride = key_cache.stride(0);
  p.v_block_stride = value_cache.stride(0);
  if (fp8) {
    p.key_scales = key_scales.data_ptr<float>();
    p.value_scales = value_scales.data_ptr<float>();
    p.k_scale_stride = key_scales.stride(0);
    p.v_scale_stride = value_scales.stride(0);
  }
  p.block_tables = tab;
  p.table_stride = dims.max_blocks;
  p.seq_lens = len_ptr;
  p.num_heads = dims.num_heads;
  p.num_kv_heads = dims.num_kv_heads;
  p.head_dim = dims.head_dim;
  p.block_size = dims.block_size;
  p.group = dims.group;
  p.scale = static_cast<float>(scale);
  p.partition_tokens = partition_tokens;
  p.num_partitions = parts;
  p.out = out.data_ptr();
  std::unique_ptr<float[]> part_buf;
  if (parts > 1) {
    // Not zeroed: every unit writes its partials, an empty partition's too (sum 0, which
    // tells merge_partitions to skip it). The sums are zeroed all the same: a guard
    // that costs a few hundred bytes.
    const int64_t n = dims.num_seqs * dims.num_heads * parts;
    part_buf.reset(new float[n * (dims.head_dim + 2)]);
    p.part_out = part_buf.get();
    p.part_max = p.part_out + n * dims.head_dim;
    p.part_sum = p.part_max + n;
    std::fill(p.part_sum, p.part_sum + n, 0.f);
  }
  // A split step's merge runs per (sequence, group of kv heads), on the thread that
  // completes the group's last outstanding partition, while the other threads still
  // compute: after the step, on the caller alone, it took 6-10 us of a 200-260 us step
  // (1K tokens, 32 query heads, 4 partitions, two threads; partials written by the
  // other core). The count's acquire-release makes every partition's partials visible
  // to the merger.
  MergeFn merge = nullptr;
  std::unique_ptr<std::atomic<int64_t>[]> finished;
  if (parts > 1) {
    merge = kind == at::kFloat  ? &merge_pairs<Kind::F32>
            : kind == at::kHalf ? &merge_pairs<Kind::F16>
                                : &merge_pairs<Kind::BF16>;
    finished.reset(new std::atomic<int64_t>[dims.num_seqs * head_groups]());
  }

  const int64_t D = dims.head_dim, G = dims.group, NH = dims.num_heads;
  const AttendFn attend = kernel.fn;
  const auto body = [&](const std::function<bool(int64_t&)>& claim) {
    // One block, not zeroed (66 KiB at 32 heads of 128, a few percent of a 1K-token
    // step; every unit sets what it reads), starting on a 4 KiB boundary, with the
    // token-major kernel's buffers on the next one. Where malloc put them mattered: at
    // some addresses the token-major kernel ran 12-18% slower per token (one thread, 1K
    // tokens, 250 against 290-310 thousand cycles a step; likely 4 KiB aliasing
    // between its buffers and the rows, not measured here), so a split step, whose
    // partials buffer moved the scratch, paid it and a whole one mostly did not.
    constexpr int64_t kPage = 4096 / sizeof(float);
    const int64_t main_floats = 2 * NH * D + 2 * NH + 2 * kChunk * D + G * kChunk;
    const int64_t tm_at = ceil_div(main_floats, kPage) * kPage;
    std::unique_ptr<float[]> buf(new float[kPage - 1 + tm_at + tm_floats(NH)]);
    const uintptr_t page_mask = uintptr_t{4096} - 1;
    float* base = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(buf.get()) + page_mask) & ~page_mask);
    std::vector<int64_t> offsets(2 * kChunk);
    std::vector<const float*> rows(2 * kChunk);
    std::vector<float> weights(parts > 1 ? 2 * parts : 0);  // merge_pairs' scratch
    Scratch w{};
    w.tm = base + tm_at;
    w.q = base;
    w.acc = w.q + NH * D;
    w.m = w.acc + NH * D;
    w.l = w.m + NH;
    w.kf = w.l + NH;
    w.vf = w.kf + kChunk * D;
    w.scores = w.vf + kChunk * D;
    w.koff = offsets.data();
    w.voff = offsets.data() + kChunk;
    w.krows = rows.data();
    w.vrows = rows.data() + kChunk;
    for (int64_t i = 0; claim(i);) {
      // Units are numbered (sequence, partition, kv head), the head fastest.
      const int64_t sp = i / head_groups, hg = i % head_groups;
      const int64_t h0 = hg * heads_per_item, h1 = std::min(h0 + heads_per_item, H);  // kv heads
      attend(p, w, sp * H + h0, sp * H + h1);
      // Before the next claim, which counts this item done: the caller returns once
      // every item is, so every merge has written its outputs by then.
      if (merge != nullptr) {
        const int64_t s = sp / parts;
        if (finished[s * head_groups + hg].fetch_add(1, std::memory_order_acq_rel) + 1 == parts) {
          merge(p, s * NH + h0 * G, s * NH + h1 * G, weights.data());
        }
      }
    }
  };
  const int64_t ran =
      run_items(items, std::min(threads, items), elements <= max_team_elements(), body);
  last_kernel = {kernel.isa, parts, partition_tokens, ran};
  return out;
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, double scale) {
  return paged_attention_impl(query, key_cache, value_cache, at::Tensor(), at::Tensor(),
                              block_tables, seq_lens, scale);
}

at::Tensor paged_attention_fp8_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                   const at::Tensor& value_cache, const at::Tensor& key_scales,
                                   const at::Tensor& value_scales, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, double scale) {
  return paged_attention_impl(query, key_cache, value_cache, key_scales, value_scales,
                              block_tables, seq_lens, scale);
}

void check_slots(const int64_t* slot, const WriteKVDims& dims) {
  const int64_t num_slots = dims.num_blocks * dims.block_size;
  // Every slot is checked before the first write: a bad mapping changes nothing.
  for (int64_t t = 0; t < dims.num_tokens; ++t) {
    TORCH_CHECK(slot[t] < num_slots, "kvstore.write_kv: slot_mapping[", t,
                "]: expected a slot below ", num_slots, " (num_blocks * block_size) or negative "
                "(skip), got ", slot[t]);
  }
}

template <typename T>
float to_float(T x) {
  return static_cast<float>(x);
}

// Quantizes the rows of kv head `h` of `src` [num_tokens, H, D] into an fp8 cache,
// tokens in order, with the scale policy of fp8_scale_for (paged_attention_common.h):
// each (block, head) is owned by one caller, so the tokens of a block go in order.
template <typename T>
void quantize_head(const T* src, int64_t stride0, int64_t stride1, uint8_t* cache,
                   int64_t block_stride, float* scales, int64_t scale_stride, const int64_t* slot,
                   const WriteKVDims& dims, int64_t h) {
  const int64_t H = dims.num_kv_heads, D = dims.head_dim, B = dims.block_size;
  for (int64_t t = 0; t < dims.num_tokens; ++t) {
    if (slot[t] < 0) continue;
    const int64_t blk = slot[t] / B, off = slot[t] % B;
    const T* x = src + t * stride0 + h * stride1;
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(to_float(x[d])));
    float& s = scales[blk * scale_stride + h];
    const float old = s;
    const float now = fp8_scale_for(old, amax, off);
    uint8_t* base = cache + blk * block_stride + h * D;
    if (off > 0 && now != old && old > 0.f) {
      // The block's earlier tokens move to the grown scale.
      for (int64_t o = 0; o < off; ++o) {
        uint8_t* row = base + o * H * D;
        for (int64_t d = 0; d < D; ++d) {
          row[d] = fp8_quantize(fp8_e4m3_bits_to_float(row[d]) * old, now);
        }
      }
    }
    s = now;
    uint8_t* row = base + off * H * D;
    for (int64_t d = 0; d < D; ++d) row[d] = fp8_quantize(to_float(x[d]), now);
  }
}

void write_kv_fp8_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                      at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                      const at::Tensor& slot_mapping) {
  const WriteKVDims dims =
      check_write_kv(key, value, key_cache, value_cache, slot_mapping, /*fp8=*/true);
  check_scales(key_scales, key_cache, "kvstore.write_kv", "key_scales");
  check_scales(value_scales, value_cache, "kvstore.write_kv", "value_scales");
  check_written_blocks(key_scales, value_scales, dims.num_kv_heads, "kvstore.write_kv",
                       "key_scales", "value_scales");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(slot, dims);
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const int64_t H = dims.num_kv_heads;
  auto* kc = static_cast<uint8_t*>(key_cache.data_ptr());
  auto* vc = static_cast<uint8_t*>(value_cache.data_ptr());
  float* ks = key_scales.data_ptr<float>();
  float* vs = value_scales.data_ptr<float>();
  // Work items: (K or V, kv head); each owns its scales and rows.
  at::parallel_for(0, 2 * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bool is_v = i >= H;
      const int64_t h = i % H;
      const at::Tensor& src = is_v ? v : k;
      uint8_t* cache = is_v ? vc : kc;
      const int64_t bs = (is_v ? value_cache : key_cache).stride(0);
      float* sc = is_v ? vs : ks;
      const int64_t ss = (is_v ? value_scales : key_scales).stride(0);
      const auto dt = src.scalar_type();
      if (dt == at::kFloat) {
        quantize_head(src.data_ptr<float>(), src.stride(0), src.stride(1), cache, bs, sc, ss,
                      slot, dims, h);
      } else if (dt == at::kHalf) {
        quantize_head(src.data_ptr<c10::Half>(), src.stride(0), src.stride(1), cache, bs, sc,
                      ss, slot, dims, h);
      } else {
        quantize_head(src.data_ptr<c10::BFloat16>(), src.stride(0), src.stride(1), cache, bs,
                      sc, ss, slot, dims, h);
      }
    }
  });
}

void write_kv_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const WriteKVDims dims = check_write_kv(key, value, key_cache, value_cache, slot_mapping);
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(slot, dims);
  const at::Tensor k = key.stride(2) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(2) == 1 ? value : value.contiguous();
  const int64_t H = dims.num_kv_heads, D = dims.head_dim;
  const int64_t elem = key_cache.element_size();
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  auto* kcp = static_cast<char*>(key_cache.data_ptr());
  auto* vcp = static_cast<char*>(value_cache.data_ptr());
  const int64_t kbs = key_cache.stride(0), vbs = value_cache.stride(0);
  at::parallel_for(0, dims.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) continue;
      const int64_t blk = slot[t] / dims.block_size, off = slot[t] % dims.block_size;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t dst = (blk * kbs + (off * H + h) * D) * elem;
        std::memcpy(kcp + dst, kp + (t * k.stride(0) + h * k.stride(1)) * elem, D * elem);
        const int64_t vdst = (blk * vbs + (off * H + h) * D) * elem;
        std::memcpy(vcp + vdst, vp + (t * v.stride(0) + h * v.stride(1)) * elem, D * elem);
      }
    }
  });
}

}  // namespace
}  // namespace kvstore

// "isa=<avx512_bf16|avx512|avx2|avx2_generic|base> partitions=<n> partition_tokens=<n> threads=<n>"
// for the calling thread's last CPU paged_attention call ("isa=none" before any).
std::string last_cpu_kernel() {
  const auto& k = kvstore::last_kernel;
  return std::string("isa=") + k.isa + " partitions=" + std::to_string(k.partitions) +
         " partition_tokens=" + std::to_string(k.partition_tokens) +
         " threads=" + std::to_string(k.threads);
}

// No tensor argument to dispatch on: a catch-all kernel.
TORCH_LIBRARY_FRAGMENT(kvstore, m) { m.def("last_cpu_kernel() -> str", &last_cpu_kernel); }

TORCH_LIBRARY_IMPL(kvstore, CPU, m) {
  m.impl("paged_attention", &kvstore::paged_attention_cpu);
  m.impl("write_kv", &kvstore::write_kv_cpu);
  m.impl("paged_attention_fp8", &kvstore::paged_attention_fp8_cpu);
  m.impl("write_kv_fp8", &kvstore::write_kv_fp8_cpu);
}
