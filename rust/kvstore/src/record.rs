//! One block's record: encoding (checksums, a payload coded by [`crate::codec`]),
//! decoding and every check a record must pass before its bytes are served.
//! The write path, reads, `verify`, compaction and the segment scanner all go
//! through here, so a record means the same thing to each of them. The byte
//! layout is drawn in [`crate::format`]; `tests/golden.rs` pins it.

use crate::codec::{self, Codec};
use crate::error::Result;
use crate::format::{u16_at, u32_at, u64_at};
use crate::id::BlockId;
use crate::layout::Layout;
use std::io::IoSlice;

pub const RECORD_MAGIC: [u8; 4] = *b"KVRC";
pub const RECORD_VERSION: u16 = 1;
pub const RECORD_HEADER_LEN: usize = 80;

pub const FLAG_ZSTD: u16 = 1;
pub const FLAG_SHUFFLE: u16 = 2;
/// 16-bit elements as two planes: the high bytes (sign and exponent) as one
/// zstd frame, then the low bytes (mostly mantissa) raw. Alone: never with
/// the other two flags.
pub const FLAG_EXPONENT: u16 = 4;
const KNOWN_FLAGS: u16 = FLAG_ZSTD | FLAG_SHUFFLE | FLAG_EXPONENT;


/// The fixed-size part of a record, decoded and checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub flags: u16,
    pub n_tokens: u32,
    pub stored_len: u64,
    pub raw_len: u64,
    pub block_id: BlockId,
    pub stored_crc: u32,
    pub raw_crc: u32,
    pub header_crc: u32,
}

impl RecordHeader {
    /// Bytes of header + tokens, i.e. the offset of the payload in the record.
    pub fn meta_len(&self) -> usize {
        RECORD_HEADER_LEN + 4 * self.n_tokens as usize
    }
    /// Bytes of the whole record.
    pub fn record_len(&self) -> u64 {
        self.meta_len() as u64 + self.stored_len
    }
}

/// Encodes header + token ids (everything before the payload).
pub fn encode_meta(
    flags: u16,
    block_id: &BlockId,
    tokens: &[u32],
    stored_len: u64,
    raw_len: u64,
    stored_crc: u32,
    raw_crc: u32,
) -> Vec<u8> {
    let mut m = vec![0u8; RECORD_HEADER_LEN + 4 * tokens.len()];
    m[0..4].copy_from_slice(&RECORD_MAGIC);
    m[4..6].copy_from_slice(&RECORD_VERSION.to_le_bytes());
    m[6..8].copy_from_slice(&flags.to_le_bytes());
    m[8..12].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
    m[16..24].copy_from_slice(&stored_len.to_le_bytes());
    m[24..32].copy_from_slice(&raw_len.to_le_bytes());
    m[32..64].copy_from_slice(block_id);
    m[64..68].copy_from_slice(&stored_crc.to_le_bytes());
    m[68..72].copy_from_slice(&raw_crc.to_le_bytes());
    for (i, t) in tokens.iter().enumerate() {
        let at = RECORD_HEADER_LEN + 4 * i;
        m[at..at + 4].copy_from_slice(&t.to_le_bytes());
    }
    let crc = header_crc(&m);
    m[72..76].copy_from_slice(&crc.to_le_bytes());
    m
}

fn header_crc(meta: &[u8]) -> u32 {
    let c = crate::crc::crc32c(&meta[0..72]);
    crate::crc::append(c, &meta[RECORD_HEADER_LEN..])
}

