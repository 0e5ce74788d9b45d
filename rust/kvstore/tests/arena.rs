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
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
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
