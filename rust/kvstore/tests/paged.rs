//! Gets and puts straight between the store and a paged cache laid out as
//! vLLM's CPU backend lays it (per block: K `[H][D][B]`, then V `[H][B][D]`,
//! then padding; B and D span a whole 8x8 tile of the engine's transpose and
//! an edge), checked against an element-by-element model of that
//! layout written here, not the engine's copy.

use kvstore::{DType, Durability, Error, Layout, Options, PagedLayout, PagedPart, Store};
use std::os::unix::fs::FileExt;

mod support;
use support::{kv_for, seq};

const B: usize = 12;
const H: usize = 2;
const D: usize = 10;
const L: usize = 2;
/// Elements per cache block: K and V, and 5 of padding.
const STRIDE: usize = 2 * B * H * D + 5;
const CACHE_BLOCKS: usize = 8;

fn layout() -> Layout {
    Layout::new(L as u32, H as u32, D as u32, DType::Float16, B as u32).unwrap()
}

fn paged() -> PagedLayout {
    PagedLayout {
        block_stride: STRIDE,
        parts: [
            PagedPart {
                offset: 0,
                strides: [1, D * B, B],
            },
            PagedPart {
                offset: B * H * D,
                strides: [D, B * D, 1],
            },
        ],
    }
}

/// The element offset of (K or V, token, head, dim) of cache block `n`, by
/// the layout's definition.
fn model_offset(n: usize, kv: usize, t: usize, h: usize, d: usize) -> usize {
    n * STRIDE
        + if kv == 0 {
            (h * D + d) * B + t
        } else {
            B * H * D + (h * B + t) * D + d
        }
}

fn open(dir: &std::path::Path, hot: Option<&std::path::Path>) -> Store {
    open_with(dir, hot, None)
}

/// `open` with `get_readers` (the threads of a paged get or put) forced.
fn open_with(
    dir: &std::path::Path,
    hot: Option<&std::path::Path>,
    readers: Option<usize>,
) -> Store {
    Store::open(
        dir,
        Options {
            fingerprint: Some("paged@1".into()),
            layout: Some(layout()),
            durability: Durability::Sync,
            hot_bytes: hot.map(|_| 16 << 20),
            hot_dir: hot.map(std::path::Path::to_path_buf),
            get_readers: readers,
            ..Options::default()
        },
    )
    .unwrap()
}

/// `L` layers of sentinel bytes.
fn caches() -> Vec<Vec<u8>> {
    vec![vec![0xEE; CACHE_BLOCKS * STRIDE * 2]; L]
}

/// `caches` with token block `i` of `tokens` (KV `kv_for`) in cache block
/// `blocks[i - first]`, for each `i` in `first..upto`, by the model.
fn model(tokens: &[u32], first: usize, upto: usize, blocks: &[usize]) -> Vec<Vec<u8>> {
    model_of(model_offset, tokens, first, upto, blocks)
}

/// `model` for the layout whose element offsets `offset` gives.
fn model_of(
    offset: fn(usize, usize, usize, usize, usize) -> usize,
    tokens: &[u32],
    first: usize,
    upto: usize,
    blocks: &[usize],
) -> Vec<Vec<u8>> {
    let l = layout();
    let kv = kv_for(&l, tokens);
    let t_all = tokens.len();
    let mut out = caches();
    for i in first..upto {
        let n = blocks[i - first];
        for (layer, cache) in out.iter_mut().enumerate() {
            for k in 0..2 {
                for t in 0..B {
                    for h in 0..H {
                        for d in 0..D {
                            let src = (((layer * 2 + k) * t_all + i * B + t) * H + h) * D + d;
                            let dst = offset(n, k, t, h, d);
                            cache[dst * 2..dst * 2 + 2].copy_from_slice(&kv[src * 2..src * 2 + 2]);
                        }
                    }
                }
            }
        }
    }
    out
}

fn get_paged(s: &Store, tokens: &[u32], start: usize, blocks: &[usize]) -> (usize, Vec<Vec<u8>>) {
    get_paged_as(s, &paged(), tokens, start, blocks)
}

