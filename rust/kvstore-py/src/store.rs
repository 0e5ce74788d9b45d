//! The `Store` pyclass: a handle on one store. Each method reads its
//! arguments, then calls the engine with the GIL released.

use crate::error::{invalid, PyResultExt};
use crate::options::OpenOptions;
use crate::progress::Progress;
use crate::reports::{
    CompactReport, GcReport, Manifest, NodeReport, PushReport, SegmentReport, Stats, VerifyReport,
};
use kvstore::Store as Engine;
use numpy::{PyArray1, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;
use std::time::Duration;

/// A handle on one store; all methods may be called from many threads.
#[pyclass(frozen, module = "kvstore._lib", name = "Store")]
pub struct Store {
    engine: Engine,
    path: PathBuf,
}

/// The elements of a 1-D array, which must be contiguous.
fn slice<'a, T: numpy::Element>(a: &'a PyReadonlyArray1<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| invalid(format!("{what}: expected a contiguous array")))
}

/// Seconds from Python as a `Duration`: `InvalidInput` when negative (or zero,
/// if it must be `positive`), not finite, or too large to represent.
fn seconds(what: &str, s: f64, positive: bool) -> PyResult<Duration> {
    let sign_ok = if positive { s > 0.0 } else { s >= 0.0 };
    sign_ok
        .then(|| Duration::try_from_secs_f64(s).ok())
        .flatten()
        .ok_or_else(|| {
            invalid(format!(
                "{what}: expected a {} number of seconds, got {s}",
                if positive { "positive" } else { "non-negative" }
            ))
        })
}

/// The engine's paged geometry from `get_paged`'s arguments.
fn paged_layout(block_stride: usize, parts: [(usize, [usize; 3]); 2]) -> kvstore::PagedLayout {
    let part = |(offset, strides): (usize, [usize; 3])| kvstore::PagedPart { offset, strides };
    kvstore::PagedLayout {
        block_stride,
        parts: parts.map(part),
    }
}

