//! Socket lifecycle: directories, stale sockets, DRA before registration, cleanup order.

use std::{collections::HashMap, path::Path, sync::Arc, time::Duration};

use dra_kubelet::{
    ClaimRef, DraDriver, PluginServer, PluginServerConfig, PrepareOutcome, ServerError, SocketKind,
    UnprepareOutcome,
};
use migdra_proto::registration::{InfoRequest, registration_client::RegistrationClient};
use migdra_testkit::dra_kubelet::{
    DRIVER, GUARD, ScriptedDriver, channel, plugin_server, prepare_one, serve_registered, short_tempdir,
    shut_down,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

fn server<D: DraDriver>(root: &Path, driver: Arc<D>) -> PluginServer<D> {
    plugin_server(PluginServerConfig::new(root, DRIVER), driver)
}

async fn plugin_name(socket: &Path) -> String {
    RegistrationClient::new(channel(socket).await)
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner()
        .name
}

/// Polls (as a wait, bounded by the guard) until `path` has the wanted existence.
async fn wait_for_existence(path: &Path, exists: bool) {
    tokio::time::timeout(GUARD, async {
        while path.exists() != exists {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("socket state reached in time");
}

#[tokio::test]
async fn dra_socket_serves_before_the_registration_socket_exists() {
    let dir = short_tempdir();
    let shutdown = CancellationToken::new();
    let dra = server(dir.path(), Arc::new(ScriptedDriver::default()))
        .serve_dra(shutdown.clone())
        .await
        .expect("serve DRA");
    let registration_socket = dra.registration_socket();

    assert!(!registration_socket.exists(), "not registered yet");
    assert!(
        !registration_socket.parent().expect("dir").exists(),
        "registration dir untouched"
    );
    let response = prepare_one(&dra.dra_socket(), "ok-1").await;
    assert_eq!(
        response.claims["ok-1"].error, "",
        "DRA answers before registration"
    );

    let serving = dra.register().await.expect("register");
    assert!(registration_socket.exists());
    assert_eq!(plugin_name(&registration_socket).await, DRIVER);
    shut_down(&shutdown, serving).await;
}

#[tokio::test]
async fn stale_sockets_are_replaced() {
    let dir = short_tempdir();
    let config = PluginServerConfig::new(dir.path(), DRIVER);
    for path in [config.dra_socket(), config.registration_socket()] {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        // What a crashed plugin leaves behind: a socket file nobody listens on.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        assert!(std::os::unix::net::UnixStream::connect(&path).is_err(), "stale");
    }

    let shutdown = CancellationToken::new();
    let serving = serve_registered(
        server(dir.path(), Arc::new(ScriptedDriver::default())),
        shutdown.clone(),
    )
    .await;
    assert_eq!(prepare_one(serving.dra_socket(), "ok-1").await.claims.len(), 1);
    assert_eq!(plugin_name(serving.registration_socket()).await, DRIVER);
    shut_down(&shutdown, serving).await;
}

/// The permission bits of `path`.
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).expect("stat").permissions().mode() & 0o7777
}

#[tokio::test]
async fn both_sockets_get_their_mode_not_the_umasks_nor_the_stale_ones() {
    use std::os::unix::fs::PermissionsExt;
    let dir = short_tempdir();
    let config = PluginServerConfig::new(dir.path(), DRIVER);
    // A stale socket anyone could connect to: the new one must not inherit that.
    let stale = config.dra_socket();
    std::fs::create_dir_all(stale.parent().expect("dir")).expect("mkdir");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o777)).expect("chmod");

    let shutdown = CancellationToken::new();
    let serving = serve_registered(
        server(dir.path(), Arc::new(ScriptedDriver::default())),
        shutdown.clone(),
    )
    .await;
    assert_eq!(
        dra_kubelet::SOCKET_MODE,
        0o600,
        "owner only: the kubelet runs as root"
    );
    for socket in [serving.dra_socket(), serving.registration_socket()] {
        assert_eq!(mode(socket), dra_kubelet::SOCKET_MODE, "{}", socket.display());
    }
    // The kubelet (root, like this test) still connects to both.
    assert_eq!(
        prepare_one(serving.dra_socket(), "ok-1").await.claims["ok-1"].error,
        ""
    );
    assert_eq!(plugin_name(serving.registration_socket()).await, DRIVER);
    shut_down(&shutdown, serving).await;
}

#[tokio::test]
async fn run_serves_until_cancelled_then_removes_both_sockets() {
    let dir = short_tempdir();
    let config = PluginServerConfig::new(dir.path(), DRIVER);
    let (dra_socket, registration_socket) = (config.dra_socket(), config.registration_socket());
    let shutdown = CancellationToken::new();
    let run = tokio::spawn(server(dir.path(), Arc::new(ScriptedDriver::default())).run(shutdown.clone()));

    wait_for_existence(&registration_socket, true).await;
    assert!(
        dra_socket.exists(),
        "the DRA socket exists whenever the registration socket does"
    );
    assert_eq!(plugin_name(&registration_socket).await, DRIVER);
    assert_eq!(prepare_one(&dra_socket, "ok-1").await.claims["ok-1"].error, "");

    shutdown.cancel();
    tokio::time::timeout(GUARD, run)
        .await
        .expect("in time")
        .expect("joined")
        .expect("clean");
    assert!(!registration_socket.exists());
    assert!(!dra_socket.exists());
    assert!(dra_socket.parent().expect("dir").exists(), "directories stay");
}

