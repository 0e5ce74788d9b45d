//! `kvstore._lib`: the Python binding of the engine. It converts arguments,
//! releases the GIL around every call into the engine, and maps errors to the
//! exception classes of `kvstore.errors`. No store logic lives here.

use kvstore::{DType, Durability, Layout, Options, Store as Engine};
use numpy::{PyArray1, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod error;
use error::{to_pyerr, PyResultExt};

/// A handle on one store; all methods may be called from many threads.
#[pyclass(frozen, module = "kvstore._lib", name = "Store")]
struct Store {
    engine: Engine,
    path: PathBuf,
}

fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        to_pyerr(kvstore::Error::InvalidInput(format!(
            "{what}: expected a contiguous array"
        )))
    })
}

/// A Python progress callback, called at most ten times a second (and at the
/// end). The engine cannot stop half way through a compaction or a rebuild, so
/// an exception the callback raises (Ctrl-C included) silences it and is
/// raised once the work is done (`finish`).
struct Progress {
    cb: Option<Py<PyAny>>,
    last: std::sync::Mutex<Option<Instant>>,
    error: std::sync::Mutex<Option<PyErr>>,
}

impl Progress {
    fn new(cb: Option<Py<PyAny>>) -> Self {
        Progress {
            cb,
            last: std::sync::Mutex::new(None),
            error: std::sync::Mutex::new(None),
        }
    }

    fn call(&self, done: u64, total: u64) {
        let Some(cb) = &self.cb else { return };
        let mut last = self.last.lock().expect("progress lock");
        if done < total && last.is_some_and(|t| t.elapsed() < Duration::from_millis(100)) {
            return;
        }
        *last = Some(Instant::now());
        let mut error = self.error.lock().expect("progress error lock");
        if error.is_none() {
            *error = Python::attach(|py| cb.call1(py, (done, total)).err());
        }
    }

    /// The operation's result, unless the callback raised: then its exception.
    fn finish<T>(&self, result: PyResult<T>) -> PyResult<T> {
        match self.error.lock().expect("progress error lock").take() {
            Some(e) => Err(e),
            None => result,
        }
    }
}

