//! The remote tier: a Redis or Valkey server or cluster behind the local
//! store, shared by every host. The local store stays the first tier and the
//! source of durability; the server is a cache that may lose anything.
//!
//! - [`keys`]: key names (tenant tag, hash tags grouping a chain's blocks)
//!   and the MAC sealing each value.
//! - `client`: the connections, one per node, and the slot map; redirects
//!   followed (`wire`: a node's connection, with one deadline per call;
//!   `lookup`: its addresses by that deadline).
//! - [`queue`]: the bounded queue of the background uploader.
//! - [`breaker`]: skips a node that timed out, for a while.
//!
//! After open, every remote failure is a miss (or a dropped write) and a
//! counter; nothing here fails a local put or get.

mod breaker;
#[cfg(feature = "remote")]
mod client;
#[cfg(not(feature = "remote"))]
#[path = "off.rs"]
mod client;
mod fault;
pub(crate) mod keys;
#[cfg(feature = "remote")]
mod lookup;
mod queue;
#[cfg(feature = "remote")]
mod wire;

use crate::error::{Error, Result};
use crate::id::BlockId;
use breaker::Breaker;
use client::{Blame, Client, Fault};
use keys::{session_head_version, session_version, Keys, SESSION_HEAD, SESSION_VALUE_MAX};
use queue::Queue;
pub(crate) use queue::{Item, Kind, Sent};
use std::borrow::Cow;
use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// `host:port` of `node` (`host:port` or a URL): what messages and reports
/// show of a node.
pub(crate) fn addr(node: &str) -> &str {
    let rest = node.split_once("://").map_or(node, |(_, r)| r);
    let rest = rest.split('/').next().unwrap_or(rest);
    // Never a user or password (refused at open, but options may be shown before).
    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
}

/// When a put's blocks reach the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// In the background, through a bounded queue (full: dropped, counted).
    Behind,
    /// Before `put` returns (a failure is counted, never raised).
    Through,
}

impl WriteMode {
    /// Parses `"behind"` or `"through"`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "behind" => Ok(WriteMode::Behind),
            "through" => Ok(WriteMode::Through),
            other => Err(Error::InvalidInput(format!(
                "remote write: expected \"behind\" or \"through\", got {other:?}"
            ))),
        }
    }
}

/// How to reach the remote tier.
#[derive(Clone)]
pub struct RemoteOptions {
    /// `host:port` (or `redis://host:port`) of one node or of cluster nodes;
    /// the cluster is discovered from the first that answers.
    pub nodes: Vec<String>,
    /// ACL user; `None`: `default`.
    pub username: Option<String>,
    /// Password; never shown in a message or `Debug`.
    pub password: Option<String>,
    /// CA certificate (PEM) to trust: connect with TLS (as a `rediss://`
    /// node does, which without it trusts the system's roots).
    pub tls_ca: Option<PathBuf>,
    /// Key namespace (and ACL key pattern root) on the server.
    pub prefix: String,
    /// When a put's blocks reach the server.
    pub write: WriteMode,
    /// Time to live of values, renewed on read; `None`: server eviction only.
    pub ttl: Option<Duration>,
    /// Connection and response timeout of every call.
    pub timeout: Duration,
    /// How long a node that timed out or was unreachable is skipped.
    pub breaker: Duration,
    /// Bound on bytes queued for upload.
    pub queue_bytes: usize,
    /// How long `close` waits for the queue to drain.
    pub close_timeout: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            nodes: Vec::new(),
            username: None,
            password: None,
            tls_ca: None,
            prefix: "kvstore".into(),
            write: WriteMode::Behind,
            ttl: None,
            timeout: Duration::from_secs(1),
            breaker: Duration::from_secs(3),
            queue_bytes: 256 << 20,
            close_timeout: Duration::from_secs(10),
        }
    }
}

