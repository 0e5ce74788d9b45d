//! A node's addresses by a call's deadline. `getaddrinfo` has no timeout
//! of its own (only the resolver's: 5 s a try, up to 30 s with retries and
//! several name servers), so a hung resolver held a connect, and every call
//! queued behind it, past any deadline. An IP address needs no lookup; a
//! name is looked up on a thread of its own, waited for until the deadline
//! and then left to end alone.
//!
//! One lookup runs per name: a caller that finds the name already being
//! looked up waits for that lookup's answer instead of starting another.
//! So a name whose lookup hangs holds one thread, however many calls ask
//! for it, and only [`MAX_RUNNING`] names hanging at once keep other names
//! from being looked up.

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// Names being looked up at once, at most: each hung lookup holds a
/// thread until the resolver gives up; past this many names a connect to
/// a name not among them fails at once.
const MAX_RUNNING: usize = 4;

/// How every error of [`addresses`] begins (an open's message tells it
/// from a node that did not answer).
pub(crate) const FAILED: &str = "name lookup failed";

/// A lookup's answer, shared by every caller waiting for it (an
/// `io::Error` is not `Clone`, so its kind and text).
type Answer = Result<Vec<IpAddr>, (io::ErrorKind, String)>;

/// Resolves a name to its addresses (the port is set by the caller).
type Resolve = fn(&str) -> io::Result<Vec<IpAddr>>;

/// One name's lookup: its answer once the resolver gives one.
#[derive(Default)]
struct Pending {
    answer: Mutex<Option<Answer>>,
    ready: Condvar,
}

/// The lookups of one process still running, each with its name (waited
/// for or not; at most [`MAX_RUNNING`], so a list, not a map).
struct Lookups {
    running: Mutex<Vec<(String, Arc<Pending>)>>,
    resolve: Resolve,
}

/// This process's lookups, through the system's resolver.
static LOOKUPS: Lookups = Lookups::new(system_resolver);

fn system_resolver(host: &str) -> io::Result<Vec<IpAddr>> {
    Ok((host, 0).to_socket_addrs()?.map(|a| a.ip()).collect())
}

/// A lock that a panic elsewhere does not poison: the guarded values stay
/// whole (an answer is set in one step, a list entry added or removed).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The addresses of `host` (no brackets) and `port`, by `deadline`.
pub(crate) fn addresses(host: &str, port: u16, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    match LOOKUPS.look_up(host, deadline) {
        Ok(ips) => Ok(ips
            .into_iter()
            .map(|ip| SocketAddr::new(ip, port))
            .collect()),
        // The host named: an open's message may be about another node.
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("{FAILED} for {host}: {e}"),
        )),
    }
}

impl Lookups {
    const fn new(resolve: Resolve) -> Self {
        Self {
            running: Mutex::new(Vec::new()),
            resolve,
        }
    }

