//! `lookup` is exact on long chains (a gallop over the index's closed marks,
//! then hashed and probed a chunk at a time in key order, see
//! `store/lookup.rs`): holes in the middle of a chain (blocks removed from
//! the index as eviction does, evicted by `gc`, damaged records found by a
//! read or by `repair`, pinned blocks removed) end the prefix exactly where a
//! model of the expected state says, on the handle that saw the chain and on
//! fresh handles. The closed marks themselves are checked against the model
//! (a block is closed exactly when its whole ancestry is indexed), also
//! after random puts, evictions and quarantines over chains that share
//! prefixes, and after an older binary removed blocks behind their back.

use kvstore::index::Index;
use kvstore::{DType, Durability, Keyer, Layout, Options, Store};
use std::collections::{BTreeSet, HashSet};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

mod support;
use support::{kv_for, prefix_matches, seq, NO_PROGRESS};

/// Small blocks (4 tokens, 64 bytes of KV), so chains of thousands of
/// blocks (several of the walk's chunks, up to 1024 blocks) stay small.
fn layout() -> Layout {
    Layout::new(1, 1, 4, DType::Float16, 4).unwrap()
}

fn opts() -> Options {
    Options {
        fingerprint: Some("lookup-model@1".into()),
        layout: Some(layout()),
        durability: Durability::None,
        ..Options::default()
    }
}

/// The model: the longest prefix of `ids` whose blocks are all present.
fn expected(ids: &[[u8; 32]], removed: &BTreeSet<usize>) -> usize {
    (0..ids.len())
        .find(|i| removed.contains(i))
        .unwrap_or(ids.len())
        * 4
}

/// Removes block `i` of the chain from the index, as eviction does.
fn remove(dir: &Path, id: &[u8; 32]) {
    let index = Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap();
    let mut txn = index.write().unwrap();
    let loc = index
        .get_block_rw(&txn, id)
        .unwrap()
        .expect("block indexed");
    assert!(index.delete_block_if_at(&mut txn, id, &loc).unwrap());
    index.commit(txn, false).unwrap();
}

/// Flips the last payload byte of block `id`'s record.
fn damage_payload(dir: &Path, id: &[u8; 32]) {
    let loc = {
        let index = Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap();
        let txn = index.read().unwrap();
        index.get_block(&txn, id).unwrap().expect("block indexed")
    };
    let seg = dir
        .join("segments")
        .join(format!("{:016x}.kvseg", loc.segment));
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap_or_else(|e| panic!("{}: {e}", seg.display()));
    let at = loc.offset + loc.record_len - 1;
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, at).unwrap();
    f.write_all_at(&[byte[0] ^ 0xff], at).unwrap();
}

/// Both the handle that has the chain's locations cached and a fresh one
/// agree with the model.
fn check(dir: &Path, s: &Store, tokens: &[u32], want: usize) {
    assert_eq!(s.lookup(tokens, b"").unwrap(), want, "same handle");
    let fresh = Store::open(dir, opts()).unwrap();
    assert_eq!(fresh.lookup(tokens, b"").unwrap(), want, "fresh handle");
    assert_eq!(fresh.stored_prefix(tokens, b"").unwrap(), want);
    // Past the end of the stored prefix by one token: the same answer.
    let mut longer = tokens.to_vec();
    longer.push(7);
    assert_eq!(fresh.lookup(&longer, b"").unwrap(), want);
}

