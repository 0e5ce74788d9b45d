//! Segment scanner: walks a segment file record by record without the index.
//!
//! This is the reader behind `kvstore verify --repair` and the index rebuild:
//! it trusts nothing in the file. Every record is checked the way a read
//! checks it (header fields, the layout's lengths, header checksum, stored
//! payload checksum) and every length is bounded by the layout before it sizes
//! a read or an allocation. A record that fails a check is damage: it is
//! reported, and the scan resynchronises on the next offset that holds a
//! record magic whose header decodes and whose header checksum holds. A file
//! that ends inside a record (a torn append) ends the scan.
//!
//! In a version-2 segment a record starts with the zero padding that puts
//! its payload on a 4 KiB boundary; the padding is a function of where the
//! record starts, so the scan knows how much to expect, checks it is zeros
//! and counts it in the record. A record found by resynchronising must be
//! placed so too (its payload aligned), or it is not a version-2 record.
//! When the segment header is unreadable, either placement is accepted.
//! Padding that is not zeros damages the whole record behind it, however
//! sound its meta and payload (reads and `verify` say the same, through
//! [`record::check_padding`]): the scan skips that record and names its
//! block, so a rebuilt index never serves what `verify` calls damaged.
//!
//! The scan reads the file's length once, at the start. Scan a sealed segment,
//! or hold the writer's lock on an active one: bytes a live writer appends
//! meanwhile are not seen, and a record it is halfway through looks torn.

use crate::format::{self, SEGMENT_HEADER_LEN};
use crate::record::{self, RecordHeader, RECORD_HEADER_LEN, RECORD_MAGIC};
use crate::id::BlockId;
use crate::layout::Layout;
use std::fs::File;
use std::io;

/// Largest read the scanner makes for a payload; payloads are checked in
/// chunks of this size, so memory does not grow with the record.
const PAYLOAD_CHUNK: usize = 1 << 20;
/// Bytes searched per read while looking for the next record magic.
const RESYNC_WINDOW: usize = 64 << 10;