impl std::fmt::Debug for RemoteOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteOptions")
            .field(
                "nodes",
                &self.nodes.iter().map(|n| addr(n)).collect::<Vec<_>>(),
            )
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls_ca", &self.tls_ca)
            .field("prefix", &self.prefix)
            .field("write", &self.write)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// What `kvstore remote push` did (`Store::remote_push`).
#[derive(Clone, Debug, Default)]
pub struct PushReport {
    /// Blocks in the store.
    pub blocks: u64,
    /// Blocks whose place in a chain (so whose key) could not be found: put
    /// with `extra` bytes, under another salt than this handle's, or whose
    /// chain's earlier blocks are gone from the store.
    pub unplaced: u64,
    /// Blocks whose record could not be read or failed its header check.
    pub unreadable: u64,
    /// Blocks sent to the server.
    pub uploaded: u64,
    /// Blocks the server had already.
    pub present: u64,
    /// Blocks whose upload failed (counted by kind in the remote stats).
    pub failed: u64,
    /// Value bytes sent.
    pub bytes_written: u64,
}

impl PushReport {
    pub(crate) fn add(&mut self, o: &PushReport) {
        self.uploaded += o.uploaded;
        self.present += o.present;
        self.failed += o.failed;
        self.unreadable += o.unreadable;
        self.bytes_written += o.bytes_written;
    }
}

/// One node of the remote tier as `kvstore remote ping|stats` shows it.
#[derive(Clone, Debug, Default)]
pub struct NodeReport {
    /// `host:port`.
    pub node: String,
    /// Round trip of a `PING` on a fresh connection.
    pub rtt: Option<Duration>,
    /// Why the node could not be reached (names the node and user, never
    /// the password).
    pub error: Option<String>,
    /// Figures from the node's `INFO` (memory, eviction, keys, hits).
    pub info: std::collections::BTreeMap<String, String>,
}

/// What the remote tier did for one handle (`Stats::remote`).
#[derive(Clone, Debug, Default)]
pub struct RemoteStats {
    /// Blocks served from the server (verified).
    pub hits: u64,
    /// Blocks asked of the server and not there (or not reachable).
    pub misses: u64,
    /// Values under a block's key that failed verification (served as misses).
    pub invalid: u64,
    /// Calls that timed out.
    pub errors_timeout: u64,
    /// Calls that could not reach their node.
    pub errors_connection: u64,
    /// Calls refused for lack of permission (ACL).
    pub errors_permission: u64,
    /// Writes refused for lack of memory (`noeviction`).
    pub errors_oom: u64,
    /// Calls answered `CLUSTERDOWN`.
    pub errors_cluster_down: u64,
    /// Other failed calls.
    pub errors_other: u64,
    /// Calls skipped because their node's breaker was open.
    pub breaker_skips: u64,
    /// Value bytes read from the server.
    pub bytes_read: u64,
    /// Value bytes written to the server.
    pub bytes_written: u64,
    /// Blocks uploaded.
    pub blocks_uploaded: u64,
    /// Blocks not uploaded because the server had them.
    pub blocks_present: u64,
    /// Blocks dropped: queue full, or still queued at close.
    pub writes_dropped: u64,
    /// Values (blocks and sessions) whose upload failed (counted by kind
    /// too).
    pub write_failures: u64,
    /// Values (blocks and sessions) not sent because they are larger than the
    /// server accepts (`proto-max-bulk-len`; also counted in `write_failures`).
    pub too_large: u64,
    /// Bytes waiting in the upload queue.
    pub queued_bytes: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    invalid: AtomicU64,
    faults: [AtomicU64; 6],
    breaker_skips: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    blocks_uploaded: AtomicU64,
    blocks_present: AtomicU64,
    writes_dropped: AtomicU64,
    write_failures: AtomicU64,
    too_large: AtomicU64,
}

fn add(c: &AtomicU64, n: usize) {
    c.fetch_add(n as u64, Ordering::Relaxed);
}

/// Ids this handle believes the server holds (uploaded or read), bounded.
const KNOWN_MAX: usize = 1 << 20;

/// Keys whose value on the server this handle found invalid, bounded: their
/// next upload overwrites the value instead of taking it for present.
const INVALID_MAX: usize = 4096;