#[test]
fn holes_end_the_prefix_where_the_model_says() {
    let l = layout();
    // Chains below the chunked walk's threshold (64 blocks) and of several
    // chunks (64 blocks, doubling up to 1024); holes at chunk edges, at the
    // start, at the end, and several at once. With the closed marks the
    // gallop finds the first hole; without them (a store written before
    // them) the walk goes chunk by chunk from block 0, so the holes at the
    // chunks' first and last blocks are where its edges are.
    let cases: &[(usize, &[usize])] = &[
        (40, &[]),
        (40, &[17]),
        (100, &[]),
        (100, &[37]),
        (1500, &[]),
        (1500, &[0]),
        (1500, &[63]),
        (1500, &[64]),
        (1500, &[192, 191]),
        (1500, &[447]),
        (1500, &[448, 960]),
        (2500, &[959]),
        (2500, &[1983]),
        (2500, &[1984]),
        (1500, &[511]),
        (1500, &[512]),
        (1500, &[1023, 7]),
        (2500, &[1024]),
        (1500, &[1499]),
        (2048, &[1600, 900, 1601]),
    ];
    for marks in [true, false] {
        for (seed, &(blocks, holes)) in cases.iter().enumerate() {
            holes_case(&l, seed as u32 + 1, blocks, holes, marks);
        }
    }
}

/// A chain of `blocks` blocks, stored, then (without the closed marks
/// unless `marks`) holes removed one by one at `holes`, then filled again:
/// lookup follows the model throughout.
fn holes_case(l: &Layout, seed: u32, blocks: usize, holes: &[usize], marks: bool) {
    let dir = tempfile::tempdir().unwrap();
    let tokens = seq(seed, blocks * 4 + 3);
    let s = Store::open(dir.path(), opts()).unwrap();
    assert_eq!(
        s.put(&tokens, &kv_for(l, &tokens), tokens.len(), b"")
            .unwrap(),
        blocks * 4
    );
    let ids = Keyer::new("lookup-model@1", l, None).chain(&tokens, 4, b"");
    if !marks {
        clear_marks(dir.path());
    }
    let mut removed = BTreeSet::new();
    check(dir.path(), &s, &tokens, expected(&ids, &removed));
    for &h in holes {
        remove(dir.path(), &ids[h]);
        removed.insert(h);
        check(dir.path(), &s, &tokens, expected(&ids, &removed));
    }
    // A put of the same tokens fills the holes again.
    s.put(&tokens, &kv_for(l, &tokens), tokens.len(), b"")
        .unwrap();
    check(dir.path(), &s, &tokens, blocks * 4);
}

/// Empties the index's closed marks, as a store written before them has none.
fn clear_marks(dir: &Path) {
    let index = index_of(dir);
    let mut txn = index.write().unwrap();
    for name in ["parents", "children"] {
        raw_table(&index, &txn, name).clear(&mut txn).unwrap();
    }
    index.commit(txn, false).unwrap();
}

/// A store at `dir` holding a chain of `blocks` blocks: the open handle,
/// the tokens and the chain's ids.
fn stored_chain(dir: &Path, seed: u32, blocks: usize) -> (Store, Vec<u32>, Vec<[u8; 32]>) {
    let l = layout();
    let tokens = seq(seed, blocks * 4);
    let s = Store::open(dir, opts()).unwrap();
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    let ids = Keyer::new("lookup-model@1", &l, None).chain(&tokens, 4, b"");
    (s, tokens, ids)
}

#[test]
fn a_damaged_block_found_by_a_read_ends_the_prefix() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1300;
    let (s, tokens, ids) = stored_chain(dir.path(), 77, blocks);
    let bad = 700;
    damage_payload(dir.path(), &ids[bad]);
    // Not yet read: the index still lists it.
    check(dir.path(), &s, &tokens, blocks * 4);
    let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
    let m = s.get_into(&tokens, b"", &mut out, tokens.len()).unwrap();
    assert_eq!(m, bad * 4, "the read stops at the damaged block");
    assert!(prefix_matches(&l, &out, tokens.len(), &tokens, m));
    // Quarantined by that read: a hole from now on.
    check(dir.path(), &s, &tokens, bad * 4);
}

#[test]
fn a_pinned_block_removed_from_the_middle_ends_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1100;
    let (s, tokens, ids) = stored_chain(dir.path(), 5, blocks);
    assert_eq!(s.pin(&tokens, b"", 5, None).unwrap(), blocks * 4);
    remove(dir.path(), &ids[600]);
    check(dir.path(), &s, &tokens, 600 * 4);
}

