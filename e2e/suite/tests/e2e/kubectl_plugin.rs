//! `kubectl migdra` against the cluster: the built `kubectl-migdra` binary, run with the
//! admin kubeconfig, on a fixed layout (a foreign instance and three pods placed one after
//! another). The layout's JSON must agree with the simulated GPUs and the claims; its text must
//! match the golden `golden/kubectl_layout.txt` (claim-name suffixes and MIG UUIDs masked;
//! `MIGDRA_UPDATE_GOLDEN=1` rewrites it); `fits` must predict the device the scheduler then
//! allocates; `claims` must list the claims as prepared with their devices.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::{Context, anyhow, bail, ensure};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use migdra_e2e::{
    cluster::{Cluster, NODE, wait_until},
    layout::wait_in_sync,
    workload::{self, create_pod, create_template, on_gpu, profile_is, wait_phase},
};
use serde_json::Value;

use crate::support::{SHORT, gpu_uuid, mig, settle, slices};

tests![kubectl_migdra_shows_a_fixed_layout_and_predicts_placement];

/// GI profile ID of `1g.10gb` on the H100.
const H100_1G_10GB: u32 = 19;
/// Environment variable that rewrites the golden instead of comparing.
const UPDATE_GOLDEN: &str = "MIGDRA_UPDATE_GOLDEN";

async fn kubectl_migdra_shows_a_fixed_layout_and_predicts_placement(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    let result = fixed_layout(cluster).await;
    // Leave the GPUs as found even after a failure: the foreign instance is not migdra's,
    // so nothing else would remove it.
    let restored = remove_foreign_instance(cluster).await;
    result?;
    restored?;
    settle(cluster).await
}

