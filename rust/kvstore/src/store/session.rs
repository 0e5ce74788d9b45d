//! Sessions: a name bound to a token sequence, per tenant, so an agent can
//! ask for its conversation back after a restart.

use super::Inner;
use crate::error::{Error, Result};

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
        self.index.put_session(&mut txn, &self.tag, name, tokens)?;
        self.index.commit(txn, self.durable())?;
        self.remote_save_session(name, Some(tokens));
        Ok(n)
    }

    /// The tokens of session `name`. With a remote tier, the server's copy
    /// comes first: every host's save sets it, so it is the last one saved
    /// anywhere (an agent that moved to another host and back finds what it
    /// saved there), unless this handle's own save has not reached it; it is
    /// kept here too. Without one, or where the server has none, this store's.
    pub(super) fn session_tokens(&self, name: &str) -> Result<Vec<u32>> {
        let local = {
            let txn = self.index.read()?;
            self.index.get_session(&txn, &self.tag, name)?
        };
        let Some(t) = self.remote_session(name) else {
            return local.ok_or_else(|| Error::SessionNotFound(name.to_string()));
        };
        if local.as_ref() != Some(&t) {
            let mut txn = self.index.write()?;
            self.index.put_session(&mut txn, &self.tag, name, &t)?;
            self.index.commit(txn, self.durable())?;
        }
        Ok(t)
    }

    pub(super) fn sessions(&self) -> Result<Vec<(String, usize)>> {
        let txn = self.index.read()?;
        self.index.sessions(&txn, &self.tag)
    }

    pub(super) fn delete_session(&self, name: &str) -> Result<bool> {
        let mut txn = self.index.write()?;
        let found = self.index.delete_session(&mut txn, &self.tag, name)?;
        self.index.commit(txn, self.durable())?;
        self.remote_save_session(name, None);
        Ok(found)
    }
}
