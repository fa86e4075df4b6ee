//! Kueue quotas on migdra's devices: Kueue (built from its Go module, see
//! `migdra_e2e::cluster::start_kueue`) charges batch/v1 Jobs whose pods use migdra claim
//! templates to a GPU-memory quota, read from the `memory` counter the devices consume, which
//! the controller publishes with `--keep-memory-counter`. Jobs whose claims fit are admitted
//! and run; one that does not waits until an earlier one finishes; a whole GPU is charged its
//! whole memory; a `firstAvailable` request is refused as Kueue documents (it charges only
//! `exactly` requests).
//!
//! Kueue charges a request the largest `memory` any device matching the request's class and
//! selectors consumes, on any node; each test reads that from the published slices. Each test
//! turns the counter on with `helm upgrade` of the chart's `controller.keepMemoryCounter` and
//! off again at its end, leaving the release at its installed values; Kueue itself keeps
//! running after this theme.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::Pod,
    resource::v1::{Device, ResourceSlice},
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, DynamicObject, ListParams, PostParams},
};
use migdra_api::slices::quantity;
use migdra_e2e::{
    cluster::{Cluster, DRIVER, GPU_MEMORY, KUEUE_API_VERSION, kueue_api, wait_until},
    workload::{self, NAMESPACE, Request, create_template, on_gpu, profile_is},
};
use serde_json::{Value, json};

use crate::support::{SHORT, WHOLE, gpu_uuid, mig, settle, slices};

tests![
    kueue_admits_mig_jobs_that_fit_the_memory_quota,
    kueue_holds_a_job_over_the_quota_until_an_earlier_one_finishes,
    kueue_charges_a_whole_gpu_its_whole_memory,
    kueue_refuses_first_available_requests,
];

/// The ResourceFlavor every test ClusterQueue uses (no node labels: one node).
const FLAVOR: &str = "migdra-e2e";
/// Bytes in a MiB.
const MIB: u128 = 1 << 20;
/// How long Kueue gets to decide about a workload.
const ADMISSION: Duration = Duration::from_secs(60);

/// Kueue running, the memory counter published, the flavor there.
async fn kueue_up(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster.start_kueue().await?;
    cluster.set_keep_memory_counter(true).await?;
    let flavors = kueue_api(&cluster.client, "ResourceFlavor", "resourceflavors");
    if flavors.get_opt(FLAVOR).await?.is_none() {
        let flavor: DynamicObject = serde_json::from_value(json!({
            "apiVersion": KUEUE_API_VERSION,
            "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR},
        }))?;
        flavors.create(&PostParams::default(), &flavor).await?;
    }
    Ok(())
}

/// The controller back to the release's installed values: no `memory` counter.
async fn kueue_down(cluster: &mut Cluster) -> anyhow::Result<()> {
    cluster.set_keep_memory_counter(false).await
}

/// A ClusterQueue `name` with `quota` bytes of [`GPU_MEMORY`] and a LocalQueue `name` in the
/// test namespace feeding it; waits until the ClusterQueue is active.
async fn create_queues(client: &Client, name: &str, quota: u128) -> anyhow::Result<()> {
    ensure!(quota.is_multiple_of(MIB), "quota {quota} is not whole MiB");
    let cluster_queues = kueue_api(client, "ClusterQueue", "clusterqueues");
    let queue: DynamicObject = serde_json::from_value(json!({
        "apiVersion": KUEUE_API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [{
                "coveredResources": [GPU_MEMORY],
                "flavors": [{"name": FLAVOR, "resources": [
                    {"name": GPU_MEMORY, "nominalQuota": quantity::mebibytes((quota / MIB) as u64)},
                ]}],
            }],
        },
    }))?;
    cluster_queues.create(&PostParams::default(), &queue).await?;
    let local: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &migdra_e2e::cluster::kueue_resource("LocalQueue", "localqueues"),
    );
    let local_queue: DynamicObject = serde_json::from_value(json!({
        "apiVersion": KUEUE_API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"clusterQueue": name},
    }))?;
    local.create(&PostParams::default(), &local_queue).await?;
    wait_until(ADMISSION, || async {
        let queue = cluster_queues.get(name).await.ok()?;
        condition(&queue.data, "Active")
            .is_some_and(|c| c.status == "True")
            .then_some(())
    })
    .await
    .with_context(|| format!("ClusterQueue {name} never became active"))
}

/// Deletes the queues [`create_queues`] made.
async fn delete_queues(client: &Client, name: &str) -> anyhow::Result<()> {
    let local: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &migdra_e2e::cluster::kueue_resource("LocalQueue", "localqueues"),
    );
    local.delete(name, &DeleteParams::default()).await?;
    kueue_api(client, "ClusterQueue", "clusterqueues")
        .delete(name, &DeleteParams::default())
        .await?;
    Ok(())
}

