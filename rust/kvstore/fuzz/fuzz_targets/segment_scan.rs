//! Any bytes as a segment: the scan's report must tile the input and every
//! record it reports must pass every check; the same bytes also drive
//! `damaged_segment`, which damages a valid segment and checks that every
//! record left intact is still found.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvstore_fuzz::scan_checked(data);
    kvstore_fuzz::damaged_segment(data);
});
