//! Helpers shared by the engine's integration tests: KV recomputable from
//! token ids (the model every test compares against) and token sequences.
#![allow(dead_code)] // each test binary uses a part

use kvstore::Layout;

pub const NO_PROGRESS: &(dyn Fn(u64, u64) + Sync) = &|_, _| {};

/// KV bytes of a `[L, 2, T, H, D]` buffer that depend only on (position,
/// token), like a model's: a shared prefix has the same bytes in any sequence.
pub fn kv_for(l: &Layout, tokens: &[u32]) -> Vec<u8> {
    let t = tokens.len();
    let tb = l.token_bytes();
    let mut out = vec![0u8; l.kv_bytes(t).unwrap()];
    for lk in 0..(l.num_layers as usize * 2) {
        for (pos, tok) in tokens.iter().enumerate() {
            let start = (lk * t + pos) * tb;
            for (j, b) in out[start..start + tb].iter_mut().enumerate() {
                let x = (u64::from(*tok) * 2_654_435_761)
                    ^ ((pos as u64) << 20)
                    ^ ((lk as u64) << 40)
                    ^ j as u64;
                *b = (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
            }
        }
    }
    out
}

/// Offset of record `k`'s payload in a segment whose raw records of layout
/// `l` were appended in order after its header: in a version-2 segment each
/// large payload starts on a 4 KiB boundary, after zero padding.
pub fn payload_offset(l: &Layout, k: usize) -> u64 {
    use kvstore::format;
    let meta = kvstore::record::meta_len(l);
    let mut end = format::SEGMENT_HEADER_LEN as u64;
    let mut payload = 0;
    for _ in 0..=k {
        let stored = l.block_bytes() as u64;
        payload =
            end + format::pad_before(format::SEGMENT_VERSION, end, meta, stored) + meta as u64;
        end = payload + l.block_bytes() as u64;
    }
    payload
}

/// Where record `k` of [`payload_offset`]'s segment ends.
pub fn record_end(l: &Layout, k: usize) -> u64 {
    payload_offset(l, k) + l.block_bytes() as u64
}

/// Whether the first `m` tokens of `got`, a `[L, 2, t, H, D]` buffer, are
/// exactly the reference KV of `tokens[..m]`.
pub fn prefix_matches(l: &Layout, got: &[u8], t: usize, tokens: &[u32], m: usize) -> bool {
    let expect = kv_for(l, &tokens[..m]);
    let tb = l.token_bytes();
    (0..(l.num_layers as usize * 2))
        .all(|lk| got[lk * t * tb..lk * t * tb + m * tb] == expect[lk * m * tb..(lk + 1) * m * tb])
}

/// `n` token ids from a seed (distinct seeds rarely share a prefix).
pub fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 50_000)
        .collect()
}