#[pymethods]
impl Store {
    /// Opens or creates a store. `layout` is `(num_layers, num_kv_heads,
    /// head_dim, dtype, block_size)`; with `layout` and `fingerprint` both
    /// `None` an existing store opens as its MANIFEST says.
    #[staticmethod]
    #[pyo3(signature = (path, fingerprint, layout, salt, durability, disk_bytes, compression_level, segment_bytes, batch_window_ms, create, hot_bytes, hot_dir, index_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        fingerprint: Option<String>,
        layout: Option<(u32, u32, u32, String, u32)>,
        salt: Option<Vec<u8>>,
        durability: &str,
        disk_bytes: Option<u64>,
        compression_level: i32,
        segment_bytes: u64,
        batch_window_ms: u64,
        create: bool,
        hot_bytes: Option<u64>,
        hot_dir: Option<PathBuf>,
        index_bytes: Option<u64>,
    ) -> PyResult<Store> {
        let layout = match layout {
            Some((l, h, d, dtype, b)) => {
                Some(Layout::new(l, h, d, DType::parse(&dtype).py()?, b).py()?)
            }
            None => None,
        };
        let opts = Options {
            fingerprint,
            layout,
            salt,
            durability: Durability::parse(durability).py()?,
            disk_bytes,
            compression_level,
            segment_bytes,
            batch_window: Duration::from_millis(batch_window_ms),
            create,
            hot_bytes,
            hot_dir,
            index_bytes: index_bytes.unwrap_or(kvstore::DEFAULT_INDEX_BYTES),
            ..Options::default()
        };
        let p = path.clone();
        let engine = py.detach(move || Engine::open(&p, opts)).py()?;
        Ok(Store { engine, path })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.engine.is_closed()
    }

    /// `(num_layers, num_kv_heads, head_dim, dtype, block_size)`.
    fn layout(&self) -> PyResult<(u32, u32, u32, &'static str, u32)> {
        let l = self.engine.layout().py()?;
        Ok((
            l.num_layers,
            l.num_kv_heads,
            l.head_dim,
            l.dtype.name(),
            l.block_size,
        ))
    }

    fn manifest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.engine.manifest().py()?;
        let d = PyDict::new(py);
        d.set_item("format_version", m.format_version)?;
        d.set_item("fingerprint", m.fingerprint)?;
        d.set_item("num_layers", m.num_layers)?;
        d.set_item("num_kv_heads", m.num_kv_heads)?;
        d.set_item("head_dim", m.head_dim)?;
        d.set_item("dtype", m.dtype)?;
        d.set_item("block_size", m.block_size)?;
        d.set_item("created_unix", m.created_unix)?;
        d.set_item("store_id", m.store_id)?;
        Ok(d)
    }

    fn durability(&self) -> PyResult<&'static str> {
        Ok(self.engine.durability().py()?.name())
    }

    fn put(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        kv: PyReadonlyArray1<'_, u8>,
        kv_tokens: usize,
        extra: &[u8],
    ) -> PyResult<usize> {
        let (t, k) = (slice(&tokens, "tokens")?, slice(&kv, "kv")?);
        py.detach(|| self.engine.put(t, k, kv_tokens, extra)).py()
    }

    /// Longest stored prefix in tokens; `count` adds it to the hit/miss figures.
    fn lookup(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        count: bool,
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        py.detach(|| {
            if count {
                self.engine.lookup(t, extra)
            } else {
                self.engine.stored_prefix(t, extra)
            }
        })
        .py()
    }

    fn get_into(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        mut out: PyReadwriteArray1<'_, u8>,
        out_tokens: usize,
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        let o = out.as_slice_mut().map_err(|_| {
            to_pyerr(kvstore::Error::InvalidInput(
                "out: expected a contiguous array".into(),
            ))
        })?;
        py.detach(|| self.engine.get_into(t, extra, o, out_tokens))
            .py()
    }

    #[pyo3(signature = (tokens, extra, priority, ttl_s=None))]
    fn pin(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        priority: u64,
        ttl_s: Option<f64>,
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        let ttl = ttl_s.map(|s| seconds("ttl", s, true)).transpose()?;
        py.detach(|| self.engine.pin(t, extra, priority, ttl)).py()
    }

    fn unpin(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        py.detach(|| self.engine.unpin(t, extra)).py()
    }

    fn hot_blocks(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
    ) -> PyResult<Vec<Option<(u64, u64, u64)>>> {
        let t = slice(&tokens, "tokens")?;
        py.detach(|| self.engine.hot_blocks(t, extra)).py()
    }

    fn hot_unchanged(&self, slots: Vec<(u64, u64)>) -> PyResult<Vec<bool>> {
        self.engine.hot_unchanged(&slots).py()
    }

    /// `(path, device, inode, length)` of the hot tier's file, or None.
    fn arena_file(&self) -> PyResult<Option<(PathBuf, u64, u64, u64)>> {
        self.engine.arena_file().py()
    }

    /// `(address, length)` of the hot-tier mapping, or None without one.
    fn arena_region(&self) -> PyResult<Option<(usize, usize)>> {
        self.engine.arena_region().py()
    }

    fn save_session(
        &self,
        py: Python<'_>,
        name: &str,
        tokens: PyReadonlyArray1<'_, u32>,
        kv: PyReadonlyArray1<'_, u8>,
        kv_tokens: usize,
    ) -> PyResult<usize> {
        let (t, k) = (slice(&tokens, "tokens")?, slice(&kv, "kv")?);
        py.detach(|| self.engine.save_session(name, t, k, kv_tokens))
            .py()
    }

    fn session_tokens<'py>(
        &self,
        py: Python<'py>,
        name: &str,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let v = py.detach(|| self.engine.session_tokens(name)).py()?;
        Ok(PyArray1::from_vec(py, v))
    }

    fn sessions(&self, py: Python<'_>) -> PyResult<Vec<(String, usize)>> {
        py.detach(|| self.engine.sessions()).py()
    }

    fn delete_session(&self, py: Python<'_>, name: &str) -> PyResult<bool> {
        py.detach(|| self.engine.delete_session(name)).py()
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.engine.flush()).py()
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.engine.close()).py()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.engine.stats()).py()?;
        let d = PyDict::new(py);
        d.set_item("blocks", s.blocks)?;
        d.set_item("sessions", s.sessions)?;
        d.set_item("segments", s.segments)?;
        d.set_item("disk_bytes", s.disk_bytes)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("dead_bytes", s.dead_bytes)?;
        d.set_item("raw_live_bytes", s.raw_live_bytes)?;
        d.set_item("damaged_blocks", s.damaged_blocks)?;
        d.set_item("pending_blocks", s.pending_blocks)?;
        d.set_item("hit_blocks", s.hit_blocks)?;
        d.set_item("miss_blocks", s.miss_blocks)?;
        d.set_item("total_hit_blocks", s.total_hit_blocks)?;
        d.set_item("total_miss_blocks", s.total_miss_blocks)?;
        d.set_item("blocks_written", s.blocks_written)?;
        d.set_item("blocks_deduped", s.blocks_deduped)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("block_bytes", s.block_bytes)?;
        d.set_item("hot_hit_blocks", s.hot_hit_blocks)?;
        d.set_item("disk_hit_blocks", s.disk_hit_blocks)?;
        match s.arena {
            Some(a) => {
                d.set_item("hot_path", a.path)?;
                d.set_item("hot_bytes", a.bytes)?;
                d.set_item("hot_slots", a.slots)?;
                d.set_item("hot_slots_used", a.slots_used)?;
                d.set_item("hot_slots_pinned", a.slots_pinned)?;
                d.set_item("hot_blocks", a.slots_used)?;
                d.set_item("hot_evictions", a.evictions)?;
                d.set_item("hot_inserts", a.inserts)?;
                d.set_item("hot_slots_torn", a.slots_torn)?;
                d.set_item("page_kind", a.page_kind)?;
            }
            None => {
                d.set_item("hot_path", py.None())?;
                d.set_item("hot_bytes", 0)?;
                d.set_item("hot_slots", 0)?;
                d.set_item("hot_slots_used", 0)?;
                d.set_item("hot_slots_pinned", 0)?;
                d.set_item("hot_blocks", 0)?;
                d.set_item("hot_evictions", 0)?;
                d.set_item("hot_inserts", 0)?;
                d.set_item("hot_slots_torn", 0)?;
                d.set_item("page_kind", "none")?;
            }
        }
        Ok(d)
    }

    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let segs = py.detach(|| self.engine.segments()).py()?;
        let out = PyList::empty(py);
        for s in segs {
            let d = PyDict::new(py);
            d.set_item("segment", s.segment)?;
            d.set_item("sealed", s.sealed)?;
            d.set_item("file_bytes", s.file_bytes)?;
            d.set_item("committed_bytes", s.committed_bytes)?;
            d.set_item("live_bytes", s.live_bytes)?;
            d.set_item("live_records", s.live_records)?;
            d.set_item("dead_bytes", s.dead_bytes)?;
            out.append(d)?;
        }
        Ok(out)
    }

    #[pyo3(signature = (progress=None, repair=false))]
    fn verify<'py>(
        &self,
        py: Python<'py>,
        progress: Option<Py<PyAny>>,
        repair: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let p = Progress::new(progress);
        let r = p.finish(
            py.detach(|| {
                if repair {
                    self.engine.repair(&|d, t| p.call(d, t))
                } else {
                    self.engine.verify(&|d, t| p.call(d, t))
                }
            })
            .py(),
        )?;
        let d = PyDict::new(py);
        d.set_item("records_checked", r.records_checked)?;
        d.set_item("bytes_checked", r.bytes_checked)?;
        let damaged = PyList::empty(py);
        for x in r.damaged {
            let e = PyDict::new(py);
            e.set_item("block_id", x.block_id)?;
            e.set_item("segment", x.segment)?;
            e.set_item("offset", x.offset)?;
            e.set_item("reason", x.reason)?;
            damaged.append(e)?;
        }
        d.set_item("damaged", damaged)?;
        d.set_item("problems", r.problems)?;
        Ok(d)
    }

    #[pyo3(signature = (progress=None))]
    fn compact<'py>(
        &self,
        py: Python<'py>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let p = Progress::new(progress);
        let r = p.finish(py.detach(|| self.engine.compact(&|d, t| p.call(d, t))).py())?;
        compact_dict(py, &r)
    }

    #[pyo3(signature = (max_bytes=None, older_than_s=None, progress=None))]
    fn gc<'py>(
        &self,
        py: Python<'py>,
        max_bytes: Option<u64>,
        older_than_s: Option<f64>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let older = older_than_s
            .map(|s| seconds("older_than", s, false))
            .transpose()?;
        let p = Progress::new(progress);
        let r = p.finish(
            py.detach(|| self.engine.gc(max_bytes, older, &|d, t| p.call(d, t)))
                .py(),
        )?;
        let d = PyDict::new(py);
        d.set_item("blocks_evicted", r.blocks_evicted)?;
        d.set_item("bytes_evicted", r.bytes_evicted)?;
        d.set_item("compact", compact_dict(py, &r.compact)?)?;
        Ok(d)
    }
}

