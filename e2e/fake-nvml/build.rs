//! Links the cdylib with `-z nodelete`: nvml-wrapper dlcloses the library when an `Nvml`
//! drops, but Rust's runtime registers thread-exit destructors (pthread keys) inside it, so an
//! unloaded copy would crash the next exiting thread. Real NVML is never unloaded either.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!("cargo:rerun-if-changed=build.rs");
}
