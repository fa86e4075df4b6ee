//! Compiles migdra's own .proto files with protox (pure Rust, no protoc binary) and generates
//! prost messages plus tonic servers and clients.

const PROTO_DIR: &str = "proto";
const FILES: [&str; 5] = [
    "proto/dra_v1.proto",
    "proto/dra_v1beta1.proto",
    "proto/registration.proto",
    "proto/health_v1alpha1.proto",
    "proto/health_v1.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed={PROTO_DIR}");
    for file in FILES {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(FILES, [PROTO_DIR])?;
    // One output file per protobuf package; lib.rs includes each into its own module, so the
    // bare `v1` health package cannot clash with the DRA `...dra.v1` package.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
