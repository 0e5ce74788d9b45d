//! The engine's reports as Python dicts. Each struct here derives
//! `IntoPyObject`, so it becomes a dict keyed by its field names, in field
//! order; `_lib.pyi` types each one as a `TypedDict`. The keys are read by
//! `kvstore.cli`, by users and by tests: renaming a field is an API change.

use pyo3::IntoPyObject;

/// Declares a report struct and its `From` the engine's struct, from one field
/// list: `name: Type` copies the engine's field, `name: Type = f` converts it
/// with `f`.
macro_rules! report {
    ($(#[$meta:meta])* $name:ident from $engine:ty {
        $($field:ident: $ty:ty $(= $conv:expr)?),* $(,)?
    }) => {
        $(#[$meta])*
        #[derive(IntoPyObject)]
        pub struct $name {
            $(pub $field: $ty,)*
        }

        impl From<$engine> for $name {
            fn from(r: $engine) -> Self {
                $name {
                    $($field: report!(@conv r.$field $(, $conv)?),)*
                }
            }
        }
    };
    (@conv $value:expr) => { $value };
    (@conv $value:expr, $conv:expr) => { $conv($value) };
}

/// Converts every element of an engine list.
pub fn list<A, B: From<A>>(v: Vec<A>) -> Vec<B> {
    v.into_iter().map(B::from).collect()
}

report! {
    /// `Store.manifest()`: what the store's MANIFEST says.
    Manifest from kvstore::Manifest {
        format_version: u32,
        fingerprint: String,
        num_layers: u32,
        num_kv_heads: u32,
        head_dim: u32,
        dtype: String,
        block_size: u32,
        created_unix: u64,
        store_id: String,
        storage: Option<String>,
        kind: Option<String>,
    }
}

report! {
    /// One element of `Store.segments()`.
    SegmentReport from kvstore::SegmentReport {
        segment: u64,
        sealed: bool,
        file_bytes: Option<u64>,
        committed_bytes: u64,
        live_bytes: u64,
        live_records: u64,
        dead_bytes: u64,
    }
}

report! {
    /// A damaged record found by `Store.verify()`.
    Damage from kvstore::Damage {
        block_id: String,
        segment: u64,
        offset: u64,
        reason: String,
    }
}

report! {
    /// `Store.verify()`.
    VerifyReport from kvstore::VerifyReport {
        records_checked: u64,
        bytes_checked: u64,
        damaged: Vec<Damage> = list,
        problems: Vec<String>,
    }
}

report! {
    /// `Store.compact()`, and the compaction part of `Store.gc()`.
    CompactReport from kvstore::CompactReport {
        segments_rewritten: u64,
        records_moved: u64,
        records_dropped: u64,
        bytes_before: u64,
        bytes_after: u64,
    }
}

report! {
    /// `Store.gc()`.
    GcReport from kvstore::GcReport {
        blocks_evicted: u64,
        bytes_evicted: u64,
        compact: CompactReport = CompactReport::from,
    }
}

/// A damaged range found by `rebuild_index`, with its segment.
#[derive(IntoPyObject)]
pub struct RebuildDamage {
    pub segment: u64,
    pub start: u64,
    pub end: u64,
    /// Hex, when the record's header still named its block.
    pub block_id: Option<String>,
    pub reason: String,
}

impl From<(u64, kvstore::DamagedRange)> for RebuildDamage {
    fn from((segment, r): (u64, kvstore::DamagedRange)) -> Self {
        RebuildDamage {
            segment,
            start: r.start,
            end: r.end,
            block_id: r.block_id.map(|id| kvstore::block_id_hex(&id)),
            reason: r.reason,
        }
    }
}

report! {
    /// `rebuild_index()`.
    RebuildReport from kvstore::RebuildReport {
        segments: u64,
        records: u64,
        blocks: u64,
        damaged: Vec<RebuildDamage> = list,
        skipped: Vec<String>,
        old_index: Option<String>,
    }
}

/// `Store.stats()`: the engine's figures with the hot tier's flattened in
/// (`hot_*` and `page_kind`; zeros and "none" without a hot tier).
#[derive(IntoPyObject)]
pub struct Stats {
    pub blocks: u64,
    pub sessions: u64,
    pub segments: u64,
    pub segments_v1: u64,
    pub disk_bytes: u64,
    pub live_bytes: u64,
    pub dead_bytes: u64,
    pub raw_live_bytes: u64,
    pub damaged_blocks: u64,
    pub pending_blocks: u64,
    pub read_errors: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    pub total_hit_blocks: u64,
    pub total_miss_blocks: u64,
    pub blocks_written: u64,
    pub blocks_deduped: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    pub block_bytes: u64,
    pub hot_hit_blocks: u64,
    pub disk_hit_blocks: u64,
    pub hot_path: Option<String>,
    pub hot_bytes: u64,
    pub hot_slots: u64,
    pub hot_slots_used: u64,
    pub hot_slots_pinned: u64,
    /// The same as `hot_slots_used`: one block per used slot.
    pub hot_blocks: u64,
    pub hot_evictions: u64,
    pub hot_inserts: u64,
    pub hot_slots_torn: u64,
    /// This handle's waits for the arena's writers' lock that ran out.
    pub hot_lock_timeouts: u64,
    /// This handle's cache fills skipped because that lock was not free.
    pub hot_fills_skipped: u64,
    pub page_kind: String,
    /// Whether this handle maps the arena (false: opened without a hot
    /// tier, the figures read from the store's arena file).
    pub hot_mapped: bool,
    /// The remote tier, if this handle has one.
    pub remote: Option<RemoteStats>,
    /// Clients' named counters (`Store.add_counters`), store-wide.
    pub counters: std::collections::BTreeMap<String, u64>,
}

report! {
    /// `Store.stats()["remote"]`: what the remote tier did for this handle.
    RemoteStats from kvstore::RemoteStats {
        hits: u64,
        misses: u64,
        invalid: u64,
        errors_timeout: u64,
        errors_connection: u64,
        errors_permission: u64,
        errors_oom: u64,
        errors_cluster_down: u64,
        errors_other: u64,
        breaker_skips: u64,
        bytes_read: u64,
        bytes_written: u64,
        blocks_uploaded: u64,
        blocks_present: u64,
        writes_dropped: u64,
        write_failures: u64,
        too_large: u64,
        queued_bytes: u64,
    }
}

report! {
    /// `Store.remote_nodes()`: one node of the remote tier.
    NodeReport from kvstore::NodeReport {
        node: String,
        rtt: Option<f64> = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64()),
        error: Option<String>,
        info: std::collections::BTreeMap<String, String>,
    }
}

