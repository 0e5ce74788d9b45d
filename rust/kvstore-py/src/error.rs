//! The one place engine errors become Python exceptions. The classes live in
//! `kvstore.errors` (plain Python, so they pickle and can inherit from both
//! `KVStoreError` and a builtin such as `ValueError`); `import_exception!`
//! names them here as Rust types, imported on first use.

use pyo3::PyErr;

pyo3::import_exception!(kvstore.errors, KVStoreError);
pyo3::import_exception!(kvstore.errors, LayoutMismatch);
pyo3::import_exception!(kvstore.errors, InvalidInput);
pyo3::import_exception!(kvstore.errors, StoreFull);
pyo3::import_exception!(kvstore.errors, StoreClosed);
pyo3::import_exception!(kvstore.errors, StoreLocked);
pyo3::import_exception!(kvstore.errors, CorruptStore);
pyo3::import_exception!(kvstore.errors, SessionNotFound);
pyo3::import_exception!(kvstore.errors, StoreIOError);
pyo3::import_exception!(kvstore.errors, RemoteError);

pub fn to_pyerr(e: kvstore::Error) -> PyErr {
    use kvstore::Error as E;
    let msg = e.to_string();
    match e {
        E::LayoutMismatch(_) => LayoutMismatch::new_err(msg),
        E::InvalidInput(_) => InvalidInput::new_err(msg),
        E::StoreFull(_) => StoreFull::new_err(msg),
        E::StoreClosed(_) => StoreClosed::new_err(msg),
        E::StoreLocked(_) => StoreLocked::new_err(msg),
        E::CorruptStore { .. } => CorruptStore::new_err(msg),
        E::SessionNotFound(_) => SessionNotFound::new_err(msg),
        E::Poisoned(_) | E::Io { .. } => StoreIOError::new_err(msg),
        E::Remote(_) => RemoteError::new_err(msg),
        E::Index(_) => KVStoreError::new_err(msg),
    }
}

/// `InvalidInput` with `msg`: bad arguments found by the binding itself.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    to_pyerr(kvstore::Error::InvalidInput(msg.into()))
}

pub trait PyResultExt<T> {
    fn py(self) -> pyo3::PyResult<T>;
}

impl<T> PyResultExt<T> for kvstore::Result<T> {
    fn py(self) -> pyo3::PyResult<T> {
        self.map_err(to_pyerr)
    }
}
