//! Huge pages: what kind of pages back a mapping (as the kernel reports it,
//! not as asked), where hugetlbfs is mounted, and where an arena goes when
//! the user names no directory.

use std::path::PathBuf;

/// What kind of pages back the arena, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageKind {
    /// A hugetlbfs mapping (explicit huge pages).
    HugeTlb,
    /// Transparent huge pages (`MADV_HUGEPAGE`).
    TransparentHuge,
    /// Normal 4 KiB pages.
    Normal,
}

impl PageKind {
    /// How the header stores it.
    pub(crate) fn code(&self) -> u64 {
        match self {
            PageKind::HugeTlb => 1,
            PageKind::TransparentHuge => 2,
            PageKind::Normal => 3,
        }
    }

    /// Back from the header; `None` for anything else.
    pub(crate) fn from_code(code: u64) -> Option<PageKind> {
        match code {
            1 => Some(PageKind::HugeTlb),
            2 => Some(PageKind::TransparentHuge),
            3 => Some(PageKind::Normal),
            _ => None,
        }
    }

    /// The name `stats()` and `kvstore info` show.
    pub fn name(&self) -> &'static str {
        match self {
            PageKind::HugeTlb => "hugetlb",
            PageKind::TransparentHuge => "thp",
            PageKind::Normal => "normal",
        }
    }
}

/// The hugetlbfs mounts, from `/proc/mounts`.
pub(crate) fn hugetlbfs_mounts() -> Vec<PathBuf> {
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else {
        return Vec::new();
    };
    mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_, dir, fs) = (f.next(), f.next(), f.next());
            (fs == Some("hugetlbfs")).then(|| dir.map(PathBuf::from))?
        })
        .collect()
}

/// Where arenas live when the user names no directory: a hugetlbfs mount
/// with enough free huge pages, else `/dev/shm`.
pub(crate) fn default_dir(bytes: u64) -> PathBuf {
    for dir in hugetlbfs_mounts() {
        let free = rustix::fs::statvfs(&dir).map_or(0, |s| s.f_bavail * s.f_bsize);
        if free >= bytes {
            return dir;
        }
    }
    PathBuf::from("/dev/shm")
}

/// Reads the page kind of the mapping at `addr` from `/proc/self/smaps`: what
/// the kernel gave, not what was asked for.
pub(crate) fn page_kind_of(addr: usize) -> PageKind {
    let Ok(smaps) = std::fs::read_to_string("/proc/self/smaps") else {
        return PageKind::Normal;
    };
    let prefix = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&prefix));
    lines.next();
    let mut kind = PageKind::Normal;
    for line in lines {
        if line
            .split_whitespace()
            .next()
            .is_some_and(|w| w.contains('-') && !w.ends_with(':'))
        {
            break; // next mapping
        }
        let mut f = line.split_whitespace();
        let (key, value) = (
            f.next().unwrap_or(""),
            f.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0),
        );
        match key {
            "KernelPageSize:" if value >= 2048 => return PageKind::HugeTlb,
            "ShmemPmdMapped:" | "FilePmdMapped:" if value > 0 => kind = PageKind::TransparentHuge,
            _ => {}
        }
    }
    kind
}
