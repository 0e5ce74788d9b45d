//! Payload codecs: how a block's raw bytes become a record's stored
//! payload and back (zstd over byte planes; the exponent plane of 16-bit
//! elements). The record around them (header, checksums, flags) is
//! [`crate::record`]'s; the bytes are drawn in [`crate::format`].

use crate::error::{Error, Result};
use crate::record::RecordHeader;

/// How a record's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// As given.
    Raw,
    /// One zstd frame at this level (1 to 22) over byte planes.
    Zstd(i32),
    /// For 16-bit elements: the exponent plane entropy-coded, the mantissa
    /// plane raw ([`FLAG_EXPONENT`](crate::record::FLAG_EXPONENT)); other elements are stored raw.
    Exponent,
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


pub(crate) fn zstd_error(e: std::io::Error) -> Error {
    Error::Io {
        context: "zstd compress".into(),
        source: e,
    }
}

thread_local! {
    /// One compression context per thread, reused: making one costs about as
    /// much as compressing a small block.
    static EXPONENT_CCTX: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
    static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// The exponent plane's compressor. Its bytes repeat a few values in no
/// order, so nearly all the gain is the Huffman coding of literals; the
/// match finder only costs time. So: zstd's fast strategy with the smallest
/// hash table and the longest minimum match, which finds almost no matches
/// (on `randn * 0.05` in bf16: the plane to 0.33 of its size, at about three
/// times the speed of level 1, which gets 0.38).
fn exponent_compressor() -> std::io::Result<zstd::bulk::Compressor<'static>> {
    use zstd::zstd_safe::{CParameter as P, Strategy};
    let mut c = zstd::bulk::Compressor::new(1)?;
    for p in [
        P::Strategy(Strategy::ZSTD_fast),
        P::WindowLog(17),
        P::HashLog(6),
        P::ChainLog(6),
        P::SearchLog(1),
        P::MinMatch(7),
        P::TargetLength(0),
    ] {
        c.set_parameter(p)?;
    }
    Ok(c)
}

/// [`FLAG_EXPONENT`](crate::record::FLAG_EXPONENT)'s payload of 16-bit runs: the zstd frame of the high
/// bytes, then the low bytes.
pub(crate) fn encode_exponent(chunks: &[&[u8]]) -> Result<Vec<u8>> {
    let n: usize = chunks.iter().map(|c| c.len() / 2).sum();
    let mut low = Vec::with_capacity(n);
    let mut high = Vec::with_capacity(n);
    for c in chunks {
        split_planes(c, &mut low, &mut high);
    }
    let mut out = EXPONENT_CCTX.with(|cell| -> Result<Vec<u8>> {
        let mut cell = cell.borrow_mut();
        let cctx = match &mut *cell {
            Some(c) => c,
            None => cell.insert(exponent_compressor().map_err(zstd_error)?),
        };
        let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(n) + n);
        cctx.compress_to_buffer(&high[..], &mut out)
            .map_err(zstd_error)?;
        Ok(out)
    })?;
    out.extend_from_slice(&low);
    Ok(out)
}

/// Appends the low and the high byte of each 16-bit element of `src`.
fn split_planes(src: &[u8], low: &mut Vec<u8>, high: &mut Vec<u8>) {
    low.extend(src.chunks_exact(2).map(|e| e[0]));
    high.extend(src.chunks_exact(2).map(|e| e[1]));
}

/// Interleaves planes back into 16-bit elements.
fn join_planes(low: &[u8], high: &[u8], dst: &mut [u8]) {
    for ((e, &l), &h) in dst.chunks_exact_mut(2).zip(low).zip(high) {
        e[0] = l;
        e[1] = h;
    }
}

/// Decodes a [`FLAG_EXPONENT`](crate::record::FLAG_EXPONENT) payload (checksum of the stored bytes already
/// checked) straight into `out`.
pub(crate) fn decode_exponent(
    raw_len: usize,
    h: &RecordHeader,
    stored: &[u8],
    out: &mut [&mut [u8]],
    scratch: &mut Vec<u8>,
) -> Result<(), String> {
    let n = raw_len / 2;
    // check_shape made sure the frame is at least one byte.
    let (frame, low) = stored.split_at(stored.len() - n);
    scratch.clear();
    scratch.reserve(n);
    let got = DCTX.with(|cell| -> Result<usize, String> {
        let mut cell = cell.borrow_mut();
        let dctx = match &mut *cell {
            Some(d) => d,
            None => cell.insert(zstd::bulk::Decompressor::new().map_err(|e| format!("zstd: {e}"))?),
        };
        dctx.decompress_to_buffer(frame, scratch)
            .map_err(|e| format!("zstd: {e}"))
    })?;
    if got != n || scratch.len() != n {
        return Err(format!("zstd frame decodes to {got} bytes, expected {n}"));
    }
    let mut at = 0;
    let mut crc = 0;
    for dst in out.iter_mut() {
        let m = dst.len() / 2;
        join_planes(&low[at..at + m], &scratch[at..at + m], dst);
        crc = crc32c::crc32c_append(crc, dst);
        at += m;
    }
    if at != n {
        return Err("record runs do not match its length".into());
    }
    if crc != h.raw_crc {
        return Err("decoded payload checksum mismatch".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
