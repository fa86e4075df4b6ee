//! The CustomResourceDefinitions of migdra, rendered from the Rust types.

use kube::CustomResourceExt;
use migdra_api::{inventory::GpuNode, policy::MigPolicy};

/// The GpuNode and MigPolicy CRDs as multi-document YAML (stable: the same types give the
/// same bytes).
pub fn crds_yaml() -> Result<String, serde_saphyr::SerializeError> {
    let mut out = String::new();
    for crd in [GpuNode::crd(), MigPolicy::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

    use super::*;

    #[test]
    fn prints_both_crds_and_they_round_trip() {
        let yaml = crds_yaml().unwrap();
        assert_eq!(yaml, crds_yaml().unwrap(), "stable output");
        let docs: Vec<CustomResourceDefinition> = yaml
            .split("---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_saphyr::from_str(d).unwrap())
            .collect();
        let names: Vec<&str> = docs.iter().map(|c| c.metadata.name.as_deref().unwrap()).collect();
        assert_eq!(names, ["gpunodes.gpu.migdra.dev", "migpolicies.gpu.migdra.dev"]);
        assert_eq!(docs[0], GpuNode::crd());
        assert_eq!(docs[1], MigPolicy::crd());
        let gpunode = &docs[0].spec.versions[0];
        assert!(gpunode.subresources.as_ref().unwrap().status.is_some());
    }
}