/// Positional reads from something of a fixed length: a file or a byte slice.
pub trait ReadAt {
    /// Total length in bytes.
    fn size(&self) -> io::Result<u64>;
    /// Fills `buf` from `offset`; reading past the end is an error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

impl ReadAt for File {
    fn size(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
}

impl ReadAt for [u8] {
    fn size(&self) -> io::Result<u64> {
        Ok(self.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end"))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl<T: ReadAt + ?Sized> ReadAt for &T {
    fn size(&self) -> io::Result<u64> {
        (**self).size()
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
}

/// A record that passed every check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScannedRecord {
    /// Offset of the record in the file.
    pub offset: u64,
    /// Bytes of the whole record (header, tokens, payload).
    pub record_len: u64,
    pub header: RecordHeader,
    pub tokens: Vec<u32>,
}

/// A run of bytes that holds no valid record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DamagedRange {
    /// First byte of the range.
    pub start: u64,
    /// Exclusive: the next valid record, the torn tail, or the end of the file.
    pub end: u64,
    /// The block a damaged record held, when its header checksum still held
    /// (its payload did not).
    pub block_id: Option<BlockId>,
    /// What was wrong at `start`.
    pub reason: String,
}

/// What a scan found. The header (when valid), the records, the damaged
/// ranges and the torn tail together cover the file exactly, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// The segment number its header names; `None` when the header is damaged
    /// or the file is shorter than a header.
    pub segment: Option<u64>,
    /// The file's length when the scan started.
    pub file_len: u64,
    /// Records that passed every check.
    pub records: u64,
    /// Damaged ranges, in file order, disjoint.
    pub damaged: Vec<DamagedRange>,
    /// End of the last valid record (or of the header when there is none; 0
    /// when the header is damaged too).
    pub valid_len: u64,
    /// Offset of the record the file ends inside, if it does: a torn append.
    pub torn_tail: Option<u64>,
}

impl ScanReport {
    /// Every byte accounted for by the header and valid records.
    #[cfg(any(test, feature = "__internal_whitebox"))]
    pub fn is_clean(&self) -> bool {
        self.segment.is_some() && self.damaged.is_empty() && self.torn_tail.is_none()
    }
}

/// Scans a whole segment, calling `on_record` for each valid record in file
/// order. Errors are I/O errors only; damage is in the report.
pub fn scan_segment<R: ReadAt + ?Sized>(
    r: &R,
    layout: &Layout,
    on_record: impl FnMut(ScannedRecord),
) -> io::Result<ScanReport> {
    let len = r.size()?;
    let meta_len = RECORD_HEADER_LEN + 4 * layout.block_size as usize;
    let mut s = Scanner {
        r,
        layout,
        len,
        meta_len,
        version: None,
        header: [0u8; RECORD_HEADER_LEN],
        meta: Vec::new(),
        chunk: Vec::new(),
        window: Vec::new(),
    };
    s.run(on_record)
}

/// What one record position holds.
enum Step {
    Record(ScannedRecord),
    /// The file ends before the record that starts here could.
    Torn,
    /// Damage; `resume` is where to look for the next record from (the end of
    /// a record whose header was sound, otherwise the next byte).
    Bad {
        reason: String,
        resume: u64,
        block_id: Option<BlockId>,
    },
}

struct Scanner<'a, R: ?Sized> {
    r: &'a R,
    layout: &'a Layout,
    len: u64,
    meta_len: usize,
    /// The segment's version, when its header decodes.
    version: Option<u32>,
    header: [u8; RECORD_HEADER_LEN],
    meta: Vec<u8>,
    chunk: Vec<u8>,
    window: Vec<u8>,
}

impl<R: ReadAt + ?Sized> Scanner<'_, R> {
    fn run(&mut self, mut on_record: impl FnMut(ScannedRecord)) -> io::Result<ScanReport> {
        let mut report = ScanReport {
            file_len: self.len,
            ..ScanReport::default()
        };
        if self.len < SEGMENT_HEADER_LEN as u64 {
            report.torn_tail = Some(0);
            return Ok(report);
        }
        let mut h = [0u8; SEGMENT_HEADER_LEN];
        self.r.read_exact_at(&mut h, 0)?;
        let mut pos = SEGMENT_HEADER_LEN as u64;
        let mut step = match format::decode_segment_header(&h) {
            Ok((n, version)) => {
                report.segment = Some(n);
                self.version = Some(version);
                report.valid_len = pos;
                None
            }
            Err(reason) => Some(Step::Bad {
                reason,
                resume: pos,
                block_id: None,
            }),
        };
        let mut start = 0;
        loop {
            let current = match step.take() {
                Some(s) => s,
                None if pos == self.len => break,
                None => {
                    start = pos;
                    self.examine(pos)?
                }
            };
            match current {
                Step::Record(rec) => {
                    pos = rec.offset + rec.record_len;
                    report.valid_len = pos;
                    report.records += 1;
                    on_record(rec);
                }
                Step::Torn => {
                    report.torn_tail = Some(pos);
                    break;
                }
                Step::Bad {
                    reason,
                    resume,
                    block_id,
                } => {
                    // After a record whose header held, `resume` is where
                    // the next record starts, its padding included: taken
                    // from there when it is one, so that it keeps its
                    // padding (a search finds only its magic, after it).
                    let mut next = None;
                    if block_id.is_some() && resume < self.len {
                        if let rec @ Step::Record(_) = self.examine(resume)? {
                            step = Some(rec);
                            next = Some(resume);
                        }
                    }
                    let next = match next {
                        Some(q) => Some(q),
                        None => self.resync(resume)?,
                    };
                    report.damaged.push(DamagedRange {
                        start,
                        end: next.unwrap_or(self.len),
                        block_id,
                        reason,
                    });
                    match next {
                        Some(q) => pos = q,
                        None => break,
                    }
                }
            }
        }
        Ok(report)
    }

    /// Decodes and checks the header + tokens at `pos`: `Ok(None)` when the
    /// file ends before they do, `Ok(Some(Err))` when they are damaged.
    fn read_meta(&mut self, pos: u64) -> io::Result<Option<Result<RecordHeader, String>>> {
        let remaining = self.len - pos;
        if remaining < RECORD_HEADER_LEN as u64 {
            return Ok(None);
        }
        self.r.read_exact_at(&mut self.header, pos)?;
        let header = match record::decode_checked(&self.header, self.layout) {
            Ok(h) => h,
            Err(reason) => return Ok(Some(Err(reason))),
        };
        // The shape check pinned n_tokens, so this is the layout's meta length.
        let meta_len = header.meta_len();
        if remaining < meta_len as u64 {
            return Ok(None);
        }
        self.meta.clear();
        self.meta.extend_from_slice(&self.header);
        self.meta.resize(meta_len, 0);
        self.r.read_exact_at(
            &mut self.meta[RECORD_HEADER_LEN..],
            pos + RECORD_HEADER_LEN as u64,
        )?;
        Ok(Some(
            record::check_meta(&header, &self.meta).map(|()| header),
        ))
    }