#[test]
fn pending_blocks_past_the_committed_ones_count_on_their_handle() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let committed = seq(9, 700 * 4);
    let mut tokens = committed.clone();
    tokens.extend(seq(10, 800 * 4));
    let batch = || Options {
        durability: Durability::Batch,
        batch_window: std::time::Duration::from_secs(3600),
        batch_bytes: 1 << 30,
        ..opts()
    };
    let s = Store::open(dir.path(), batch()).unwrap();
    s.put(&committed, &kv_for(&l, &committed), committed.len(), b"")
        .unwrap();
    s.flush().unwrap();
    // The rest waits for its group commit: only this handle sees it.
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    assert_eq!(s.lookup(&tokens, b"").unwrap(), tokens.len());
    let other = Store::open(dir.path(), opts()).unwrap();
    assert_eq!(other.lookup(&tokens, b"").unwrap(), committed.len());
    s.flush().unwrap();
    assert_eq!(other.lookup(&tokens, b"").unwrap(), tokens.len());
}

/// The parent of a chain's first block.
const ROOT: [u8; 32] = [0; 32];

fn index_of(dir: &Path) -> std::sync::Arc<Index> {
    Index::open(&dir.join("index"), true, kvstore::DEFAULT_INDEX_BYTES).unwrap()
}

/// One of the index's tables, as a binary that does not know its meaning
/// (an older one) reaches it.
fn raw_table(
    index: &Index,
    txn: &heed::RoTxn<'_, heed::WithoutTls>,
    name: &str,
) -> heed::Database<heed::types::Bytes, heed::types::Bytes> {
    index.env.open_database(txn, Some(name)).unwrap().unwrap()
}

/// Per block, independently of the marks: is it in the index.
fn indexed(dir: &Path, ids: &[[u8; 32]]) -> Vec<bool> {
    let index = index_of(dir);
    let txn = index.read().unwrap();
    ids.iter()
        .map(|id| index.get_block(&txn, id).unwrap().is_some())
        .collect()
}

/// Per block: is it marked closed (under its parent in this chain).
fn closed(dir: &Path, ids: &[[u8; 32]]) -> Vec<bool> {
    let index = index_of(dir);
    let txn = index.read().unwrap();
    let trusted = index.chains_trusted(&txn).unwrap();
    (0..ids.len())
        .map(|k| {
            let parent = if k == 0 { &ROOT } else { &ids[k - 1] };
            trusted && index.is_closed(&txn, &ids[k], parent).unwrap()
        })
        .collect()
}

/// The reference: leading blocks indexed, one probe each.
fn per_block(dir: &Path, ids: &[[u8; 32]]) -> usize {
    indexed(dir, ids).iter().take_while(|&&x| x).count()
}

/// Marks agree with the model: block k is closed exactly when blocks 0..=k
/// are all indexed (every block here was stored by a put, which knows its
/// parent).
fn assert_marks_follow_the_index(dir: &Path, ids: &[[u8; 32]]) {
    let whole = per_block(dir, ids);
    let marks = closed(dir, ids);
    for (k, &c) in marks.iter().enumerate() {
        assert_eq!(
            c,
            k < whole,
            "block {k}: closed {c}, indexed prefix {whole}"
        );
    }
}

