//! The connection to the server: one node or a cluster. Commands are packed
//! and replies parsed by the `redis` crate, and sent over connections of our
//! own (`wire`), one per node, where every call has one deadline for
//! connecting, writing and reading all its replies. The crate's sync cluster
//! client (its async one stalled after a node died; see the notes) only
//! follows redirects. Which node serves a key is read from `CLUSTER SLOTS`
//! at open (and again when it may have changed), for the circuit breaker and
//! to send a pipeline to its node. TLS: rustls with ring, trusting the CA of
//! `tls_ca` (or the system's roots for a `rediss://` node without one).

use super::keys::slot;
use super::wire::{Target, Wire};
use super::{addr, Newer, NodeReport, RemoteOptions};
use crate::error::{Error, Result};
use redis::cluster::{ClusterClientBuilder, ClusterConnection};
use redis::{Cmd, RedisError, TlsCertificates, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use super::fault::Fault;

// Two per store handle: their size does not matter.
#[allow(clippy::large_enum_variant)]
enum Conn {
    Single {
        target: Target,
        conn: Option<Wire>,
    },
    /// The crate's cluster connection, which follows redirects (`run`);
    /// `None` after the slot map changed, made again on its next use (making
    /// it reaches every node, which a call's deadline cannot bound).
    Cluster(Option<Box<ClusterConnection>>),
}

/// One connection (a reader's or the uploader's) and the slot map.
pub(crate) struct Client {
    conn: Conn,
    /// `(first slot, last slot, node)`, sorted; empty for one node.
    slots: Vec<(u16, u16, String)>,
    single_node: String,
    tls: Tls,
    /// The server's bulk limit (`proto-max-bulk-len`) in bytes.
    max_value: u64,
    /// How to reach a node (user and password), for `direct`.
    opts: RemoteOptions,
    /// A cluster's pipelines go to the node of their slot over these, one per
    /// node of `slots` (see `run`).
    direct: HashMap<String, Wire>,
    /// The slot map may be out of date: a node failed, or a key was
    /// redirected. Read again (`refresh_from`) when a call has time left.
    stale: bool,
    /// The server refused the commands of a transaction (a user without
    /// `@transaction`, or they are unknown): sessions are set without
    /// asking (`set_unless_newer`).
    no_transactions: bool,
}

/// Redis's default `proto-max-bulk-len`, assumed when `CONFIG GET` is refused.
const DEFAULT_MAX_BULK: u64 = 512 << 20;

/// How connections are made: plain TCP, or TLS trusting `certs` (the CA of
/// `tls_ca`; `None`: the system's roots).
#[derive(Clone)]
struct Tls {
    on: bool,
    /// For the crate's cluster connection.
    certs: Option<TlsCertificates>,
    /// For this client's own connections (`wire`); `Some` when `on`.
    config: Option<Arc<rustls::ClientConfig>>,
}

impl Tls {
    /// TLS when `tls_ca` is given or a node is a `rediss://` URL.
    fn of(opts: &RemoteOptions) -> Result<Tls> {
        let on = opts.tls_ca.is_some() || opts.nodes.iter().any(|n| n.starts_with("rediss://"));
        if on {
            // rustls needs one process-wide crypto provider; the first wins
            // (a host program may have installed its own).
            static PROVIDER: std::sync::Once = std::sync::Once::new();
            PROVIDER.call_once(|| {
                let _ = rustls::crypto::ring::default_provider().install_default();
            });
        }
        let certs = opts
            .tls_ca
            .as_ref()
            .map(|path| {
                std::fs::read(path)
                    .map(|pem| TlsCertificates {
                        client_tls: None,
                        root_cert: Some(pem),
                    })
                    .map_err(|e| Error::Remote(format!("remote tls_ca {}: {e}", path.display())))
            })
            .transpose()?;
        let config = if on {
            Some(Arc::new(tls_config(opts, certs.as_ref())?))
        } else {
            None
        };
        Ok(Tls { on, certs, config })
    }

    /// How this client's own connections reach `node` (`host:port` or a URL).
    fn target(&self, opts: &RemoteOptions, node: &str) -> Result<Target> {
        Target::new(
            addr(node),
            self.config.clone(),
            opts.username.clone(),
            opts.password.clone(),
        )
        .ok_or_else(|| Error::Remote(format!("remote node {:?}: not an address", addr(node))))
    }

    /// `redis://` or `rediss://` URL of `node` (`host:port` or a URL; a user
    /// or password in it was refused when the options were checked).
    fn url(&self, node: &str) -> String {
        let scheme = if self.on { "rediss" } else { "redis" };
        format!("{scheme}://{}", addr(node))
    }
}

/// A message naming the node and the user, never the password.
fn open_error(opts: &RemoteOptions, node: &str, what: &str, e: &RedisError) -> Error {
    let user = opts.username.as_deref().unwrap_or("default");
    let node = addr(node);
    let mut msg = format!("remote node {node} (user {user:?}): {what}: {e}");
    if let Some(p) = opts.password.as_deref().filter(|p| !p.is_empty()) {
        msg = msg.replace(p, "***");
    }
    Error::Remote(msg)
}

/// What failed at open, for the message: `step` (`None`: the connection
/// itself) and the kind of the error.
fn open_what(tls: &Tls, step: Option<&str>, probe_key: &str, e: &RedisError) -> String {
    let fault = Fault::of(e);
    match (step, fault) {
        (None, Fault::Permission) => "authentication failed".into(),
        (None, _) if e.is_connection_refusal() => "unreachable".into(),
        (None, _) if tls.on => "TLS connection failed (is tls_ca the CA of its certificate, and \
                                the port a TLS port?)"
            .into(),
        (None, _) => "unreachable (if the port speaks TLS: give tls_ca or a rediss:// node)".into(),
        (Some("EXISTS"), Fault::Permission) => format!("may not use the keys under {probe_key:?}"),
        (Some(step), Fault::Permission) => format!("{step}: permission denied"),
        (Some(step), Fault::Timeout) => format!("{step}: no answer within the timeout"),
        (Some(step), Fault::Connection) => format!("{step}: connection lost"),
        (Some(step), _) => format!("{step}: refused"),
    }
}

impl Client {
    /// Connects to the first node of `opts.nodes` that answers, finds out
    /// whether it is a cluster, and checks that the user may read and write
    /// `probe_key`. A node that fails (unreachable, frozen, loading) is
    /// passed over for the next; a refused password or permission fails at
    /// once, as every node would refuse it. Every failure is `Error::Remote`.
    pub(crate) fn connect(opts: &RemoteOptions, probe_key: &str) -> Result<Client> {
        let tls = Tls::of(opts)?;
        let mut last = None;
        for node in &opts.nodes {
            match Client::connect_to(opts, &tls, node, probe_key)? {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Remote("remote: no nodes given".into())))
    }

    /// `connect` on one node: `Err` for a failure that ends the search,
    /// `Ok(Err)` for one that moves on to the next node. Each step has the
    /// timeout.
    fn connect_to(
        opts: &RemoteOptions,
        tls: &Tls,
        node: &str,
        probe_key: &str,
    ) -> Result<Result<Client>> {
        let target = tls.target(opts, node)?;
        let deadline = || Instant::now() + opts.timeout;
        let fail = |step: Option<&str>, e: &RedisError| -> Result<Result<Client>> {
            let err = open_error(opts, node, &open_what(tls, step, probe_key, e), e);
            if Fault::of(e) == Fault::Permission {
                Err(err)
            } else {
                Ok(Err(err))
            }
        };
        let mut conn = match Wire::connect(&target, deadline()) {
            Ok(c) => c,
            Err(e) => return fail(None, &e),
        };
        let info_text: String = match conn.query(redis::cmd("INFO").arg("cluster"), deadline()) {
            Ok(t) => t,
            Err(e) => return fail(Some("INFO cluster"), &e),
        };
        // Restricted ACL users may not run CONFIG: then assume the default.
        let max_value = conn
            .query::<Vec<String>>(
                redis::cmd("CONFIG").arg("GET").arg("proto-max-bulk-len"),
                deadline(),
            )
            .ok()
            .and_then(|kv| kv.get(1)?.parse().ok())
            .unwrap_or(DEFAULT_MAX_BULK);
        let (conn, slots) = if info_text.contains("cluster_enabled:1") {
            let slots = match conn.query(redis::cmd("CLUSTER").arg("SLOTS"), deadline()) {
                Ok(v) => parse_slots(v),
                Err(e) => return fail(Some("CLUSTER SLOTS"), &e),
            };
            let cluster = match cluster_connection(opts, tls) {
                Ok(c) => c,
                Err(e) => return fail(Some("cluster connection"), &e),
            };
            (Conn::Cluster(Some(Box::new(cluster))), slots)
        } else {
            let single = Conn::Single {
                target,
                conn: Some(conn),
            };
            (single, Vec::new())
        };
        let mut me = Client {
            conn,
            slots,
            single_node: addr(node).to_string(),
            tls: tls.clone(),
            max_value,
            opts: opts.clone(),
            direct: HashMap::new(),
            stale: false,
            no_transactions: false,
        };
        let probe: RedisResult<Vec<i64>> = me.run(
            vec![redis::cmd("EXISTS").arg(probe_key).clone()],
            deadline(),
        );
        match probe {
            Ok(_) => Ok(Ok(me)),
            Err(e) => fail(Some("EXISTS"), &e),
        }
    }

    /// A second connection with the same settings (for the uploader).
    pub(crate) fn connect_again(&self, opts: &RemoteOptions) -> Result<Client> {
        let conn = match &self.conn {
            Conn::Single { target, .. } => Conn::Single {
                target: target.clone(),
                conn: None,
            },
            Conn::Cluster(_) => Conn::Cluster(Some(Box::new(
                cluster_connection(opts, &self.tls)
                    .map_err(|e| open_error(opts, &self.single_node, "cluster connection", &e))?,
            ))),
        };
        Ok(Client {
            conn,
            slots: self.slots.clone(),
            single_node: self.single_node.clone(),
            tls: self.tls.clone(),
            max_value: self.max_value,
            opts: self.opts.clone(),
            direct: HashMap::new(),
            stale: false,
            no_transactions: false,
        })
    }

    /// Whether the slot map may be out of date (see `refresh_from`).
    pub(crate) fn stale(&self) -> bool {
        self.stale
    }

    /// A node of the map failed: slots may have moved off it (a replica
    /// promoted in its place), and the crate follows a redirect of a single
    /// command silently, without telling this map.
    pub(crate) fn mark_stale(&mut self) {
        self.stale = !self.slots.is_empty();
    }

    /// The nodes of the slot map (none for one node).
    pub(crate) fn slot_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self.slots.iter().map(|r| r.2.clone()).collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// Reads the slot map from `node` by `deadline` (over this client's
    /// connection to it, made if need be). Where the map changed, the crate's
    /// cluster connection is made again on its next use: it learns a new map
    /// only from a redirect, and a dead master sends none, so it kept sending
    /// that master's slots to its address for the life of the handle.
    pub(crate) fn refresh_from(&mut self, node: &str, deadline: Instant) -> Result<(), Fault> {
        let v = self
            .on_node(node, deadline, |w| {
                w.query::<Value>(redis::cmd("CLUSTER").arg("SLOTS"), deadline)
            })
            .map_err(|e| {
                let fault = Fault::of(&e);
                if !matches!(fault, Fault::Timeout | Fault::Connection) {
                    // The node answered but will not tell (refused to the
                    // user): asking again at every call would only cost.
                    self.stale = false;
                }
                fault
            })?;
        let slots = parse_slots(v);
        if slots.is_empty() {
            self.stale = false;
            return Err(Fault::Other);
        }
        if slots != self.slots {
            if let Conn::Cluster(c) = &mut self.conn {
                *c = None;
            }
        }
        self.direct.retain(|n, _| slots.iter().any(|r| &r.2 == n));
        self.slots = slots;
        self.stale = false;
        Ok(())
    }

    /// The largest value the server accepts, in bytes.
    pub(crate) fn max_value(&self) -> u64 {
        self.max_value
    }

    /// The node serving `key` (for the breaker).
    pub(crate) fn node_of(&self, key: &str) -> &str {
        if self.slots.is_empty() {
            return &self.single_node;
        }
        let s = slot(key.as_bytes());
        let i = self.slots.partition_point(|r| r.1 < s);
        match self.slots.get(i) {
            Some(r) if r.0 <= s => &r.2,
            _ => &self.single_node,
        }
    }

    /// Runs `cmds` (keys of one slot) as one pipeline by `deadline`; one
    /// result each. (The commands move into the pipeline: a `SET`'s value is
    /// not copied once more.)
    fn run<T: redis::FromRedisValue>(
        &mut self,
        cmds: Vec<Cmd>,
        deadline: Instant,
    ) -> RedisResult<Vec<T>> {
        // A cluster's pipeline goes to the node of its slot (this map's) over
        // a connection of this client's (`pipeline`): the crate's cluster
        // pipeline reads a reply for every command after a timeout. A
        // redirect (a reshard) goes through the crate's connection, which
        // follows it.
        let by_slot = matches!(self.conn, Conn::Cluster(_)) && !self.slots.is_empty();
        let node = by_slot
            .then(|| cmds.first().and_then(first_key))
            .flatten()
            .map(|k| self.node_of(&k).to_string());
        let cmds = match node {
            Some(node) => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                match self.on_node(&node, deadline, |w| pipeline(w, &p, deadline)) {
                    Err(e) if redirected(&e) => {
                        self.stale = true;
                        p.cmd_iter().cloned().collect()
                    }
                    r => return r,
                }
            }
            None => cmds,
        };
        match &mut self.conn {
            Conn::Cluster(c) => {
                if c.is_none() {
                    *c = Some(Box::new(cluster_connection(&self.opts, &self.tls)?));
                }
                let c = c.as_mut().expect("cluster connection");
                let mut p = redis::cluster::cluster_pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                match p.query(c) {
                    Err(e) if redirected(&e) => {
                        // The crate's cluster pipeline returns MOVED/ASK (after a
                        // reshard) as failures instead of following them; one
                        // command at a time follows them. Each command has its
                        // own timeout: the call's deadline bounds them all.
                        let out = p
                            .cmd_iter()
                            .map(|cmd| {
                                if Instant::now() >= deadline {
                                    return Err(RedisError::from(std::io::Error::new(
                                        std::io::ErrorKind::TimedOut,
                                        "the call's deadline passed while following a reshard",
                                    )));
                                }
                                cmd.query(&mut **c)
                            })
                            .collect::<RedisResult<Vec<T>>>()?;
                        self.stale = true;
                        Ok(out)
                    }
                    r => r,
                }
            }
            Conn::Single { target, conn } => {
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                on_single(target, conn, deadline, |w| pipeline(w, &p, deadline))
            }
        }
    }

    /// Runs `f` on this client's connection to `node` (made on first use,
    /// within `deadline` too), dropped where it fails out of step.
    fn on_node<T>(
        &mut self,
        node: &str,
        deadline: Instant,
        f: impl FnOnce(&mut Wire) -> RedisResult<T>,
    ) -> RedisResult<T> {
        if !self.direct.contains_key(node) {
            let target = self.tls.target(&self.opts, node).map_err(|e| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    e.to_string(),
                ))
            })?;
            let c = Wire::connect(&target, deadline)?;
            self.direct.insert(node.to_string(), c);
        }
        let res = f(self.direct.get_mut(node).expect("connection"));
        if res.as_ref().is_err_and(out_of_step) {
            self.direct.remove(node);
        }
        res
    }
}

