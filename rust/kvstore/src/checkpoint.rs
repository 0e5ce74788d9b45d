//! Content hashes of model checkpoint files (the weights behind a model
//! fingerprint): the standard BLAKE3 of a whole file, as `b3sum` prints it,
//! computed on several threads in bounded memory.
//!
//! The file is cut into aligned subtrees of `SUBTREE` bytes (a power of two
//! of BLAKE3 chunks, so each is a node of the file's BLAKE3 tree). Threads
//! take subtrees in turn, stream each through a `PIECE`-byte buffer of their
//! own with positioned reads, and leave its chaining value; the values are
//! then merged along the tree's shape (`left_subtree_len`) into the root.
//! Memory: one buffer per thread, never the file. Reads, not a mapping: a
//! file truncated while it is hashed is then an error, not a `SIGBUS`.

use crate::error::{IoContext, Result};
use blake3::hazmat::{
    left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, ChainingValue, HasherExt, Mode,
};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of one subtree a thread hashes at a time: large enough that the
/// merges cost nothing, small enough that two threads share a 16 MiB file.
const SUBTREE: u64 = 8 << 20;

/// Bytes read at a time: small enough to stay in a core's L2 cache between
/// the read that fills it and the hash that consumes it.
const PIECE: usize = 256 << 10;

/// Where each buffer starts: the kernel's copy into a buffer that is not
/// cache-line aligned (malloc's 16 bytes past a page) runs at a fifth of its
/// speed on some CPUs (AMD EPYC, `rep movsb`).
const ALIGN: usize = 4096;

/// The BLAKE3 hash of the file at `path`, on up to `threads` threads (at
/// least one). Memory: one 260 KiB buffer per thread.
pub fn blake3_file(path: &Path, threads: usize) -> Result<blake3::Hash> {
    blake3_file_in(path, threads, SUBTREE)
}

fn blake3_file_in(path: &Path, threads: usize, subtree: u64) -> Result<blake3::Hash> {
    let context = || format!("hashing {}", path.display());
    let file = File::open(path).ctx(context)?;
    let len = file.metadata().ctx(context)?.len();
    if len <= subtree {
        let mut hasher = blake3::Hasher::new();
        feed(&file, &mut Buffer::new(), &mut hasher, 0, len).ctx(context)?;
        return Ok(hasher.finalize());
    }
    let count = len.div_ceil(subtree);
    let next = AtomicU64::new(0);
    let worker = || -> Result<Vec<(u64, ChainingValue)>> {
        // A description of its own per thread: the kernel's readahead follows
        // each thread's sequential run instead of one interleaved stream.
        let own = File::open(path).ctx(context)?;
        let _ = rustix::fs::fadvise(&own, 0, None, rustix::fs::Advice::Sequential);
        let mut buf = Buffer::new();
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= count {
                return Ok(done);
            }
            let start = i * subtree;
            // The whole subtree asked of the disk at once, so that from a cold
            // page cache the device has reads queued while this thread hashes.
            let _ = rustix::fs::fadvise(
                &own,
                start,
                std::num::NonZeroU64::new(subtree),
                rustix::fs::Advice::WillNeed,
            );
            let mut hasher = blake3::Hasher::new();
            hasher.set_input_offset(start);
            feed(&own, &mut buf, &mut hasher, start, subtree.min(len - start)).ctx(context)?;
            done.push((i, hasher.finalize_non_root()));
        }
    };
    let threads = threads.clamp(1, count as usize);
    let mut cvs = vec![[0u8; 32]; count as usize];
    std::thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(worker)).collect();
        for handle in handles {
            for (i, cv) in handle.join().expect("a hashing thread panicked")? {
                cvs[i as usize] = cv;
            }
        }
        Ok(())
    })?;
    let left = left_subtree_len(len);
    Ok(merge_subtrees_root(
        &merged(&cvs, subtree, 0, left),
        &merged(&cvs, subtree, left, len - left),
        Mode::Hash,
    ))
}

/// One thread's `PIECE` bytes, `ALIGN`-aligned.
struct Buffer(Vec<u8>);

impl Buffer {
    fn new() -> Self {
        Buffer(vec![0u8; PIECE + ALIGN])
    }

    fn piece(&mut self) -> &mut [u8] {
        let skip = self.0.as_ptr().addr().wrapping_neg() % ALIGN;
        &mut self.0[skip..skip + PIECE]
    }
}

/// Feeds `len` bytes of `file` from `start` to `hasher`, a piece at a time.
fn feed(
    file: &File,
    buf: &mut Buffer,
    hasher: &mut blake3::Hasher,
    start: u64,
    len: u64,
) -> std::io::Result<()> {
    let buf = buf.piece();
    let mut at = start;
    while at < start + len {
        let n = PIECE.min((start + len - at) as usize);
        // A short file (truncated since its length was read) fails here.
        file.read_exact_at(&mut buf[..n], at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(())
}

/// The chaining value of the tree node over `len` bytes from `start`, a
/// subtree-aligned range; built from the subtrees' values `cvs`. Every split
/// above one subtree falls on a subtree boundary: `left_subtree_len` of a
/// length past a power of two `subtree` is a power of two at least as large.
fn merged(cvs: &[ChainingValue], subtree: u64, start: u64, len: u64) -> ChainingValue {
    if len <= subtree {
        return cvs[(start / subtree) as usize];
    }
    let left = left_subtree_len(len);
    merge_subtrees_non_root(
        &merged(cvs, subtree, start, left),
        &merged(cvs, subtree, start + left, len - left),
        Mode::Hash,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        // Bytes that differ from chunk to chunk, so a misplaced subtree shows.
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 1024) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&bytes).unwrap();
        (f, bytes)
    }

    #[test]
    fn equals_the_plain_hash_of_the_bytes_whatever_the_split() {
        let chunk = blake3::CHUNK_LEN;
        for subtree in [1024u64, 2048, 8192] {
            for len in [
                0,
                1,
                chunk,
                chunk + 1,
                8 * chunk - 1,
                8 * chunk,
                8 * chunk + 1,
                13 * chunk + 5,
                64 * chunk,
                100 * chunk + 17,
            ] {
                let (f, bytes) = file_of(len);
                for threads in [1, 2, 5] {
                    assert_eq!(
                        blake3_file_in(f.path(), threads, subtree).unwrap(),
                        blake3::hash(&bytes),
                        "len {len}, subtree {subtree}, threads {threads}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_file_larger_than_a_subtree_and_a_piece() {
        let (f, bytes) = file_of((SUBTREE + 3 * PIECE as u64 + 11) as usize);
        assert_eq!(blake3_file(f.path(), 2).unwrap(), blake3::hash(&bytes));
    }

    #[test]
    fn a_missing_file_is_an_io_error_naming_it() {
        let e = blake3_file(Path::new("/nonexistent/model.safetensors"), 2).unwrap_err();
        assert!(matches!(e, crate::Error::Io { .. }), "{e:?}");
        assert!(
            e.to_string().contains("/nonexistent/model.safetensors"),
            "{e}"
        );
    }
}