fn compact_dict<'py>(py: Python<'py>, r: &kvstore::CompactReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("segments_rewritten", r.segments_rewritten)?;
    d.set_item("records_moved", r.records_moved)?;
    d.set_item("records_dropped", r.records_dropped)?;
    d.set_item("bytes_before", r.bytes_before)?;
    d.set_item("bytes_after", r.bytes_after)?;
    Ok(d)
}

/// Seconds from Python as a `Duration`: `InvalidInput` when negative (or zero,
/// if it must be `positive`), not finite, or too large to represent.
fn seconds(what: &str, s: f64, positive: bool) -> PyResult<Duration> {
    let sign_ok = if positive { s > 0.0 } else { s >= 0.0 };
    sign_ok
        .then(|| Duration::try_from_secs_f64(s).ok())
        .flatten()
        .ok_or_else(|| {
            to_pyerr(kvstore::Error::InvalidInput(format!(
                "{what}: expected a {} number of seconds, got {s}",
                if positive { "positive" } else { "non-negative" }
            )))
        })
}

/// Rebuilds a store's index from its segment files (every handle closed).
#[pyfunction]
#[pyo3(signature = (path, progress=None))]
fn rebuild_index<'py>(
    py: Python<'py>,
    path: PathBuf,
    progress: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let p = Progress::new(progress);
    let r = p.finish(
        py.detach(|| kvstore::rebuild_index(&path, &|d, t| p.call(d, t)))
            .py(),
    )?;
    let d = PyDict::new(py);
    d.set_item("segments", r.segments)?;
    d.set_item("records", r.records)?;
    d.set_item("blocks", r.blocks)?;
    let damaged = PyList::empty(py);
    for (segment, x) in r.damaged {
        let e = PyDict::new(py);
        e.set_item("segment", segment)?;
        e.set_item("start", x.start)?;
        e.set_item("end", x.end)?;
        e.set_item("block_id", x.block_id.as_ref().map(kvstore::block_id_hex))?;
        e.set_item("reason", x.reason)?;
        damaged.append(e)?;
    }
    d.set_item("damaged", damaged)?;
    d.set_item("skipped", r.skipped)?;
    d.set_item("old_index", r.old_index)?;
    Ok(d)
}

#[pymodule]
fn _lib(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_function(wrap_pyfunction!(rebuild_index, m)?)?;
    m.add("FORMAT_VERSION", kvstore::FORMAT_VERSION)?;
    Ok(())
}