fn get_paged_as(
    s: &Store,
    paged: &PagedLayout,
    tokens: &[u32],
    start: usize,
    blocks: &[usize],
) -> (usize, Vec<Vec<u8>>) {
    let mut c = caches();
    let mut spans: Vec<&mut [u8]> = c.iter_mut().map(|v| &mut v[..]).collect();
    let m = s
        .get_paged(tokens, start, b"", paged, &mut spans, blocks)
        .unwrap();
    (m, c)
}

/// A GPU backend's layout: each layer `[2][CACHE_BLOCKS][B][H][D]`, so a
/// block's V lies far past its K (not within one block stride).
fn split_paged() -> PagedLayout {
    PagedLayout {
        block_stride: B * H * D,
        parts: [
            PagedPart {
                offset: 0,
                strides: [H * D, D, 1],
            },
            PagedPart {
                offset: CACHE_BLOCKS * B * H * D,
                strides: [H * D, D, 1],
            },
        ],
    }
}

fn split_offset(n: usize, kv: usize, t: usize, h: usize, d: usize) -> usize {
    ((kv * CACHE_BLOCKS + n) * B + t) * H * D + h * D + d
}

#[test]
fn gets_land_where_the_layout_says_from_disk_and_hot_tier() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let tokens = seq(1, 5 * B + 2); // 5 full blocks and 2 tokens
    let kv = kv_for(&layout(), &tokens);
    open(dir.path(), None)
        .put(&tokens, &kv, 5 * B + 2, b"")
        .unwrap();
    let blocks = [6, 0, 3, 7];
    // On one thread, and over 2 and 3 (each writing its own cache blocks).
    for readers in [None, Some(2), Some(3)] {
        let hot = tempfile::tempdir().unwrap();
        for hot_dir in [None, Some(hot.path()), Some(hot.path())] {
            // Without a hot tier; then with one (from disk: a paged get does
            // not promote, a canonical get does); then from it.
            let s = open_with(dir.path(), hot_dir, readers);
            let (m, got) = get_paged(&s, &tokens, B, &blocks);
            assert_eq!(m, 5 * B);
            assert!(
                got == model(&tokens, 1, 5, &blocks),
                "{hot_dir:?} {readers:?}"
            );
            if hot_dir.is_some() {
                let st = s.stats().unwrap();
                let hot = s.hot_blocks(&tokens, b"").unwrap()[1].is_some();
                let want = if hot { (4, 0) } else { (0, 4) };
                assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), want);
                let mut out = vec![0u8; layout().kv_bytes(5 * B).unwrap()];
                assert_eq!(s.get_into(&tokens, b"", &mut out, 5 * B).unwrap(), 5 * B);
            }
            // V outside the block stride: one thread, whatever is asked.
            let (m, got) = get_paged_as(&s, &split_paged(), &tokens, B, &blocks);
            assert_eq!(m, 5 * B);
            assert!(got == model_of(split_offset, &tokens, 1, 5, &blocks));
            // A cache block named twice: one thread, the last block wins.
            let twice = [6, 0, 6, 7];
            let (m, got) = get_paged(&s, &tokens, B, &twice);
            assert_eq!(m, 5 * B);
            assert!(got == model(&tokens, 1, 5, &twice));
        }
    }
    drop(hot);
    // Fewer cache blocks than stored ones: only those land.
    let s = open(dir.path(), None);
    let (m, got) = get_paged(&s, &tokens, 0, &[2, 5]);
    assert_eq!(m, 2 * B);
    assert!(got == model(&tokens, 0, 2, &[2, 5]));
}

#[test]
fn puts_store_what_a_canonical_put_stores() {
    let l = layout();
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let tokens = seq(2, 5 * B + 3);
    let blocks = [4, 1, 7, 0, 2];
    let cache = model(&tokens, 0, 5, &blocks);
    let spans: Vec<&[u8]> = cache.iter().map(|v| &v[..]).collect();
    // Gathered over 2 threads (forced; the blocks are small).
    let s = open_with(a.path(), None, Some(2));
    // A chunked save: the first two blocks, then the rest.
    assert_eq!(
        s.put_paged(&tokens[..2 * B], 0, b"", &paged(), &spans, &blocks[..2])
            .unwrap(),
        2 * B
    );
    assert_eq!(
        s.put_paged(&tokens, 2 * B, b"", &paged(), &spans, &blocks[2..])
            .unwrap(),
        5 * B
    );
    let mut out = vec![0u8; l.kv_bytes(5 * B).unwrap()];
    assert_eq!(s.get_into(&tokens, b"", &mut out, 5 * B).unwrap(), 5 * B);
    assert!(out == kv_for(&l, &tokens[..5 * B]));
    // The same ids as a put of the canonical KV.
    let r = open(b.path(), None);
    r.put(&tokens, &kv_for(&l, &tokens), 5 * B + 3, b"")
        .unwrap();
    assert_eq!(
        s.block_ids(&tokens, b"").unwrap(),
        r.block_ids(&tokens, b"").unwrap()
    );
    assert_eq!(s.stats().unwrap().blocks_written, 5);
}

