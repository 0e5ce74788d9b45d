// The walk of the head-major decode kernels over their work units: per unit group (one
// sequence and partition, kv heads h0 .. h1 - 1), tile by tile, head by head within a
// tile, the next tile's rows prefetched (LineStream) while the current one computes.
// Included at the end of paged_attention_cpu_avx512.h and paged_attention_cpu_avx2.h
// (no include guard, no #include), which define what it calls for their vector width:
// DotVec (a tile's dot accumulators), kDot, load_q, attend_tile, fp8_tile_has_nan,
// write_unit_outputs and min64.

// The same work units and outputs as attend_units in paged_attention_cpu_kernel.h;
// K: query and output dtype, C: cache dtype (K, or FP8 with per-(block, head) scales).
// Head by head within a tile because the heads' rows of a token are adjacent: each page
// is touched while hot. DC: head_dim known at compile time (0: at run time).
template <Kind K, Kind C, int DC>
KVSTORE_INLINE void attend_rows_d(const Params& p, const Scratch& w, int64_t begin, int64_t end) {
  // The AVX512-BF16 build decodes bfloat16 queries token-major (attend_units_token_major).
  static_assert(!kDot<K, C>, "vdpbf16ps decoding is paged_attention_cpu_token_major.h's");
  using T = typename Storage<C>::type;
  using TQ = typename Storage<K>::type;
  const int64_t D = DC > 0 ? DC : p.head_dim, G = p.group, H = p.num_kv_heads, P = p.num_partitions;
  const int64_t row_stride = H * D;
  const T* kc = static_cast<const T*>(p.key_cache);
  const T* vc = static_cast<const T*>(p.value_cache);
  // The dot accumulators of a tile: [kGroupTile, kTile] vectors (4 or 2 KiB), aligned.
  alignas(64) DotVec dots[kGroupTile * kTile];
  for (auto& d : dots) d = DotVec{};  // lanes past a short tile: read, never used
  TileRows<C> t{};
  LineStream next{};
  next.row_bytes = D * static_cast<int64_t>(sizeof(T));
  const int64_t tiles = ceil_div(G, kGroupTile);  // group tiles per kv head
  LineShare share{ceil_div(next.row_lines(), tiles), 0};
  int64_t blk[kTile], off[kTile], next_blk[kTile], next_off[kTile];
  for (int64_t unit = begin; unit < end;) {
    const UnitRun u = unit_run(p, unit, end);
    const int64_t s = u.s, part = u.part, h0 = u.h0, h1 = u.h1, start = u.start, stop = u.stop;
    const int32_t* table = u.table;
    unit += h1 - h0;

    const int64_t heads = (h1 - h0) * G;
    const TQ* q = static_cast<const TQ*>(p.query) + (s * p.num_heads + h0 * G) * D;
    load_q<K, C>(q, w.q, heads * D, p.scale);
    for (int64_t i = 0; i < heads * D; ++i) w.acc[i] = 0.f;
    for (int64_t i = 0; i < heads; ++i) {
      w.m[i] = -__builtin_inff();
      w.l[i] = 0.f;
    }

    TokenCursor cur{table, p.block_size, start / p.block_size, start % p.block_size};
    const int64_t first_n = min64(kTile, stop - start);
    for (int64_t j = 0; j < first_n; ++j) cur.next(next_blk[j], next_off[j]);
    for (int64_t c0 = start; c0 < stop; c0 += kTile) {
      t.n = min64(kTile, stop - c0);
      const int64_t next_n = c0 + kTile < stop ? min64(kTile, stop - (c0 + kTile)) : 0;
      for (int64_t j = 0; j < t.n; ++j) {
        blk[j] = next_blk[j];
        off[j] = next_off[j];
      }
      for (int64_t j = 0; j < next_n; ++j) cur.next(next_blk[j], next_off[j]);
      next.n_rows = 2 * next_n;
      share.per_head = ceil_div(next.lines(), 4 * min64(G, kGroupTile) * tiles);
      for (int64_t h = h0; h < h1; ++h) {
        for (int64_t j = 0; j < t.n; ++j) {
          t.k[j] = kc + blk[j] * p.k_block_stride + off[j] * row_stride + h * D;
          t.v[j] = vc + blk[j] * p.v_block_stride + off[j] * row_stride + h * D;
          if constexpr (C == Kind::FP8) {
            t.kmul[j] = p.key_scales[blk[j] * p.k_scale_stride + h];
            t.vmul[j] = p.value_scales[blk[j] * p.v_scale_stride + h];
          }
        }
        for (int64_t j = 0; j < next_n; ++j) {
          next.rows[j] = reinterpret_cast<const char*>(kc + next_blk[j] * p.k_block_stride +
                                                       next_off[j] * row_stride + h * D);
          next.rows[next_n + j] = reinterpret_cast<const char*>(
              vc + next_blk[j] * p.v_block_stride + next_off[j] * row_stride + h * D);
        }
        next.restart();
        const int64_t i_h = (h - h0) * G;
        int64_t g = 0;
        for (; g + kGroupTile <= G; g += kGroupTile) {
          attend_tile<K, C, kGroupTile>(w, i_h + g, D, t, next, share, dots);
        }
        switch (G - g) {
          case 3: attend_tile<K, C, 3>(w, i_h + g, D, t, next, share, dots); break;
          case 2: attend_tile<K, C, 2>(w, i_h + g, D, t, next, share, dots); break;
          case 1: attend_tile<K, C, 1>(w, i_h + g, D, t, next, share, dots); break;
          default: break;
        }
        next.issue_rest();
        if constexpr (C == Kind::FP8) {
          // A NaN byte is a NaN value (fp8x16 makes it 480): in K the reference's
          // softmax makes every output of the group NaN, in V its column; here both
          // make the group's accumulators NaN, never a finite value (merges keep it;
          // test_fp8_nan_byte_in_an_attended_token_is_nan).
          if (fp8_tile_has_nan(t, D)) {
            for (int64_t d = 0; d < G * D; ++d) w.acc[i_h * D + d] = __builtin_nanf("");
          }
        }
      }
    }

    write_unit_outputs<K, C>(p, w, s, part, h0, heads);
  }
}

// Head size 128 known at compile time: the loops over a row unroll and their pointers
// fold into addressing, as in the token-major kernel. On the Xeon (AVX-512 without BF16),
// one thread, 8K bfloat16 tokens in L2: 320-325 -> 290-292 ns per token; outputs
// bit-identical.
template <Kind K, Kind C>
KVSTORE_INLINE void attend_rows(const Params& p, const Scratch& w, int64_t begin, int64_t end) {
  if (p.head_dim == 128) {
    attend_rows_d<K, C, 128>(p, w, begin, end);
  } else {
    attend_rows_d<K, C, 0>(p, w, begin, end);
  }
}
