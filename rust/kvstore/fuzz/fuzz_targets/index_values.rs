//! Any bytes as index values: a `Location` decodes from any 40 bytes or more,
//! refuses fewer, and re-encodes to the bytes it came from; a `SegmentInfo`
//! decodes from any 32 bytes or more into the little-endian fields there.
#![no_main]

use kvstore::index::{Location, SegmentInfo, SegmentState, LOCATION_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match Location::decode(data) {
        Some(loc) => {
            assert!(data.len() >= LOCATION_LEN);
            assert_eq!(loc.encode()[..], data[..LOCATION_LEN]);
            assert!(loc.same_record(&loc));
        }
        None => assert!(data.len() < LOCATION_LEN),
    }
    match SegmentInfo::decode(data) {
        Some(info) => {
            let u = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
            assert_eq!(
                (info.committed_len, info.live_bytes, info.live_records),
                (u(8), u(16), u(24))
            );
            assert_eq!(info.state == SegmentState::Active, data[0] == 0);
        }
        None => assert!(data.len() < 32),
    }
});
