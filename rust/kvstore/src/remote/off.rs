//! The remote tier in a build without the `remote` feature: opening a store
//! with one is an error, so nothing else here can run.

use super::{NodeReport, RemoteOptions};
use crate::error::{Error, Result};
use std::convert::Infallible;
use std::time::Duration;

pub(crate) use super::fault::Fault;

/// Never made: `connect` fails.
pub(crate) struct Client(Infallible);

#[allow(clippy::unused_self, clippy::needless_pass_by_ref_mut)]
impl Client {
    pub(crate) fn connect(_: &RemoteOptions, _: &str) -> Result<Client> {
        Err(Error::Remote(
            "this build of kvstore has no remote tier (cargo feature `remote`)".into(),
        ))
    }
    pub(crate) fn connect_again(&self, _: &RemoteOptions) -> Result<Client> {
        match self.0 {}
    }
    pub(crate) fn node_of(&self, _: &str) -> &str {
        match self.0 {}
    }
    pub(crate) fn refresh_slots(&mut self, _: &RemoteOptions, _: &str, _: impl Fn(&str) -> bool) {
        match self.0 {}
    }
    pub(crate) fn max_value(&self) -> u64 {
        match self.0 {}
    }
    pub(crate) fn get_upto(
        &mut self,
        _: &[String],
        _: usize,
    ) -> Result<Vec<Option<Vec<u8>>>, Fault> {
        match self.0 {}
    }
    pub(crate) fn present(&mut self, _: &[&str]) -> Result<Vec<bool>, Fault> {
        match self.0 {}
    }
    pub(crate) fn set_all(
        &mut self,
        _: &[(&str, &[u8])],
        _: Option<Duration>,
    ) -> Result<(), Fault> {
        match self.0 {}
    }
    pub(crate) fn expire(&mut self, _: &[String], _: Duration) -> Result<(), Fault> {
        match self.0 {}
    }
    pub(crate) fn nodes(&self, _: &RemoteOptions) -> Vec<NodeReport> {
        match self.0 {}
    }
}
