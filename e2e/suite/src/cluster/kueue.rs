//! Kueue on the cluster, for the quota tests: its controller manager, built from the Go module
//! proxy by `e2e/kueue/build.sh`, runs as a host process with the admin kubeconfig, like the
//! rest of the control plane. Its CRDs come from the same module source.
//!
//! Kueue's webhooks (the Job webhook suspends a queued Job until Kueue admits it) must be
//! reachable by the API server on loopback. Kueue's own certificate management names the
//! certificate after a Service (`<service>.<namespace>.svc`), which the API server cannot reach
//! from a host process, so it is off: a self-signed certificate for 127.0.0.1 serves the
//! webhooks, and the webhook configurations of the module's manifests are registered with a
//! `url` on loopback and that certificate as `caBundle` (only the webhooks of Kueue's own
//! types and of batch/v1 Jobs, the one integration enabled; the others have no handler).
//! Without its certificate management Kueue also reads a metrics certificate from a fixed
//! host path, `/etc/kueue/metrics/certs`: the process runs in a mount namespace of its own in
//! which an overlay over `/etc` adds that file, so the host's `/etc` is left as it is.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use k8s_openapi::{
    ByteString,
    api::{
        admissionregistration::v1::{MutatingWebhookConfiguration, ValidatingWebhookConfiguration},
        apps::v1::Deployment,
        core::v1::Namespace,
        resource::v1::ResourceSlice,
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, PostParams},
};
use migdra_api::inventory::pool_name;
use serde_json::{Value, json};

use super::{
    CHART_NAMESPACE, Cluster, DRIVER, MigdraMode, NODE, boot::script_output,
    chart_mode::CONTROLLER_DEPLOYMENT, repo_root, wait_until, write,
};

/// Kueue's component name (logs, pid file, [`Cluster::stop`]).
pub const KUEUE: &str = "kueue";
/// The namespace Kueue runs in.
pub const KUEUE_NAMESPACE: &str = "kueue-system";
/// The quota resource Kueue charges migdra's claims to: GPU memory, read from the `memory`
/// counter the devices consume.
pub const GPU_MEMORY: &str = "gpu.migdra.dev/memory";
/// The DeviceClasses mapped to [`GPU_MEMORY`]: the chart's MIG and whole-GPU classes.
const MAPPED_CLASSES: [&str; 2] = ["mig.migdra.dev", "gpu.migdra.dev"];
/// Kueue's API group and the version the tests use.
pub const KUEUE_API_VERSION: &str = "kueue.x-k8s.io/v1beta2";

/// A Kueue resource (`kind`, plural `plural`) of [`KUEUE_API_VERSION`].
pub fn kueue_resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: "kueue.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: KUEUE_API_VERSION.into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

