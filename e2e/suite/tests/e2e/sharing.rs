//! Shared partitions: with a MigPolicy that shares `1g.10gb`, two pods with separate claims
//! are allocated shares of one device, the plugin creates one MIG instance for both (the same
//! MIG UUID in both containers), the instance survives the first pod and is destroyed after
//! the second. The policy is removed at the end, and the pool is back to exclusive devices.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use migdra_api::{
    device_name::DeviceName,
    policy::{MigPolicy, MigPolicySpec, SharingSpec},
    slices::SHARES_CAPACITY,
};
use migdra_e2e::{
    cluster::{Cluster, DRIVER, wait_until},
    workload::{self, create_pod, create_template, on_gpu, profile_is, wait_phase},
};

use crate::support::{SHORT, gpu_uuid, instances, mig, settle, slices};

tests![two_pods_share_one_1g_instance_until_the_second_ends];

/// The test's MigPolicy (the highest priority, so it applies whatever else exists).
const POLICY: &str = "e2e-sharing";

/// Names of the pool's devices published as shared.
async fn shared_devices(cluster: &Cluster) -> anyhow::Result<Vec<String>> {
    Ok(slices(cluster)
        .await?
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| d.allow_multiple_allocations == Some(true))
        .map(|d| d.name.clone())
        .collect())
}

/// The claim's one allocation result: device and share ID.
fn share_of(claim: &ResourceClaim) -> anyhow::Result<(String, String)> {
    let results = workload::allocation_results(claim);
    let [result] = results.as_slice() else {
        bail!("one result expected: {results:?}")
    };
    let share = result
        .share_id
        .clone()
        .with_context(|| format!("{} was allocated without a share ID", result.device))?;
    let consumed = result
        .consumed_capacity
        .as_ref()
        .and_then(|c| c.get(SHARES_CAPACITY))
        .map(|q| q.0.clone());
    ensure!(
        consumed.as_deref() == Some("1"),
        "the claim takes one share by default, consumed {consumed:?}"
    );
    Ok((result.device.clone(), share))
}

async fn two_pods_share_one_1g_instance_until_the_second_ends(cluster: &mut Cluster) -> anyhow::Result<()> {
    let policies: Api<MigPolicy> = Api::all(cluster.client.clone());
    let policy = MigPolicy::new(
        POLICY,
        MigPolicySpec {
            priority: i32::MAX,
            sharing: Some(SharingSpec {
                profiles: vec!["1g.10gb".into()],
                shares: Some(2),
            }),
            ..Default::default()
        },
    );
    policies.create(&PostParams::default(), &policy).await?;
    let outcome = share_one_instance(cluster).await;
    // Restore: the policy goes whatever happened, and the pool is exclusive again.
    let _ = policies.delete(POLICY, &DeleteParams::default()).await;
    let restored = wait_until(SHORT, || async {
        shared_devices(cluster).await.ok().filter(|d| d.is_empty())
    })
    .await
    .context("the pool still publishes shared devices after the policy was deleted");
    outcome?;
    restored?;
    settle(cluster).await
}

async fn share_one_instance(cluster: &Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    let published = wait_until(SHORT, || async {
        shared_devices(cluster).await.ok().filter(|d| !d.is_empty())
    })
    .await
    .context("the pool never published shared devices")?;
    ensure!(
        published.iter().all(|d| d.contains("-mig-1g10gb-")),
        "only 1g.10gb is shared: {published:?}"
    );
    let uuid = gpu_uuid(cluster, 0);
    create_template(
        &c,
        "shared-1g",
        mig(&[profile_is("1g.10gb"), on_gpu(&uuid)]),
        None,
    )
    .await?;
    create_pod(&c, "share-a", "shared-1g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "share-a", "Running", SHORT).await?;
    create_pod(&c, "share-b", "shared-1g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "share-b", "Running", SHORT).await?;

    let claim_a = workload::pod_claim(&c, "share-a").await?;
    let claim_b = workload::pod_claim(&c, "share-b").await?;
    let (device, share_a) = share_of(&claim_a)?;
    let (device_b, share_b) = share_of(&claim_b)?;
    ensure!(
        device == device_b,
        "both claims hold shares of one device: {device} and {device_b}"
    );
    ensure!(share_a != share_b, "two shares, two share IDs: {share_a}");
    let DeviceName::Mig { minor, start, .. } = device.parse::<DeviceName>()? else {
        bail!("{device} is not MIG")
    };
    // One instance (1g is GI profile 19) at the allocated placement, for both.
    let on_gpu: Vec<_> = instances(cluster, minor)
        .into_iter()
        .filter(|(p, s, _)| *p == 19 && *s == start)
        .collect();
    ensure!(on_gpu.len() == 1, "one instance: {:?}", instances(cluster, minor));
    let mig_uuid = on_gpu[0].2.first().context("no compute instance")?.clone();
    for pod in ["share-a", "share-b"] {
        let view = workload::container_view(&c, pod, "main").await?;
        ensure!(
            view.device_uuid(&device) == Some(mig_uuid.as_str()),
            "{pod} sees {mig_uuid}: env {:?}",
            view.env
        );
    }

    // The first pod ends: its claim is unprepared, the instance stays for the second.
    let uid_a = claim_a.metadata.uid.clone().unwrap_or_default();
    let uid_b = claim_b.metadata.uid.clone().unwrap_or_default();
    let spec = |uid: &str| cluster.layout.cdi_dir.join(format!("{DRIVER}-claim_{uid}.json"));
    workload::delete_pods(&c, &["share-a"]).await?;
    wait_until(SHORT, || async { (!spec(&uid_a).exists()).then_some(()) })
        .await
        .context("the first claim was not unprepared")?;
    let still: Vec<_> = instances(cluster, minor)
        .into_iter()
        .filter(|(p, s, _)| *p == 19 && *s == start)
        .collect();
    ensure!(
        still.len() == 1 && still[0].2.first() == Some(&mig_uuid),
        "the instance must survive the first pod: {still:?}"
    );
    ensure!(
        spec(&uid_b).exists(),
        "the second claim's CDI spec went with the first"
    );
    ensure!(
        workload::phase(&c, "share-b").await.as_deref() == Some("Running"),
        "share-b stopped running"
    );

    // The second ends: the instance goes.
    workload::delete_pods(&c, &["share-b"]).await?;
    wait_until(SHORT, || async {
        (!instances(cluster, minor).iter().any(|(_, s, _)| *s == start)).then_some(())
    })
    .await
    .context("the instance was not destroyed after the last claim")?;
    wait_until(Duration::from_secs(30), || async {
        (!spec(&uid_b).exists()).then_some(())
    })
    .await
    .context("the second claim's CDI spec was not removed")?;
    Ok(())
}
