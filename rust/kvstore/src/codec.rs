//! Payload codecs: how a block's raw bytes become a record's stored
//! payload and back (zstd over byte planes; the exponent plane of 16-bit
//! elements). The record around them (header, checksums, flags) is
//! [`crate::record`]'s; the bytes are drawn in [`crate::format`].

use crate::error::{Error, Result};
use std::sync::Mutex;

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
    /// One decompression context per thread, reused.
    static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// What encoding an exponent payload needs besides its output: a zstd
/// context (making one costs about as much as compressing a small block)
/// and the block's planes (high bytes, then low).
struct ExponentScratch {
    cctx: zstd::bulk::Compressor<'static>,
    planes: Vec<u8>,
}

/// Idle [`ExponentScratch`]es. Shared rather than per thread: a put's
/// encoder threads live for one window of blocks, and per-thread state was
/// made and faulted in again for each window (4% of the put's CPU time).
/// One per thread encoding at once is taken; at most [`SCRATCH_MAX`] are
/// kept.
static SCRATCH: Mutex<Vec<ExponentScratch>> = Mutex::new(Vec::new());

/// More than the cores of the machines this runs on encode at once.
const SCRATCH_MAX: usize = 16;

/// Payload buffers handed back once their record is written, for the next
/// blocks' encoding. A fresh buffer of a block's size is mapped anew by the
/// allocator and each of its pages faults on first write: about 40 faults
/// per 256 KiB block, measured at a third of an exponent put's CPU time.
/// At most [`SPARE_MAX`] are kept.
static SPARE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// Two of the put's encoding windows (`ENCODE_WINDOW` in `store/put.rs`):
/// as many buffers as a put holds in flight, so keeping them idle does not
/// raise the peak memory; and, for large blocks, at most [`SPARE_BYTES`].
const SPARE_MAX: usize = 32;
const SPARE_BYTES: usize = 32 << 20;

/// An empty buffer with room for `capacity` bytes, a spare one if any.
fn spare_buffer(capacity: usize) -> Vec<u8> {
    let mut buf = SPARE
        .lock()
        .ok()
        .and_then(|mut s| s.pop())
        .unwrap_or_default();
    buf.clear();
    buf.reserve(capacity);
    buf
}

/// Hands a payload buffer back for [`spare_buffer`] once its bytes are
/// written (dropped when enough are kept).
pub(crate) fn recycle(buf: Vec<u8>) {
    if let Ok(mut spare) = SPARE.lock() {
        let kept: usize = spare.iter().map(Vec::capacity).sum();
        if spare.len() < SPARE_MAX && kept + buf.capacity() <= SPARE_BYTES {
            spare.push(buf);
        }
    }
}

/// The exponent plane's compressor: Huffman-coded literals and nothing
/// else. The plane's bytes repeat a few values in no order, so all of the
/// gain is the entropy coding; zstd's match finder only costs time (level 1
/// gets the plane to 0.38 of its size, literals alone to 0.33). The fast
/// strategy reads `target_length` as how far to skip ahead after a miss, so
/// at its largest the matcher looks at a handful of positions per block;
/// literal compression is then off by default and is forced on. The output is
/// an ordinary zstd frame: any decoder reads it, and records written with the
/// previous settings (a few matches found) decode the same way.
fn exponent_compressor() -> std::io::Result<zstd::bulk::Compressor<'static>> {
    use zstd::zstd_safe::{CParameter as P, ParamSwitch, Strategy};
    let mut c = zstd::bulk::Compressor::new(1)?;
    for p in [
        P::Strategy(Strategy::ZSTD_fast),
        P::WindowLog(17),
        P::HashLog(6),
        P::ChainLog(6),
        P::SearchLog(1),
        P::MinMatch(7),
        P::TargetLength(1 << 17),
        P::LiteralCompressionMode(ParamSwitch::Enable),
    ] {
        c.set_parameter(p)?;
    }
    Ok(c)
}

