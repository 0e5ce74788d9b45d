//! Where a fresh handle's lookup of a 128K-token prefix spends its time:
//! the block-id chain alone (against its floor: BLAKE3 of as many
//! independent block-sized inputs), the whole lookup on a fresh handle, and
//! the same on a handle that has seen the prefix. Any exact lookup must
//! derive every id of the prefix, so the chain is the lookup's limit: the
//! lookups are printed as a ratio to it.
//!
//! `cargo bench -p kvstore --bench lookup`

use kvstore::{DType, Durability, Keyer, Layout, Options, Store};
use std::hint::black_box;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<R>(runs: usize, mut f: impl FnMut() -> R) -> Duration {
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                black_box(f());
                t.elapsed()
            })
            .collect(),
    )
}

/// What the closed marks cost a put: the whole put of `tokens` into a new
/// store (tiny blocks, so the index work is most of it), median of 5.
fn time_put(tokens: &[u32], opts: &dyn Fn() -> Options) -> Duration {
    median(
        (0..5)
            .map(|_| {
                let d = tempfile::tempdir().expect("tempdir");
                let st = Store::open(d.path(), opts()).expect("open");
                let layout = st.layout().expect("layout");
                let kv = vec![7u8; layout.kv_bytes(tokens.len()).expect("kv bytes")];
                let t = Instant::now();
                assert_eq!(
                    st.put(tokens, &kv, tokens.len(), b"").expect("put"),
                    tokens.len()
                );
                t.elapsed()
            })
            .collect(),
    )
}

fn main() {
    let layout = Layout::new(1, 1, 8, DType::BFloat16, 16).expect("layout");
    let n_tokens = 131_072usize;
    let tokens: Vec<u32> = (0..n_tokens as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let opts = || Options {
        fingerprint: Some("bench@1".into()),
        layout: Some(layout),
        durability: Durability::None,
        ..Options::default()
    };
    {
        let st = Store::open(dir.path(), opts()).expect("open");
        let kv = vec![7u8; layout.kv_bytes(n_tokens).expect("kv bytes")];
        assert_eq!(st.put(&tokens, &kv, n_tokens, b"").expect("put"), n_tokens);
        st.close().expect("close");
    }
    let runs = 30;
    let put = time_put(&tokens, &opts);
    let keyer = Keyer::new("bench@1", &layout, None);
    let chain = time(runs, || keyer.chain(&tokens, 16, b""));
    // The same number of keyed hashes of one block's input size (32-byte
    // parent, length, 16 tokens, extra length), none waiting for another.
    let input = [7u8; 32 + 4 + 16 * 4 + 8];
    let hash_key = [9u8; 32];
    let floor = time(runs, || {
        (0..n_tokens / 16).fold(0u8, |x, _| {
            x ^ blake3::keyed_hash(&hash_key, black_box(&input)).as_bytes()[0]
        })
    });
    let fresh = median(
        (0..runs)
            .map(|_| {
                let st = Store::open(dir.path(), opts()).expect("open");
                let t = Instant::now();
                assert_eq!(st.lookup(&tokens, b"").expect("lookup"), n_tokens);
                t.elapsed()
            })
            .collect(),
    );
    let st = Store::open(dir.path(), opts()).expect("open");
    let warm = time(runs, || st.lookup(&tokens, b"").expect("lookup"));
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    drop(st);
    {
        let ids = keyer.chain(&tokens, 16, b"");
        let idx =
            kvstore::index::Index::open(&dir.path().join("index"), true, 1 << 30).expect("index");
        let probe = time(runs, || {
            let txn = idx.read().expect("txn");
            ids.iter()
                .filter(|id| idx.get_block(&txn, id).expect("get").is_some())
                .count()
        });
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        let probe_sorted = time(runs, || {
            let txn = idx.read().expect("txn");
            sorted
                .iter()
                .filter(|id| idx.get_block(&txn, id).expect("get").is_some())
                .count()
        });
        let sort = time(runs, || {
            let mut s = ids.clone();
            s.sort_unstable_by_key(|id| u64::from_be_bytes(id[..8].try_into().unwrap()));
            s
        });
        println!("  raw LMDB probes, chain order {:8.3} ms", ms(probe));
        println!("  raw LMDB probes, key order   {:8.3} ms", ms(probe_sorted));
        println!("  sort by u64 prefix           {:8.3} ms", ms(sort));
    }
    println!(
        "lookup of {n_tokens} tokens ({} blocks), median of {runs}:",
        n_tokens / 16
    );
    let per_block = |d: Duration| d.as_secs_f64() * 1e9 / (n_tokens / 16) as f64;
    println!(
        "  block-id chain alone      {:8.3} ms ({:.0} ns/block, {:.2}x independent keyed hashes: {:.0} ns)",
        ms(chain),
        per_block(chain),
        chain.as_secs_f64() / floor.as_secs_f64(),
        per_block(floor)
    );
    let ratio = |d: Duration| d.as_secs_f64() / chain.as_secs_f64();
    println!(
        "  lookup, fresh handle      {:8.3} ms ({:.2}x the chain)",
        ms(fresh),
        ratio(fresh)
    );
    println!(
        "  lookup, same handle again {:8.3} ms ({:.2}x the chain)",
        ms(warm),
        ratio(warm)
    );
    println!("  put of the {} blocks   {:8.3} ms", n_tokens / 16, ms(put));
}