/// The operations the remote tier uses; every failure is a [`Fault`].
impl Client {
    /// Values of `keys` (one slot), `None` where absent or empty, each read
    /// up to `max + 1` bytes (`GETRANGE`): a longer value, which no valid
    /// one is, arrives cut, so a reply never holds more. `MGET` would take
    /// whatever a writer in the namespace put there. A key of another type
    /// reads as an empty value, which no check passes.
    pub(crate) fn get_upto(
        &mut self,
        keys: &[String],
        max: usize,
        deadline: Instant,
    ) -> Result<Vec<Option<Vec<u8>>>, Fault> {
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| redis::cmd("GETRANGE").arg(k).arg(0).arg(max).clone())
            .collect();
        let v: Vec<Value> = self.run(cmds, deadline).map_err(|e| Fault::of(&e))?;
        v.into_iter()
            .map(|v| match v {
                Value::BulkString(b) if b.is_empty() => Ok(None),
                Value::BulkString(b) => Ok(Some(b)),
                Value::ServerError(_) => Ok(Some(Vec::new())),
                _ => Err(Fault::Other),
            })
            .collect()
    }

    /// Whether each of `keys` (one slot) holds a non-empty string (`STRLEN`):
    /// an empty value, or a key of another type, is not a block's and is
    /// set over.
    pub(crate) fn present(&mut self, keys: &[&str], deadline: Instant) -> Result<Vec<bool>, Fault> {
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| redis::cmd("STRLEN").arg(*k).clone())
            .collect();
        let v: Vec<Value> = self.run(cmds, deadline).map_err(|e| Fault::of(&e))?;
        v.into_iter()
            .map(|v| match v {
                Value::Int(n) => Ok(n > 0),
                Value::ServerError(_) => Ok(false),
                _ => Err(Fault::Other),
            })
            .collect()
    }

    /// Sets each `(key, value)` (one slot), with a time to live if given.
    pub(crate) fn set_all(
        &mut self,
        items: &[(&str, &[u8])],
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let cmds: Vec<Cmd> = items.iter().map(|(k, v)| set_cmd(k, v, ttl)).collect();
        let _: Vec<Value> = self.run(cmds, deadline).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Sets `key` to `value` (with a time to live if given) unless the value
    /// there is newer (`newer`): then `Ok(false)`. One optimistic
    /// transaction on the key's node: `WATCH` and the value's head, its
    /// whole (up to `newer.max + 1` bytes) only where the head says it may
    /// be newer, then `MULTI`, `SET`, `EXEC`; tried again (up to
    /// [`RACE_TRIES`] times, while the call has time) where another client
    /// changed the key in between. Where the server refuses the transaction
    /// (a user without `@transaction`, the commands renamed or unknown
    /// behind a proxy), the key's slot moved, or this client has no
    /// connection of its own to the node (no slot map), a plain `SET`
    /// instead; a refusal whose `SET` goes through turns the transaction off
    /// for this client. Any other error reply is a fault.
    pub(crate) fn set_unless_newer(
        &mut self,
        (key, value): (&str, &[u8]),
        ttl: Option<Duration>,
        newer: &Newer<'_>,
        deadline: Instant,
    ) -> Result<bool, Fault> {
        if self.no_transactions {
            return self.set_all(&[(key, value)], ttl, deadline).map(|()| true);
        }
        let set = set_cmd(key, value, ttl);
        let mut races = 0;
        loop {
            let began = Instant::now();
            let Some(tried) = self.on_key(key, deadline, |w| {
                watched_set(w, key, &set, newer, deadline)
            }) else {
                break;
            };
            match tried.map_err(|e| Fault::of(&e))? {
                Tried::Done(set) => return Ok(set),
                // Another client changed the key meanwhile: read it again,
                // while the call has time for another try; where others keep
                // writing it, give up (counted, but no failure of the node).
                Tried::Raced => {
                    races += 1;
                    if races == RACE_TRIES || Instant::now() + began.elapsed() > deadline {
                        return Err(Fault::Other);
                    }
                }
                Tried::Refused(e) if redirected(&e) => {
                    self.stale = true;
                    break;
                }
                // The commands refused (no `@transaction`, renamed or unknown
                // behind a proxy) or the key (no permission, out of memory):
                // a plain SET tells which, and only the first turns the
                // transaction off for this client.
                Tried::Refused(e) if refuses_transactions(&e) => {
                    let set = self.set_all(&[(key, value)], ttl, deadline);
                    self.no_transactions = set.is_ok();
                    return set.map(|()| true);
                }
                // Anything else (a node loading, busy, or down) is the fault
                // it is; the next upload tries the transaction again.
                Tried::Refused(e) => return Err(Fault::of(&e)),
            }
        }
        self.set_all(&[(key, value)], ttl, deadline).map(|()| true)
    }

    /// Runs `f` on this client's own connection to the node of `key`, made
    /// on first use (within `deadline` too) and dropped where it fails out
    /// of step; `None` for a cluster whose slot map is not known (the
    /// crate's connection routes for it).
    fn on_key<T>(
        &mut self,
        key: &str,
        deadline: Instant,
        f: impl FnOnce(&mut Wire) -> RedisResult<T>,
    ) -> Option<RedisResult<T>> {
        if matches!(self.conn, Conn::Cluster(_)) {
            if self.slots.is_empty() {
                return None;
            }
            let node = self.node_of(key).to_string();
            return Some(self.on_node(&node, deadline, f));
        }
        match &mut self.conn {
            Conn::Single { target, conn } => Some(on_single(target, conn, deadline, f)),
            Conn::Cluster(_) => None,
        }
    }

    /// Renews the time to live of `keys` (one slot).
    pub(crate) fn expire(
        &mut self,
        keys: &[String],
        ttl: Duration,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| {
                redis::cmd("PEXPIRE")
                    .arg(k)
                    .arg(ttl.as_millis() as u64)
                    .clone()
            })
            .collect();
        let _: Vec<Value> = self.run(cmds, deadline).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Every node of the slot map (or the one node), on a fresh connection:
    /// the round trip of a `PING` and figures from `INFO`, or the error.
    pub(crate) fn nodes(&self, opts: &RemoteOptions) -> Vec<NodeReport> {
        let mut nodes = self.slot_nodes();
        if nodes.is_empty() {
            nodes.push(self.single_node.clone());
        }
        nodes
            .into_iter()
            .map(|n| {
                let mut rep = NodeReport {
                    node: n.clone(),
                    ..NodeReport::default()
                };
                match node_report(opts, &self.tls, &n, &mut rep) {
                    Ok(()) => {}
                    Err(e) => rep.error = Some(e.to_string()),
                }
                rep
            })
            .collect()
    }
}

