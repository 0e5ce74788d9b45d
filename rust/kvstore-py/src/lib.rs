//! `kvstore._lib`: the Python binding of the engine. It converts arguments,
//! releases the GIL around every call into the engine, and maps errors to the
//! exception classes of `kvstore.errors`. No store logic lives here.
//!
//! One module per Python-facing concept: `store` (the `Store` class),
//! `options` (what `Store.open` reads), `reports` (the dicts methods return),
//! `progress` (callbacks), `error` (the exception mapping).

// PyO3 hands every argument over by value (owned arrays, strings, paths,
// callbacks), whether the function consumes it or not.
#![allow(clippy::needless_pass_by_value)]

use pyo3::prelude::*;
use std::path::PathBuf;

mod error;
mod options;
mod progress;
mod reports;
mod store;

use error::PyResultExt;

/// Rebuilds a store's index from its segment files (every handle closed).
#[pyfunction]
#[pyo3(signature = (path, progress=None))]
fn rebuild_index(
    py: Python<'_>,
    path: PathBuf,
    progress: Option<Py<PyAny>>,
) -> PyResult<reports::RebuildReport> {
    let p = progress::Progress::new(progress);
    let r = py.detach(|| kvstore::rebuild_index(&path, &|d, t| p.call(d, t)));
    Ok(p.finish(r.py())?.into())
}

/// Where stores look for arenas: `hot_dir`, `$KVSTORE_HOT_DIR`, hugetlbfs
/// mounts, `/dev/shm`.
#[pyfunction]
#[pyo3(signature = (hot_dir=None))]
fn arena_dirs(hot_dir: Option<PathBuf>) -> Vec<String> {
    kvstore::arena_dirs(hot_dir.as_deref())
        .iter()
        .map(|d| d.display().to_string())
        .collect()
}

/// Every arena in `dirs`; with `prune`, orphans no process maps are removed.
#[pyfunction]
#[pyo3(signature = (dirs, prune=false))]
fn arenas(py: Python<'_>, dirs: Vec<PathBuf>, prune: bool) -> Vec<reports::ArenaInfo> {
    reports::list(py.detach(|| kvstore::list_arenas(&dirs, prune)))
}

/// Removes one arena file (`kvstore-<id>.arena`); false if there was none.
#[pyfunction]
fn remove_arena_file(py: Python<'_>, path: PathBuf) -> PyResult<bool> {
    py.detach(|| kvstore::remove_arena_file(&path)).py()
}

/// The BLAKE3 hash (hex) of a checkpoint file, on `threads` threads
/// (default: the CPUs this process may use, at most 16), the GIL released.
#[pyfunction]
#[pyo3(signature = (path, threads=None))]
fn blake3_file(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<String> {
    let threads = threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get().min(16)));
    let hash = py.detach(|| kvstore::blake3_file(&path, threads)).py()?;
    Ok(hash.to_hex().to_string())
}

#[pymodule]
fn _lib(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::Store>()?;
    m.add_function(wrap_pyfunction!(rebuild_index, m)?)?;
    m.add_function(wrap_pyfunction!(arena_dirs, m)?)?;
    m.add_function(wrap_pyfunction!(arenas, m)?)?;
    m.add_function(wrap_pyfunction!(remove_arena_file, m)?)?;
    m.add_function(wrap_pyfunction!(blake3_file, m)?)?;
    m.add("FORMAT_VERSION", kvstore::FORMAT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
