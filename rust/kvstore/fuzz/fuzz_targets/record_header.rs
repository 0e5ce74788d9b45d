//! Any bytes as a record's meta (header + tokens), with the fuzz layout's
//! bounds: decoding never reads or trusts more than the bounds allow, and a
//! meta that passes its checksum re-encodes to the same bytes. The input is
//! also tried with its checksum fixed up, so the fuzzer gets past it.
#![no_main]

use kvstore::record::{self, RECORD_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fn check(data: &[u8]) {
    let l = kvstore_fuzz::layout();
    let (max_tokens, max_stored) = (l.block_size, l.block_bytes() as u64);
    let Ok(h) = record::decode_header(data, max_tokens, max_stored) else {
        return;
    };
    assert!(h.n_tokens <= max_tokens && h.stored_len <= max_stored);
    let Some(meta) = data.get(..h.meta_len()) else {
        return;
    };
    if record::check_meta(&h, meta).is_err() {
        return;
    }
    let tokens: Vec<u32> = record::tokens(meta).collect();
    assert_eq!(tokens.len(), h.n_tokens as usize);
    let again = record::encode_meta(
        h.flags,
        &h.block_id,
        &tokens,
        h.stored_len,
        h.raw_len,
        h.stored_crc,
        h.raw_crc,
    );
    assert_eq!(again, meta, "a meta that checks re-encodes differently");
    let _ = kvstore::record::check_shape(&h, &l);
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= RECORD_HEADER_LEN {
        let n = u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
        if let Some(meta) = data.get(..RECORD_HEADER_LEN + 4 * n) {
            let mut fixed = meta.to_vec();
            let crc = kvstore_fuzz::meta_crc(&fixed);
            fixed[72..76].copy_from_slice(&crc.to_le_bytes());
            check(&fixed);
        }
    }
});