#[test]
fn a_damaged_block_is_not_landed_and_ends_the_hit() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let tokens = seq(3, 3 * B); // 3 blocks
    open(dir.path(), None)
        .put(&tokens, &kv_for(&l, &tokens), 3 * B, b"")
        .unwrap();
    // The second block's payload gets one byte flipped (see tests/store.rs).
    flip_record(dir.path(), 1);
    let s = open(dir.path(), None);
    let (m, got) = get_paged(&s, &tokens, 0, &[3, 5, 6]);
    assert_eq!(m, B);
    // Block 5 (the damaged one) and 6 keep their sentinel bytes.
    let one = model(&tokens, 0, 1, &[3]);
    assert!(got == one);
    // Quarantined now. A thread for each block: the third may have landed
    // block 6 before the second found the block missing (not reported: the
    // prefix still ends at 1 block), but never anything in block 5.
    let s = open_with(dir.path(), None, Some(3));
    let (m, got) = get_paged(&s, &tokens, 0, &[3, 5, 6]);
    assert_eq!(m, B);
    let all = model(&tokens, 0, 3, &[3, 5, 6]);
    let block6 = |c: &Vec<Vec<u8>>| -> Vec<Vec<u8>> {
        c.iter()
            .map(|l| l[6 * STRIDE * 2..7 * STRIDE * 2].to_vec())
            .collect()
    };
    let mut without6 = got.clone();
    for (layer, want) in without6.iter_mut().zip(&one) {
        layer[6 * STRIDE * 2..7 * STRIDE * 2]
            .copy_from_slice(&want[6 * STRIDE * 2..7 * STRIDE * 2]);
    }
    assert!(without6 == one);
    assert!(block6(&got) == block6(&one) || block6(&got) == block6(&all));
}

/// `caches` without cache block `n` of each layer (this file's layout).
fn without_block(caches: &[Vec<u8>], n: usize) -> Vec<Vec<u8>> {
    caches
        .iter()
        .map(|v| [&v[..n * STRIDE * 2], &v[(n + 1) * STRIDE * 2..]].concat())
        .collect()
}

/// Flips byte `at` of `path`.
fn flip(path: &std::path::Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[!byte[0]], at).unwrap();
}

/// Flips a byte of block `k`'s payload in the store's (only) segment.
fn flip_record(dir: &std::path::Path, k: usize) {
    let seg = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    flip(&seg, support::payload_offset(&layout(), k) + 5);
}

/// A store (and its hot tier's directory) holding 3 blocks of `tokens`, all
/// in the hot tier (a put writes through to it) and landed by a paged get
/// into `blocks`; with the arena file's path and where block 1's data lies
/// in it.
fn hot_store(
    tokens: &[u32],
    blocks: &[usize],
) -> (
    tempfile::TempDir,
    tempfile::TempDir,
    Store,
    std::path::PathBuf,
    u64,
) {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let s = open(dir.path(), Some(hot.path()));
    s.put(tokens, &kv_for(&layout(), tokens), 3 * B, b"")
        .unwrap();
    assert_eq!(get_paged(&s, tokens, 0, blocks).0, 3 * B);
    let arena = s.arena_file().unwrap().unwrap().0;
    let (_, _, at) = s.hot_blocks(tokens, b"").unwrap()[1].unwrap();
    (dir, hot, s, arena, at)
}

