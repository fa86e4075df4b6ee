//! The two kubelet sockets: the DRA socket (DRA v1 + v1beta1, health v1alpha1 + v1) and the
//! registration socket. Both are served behind the `:authority` proxy
//! ([`crate::authority_proxy`]): the kubelet sends the percent-encoded socket path as
//! `:authority` on the registration socket, and kubelets before 1.34 on the DRA socket too.
//!
//! Order matters to the kubelet: the DRA socket is served before the registration socket
//! exists (the kubelet may call it right after registering), and on shutdown the registration
//! socket goes first (deleting it deregisters the plugin), the DRA socket last.
//!
//! ```text
//! <kubelet root>/plugins/<driver>/dra.sock
//! <kubelet root>/plugins_registry/<driver>-reg.sock
//! ```
//!
//! With an instance name ([`PluginServerConfig::instance`], e.g. the pod UID) the names are
//! unique per plugin instance, as the kubelet's rolling-update convention has them, so two
//! instances (a DaemonSet with `maxSurge > 0`) can be registered at once:
//!
//! ```text
//! <kubelet root>/plugins/<driver>/dra-<instance>.sock
//! <kubelet root>/plugins_registry/<driver>-<instance>-reg.sock
//! ```
//!
//! Each instance removes its own sockets at start (a stale file of a crashed run) and on
//! shutdown, and never another instance's live ones: at start it only removes sockets of
//! this driver that nobody listens on (left by an instance that was killed), because those
//! names are never reused and the kubelet would keep dialing them.

use std::{
    future::Future,
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::{net::UnixListener, sync::watch, task::JoinHandle, time::Instant};
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::transport::Server;
use tracing::{info, warn};

use crate::{
    DeviceHealthReport, DraDriver, RegistrationState,
    authority_proxy::AuthorityProxy,
    dra::DraService,
    health::{DEFAULT_RESEND_INTERVAL, HealthService},
    registration::RegistrationService,
};

/// `sun_path` holds 108 bytes including the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// How long a shutdown waits for in-flight calls by default before dropping them.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Which of the two sockets an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketKind {
    /// The DRA service socket.
    Dra,
    /// The plugin registration socket.
    Registration,
}

impl std::fmt::Display for SocketKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Dra => "DRA",
            Self::Registration => "registration",
        })
    }
}

