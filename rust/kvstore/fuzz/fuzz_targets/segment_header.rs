//! Any bytes as a segment header: a header that decodes re-encodes to the
//! same bytes (but for fields the decoder ignores). The input is also tried
//! with its checksum fixed up.
#![no_main]

use kvstore::format::{self, SEGMENT_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    if let Ok(n) = format::decode_segment_header(data) {
        let again = format::encode_segment_header(n);
        // `decode_segment_header` checks neither the header-length field
        // (12..16, under the checksum) nor the reserved u32 (28..32, outside
        // it), so only the other fields must agree; with those two as written
        // the whole header must.
        assert_eq!(again[..12], data[..12], "magic or version differ");
        assert_eq!(again[16..24], data[16..24], "segment number differs");
        if data[12..16] == again[12..16] {
            assert_eq!(
                again[..28],
                data[..28],
                "a segment header that decodes re-encodes differently"
            );
        }
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
