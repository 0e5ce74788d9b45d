//! The disk format is a contract: these bytes and this fixture must keep
//! reading the same in every later version. A change that breaks them needs a
//! new format version and a migration, not new golden values.

// Golden values stay exactly as they were printed when first pinned.
#![allow(clippy::unreadable_literal, clippy::format_collect)]

use kvstore::format::{self, Manifest};
use kvstore::record;
use kvstore::{Codec, DType, Durability, Layout, Options, Store};
use std::path::Path;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn segment_header_bytes() {
    assert_eq!(
        hex(&format::encode_segment_header_of(0x0102030405060708, 1)),
        "4b56535453454700010000002000000008070605040302016623baef00000000"
    );
    assert_eq!(
        hex(&format::encode_segment_header(0x0102030405060708)),
        "4b5653545345470002000000200000000807060504030201954342fc00000000"
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

/// The fixture writers replace checked-in files: `--ignored` alone (or
/// `--include-ignored`) must not run them by accident.
fn require_write_fixture() {
    assert!(
        std::env::var_os("KVSTORE_WRITE_FIXTURE").is_some(),
        "this writes a checked-in fixture: set KVSTORE_WRITE_FIXTURE=1 to mean it"
    );
}

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

fn fixture_opts(codec: Codec) -> Options {
    Options {
        fingerprint: Some(FIXTURE_MODEL.into()),
        layout: Some(fixture_layout()),
        durability: Durability::Sync,
        codec,
        ..Options::default()
    }
}

/// Writes `tests/fixtures/v1` (run once, by hand, when a format version is
/// released: `KVSTORE_WRITE_FIXTURE=1 cargo test -p kvstore --test golden --
/// --ignored --exact write_v1_fixture`).
#[test]
#[ignore = "writes the v1 fixture; run by hand (see its doc)"]
fn write_v1_fixture() {
    require_write_fixture();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1");
    let _ = std::fs::remove_dir_all(&dir);
    let data = fixture_data();
    {
        let s = Store::open(&dir, fixture_opts(Codec::Raw)).unwrap();
        let (t, kv) = &data[0];
        s.put(t, kv, t.len(), b"").unwrap();
        s.save_session("fixture-session", t, kv, t.len()).unwrap();
    }
    {
        // Compressed records, in a second segment.
        let s = Store::open(&dir, fixture_opts(Codec::Zstd(3))).unwrap();
        for (t, kv) in &data[1..] {
            s.put(t, kv, t.len(), b"").unwrap();
        }
    }
}

/// A copy of the v1 fixture store (opening may recover, so write, it).
fn v1_fixture_copy() -> tempfile::TempDir {
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
    tmp
}

/// The version each segment file's header names.
fn segment_versions(root: &Path) -> Vec<u32> {
    let mut v: Vec<u32> = std::fs::read_dir(root.join("segments"))
        .unwrap()
        .map(|e| {
            let b = std::fs::read(e.unwrap().path()).unwrap();
            format::decode_segment_header(&b).unwrap().1
        })
        .collect();
    v.sort_unstable();
    v
}

/// Every fixture sequence reads back bit-exact from `s`.
fn check_fixture_kv(s: &Store) {
    let l = fixture_layout();
    for (tokens, kv) in fixture_data() {
        let full = tokens.len() / 4 * 4;
        let mut out = vec![0u8; l.kv_bytes(tokens.len()).unwrap()];
        let m = s.get_into(&tokens, b"", &mut out, tokens.len()).unwrap();
        assert_eq!(m, full);
        assert_eq!(out, kv, "fixture KV differs");
    }
}

#[test]
fn reads_v1_fixture() {
    let tmp = v1_fixture_copy();
    let manifest = std::fs::read(tmp.path().join("MANIFEST")).unwrap();
    let m = Manifest::decode(&manifest).unwrap();
    assert_eq!(m.format_version, 1);
    assert_eq!(m.fingerprint, FIXTURE_MODEL);
    let s = Store::open(tmp.path(), fixture_opts(Codec::Raw)).unwrap();
    check_fixture_kv(&s);
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
    assert_eq!(
        segment_versions(tmp.path()),
        vec![1, 1],
        "reads do not rewrite"
    );
    let after = std::fs::read(tmp.path().join("MANIFEST")).unwrap();
    assert_eq!(after, manifest, "reads leave the MANIFEST of format 1");
}

/// `compact` rewrites a v1 store's segments as version 2, upgrading its
/// MANIFEST first (not at open: see `tests/format_v2.rs`), and the KV stays
/// bit-exact.
#[test]
fn compact_rewrites_v1_segments_as_v2() {
    let tmp = v1_fixture_copy();
    let s = Store::open(tmp.path(), fixture_opts(Codec::Raw)).unwrap();
    assert_eq!(s.manifest().unwrap().format_version, 1);
    let before = s.stats().unwrap().blocks;
    let r = s.compact(&|_, _| {}).unwrap();
    assert_eq!(s.manifest().unwrap().format_version, format::FORMAT_VERSION);
    let m = Manifest::decode(&std::fs::read(tmp.path().join("MANIFEST")).unwrap()).unwrap();
    assert_eq!(m.format_version, 2);
    assert_eq!(
        (r.segments_rewritten, r.records_moved, r.records_dropped),
        (2, 9, 0)
    );
    assert_eq!(segment_versions(tmp.path()), vec![2]);
    assert_eq!(s.stats().unwrap().blocks, before);
    check_fixture_kv(&s);
    assert!(s.verify(&|_, _| {}).unwrap().damaged.is_empty());
    // Nothing left to upgrade: a second compaction rewrites nothing.
    assert_eq!(s.compact(&|_, _| {}).unwrap().segments_rewritten, 0);
    drop(s);
    let s = Store::open(tmp.path(), fixture_opts(Codec::Raw)).unwrap();
    check_fixture_kv(&s);
    assert_eq!(
        s.session_tokens("fixture-session").unwrap(),
        fixture_data()[0].0
    );
}

/// 128 KiB blocks: payloads a version-2 segment aligns.
fn v2_layout() -> Layout {
    Layout::new(2, 1, 1024, DType::Float16, 16).unwrap()
}

/// A version-2 segment as this build writes it: its header, then each
/// record's zero padding, meta and payload, a large payload on a 4 KiB
/// boundary; small payloads (the fixture layout's) back to back.
#[test]
fn v2_segment_bytes() {
    let l = v2_layout();
    let t: Vec<u32> = (0..48).map(|i| 7000 + i).collect();
    let kv: Vec<u8> = (0..l.kv_bytes(t.len()).unwrap())
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    {
        let o = Options {
            layout: Some(l),
            ..fixture_opts(Codec::Raw)
        };
        let s = Store::open(tmp.path(), o).unwrap();
        s.put(&t, &kv, t.len(), b"").unwrap();
    }
    let bytes = std::fs::read(tmp.path().join("segments/0000000000000001.kvseg")).unwrap();
    let meta_len = record::meta_len(&l);
    assert_eq!(
        hex(&bytes[..32]),
        "4b5653545345470002000000200000000100000000000000248eaf1f00000000"
    );
    let mut at = 32;
    for k in 0..3 {
        let pad = format::pad_before(2, at as u64, meta_len, l.block_bytes() as u64) as usize;
        assert!(
            pad > 0 && bytes[at..at + pad].iter().all(|&b| b == 0),
            "record {k}"
        );
        let payload = at + pad + meta_len;
        assert_eq!(payload % 4096, 0, "record {k}");
        let h = record::decode_header(&bytes[at + pad..payload], 16, 1 << 20).unwrap();
        assert_eq!(h.stored_len, l.block_bytes() as u64);
        // The payload is the block's KV, layer run after layer run.
        let runs = l.block_runs(&kv, t.len(), k);
        assert_eq!(
            &bytes[payload..payload + l.block_bytes()],
            &runs.concat()[..]
        );
        at = payload + l.block_bytes();
    }
    assert_eq!(at, bytes.len());
    assert_eq!(
        (bytes.len(), format!("{:08x}", crc32c::crc32c(&bytes))),
        (405504, "3a960127".to_string())
    );
    assert_eq!(
        hex(&bytes[4096 - meta_len..4096 - meta_len + 80]),
        concat!(
            "4b565243010000001000000000000000000002000000000000000200000000007e709a2a",
            "ef3d8f143725ba60492ff3700c50e223371d9ef631ee4348c28d7eb4bb31ecf0bb31ecf0",
            "d28bd07200000000"
        )
    );

    // Small payloads: no padding, as in version 1.
    let tmp = tempfile::tempdir().unwrap();
    let (t, kv) = &fixture_data()[1];
    {
        let s = Store::open(tmp.path(), fixture_opts(Codec::Raw)).unwrap();
        s.put(t, kv, t.len(), b"").unwrap();
    }
    let bytes = std::fs::read(tmp.path().join("segments/0000000000000001.kvseg")).unwrap();
    let fl = fixture_layout();
    assert_eq!(
        bytes.len(),
        32 + 3 * (record::meta_len(&fl) + fl.block_bytes())
    );
    assert_eq!(&bytes[8..12], &2u32.to_le_bytes());
}

/// The block of the exponent-plane golden record: bf16 `[2, 2, 8, 2, 16]`,
/// few exponents and random mantissas, a pure function of the index.
fn exponent_layout() -> Layout {
    Layout::new(2, 2, 16, DType::BFloat16, 8).unwrap()
}

fn exponent_block() -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..exponent_layout().block_bytes() / 2)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            [
                x as u8,
                0x3c + (x >> 8) as u8 % 4 + ((x >> 16) as u8 & 0x80),
            ]
        })
        .collect()
}