/// How `Client::set_unless_newer` tells whether the value on the server is
/// newer than the one to set. (Only the client of the `remote` feature
/// reads it.)
#[cfg_attr(not(feature = "remote"), allow(dead_code))]
pub(crate) struct Newer<'a> {
    /// Bytes read of it first.
    pub(crate) head: usize,
    /// Whether a value that begins with these (unchecked) bytes may be
    /// newer; if not, it is set over without reading the rest.
    pub(crate) may_be: &'a dyn Fn(&[u8]) -> bool,
    /// Whether the whole value, read up to `max + 1` bytes, is newer (and
    /// valid: an invalid one is set over).
    pub(crate) is: &'a dyn Fn(&[u8]) -> bool,
    /// The longest valid value.
    pub(crate) max: usize,
}

/// What the uploader thread and the callers share.
struct Shared {
    opts: RemoteOptions,
    keys: Keys,
    /// Shared with the clients, which ask it before following a redirect.
    breaker: Arc<Breaker>,
    counters: Counters,
    queue: Queue,
    writer: Mutex<Client>,
    known: Mutex<HashSet<BlockId>>,
    invalid: Mutex<HashSet<String>>,
}

/// An open remote tier (one per store handle).
pub(crate) struct Remote {
    shared: Arc<Shared>,
    reader: Mutex<Client>,
    /// The uploader thread, and what tells that it ended (its sender is
    /// dropped when it returns).
    uploader: Mutex<Option<(JoinHandle<()>, Receiver<()>)>>,
}

impl Remote {
    /// Connects (`Error::Remote` if no node answers, or authentication or
    /// permission fails) and starts the uploader.
    pub(crate) fn open(opts: &RemoteOptions, tag: &[u8; 16], mac_key: [u8; 32]) -> Result<Remote> {
        if opts.nodes.is_empty() {
            return Err(Error::InvalidInput("remote: nodes is empty".into()));
        }
        if opts.nodes.iter().any(|n| n.contains('@')) {
            // Not echoed: the part before '@' may be a password.
            return Err(Error::InvalidInput(
                "remote nodes: a user or password in a node URL is not accepted; give the \
                 username and the password (from a variable or file) apart"
                    .into(),
            ));
        }
        if opts.prefix.is_empty() || opts.prefix.contains(['{', '}']) {
            return Err(Error::InvalidInput(format!(
                "remote prefix: expected a non-empty string without braces, got {:?}",
                opts.prefix
            )));
        }
        let keys = Keys::new(&opts.prefix, tag, mac_key);
        let breaker = Arc::new(Breaker::new(opts.breaker));
        let reader = Client::connect(opts, &keys.session("kvstore-probe"), &breaker)?;
        let writer = reader.connect_again();
        let shared = Arc::new(Shared {
            opts: opts.clone(),
            keys,
            breaker,
            counters: Counters::default(),
            queue: Queue::new(opts.queue_bytes),
            writer: Mutex::new(writer),
            known: Mutex::new(HashSet::new()),
            invalid: Mutex::new(HashSet::new()),
        });
        let uploader = (opts.write == WriteMode::Behind).then(|| {
            let s = shared.clone();
            let (ended, ends) = mpsc::channel::<()>();
            let t = std::thread::Builder::new()
                .name("kvstore-remote".into())
                .spawn(move || {
                    let _ended = ended;
                    while let Some(batch) = s.queue.pop() {
                        s.write(batch);
                        s.queue.done();
                    }
                })
                .expect("spawn remote uploader");
            (t, ends)
        });
        Ok(Remote {
            shared,
            reader: Mutex::new(reader),
            uploader: Mutex::new(uploader),
        })
    }

    /// Key names and value seals of this tier.
    pub(crate) fn keys(&self) -> &Keys {
        &self.shared.keys
    }

    /// Whether the server is believed to hold block `id` already.
    pub(crate) fn knows(&self, id: &BlockId) -> bool {
        self.shared.known.lock().expect("known lock").contains(id)
    }

