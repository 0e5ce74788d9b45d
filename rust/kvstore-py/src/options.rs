//! The options of `Store.open`, read from one Python dict (`OpenOptions` in
//! `_lib.pyi`). Keys left out take the engine's defaults.

use crate::error::{invalid, PyResultExt};
use kvstore::{Codec, DType, Durability, Kind, Layout, Options, RemoteOptions, Storage, WriteMode};
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
    storage: String,
    kind: String,
}

impl LayoutArg {
    /// A latent layout's `head_dim` is its width (`Layout::latent`).
    fn to_engine(&self) -> PyResult<Layout> {
        let dtype = DType::parse(&self.dtype).py()?;
        let kind = Kind::parse(&self.kind).py()?;
        let layout = Layout::of_kind(
            kind,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            dtype,
            self.block_size,
        );
        layout
            .and_then(|l| l.with_storage(Storage::parse(&self.storage)?))
            .py()
    }
}

/// The remote tier, read from the dict `kvstore.Remote` makes. The password
/// is read here from the environment variable or file it names, and goes
/// nowhere but the engine's connection settings.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct RemoteArg {
    nodes: Vec<String>,
    #[pyo3(default)]
    username: Option<String>,
    #[pyo3(default)]
    password_env: Option<String>,
    #[pyo3(default)]
    password_file: Option<PathBuf>,
    #[pyo3(default)]
    tls_ca: Option<PathBuf>,
    prefix: String,
    write: String,
    #[pyo3(default)]
    ttl_ms: Option<u64>,
    #[pyo3(default)]
    timeout_ms: Option<u64>,
    #[pyo3(default)]
    breaker_ms: Option<u64>,
}

impl RemoteArg {
    fn to_engine(&self) -> PyResult<RemoteOptions> {
        let d = RemoteOptions::default();
        let password = match (&self.password_env, &self.password_file) {
            (Some(var), _) => Some(std::env::var(var).map_err(|_| {
                invalid(format!(
                    "remote password_env: the environment variable {var:?} is not set (or not UTF-8)"
                ))
            })?),
            (None, Some(f)) => Some(
                std::fs::read_to_string(f)
                    .map_err(|e| {
                        invalid(format!("remote password_file {}: {e}", f.display()))
                    })?
                    .trim_end_matches(['\n', '\r'])
                    .to_string(),
            ),
            (None, None) => None,
        };
        Ok(RemoteOptions {
            nodes: self.nodes.clone(),
            username: self.username.clone(),
            password,
            tls_ca: self.tls_ca.clone(),
            prefix: self.prefix.clone(),
            write: WriteMode::parse(&self.write).py()?,
            ttl: self.ttl_ms.map(Duration::from_millis),
            timeout: self.timeout_ms.map_or(d.timeout, Duration::from_millis),
            breaker: self.breaker_ms.map_or(d.breaker, Duration::from_millis),
            ..d
        })
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
    compression: Option<String>,
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
    #[pyo3(default)]
    remote: Option<RemoteArg>,
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
            codec: match self.compression.as_deref() {
                None => Codec::Raw,
                Some("zstd") => Codec::Zstd(self.compression_level.unwrap_or(3)),
                Some("exponent") => Codec::Exponent,
                Some(other) => {
                    return Err(invalid(format!(
                        "compression: expected None, 'zstd' or 'exponent', got {other:?}"
                    )))
                }
            },
            segment_bytes: self.segment_bytes.unwrap_or(d.segment_bytes),
            batch_window: self
                .batch_window_ms
                .map_or(d.batch_window, Duration::from_millis),
            create: self.create,
            hot_bytes: self.hot_bytes,
            hot_dir: self.hot_dir.clone(),
            index_bytes: self.index_bytes.unwrap_or(d.index_bytes),
            remote: self.remote.as_ref().map(RemoteArg::to_engine).transpose()?,
            ..d
        })
    }
}
