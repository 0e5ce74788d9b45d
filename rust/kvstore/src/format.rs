//! The on-disk format: segment headers and the MANIFEST here, and the byte
//! layout of records, whose codec is [`crate::record`]. This module is the
//! contract; `tests/golden.rs` pins its bytes.
//!
//! A segment file is a 32-byte header followed by records. In a version-2
//! segment (written since format version 2) a record whose payload is 64 KiB
//! or more ([`ALIGN_MIN_PAYLOAD`]) begins with zero bytes, as many as put its
//! payload on a 4 KiB boundary of the file, so that the payload can be read
//! with `O_DIRECT` straight into the destination; smaller records, and every
//! record of a version-1 segment, have no padding.
//!
//! ```text
//! segment header (32 B)            record (pad + 80 B header + 4·n tokens + payload)
//!  0 magic      b"KVSTSEG\0"          0 padding    p zero bytes, p < 4096, such that
//!  8 version    u32 = 2 (or 1)                      offset + p + 80 + 4·n ≡ 0 (mod 4096)
//! 12 hdr len    u32 = 32                            (p = 0 in version 1, and for
//!                                                   payloads under 64 KiB)
//! 16 segment no u64                 p+0 magic      b"KVRC"
//! 24 crc32c     u32 of bytes 0..24 p+4 version    u16 = 1
//! 28 reserved   u32 = 0            p+6 flags      u16 (bit 0 zstd, bit 1 byte-plane shuffle,
//!                                                      bit 2 exponent plane; see below)
//!                                  p+8 n tokens   u32
//!                                 p+12 reserved   u32 = 0
//!                                 p+16 stored len u64 (payload bytes on disk)
//!                                 p+24 raw len    u64 (payload bytes decoded)
//!                                 p+32 block id   [u8; 32]
//!                                 p+64 stored crc u32 crc32c of the payload as stored
//!                                 p+68 raw crc    u32 crc32c of the decoded payload
//!                                 p+72 header crc u32 crc32c of bytes p+0..p+72 then the tokens
//!                                 p+76 reserved   u32 = 0
//!                                 p+80 tokens     n × u32
//!                                   .. payload    stored len bytes (version 2, ≥ 64 KiB: 4 KiB-aligned)
//! ```
//!
//! The padding belongs to the record that follows it: an index entry's
//! offset is where the padding starts and its length counts it, so a
//! record's bytes are one range of the file and the padding is checked (it
//! must be zeros) with the record: padding that is not zeros damages the
//! record, for reads, `verify` and the scanner alike. A padded record
//! starts with a zero byte, an unpadded one with its magic, and the padding
//! is a function of the offset: so a scanner finds the next record where
//! the last one ended.
//!
//! All integers are little-endian by explicit encoding. A compressed payload is
//! one zstd frame (any decoder reads it); with the shuffle flag the decoded
//! bytes are byte planes (all first bytes of each element, then all second
//! bytes, …) that `unshuffle` turns back into elements.
//!
//! With the exponent flag (bit 2, only ever alone, only for 16-bit dtypes)
//! the payload is two planes of the `n = raw len / 2` elements: first one
//! zstd frame holding the high byte of each element (sign and exponent bits),
//! in element order, then the `n` low bytes, raw, in element order. The frame
//! is the first `stored len - n` bytes (at least one). Records with bits 0-1
//! read as before: the flag was added without a version change because a
//! reader that predates it refuses the record (unknown flags: a miss), never
//! misreads it.

use crate::error::{Error, Result};
use crate::layout::{DType, Kind, Layout, Storage};
use serde::{Deserialize, Serialize};

pub const SEGMENT_MAGIC: [u8; 8] = *b"KVSTSEG\0";
/// Version of the segments this build writes; it reads 1 too.
pub const SEGMENT_VERSION: u32 = 2;
/// Segments of this version hold records back to back, unaligned.
pub const SEGMENT_VERSION_V1: u32 = 1;
pub const SEGMENT_HEADER_LEN: usize = 32;
/// Version-2 payloads start on this boundary of the file: the page size,
/// and the logical block size of every disk `O_DIRECT` meets in practice.
pub const PAYLOAD_ALIGN: u64 = 4096;

/// Format version written in the MANIFEST: 2 since segments may be of
/// version 2 (a build that reads only version 1 must refuse the store
/// rather than take padded records for damage). Version-1 stores open and
/// read as they are; their MANIFEST is upgraded (atomically) just before the
/// first version-2 segment is created in them, by a put or a compaction.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest MANIFEST format version this build opens.
pub const FORMAT_VERSION_MIN: u32 = 1;

/// Version-2 payloads of at least this many bytes start on a
/// [`PAYLOAD_ALIGN`] boundary; smaller ones are not aligned (their padding
/// would cost more than a sixteenth of them, and they are too small for
/// direct reads to pay).
pub const ALIGN_MIN_PAYLOAD: u64 = 16 * PAYLOAD_ALIGN;

