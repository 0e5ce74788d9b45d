//! Any bytes as a segment header: a header that decodes re-encodes to the
//! same bytes. The input is also tried
//! with its checksum fixed up.
#![no_main]

use kvstore::format::{self, SEGMENT_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    if let Ok((n, version)) = format::decode_segment_header(data) {
        let again = format::encode_segment_header_of(n, version);
        assert_eq!(
            again[..],
            data[..SEGMENT_HEADER_LEN],
            "a segment header that decodes re-encodes differently"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= SEGMENT_HEADER_LEN {
        let mut fixed = data[..SEGMENT_HEADER_LEN].to_vec();
        let crc = crc32c::crc32c(&fixed[..24]);
        fixed[24..28].copy_from_slice(&crc.to_le_bytes());
        check(&fixed);
    }
});
