//! One claim through its life: allocated, prepared into exactly the MIG instance the
//! container receives, and released (instance and CDI spec gone) when the pod finishes.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use migdra_api::device_name::DeviceName;
use migdra_e2e::{
    cluster::{Cluster, wait_until},
    workload::{self, create_pod, create_template, profile_is, wait_phase},
};

use crate::support::{
    SHORT, check_driver_files, claim_spec, device_health, instances, mig, mig_instance, settle,
};

tests![
    mig_pod_gets_exactly_its_instance,
    two_claims_in_one_container_get_both_devices_and_one_set_of_driver_files,
    finished_pod_releases_its_instance
];

/// The MIG device's GI and CI capability minors, from the simulated /proc.
fn capability_minors(cluster: &Cluster, device: &str) -> anyhow::Result<Vec<i64>> {
    let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
        bail!("{device} is not MIG")
    };
    Ok(mig_instance(cluster, minor, start)?.0)
}

async fn two_claims_in_one_container_get_both_devices_and_one_set_of_driver_files(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "pair-1g", mig(&[profile_is("1g.10gb")]), None).await?;
    create_template(&c, "pair-2g", mig(&[profile_is("2g.20gb")]), None).await?;
    workload::create_pod_with_claims(&c, "pair", &["pair-1g", "pair-2g"]).await?;
    wait_phase(&c, "pair", "Running", SHORT).await?;
    let view = workload::container_view(&c, "pair", "main").await?;
    let mut devices = Vec::new();
    let mut uids = Vec::new();
    for name in ["claim-0", "claim-1"] {
        let claim = workload::pod_claim_named(&c, "pair", name).await?;
        let allocated = workload::allocated(&claim);
        ensure!(allocated.len() == 1, "{name}: {allocated:?}");
        devices.push(allocated[0].1.clone());
        uids.push(claim.metadata.uid.clone().unwrap_or_default());
    }
    let state = cluster.gpus()?;
    let caps = view.capability_minors();
    for device in &devices {
        // Each device's capability nodes (GI and CI) and its own UUID variable are there.
        for minor in capability_minors(cluster, device)? {
            ensure!(
                caps.contains(&minor),
                "{device}: capability minor {minor} not in {caps:?}"
            );
        }
        let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
            bail!("{device} is not MIG")
        };
        let uuid = state
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .and_then(|g| g.gpu_instances.iter().find(|gi| gi.start == start))
            .and_then(|gi| gi.compute_instances.first())
            .map(|ci| ci.uuid.clone())
            .context("no instance")?;
        ensure!(
            view.device_uuid(device) == Some(uuid.as_str()),
            "{device}: env {:?}",
            view.env
        );
    }
    ensure!(
        caps.len() == 4,
        "two GI and two CI capability nodes: {:?}",
        view.devices
    );
    // Both claims' specs are in the CDI directory; each names the driver's files (the
    // driver device) for the container. The container got those files once.
    for uid in &uids {
        let spec = claim_spec(cluster, uid);
        ensure!(spec.exists(), "no CDI spec {}", spec.display());
    }
    check_driver_files(cluster, &view)?;
    settle(cluster).await
}