#[test]
fn a_hot_block_that_fails_its_check_after_landing_is_read_again_or_ends_the_hit() {
    // Blocks from the hot tier land four runs at a time and are checked
    // after the last: one damaged there has already put its bytes in the
    // cache.
    let l = layout();
    let tokens = seq(5, 3 * B);
    let blocks = [3, 5, 6];
    let (dir, _hot, s, arena, at) = hot_store(&tokens, &blocks);
    // Its last run damaged, so every run lands before the check fails: the
    // block is read again from its record, all of it.
    let last_run = at + (l.block_bytes() - 3) as u64;
    flip(&arena, last_run);
    let before = s.stats().unwrap();
    let (m, got) = get_paged(&s, &tokens, 0, &blocks);
    assert_eq!(m, 3 * B);
    assert!(got == model(&tokens, 0, 3, &blocks));
    let after = s.stats().unwrap();
    assert_eq!(after.hot_hit_blocks - before.hot_hit_blocks, 2);
    assert_eq!(after.disk_hit_blocks - before.disk_hit_blocks, 1);
    // The slot was rewritten with the record's checked bytes: the next load
    // lands all three from the hot tier, none from disk, and the same KV.
    let before = s.stats().unwrap();
    let (m, again) = get_paged(&s, &tokens, 0, &blocks);
    assert_eq!(m, 3 * B);
    assert!(again == got);
    let after = s.stats().unwrap();
    assert_eq!(after.hot_hit_blocks - before.hot_hit_blocks, 3);
    assert_eq!(after.disk_hit_blocks - before.disk_hit_blocks, 0);
    // Damaged in the hot tier again and now in its record too: the hit ends
    // before it, and block 6 is not touched.
    assert_eq!(s.hot_blocks(&tokens, b"").unwrap()[1].unwrap().2, at);
    flip(&arena, last_run);
    flip_record(dir.path(), 1);
    let (m, got) = get_paged(&s, &tokens, 0, &blocks);
    assert_eq!(m, B);
    let want = model(&tokens, 0, 1, &blocks[..1]);
    assert!(without_block(&got, 5) == without_block(&want, 5));
}

#[test]
fn hot_blocks_damaged_while_they_land_are_never_landed_wrong() {
    // Another process scribbling on a slot at any moment (a byte of block
    // 1's K flipped and flipped back, over and over) while loads run: each
    // load either checks out from the hot tier or reads the record again,
    // so every load is whole and right.
    let tokens = seq(6, 3 * B);
    let blocks = [7, 2, 4];
    let (_dir, _hot, s, arena, at) = hot_store(&tokens, &blocks);
    let want = model(&tokens, 0, 3, &blocks);
    let done = std::sync::atomic::AtomicBool::new(false);
    let wrong = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                flip(&arena, at + 7);
            }
        });
        let wrong = (0..200)
            .filter(|_| get_paged(&s, &tokens, 0, &blocks) != (3 * B, want.clone()))
            .count();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        wrong
    });
    assert_eq!(wrong, 0, "loads not whole and right");
}

#[test]
fn cache_blocks_outside_the_spans_are_refused_before_any_copy() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(4, 2 * B);
    let s = open(dir.path(), None);
    s.put(&tokens, &kv_for(&layout(), &tokens), 2 * B, b"")
        .unwrap();
    let mut c = caches();
    let mut spans: Vec<&mut [u8]> = c.iter_mut().map(|v| &mut v[..]).collect();
    let e = s
        .get_paged(&tokens, 0, b"", &paged(), &mut spans, &[0, CACHE_BLOCKS])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    assert!(c == caches());
    // A layer short by one byte cannot hold the last cache block either.
    let mut short = caches();
    short[1].truncate(((CACHE_BLOCKS - 1) * STRIDE + 2 * B * H * D) * 2 - 1);
    let mut spans: Vec<&mut [u8]> = short.iter_mut().map(|v| &mut v[..]).collect();
    let e = s
        .get_paged(&tokens, 0, b"", &paged(), &mut spans, &[CACHE_BLOCKS - 1])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    // Too few layers; a put with a block count that does not match its tokens.
    let mut spans: Vec<&mut [u8]> = c.iter_mut().take(1).map(|v| &mut v[..]).collect();
    assert!(s
        .get_paged(&tokens, 0, b"", &paged(), &mut spans, &[0])
        .is_err());
    let spans: Vec<&[u8]> = c.iter().map(|v| &v[..]).collect();
    assert!(s
        .put_paged(&tokens, 0, b"", &paged(), &spans, &[0])
        .is_err());
    // A cache block named twice in a save: its KV was stored under both
    // token blocks' ids.
    let other = seq(5, 2 * B);
    let e = s
        .put_paged(&other, 0, b"", &paged(), &spans, &[3, 3])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidInput(_)), "{e}");
    assert_eq!(s.lookup(&other, b"").unwrap(), 0);
}