const EXPONENT_RECORD: &str = "tests/fixtures/exponent-record.bin";

fn exponent_record() -> Vec<u8> {
    let l = exponent_layout();
    let kv = exponent_block();
    let chunks: Vec<&[u8]> = kv.chunks(l.chunk_bytes()).collect();
    let tokens: Vec<u32> = (100..108).collect();
    let rec = record::encode(&l, Codec::Exponent, &[0x5a; 32], &tokens, &chunks).unwrap();
    rec.slices().iter().flat_map(|s| s.to_vec()).collect()
}

/// Writes the exponent-plane golden record (by hand, once:
/// `KVSTORE_WRITE_FIXTURE=1 cargo test -p kvstore --test golden -- --ignored
/// --exact write_exponent_record`).
#[test]
#[ignore = "writes the exponent-plane golden record; run by hand (see its doc)"]
fn write_exponent_record() {
    require_write_fixture();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPONENT_RECORD);
    std::fs::write(path, exponent_record()).unwrap();
}

/// A record with the exponent flag, as first written, decodes bit-exact;
/// its header bytes are pinned here.
#[test]
fn exponent_record_bytes() {
    let l = exponent_layout();
    let bytes = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join(EXPONENT_RECORD)).unwrap();
    let (meta, stored) = bytes.split_at(record::meta_len(&l));
    assert_eq!(
        hex(&meta[..record::RECORD_HEADER_LEN]),
        concat!(
            "4b565243010004000800000000000000a2050000000000000008000000000000",
            "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a",
            "b7399535258749074c01418700000000"
        )
    );
    let tokens: Vec<u32> = (100..108).collect();
    let h = record::check_read(&l, meta, &[0x5a; 32], stored.len() as u64, Some(&tokens))
        .unwrap_or_else(|_| panic!("golden record refused"));
    assert_eq!(h.flags, record::FLAG_EXPONENT);
    let mut out = vec![0u8; l.block_bytes()];
    let mut runs: Vec<&mut [u8]> = out.chunks_mut(l.chunk_bytes()).collect();
    record::decode_compressed(&l, &h, stored, &mut runs, &mut Vec::new()).unwrap();
    assert_eq!(out, exponent_block());
    // The low plane is stored as is, after the frame.
    let low: Vec<u8> = exponent_block().iter().step_by(2).copied().collect();
    assert_eq!(&stored[stored.len() - low.len()..], &low[..]);
    // Today's encoder writes the same bytes. (A zstd upgrade may change the
    // frame without changing the format: then only this line moves.)
    assert_eq!(exponent_record(), bytes);
}
