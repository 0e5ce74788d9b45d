//! Every file-system step of the engine: positional vectored I/O, opening
//! files safely (no symlinks, no FIFOs, private modes), and the steps that
//! make writes durable (fdatasync, fsync, truncation, rename, unlink,
//! directory sync). Each durable step passes through a [`crate::fault`] hook,
//! so crash tests can fail, kill or power off the process at it.

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::{self, IoSlice, IoSliceMut, Read};

use crate::fault;
use crate::os::Residency;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

/// Linux accepts at most this many iovecs per call.
const IOV_MAX: usize = 1024;

/// Writes every buffer, in order, starting at `offset`.
pub fn write_all_at(file: &File, mut bufs: &mut [IoSlice<'_>], mut offset: u64) -> io::Result<()> {
    fault::before(fault::Op::Write, Some(file))?;
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        let written = rustix::io::pwritev(file, &bufs[..n], offset)?;
        if written == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "pwritev wrote nothing",
            ));
        }
        offset += written as u64;
        IoSlice::advance_slices(&mut bufs, written);
    }
    fault::wrote(file);
    Ok(())
}

/// Fills every buffer, in order, from `offset`; end of file is an error.
pub fn read_exact_at(
    file: &File,
    mut bufs: &mut [IoSliceMut<'_>],
    mut offset: u64,
) -> io::Result<()> {
    while !bufs.is_empty() {
        let n = bufs.len().min(IOV_MAX);
        let read = rustix::io::preadv(file, &mut bufs[..n], offset)?;
        if read == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "record extends past end of file",
            ));
        }
        offset += read as u64;
        IoSliceMut::advance_slices(&mut bufs, read);
    }
    Ok(())
}

/// Creates a new file, 0600, refusing to follow a symlink or reuse a name.
pub fn create_new(path: &Path) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)?;
    fault::created(&f);
    Ok(f)
}

/// Opens an existing regular file, refusing a symlink. Non-blocking open, so
/// a FIFO or device planted in the store cannot hang us; it is refused.
pub fn open_existing(path: &Path, write: bool) -> io::Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

/// Opens an existing regular file for reads with `O_DIRECT` (as
/// [`open_existing`] otherwise); `None` where the file system refuses the
/// flag (tmpfs: `EINVAL`).
pub fn open_direct(path: &Path) -> io::Result<Option<File>> {
    let flags =
        rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::DIRECT;
    match OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits() as i32)
        .open(path)
    {
        Ok(f) if f.metadata()?.is_file() => Ok(Some(f)),
        Ok(_) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// (memory, file offset) alignment that `O_DIRECT` reads of `file` need
/// (`statx` `STATX_DIOALIGN`, Linux 6.1); `None` when the file system says
/// it has no direct I/O. Before 6.1 the kernel does not say: a page for
/// both, which every device accepts.
pub fn direct_alignment(file: &File) -> Option<(usize, u64)> {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    let page = crate::format::PAYLOAD_ALIGN;
    match statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
        Ok(st) if StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::DIOALIGN) => {
            let (mem, off) = (
                st.stx_dio_mem_align as usize,
                u64::from(st.stx_dio_offset_align),
            );
            (mem > 0 && off > 0).then_some((mem, off))
        }
        _ => Some((page as usize, page)),
    }
}

/// Whether the page cache holds every page of `file`'s bytes
/// `offset..offset + len`, asked `how` (`os::all_cached`; from
/// [`residency`]). Where it cannot be told, yes: the buffered read, as
/// before direct reads.
pub fn cached(file: &File, offset: u64, len: u64, how: Residency) -> bool {
    crate::os::all_cached(file, offset, len, how)
}

/// How to ask which of `file`'s pages the page cache holds: by `mincore`
/// on overlayfs, whose `cachestat` counts the overlay's own page cache (0
/// pages for a file read through it), else `cachestat` first.
pub fn residency(file: &File) -> Residency {
    /// `OVERLAYFS_SUPER_MAGIC` of the kernel's `magic.h`.
    const OVERLAYFS: u64 = 0x794c_7630;
    match rustix::fs::fstatfs(file) {
        Ok(st) if st.f_type as u64 == OVERLAYFS => Residency::Mincore,
        _ => Residency::Cachestat,
    }
}

/// Reads a small file whole (a MANIFEST), refusing a symlink or anything
/// larger than `limit` bytes.
pub fn read_small(path: &Path, limit: u64) -> io::Result<Vec<u8>> {
    let f = open_existing(path, false)?;
    let len = f.metadata()?.len();
    if len > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is {len} bytes, more than {limit}", path.display()),
        ));
    }
    let mut buf = Vec::with_capacity(len as usize);
    io::Read::take(&f, limit).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Refuses a directory other users can write to: they could plant or swap
/// segment files and index entries under the store.
pub fn check_private_dir(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::symlink_metadata(path)?.permissions().mode();
    if mode & 0o002 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is writable by every user (mode {:o}); refusing to trust it (chmod o-w)",
                path.display(),
                mode & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Opens a lock file, creating it 0600 if missing; refuses a symlink.
pub fn open_or_create(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
}

/// Creates a directory 0700 if missing; refuses a symlink in its place.
pub fn ensure_dir(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is a symlink; refusing to follow it", path.display()),
        )),
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} exists and is not a directory", path.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            match DirBuilder::new().mode(0o700).create(path) {
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                other => other,
            }
        }
        Err(e) => Err(e),
    }
}

/// Makes a directory's entries (a created, renamed or removed file) durable.
pub fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = File::open(path)?;
    fault::before(fault::Op::Sync, None)?;
    dir.sync_all()?;
    fault::dir_synced(path);
    Ok(())
}

/// Writes `bytes` to `path` atomically: temp file, fsync, rename, fsync dir.
/// Never rewrites a file in place (another process may have it mapped or open).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let f = create_new(&tmp)?;
    let res = (|| {
        write_all_at(&f, &mut [IoSlice::new(bytes)], 0)?;
        sync_all(&f)?;
        rename(&tmp, path)?;
        sync_dir(dir)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// A hooked `fdatasync`.
pub fn sync_data(file: &File) -> io::Result<()> {
    fault::before(fault::Op::Sync, Some(file))?;
    file.sync_data()?;
    fault::synced(file);
    Ok(())
}

/// A hooked `fsync` (data and metadata: used after a truncation).
pub fn sync_all(file: &File) -> io::Result<()> {
    fault::before(fault::Op::Sync, Some(file))?;
    file.sync_all()?;
    fault::synced(file);
    Ok(())
}

/// A hooked truncation (counts as a write).
pub fn set_len(file: &File, len: u64) -> io::Result<()> {
    fault::before(fault::Op::Write, Some(file))?;
    file.set_len(len)?;
    fault::wrote(file);
    Ok(())
}

/// A hooked unlink.
pub fn remove_file(path: &Path) -> io::Result<()> {
    fault::before(fault::Op::Unlink, None)?;
    std::fs::remove_file(path)
}

/// A hooked rename.
pub fn rename(from: &Path, to: &Path) -> io::Result<()> {
    fault::before(fault::Op::Rename, None)?;
    fault::replacing(to);
    std::fs::rename(from, to)?;
    fault::renamed(from, to);
    Ok(())
}