#[test]
fn gc_evicting_the_middle_of_a_chain_ends_the_prefix_and_a_put_closes_it_again() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1200;
    let tokens = seq(31, blocks * 4);
    let s = Store::open(dir.path(), opts()).unwrap();
    // The first half first, then the whole: the first half's tail is the
    // least recently used part, in the middle of the chain.
    s.put(
        &tokens[..600 * 4],
        &kv_for(&l, &tokens[..600 * 4]),
        600 * 4,
        b"",
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    let ids = Keyer::new("lookup-model@1", &l, None).chain(&tokens, 4, b"");
    assert_marks_follow_the_index(dir.path(), &ids);
    check(dir.path(), &s, &tokens, blocks * 4);
    let live: u64 = {
        let index = index_of(dir.path());
        let txn = index.read().unwrap();
        index
            .all_blocks(&txn)
            .unwrap()
            .iter()
            .map(|(_, l)| l.record_len)
            .sum()
    };
    let one = live / blocks as u64;
    let report = s.gc(Some(live - 10 * one), None, NO_PROGRESS).unwrap();
    assert_eq!(report.blocks_evicted, 10);
    let present = indexed(dir.path(), &ids);
    let gone: Vec<usize> = (0..blocks).filter(|&k| !present[k]).collect();
    assert_eq!(
        gone,
        (590..600).collect::<Vec<_>>(),
        "LRU took the first put's tail"
    );
    assert_marks_follow_the_index(dir.path(), &ids);
    check(dir.path(), &s, &tokens, 590 * 4);
    // The put stores the ten again and closes everything after them.
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    assert_marks_follow_the_index(dir.path(), &ids);
    assert!(closed(dir.path(), &ids)[blocks - 1]);
    check(dir.path(), &s, &tokens, blocks * 4);
}

#[test]
fn a_record_quarantined_by_repair_ends_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 900;
    let (s, tokens, ids) = stored_chain(dir.path(), 41, blocks);
    let bad = 333;
    damage_payload(dir.path(), &ids[bad]);
    let report = s.repair(NO_PROGRESS).unwrap();
    assert_eq!(report.damaged.len(), 1);
    assert_marks_follow_the_index(dir.path(), &ids);
    check(dir.path(), &s, &tokens, bad * 4);
}

#[test]
fn pinned_blocks_stay_found_when_gc_evicts_everything_else() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1000;
    let (s, tokens, ids) = stored_chain(dir.path(), 43, blocks);
    let kept = 700;
    assert_eq!(s.pin(&tokens[..kept * 4], b"", 1, None).unwrap(), kept * 4);
    let report = s.gc(Some(0), None, NO_PROGRESS).unwrap();
    assert_eq!(report.blocks_evicted, (blocks - kept) as u64);
    assert_marks_follow_the_index(dir.path(), &ids);
    assert_eq!(closed(dir.path(), &ids)[..kept], vec![true; kept][..]);
    check(dir.path(), &s, &tokens, kept * 4);
}

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }
}

