// The parts of the head-major decode kernels that do not depend on the vector width:
// the tile, the rows of a tile, the prefetches of the next tile's rows, the walk over a
// sequence's tokens. Included by paged_attention_cpu_avx512.h (16 lanes) and
// paged_attention_cpu_avx2.h (8 lanes), each in its own namespace under its own target
// pragma (no include guard, no #include: the includer provides Kind, Storage,
// ceil_div and the intrinsics), before their vector code; paged_attention_cpu_head_major.h
// walks the units with both.

constexpr int64_t kTile = 16;      // tokens per tile: one score vector of 16, two of 8
constexpr int64_t kGroupTile = 4;  // query heads sharing a loaded K or V vector

// The next tile's rows of one kv head, prefetched into L2 (_MM_HINT_T1) a row at a time
// all through this tile's work on that head: q·k, the softmax and P·V. A core keeps
// only so many misses in flight, so prefetches issued in a burst (all of them during q·k,
// as it was) stall q·k until the memory delivers, and the softmax and P·V then run with
// nothing in flight (at 32K tokens on two threads of a Xeon, KV at 0.67 of the read
// stream then, 0.73-0.81 spread: benches/README.md).
struct LineStream {
  const char* rows[2 * kTile];  // K rows, then V rows
  int64_t n_rows;
  int64_t row_bytes;
  int64_t r;       // the next row
  int64_t credit;  // lines asked for and not issued yet; negative: issued ahead
  KVSTORE_INLINE int64_t row_lines() const { return ceil_div(row_bytes, 64); }
  KVSTORE_INLINE int64_t lines() const { return n_rows * row_lines(); }
  // From the first row of a new tile (rows set by the caller).
  KVSTORE_INLINE void restart() { r = credit = 0; }
  // Asks for `count` more lines, issued a whole row at a time (none past the last row):
  // a call is an add and a compare or two unless a row is owed. Issued line by line
  // (the next row and byte kept from call to call) they took about nine instructions a
  // line, 8 lines a token and kv head for 2-byte rows of head size 128: with the KV in
  // L2 (two threads) the kernel ran 4-8% slower. A row that starts inside a line (fp8
  // rows of head sizes 48 mod 64; on AVX2 also 2-byte rows of head sizes 16 mod 32)
  // spans one line more than this issues; its last line
  // is left to the hardware's adjacent-line prefetcher: fetching it too (the row's last
  // byte as a last address) made head size 128 3-4% slower.
  KVSTORE_INLINE void issue(int64_t count) {
    credit += count;
    while (credit > 0 && r < n_rows) {
      const char* row = rows[r++];
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
      credit -= row_lines();
    }
  }
  // Every row not issued yet: credit never falls below -row_lines(), so lines() is
  // enough (and cannot overflow it, as INT64_MAX would).
  KVSTORE_INLINE void issue_rest() { issue(lines()); }
};

// The rows of one tile of one kv head.
template <Kind C>
struct TileRows {
  const typename Storage<C>::type* k[kTile];
  const typename Storage<C>::type* v[kTile];
  int64_t n;
  alignas(64) float kmul[kTile];  // per token: what multiplies its score
  alignas(64) float vmul[kTile];  // fp8: the token's V scale
};

// How many of the next tile's lines a group tile asks for where (LineStream), in
// proportion to the work (measured on the Xeon, 8K tokens in L2: q·k 45%, the softmax
// 20%, P·V 35%): K's during q·k, a quarter during the softmax, one per row and column
// block during P·V (16 * CB columns on AVX-512, 8 * CB on AVX2), each shared among a
// head's group tiles; the caller issues what is left once a head's tiles are done. Set
// once per step (per_token) and per tile (per_head, which follows the next tile's
// length), not per call: a division costs Intel cores 40-90 cycles.
struct LineShare {
  int64_t per_token;  // during q·k
  int64_t per_head;   // during the softmax, per query head
};

// Walks a sequence's tokens in order: the pool block and offset of each, without a
// division per token.
struct TokenCursor {
  const int32_t* table;
  int64_t block_size;
  int64_t index;   // block index in the table
  int64_t offset;  // token offset in that block
  KVSTORE_INLINE void next(int64_t& blk, int64_t& off) {
    blk = table[index];
    off = offset;
    if (++offset == block_size) {
      offset = 0;
      ++index;
    }
  }
};
