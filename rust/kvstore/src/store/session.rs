//! Sessions: a name bound to a token sequence, per tenant, so an agent can
//! ask for its conversation back after a restart.
//!
//! ## Versions (with a remote tier)
//!
//! Every save and delete gets a version: the wall clock in nanoseconds, or
//! one more than the store's `session_clock` (every version it wrote or took
//! from the server) where that is later. It is kept in the index
//! (`session_versions`) and in the frame sent to the server, a delete as a
//! versioned tombstone. A load takes whichever copy, this store's or the
//! server's, has the higher version:
//!
//! - the server's only when it is newer, and then keeps it here (a
//!   tombstone deletes the local copy);
//! - this store's when it is newer: a save or delete whose upload is queued
//!   or failed (a restarted handle, or another handle on this store, sees it
//!   too, since the version is in the index); it is sent again to repair
//!   the server;
//! - both at version 0 (sessions saved before versions, on either side):
//!   the server's first, as before.
//!
//! So a save that follows the load of another host's copy always wins over
//! it (causal order), and saves made concurrently on two hosts are ordered
//! by their hosts' clocks: a host whose clock runs ahead wins over a later
//! save made on a host whose clock is behind, until the next load there.
//! A tombstone stays here only until its upload succeeds (or a save or
//! delete replaces it); every open with a remote tier sends the rest again.
//! A delete made without a remote tier keeps no tombstone (nothing would
//! send it), so a server copy from before it may come back on a later load
//! with one.

use super::Inner;
use crate::error::{Error, Result};
use crate::index::LocalSession;
use crate::remote::keys::SessionFrame;

impl Inner {
    pub(super) fn save_session(
        &self,
        name: &str,
        tokens: &[u32],
        kv: &[u8],
        kv_tokens: usize,
    ) -> Result<usize> {
        if name.is_empty() || name.len() > 400 {
            return Err(Error::InvalidInput(format!(
                "session name: expected 1 to 400 bytes of UTF-8, got {} bytes",
                name.len()
            )));
        }
        // The KV may cover fewer tokens than the session binds (a cache that has
        // not seen the last generated token): store what it covers.
        let covered = tokens.len().min(kv_tokens);
        let n = self.put_from(&tokens[..covered], 0, kv, kv_tokens, b"")?;
        let mut w = self.writer.lock().expect("writer lock");
        self.commit_pending(&mut w)?;
        // As for blocks: the rest of the map is kept for gc, which needs
        // pages to delete (a session's tokens may take megabytes).
        if self.index.nearly_full()? {
            return Err(Error::StoreFull(
                "the index map is nearly full (the rest is kept for gc); session not saved: \
                 free blocks or sessions, or reopen with a larger index_bytes"
                    .into(),
            ));
        }
        let mut txn = self.index.write()?;
        let version = self
            .index
            .next_session_version(&mut txn, crate::clock::now_ns())?;
        self.index
            .put_session(&mut txn, &self.tag, name, tokens, version)?;
        self.index.commit(txn, self.durable())?;
        drop(w);
        self.remote_save_session(name, version, Some(tokens));
        Ok(n)
    }

    /// The tokens of session `name`: of this store's copy or the server's,
    /// whichever is newer (see the module doc).
    pub(super) fn session_tokens(&self, name: &str) -> Result<Vec<u32>> {
        let not_found = || Error::SessionNotFound(name.to_string());
        let local = {
            let txn = self.index.read()?;
            self.index.get_session_versioned(&txn, &self.tag, name)?
        };
        let Some(server) = self.remote_session(name) else {
            // None there (or the server could not be asked): a tombstone is
            // sent again, so that it leaves this store once the server has it.
            // (A live copy is not: while the server is down every load would
            // queue its tokens.)
            if local.tokens.is_none() && local.version > 0 {
                self.remote_save_session(name, local.version, None);
            }
            return local.tokens.ok_or_else(not_found);
        };
        if !newer(&server, &local) {
            if server.version < local.version {
                // The server missed this store's last save or delete.
                self.remote_save_session(name, local.version, local.tokens.as_deref());
            }
            return local.tokens.ok_or_else(not_found);
        }
        let mut txn = self.index.write()?;
        // Another handle may have saved since the read above: the newer wins.
        let local = self.index.get_session_versioned(&txn, &self.tag, name)?;
        if !newer(&server, &local) {
            return local.tokens.ok_or_else(not_found);
        }
        match &server.tokens {
            Some(t) => self
                .index
                .put_session(&mut txn, &self.tag, name, t, server.version)?,
            // The server holds this deletion: no tombstone to keep here (the
            // session clock orders later saves here after it all the same).
            None => drop(self.index.delete_session(&mut txn, &self.tag, name, None)?),
        }
        self.index.see_session_version(&mut txn, server.version)?;
        self.index.commit(txn, self.durable())?;
        server.tokens.ok_or_else(not_found)
    }

    pub(super) fn sessions(&self) -> Result<Vec<(String, usize)>> {
        let txn = self.index.read()?;
        self.index.sessions(&txn, &self.tag)
    }

    pub(super) fn delete_session(&self, name: &str) -> Result<bool> {
        let mut txn = self.index.write()?;
        let version = self
            .index
            .next_session_version(&mut txn, crate::clock::now_ns())?;
        // Kept until the server has it; without a remote tier nothing would
        // ever send it, and tombstones would pile up.
        let tombstone = self.remote.is_some().then_some(version);
        let found = self
            .index
            .delete_session(&mut txn, &self.tag, name, tombstone)?;
        self.index.commit(txn, self.durable())?;
        self.remote_save_session(name, version, None);
        Ok(found)
    }

    /// At open: sends again the deletions whose upload never succeeded, so
    /// that tombstones do not stay here for ever.
    pub(super) fn resend_tombstones(&self) -> Result<()> {
        if self.remote.is_none() {
            return Ok(());
        }
        let tombstones = {
            let txn = self.index.read()?;
            self.index.session_tombstones(&txn, &self.tag)?
        };
        for (name, version) in tombstones {
            self.remote_save_session(&name, version, None);
        }
        Ok(())
    }
}

/// Whether the server's copy of a session wins over this store's: newer,
/// or, both from before versions, different (the server's came first then).
fn newer(server: &SessionFrame, local: &LocalSession) -> bool {
    server.version > local.version
        || (server.version == 0 && local.version == 0 && server.tokens != local.tokens)
}