/// A layout of 6 runs of 16 KiB (96 KiB a block, so a version-2 record's
/// payload is aligned after padding).
fn wide() -> Layout {
    Layout::new(3, 4, 64, DType::Float16, 32).unwrap()
}

const WIDE_BLOCKS: usize = 4;

/// A paged layout that keeps a block's K, then V, as canonical `[B, H, D]`
/// runs (the scatter itself is checked above; here, what lands when).
fn plain(l: &Layout) -> PagedLayout {
    let (h, d) = (l.num_kv_heads as usize, l.head_dim as usize);
    let n = l.block_size as usize * h * d;
    let part = |offset| PagedPart {
        offset,
        strides: [h * d, d, 1],
    };
    PagedLayout {
        block_stride: 2 * n,
        parts: [part(0), part(n)],
    }
}

/// Bytes of one run (K or V of one layer of one block).
fn run_bytes(l: &Layout) -> usize {
    l.block_size as usize * l.token_bytes()
}

/// `plain` caches of `WIDE_BLOCKS` blocks per layer, sentinel bytes, with
/// token block `i` of `tokens` in cache block `blocks[i]` for `i < upto`.
fn wide_model(l: &Layout, tokens: &[u32], upto: usize, blocks: &[usize]) -> Vec<Vec<u8>> {
    let kv = kv_for(l, tokens);
    let (t, tb, b, run) = (
        tokens.len(),
        l.token_bytes(),
        l.block_size as usize,
        run_bytes(l),
    );
    let mut out = vec![vec![0xEE; WIDE_BLOCKS * 2 * run]; l.num_layers as usize];
    for (i, &c) in blocks.iter().enumerate().take(upto) {
        for (layer, cache) in out.iter_mut().enumerate() {
            for k in 0..2 {
                let src = ((layer * 2 + k) * t + i * b) * tb;
                let dst = (2 * c + k) * run;
                cache[dst..dst + run].copy_from_slice(&kv[src..src + run]);
            }
        }
    }
    out
}

fn open_layout(dir: &std::path::Path, l: Layout, hot: Option<&std::path::Path>) -> Store {
    Store::open(
        dir,
        Options {
            fingerprint: Some("paged@1".into()),
            layout: Some(l),
            durability: Durability::Sync,
            hot_bytes: hot.map(|_| 16 << 20),
            hot_dir: hot.map(std::path::Path::to_path_buf),
            ..Options::default()
        },
    )
    .unwrap()
}

/// A store of layout `l` holding 3 blocks of `tokens`, no hot tier.
fn three_blocks(l: Layout, tokens: &[u32]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let s = open_layout(dir.path(), l, None);
    s.put(tokens, &kv_for(&l, tokens), tokens.len(), b"")
        .unwrap();
    dir
}

/// `get_paged` of `tokens` from 0 into `blocks` of fresh `plain` caches.
fn wide_get(s: &Store, l: &Layout, tokens: &[u32], blocks: &[usize]) -> (usize, Vec<Vec<u8>>) {
    let mut c = vec![vec![0xEE; WIDE_BLOCKS * 2 * run_bytes(l)]; l.num_layers as usize];
    let mut spans: Vec<&mut [u8]> = c.iter_mut().map(|v| &mut v[..]).collect();
    let m = s
        .get_paged(tokens, 0, b"", &plain(l), &mut spans, blocks)
        .unwrap();
    (m, c)
}

fn only_segment(dir: &std::path::Path) -> std::path::PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(segs.len(), 1);
    segs.pop().unwrap()
}

