//! Why a claim cannot be prepared as allocated, and why planning failed.

use migdra_api::{geometry::PlacementError, profile::ProfileName};

use crate::nvml::BackendError;

/// Why a claim cannot be prepared as allocated. The message is what the user sees in the
/// pod's event; [`Rejection::reason`] is the stable label for metrics. Claims and holders
/// are named `namespace/name`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The GPU holds a checkpoint record that recovery could not repair yet; nothing is
    /// created on it until the repair succeeds.
    #[error("device {device}: GPU {minor} is unavailable until recovery of claim {claim} succeeds: {error}")]
    GpuRecoveryPending {
        device: String,
        minor: u32,
        claim: String,
        /// Why its repair failed last.
        error: String,
    },
    /// The GPU is lost (fallen off the bus, or mid reset): NVML cannot reach it, so nothing
    /// is created on it.
    #[error("device {device}: GPU {minor} is lost and cannot be used until it is back: {message}")]
    GpuLost {
        device: String,
        minor: u32,
        message: String,
    },
    /// The device names a GPU this node does not have.
    #[error("device {device}: this node has no GPU with minor number {minor}")]
    NoSuchGpu { device: String, minor: u32 },
    /// A whole GPU allocated after partitions of it.
    #[error("device {device} is GPU {minor} whole, which this claim also allocates partitions of")]
    WholeGpuAlsoPartitioned { device: String, minor: u32 },
    /// A partition of a GPU allocated whole earlier in the claim.
    #[error("device {device} is on GPU {minor}, which this claim also allocates whole")]
    PartitionOfWholeGpu { device: String, minor: u32 },
    /// The same whole GPU twice.
    #[error("device {device} is allocated twice in this claim")]
    DuplicateDevice { device: String },
    /// Another prepared claim holds the GPU or an overlapping placement.
    #[error(
        "device {device} overlaps device {other_device} already prepared for claim {other_claim} ({other_uid})"
    )]
    InUseByClaim {
        device: String,
        other_device: String,
        other_claim: String,
        other_uid: String,
    },
    /// The same shared device twice in one claim (more shares are asked for with
    /// `capacity.requests`, not with a second device).
    #[error(
        "shared device {device} is allocated twice in this claim; ask for more shares with capacity.requests instead"
    )]
    DuplicateShare { device: String },
    /// A shared device's instance is held only by claims that are not fully prepared (one is
    /// being rolled back or unprepared): it cannot be joined until that finishes.
    #[error(
        "shared device {device}: its MIG instance is being set up or torn down for claim {holder}; retry once that finishes"
    )]
    SharedInstanceUnsettled { device: String, holder: String },
    /// The instance the holders of a shared device recorded is gone from the GPU.
    #[error(
        "shared device {device}: MIG instance {gpu_instance} on GPU {minor}, held by claim {holder}, no longer exists"
    )]
    SharedInstanceMissing {
        device: String,
        minor: u32,
        gpu_instance: u32,
        holder: String,
    },
    /// A partition of a GPU that has no MIG.
    #[error("device {device}: GPU {minor} ({product_name}) is not MIG-capable")]
    NotMigCapable {
        device: String,
        minor: u32,
        product_name: String,
    },
    /// A profile the GPU does not offer.
    #[error("device {device}: GPU {minor} ({product_name}) has no MIG profile {profile} (it offers {})", offered.join(", "))]
    UnknownProfile {
        device: String,
        minor: u32,
        product_name: String,
        profile: ProfileName,
        /// The profiles the GPU has.
        offered: Vec<String>,
    },
    /// The placement is not valid on the GPU, or collides with what exists or with another
    /// device of the claim.
    #[error("device {device}: cannot create {profile} at memory slice {start} on GPU {minor}: {cause}")]
    PlacementUnavailable {
        device: String,
        profile: ProfileName,
        start: u32,
        minor: u32,
        cause: PlacementError,
    },
    /// A whole GPU that carries instances migdra did not create.
    #[error(
        "GPU {minor} has {count} MIG instance(s) that migdra does not own; it cannot be handed out whole"
    )]
    ForeignInstances { minor: u32, count: usize },
    /// The MIG-mode switch waited for a GPU reset the driver could not do; it was withdrawn.
    #[error(
        "device {device}: switching MIG mode on GPU {minor} needs a GPU reset the driver could not do (processes hold the GPU, or it is passed through to a VM); the change was withdrawn"
    )]
    MigModeChangePending { device: String, minor: u32 },
    /// The allocation needs a MIG-mode switch that only a GPU reset applies (Ampere), on a GPU
    /// passed through to a VM, where the driver cannot reset it: the change would only ever
    /// be pending, so migdra does not ask for it.
    #[error(
        "device {device} needs MIG turned {} on GPU {minor}, which applies a MIG-mode change only with a GPU reset that this VM cannot do; the mode was left unchanged (set it on the host, or reboot the VM after nvidia-smi -mig)",
        on_off(*enabled)
    )]
    MigModeNeedsReset {
        device: String,
        minor: u32,
        enabled: bool,
    },
    /// Another client holds the GPU, so its MIG mode cannot be switched now. `holders` are
    /// the processes NVML lists (`pid 4242 (python3)`); empty when only clients NVML cannot
    /// list hold it (an NVML session: DCGM's nv-hostengine, dcgm-exporter, a second plugin).
    #[error(
        "device {device} needs MIG turned {} on GPU {minor}, but the GPU is in use by {}; the mode was left unchanged. Stop them, or use the GPU in the mode it is in (MigPolicy migMode Current, Mig or Whole)",
        on_off(*enabled),
        holders_text(holders)
    )]
    MigModeSwitchBlocked {
        device: String,
        minor: u32,
        enabled: bool,
        holders: Vec<String>,
    },
    /// The GPU vanished between planning and creation.
    #[error("GPU {minor} disappeared")]
    GpuGone { minor: u32 },
    /// `adminAccess` to a MIG device: MIG devices exist only once a claim has them created,
    /// so there is nothing to monitor (the chart's admission policy refuses such claims
    /// earlier; this is the plugin's own check).
    #[error(
        "device {device}: adminAccess is only supported for whole GPUs; a MIG device does not exist until a claim without adminAccess has it created (request a whole GPU, device class gpu.migdra.dev, to monitor a GPU and all its MIG instances)"
    )]
    AdminAccessMigDevice { device: String },
    /// A claim with `adminAccess` devices and ordinary ones of this driver.
    #[error(
        "device {device} is allocated with adminAccess but device {other} of the same claim is not; put the monitoring request in a claim of its own"
    )]
    AdminAccessMixed { device: String, other: String },
}