/// The `INFO` fields `kvstore remote stats` shows.
const INFO_FIELDS: &[&str] = &[
    "redis_version",
    "valkey_version",
    "role",
    "used_memory",
    "used_memory_rss",
    "used_memory_peak",
    "maxmemory",
    "maxmemory_policy",
    "evicted_keys",
    "expired_keys",
    "keyspace_hits",
    "keyspace_misses",
    "connected_clients",
    "cluster_enabled",
    "db0",
];

/// `PING` and `INFO` of `node`, each within the timeout.
fn node_report(opts: &RemoteOptions, tls: &Tls, node: &str, rep: &mut NodeReport) -> Result<()> {
    let deadline = || Instant::now() + opts.timeout;
    let mut c = Wire::connect(&tls.target(opts, node)?, deadline())
        .map_err(|e| open_error(opts, node, "unreachable", &e))?;
    let t0 = Instant::now();
    c.query::<String>(&redis::cmd("PING"), deadline())
        .map_err(|e| open_error(opts, node, "PING", &e))?;
    rep.rtt = Some(t0.elapsed());
    // INFO may be refused to a user without the permission: the round trip stands.
    if let Ok(text) = c.query::<String>(&redis::cmd("INFO"), deadline()) {
        for line in text.lines() {
            if let Some((k, v)) = line.split_once(':') {
                if INFO_FIELDS.contains(&k) {
                    rep.info.insert(k.to_string(), v.trim().to_string());
                }
            }
        }
    }
    Ok(())
}