/// Errors of the socket server; each names the path involved.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The driver name cannot be used in a socket path.
    #[error("driver name {0:?} cannot be used in a socket path")]
    InvalidDriverName(String),
    /// The kubelet root dir could not be made absolute.
    #[error("cannot make kubelet root dir {path} absolute: {source}")]
    KubeletRoot {
        /// The configured root dir.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A socket path is too long for a unix socket.
    #[error("{kind} socket path {path} is {len} bytes long; unix sockets allow at most {MAX_SOCKET_PATH}")]
    PathTooLong {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The instance name cannot be used in a socket file name.
    #[error("plugin instance name {0:?} cannot be used in a socket file name")]
    InvalidInstanceName(String),
    /// The socket's directory could not be created.
    #[error("cannot create directory {path} for the {kind} socket: {source}")]
    CreateDir {
        /// Which socket.
        kind: SocketKind,
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A stale socket file could not be removed.
    #[error("cannot remove stale {kind} socket {path}: {source}")]
    RemoveStale {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Binding the socket failed.
    #[error("cannot bind the {kind} socket {path}: {source}")]
    Bind {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The gRPC server failed.
    #[error("the {kind} gRPC server on {path} failed: {source}")]
    Serve {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: tonic::transport::Error,
    },
    /// A gRPC server stopped although no shutdown was requested.
    #[error("the {kind} gRPC server on {path} stopped unexpectedly")]
    Stopped {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
    },
    /// The server task panicked or was cancelled.
    #[error("the {kind} server task on {path} died: {source}")]
    Task {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: tokio::task::JoinError,
    },
    /// The socket file could not be removed on shutdown.
    #[error("cannot remove the {kind} socket {path}: {source}")]
    RemoveSocket {
        /// Which socket.
        kind: SocketKind,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// Where and how to serve.
#[derive(Clone, Debug)]
pub struct PluginServerConfig {
    /// The kubelet's root dir (`/var/lib/kubelet`).
    pub kubelet_root: PathBuf,
    /// The DRA driver name (`dra.example.com`).
    pub driver_name: String,
    /// How often health streams re-send the full list without a change.
    pub health_resend_interval: Duration,
    /// How long shutdown waits for in-flight calls before dropping them.
    pub shutdown_grace: Duration,
    /// Makes both socket names unique to this plugin instance (the pod UID in a DaemonSet),
    /// for rolling updates where an old and a new instance run side by side. `None` (or
    /// empty): the fixed names.
    pub instance: Option<String>,
}

impl PluginServerConfig {
    /// Defaults for everything but the root dir and driver name.
    pub fn new(kubelet_root: impl Into<PathBuf>, driver_name: impl Into<String>) -> Self {
        Self {
            kubelet_root: kubelet_root.into(),
            driver_name: driver_name.into(),
            health_resend_interval: DEFAULT_RESEND_INTERVAL,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            instance: None,
        }
    }

    /// Names the sockets after `instance` (see [`Self::instance`]); empty keeps the fixed
    /// names.
    pub fn with_instance(mut self, instance: impl Into<String>) -> Self {
        let instance = instance.into();
        self.instance = (!instance.is_empty()).then_some(instance);
        self
    }

    fn instance_name(&self) -> Option<&str> {
        self.instance.as_deref().filter(|i| !i.is_empty())
    }

    /// `<kubelet root>/plugins/<driver>/dra.sock`, or `dra-<instance>.sock` with an instance.
    pub fn dra_socket(&self) -> PathBuf {
        let file = match self.instance_name() {
            Some(instance) => format!("dra-{instance}.sock"),
            None => "dra.sock".to_string(),
        };
        self.kubelet_root
            .join("plugins")
            .join(&self.driver_name)
            .join(file)
    }

    /// `<kubelet root>/plugins_registry/<driver>-reg.sock`, or `<driver>-<instance>-reg.sock`
    /// with an instance.
    pub fn registration_socket(&self) -> PathBuf {
        let file = match self.instance_name() {
            Some(instance) => format!("{}-{instance}-reg.sock", self.driver_name),
            None => format!("{}-reg.sock", self.driver_name),
        };
        self.kubelet_root.join("plugins_registry").join(file)
    }

    /// Whether a registration socket file name belongs to this driver (any instance).
    fn is_registration_socket(&self, name: &str) -> bool {
        name.starts_with(&format!("{}-", self.driver_name)) && name.ends_with("-reg.sock")
    }

    /// The registration sockets of other instances of this driver that a process listens on:
    /// during a rolling update, the instance the kubelet keeps calling once this one is gone.
    /// A stopping instance uses it to tell a hand-over (someone else still serves the node)
    /// from the node losing its plugin.
    pub async fn live_peer_registrations(&self) -> Vec<PathBuf> {
        let mut live = Vec::new();
        for path in sibling_sockets(&self.registration_socket(), |n| self.is_registration_socket(n)).await {
            if probe(&path).await == Probe::Alive {
                live.push(path);
            }
        }
        live
    }

    fn validate(&self) -> Result<Self, ServerError> {
        let name = &self.driver_name;
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\0']) {
            return Err(ServerError::InvalidDriverName(name.clone()));
        }
        // A path separator would put the socket elsewhere, and the kubelet's plugin watcher
        // ignores dot-files (a leading dot cannot occur: the names start with the driver or
        // `dra-`).
        if let Some(instance) = self.instance_name()
            && instance.contains(['/', '\0'])
        {
            return Err(ServerError::InvalidInstanceName(instance.to_string()));
        }
        // The kubelet dials the endpoint we announce verbatim, so it must be absolute.
        let kubelet_root =
            std::path::absolute(&self.kubelet_root).map_err(|source| ServerError::KubeletRoot {
                path: self.kubelet_root.clone(),
                source,
            })?;
        Ok(Self {
            kubelet_root,
            ..self.clone()
        })
    }
}

/// The kubelet-facing gRPC servers of one driver.
pub struct PluginServer<D> {
    config: PluginServerConfig,
    driver: Arc<D>,
    health: watch::Receiver<Vec<DeviceHealthReport>>,
    registration: watch::Sender<RegistrationState>,
}

impl<D: DraDriver> PluginServer<D> {
    /// Servers for `driver`; health streams follow `health`, and the kubelet's registration
    /// verdicts are published to `registration`.
    pub fn new(
        config: PluginServerConfig,
        driver: Arc<D>,
        health: watch::Receiver<Vec<DeviceHealthReport>>,
        registration: watch::Sender<RegistrationState>,
    ) -> Self {
        Self {
            config,
            driver,
            health,
            registration,
        }
    }

    /// Serves both sockets until `shutdown` is cancelled, then removes them (registration
    /// first). Equivalent to [`Self::serve_dra`], [`DraServing::register`],
    /// [`PluginServing::wait`].
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        self.serve_dra(shutdown).await?.register().await?.wait().await
    }

    /// Step 1: creates the directories, removes a stale DRA socket, binds it and starts serving
    /// DRA v1 + v1beta1 and health v1alpha1 + v1 on it, through the `:authority` proxy. The
    /// registration socket is not touched.
    pub async fn serve_dra(self, shutdown: CancellationToken) -> Result<DraServing, ServerError> {
        let config = self.config.validate()?;
        let stop = shutdown.child_token();
        let dra_path = config.dra_socket();
        // Instances that died without cleaning up (SIGKILL, a node crash) left sockets under
        // names no later instance reuses; the kubelet would keep dialing them.
        remove_dead_sockets(&config.registration_socket(), |name| {
            config.is_registration_socket(name)
        })
        .await;
        remove_dead_sockets(&dra_path, |name| {
            name == "dra.sock" || (name.starts_with("dra-") && name.ends_with(".sock"))
        })
        .await;
        let listener = bind_socket(SocketKind::Dra, &dra_path).await?;
        let dra_socket = SocketFile {
            kind: SocketKind::Dra,
            path: Some(dra_path.clone()),
        };

        let dra = DraService::new(self.driver);
        let health = HealthService::new(self.health, config.health_resend_interval, stop.clone());
        let router = Server::builder()
            .add_service(dra.v1_server())
            .add_service(dra.v1beta1_server())
            .add_service(health.v1alpha1_server())
            .add_service(health.v1_server());
        let (proxy, connections) = AuthorityProxy::new(SocketKind::Dra, listener);
        let serve_stop = stop.clone();
        let task = spawn_server(SocketKind::Dra, dra_path.clone(), stop.clone(), async move {
            let (served, ()) = tokio::join!(
                router.serve_with_incoming_shutdown(connections, serve_stop.clone().cancelled_owned()),
                proxy.run(serve_stop),
            );
            served
        });
        info!(socket = %dra_path.display(), "serving DRA v1, v1beta1 and resource health v1alpha1, v1");
        Ok(DraServing {
            stop_guard: stop.clone().drop_guard(),
            dra_socket,
            stop,
            dra_task: task,
            config,
            registration: self.registration,
        })
    }
}

/// The DRA socket is being served; the plugin is not registered yet.
pub struct DraServing {
    // Field order is drop order: stop the servers, then remove the socket.
    stop_guard: DropGuard,
    dra_socket: SocketFile,
    stop: CancellationToken,
    dra_task: JoinHandle<Result<(), ServerError>>,
    config: PluginServerConfig,
    registration: watch::Sender<RegistrationState>,
}

impl DraServing {
    /// The absolute path of the DRA socket.
    pub fn dra_socket(&self) -> PathBuf {
        self.config.dra_socket()
    }

    /// The absolute path the registration socket will have.
    pub fn registration_socket(&self) -> PathBuf {
        self.config.registration_socket()
    }

    /// Step 2: removes a stale registration socket, binds it and serves plugin registration
    /// through the `:authority` proxy. On failure the DRA socket is shut down and removed too.
    pub async fn register(self) -> Result<PluginServing, ServerError> {
        let registration_path = self.config.registration_socket();
        let mut serving = PluginServing {
            stop_guard: self.stop_guard,
            registration_socket: SocketFile {
                kind: SocketKind::Registration,
                path: None,
            },
            dra_socket: self.dra_socket,
            stop: self.stop,
            registration_task: None,
            dra_task: self.dra_task,
            dra_path: self.config.dra_socket(),
            registration_path: registration_path.clone(),
            grace: self.config.shutdown_grace,
        };
        let listener = match bind_socket(SocketKind::Registration, &registration_path).await {
            Ok(listener) => listener,
            Err(error) => {
                serving.stop.cancel();
                if let Err(cleanup) = serving.wait().await {
                    warn!(error = %cleanup, "shutting down the DRA socket failed");
                }
                return Err(error);
            }
        };
        serving.registration_socket.path = Some(registration_path.clone());

        let service = RegistrationService::new(
            self.config.driver_name.clone(),
            self.config.dra_socket(),
            self.registration,
        );
        let (proxy, connections) = AuthorityProxy::new(SocketKind::Registration, listener);
        let router = Server::builder().add_service(service.into_server());
        let stop = serving.stop.clone();
        serving.registration_task = Some(spawn_server(
            SocketKind::Registration,
            registration_path.clone(),
            serving.stop.clone(),
            async move {
                let (served, ()) = tokio::join!(
                    router.serve_with_incoming_shutdown(connections, stop.clone().cancelled_owned()),
                    proxy.run(stop),
                );
                served
            },
        ));
        info!(
            socket = %registration_path.display(),
            driver = %self.config.driver_name,
            "serving plugin registration"
        );
        Ok(serving)
    }
}

/// Both sockets are being served.
pub struct PluginServing {
    // Field order is drop order: stop the servers, deregister, then remove the DRA socket.
    stop_guard: DropGuard,
    registration_socket: SocketFile,
    dra_socket: SocketFile,
    stop: CancellationToken,
    registration_task: Option<JoinHandle<Result<(), ServerError>>>,
    dra_task: JoinHandle<Result<(), ServerError>>,
    dra_path: PathBuf,
    registration_path: PathBuf,
    grace: Duration,
}

impl PluginServing {
    /// The absolute path of the DRA socket.
    pub fn dra_socket(&self) -> &Path {
        &self.dra_path
    }

    /// The absolute path of the registration socket.
    pub fn registration_socket(&self) -> &Path {
        &self.registration_path
    }

    /// Serves until the shutdown token is cancelled (or a server fails), then removes the
    /// registration socket, lets in-flight calls finish (up to the shutdown grace), stops both
    /// servers and removes the DRA socket. Returns the first error.
    pub async fn wait(self) -> Result<(), ServerError> {
        let Self {
            stop_guard,
            mut registration_socket,
            mut dra_socket,
            stop,
            registration_task,
            dra_task,
            dra_path,
            registration_path,
            grace,
        } = self;
        // Also cancelled by a server task that stops on its own (see `spawn_server`).
        stop.cancelled().await;
        info!("shutting down the kubelet plugin sockets");

        let mut errors = Vec::new();
        // Deregister first: the kubelet stops calling once the registration socket is gone.
        errors.extend(registration_socket.remove().err());
        let deadline = Instant::now() + grace;
        if let Some(task) = registration_task {
            errors.extend(finish(SocketKind::Registration, registration_path, task, deadline).await);
        }
        errors.extend(finish(SocketKind::Dra, dra_path, dra_task, deadline).await);
        errors.extend(dra_socket.remove().err());
        drop(stop_guard);
        match errors.into_iter().next() {
            Some(error) => Err(error),
            None => {
                info!("kubelet plugin sockets removed");
                Ok(())
            }
        }
    }
}

/// Runs a gRPC server; when it stops on its own (an error, or its listener ended) it cancels
/// `stop`, so that the other server stops too and the sockets are cleaned up.
fn spawn_server<F>(
    kind: SocketKind,
    path: PathBuf,
    stop: CancellationToken,
    serve: F,
) -> JoinHandle<Result<(), ServerError>>
where
    F: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let result = serve.await;
        let stopped_early = !stop.is_cancelled();
        stop.cancel();
        match result {
            Err(source) => Err(ServerError::Serve { kind, path, source }),
            Ok(()) if stopped_early => Err(ServerError::Stopped { kind, path }),
            Ok(()) => Ok(()),
        }
    })
}

/// Waits for a server task until `deadline`, then aborts it.
async fn finish(
    kind: SocketKind,
    path: PathBuf,
    mut task: JoinHandle<Result<(), ServerError>>,
    deadline: Instant,
) -> Option<ServerError> {
    match tokio::time::timeout_at(deadline, &mut task).await {
        Ok(Ok(outcome)) => outcome.err(),
        Ok(Err(source)) => Some(ServerError::Task { kind, path, source }),
        Err(_) => {
            warn!(%kind, "server did not stop within the shutdown grace; dropping its connections");
            task.abort();
            None
        }
    }
}

/// A bound socket file, removed on drop unless already removed.
struct SocketFile {
    kind: SocketKind,
    path: Option<PathBuf>,
}

impl SocketFile {
    fn remove(&mut self) -> Result<(), ServerError> {
        let Some(path) = self.path.take() else {
            return Ok(());
        };
        match std::fs::remove_file(&path) {
            Ok(()) => {
                info!(kind = %self.kind, socket = %path.display(), "removed socket");
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(ServerError::RemoveSocket {
                kind: self.kind,
                path,
                source,
            }),
        }
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Err(error) = self.remove() {
            warn!(%error, "socket cleanup failed");
        }
    }
}

/// How long a probe of another instance's socket may take before it counts as alive.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Whether something listens on a socket file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Probe {
    /// Connecting was refused: the process that bound it is gone.
    Dead,
    /// Connected, or could not tell (a probe that times out counts as alive).
    Alive,
}

async fn probe(path: &Path) -> Probe {
    match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::UnixStream::connect(path)).await {
        Ok(Err(error)) if error.kind() == io::ErrorKind::ConnectionRefused => Probe::Dead,
        _ => Probe::Alive,
    }
}