/// A batch/v1 Job in LocalQueue `queue`: one pod whose container sleeps `seconds` with a claim
/// from `template`.
async fn create_job(
    client: &Client,
    name: &str,
    queue: &str,
    template: &str,
    seconds: u32,
) -> anyhow::Result<()> {
    let job: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"app.kubernetes.io/part-of": "migdra-e2e", "kueue.x-k8s.io/queue-name": queue},
        },
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/part-of": "migdra-e2e"}},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "main",
                        "image": "registry.k8s.io/e2e-test-images/busybox:1.36",
                        "command": ["sleep", seconds.to_string()],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
                },
            },
        },
    }))?;
    Api::<Job>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &job)
        .await?;
    Ok(())
}

/// One status condition of a Kubernetes object given as JSON.
struct Condition {
    status: String,
    reason: String,
    message: String,
}

fn condition(object: &Value, kind: &str) -> Option<Condition> {
    let c = object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)?;
    let text = |field: &str| c[field].as_str().unwrap_or_default().to_string();
    Some(Condition {
        status: text("status"),
        reason: text("reason"),
        message: text("message"),
    })
}

/// The Workload Kueue made for Job `job`.
async fn workload_of(client: &Client, job: &str) -> Option<Value> {
    let workloads: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        NAMESPACE,
        &migdra_e2e::cluster::kueue_resource("Workload", "workloads"),
    );
    let list = workloads.list(&ListParams::default()).await.ok()?;
    list.items
        .into_iter()
        .find(|w| {
            w.owner_references()
                .iter()
                .any(|o| o.kind == "Job" && o.name == job)
        })
        .and_then(|w| serde_json::to_value(w).ok())
}

/// Waits until Job `job`'s Workload is admitted; returns it.
async fn wait_admitted(client: &Client, job: &str) -> anyhow::Result<Value> {
    wait_until(ADMISSION, || async {
        let workload = workload_of(client, job).await?;
        condition(&workload, "Admitted")
            .is_some_and(|c| c.status == "True")
            .then_some(workload)
    })
    .await
    .with_context(|| format!("the Workload of Job {job} was not admitted"))
}

/// What an admitted Workload was charged of [`GPU_MEMORY`], in bytes.
fn charged(workload: &Value) -> anyhow::Result<u128> {
    let usage = &workload["status"]["admission"]["podSetAssignments"][0]["resourceUsage"][GPU_MEMORY];
    let text = usage.as_str().with_context(|| {
        format!(
            "no {GPU_MEMORY} in the admission: {}",
            workload["status"]["admission"]
        )
    })?;
    quantity::parse(text).with_context(|| format!("{GPU_MEMORY} usage {text:?} is not an integer quantity"))
}

/// The name of Job `job`'s pod, once there is one.
async fn job_pod(client: &Client, job: &str) -> anyhow::Result<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    wait_until(SHORT, || async {
        let list = pods
            .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
            .await
            .ok()?;
        list.items.first().map(ResourceExt::name_any)
    })
    .await
    .with_context(|| format!("Job {job} made no pod"))
}

/// Whether Job `job` is suspended, and how many pods it has.
async fn job_state(client: &Client, job: &str) -> anyhow::Result<(bool, usize)> {
    let suspended = Api::<Job>::namespaced(client.clone(), NAMESPACE)
        .get(job)
        .await?
        .spec
        .and_then(|s| s.suspend)
        .unwrap_or(false);
    let pods = Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await?;
    Ok((suspended, pods.items.len()))
}

/// Waits until Job `job`'s pod runs with its claim allocated; returns the device.
async fn wait_running(client: &Client, job: &str) -> anyhow::Result<String> {
    let pod = job_pod(client, job).await?;
    workload::wait_phase(client, &pod, "Running", SHORT).await?;
    let claim = workload::pod_claim(client, &pod).await?;
    let allocated = workload::allocated(&claim);
    let [(_, device)] = allocated.as_slice() else {
        bail!("Job {job}'s claim has {allocated:?} allocated, one device expected")
    };
    Ok(device.clone())
}

/// A string attribute of a device.
fn attribute<'d>(device: &'d Device, name: &str) -> Option<&'d str> {
    device.attributes.as_ref()?.get(name)?.string.as_deref()
}

/// The `memory` a device consumes, in bytes.
fn memory_consumed(device: &Device) -> Option<u128> {
    device
        .consumes_counters
        .iter()
        .flatten()
        .find_map(|c| c.counters.get("memory"))
        .and_then(|c| quantity::parse(&c.value.0))
}