/// The client configuration of this client's TLS connections: trusting the
/// CA of `tls_ca`, or the system's roots.
fn tls_config(
    opts: &RemoteOptions,
    certs: Option<&TlsCertificates>,
) -> Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match certs.and_then(|c| c.root_cert.as_deref()) {
        Some(pem) => {
            let bad = |e: &dyn std::fmt::Display| {
                let path = opts.tls_ca.as_deref().unwrap_or(std::path::Path::new(""));
                Error::Remote(format!("remote tls_ca {}: {e}", path.display()))
            };
            for cert in CertificateDer::pem_slice_iter(pem) {
                roots.add(cert.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
            }
        }
        None => {
            // Unreadable system certificates are left out: a server's
            // certificate they would have trusted fails its handshake.
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}

type RedisResult<T> = redis::RedisResult<T>;

fn cluster_connection(opts: &RemoteOptions, tls: &Tls) -> RedisResult<ClusterConnection> {
    let mut b = ClusterClientBuilder::new(opts.nodes.iter().map(|n| tls.url(n)))
        .connection_timeout(opts.timeout)
        .response_timeout(opts.timeout)
        .retries(1)
        // The one retry after CLUSTERDOWN, TRYAGAIN, MASTERDOWN or LOADING
        // waits a random 0 to 10 ms, at most a tenth of the timeout: the
        // crate's default wait, 1.28 s or more whatever the timeout, made
        // every call on a cluster that lost a master take 1.3 s.
        .min_retry_wait(0)
        .max_retry_wait(retry_wait_ms(opts.timeout));
    if let Some(u) = &opts.username {
        b = b.username(u);
    }
    if let Some(p) = &opts.password {
        b = b.password(p);
    }
    if let Some(c) = &tls.certs {
        b = b.certs(c.clone());
    }
    b.build()?.get_connection()
}

/// Runs pipeline `p` on `c` by `deadline`, its replies read one at a time
/// up to the first failure of the connection: `Pipeline::query` goes on
/// reading every reply after a timeout, a timeout each (16 EXISTS, 8 s at a
/// timeout of 0.5 s). A server's error (a redirect, a refusal) leaves the
/// connection in step: the other replies are read, the first error
/// returned; but `WRONGTYPE` (a key of another type, which only a foreign
/// writer leaves under a block's key) stays in its place as that command's
/// reply, so the rest of the group is still read.
fn pipeline<T: redis::FromRedisValue>(
    c: &mut Wire,
    p: &redis::Pipeline,
    deadline: Instant,
) -> RedisResult<Vec<T>> {
    let replies = c.replies(&p.get_packed_pipeline(), p.len(), deadline)?;
    let mut values = Vec::with_capacity(p.len());
    let mut refused = None;
    for v in replies {
        match v {
            Value::ServerError(e) if e.code() != "WRONGTYPE" => refused = refused.or(Some(e)),
            v => values.push(v),
        }
    }
    if let Some(e) = refused {
        return Err(e.into());
    }
    values
        .into_iter()
        .map(|v| T::from_redis_value(v).map_err(RedisError::from))
        .collect()
}

/// Runs `f` on a single node's connection `conn` to `target`, made on first
/// use (within `deadline` too) and dropped where it fails out of step.
fn on_single<T>(
    target: &Target,
    conn: &mut Option<Wire>,
    deadline: Instant,
    f: impl FnOnce(&mut Wire) -> RedisResult<T>,
) -> RedisResult<T> {
    if conn.is_none() {
        *conn = Some(Wire::connect(target, deadline)?);
    }
    let res = f(conn.as_mut().expect("connection"));
    if res.as_ref().is_err_and(out_of_step) {
        *conn = None;
    }
    res
}

/// `SET key value [PX ttl]`.
fn set_cmd(key: &str, value: &[u8], ttl: Option<Duration>) -> Cmd {
    let mut c = redis::cmd("SET");
    c.arg(key).arg(value);
    if let Some(t) = ttl {
        c.arg("PX").arg(t.as_millis() as u64);
    }
    c
}

/// Tries of `set_unless_newer` while other clients keep changing the key.
const RACE_TRIES: usize = 3;

/// What one try of `set_unless_newer` came to.
enum Tried {
    /// Set (`true`), or not: the value there is newer.
    Done(bool),
    /// Another client changed the key between the `WATCH` and the `EXEC`,
    /// which then set nothing.
    Raced,
    /// The server refused a command of the transaction (its error reply).
    Refused(RedisError),
}

/// One try of `set_unless_newer` on `w`. Whatever the replies, the
/// connection is left in step, outside any transaction and watching
/// nothing.
fn watched_set(
    w: &mut Wire,
    key: &str,
    set: &Cmd,
    newer: &Newer<'_>,
    deadline: Instant,
) -> RedisResult<Tried> {
    // Its reply does not matter (a user without `@transaction` is refused
    // UNWATCH too, and then watches nothing).
    let unwatch = |w: &mut Wire, t: Tried| -> RedisResult<Tried> {
        w.replies(&redis::cmd("UNWATCH").get_packed_command(), 1, deadline)?;
        Ok(t)
    };
    let head = match read_value(w, key, true, newer.head, deadline)? {
        Ok(h) => h,
        Err(e) => return unwatch(w, Tried::Refused(e)),
    };
    if !head.is_empty() && (newer.may_be)(&head) {
        match read_value(w, key, false, newer.max + 1, deadline)? {
            Ok(whole) if (newer.is)(&whole) => return unwatch(w, Tried::Done(false)),
            Ok(_) => {}
            Err(e) => return unwatch(w, Tried::Refused(e)),
        }
    }
    let mut tx = redis::pipe();
    tx.cmd("MULTI").add_command(set.clone()).cmd("EXEC");
    let got = w.replies(&tx.get_packed_pipeline(), 3, deadline)?;
    // A refused MULTI ran the SET alone, and a refused EXEC (EXECABORT)
    // discarded it; either way it is set again, without the transaction.
    // DISCARD and UNWATCH leave the connection outside any transaction and
    // watching nothing, whichever was refused (their replies do not matter).
    if let Some(e) = got.iter().find_map(refusal) {
        let mut end = redis::pipe();
        end.cmd("DISCARD").cmd("UNWATCH");
        w.replies(&end.get_packed_pipeline(), 2, deadline)?;
        return Ok(Tried::Refused(e));
    }
    match &got[2] {
        Value::Nil => Ok(Tried::Raced),
        Value::Array(done) => Ok(match done.first().and_then(refusal) {
            Some(e) => Tried::Refused(e),
            None => Tried::Done(true),
        }),
        _ => Err(RedisError::from((
            redis::ErrorKind::Parse,
            "EXEC: not an array",
        ))),
    }
}

/// After `WATCH key` (with `watch`), the first `len` bytes of the value
/// under `key` (empty where it is missing or of another type), or the
/// server's refusal of either command.
fn read_value(
    w: &mut Wire,
    key: &str,
    watch: bool,
    len: usize,
    deadline: Instant,
) -> RedisResult<Result<Vec<u8>, RedisError>> {
    let mut p = redis::pipe();
    if watch {
        p.cmd("WATCH").arg(key);
    }
    p.cmd("GETRANGE").arg(key).arg(0).arg(len.saturating_sub(1));
    let mut got = w.replies(&p.get_packed_pipeline(), p.len(), deadline)?;
    let wrong_type = |v: &Value| matches!(v, Value::ServerError(e) if e.code() == "WRONGTYPE");
    if let Some(e) = got.iter().filter(|v| !wrong_type(v)).find_map(refusal) {
        return Ok(Err(e));
    }
    Ok(Ok(match got.pop() {
        Some(Value::BulkString(b)) => b,
        _ => Vec::new(),
    }))
}

/// Whether a server's error reply refuses the commands of a transaction,
/// or may: `NOPERM` (an ACL without them, or without the key), an unknown
/// command (renamed away, or behind a proxy that lacks it), `EXECABORT` (a
/// refused `EXEC`, or a `SET` refused while queued).
fn refuses_transactions(e: &RedisError) -> bool {
    matches!(e.code(), Some("NOPERM" | "EXECABORT"))
        || e.to_string()
            .to_ascii_lowercase()
            .contains("unknown command")
}

/// A server's error reply, as an error.
fn refusal(v: &Value) -> Option<RedisError> {
    match v {
        Value::ServerError(e) => Some(RedisError::from(e.clone())),
        _ => None,
    }
}

/// Whether a failed request left its connection out of step (a late reply
/// would answer the next request): then it is made afresh.
fn out_of_step(e: &RedisError) -> bool {
    matches!(Fault::of(e), Fault::Timeout | Fault::Connection)
        || e.kind() == redis::ErrorKind::Parse
}

/// The key of a one-key command (its first argument).
fn first_key(cmd: &Cmd) -> Option<String> {
    match cmd.args_iter().nth(1)? {
        redis::Arg::Simple(k) => String::from_utf8(k.to_vec()).ok(),
        _ => None,
    }
}

/// The longest wait before a cluster retry: a tenth of the timeout, at
/// least 1 ms.
fn retry_wait_ms(timeout: std::time::Duration) -> u64 {
    u64::try_from(timeout.as_millis() / 10).map_or(u64::MAX, |ms| ms.max(1))
}

/// Whether a pipeline failed for keys that moved to another node.
fn redirected(e: &RedisError) -> bool {
    use redis::ServerErrorKind as K;
    e.clone().into_server_errors().is_some_and(|errs| {
        errs.iter()
            .any(|(_, s)| matches!(s.kind(), Some(K::Moved | K::Ask)))
    })
}

/// `(first, last, "host:port")` of every slot range of a `CLUSTER SLOTS`
/// reply, sorted.
fn parse_slots(v: Value) -> Vec<(u16, u16, String)> {
    let Value::Array(v) = v else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for r in v {
        let Value::Array(r) = r else { continue };
        let (Some(Value::Int(a)), Some(Value::Int(b)), Some(Value::Array(m))) =
            (r.first(), r.get(1), r.get(2))
        else {
            continue;
        };
        let host = match m.first() {
            Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
            _ => continue,
        };
        let Some(Value::Int(port)) = m.get(1) else {
            continue;
        };
        out.push((*a as u16, *b as u16, format!("{host}:{port}")));
    }
    out.sort();
    out
}