    /// Remembers (or forgets) that the server holds these blocks.
    pub(crate) fn mark(&self, ids: &[BlockId], held: bool) {
        self.shared.mark(ids.iter(), held);
    }

    /// Sends a batch (one hash-tag group) to the server: queued (behind) or
    /// at once (through). Never fails: drops are counted.
    pub(crate) fn upload(&self, batch: Vec<Item>) {
        if batch.is_empty() {
            return;
        }
        let ids: Vec<BlockId> = batch.iter().filter_map(|i| i.kind.block()).collect();
        self.shared.mark(ids.iter(), true);
        if self.shared.opts.write == WriteMode::Through {
            self.shared.write(batch);
            return;
        }
        if let Err(batch) = self.shared.queue.push(batch) {
            add(&self.shared.counters.writes_dropped, batch.len());
            self.shared.mark(ids.iter(), false);
        }
    }

    /// The values under `keys` (one hash-tag group), each read up to `max`
    /// bytes (the longest valid value) plus one: a longer one arrives cut
    /// and fails its check. Any failure reads as all absent (and is counted).
    pub(crate) fn fetch(&self, keys: &[String], max: usize) -> Vec<Option<Vec<u8>>> {
        let s = &self.shared;
        let mut c = self.reader.lock().expect("remote reader");
        let res = s.call(&mut c, &keys[0], |c, d| c.get_upto(keys, max, d));
        let vals = res.unwrap_or_else(|| vec![None; keys.len()]);
        let got: usize = vals.iter().flatten().map(Vec::len).sum();
        add(&s.counters.bytes_read, got);
        if let (Some(ttl), true) = (s.opts.ttl, got > 0) {
            let hit: Vec<String> = keys
                .iter()
                .zip(&vals)
                .filter(|(_, v)| v.is_some())
                .map(|(k, _)| k.clone())
                .collect();
            let _ = s.call(&mut c, &hit[0], |c, d| c.expire(&hit, ttl, d));
        }
        vals
    }

    /// The value under one key, read up to `max` bytes plus one as by
    /// [`Remote::fetch`] (absent on any failure, counted).
    pub(crate) fn get(&self, key: &str, max: usize) -> Option<Vec<u8>> {
        let mut c = self.reader.lock().expect("remote reader");
        let keys = [key.to_string()];
        let v = self
            .shared
            .call(&mut c, key, |c, d| c.get_upto(&keys, max, d))
            .and_then(|mut v| v.pop().flatten());
        add(
            &self.shared.counters.bytes_read,
            v.as_ref().map_or(0, Vec::len),
        );
        v
    }

    /// The value under `key` (of block `id`, or a session) failed
    /// verification: not there for this handle, and overwritten by its next
    /// upload of that key. Counted.
    pub(crate) fn found_invalid(&self, key: &str, id: Option<&BlockId>) {
        self.shared.mark(id.into_iter(), false);
        add(&self.shared.counters.invalid, 1);
        let mut bad = self.shared.invalid.lock().expect("invalid lock");
        if bad.len() >= INVALID_MAX {
            bad.clear();
        }
        bad.insert(key.to_string());
    }

    /// Counts blocks served and missed (refused ones: `found_invalid`).
    pub(crate) fn count(&self, hits: usize, misses: usize) {
        let c = &self.shared.counters;
        add(&c.hits, hits);
        add(&c.misses, misses);
    }

    /// Waits (up to `timeout`) for the queue to drain; whether it did.
    pub(crate) fn flush(&self, timeout: Duration) -> bool {
        self.shared.queue.drain(Instant::now() + timeout)
    }

    /// Drains within the close timeout, drops what is left, stops the
    /// uploader: returns within the close timeout and one call's timeout.
    pub(crate) fn close(&self) {
        self.flush(self.shared.opts.close_timeout);
        let dropped = self.shared.queue.close(true);
        add(&self.shared.counters.writes_dropped, dropped);
        let uploader = self.uploader.lock().expect("uploader lock").take();
        self.shared.stop(uploader);
    }

