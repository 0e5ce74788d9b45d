//! Engine tests against a model of the expected state: every block's bytes
//! are recomputed from its token ids, so any wrong byte shows.

use kvstore::{DType, Durability, Error, Layout, Options, Store};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

mod support;
use support::{kv_for, prefix_matches, seq, NO_PROGRESS};

fn layout() -> Layout {
    Layout::new(2, 2, 4, DType::Float16, 4).unwrap()
}

fn opts(durability: Durability) -> Options {
    Options {
        fingerprint: Some("test-model@1".into()),
        layout: Some(layout()),
        durability,
        ..Options::default()
    }
}

fn get(store: &Store, tokens: &[u32]) -> (usize, Vec<u8>) {
    let l = store.layout().unwrap();
    let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
    let m = store.get_into(tokens, b"", &mut out, tokens.len()).unwrap();
    (m, out)
}

/// The first `m` tokens of a `[L, 2, T, H, D]` buffer must equal the reference.
fn assert_prefix_eq(l: &Layout, got: &[u8], t: usize, tokens: &[u32], m: usize) {
    assert!(prefix_matches(l, got, t, tokens, m), "wrong bytes");
}

#[test]
fn round_trip_dedupe_and_partial_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let l = layout();
    let a = seq(1, 10); // 2 full blocks + 2 tokens
    assert_eq!(s.put(&a, &kv_for(&l, &a), a.len(), b"").unwrap(), 8);
    let mut b = a[..8].to_vec();
    b.extend(seq(2, 8)); // shares 2 blocks with a
    assert_eq!(s.put(&b, &kv_for(&l, &b), b.len(), b"").unwrap(), 16);
    let st = s.stats().unwrap();
    assert_eq!((st.blocks, st.blocks_written, st.blocks_deduped), (4, 4, 2));
    assert_eq!(s.lookup(&a, b"").unwrap(), 8);
    let (m, out) = get(&s, &b);
    assert_eq!(m, 16);
    assert_prefix_eq(&l, &out, b.len(), &b, m);
    // A different `extra` key is another block chain.
    assert_eq!(s.lookup(&a, b"adapter").unwrap(), 0);
}

#[test]
fn compressed_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(Durability::None);
    o.codec = kvstore::Codec::Zstd(3);
    let s = Store::open(dir.path(), o).unwrap();
    let l = layout();
    let t = seq(3, 16);
    // Low-entropy KV so zstd really stores a compressed frame.
    let kv = vec![0x3cu8; l.kv_bytes(16).unwrap()];
    s.put(&t, &kv, 16, b"").unwrap();
    let st = s.stats().unwrap();
    assert!(
        st.live_bytes < st.raw_live_bytes,
        "payloads were not compressed"
    );
    let (m, out) = get(&s, &t);
    assert_eq!(m, 16);
    assert_eq!(out, kv);
}

#[test]
fn restart_finds_flushed_blocks_and_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let t = seq(4, 40);
    {
        let s = Store::open(dir.path(), opts(Durability::Batch)).unwrap();
        s.save_session("agent", &t, &kv_for(&l, &t), t.len())
            .unwrap();
        s.flush().unwrap();
    }
    let s = Store::open(dir.path(), opts(Durability::Batch)).unwrap();
    assert_eq!(s.session_tokens("agent").unwrap(), t);
    let (m, out) = get(&s, &t);
    assert_eq!(m, 40);
    assert_prefix_eq(&l, &out, t.len(), &t, m);
    assert!(matches!(
        s.session_tokens("nobody"),
        Err(Error::SessionNotFound(_))
    ));
}

#[test]
fn identity_mismatch_and_salts() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let t = seq(5, 8);
    let mut salted = opts(Durability::None);
    salted.salt = Some(b"tenant-a".to_vec());
    {
        let s = Store::open(dir.path(), salted.clone()).unwrap();
        s.put(&t, &kv_for(&l, &t), 8, b"").unwrap();
        s.save_session("mine", &t, &kv_for(&l, &t), 8).unwrap();
    }
    let mut other = salted.clone();
    other.salt = Some(b"tenant-b".to_vec());
    let s = Store::open(dir.path(), other).unwrap();
    assert_eq!(s.lookup(&t, b"").unwrap(), 0);
    assert!(s.sessions().unwrap().is_empty());
    drop(s);
    let s = Store::open(dir.path(), salted.clone()).unwrap();
    assert_eq!(s.lookup(&t, b"").unwrap(), 8);
    drop(s);
    let mut wrong_model = salted.clone();
    wrong_model.fingerprint = Some("other-model".into());
    assert!(matches!(
        Store::open(dir.path(), wrong_model),
        Err(Error::LayoutMismatch(_))
    ));
    let mut wrong_layout = salted;
    wrong_layout.layout = Some(Layout::new(2, 2, 4, DType::BFloat16, 4).unwrap());
    assert!(matches!(
        Store::open(dir.path(), wrong_layout),
        Err(Error::LayoutMismatch(_))
    ));
}

