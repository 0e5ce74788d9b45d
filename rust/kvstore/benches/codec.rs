//! The record codec and the segment scanner, against memcpy of the same
//! bytes in the same run (the floor any codec pays to move a block).
//!
//! Each codec is timed twice: by the wall clock (group `record`) and by the
//! CPU time of the benchmarking thread (group `record-cpu`, its
//! `CLOCK_THREAD_CPUTIME_ID`). On a machine shared with other work the
//! wall clock counts the time the thread waited for a core; the CPU time is
//! what one core spends per block, so `cores / cpu time` bounds what a put's
//! parallel encoding or a get's parallel decoding can reach.
//!
//! `cargo bench -p kvstore --bench codec`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvstore::format;
use kvstore::record::{self, Mismatch};
use kvstore::scan;
use kvstore::{BlockId, Codec, DType, Layout};
use std::hint::black_box;
use std::time::Duration;

/// A model-like block: 4 layers, 8 KV heads of 128, bf16, 16 tokens (256 KiB).
fn layout() -> Layout {
    Layout::new(4, 8, 128, DType::BFloat16, 16).expect("layout")
}

/// KV-like bf16 bytes: `randn * 0.05` rounded to bf16 (Box-Muller over
/// xorshift), so exponents repeat (what the codecs exploit) while mantissas
/// look random.
fn kv_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut uniform = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let (u, v) = (uniform(), uniform());
        let g = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
        let f = (g * 0.05) as f32;
        // Round to nearest even into bf16's 16 high bits.
        let bits = f.to_bits();
        let bf = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
        out.extend_from_slice(&(bf as u16).to_le_bytes());
    }
    out.truncate(n);
    out
}

fn block(layout: &Layout, seed: u64) -> (BlockId, Vec<u32>, Vec<u8>) {
    let tokens: Vec<u32> = (0..layout.block_size).map(|t| t + seed as u32).collect();
    let mut id = [0u8; 32];
    id[..8].copy_from_slice(&seed.to_le_bytes());
    (id, tokens, kv_bytes(layout.block_bytes(), seed))
}

/// This thread's CPU clock.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// `f` run `iters` times, timed in this thread's CPU time.
fn cpu_time(iters: u64, mut f: impl FnMut()) -> Duration {
    let t0 = thread_cpu();
    for _ in 0..iters {
        f();
    }
    thread_cpu().saturating_sub(t0)
}

fn encode_decode(c: &mut Criterion) {
    let l = layout();
    let (id, tokens, kv) = block(&l, 7);
    let chunks: Vec<&[u8]> = kv.chunks(l.chunk_bytes()).collect();
    for cpu in [false, true] {
        let mut g = c.benchmark_group(if cpu { "record-cpu" } else { "record" });
        g.throughput(Throughput::Bytes(l.block_bytes() as u64));
        // Timed by the wall clock, or by this thread's CPU time.
        let run = |b: &mut criterion::Bencher<'_>, f: &mut dyn FnMut()| {
            if cpu {
                b.iter_custom(|iters| cpu_time(iters, &mut *f));
            } else {
                b.iter(&mut *f);
            }
        };
        let mut dst = vec![0u8; kv.len()];
        g.bench_function("memcpy", |b| {
            run(b, &mut || dst.copy_from_slice(black_box(&kv)));
        });
        for level in [Codec::Raw, Codec::Zstd(1), Codec::Zstd(3), Codec::Exponent] {
            g.bench_with_input(
                BenchmarkId::new("encode", format!("{level:?}")),
                &level,
                |b, &level| {
                    run(b, &mut || {
                        black_box(
                            record::encode(&l, level, &id, &tokens, black_box(&chunks))
                                .expect("encode"),
                        );
                    });
                },
            );
            let rec = record::encode(&l, level, &id, &tokens, &chunks).expect("encode");
            if !cpu {
                eprintln!(
                    "{level:?}: {:.3}x smaller",
                    l.block_bytes() as f64 / rec.stored_len() as f64
                );
            }
            let bytes: Vec<u8> = rec.slices().iter().flat_map(|s| s.to_vec()).collect();
            let (meta, stored) = bytes.split_at(record::meta_len(&l));
            let mut out = vec![0u8; l.block_bytes()];
            let mut scratch = Vec::new();
            g.bench_with_input(
                BenchmarkId::new("check+decode", format!("{level:?}")),
                &level,
                |b, _| {
                    run(b, &mut || {
                        check_decode(&l, meta, stored, &id, &tokens, &mut out, &mut scratch);
                    });
                },
            );
        }
        g.finish();
    }
}

/// A read's work on one record: check its meta, then copy and check (raw)
/// or check and decode (compressed) its payload into `out`.
fn check_decode(
    l: &Layout,
    meta: &[u8],
    stored: &[u8],
    id: &BlockId,
    tokens: &[u32],
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) {
    let h = match record::check_read(l, meta, id, stored.len() as u64, Some(tokens)) {
        Ok(h) => h,
        Err(Mismatch::Damaged(r)) => panic!("{r}"),
        Err(Mismatch::OtherTokens) => panic!("other tokens"),
    };
    let mut runs: Vec<&mut [u8]> = out.chunks_mut(l.chunk_bytes()).collect();
    if stored.len() == l.block_bytes() {
        for (dst, src) in runs.iter_mut().zip(stored.chunks(l.chunk_bytes())) {
            dst.copy_from_slice(src);
        }
        record::check_raw(&h, &runs).expect("raw");
    } else {
        record::decode_compressed(l, &h, stored, &mut runs, scratch).expect("decode");
    }
}

fn scanner(c: &mut Criterion) {
    let l = layout();
    let n = 64;
    let mut segment = format::encode_segment_header(1).to_vec();
    for seed in 0..n {
        let (id, tokens, kv) = block(&l, seed);
        let chunks: Vec<&[u8]> = kv.chunks(l.chunk_bytes()).collect();
        let rec = record::encode(&l, Codec::Raw, &id, &tokens, &chunks).expect("encode");
        for s in rec.slices() {
            segment.extend_from_slice(&s);
        }
    }
    let mut g = c.benchmark_group("scan");
    g.throughput(Throughput::Bytes(segment.len() as u64));
    let mut copy = vec![0u8; segment.len()];
    g.bench_function("memcpy", |b| {
        b.iter(|| copy.copy_from_slice(black_box(&segment)));
    });
    g.bench_function("segment_of_64_raw_records", |b| {
        b.iter(|| {
            let mut found = 0;
            let report =
                scan::scan_segment(black_box(&segment[..]), &l, |_| found += 1).expect("scan");
            assert!(report.damaged.is_empty() && found == n);
        });
    });
    g.finish();
}

criterion_group!(benches, encode_decode, scanner);
criterion_main!(benches);
