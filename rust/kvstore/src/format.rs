//! The on-disk format: segment headers, records, the MANIFEST. This module is
//! the contract; `tests/golden.rs` pins its bytes.
//!
//! A segment file is a 32-byte header followed by records, back to back:
//!
//! ```text
//! segment header (32 B)            record (80 B header + 4·n tokens + payload)
//!  0 magic      b"KVSTSEG\0"        0 magic        b"KVRC"
//!  8 version    u32 = 1             4 version      u16 = 1
//! 12 hdr len    u32 = 32            6 flags        u16 (bit 0 zstd, bit 1 byte-plane shuffle)
//! 16 segment no u64                 8 n tokens     u32
//! 24 crc32c     u32 of bytes 0..24 12 reserved     u32 = 0
//! 28 reserved   u32 = 0            16 stored len   u64 (payload bytes on disk)
//!                                  24 raw len      u64 (payload bytes decoded)
//!                                  32 block id     [u8; 32]
//!                                  64 stored crc   u32 crc32c of the payload as stored
//!                                  68 raw crc      u32 crc32c of the decoded payload
//!                                  72 header crc   u32 crc32c of bytes 0..72 then the tokens
//!                                  76 reserved     u32 = 0
//!                                  80 tokens       n × u32
//!                                  .. payload      stored len bytes
//! ```
//!
//! All integers are little-endian by explicit encoding. A compressed payload is
//! one zstd frame (any decoder reads it); with the shuffle flag the decoded
//! bytes are byte planes (all first bytes of each element, then all second
//! bytes, …) that `unshuffle` turns back into elements.

use crate::error::{Error, Result};
use crate::id::BlockId;
use crate::layout::{DType, Layout};
use serde::{Deserialize, Serialize};

pub const SEGMENT_MAGIC: [u8; 8] = *b"KVSTSEG\0";
pub const SEGMENT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_LEN: usize = 32;

pub const RECORD_MAGIC: [u8; 4] = *b"KVRC";
pub const RECORD_VERSION: u16 = 1;
pub const RECORD_HEADER_LEN: usize = 80;

pub const FLAG_ZSTD: u16 = 1;
pub const FLAG_SHUFFLE: u16 = 2;
const KNOWN_FLAGS: u16 = FLAG_ZSTD | FLAG_SHUFFLE;

/// Format version written in the MANIFEST.
pub const FORMAT_VERSION: u32 = 1;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Header of a segment file.
pub fn encode_segment_header(segment: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(SEGMENT_HEADER_LEN as u32).to_le_bytes());
    h[16..24].copy_from_slice(&segment.to_le_bytes());
    let crc = crc32c::crc32c(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a segment header and returns its segment number.
pub fn decode_segment_header(h: &[u8]) -> Result<u64, String> {
    if h.len() < SEGMENT_HEADER_LEN {
        return Err(format!(
            "segment header: {} bytes, expected {SEGMENT_HEADER_LEN}",
            h.len()
        ));
    }
    if h[0..8] != SEGMENT_MAGIC {
        return Err("segment header: bad magic".into());
    }
    if u32_at(h, 24) != crc32c::crc32c(&h[0..24]) {
        return Err("segment header: checksum mismatch".into());
    }
    let version = u32_at(h, 8);
    if version != SEGMENT_VERSION {
        return Err(format!(
            "segment header: version {version}, this build reads {SEGMENT_VERSION}"
        ));
    }
    if u32_at(h, 12) != SEGMENT_HEADER_LEN as u32 {
        return Err(format!(
            "segment header: header length {}, expected {SEGMENT_HEADER_LEN}",
            u32_at(h, 12)
        ));
    }
    if u32_at(h, 28) != 0 {
        // Not covered by the checksum, so it must hold its one valid value.
        return Err("segment header: reserved bytes are not zero".into());
    }
    Ok(u64_at(h, 16))
}

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
pub fn encode_record_meta(
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
    let c = crc32c::crc32c(&meta[0..72]);
    crc32c::crc32c_append(c, &meta[RECORD_HEADER_LEN..])
}

/// Decodes the fixed 80-byte header. Only lengths are checked here (against
/// `max_stored`, so no allocation or read is sized by an unchecked field);
/// `check_meta` checks the header checksum once the tokens are read too.
pub fn decode_record_header(
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

/// Token ids stored in a record's meta bytes.
pub fn record_tokens(meta: &[u8]) -> impl Iterator<Item = u32> + '_ {
    meta[RECORD_HEADER_LEN..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
}

/// Byte-plane shuffle: element i's byte j goes to `j * n + i`.
pub fn shuffle(src: &[u8], elem: usize, dst: &mut Vec<u8>) {
    let n = src.len() / elem;
    dst.clear();
    dst.resize(src.len(), 0);
    for j in 0..elem {
        let plane = &mut dst[j * n..(j + 1) * n];
        for (i, out) in plane.iter_mut().enumerate() {
            *out = src[i * elem + j];
        }
    }
}

/// Inverse of `shuffle`.
pub fn unshuffle(src: &[u8], elem: usize, dst: &mut [u8]) {
    let n = src.len() / elem;
    for j in 0..elem {
        let plane = &src[j * n..(j + 1) * n];
        for (i, b) in plane.iter().enumerate() {
            dst[i * elem + j] = *b;
        }
    }
}

/// Contents of `<store>/MANIFEST`: a JSON object, then a line holding the
/// crc32c of the JSON bytes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub format_version: u32,
    pub fingerprint: String,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub dtype: String,
    pub block_size: u32,
    pub created_unix: u64,
    pub store_id: String,
}

impl Manifest {
    pub fn layout(&self) -> Result<Layout> {
        Layout::new(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            DType::parse(&self.dtype)?,
            self.block_size,
        )
    }

    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_string_pretty(self).expect("manifest serializes");
        let crc = crc32c::crc32c(json.as_bytes());
        format!("{json}\ncrc32c {crc:08x}\n").into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "MANIFEST is not UTF-8".to_string())?;
        let body = text
            .strip_suffix('\n')
            .ok_or("MANIFEST: missing final newline")?;
        let (json, crc_line) = body
            .rsplit_once('\n')
            .ok_or("MANIFEST: missing checksum line")?;
        let crc_hex = crc_line
            .strip_prefix("crc32c ")
            .ok_or("MANIFEST: bad checksum line")?;
        let crc = u32::from_str_radix(crc_hex, 16).map_err(|_| "MANIFEST: bad checksum value")?;
        if crc != crc32c::crc32c(json.as_bytes()) {
            return Err("MANIFEST: checksum mismatch".into());
        }
        let m: Manifest = serde_json::from_str(json).map_err(|e| format!("MANIFEST: {e}"))?;
        if m.format_version != FORMAT_VERSION {
            return Err(format!(
                "MANIFEST: format version {}, this build reads {FORMAT_VERSION}",
                m.format_version
            ));
        }
        Ok(m)
    }
}