/// What Kueue charges a request for one device among those `matches` selects: the most
/// `memory` any of them consumes.
fn expected_charge(slices: &[ResourceSlice], matches: impl Fn(&Device) -> bool) -> anyhow::Result<u128> {
    slices
        .iter()
        .filter(|s| s.spec.driver == DRIVER)
        .flat_map(|s| s.spec.devices.iter().flatten())
        .filter(|d| matches(d))
        .filter_map(memory_consumed)
        .max()
        .context("no matching device consumes memory")
}

/// The device `name` of the pool.
fn device<'s>(slices: &'s [ResourceSlice], name: &str) -> anyhow::Result<&'s Device> {
    slices
        .iter()
        .flat_map(|s| s.spec.devices.iter().flatten())
        .find(|d| d.name == name)
        .with_context(|| format!("device {name} is not in the pool"))
}

/// The `memory` charge of one MIG partition of `profile`.
fn profile_charge(slices: &[ResourceSlice], profile: &str) -> anyhow::Result<u128> {
    expected_charge(slices, |d| attribute(d, "profile") == Some(profile))
}

/// Waits until the Workload of Job `job` is refused quota for lack of [`GPU_MEMORY`] and
/// checks that the Job stays suspended without pods.
async fn wait_over_quota(client: &Client, job: &str) -> anyhow::Result<()> {
    let reason = wait_until(ADMISSION, || async {
        let workload = workload_of(client, job).await?;
        condition(&workload, "QuotaReserved")
            .filter(|c| c.status == "False" && c.message.contains(GPU_MEMORY))
            .map(|c| c.message)
    })
    .await
    .with_context(|| format!("Job {job}'s Workload was never refused quota for {GPU_MEMORY}"))?;
    ensure!(
        reason.contains("insufficient"),
        "Job {job} waits for another reason: {reason}"
    );
    let (suspended, pods) = job_state(client, job).await?;
    ensure!(
        suspended && pods == 0,
        "Job {job} over quota: suspended {suspended}, {pods} pods"
    );
    Ok(())
}

/// Two MIG Jobs whose memory together fills the quota exactly are both admitted, each charged
/// its partition's memory, and run on partitions of the profiles they asked for.
async fn kueue_admits_mig_jobs_that_fit_the_memory_quota(cluster: &mut Cluster) -> anyhow::Result<()> {
    kueue_up(cluster).await?;
    let c = cluster.client.clone();
    let pool = slices(cluster).await?;
    let (three, one) = (
        profile_charge(&pool, "3g.40gb")?,
        profile_charge(&pool, "1g.10gb")?,
    );
    create_template(&c, "kq-3g", mig(&[profile_is("3g.40gb")]), None).await?;
    create_template(&c, "kq-1g", mig(&[profile_is("1g.10gb")]), None).await?;
    create_queues(&c, "kq-fit", three + one).await?;
    create_job(&c, "fit-3g", "kq-fit", "kq-3g", 3600).await?;
    create_job(&c, "fit-1g", "kq-fit", "kq-1g", 3600).await?;
    for (job, profile, charge) in [("fit-3g", "3g.40gb", three), ("fit-1g", "1g.10gb", one)] {
        let workload = wait_admitted(&c, job).await?;
        ensure!(
            charged(&workload)? == charge,
            "Job {job} charged {} bytes, its {profile} consumes {charge}",
            charged(&workload)?
        );
        let name = wait_running(&c, job).await?;
        let allocated = device(&pool, &name)?;
        ensure!(
            attribute(allocated, "profile") == Some(profile),
            "Job {job} got {name}, not a {profile}"
        );
    }
    settle(cluster).await?;
    delete_queues(&c, "kq-fit").await?;
    kueue_down(cluster).await
}

/// With room for two 1g.10gb partitions, a third 1g Job waits, suspended, while the other two
/// run, and is admitted and runs once the short one of them has finished.
async fn kueue_holds_a_job_over_the_quota_until_an_earlier_one_finishes(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    kueue_up(cluster).await?;
    let c = cluster.client.clone();
    let pool = slices(cluster).await?;
    let one = profile_charge(&pool, "1g.10gb")?;
    create_template(&c, "kq-1g", mig(&[profile_is("1g.10gb")]), None).await?;
    create_queues(&c, "kq-hold", 2 * one).await?;
    create_job(&c, "hold-short", "kq-hold", "kq-1g", 30).await?;
    create_job(&c, "hold-long", "kq-hold", "kq-1g", 3600).await?;
    for job in ["hold-short", "hold-long"] {
        wait_admitted(&c, job).await?;
        wait_running(&c, job).await?;
    }
    create_job(&c, "hold-next", "kq-hold", "kq-1g", 3600).await?;
    wait_over_quota(&c, "hold-next").await?;
    let short_pod = job_pod(&c, "hold-short").await?;
    ensure!(
        workload::phase(&c, &short_pod).await.as_deref() == Some("Running"),
        "the short Job ended before the next one was seen waiting; the test cannot tell why it waited"
    );
    let admitted = wait_admitted(&c, "hold-next").await?;
    ensure!(charged(&admitted)? == one, "the next Job is charged one 1g.10gb");
    let finished = workload_of(&c, "hold-short")
        .await
        .and_then(|w| condition(&w, "Finished"))
        .is_some_and(|f| f.status == "True");
    ensure!(
        finished,
        "the next Job was admitted before the short one finished"
    );
    wait_running(&c, "hold-next").await?;
    settle(cluster).await?;
    delete_queues(&c, "kq-hold").await?;
    kueue_down(cluster).await
}

