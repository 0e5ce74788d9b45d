// Schemas of the kvstore torch ops. The CPU and CUDA kernels register their
// implementations in their own translation units (TORCH_LIBRARY_IMPL), and the
// Python side registers the fake (meta) implementations used by torch.compile.
#include <torch/library.h>

TORCH_LIBRARY(kvstore, m) {
  // query [num_seqs, num_heads, head_dim]; key/value_cache
  // [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32
  // [num_seqs, max_blocks]; seq_lens int32 [num_seqs]. Returns
  // [num_seqs, num_heads, head_dim] in query's dtype.
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
  // key/value [num_tokens, num_kv_heads, head_dim] go to slot_mapping int64
  // [num_tokens] (slot = block * block_size + offset; a negative slot skips the
  // token). The caches are written in place.
  m.def(
      "write_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
}
