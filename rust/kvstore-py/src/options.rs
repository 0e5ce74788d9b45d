//! The options of `Store.open`, read from one Python dict (`OpenOptions` in
//! `_lib.pyi`). Keys left out take the engine's defaults.

use crate::error::PyResultExt;
use kvstore::{DType, Durability, Layout, Options};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::time::Duration;

/// A KV layout, read from the attributes of a `kvstore.Layout`.
#[derive(FromPyObject)]
pub struct LayoutArg {
    num_layers: u32,
    num_kv_heads: u32,
    head_dim: u32,
    dtype: String,
    block_size: u32,
}

impl LayoutArg {
    fn to_engine(&self) -> PyResult<Layout> {
        let dtype = DType::parse(&self.dtype).py()?;
        Layout::new(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            self.block_size,
        )
        .py()
    }
}

/// Everything `Store.open` needs besides the path. With `layout` and
/// `fingerprint` both absent an existing store opens as its MANIFEST says.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct OpenOptions {
    durability: String,
    create: bool,
    #[pyo3(default)]
    fingerprint: Option<String>,
    #[pyo3(default)]
    layout: Option<LayoutArg>,
    #[pyo3(default)]
    salt: Option<Vec<u8>>,
    #[pyo3(default)]
    disk_bytes: Option<u64>,
    #[pyo3(default)]
    compression_level: Option<i32>,
    #[pyo3(default)]
    segment_bytes: Option<u64>,
    #[pyo3(default)]
    batch_window_ms: Option<u64>,
    #[pyo3(default)]
    hot_bytes: Option<u64>,
    #[pyo3(default)]
    hot_dir: Option<PathBuf>,
    #[pyo3(default)]
    index_bytes: Option<u64>,
}

impl OpenOptions {
    /// The engine's `Options`: parsed layout and durability, defaults filled in.
    pub fn to_engine(&self) -> PyResult<Options> {
        let d = Options::default();
        Ok(Options {
            fingerprint: self.fingerprint.clone(),
            layout: self.layout.as_ref().map(LayoutArg::to_engine).transpose()?,
            salt: self.salt.clone(),
            durability: Durability::parse(&self.durability).py()?,
            disk_bytes: self.disk_bytes,
            compression_level: self.compression_level.unwrap_or(d.compression_level),
            segment_bytes: self.segment_bytes.unwrap_or(d.segment_bytes),
            batch_window: self
                .batch_window_ms
                .map_or(d.batch_window, Duration::from_millis),
            create: self.create,
            hot_bytes: self.hot_bytes,
            hot_dir: self.hot_dir.clone(),
            index_bytes: self.index_bytes.unwrap_or(d.index_bytes),
            ..d
        })
    }
}