/// Decodes the fixed 80-byte header. Only lengths are checked here (against
/// `max_stored`, so no allocation or read is sized by an unchecked field);
/// [`check_meta`] checks the header checksum once the tokens are read too.
pub fn decode_header(
    h: &[u8],
    max_tokens: u32,
    max_stored: u64,
) -> Result<RecordHeader, String> {
    if h.len() < RECORD_HEADER_LEN {
        return Err(format!(
            "record header: {} bytes, expected {RECORD_HEADER_LEN}",
            h.len()
        ));
    }
    if h[0..4] != RECORD_MAGIC {
        return Err("record header: bad magic".into());
    }
    let version = u16_at(h, 4);
    if version != RECORD_VERSION {
        return Err(format!(
            "record header: version {version}, this build reads {RECORD_VERSION}"
        ));
    }
    let flags = u16_at(h, 6);
    if flags & !KNOWN_FLAGS != 0 {
        return Err(format!("record header: unknown flags {flags:#x}"));
    }
    if u32_at(h, 76) != 0 || u32_at(h, 12) != 0 {
        // Reserved: a header that decodes has one encoding.
        return Err("record header: reserved bytes are not zero".into());
    }
    let n_tokens = u32_at(h, 8);
    if n_tokens > max_tokens {
        return Err(format!(
            "record header: {n_tokens} tokens, at most {max_tokens} expected"
        ));
    }
    let stored_len = u64_at(h, 16);
    if stored_len > max_stored {
        return Err(format!(
            "record header: stored length {stored_len} exceeds {max_stored}"
        ));
    }
    let mut block_id = [0u8; 32];
    block_id.copy_from_slice(&h[32..64]);
    Ok(RecordHeader {
        flags,
        n_tokens,
        stored_len,
        raw_len: u64_at(h, 24),
        block_id,
        stored_crc: u32_at(h, 64),
        raw_crc: u32_at(h, 68),
        header_crc: u32_at(h, 72),
    })
}

/// Checks the header checksum over header + tokens (`meta` = both).
pub fn check_meta(header: &RecordHeader, meta: &[u8]) -> Result<(), String> {
    if meta.len() != header.meta_len() {
        return Err("record: truncated token ids".into());
    }
    if header_crc(meta) != header.header_crc {
        return Err("record header: checksum mismatch".into());
    }
    Ok(())
}

/// Checks the padding before a record's meta (version 2: zeros that align
/// its payload). The one rule for reads, `verify` and the scanner alike: a
/// record whose padding is not zeros is damaged as a whole, even when its
/// meta and payload check out, so that no path serves (or re-indexes) what
/// another calls damage.
pub fn check_padding(pad: &[u8]) -> Result<(), String> {
    // An OR over all of it (vectorized), not a search that stops early:
    // padding is up to 4 KiB per record, read with every payload.
    if pad.iter().fold(0, |acc, &b| acc | b) != 0 {
        return Err("record padding is not zeros".into());
    }
    Ok(())
}

/// Token ids stored in a record's meta bytes.
pub fn tokens(meta: &[u8]) -> impl Iterator<Item = u32> + '_ {
    meta[RECORD_HEADER_LEN..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// Checks what a read of a store with this layout insists on beyond what
/// [`decode_header`] checks: the layout's token count and raw length, and a
/// compression flag that agrees with the lengths (a stored length equal to
/// the raw length always means "raw", whose two checksums are one).
pub fn check_shape(h: &RecordHeader, layout: &Layout) -> Result<(), String> {
    if h.n_tokens != layout.block_size {
        return Err(format!(
            "record has {} tokens, the layout {}",
            h.n_tokens, layout.block_size
        ));
    }
    if h.raw_len != layout.block_bytes() as u64 {
        return Err(format!(
            "record raw length {} differs from the layout's {}",
            h.raw_len,
            layout.block_bytes()
        ));
    }
    let compressed = h.flags & (FLAG_ZSTD | FLAG_EXPONENT) != 0;
    if h.flags & FLAG_EXPONENT != 0
        && (h.flags != FLAG_EXPONENT
            || layout.elem_size() != 2
            || h.stored_len <= h.raw_len / 2)
    {
        // The low plane is raw_len / 2 bytes and the high plane's frame is
        // never empty.
        return Err("record exponent flag disagrees with its layout or lengths".into());
    }
    if compressed == (h.stored_len == h.raw_len) {
        return Err("record compression flag disagrees with its lengths".into());
    }
    if !compressed && h.stored_crc != h.raw_crc {
        return Err("raw record has two different payload checksums".into());
    }
    Ok(())
}

/// Decodes a fixed record header with the layout's bounds and shape.
pub fn decode_checked(h: &[u8], layout: &Layout) -> Result<RecordHeader, String> {
    let header = decode_header(h, layout.block_size, layout.block_bytes() as u64)?;
    check_shape(&header, layout)?;
    Ok(header)
}

/// Bytes of header + token ids of a block record in this layout.
pub fn meta_len(layout: &Layout) -> usize {
    RECORD_HEADER_LEN + 4 * layout.block_size as usize
}

/// A block's record, encoded and ready to append: its meta (header + token
/// ids) and payload, either the caller's raw runs or one zstd frame.
pub struct Encoded<'a> {
    meta: Vec<u8>,
    raw: &'a [&'a [u8]],
    compressed: Option<Vec<u8>>,
}

