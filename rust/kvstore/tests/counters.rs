//! Clients' named counters (`Store::add_counters`): kept per handle, added to
//! the store-wide totals at flush and close, shown by `stats`; checked
//! against a model of what each handle added.

use kvstore::{DType, Durability, Error, Layout, Options, Store};
use std::collections::BTreeMap;

fn open(dir: &std::path::Path) -> Store {
    Store::open(
        dir,
        Options {
            fingerprint: Some("counters@1".into()),
            layout: Some(Layout::new(1, 1, 2, DType::Float16, 4).unwrap()),
            durability: Durability::Sync,
            ..Options::default()
        },
    )
    .unwrap()
}

fn counters(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

#[test]
fn counters_add_up_across_handles_and_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (open(dir.path()), open(dir.path()));
    a.add_counters(&[("vllm.hit_tokens", 64), ("vllm.load_bytes", 1 << 20)])
        .unwrap();
    a.add_counters(&[("vllm.hit_tokens", 32)]).unwrap();
    b.add_counters(&[("vllm.hit_tokens", 5), ("vllm.load_errors", 1)])
        .unwrap();
    // Unsaved: each handle sees the saved totals and its own additions.
    assert_eq!(
        a.stats().unwrap().counters,
        counters(&[("vllm.hit_tokens", 96), ("vllm.load_bytes", 1 << 20)])
    );
    a.flush().unwrap();
    assert_eq!(
        b.stats().unwrap().counters,
        counters(&[
            ("vllm.hit_tokens", 101),
            ("vllm.load_bytes", 1 << 20),
            ("vllm.load_errors", 1)
        ])
    );
    // A second flush adds nothing twice.
    a.flush().unwrap();
    a.close().unwrap();
    b.close().unwrap();
    let c = open(dir.path());
    assert_eq!(
        c.stats().unwrap().counters,
        counters(&[
            ("vllm.hit_tokens", 101),
            ("vllm.load_bytes", 1 << 20),
            ("vllm.load_errors", 1)
        ])
    );
}

#[test]
fn bad_names_are_refused_and_add_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let long = "x".repeat(65);
    for name in ["", "Upper", "space d", "nul\0", &long] {
        let e = s.add_counters(&[("fine", 1), (name, 1)]).unwrap_err();
        assert!(matches!(e, Error::InvalidInput(_)), "{name:?}: {e}");
    }
    assert!(s.stats().unwrap().counters.is_empty());
}

#[test]
fn many_names_are_saved_as_they_come() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    for i in 0..300 {
        s.add_counters(&[(&format!("c{i}"), i)]).unwrap();
    }
    // Not closed: the first 256 names were saved when the handle held them.
    std::mem::forget(s);
    let r = open(dir.path());
    let saved = r.stats().unwrap().counters;
    assert_eq!(saved.len(), 256);
    assert!(saved.iter().all(|(k, v)| *k == format!("c{v}")));
}