report! {
    /// `Store.remote_push()`: what `kvstore remote push` did.
    PushReport from kvstore::PushReport {
        blocks: u64,
        unplaced: u64,
        unreadable: u64,
        uploaded: u64,
        present: u64,
        failed: u64,
        bytes_written: u64,
    }
}

impl From<kvstore::Stats> for Stats {
    fn from(s: kvstore::Stats) -> Self {
        let (hot_path, a) = match s.arena {
            Some(a) => (Some(a.path.clone()), a),
            None => (
                None,
                kvstore::ArenaStats {
                    page_kind: "none".into(),
                    ..Default::default()
                },
            ),
        };
        Stats {
            blocks: s.blocks,
            sessions: s.sessions,
            segments: s.segments,
            segments_v1: s.segments_v1,
            disk_bytes: s.disk_bytes,
            live_bytes: s.live_bytes,
            dead_bytes: s.dead_bytes,
            raw_live_bytes: s.raw_live_bytes,
            damaged_blocks: s.damaged_blocks,
            pending_blocks: s.pending_blocks,
            read_errors: s.read_errors,
            hit_blocks: s.hit_blocks,
            miss_blocks: s.miss_blocks,
            total_hit_blocks: s.total_hit_blocks,
            total_miss_blocks: s.total_miss_blocks,
            blocks_written: s.blocks_written,
            blocks_deduped: s.blocks_deduped,
            bytes_written: s.bytes_written,
            bytes_read: s.bytes_read,
            block_bytes: s.block_bytes,
            hot_hit_blocks: s.hot_hit_blocks,
            disk_hit_blocks: s.disk_hit_blocks,
            hot_path,
            hot_bytes: a.bytes,
            hot_slots: a.slots,
            hot_slots_used: a.slots_used,
            hot_slots_pinned: a.slots_pinned,
            hot_blocks: a.slots_used,
            hot_evictions: a.evictions,
            hot_inserts: a.inserts,
            hot_slots_torn: a.slots_torn,
            hot_lock_timeouts: a.lock_timeouts,
            hot_fills_skipped: a.fills_skipped,
            page_kind: a.page_kind,
            hot_mapped: a.mapped,
            remote: s.remote.map(RemoteStats::from),
            counters: s.counters,
        }
    }
}

report! {
    /// One element of `arenas()`: an arena file and the store it belongs to.
    ArenaInfo from kvstore::ArenaInfo {
        path: String,
        header: String,
        reason: String,
        store_id: Option<String>,
        store_path: Option<String>,
        store_exists: bool,
        owned: bool,
        orphan: bool,
        bytes: u64,
        page_kind: String,
        last_used_ms: u64,
        mapped_by: u64,
        pruned: bool,
    }
}
