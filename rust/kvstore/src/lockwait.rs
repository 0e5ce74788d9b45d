//! Waiting for a lock with a deadline (an opener's: the store's LOCK, the
//! arena's; an arena writer's `flock`); and, when the wait gives up, who
//! holds it, for the `StoreLocked` error: the holder's pid and what its
//! threads are doing (one stuck in the kernel, state D, keeps a lock however
//! it is killed).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

/// Tries `take` (true: taken) every `poll` until it succeeds or `deadline`
/// has passed (false).
pub(crate) fn wait_for(
    deadline: Instant,
    poll: Duration,
    mut take: impl FnMut() -> std::io::Result<bool>,
) -> std::io::Result<bool> {
    loop {
        if take()? {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(poll);
    }
}

/// `flock(LOCK_EX)` of `file` without waiting: false if another open file
/// description holds it.
pub(crate) fn try_flock(file: &File) -> std::io::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(std::fs::TryLockError::WouldBlock) => Ok(false),
        Err(std::fs::TryLockError::Error(e)) => Err(e),
    }
}

/// ` (pid N: threads <states>)`: each distinct state and kernel wait channel
/// of process `pid`'s threads from /proc. If it has exited, whoever holds the
/// lock now shares the descriptor it took it through (inherited it).
pub(crate) fn describe(pid: u32) -> String {
    if pid == std::process::id() {
        // flock is per open file: another handle of this process holds it.
        return " (this process, through another handle)".into();
    }
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!(
            " (by a process sharing the descriptor of pid {pid}, which took it and exited)"
        );
    };
    let mut seen = std::collections::BTreeSet::new();
    for task in tasks.flatten().take(256) {
        let read = |what: &str| std::fs::read_to_string(task.path().join(what)).unwrap_or_default();
        // `stat` is "tid (comm) S ...": the state letter follows the last ')'.
        let stat = read("stat");
        let Some(state) = stat.rfind(')').and_then(|i| stat.get(i + 2..i + 3)) else {
            continue;
        };
        let wchan = read("wchan");
        seen.insert(match wchan.as_str() {
            "" | "0" => state.to_string(),
            w => format!("{state} in {w}"),
        });
    }
    let threads: Vec<String> = seen.into_iter().take(6).collect();
    format!(" (pid {pid}: threads {})", threads.join(", "))
}

/// The processes holding a `flock` on `file`, from /proc/locks (which names
/// the process that took each one, as seen from this pid namespace), each
/// described as `describe` does; ` (by a process /proc/locks does not name)`
/// if none is listed.
pub(crate) fn flock_holders(file: &File) -> String {
    let Ok(meta) = file.metadata() else {
        return String::new();
    };
    let dev = meta.dev();
    let want = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev),
        meta.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let named: String = locks
        .lines()
        .filter_map(|line| flock_holder(line, &want))
        .take(4)
        .map(describe)
        .collect();
    if named.is_empty() {
        " (by a process /proc/locks does not name)".into()
    } else {
        named
    }
}

/// The pid of a held (not awaited: `->`) FLOCK line of /proc/locks on the
/// file `dev_ino` ("maj:min:inode"), e.g. `3: FLOCK  ADVISORY  WRITE 4242 00:1b:78583 0 EOF`.
fn flock_holder(line: &str, dev_ino: &str) -> Option<u32> {
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.get(1) != Some(&"FLOCK") || f.get(5) != Some(&dev_ino) {
        return None;
    }
    // 0: a process outside this pid namespace.
    f.get(4)?.parse().ok().filter(|&pid| pid > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flock_lines_are_read_by_field() {
        let at = "00:1b:78583";
        let held = "3: FLOCK  ADVISORY  WRITE 4242 00:1b:78583 0 EOF";
        assert_eq!(flock_holder(held, at), Some(4242));
        // a process waiting for it, another file, another kind of lock
        assert_eq!(
            flock_holder("3: -> FLOCK  ADVISORY  WRITE 17 00:1b:78583 0 EOF", at),
            None
        );
        assert_eq!(
            flock_holder("3: FLOCK  ADVISORY  WRITE 4242 00:1b:785830 0 EOF", at),
            None
        );
        assert_eq!(
            flock_holder("1: OFDLCK ADVISORY  READ -1 00:1b:78583 0 EOF", at),
            None
        );
        assert_eq!(flock_holder("", at), None);
        let outside = "3: FLOCK  ADVISORY  WRITE 0 00:1b:78583 0 EOF";
        assert_eq!(flock_holder(outside, at), None);
    }

    #[test]
    fn a_flock_held_here_names_this_process() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let a = File::create(&path).unwrap();
        let b = File::open(&path).unwrap();
        assert_eq!(
            flock_holders(&b),
            " (by a process /proc/locks does not name)"
        );
        a.lock().unwrap();
        assert_eq!(flock_holders(&b), " (this process, through another handle)");
    }
}
