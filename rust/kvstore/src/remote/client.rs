//! The connection to the server: one node or a cluster. Commands are packed
//! and replies parsed by the `redis` crate, and sent over connections of our
//! own (`wire`), one per node, where every call has one deadline for
//! connecting, writing, reading all its replies and following redirects.
//! Which node serves a key is read from `CLUSTER SLOTS` at open (and again
//! when it may have changed), for the circuit breaker and to send a pipeline
//! to its node; a command that reaches the wrong one is redirected (`MOVED`,
//! or `ASK` while its slot migrates) and sent on (`run`). TLS: rustls with
//! ring, trusting the CA of `tls_ca` (or the system's roots for a
//! `rediss://` node without one).

use super::breaker::Breaker;
use super::keys::slot;
use super::lookup;
use super::wire::{deadline_passed, Target, Wire};
use super::{addr, Newer, NodeReport, RemoteOptions};
use crate::error::{Error, Result};
use redis::{Cmd, RedisError, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use super::fault::{Blame, Fault};

/// One client (a reader's or the uploader's): its connections and the slot
/// map.
pub(crate) struct Client {
    /// `(first slot, last slot, node)`, sorted; empty for one node.
    slots: Vec<(u16, u16, String)>,
    /// The node of `opts.nodes` that answered at open: the one node, or
    /// where a key goes whose slot the map lacks.
    single_node: String,
    tls: Tls,
    /// The server's bulk limit (`proto-max-bulk-len`) in bytes.
    max_value: u64,
    /// How to reach a node (user and password), for `conns`.
    opts: RemoteOptions,
    /// Whether the server is a cluster: only a cluster's redirects are
    /// followed (a single server has no others to send a client to).
    cluster: bool,
    /// One connection per node of the map (and `single_node`) this client
    /// talks to, made on first use; of other nodes (a redirect's target not
    /// in the map) one at a time.
    conns: HashMap<String, Wire>,
    /// What the last failed call leaves its caller to act on.
    blame: Option<Blame>,
    /// The store's breakers, asked before following a redirect (the call's
    /// own node is asked by the caller).
    breaker: Arc<Breaker>,
    /// The slot map may be out of date: a node failed, or a key was
    /// redirected (`MOVED`). Read again (`refresh_from`) before the next
    /// call.
    stale: bool,
    /// The server refused the commands of a transaction (a user without
    /// `@transaction`, or they are unknown): sessions are set without
    /// asking (`set_unless_newer`).
    no_transactions: bool,
}

/// Redis's default `proto-max-bulk-len`, assumed when `CONFIG GET` is refused.
const DEFAULT_MAX_BULK: u64 = 512 << 20;

/// How connections are made: plain TCP, or TLS (`config`) trusting the CA
/// of `tls_ca` or the system's roots.
#[derive(Clone)]
struct Tls {
    on: bool,
    /// `Some` when `on`.
    config: Option<Arc<rustls::ClientConfig>>,
}

impl Tls {
    /// TLS when `tls_ca` is given or a node is a `rediss://` URL.
    fn of(opts: &RemoteOptions) -> Result<Tls> {
        // rustls needs one process-wide crypto provider; the first wins (a
        // host program may have installed its own).
        static PROVIDER: std::sync::Once = std::sync::Once::new();
        let on = opts.tls_ca.is_some() || opts.nodes.iter().any(|n| n.starts_with("rediss://"));
        if !on {
            return Ok(Tls { on, config: None });
        }
        PROVIDER.call_once(|| {
            let _ = rustls::crypto::ring::default_provider().install_default();
        });
        let ca = opts
            .tls_ca
            .as_ref()
            .map(|path| {
                std::fs::read(path)
                    .map_err(|e| Error::Remote(format!("remote tls_ca {}: {e}", path.display())))
            })
            .transpose()?;
        let config = Some(Arc::new(tls_config(opts, ca.as_deref())?));
        Ok(Tls { on, config })
    }

    /// How this client's connections reach `node` (`host:port` or a URL).
    fn target(&self, opts: &RemoteOptions, node: &str) -> Result<Target> {
        Target::new(
            addr(node),
            self.config.clone(),
            opts.username.clone(),
            opts.password.clone(),
        )
        .ok_or_else(|| Error::Remote(format!("remote node {:?}: not an address", addr(node))))
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
        (None, _) if e.is_connection_refusal() || e.to_string().contains(lookup::FAILED) => {
            "unreachable".into()
        }
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
    pub(crate) fn connect(
        opts: &RemoteOptions,
        probe_key: &str,
        breaker: &Arc<Breaker>,
    ) -> Result<Client> {
        let tls = Tls::of(opts)?;
        let mut last = None;
        for node in &opts.nodes {
            match Client::connect_to(opts, &tls, node, probe_key, breaker)? {
                Ok(c) => return Ok(c),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Remote("remote: no nodes given".into())))
    }

    /// `connect` on one node: `Err` for a failure that ends the search,
    /// `Ok(Err)` for one that moves on to the next node. All its steps
    /// share one timeout.
    fn connect_to(
        opts: &RemoteOptions,
        tls: &Tls,
        node: &str,
        probe_key: &str,
        breaker: &Arc<Breaker>,
    ) -> Result<Result<Client>> {
        let target = tls.target(opts, node)?;
        let deadline = Instant::now() + opts.timeout;
        let fail = |step: Option<&str>, e: &RedisError| -> Result<Result<Client>> {
            let err = open_error(opts, node, &open_what(tls, step, probe_key, e), e);
            if Fault::of(e) == Fault::Permission {
                Err(err)
            } else {
                Ok(Err(err))
            }
        };
        let mut conn = match Wire::connect(&target, deadline) {
            Ok(c) => c,
            Err(e) => return fail(None, &e),
        };
        let info_text: String = match conn.query(redis::cmd("INFO").arg("cluster"), deadline) {
            Ok(t) => t,
            Err(e) => return fail(Some("INFO cluster"), &e),
        };
        // Restricted ACL users may not run CONFIG: then assume the default.
        let max_value = conn
            .query::<Vec<String>>(
                redis::cmd("CONFIG").arg("GET").arg("proto-max-bulk-len"),
                deadline,
            )
            .ok()
            .and_then(|kv| kv.get(1)?.parse().ok())
            .unwrap_or(DEFAULT_MAX_BULK);
        let single_node = addr(node).to_string();
        let cluster = info_text.contains("cluster_enabled:1");
        let slots = if cluster {
            match conn.query(redis::cmd("CLUSTER").arg("SLOTS"), deadline) {
                Ok(v) => parse_slots(v, &single_node),
                Err(e) => return fail(Some("CLUSTER SLOTS"), &e),
            }
        } else {
            Vec::new()
        };
        let mut me = Client {
            slots,
            cluster,
            conns: HashMap::from([(single_node.clone(), conn)]),
            blame: None,
            breaker: breaker.clone(),
            single_node,
            tls: tls.clone(),
            max_value,
            opts: opts.clone(),
            stale: false,
            no_transactions: false,
        };
        let probe: RedisResult<Vec<i64>> =
            me.run(&[redis::cmd("EXISTS").arg(probe_key).clone()], deadline);
        match probe {
            Ok(_) => Ok(Ok(me)),
            Err(e) => fail(Some("EXISTS"), &e),
        }
    }

    /// A second client with the same settings and slot map (for the
    /// uploader); it connects on first use.
    pub(crate) fn connect_again(&self) -> Client {
        Client {
            slots: self.slots.clone(),
            cluster: self.cluster,
            single_node: self.single_node.clone(),
            tls: self.tls.clone(),
            max_value: self.max_value,
            opts: self.opts.clone(),
            conns: HashMap::new(),
            blame: None,
            breaker: self.breaker.clone(),
            stale: self.stale,
            no_transactions: false,
        }
    }

    /// Why the calls since the last `take_blame` failed, where a node's
    /// connection failed or a redirect was not followed.
    pub(crate) fn take_blame(&mut self) -> Option<Blame> {
        self.blame.take()
    }

    /// Whether a redirect may be followed to `node`: its breaker is closed
    /// (or lets this call probe it); else the call is a skip.
    fn may_follow(&mut self, node: &str) -> bool {
        let allowed = self.breaker.allow(node);
        if !allowed {
            self.blame = Some(Blame::Skipped);
        }
        allowed
    }

    /// Whether the slot map may be out of date (see `refresh_from`).
    pub(crate) fn stale(&self) -> bool {
        self.stale
    }

    /// A node of the map failed: slots may have moved off it (a replica
    /// promoted in its place, which sends no redirect for a dead master).
    pub(crate) fn mark_stale(&mut self) {
        self.stale = self.cluster;
    }

    /// The nodes of the slot map, or the node given at open where the map
    /// is empty (one node, or a cluster that listed no slots).
    pub(crate) fn slot_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self.slots.iter().map(|r| r.2.clone()).collect();
        nodes.sort();
        nodes.dedup();
        if nodes.is_empty() {
            nodes.push(self.single_node.clone());
        }
        nodes
    }

    /// Reads the slot map from `node` by `deadline` (over this client's
    /// connection to it, made if need be), and drops the connections to
    /// nodes no longer in it.
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
        let slots = parse_slots(v, node);
        if slots.is_empty() {
            self.stale = false;
            return Err(Fault::Other);
        }
        self.conns.retain(|n, _| slots.iter().any(|r| &r.2 == n));
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

    /// Runs `cmds` (keys of one slot) as one pipeline on the node of their
    /// slot, all by `deadline`; one result each. A command that reaches the
    /// wrong node is sent on where the node redirects it: `MOVED` (the slot
    /// has moved: the map is read again before the next call) or `ASK` (the
    /// slot is migrating and the key has gone: sent after `ASKING`, the map
    /// stays), up to [`MAX_REDIRECTS`] times. Replies as `settle` makes
    /// them.
    fn run<T: redis::FromRedisValue>(
        &mut self,
        cmds: &[Cmd],
        deadline: Instant,
    ) -> RedisResult<Vec<T>> {
        let mut node = match cmds.first().and_then(first_key) {
            Some(k) => self.node_of(&k).to_string(),
            None => self.single_node.clone(),
        };
        let mut replies: Vec<Option<Value>> = vec![None; cmds.len()];
        // The commands to send to `node`: index, and whether after `ASKING`.
        let mut todo: Vec<(usize, bool)> = (0..cmds.len()).map(|i| (i, false)).collect();
        for hop in 0..=MAX_REDIRECTS {
            let size = todo.iter().map(|&(i, _)| packed_len(&cmds[i]) + 32).sum();
            let mut packed = Vec::with_capacity(size);
            for &(i, asking) in &todo {
                if asking {
                    redis::cmd("ASKING").write_packed_command(&mut packed);
                }
                cmds[i].write_packed_command(&mut packed);
            }
            let n = todo
                .iter()
                .map(|&(_, asking)| 1 + usize::from(asking))
                .sum();
            let mut got = self
                .on_node(&node, deadline, |w| w.replies(&packed, n, deadline))?
                .into_iter();
            if hop > 0 {
                self.breaker.reset(&node); // a redirect's target answered
            }
            let mut next = Vec::new();
            let mut to: Option<String> = None;
            for &(i, asking) in &todo {
                // A refused ASKING (a user without `@connection`) is the
                // command's reply: the node would only send it back (MOVED).
                let refused = asking
                    .then(|| got.next())
                    .flatten()
                    .filter(|v| matches!(v, Value::ServerError(_)));
                let v = got.next().expect("one reply per command");
                if let Some(e) = refused {
                    replies[i] = Some(e);
                    continue;
                }
                match redirect(&v, &node).filter(|_| self.cluster) {
                    // One slot moves to one node at a time; a command sent
                    // elsewhere meanwhile keeps its redirect, a refusal.
                    Some((at, ask))
                        if hop < MAX_REDIRECTS && to.as_ref().is_none_or(|t| *t == at) =>
                    {
                        self.stale |= !ask;
                        to = Some(at);
                        next.push((i, ask));
                    }
                    _ => {}
                }
                replies[i] = Some(v);
            }
            match to {
                Some(at) if self.may_follow(&at) => (node, todo) = (at, next),
                _ => break,
            }
        }
        settle(replies.into_iter().map(|v| v.expect("a reply")).collect())
    }

    /// Runs `f` on this client's connection to `node` (made on first use,
    /// within `deadline` too), dropped where it fails out of step.
    fn on_node<T>(
        &mut self,
        node: &str,
        deadline: Instant,
        f: impl FnOnce(&mut Wire) -> RedisResult<T>,
    ) -> RedisResult<T> {
        if Instant::now() >= deadline {
            // Spent on an earlier node (before a redirect): not this one's fault.
            return Err(deadline_passed().into());
        }
        if !self.conns.contains_key(node) {
            let target = self.tls.target(&self.opts, node).map_err(|e| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    e.to_string(),
                ))
            })?;
            // Bounded whatever the nodes a server redirects to: one
            // connection outside the map at a time.
            let (seed, slots) = (&self.single_node, &self.slots);
            self.conns
                .retain(|n, _| n == seed || slots.iter().any(|r| &r.2 == n));
            match Wire::connect(&target, deadline) {
                Ok(c) => self.conns.insert(node.to_string(), c),
                Err(e) => {
                    self.blame = Some(Blame::Failed(node.to_string()));
                    return Err(e);
                }
            };
        }
        let res = f(self.conns.get_mut(node).expect("connection"));
        if res.as_ref().is_err_and(out_of_step) {
            self.conns.remove(node);
            self.blame = Some(Blame::Failed(node.to_string()));
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
        let v: Vec<Value> = self.run(&cmds, deadline).map_err(|e| Fault::of(&e))?;
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
        let v: Vec<Value> = self.run(&cmds, deadline).map_err(|e| Fault::of(&e))?;
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
        let _: Vec<Value> = self.run(&cmds, deadline).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Sets `key` to `value` (with a time to live if given) unless the value
    /// there is newer (`newer`): then `Ok(false)`. One optimistic
    /// transaction on the key's node: `WATCH` and the value's head, its
    /// whole (up to `newer.max + 1` bytes) only where the head says it may
    /// be newer, then `MULTI`, `SET`, `EXEC`; tried again (up to
    /// [`RACE_TRIES`] times, while the call has time) where another client
    /// changed the key in between; taken to the slot's new node after a
    /// `MOVED`. Where the server refuses the transaction (a user without
    /// `@transaction`, the commands renamed or unknown behind a proxy) or
    /// the key's slot migrates (`ASK`), a plain `SET` instead, which follows
    /// the redirect; a refusal whose `SET` goes through turns the
    /// transaction off for this client. Any other error reply is a fault.
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
        let mut node = self.node_of(key).to_string();
        let mut hops = 0;
        loop {
            let began = Instant::now();
            let tried = self.on_node(&node, deadline, |w| {
                watched_set(w, key, &set, newer, deadline)
            });
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
                // A moved slot: the transaction goes to its new node (and the
                // map is read again before the next call). A migrating one (`ASK`)
                // is set without it: the transaction would need `ASKING`
                // before each of its commands, on a node that may not have
                // the key's value yet.
                Tried::Refused(e) if redirected(&e) => {
                    match redirect_of(e.code(), e.detail(), &node).filter(|_| self.cluster) {
                        Some((at, false)) if hops < MAX_REDIRECTS => {
                            self.stale = true;
                            if !self.may_follow(&at) {
                                return Err(Fault::Other); // a skip (`take_blame`)
                            }
                            node = at;
                            hops += 1;
                        }
                        _ => break,
                    }
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
        let _: Vec<Value> = self.run(&cmds, deadline).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Every node of the slot map (or the one node), on a fresh connection:
    /// the round trip of a `PING` and figures from `INFO`, or the error.
    pub(crate) fn nodes(&self, opts: &RemoteOptions) -> Vec<NodeReport> {
        self.slot_nodes()
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
fn tls_config(opts: &RemoteOptions, ca: Option<&[u8]>) -> Result<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
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

/// The results of a pipeline's `replies`: a server's error (a refusal, or
/// a redirect not followed) among them makes the whole the first such
/// error; but `WRONGTYPE` (a key of another type, which only a foreign
/// writer leaves under a block's key) stays in its place as that command's
/// reply. (The replies are read one at a time up to the first failure of
/// the connection: the crate's `Pipeline::query` went on reading every reply
/// after a timeout, a timeout each: 16 EXISTS, 8 s at a timeout of 0.5 s.)
fn settle<T: redis::FromRedisValue>(replies: Vec<Value>) -> RedisResult<Vec<T>> {
    let mut values = Vec::with_capacity(replies.len());
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

/// At least the length of `cmd` packed (RESP: `*n`, then `$len`, the bytes
/// and CRLF for each argument), so that a group's values are copied into
/// the request once, not again each time it grows.
fn packed_len(cmd: &Cmd) -> usize {
    let args: usize = cmd
        .args_iter()
        .map(|a| match a {
            redis::Arg::Simple(b) => b.len() + 24,
            _ => 48, // a scan's cursor
        })
        .sum();
    args + 24
}

/// The key of a one-key command (its first argument).
fn first_key(cmd: &Cmd) -> Option<String> {
    match cmd.args_iter().nth(1)? {
        redis::Arg::Simple(k) => String::from_utf8(k.to_vec()).ok(),
        _ => None,
    }
}

/// Redirects one call follows: a slot that moves while the call runs sends
/// one or two (`ASK`, then `MOVED` once its migration ends).
const MAX_REDIRECTS: usize = 5;

/// Where a reply redirects its command (`MOVED` or `ASK slot host:port`),
/// and whether it asks (`ASK`). An empty host is `from`'s (a node that
/// knows no address of its own for the other); an unknown one (`?`) is no
/// redirect to follow.
fn redirect(v: &Value, from: &str) -> Option<(String, bool)> {
    match v {
        Value::ServerError(e) => redirect_of(Some(e.code()), e.details(), from),
        _ => None,
    }
}

/// [`redirect`] of an error's `code` and `details`.
fn redirect_of(code: Option<&str>, details: Option<&str>, from: &str) -> Option<(String, bool)> {
    let ask = match code? {
        "MOVED" => false,
        "ASK" => true,
        _ => return None,
    };
    let (host, port) = details?.split_whitespace().nth(1)?.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    let host = match host {
        "" => from.rsplit_once(':')?.0,
        "?" => return None,
        h => h,
    };
    Some((format!("{host}:{port}"), ask))
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
/// reply (from node `from`), sorted. A master without an endpoint (NULL or
/// empty: `cluster-preferred-endpoint-type unknown-endpoint`) is on
/// `from`'s host; one whose endpoint is unknown (`?`) is left out (its
/// slots go to the node given at open, which redirects).
fn parse_slots(v: Value, from: &str) -> Vec<(u16, u16, String)> {
    let from_host = from.rsplit_once(':').map_or(from, |(h, _)| h);
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
            Some(Value::BulkString(h)) if h.as_slice() == b"?" => continue,
            Some(Value::BulkString(h)) if !h.is_empty() => String::from_utf8_lossy(h).into_owned(),
            Some(Value::BulkString(_) | Value::Nil) => from_host.to_string(),
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

#[cfg(test)]
mod tests {
    use super::{parse_slots, redirect_of};
    use redis::Value;

    fn range(lo: i64, hi: i64, host: Value, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(lo),
            Value::Int(hi),
            Value::Array(vec![host, Value::Int(port)]),
        ])
    }

    #[test]
    fn a_map_takes_a_missing_endpoint_from_the_node_that_listed_it() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = Value::Array(vec![
            range(8192, 16383, bulk("10.0.0.2"), 7001),
            range(0, 99, Value::Nil, 7002),
            range(100, 199, bulk(""), 7003),
            range(200, 299, bulk("?"), 7004),
            range(300, 8191, bulk("::1"), 7005),
        ]);
        assert_eq!(
            parse_slots(reply, "node-a:7000"),
            vec![
                (0, 99, "node-a:7002".to_string()),
                (100, 199, "node-a:7003".to_string()),
                (300, 8191, "::1:7005".to_string()),
                (8192, 16383, "10.0.0.2:7001".to_string()),
            ]
        );
    }

    #[test]
    fn redirects_name_their_node() {
        let from = "10.0.0.1:7000";
        let at = |code, details| redirect_of(Some(code), Some(details), from);
        assert_eq!(
            at("MOVED", "12 10.0.0.2:7001"),
            Some(("10.0.0.2:7001".into(), false))
        );
        assert_eq!(
            at("ASK", "12 host-b:7002"),
            Some(("host-b:7002".into(), true))
        );
        assert_eq!(at("MOVED", "12 ::1:7003"), Some(("::1:7003".into(), false)));
        assert_eq!(
            at("MOVED", "12 :7004"),
            Some(("10.0.0.1:7004".into(), false))
        );
        assert_eq!(at("MOVED", "12 ?:7005"), None);
        assert_eq!(at("MOVED", "12 10.0.0.2:port"), None);
        assert_eq!(at("MOVED", "12"), None);
        assert_eq!(at("ERR", "12 10.0.0.2:7001"), None);
        assert_eq!(redirect_of(None, Some("12 10.0.0.2:7001"), from), None);
    }
}
