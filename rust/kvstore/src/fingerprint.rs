//! What the engine reads in a model fingerprint. A fingerprint is an opaque
//! string bound into every block id, except for one thing: telling a user
//! whose store was created under kvstore's first fingerprint scheme why the
//! fingerprint of the same model no longer matches it.
//!
//! The schemes, as the Python package writes them (`kvstore.fingerprint`,
//! `kvstore.hf.fingerprint`), each optionally followed by vLLM's binding
//! `+vllm@sha256:<hex>`:
//!
//! ```text
//! <name>@sha256:<64 hex>    first scheme: SHA-256 of the config and the tensors in memory
//! <name>@ckpt-v1:<64 hex>   the checkpoint files (config.json and weight files)
//! ```

/// The marker of fingerprints computed from checkpoint files.
const CHECKPOINT_SCHEME: &str = "@ckpt-v1:";

/// The fingerprint without vLLM's binding of its own settings.
fn base(fingerprint: &str) -> &str {
    fingerprint.split("+vllm@").next().unwrap_or(fingerprint)
}

fn is_weights_scheme(fingerprint: &str) -> bool {
    base(fingerprint)
        .rsplit_once("@sha256:")
        .is_some_and(|(name, hex)| {
            !name.is_empty() && hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
        })
}

/// What to add to a fingerprint mismatch between a store's fingerprint and
/// the one it is opened with: where the store's is of the first scheme and
/// the other of the checkpoint scheme, the change of scheme and what to do;
/// otherwise nothing.
pub(crate) fn mismatch_note(stored: &str, given: &str) -> &'static str {
    if is_weights_scheme(stored) && base(given).contains(CHECKPOINT_SCHEME) {
        "; the store's fingerprint is of kvstore's earlier scheme (a SHA-256 of the weights \
         as loaded in memory), the model's is of the checkpoint files, as kvstore.hf and the \
         vLLM connector now compute it: no block of this store is reachable under it. Keep \
         using this store by opening it with the store's fingerprint as the model \
         (kvstore.hf.fingerprint(model, source=\"weights\") still computes it; for vLLM, \
         kv_connector_extra_config[\"fingerprint\"]), or give the model a new store"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OLD: &str =
        "llama@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const NEW: &str =
        "llama@ckpt-v1:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn explains_a_store_of_the_first_scheme_opened_with_a_checkpoint_fingerprint() {
        assert!(mismatch_note(OLD, NEW).contains("earlier scheme"));
        let vllm = "+vllm@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let old_vllm = format!("{OLD}{vllm}");
        let new_vllm = format!("{NEW}{vllm}");
        assert!(mismatch_note(&old_vllm, &new_vllm).contains("earlier scheme"));
        let named = format!("org/tiny@rev{}", &OLD[5..]);
        assert!(mismatch_note(&named, NEW).contains("earlier scheme"));
    }

    #[test]
    fn says_nothing_of_other_mismatches() {
        assert_eq!(mismatch_note("org/model@rev", NEW), "");
        assert_eq!(mismatch_note(OLD, "org/model@rev"), "");
        assert_eq!(mismatch_note(OLD, OLD), "");
        assert_eq!(mismatch_note(NEW, OLD), "");
        assert_eq!(mismatch_note("llama@sha256:abc", NEW), "", "not a SHA-256");
        assert_eq!(mismatch_note(&OLD[5..], NEW), "", "no name");
    }
}
