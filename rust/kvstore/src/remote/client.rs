//! The connection to the server: one node or a cluster, through the `redis`
//! crate's sync clients (its async cluster client stalled after a node died;
//! see the notes). Every call has a deadline: connection and response
//! timeouts. Which node serves a key is read from `CLUSTER SLOTS` at open,
//! for the circuit breaker. TLS: rustls with ring, trusting the CA of
//! `tls_ca` (or the system's roots for a `rediss://` node without one).

use super::keys::slot;
use super::{addr, NodeReport, RemoteOptions};
use crate::error::{Error, Result};
use redis::cluster::{ClusterClientBuilder, ClusterConnection};
use redis::{
    Cmd, ConnectionInfo, ConnectionLike, IntoConnectionInfo, RedisError, TlsCertificates, Value,
};
use std::collections::HashMap;
use std::time::Instant;

pub(crate) use super::fault::Fault;

// Two per store handle: their size does not matter.
#[allow(clippy::large_enum_variant)]
enum Conn {
    Single {
        info: ConnectionInfo,
        conn: Option<redis::Connection>,
    },
    Cluster(Box<ClusterConnection>),
}

/// One connection (a reader's or the uploader's) and the slot map.
pub(crate) struct Client {
    conn: Conn,
    /// `(first slot, last slot, node)`, sorted; empty for one node.
    slots: Vec<(u16, u16, String)>,
    single_node: String,
    timeout: std::time::Duration,
    tls: Tls,
    /// The server's bulk limit (`proto-max-bulk-len`) in bytes.
    max_value: u64,
    /// How to reach a node (user and password), for `direct`.
    opts: RemoteOptions,
    /// A cluster's pipelines go to the node of their slot over these, one per
    /// node of `slots` (see `run`).
    direct: HashMap<String, redis::Connection>,
}

/// Redis's default `proto-max-bulk-len`, assumed when `CONFIG GET` is refused.
const DEFAULT_MAX_BULK: u64 = 512 << 20;

/// How connections are made: plain TCP, or TLS trusting `certs` (the CA of
/// `tls_ca`; `None`: the system's roots).
#[derive(Clone)]
struct Tls {
    on: bool,
    certs: Option<TlsCertificates>,
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
        Ok(Tls { on, certs })
    }

    /// `redis://` or `rediss://` URL of `node` (`host:port` or a URL; a user
    /// or password in it was refused when the options were checked).
    fn url(&self, node: &str) -> String {
        let scheme = if self.on { "rediss" } else { "redis" };
        format!("{scheme}://{}", addr(node))
    }

    fn client(&self, info: ConnectionInfo) -> RedisResult<redis::Client> {
        match &self.certs {
            Some(c) => redis::Client::build_with_tls(info, c.clone()),
            None => redis::Client::open(info),
        }
    }
}