fn segment_file(dir: &Path) -> std::path::PathBuf {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files.pop().unwrap()
}

#[test]
fn damaged_payload_is_a_miss_and_is_stored_again() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let t = seq(6, 12); // 3 blocks
    let kv = kv_for(&l, &t);
    {
        let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
        s.put(&t, &kv, 12, b"").unwrap();
    }
    // Damage the second block's payload.
    let f = OpenOptions::new()
        .write(true)
        .open(segment_file(dir.path()))
        .unwrap();
    f.write_all_at(&[0xff], support::payload_offset(&l, 1) + 5)
        .unwrap();
    drop(f);
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let report = s.verify(NO_PROGRESS).unwrap();
    assert_eq!(report.damaged.len(), 1, "{report:?}");
    let (m, out) = get(&s, &t);
    assert_eq!(m, 4, "reads stop at the damaged block");
    assert_prefix_eq(&l, &out, 12, &t, m);
    assert_eq!(s.stats().unwrap().damaged_blocks, 1);
    // The damaged entry left the index, so a put stores the block again.
    s.put(&t, &kv, 12, b"").unwrap();
    let (m, out) = get(&s, &t);
    assert_eq!(m, 12);
    assert_prefix_eq(&l, &out, 12, &t, m);
}

#[test]
fn segment_of_a_live_writer_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let t = seq(7, 8);
    let seg;
    {
        let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
        s.put(&t, &kv_for(&l, &t), 8, b"").unwrap();
        seg = segment_file(dir.path());
        // Garbage after the committed records, as a crash mid-append leaves.
        std::mem::forget(s); // no close: the segment stays "active"
    }
    let committed = std::fs::metadata(&seg).unwrap().len();
    let f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all_at(&[0xab; 1000], committed).unwrap();
    drop(f);
    // The forgotten handle still holds the segment lock in this process, so
    // recovery must leave the segment alone...
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), committed + 1000);
    assert_eq!(s.lookup(&t, b"").unwrap(), 8);
    drop(s);
}

/// Child-process entry point of the test below, which runs it (`--ignored
/// --exact`) with the variable set: puts, leaves a torn record after the
/// committed ones, and dies without closing anything.
#[test]
#[ignore = "the child process of torn_tail_of_dead_writer_is_truncated; it runs it"]
fn child_put_tear_and_abort() {
    let dir = std::env::var("KVSTORE_TEST_CHILD_DIR")
        .expect("run by torn_tail_of_dead_writer_is_truncated, which sets KVSTORE_TEST_CHILD_DIR");
    let dir = Path::new(&dir);
    let l = layout();
    let t = seq(8, 8);
    let s = Store::open(dir, opts(Durability::Sync)).unwrap();
    s.put(&t, &kv_for(&l, &t), 8, b"").unwrap();
    let seg = segment_file(dir);
    let committed = std::fs::metadata(&seg).unwrap().len();
    let f = OpenOptions::new().write(true).open(&seg).unwrap();
    f.write_all_at(b"KVRC\x01\x00 torn record", committed)
        .unwrap();
    std::process::abort();
}

#[test]
fn torn_tail_of_dead_writer_is_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_put_tear_and_abort",
            "--test-threads=1",
        ])
        .env("KVSTORE_TEST_CHILD_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child must die by abort");
    let seg = segment_file(dir.path());
    let torn_len = std::fs::metadata(&seg).unwrap().len();
    let l = layout();
    let t = seq(8, 8);
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let after = std::fs::metadata(&seg).unwrap().len();
    assert!(
        after < torn_len,
        "recovery truncated the torn tail ({torn_len} -> {after})"
    );
    assert_eq!(after, support::record_end(&l, 1));
    let (m, out) = get(&s, &t);
    assert_eq!(m, 8);
    assert_prefix_eq(&l, &out, 8, &t, m);
    assert!(s.verify(NO_PROGRESS).unwrap().damaged.is_empty());
    // The dead writer's segment is sealed; new puts go to a new one.
    let u = seq(12, 8);
    s.put(&u, &kv_for(&l, &u), 8, b"").unwrap();
    assert_eq!(s.segments().unwrap().len(), 2);
}