/// Random puts, evictions and quarantines over chains that share prefixes
/// (a trunk and branches off it): after each step, `lookup` on the same
/// handle and (every few steps) on a fresh one equals the per-block
/// reference, the index holds exactly the model's blocks, and the closed
/// marks follow the index.
#[test]
fn lookup_follows_a_model_through_random_puts_evictions_and_quarantines() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(dir.path(), opts()).unwrap();
    let keyer = Keyer::new("lookup-model@1", &l, None);
    let trunk = seq(50, 200 * 4);
    let chains: Vec<Vec<u32>> = (0..5u32)
        .map(|c| {
            let fork = [0, 40, 90, 150, 200][c as usize] * 4;
            let mut t = trunk[..fork].to_vec();
            t.extend(seq(60 + c, 300 * 4 - fork));
            t
        })
        .collect();
    let chain_ids: Vec<Vec<[u8; 32]>> = chains.iter().map(|t| keyer.chain(t, 4, b"")).collect();
    let mut model: HashSet<[u8; 32]> = HashSet::new();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for step in 0..120 {
        let c = rng.below(chains.len());
        let ids = &chain_ids[c];
        match rng.below(4) {
            0 | 1 => {
                // A put of a random prefix (at least 64 blocks: the gallop's
                // threshold) stores every missing block of it.
                let n = 64 + rng.below(ids.len() - 63);
                let t = &chains[c][..n * 4];
                s.put(t, &kv_for(&l, t), t.len(), b"").unwrap();
                model.extend(ids[..n].iter().copied());
            }
            op => {
                let present: Vec<usize> = (0..ids.len())
                    .filter(|&k| model.contains(&ids[k]))
                    .collect();
                if present.is_empty() {
                    continue;
                }
                let k = present[rng.below(present.len())];
                let index = index_of(dir.path());
                let mut txn = index.write().unwrap();
                let loc = index.get_block_rw(&txn, &ids[k]).unwrap().unwrap();
                let removed = if op == 2 {
                    index.delete_block_if_at(&mut txn, &ids[k], &loc).unwrap()
                } else {
                    index
                        .quarantine_if_at(&mut txn, &ids[k], &loc, "model test")
                        .unwrap()
                };
                assert!(removed);
                index.commit(txn, false).unwrap();
                model.remove(&ids[k]);
            }
        }
        for (t, ids) in chains.iter().zip(&chain_ids) {
            let want = ids.iter().take_while(|id| model.contains(*id)).count();
            assert_eq!(
                per_block(dir.path(), ids),
                want,
                "step {step}: the index is the model"
            );
            assert_eq!(
                s.lookup(t, b"").unwrap(),
                want * 4,
                "step {step}: same handle"
            );
            assert_marks_follow_the_index(dir.path(), ids);
        }
        if step % 10 == 0 {
            let fresh = Store::open(dir.path(), opts()).unwrap();
            for (t, ids) in chains.iter().zip(&chain_ids) {
                let want = ids.iter().take_while(|id| model.contains(*id)).count();
                assert_eq!(
                    fresh.lookup(t, b"").unwrap(),
                    want * 4,
                    "step {step}: fresh handle"
                );
            }
            // The invariants verify checks hold (shared prefixes, holes).
            let index = index_of(dir.path());
            let txn = index.read().unwrap();
            assert!(index.chains_trusted(&txn).unwrap());
            assert_eq!(index.check_chains(&txn, 10).unwrap(), Vec::<String>::new());
        }
    }
    let report = s.verify(NO_PROGRESS).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// A binary older than the closed marks removes blocks without unmarking
/// their descendants, and bumps only `generation`: the marks are no longer
/// trusted (lookup falls back to probing every block), and the next open
/// of the index empties them.
#[test]
fn blocks_removed_by_an_older_binary_do_not_leave_a_stale_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 800;
    let (s, tokens, ids) = stored_chain(dir.path(), 47, blocks);
    assert!(closed(dir.path(), &ids)[blocks - 1]);
    let hole = 250;
    {
        let index = index_of(dir.path());
        let mut txn = index.write().unwrap();
        let table = raw_table(&index, &txn, "blocks");
        assert!(table.delete(&mut txn, &ids[hole]).unwrap());
        let g = index.generation(&txn).unwrap();
        index.set_meta_u64(&mut txn, "generation", g + 1).unwrap();
        index.commit(txn, false).unwrap();
        let txn = index.read().unwrap();
        assert!(!index.chains_trusted(&txn).unwrap());
        // The stale marks are there, and would claim the whole chain.
        assert!(index
            .is_closed(&txn, &ids[blocks - 1], &ids[blocks - 2])
            .unwrap());
    }
    check(dir.path(), &s, &tokens, hole * 4);
    // A removal by this version keeps the marks untrusted.
    {
        let index = index_of(dir.path());
        let mut txn = index.write().unwrap();
        let loc = index.get_block_rw(&txn, &ids[600]).unwrap().unwrap();
        assert!(index.delete_block_if_at(&mut txn, &ids[600], &loc).unwrap());
        index.commit(txn, false).unwrap();
        assert!(!index.chains_trusted(&index.read().unwrap()).unwrap());
    }
    check(dir.path(), &s, &tokens, hole * 4);
    s.close().unwrap();
    drop(s);
    assert!(!Index::is_open_here(&dir.path().join("index")));
    // Reopened: the marks are gone and trusted again; a put marks anew.
    let s = Store::open(dir.path(), opts()).unwrap();
    assert!(index_of(dir.path())
        .chains_trusted(&index_of(dir.path()).read().unwrap())
        .unwrap());
    assert_eq!(closed(dir.path(), &ids), vec![false; blocks]);
    check(dir.path(), &s, &tokens, hole * 4);
    let l = layout();
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    check(dir.path(), &s, &tokens, blocks * 4);
    // The put met the blocks stored before the marks were emptied and
    // closed them along with blocks 250 and 600, stored again.
    assert_marks_follow_the_index(dir.path(), &ids);
    assert!(closed(dir.path(), &ids)[blocks - 1]);
}

