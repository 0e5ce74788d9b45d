//! A connection to one node whose every call has one deadline: the name
//! lookup (`lookup`), connecting, the TLS handshake, writing the request
//! and reading all its replies stop when it passes. The `redis` crate's
//! sync connection applies its timeout to each socket read, so a server
//! that trickled a reply (each byte inside the timeout) held a call, and
//! every thread queued behind it, for as long as it liked; here each read
//! and write is given only the time left. The crate still packs the
//! commands and parses the replies (its `Parser`).

use super::lookup;
use redis::{ErrorKind, Parser, RedisError, RedisResult, Value};
use rustls::pki_types::ServerName;
use rustls::{ClientConnection, StreamOwned};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One node and how to reach it.
#[derive(Clone)]
pub(crate) struct Target {
    host: String,
    port: u16,
    tls: Option<Arc<rustls::ClientConfig>>,
    username: Option<String>,
    password: Option<String>,
}

impl Target {
    /// `node` is `host:port` (an IPv6 host in brackets).
    pub(crate) fn new(
        node: &str,
        tls: Option<Arc<rustls::ClientConfig>>,
        username: Option<String>,
        password: Option<String>,
    ) -> Option<Target> {
        let (host, port) = node.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        Some(Target {
            host: host.to_string(),
            port: port.parse().ok()?,
            tls,
            username,
            password,
        })
    }
}

pub(crate) fn deadline_passed() -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "the call's deadline passed")
}

/// How long a socket timeout, set to the time left, serves before it is set
/// again: a read or write may end up to this much past the deadline, and a
/// call that moves a large value in many reads pays one `setsockopt` per
/// interval, not one per read (64 MiB of gets on loopback: 765 instead of
/// 8,550).
const REARM: Duration = Duration::from_millis(2);

/// Bytes read from the socket at once, per connection (one per node a
/// client talks to).
const READ_BUFFER: usize = 256 << 10;

/// The socket, each read and write bounded by the time left to `deadline`
/// (within [`REARM`]).
struct Sock {
    tcp: TcpStream,
    deadline: Instant,
    /// When the read and the write timeouts were last set to the time left
    /// (`None`: not for this deadline).
    read_armed: Option<Instant>,
    write_armed: Option<Instant>,
}

impl Sock {
    fn new(tcp: TcpStream, deadline: Instant) -> Sock {
        Sock {
            tcp,
            deadline,
            read_armed: None,
            write_armed: None,
        }
    }

    fn set_deadline(&mut self, deadline: Instant) {
        self.deadline = deadline;
        self.read_armed = None;
        self.write_armed = None;
    }
}

/// The timeout to set before a read or write whose timeout was set at
/// `armed`: the time left to `deadline`, where that one is older than
/// [`REARM`] (else `None`: keep it). Fails once the deadline has passed.
fn rearm(deadline: Instant, armed: &mut Option<Instant>) -> io::Result<Option<Duration>> {
    let now = Instant::now();
    let left = deadline
        .checked_duration_since(now)
        .filter(|d| !d.is_zero())
        .ok_or_else(deadline_passed)?;
    if armed.is_some_and(|at| now.duration_since(at) <= REARM) {
        return Ok(None);
    }
    *armed = Some(now);
    Ok(Some(left))
}

/// A socket timeout reads as `WouldBlock` on Unix: the call's deadline.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        deadline_passed()
    } else {
        e
    }
}

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(t) = rearm(self.deadline, &mut self.read_armed)? {
            self.tcp.set_read_timeout(Some(t))?;
        }
        self.tcp.read(buf).map_err(timed_out)
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(t) = rearm(self.deadline, &mut self.write_armed)? {
            self.tcp.set_write_timeout(Some(t))?;
        }
        self.tcp.write(buf).map_err(timed_out)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

enum Stream {
    Plain(Sock),
    Tls(Box<StreamOwned<ClientConnection, Sock>>),
}

impl Stream {
    fn set_deadline(&mut self, deadline: Instant) {
        match self {
            Stream::Plain(s) => s.set_deadline(deadline),
            Stream::Tls(t) => t.sock.set_deadline(deadline),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(t) => t.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(t) => t.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(t) => t.flush(),
        }
    }
}

