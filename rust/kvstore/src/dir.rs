//! The store directory: where each file lives, segment file names, the
//! MANIFEST, and the lock files.
//!
//! ```text
//! <store>/MANIFEST         format version, fingerprint, layout, store id
//! <store>/LOCK             held while a process creates, recovers or rebuilds;
//!                          shared by every open handle (`OpenMark`)
//! <store>/COMPACT.lock     held by the one compaction or gc running
//! <store>/index/           the LMDB environment
//! <store>/segments/<16 hex digits>.kvseg
//! ```

use crate::error::{Error, IoContext, Result};
use crate::format::{self, Manifest};
use crate::fs;
use crate::layout::{Kind, Layout, Storage};
use crate::lockwait;
use crate::os::{ofd_lock, OfdLock, ParentOnly};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A MANIFEST is a few hundred bytes; anything past this is not one.
const MANIFEST_MAX: u64 = 64 << 10;

/// How long an opener waits for another process creating or recovering.
const LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// What an open handle holds for its whole life: a shared lock
/// (`F_OFD_SETLK`) on LOCK through a description of its own, which a forked
/// child does not keep (`os::ParentOnly`; where that cannot be had, an
/// ordinary description, which a child keeps). `rebuild_index` asks for it
/// exclusively: it must not run beside any handle, an idle one included,
/// whose later puts would be committed to the index it moves aside.
pub struct OpenMark {
    _own: Option<ParentOnly>,
    _plain: Option<File>,
}

/// Paths inside one store directory.
#[derive(Clone, Debug)]
pub(crate) struct StoreDir {
    root: PathBuf,
}

impl StoreDir {
    pub fn new(root: &Path) -> Self {
        StoreDir {
            root: root.to_path_buf(),
        }
    }

    pub fn manifest_path(&self) -> PathBuf {
        self.root.join("MANIFEST")
    }

    pub fn index_dir(&self) -> PathBuf {
        self.root.join("index")
    }

    pub fn segments_dir(&self) -> PathBuf {
        self.root.join("segments")
    }

    pub fn segment_path(&self, segment: u64) -> PathBuf {
        self.segments_dir().join(format!("{segment:016x}.kvseg"))
    }