    /// Every node: round trip and server figures, or the error.
    pub(crate) fn nodes(&self) -> Vec<NodeReport> {
        self.reader
            .lock()
            .expect("remote reader")
            .nodes(&self.shared.opts)
    }

    /// Uploads, now, the blocks of one hash-tag group that the server lacks
    /// (`kvstore remote push`): `ids[k]` under `keys[k]`, whose record
    /// `record(k)` reads only for those missing (`None`: unreadable, not sent).
    pub(crate) fn push_group(
        &self,
        keys: &[String],
        ids: &[BlockId],
        mut record: impl FnMut(usize) -> Option<Vec<u8>>,
    ) -> PushReport {
        let s = &self.shared;
        let mut c = s.writer.lock().expect("remote writer");
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        s.send(&mut c, &keys, ids, |k| {
            record(k).map(|v| Cow::Owned(s.keys.seal(keys[k], v)))
        })
    }

    pub(crate) fn stats(&self) -> RemoteStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RemoteStats {
            hits: g(&c.hits),
            misses: g(&c.misses),
            invalid: g(&c.invalid),
            errors_timeout: g(&c.faults[Fault::Timeout as usize]),
            errors_connection: g(&c.faults[Fault::Connection as usize]),
            errors_permission: g(&c.faults[Fault::Permission as usize]),
            errors_oom: g(&c.faults[Fault::OutOfMemory as usize]),
            errors_cluster_down: g(&c.faults[Fault::ClusterDown as usize]),
            errors_other: g(&c.faults[Fault::Other as usize]),
            breaker_skips: g(&c.breaker_skips),
            bytes_read: g(&c.bytes_read),
            bytes_written: g(&c.bytes_written),
            blocks_uploaded: g(&c.blocks_uploaded),
            blocks_present: g(&c.blocks_present),
            writes_dropped: g(&c.writes_dropped),
            write_failures: g(&c.write_failures),
            too_large: g(&c.too_large),
            queued_bytes: self.shared.queue.bytes() as u64,
        }
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        self.shared.queue.close(true);
        let uploader = self.uploader.get_mut().ok().and_then(Option::take);
        self.shared.stop(uploader);
    }
}

