//! The disk format is a contract: these bytes and this fixture must keep
//! reading the same in every later version. A change that breaks them needs a
//! new format version and a migration, not new golden values.

// Golden values stay exactly as they were printed when first pinned.
#![allow(clippy::unreadable_literal, clippy::format_collect)]

use kvstore::format::{self, Manifest};
use kvstore::record;
use kvstore::{DType, Durability, Layout, Options, Store};
use std::path::Path;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn segment_header_bytes() {
    assert_eq!(
        hex(&format::encode_segment_header(0x0102030405060708)),
        "4b56535453454700010000002000000008070605040302016623baef00000000"
    );
}

#[test]
fn record_meta_bytes() {
    let meta = record::encode_meta(
        record::FLAG_ZSTD | record::FLAG_SHUFFLE,
        &[0xab; 32],
        &[1, 2],
        7,
        9,
        0x11223344,
        0x55667788,
    );
    assert_eq!(
        hex(&meta),
        concat!(
            "4b5652430100030002000000000000000700000000000000",
            "0900000000000000",
            "abababababababababababababababababababababababababababababababab",
            "4433221188776655",
            "c62e6fbf",
            "00000000",
            "0100000002000000"
        )
    );
}

const FIXTURE_MODEL: &str = "kvstore-fixture@1";

fn fixture_layout() -> Layout {
    Layout::new(2, 1, 4, DType::Float16, 4).unwrap()
}

/// Sequences stored in the fixture, and their KV: a pure function of the
/// token ids, so the test recomputes it.
fn fixture_data() -> Vec<(Vec<u32>, Vec<u8>)> {
    let l = fixture_layout();
    (0..3u32)
        .map(|s| {
            let tokens: Vec<u32> = (0..8 + 4 * s).map(|i| 1000 * s + i).collect();
            let kv = (0..l.kv_bytes(tokens.len()).unwrap())
                .map(|i| (i as u32 * 31 + s * 7) as u8)
                .collect();
            (tokens, kv)
        })
        .collect()
}

fn fixture_opts(compression_level: i32) -> Options {
    Options {
        fingerprint: Some(FIXTURE_MODEL.into()),
        layout: Some(fixture_layout()),
        durability: Durability::Sync,
        compression_level,
        ..Options::default()
    }
}

/// Writes `tests/fixtures/v1` (run once, by hand, when a format version is
/// released: `KVSTORE_WRITE_FIXTURE=1 cargo test -p kvstore --test golden`).
#[test]
fn write_v1_fixture() {
    if std::env::var("KVSTORE_WRITE_FIXTURE").is_err() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    let _ = std::fs::remove_dir_all(&dir);
    let data = fixture_data();
    {
        let s = Store::open(&dir, fixture_opts(0)).unwrap();
        let (t, kv) = &data[0];
        s.put(t, kv, t.len(), b"").unwrap();
        s.save_session("fixture-session", t, kv, t.len()).unwrap();
    }
    {
        // Compressed records, in a second segment.
        let s = Store::open(&dir, fixture_opts(3)).unwrap();
        for (t, kv) in &data[1..] {
            s.put(t, kv, t.len(), b"").unwrap();
        }
    }
}

#[test]
fn reads_v1_fixture() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    let tmp = tempfile::tempdir().unwrap();
    // Copy: opening may recover (and so write) the store.
    for sub in ["", "index", "segments"] {
        std::fs::create_dir_all(tmp.path().join(sub)).unwrap();
        for e in std::fs::read_dir(src.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file()
                && e.file_name() != "LOCK"
                && e.file_name() != "lock.mdb"
            {
                std::fs::copy(e.path(), tmp.path().join(sub).join(e.file_name())).unwrap();
            }
        }
    }
    let m = Manifest::decode(&std::fs::read(tmp.path().join("MANIFEST")).unwrap()).unwrap();
    assert_eq!(m.format_version, 1);
    assert_eq!(m.fingerprint, FIXTURE_MODEL);
    let s = Store::open(tmp.path(), fixture_opts(0)).unwrap();
    let l = fixture_layout();
    for (tokens, kv) in fixture_data() {
        let full = tokens.len() / 4 * 4;
        let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
        let m = s.get_into(&tokens, b"", &mut out, tokens.len()).unwrap();
        assert_eq!(m, full);
        assert_eq!(out, kv, "fixture KV differs");
    }
    assert_eq!(
        s.session_tokens("fixture-session").unwrap(),
        fixture_data()[0].0
    );
    let st = s.stats().unwrap();
    assert_eq!(st.blocks, 2 + 3 + 4);
    assert!(
        st.live_bytes < st.raw_live_bytes + 9 * 96,
        "compressed records are in the fixture"
    );
    assert!(s.verify(&|_, _| {}).unwrap().damaged.is_empty());
}
