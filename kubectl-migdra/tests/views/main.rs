//! The views on a hand-built cluster ([`fixture`]): facts asserted on the view models, and
//! the text, JSON and YAML renderings compared with the goldens in `tests/golden/`.
//! `MIGDRA_UPDATE_GOLDEN=1 cargo test -p kubectl-migdra` rewrites the goldens.

#![allow(clippy::unwrap_used)] // test code

mod fixture;
mod golden;

mod claims;
mod fits;
mod layout;