async fn mig_pod_gets_exactly_its_instance(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "mig-3g", mig(&[profile_is("3g.40gb")]), None).await?;
    create_pod(&c, "mig-3g", "mig-3g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "mig-3g", "Running", SHORT).await?;
    let claim = workload::pod_claim(&c, "mig-3g").await?;
    let allocated = workload::allocated(&claim);
    ensure!(allocated.len() == 1, "{allocated:?}");
    let device = &allocated[0].1;
    let DeviceName::Mig {
        minor,
        profile,
        start,
    } = device.parse::<DeviceName>()?
    else {
        bail!("{device} is not MIG")
    };
    ensure!(profile.to_string() == "3g.40gb");
    // The instance exists at the allocated placement (3g is GI profile 9).
    let on_gpu: Vec<_> = instances(cluster, minor)
        .into_iter()
        .filter(|(p, s, _)| *p == 9 && *s == start)
        .collect();
    ensure!(
        on_gpu.len() == 1,
        "no 3g instance at {start} on GPU {minor}: {:?}",
        instances(cluster, minor)
    );
    let mig_uuid = on_gpu[0].2.first().context("no compute instance")?.clone();
    // The container received exactly that instance, its claim's CDI spec applied.
    let view = workload::container_view(&c, "mig-3g", "main").await?;
    ensure!(
        view.device_uuid(device) == Some(mig_uuid.as_str()),
        "env {:?}",
        view.env
    );
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let spec = claim_spec(cluster, &uid);
    ensure!(spec.exists(), "no CDI spec {}", spec.display());
    // Plain runc gets a CUDA-capable container: the driver's libraries, found by the
    // dynamic linker, and no second injection by a NVIDIA runtime.
    check_driver_files(cluster, &view)?;
    let paths = view.device_paths();
    for expected in [
        format!("/dev/nvidia{minor}"),
        "/dev/nvidiactl".into(),
        "/dev/nvidia-uvm".into(),
    ] {
        ensure!(
            paths.contains(&expected.as_str()),
            "missing {expected} in {paths:?}"
        );
    }
    let caps = view.capability_minors();
    ensure!(caps.len() == 2, "GI and CI capability nodes: {caps:?}");
    // Their minors are the ones of this instance's capability files.
    let state = cluster.gpus()?;
    let gi = state
        .gpus
        .iter()
        .find(|g| g.minor == minor)
        .unwrap()
        .gpu_instances
        .iter()
        .find(|gi| gi.start == start)
        .unwrap();
    let access = cluster.layout.gpu_host.join(format!(
        "proc-root/driver/nvidia/capabilities/gpu{minor}/mig/gi{}/access",
        gi.id
    ));
    let text = std::fs::read_to_string(&access)?;
    let gi_minor: i64 = text
        .lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .context("minor")?
        .trim()
        .parse()?;
    ensure!(
        caps.contains(&gi_minor),
        "GI capability minor {gi_minor} not in {caps:?}"
    );
    // The kubelet shows the device's health from the plugin's health stream.
    let healthy = wait_until(Duration::from_secs(60), || async {
        device_health(cluster, "mig-3g", device)
            .await
            .filter(|h| h == "Healthy")
    })
    .await;
    ensure!(
        healthy.is_ok(),
        "device health stayed {:?}",
        device_health(cluster, "mig-3g", device).await
    );
    settle(cluster).await
}

async fn finished_pod_releases_its_instance(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    create_template(&c, "mig-2g", mig(&[profile_is("2g.20gb")]), None).await?;
    create_pod(&c, "short-job", "mig-2g", &["sleep", "10"], true).await?;
    wait_phase(&c, "short-job", "Running", SHORT).await?;
    let claim = workload::pod_claim(&c, "short-job").await?;
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let (_, device) = workload::allocated(&claim).pop().context("not allocated")?;
    let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
        bail!("not MIG")
    };
    ensure!(instances(cluster, minor).iter().any(|(_, s, _)| *s == start));
    wait_phase(&c, "short-job", "Succeeded", SHORT).await?;
    wait_until(SHORT, || async {
        (!instances(cluster, minor).iter().any(|(_, s, _)| *s == start)).then_some(())
    })
    .await
    .context("the instance was not destroyed after the pod finished")?;
    let spec = claim_spec(cluster, &uid);
    wait_until(SHORT, || async { (!spec.exists()).then_some(()) })
        .await
        .context("CDI spec not removed")?;
    ensure!(
        workload::phase(&c, "short-job").await.as_deref() == Some("Succeeded"),
        "the pod was not deleted, it completed"
    );
    settle(cluster).await
}