fn on_off(enabled: bool) -> &'static str {
    if enabled { "on" } else { "off" }
}

fn holders_text(holders: &[String]) -> String {
    if holders.is_empty() {
        "another client NVML cannot list (an NVML session such as DCGM's nv-hostengine, dcgm-exporter or a second plugin instance)".into()
    } else {
        format!("other processes: {}", holders.join(", "))
    }
}

impl Rejection {
    /// A stable CamelCase label of the cause (a bounded set, for metrics).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::GpuRecoveryPending { .. } => "GpuRecoveryPending",
            Self::GpuLost { .. } => "GpuLost",
            Self::NoSuchGpu { .. } => "NoSuchGpu",
            Self::WholeGpuAlsoPartitioned { .. } => "WholeGpuAlsoPartitioned",
            Self::PartitionOfWholeGpu { .. } => "PartitionOfWholeGpu",
            Self::DuplicateDevice { .. } => "DuplicateDevice",
            Self::InUseByClaim { .. } => "InUseByClaim",
            Self::DuplicateShare { .. } => "DuplicateShare",
            Self::SharedInstanceUnsettled { .. } => "SharedInstanceUnsettled",
            Self::SharedInstanceMissing { .. } => "SharedInstanceMissing",
            Self::NotMigCapable { .. } => "NotMigCapable",
            Self::UnknownProfile { .. } => "UnknownProfile",
            Self::PlacementUnavailable { cause, .. } => match cause {
                PlacementError::UnknownProfile(_) | PlacementError::InvalidStart { .. } => "InvalidPlacement",
                PlacementError::Overlap { .. } => "PlacementOverlap",
                PlacementError::InstanceLimit { .. } => "InstanceLimit",
                PlacementError::Budget { .. } => "MigBudgetExceeded",
            },
            Self::ForeignInstances { .. } => "ForeignInstances",
            Self::MigModeChangePending { .. } => "MigModeChangePending",
            Self::MigModeNeedsReset { .. } => "MigModeNeedsReset",
            Self::MigModeSwitchBlocked { .. } => "MigModeSwitchBlocked",
            Self::GpuGone { .. } => "GpuGone",
            Self::AdminAccessMigDevice { .. } => "AdminAccessMigDevice",
            Self::AdminAccessMixed { .. } => "AdminAccessMixed",
        }
    }
}

/// Why planning failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// Listing a GPU's instances failed, and the decision needed them.
    #[error(transparent)]
    Backend(#[from] BackendError),
}
