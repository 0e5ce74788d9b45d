//! Shared pieces of the fuzz targets: the small layout they use, the
//! invariants every segment scan must keep, and a builder of valid segments
//! that a fuzz input then damages in ways a checksum must catch.

use kvstore::format::{self, SEGMENT_HEADER_LEN};
use kvstore::record::{self, FLAG_SHUFFLE, FLAG_ZSTD};
use kvstore::scan::{self, ScanReport, ScannedRecord};
use kvstore::{BlockId, DType, Layout};

/// 1 layer, 1 KV head, head_dim 4, float16, 2 tokens: 32-byte blocks and
/// 88-byte record metas, small enough for the fuzzer to build records.
/// `rust/kvstore/tests/scan.rs` writes the seeds with the same layout.
pub fn layout() -> Layout {
    Layout::new(1, 1, 4, DType::Float16, 2).expect("valid layout")
}

/// Header checksum of a record's meta (header + tokens), as the format defines it.
pub fn meta_crc(meta: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&meta[..72]), &meta[80..])
}

/// Scans `bytes` as a segment and checks what must hold for any input: the
/// header, records, damaged ranges and torn tail tile the input in order,
/// and every record reported passes every check again.
pub fn scan_checked(bytes: &[u8]) -> (ScanReport, Vec<ScannedRecord>) {
    let l = layout();
    let mut found = Vec::new();
    let report =
        scan::scan_segment(bytes, &l, |r| found.push(r)).expect("a slice has no I/O errors");
    let len = bytes.len() as u64;
    assert_eq!(report.file_len, len);
    assert_eq!(report.records, found.len() as u64);
    assert!(report.valid_len <= len);
    assert_eq!(
        report.segment.is_some(),
        bytes.len() >= SEGMENT_HEADER_LEN && format::decode_segment_header(bytes).is_ok()
    );
    let mut prev_end = 0u64;
    for r in &found {
        let end = r.offset.checked_add(r.record_len).expect("no overflow");
        assert!(
            r.offset >= prev_end && r.offset >= SEGMENT_HEADER_LEN as u64,
            "{r:?}"
        );
        assert!(end <= len, "record past the end: {r:?}");
        assert_eq!(r.record_len, r.header.record_len());
        prev_end = end;
        record::check_shape(&r.header, &l).expect("shape");
        let rec = &bytes[r.offset as usize..end as usize];
        let (meta, payload) = rec.split_at(r.header.meta_len());
        assert_eq!(
            record::decode_header(meta, l.block_size, l.block_bytes() as u64).as_ref(),
            Ok(&r.header)
        );
        record::check_meta(&r.header, meta).expect("meta checksum");
        assert!(record::tokens(meta).eq(r.tokens.iter().copied()));
        assert_eq!(crc32c::crc32c(payload), r.header.stored_crc);
    }
    match found.last() {
        Some(r) => assert_eq!(report.valid_len, r.offset + r.record_len),
        None if report.segment.is_some() => assert_eq!(report.valid_len, SEGMENT_HEADER_LEN as u64),
        None => assert_eq!(report.valid_len, 0),
    }
    let mut spans: Vec<(u64, u64)> = Vec::new();
    if report.segment.is_some() {
        spans.push((0, SEGMENT_HEADER_LEN as u64));
    }
    spans.extend(found.iter().map(|r| (r.offset, r.offset + r.record_len)));
    let mut prev = 0;
    for d in &report.damaged {
        assert!(d.start < d.end && d.start >= prev && d.end <= len, "{d:?}");
        prev = d.end;
        spans.push((d.start, d.end));
    }
    if let Some(t) = report.torn_tail {
        assert!(
            t < len || len < SEGMENT_HEADER_LEN as u64,
            "torn at {t} of {len}"
        );
        assert!(t >= report.valid_len);
        spans.push((t, len));
    }
    spans.sort_unstable();
    let mut at = 0;
    for (s, e) in spans {
        assert_eq!(s, at, "gap or overlap at {at}: {report:?}");
        at = e;
    }
    assert_eq!(at, len, "scan does not cover the input: {report:?}");
    (report, found)
}

/// Reads bytes off the front of the fuzz input, zeros once it runs out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((b, rest)) => {
                self.0 = rest;
                *b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }
}

/// Builds a valid segment from the input's first bytes, damages it with the
/// rest (at most 5 flipped bits, 2 zeroed ranges of up to 64 bytes, and a
/// truncation: damage a crc32c always or almost always detects), then checks
/// that every record the damage did not touch is found where it was.
pub fn damaged_segment(data: &[u8]) {
    let l = layout();
    let mut input = Input(data);
    let n = input.byte() % 7;
    let mut bytes = format::encode_segment_header(1).to_vec();
    let mut records: Vec<(usize, usize, BlockId)> = Vec::new();
    let raw_len = l.block_bytes();
    for k in 0..n {
        let seed = input.byte();
        let kind = input.byte();
        let mut id = [seed; 32];
        id[0] = k;
        let tokens = [u32::from(seed), u32::from(k)];
        let raw: Vec<u8> = (0..raw_len)
            .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(k))
            .collect();
        let (flags, stored) = if kind & 1 == 1 {
            let n = 1 + usize::from(kind >> 2) % (raw_len - 1);
            let shuffle = if kind & 2 != 0 { FLAG_SHUFFLE } else { 0 };
            (
                FLAG_ZSTD | shuffle,
                raw[..n].iter().map(|b| b ^ 0x5a).collect(),
            )
        } else {
            (0, raw.clone())
        };
        let meta = record::encode_meta(
            flags,
            &id,
            &tokens,
            stored.len() as u64,
            raw_len as u64,
            crc32c::crc32c(&stored),
            crc32c::crc32c(&raw),
        );
        let offset = bytes.len();
        bytes.extend_from_slice(&meta);
        bytes.extend_from_slice(&stored);
        records.push((offset, bytes.len() - offset, id));
    }
    let (report, found) = scan_checked(&bytes);
    assert!(
        report.is_clean() && found.len() == records.len(),
        "{report:?}"
    );

    let original = bytes.clone();
    let (mut flips, mut zeros) = (0, 0);
    for _ in 0..8 {
        if input.0.is_empty() {
            break;
        }
        let op = input.byte() % 3;
        let pos = usize::from(input.u16()) % bytes.len().max(1);
        let arg = input.byte();
        match op {
            0 if flips < 5 && !bytes.is_empty() => {
                bytes[pos] ^= 1 << (arg & 7);
                flips += 1;
            }
            1 if zeros < 2 && !bytes.is_empty() => {
                let end = (pos + 1 + usize::from(arg % 64)).min(bytes.len());
                bytes[pos..end].fill(0);
                zeros += 1;
            }
            2 => bytes.truncate(pos),
            _ => {}
        }
    }
    let (_, found) = scan_checked(&bytes);
    for (offset, len, id) in records {
        let end = offset + len;
        if end <= bytes.len() && bytes[offset..end] == original[offset..end] {
            assert!(
                found
                    .iter()
                    .any(|r| r.offset == offset as u64 && r.header.block_id == id),
                "intact record at {offset} not found; found {:?}",
                found.iter().map(|r| r.offset).collect::<Vec<_>>()
            );
        }
    }
}
