//! The two kubelet sockets, both served behind the `:authority` proxy
//! ([`crate::authority_proxy`]): the DRA socket (DRA v1 + v1beta1, health v1alpha1 + v1) and
//! the registration socket. The DRA socket is served before the registration socket exists (the
//! kubelet may call it right after registering); on shutdown the registration socket goes first
//! (deleting it deregisters the plugin), the DRA socket last.
//!
//! With an instance name (the pod UID) both socket names are unique per instance, so an old and
//! a new instance can be registered at once during a rolling update. Those names are never
//! reused, so at start an instance also removes this driver's sockets that nobody listens on
//! (left by a killed instance) — never another instance's live ones.

use std::{
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use migdra_proto::registration::registration_server::RegistrationServer;
use tokio::{net::UnixListener, sync::watch, task::JoinHandle, time::Instant};
use tokio_util::sync::{CancellationToken, DropGuard};
use tonic::transport::{Server, server::Router};
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

/// Mode of both socket files: only their owner (the plugin's user, root in the chart) and root,
/// which the kubelet runs as, may connect; the process umask plays no part.
pub const SOCKET_MODE: u32 = 0o600;

/// Connections the kernel queues before the server accepts them (the kubelet opens one per
/// plugin).
const LISTEN_BACKLOG: u32 = 128;

/// How long a shutdown waits for in-flight calls by default before dropping them.
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Which of the two sockets an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SocketKind {
    Dra,
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
    #[error("driver name {0:?} cannot be used in a socket path")]
    InvalidDriverName(String),
    #[error("cannot make kubelet root dir {path} absolute: {source}")]
    KubeletRoot { path: PathBuf, source: io::Error },
    #[error("{kind} socket path {path} is {len} bytes long; unix sockets allow at most {MAX_SOCKET_PATH}")]
    PathTooLong {
        kind: SocketKind,
        path: PathBuf,
        len: usize,
    },
    #[error("plugin instance name {0:?} cannot be used in a socket file name")]
    InvalidInstanceName(String),
    #[error("cannot create directory {path} for the {kind} socket: {source}")]
    CreateDir {
        kind: SocketKind,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot remove stale {kind} socket {path}: {source}")]
    RemoveStale {
        kind: SocketKind,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot bind the {kind} socket {path}: {source}")]
    Bind {
        kind: SocketKind,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot set mode {mode:o} on the {kind} socket {path}: {source}")]
    SetMode {
        kind: SocketKind,
        path: PathBuf,
        mode: u32,
        source: io::Error,
    },
    #[error("the {kind} gRPC server on {path} failed: {source}")]
    Serve {
        kind: SocketKind,
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the {kind} gRPC server on {path} stopped unexpectedly")]
    Stopped { kind: SocketKind, path: PathBuf },
    #[error("the {kind} server task on {path} died: {source}")]
    Task {
        kind: SocketKind,
        path: PathBuf,
        source: tokio::task::JoinError,
    },
    #[error("cannot remove the {kind} socket {path}: {source}")]
    RemoveSocket {
        kind: SocketKind,
        path: PathBuf,
        source: io::Error,
    },
}

/// Where and how to serve.
#[derive(Clone, Debug)]
pub struct PluginServerConfig {
    /// `/var/lib/kubelet`.
    pub kubelet_root: PathBuf,
    pub driver_name: String,
    /// How often health streams re-send the full list without a change.
    pub health_resend_interval: Duration,
    /// How long shutdown waits for in-flight calls before dropping them.
    pub shutdown_grace: Duration,
    /// Makes both socket names unique to this instance (the pod UID); `None` or empty: the
    /// fixed names.
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

    /// Names the sockets after `instance`; empty keeps the fixed names.
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

    /// The live registration sockets of other instances of this driver: a stopping instance
    /// tells a rolling-update hand-over from the node losing its plugin by them.
    pub async fn live_peer_registrations(&self) -> Vec<PathBuf> {
        let mut live = Vec::new();
        for path in sibling_sockets(&self.registration_socket(), |n| self.is_registration_socket(n)).await {
            if !is_dead(&path).await {
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
        // A path separator would put the socket elsewhere (a leading dot, which the plugin
        // watcher ignores, cannot occur: names start with the driver or `dra-`).
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
    /// Health streams follow `health`; the kubelet's registration verdicts go to
    /// `registration`.
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

    /// [`Self::serve_dra`], [`DraServing::register`], [`PluginServing::wait`]: serves both
    /// sockets until `shutdown` is cancelled, then removes them.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        self.serve_dra(shutdown).await?.register().await?.wait().await
    }

    /// Step 1: binds the DRA socket (replacing a stale one) and serves DRA and health on it.
    pub async fn serve_dra(self, shutdown: CancellationToken) -> Result<DraServing, ServerError> {
        let config = self.config.validate()?;
        let stop = shutdown.child_token();
        let dra_path = config.dra_socket();
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
        let task = serve_proxied(SocketKind::Dra, dra_path.clone(), listener, router, stop.clone());
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
    pub fn dra_socket(&self) -> PathBuf {
        self.config.dra_socket()
    }

    pub fn registration_socket(&self) -> PathBuf {
        self.config.registration_socket()
    }

    /// Step 2: binds the registration socket (replacing a stale one) and serves plugin
    /// registration. On failure the DRA socket is shut down and removed too.
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

        let service = RegistrationService {
            driver_name: self.config.driver_name.clone(),
            endpoint: self.config.dra_socket(),
            state: self.registration,
        };
        serving.registration_task = Some(serve_proxied(
            SocketKind::Registration,
            registration_path.clone(),
            listener,
            Server::builder().add_service(RegistrationServer::new(service)),
            serving.stop.clone(),
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
    pub fn dra_socket(&self) -> &Path {
        &self.dra_path
    }

    pub fn registration_socket(&self) -> &Path {
        &self.registration_path
    }

    /// Serves until the shutdown token is cancelled (or a server fails), then deregisters, lets
    /// in-flight calls finish (up to the shutdown grace) and removes the DRA socket. Returns the
    /// first error.
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
        // Also cancelled by a server task that stops on its own (see `serve_proxied`).
        stop.cancelled().await;
        info!("shutting down the kubelet plugin sockets");

        let mut errors = Vec::new();
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

/// Serves `router` on `listener` behind the `:authority` proxy. When the server stops on its
/// own (an error, or its listener ended) it cancels `stop`, so that the other server stops too
/// and the sockets are cleaned up.
fn serve_proxied(
    kind: SocketKind,
    path: PathBuf,
    listener: UnixListener,
    router: Router,
    stop: CancellationToken,
) -> JoinHandle<Result<(), ServerError>> {
    let (proxy, connections) = AuthorityProxy::new(kind, listener);
    tokio::spawn(async move {
        let (result, ()) = tokio::join!(
            router.serve_with_incoming_shutdown(connections, stop.clone().cancelled_owned()),
            proxy.run(stop.clone()),
        );
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

/// Whether the process that bound `path` is gone (connecting is refused); a probe that times
/// out counts as alive.
async fn is_dead(path: &Path) -> bool {
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, tokio::net::UnixStream::connect(path)).await,
        Ok(Err(error)) if error.kind() == io::ErrorKind::ConnectionRefused
    )
}

/// The sockets next to `own` (not `own` itself) whose file name `is_plugin_socket` accepts.
async fn sibling_sockets(own: &Path, is_plugin_socket: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;

    let mut found = Vec::new();
    let Some(dir) = own.parent() else { return found };
    let Ok(mut entries) = tokio::fs::read_dir(dir).await else {
        return found;
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

/// Removes the dead sockets next to `own` whose file name `is_plugin_socket` accepts; failures
/// are logged, never fatal.
async fn remove_dead_sockets(own: &Path, is_plugin_socket: impl Fn(&str) -> bool) {
    for path in sibling_sockets(own, is_plugin_socket).await {
        if is_dead(&path).await {
            match tokio::fs::remove_file(&path).await {
                Ok(()) => {
                    info!(socket = %path.display(), "removed the dead socket of another plugin instance")
                }
                Err(error) => warn!(socket = %path.display(), %error, "cannot remove a dead plugin socket"),
            }
        }
    }
}

/// Creates the socket's directory, removes a stale socket file, binds, sets [`SOCKET_MODE`]
/// and listens.
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
    let bind_error = |source| ServerError::Bind {
        kind,
        path: path.to_path_buf(),
        source,
    };
    // Bound but not yet listening: a connect is refused until the mode is set, so nobody
    // connects under the umask's mode.
    let socket = tokio::net::UnixSocket::new_stream().map_err(bind_error)?;
    socket.bind(path).map_err(bind_error)?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
        .await
        .map_err(|source| ServerError::SetMode {
            kind,
            path: path.to_path_buf(),
            mode: SOCKET_MODE,
            source,
        })?;
    socket.listen(LISTEN_BACKLOG).map_err(bind_error)
}
