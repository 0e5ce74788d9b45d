//! Fault injection for crash and power-loss tests (feature `fault-injection`).
//!
//! Every durable step of the engine passes through a hook here: a write, an
//! fdatasync/fsync, a rename, an unlink, an index commit. Tests arm a plan —
//! "at the Nth step, fail it / kill the process / lose power" — run a workload
//! and check, after reopening, that the store holds exactly what was durable.
//!
//! Power loss is simulated on the files the engine wrote through these hooks:
//! bytes written since a file's last sync are cut at a random length (and the
//! kept part may read back as zeros, as when the size reached the disk before
//! the data), files whose directory entry was never synced vanish, and renames
//! not followed by a directory sync are undone (a file the rename replaced
//! comes back). LMDB is trusted to keep its own
//! synced commits (it is not routed through these hooks), which is exactly the
//! property under test: no commit may point at bytes a power loss can take.
//!
//! Without the feature every hook is an empty inline function.

/// A durable step of the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Write,
    Sync,
    Rename,
    Unlink,
    Commit,
}

/// What happens at the armed step.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The step fails with EIO (the process goes on).
    Fail,
    /// The process is killed (SIGKILL) just before the step.
    Crash,
    /// Unsynced writes are lost or torn (seeded), then the process is killed.
    /// A write at the armed step is performed first, so it can be torn.
    PowerLoss { seed: u64 },
}

#[cfg(feature = "fault-injection")]
mod imp {
    use super::{Mode, Op};
    use std::collections::HashMap;
    use std::fs::File;
    use std::io;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex;

    /// A file written through the hooks, by (device, inode).
    struct Tracked {
        path: PathBuf,
        /// Length at its last sync (what survives a power loss for sure).
        durable_len: u64,
        /// Written since its last sync.
        dirty: bool,
        /// Its directory entry was created and not yet synced.
        new_entry: bool,
    }

    /// A rename a power loss may undo.
    struct Renamed {
        from: PathBuf,
        to: PathBuf,
        /// What `to` held before, if the rename replaced a file: undoing
        /// the rename brings it back, as a file system that never saw the
        /// new entry would.
        replaced: Option<Vec<u8>>,
    }

    #[derive(Default)]
    struct State {
        plan: Option<(u64, Mode)>,
        /// Every step since `arm`, in order.
        trace: Vec<Op>,
        files: HashMap<(u64, u64), Tracked>,
        /// Renames not followed by a sync of their directory.
        renames: Vec<Renamed>,
        /// The bytes of the file the next rename replaces (`replacing`).
        replaced: Option<Vec<u8>>,
        /// Power loss armed at a write: lose power once it is done.
        after_write: Option<u64>,
    }

    static STEPS: AtomicU64 = AtomicU64::new(0);
    static STATE: Mutex<Option<State>> = Mutex::new(None);

    fn with<R>(f: impl FnOnce(&mut State) -> R) -> R {
        let mut g = STATE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(g.get_or_insert_with(State::default))
    }

    /// Arms the plan: the `nth` step from now (1-based) fails, crashes or
    /// loses power. Resets the step counter and the tracked files.
    pub fn arm(nth: u64, mode: Mode) {
        STEPS.store(0, Ordering::SeqCst);
        with(|s| {
            *s = State::default();
            s.plan = Some((nth, mode));
        });
    }

    /// Counts steps without acting on any (`steps()` tells how many ran).
    pub fn count_only() {
        arm(u64::MAX, Mode::Fail);
    }

    /// Steps taken since the last `arm`.
    pub fn steps() -> u64 {
        STEPS.load(Ordering::SeqCst)
    }

    /// The kind of every step taken since the last `arm`, in order.
    pub fn trace() -> Vec<Op> {
        with(|s| s.trace.clone())
    }

    fn key(file: &File) -> Option<(u64, u64)> {
        file.metadata().ok().map(|m| (m.dev(), m.ino()))
    }

    fn path_of(file: &File) -> PathBuf {
        std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap_or_default()
    }

