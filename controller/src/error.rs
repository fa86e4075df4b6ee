//! The controller's error type.

use migdra_api::policy::PolicyError;

/// Everything that can go wrong in the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A write lost a race with another writer (HTTP 409): the view it was based on is
    /// stale. The controller retries with backoff from a fresh view.
    #[error("{operation} of {object} conflicted with a concurrent change: {source}")]
    Conflict {
        /// `create`, `update` or `delete`.
        operation: &'static str,
        /// The object, e.g. `ResourceSlice node-a-gpu.migdra.dev-000`.
        object: String,
        #[source]
        source: kube::Error,
    },
    #[error("{operation} of ResourceSlice {name} failed: {source}")]
    SliceWrite {
        /// `create`, `update`, `delete` or `get`.
        operation: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("patching the status of GpuNode {node} failed: {source}")]
    StatusPatch {
        node: String,
        #[source]
        source: kube::Error,
    },
    /// The API server stored a slice without some of the fields that were sent, usually
    /// because a feature gate is off. Such a pool would be published wrong, so the controller
    /// stops and reports instead of looping.
    #[error(
        "the API server dropped fields of ResourceSlice {name} (is a DRA feature gate such as \
         DRAPartitionableDevices or DRADeviceTaints disabled?)"
    )]
    FieldsDropped { name: String },
    /// The MigPolicy that applies to the node is invalid.
    #[error("no valid MigPolicy for node {node}: {source}")]
    Policy {
        node: String,
        #[source]
        source: PolicyError,
    },
    /// The rendered pool breaks an API rule; it is not written.
    #[error("the pool of node {node} is invalid: {problems}")]
    InvalidPool {
        node: String,
        /// Every problem found, joined.
        problems: String,
    },
    /// A heartbeat expiry seen in the cache could not be confirmed with a fresh read of the
    /// node's Lease: the pool is kept, and the node retried with backoff.
    #[error(
        "the heartbeat of node {node} looks expired in the cache, but reading its {object} \
         to confirm failed, so its pool is kept: {reason}"
    )]
    HeartbeatUnconfirmed {
        node: String,
        /// What could not be read.
        object: &'static str,
        /// The API error or the timeout.
        reason: String,
    },
    /// The caches the reconciler reads were not filled in time.
    #[error("the {what} cache is not ready")]
    NotReady { what: &'static str },
    /// The controller's watches ended with an error.
    #[error("the controller stopped: {0}")]
    Controller(String),
    #[error("leader election failed: {0}")]
    LeaderElection(#[source] kube_lease_manager::LeaseManagerError),
}

impl Error {
    /// The `reason` label of `migdra_controller_reconcile_errors_total`, and the `reason` of
    /// the Kubernetes event and of the `Published=False` condition.
    fn reasons(&self) -> (&'static str, &'static str) {
        match self {
            Self::Conflict { .. } => ("conflict", "Conflict"),
            Self::SliceWrite { .. } => ("slice_write", "PublishFailed"),
            Self::StatusPatch { .. } => ("status_patch", "StatusFailed"),
            Self::FieldsDropped { .. } => ("fields_dropped", "FieldsDropped"),
            Self::Policy { .. } => ("policy", "PolicyInvalid"),
            Self::InvalidPool { .. } => ("invalid_pool", "PoolInvalid"),
            Self::HeartbeatUnconfirmed { .. } => ("heartbeat_unconfirmed", "HeartbeatUnconfirmed"),
            Self::NotReady { .. } => ("not_ready", "CachesNotReady"),
            Self::Controller(_) => ("controller", "ControllerFailed"),
            Self::LeaderElection(_) => ("leader_election", "LeaderElectionFailed"),
        }
    }

    /// The `reason` label of `migdra_controller_reconcile_errors_total`.
    pub fn metric_label(&self) -> &'static str {
        self.reasons().0
    }

    /// The `reason` of the Kubernetes event and of the `Published=False` condition.
    pub fn reason(&self) -> &'static str {
        self.reasons().1
    }

    /// Wraps an API error of a slice write, telling conflicts apart.
    pub fn slice_write(operation: &'static str, name: &str, source: kube::Error) -> Self {
        if is_conflict(&source) {
            Self::Conflict {
                operation,
                object: format!("ResourceSlice {name}"),
                source,
            }
        } else {
            Self::SliceWrite {
                operation,
                name: name.to_string(),
                source,
            }
        }
    }

    /// True for transient races that need no event (an unconfirmed heartbeat expiry is a
    /// struggling API server, which another event write would load further).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Self::Conflict { .. } | Self::NotReady { .. } | Self::HeartbeatUnconfirmed { .. }
        )
    }
}

/// True for HTTP 409 (Conflict, AlreadyExists).
pub fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 409)
}

/// True for HTTP 404.
pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(status) if status.code == 404)
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
