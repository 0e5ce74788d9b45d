//! Progress callbacks from Python for long engine work (verify, compact, gc,
//! rebuild-index).

use pyo3::prelude::*;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A Python progress callback, called at most ten times a second (and at the
/// end). The engine cannot stop half way through a compaction or a rebuild, so
/// an exception the callback raises (Ctrl-C included) silences it and is
/// raised once the work is done (`finish`).
pub struct Progress {
    cb: Option<Py<PyAny>>,
    last: Mutex<Option<Instant>>,
    error: Mutex<Option<PyErr>>,
}

impl Progress {
    pub fn new(cb: Option<Py<PyAny>>) -> Self {
        Progress {
            cb,
            last: Mutex::new(None),
            error: Mutex::new(None),
        }
    }

    pub fn call(&self, done: u64, total: u64) {
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
    pub fn finish<T>(&self, result: PyResult<T>) -> PyResult<T> {
        match self.error.lock().expect("progress error lock").take() {
            Some(e) => Err(e),
            None => result,
        }
    }
}
