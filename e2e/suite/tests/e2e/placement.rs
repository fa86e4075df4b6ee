//! Placement across claims: partitions pack a GPU, whole GPUs and partitions exclude each
//! other, and a `firstAvailable` request falls back when its first choice does not fit.

use std::time::Duration;

use anyhow::{Context, ensure};
use migdra_e2e::{
    cluster::Cluster,
    workload::{self, Request, create_pod, create_template, on_gpu, profile_is, wait_phase},
};

use crate::support::{MIG, SHORT, WHOLE, check_driver_files, gpu_uuid, instances, mig, settle};

tests![
    seven_1g_pods_pack_one_gpu_and_an_eighth_waits,
    whole_gpu_and_partitions_exclude_each_other,
    first_available_falls_back_when_no_2g_fits,
];

async fn seven_1g_pods_pack_one_gpu_and_an_eighth_waits(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let uuid = gpu_uuid(cluster, 1);
    create_template(&c, "one-g", mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]), None).await?;
    create_pod(&c, "pack-1", "one-g", &["sleep", "60"], true).await?;
    for i in 2..=7 {
        create_pod(&c, &format!("pack-{i}"), "one-g", &["sleep", "3600"], true).await?;
    }
    for i in 1..=7 {
        wait_phase(&c, &format!("pack-{i}"), "Running", Duration::from_secs(90)).await?;
    }
    let mut starts: Vec<u32> = instances(cluster, 1)
        .iter()
        .filter(|(p, _, _)| *p == 19)
        .map(|(_, s, _)| *s)
        .collect();
    starts.sort_unstable();
    ensure!(
        starts == vec![0, 1, 2, 3, 4, 5, 6],
        "GPU 1 holds 1g instances at {starts:?}"
    );
    create_pod(&c, "pack-8", "one-g", &["sleep", "3600"], true).await?;
    // The eighth cannot be scheduled while the seven run.
    workload::wait_unschedulable(&c, "pack-8", SHORT).await?;
    ensure!(
        workload::phase(&c, "pack-1").await.as_deref() == Some("Running"),
        "pack-1 finished too early for the check"
    );
    wait_phase(&c, "pack-1", "Succeeded", Duration::from_secs(90)).await?;
    wait_phase(&c, "pack-8", "Running", Duration::from_secs(120)).await?;
    ensure!(instances(cluster, 1).len() == 7);
    settle(cluster).await
}

async fn whole_gpu_and_partitions_exclude_each_other(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let uuid = gpu_uuid(cluster, 1);
    create_template(&c, "part", mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]), None).await?;
    create_template(
        &c,
        "whole",
        Request::Exactly {
            class: WHOLE.into(),
            selectors: vec![on_gpu(&uuid)],
        },
        None,
    )
    .await?;
    create_pod(&c, "part-1", "part", &["sleep", "3600"], false).await?;
    wait_phase(&c, "part-1", "Running", SHORT).await?;
    create_pod(&c, "whole-1", "whole", &["sleep", "3600"], false).await?;
    workload::wait_unschedulable(&c, "whole-1", SHORT)
        .await
        .context("whole GPU allocated next to a partition")?;
    workload::delete_pods(&c, &["part-1"]).await?;
    wait_phase(&c, "whole-1", "Running", Duration::from_secs(120)).await?;
    let gpu = cluster.gpus()?.gpus.into_iter().find(|g| g.minor == 1).unwrap();
    ensure!(
        !gpu.mig_enabled && gpu.gpu_instances.is_empty(),
        "whole GPU needs MIG off and no instances"
    );
    let view = workload::container_view(&c, "whole-1", "main").await?;
    ensure!(
        view.device_uuid("gpu-1") == Some(uuid.as_str()),
        "env {:?}",
        view.env
    );
    // A whole GPU gets its device node and the same driver files as a partition.
    ensure!(
        view.device_nodes()
            .iter()
            .any(|n| n.path == "/dev/nvidia1" && n.minor == Some(1)),
        "{:?}",
        view.devices
    );
    ensure!(
        view.capability_minors().is_empty(),
        "a whole GPU has no MIG capability nodes: {:?}",
        view.devices
    );
    check_driver_files(cluster, &view)?;
    create_pod(&c, "part-2", "part", &["sleep", "3600"], false).await?;
    workload::wait_unschedulable(&c, "part-2", SHORT)
        .await
        .context("partition allocated on a GPU in use whole")?;
    workload::delete_pods(&c, &["whole-1"]).await?;
    wait_phase(&c, "part-2", "Running", Duration::from_secs(120)).await?;
    ensure!(
        cluster
            .gpus()?
            .gpus
            .iter()
            .find(|g| g.minor == 1)
            .unwrap()
            .mig_enabled,
        "MIG switched back on"
    );
    settle(cluster).await
}

async fn first_available_falls_back_when_no_2g_fits(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let a100 = gpu_uuid(cluster, 2);
    create_template(&c, "a100-4g", mig(&[profile_is("4g.20gb"), on_gpu(&a100)]), None).await?;
    create_template(&c, "a100-2g", mig(&[profile_is("2g.10gb"), on_gpu(&a100)]), None).await?;
    create_pod(&c, "fill-4g", "a100-4g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "fill-4g", "Running", SHORT).await?;
    create_pod(&c, "fill-2g", "a100-2g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "fill-2g", "Running", SHORT).await?;
    // Slices 0-5 are taken: no 2g placement (0, 2, 4) is free, but a 1g fits at 6.
    let chain = Request::FirstAvailable(vec![
        (
            "big".into(),
            MIG.into(),
            vec![profile_is("2g.10gb"), on_gpu(&a100)],
        ),
        (
            "small".into(),
            MIG.into(),
            vec![profile_is("1g.5gb"), on_gpu(&a100)],
        ),
    ]);
    create_template(&c, "fallback", chain, None).await?;
    create_pod(&c, "fallback", "fallback", &["sleep", "3600"], false).await?;
    wait_phase(&c, "fallback", "Running", SHORT).await?;
    let claim = workload::pod_claim(&c, "fallback").await?;
    let allocated = workload::allocated(&claim);
    ensure!(
        allocated.len() == 1 && allocated[0].0 == "gpu/small",
        "{allocated:?}"
    );
    ensure!(allocated[0].1 == "gpu-2-mig-1g5gb-6", "{allocated:?}");
    let view = workload::container_view(&c, "fallback", "main").await?;
    ensure!(
        view.device_uuid("gpu-2-mig-1g5gb-6")
            .is_some_and(|v| v.starts_with("MIG-")),
        "env {:?}",
        view.env
    );
    settle(cluster).await
}
