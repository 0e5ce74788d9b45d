// Argument checks shared by the CPU and CUDA implementations of the ops.
//
// Each message names the argument, what was expected and what was given, so a
// caller can fix the call without reading this file.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <utility>

namespace kvstore {

struct PagedAttentionDims {
  int64_t num_seqs;
  int64_t num_heads;
  int64_t head_dim;
  int64_t num_blocks;
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t max_blocks;
  int64_t group;  // query heads per kv head
};

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* what) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kHalf || s == at::kBFloat16 || s == at::kFloat, op, ": ", what,
              ": expected dtype float16, bfloat16 or float32, got ", s);
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                              const char* what) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", what, ": expected device ", ref.device(),
              " (that of the first argument), got ", t.device());
}

// A cache is [num_blocks, block_size, num_kv_heads, head_dim] whose rows
// (block_size, heads, dims) are packed; only the block stride may be free, so
// a per-layer slice of a bigger pool ([L, 2, N, B, H, D][l, 0]) qualifies.
inline void check_cache_layout(const at::Tensor& c, const char* op, const char* what) {
  TORCH_CHECK(c.dim() == 4, op, ": ", what,
              ": expected 4 dims [num_blocks, block_size, num_kv_heads, head_dim], got shape ",
              c.sizes());
  const int64_t h = c.size(2), d = c.size(3);
  TORCH_CHECK(c.stride(3) == 1 && c.stride(2) == d && c.stride(1) == h * d, op, ": ", what,
              ": expected packed [block_size, num_kv_heads, head_dim] rows (strides [*, ", h * d,
              ", ", d, ", 1]), got strides ", c.strides());
}

// Per-(block, kv head) fp32 scales of an fp8 cache: [num_blocks, num_kv_heads] with
// packed heads; the block stride is free (a slice of a pool's [L, 2, N, H] scales).
inline void check_scales(const at::Tensor& scales, const at::Tensor& cache, const char* op,
                         const char* what) {
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat, op, ": ", what,
              ": expected a float32 tensor [num_blocks, num_kv_heads], got ",
              scales.scalar_type(), " of shape ", scales.sizes());
  TORCH_CHECK(scales.size(0) == cache.size(0) && scales.size(1) == cache.size(2), op, ": ", what,
              ": expected shape [", cache.size(0), ", ", cache.size(2),
              "] (num_blocks, num_kv_heads of the cache), got ", scales.sizes());
  TORCH_CHECK(scales.size(1) <= 1 || scales.stride(1) == 1, op, ": ", what,
              ": expected packed heads (stride 1 along dim 1), got strides ", scales.strides());
  check_same_device(scales, cache, op, what);
}

// Whether rows of `row` elements at i * stride and at delta + j * stride (i, j < n) share
// an element: |delta + k * stride| < row for some k = j - i in (-n, n). With stride >= row
// (check_written_blocks) only the two k nearest -delta / stride can.
inline bool strided_rows_meet(int64_t delta, int64_t stride, int64_t row, int64_t n) {
  if (n <= 0 || row <= 0) return false;
  if (delta < 0) delta = -delta;  // the same question with the two tensors swapped
  if (n == 1 || stride <= 0) return delta < row;
  const int64_t k = delta / stride;
  return (k <= n - 1 && delta - k * stride < row) ||
         (k + 1 <= n - 1 && (k + 1) * stride - delta < row);
}

// The written-to tensors of an in-place op, K's and V's (caches, or fp8 scales), each
// [num_blocks, ...] with blocks of `block_elems` packed elements. A block stride shorter
// than a block (0 for an expand()ed tensor) would put several blocks in one place, and K
// and V that share elements (the same tensor, views of one) would take each other's
// writes: a write to one block would silently change others, so both are refused, as
// torch's own in-place ops refuse outputs that overlap. K and V may still interleave in
// one pool ([N, 2, B, H, D][:, 0] and [:, 1]).
inline void check_written_blocks(const at::Tensor& k, const at::Tensor& v, int64_t block_elems,
                                 const char* op, const char* k_what, const char* v_what) {
  for (const auto& [t, what] : {std::pair{&k, k_what}, std::pair{&v, v_what}}) {
    TORCH_CHECK(t->size(0) <= 1 || t->stride(0) >= block_elems, op, ": ", what,
                ": expected blocks that do not overlap (a block stride of at least ",
                block_elems, " elements), got block stride ", t->stride(0),
                ": an expand()ed or as_strided tensor would take every block's writes in one "
                "place (clone() it)");
  }
  bool meet = false;
  if (k.numel() > 0 && v.numel() > 0 && k.storage().is_alias_of(v.storage())) {
    if (k.stride(0) == v.stride(0)) {
      meet = strided_rows_meet(v.storage_offset() - k.storage_offset(), k.stride(0), block_elems,
                               k.size(0));
    } else {
      const at::MemOverlapStatus status = at::get_overlap_status(k, v);
      meet = status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
    }
  }
  TORCH_CHECK(!meet, op, ": ", v_what, ": expected memory apart from ", k_what,
              "'s, got tensors that share elements (the same tensor, or overlapping views of "
              "one): each would take the other's writes");
}

inline void check_fp8_cache(const at::Tensor& c, const char* op, const char* what) {
  TORCH_CHECK(c.scalar_type() == at::kFloat8_e4m3fn, op, ": ", what,
              ": expected dtype float8_e4m3fn, got ", c.scalar_type());
}

