//! A read's blocks split among reader threads: how many threads a read of
//! so many bytes starts, the consecutive ranges they take, and running the
//! ranges (the calling thread takes the first) with the result the
//! one-thread walk would have had. Gets (`read`) and paged loads (`paged`)
//! both use it.

use super::Snap;
use crate::error::Result;
use std::sync::OnceLock;

/// Reader threads a get uses at most (the calling one included): reads in
/// flight stay few, and a get leaves cores to the others.
const MAX_READERS: usize = 4;

/// Bytes a reader thread must have to read for a get to start it: below this
/// a thread's start (tens of µs, more on a busy machine, where it waits for
/// a core) costs more than it saves. Copies from memory (the hot tier, the
/// page cache) need 4 MiB each: a 4 MiB restore (256 tokens of 16 KiB) on
/// one thread measured as fast or faster than on two, cold reads included
/// (the kernel's readahead keeps one stream busy). Direct reads, whose
/// threads wait on the device, need 1 MiB: more of them keep it busy.
const BYTES_PER_READER: usize = 4 << 20;
const BYTES_PER_DIRECT_READER: usize = 1 << 20;

/// Runs `work` over consecutive ranges of a read's blocks, each given as
/// (its length, its work): the first on the calling thread with `snap`, the
/// others on scoped threads named `name`, each taking its own snapshot.
/// Returns the blocks served as the one-thread walk would count them: in
/// range order, up to and including the first range that served fewer than
/// its length (an error past that is never reached).
pub(super) fn in_ranges<'s, W, F>(
    snap: &mut Option<Snap<'s>>,
    name: &str,
    mut ranges: impl Iterator<Item = (usize, W)>,
    work: &F,
) -> Result<usize>
where
    W: Send,
    F: Fn(&mut Option<Snap<'s>>, W) -> Result<usize> + Sync,
{
    let Some((len0, first)) = ranges.next() else {
        return Ok(0);
    };
    let results: Vec<(usize, Result<usize>)> = std::thread::scope(|scope| {
        let spawned: Vec<_> = ranges
            .map(|(len, w)| {
                let handle = std::thread::Builder::new()
                    .name(name.into())
                    .spawn_scoped(scope, move || work(&mut None, w));
                (len, handle)
            })
            .collect();
        let mut results = vec![(len0, work(snap, first))];
        for (len, handle) in spawned {
            let res = match handle {
                Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                // No thread to be had: the range is not read, so the prefix
                // ends where it starts (a miss is always safe).
                Err(_) => Ok(0),
            };
            results.push((len, res));
        }
        results
    });
    let mut served = 0;
    for (len, res) in results {
        let got = res?;
        served += got;
        if got < len {
            break;
        }
    }
    Ok(served)
}

/// Reader threads for a get of `blocks` blocks of `block_bytes` each: one
/// per core (or, with `direct` reads, whose threads mostly wait on the
/// device, as many as keep it busy whatever the cores), at most
/// [`MAX_READERS`], each with [`BYTES_PER_READER`] ([`BYTES_PER_DIRECT_READER`])
/// or more; `forced` (the
/// `get_readers` option) overrides all but the block count.
pub(super) fn reader_threads(
    blocks: usize,
    block_bytes: usize,
    forced: Option<usize>,
    direct: bool,
) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    if let Some(n) = forced {
        return n.min(blocks).max(1);
    }
    let cores = *CORES
        .get_or_init(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    let (threads, per_reader) = if direct {
        (MAX_READERS, BYTES_PER_DIRECT_READER)
    } else {
        (cores, BYTES_PER_READER)
    };
    let by_size = blocks.saturating_mul(block_bytes) / per_reader;
    threads.min(MAX_READERS).min(by_size).min(blocks).max(1)
}

/// `0..n` cut into `threads` consecutive ranges: their bounds.
pub(super) fn range_bounds(n: usize, threads: usize) -> Vec<usize> {
    (0..n)
        .step_by(n.div_ceil(threads).max(1))
        .chain([n])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::reader_threads;

    const BLOCK: usize = 256 << 10;

    #[test]
    fn small_buffered_gets_stay_on_the_calling_thread() {
        // 256 tokens of bench_ttft's layout: 16 blocks of 256 KiB, 4 MiB.
        assert_eq!(reader_threads(16, BLOCK, None, false), 1);
        assert_eq!(reader_threads(31, BLOCK, None, false), 1);
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        assert_eq!(reader_threads(32, BLOCK, None, false), cores.min(2));
        assert_eq!(reader_threads(1 << 20, BLOCK, None, false), cores.min(4));
    }

    #[test]
    fn direct_reads_start_a_thread_per_mib() {
        assert_eq!(reader_threads(3, BLOCK, None, true), 1);
        assert_eq!(reader_threads(8, BLOCK, None, true), 2);
        assert_eq!(reader_threads(16, BLOCK, None, true), 4);
    }

    #[test]
    fn forced_readers_override_the_size_rule() {
        assert_eq!(reader_threads(16, BLOCK, Some(3), false), 3);
        assert_eq!(reader_threads(2, BLOCK, Some(3), false), 2);
    }
}