/// Zero bytes before the meta of a record that starts at `offset` of a
/// segment of `version`, with `meta_len` bytes of header and token ids and
/// a payload of `stored_len` bytes: what puts the payload on a
/// [`PAYLOAD_ALIGN`] boundary (none in version 1, none for a payload under
/// [`ALIGN_MIN_PAYLOAD`]).
pub fn pad_before(version: u32, offset: u64, meta_len: usize, stored_len: u64) -> u64 {
    if version < 2 || stored_len < ALIGN_MIN_PAYLOAD {
        return 0;
    }
    let meta_end = offset + meta_len as u64;
    meta_end.next_multiple_of(PAYLOAD_ALIGN) - meta_end
}

/// Whether a record at `offset` whose first `pad` bytes are padding is
/// placed as a segment of `version` requires (`None`: the segment header is
/// unreadable, so either version's placement is accepted; the record's own
/// checks still apply).
pub fn placement_ok(
    version: Option<u32>,
    offset: u64,
    pad: u64,
    meta_len: usize,
    stored_len: u64,
) -> bool {
    let v2 = pad == pad_before(2, offset, meta_len, stored_len);
    match version {
        Some(SEGMENT_VERSION_V1) => pad == 0,
        Some(_) => v2,
        None => pad == 0 || v2,
    }
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Header of a segment file this build writes ([`SEGMENT_VERSION`]).
pub fn encode_segment_header(segment: u64) -> [u8; SEGMENT_HEADER_LEN] {
    encode_segment_header_of(segment, SEGMENT_VERSION)
}

/// Header of a segment file of `version` (tests write version 1 with it).
pub fn encode_segment_header_of(segment: u64, version: u32) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[0..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&(SEGMENT_HEADER_LEN as u32).to_le_bytes());
    h[16..24].copy_from_slice(&segment.to_le_bytes());
    let crc = crate::crc::crc32c(&h[0..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a segment header and returns its segment number and version.
pub fn decode_segment_header(h: &[u8]) -> Result<(u64, u32), String> {
    if h.len() < SEGMENT_HEADER_LEN {
        return Err(format!(
            "segment header: {} bytes, expected {SEGMENT_HEADER_LEN}",
            h.len()
        ));
    }
    if h[0..8] != SEGMENT_MAGIC {
        return Err("segment header: bad magic".into());
    }
    if u32_at(h, 24) != crate::crc::crc32c(&h[0..24]) {
        return Err("segment header: checksum mismatch".into());
    }
    let version = u32_at(h, 8);
    if !(SEGMENT_VERSION_V1..=SEGMENT_VERSION).contains(&version) {
        return Err(format!(
            "segment header: version {version}, this build reads {SEGMENT_VERSION_V1} to \
             {SEGMENT_VERSION}"
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
    Ok((u64_at(h, 16), version))
}

/// Contents of `<store>/MANIFEST`: a JSON object, then a line holding the
/// crc32c of the JSON bytes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    /// Format version of the store ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The model fingerprint the store is bound to.
    pub fingerprint: String,
    /// Layers of the layout.
    pub num_layers: u32,
    /// KV heads of the layout.
    pub num_kv_heads: u32,
    /// Head dimension of the layout.
    pub head_dim: u32,
    /// Element type of the layout, by name (`bfloat16`, ...).
    pub dtype: String,
    /// Tokens per block.
    pub block_size: u32,
    /// Creation time, seconds since the epoch.
    pub created_unix: u64,
    /// Random id of the store (32 hex digits); names its hot-tier arena.
    pub store_id: String,
    /// How blocks are stored ([`Storage::name`]); absent means exact, so
    /// MANIFESTs of exact stores are the bytes they always were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
    /// What a block holds ([`Kind::name`]); absent means K/V, so MANIFESTs
    /// of K/V stores are the bytes they always were. With `latent`,
    /// `head_dim` is the latent's width `W` and `num_kv_heads` 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

impl Manifest {
    /// The layout the MANIFEST describes.
    pub fn layout(&self) -> Result<Layout> {
        let storage = match &self.storage {
            None => Storage::Exact,
            Some(s) => Storage::parse(s)?,
        };
        let kind = match &self.kind {
            None => Kind::KeyValue,
            Some(k) => Kind::parse(k)?,
        };
        Layout::of_kind(
            kind,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            DType::parse(&self.dtype)?,
            self.block_size,
        )?
        .with_storage(storage)
    }

    /// The bytes of the MANIFEST file.
    pub fn encode(&self) -> Vec<u8> {
        let json = serde_json::to_string_pretty(self).expect("manifest serializes");
        let crc = crate::crc::crc32c(json.as_bytes());
        format!("{json}\ncrc32c {crc:08x}\n").into_bytes()
    }

    /// Parses and checks MANIFEST bytes; the reason when they are not one.
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
        if crc != crate::crc::crc32c(json.as_bytes()) {
            return Err("MANIFEST: checksum mismatch".into());
        }
        let m: Manifest = serde_json::from_str(json).map_err(|e| format!("MANIFEST: {e}"))?;
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&m.format_version) {
            return Err(format!(
                "MANIFEST: format version {}, this build reads {FORMAT_VERSION_MIN} to \
                 {FORMAT_VERSION}",
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
            "store was created for model {:?}, opened with {:?}{}",
            m.fingerprint,
            fingerprint,
            crate::fingerprint::mismatch_note(&m.fingerprint, fingerprint)
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
    let storage = match l.storage {
        Storage::Exact => String::new(),
        Storage::Fp8 => format!(", storage={}", Storage::Fp8.name()),
    };
    if let Some(width) = l.latent_width() {
        return format!(
            "(kind=latent, num_layers={}, latent_dim={width}, dtype={}, block_size={}{storage})",
            l.num_layers,
            l.dtype.name(),
            l.block_size
        );
    }
    format!(
        "(num_layers={}, num_kv_heads={}, head_dim={}, dtype={}, block_size={}{storage})",
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

    fn manifest(format_version: u32) -> Manifest {
        Manifest {
            format_version,
            fingerprint: "m".into(),
            num_layers: 1,
            num_kv_heads: 2,
            head_dim: 4,
            dtype: "float16".into(),
            block_size: 16,
            created_unix: 1,
            store_id: "00".into(),
            storage: None,
            kind: None,
        }
    }

    #[test]
    fn manifest_round_trip_and_damage() {
        let m = manifest(FORMAT_VERSION);
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
        assert_eq!(decode_segment_header(&h).unwrap(), (42, 2));
        let v1 = encode_segment_header_of(42, 1);
        assert_eq!(decode_segment_header(&v1).unwrap(), (42, 1));
        let mut bad = h;
        bad[17] ^= 1;
        assert!(decode_segment_header(&bad).is_err());
        assert!(decode_segment_header(&encode_segment_header_of(1, 3)).is_err());
        assert!(decode_segment_header(&encode_segment_header_of(1, 0)).is_err());
    }

    #[test]
    fn padding_puts_payloads_on_the_boundary() {
        let big = ALIGN_MIN_PAYLOAD;
        for meta in [80usize, 144, 4096, 5000] {
            for offset in [32u64, 4095, 4096, 4097, 1 << 20, (1 << 20) + 123] {
                let pad = pad_before(2, offset, meta, big);
                assert!(pad < PAYLOAD_ALIGN);
                assert_eq!((offset + pad + meta as u64) % PAYLOAD_ALIGN, 0);
                assert!(placement_ok(Some(2), offset, pad, meta, big));
                assert!(placement_ok(None, offset, pad, meta, big));
                assert_eq!(pad_before(1, offset, meta, big), 0);
                assert!(placement_ok(Some(1), offset, 0, meta, big));
                // Misplaced: an unaligned payload in version 2, padding in 1.
                assert!(!placement_ok(Some(2), offset, pad + 1, meta, big));
                assert!(!placement_ok(Some(2), offset + 1, pad, meta, big));
                assert_eq!(placement_ok(Some(1), offset, pad, meta, big), pad == 0);
                // Small payloads are never padded.
                assert_eq!(pad_before(2, offset, meta, big - 1), 0);
                assert!(placement_ok(Some(2), offset, 0, meta, big - 1));
                assert!(!placement_ok(Some(2), offset, pad.max(1), meta, big - 1));
            }
        }
    }

    /// A latent store's MANIFEST names its kind and its width as `head_dim`; a K/V
    /// store's has no `kind` (its bytes are what they always were).
    #[test]
    fn latent_manifest_bytes() {
        let mut m = manifest(FORMAT_VERSION);
        assert!(!String::from_utf8(m.encode()).unwrap().contains("kind"));
        m.num_kv_heads = 1;
        m.head_dim = 576;
        m.kind = Some("latent".into());
        let text = String::from_utf8(m.encode()).unwrap();
        assert!(text.contains("\"head_dim\": 576,") && text.ends_with("\"kind\": \"latent\"\n}\ncrc32c 6e32eda2\n"), "{text}");
        let l = Manifest::decode(&m.encode()).unwrap().layout().unwrap();
        assert_eq!(l, Layout::latent(1, 576, DType::Float16, 16).unwrap());
        m.num_kv_heads = 2;
        assert!(m.layout().is_err());
        m.num_kv_heads = 1;
        m.kind = Some("mla".into());
        assert!(m.layout().is_err());
        assert!(describe(&l).starts_with("(kind=latent, num_layers=1, latent_dim=576,"));
    }

    #[test]
    fn manifest_versions() {
        let mut m = manifest(1);
        assert_eq!(Manifest::decode(&m.encode()).unwrap().format_version, 1);
        m.format_version = 3;
        assert!(Manifest::decode(&m.encode()).is_err());
        m.format_version = 0;
        assert!(Manifest::decode(&m.encode()).is_err());
    }
}
