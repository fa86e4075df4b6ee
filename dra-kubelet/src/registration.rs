//! The kubelet plugin registration service (`pluginregistration.Registration`), served on the
//! registration socket behind the `:authority` proxy ([`crate::authority_proxy`]).

use std::path::PathBuf;

use migdra_proto::registration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::Registration,
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use crate::RegistrationState;

/// The plugin type the kubelet's DRA plugin handler accepts.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// The gRPC services we offer, as `<package>.<service>`, preferred first. The kubelet takes
/// the first DRAPlugin entry it supports, and (1.37+) opens the optional health stream only
/// for a DRAResourceHealth service listed here; entries it does not know are ignored.
pub const SUPPORTED_VERSIONS: [&str; 4] = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
];

/// Answers the kubelet's `GetInfo` and records its `NotifyRegistrationStatus`.
pub struct RegistrationService {
    pub driver_name: String,
    /// The DRA socket, absolute: the kubelet dials exactly this path.
    pub endpoint: PathBuf,
    pub state: watch::Sender<RegistrationState>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _request: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        info!(driver = %self.driver_name, endpoint = %self.endpoint.display(), "kubelet asked for plugin info");
        Ok(Response::new(PluginInfo {
            r#type: PLUGIN_TYPE.to_string(),
            name: self.driver_name.clone(),
            endpoint: self.endpoint.to_string_lossy().into_owned(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| (*v).to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        let error = (!status.plugin_registered).then(|| status.error.clone());
        self.state.send_replace(RegistrationState {
            registered: status.plugin_registered,
            error: error.clone(),
        });
        match error {
            None => {
                info!(driver = %self.driver_name, "kubelet registered the plugin");
                Ok(Response::new(RegistrationStatusResponse {}))
            }
            Some(error) => {
                error!(driver = %self.driver_name, %error, "kubelet rejected the plugin registration");
                // Like the Go helper: answering with an error makes the kubelet restart the sequence.
                Err(Status::unknown(format!("plugin registration failed: {error}")))
            }
        }
    }
}
