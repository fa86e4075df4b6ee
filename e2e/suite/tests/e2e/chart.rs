//! The Helm chart under a real API server: every rendered object and example passes a
//! server-side dry run, and the RBAC matrix holds for the chart's ServiceAccounts (including
//! real writes with the token of the running plugin pod, bound to the pod and its node: its
//! own node's GpuNode and claim status only, the latter also by the admission policy alone,
//! as on Kubernetes 1.35), and API Priority and Fairness puts the running pods' requests
//! where the chart's FlowSchemas say.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::{
    rbac::v1::{ClusterRole, ClusterRoleBinding},
    resource::v1::ResourceClaim,
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use migdra_api::inventory::{GpuNode, pool_name};
use migdra_e2e::cluster::{
    CHART_NAMESPACE, CONTROLLER_ACCOUNT, Cluster, DRIVER, NODE, PLUGIN_ACCOUNT, wait_until,
};
use serde_json::json;

tests![
    chart_objects_pass_server_side_dry_run,
    rbac_matrix_holds_against_the_api_server,
    admission_policy_pins_claim_status_writes_without_the_136_checks,
    migdra_requests_land_in_the_charts_priority_levels
];

fn kubectl(cluster: &Cluster, args: &[&str]) -> anyhow::Result<std::process::Output> {
    Ok(
        std::process::Command::new(cluster.layout.upstream_bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", cluster.layout.kubeconfig.display()))
            .args(args)
            .output()?,
    )
}

async fn chart_objects_pass_server_side_dry_run(cluster: &mut Cluster) -> anyhow::Result<()> {
    for file in ["chart-default.yaml", "chart-custom.yaml"] {
        let rendered = std::fs::read_to_string(cluster.layout.run_dir.join(file))?;
        // This API server has no Prometheus Operator CRDs: its PodMonitors and PrometheusRule
        // are left out here (the chart tests check them).
        let rendered: String = rendered
            .split("\n---")
            .filter(|doc| !doc.contains("\napiVersion: monitoring.coreos.com/"))
            .collect::<Vec<_>>()
            .join("\n---");
        let path = cluster.layout.run_dir.join(format!("dry-run-{file}"));
        std::fs::write(&path, &rendered)?;
        let objects = rendered.matches("\nkind: ").count() + usize::from(rendered.starts_with("kind: "));
        ensure!(objects >= 10, "{file}: only {objects} objects rendered");
        let out = kubectl(
            cluster,
            &[
                "apply",
                "--server-side",
                "--dry-run=server",
                "--force-conflicts",
                "--field-manager=migdra-e2e",
                "-f",
                &path.to_string_lossy(),
            ],
        )?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "{file} rejected by the API server:\n{}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
        let applied = stdout.lines().filter(|l| l.contains("(server dry run)")).count();
        ensure!(
            applied == objects,
            "{file}: {applied} of {objects} objects applied:\n{stdout}"
        );
    }
    // The examples the docs point to are valid objects for this API server too.
    let examples = migdra_e2e::cluster::repo_root().join("examples");
    let out = kubectl(
        cluster,
        &[
            "apply",
            "--dry-run=server",
            "--namespace=default",
            "-f",
            &examples.to_string_lossy(),
        ],
    )?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        out.status.success(),
        "examples rejected:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut objects = 0;
    for entry in std::fs::read_dir(&examples)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            objects += std::fs::read_to_string(&path)?
                .lines()
                .filter(|l| l.starts_with("kind: "))
                .count();
        }
    }
    let applied = stdout.lines().filter(|l| l.contains("(server dry run)")).count();
    ensure!(
        objects >= 12 && applied == objects,
        "{applied} of {objects} example objects applied:\n{stdout}"
    );
    Ok(())
}

/// The claim-status probes' namespace.
const PROBE_NAMESPACE: &str = "default";
/// Another DRA driver, whose entries the plugin must leave alone.
const OTHER_DRIVER: &str = "net.example.com";
/// Name of the temporary ClusterRole(Binding) of [`lift_136_checks`].
const LIFTED: &str = "migdra-e2e-plugin-without-136-checks";

