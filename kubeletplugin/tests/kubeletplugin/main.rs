//! The helper over real unix sockets, driven by a tiny scripted driver (see [`support`]): the DRA
//! service, the health streams, plugin registration through the `:authority` fix, and the
//! socket lifecycle. One test binary, so the crate is linked once.

mod dra;
mod health;
mod registration;
mod sockets;
mod support;
