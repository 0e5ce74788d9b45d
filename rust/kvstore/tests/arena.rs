//! The shared-memory hot tier: sharing, eviction and pins, capacity, hostile
//! arena files, torn slots. Each test puts its arena in its own temporary
//! directory (`hot_dir`), so nothing is left in /dev/shm.

use kvstore::{DType, Durability, Error, Layout, Options, Store};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// 16 KiB blocks: a few MiB of arena holds about a hundred of them.
fn layout() -> Layout {
    Layout::new(2, 2, 64, DType::Float16, 16).unwrap()
}

fn opts(hot_dir: &Path, hot_bytes: u64) -> Options {
    Options {
        fingerprint: Some("arena-test@1".into()),
        layout: Some(layout()),
        durability: Durability::None,
        hot_bytes: Some(hot_bytes),
        hot_dir: Some(hot_dir.to_path_buf()),
        ..Options::default()
    }
}

fn seq(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_003 + i).collect()
}

fn kv_for(tokens: &[u32]) -> Vec<u8> {
    let l = layout();
    let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
    let tb = l.token_bytes();
    let t = tokens.len();
    for lk in 0..(l.num_layers as usize * 2) {
        for (pos, tok) in tokens.iter().enumerate() {
            for j in 0..tb {
                out[(lk * t + pos) * tb + j] =
                    (tok.wrapping_mul(31) ^ (lk as u32 * 7) ^ j as u32) as u8;
            }
        }
    }
    out
}

fn get(s: &Store, tokens: &[u32]) -> usize {
    let mut out = vec![0u8; layout().kv_bytes(tokens.len()).unwrap()];
    let m = s.get_into(tokens, b"", &mut out, tokens.len()).unwrap();
    let expect = kv_for(&tokens[..m]);
    let tb = layout().token_bytes();
    for lk in 0..4 {
        let got = &out[lk * tokens.len() * tb..lk * tokens.len() * tb + m * tb];
        assert!(
            got == &expect[lk * m * tb..(lk + 1) * m * tb],
            "wrong bytes"
        );
    }
    m
}

fn arena_file(hot_dir: &Path) -> PathBuf {
    std::fs::read_dir(hot_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
}

#[test]
fn second_handle_reads_from_the_arena_not_the_segments() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(1, 64);
    let a = Store::open(dir.path(), opts(hot.path(), 8 << 20)).unwrap();
    a.put(&t, &kv_for(&t), 64, b"").unwrap();
    let b = Store::open(dir.path(), opts(hot.path(), 8 << 20)).unwrap();
    assert_eq!(get(&b, &t), 64);
    let st = b.stats().unwrap();
    assert_eq!(
        (st.hot_hit_blocks, st.disk_hit_blocks, st.bytes_read),
        (4, 0, 0)
    );
}

#[test]
fn restart_without_arena_refills_from_segments() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(2, 64);
    {
        let a = Store::open(dir.path(), opts(hot.path(), 8 << 20)).unwrap();
        a.put(&t, &kv_for(&t), 64, b"").unwrap();
    }
    std::fs::remove_file(arena_file(hot.path())).unwrap(); // a reboot
    let b = Store::open(dir.path(), opts(hot.path(), 8 << 20)).unwrap();
    assert_eq!(get(&b, &t), 64);
    assert_eq!(b.stats().unwrap().disk_hit_blocks, 4);
    assert_eq!(get(&b, &t), 64);
    let st = b.stats().unwrap();
    assert_eq!(
        (st.hot_hit_blocks, st.disk_hit_blocks),
        (4, 4),
        "promoted on the first get"
    );
}