    /// The addresses of `host`, from the lookup of it already running or
    /// from one started on a thread of its own, waited for until `deadline`.
    fn look_up(&'static self, host: &str, deadline: Instant) -> io::Result<Vec<IpAddr>> {
        let timed_out = |why: &str| io::Error::new(io::ErrorKind::TimedOut, why.to_string());
        if Instant::now() >= deadline {
            return Err(timed_out("the call's deadline passed before the lookup"));
        }
        let pending = {
            let mut running = lock(&self.running);
            if let Some((_, p)) = running.iter().find(|(name, _)| name == host) {
                Arc::clone(p)
            } else if running.len() >= MAX_RUNNING {
                return Err(timed_out("the lookups of other names have not ended"));
            } else {
                let p = Arc::new(Pending::default());
                self.start(host, Arc::clone(&p))?;
                running.push((host.to_string(), Arc::clone(&p)));
                p
            }
        };
        let mut answer = lock(&pending.answer);
        loop {
            if let Some(got) = answer.as_ref() {
                return got
                    .clone()
                    .map_err(|(kind, text)| io::Error::new(kind, text));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out(
                    "no answer from the name lookup within the timeout",
                ));
            }
            answer = pending
                .ready
                .wait_timeout(answer, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// A thread that looks `host` up, gives every waiter its answer and
    /// then lets the next caller start a lookup of its own.
    fn start(&'static self, host: &str, pending: Arc<Pending>) -> io::Result<()> {
        let name = host.to_string();
        let resolve = self.resolve;
        std::thread::Builder::new()
            .name("kvstore-lookup".into())
            .spawn(move || {
                // A resolver that panics still answers and leaves the list.
                let got = std::panic::catch_unwind(|| resolve(&name))
                    .unwrap_or_else(|_| Err(io::Error::other("the resolver panicked")))
                    .map_err(|e| (e.kind(), e.to_string()));
                // Out of the list first (under its lock, which the starter holds
                // until the entry is in): a caller from now on looks up afresh.
                lock(&self.running).retain(|(_, p)| !Arc::ptr_eq(p, &pending));
                *lock(&pending.answer) = Some(got);
                pending.ready.notify_all();
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{addresses, Lookups, MAX_RUNNING};
    use std::io;
    use std::net::{IpAddr, SocketAddr};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Lookups started by the resolvers below, and whether a hung one may end.
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    static RELEASED: AtomicBool = AtomicBool::new(false);

    /// Names starting with "stuck" hang until released; "bad" fails; any
    /// other name answers at once.
    #[allow(clippy::unnecessary_wraps)] // a resolver's signature
    fn resolver(host: &str) -> io::Result<Vec<IpAddr>> {
        STARTED.fetch_add(1, Ordering::AcqRel);
        if host.starts_with("stuck") {
            while !RELEASED.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            return Ok(vec![IpAddr::from([10, 0, 0, 1])]);
        }
        if host == "bad" {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such name"));
        }
        Ok(vec![IpAddr::from([10, 0, 0, 2])])
    }

    fn soon(ms: u64) -> Instant {
        Instant::now() + Duration::from_millis(ms)
    }

    fn running(l: &Lookups) -> usize {
        l.running.lock().expect("lock").len()
    }

    /// Waits (at most 10 s) until `done()`.
    fn until(done: impl Fn() -> bool) {
        let t0 = Instant::now();
        while !done() {
            assert!(t0.elapsed() < Duration::from_secs(10), "waited 10 s");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A lookup of a hung name, which must end at its deadline, not before.
    fn hangs_until_deadline(l: &'static Lookups, host: &str) {
        let deadline = soon(20);
        let e = l.look_up(host, deadline).expect_err("hung");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(
            Instant::now() >= deadline,
            "{e}: failed before its deadline"
        );
    }

    #[test]
    fn one_lookup_per_name_and_names_running_at_once_are_bounded() {
        static L: Lookups = Lookups::new(resolver);
        let t0 = Instant::now();
        // Many calls for one hung name: one lookup, each call ends at its deadline.
        for _ in 0..3 * MAX_RUNNING {
            hangs_until_deadline(&L, "stuck-0");
        }
        until(|| STARTED.load(Ordering::Acquire) >= 1);
        assert_eq!(STARTED.load(Ordering::Acquire), 1);
        assert_eq!(running(&L), 1);
        // Other names still answer while it hangs, and fail with their own error.
        assert_eq!(
            L.look_up("ok", soon(10_000)).expect("answered"),
            [IpAddr::from([10, 0, 0, 2])]
        );
        let e = L.look_up("bad", soon(10_000)).expect_err("no such name");
        assert_eq!(
            (e.kind(), e.to_string()),
            (io::ErrorKind::NotFound, "no such name".into())
        );
        assert_eq!(STARTED.load(Ordering::Acquire), 3);
        // Hung names up to the bound; past it a new name fails at once.
        for i in 1..MAX_RUNNING {
            hangs_until_deadline(&L, &format!("stuck-{i}"));
        }
        assert_eq!(running(&L), MAX_RUNNING);
        let t1 = Instant::now();
        let e = L.look_up("ok", soon(60_000)).expect_err("bounded");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("other names"), "{e}");
        assert!(
            t1.elapsed() < Duration::from_millis(500),
            "{:?}",
            t1.elapsed()
        );
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        // A call whose deadline has passed starts nothing.
        let e = L.look_up("ok", Instant::now()).expect_err("too late");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        // A caller waiting on the hung lookup when it ends gets its answer: its
        // hold on the lookup (beside the list's and the thread's) is seen first.
        let started = STARTED.load(Ordering::Acquire);
        let waiter = std::thread::spawn(|| L.look_up("stuck-0", soon(60_000)));
        until(|| {
            let list = L.running.lock().expect("lock");
            list.iter()
                .any(|(n, p)| n == "stuck-0" && Arc::strong_count(p) == 3)
        });
        RELEASED.store(true, Ordering::Release);
        let got = waiter
            .join()
            .expect("joined")
            .expect("answered once released");
        assert_eq!(got, [IpAddr::from([10, 0, 0, 1])]);
        assert_eq!(
            STARTED.load(Ordering::Acquire),
            started,
            "the waiter joined, not started"
        );
        // Once they end, a name is looked up afresh (no answer is kept).
        until(|| running(&L) == 0);
        assert_eq!(
            L.look_up("stuck-0", soon(60_000)).expect("answered"),
            [IpAddr::from([10, 0, 0, 1])]
        );
        assert_eq!(STARTED.load(Ordering::Acquire), started + 1);
    }

    #[test]
    fn a_resolver_that_panics_answers_and_frees_its_place() {
        static L: Lookups = Lookups::new(|_| panic!("a resolver's bug"));
        for _ in 0..2 * MAX_RUNNING {
            let e = L.look_up("any", soon(10_000)).expect_err("panicked");
            assert_eq!(e.kind(), io::ErrorKind::Other);
            assert!(e.to_string().contains("panicked"), "{e}");
        }
        until(|| running(&L) == 0);
    }

    #[test]
    fn an_address_needs_no_lookup_and_a_name_is_looked_up() {
        let past = Instant::now();
        let v6 = addresses("::1", 7, past).expect("no lookup, no deadline");
        assert_eq!(v6, vec!["[::1]:7".parse::<SocketAddr>().expect("addr")]);
        let v4 = addresses("127.0.0.1", 8, past).expect("no lookup, no deadline");
        assert_eq!(v4, vec![SocketAddr::from(([127, 0, 0, 1], 8))]);
        let local = addresses("localhost", 9, soon(10_000)).expect("localhost resolves");
        assert!(local.iter().all(|a| a.ip().is_loopback() && a.port() == 9));
        assert!(!local.is_empty());
        // An error names the host (an open's message may be about another node).
        let e = addresses("stuck", 9, past).expect_err("too late");
        assert_eq!(
            e.to_string(),
            "name lookup failed for stuck: the call's deadline passed before the lookup"
        );
    }
}