/// A driver whose prepare blocks until released, to hold a call in flight.
#[derive(Default)]
struct GateDriver {
    entered: Notify,
    release: Notify,
}

impl DraDriver for GateDriver {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, PrepareOutcome> {
        self.entered.notify_one();
        self.release.notified().await;
        claims.into_iter().map(|c| (c.uid, Ok(Vec::new()))).collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> HashMap<String, UnprepareOutcome> {
        claims.into_iter().map(|c| (c.uid, Ok(()))).collect()
    }
}

#[tokio::test]
async fn shutdown_deregisters_first_and_lets_in_flight_calls_finish() {
    let dir = short_tempdir();
    let driver = Arc::new(GateDriver::default());
    let shutdown = CancellationToken::new();
    let serving = serve_registered(server(dir.path(), Arc::clone(&driver)), shutdown.clone()).await;
    let (dra_socket, registration_socket) = (
        serving.dra_socket().to_path_buf(),
        serving.registration_socket().to_path_buf(),
    );

    let call = tokio::spawn({
        let dra_socket = dra_socket.clone();
        async move { prepare_one(&dra_socket, "slow-1").await }
    });
    tokio::time::timeout(GUARD, driver.entered.notified())
        .await
        .expect("prepare started");

    shutdown.cancel();
    let wait = tokio::spawn(serving.wait());
    wait_for_existence(&registration_socket, false).await;
    assert!(
        dra_socket.exists(),
        "the DRA socket outlives the registration socket while a call is in flight"
    );

    driver.release.notify_one();
    let response = tokio::time::timeout(GUARD, call)
        .await
        .expect("in time")
        .expect("joined");
    assert_eq!(
        response.claims["slow-1"].error, "",
        "the in-flight prepare completed"
    );
    tokio::time::timeout(GUARD, wait)
        .await
        .expect("in time")
        .expect("joined")
        .expect("clean");
    assert!(!dra_socket.exists());
}

#[tokio::test]
async fn dropping_the_server_removes_both_sockets() {
    let dir = short_tempdir();
    let serving = serve_registered(
        server(dir.path(), Arc::new(ScriptedDriver::default())),
        CancellationToken::new(),
    )
    .await;
    let (dra_socket, registration_socket) = (
        serving.dra_socket().to_path_buf(),
        serving.registration_socket().to_path_buf(),
    );
    assert!(dra_socket.exists() && registration_socket.exists());
    drop(serving);
    assert!(!registration_socket.exists());
    assert!(!dra_socket.exists());
}

#[tokio::test]
async fn registration_failure_shuts_the_dra_socket_down() {
    let dir = short_tempdir();
    // A file where the registration directory belongs.
    std::fs::write(dir.path().join("plugins_registry"), b"not a dir").expect("write");
    let dra = server(dir.path(), Arc::new(ScriptedDriver::default()))
        .serve_dra(CancellationToken::new())
        .await
        .expect("serve DRA");
    let dra_socket = dra.dra_socket();
    assert!(dra_socket.exists());
    let error = match dra.register().await {
        Ok(_) => panic!("registration directory cannot be created"),
        Err(error) => error,
    };
    match &error {
        ServerError::CreateDir { kind, path, .. } => {
            assert_eq!(*kind, SocketKind::Registration);
            assert_eq!(path, &dir.path().join("plugins_registry"));
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert!(error.to_string().contains("plugins_registry"), "{error}");
    assert!(
        !dra_socket.exists(),
        "DRA socket removed after the failed registration"
    );
}

#[tokio::test]
async fn unusable_paths_and_names_are_refused() {
    let dir = short_tempdir();
    let long_root = dir.path().join("x".repeat(100));
    let error = server(&long_root, Arc::new(ScriptedDriver::default()))
        .serve_dra(CancellationToken::new())
        .await
        .err()
        .expect("path too long");
    assert!(
        matches!(&error, ServerError::PathTooLong { kind: SocketKind::Dra, len, .. } if *len > 107),
        "{error:?}"
    );
    assert!(!long_root.exists(), "nothing created for an unusable path");

    for name in ["", "..", "a/b"] {
        let config = PluginServerConfig::new(dir.path(), name);
        let error = plugin_server(config, Arc::new(ScriptedDriver::default()))
            .serve_dra(CancellationToken::new())
            .await
            .err()
            .expect("invalid name");
        assert!(matches!(error, ServerError::InvalidDriverName(_)), "{error:?}");
    }
}