impl Encoded<'_> {
    /// Bytes of header and token ids, before the payload.
    pub fn meta_len(&self) -> usize {
        self.meta.len()
    }

    /// Bytes of the whole record (without the padding a segment puts
    /// before it: see [`crate::format::pad_before`]).
    pub fn record_len(&self) -> u64 {
        self.meta.len() as u64 + self.stored_len()
    }

    /// Bytes of the payload as stored.
    pub fn stored_len(&self) -> u64 {
        match &self.compressed {
            Some(z) => z.len() as u64,
            None => self.raw.iter().map(|c| c.len() as u64).sum(),
        }
    }

    /// Hands the payload's buffer back to the encoder once the record is
    /// written (see `codec::recycle`).
    pub fn recycle(self) {
        if let Some(z) = self.compressed {
            codec::recycle(z);
        }
    }

    /// The record as buffers to write in order.
    pub fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut bufs = Vec::with_capacity(self.raw.len() + 1);
        bufs.push(IoSlice::new(&self.meta));
        match &self.compressed {
            Some(z) => bufs.push(IoSlice::new(z)),
            None => bufs.extend(self.raw.iter().map(|c| IoSlice::new(c))),
        }
        bufs
    }
}

/// Encodes the record of block `id`: `chunks` are its `2L` runs of raw KV.
/// The payload is stored per `codec`, unless that does not make it smaller
/// (then it stays raw, so that a stored length equal to the raw length always
/// means "raw").
pub fn encode<'a>(
    layout: &Layout,
    codec: Codec,
    id: &BlockId,
    tokens: &[u32],
    chunks: &'a [&'a [u8]],
) -> Result<Encoded<'a>> {
    let raw_len = layout.block_bytes() as u64;
    let raw_crc = crate::crc::of(chunks);
    let elem = layout.elem_size();
    let (flags, compressed) = match codec {
        Codec::Zstd(level) => {
            let plain = chunks.concat();
            let mut shuffled = Vec::new();
            let (flags, src): (u16, &[u8]) = if elem > 1 {
                codec::shuffle(&plain, elem, &mut shuffled);
                (FLAG_ZSTD | FLAG_SHUFFLE, &shuffled)
            } else {
                (FLAG_ZSTD, &plain)
            };
            let z = zstd::bulk::compress(src, level).map_err(codec::zstd_error)?;
            (flags, Some(z))
        }
        Codec::Exponent if elem == 2 => (FLAG_EXPONENT, Some(codec::encode_exponent(chunks)?)),
        // No exponent plane to code (fp8, float32): stored raw.
        Codec::Raw | Codec::Exponent => (0, None),
    };
    let (flags, compressed) = match compressed {
        Some(z) if (z.len() as u64) < raw_len => (flags, Some(z)),
        other => {
            if let Some(z) = other {
                codec::recycle(z);
            }
            (0, None)
        }
    };
    let (stored_len, stored_crc) = match &compressed {
        Some(z) => (z.len() as u64, crate::crc::crc32c(z)),
        None => (raw_len, raw_crc),
    };
    let meta = encode_meta(flags, id, tokens, stored_len, raw_len, stored_crc, raw_crc);
    Ok(Encoded {
        meta,
        raw: chunks,
        compressed,
    })
}