#[test]
fn capacity_is_bounded_and_eviction_keeps_pins() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let hot_bytes = 5 << 20;
    let s = Store::open(dir.path(), opts(hot.path(), hot_bytes)).unwrap();
    let st = s.stats().unwrap().arena.unwrap();
    assert!(
        st.bytes <= hot_bytes,
        "arena of {} bytes for hot_bytes {hot_bytes}",
        st.bytes
    );
    assert_eq!(
        std::fs::metadata(arena_file(hot.path())).unwrap().len(),
        st.bytes
    );
    let slots = st.slots;
    let pinned = seq(3, 16 * 8);
    s.put(&pinned, &kv_for(&pinned), pinned.len(), b"").unwrap();
    assert_eq!(s.pin(&pinned, b"", 10, None).unwrap(), pinned.len());
    // Churn through several times the arena's capacity.
    for i in 0..(slots as u32 * 3 / 4) {
        let t = seq(1000 + i, 64);
        s.put(&t, &kv_for(&t), 64, b"").unwrap();
    }
    let st = s.stats().unwrap();
    let a = st.arena.unwrap();
    assert!(a.evictions > 0);
    assert_eq!(a.slots_pinned, 8);
    assert!(a.slots_used <= a.slots);
    let before = s.stats().unwrap().disk_hit_blocks;
    assert_eq!(get(&s, &pinned), pinned.len());
    assert_eq!(
        s.stats().unwrap().disk_hit_blocks,
        before,
        "pinned blocks stayed hot"
    );
    // An early unpinned sequence was evicted: it comes from the segments.
    let first = seq(1000, 64);
    assert_eq!(get(&s, &first), 64);
    assert!(s.stats().unwrap().disk_hit_blocks > before);
}

#[test]
fn full_of_pins_is_store_full_and_higher_priority_wins() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    let slots = s.stats().unwrap().arena.unwrap().slots as usize;
    let all = seq(4, 16 * (slots + 8));
    s.put(&all, &kv_for(&all), all.len(), b"").unwrap();
    let err = s.pin(&all, b"", 5, None).unwrap_err();
    assert!(matches!(err, Error::StoreFull(_)), "{err}");
    let a = s.stats().unwrap().arena.unwrap();
    assert!(a.slots_pinned > 0 && a.slots_pinned <= a.slots);
    // Everything is still readable (from the segments where not hot).
    assert_eq!(get(&s, &all), all.len());
    // A higher priority displaces lower pins.
    let vip = seq(5, 16);
    s.put(&vip, &kv_for(&vip), 16, b"").unwrap();
    assert_eq!(s.pin(&vip, b"", 50, None).unwrap(), 16);
    // Unpinning makes room again.
    s.unpin(&all, b"").unwrap();
    assert_eq!(s.stats().unwrap().arena.unwrap().slots_pinned, 1);
}

#[test]
fn pins_expire() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    let t = seq(6, 64);
    s.put(&t, &kv_for(&t), 64, b"").unwrap();
    s.pin(&t, b"", 7, Some(Duration::from_millis(50))).unwrap();
    assert_eq!(s.stats().unwrap().arena.unwrap().slots_pinned, 4);
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(s.stats().unwrap().arena.unwrap().slots_pinned, 0);
    // And gc may evict them again.
    let r = s.gc(Some(0), None, &|_, _| {}).unwrap();
    assert_eq!(r.blocks_evicted, 4);
}

#[test]
fn gc_keeps_pinned_blocks_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let o = Options {
        hot_bytes: None,
        ..opts(Path::new("/nonexistent"), 0)
    };
    let s = Store::open(dir.path(), o).unwrap();
    let (keep, drop) = (seq(7, 32), seq(8, 32));
    s.put(&keep, &kv_for(&keep), 32, b"").unwrap();
    s.put(&drop, &kv_for(&drop), 32, b"").unwrap();
    s.pin(&keep, b"", 1, None).unwrap();
    let r = s.gc(Some(0), None, &|_, _| {}).unwrap();
    assert_eq!(r.blocks_evicted, 2);
    assert_eq!(s.lookup(&keep, b"").unwrap(), 32);
    assert_eq!(s.lookup(&drop, b"").unwrap(), 0);
}

