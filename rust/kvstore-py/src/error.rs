//! The one place engine errors become Python exceptions. The classes live in
//! `kvstore.errors` (plain Python, so they pickle and can inherit from both
//! `KVStoreError` and a builtin such as `ValueError`).

use pyo3::prelude::*;

pub fn to_pyerr(e: kvstore::Error) -> PyErr {
    use kvstore::Error as E;
    let class = match &e {
        E::LayoutMismatch(_) => "LayoutMismatch",
        E::InvalidInput(_) => "InvalidInput",
        E::StoreFull(_) => "StoreFull",
        E::StoreClosed(_) => "StoreClosed",
        E::StoreLocked(_) => "StoreLocked",
        E::CorruptStore { .. } => "CorruptStore",
        E::SessionNotFound(_) => "SessionNotFound",
        E::Poisoned(_) | E::Io { .. } => "StoreIOError",
        E::Index(_) => "KVStoreError",
    };
    let msg = e.to_string();
    Python::attach(|py| {
        match py
            .import("kvstore.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|c| c.call1((msg.clone(),)))
        {
            Ok(exc) => PyErr::from_value(exc),
            Err(import_failed) => import_failed,
        }
    })
}

pub trait PyResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> PyResultExt<T> for kvstore::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}