/// One block to encode: its id, token ids and `2L` runs.
pub type Job<'a> = (&'a BlockId, &'a [u32], &'a [&'a [u8]]);

/// [`encode`] of several blocks (`(id, tokens, runs)` each), in order; spread
/// over the machine's cores when there is compression work to share.
pub fn encode_many<'a>(
    layout: &Layout,
    codec: Codec,
    blocks: &[Job<'a>],
) -> Vec<Result<Encoded<'a>>> {
    let one = |&(id, tokens, chunks): &Job<'a>| encode(layout, codec, id, tokens, chunks);
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if codec == Codec::Raw || blocks.len() < 2 || threads < 2 {
        return blocks.iter().map(one).collect();
    }
    // Contiguous shares, so the results come back in order by concatenation.
    let share = blocks.len().div_ceil(threads.min(blocks.len()));
    std::thread::scope(|scope| {
        let rest: Vec<_> = blocks[share..]
            .chunks(share)
            .map(|part| scope.spawn(move || part.iter().map(one).collect::<Vec<_>>()))
            .collect();
        let mut out: Vec<_> = blocks[..share].iter().map(one).collect();
        for h in rest {
            out.extend(h.join().expect("encoder thread panicked"));
        }
        out
    })
}

/// Why a record read back cannot be served for the block asked for.
#[derive(Debug)]
pub enum Mismatch {
    /// Damaged, misplaced or not this block's record.
    Damaged(String),
    /// A sound record of another token sequence under the same id (a hash
    /// collision): a miss, and not damage.
    OtherTokens,
}

/// Checks a record's meta bytes, read from where the index says block `id`
/// lies with a payload of `stored_len` bytes: the header and its checksum,
/// the layout's shape, the block id and, when given, the token ids asked for.
pub fn check_read(
    layout: &Layout,
    meta: &[u8],
    id: &BlockId,
    stored_len: u64,
    tokens: Option<&[u32]>,
) -> Result<RecordHeader, Mismatch> {
    let h = decode_header(meta, layout.block_size, layout.block_bytes() as u64)
        .and_then(|h| check_meta(&h, meta).map(|()| h))
        .map_err(Mismatch::Damaged)?;
    if &h.block_id != id {
        return Err(Mismatch::Damaged(
            "record holds another block (misplaced or colliding record)".into(),
        ));
    }
    check_shape(&h, layout).map_err(Mismatch::Damaged)?;
    if h.stored_len != stored_len {
        return Err(Mismatch::Damaged(
            "record lengths disagree with the layout or the index".into(),
        ));
    }
    if tokens.is_some_and(|t| !self::tokens(meta).eq(t.iter().copied())) {
        return Err(Mismatch::OtherTokens);
    }
    Ok(h)
}

/// Checks a raw payload read straight into its destination runs.
pub fn check_raw(h: &RecordHeader, out: &[&mut [u8]]) -> Result<(), String> {
    if crate::crc::of(out) != h.raw_crc {
        return Err("payload checksum mismatch".into());
    }
    Ok(())
}

