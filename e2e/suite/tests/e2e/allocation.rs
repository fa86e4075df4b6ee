//! One claim through its life: allocated, prepared into exactly the MIG instance the
//! container receives, and released (instance and CDI spec gone) when the pod finishes.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use migdra_api::device_name::DeviceName;
use migdra_e2e::{
    cluster::{Cluster, DRIVER, wait_until},
    workload::{self, create_pod, create_template, profile_is, wait_phase},
};

use crate::support::{SHORT, device_health, instances, mig, settle};

tests![
    mig_pod_gets_exactly_its_instance,
    finished_pod_releases_its_instance
];

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
    // The container received exactly that instance.
    let record = workload::container_record(&cluster.layout.records_dir, "mig-3g", "main")?;
    ensure!(
        record.env_value("NVIDIA_VISIBLE_DEVICES") == Some(mig_uuid.as_str()),
        "env {:?}",
        record.env
    );
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    ensure!(
        record.cdi_devices == vec![format!("{DRIVER}/claim={uid}-{device}")],
        "CDI devices {:?}",
        record.cdi_devices
    );
    let paths: Vec<&str> = record.device_nodes.iter().map(|n| n.path.as_str()).collect();
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
    let caps: Vec<_> = record
        .device_nodes
        .iter()
        .filter(|n| n.path.starts_with("/dev/nvidia-caps/"))
        .collect();
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
        caps.iter().any(|n| n.minor == gi_minor),
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
    let spec = cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
    wait_until(SHORT, || async { (!spec.exists()).then_some(()) })
        .await
        .context("CDI spec not removed")?;
    ensure!(
        workload::phase(&c, "short-job").await.as_deref() == Some("Succeeded"),
        "the pod was not deleted, it completed"
    );
    settle(cluster).await
}