async fn fixed_layout(cluster: &mut Cluster) -> anyhow::Result<()> {
    let c = cluster.client.clone();
    // A foreign 1g.10gb at placement 6 of GPU 0, as an admin with nvidia-smi would make it.
    let index = u32::try_from(cluster.state_index_of_minor(0)?)?;
    cluster
        .update_gpus(|s| s.create_full_instance(index, H100_1G_10GB, 6))?
        .map_err(|code| anyhow!("creating the foreign instance failed with NVML code {code}"))?;
    wait_for_pool(cluster, |devices| {
        !devices.contains("gpu-0-mig-1g10gb-6") && devices.contains("gpu-0-mig-1g10gb-5")
    })
    .await
    .context("the pool still offers the foreign instance's placement")?;

    // One pod after the other, so that each lands on the first free device in pool order.
    let gpu0 = gpu_uuid(cluster, 0);
    create_template(&c, "kp-3g", mig(&[profile_is("3g.40gb"), on_gpu(&gpu0)]), None).await?;
    create_template(&c, "kp-1g", mig(&[profile_is("1g.10gb"), on_gpu(&gpu0)]), None).await?;
    create_template(&c, "kp-2g", mig(&[profile_is("2g.10gb")]), None).await?;
    create_template(&c, "kp-any-1g", mig(&[profile_is("1g.10gb")]), None).await?;
    for (pod, template) in [("kp-train", "kp-3g"), ("kp-infer", "kp-1g"), ("kp-a100", "kp-2g")] {
        create_pod(&c, pod, template, &["sleep", "3600"], false).await?;
        wait_phase(&c, pod, "Running", Duration::from_secs(90)).await?;
    }
    wait_in_sync(cluster, SHORT).await?;

    // The layout as JSON: the same instances as the simulated GPUs, joined with the claims.
    let layout: Value = serde_json::from_str(&run(cluster, &["layout", "-o", "json"]).await?.0)?;
    check_layout(cluster, &layout).await?;

    // The layout as text, against the golden.
    let (text, _) = run(cluster, &["layout", NODE, "--no-color"]).await?;
    check_golden("kubectl_layout.txt", &mask(&text, &claim_names(&layout)))?;

    // `fits` predicts where the next unpinned 1g.10gb lands; the scheduler must agree.
    let (fits, code) = run(cluster, &["fits", "1g.10gb", "--node", NODE, "-o", "json"]).await?;
    ensure!(code == 0, "fits exited {code}: {fits}");
    let fits: Value = serde_json::from_str(&fits)?;
    let predicted = fits["nodes"][0]["lands"]["device"]
        .as_str()
        .with_context(|| format!("fits predicted nothing: {fits}"))?
        .to_string();
    ensure!(
        predicted == "gpu-0-mig-1g10gb-5",
        "fits predicted {predicted}; packed order puts the next 1g.10gb on GPU 0's first free placement, 5"
    );
    create_pod(&c, "kp-next", "kp-any-1g", &["sleep", "3600"], false).await?;
    wait_phase(&c, "kp-next", "Running", Duration::from_secs(90)).await?;
    let allocated = workload::allocated(&workload::pod_claim(&c, "kp-next").await?);
    ensure!(
        allocated.iter().any(|(_, d)| *d == predicted),
        "fits predicted {predicted}, the scheduler allocated {allocated:?}"
    );

    // The largest profile skips the fragmented GPU 0 for the empty GPU 1.
    let (no_fit, code) = run(cluster, &["fits", "7g.80gb", "--node", NODE, "-o", "json"]).await?;
    let no_fit: Value = serde_json::from_str(&no_fit)?;
    let lands = no_fit["nodes"][0]["lands"]["device"].as_str().map(str::to_string);
    ensure!(
        code == 0 && lands.as_deref() == Some("gpu-1-mig-7g80gb-0"),
        "7g.80gb should land on the empty GPU 1: exit {code}, {no_fit}"
    );

    // `claims`: every pod's claim prepared (its pod runs), with the device it was allocated.
    let claims: Value =
        serde_json::from_str(&run(cluster, &["claims", "-n", "default", "-o", "json"]).await?.0)?;
    for pod in ["kp-train", "kp-infer", "kp-a100", "kp-next"] {
        let claim = workload::pod_claim(&c, pod).await?;
        let name = claim.metadata.name.clone().unwrap_or_default();
        let row = claims["claims"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["name"] == name.as_str())
            .with_context(|| format!("claims does not list {name}: {claims}"))?;
        ensure!(row["state"] == "Prepared", "{name}: {row}");
        ensure!(row["node"] == NODE, "{name}: {row}");
        let devices: Vec<&str> = row["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["device"].as_str())
            .collect();
        let allocated: Vec<String> = workload::allocated(&claim).into_iter().map(|(_, d)| d).collect();
        ensure!(
            devices == allocated,
            "{name}: claims shows {devices:?}, allocated {allocated:?}"
        );
        ensure!(
            row["pods"][0]["name"] == pod && row["pods"][0]["phase"] == "Running",
            "{name}: {row}"
        );
    }
    Ok(())
}

/// The layout JSON agrees with the simulated GPUs and the claims.
async fn check_layout(cluster: &Cluster, layout: &Value) -> anyhow::Result<()> {
    let c = &cluster.client;
    let node = &layout["nodes"][0];
    ensure!(node["node"] == NODE, "{layout}");
    let gpus = node["gpus"].as_array().context("no gpus")?;
    let minors: Vec<u64> = gpus.iter().filter_map(|g| g["minor"].as_u64()).collect();
    ensure!(minors == [0, 1, 2], "GPU minors {minors:?}");
    let state = cluster.gpus()?;
    for gpu in gpus {
        let minor = u32::try_from(gpu["minor"].as_u64().unwrap_or(u64::MAX))?;
        let fake = state
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .context("no such GPU")?;
        ensure!(gpu["uuid"] == fake.uuid.as_str(), "GPU {minor}: {}", gpu["uuid"]);
        let shown: BTreeSet<(u64, u64)> = gpu["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| {
                (
                    i["profileId"].as_u64().unwrap_or(0),
                    i["start"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        let actual: BTreeSet<(u64, u64)> = fake
            .gpu_instances
            .iter()
            .map(|gi| (u64::from(gi.profile_id), u64::from(gi.start)))
            .collect();
        ensure!(
            shown == actual,
            "GPU {minor}: layout shows {shown:?}, NVML holds {actual:?}"
        );
    }
    // A MIG UUID shown is the one NVML reports for that instance; it is shown whenever the
    // plugin wrote it into the claim's status.
    let claims: Api<ResourceClaim> = Api::namespaced(c.clone(), workload::NAMESPACE);
    for gpu in gpus {
        let minor = u32::try_from(gpu["minor"].as_u64().unwrap_or(u64::MAX))?;
        let fake = state
            .gpus
            .iter()
            .find(|g| g.minor == minor)
            .context("no such GPU")?;
        for instance in gpu["instances"].as_array().into_iter().flatten() {
            let start = instance["start"].as_u64().unwrap_or(u64::MAX);
            let nvml_uuid = fake
                .gpu_instances
                .iter()
                .find(|gi| u64::from(gi.start) == start)
                .and_then(|gi| gi.compute_instances.first())
                .map(|ci| ci.uuid.as_str());
            if let Some(shown) = instance["migUuid"].as_str() {
                ensure!(
                    Some(shown) == nvml_uuid,
                    "GPU {minor}@{start}: shows {shown}, NVML has {nvml_uuid:?}"
                );
            }
            for user in instance["users"].as_array().into_iter().flatten() {
                let name = user["claim"]["name"].as_str().unwrap_or_default();
                let written = claims
                    .get(name)
                    .await?
                    .status
                    .and_then(|s| s.devices)
                    .is_some_and(|d| d.iter().any(|e| e.data.is_some()));
                ensure!(
                    !written || instance["migUuid"].is_string(),
                    "GPU {minor}@{start}: claim {name} has status data but the layout shows no MIG UUID"
                );
            }
        }
    }
    // Who holds what on GPU 0: 3g@0 and 1g@4 by the pods' claims, the foreign 1g@6 by nobody.
    let gpu0 = &gpus[0];
    let mut seen = Vec::new();
    for instance in gpu0["instances"].as_array().into_iter().flatten() {
        let users: Vec<(String, String)> = instance["users"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|u| {
                (
                    u["claim"]["name"].as_str().unwrap_or_default().to_string(),
                    u["pods"][0]["name"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        seen.push((
            instance["profile"].as_str().unwrap_or_default().to_string(),
            instance["start"].as_u64().unwrap_or(0),
            instance["owner"].as_str().unwrap_or_default().to_string(),
            users,
        ));
    }
    let claim_of = |pod: &'static str| async move {
        let claim = workload::pod_claim(c, pod).await?;
        anyhow::Ok((claim.metadata.name.unwrap_or_default(), pod.to_string()))
    };
    let expected = vec![
        (
            "3g.40gb".to_string(),
            0,
            "migdra".to_string(),
            vec![claim_of("kp-train").await?],
        ),
        (
            "1g.10gb".to_string(),
            4,
            "migdra".to_string(),
            vec![claim_of("kp-infer").await?],
        ),
        ("1g.10gb".to_string(), 6, "foreign".to_string(), vec![]),
    ];
    ensure!(seen == expected, "GPU 0 shows {seen:?}, expected {expected:?}");
    let slice_map: Vec<&str> = gpu0["sliceMap"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        slice_map
            == [
                "migdra", "migdra", "migdra", "migdra", "migdra", "free", "foreign", "free"
            ],
        "GPU 0 slice map {slice_map:?}"
    );
    let f = &gpu0["fragmentation"];
    ensure!(
        f["freeSlices"] == 2 && f["largestFitSlices"] == 1 && f["strandedSlices"] == 1,
        "GPU 0 fragmentation {f}"
    );
    let a100 = &gpus[2]["instances"][0];
    ensure!(
        a100["profile"] == "2g.10gb" && a100["users"][0]["pods"][0]["name"] == "kp-a100",
        "A100: {a100}"
    );
    Ok(())
}

/// Runs the built `kubectl-migdra` with the admin kubeconfig: (stdout, exit code).
async fn run(cluster: &Cluster, args: &[&str]) -> anyhow::Result<(String, i32)> {
    let binary: PathBuf = cluster.layout.migdra_bin.join("kubectl-migdra");
    ensure!(
        binary.is_file(),
        "{} not found; run `cargo build --workspace --all-targets` first",
        binary.display()
    );
    let output = tokio::process::Command::new(&binary)
        .args(args)
        .arg("--kubeconfig")
        .arg(&cluster.layout.kubeconfig)
        .env_remove("NO_COLOR")
        .output()
        .await
        .with_context(|| format!("running {}", binary.display()))?;
    let code = output.status.code().unwrap_or(-1);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if code == 2 {
        bail!("kubectl-migdra {args:?} failed: {stderr}");
    }
    ensure!(
        stderr.trim().is_empty(),
        "kubectl-migdra {args:?} warned: {stderr}"
    );
    Ok((String::from_utf8(output.stdout)?, code))
}

/// Names of the claims the layout shows, for masking their generated suffixes.
fn claim_names(layout: &Value) -> Vec<String> {
    let mut names = Vec::new();
    for gpu in layout["nodes"][0]["gpus"].as_array().into_iter().flatten() {
        let users = gpu["instances"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|i| i["users"].as_array().into_iter().flatten())
            .chain(gpu["wholeGpu"].as_array().into_iter().flatten());
        for user in users {
            if let Some(name) = user["claim"]["name"].as_str() {
                names.push(name.to_string());
            }
        }
    }
    names
}

/// Masks what differs between runs: the random suffix of generated claim names (`kp-train-gpu-x7k2p`
/// becomes `kp-train-gpu-*****`), and drops MIG UUIDs (random in the fake; shown only once the
/// plugin writes claim status, and checked against NVML in [`check_layout`]).
fn mask(text: &str, claims: &[String]) -> String {
    let mut out = text.to_string();
    for name in claims {
        if let Some((prefix, suffix)) = name.rsplit_once('-') {
            out = out.replace(name, &format!("{prefix}-{}", "*".repeat(suffix.len())));
        }
    }
    out.lines()
        .map(|line| match line.find("  MIG-") {
            Some(at) => &line[..at],
            None => line,
        })
        .fold(String::new(), |mut text, line| {
            text.push_str(line);
            text.push('\n');
            text
        })
}

fn check_golden(name: &str, actual: &str) -> anyhow::Result<()> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/e2e/golden")
        .join(name);
    if std::env::var_os(UPDATE_GOLDEN).is_some() {
        std::fs::write(&path, actual)?;
        return Ok(());
    }
    let expected = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    ensure!(
        expected == actual,
        "the layout differs from {} ({UPDATE_GOLDEN}=1 rewrites it)\n--- expected\n{expected}--- actual\n{actual}",
        path.display()
    );
    Ok(())
}

/// Waits until the published pool's device names satisfy `check`.
async fn wait_for_pool(cluster: &Cluster, check: impl Fn(&BTreeSet<String>) -> bool) -> anyhow::Result<()> {
    wait_until(SHORT, || async {
        let devices: BTreeSet<String> = slices(cluster)
            .await
            .ok()?
            .into_iter()
            .flat_map(|s| s.spec.devices.unwrap_or_default())
            .map(|d| d.name)
            .collect();
        check(&devices).then_some(())
    })
    .await
}

/// Removes the foreign instance (as an admin would) and waits until the pool offers its
/// placement again.
async fn remove_foreign_instance(cluster: &Cluster) -> anyhow::Result<()> {
    let index = cluster.state_index_of_minor(0)?;
    let removed = cluster.update_gpus(|s| {
        let gpu = &mut s.gpus[index];
        let before = gpu.gpu_instances.len();
        gpu.gpu_instances
            .retain(|gi| !(gi.profile_id == H100_1G_10GB && gi.start == 6));
        before != gpu.gpu_instances.len()
    })?;
    if removed {
        wait_for_pool(cluster, |devices| devices.contains("gpu-0-mig-1g10gb-6"))
            .await
            .context("the pool does not offer placement 6 again after the foreign instance went")?;
    }
    Ok(())
}