#[test]
fn compact_and_gc_keep_every_live_block() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let mut o = opts(Durability::Sync);
    o.segment_bytes = 1 << 20;
    let s = Store::open(dir.path(), o).unwrap();
    let seqs: Vec<Vec<u32>> = (0..60).map(|i| seq(100 + i, 256)).collect();
    for t in &seqs {
        s.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
    }
    let before = s.stats().unwrap();
    assert!(before.segments > 1);
    // Evict about half the bytes, then check the rest is intact.
    let r = s
        .gc(Some(before.live_bytes / 2), None, NO_PROGRESS)
        .unwrap();
    assert!(r.blocks_evicted > 0);
    let after = s.stats().unwrap();
    assert!(after.live_bytes <= before.live_bytes / 2);
    assert_eq!(after.dead_bytes, 0, "gc compacts what it evicted");
    let mut kept = 0;
    for t in &seqs {
        let (m, out) = get(&s, t);
        assert_prefix_eq(&l, &out, t.len(), t, m);
        kept += m;
    }
    assert!(kept > 0);
    assert!(s.verify(NO_PROGRESS).unwrap().damaged.is_empty());
    // Oldest first: the last sequence put survives whole.
    assert_eq!(s.lookup(seqs.last().unwrap(), b"").unwrap(), 256);
}

#[test]
fn threads_share_one_handle() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(Store::open(dir.path(), opts(Durability::Batch)).unwrap());
    let l = layout();
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                for j in 0..50 {
                    let mut t = seq(9, 16); // shared prefix
                    t.extend(seq(1000 + i * 100 + j, 16));
                    s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap();
                    let (m, out) = get(&s, &t);
                    assert_eq!(m, 32);
                    assert_prefix_eq(&l, &out, t.len(), &t, m);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let st = s.stats().unwrap();
    assert_eq!(st.blocks + st.pending_blocks, 4 + 4 * 50 * 4);
    s.close().unwrap();
    assert!(matches!(
        s.lookup(&seq(9, 16), b""),
        Err(Error::StoreClosed(_))
    ));
}

#[test]
fn disk_bytes_evicts_least_recently_used_and_keeps_prefixes_whole() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let limit = 64 << 10;
    let mut o = opts(Durability::Sync);
    o.disk_bytes = Some(limit);
    let s = Store::open(dir.path(), o).unwrap();
    let system = seq(20, 32); // 8 blocks, read before every new put
    s.put(&system, &kv_for(&l, &system), 32, b"").unwrap();
    let others: Vec<Vec<u32>> = (0..150).map(|i| seq(1000 + i, 24)).collect();
    for t in &others {
        assert_eq!(get(&s, &system).0, 32, "the hot system prompt was evicted");
        s.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
        let st = s.stats().unwrap();
        assert!(
            st.disk_bytes <= limit,
            "{} bytes on disk over the {limit} limit",
            st.disk_bytes
        );
    }
    // Far more was put than fits: the early, unused sequences are gone, the
    // recent ones are whole, and whatever is stored is a readable prefix.
    assert_eq!(s.lookup(&others[0], b"").unwrap(), 0);
    assert_eq!(s.lookup(others.last().unwrap(), b"").unwrap(), 24);
    for t in &others {
        let (m, out) = get(&s, t);
        assert_prefix_eq(&l, &out, t.len(), t, m);
    }
    assert!(s.verify(NO_PROGRESS).unwrap().damaged.is_empty());
}