fn info_for(opts: &RemoteOptions, tls: &Tls, node: &str) -> Result<ConnectionInfo> {
    let info = tls.url(node).into_connection_info().map_err(|e| {
        Error::Remote(format!(
            "remote node {:?}: not an address ({e})",
            addr(node)
        ))
    })?;
    let mut settings = info.redis_settings().clone();
    if let Some(u) = &opts.username {
        settings = settings.set_username(u);
    }
    if let Some(p) = &opts.password {
        settings = settings.set_password(p);
    }
    Ok(info.set_redis_settings(settings))
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

impl Client {
    /// Connects to the first reachable node of `opts.nodes`, finds out
    /// whether it is a cluster, and checks that the user may read and write
    /// `probe_key`. Every failure is `Error::Remote`.
    pub(crate) fn connect(opts: &RemoteOptions, probe_key: &str) -> Result<Client> {
        let tls = Tls::of(opts)?;
        let mut last = None;
        for node in &opts.nodes {
            let info = info_for(opts, &tls, node)?;
            let client = tls
                .client(info.clone())
                .map_err(|e| open_error(opts, node, "bad address", &e))?;
            let mut conn = match client.get_connection_with_timeout(opts.timeout) {
                Ok(c) => c,
                Err(e) if Fault::of(&e) == Fault::Permission => {
                    return Err(open_error(opts, node, "authentication failed", &e));
                }
                Err(e) => {
                    let what = if e.is_connection_refusal() {
                        "unreachable"
                    } else if tls.on {
                        "TLS connection failed (is tls_ca the CA of its certificate, and the \
                         port a TLS port?)"
                    } else {
                        "unreachable (if the port speaks TLS: give tls_ca or a rediss:// node)"
                    };
                    last = Some(open_error(opts, node, what, &e));
                    continue;
                }
            };
            let set = |c: &redis::Connection| {
                c.set_read_timeout(Some(opts.timeout))?;
                c.set_write_timeout(Some(opts.timeout))
            };
            set(&conn).map_err(|e| open_error(opts, node, "socket options", &e))?;
            let info_text: String = redis::cmd("INFO")
                .arg("cluster")
                .query(&mut conn)
                .map_err(|e| open_error(opts, node, "INFO cluster", &e))?;
            // Restricted ACL users may not run CONFIG: then assume the default.
            let max_value = redis::cmd("CONFIG")
                .arg("GET")
                .arg("proto-max-bulk-len")
                .query::<Vec<String>>(&mut conn)
                .ok()
                .and_then(|kv| kv.get(1)?.parse().ok())
                .unwrap_or(DEFAULT_MAX_BULK);
            let mut me = if info_text.contains("cluster_enabled:1") {
                let slots = cluster_slots(&mut conn)
                    .map_err(|e| open_error(opts, node, "CLUSTER SLOTS", &e))?;
                let cluster = cluster_connection(opts, &tls)
                    .map_err(|e| open_error(opts, node, "cluster connection", &e))?;
                Client {
                    conn: Conn::Cluster(Box::new(cluster)),
                    slots,
                    single_node: addr(node).to_string(),
                    timeout: opts.timeout,
                    tls: tls.clone(),
                    max_value,
                    opts: opts.clone(),
                    direct: HashMap::new(),
                }
            } else {
                Client {
                    conn: Conn::Single {
                        info,
                        conn: Some(conn),
                    },
                    slots: Vec::new(),
                    single_node: addr(node).to_string(),
                    timeout: opts.timeout,
                    tls: tls.clone(),
                    max_value,
                    opts: opts.clone(),
                    direct: HashMap::new(),
                }
            };
            let probe: RedisResult<Vec<i64>> =
                me.run(vec![redis::cmd("EXISTS").arg(probe_key).clone()]);
            if let Err(e) = probe {
                return Err(open_error(
                    opts,
                    node,
                    &format!("may not use the keys under {probe_key:?}"),
                    &e,
                ));
            }
            return Ok(me);
        }
        Err(last.unwrap_or_else(|| Error::Remote("remote: no nodes given".into())))
    }

    /// A second connection with the same settings (for the uploader).
    pub(crate) fn connect_again(&self, opts: &RemoteOptions) -> Result<Client> {
        let conn = match &self.conn {
            Conn::Single { info, .. } => Conn::Single {
                info: info.clone(),
                conn: None,
            },
            Conn::Cluster(_) => Conn::Cluster(Box::new(
                cluster_connection(opts, &self.tls)
                    .map_err(|e| open_error(opts, &self.single_node, "cluster connection", &e))?,
            )),
        };
        Ok(Client {
            conn,
            slots: self.slots.clone(),
            single_node: self.single_node.clone(),
            timeout: self.timeout,
            tls: self.tls.clone(),
            max_value: self.max_value,
            opts: self.opts.clone(),
            direct: HashMap::new(),
        })
    }

    /// Reads the slot map again from a node other than `failed` that `allow`
    /// lets through (a fresh connection each, within the timeout), so that
    /// slots moved away from a failed node are no longer blamed on it: the
    /// crate follows a redirect of a single command silently, without telling
    /// this map. Keeps the old map if no node answers. Where the map changed
    /// (a replica promoted in the failed master's place), the cluster
    /// connection is made again: the crate learns a new map only from a
    /// redirect, and a dead master sends none, so it kept sending that
    /// master's slots to its address for the life of the handle.
    pub(crate) fn refresh_slots(
        &mut self,
        opts: &RemoteOptions,
        failed: &str,
        allow: impl Fn(&str) -> bool,
    ) {
        let mut nodes: Vec<String> = self.slots.iter().map(|r| r.2.clone()).collect();
        nodes.sort();
        nodes.dedup();
        for n in nodes.iter().filter(|n| *n != failed && allow(n)) {
            let Ok(info) = info_for(opts, &self.tls, n) else {
                continue;
            };
            let conn = self
                .tls
                .client(info)
                .and_then(|c| c.get_connection_with_timeout(self.timeout));
            let Ok(mut conn) = conn else { continue };
            if conn.set_read_timeout(Some(self.timeout)).is_err() {
                continue;
            }
            if let Ok(slots) = cluster_slots(&mut conn) {
                if !slots.is_empty() {
                    if slots != self.slots && matches!(self.conn, Conn::Cluster(_)) {
                        if let Ok(c) = cluster_connection(opts, &self.tls) {
                            self.conn = Conn::Cluster(Box::new(c));
                        }
                    }
                    self.direct.retain(|n, _| slots.iter().any(|r| &r.2 == n));
                    self.slots = slots;
                    return;
                }
            }
        }
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

    /// Runs `cmds` (keys of one slot) as one pipeline; one result each.
    /// (The commands move into the pipeline: a `SET`'s value is not copied
    /// once more.)
    fn run<T: redis::FromRedisValue>(&mut self, cmds: Vec<Cmd>) -> RedisResult<Vec<T>> {
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
                match self.run_on(&node, &p) {
                    Err(e) if redirected(&e) => p.cmd_iter().cloned().collect(),
                    r => return r,
                }
            }
            None => cmds,
        };
        match &mut self.conn {
            Conn::Cluster(c) => {
                let mut p = redis::cluster::cluster_pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                let deadline = Instant::now() + self.timeout;
                match p.query(c) {
                    Err(e) if redirected(&e) => {
                        // The crate's cluster pipeline returns MOVED/ASK (after a
                        // reshard) as failures instead of following them; one
                        // command at a time follows them and refreshes the
                        // client's slot map for the next pipeline. Each command
                        // has its own timeout: the call's deadline bounds them all.
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
                        if let Ok(slots) = cluster_slots(&mut **c) {
                            self.slots = slots;
                        }
                        Ok(out)
                    }
                    r => r,
                }
            }
            Conn::Single { info, conn } => {
                if conn.is_none() {
                    *conn = Some(connect(&self.tls, info.clone(), self.timeout)?);
                }
                let mut p = redis::pipe();
                for cmd in cmds {
                    p.add_command(cmd);
                }
                let res = pipeline(conn.as_mut().expect("connection"), &p);
                if res.as_ref().is_err_and(out_of_step) {
                    *conn = None;
                }
                res
            }
        }
    }

    /// Runs pipeline `p` on `node` over this client's connection to it (made
    /// on first use), dropped where it fails out of step.
    fn run_on<T: redis::FromRedisValue>(
        &mut self,
        node: &str,
        p: &redis::Pipeline,
    ) -> RedisResult<Vec<T>> {
        if !self.direct.contains_key(node) {
            let info = info_for(&self.opts, &self.tls, node).map_err(|e| {
                RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    e.to_string(),
                ))
            })?;
            let c = connect(&self.tls, info, self.timeout)?;
            self.direct.insert(node.to_string(), c);
        }
        let res = pipeline(self.direct.get_mut(node).expect("connection"), p);
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
    ) -> Result<Vec<Option<Vec<u8>>>, Fault> {
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| redis::cmd("GETRANGE").arg(k).arg(0).arg(max).clone())
            .collect();
        let v: Vec<Value> = self.run(cmds).map_err(|e| Fault::of(&e))?;
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
    pub(crate) fn present(&mut self, keys: &[&str]) -> Result<Vec<bool>, Fault> {
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| redis::cmd("STRLEN").arg(*k).clone())
            .collect();
        let v: Vec<Value> = self.run(cmds).map_err(|e| Fault::of(&e))?;
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
        ttl: Option<std::time::Duration>,
    ) -> Result<(), Fault> {
        let cmds: Vec<Cmd> = items
            .iter()
            .map(|(k, v)| {
                let mut c = redis::cmd("SET");
                c.arg(*k).arg(*v);
                if let Some(t) = ttl {
                    c.arg("PX").arg(t.as_millis() as u64);
                }
                c
            })
            .collect();
        let _: Vec<Value> = self.run(cmds).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Renews the time to live of `keys` (one slot).
    pub(crate) fn expire(
        &mut self,
        keys: &[String],
        ttl: std::time::Duration,
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
        let _: Vec<Value> = self.run(cmds).map_err(|e| Fault::of(&e))?;
        Ok(())
    }

    /// Every node of the slot map (or the one node), on a fresh connection:
    /// the round trip of a `PING` and figures from `INFO`, or the error.
    pub(crate) fn nodes(&self, opts: &RemoteOptions) -> Vec<NodeReport> {
        let mut nodes: Vec<String> = self.slots.iter().map(|r| r.2.clone()).collect();
        if nodes.is_empty() {
            nodes.push(self.single_node.clone());
        }
        nodes.sort();
        nodes.dedup();
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

fn node_report(opts: &RemoteOptions, tls: &Tls, node: &str, rep: &mut NodeReport) -> Result<()> {
    let info = info_for(opts, tls, node)?;
    let mut c = tls
        .client(info)
        .and_then(|c| c.get_connection_with_timeout(opts.timeout))
        .map_err(|e| open_error(opts, node, "unreachable", &e))?;
    c.set_read_timeout(Some(opts.timeout))
        .and_then(|()| c.set_write_timeout(Some(opts.timeout)))
        .map_err(|e| open_error(opts, node, "socket options", &e))?;
    let t0 = std::time::Instant::now();
    redis::cmd("PING")
        .query::<String>(&mut c)
        .map_err(|e| open_error(opts, node, "PING", &e))?;
    rep.rtt = Some(t0.elapsed());
    // INFO may be refused to a user without the permission: the round trip stands.
    if let Ok(text) = redis::cmd("INFO").query::<String>(&mut c) {
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

/// A plain connection to `info`'s node, made within `timeout`, whose reads
/// and writes give up after it.
fn connect(
    tls: &Tls,
    info: ConnectionInfo,
    timeout: std::time::Duration,
) -> RedisResult<redis::Connection> {
    let c = tls.client(info)?.get_connection_with_timeout(timeout)?;
    c.set_read_timeout(Some(timeout))?;
    c.set_write_timeout(Some(timeout))?;
    Ok(c)
}

/// Runs pipeline `p` on `c`, its replies read one at a time up to the first
/// failure of the connection: `Pipeline::query` goes on reading every reply
/// after a timeout, a timeout each (16 EXISTS, 8 s at a timeout of 0.5 s).
/// A server's error (a redirect, a refusal) leaves the connection in step:
/// the other replies are read, the first error returned; but `WRONGTYPE` (a
/// key of another type, which only a foreign writer leaves under a block's
/// key) stays in its place as that command's reply, so the rest of the
/// group is still read.
fn pipeline<T: redis::FromRedisValue>(
    c: &mut redis::Connection,
    p: &redis::Pipeline,
) -> RedisResult<Vec<T>> {
    c.send_packed_command(&p.get_packed_pipeline())?;
    let mut values = Vec::with_capacity(p.len());
    let mut refused = None;
    for _ in 0..p.len() {
        match c.recv_response()? {
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

/// Whether a failed request left its connection out of step (a late reply
/// would answer the next request): then it is made afresh.
fn out_of_step(e: &RedisError) -> bool {
    matches!(Fault::of(e), Fault::Timeout | Fault::Connection)
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

/// `(first, last, "host:port")` of every slot range, sorted.
fn cluster_slots(conn: &mut impl ConnectionLike) -> RedisResult<Vec<(u16, u16, String)>> {
    let v: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query(conn)?;
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
    Ok(out)
}