/// A connection to one node. After a failed read or write it is out of
/// step (a late reply would answer the next request): the caller drops it.
pub(crate) struct Wire {
    /// Buffered: the crate's parser reads 8 KiB at a time, so a 256 KiB
    /// value took 32 `recvfrom`s; through [`READ_BUFFER`] it takes what the
    /// socket holds at once (64 MiB of gets: 276 reads instead of 8,471).
    stream: io::BufReader<Stream>,
    parser: Parser,
}

impl Wire {
    /// Connects, shakes hands (TLS) and authenticates, all by `deadline`.
    /// A refused `AUTH` is `ErrorKind::AuthenticationFailed`.
    pub(crate) fn connect(t: &Target, deadline: Instant) -> RedisResult<Wire> {
        let mut last = None;
        let mut tcp = None;
        for a in lookup::addresses(&t.host, t.port, deadline)? {
            let left = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or_else(deadline_passed)?;
            match TcpStream::connect_timeout(&a, left) {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let tcp = match (tcp, last) {
            (Some(s), _) => s,
            (None, Some(e)) => return Err(e.into()),
            (None, None) => {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    "the address resolves to nothing",
                )
                .into())
            }
        };
        tcp.set_nodelay(true)?;
        let mut sock = Sock::new(tcp, deadline);
        let stream = match &t.tls {
            None => Stream::Plain(sock),
            Some(config) => {
                let name = ServerName::try_from(t.host.clone())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                let mut conn =
                    ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
                // Here, not at the first command: a failed handshake is a
                // TLS failure of the connection, reported as such.
                while conn.is_handshaking() {
                    conn.complete_io(&mut sock)?;
                }
                Stream::Tls(Box::new(StreamOwned::new(conn, sock)))
            }
        };
        let mut w = Wire {
            stream: io::BufReader::with_capacity(READ_BUFFER, stream),
            parser: Parser::new(),
        };
        if let Some(p) = &t.password {
            let mut auth = redis::cmd("AUTH");
            if let Some(u) = &t.username {
                auth.arg(u);
            }
            auth.arg(p);
            let mut v = w.replies(&auth.get_packed_command(), 1, deadline)?;
            if let Some(Value::ServerError(e)) = v.pop() {
                // The server's words only: the password is never echoed.
                let why = RedisError::from(e).to_string();
                return Err(RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "authentication failed",
                    why,
                )));
            }
        }
        Ok(w)
    }

    /// Sends `packed` (`n` commands) and reads their `n` replies (a server's
    /// error among them as `Value::ServerError`), all by `deadline`; stops
    /// at the first failure of the connection.
    pub(crate) fn replies(
        &mut self,
        packed: &[u8],
        n: usize,
        deadline: Instant,
    ) -> RedisResult<Vec<Value>> {
        self.stream.get_mut().set_deadline(deadline);
        self.stream.get_mut().write_all(packed)?;
        self.stream.get_mut().flush()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.parser.parse_value(&mut self.stream)?);
        }
        Ok(out)
    }

    /// Runs one command by `deadline`; a server's error is an `Err`.
    pub(crate) fn query<T: redis::FromRedisValue>(
        &mut self,
        cmd: &redis::Cmd,
        deadline: Instant,
    ) -> RedisResult<T> {
        match self.replies(&cmd.get_packed_command(), 1, deadline)?.pop() {
            Some(Value::ServerError(e)) => Err(e.into()),
            Some(v) => T::from_redis_value(v).map_err(RedisError::from),
            None => Err(io::Error::from(io::ErrorKind::UnexpectedEof).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{rearm, REARM};
    use std::time::{Duration, Instant};

    #[test]
    fn a_timeout_is_set_again_only_once_it_could_overshoot_by_rearm() {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut armed = None;
        let first = rearm(deadline, &mut armed).expect("time left");
        assert!(first.is_some_and(|t| t <= Duration::from_secs(10)));
        // Within REARM of the first: kept (a read may overshoot by REARM).
        assert_eq!(rearm(deadline, &mut armed).expect("time left"), None);
        std::thread::sleep(REARM + Duration::from_millis(1));
        let again = rearm(deadline, &mut armed).expect("time left");
        assert!(again.is_some_and(|t| t < first.expect("set")));
        // Once the deadline has passed, nothing more is read or written.
        let past = Instant::now();
        let err = rearm(past, &mut None).expect_err("deadline passed");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(rearm(past, &mut armed).is_err());
    }
}