#[test]
fn hostile_arena_files_are_refused_and_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    // Create the store first to learn the arena's name.
    let name = {
        let hot = tempfile::tempdir().unwrap();
        Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
        arena_file(hot.path()).file_name().unwrap().to_owned()
    };
    let refused = |hot: &Path, what: &str| match Store::open(dir.path(), opts(hot, 4 << 20)) {
        Err(Error::CorruptStore { reason, .. }) => assert!(reason.contains(what), "{reason}"),
        Err(e) => panic!("expected CorruptStore mentioning {what:?}, got {e}"),
        Ok(_) => panic!("hostile arena ({what}) accepted"),
    };
    // A symlink to a file of the attacker's choosing.
    let hot = tempfile::tempdir().unwrap();
    let target = hot.path().join("target");
    std::fs::write(&target, b"precious").unwrap();
    std::os::unix::fs::symlink(&target, hot.path().join(&name)).unwrap();
    refused(hot.path(), "symlink");
    assert_eq!(std::fs::read(&target).unwrap(), b"precious");
    // Wrong size / not an arena.
    let hot = tempfile::tempdir().unwrap();
    let f = hot.path().join(&name);
    std::fs::write(&f, vec![7u8; 12345]).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    refused(hot.path(), "not a kvstore arena");
    // Readable by others.
    let hot = tempfile::tempdir().unwrap();
    let f = hot.path().join(&name);
    std::fs::write(&f, b"").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    refused(hot.path(), "mode");
    // Owned by another user (needs root to set up).
    if rustix_is_root() {
        let hot = tempfile::tempdir().unwrap();
        let f = hot.path().join(&name);
        std::fs::write(&f, b"").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&f, Some(65534), Some(65534)).unwrap();
        refused(hot.path(), "owned by uid 65534");
    }
    // An arena of another store with the same name.
    let hot = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let o2 = Options {
        fingerprint: Some("another-model".into()),
        ..opts(hot.path(), 4 << 20)
    };
    let s2 = Store::open(other.path(), o2).unwrap();
    let theirs = arena_file(hot.path());
    drop(s2);
    std::fs::rename(&theirs, hot.path().join(&name)).unwrap();
    refused(hot.path(), "another store");
}

fn rustix_is_root() -> bool {
    std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
}

#[test]
fn torn_slot_left_by_a_dead_writer_is_reclaimed_on_open() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(9, 16);
    {
        let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
        s.put(&t, &kv_for(&t), 16, b"").unwrap();
        assert_eq!(s.stats().unwrap().arena.unwrap().slots_used, 1);
    }
    // Make every slot's version odd, as a writer killed mid-insert leaves one.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(arena_file(hot.path()))
        .unwrap();
    let word = |off: u64| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, off).unwrap();
        u64::from_le_bytes(b)
    };
    let (nslots, slot_hdr) = (word(16), word(32));
    for slot in 0..nslots {
        let off = 4096 + slot * slot_hdr;
        f.write_all_at(&(word(off) | 1).to_le_bytes(), off).unwrap();
    }
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    let a = s.stats().unwrap().arena.unwrap();
    assert_eq!(
        (a.slots_torn, a.slots_used),
        (0, 0),
        "reclaimed, and the torn block is not served"
    );
    assert_eq!(get(&s, &t), 16);
    assert_eq!(s.stats().unwrap().disk_hit_blocks, 1);
    assert_eq!(get(&s, &t), 16);
    assert_eq!(
        s.stats().unwrap().hot_hit_blocks,
        1,
        "the slot is used again"
    );
}

#[test]
fn too_small_hot_bytes_is_invalid_input() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    assert!(matches!(
        Store::open(dir.path(), opts(hot.path(), 4096)),
        Err(Error::InvalidInput(_))
    ));
    assert_eq!(
        std::fs::read_dir(hot.path()).unwrap().count(),
        0,
        "nothing left behind"
    );
}

/// The arena file of a closed (or open: tmpfs keeps a mapping and the file
/// coherent) store, read and damaged through ordinary file I/O.
struct RawArena {
    file: std::fs::File,
}