/// `Store.layout()`: the fields of a `kvstore.Layout`, in its order.
type LayoutTuple = (u32, u32, u32, &'static str, u32, &'static str, &'static str);

#[pymethods]
impl Store {
    /// Opens or creates the store at `path` (see `OpenOptions`).
    #[staticmethod]
    fn open(py: Python<'_>, path: PathBuf, options: OpenOptions) -> PyResult<Store> {
        let opts = options.to_engine()?;
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
    /// `(L, H, D, dtype, B, storage, kind)`; a latent layout's `D` is its width.
    fn layout(&self) -> PyResult<LayoutTuple> {
        let l = self.engine.layout().py()?;
        Ok((
            l.num_layers,
            l.num_kv_heads,
            l.latent_width().unwrap_or(l.head_dim),
            l.dtype.name(),
            l.block_size,
            l.storage.name(),
            l.kind.name(),
        ))
    }

    fn manifest(&self) -> PyResult<Manifest> {
        Ok(self.engine.manifest().py()?.into())
    }

    fn durability(&self) -> PyResult<&'static str> {
        Ok(self.engine.durability().py()?.name())
    }

    /// Stores the full blocks of `tokens` from token `start` on; `kv` (bytes
    /// of `[L, 2, kv_tokens, H, D]`) holds `tokens[start..]`.
    #[pyo3(signature = (tokens, kv, kv_tokens, extra, start=0))]
    fn put(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        kv: PyReadonlyArray1<'_, u8>,
        kv_tokens: usize,
        extra: &[u8],
        start: usize,
    ) -> PyResult<usize> {
        let (t, k) = (slice(&tokens, "tokens")?, slice(&kv, "kv")?);
        py.detach(|| self.engine.put_from(t, start, k, kv_tokens, extra))
            .py()
    }

    /// The engine's ids of the full blocks of `tokens` (32 bytes each), keyed
    /// by this handle's model, layout and salt, and by `extra`.
    fn block_ids<'py>(
        &self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let t = slice(&tokens, "tokens")?;
        let ids = py.detach(|| self.engine.block_ids(t, extra)).py()?;
        Ok(ids.iter().map(|id| PyBytes::new(py, id)).collect())
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

    /// Fills `out` (bytes of `[L, 2, out_tokens, H, D]`) with the KV of
    /// `tokens[start..m]`, `m` the longest stored prefix; returns `m`.
    #[pyo3(signature = (tokens, extra, out, out_tokens, start=0))]
    fn get_into(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        mut out: PyReadwriteArray1<'_, u8>,
        out_tokens: usize,
        start: usize,
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        let o = out
            .as_slice_mut()
            .map_err(|_| invalid("out: expected a contiguous array"))?;
        py.detach(|| self.engine.get_from(t, start, extra, o, out_tokens))
            .py()
    }

    /// `get_into` straight into a paged cache: `layers` (each a layer's
    /// whole cache memory as bytes) receive block `start / B + k` of `tokens`
    /// in cache block `blocks[k]`, placed by `block_stride` and `parts` (K
    /// and V: element offset in a block, token/head/dim element strides).
    #[allow(clippy::too_many_arguments)]
    fn get_paged(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        start: usize,
        mut layers: Vec<PyReadwriteArray1<'_, u8>>,
        blocks: Vec<usize>,
        block_stride: usize,
        parts: [(usize, [usize; 3]); 2],
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        let mut spans = layers
            .iter_mut()
            .map(|a| {
                a.as_slice_mut()
                    .map_err(|_| invalid("layers: expected contiguous byte arrays"))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let paged = paged_layout(block_stride, parts);
        py.detach(|| {
            self.engine
                .get_paged(t, start, extra, &paged, &mut spans, &blocks)
        })
        .py()
    }

    /// `put` straight out of a paged cache (see `get_paged`): the full blocks
    /// of `tokens` from `start` on are cache blocks `blocks`.
    #[allow(clippy::too_many_arguments)]
    fn put_paged(
        &self,
        py: Python<'_>,
        tokens: PyReadonlyArray1<'_, u32>,
        extra: &[u8],
        start: usize,
        layers: Vec<PyReadonlyArray1<'_, u8>>,
        blocks: Vec<usize>,
        block_stride: usize,
        parts: [(usize, [usize; 3]); 2],
    ) -> PyResult<usize> {
        let t = slice(&tokens, "tokens")?;
        let spans = layers
            .iter()
            .map(|a| slice(a, "layers"))
            .collect::<PyResult<Vec<_>>>()?;
        let paged = paged_layout(block_stride, parts);
        py.detach(|| {
            self.engine
                .put_paged(t, start, extra, &paged, &spans, &blocks)
        })
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

    /// Adds to clients' named counters, shown by `stats()["counters"]`.
    fn add_counters(&self, py: Python<'_>, counts: Vec<(String, u64)>) -> PyResult<()> {
        let c: Vec<(&str, u64)> = counts.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        // It may commit the counters (an index transaction): no GIL held meanwhile.
        py.detach(|| self.engine.add_counters(&c)).py()
    }

    fn stats(&self, py: Python<'_>) -> PyResult<Stats> {
        Ok(py.detach(|| self.engine.stats()).py()?.into())
    }

    /// Every node of the remote tier: round trip and `INFO` figures, or the error.
    fn remote_nodes(&self, py: Python<'_>) -> PyResult<Vec<NodeReport>> {
        let rows = py.detach(|| self.engine.remote_nodes()).py()?;
        Ok(rows.into_iter().map(NodeReport::from).collect())
    }

    /// Uploads the blocks the remote tier lacks (`kvstore remote push`).
    #[pyo3(signature = (progress=None))]
    fn remote_push(&self, py: Python<'_>, progress: Option<Py<PyAny>>) -> PyResult<PushReport> {
        let p = Progress::new(progress);
        let r = py.detach(|| self.engine.remote_push(&|d, t| p.call(d, t)));
        Ok(p.finish(r.py())?.into())
    }

    fn segments(&self, py: Python<'_>) -> PyResult<Vec<SegmentReport>> {
        let segments = py.detach(|| self.engine.segments()).py()?;
        Ok(segments.into_iter().map(SegmentReport::from).collect())
    }

    #[pyo3(signature = (progress=None, repair=false))]
    fn verify(
        &self,
        py: Python<'_>,
        progress: Option<Py<PyAny>>,
        repair: bool,
    ) -> PyResult<VerifyReport> {
        let p = Progress::new(progress);
        let r = py.detach(|| {
            if repair {
                self.engine.repair(&|d, t| p.call(d, t))
            } else {
                self.engine.verify(&|d, t| p.call(d, t))
            }
        });
        Ok(p.finish(r.py())?.into())
    }

    #[pyo3(signature = (progress=None))]
    fn compact(&self, py: Python<'_>, progress: Option<Py<PyAny>>) -> PyResult<CompactReport> {
        let p = Progress::new(progress);
        let r = py.detach(|| self.engine.compact(&|d, t| p.call(d, t)));
        Ok(p.finish(r.py())?.into())
    }

    #[pyo3(signature = (max_bytes=None, older_than_s=None, progress=None))]
    fn gc(
        &self,
        py: Python<'_>,
        max_bytes: Option<u64>,
        older_than_s: Option<f64>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<GcReport> {
        let older = older_than_s
            .map(|s| seconds("older_than", s, false))
            .transpose()?;
        let p = Progress::new(progress);
        let r = py.detach(|| self.engine.gc(max_bytes, older, &|d, t| p.call(d, t)));
        Ok(p.finish(r.py())?.into())
    }
}
