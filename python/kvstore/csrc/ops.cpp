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
  // fp8 KV: key/value_cache float8_e4m3fn [num_blocks, block_size, num_kv_heads,
  // head_dim], key/value_scales float32 [num_blocks, num_kv_heads] (the value of a
  // byte is its e4m3 value times the scale of its block and kv head). Dequantized in
  // registers; query and the result are float16, bfloat16 or float32.
  m.def(
      "paged_attention_fp8(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor key_scales, Tensor value_scales, Tensor block_tables, Tensor seq_lens, "
      "float scale) -> Tensor");
  // Quantizes key/value (any float dtype) into fp8 caches, tokens in order. A token at
  // offset 0 of a block sets the (block, head) scale to the smallest power of two
  // that holds it (amax <= 448 * scale); a later token that does not fit grows the
  // scale and requantizes the block's earlier tokens (exact above e4m3's smallest
  // normal, power-of-two ratio). Nothing saturates unless a value is inf.
  m.def(
      "write_kv_fp8(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slot_mapping) -> ()");
}