/// Creates the claim `name` in [`PROBE_NAMESPACE`] and allocates it as the scheduler would on
/// `node` (a nodeSelector naming the node), with device gpu-0 of each `(driver, pool node)`
/// of `results`: the API server accepts `status.devices` entries only of allocated devices.
async fn allocated_probe(
    admin: &Api<ResourceClaim>,
    name: &str,
    node: &str,
    results: &[(&str, &str)],
) -> anyhow::Result<()> {
    let requests: Vec<_> = (0..results.len())
        .map(|i| json!({"name": format!("r{i}"), "exactly": {"deviceClassName": "gpu.migdra.dev"}}))
        .collect();
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": requests}},
    }))?;
    admin.create(&PostParams::default(), &claim).await?;
    let results: Vec<_> = results
        .iter()
        .enumerate()
        .map(|(i, (driver, pool_node))| {
            json!({"request": format!("r{i}"), "driver": driver, "pool": pool_name(pool_node, driver), "device": "gpu-0"})
        })
        .collect();
    let allocation = json!({"status": {"allocation": {
        "devices": {"results": results},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}
        ]}]},
    }}});
    admin
        .patch_status(name, &PatchParams::default(), &Patch::Merge(allocation))
        .await
        .context("allocating the probe claim")?;
    Ok(())
}

/// A `status.devices` entry of `driver` for device gpu-0 of `node`'s pool.
fn device_entry(node: &str, driver: &str) -> serde_json::Value {
    json!({
        "driver": driver, "pool": pool_name(node, driver), "device": "gpu-0",
        "data": {"type": "gpu", "uuid": "GPU-probe"},
    })
}

/// What the plugin's token may do to the status of the probe claim `name`: a server-side
/// apply (dry run) of `status` with the plugin's field manager, as the plugin writes. The
/// probe claim is deleted afterwards.
async fn plugin_status_write(
    admin: &Api<ResourceClaim>,
    plugin: &Api<ResourceClaim>,
    name: &str,
    status: serde_json::Value,
) -> anyhow::Result<Result<(), Box<kube::core::Status>>> {
    let object = json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": PROBE_NAMESPACE},
        "status": status,
    });
    let params = PatchParams {
        dry_run: true,
        ..PatchParams::apply(&format!("{DRIVER}/kubelet-plugin")).force()
    };
    let result = plugin.patch_status(name, &params, &Patch::Apply(object)).await;
    admin.delete(name, &Default::default()).await?;
    match result {
        Ok(_) => Ok(Ok(())),
        Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => Ok(Err(e)),
        Err(e) => bail!("plugin status write on {name}: {e}"),
    }
}

/// Grants the plugin's ServiceAccount what a 1.36+ API server checks for a claim status write
/// beyond RBAC on resourceclaims/status (arbitrary-node access to every driver's entries, and
/// resourceclaims/binding), so that its writes reach admission as on Kubernetes 1.35, where
/// only the chart's admission policy stands in the way. [`revoke_136_checks`] undoes it.
async fn lift_136_checks(cluster: &Cluster) -> anyhow::Result<()> {
    let roles: Api<ClusterRole> = Api::all(cluster.client.clone());
    let bindings: Api<ClusterRoleBinding> = Api::all(cluster.client.clone());
    let role: ClusterRole = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": LIFTED},
        "rules": [
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/driver"],
             "verbs": ["arbitrary-node:patch"]},
            {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/binding"], "verbs": ["patch"]},
        ],
    }))?;
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": LIFTED},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": LIFTED},
        "subjects": [{"kind": "ServiceAccount", "name": PLUGIN_ACCOUNT, "namespace": CHART_NAMESPACE}],
    }))?;
    roles.create(&PostParams::default(), &role).await?;
    bindings.create(&PostParams::default(), &binding).await?;
    // The authorizer sees new bindings through its informers: wait until it answers yes.
    let user = format!("--as=system:serviceaccount:{CHART_NAMESPACE}:{PLUGIN_ACCOUNT}");
    for (verb, resource, sub) in [
        (
            "arbitrary-node:patch",
            format!("resourceclaims/{OTHER_DRIVER}"),
            "driver",
        ),
        ("patch", "resourceclaims".to_string(), "binding"),
    ] {
        wait_until(Duration::from_secs(30), || async {
            let sub = format!("--subresource={sub}");
            let namespace = format!("--namespace={PROBE_NAMESPACE}");
            let out = kubectl(
                cluster,
                &["auth", "can-i", verb, &resource, &sub, &namespace, &user],
            )
            .ok()?;
            (String::from_utf8_lossy(&out.stdout).trim() == "yes").then_some(())
        })
        .await
        .with_context(|| format!("the grant of {verb} {resource}/{sub} did not take effect"))?;
    }
    Ok(())
}