/// [`FLAG_EXPONENT`](crate::record::FLAG_EXPONENT)'s payload of 16-bit
/// runs: the zstd frame of the high bytes, then the low bytes.
pub(crate) fn encode_exponent(chunks: &[&[u8]]) -> Result<Vec<u8>> {
    let n: usize = chunks.iter().map(|c| c.len() / 2).sum();
    let idle = SCRATCH.lock().ok().and_then(|mut s| s.pop());
    let mut scratch = match idle {
        Some(s) => s,
        None => ExponentScratch {
            cctx: exponent_compressor().map_err(zstd_error)?,
            planes: Vec::new(),
        },
    };
    if scratch.planes.len() < 2 * n {
        scratch.planes.resize(2 * n, 0);
    }
    let (high, low) = scratch.planes[..2 * n].split_at_mut(n);
    let mut at = 0;
    for c in chunks {
        let m = c.len() / 2;
        split_planes(c, &mut low[at..at + m], &mut high[at..at + m]);
        at += m;
    }
    let mut out = spare_buffer(zstd::zstd_safe::compress_bound(n) + n);
    let res = scratch.cctx.compress_to_buffer(&*high, &mut out);
    out.extend_from_slice(low);
    if let Ok(mut idle) = SCRATCH.lock() {
        if idle.len() < SCRATCH_MAX {
            idle.push(scratch);
        }
    }
    res.map_err(zstd_error)?;
    Ok(out)
}

/// Elements split per step: their words stay in a stack buffer in L1.
const SPLIT_STEP: usize = 1024;

/// Writes the low and the high byte of each 16-bit element of `src` into
/// `low` and `high` (`src.len() / 2` bytes each). Written as a copy into
/// 16-bit words and then one narrowing per plane because those two loops
/// vectorize (about 20 GiB/s), while picking every other byte of `src`
/// does not (about 4).
fn split_planes(src: &[u8], low: &mut [u8], high: &mut [u8]) {
    let mut words = [0u16; SPLIT_STEP];
    let steps = src
        .chunks(2 * SPLIT_STEP)
        .zip(low.chunks_mut(SPLIT_STEP))
        .zip(high.chunks_mut(SPLIT_STEP));
    for ((s, l), h) in steps {
        let words = &mut words[..l.len()];
        for (w, e) in words.iter_mut().zip(s.chunks_exact(2)) {
            *w = u16::from_le_bytes([e[0], e[1]]);
        }
        for ((l, h), &w) in l.iter_mut().zip(h.iter_mut()).zip(words.iter()) {
            *l = w as u8;
            *h = (w >> 8) as u8;
        }
    }
}

/// Interleaves planes back into 16-bit elements (this loop vectorizes).
fn join_planes(low: &[u8], high: &[u8], dst: &mut [u8]) {
    for ((e, &l), &h) in dst.chunks_exact_mut(2).zip(low).zip(high) {
        e[0] = l;
        e[1] = h;
    }
}

/// Decodes an exponent-coded payload (the record's `FLAG_EXPONENT`; checksum of the
/// stored bytes already checked) straight into `out`, whose bytes must checksum to
/// `raw_crc` (the record's checksum of the uncompressed block).
pub(crate) fn decode_exponent(
    raw_len: usize,
    raw_crc: u32,
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
        crc = crate::crc::append(crc, dst);
        at += m;
    }
    if at != n {
        return Err("record runs do not match its length".into());
    }
    if crc != raw_crc {
        return Err("decoded payload checksum mismatch".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_split_and_join() {
        // Odd lengths and more than one step of the split.
        for n in [0, 1, 7, SPLIT_STEP, SPLIT_STEP + 3, 3 * SPLIT_STEP - 1] {
            let src: Vec<u8> = (0..2 * n).map(|i| (i * 7 + i / 256) as u8).collect();
            let (mut low, mut high) = (vec![0u8; n], vec![0u8; n]);
            split_planes(&src, &mut low, &mut high);
            let want_low: Vec<u8> = src.iter().step_by(2).copied().collect();
            let want_high: Vec<u8> = src.iter().skip(1).step_by(2).copied().collect();
            assert_eq!((&low, &high), (&want_low, &want_high), "{n} elements");
            let mut back = vec![0u8; 2 * n];
            join_planes(&low, &high, &mut back);
            assert_eq!(back, src, "{n} elements");
        }
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
}