/// Kueue's Configuration for this cluster: every endpoint on loopback, no leader election, no
/// certificate management (see the module documentation), only the batch/v1 Job integration,
/// no visibility API server, and GPU memory as the quota of migdra's classes, counted by the
/// driver's `memory` counter.
fn configuration(health: u16, metrics: u16, webhook: u16, cert_dir: &Path) -> String {
    let classes = MAPPED_CLASSES.map(|c| format!("\"{c}\"")).join(", ");
    format!(
        "apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: {KUEUE_NAMESPACE}
health:
  healthProbeBindAddress: 127.0.0.1:{health}
metrics:
  bindAddress: 127.0.0.1:{metrics}
webhook:
  host: 127.0.0.1
  port: {webhook}
  certDir: {cert_dir}
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
integrations:
  frameworks: [\"batch/job\"]
featureGates:
  VisibilityOnDemand: false
resources:
  deviceClassMappings:
  - name: {GPU_MEMORY}
    deviceClassNames: [{classes}]
    sources:
    - counter:
        name: memory
        driver: {DRIVER}
        deviceSelector:
          cel:
            expression: 'device.driver == \"{DRIVER}\"'
",
        cert_dir = cert_dir.display(),
    )
}

/// True for the webhooks this Kueue serves: its own types' and batch/v1 Jobs'.
fn served(webhook: &Value) -> bool {
    let path = webhook["clientConfig"]["service"]["path"]
        .as_str()
        .unwrap_or_default();
    path.contains("-kueue-x-k8s-io-") || path.ends_with("-batch-v1-job")
}

/// Rewrites one webhook configuration of the module's manifests for loopback: only the
/// webhooks Kueue serves here, each called at `https://127.0.0.1:<port><path>`.
fn for_loopback(mut configuration: Value, port: u16) -> anyhow::Result<Value> {
    let name = configuration["metadata"]["name"]
        .as_str()
        .context("a webhook configuration without a name")?
        .to_string();
    configuration["metadata"] = json!({"name": format!("kueue-{name}")});
    let webhooks = configuration["webhooks"]
        .as_array()
        .context("a webhook configuration without webhooks")?;
    let mut kept = Vec::new();
    for webhook in webhooks.iter().filter(|w| served(w)) {
        let mut webhook = webhook.clone();
        let path = webhook["clientConfig"]["service"]["path"]
            .as_str()
            .context("a webhook without a path")?
            .to_string();
        webhook["clientConfig"] = json!({"url": format!("https://127.0.0.1:{port}{path}")});
        kept.push(webhook);
    }
    if kept.is_empty() {
        bail!("webhook configuration {name} has none of the webhooks Kueue serves here");
    }
    configuration["webhooks"] = Value::Array(kept);
    Ok(configuration)
}

impl Cluster {
    /// Starts Kueue unless it runs: builds it (or takes the cached build), installs its CRDs
    /// and webhook configurations, and waits until the API server can call its webhooks.
    pub async fn start_kueue(&mut self) -> anyhow::Result<()> {
        if self.is_running(KUEUE) {
            return Ok(());
        }
        self.kill(KUEUE); // reaps it, when it died
        let dist = script_output(&repo_root().join("e2e/kueue/build.sh"))?;
        let dir = self.layout.run_dir.join("kueue");
        let cert_dir = dir.join("webhook-certs");
        let certificate = self.kueue_certificate(&dir, &cert_dir)?;
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        if namespaces.get_opt(KUEUE_NAMESPACE).await?.is_none() {
            namespaces
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({"metadata": {"name": KUEUE_NAMESPACE}}))?,
                )
                .await?;
        }
        self.kubectl(
            &["apply", "--server-side", "--force-conflicts", "-f"],
            &dist.join("crd"),
        )?;
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        for name in ["clusterqueues", "localqueues", "resourceflavors", "workloads"] {
            let name = format!("{name}.kueue.x-k8s.io");
            wait_until(Duration::from_secs(60), || async {
                let crd = crds.get(&name).await.ok()?;
                crd.status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            })
            .await
            .with_context(|| format!("CRD {name} not established"))?;
        }
        let (health, metrics, webhook) = (
            self.port("kueue-health")?,
            self.port("kueue-metrics")?,
            self.port("kueue-webhook")?,
        );
        let config = dir.join("config.yaml");
        write(&config, &configuration(health, metrics, webhook, &cert_dir))?;
        self.register_kueue_webhooks(&dist.join("webhook/manifests.yaml"), webhook, &certificate)
            .await?;
        let overlay = format!(
            "mount -t overlay overlay -o lowerdir=/etc,upperdir={},workdir={} /etc && exec \"$0\" \"$@\"",
            dir.join("etc").display(),
            dir.join("etc-work").display()
        );
        let kueue = dist.join("bin/kueue");
        self.start_component(
            KUEUE,
            Path::new("unshare"),
            &[
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                &overlay,
                &kueue.display().to_string(),
                &format!("--config={}", config.display()),
                &format!("--kubeconfig={}", self.layout.kubeconfig.display()),
            ],
        )?;
        self.wait_kueue_webhooks().await
    }

    /// A self-signed certificate and key for 127.0.0.1 in the webhook certificate directory
    /// and, for the metrics endpoint, under the `/etc` overlay's upper directory. Returns the
    /// certificate (PEM), which is also its own CA.
    fn kueue_certificate(&self, dir: &Path, cert_dir: &Path) -> anyhow::Result<Vec<u8>> {
        let metrics_dir = dir.join("etc/kueue/metrics/certs");
        for d in [cert_dir, &metrics_dir, &dir.join("etc-work")] {
            fs::create_dir_all(d)?;
        }
        let (crt, key) = (cert_dir.join("tls.crt"), cert_dir.join("tls.key"));
        let status = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ])
            .args(["-nodes", "-days", "7", "-subj", "/CN=kueue-e2e"])
            .args(["-addext", "subjectAltName=IP:127.0.0.1"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&crt)
            .stderr(Stdio::null())
            .status()
            .context("running openssl to make Kueue's serving certificate")?;
        if !status.success() {
            bail!("openssl req failed making Kueue's serving certificate");
        }
        for file in [&crt, &key] {
            fs::copy(file, metrics_dir.join(file.file_name().unwrap_or_default()))?;
        }
        Ok(fs::read(&crt)?)
    }

    /// Runs the cluster's kubectl as admin with `args` and then `file`.
    fn kubectl(&self, args: &[&str], file: &Path) -> anyhow::Result<String> {
        let output = Command::new(self.layout.upstream_bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", self.layout.kubeconfig.display()))
            .args(args)
            .arg(file)
            .output()
            .context("running kubectl")?;
        if !output.status.success() {
            bail!(
                "kubectl {} {} failed: {}",
                args.join(" "),
                file.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Registers the module's webhook configurations, rewritten for loopback, with
    /// `certificate` as every webhook's `caBundle`.
    async fn register_kueue_webhooks(
        &self,
        manifests: &Path,
        port: u16,
        certificate: &[u8],
    ) -> anyhow::Result<()> {
        // kubectl prints one JSON document per YAML document.
        let printed = self.kubectl(&["create", "--dry-run=client", "-o", "json", "-f"], manifests)?;
        let items = serde_json::Deserializer::from_str(&printed)
            .into_iter::<Value>()
            .collect::<Result<Vec<_>, _>>()
            .context("reading kubectl's JSON of the webhook manifests")?;
        if items.is_empty() {
            bail!(
                "kubectl read no webhook configurations from {}",
                manifests.display()
            );
        }
        for item in &items {
            let configuration = for_loopback(item.clone(), port)?;
            match item["kind"].as_str() {
                Some("MutatingWebhookConfiguration") => {
                    let mut c: MutatingWebhookConfiguration = serde_json::from_value(configuration)?;
                    for w in c.webhooks.iter_mut().flatten() {
                        w.client_config.ca_bundle = Some(ByteString(certificate.to_vec()));
                    }
                    replace_or_create(Api::all(self.client.clone()), c).await?;
                }
                Some("ValidatingWebhookConfiguration") => {
                    let mut c: ValidatingWebhookConfiguration = serde_json::from_value(configuration)?;
                    for w in c.webhooks.iter_mut().flatten() {
                        w.client_config.ca_bundle = Some(ByteString(certificate.to_vec()));
                    }
                    replace_or_create(Api::all(self.client.clone()), c).await?;
                }
                other => bail!("unexpected object {other:?} in {}", manifests.display()),
            }
        }
        Ok(())
    }

    /// Waits until the API server can call Kueue's webhooks: a dry-run ResourceFlavor passes
    /// its mutating and validating webhooks (failure policy Fail).
    async fn wait_kueue_webhooks(&mut self) -> anyhow::Result<()> {
        let flavors: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &kueue_resource("ResourceFlavor", "resourceflavors"),
        );
        let probe: DynamicObject = serde_json::from_value(json!({
            "apiVersion": KUEUE_API_VERSION,
            "kind": "ResourceFlavor",
            "metadata": {"name": "webhook-probe"},
        }))?;
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            if !self.is_running(KUEUE) {
                bail!("Kueue exited; log in {}", self.layout.log(KUEUE).display());
            }
            let last = match flavors.create(&dry_run, &probe).await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if std::time::Instant::now() > deadline {
                bail!(
                    "the API server could not call Kueue's webhooks within 120 s ({last}); log in {}",
                    self.layout.log(KUEUE).display()
                );
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Runs migdra's controller with or without `--keep-memory-counter` (nothing changes when
    /// it already runs so), then waits until the node's pool carries the `memory` counter
    /// exactly when it is kept, and is published. From the chart, `helm upgrade` sets the
    /// chart's `controller.keepMemoryCounter` and the Deployment rolls out a new controller
    /// pod; as a host process, the controller is restarted with the flag.
    pub async fn set_keep_memory_counter(&mut self, keep: bool) -> anyhow::Result<()> {
        match self.layout.migdra_mode {
            MigdraMode::Chart => {
                if self.deployed_keep_memory_counter().await? != keep {
                    self.upgrade_chart(&[&format!("controller.keepMemoryCounter={keep}")])?;
                    self.wait_controller_rolled_out().await?;
                }
            }
            MigdraMode::HostProcesses => {
                if self.controller_keep_memory_counter != keep || !self.is_running("migdra-controller") {
                    self.stop("migdra-controller", Duration::from_secs(10));
                    self.controller_keep_memory_counter = keep;
                    self.start_migdra_controller()?;
                }
            }
        }
        let slices: Api<ResourceSlice> = Api::all(self.client.clone());
        let pool = pool_name(NODE, DRIVER);
        wait_until(Duration::from_secs(60), || async {
            let list = slices.list(&Default::default()).await.ok()?;
            let ours: Vec<_> = list.items.iter().filter(|s| s.spec.pool.name == pool).collect();
            let generation = ours.iter().map(|s| s.spec.pool.generation).max()?;
            let has_memory = ours
                .iter()
                .filter(|s| s.spec.pool.generation == generation)
                .flat_map(|s| s.spec.shared_counters.iter().flatten())
                .any(|set| set.counters.contains_key("memory"));
            (has_memory == keep).then_some(())
        })
        .await
        .with_context(|| {
            format!(
                "the pool never had the memory counter {}",
                if keep { "kept" } else { "left out" }
            )
        })?;
        self.wait_published(Duration::from_secs(60)).await
    }
}

impl Cluster {
    /// The chart's controller Deployment.
    async fn controller_deployment(&self) -> anyhow::Result<Deployment> {
        Api::<Deployment>::namespaced(self.client.clone(), CHART_NAMESPACE)
            .get(CONTROLLER_DEPLOYMENT)
            .await
            .with_context(|| format!("reading Deployment {CHART_NAMESPACE}/{CONTROLLER_DEPLOYMENT}"))
    }

    /// Whether the controller Deployment's pods run with `KEEP_MEMORY_COUNTER=true` (what the
    /// release says now, whichever revision it is at).
    async fn deployed_keep_memory_counter(&self) -> anyhow::Result<bool> {
        let deployment = self.controller_deployment().await?;
        let value = deployment
            .spec
            .and_then(|s| s.template.spec)
            .into_iter()
            .flat_map(|s| s.containers)
            .flat_map(|c| c.env.into_iter().flatten())
            .find(|e| e.name == "KEEP_MEMORY_COUNTER")
            .and_then(|e| e.value)
            .with_context(|| format!("Deployment {CONTROLLER_DEPLOYMENT} sets no KEEP_MEMORY_COUNTER"))?;
        Ok(value == "true")
    }

    /// Waits until the controller Deployment's rollout is complete: every replica of the new
    /// template Ready and no pod of the old one left.
    async fn wait_controller_rolled_out(&self) -> anyhow::Result<()> {
        wait_until(Duration::from_secs(180), || async {
            let deployment = self.controller_deployment().await.ok()?;
            let want = deployment.spec?.replicas.unwrap_or(1);
            let status = deployment.status?;
            let done = status.observed_generation >= deployment.metadata.generation
                && status.updated_replicas == Some(want)
                && status.replicas == Some(want)
                && status.ready_replicas == Some(want);
            done.then_some(())
        })
        .await
        .with_context(|| format!("Deployment {CONTROLLER_DEPLOYMENT} did not roll out the new controller"))
    }
}

/// Creates `object`, or replaces the one of that name (keeping its resourceVersion).
async fn replace_or_create<K>(api: Api<K>, mut object: K) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = object.meta().name.clone().context("an object without a name")?;
    match api.get_opt(&name).await? {
        Some(existing) => {
            object.meta_mut().resource_version = existing.meta().resource_version.clone();
            api.replace(&name, &PostParams::default(), &object).await?;
        }
        None => {
            api.create(&PostParams::default(), &object).await?;
        }
    }
    Ok(())
}

/// A client for the tests' Kueue objects of `kind`, cluster-wide.
pub fn kueue_api(client: &Client, kind: &str, plural: &str) -> Api<DynamicObject> {
    Api::all_with(client.clone(), &kueue_resource(kind, plural))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Value {
        json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "mutating-webhook-configuration", "labels": {"x": "y"}},
            "webhooks": [
                {"name": "mjob.kb.io", "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": "/mutate-batch-v1-job"}}},
                {"name": "mpod.kb.io", "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": "/mutate--v1-pod"}}},
                {"name": "mworkload.kb.io", "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": "/mutate-kueue-x-k8s-io-v1beta2-workload"}}},
                {"name": "mjobset.kb.io", "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": "/mutate-jobset-x-k8s-io-v1alpha2-jobset"}}},
            ],
        })
    }

    #[test]
    fn only_served_webhooks_are_kept_and_called_on_loopback() {
        let rewritten = for_loopback(manifest(), 9443).unwrap();
        assert_eq!(
            rewritten["metadata"],
            json!({"name": "kueue-mutating-webhook-configuration"})
        );
        let names: Vec<&str> = rewritten["webhooks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["mjob.kb.io", "mworkload.kb.io"]);
        assert_eq!(
            rewritten["webhooks"][0]["clientConfig"],
            json!({"url": "https://127.0.0.1:9443/mutate-batch-v1-job"})
        );
    }

    #[test]
    fn a_configuration_without_served_webhooks_is_an_error() {
        let mut m = manifest();
        m["webhooks"] = json!([m["webhooks"][1].clone()]);
        let err = for_loopback(m, 9443).unwrap_err();
        assert!(err.to_string().contains("none of the webhooks"), "{err}");
        assert!(for_loopback(json!({"webhooks": []}), 1).is_err());
    }
}