    /// The padding a record starting at `pos` may have: none where a record
    /// magic is (or in version 1), else what aligns a large payload.
    fn pad_at(&self, pos: u64) -> io::Result<u64> {
        let most = format::pad_before(2, pos, self.meta_len, u64::MAX);
        if most == 0 || self.version == Some(format::SEGMENT_VERSION_V1) {
            return Ok(0);
        }
        if self.len - pos >= RECORD_MAGIC.len() as u64 {
            let mut head = [0u8; RECORD_MAGIC.len()];
            self.r.read_exact_at(&mut head, pos)?;
            if head == RECORD_MAGIC {
                return Ok(0);
            }
        }
        Ok(most)
    }

    /// What the record starting at `pos` (its padding first) is.
    fn examine(&mut self, pos: u64) -> io::Result<Step> {
        let remaining = self.len - pos;
        let pad = self.pad_at(pos)?;
        if pad > 0 {
            let n = pad.min(remaining) as usize;
            self.chunk.resize(n, 0);
            self.r.read_exact_at(&mut self.chunk[..n], pos)?;
            if let Err(reason) = record::check_padding(&self.chunk[..n]) {
                return self.damaged_padding(pos, pad, &reason);
            }
            if remaining <= pad {
                // The file ends in the padding: an append torn before its record.
                return Ok(Step::Torn);
            }
        }
        Ok(match self.examine_meta(pos + pad)? {
            Step::Record(rec) => {
                let stored = rec.header.stored_len;
                if format::placement_ok(self.version, pos, pad, self.meta_len, stored) {
                    Step::Record(ScannedRecord {
                        offset: pos,
                        record_len: pad + rec.record_len,
                        ..rec
                    })
                } else {
                    Step::Bad {
                        reason: format!(
                            "record at offset {pos} is not placed as its segment's version \
                             requires"
                        ),
                        resume: rec.offset + rec.record_len,
                        block_id: Some(rec.header.block_id),
                    }
                }
            }
            // A record magic where padding belongs (which `pad_at` took for
            // an unpadded record): damaged padding if a record lies behind.
            Step::Bad {
                reason,
                resume,
                block_id: None,
            } if pad == 0 && self.version != Some(format::SEGMENT_VERSION_V1) => {
                let most = format::pad_before(2, pos, self.meta_len, u64::MAX);
                match self.record_behind(pos, most)? {
                    Some(rec) => Step::Bad {
                        reason: format!("record padding is not zeros (record at offset {pos})"),
                        resume: rec.offset + rec.record_len,
                        block_id: Some(rec.header.block_id),
                    },
                    None => Step::Bad {
                        reason,
                        resume,
                        block_id: None,
                    },
                }
            }
            other => other,
        })
    }

    /// The record at `pos`, whose `pad` bytes of padding are not zeros. A
    /// sound large record behind them (placed where that padding puts it) is
    /// damaged with its padding, as reads and `verify` see it: it is skipped
    /// whole and named, never re-indexed. Anything else behind is looked
    /// for from the next byte on.
    fn damaged_padding(&mut self, pos: u64, pad: u64, reason: &str) -> io::Result<Step> {
        let (resume, block_id) = match self.record_behind(pos, pad)? {
            Some(rec) => (rec.offset + rec.record_len, Some(rec.header.block_id)),
            None => (pos + 1, None),
        };
        Ok(Step::Bad {
            reason: format!("{reason} (record at offset {pos})"),
            resume,
            block_id,
        })
    }

    /// The sound record whose meta starts `pad` bytes after `pos`, if there
    /// is one and that much padding is what a record at `pos` would have.
    fn record_behind(&mut self, pos: u64, pad: u64) -> io::Result<Option<ScannedRecord>> {
        if pad == 0 || self.len - pos <= pad {
            return Ok(None);
        }
        Ok(match self.examine_meta(pos + pad)? {
            Step::Record(rec)
                if format::placement_ok(
                    self.version,
                    pos,
                    pad,
                    self.meta_len,
                    rec.header.stored_len,
                ) =>
            {
                Some(rec)
            }
            _ => None,
        })
    }

