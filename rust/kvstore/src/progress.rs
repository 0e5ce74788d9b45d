//! Progress reports of long work (`verify`, `compact`, `gc`, `rebuild_index`).

/// A progress callback: called with (done, total) as the work advances.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Sync);
