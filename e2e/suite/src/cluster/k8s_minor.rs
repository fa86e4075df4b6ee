//! Which upstream Kubernetes minor the cluster runs: the pinned default, or an older supported
//! one that `e2e/upstream/build.sh` builds from its own module when [`K8S_MINOR_ENV`] names it.

use anyhow::bail;

/// The environment variable that selects the minor (`1.35`; unset, empty or `1.37` for the
/// default). `e2e/upstream/build.sh` reads the same variable.
pub const K8S_MINOR_ENV: &str = "MIGDRA_K8S_MINOR";

/// Feature gates the API server and scheduler get on 1.37: the DRA features migdra uses,
/// explicitly.
const GATES_1_37: &str = "DRAPartitionableDevices=true,DRADeviceTaints=true,DRAPrioritizedList=true";
/// Feature gates every component gets on 1.35: besides 1.37's, the alpha gates of the features
/// that are on by default from 1.36 or 1.37 (shared partitions, the device plugin's resource
/// names). The kubelet and controller-manager need them too on 1.35: the kubelet admits a
/// container's extended resource through DRA only with DRAExtendedResource.
const GATES_1_35: &str = "DRAPartitionableDevices=true,DRADeviceTaints=true,DRAPrioritizedList=true,\
DRAConsumableCapacity=true,DRAExtendedResource=true";

/// An upstream Kubernetes minor the e2e cluster can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum K8sMinor {
    /// 1.37, the pinned default (`e2e/upstream/go.mod`).
    V1_37,
    /// 1.35, the oldest supported minor (`e2e/upstream/v1.35/go.mod`).
    V1_35,
}

impl K8sMinor {
    /// The minor [`K8S_MINOR_ENV`] selects.
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var(K8S_MINOR_ENV) {
            Err(std::env::VarError::NotPresent) => Ok(Self::V1_37),
            Ok(v) => Self::parse(&v),
            Err(e) => bail!("{K8S_MINOR_ENV}: {e}"),
        }
    }

    fn parse(value: &str) -> anyhow::Result<Self> {
        match value {
            "" | "1.37" => Ok(Self::V1_37),
            "1.35" => Ok(Self::V1_35),
            v => bail!("{K8S_MINOR_ENV}={v:?}: expected \"1.35\" or \"1.37\""),
        }
    }

    /// `--feature-gates` for the API server and scheduler.
    pub(super) fn control_plane_gates(self) -> &'static str {
        match self {
            Self::V1_37 => GATES_1_37,
            Self::V1_35 => GATES_1_35,
        }
    }

    /// `--feature-gates` for the controller-manager and kubelet, where their defaults fall
    /// short.
    pub(super) fn node_gates(self) -> Option<&'static str> {
        match self {
            Self::V1_37 => None,
            Self::V1_35 => Some(GATES_1_35),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_named_minors_parse() {
        assert_eq!(K8sMinor::parse("").ok(), Some(K8sMinor::V1_37));
        assert_eq!(K8sMinor::parse("1.37").ok(), Some(K8sMinor::V1_37));
        assert_eq!(K8sMinor::parse("1.35").ok(), Some(K8sMinor::V1_35));
    }

    #[test]
    fn unpinned_minor_is_refused_with_the_choices() {
        let error = K8sMinor::parse("1.36").err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some("MIGDRA_K8S_MINOR=\"1.36\": expected \"1.35\" or \"1.37\"")
        );
    }

    #[test]
    fn only_135_gates_the_node_components() {
        assert_eq!(K8sMinor::V1_37.node_gates(), None);
        let gates = K8sMinor::V1_35.node_gates().unwrap_or_default();
        assert!(gates.contains("DRAPartitionableDevices=true"), "{gates}");
        assert!(gates.contains("DRAExtendedResource=true"), "{gates}");
        assert_eq!(K8sMinor::V1_35.control_plane_gates(), gates);
    }
}
