//! The controller's integration tests, one binary: the whole controller against a fake API
//! server ([`controller`]), leader election against a fake Lease API ([`leader`]) and the
//! reconciler against a scripted API server ([`reconcile`]), with the support of
//! `migdra_testkit::controller`.
#![allow(clippy::unwrap_used)] // test helpers outside #[test] functions

mod controller;
mod leader;
mod reconcile;
