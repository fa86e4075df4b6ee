//! The kubelet gRPC protocols migdra speaks, generated from migdra's own `.proto` files
//! (`proto/proto/`): DRA (`v1`, `v1beta1`), plugin registration and DRA resource health
//! (`v1alpha1`, `v1`). Each protobuf package lives in its own module so that the bare `v1`
//! health package and the DRA `k8s.io.kubelet.pkg.apis.dra.v1` package never collide.

/// The kubelet's DRA plugin service (`NodePrepareResources`, `NodeUnprepareResources`).
pub mod dra {
    /// `k8s.io.kubelet.pkg.apis.dra.v1`, advertised as `v1.DRAPlugin` (kubelet 1.34+).
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }

    /// `k8s.io.kubelet.pkg.apis.dra.v1beta1`, advertised as `v1beta1.DRAPlugin` (kubelet 1.32+).
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
}

/// `pluginregistration`: the kubelet's plugin registration service (`GetInfo`,
/// `NotifyRegistrationStatus`), served on the registration socket.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod registration {
    tonic::include_proto!("pluginregistration");
}

/// The kubelet's DRA resource health service (`NodeWatchResources`).
pub mod health {
    /// Bare package `v1alpha1`, service `v1alpha1.DRAResourceHealth`.
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");
    }

    /// Bare package `v1`, service `v1.DRAResourceHealth` (kubelet 1.37+).
    #[allow(missing_docs, clippy::all, clippy::pedantic)]
    pub mod v1 {
        tonic::include_proto!("v1");
    }
}