/// A store written before the marks existed has blocks and no `parents`
/// entries (emptied here, as such a store has them): lookups probe every
/// block and stay exact, holes included; chains stored from now on are
/// closed as they are put.
#[test]
fn a_store_without_marks_is_walked_block_by_block() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let blocks = 1500;
    let (s, tokens, ids) = stored_chain(dir.path(), 53, blocks);
    clear_marks(dir.path());
    assert_eq!(closed(dir.path(), &ids), vec![false; blocks]);
    check(dir.path(), &s, &tokens, blocks * 4);
    remove(dir.path(), &ids[1200]);
    check(dir.path(), &s, &tokens, 1200 * 4);
    let other = seq(54, 300 * 4);
    s.put(&other, &kv_for(&l, &other), other.len(), b"")
        .unwrap();
    let other_ids = Keyer::new("lookup-model@1", &l, None).chain(&other, 4, b"");
    assert_marks_follow_the_index(dir.path(), &other_ids);
    check(dir.path(), &s, &other, other.len()); // A new chain extending the old one (hole at 1200 filled by the put):
                                                // every block of it closed, the old ones included.
    let mut longer = tokens.clone();
    longer.extend(seq(55, 100 * 4));
    s.put(&longer, &kv_for(&l, &longer), longer.len(), b"")
        .unwrap();
    let longer_ids = Keyer::new("lookup-model@1", &l, None).chain(&longer, 4, b"");
    assert_marks_follow_the_index(dir.path(), &longer_ids);
    assert!(closed(dir.path(), &longer_ids)[longer_ids.len() - 1]);
    check(dir.path(), &s, &longer, longer.len());
}

/// Removing a block with more closed descendants than one walk rewrites
/// stops trusting the marks in the same transaction (a bounded write, and
/// no stale mark trusted); lookups stay exact, and the next open empties
/// the marks, which puts then set again.
#[test]
fn removing_a_block_above_a_long_subtree_stops_trusting_the_marks() {
    let l = layout();
    let dir = tempfile::tempdir().unwrap();
    let blocks = kvstore::index::MARK_WALK_MAX + 300;
    let (s, tokens, ids) = stored_chain(dir.path(), 61, blocks);
    assert!(closed(dir.path(), &ids)[blocks - 1]);
    // Under the bound: unmarked, still trusted.
    remove(dir.path(), &ids[blocks - 200]);
    assert!(index_of(dir.path())
        .chains_trusted(&index_of(dir.path()).read().unwrap())
        .unwrap());
    assert_marks_follow_the_index(dir.path(), &ids);
    check(dir.path(), &s, &tokens, (blocks - 200) * 4);
    // Above it: the walk stops, and so does the trust.
    remove(dir.path(), &ids[3]);
    {
        let index = index_of(dir.path());
        let txn = index.read().unwrap();
        assert!(!index.chains_trusted(&txn).unwrap());
        // Some marks below the hole are stale, and not relied on.
        assert!(index
            .is_closed(&txn, &ids[blocks - 201], &ids[blocks - 202])
            .unwrap());
    }
    check(dir.path(), &s, &tokens, 3 * 4);
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    check(dir.path(), &s, &tokens, blocks * 4);
    s.close().unwrap();
    drop(s);
    let s = Store::open(dir.path(), opts()).unwrap();
    assert_eq!(closed(dir.path(), &ids), vec![false; blocks]);
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    assert_marks_follow_the_index(dir.path(), &ids);
    assert!(closed(dir.path(), &ids)[blocks - 1]);
    check(dir.path(), &s, &tokens, blocks * 4);
}