/// Rejects a layout/fingerprint that differs from the store's, naming both.
pub fn check_identity(m: &Manifest, fingerprint: &str, layout: &Layout) -> Result<()> {
    let mine = m.layout()?;
    if m.fingerprint != fingerprint {
        return Err(Error::LayoutMismatch(format!(
            "store was created for model {:?}, opened with {:?}",
            m.fingerprint, fingerprint
        )));
    }
    if mine != *layout {
        return Err(Error::LayoutMismatch(format!(
            "store layout is {}, opened with {}",
            describe(&mine),
            describe(layout)
        )));
    }
    Ok(())
}

pub fn describe(l: &Layout) -> String {
    format!(
        "(num_layers={}, num_kv_heads={}, head_dim={}, dtype={}, block_size={})",
        l.num_layers,
        l.num_kv_heads,
        l.head_dim,
        l.dtype.name(),
        l.block_size
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_meta_round_trip_and_damage() {
        let id = [9u8; 32];
        let meta = encode_record_meta(FLAG_ZSTD, &id, &[1, 2, 3], 100, 200, 5, 6);
        let h = decode_record_header(&meta, 16, 1000).unwrap();
        assert_eq!(h.n_tokens, 3);
        assert_eq!(h.stored_len, 100);
        assert_eq!(h.raw_len, 200);
        assert_eq!(h.block_id, id);
        check_meta(&h, &meta).unwrap();
        assert_eq!(record_tokens(&meta).collect::<Vec<_>>(), vec![1, 2, 3]);
        for at in 0..meta.len() {
            let mut bad = meta.clone();
            bad[at] ^= 0x10;
            let ok =
                decode_record_header(&bad, 16, 1000).and_then(|h| check_meta(&h, &bad).map(|_| h));
            assert!(ok.is_err(), "flip at {at} went unnoticed");
        }
    }

    #[test]
    fn lengths_are_bounded_before_use() {
        let meta = encode_record_meta(0, &[0; 32], &[1; 4], u64::MAX, 0, 0, 0);
        assert!(decode_record_header(&meta, 16, 1 << 20).is_err());
        let meta = encode_record_meta(0, &[0; 32], &[1; 40], 10, 10, 0, 0);
        assert!(decode_record_header(&meta, 16, 1 << 20).is_err());
    }

    #[test]
    fn shuffle_round_trip() {
        let src: Vec<u8> = (0..64u8).collect();
        let mut s = Vec::new();
        shuffle(&src, 2, &mut s);
        assert_eq!(&s[..4], &[0, 2, 4, 6]);
        let mut back = vec![0u8; 64];
        unshuffle(&s, 2, &mut back);
        assert_eq!(back, src);
    }

    #[test]
    fn manifest_round_trip_and_damage() {
        let m = Manifest {
            format_version: FORMAT_VERSION,
            fingerprint: "m".into(),
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 4,
            dtype: "float16".into(),
            block_size: 16,
            created_unix: 1,
            store_id: "00".into(),
        };
        let b = m.encode();
        assert_eq!(Manifest::decode(&b).unwrap(), m);
        let mut bad = b.clone();
        bad[10] ^= 1;
        assert!(Manifest::decode(&bad).is_err());
        assert!(Manifest::decode(&b[..b.len() - 3]).is_err());
    }

    #[test]
    fn segment_header_round_trip() {
        let h = encode_segment_header(42);
        assert_eq!(decode_segment_header(&h).unwrap(), 42);
        let mut bad = h;
        bad[17] ^= 1;
        assert!(decode_segment_header(&bad).is_err());
    }
}