    /// [`Scanner::examine`] of the record whose meta starts at `pos`.
    fn examine_meta(&mut self, pos: u64) -> io::Result<Step> {
        let remaining = self.len - pos;
        let header = match self.read_meta(pos)? {
            Some(Ok(h)) => h,
            Some(Err(reason)) => {
                return Ok(Step::Bad {
                    reason: format!("{reason} (at offset {pos})"),
                    resume: pos + 1,
                    block_id: None,
                })
            }
            None => {
                // Fewer bytes than a header and tokens: a torn append if they
                // begin like a record, else garbage.
                let mut head = [0u8; RECORD_MAGIC.len()];
                let n = head.len().min(remaining as usize);
                self.r.read_exact_at(&mut head[..n], pos)?;
                if head[..n] == RECORD_MAGIC[..n] {
                    return Ok(Step::Torn);
                }
                return Ok(Step::Bad {
                    reason: format!("{remaining} bytes at the end that are not a record"),
                    resume: pos + 1,
                    block_id: None,
                });
            }
        };
        let record_len = header.record_len();
        if record_len > remaining {
            return Ok(Step::Torn);
        }
        let mut crc = 0u32;
        let mut at = pos + header.meta_len() as u64;
        let mut left = header.stored_len;
        self.chunk
            .resize(PAYLOAD_CHUNK.min(header.stored_len as usize), 0);
        while left > 0 {
            let n = PAYLOAD_CHUNK.min(left as usize);
            self.r.read_exact_at(&mut self.chunk[..n], at)?;
            crc = crate::crc::append(crc, &self.chunk[..n]);
            at += n as u64;
            left -= n as u64;
        }
        if crc != header.stored_crc {
            return Ok(Step::Bad {
                reason: format!("stored payload checksum mismatch (record at offset {pos})"),
                resume: pos + record_len,
                block_id: Some(header.block_id),
            });
        }
        Ok(Step::Record(ScannedRecord {
            offset: pos,
            record_len,
            tokens: record::tokens(&self.meta).collect(),
            header,
        }))
    }