#[test]
fn records_of_many_runs_land_from_disk_and_are_not_promoted() {
    let l = wide();
    let b = l.block_size as usize;
    let tokens = seq(7, 3 * b);
    let dir = three_blocks(l, &tokens);
    let blocks = [3, 0, 2];
    let want = wide_model(&l, &tokens, 3, &blocks);
    let s = open_layout(dir.path(), l, None);
    assert_eq!(wide_get(&s, &l, &tokens, &blocks), (3 * b, want.clone()));
    assert_eq!(s.stats().unwrap().disk_hit_blocks, 3);
    // With a hot tier: read from disk, twice (the engine keeps what it loads).
    let hot = tempfile::tempdir().unwrap();
    let s = open_layout(dir.path(), l, Some(hot.path()));
    for (disk, hot) in [(3, 0), (6, 0)] {
        assert_eq!(wide_get(&s, &l, &tokens, &blocks), (3 * b, want.clone()));
        let st = s.stats().unwrap();
        assert_eq!((st.disk_hit_blocks, st.hot_hit_blocks), (disk, hot));
    }
}

#[test]
fn a_record_damaged_in_its_last_run_is_not_landed_and_ends_the_hit() {
    let l = wide();
    let b = l.block_size as usize;
    let tokens = seq(8, 3 * b);
    let blocks = [3, 1, 2];
    for hot in [false, true] {
        let dir = three_blocks(l, &tokens);
        // A byte of block 1's last run.
        let last = support::payload_offset(&l, 1) + l.block_bytes() as u64 - 9;
        flip(&only_segment(dir.path()), last);
        let hot_dir = tempfile::tempdir().unwrap();
        let s = open_layout(dir.path(), l, hot.then(|| hot_dir.path()));
        let (m, got) = wide_get(&s, &l, &tokens, &blocks);
        assert_eq!(m, b, "hot tier {hot}");
        // Neither it nor the block after it is touched.
        assert!(got == wide_model(&l, &tokens, 1, &blocks));
        let st = s.stats().unwrap();
        assert_eq!((st.disk_hit_blocks, st.damaged_blocks), (1, 1));
        // Quarantined: the next load ends there without reading it.
        assert_eq!(wide_get(&s, &l, &tokens, &blocks).0, b);
    }
}

#[test]
fn a_record_with_a_damaged_header_is_not_landed_and_ends_the_hit() {
    let l = wide();
    let b = l.block_size as usize;
    let tokens = seq(9, 3 * b);
    let dir = three_blocks(l, &tokens);
    // A byte of block 1's block id, in its header.
    let meta = kvstore::record::meta_len(&l) as u64;
    flip(
        &only_segment(dir.path()),
        support::payload_offset(&l, 1) - meta + 40,
    );
    let s = open_layout(dir.path(), l, None);
    let blocks = [3, 1, 2];
    assert_eq!(
        wide_get(&s, &l, &tokens, &blocks),
        (b, wide_model(&l, &tokens, 1, &blocks))
    );
    assert_eq!(s.stats().unwrap().damaged_blocks, 1);
}

#[test]
fn version_1_records_land_and_damaged_ones_end_the_hit() {
    // This file's layout: records too small to be padded, so rewriting the
    // segment's header and the MANIFEST as version 1 makes a version-1
    // store of them (as tests/format_v2.rs does).
    let l = layout();
    let tokens = seq(10, 3 * B);
    let dir = three_blocks(l, &tokens);
    let seg = only_segment(dir.path());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap();
    let mut h = [0u8; kvstore::format::SEGMENT_HEADER_LEN];
    f.read_exact_at(&mut h, 0).unwrap();
    let (n, _) = kvstore::format::decode_segment_header(&h).unwrap();
    f.write_all_at(&kvstore::format::encode_segment_header_of(n, 1), 0)
        .unwrap();
    let path = dir.path().join("MANIFEST");
    let m = kvstore::format::Manifest::decode(&std::fs::read(&path).unwrap()).unwrap();
    let v1 = kvstore::format::Manifest {
        format_version: 1,
        ..m
    };
    std::fs::write(&path, v1.encode()).unwrap();
    let blocks = [6, 0, 3];
    let s = open(dir.path(), None);
    assert_eq!(s.stats().unwrap().segments_v1, 1);
    assert_eq!(
        get_paged(&s, &tokens, 0, &blocks),
        (3 * B, model(&tokens, 0, 3, &blocks))
    );
    drop(s);
    flip(&seg, support::payload_offset(&l, 2) + 3);
    let s = open(dir.path(), None);
    assert_eq!(
        get_paged(&s, &tokens, 0, &blocks),
        (2 * B, model(&tokens, 0, 2, &blocks))
    );
    assert_eq!(s.stats().unwrap().damaged_blocks, 1);
}

