//! Any bytes as an index value: a `Location` decodes from any 40 bytes or
//! more, refuses fewer, and re-encodes to the bytes it came from.
#![no_main]

use kvstore::index::{Location, LOCATION_LEN};
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
});
