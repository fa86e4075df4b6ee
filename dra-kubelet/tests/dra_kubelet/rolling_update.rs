//! Rolling update: two plugin instances of one driver on one kubelet, each with its own socket
//! names; stopping one removes only its sockets while the other keeps serving.

use std::{path::Path, sync::Arc};

use dra_kubelet::{PluginServerConfig, PluginServing, ServerError};
use migdra_proto::registration::{InfoRequest, registration_client::RegistrationClient};
use migdra_testkit::dra_kubelet::{
    DRIVER, ScriptedDriver, channel, plugin_server, prepare_one, serve_registered, short_tempdir,
};
use tokio_util::sync::CancellationToken;

async fn serve(
    root: &Path,
    instance: &str,
    shutdown: CancellationToken,
) -> (Arc<ScriptedDriver>, PluginServing) {
    let driver = Arc::new(ScriptedDriver::default());
    let config = PluginServerConfig::new(root, DRIVER).with_instance(instance);
    let serving = serve_registered(plugin_server(config, Arc::clone(&driver)), shutdown).await;
    (driver, serving)
}

async fn announced_endpoint(registration_socket: &Path) -> String {
    RegistrationClient::new(channel(registration_socket).await)
        .get_info(InfoRequest {})
        .await
        .expect("GetInfo")
        .into_inner()
        .endpoint
}

#[test]
fn an_instance_name_makes_both_socket_names_unique_and_empty_keeps_the_fixed_ones() {
    let fixed = PluginServerConfig::new("/var/lib/kubelet", DRIVER);
    assert_eq!(
        fixed.dra_socket(),
        Path::new("/var/lib/kubelet/plugins/dra.example.com/dra.sock")
    );
    assert_eq!(
        fixed.registration_socket(),
        Path::new("/var/lib/kubelet/plugins_registry/dra.example.com-reg.sock")
    );
    let empty = fixed.clone().with_instance("");
    assert_eq!(empty.dra_socket(), fixed.dra_socket());
    assert_eq!(empty.registration_socket(), fixed.registration_socket());

    let pod = fixed.with_instance("6f1c2a9e-uid");
    assert_eq!(
        pod.dra_socket(),
        Path::new("/var/lib/kubelet/plugins/dra.example.com/dra-6f1c2a9e-uid.sock")
    );
    assert_eq!(
        pod.registration_socket(),
        Path::new("/var/lib/kubelet/plugins_registry/dra.example.com-6f1c2a9e-uid-reg.sock")
    );
}

#[tokio::test]
async fn an_instance_name_with_a_path_separator_is_refused() {
    let dir = short_tempdir();
    let config = PluginServerConfig::new(dir.path(), DRIVER).with_instance("../evil");
    let result = plugin_server(config, Arc::new(ScriptedDriver::default()))
        .serve_dra(CancellationToken::new())
        .await;
    match result {
        Err(ServerError::InvalidInstanceName(name)) => assert_eq!(name, "../evil"),
        Err(other) => panic!("wrong error: {other}"),
        Ok(_) => panic!("an instance name with a slash was accepted"),
    }
}

#[tokio::test]
async fn two_instances_serve_side_by_side_and_stopping_one_leaves_the_other() {
    let dir = short_tempdir();
    let (old_stop, new_stop) = (CancellationToken::new(), CancellationToken::new());
    let (old_driver, old) = serve(dir.path(), "old-pod", old_stop.clone()).await;
    let (new_driver, new) = serve(dir.path(), "new-pod", new_stop.clone()).await;
    let (old_dra, old_reg) = (
        old.dra_socket().to_path_buf(),
        old.registration_socket().to_path_buf(),
    );
    let (new_dra, new_reg) = (
        new.dra_socket().to_path_buf(),
        new.registration_socket().to_path_buf(),
    );
    assert_ne!(old_dra, new_dra);
    assert_ne!(old_reg, new_reg);

    // Starting the new instance removed nothing of the old one: each announces its own DRA
    // socket, and both answer.
    assert_eq!(announced_endpoint(&old_reg).await, old_dra.to_string_lossy());
    assert_eq!(announced_endpoint(&new_reg).await, new_dra.to_string_lossy());
    assert!(
        prepare_one(&old_dra, "ok-old").await.claims["ok-old"]
            .error
            .is_empty()
    );
    assert!(
        prepare_one(&new_dra, "ok-new").await.claims["ok-new"]
            .error
            .is_empty()
    );

    old_stop.cancel();
    old.wait().await.expect("old instance shuts down cleanly");
    assert!(
        !old_dra.exists() && !old_reg.exists(),
        "the old instance removed its sockets"
    );
    assert!(
        new_dra.exists() && new_reg.exists(),
        "the new instance's sockets stay"
    );
    assert_eq!(announced_endpoint(&new_reg).await, new_dra.to_string_lossy());
    assert!(
        prepare_one(&new_dra, "ok-after").await.claims["ok-after"]
            .error
            .is_empty()
    );

    let calls = |d: &ScriptedDriver| -> Vec<String> {
        let calls = d.prepare_calls.lock().expect("lock");
        calls.iter().flatten().map(|c| c.uid.clone()).collect()
    };
    assert_eq!(calls(&old_driver), ["ok-old"]);
    assert_eq!(calls(&new_driver), ["ok-new", "ok-after"]);

    new_stop.cancel();
    new.wait().await.expect("new instance shuts down cleanly");
    assert!(!new_dra.exists() && !new_reg.exists());
}

#[tokio::test]
async fn a_starting_instance_removes_dead_sockets_of_others_and_keeps_live_ones() {
    let dir = short_tempdir();
    let config = |instance: &str| PluginServerConfig::new(dir.path(), DRIVER).with_instance(instance);
    // A killed instance: its socket files stay, nobody listens.
    let dead = config("killed-pod");
    for path in [dead.dra_socket(), dead.registration_socket()] {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
    }
    // Files that are not plugin sockets stay whatever they are.
    let checkpoint = dead.dra_socket().with_file_name("checkpoint.json");
    std::fs::write(&checkpoint, b"{}").unwrap();
    let other_driver = dir.path().join("plugins_registry/other.example.com-x-reg.sock");
    drop(std::os::unix::net::UnixListener::bind(&other_driver).unwrap());

    let live_stop = CancellationToken::new();
    let (_live_driver, live) = serve(dir.path(), "live-pod", live_stop.clone()).await;
    let new_stop = CancellationToken::new();
    let (_new_driver, new) = serve(dir.path(), "new-pod", new_stop.clone()).await;

    assert!(
        !dead.dra_socket().exists() && !dead.registration_socket().exists(),
        "dead sockets removed"
    );
    assert!(
        live.dra_socket().exists() && live.registration_socket().exists(),
        "live sockets kept"
    );
    assert_eq!(
        announced_endpoint(live.registration_socket()).await,
        live.dra_socket().to_string_lossy()
    );
    assert!(checkpoint.exists() && other_driver.exists());
    // Each sees the other as the live peer that keeps serving the node.
    let live_config = config("live-pod");
    let new_config = config("new-pod");
    assert_eq!(
        new_config.live_peer_registrations().await,
        [live.registration_socket().to_path_buf()]
    );
    assert_eq!(
        live_config.live_peer_registrations().await,
        [new.registration_socket().to_path_buf()]
    );

    live_stop.cancel();
    live.wait().await.expect("clean shutdown");
    assert!(
        new_config.live_peer_registrations().await.is_empty(),
        "the last instance has no peer"
    );
    new_stop.cancel();
    new.wait().await.expect("clean shutdown");
}
