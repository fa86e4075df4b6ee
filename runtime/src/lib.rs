//! Process plumbing shared by `migdra-controller` and `migdra-kubelet-plugin`: the flags both
//! take ([`ProcessArgs`]), logging setup, the HTTP endpoint for metrics and probes, shutdown on
//! signals ([`Process`]), and the Kubernetes client.

use std::{
    convert::Infallible,
    net::SocketAddr,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The flags of both binaries' processes, each also from an environment variable.
#[derive(Clone, Debug, clap::Args)]
pub struct ProcessArgs {
    /// Kubeconfig file (default: $KUBECONFIG, ~/.kube/config or the in-cluster configuration).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log filter, RUST_LOG syntax.
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Address of the HTTP endpoint (/metrics, /healthz, /readyz).
    #[arg(long, env = "HTTP_ADDRESS", default_value = "0.0.0.0:8080")]
    pub http_address: SocketAddr,
    /// Worker threads of the async runtime (NVML and file work run on blocking threads
    /// besides). Fixed rather than one per core, so memory does not grow with the machine.
    #[arg(long, env = "WORKER_THREADS", default_value_t = DEFAULT_WORKER_THREADS,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub worker_threads: u16,
}

/// Errors of starting a process's plumbing.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("setting up logging: {0}")]
    Logging(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("starting the HTTP endpoint: {0}")]
    Http(#[from] HttpError),
}

impl ProcessArgs {
    /// Installs the global tracing subscriber with the configured format and filter.
    pub fn init_logging(&self) -> Result<(), StartError> {
        init_logging(self.log_format, &self.log_level).map_err(StartError::Logging)
    }

    /// Installs the signal handlers and serves `metrics` and the probes on the HTTP address.
    pub async fn start(
        &self,
        metrics: impl Fn() -> String + Send + Sync + 'static,
    ) -> Result<Process, StartError> {
        let shutdown = shutdown_on_signals().map_err(StartError::Signals)?;
        let ready = Readiness::default();
        let (addr, http_task) = serve_http(
            self.http_address,
            Arc::new(metrics),
            ready.clone(),
            shutdown.clone(),
        )
        .await?;
        tracing::info!(http_addr = %addr, "serving metrics and probes");
        Ok(Process {
            shutdown,
            ready,
            http_task,
        })
    }
}

/// A started process: its shutdown signal, its readiness and its HTTP endpoint.
#[derive(Debug)]
pub struct Process {
    /// Fires on SIGTERM or SIGINT, or when the process cancels it to stop.
    pub shutdown: CancellationToken,
    /// What `/readyz` reports.
    pub ready: Readiness,
    /// The HTTP endpoint; it ends once `shutdown` fires.
    pub http_task: JoinHandle<()>,
}

/// Installs the global tracing subscriber. `filter` uses `RUST_LOG` syntax (e.g. `info` or
/// `migdra=debug,kube=info`).
pub fn init_logging(format: LogFormat, filter: &str) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let filter = EnvFilter::try_new(filter)?;
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(fmt::layer().with_target(true)).try_init()?,
        LogFormat::Json => registry
            .with(fmt::layer().json().flatten_event(true).with_current_span(false))
            .try_init()?,
    }
    Ok(())
}

/// Worker threads of the async runtime unless a flag says otherwise. Not the node's core
/// count (tokio's default): a GPU node has 100 or more cores, and every worker thread keeps
/// memory of its own (stack, allocator arena) for work that two threads carry.
pub const DEFAULT_WORKER_THREADS: u16 = 2;

/// The multi-threaded async runtime with `worker_threads` workers (blocking work, such as
/// NVML and file calls, runs on tokio's separate blocking threads, whatever this number).
pub fn async_runtime(worker_threads: u16) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(usize::from(worker_threads.max(1)))
        .enable_all()
        .build()
}

/// A cancellation token that fires on SIGTERM or SIGINT.
pub fn shutdown_on_signals() -> Result<CancellationToken, std::io::Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let fire = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
            _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
        }
        fire.cancel();
    });
    Ok(token)
}

/// Why no Kubernetes client could be made.
#[derive(Debug, thiserror::Error)]
pub enum KubeClientError {
    #[error("reading the kubeconfig {path}: {source}")]
    Kubeconfig {
        path: std::path::PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No usable configuration (neither in-cluster nor $KUBECONFIG).
    #[error("finding the cluster configuration: {0}")]
    Infer(#[from] kube::config::InferConfigError),
    #[error("creating the Kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// A Kubernetes client from an explicit kubeconfig file, or else the usual inference
/// (in-cluster service account, then `$KUBECONFIG` / `~/.kube/config`).
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client, KubeClientError> {
    Ok(kube::Client::try_from(kube_config(kubeconfig).await?)?)
}

/// The configuration [`kube_client`] makes its client from, for a second client with other
/// settings (the plugin's heartbeat client, which retries its own way).
pub async fn kube_config(kubeconfig: Option<&std::path::Path>) -> Result<kube::Config, KubeClientError> {
    Ok(match kubeconfig {
        Some(path) => {
            let error = |source| KubeClientError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let kubeconfig = kube::config::Kubeconfig::read_from(path).map_err(error)?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(error)?
        }
        None => kube::Config::infer().await?,
    })
}

/// A readiness flag the HTTP endpoint reports on `/readyz`.
#[derive(Clone, Debug, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Relaxed);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

type MetricsRenderer = Arc<dyn Fn() -> String + Send + Sync>;

/// Errors of the HTTP endpoint.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Binds `addr` and serves `/metrics` (OpenMetrics text), `/healthz` (always 200 while the
/// process serves) and `/readyz` (200 when `ready` is set) until `shutdown` fires. Returns
/// the bound address (useful with port 0) and the serving task.
async fn serve_http(
    addr: SocketAddr,
    metrics: MetricsRenderer,
    ready: Readiness,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, JoinHandle<()>), HttpError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| HttpError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| HttpError::Bind { addr, source })?;
    let task = tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                _ = shutdown.cancelled() => break,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accepting an HTTP connection failed");
                        continue;
                    }
                },
            };
            let metrics = metrics.clone();
            let ready = ready.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let metrics = metrics.clone();
                    let ready = ready.clone();
                    async move { Ok::<_, Infallible>(respond(&req, &metrics, &ready)) }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
            });
        }
    });
    Ok((bound, task))
}

fn respond(req: &Request<Incoming>, metrics: &MetricsRenderer, ready: &Readiness) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match req.uri().path() {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics(),
        ),
        "/healthz" | "/livez" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
        "/readyz" if ready.get() => (StatusCode::OK, "text/plain", "ready\n".to_string()),
        "/readyz" => (
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "not ready\n".to_string(),
        ),
        _ => (StatusCode::NOT_FOUND, "text/plain", "not found\n".to_string()),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_metrics_and_probes() {
        let ready = Readiness::default();
        let shutdown = CancellationToken::new();
        let (addr, task) = serve_http(
            "127.0.0.1:0".parse().unwrap(),
            Arc::new(|| "# EOF\n".to_string()),
            ready.clone(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        assert!(get(addr, "/metrics").await.ends_with("# EOF\n"));
        assert!(get(addr, "/healthz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 503"));
        ready.set(true);
        assert!(get(addr, "/readyz").await.starts_with("HTTP/1.1 200"));
        assert!(get(addr, "/nope").await.starts_with("HTTP/1.1 404"));
        shutdown.cancel();
        task.await.unwrap();
    }
}