#[test]
fn disk_bytes_with_everything_pinned_is_store_full() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let mut o = opts(Durability::Sync);
    o.disk_bytes = Some(16 << 10);
    let s = Store::open(dir.path(), o).unwrap();
    let kept = seq(30, 4 * 40);
    s.put(&kept, &kv_for(&l, &kept), kept.len(), b"").unwrap();
    let n = s.lookup(&kept, b"").unwrap();
    assert!(n > 0);
    s.pin(&kept, b"", 1, None).unwrap();
    let t = seq(31, 4 * 60);
    let err = s.put(&t, &kv_for(&l, &t), t.len(), b"").unwrap_err();
    assert!(matches!(err, Error::StoreFull(_)), "{err}");
    assert!(s.stats().unwrap().disk_bytes <= 16 << 10);
    // The pinned prefix is intact; what fitted of the new one is readable.
    let (m, out) = get(&s, &kept);
    assert_eq!(m, n);
    assert_prefix_eq(&l, &out, kept.len(), &kept, m);
    let (m, out) = get(&s, &t);
    assert_prefix_eq(&l, &out, t.len(), &t, m);
}

#[test]
fn bad_input_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let l = layout();
    let t = seq(11, 8);
    let kv = kv_for(&l, &t);
    assert!(matches!(
        s.put(&t, &kv[1..], 8, b""),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        s.put(&t, &kv_for(&l, &t[..4]), 4, b""),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(s.stats().unwrap().blocks_written, 0);
    assert_eq!(s.stats().unwrap().segments, 0);
}

#[test]
fn cached_locations_follow_another_handles_gc_and_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let reader = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let writer = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let t = seq(13, 64);
    writer.put(&t, &kv_for(&l, &t), 64, b"").unwrap();
    writer.close().unwrap(); // seals the segment, so compaction may rewrite it
    assert_eq!(reader.lookup(&t, b"").unwrap(), 64); // now cached in `reader`
    let maint = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    // Evict the oldest half: the other handle's cache must not keep them.
    maint
        .gc(
            Some(maint.stats().unwrap().live_bytes / 2),
            None,
            NO_PROGRESS,
        )
        .unwrap();
    // Half the chain's blocks are gone (which half depends on equal
    // timestamps), so the stored prefix is shorter, whatever the cache held.
    let m = reader.lookup(&t, b"").unwrap();
    assert!(m < 64, "lookup still reports {m} tokens after gc");
    let (m2, out) = get(&reader, &t);
    assert_eq!(m2, m);
    assert_prefix_eq(&l, &out, 64, &t, m2);
    // Put again, then compact: locations move, cached ones must not be used.
    maint.put(&t, &kv_for(&l, &t), 64, b"").unwrap();
    maint.close().unwrap();
    let (m, out) = get(&reader, &t);
    assert_eq!(m, 64);
    assert_prefix_eq(&l, &out, 64, &t, m);
    let maint = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    maint.compact(NO_PROGRESS).unwrap();
    let (m, out) = get(&reader, &t);
    assert_eq!(m, 64);
    assert_prefix_eq(&l, &out, 64, &t, m);
}