// Header and slot header offsets (arena.rs).
const H_NSLOTS: u64 = 16;
const H_SLOT_HDR: u64 = 32;
const H_SLOT_SIZE: u64 = 40;
const H_DATA_OFF: u64 = 48;
const S_STATE: u64 = 40;
const S_CRC: u64 = 72;

impl RawArena {
    fn open(hot_dir: &Path) -> RawArena {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(arena_file(hot_dir))
            .unwrap();
        RawArena { file }
    }

    fn word(&self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.file.read_exact_at(&mut b, off).unwrap();
        u64::from_le_bytes(b)
    }

    fn flip(&self, off: u64, mask: u8) {
        let mut b = [0u8; 1];
        self.file.read_exact_at(&mut b, off).unwrap();
        self.file.write_all_at(&[b[0] ^ mask], off).unwrap();
    }

    fn slot_hdr(&self, slot: u64) -> u64 {
        4096 + slot * self.word(H_SLOT_HDR)
    }

    fn slot_data(&self, slot: u64) -> u64 {
        self.word(H_DATA_OFF) + slot * self.word(H_SLOT_SIZE)
    }

    /// The slots holding a block, in slot order.
    fn used(&self) -> Vec<u64> {
        (0..self.word(H_NSLOTS))
            .filter(|&s| self.word(self.slot_hdr(s) + S_STATE) == 1)
            .collect()
    }
}

#[test]
fn slot_checksums_are_the_lanes_of_the_arena_format() {
    // The arena's layout, which every process mapping it reads: a slot's
    // checksum is the crc32c of four crc32c lanes (little-endian), lane k
    // over runs k, k + 4, ... of the block in order. Computed here with the
    // crc32c crate, independently of the engine's. 5 layers: 10 runs, so
    // lanes 0 and 1 have three runs and lanes 2 and 3 two.
    let layout = Layout::new(5, 1, 8, DType::Float16, 16).unwrap();
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let o = Options {
        layout: Some(layout),
        ..opts(hot.path(), 4 << 20)
    };
    let t = seq(50, 64);
    let kv: Vec<u8> = (0..layout.kv_bytes(64).unwrap())
        .map(|i| (i * 97 + i / 251) as u8)
        .collect();
    Store::open(dir.path(), o)
        .unwrap()
        .put(&t, &kv, 64, b"")
        .unwrap();
    let raw = RawArena::open(hot.path());
    let (block, run) = (layout.block_bytes(), 16 * layout.token_bytes());
    assert_eq!(block / run, 10);
    let used = raw.used();
    assert_eq!(used.len(), 4);
    for slot in used {
        let mut data = vec![0u8; block];
        raw.file
            .read_exact_at(&mut data, raw.slot_data(slot))
            .unwrap();
        let mut lanes = [0u32; 4];
        for (i, r) in data.chunks_exact(run).enumerate() {
            lanes[i % 4] = crc32c::crc32c_append(lanes[i % 4], r);
        }
        let folded: Vec<u8> = lanes.iter().flat_map(|l| l.to_le_bytes()).collect();
        let want = u64::from(crc32c::crc32c(&folded));
        assert_eq!(raw.word(raw.slot_hdr(slot) + S_CRC), want, "slot {slot}");
    }
}

#[test]
fn damaged_header_geometry_is_refused_never_trusted() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(10, 64);
    {
        let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
        s.put(&t, &kv_for(&t), 64, b"").unwrap();
    }
    let raw = RawArena::open(hot.path());
    // Every bit of every geometry word: slot count, ways, slot header and
    // slot sizes, data offset, total. Among them the data offset + 1 (which
    // served another slot's bytes) and slot count + 2^59 (which overflowed a
    // size check and panicked).
    for at in 16..64 {
        for bit in 0..8 {
            raw.flip(at, 1 << bit);
            match Store::open(dir.path(), opts(hot.path(), 4 << 20)) {
                Err(Error::CorruptStore { reason, .. }) => {
                    assert!(reason.contains("arena"), "byte {at} bit {bit}: {reason}");
                }
                Err(e) => panic!("byte {at} bit {bit}: expected CorruptStore, got {e}"),
                Ok(_) => panic!("byte {at} bit {bit}: damaged geometry accepted"),
            }
            raw.flip(at, 1 << bit);
        }
    }
    // Undamaged again: adopted, and every block is served from it.
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    assert_eq!(get(&s, &t), 64);
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (4, 0));
}

