//! The thin edge to the cluster: builds a client from the user's kubeconfig (kube's standard
//! inference, or `--kubeconfig`/`--context`), and fills a [`Snapshot`] with `list` calls only,
//! so the plugin works with read-only RBAC. A list the user may not read becomes a warning on
//! the snapshot instead of an error, and the views show what they can.

use std::path::PathBuf;

use kube::{
    Api, Client, Config,
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
};
use serde::de::DeserializeOwned;

use crate::snapshot::Snapshot;

/// Objects per list page.
const PAGE_SIZE: u32 = 500;

/// Why the cluster could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading kubeconfig {path}: {source}")]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// The kubeconfig does not give a usable configuration.
    #[error("loading kubeconfig: {0}")]
    Kubeconfig(#[from] kube::config::KubeconfigError),
    /// Neither a kubeconfig nor an in-cluster configuration was found.
    #[error("finding a kubeconfig (set KUBECONFIG or pass --kubeconfig): {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("creating the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
}

/// How to reach the cluster.
#[derive(Clone, Debug, Default)]
pub struct KubeOptions {
    /// A kubeconfig file instead of `KUBECONFIG`/`~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// A kubeconfig context instead of the current one.
    pub context: Option<String>,
}

/// A client and the namespace the kubeconfig context defaults to.
#[derive(Clone)]
pub struct Connection {
    pub client: Client,
    /// The context's namespace (`default` when it names none).
    pub default_namespace: String,
}

/// Connects as kubectl would: `--kubeconfig` and `--context` when given, else kube's
/// standard inference (`KUBECONFIG`, `~/.kube/config`, in-cluster).
pub async fn connect(options: &KubeOptions) -> Result<Connection, ClientError> {
    let kube_options = KubeConfigOptions {
        context: options.context.clone(),
        ..KubeConfigOptions::default()
    };
    let config = match &options.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path).map_err(|source| ClientError::ReadKubeconfig {
                path: path.clone(),
                source,
            })?;
            Config::from_custom_kubeconfig(file, &kube_options).await?
        }
        None if options.context.is_some() => Config::from_kubeconfig(&kube_options).await?,
        None => Config::infer().await?,
    };
    let default_namespace = config.default_namespace.clone();
    let client = Client::try_from(config).map_err(ClientError::Client)?;
    Ok(Connection {
        client,
        default_namespace,
    })
}

/// Which objects a view needs, and from where.
#[derive(Clone, Debug, Default)]
pub struct Needs {
    /// Namespace of claims, pods and events (all namespaces when `None`).
    pub namespace: Option<String>,
    pub gpu_nodes: bool,
    pub slices: bool,
    pub claims: bool,
    pub pods: bool,
    pub events: bool,
    pub policies: bool,
    pub device_classes: bool,
}

/// Reads what `needs` asks for.
pub async fn snapshot(connection: &Connection, driver: &str, needs: &Needs) -> Result<Snapshot, ClientError> {
    let client = &connection.client;
    let mut snapshot = Snapshot::new(driver);
    let ns = needs.namespace.as_deref();
    let all = ListParams::default();
    let by_driver = ListParams::default().fields(&format!("spec.driver={driver}"));
    let warning_events = ListParams::default().fields("type=Warning");
    let w = &mut snapshot.warnings;
    if needs.gpu_nodes {
        snapshot.gpu_nodes = list(Api::all(client.clone()), &all, "gpunodes", w).await?;
    }
    if needs.slices {
        snapshot.slices = list(Api::all(client.clone()), &by_driver, "resourceslices", w).await?;
    }
    if needs.claims {
        snapshot.claims = list(scoped(client, ns), &all, "resourceclaims", w).await?;
    }
    if needs.pods {
        snapshot.pods = list(scoped(client, ns), &all, "pods", w).await?;
    }
    if needs.events {
        snapshot.events = list(scoped(client, ns), &warning_events, "events", w).await?;
    }
    if needs.policies {
        snapshot.policies = list(Api::all(client.clone()), &all, "migpolicies", w).await?;
    }
    if needs.device_classes {
        snapshot.device_classes = list(Api::all(client.clone()), &all, "deviceclasses", w).await?;
    }
    Ok(snapshot)
}

fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: kube::Resource<Scope = kube::core::NamespaceResourceScope>,
    <K as kube::Resource>::DynamicType: Default,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Every object, page by page. Forbidden or unknown resources become a warning and an empty
/// list.
async fn list<K>(
    api: Api<K>,
    params: &ListParams,
    what: &'static str,
    warnings: &mut Vec<String>,
) -> Result<Vec<K>, ClientError>
where
    K: Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut items = Vec::new();
    let mut params = params.clone().limit(PAGE_SIZE);
    loop {
        match api.list(&params).await {
            Ok(page) => {
                items.extend(page.items);
                match page.metadata.continue_ {
                    Some(token) if !token.is_empty() => params = params.continue_token(&token),
                    _ => return Ok(items),
                }
            }
            Err(kube::Error::Api(status)) if status.code == 403 || status.code == 404 => {
                warnings.push(format!("cannot list {what}: {}", status.message));
                return Ok(Vec::new());
            }
            Err(source) => return Err(ClientError::List { what, source }),
        }
    }
}
