//! Any bytes as a MANIFEST, and any UTF-8 as its JSON with a correct checksum
//! line appended (so the fuzzer reaches the JSON and layout checks): decoding
//! never panics, and a manifest that decodes round-trips through encode.
#![no_main]

use kvstore::format::Manifest;
use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    let Ok(m) = Manifest::decode(data) else {
        return;
    };
    let _ = m.layout();
    assert_eq!(Manifest::decode(&m.encode()).as_ref(), Ok(&m));
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if let Ok(json) = std::str::from_utf8(data) {
        let crc = crc32c::crc32c(json.as_bytes());
        check(format!("{json}\ncrc32c {crc:08x}\n").as_bytes());
    }
});