async fn revoke_136_checks(cluster: &Cluster) -> anyhow::Result<()> {
    Api::<ClusterRoleBinding>::all(cluster.client.clone())
        .delete(LIFTED, &Default::default())
        .await?;
    Api::<ClusterRole>::all(cluster.client.clone())
        .delete(LIFTED, &Default::default())
        .await?;
    Ok(())
}

/// Claim-status rows: for each, the admin creates a claim allocated on the row's node, and
/// the running plugin's token (bound to its pod on this node) server-side applies a
/// status.devices entry of its driver (dry run). For `claim-status` the API server's associated-node check decides;
/// for `claim-status-policy` the 1.36+ checks are lifted ([`lift_136_checks`]) and the chart's
/// admission policy decides. Returns the rows checked.
async fn check_claim_status_rows(
    cluster: &Cluster,
    rows: &[Row],
    failures: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let mut checked = check_claim_status_kind(cluster, rows, "claim-status", failures).await?;
    lift_136_checks(cluster).await?;
    let policy_rows = check_claim_status_kind(cluster, rows, "claim-status-policy", failures).await;
    revoke_136_checks(cluster).await?;
    checked += policy_rows?;
    Ok(checked)
}

async fn check_claim_status_kind(
    cluster: &Cluster,
    rows: &[Row],
    check: &str,
    failures: &mut Vec<String>,
) -> anyhow::Result<usize> {
    let admin: Api<ResourceClaim> = Api::namespaced(cluster.client.clone(), PROBE_NAMESPACE);
    let plugin: Api<ResourceClaim> = Api::namespaced(cluster.running_plugin_client().await?, PROBE_NAMESPACE);
    // What a refusal names: the API server's check, or the admission policy.
    let refused_by = if check == "claim-status" {
        "status.devices"
    } else {
        "ValidatingAdmissionPolicy"
    };
    let mut checked = 0;
    for row in rows.iter().filter(|r| r.check == check) {
        let node = row
            .name
            .clone()
            .context("claim-status rows name the claim's node")?;
        ensure!(
            row.verb == "patch" && row.subresource.as_deref() == Some("status"),
            "unsupported {check} row"
        );
        let name = format!("rbac-probe-{node}");
        allocated_probe(&admin, &name, &node, &[(DRIVER, node.as_str())]).await?;
        let status = json!({"devices": [device_entry(&node, DRIVER)]});
        let allowed = match plugin_status_write(&admin, &plugin, &name, status).await? {
            Ok(()) => true,
            Err(e) => {
                ensure!(
                    e.message.contains(refused_by),
                    "{check}: refused for another reason: {}",
                    e.message
                );
                false
            }
        };
        if allowed != row.expected {
            failures.push(format!(
                "{check}: plugin status.devices write on a claim allocated on {node}: allowed={allowed}, expected {}",
                row.expected
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

/// With the 1.36+ checks lifted (as on Kubernetes 1.35), the chart's admission policy alone
/// keeps the plugin of this node to its own entries of claims allocated here: it refuses a
/// claim of another node, another node's pool, another driver's entry and the reservations,
/// naming the policy, and lets the plugin's own write through.
async fn admission_policy_pins_claim_status_writes_without_the_136_checks(
    cluster: &mut Cluster,
) -> anyhow::Result<()> {
    lift_136_checks(cluster).await?;
    let result = claim_status_policy_cases(cluster).await;
    revoke_136_checks(cluster).await?;
    result
}

async fn claim_status_policy_cases(cluster: &Cluster) -> anyhow::Result<()> {
    let admin: Api<ResourceClaim> = Api::namespaced(cluster.client.clone(), PROBE_NAMESPACE);
    let plugin: Api<ResourceClaim> = Api::namespaced(cluster.running_plugin_client().await?, PROBE_NAMESPACE);
    let other = "other-node";
    let reservation =
        json!([{"resource": "pods", "name": "p", "uid": "00000000-0000-0000-0000-000000000001"}]);
    // (the claim's node, its allocated (driver, pool node)s, what the plugin writes, the
    // refusal expected). The API server itself refuses entries of devices not allocated.
    let own = [(DRIVER, NODE)];
    let cases = [
        // A claim allocated on another node, even with a device of this node's pool.
        (
            other,
            &own[..],
            json!({"devices": [device_entry(NODE, DRIVER)]}),
            Some("allocated to node other-node"),
        ),
        (
            other,
            &[(DRIVER, other)][..],
            json!({"devices": [device_entry(other, DRIVER)]}),
            Some("may only change the status.devices entries"),
        ),
        (
            NODE,
            &[(DRIVER, NODE), (OTHER_DRIVER, NODE)][..],
            json!({"devices": [device_entry(NODE, OTHER_DRIVER)]}),
            Some("may only change the status.devices entries"),
        ),
        (
            NODE,
            &own[..],
            json!({"reservedFor": reservation}),
            Some("status.reservedFor"),
        ),
        (
            NODE,
            &own[..],
            json!({"devices": [device_entry(NODE, DRIVER)]}),
            None,
        ),
    ];
    for (i, (node, results, status, refusal)) in cases.into_iter().enumerate() {
        let name = format!("policy-probe-{i}");
        allocated_probe(&admin, &name, node, results).await?;
        let what = format!("case {i}: claim on {node}, status {status}");
        match (
            plugin_status_write(&admin, &plugin, &name, status).await?,
            refusal,
        ) {
            (Ok(()), None) => {}
            (Ok(()), Some(_)) => bail!("{what}: allowed"),
            (Err(e), None) => bail!("{what}: refused: {}", e.message),
            (Err(e), Some(expected)) => ensure!(
                e.message.contains("ValidatingAdmissionPolicy") && e.message.contains(expected),
                "{what}: refused, but not by the policy with {expected:?}: {}",
                e.message
            ),
        }
    }
    Ok(())
}

/// One row of charts/tests/rbac_matrix.txt.
struct Row {
    subject: String,
    verb: String,
    resource: String,
    subresource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    expected: bool,
    check: String,
}

fn matrix() -> anyhow::Result<Vec<Row>> {
    let text =
        std::fs::read_to_string(migdra_e2e::cluster::repo_root().join("charts/tests/rbac_matrix.txt"))?;
    let field =
        |s: &str| (s != "-").then(|| s.replace("$RELEASE_NS", CHART_NAMESPACE).replace("$NODE", NODE));
    let mut rows = Vec::new();
    for line in text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        ensure!(f.len() == 8, "bad matrix row: {line}");
        rows.push(Row {
            subject: f[0].into(),
            verb: f[1].into(),
            resource: f[2].into(),
            subresource: field(f[3]),
            namespace: field(f[4]),
            name: field(f[5]),
            expected: f[6] == "yes",
            check: f[7].into(),
        });
    }
    Ok(rows)
}

async fn rbac_matrix_holds_against_the_api_server(cluster: &mut Cluster) -> anyhow::Result<()> {
    let rows = matrix()?;
    let mut failures = Vec::new();
    let mut checked = 0;
    for row in rows.iter().filter(|r| r.check == "can-i") {
        let account = if row.subject == "plugin" {
            PLUGIN_ACCOUNT
        } else {
            CONTROLLER_ACCOUNT
        };
        let target = match &row.name {
            Some(name) => format!("{}/{name}", row.resource),
            None => row.resource.clone(),
        };
        let mut args = vec!["auth".to_string(), "can-i".into(), row.verb.clone(), target];
        if let Some(sub) = &row.subresource {
            args.push(format!("--subresource={sub}"));
        }
        if let Some(ns) = &row.namespace {
            args.push(format!("--namespace={ns}"));
        }
        args.push(format!("--as=system:serviceaccount:{CHART_NAMESPACE}:{account}"));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = kubectl(cluster, &refs)?;
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if (answer == "yes") != row.expected {
            failures.push(format!(
                "{} {}: got {answer}, expected {}",
                row.subject,
                args[2..].join(" "),
                if row.expected { "yes" } else { "no" }
            ));
        }
        checked += 1;
    }
    // Admission rows: real requests with the running plugin's token (dry run), against
    // its own node's GpuNode and another node's, which the admin creates first.
    let plugin = cluster.running_plugin_client().await?;
    let admin: Api<GpuNode> = Api::all(cluster.client.clone());
    let other: GpuNode = serde_json::from_value(json!({
        "apiVersion": "gpu.migdra.dev/v1alpha1", "kind": "GpuNode",
        "metadata": {"name": "other-node"}, "spec": {"nodeName": "other-node", "driver": DRIVER}
    }))?;
    admin.create(&PostParams::default(), &other).await?;
    let api: Api<GpuNode> = Api::all(plugin);
    for row in rows.iter().filter(|r| r.check == "admission") {
        let name = row.name.clone().context("admission rows name an object")?;
        let dry = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        let patch = Patch::Merge(json!({"metadata": {"labels": {"migdra.dev/e2e": "probe"}}}));
        let result = match (row.verb.as_str(), row.subresource.as_deref()) {
            ("create", None) => {
                let mut object = other.clone();
                object.metadata.name = Some(name.clone());
                object.spec.node_name = name.clone();
                api.create(
                    &PostParams {
                        dry_run: true,
                        ..PostParams::default()
                    },
                    &object,
                )
                .await
                .map(drop)
            }
            ("patch", None) => api.patch(&name, &dry, &patch).await.map(drop),
            ("patch", Some("status")) => api
                .patch_status(&name, &dry, &Patch::Merge(json!({"status": {"plugin": null}})))
                .await
                .map(drop),
            other => bail!("unsupported admission row {other:?}"),
        };
        // Allowed means admission let it through; an AlreadyExists after admission counts.
        let allowed = match &result {
            Ok(()) => true,
            Err(kube::Error::Api(e)) if e.code == 409 => true,
            Err(kube::Error::Api(e)) if e.code == 403 || e.code == 422 => {
                ensure!(
                    e.message.contains("ValidatingAdmissionPolicy"),
                    "denied by something else: {}",
                    e.message
                );
                false
            }
            Err(e) => bail!("{} {} {name}: {e}", row.verb, row.resource),
        };
        if allowed != row.expected {
            failures.push(format!(
                "plugin {} {} {name} ({:?}): allowed={allowed}, expected {}",
                row.verb, row.resource, row.subresource, row.expected
            ));
        }
        checked += 1;
    }
    admin.delete("other-node", &Default::default()).await?;
    checked += check_claim_status_rows(cluster, &rows, &mut failures).await?;
    ensure!(checked == rows.len(), "checked {checked} of {} rows", rows.len());
    ensure!(
        failures.is_empty(),
        "{} of {checked} matrix rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!("e2e: RBAC matrix: {checked} rows hold");
    Ok(())
}

/// The chart's FlowSchemas under a real API server: none dangling, each request of the two
/// ServiceAccounts classified into the schema and priority level the chart means (the API
/// server names both in every response's `X-Kubernetes-PF-*-UID` headers), and the running
/// plugin's own heartbeat writes dispatched at `node-high`.
async fn migdra_requests_land_in_the_charts_priority_levels(cluster: &mut Cluster) -> anyhow::Result<()> {
    use k8s_openapi::api::flowcontrol::v1::{FlowSchema, PriorityLevelConfiguration};
    let schemas: Api<FlowSchema> = Api::all(cluster.client.clone());
    let levels: Api<PriorityLevelConfiguration> = Api::all(cluster.client.clone());
    let mut expected = std::collections::HashMap::new();
    for (schema, level) in [
        ("migdra-kubelet-plugin-heartbeat", "node-high"),
        ("migdra-kubelet-plugin", "workload-high"),
        ("migdra-controller-leader-election", "leader-election"),
        ("migdra-controller", "workload-high"),
    ] {
        // The API server's config controller writes the status shortly after creation.
        let object = wait_until(std::time::Duration::from_secs(30), || async {
            let object = schemas.get(schema).await.ok()?;
            let dangling = object
                .status
                .as_ref()?
                .conditions
                .as_ref()?
                .iter()
                .find(|c| c.type_.as_deref() == Some("Dangling"))?
                .status
                .clone()?;
            (dangling == "False").then_some(object)
        })
        .await
        .with_context(|| format!("FlowSchema {schema} missing, dangling or without status"))?;
        ensure!(
            object
                .spec
                .as_ref()
                .map(|s| s.priority_level_configuration.name.as_str())
                == Some(level),
            "FlowSchema {schema} does not name {level}"
        );
        let level_uid = levels.get(level).await?.metadata.uid.context("no uid")?;
        expected.insert(schema, (object.metadata.uid.context("no uid")?, level_uid));
    }

    // The plugin has been writing its GpuNode (and heartbeat Lease) since the suite started.
    let metrics = cluster
        .client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    ensure!(
        dispatched(&metrics, "migdra-kubelet-plugin-heartbeat", "node-high") > 0.0,
        "no request was dispatched through migdra-kubelet-plugin-heartbeat at node-high"
    );

    let lease = migdra_api::inventory::heartbeat_lease_name(NODE, DRIVER);
    let plugin = cluster.running_plugin_client().await?;
    let controller = cluster.running_controller_client().await?;
    let ns = CHART_NAMESPACE;
    for (client, who, path, schema) in [
        (
            &plugin,
            "plugin",
            format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{lease}"),
            "migdra-kubelet-plugin-heartbeat",
        ),
        (
            &plugin,
            "plugin",
            format!("/apis/gpu.migdra.dev/v1alpha1/gpunodes/{NODE}"),
            "migdra-kubelet-plugin-heartbeat",
        ),
        (
            &plugin,
            "plugin",
            format!("/api/v1/nodes/{NODE}"),
            "migdra-kubelet-plugin",
        ),
        (
            &plugin,
            "plugin",
            "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/none".into(),
            "migdra-kubelet-plugin",
        ),
        (
            &controller,
            "controller",
            format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/migdra-controller"),
            "migdra-controller-leader-election",
        ),
        (
            &controller,
            "controller",
            "/apis/resource.k8s.io/v1/resourceslices?limit=1".into(),
            "migdra-controller",
        ),
    ] {
        let response = client
            .send(http::Request::get(&path).body(Vec::new())?.map(Into::into))
            .await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        let (schema_uid, level_uid) = &expected[schema];
        ensure!(
            header("X-Kubernetes-PF-FlowSchema-UID") == *schema_uid
                && header("X-Kubernetes-PF-PriorityLevel-UID") == *level_uid,
            "the {who}'s GET {path} ({}) was not classified by {schema}: flow schema {:?}, priority level {:?}",
            response.status(),
            header("X-Kubernetes-PF-FlowSchema-UID"),
            header("X-Kubernetes-PF-PriorityLevel-UID"),
        );
    }
    Ok(())
}

/// `apiserver_flowcontrol_dispatched_requests_total` of one flow schema and priority level.
fn dispatched(metrics: &str, schema: &str, level: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("apiserver_flowcontrol_dispatched_requests_total{"))
        .filter(|l| {
            l.contains(&format!("flow_schema=\"{schema}\""))
                && l.contains(&format!("priority_level=\"{level}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
