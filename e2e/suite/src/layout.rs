//! Renders each simulated GPU's MIG layout: which placements are in use, and by which pod.

use std::{collections::BTreeMap, fmt::Write as _};

use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{Api, Client, api::ListParams};
use migdra_api::{catalog, device_name::DeviceName};
use migdra_fake_nvml::state::FakeState;

/// Which pod holds each allocated device: device name → `namespace/pod`.
pub async fn device_owners(client: &Client) -> anyhow::Result<BTreeMap<String, String>> {
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let pods: Api<Pod> = Api::all(client.clone());
    let mut pod_by_uid = BTreeMap::new();
    for pod in pods.list(&ListParams::default()).await?.items {
        if let Some(uid) = pod.metadata.uid.clone() {
            pod_by_uid.insert(
                uid,
                format!(
                    "{}/{}",
                    pod.metadata.namespace.unwrap_or_default(),
                    pod.metadata.name.unwrap_or_default()
                ),
            );
        }
    }
    let mut owners = BTreeMap::new();
    for claim in claims.list(&ListParams::default()).await?.items {
        let Some(status) = claim.status else { continue };
        let holder = status
            .reserved_for
            .iter()
            .flatten()
            .find_map(|r| pod_by_uid.get(&r.uid).cloned())
            .unwrap_or_else(|| format!("claim {}", claim.metadata.name.unwrap_or_default()));
        for result in status
            .allocation
            .and_then(|a| a.devices)
            .and_then(|d| d.results)
            .into_iter()
            .flatten()
        {
            owners.insert(result.device, holder.clone());
        }
    }
    Ok(owners)
}

/// One line per GPU, one line per GPU instance, with a memory-slice map such as
/// `[0 1 2 3 . . . .]`.
pub fn render(state: &FakeState, owners: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    // By device minor, the number device names carry (the state is in NVML index order).
    let mut gpus: Vec<_> = state.gpus.iter().collect();
    gpus.sort_by_key(|g| g.minor);
    for gpu in gpus {
        let model = catalog::model(&gpu.model);
        let product = model.map_or(gpu.model.as_str(), |m| m.product_name);
        let slices = model.map_or(8, |m| m.memory_slices());
        let mode = if gpu.mig_enabled { "MIG on" } else { "MIG off" };
        let _ = writeln!(out, "GPU {} {product} ({mode}) {}", gpu.minor, gpu.uuid);
        if !gpu.mig_enabled {
            let whole = DeviceName::Gpu { minor: gpu.minor }.to_string();
            match owners.get(&whole) {
                Some(owner) => {
                    let _ = writeln!(out, "  whole GPU                      used by {owner}");
                }
                None => {
                    let _ = writeln!(out, "  (idle)");
                }
            }
            continue;
        }
        if gpu.gpu_instances.is_empty() {
            let _ = writeln!(
                out,
                "  [{}]  no MIG instances",
                vec!["."; slices as usize].join(" ")
            );
        }
        let geometry = model.map(|m| m.geometry());
        let mut instances: Vec<_> = gpu.gpu_instances.iter().collect();
        instances.sort_by_key(|gi| gi.start);
        for gi in instances {
            let map: Vec<String> = (0..slices)
                .map(|s| {
                    if s >= gi.start && s < gi.start + gi.size {
                        s.to_string()
                    } else {
                        ".".into()
                    }
                })
                .collect();
            let profile = geometry
                .as_ref()
                .and_then(|g| g.profile_by_id(gi.profile_id))
                .map(|p| p.name);
            let (label, owner) = match profile {
                Some(name) => {
                    let device = DeviceName::Mig {
                        minor: gpu.minor,
                        profile: name,
                        start: gi.start,
                    }
                    .to_string();
                    (
                        format!("{name}@{}", gi.start),
                        owners
                            .get(&device)
                            .cloned()
                            .unwrap_or_else(|| "not migdra's".into()),
                    )
                }
                None => (
                    format!("profile {}@{}", gi.profile_id, gi.start),
                    "unknown".into(),
                ),
            };
            let uuid = gi
                .compute_instances
                .first()
                .map_or("(no compute instance)", |c| c.uuid.as_str());
            let _ = writeln!(out, "  [{}]  {label:<14} {uuid}  used by {owner}", map.join(" "));
        }
    }
    out
}