// fp8: the caches are float8_e4m3fn whatever query's dtype (checked by the caller
// with check_scales); else they have query's dtype.
inline PagedAttentionDims check_paged_attention(const at::Tensor& query,
                                                const at::Tensor& key_cache,
                                                const at::Tensor& value_cache,
                                                const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens, bool fp8 = false) {
  constexpr const char* op = "kvstore.paged_attention";
  TORCH_CHECK(query.dim() == 3, op,
              ": query: expected 3 dims [num_seqs, num_heads, head_dim], got shape ",
              query.sizes());
  check_float_dtype(query, op, "query");
  check_cache_layout(key_cache, op, "key_cache");
  check_cache_layout(value_cache, op, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op,
              ": value_cache: expected the shape of key_cache ", key_cache.sizes(), ", got ",
              value_cache.sizes());
  if (fp8) {
    check_fp8_cache(key_cache, op, "key_cache");
    check_fp8_cache(value_cache, op, "value_cache");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == query.scalar_type(), op,
                ": key_cache: expected dtype ", query.scalar_type(), " (that of query), got ",
                key_cache.scalar_type());
    TORCH_CHECK(value_cache.scalar_type() == query.scalar_type(), op,
                ": value_cache: expected dtype ", query.scalar_type(), " (that of query), got ",
                value_cache.scalar_type());
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt, op,
              ": block_tables: expected an int32 tensor [num_seqs, max_blocks], got ",
              block_tables.scalar_type(), " of shape ", block_tables.sizes());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt, op,
              ": seq_lens: expected an int32 tensor [num_seqs], got ", seq_lens.scalar_type(),
              " of shape ", seq_lens.sizes());
  check_same_device(key_cache, query, op, "key_cache");
  check_same_device(value_cache, query, op, "value_cache");
  check_same_device(block_tables, query, op, "block_tables");
  check_same_device(seq_lens, query, op, "seq_lens");

  PagedAttentionDims d{};
  d.num_seqs = query.size(0);
  d.num_heads = query.size(1);
  d.head_dim = query.size(2);
  d.num_blocks = key_cache.size(0);
  d.block_size = key_cache.size(1);
  d.num_kv_heads = key_cache.size(2);
  d.max_blocks = block_tables.size(1);
  TORCH_CHECK(key_cache.size(3) == d.head_dim, op, ": key_cache: expected head_dim ", d.head_dim,
              " (that of query), got ", key_cache.size(3));
  TORCH_CHECK(d.block_size > 0, op, ": key_cache: expected block_size > 0, got ", d.block_size);
  TORCH_CHECK(d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads == 0, op,
              ": expected num_heads (", d.num_heads, ") to be a multiple of num_kv_heads (",
              d.num_kv_heads, ")");
  TORCH_CHECK(block_tables.size(0) == d.num_seqs, op, ": block_tables: expected ", d.num_seqs,
              " rows (num_seqs), got ", block_tables.size(0));
  TORCH_CHECK(seq_lens.size(0) == d.num_seqs, op, ": seq_lens: expected ", d.num_seqs,
              " entries (num_seqs), got ", seq_lens.size(0));
  d.group = d.num_heads / d.num_kv_heads;
  return d;
}

struct WriteKVDims {
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t num_blocks;
  int64_t block_size;
};

// fp8: the caches are float8_e4m3fn and key/value any float dtype (quantized on the
// way in; the scales are checked by the caller); else all four share one dtype.
inline WriteKVDims check_write_kv(const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& slot_mapping, bool fp8 = false) {
  constexpr const char* op = "kvstore.write_kv";
  TORCH_CHECK(key.dim() == 3, op,
              ": key: expected 3 dims [num_tokens, num_kv_heads, head_dim], got shape ",
              key.sizes());
  TORCH_CHECK(value.sizes() == key.sizes(), op, ": value: expected the shape of key ",
              key.sizes(), ", got ", value.sizes());
  if (fp8) {
    check_fp8_cache(key_cache, op, "key_cache");
    check_float_dtype(key, op, "key");
  } else {
    check_float_dtype(key_cache, op, "key_cache");
  }
  check_cache_layout(key_cache, op, "key_cache");
  check_cache_layout(value_cache, op, "value_cache");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes(), op,
              ": value_cache: expected the shape of key_cache ", key_cache.sizes(), ", got ",
              value_cache.sizes());
  check_written_blocks(key_cache, value_cache,
                       key_cache.size(1) * key_cache.size(2) * key_cache.size(3), op,
                       "key_cache", "value_cache");
  const auto dtype = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == dtype, op, ": value_cache: expected dtype ", dtype,
              " (that of key_cache), got ", value_cache.scalar_type());
  const auto in_dtype = fp8 ? key.scalar_type() : dtype;
  TORCH_CHECK(key.scalar_type() == in_dtype, op, ": key: expected dtype ", in_dtype,
              " (that of key_cache), got ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == in_dtype, op, ": value: expected dtype ", in_dtype,
              fp8 ? " (that of key)" : " (that of key_cache)", ", got ", value.scalar_type());
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), op,
              ": key: expected [num_tokens, ", key_cache.size(2), ", ", key_cache.size(3),
              "] (heads and head_dim of key_cache), got shape ", key.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong, op,
              ": slot_mapping: expected an int64 tensor [num_tokens], got ",
              slot_mapping.scalar_type(), " of shape ", slot_mapping.sizes());
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), op, ": slot_mapping: expected ", key.size(0),
              " entries (num_tokens), got ", slot_mapping.size(0));
  check_same_device(value, key, op, "value");
  check_same_device(key_cache, key, op, "key_cache");
  check_same_device(value_cache, key, op, "value_cache");
  check_same_device(slot_mapping, key, op, "slot_mapping");
  return {key.size(0), key_cache.size(2), key_cache.size(3), key_cache.size(0),
          key_cache.size(1)};
}

}  // namespace kvstore
