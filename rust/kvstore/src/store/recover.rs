//! Recovery at open: segments whose writer died are truncated to their
//! committed length and sealed; segment files nobody registered are removed.

use super::Inner;
use crate::dir::segment_number;
use crate::error::{Error, IoContext, Result};
use crate::format;
use crate::fs;
use crate::index::SegmentState;
use std::time::Duration;

impl Inner {
    /// Seals every active segment whose writer is gone, truncating what lies
    /// past its committed length (a torn or never-committed tail).
    pub(super) fn recover(&self) -> Result<()> {
        let segments = {
            let txn = self.index.read()?;
            self.index.all_segments(&txn)?
        };
        for (seg, info) in segments {
            if info.state != SegmentState::Active {
                continue;
            }
            let path = self.dir.segment_path(seg);
            let file = match fs::open_existing(&path, true) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    return Err(Error::Io {
                        context: format!("opening {}", path.display()),
                        source: e,
                    })
                }
            };
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => continue, // its writer is alive
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::Io {
                        context: format!("locking {}", path.display()),
                        source: e,
                    })
                }
            }
            // We hold the lock, so its writer has closed it or died. Decide
            // from the entry as it is now, inside the write transaction: the
            // snapshot above may predate the writer's last commits.
            let mut txn = self.index.write()?;
            let Some(mut now) = self.index.get_segment(&txn, seg)? else {
                continue;
            };
            if now.state != SegmentState::Active {
                continue; // sealed by its writer meanwhile
            }
            let len = file
                .metadata()
                .ctx(|| format!("stat {}", path.display()))?
                .len();
            if now.live_records == 0 && now.committed_len <= format::SEGMENT_HEADER_LEN as u64 {
                // Its writer died before committing anything: nothing to keep.
                self.index.delete_segment(&mut txn, seg)?;
                self.index.commit(txn, self.durable())?;
                fs::remove_file(&path).ctx(|| format!("removing {}", path.display()))?;
                continue;
            }
            if len > now.committed_len {
                fs::set_len(&file, now.committed_len)
                    .ctx(|| format!("truncating {}", path.display()))?;
                fs::sync_all(&file).ctx(|| format!("fsync {}", path.display()))?;
            }
            now.state = SegmentState::Sealed;
            self.index.put_segment(&mut txn, seg, &now)?;
            self.index.commit(txn, self.durable())?;
        }
        self.remove_orphans()
    }

    /// Deletes segment files the index does not know, nobody holds, and that
    /// nobody touched for a minute: left by a crash between creating a
    /// segment and registering it (or retiring one and unlinking it). A
    /// writer's brand-new file is young, and locked a moment after creation.
    pub(super) fn remove_orphans(&self) -> Result<()> {
        const ORPHAN_AGE: Duration = Duration::from_secs(60);
        let (known, next): (std::collections::HashSet<u64>, u64) = {
            let txn = self.index.read()?;
            let known = self
                .index
                .all_segments(&txn)?
                .into_iter()
                .map(|(s, _)| s)
                .collect();
            (known, self.index.meta_u64(&txn, "next_segment")?)
        };
        let Ok(entries) = std::fs::read_dir(self.dir.segments_dir()) else {
            return Ok(());
        };
        for e in entries.flatten() {
            let Some(n) = segment_number(&e.file_name()) else {
                continue;
            };
            let Ok(meta) = e.metadata() else { continue };
            let young = meta
                .modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_none_or(|age| age < ORPHAN_AGE);
            // An orphan's number was handed out (`next_segment` moved past
            // it) before its writer died. A file numbered beyond that is not
            // ours to judge: the index is older than the segments (restored
            // from a backup?); `verify` and `rebuild-index` deal with it.
            if known.contains(&n) || n >= next || !meta.is_file() || young {
                continue;
            }
            if let Ok(f) = fs::open_existing(&e.path(), false) {
                if f.try_lock().is_ok() {
                    // Re-check under the lock: it may have been registered
                    // after our snapshot of the table.
                    let txn = self.index.read()?;
                    if !self.index.all_segments(&txn)?.iter().any(|(s, _)| *s == n) {
                        let _ = fs::remove_file(&e.path());
                    }
                }
            }
        }
        Ok(())
    }
}