    /// The first offset at or after `from` that holds a record magic, a
    /// header that decodes and a header checksum that holds.
    fn resync(&mut self, from: u64) -> io::Result<Option<u64>> {
        let meta_len = self.meta_len as u64;
        // A candidate needs its whole meta in the file to be checked.
        let Some(last) = self.len.checked_sub(meta_len) else {
            return Ok(None);
        };
        let mut base = from;
        while base <= last {
            let positions = (RESYNC_WINDOW as u64).min(last - base + 1) as usize;
            // A whole fixed header at every position, so candidates are
            // decoded from the window; meta_len >= RECORD_HEADER_LEN keeps
            // this inside the file.
            self.window.resize(positions + RECORD_HEADER_LEN - 1, 0);
            self.r.read_exact_at(&mut self.window, base)?;
            let mut i = 0;
            while let Some(k) = self.window[i..positions + RECORD_MAGIC.len() - 1]
                .windows(RECORD_MAGIC.len())
                .position(|w| w == RECORD_MAGIC)
            {
                let j = i + k;
                let at = base + j as u64;
                if record::decode_checked(&self.window[j..j + RECORD_HEADER_LEN], self.layout)
                    .is_ok_and(|h| format::placement_ok(self.version, at, 0, self.meta_len, h.stored_len))
                    && matches!(self.read_meta(base + j as u64)?, Some(Ok(_)))
                {
                    return Ok(Some(base + j as u64));
                }
                i = j + 1;
            }
            base += positions as u64;
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::encode_segment_header_of;
    /// The scanner's version-1 cases: records back to back.
    fn encode_segment_header(segment: u64) -> [u8; SEGMENT_HEADER_LEN] {
        encode_segment_header_of(segment, 1)
    }
    use crate::record::{encode_meta as encode_record_meta, FLAG_SHUFFLE, FLAG_ZSTD};
    use crate::layout::DType;
    use std::cell::Cell;

    /// 1 layer, 1 head, `head_dim` 4, fp16, 2 tokens: 32-byte blocks.
    fn layout() -> Layout {
        Layout::new(1, 1, 4, DType::Float16, 2).unwrap()
    }

    /// 128 KiB blocks: payloads a version-2 segment aligns (and the
    /// "compressed" ones, half as large, too).
    fn big_layout() -> Layout {
        Layout::new(1, 1, 8192, DType::Float16, 4).unwrap()
    }

    fn scan_big(bytes: &[u8]) -> (ScanReport, Vec<ScannedRecord>) {
        let mut found = Vec::new();
        let report = scan_segment(bytes, &big_layout(), |r| found.push(r)).unwrap();
        check_coverage(&report, &found);
        (report, found)
    }

    struct Built {
        bytes: Vec<u8>,
        /// (offset, length, block id) per record.
        records: Vec<(u64, u64, BlockId)>,
    }

    fn payload(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| seed.wrapping_mul(31).wrapping_add((i as u8).wrapping_mul(7)))
            .collect()
    }

    /// A version-1 segment with `n` records; every third one "compressed"
    /// (the scanner checks the stored bytes only, so any shorter payload
    /// will do).
    fn segment(layout: &Layout, n: u8) -> Built {
        segment_of(layout, n, 1)
    }

    /// [`segment`] of `version`: in version 2 each record starts with the
    /// zeros that align its payload.
    fn segment_of(layout: &Layout, n: u8, version: u32) -> Built {
        let mut bytes = encode_segment_header_of(7, version).to_vec();
        let mut records = Vec::new();
        let raw_len = layout.block_bytes();
        for k in 0..n {
            let id = [k + 1; 32];
            let tokens: Vec<u32> = (0..layout.block_size).map(|t| t + 100 * u32::from(k)).collect();
            let raw = payload(k, raw_len);
            let raw_crc = crc32c::crc32c(&raw);
            let (flags, stored) = if k % 3 == 2 {
                (FLAG_ZSTD | FLAG_SHUFFLE, payload(k ^ 0x55, raw_len / 2))
            } else {
                (0, raw)
            };
            let stored_crc = crc32c::crc32c(&stored);
            let meta = encode_record_meta(
                flags,
                &id,
                &tokens,
                stored.len() as u64,
                raw_len as u64,
                stored_crc,
                raw_crc,
            );
            let offset = bytes.len() as u64;
            let pad = format::pad_before(version, offset, meta.len(), stored.len() as u64);
            bytes.resize(bytes.len() + pad as usize, 0);
            bytes.extend_from_slice(&meta);
            bytes.extend_from_slice(&stored);
            records.push((offset, bytes.len() as u64 - offset, id));
        }
        Built { bytes, records }
    }

    fn scan(bytes: &[u8]) -> (ScanReport, Vec<ScannedRecord>) {
        let mut found = Vec::new();
        let report = scan_segment(bytes, &layout(), |r| found.push(r)).unwrap();
        check_coverage(&report, &found);
        (report, found)
    }

    /// Header, records, damage and torn tail tile the file, in order.
    fn check_coverage(report: &ScanReport, found: &[ScannedRecord]) {
        let mut spans: Vec<(u64, u64)> = Vec::new();
        if report.segment.is_some() {
            spans.push((0, SEGMENT_HEADER_LEN as u64));
        }
        spans.extend(found.iter().map(|r| (r.offset, r.offset + r.record_len)));
        spans.extend(report.damaged.iter().map(|d| (d.start, d.end)));
        if let Some(t) = report.torn_tail {
            spans.push((t, report.file_len));
        }
        spans.sort_unstable();
        let mut at = 0;
        for (s, e) in spans {
            assert_eq!(s, at, "gap or overlap at {at}: {report:?}");
            assert!(e > s || report.file_len == 0, "empty span at {s}");
            at = e;
        }
        assert_eq!(at, report.file_len, "{report:?}");
        assert_eq!(report.records, found.len() as u64);
        assert!(report.valid_len <= report.file_len);
    }

    fn offsets(found: &[ScannedRecord]) -> Vec<u64> {
        found.iter().map(|r| r.offset).collect()
    }

    #[test]
    fn clean_segment_scans_fully() {
        let l = layout();
        let b = segment(&l, 6);
        let (report, found) = scan(&b.bytes);
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.segment, Some(7));
        assert_eq!(report.records, 6);
        assert_eq!(report.valid_len, b.bytes.len() as u64);
        for (rec, (off, len, id)) in found.iter().zip(&b.records) {
            assert_eq!(
                (rec.offset, rec.record_len, rec.header.block_id),
                (*off, *len, *id)
            );
            assert_eq!(rec.tokens.len(), l.block_size as usize);
        }
        assert_eq!(found[2].header.flags, FLAG_ZSTD | FLAG_SHUFFLE);
        assert_eq!(found[1].tokens, vec![100, 101]);
    }