#[test]
fn reads_racing_compaction_are_exact_or_misses() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let mut o = opts(Durability::Sync);
    o.segment_bytes = 1 << 20;
    let seqs: Vec<Vec<u32>> = (0..40).map(|i| seq(300 + i, 256)).collect();
    {
        let w = Store::open(dir.path(), o.clone()).unwrap();
        for t in &seqs {
            w.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
        }
    }
    let reader = Arc::new(Store::open(dir.path(), o.clone()).unwrap());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = {
        let (reader, stop, seqs) = (reader.clone(), stop.clone(), seqs.clone());
        let reads = reads.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for t in &seqs {
                    let (m, out) = get(&reader, t);
                    assert_prefix_eq(&l, &out, t.len(), t, m);
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
    };
    let maint = Store::open(dir.path(), o).unwrap();
    // At least 6 rounds, and on until the reader has read every sequence
    // twice meanwhile (on a busy host its thread may start late).
    for round in 0..200 {
        let read = reads.load(std::sync::atomic::Ordering::Relaxed);
        if round >= 6 && read >= 2 * seqs.len() {
            break;
        }
        // Alternate evicting a little and compacting everything.
        let live = maint.stats().unwrap().live_bytes;
        maint.gc(Some(live - live / 20), None, NO_PROGRESS).unwrap();
        if round % 2 == 0 {
            maint.compact(NO_PROGRESS).unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    r.join().unwrap();
    assert!(
        reads.load(std::sync::atomic::Ordering::Relaxed) >= 2 * seqs.len(),
        "the reader never raced the maintenance"
    );
    assert!(maint.verify(NO_PROGRESS).unwrap().damaged.is_empty());
    // Whatever survived is still whole.
    let mut kept = 0;
    for t in &seqs {
        let (m, out) = get(&reader, t);
        assert_prefix_eq(&l, &out, t.len(), t, m);
        kept += m;
    }
    assert!(kept > 0);
}

#[test]
fn segment_created_by_a_writer_that_died_before_its_header_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let t = seq(14, 8);
    {
        let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
        s.put(&t, &kv_for(&l, &t), 8, b"").unwrap();
    }
    // What a kill between registering segment 9 and writing its header leaves.
    {
        let index = kvstore::index::Index::open(
            &dir.path().join("index"),
            false,
            kvstore::index::DEFAULT_MAP_SIZE,
        )
        .unwrap();
        let mut txn = index.write().unwrap();
        index
            .put_segment(&mut txn, 9, &kvstore::index::SegmentInfo::new())
            .unwrap();
        index.commit(txn, true).unwrap();
    }
    let empty = dir
        .path()
        .join("segments")
        .join(format!("{:016x}.kvseg", 9));
    std::fs::File::create(&empty).unwrap();
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    assert!(!empty.exists(), "recovery removes the empty segment");
    assert_eq!(s.segments().unwrap().len(), 1);
    let report = s.verify(NO_PROGRESS).unwrap();
    assert!(
        report.damaged.is_empty() && report.problems.is_empty(),
        "{report:?}"
    );
    assert_eq!(s.lookup(&t, b"").unwrap(), 8);
}

#[test]
fn session_binds_all_tokens_and_stores_what_the_kv_covers() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    let t = seq(40, 8);
    // KV of 7 tokens: the cache has not seen the last generated token yet.
    assert_eq!(s.save_session("a", &t, &kv_for(&l, &t[..7]), 7).unwrap(), 4);
    assert_eq!(s.session_tokens("a").unwrap(), t);
    let (m, out) = get(&s, &t);
    assert_eq!(m, 4);
    assert_prefix_eq(&l, &out, 8, &t, m);
}

/// A lost or garbled index is rebuilt from the segments: every sound record
/// is served again, a damaged one is a miss that `verify` names.
#[test]
fn rebuild_index_from_segments() {
    let dir = tempfile::tempdir().unwrap();
    let l = layout();
    let seqs: Vec<Vec<u32>> = (0..40).map(|i| seq(i, 12)).collect();
    {
        let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
        for q in &seqs {
            s.put(q, &kv_for(&l, q), q.len(), b"").unwrap();
        }
        s.close().unwrap();
    }
    // Damage one record's payload: its block must come back as damage.
    let segs: Vec<_> = std::fs::read_dir(dir.path().join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(segs.len(), 1);
    let f = OpenOptions::new().write(true).open(&segs[0]).unwrap();
    // The 6th record: seqs[1]'s third block.
    f.write_all_at(&[0xAA; 8], support::payload_offset(&l, 5) + 10)
        .unwrap();
    // Garble the index.
    let data = dir.path().join("index").join("data.mdb");
    let len = std::fs::metadata(&data).unwrap().len();
    std::fs::write(&data, vec![0x5Au8; len as usize]).unwrap();
    match Store::open(dir.path(), opts(Durability::Sync)) {
        Err(Error::CorruptStore { .. }) => {}
        Err(e) => panic!("expected CorruptStore, got {e}"),
        Ok(_) => panic!("a garbled index opened"),
    }

    let report = kvstore::rebuild_index(dir.path(), NO_PROGRESS).unwrap();
    assert_eq!(report.segments, 1);
    assert_eq!(report.blocks, 40 * 3 - 1);
    assert_eq!(report.damaged.len(), 1, "{:?}", report.damaged);
    assert!(report.old_index.is_some());

    let s = Store::open(dir.path(), opts(Durability::Sync)).unwrap();
    for (i, q) in seqs.iter().enumerate() {
        let (m, out) = get(&s, q);
        assert_eq!(m, if i == 1 { 8 } else { 12 }, "sequence {i}");
        assert_prefix_eq(&l, &out, q.len(), q, m);
    }
    let v = s.verify(NO_PROGRESS).unwrap();
    assert_eq!(v.damaged.len(), 1, "{:?}", v.damaged);
    assert!(v.problems.is_empty(), "{:?}", v.problems);
    // Writable, and the damaged block is stored again by the next put.
    s.put(&seqs[1], &kv_for(&l, &seqs[1]), 12, b"").unwrap();
    assert_eq!(get(&s, &seqs[1]).0, 12);
    s.close().unwrap();
}