/// Loads from the hot tier land where the layout says for every kind of
/// part, against an element-by-element model: `D` values together in the
/// cache (straight from the slot, streamed where 32-byte aligned, stored
/// plainly where not) or not (through a piece: K transposed), K and V of a
/// block apart (both straight) or interleaved (K through a piece), and V
/// far past K (a GPU backend's layout). Three layers: the runs go four at
/// a time, then two.
#[test]
fn hot_loads_land_every_kind_of_part() {
    let l = wide();
    let (b, h, d) = (
        l.block_size as usize,
        l.num_kv_heads as usize,
        l.head_dim as usize,
    );
    let n = b * h * d;
    let part = |offset, strides| PagedPart { offset, strides };
    let layouts = [
        ("vLLM CPU", cpu_paged(&l)),
        (
            "vLLM CPU, rows off 32-byte boundaries",
            PagedLayout {
                block_stride: 2 * n + 8,
                parts: [part(4, [1, d * b, b]), part(n + 4, [d, b * d, 1])],
            },
        ),
        ("K then V", plain(&l)),
        (
            "V then K",
            PagedLayout {
                block_stride: 2 * n,
                parts: [part(n, [h * d, d, 1]), part(0, [h * d, d, 1])],
            },
        ),
        (
            "K and V interleaved by token",
            PagedLayout {
                block_stride: 2 * n,
                parts: [part(0, [2 * h * d, d, 1]), part(h * d, [2 * h * d, d, 1])],
            },
        ),
        (
            "V far past K",
            PagedLayout {
                block_stride: n,
                parts: [part(0, [h * d, d, 1]), part(WIDE_BLOCKS * n, [h * d, d, 1])],
            },
        ),
    ];
    let tokens = seq(7, 3 * b);
    let kv = kv_for(&l, &tokens);
    let blocks = [3, 0, 2];
    // On one thread, and on three, each landing its own block.
    for ((name, paged), readers) in layouts.into_iter().flat_map(|x| [(x, 1), (x, 3)]) {
        let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = Store::open(
            dir.path(),
            Options {
                fingerprint: Some("paged@1".into()),
                layout: Some(l),
                durability: Durability::None,
                hot_bytes: Some(16 << 20),
                hot_dir: Some(hot.path().to_path_buf()),
                get_readers: Some(readers),
                ..Options::default()
            },
        )
        .unwrap();
        s.put(&tokens, &kv, tokens.len(), b"").unwrap();
        assert!(s
            .hot_blocks(&tokens, b"")
            .unwrap()
            .iter()
            .all(Option::is_some));
        let (want, elems) = paged_model(&l, &paged, &tokens, &blocks);
        // Each layer on a 64-byte boundary, as an engine's caches are, so
        // that aligned rows are streamed.
        let mut bufs = vec![vec![0xEEu8; elems * 2 + 64]; l.num_layers as usize];
        let mut spans: Vec<&mut [u8]> = bufs
            .iter_mut()
            .map(|v| {
                let at = v.as_ptr().align_offset(64);
                &mut v[at..at + elems * 2]
            })
            .collect();
        let before = s.stats().unwrap().hot_hit_blocks;
        let m = s
            .get_paged(&tokens, 0, b"", &paged, &mut spans, &blocks)
            .unwrap();
        let got: Vec<&[u8]> = spans.iter().map(|x| &**x).collect();
        assert_eq!(m, 3 * b, "{name}, {readers} readers");
        assert_eq!(
            s.stats().unwrap().hot_hit_blocks - before,
            3,
            "{name}: not from the hot tier"
        );
        assert!(
            got == want,
            "{name}, {readers} readers: wrong values landed"
        );
    }
}