    #[test]
    fn version_2_records_are_padded_checked_and_found() {
        let l = big_layout();
        let b = segment_of(&l, 5, 2);
        let (report, found) = scan_big(&b.bytes);
        assert!(report.is_clean(), "{report:?}");
        for (rec, (off, len, id)) in found.iter().zip(&b.records) {
            assert_eq!((rec.offset, rec.record_len, rec.header.block_id), (*off, *len, *id));
            let payload = rec.offset + rec.record_len - rec.header.stored_len;
            assert_eq!(payload % format::PAYLOAD_ALIGN, 0);
        }
        // Every byte of a record, padding included, is checked. Damaged
        // padding damages the whole record, however sound the rest of it:
        // skipped whole and named (as reads and `verify` see it), never
        // found where its meta starts. The records after it keep their
        // padding.
        for k in [0usize, 2, 4] {
            let (off, len, id) = b.records[k];
            let meta = off + format::pad_before(2, off, meta_len_of(&l), u64::MAX);
            let meta_end = meta + meta_len_of(&l) as u64;
            let some = (off..meta_end).step_by(97).chain((meta_end..off + len).step_by(7919));
            for at in some.chain([off, meta - 1, meta, meta_end, off + len - 1]) {
                let mut bad = b.bytes.clone();
                bad[at as usize] ^= 0x20;
                let (report, found) = scan_big(&bad);
                assert_eq!(report.damaged.len(), 1, "flip at {at}: {report:?}");
                let d = &report.damaged[0];
                assert_eq!(d.start, off, "flip at {at}");
                assert_eq!(report.torn_tail, None);
                assert_eq!(found.len(), 4, "flip at {at}: {report:?}");
                assert!(found.iter().all(|r| r.offset != off && r.offset != meta));
                if at < meta || at >= meta_end {
                    // The header held: the range is exactly the record, and
                    // the rest are found whole. (After a damaged header the
                    // next record is found by its magic, after its padding.)
                    assert_eq!((d.end, d.block_id), (off + len, Some(id)), "flip at {at}");
                    let others: Vec<u64> =
                        b.records.iter().map(|r| r.0).filter(|&o| o != off).collect();
                    assert_eq!(offsets(&found), others, "flip at {at}: {report:?}");
                }
                if at < meta {
                    assert!(d.reason.contains("padding"), "flip at {at}: {}", d.reason);
                }
            }
        }
        // A record magic written over the start of a padding (where the
        // scan would look for an unpadded record): the record behind it is
        // damaged all the same, and named.
        let (off, len, id) = b.records[1];
        let mut bad = b.bytes.clone();
        bad[off as usize..off as usize + 4].copy_from_slice(&RECORD_MAGIC);
        let (report, found) = scan_big(&bad);
        assert_eq!(found.len(), 4, "{report:?}");
        let d = &report.damaged[0];
        assert_eq!((d.start, d.end, d.block_id), (off, off + len, Some(id)));
        // Torn anywhere in the last record, its padding included.
        let (off, len, _) = b.records[4];
        for cut in (off + 1..off + len).step_by(1009) {
            let (report, found) = scan_big(&b.bytes[..cut as usize]);
            assert_eq!((found.len(), report.torn_tail), (4, Some(off)), "cut at {cut}");
            assert!(report.damaged.is_empty(), "cut at {cut}: {report:?}");
        }
        // A damaged header: both placements are accepted, records found.
        let mut bad = b.bytes.clone();
        bad[9] ^= 1;
        let (report, found) = scan_big(&bad);
        assert_eq!((report.segment, found.len()), (None, 5));
        // Small payloads are not padded: a version-2 segment of them holds
        // its records back to back.
        let small = segment_of(&layout(), 3, 2);
        let (report, found) = scan(&small.bytes);
        assert!(report.is_clean());
        assert_eq!(found[1].offset, found[0].offset + found[0].record_len);
        assert_eq!(found[0].record_len, segment(&layout(), 1).records[0].1);
    }

    #[test]
    fn misaligned_record_in_version_2_is_damage() {
        let l = big_layout();
        let b = segment_of(&l, 3, 2);
        let (off, len, _) = b.records[1];
        let pad = format::pad_before(2, off, meta_len_of(&l), u64::MAX) as usize;
        // Record 1 without its padding, back to back after record 0 (as in
        // version 1): sound bytes, misplaced.
        let mut bytes = b.bytes[..off as usize].to_vec();
        bytes.extend_from_slice(&b.bytes[off as usize + pad..(off + len) as usize]);
        let (report, found) = scan_big(&bytes);
        assert_eq!(found.len(), 1, "{report:?}");
        assert_eq!(report.damaged.len(), 1, "{report:?}");
        // The same bytes in a version-1 segment are a record.
        bytes[..SEGMENT_HEADER_LEN].copy_from_slice(&encode_segment_header(7));
        let (_, found) = scan_big(&bytes);
        assert_eq!(found.len(), 2);
    }

    fn meta_len_of(l: &Layout) -> usize {
        RECORD_HEADER_LEN + 4 * l.block_size as usize
    }