/// Rewrites block `id`'s raw `parents` value with `edit`.
fn edit_link(dir: &Path, id: &[u8; 32], edit: impl FnOnce(&mut Vec<u8>)) {
    let index = index_of(dir);
    let mut txn = index.write().unwrap();
    let table = raw_table(&index, &txn, "parents");
    let mut v = table.get(&txn, id).unwrap().expect("an entry").to_vec();
    edit(&mut v);
    table.put(&mut txn, id, &v).unwrap();
    index.commit(txn, false).unwrap();
}

/// A damaged mark byte (the value an earlier version wrote for "closed",
/// or the closed tag with one bit flipped) does not close a block past a
/// hole; `verify` lists the damaged one and a forged closed mark, and stops
/// trusting the marks.
#[test]
fn a_damaged_mark_does_not_count_past_a_hole() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 200;
    let (s, tokens, ids) = stored_chain(dir.path(), 71, blocks);
    remove(dir.path(), &ids[50]);
    check(dir.path(), &s, &tokens, 50 * 4);
    // The gallop probes block 63 after block 31.
    edit_link(dir.path(), &ids[63], |v| v[32] = 1);
    check(dir.path(), &s, &tokens, 50 * 4);
    // One bit off the closed tag.
    edit_link(dir.path(), &ids[127], |v| {
        v[32] = kvstore::index::CLOSED ^ 0x80;
    });
    check(dir.path(), &s, &tokens, 50 * 4);
    let report = s.verify(NO_PROGRESS).unwrap();
    assert!(
        report.problems.iter().any(|p| p.contains("mark byte 0x45")),
        "{:?}",
        report.problems
    );
    assert!(!index_of(dir.path())
        .chains_trusted(&index_of(dir.path()).read().unwrap())
        .unwrap());
    check(dir.path(), &s, &tokens, 50 * 4);
    // After a reopen (marks emptied) and a put, a forged closed mark:
    // lookups would count past the hole until verify finds it.
    s.close().unwrap();
    drop(s);
    let s = Store::open(dir.path(), opts()).unwrap();
    let l = layout();
    s.put(&tokens, &kv_for(&l, &tokens), tokens.len(), b"")
        .unwrap();
    assert_marks_follow_the_index(dir.path(), &ids);
    remove(dir.path(), &ids[50]);
    edit_link(dir.path(), &ids[63], |v| v[32] = kvstore::index::CLOSED);
    // The gallop trusts block 63, and the walk from block 64 finds the rest.
    assert_eq!(
        s.lookup(&tokens, b"").unwrap(),
        blocks * 4,
        "the forged mark counts"
    );
    let report = s.verify(NO_PROGRESS).unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains("its parent is not")),
        "{:?}",
        report.problems
    );
    check(dir.path(), &s, &tokens, 50 * 4);
}

/// A removed block whose `parents` entry is malformed still loses its
/// entry, and its descendants their marks.
#[test]
fn removing_a_block_with_a_malformed_entry_unmarks_its_descendants() {
    let dir = tempfile::tempdir().unwrap();
    let blocks = 200;
    let (s, tokens, ids) = stored_chain(dir.path(), 73, blocks);
    edit_link(dir.path(), &ids[50], |v| v.truncate(20));
    remove(dir.path(), &ids[50]);
    {
        let index = index_of(dir.path());
        let txn = index.read().unwrap();
        assert!(raw_table(&index, &txn, "parents")
            .get(&txn, &ids[50])
            .unwrap()
            .is_none());
        assert!(index.chains_trusted(&txn).unwrap());
    }
    assert_marks_follow_the_index(dir.path(), &ids);
    check(dir.path(), &s, &tokens, 50 * 4);
}
