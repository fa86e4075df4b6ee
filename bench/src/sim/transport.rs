//! One connection stack for every simulated plugin. Each plugin's client authenticates with
//! its own node-bound token (kube's own auth layer of the plugin's config, per request), so
//! the API server's authentication, node authorizer, admission policy and API Priority and
//! Fairness see one identity per plugin, as with real plugins; only the TLS stack and the
//! connection pool are shared. A stack per client would hold a TLS configuration, a pool and
//! a kept-alive connection per plugin client: two per node, 2,000 connections for the API
//! server to keep at 1,000 nodes.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::{Request, Response};
use kube::{
    Client,
    client::{Body, ConfigExt as _},
};
use tower::{BoxError, Layer as _, Service};

/// Connection stacks shared by the simulated plugins' clients: one with kube's retry of
/// refused requests, one without (the plugin's heartbeat client).
#[derive(Clone)]
pub struct SharedTransport {
    retrying: Client,
    not_retrying: Client,
}

impl SharedTransport {
    /// The stacks for the API server `config` points at; its credentials are not used (each
    /// plugin's client brings its own).
    pub fn new(config: &kube::Config) -> Result<Self, kube::Error> {
        let (retrying, not_retrying) = stack_configs(config);
        Ok(Self {
            retrying: Client::try_from(retrying)?,
            not_retrying: Client::try_from(not_retrying)?,
        })
    }

    /// A plugin's two clients, as the plugin makes them from `config` (which carries its
    /// token): one for everything, and one for its heartbeat Lease without kube's retries
    /// (the plugin's `node_status::heartbeat_client`: a renewal is retried with a fresh
    /// `renewTime` instead).
    pub fn plugin_clients(&self, config: &kube::Config) -> Result<(Client, Client), kube::Error> {
        Ok((
            client_as(config, Transport(self.retrying.clone()))?,
            client_as(config, Transport(self.not_retrying.clone()))?,
        ))
    }
}

/// The configurations of the two shared stacks, with and without kube's retry: `config`
/// without its credentials, which would otherwise go with every plugin's requests.
fn stack_configs(config: &kube::Config) -> (kube::Config, kube::Config) {
    let mut retrying = config.clone();
    retrying.auth_info = kube::config::AuthInfo::default();
    retrying.default_retry = true;
    let mut not_retrying = retrying.clone();
    not_retrying.default_retry = false;
    (retrying, not_retrying)
}

/// A client that sends through `transport` with the credentials of `config`, in its default
/// namespace.
fn client_as<S>(config: &kube::Config, transport: S) -> Result<Client, kube::Error>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let namespace = config.default_namespace.clone();
    Ok(match config.auth_layer()? {
        Some(auth) => Client::new(auth.layer(transport), namespace),
        None => Client::new(transport, namespace),
    })
}

/// A shared kube `Client` as a tower service: requests keep the headers they come with.
#[derive(Clone)]
struct Transport(Client);

impl Service<Request<Body>> for Transport {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // The shared client queues requests itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move { client.send(request).await.map_err(BoxError::from) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use http::header::AUTHORIZATION;
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::Api;

    async fn config_with_token(token: Option<&str>) -> kube::Config {
        let user = token.map_or_else(|| "{}".to_string(), |t| format!("{{token: {t}}}"));
        let yaml = format!(
            "apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:1'}}}}]
users: [{{name: u, user: {user}}}]
contexts: [{{name: x, context: {{cluster: c, user: u, namespace: ns}}}}]
current-context: x
"
        );
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&yaml).unwrap();
        kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap()
    }

    /// Sends one GET through a client made by [`client_as`] over a mock transport and returns
    /// the request the transport saw.
    async fn request_seen(config: &kube::Config) -> Request<Body> {
        let (transport, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let client = client_as(config, transport).unwrap();
        let get = tokio::spawn(async move {
            let leases: Api<Lease> = Api::default_namespaced(client);
            let _ = leases.get("beat").await;
        });
        let (request, respond) = handle.next_request().await.unwrap();
        respond.send_error(BoxError::from("mock transport"));
        get.await.unwrap();
        request
    }

    #[tokio::test]
    async fn each_plugin_client_sends_its_own_token_over_the_shared_transport() {
        for token in ["token-of-node-a", "token-of-node-b"] {
            let request = request_seen(&config_with_token(Some(token)).await).await;
            assert_eq!(
                request.headers().get(AUTHORIZATION).unwrap(),
                &format!("Bearer {token}")
            );
            assert_eq!(
                request.uri().path(),
                "/apis/coordination.k8s.io/v1/namespaces/ns/leases/beat"
            );
        }
    }

    #[tokio::test]
    async fn a_config_without_credentials_sends_no_authorization() {
        let request = request_seen(&config_with_token(None).await).await;
        assert!(request.headers().get(AUTHORIZATION).is_none());
    }

    #[tokio::test]
    async fn the_shared_stacks_carry_no_credentials_and_only_one_retries() {
        let config = config_with_token(Some("first-plugin")).await;
        assert!(config.auth_layer().unwrap().is_some());
        let (retrying, not_retrying) = stack_configs(&config);
        assert!(retrying.auth_layer().unwrap().is_none());
        assert!(not_retrying.auth_layer().unwrap().is_none());
        assert!(retrying.default_retry);
        assert!(!not_retrying.default_retry);
        assert_eq!(retrying.cluster_url, config.cluster_url);
    }
}