/// The sockets next to `own` (not `own` itself) whose file name `is_plugin_socket` accepts.
async fn sibling_sockets(own: &Path, is_plugin_socket: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;

    let mut found = Vec::new();
    let Some(dir) = own.parent() else { return found };
    let Ok(mut entries) = tokio::fs::read_dir(dir).await else {
        return found; // not there yet: no siblings either
    };
    while let Ok(Some(entry)) = entries.next_entry().await {
        let path = entry.path();
        if path != own
            && entry.file_name().to_str().is_some_and(&is_plugin_socket)
            && entry.file_type().await.is_ok_and(|t| t.is_socket())
        {
            found.push(path);
        }
    }
    found
}

/// Removes the sockets next to `own` (not `own` itself, which [`bind_socket`] replaces) whose
/// file name `is_plugin_socket` accepts and that nobody listens on. Anything else (a live
/// socket, a probe that times out, other files) is left alone; failures are logged, never
/// fatal.
async fn remove_dead_sockets(own: &Path, is_plugin_socket: impl Fn(&str) -> bool) {
    for path in sibling_sockets(own, is_plugin_socket).await {
        if probe(&path).await == Probe::Dead {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {
                    info!(socket = %path.display(), "removed the dead socket of another plugin instance")
                }
                Err(error) => warn!(socket = %path.display(), %error, "cannot remove a dead plugin socket"),
            }
        }
    }
}

/// Creates the socket's directory, removes a stale socket file and binds.
async fn bind_socket(kind: SocketKind, path: &Path) -> Result<UnixListener, ServerError> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(ServerError::PathTooLong {
            kind,
            path: path.to_path_buf(),
            len,
        });
    }
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|source| ServerError::CreateDir {
                kind,
                path: dir.to_path_buf(),
                source,
            })?;
    }
    match tokio::fs::remove_file(path).await {
        Ok(()) => info!(%kind, socket = %path.display(), "removed stale socket"),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(ServerError::RemoveStale {
                kind,
                path: path.to_path_buf(),
                source,
            });
        }
    }
    UnixListener::bind(path).map_err(|source| ServerError::Bind {
        kind,
        path: path.to_path_buf(),
        source,
    })
}