impl Shared {
    fn mark<'a>(&self, ids: impl Iterator<Item = &'a BlockId>, held: bool) {
        let mut k = self.known.lock().expect("known lock");
        if held && k.len() >= KNOWN_MAX {
            k.clear();
        }
        for id in ids {
            if held {
                k.insert(*id);
            } else {
                k.remove(id);
            }
        }
    }

    /// Waits for the uploader (its queue closed) to end, for at most one
    /// call's timeout: the batch in flight ends within its calls' deadlines,
    /// and a server must not hold `close` past them. Where it has not ended
    /// by then it is left to end on its own (it holds what it uses).
    fn stop(&self, uploader: Option<(JoinHandle<()>, Receiver<()>)>) {
        let Some((t, ends)) = uploader else { return };
        match ends.recv_timeout(self.opts.timeout) {
            Err(RecvTimeoutError::Timeout) => drop(t),
            Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                let _ = t.join();
            }
        }
    }

    /// Runs `f` on `c` with the call's deadline (one timeout from now)
    /// unless the breaker of `key`'s node is open (or of the node a redirect
    /// sends it to); counts failures and trips the breaker of the node that
    /// timed out or was unreachable (the key's, or the one a redirect sent
    /// the call to). While the slot map may be out of date (after a `MOVED`
    /// or a failed node) it is read again first, within a timeout of its own
    /// (`refresh`), so that a slot moved off a failed node is neither blamed
    /// on it nor skipped, and the call has its whole timeout: a frozen node
    /// costs one timeout, and a call two at most.
    fn call<T>(
        &self,
        c: &mut Client,
        key: &str,
        f: impl FnOnce(&mut Client, Instant) -> Result<T, Fault>,
    ) -> Option<T> {
        if c.stale() {
            self.refresh(c, Instant::now() + self.opts.timeout);
        }
        let node = c.node_of(key).to_string();
        if !self.breaker.allow(&node) {
            add(&self.counters.breaker_skips, 1);
            return None;
        }
        c.take_blame();
        let fault = match f(c, Instant::now() + self.opts.timeout) {
            Ok(v) => {
                self.breaker.reset(&node);
                return Some(v);
            }
            Err(fault) => fault,
        };
        let failed = match c.take_blame() {
            Some(Blame::Skipped) => {
                add(&self.counters.breaker_skips, 1);
                return None;
            }
            Some(Blame::Failed(n)) => n,
            None => node,
        };
        add(&self.counters.faults[fault as usize], 1);
        if matches!(fault, Fault::Timeout | Fault::Connection) {
            self.breaker.trip(&failed);
            c.mark_stale();
        }
        None
    }

    /// Reads the slot map again from the first node that answers, by
    /// `deadline`, skipping nodes whose breaker is open; a node that fails
    /// here trips its breaker too (it costs the next call nothing). With no
    /// time left the map stays marked out of date, for a later call.
    fn refresh(&self, c: &mut Client, deadline: Instant) {
        for n in c.slot_nodes() {
            if Instant::now() >= deadline {
                return;
            }
            if self.breaker.is_open(&n) {
                continue;
            }
            match c.refresh_from(&n, deadline) {
                Ok(()) => return,
                Err(fault) => {
                    add(&self.counters.faults[fault as usize], 1);
                    if matches!(fault, Fault::Timeout | Fault::Connection) {
                        self.breaker.trip(&n);
                    }
                }
            }
        }
    }

    /// Uploads the values of one hash-tag group (one slot) that the server
    /// lacks (no non-empty string under the key), or that this handle found
    /// invalid there: `keys[k]` for block `ids[k]`, whose value `value(k)`
    /// makes only for those sent (`None`: unreadable, not sent).
    /// Counts and remembers what happened; a failure is counted, never raised.
    fn send<'v>(
        &self,
        c: &mut Client,
        keys: &[&str],
        ids: &[BlockId],
        mut value: impl FnMut(usize) -> Option<Cow<'v, [u8]>>,
    ) -> PushReport {
        let mut rep = PushReport::default();
        let forced: Vec<bool> = {
            let bad = self.invalid.lock().expect("invalid lock");
            keys.iter().map(|k| bad.contains(*k)).collect()
        };
        // Which the server has (`None`: the call failed, counted).
        let asked: Vec<&str> = (0..keys.len())
            .filter(|&k| !forced[k])
            .map(|k| keys[k])
            .collect();
        let there = if asked.is_empty() {
            Some(Vec::new())
        } else {
            self.call(c, asked[0], |c, d| c.present(&asked, d))
        };
        let Some(there) = there else {
            rep.failed = keys.len() as u64;
            add(&self.counters.write_failures, keys.len());
            self.mark(ids.iter(), false);
            return rep;
        };
        let mut there = there.into_iter();
        let mut present = Vec::new();
        let mut todo = Vec::new();
        for k in 0..keys.len() {
            if !forced[k] && there.next().unwrap_or(false) {
                present.push(k);
            } else if let Some(v) = value(k) {
                if self.fits(c, &v) {
                    todo.push((k, v));
                } else {
                    rep.failed += 1;
                    self.mark(std::iter::once(&ids[k]), false);
                }
            } else {
                rep.unreadable += 1;
            }
        }
        rep.present = present.len() as u64;
        add(&self.counters.blocks_present, present.len());
        self.mark(present.iter().map(|&k| &ids[k]), true);
        if todo.is_empty() {
            return rep;
        }
        let pairs: Vec<(&str, &[u8])> = todo.iter().map(|(k, v)| (keys[*k], &v[..])).collect();
        let ttl = self.opts.ttl;
        let sent = todo.iter().map(|(k, _)| &ids[*k]);
        if self
            .call(c, pairs[0].0, |c, d| c.set_all(&pairs, ttl, d))
            .is_some()
        {
            rep.uploaded = todo.len() as u64;
            rep.bytes_written = pairs.iter().map(|(_, v)| v.len() as u64).sum();
            add(&self.counters.bytes_written, rep.bytes_written as usize);
            add(&self.counters.blocks_uploaded, todo.len());
            self.mark(sent.clone(), true);
            let mut bad = self.invalid.lock().expect("invalid lock");
            if !bad.is_empty() {
                for (k, _) in &todo {
                    bad.remove(keys[*k]);
                }
            }
        } else {
            rep.failed += todo.len() as u64;
            add(&self.counters.write_failures, todo.len());
            self.mark(sent, false);
        }
        rep
    }

    /// Whether `value` is within the server's bulk limit
    /// (`proto-max-bulk-len`): over it the server would drop the connection,
    /// and the node look dead to the breaker, so it is not sent (counted as
    /// too large and as a failed write).
    fn fits(&self, c: &Client, value: &[u8]) -> bool {
        let fits = value.len() as u64 <= c.max_value();
        if !fits {
            add(&self.counters.too_large, 1);
            add(&self.counters.write_failures, 1);
        }
        fits
    }

    /// Uploads a session's value at `version` unless the server holds a
    /// valid one at least as new (a later save or delete from another host,
    /// which a late upload of an older one must not replace). Whether the
    /// server now holds this version or a newer one; a failure is counted.
    fn send_session(&self, c: &mut Client, key: &str, value: &[u8], version: u64) -> bool {
        if !self.fits(c, value) {
            return false;
        }
        let may_be = |head: &[u8]| session_head_version(head).is_some_and(|v| v >= version);
        let is = |there: &[u8]| {
            self.keys
                .open(key, there)
                .and_then(session_version)
                .is_some_and(|v| v >= version)
        };
        let newer = Newer {
            head: SESSION_HEAD,
            may_be: &may_be,
            is: &is,
            max: SESSION_VALUE_MAX,
        };
        let ttl = self.opts.ttl;
        let set = self.call(c, key, |c, d| {
            c.set_unless_newer((key, value), ttl, &newer, d)
        });
        if set.is_none() {
            add(&self.counters.write_failures, 1);
            return false;
        }
        if set == Some(true) {
            add(&self.counters.bytes_written, value.len());
        }
        // The server holds a valid value under the key again.
        self.invalid.lock().expect("invalid lock").remove(key);
        true
    }

    /// Uploads one batch of the queue: a hash-tag group's blocks, or a
    /// session.
    fn write(&self, batch: Vec<Item>) {
        let mut c = self.writer.lock().expect("remote writer");
        let mut blocks = Vec::with_capacity(batch.len());
        let mut done = Vec::new();
        for item in batch {
            match item.kind {
                Kind::Block(id) => blocks.push((item.key, item.value, id)),
                Kind::Session { version, sent } => {
                    if self.send_session(&mut c, &item.key, &item.value, version) {
                        done.extend(sent);
                    }
                }
            }
        }
        if !blocks.is_empty() {
            let keys: Vec<&str> = blocks.iter().map(|(k, _, _)| k.as_str()).collect();
            let ids: Vec<BlockId> = blocks.iter().map(|(_, _, id)| *id).collect();
            self.send(&mut c, &keys, &ids, |k| {
                Some(Cow::Borrowed(&blocks[k].1[..]))
            });
        }
        drop(c);
        // Not under the writer lock: a tombstone's takes the index's.
        for f in done {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::addr;

    #[test]
    fn addr_is_host_and_port_only() {
        assert_eq!(addr("10.0.0.5:6379"), "10.0.0.5:6379");
        assert_eq!(addr("rediss://cache-1:6380/0"), "cache-1:6380");
        assert_eq!(addr("redis://kv:secret@cache-1:6379"), "cache-1:6379");
        assert_eq!(addr("kv:secret@cache-1:6379"), "cache-1:6379");
    }
}
