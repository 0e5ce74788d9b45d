//! The remote tier in a build without the `remote` feature: opening a store
//! with one is an error, so nothing else here can run.

use super::breaker::Breaker;
use super::{Newer, NodeReport, RemoteOptions};
use crate::error::{Error, Result};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use super::fault::{Blame, Fault};

/// Never made: `connect` fails.
pub(crate) struct Client(Infallible);

#[allow(clippy::unused_self, clippy::needless_pass_by_ref_mut)]
impl Client {
    pub(crate) fn connect(_: &RemoteOptions, _: &str, _: &Arc<Breaker>) -> Result<Client> {
        Err(Error::Remote(
            "this build of kvstore has no remote tier (cargo feature `remote`)".into(),
        ))
    }
    pub(crate) fn connect_again(&self) -> Client {
        match self.0 {}
    }
    pub(crate) fn node_of(&self, _: &str) -> &str {
        match self.0 {}
    }
    pub(crate) fn take_blame(&mut self) -> Option<Blame> {
        match self.0 {}
    }
    pub(crate) fn stale(&self) -> bool {
        match self.0 {}
    }
    pub(crate) fn mark_stale(&mut self) {
        match self.0 {}
    }
    pub(crate) fn slot_nodes(&self) -> Vec<String> {
        match self.0 {}
    }
    pub(crate) fn refresh_from(&mut self, _: &str, _: Instant) -> Result<(), Fault> {
        match self.0 {}
    }
    pub(crate) fn max_value(&self) -> u64 {
        match self.0 {}
    }
    pub(crate) fn get_upto(
        &mut self,
        _: &[String],
        _: usize,
        _: Instant,
    ) -> Result<Vec<Option<Vec<u8>>>, Fault> {
        match self.0 {}
    }
    pub(crate) fn present(&mut self, _: &[&str], _: Instant) -> Result<Vec<bool>, Fault> {
        match self.0 {}
    }
    pub(crate) fn set_all(
        &mut self,
        _: &[(&str, &[u8])],
        _: Option<Duration>,
        _: Instant,
    ) -> Result<(), Fault> {
        match self.0 {}
    }
    pub(crate) fn set_unless_newer(
        &mut self,
        _: (&str, &[u8]),
        _: Option<Duration>,
        _: &Newer<'_>,
        _: Instant,
    ) -> Result<bool, Fault> {
        match self.0 {}
    }
    pub(crate) fn expire(&mut self, _: &[String], _: Duration, _: Instant) -> Result<(), Fault> {
        match self.0 {}
    }
    pub(crate) fn nodes(&self, _: &RemoteOptions) -> Vec<NodeReport> {
        match self.0 {}
    }
}