    /// Whether `segments/` holds any segment file.
    pub fn has_segment_files(&self) -> bool {
        std::fs::read_dir(self.segments_dir()).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().ends_with(".kvseg"))
        })
    }

    /// Reads and checks the MANIFEST; `None` if there is none. A symlink, a
    /// FIFO or an absurd size is not a MANIFEST we wrote: `CorruptStore`.
    pub fn read_manifest(&self) -> Result<Option<Manifest>> {
        let path = self.manifest_path();
        match fs::read_small(&path, MANIFEST_MAX) {
            Ok(bytes) => Manifest::decode(&bytes)
                .map(Some)
                .map_err(|r| Error::corrupt(&path, r)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e)
                if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error())
                    || matches!(
                        e.kind(),
                        std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput
                    ) =>
            {
                Err(Error::corrupt(&path, e.to_string()))
            }
            Err(e) => Err(Error::Io {
                context: format!("reading {}", path.display()),
                source: e,
            }),
        }
    }

    /// Writes the MANIFEST of a new store (atomically) and returns it.
    pub fn create_manifest(&self, fingerprint: &str, layout: &Layout) -> Result<Manifest> {
        let mut rnd = [0u8; 16];
        getrandom::fill(&mut rnd).map_err(|e| Error::Io {
            context: "store id".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let m = Manifest {
            format_version: format::FORMAT_VERSION,
            fingerprint: fingerprint.to_string(),
            num_layers: layout.num_layers,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.latent_width().unwrap_or(layout.head_dim),
            dtype: layout.dtype.name().to_string(),
            block_size: layout.block_size,
            created_unix: crate::clock::now_ms() / 1000,
            store_id: crate::id::hex(&rnd),
            storage: (layout.storage != Storage::Exact).then(|| layout.storage.name().to_string()),
            kind: (layout.kind != Kind::KeyValue).then(|| layout.kind.name().to_string()),
        };
        self.write_manifest(&m)
    }

    /// Replaces the MANIFEST (atomically) with `m` and returns it.
    pub fn write_manifest(&self, m: &Manifest) -> Result<Manifest> {
        let path = self.manifest_path();
        fs::write_atomic(&path, &m.encode()).ctx(|| format!("writing {}", path.display()))?;
        Ok(m.clone())
    }

    /// Raises the MANIFEST's format version to this build's before the
    /// first version-2 segment is written (a build that reads only version
    /// 1 must then refuse the store, not take padded records for damage);
    /// until then a version-1 store keeps its MANIFEST bytes, whoever opens
    /// it. Under the LOCK, re-read first (another process may have done it),
    /// and written atomically: a crash leaves the old MANIFEST or the new
    /// one, and either opens with the segments there are. Returns the
    /// MANIFEST as it now is.
    pub fn upgrade_manifest(&self) -> Result<Manifest> {
        let _lock = self.lock()?;
        let path = self.manifest_path();
        let m = self
            .read_manifest()?
            .ok_or_else(|| Error::corrupt(&path, "missing (removed while the store was open)"))?;
        if m.format_version >= format::FORMAT_VERSION {
            return Ok(m);
        }
        self.write_manifest(&Manifest {
            format_version: format::FORMAT_VERSION,
            ..m
        })
    }

    /// Takes the store's LOCK, waiting while another process creates,
    /// recovers or rebuilds the store. Released when the file is dropped.
    pub fn lock(&self) -> Result<File> {
        let lock = fs::open_or_create(&self.root.join("LOCK"))
            .ctx(|| format!("lock file in {}", self.root.display()))?;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        let taken = lockwait::wait_for(deadline, Duration::from_millis(5), || {
            lockwait::try_flock(&lock)
        })
        .ctx(|| "locking the store".to_string())?;
        if !taken {
            return Err(Error::StoreLocked(format!(
                "the store's LOCK was not free within {}s; held now{}",
                LOCK_TIMEOUT.as_secs(),
                holder(&lock)
            )));
        }
        // Who holds it, for the error of an opener that gives up waiting.
        // Advisory: not the store's data, so written past the fault hooks
        // (`fs`), and a failed write changes nothing.
        let pid = std::process::id().to_string();
        let _ = lock
            .set_len(0)
            .and_then(|()| lock.write_all_at(pid.as_bytes(), 0));
        Ok(lock)
    }

    /// Marks the store open for as long as the mark lives (see
    /// [`OpenMark`]); `StoreLocked` while its index is being rebuilt.
    pub fn mark_open(&self) -> Result<OpenMark> {
        let path = self.root.join("LOCK");
        let file =
            fs::open_or_create(&path).ctx(|| format!("lock file in {}", self.root.display()))?;
        let own = ParentOnly::open(&file);
        let desc = own.as_ref().and_then(ParentOnly::get).unwrap_or(&file);
        if !ofd_lock(desc, OfdLock::SharedTry).ctx(|| format!("locking {}", path.display()))? {
            return Err(Error::StoreLocked(format!(
                "the index of {} is being rebuilt; open it when that is done",
                self.root.display()
            )));
        }
        let plain = own.is_none().then_some(file);
        Ok(OpenMark {
            _own: own,
            _plain: plain,
        })
    }

    /// Whether no handle marks the store open (see [`OpenMark`]), in this
    /// process or another; `lock` is the LOCK file this process holds. If so,
    /// none can until `lock` is dropped.
    pub fn none_open(&self, lock: &File) -> Result<bool> {
        ofd_lock(lock, OfdLock::ExclusiveTry)
            .ctx(|| format!("locking the LOCK of {}", self.root.display()))
    }

    /// The store-wide compaction lock (one compaction or gc at a time), or
    /// `StoreLocked` at once if another holds it.
    pub fn compaction_lock(&self) -> Result<File> {
        let lock = fs::open_or_create(&self.root.join("COMPACT.lock"))
            .ctx(|| "compaction lock".to_string())?;
        lock.try_lock().map_err(|_| {
            Error::StoreLocked("another compaction or gc is running on this store".into())
        })?;
        Ok(lock)
    }
}

/// ` (pid N: <what its threads are doing>)`: the holder of the LOCK file
/// `lock`, as it wrote itself there (`lockwait::describe`); empty where no
/// holder is known.
fn holder(lock: &File) -> String {
    let mut buf = [0u8; 16];
    let n = rustix::io::pread(lock, &mut buf, 0).unwrap_or(0);
    let Some(pid) = std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
    else {
        return String::new();
    };
    lockwait::describe(pid)
}

/// The number of a segment file from its name (`<16 hex digits>.kvseg`).
pub(crate) fn segment_number(name: &OsStr) -> Option<u64> {
    name.to_str()?
        .strip_suffix(".kvseg")
        .and_then(|s| u64::from_str_radix(s, 16).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_names_its_holder() {
        let tmp = tempfile::tempdir().unwrap();
        let sd = StoreDir::new(tmp.path());
        let path = tmp.path().join("LOCK");
        let other = fs::open_or_create(&path).unwrap();
        assert_eq!(holder(&other), "", "nobody has held it yet");
        let held = sd.lock().unwrap();
        assert_eq!(holder(&other), " (this process, through another handle)");
        drop(held);
        // Another process, as its pid reads there: what its threads are doing.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        std::fs::write(&path, child.id().to_string()).unwrap();
        let mut named = holder(&other);
        for _ in 0..100 {
            if named.contains('S') {
                break; // asleep (it may still be starting)
            }
            std::thread::sleep(Duration::from_millis(10));
            named = holder(&other);
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let prefix = format!(" (pid {}: threads S", child.id());
        assert!(named.starts_with(&prefix), "{named}");
        assert_eq!(
            holder(&other),
            format!(
                " (by a process sharing the descriptor of pid {}, which took it and exited)",
                child.id()
            )
        );
        // A later holder overwrites a longer pid: what is left is only its own.
        std::fs::write(&path, "4294967295").unwrap();
        let _again = sd.lock().unwrap();
        assert_eq!(holder(&other), " (this process, through another handle)");
    }
}