#[test]
fn arena_of_another_format_version_is_refused() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    drop(Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap());
    let raw = RawArena::open(hot.path());
    raw.file.write_all_at(&1u64.to_le_bytes(), 8).unwrap();
    match Store::open(dir.path(), opts(hot.path(), 4 << 20)) {
        Err(Error::CorruptStore { reason, .. }) => {
            assert!(reason.contains("arena format 1"), "{reason}");
        }
        Err(e) => panic!("expected CorruptStore, got {e}"),
        Ok(_) => panic!("an arena of format 1 was adopted"),
    }
}

/// Puts 4 blocks through a hot store, damages the slot of one of them with
/// `damage(raw, slot)`, and checks that a store opened afterwards serves it
/// from the segments (a hot-tier miss), repairs the slot, and then serves
/// it from the arena again.
fn damaged_slot_is_a_miss_then_repaired(seed: u32, damage: impl Fn(&RawArena, u64)) {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(seed, 64);
    {
        let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
        s.put(&t, &kv_for(&t), 64, b"").unwrap();
    }
    let raw = RawArena::open(hot.path());
    let used = raw.used();
    assert_eq!(used.len(), 4);
    damage(&raw, used[1]);
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    // The copy-out path (DMA) refuses the damaged slot too.
    let located = s.hot_blocks(&t, b"").unwrap();
    assert_eq!(located.iter().filter(|l| l.is_none()).count(), 1);
    assert_eq!(get(&s, &t), 64, "served bit-exact");
    let st = s.stats().unwrap();
    assert_eq!(
        (st.hot_hit_blocks, st.disk_hit_blocks),
        (3, 1),
        "the damaged block is a hot-tier miss"
    );
    // The disk read re-inserted it: the writer rewrote the damaged slot.
    assert_eq!(get(&s, &t), 64);
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (7, 1), "repaired");
    assert!(s
        .hot_blocks(&t, b"")
        .unwrap()
        .iter()
        .all(std::option::Option::is_some));
    assert_eq!(raw.used(), used, "repaired in place");
}

#[test]
fn flipped_slot_data_byte_is_a_miss() {
    for (k, (at, bit)) in [(0, 0), (1, 3), (5000, 7), (16383, 4)]
        .into_iter()
        .enumerate()
    {
        damaged_slot_is_a_miss_then_repaired(20 + k as u32, |raw, slot| {
            raw.flip(raw.slot_data(slot) + at, 1 << bit);
        });
    }
}

#[test]
fn zeroed_slot_data_page_is_a_miss() {
    damaged_slot_is_a_miss_then_repaired(30, |raw, slot| {
        let page = raw.slot_data(slot).next_multiple_of(4096);
        raw.file.write_all_at(&[0u8; 4096], page).unwrap();
    });
}

#[test]
fn flipped_slot_checksum_is_a_miss() {
    damaged_slot_is_a_miss_then_repaired(31, |raw, slot| {
        raw.flip(raw.slot_hdr(slot) + S_CRC + 2, 0x10);
    });
}

#[test]
fn slot_damaged_while_the_store_is_open_is_a_miss() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(32, 64);
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    s.put(&t, &kv_for(&t), 64, b"").unwrap();
    assert_eq!(get(&s, &t), 64);
    assert_eq!(s.stats().unwrap().hot_hit_blocks, 4);
    // Written through the file, seen through this process's mapping.
    let raw = RawArena::open(hot.path());
    let slot = raw.used()[2];
    raw.flip(raw.slot_data(slot) + 777, 0x40);
    assert_eq!(get(&s, &t), 64, "served bit-exact");
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (7, 1));
    assert_eq!(get(&s, &t), 64);
    assert_eq!(s.stats().unwrap().hot_hit_blocks, 11, "repaired");
}

