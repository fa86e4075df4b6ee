//! The helper over real unix sockets, driven by a tiny scripted driver (see `migdra_testkit::dra_kubelet`): the DRA
//! service, the health streams, plugin registration, the `:authority` fix on both sockets, and
//! the socket lifecycle. One test binary, so the crate is linked once.

mod authority;
mod dra;
mod health;
mod registration;
mod rolling_update;
mod sockets;