/// Checks a compressed payload, decodes it and lands it in `out` (the
/// block's `2L` runs). `scratch` is reused across calls.
pub fn decode_compressed(
    layout: &Layout,
    h: &RecordHeader,
    stored: &[u8],
    out: &mut [&mut [u8]],
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    if crate::crc::crc32c(stored) != h.stored_crc {
        return Err("stored payload checksum mismatch".into());
    }
    let raw_len = layout.block_bytes();
    if h.flags & FLAG_EXPONENT != 0 {
        return codec::decode_exponent(raw_len, h.raw_crc, stored, out, scratch);
    }
    let mut decoded = vec![0u8; raw_len];
    match zstd::bulk::decompress_to_buffer(stored, &mut decoded[..]) {
        Ok(n) if n == raw_len => {}
        Ok(n) => return Err(format!("zstd frame decodes to {n} bytes, expected {raw_len}")),
        Err(e) => return Err(format!("zstd: {e}")),
    }
    let plain: &[u8] = if h.flags & FLAG_SHUFFLE != 0 {
        scratch.resize(decoded.len(), 0);
        codec::unshuffle(&decoded, layout.elem_size(), scratch);
        scratch
    } else {
        &decoded
    };
    if crate::crc::crc32c(plain) != h.raw_crc {
        return Err("decoded payload checksum mismatch".into());
    }
    for (dst, src) in out.iter_mut().zip(plain.chunks(layout.chunk_bytes())) {
        dst.copy_from_slice(src);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Padding is damage wherever a single bit of it is set, at every
    /// length up to a page (the OR must not stop short of the end).
    #[test]
    fn any_set_bit_in_padding_is_damage() {
        for len in [0, 1, 7, 31, 32, 33, 63, 64, 65, 4095, 4096] {
            let mut pad = vec![0u8; len];
            assert!(check_padding(&pad).is_ok(), "zeros of {len}");
            for at in 0..len {
                for bit in [0, 7] {
                    pad[at] = 1 << bit;
                    assert!(check_padding(&pad).is_err(), "len {len}, byte {at}");
                    pad[at] = 0;
                }
            }
        }
    }

    /// The format promises "one zstd frame of the high bytes", not how it was
    /// made: a frame full of matches (level 19, as a future encoder or the
    /// previous settings might write) decodes too, and this encoder's frame
    /// is literals only (no match found in a plane with long repeats).
    #[test]
    fn exponent_frame_of_any_encoder_decodes() {
        let l = Layout::new(2, 2, 64, crate::layout::DType::BFloat16, 16).unwrap();
        let n = l.block_bytes() / 2;
        // Repeating runs: a match finder finds plenty.
        let kv: Vec<u8> = (0..n)
            .flat_map(|i| [(i * 31) as u8, 0x3c + (i / 7 % 4) as u8])
            .collect();
        let high: Vec<u8> = kv.iter().skip(1).step_by(2).copied().collect();
        let low: Vec<u8> = kv.iter().step_by(2).copied().collect();
        let tokens: Vec<u32> = (0..l.block_size).collect();
        let id = [7u8; 32];
        let decode = |stored: &[u8]| {
            let meta = encode_meta(
                FLAG_EXPONENT,
                &id,
                &tokens,
                stored.len() as u64,
                l.block_bytes() as u64,
                crc32c::crc32c(stored),
                crc32c::crc32c(&kv),
            );
            let h = check_read(&l, &meta, &id, stored.len() as u64, Some(&tokens))
                .unwrap_or_else(|m| panic!("{m:?}"));
            let mut out = vec![0u8; l.block_bytes()];
            let mut runs: Vec<&mut [u8]> = out.chunks_mut(l.chunk_bytes()).collect();
            decode_compressed(&l, &h, stored, &mut runs, &mut Vec::new()).unwrap();
            out
        };
        let matched = [zstd::bulk::compress(&high, 19).unwrap(), low.clone()].concat();
        assert_eq!(decode(&matched), kv);
        let chunks: Vec<&[u8]> = kv.chunks(l.chunk_bytes()).collect();
        let mine = codec::encode_exponent(&chunks).unwrap();
        assert_eq!(decode(&mine), kv);
        // Literals only: larger than the frame of matches, which exploits the runs.
        assert!(mine.len() - n > matched.len() - n, "{} vs {}", mine.len(), matched.len());
    }

    #[test]
    fn record_meta_round_trip_and_damage() {
        let id = [9u8; 32];
        let meta = encode_meta(FLAG_ZSTD, &id, &[1, 2, 3], 100, 200, 5, 6);
        let h = decode_header(&meta, 16, 1000).unwrap();
        assert_eq!(h.n_tokens, 3);
        assert_eq!(h.stored_len, 100);
        assert_eq!(h.raw_len, 200);
        assert_eq!(h.block_id, id);
        check_meta(&h, &meta).unwrap();
        assert_eq!(tokens(&meta).collect::<Vec<_>>(), vec![1, 2, 3]);
        for at in 0..meta.len() {
            let mut bad = meta.clone();
            bad[at] ^= 0x10;
            let ok =
                decode_header(&bad, 16, 1000).and_then(|h| check_meta(&h, &bad).map(|()| h));
            assert!(ok.is_err(), "flip at {at} went unnoticed");
        }
    }

    #[test]
    fn lengths_are_bounded_before_use() {
        let meta = encode_meta(0, &[0; 32], &[1; 4], u64::MAX, 0, 0, 0);
        assert!(decode_header(&meta, 16, 1 << 20).is_err());
        let meta = encode_meta(0, &[0; 32], &[1; 40], 10, 10, 0, 0);
        assert!(decode_header(&meta, 16, 1 << 20).is_err());
    }

    fn bf16_layout() -> Layout {
        Layout::new(2, 2, 16, crate::layout::DType::BFloat16, 8).unwrap()
    }

    /// bf16 bytes with few exponents and random mantissas (xorshift).
    fn kv_like(n: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..n / 2)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Sign and one of four exponents near 2^-5; random mantissa.
                let hi = 0x3c + (x >> 8) as u8 % 4 + ((x >> 16) as u8 & 0x80);
                [x as u8, hi]
            })
            .collect()
    }

    fn encoded_bytes(layout: &Layout, codec: Codec, kv: &[u8]) -> (Vec<u8>, Vec<u8>) {
        let chunks: Vec<&[u8]> = kv.chunks(layout.chunk_bytes()).collect();
        let tokens: Vec<u32> = (0..layout.block_size).collect();
        let rec = encode(layout, codec, &[3; 32], &tokens, &chunks).unwrap();
        let bytes: Vec<u8> = rec.slices().iter().flat_map(|s| s.to_vec()).collect();
        let (meta, stored) = bytes.split_at(meta_len(layout));
        (meta.to_vec(), stored.to_vec())
    }

    fn decode_all(layout: &Layout, meta: &[u8], stored: &[u8]) -> Result<Vec<u8>, String> {
        let tokens: Vec<u32> = (0..layout.block_size).collect();
        let h = check_read(layout, meta, &[3; 32], stored.len() as u64, Some(&tokens))
            .map_err(|m| format!("{m:?}"))?;
        let mut out = vec![0u8; layout.block_bytes()];
        let mut runs: Vec<&mut [u8]> = out.chunks_mut(layout.chunk_bytes()).collect();
        decode_compressed(layout, &h, stored, &mut runs, &mut Vec::new())?;
        Ok(out)
    }

    #[test]
    fn exponent_round_trip_and_size() {
        let l = bf16_layout();
        let kv = kv_like(l.block_bytes());
        let (meta, stored) = encoded_bytes(&l, Codec::Exponent, &kv);
        let h = decode_header(&meta, 8, l.block_bytes() as u64).unwrap();
        assert_eq!(h.flags, FLAG_EXPONENT);
        // 3 bits of entropy in the high plane: well under 3/4 of the raw bytes.
        assert!(stored.len() < kv.len() * 3 / 4, "{} of {}", stored.len(), kv.len());
        assert_eq!(&stored[stored.len() - kv.len() / 2..], &kv.iter().step_by(2).copied().collect::<Vec<_>>()[..]);
        assert_eq!(decode_all(&l, &meta, &stored).unwrap(), kv);
        // Through encode_many (threads) too: the same records, in order.
        let blocks: Vec<Vec<u8>> = (0..5).map(|i| kv.iter().map(|b| b ^ i).collect()).collect();
        let runs: Vec<Vec<&[u8]>> = blocks.iter().map(|b| b.chunks(l.chunk_bytes()).collect()).collect();
        let tokens: Vec<u32> = (0..l.block_size).collect();
        let ids: Vec<BlockId> = (0..5u8).map(|i| [i; 32]).collect();
        let jobs: Vec<_> = (0..5).map(|i| (&ids[i], &tokens[..], &runs[i][..])).collect();
        for (i, rec) in encode_many(&l, Codec::Exponent, &jobs).into_iter().enumerate() {
            let one = encode(&l, Codec::Exponent, &ids[i], &tokens, &runs[i]).unwrap();
            let flat = |r: &Encoded<'_>| r.slices().iter().flat_map(|s| s.to_vec()).collect::<Vec<u8>>();
            assert_eq!(flat(&rec.unwrap()), flat(&one), "block {i}");
        }
    }

    #[test]
    fn exponent_falls_back_to_raw() {
        // Random high bytes do not compress: the record stays raw.
        let l = bf16_layout();
        let mut x = 1u32;
        let kv: Vec<u8> = (0..l.block_bytes())
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 24) as u8
            })
            .collect();
        let (meta, stored) = encoded_bytes(&l, Codec::Exponent, &kv);
        assert_eq!(u16_at(&meta, 6), 0);
        assert_eq!(stored, kv);
        // Other element sizes have no exponent plane: raw too.
        let f32l = Layout::new(2, 2, 8, crate::layout::DType::Float32, 8).unwrap();
        let (meta, _) = encoded_bytes(&f32l, Codec::Exponent, &vec![0u8; f32l.block_bytes()]);
        assert_eq!(u16_at(&meta, 6), 0);
    }

    #[test]
    fn damaged_exponent_payload_is_refused() {
        let l = bf16_layout();
        let kv = kv_like(l.block_bytes());
        let (meta, stored) = encoded_bytes(&l, Codec::Exponent, &kv);
        let h = decode_header(&meta, 8, l.block_bytes() as u64).unwrap();
        let tokens: Vec<u32> = (0..l.block_size).collect();
        for at in (0..stored.len()).step_by(7).chain([stored.len() - 1]) {
            let mut bad = stored.clone();
            bad[at] ^= 0x41;
            assert!(decode_all(&l, &meta, &bad).is_err(), "flip at {at} went unnoticed");
            // Forged: the stored checksum made to match; the frame or the raw
            // checksum must still catch it.
            let forged = encode_meta(
                h.flags, &h.block_id, &tokens, h.stored_len, h.raw_len, crc32c::crc32c(&bad), h.raw_crc,
            );
            assert!(decode_all(&l, &forged, &bad).is_err(), "forged flip at {at} went unnoticed");
        }
        // The flag with others, on a 4-byte dtype, or with a frame of no bytes.
        let n = l.block_bytes() as u64;
        for (flags, stored_len) in [
            (FLAG_EXPONENT | FLAG_ZSTD, h.stored_len),
            (FLAG_EXPONENT | FLAG_SHUFFLE, h.stored_len),
            (FLAG_EXPONENT, n / 2),
            (FLAG_EXPONENT, n),
        ] {
            let m = encode_meta(flags, &h.block_id, &tokens, stored_len, n, 1, 2);
            let hh = decode_header(&m, 8, n).unwrap();
            assert!(check_shape(&hh, &l).is_err(), "{flags:#x} {stored_len}");
        }
        let f32l = Layout::new(2, 2, 8, crate::layout::DType::Float32, 4).unwrap();
        let m = encode_meta(FLAG_EXPONENT, &h.block_id, &tokens[..4], 100, f32l.block_bytes() as u64, 1, 2);
        let hh = decode_header(&m, 8, f32l.block_bytes() as u64).unwrap();
        assert!(check_shape(&hh, &f32l).is_err());
    }

}