/// Caches of `WIDE_BLOCKS` blocks laid out as `paged` says (sentinel bytes
/// elsewhere), with token block `i` of `tokens` in cache block `blocks[i]`,
/// each value put by the layout's definition; and their length in elements.
fn paged_model(
    l: &Layout,
    paged: &PagedLayout,
    tokens: &[u32],
    blocks: &[usize],
) -> (Vec<Vec<u8>>, usize) {
    let (b, h, d) = (
        l.block_size as usize,
        l.num_kv_heads as usize,
        l.head_dim as usize,
    );
    let kv = kv_for(l, tokens);
    let elems = (0..WIDE_BLOCKS)
        .flat_map(|c| {
            paged.parts.iter().map(move |p| {
                c * paged.block_stride
                    + p.offset
                    + (b - 1) * p.strides[0]
                    + (h - 1) * p.strides[1]
                    + (d - 1) * p.strides[2]
                    + 1
            })
        })
        .max()
        .unwrap();
    let mut want = vec![vec![0xEEu8; elems * 2]; l.num_layers as usize];
    for (i, &c) in blocks.iter().enumerate() {
        for (layer, cache) in want.iter_mut().enumerate() {
            for (k, p) in paged.parts.iter().enumerate() {
                for (t, hh, dd) in
                    (0..b).flat_map(|t| (0..h).flat_map(move |x| (0..d).map(move |y| (t, x, y))))
                {
                    let src =
                        ((((layer * 2 + k) * tokens.len() + i * b + t) * h + hh) * d + dd) * 2;
                    let dst = (c * paged.block_stride
                        + p.offset
                        + t * p.strides[0]
                        + hh * p.strides[1]
                        + dd * p.strides[2])
                        * 2;
                    cache[dst..dst + 2].copy_from_slice(&kv[src..src + 2]);
                }
            }
        }
    }
    (want, elems)
}

/// vLLM's CPU layout for layout `l`: per block, K `[H][D][B]`, then V
/// `[H][B][D]`.
fn cpu_paged(l: &Layout) -> PagedLayout {
    let (b, h, d) = (
        l.block_size as usize,
        l.num_kv_heads as usize,
        l.head_dim as usize,
    );
    let n = b * h * d;
    PagedLayout {
        block_stride: 2 * n,
        parts: [
            PagedPart {
                offset: 0,
                strides: [1, d * b, b],
            },
            PagedPart {
                offset: n,
                strides: [d, b * d, 1],
            },
        ],
    }
}

/// `hot_blocks_damaged_while_they_land_are_never_landed_wrong` with rows
/// the one-pass copy takes (vLLM's CPU layout, `D` of 64): bytes of block
/// 1's K and V in the first group of runs and of its last run flipped and
/// flipped back, over and over, while loads run; each load is whole and
/// right.
#[test]
fn hot_blocks_damaged_while_they_land_in_one_pass_are_never_landed_wrong() {
    let l = wide();
    let paged = cpu_paged(&l);
    let tokens = seq(9, 3 * l.block_size as usize);
    let blocks = [1, 3, 0];
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let s = open_layout(dir.path(), l, Some(hot.path()));
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    let arena = s.arena_file().unwrap().unwrap().0;
    let (_, _, at) = s.hot_blocks(&tokens, b"").unwrap()[1].unwrap();
    let run = run_bytes(&l) as u64;
    let (want, elems) = paged_model(&l, &paged, &tokens, &blocks);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (wrong, hot_hits) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                for off in [7, run + 7, 5 * run + 9] {
                    flip(&arena, at + off);
                }
            }
        });
        let before = s.stats().unwrap().hot_hit_blocks;
        let wrong = (0..200)
            .filter(|_| {
                let mut got = vec![vec![0xEEu8; elems * 2]; l.num_layers as usize];
                let mut spans: Vec<&mut [u8]> = got.iter_mut().map(|v| &mut v[..]).collect();
                let m = s
                    .get_paged(&tokens, 0, b"", &paged, &mut spans, &blocks)
                    .unwrap();
                m != tokens.len() || got != want
            })
            .count();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (wrong, s.stats().unwrap().hot_hit_blocks - before)
    });
    assert_eq!(wrong, 0, "loads not whole and right");
    // Blocks 0 and 2 were never touched: they came from the hot tier.
    assert!(hot_hits >= 400, "{hot_hits} hot-tier hits");
}