    #[test]
    fn empty_segment_and_short_files() {
        let (report, found) = scan(&encode_segment_header(3));
        assert!(report.is_clean());
        assert_eq!(
            (report.segment, report.valid_len, found.len()),
            (Some(3), 32, 0)
        );
        for n in [0usize, 1, 31] {
            let (report, _) = scan(&encode_segment_header(3)[..n]);
            assert_eq!((report.segment, report.torn_tail), (None, Some(0)));
        }
    }

    #[test]
    fn every_flipped_bit_is_damage_and_the_rest_is_found() {
        let l = layout();
        let b = segment(&l, 5);
        for k in [0usize, 2, 4] {
            let (off, len, _) = b.records[k];
            for at in off..off + len {
                for bit in [0x01u8, 0x80] {
                    let mut bad = b.bytes.clone();
                    bad[at as usize] ^= bit;
                    let (report, found) = scan(&bad);
                    let expect: Vec<u64> = b
                        .records
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != k)
                        .map(|(_, r)| r.0)
                        .collect();
                    assert_eq!(offsets(&found), expect, "flip {bit:#x} at {at}");
                    assert_eq!(report.damaged.len(), 1, "flip at {at}: {report:?}");
                    let d = &report.damaged[0];
                    assert_eq!((d.start, d.end), (off, off + len), "flip at {at}");
                    assert_eq!(report.torn_tail, None);
                    let valid = if k == 4 { off } else { b.bytes.len() as u64 };
                    assert_eq!(report.valid_len, valid, "flip at {at}");
                }
            }
        }
    }

    #[test]
    fn payload_damage_names_the_block() {
        let b = segment(&layout(), 3);
        let mut bad = b.bytes.clone();
        let (off, len, id) = b.records[1];
        bad[(off + len - 1) as usize] ^= 0xff;
        let (report, found) = scan(&bad);
        assert_eq!(found.len(), 2);
        assert_eq!(report.damaged[0].block_id, Some(id));
        assert!(report.damaged[0].reason.contains("payload checksum"));
    }

    #[test]
    fn damaged_segment_header_keeps_the_records() {
        let b = segment(&layout(), 3);
        for at in [0usize, 9, 17, 25] {
            let mut bad = b.bytes.clone();
            bad[at] ^= 4;
            let (report, found) = scan(&bad);
            assert_eq!(report.segment, None);
            assert_eq!(found.len(), 3);
            assert_eq!((report.damaged[0].start, report.damaged[0].end), (0, 32));
            assert_eq!(report.valid_len, b.bytes.len() as u64);
        }
    }

    #[test]
    fn truncated_tail_is_torn() {
        let b = segment(&layout(), 4);
        let (off, len, _) = b.records[3];
        for cut in off + 1..off + len {
            let (report, found) = scan(&b.bytes[..cut as usize]);
            assert_eq!(found.len(), 3, "cut at {cut}");
            assert_eq!(report.torn_tail, Some(off), "cut at {cut}");
            assert!(report.damaged.is_empty(), "cut at {cut}: {report:?}");
            assert_eq!(report.valid_len, off);
        }
    }

    #[test]
    fn zeroed_range_loses_only_what_it_covers() {
        let b = segment(&layout(), 5);
        let (o1, l1, _) = b.records[1];
        let (o2, _, _) = b.records[2];
        let mut bad = b.bytes.clone();
        // From the last bytes of record 1's payload into record 2's header.
        bad[(o1 + l1 - 4) as usize..(o2 + 20) as usize].fill(0);
        let (report, found) = scan(&bad);
        assert_eq!(
            offsets(&found),
            vec![b.records[0].0, b.records[3].0, b.records[4].0]
        );
        assert_eq!(report.damaged.first().map(|d| d.start), Some(o1));
        assert_eq!(report.damaged.last().map(|d| d.end), Some(b.records[3].0));
    }

    #[test]
    fn garbage_after_the_last_record() {
        let b = segment(&layout(), 2);
        let end = b.bytes.len() as u64;
        let mut seed = 12345u32;
        let garbage: Vec<u8> = (0..1000)
            .map(|_| {
                seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (seed >> 16) as u8
            })
            .collect();
        for tail in [&garbage[..], &garbage[..10], &[0u8; 200][..]] {
            let mut bytes = b.bytes.clone();
            bytes.extend_from_slice(tail);
            if tail[0] == RECORD_MAGIC[0] {
                continue;
            }
            let (report, found) = scan(&bytes);
            assert_eq!(found.len(), 2);
            assert_eq!(report.valid_len, end);
            assert_eq!(report.torn_tail, None);
            assert_eq!(report.damaged.len(), 1);
            assert_eq!(
                (report.damaged[0].start, report.damaged[0].end),
                (end, bytes.len() as u64)
            );
        }
    }

    #[test]
    fn record_of_another_layout_is_damage() {
        let l = layout();
        let b = segment(&l, 2);
        let mut bytes = b.bytes.clone();
        let raw = payload(9, 32);
        let crc = crc32c::crc32c(&raw);
        // Three tokens where the layout has two: right lengths otherwise.
        bytes.extend(encode_record_meta(
            0,
            &[9; 32],
            &[1, 2, 3],
            32,
            32,
            crc,
            crc,
        ));
        bytes.extend(&raw);
        bytes.extend(&segment(&l, 1).bytes[32..]);
        let (report, found) = scan(&bytes);
        assert_eq!(found.len(), 3);
        assert_eq!(report.damaged.len(), 1);
        assert!(report.damaged[0].reason.contains("tokens"), "{report:?}");
    }

    /// Records every read's size, to prove no read is sized by the file.
    struct Counting<'a> {
        bytes: &'a [u8],
        largest: Cell<usize>,
    }

    impl ReadAt for Counting<'_> {
        fn size(&self) -> io::Result<u64> {
            self.bytes.size()
        }
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            self.largest.set(self.largest.get().max(buf.len()));
            self.bytes.read_exact_at(buf, offset)
        }
    }

    #[test]
    fn absurd_lengths_allocate_nothing_big() {
        let l = layout();
        let mut bytes = encode_segment_header(1).to_vec();
        for (n_tok, stored, raw) in [
            (2usize, u64::MAX, 32u64),
            (2, 1 << 40, 1 << 40),
            (2, 16, u64::MAX),
            (100_000, 32, 32),
        ] {
            let tokens = vec![0u32; n_tok];
            bytes.extend(encode_record_meta(
                FLAG_ZSTD, &[1; 32], &tokens, stored, raw, 0, 0,
            ));
        }
        let good = segment(&l, 1);
        bytes.extend(&good.bytes[32..]);
        let r = Counting {
            bytes: &bytes,
            largest: Cell::new(0),
        };
        let mut found = Vec::new();
        let report = scan_segment(&r, &l, |rec| found.push(rec)).unwrap();
        check_coverage(&report, &found);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].header.block_id, good.records[0].2);
        assert!(
            r.largest.get() < RESYNC_WINDOW + RECORD_HEADER_LEN,
            "{}",
            r.largest.get()
        );
    }

    #[test]
    fn record_claiming_past_the_end_is_torn() {
        let b = segment(&layout(), 2);
        let mut bytes = b.bytes.clone();
        let end = bytes.len() as u64;
        // A sound header whose payload never made it to disk.
        bytes.extend(encode_record_meta(
            FLAG_ZSTD,
            &[3; 32],
            &[1, 2],
            20,
            32,
            0,
            0,
        ));
        let (report, found) = scan(&bytes);
        assert_eq!(found.len(), 2);
        assert_eq!(report.torn_tail, Some(end));
        assert!(report.damaged.is_empty());
    }

    #[test]
    fn scans_a_file_and_large_resync_windows() {
        let l = layout();
        let b = segment(&l, 3);
        // Damage, then more than one resync window of junk, then records.
        let mut bytes = b.bytes.clone();
        bytes[b.records[0].0 as usize] = b'X';
        let rest = bytes.split_off(b.records[1].0 as usize);
        // Magics that straddle every window boundary, none of them a record.
        for _ in 0..=(3 * RESYNC_WINDOW / 4) {
            bytes.extend_from_slice(&RECORD_MAGIC);
        }
        bytes.extend_from_slice(b"KV");
        bytes.extend(rest);
        let mut f = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut f, &bytes).unwrap();
        let mut found = Vec::new();
        let report = scan_segment(&f, &l, |r| found.push(r)).unwrap();
        check_coverage(&report, &found);
        assert_eq!(found.len(), 2);
        assert_eq!(report.damaged.len(), 1);
        assert_eq!(report.valid_len, bytes.len() as u64);
        assert_eq!(report, scan(&bytes).0);
    }

    #[test]
    fn slice_reads_are_bounds_checked() {
        let b: &[u8] = &[1, 2, 3];
        let mut buf = [0u8; 2];
        assert!(b.read_exact_at(&mut buf, 2).is_err());
        assert!(b.read_exact_at(&mut buf, u64::MAX).is_err());
        b.read_exact_at(&mut buf, 1).unwrap();
        assert_eq!(buf, [2, 3]);
    }
}