    fn track<'s>(s: &'s mut State, file: &File) -> Option<&'s mut Tracked> {
        let k = key(file)?;
        Some(s.files.entry(k).or_insert_with(|| Tracked {
            path: path_of(file),
            // A file first seen now: what it holds was there before the
            // workload (or survived the last crash), so count it as durable.
            durable_len: file.metadata().map_or(0, |m| m.len()),
            dirty: false,
            new_entry: false,
        }))
    }

    pub fn before(op: Op, file: Option<&File>) -> io::Result<()> {
        let n = STEPS.fetch_add(1, Ordering::SeqCst) + 1;
        let plan = with(|s| {
            if let (Op::Write, Some(f)) = (op, file) {
                track(s, f);
            }
            s.trace.push(op);
            s.plan
        });
        match plan {
            Some((nth, mode)) if nth == n => match mode {
                Mode::Fail => Err(io::Error::from_raw_os_error(
                    rustix::io::Errno::IO.raw_os_error(),
                )),
                Mode::Crash => die(),
                Mode::PowerLoss { seed } if op == Op::Write => {
                    with(|s| s.after_write = Some(seed));
                    Ok(())
                }
                Mode::PowerLoss { seed } => {
                    lose_power(seed);
                    die()
                }
            },
            _ => Ok(()),
        }
    }

    pub fn wrote(file: &File) {
        let seed = with(|s| {
            if let Some(t) = track(s, file) {
                t.dirty = true;
            }
            s.after_write.take()
        });
        if let Some(seed) = seed {
            lose_power(seed);
            die();
        }
    }

    pub fn synced(file: &File) {
        let len = file.metadata().map_or(0, |m| m.len());
        with(|s| {
            if let Some(t) = track(s, file) {
                t.durable_len = len;
                t.dirty = false;
            }
        });
    }

    pub fn created(file: &File) {
        with(|s| {
            if let Some(k) = key(file) {
                s.files.insert(
                    k,
                    Tracked {
                        path: path_of(file),
                        durable_len: 0,
                        dirty: false,
                        new_entry: true,
                    },
                );
            }
        });
    }

    /// `p` with its directory resolved (the file itself may not exist).
    fn canon(p: &Path) -> PathBuf {
        match (
            p.parent().and_then(|d| d.canonicalize().ok()),
            p.file_name(),
        ) {
            (Some(d), Some(n)) => d.join(n),
            _ => p.to_path_buf(),
        }
    }

    /// Called just before a rename onto `to`: keeps what `to` holds.
    pub fn replacing(to: &Path) {
        let old = std::fs::read(to).ok();
        with(|s| s.replaced = old);
    }

    pub fn renamed(from: &Path, to: &Path) {
        let (from, to) = (canon(from), canon(to));
        with(|s| {
            // The replaced file is gone; its tracking must not act on the
            // file that now has its name.
            s.files.retain(|_, t| t.path != to);
            for t in s.files.values_mut() {
                if t.path == from {
                    t.path.clone_from(&to);
                }
            }
            let replaced = s.replaced.take();
            s.renames.push(Renamed { from, to, replaced });
        });
    }

    pub fn dir_synced(dir: &Path) {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        with(|s| {
            for t in s.files.values_mut() {
                if t.path.parent() == Some(&dir) {
                    t.new_entry = false;
                }
            }
            s.renames
                .retain(|r| r.to.parent().map(Path::to_path_buf) != Some(dir.clone()));
        });
    }

    /// xorshift64*: deterministic per seed, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            if n == 0 {
                0
            } else {
                self.next() % n
            }
        }
    }

    /// Throws away what a power cut could: see the module documentation.
    fn lose_power(seed: u64) {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let (files, renames) =
            with(|s| (std::mem::take(&mut s.files), std::mem::take(&mut s.renames)));
        let mut files: Vec<Tracked> = files.into_values().collect();
        for r in renames.into_iter().rev() {
            let undo = rng.below(2) == 0;
            if undo {
                let _ = std::fs::rename(&r.to, &r.from);
                if let Some(old) = r.replaced {
                    let _ = std::fs::write(&r.to, old);
                }
            }
            for t in files.iter_mut().filter(|t| t.path == r.to) {
                if undo {
                    t.path.clone_from(&r.from);
                } else {
                    // A rename that reached the disk carries its file's
                    // entry with it: the file no longer vanishes.
                    t.new_entry = false;
                }
            }
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        for t in files {
            if t.new_entry && rng.below(2) == 0 {
                let _ = std::fs::remove_file(&t.path);
                continue;
            }
            if !t.dirty {
                continue;
            }
            let Ok(f) = std::fs::OpenOptions::new().write(true).open(&t.path) else {
                continue;
            };
            let len = f.metadata().map_or(0, |m| m.len());
            if len <= t.durable_len {
                continue;
            }
            let keep = t.durable_len + rng.below(len - t.durable_len + 1);
            let _ = f.set_len(keep);
            if keep > t.durable_len && rng.below(2) == 0 {
                // The size reached the disk, the data did not.
                let from = t.durable_len + rng.below(keep - t.durable_len);
                let zeros = vec![0u8; (keep - from) as usize];
                let _ = f.write_all_at(&zeros, from);
            }
        }
    }

    fn die() -> ! {
        let _ =
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
        // SIGKILL cannot be caught; this is never reached.
        std::process::abort()
    }
}

#[cfg(not(feature = "fault-injection"))]
mod imp {
    use super::Op;
    use std::fs::File;
    use std::io;
    use std::path::Path;

    #[inline]
    #[allow(clippy::unnecessary_wraps)] // the same signature as with the feature
    pub fn before(_: Op, _: Option<&File>) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    pub fn wrote(_: &File) {}
    #[inline]
    pub fn synced(_: &File) {}
    #[inline]
    pub fn created(_: &File) {}
    #[inline]
    pub fn replacing(_: &Path) {}
    #[inline]
    pub fn renamed(_: &Path, _: &Path) {}
    #[inline]
    pub fn dir_synced(_: &Path) {}
}

#[cfg(feature = "fault-injection")]
pub use imp::{arm, count_only, steps, trace};

pub(crate) use imp::{before, created, dir_synced, renamed, replacing, synced, wrote};
