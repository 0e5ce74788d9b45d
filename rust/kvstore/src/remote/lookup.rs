//! A node's addresses by a call's deadline. `getaddrinfo` has no timeout
//! of its own (only the resolver's: 5 s a try, up to 30 s with retries and
//! several name servers), so a hung resolver held a connect, and every call
//! queued behind it, past any deadline. An IP address needs no lookup; a
//! name is looked up on a thread of its own, waited for until the deadline
//! and then left to end alone.

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

/// Lookups running at once, at most: each hung one holds a thread until
/// the resolver gives up; past this many a connect fails at once.
const MAX_RUNNING: usize = 4;

/// Lookups of this process still running (waited for or not).
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// How every error of [`addresses`] begins (an open's message tells it
/// from a node that did not answer).
pub(crate) const FAILED: &str = "name lookup failed";

/// The addresses of `host` (no brackets) and `port`, by `deadline`.
pub(crate) fn addresses(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    look_up(host, port, deadline, &RUNNING, |h, p| {
        (h, p).to_socket_addrs().map(Iterator::collect)
    })
    .map_err(|e| io::Error::new(e.kind(), format!("{FAILED}: {e}")))
}

/// `resolve(host, port)` on a thread of its own, counted in `running`,
/// waited for until `deadline`.
fn look_up(
    host: &str,
    port: u16,
    deadline: Instant,
    running: &'static AtomicUsize,
    resolve: fn(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> io::Result<Vec<SocketAddr>> {
    let timed_out = |why: &str| io::Error::new(io::ErrorKind::TimedOut, format!("{host}: {why}"));
    if running.fetch_add(1, Ordering::AcqRel) >= MAX_RUNNING {
        running.fetch_sub(1, Ordering::AcqRel);
        return Err(timed_out("earlier name lookups have not ended"));
    }
    let (tx, rx) = mpsc::channel();
    let name = host.to_string();
    let spawned = std::thread::Builder::new()
        .name("kvstore-lookup".into())
        .spawn(move || {
            let got = resolve(&name, port);
            running.fetch_sub(1, Ordering::AcqRel);
            let _ = tx.send(got); // the caller may have stopped waiting
        });
    if let Err(e) = spawned {
        running.fetch_sub(1, Ordering::AcqRel);
        return Err(e);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    rx.recv_timeout(left).unwrap_or_else(|_| {
        Err(timed_out(
            "no answer from the name lookup within the timeout",
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::{addresses, look_up, MAX_RUNNING};
    use std::io;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    #[allow(clippy::unnecessary_wraps)] // a resolver's signature
    fn hangs(_: &str, _: u16) -> io::Result<Vec<SocketAddr>> {
        std::thread::sleep(Duration::from_millis(1500));
        Ok(vec![SocketAddr::from(([10, 0, 0, 1], 1))])
    }

    #[allow(clippy::unnecessary_wraps)] // a resolver's signature
    fn answers(_: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
        Ok(vec![SocketAddr::from(([10, 0, 0, 2], port))])
    }

    #[test]
    fn a_hung_lookup_ends_at_the_deadline_and_the_running_ones_are_bounded() {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        let t0 = Instant::now();
        for _ in 0..MAX_RUNNING {
            let deadline = Instant::now() + Duration::from_millis(50);
            let e = look_up("stuck", 1, deadline, &RUNNING, hangs).expect_err("hung");
            assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        }
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        assert_eq!(RUNNING.load(Ordering::Acquire), MAX_RUNNING);
        // No thread more while those run: the next fails at once, time or not.
        let t1 = Instant::now();
        let far = t1 + Duration::from_secs(60);
        let e = look_up("other", 2, far, &RUNNING, answers).expect_err("bounded");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(t1.elapsed() < Duration::from_millis(100));
        // Once they end, lookups run again.
        while RUNNING.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
        let got = look_up("other", 2, far, &RUNNING, answers).expect("answered");
        assert_eq!(got, vec![SocketAddr::from(([10, 0, 0, 2], 2))]);
        assert_eq!(RUNNING.load(Ordering::Acquire), 0);
    }

    #[test]
    fn an_address_needs_no_lookup_and_a_name_is_looked_up() {
        let past = Instant::now();
        let v6 = addresses("::1", 7, past).expect("no lookup, no deadline");
        assert_eq!(v6, vec!["[::1]:7".parse::<SocketAddr>().expect("addr")]);
        let v4 = addresses("127.0.0.1", 8, past).expect("no lookup, no deadline");
        assert_eq!(v4, vec![SocketAddr::from(([127, 0, 0, 1], 8))]);
        let soon = Instant::now() + Duration::from_secs(10);
        let local = addresses("localhost", 9, soon).expect("localhost resolves");
        assert!(local.iter().all(|a| a.ip().is_loopback() && a.port() == 9));
        assert!(!local.is_empty());
    }
}
