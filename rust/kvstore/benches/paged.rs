//! `get_paged` (the engine's side of the vLLM connector's loads) against
//! `get_into` of the same request into a contiguous buffer and
//! memcpy of the same bytes, in the same run; on every core and on one
//! thread, and on one thread with K laid out as V (no transpose: what K's
//! transpose costs is the difference): a 2K-token request of
//! `bench_vllm.py`'s layout (8 layers, 4 KV heads of 64, bf16, blocks of 32:
//! 16 MiB), landing in random blocks of per-layer paged caches laid out as
//! vLLM's CPU backend lays them (K `[H][D][B]`, V `[H][B][D]`; 1 GiB in
//! all, more than a CPU cache holds). Six such requests are stored and
//! loaded in turn: 96 MiB of hot tier, read from DRAM; and on one thread
//! from a handle without a hot tier (each block a `pread` of a segment in
//! the page cache, checked, then scattered).
//!
//! `cargo bench -p kvstore --bench paged`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvstore::{DType, Durability, Layout, Options, PagedLayout, PagedPart, Store};
use std::hint::black_box;

const L: usize = 8;
const H: usize = 4;
const D: usize = 64;
const B: usize = 32;
const TOKENS: usize = 2048;
const CACHE_BLOCKS: usize = 512;
const REQUESTS: usize = 6;

fn paged() -> PagedLayout {
    let mut p = untransposed();
    p.parts[0].strides = [1, D * B, B];
    p
}

/// `paged` with K laid out as V, `[H][B][D]`.
fn untransposed() -> PagedLayout {
    PagedLayout {
        block_stride: 2 * B * H * D,
        parts: [
            PagedPart {
                offset: 0,
                strides: [D, B * D, 1],
            },
            PagedPart {
                offset: B * H * D,
                strides: [D, B * D, 1],
            },
        ],
    }
}

fn bench(c: &mut Criterion) {
    let l = Layout::new(L as u32, H as u32, D as u32, DType::BFloat16, B as u32).expect("layout");
    let (dir, hot) = (
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    );
    // Threads for the paged copies: as many as the cores (None), or one.
    let open = |readers: Option<usize>, hot_bytes: Option<u64>| {
        Store::open(
            dir.path(),
            Options {
                fingerprint: Some("bench-paged@1".into()),
                layout: Some(l),
                durability: Durability::None,
                // Room to spare: the hot tier is set-associative, and at 160
                // MiB two of the 384 blocks lost their set's place to others.
                hot_bytes,
                hot_dir: Some(hot.path().to_path_buf()),
                get_readers: readers,
                ..Options::default()
            },
        )
        .expect("open")
    };
    let hot_bytes = Some(512 << 20);
    let (s, one) = (open(None, hot_bytes), open(Some(1), hot_bytes));
    // Without a hot tier: the segments, from the page cache.
    let warm = open(Some(1), None);
    // Requests in turn, more bytes than the CPU's last-level cache (32 MiB
    // here), so that each load reads the hot tier from DRAM, as a load
    // between a serving engine's forward passes does.
    let prompts: Vec<Vec<u32>> = (0..REQUESTS as u32)
        .map(|r| (1..=TOKENS as u32).map(|t| t + r * 100_000).collect())
        .collect();
    let nbytes = l.kv_bytes(TOKENS).expect("size");
    let kv: Vec<u8> = (0..nbytes).map(|i| (i * 7 + i / 4093) as u8).collect();
    for tokens in &prompts {
        s.put(tokens, &kv, TOKENS, b"").expect("put");
    }
    // All of them in the hot tier: no load below reads the segments.
    for tokens in &prompts {
        let hot = s.hot_blocks(tokens, b"").expect("hot blocks");
        assert!(
            hot.iter().all(Option::is_some),
            "a block not in the hot tier"
        );
    }
    let mut turn = 0;
    let n = TOKENS / B;
    // Every 7th cache block: scattered over the caches, each used once.
    let blocks: Vec<usize> = (0..n).map(|i| i * 7 % CACHE_BLOCKS).collect();
    let mut caches = vec![vec![0u8; CACHE_BLOCKS * 2 * B * H * D * 2]; L];
    let mut out = vec![0u8; nbytes];
    let mut pairs: Vec<(Vec<u8>, Vec<u8>)> =
        (0..4).map(|_| (vec![1; nbytes], vec![0; nbytes])).collect();
    let mut g = c.benchmark_group("paged");
    g.throughput(Throughput::Bytes(nbytes as u64));
    g.sample_size(20);
    let mut i = 0;
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            let (src, dst) = &mut pairs[i % 4];
            i += 1;
            black_box(&mut dst[..]).copy_from_slice(src);
        });
    });
    g.bench_function("get_into (hot tier)", |b| {
        b.iter(|| {
            turn += 1;
            let got = s
                .get_into(&prompts[turn % REQUESTS], b"", black_box(&mut out), TOKENS)
                .expect("get");
            assert_eq!(got, TOKENS);
        });
    });
    let rows = [
        ("get_paged (hot tier)", &s, paged()),
        ("get_paged (hot tier, 1 thread)", &one, paged()),
        (
            "get_paged (hot tier, 1 thread, K as V)",
            &one,
            untransposed(),
        ),
        ("get_paged (page cache, 1 thread)", &warm, paged()),
    ];
    for (name, store, layout) in rows {
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut spans: Vec<&mut [u8]> = caches.iter_mut().map(|c| &mut c[..]).collect();
                turn += 1;
                let tokens = &prompts[turn % REQUESTS];
                let got = store
                    .get_paged(tokens, 0, b"", &layout, &mut spans, &blocks)
                    .expect("get");
                assert_eq!(got, TOKENS);
            });
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