/// A whole-GPU claim on an H100 is charged the GPU's whole memory budget (the counter set's
/// `memory`): with a quota of exactly that, it runs and a 1g Job behind it waits.
async fn kueue_charges_a_whole_gpu_its_whole_memory(cluster: &mut Cluster) -> anyhow::Result<()> {
    kueue_up(cluster).await?;
    let c = cluster.client.clone();
    let pool = slices(cluster).await?;
    let uuid = gpu_uuid(cluster, 0);
    let whole = expected_charge(&pool, |d| {
        attribute(d, "type") == Some("gpu") && attribute(d, "uuid") == Some(uuid.as_str())
    })?;
    let budget = pool
        .iter()
        .flat_map(|s| s.spec.shared_counters.iter().flatten())
        .find(|set| set.name == "gpu-0")
        .and_then(|set| set.counters.get("memory"))
        .and_then(|m| quantity::parse(&m.value.0))
        .context("GPU 0's counter set publishes no memory")?;
    ensure!(
        whole == budget,
        "the whole GPU consumes {whole} of a {budget} memory budget"
    );
    ensure!(
        whole > profile_charge(&pool, "7g.80gb")?,
        "the whole GPU should consume more memory than its largest partition"
    );
    create_template(
        &c,
        "kq-whole",
        Request::Exactly {
            class: WHOLE.into(),
            selectors: vec![on_gpu(&uuid)],
        },
        None,
    )
    .await?;
    create_template(&c, "kq-1g", mig(&[profile_is("1g.10gb")]), None).await?;
    create_queues(&c, "kq-whole", whole).await?;
    create_job(&c, "whole", "kq-whole", "kq-whole", 3600).await?;
    let workload = wait_admitted(&c, "whole").await?;
    ensure!(
        charged(&workload)? == whole,
        "the whole GPU is charged {} bytes, not {whole}",
        charged(&workload)?
    );
    let name = wait_running(&c, "whole").await?;
    ensure!(
        attribute(device(&pool, &name)?, "uuid") == Some(uuid.as_str()),
        "the whole-GPU Job got {name}"
    );
    create_job(&c, "after-whole", "kq-whole", "kq-1g", 3600).await?;
    wait_over_quota(&c, "after-whole").await?;
    settle(cluster).await?;
    delete_queues(&c, "kq-whole").await?;
    kueue_down(cluster).await
}

/// Kueue charges only `exactly` requests: a Job whose claim template asks for the first
/// available of two profiles is refused as inadmissible with that reason, stays suspended and
/// makes no pod, although the quota would hold either alternative.
async fn kueue_refuses_first_available_requests(cluster: &mut Cluster) -> anyhow::Result<()> {
    kueue_up(cluster).await?;
    let c = cluster.client.clone();
    let pool = slices(cluster).await?;
    let three = profile_charge(&pool, "3g.40gb")?;
    create_template(
        &c,
        "kq-first",
        Request::FirstAvailable(vec![
            (
                "big".into(),
                crate::support::MIG.into(),
                vec![profile_is("3g.40gb")],
            ),
            (
                "small".into(),
                crate::support::MIG.into(),
                vec![profile_is("1g.10gb")],
            ),
        ]),
        None,
    )
    .await?;
    create_queues(&c, "kq-first", 2 * three).await?;
    create_job(&c, "first-available", "kq-first", "kq-first", 3600).await?;
    let refused = wait_until(ADMISSION, || async {
        let workload = workload_of(&c, "first-available").await?;
        condition(&workload, "QuotaReserved")
            .filter(|q| q.status == "False" && q.message.contains("FirstAvailable"))
    })
    .await
    .context("the firstAvailable Job's Workload was never refused")?;
    ensure!(
        refused.reason == "Inadmissible" || refused.reason == "Misconfigured",
        "refused with reason {}: {}",
        refused.reason,
        refused.message
    );
    let (suspended, pods) = job_state(&c, "first-available").await?;
    ensure!(
        suspended && pods == 0,
        "the refused Job: suspended {suspended}, {pods} pods"
    );
    settle(cluster).await?;
    delete_queues(&c, "kq-first").await?;
    kueue_down(cluster).await
}
