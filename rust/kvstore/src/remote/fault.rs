//! Kinds of remote failure, for the counters, and whom a failure blames.

/// What went wrong with a call, for the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fault {
    Timeout,
    Connection,
    Permission,
    OutOfMemory,
    ClusterDown,
    Other,
}

/// Why a call failed, beyond its [`Fault`].
#[cfg_attr(not(feature = "remote"), allow(dead_code))] // made by the client only
pub(crate) enum Blame {
    /// This node's connection failed (timed out or dropped); it may be a
    /// redirect's target, not the key's node in the map.
    Failed(String),
    /// The call stopped at a redirect to a node whose breaker is open: a
    /// skip, not a fault.
    Skipped,
}

#[cfg(feature = "remote")]
impl Fault {
    pub(crate) fn of(e: &redis::RedisError) -> Fault {
        use redis::ErrorKind as K;
        // A failed pipeline may carry the server's code only in its text.
        let text = e.to_string();
        let code = e.code().unwrap_or_else(|| {
            [
                "NOPERM",
                "WRONGPASS",
                "NOAUTH",
                "OOM",
                "CLUSTERDOWN",
                "MASTERDOWN",
            ]
            .into_iter()
            .find(|c| {
                // `OOM command…`, or a pipeline's `(Index 0, error: "OOM": command…)`.
                text.starts_with(&format!("{c} ")) || text.contains(&format!("\"{c}\""))
            })
            .unwrap_or("")
        });
        if e.is_timeout() {
            Fault::Timeout
        } else if matches!(code, "NOPERM" | "WRONGPASS" | "NOAUTH")
            || e.kind() == K::AuthenticationFailed
        {
            Fault::Permission
        } else if code == "OOM" {
            Fault::OutOfMemory
        } else if code == "CLUSTERDOWN" || code == "MASTERDOWN" {
            Fault::ClusterDown
        } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
            Fault::Connection
        } else {
            Fault::Other
        }
    }
}