#[test]
fn blocks_of_any_run_count_round_trip_through_the_arena() {
    // 2L runs per block: 2, 6 and 10 are not multiples of the checksum's
    // lane count (4), 8 is; runs of 7 × 24 × 4 bytes are not multiples of 8.
    for (layers, heads, dim, dtype, bs) in [
        (1, 1, 64, DType::Float16, 16),
        (3, 2, 24, DType::Float32, 7),
        (4, 1, 8, DType::BFloat16, 16),
        (5, 1, 8, DType::Float16, 3),
    ] {
        let layout = Layout::new(layers, heads, dim, dtype, bs).unwrap();
        let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let o = Options {
            layout: Some(layout),
            ..opts(hot.path(), 4 << 20)
        };
        let n = 4 * bs as usize;
        let t = seq(40 + layers, n);
        let kv: Vec<u8> = (0..layout.kv_bytes(n).unwrap())
            .map(|i| (i * 131 + layers as usize) as u8)
            .collect();
        let a = Store::open(dir.path(), o.clone()).unwrap();
        a.put(&t, &kv, n, b"").unwrap();
        let b = Store::open(dir.path(), o).unwrap();
        let mut out = vec![0u8; kv.len()];
        assert_eq!(b.get_into(&t, b"", &mut out, n).unwrap(), n);
        assert!(out == kv, "{layers} layers: wrong bytes");
        let st = b.stats().unwrap();
        assert_eq!(
            (st.hot_hit_blocks, st.disk_hit_blocks),
            (4, 0),
            "{layers} layers"
        );
    }
}

/// A creator killed after it reserved the arena's pages and before it wrote
/// the header leaves a full-size file of zeros: it used to be refused ("bad
/// magic") by every later open, for good. It is removed and created afresh.
#[test]
fn an_arena_its_creator_left_unfinished_is_replaced() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(21, 64);
    let len = {
        let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
        s.put(&t, &kv_for(&t), 64, b"").unwrap();
        std::fs::metadata(arena_file(hot.path())).unwrap().len()
    };
    let path = arena_file(hot.path());
    std::fs::write(&path, vec![0u8; len as usize]).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let s = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    assert_eq!(get(&s, &t), 64, "from the segments");
    assert_eq!(get(&s, &t), 64, "from the new arena");
    let st = s.stats().unwrap();
    assert_eq!((st.hot_hit_blocks, st.disk_hit_blocks), (4, 4));
}

/// An arena whose ready word was damaged while a process maps it: the next
/// opener used to truncate it in place, which faulted (SIGBUS) every process
/// that touched its mapping, and restarted its slot versions under them. The
/// file is replaced instead; the mapper keeps serving its own copy.
#[test]
fn a_damaged_ready_word_leaves_the_mapping_whole() {
    let (dir, hot) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let t = seq(22, 64);
    let a = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    a.put(&t, &kv_for(&t), 64, b"").unwrap();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(arena_file(hot.path()))
        .unwrap();
    file.write_all_at(&[0u8; 8], 96).unwrap(); // the ready word
    let b = Store::open(dir.path(), opts(hot.path(), 4 << 20)).unwrap();
    assert_eq!(get(&a, &t), 64);
    assert_eq!(get(&b, &t), 64);
    let (sa, sb) = (a.stats().unwrap(), b.stats().unwrap());
    assert_eq!(
        (sa.hot_hit_blocks, sa.disk_hit_blocks),
        (4, 0),
        "a kept its arena"
    );
    assert_eq!(
        (sb.hot_hit_blocks, sb.disk_hit_blocks),
        (0, 4),
        "b started a new one"
    );
}
