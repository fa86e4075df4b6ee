//! Command line of `migdra-controller`. Every flag can also come from an environment
//! variable, which is how the Helm chart configures it.

use std::time::Duration;

use clap::{Parser, Subcommand};
use migdra_api::{inventory::DEFAULT_DRIVER_NAME, policy::MigMode};
use migdra_runtime::ProcessArgs;

/// migdra controller: publishes the ResourceSlice pool of every GPU node whose kubelet
/// plugin is live, from the node's GpuNode inventory and the MigPolicies.
#[derive(Debug, Parser)]
#[command(name = "migdra-controller", version)]
pub struct Args {
    /// What to do instead of running the controller.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// DRA driver name; must match the kubelet plugins and the DeviceClasses.
    #[arg(long, env = "DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,
    /// Namespace of the leader-election Lease and of the plugins' heartbeat Leases.
    #[arg(long, env = "POD_NAMESPACE", default_value = "migdra-system")]
    pub namespace: String,
    /// This replica's identity in the Lease (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Run only while holding the Lease; false runs unconditionally (development, tests).
    #[arg(long, env = "LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, env = "LEASE_NAME", default_value = "migdra-controller")]
    pub lease_name: String,
    /// Seconds a Lease stays valid without renewal (renewed a third of that before expiry).
    #[arg(long, env = "LEASE_DURATION_SECONDS", default_value_t = 15,
          value_parser = clap::value_parser!(u64).range(2..))]
    pub lease_duration_seconds: u64,
    /// Seconds without a plugin heartbeat (measured from when the controller observed the last
    /// renewal, not from the node's renewTime) after which the node's pool is withdrawn; a plugin
    /// heartbeating less often gets 1.5 of its intervals. The kubelet deletes a driver's
    /// slices 30 s after its plugin disconnects, so keep this below 30 (minus a second or two
    /// for the reconcile) and above the plugin's interval (15 s by default) plus the latency
    /// of a status write: the default 25 withdraws a dead plugin's pool before the kubelet's
    /// wipe and tolerates one beat up to 10 s late.
    #[arg(long, env = "HEARTBEAT_TIMEOUT_SECONDS", default_value_t = 25,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub heartbeat_timeout_seconds: u64,
    /// Fraction (0 < f <= 1) of registered plugins whose heartbeats must expire at the same
    /// time (and at least 3 of them) for the controller to blame the control plane rather
    /// than the plugins: it then withdraws no pool on heartbeat expiry alone (an unregistered
    /// plugin or a kubelet wipe still withdraws), logs a warning and sets the metric
    /// migdra_controller_heartbeat_withdrawals_held. 1 disables the rule. On any number of
    /// nodes, an expiry while the node's kubelet Lease is not seen renewing either withdraws
    /// nothing.
    #[arg(long, env = "MASS_EXPIRY_THRESHOLD", default_value_t = crate::liveness::DEFAULT_MASS_EXPIRY_THRESHOLD,
          value_parser = parse_fraction)]
    pub mass_expiry_threshold: f64,
    /// Most nodes reconciled at once. Bounds the memory of a cold start (each publishing
    /// reconciliation holds its pool's slices, encoded, and one answer of the server at a
    /// time) and the write concurrency against the API server.
    #[arg(long, env = "MAX_CONCURRENT_RECONCILES", default_value_t = 16,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub max_concurrent_reconciles: u16,
    /// Publish each GPU's `memory` counter (MiB), which never refuses an allocation the memory
    /// slices allow and is otherwise left out, so that a quota can charge claims by GPU memory
    /// (Kueue's counter-based quota on partitionable devices). Costs the scheduler one more
    /// counter per device in every fit check.
    #[arg(long, env = "KEEP_MEMORY_COUNTER", default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub keep_memory_counter: bool,
    /// MIG mode of the nodes whose MigPolicy names none (see the MigPolicy's `migMode`):
    /// `current` uses each GPU in the mode it is in and never switches one; `dynamic`
    /// switches modes at prepare, which fails while other clients (dcgm-exporter,
    /// nv-hostengine) hold the GPU.
    #[arg(long, env = "DEFAULT_MIG_MODE", value_enum, default_value_t = MigModeArg::Current)]
    pub default_mig_mode: MigModeArg,
    /// Logging, the HTTP endpoint, threads and the kubeconfig.
    #[command(flatten)]
    pub process: ProcessArgs,
}

/// [`MigMode`] on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MigModeArg {
    Current,
    Mig,
    Whole,
    Dynamic,
}

impl From<MigModeArg> for MigMode {
    fn from(arg: MigModeArg) -> Self {
        match arg {
            MigModeArg::Current => Self::Current,
            MigModeArg::Mig => Self::Mig,
            MigModeArg::Whole => Self::Whole,
            MigModeArg::Dynamic => Self::Dynamic,
        }
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the GpuNode and MigPolicy CustomResourceDefinitions as multi-document YAML.
    PrintCrds,
}

impl Args {
    pub fn heartbeat_timeout(&self) -> Duration {
        Duration::from_secs(self.heartbeat_timeout_seconds)
    }

    /// The identity: the flag, else the host name, else a fixed fallback.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(hostname)
            .unwrap_or_else(|| "migdra-controller".to_string())
    }
}

/// A fraction in (0, 1].
fn parse_fraction(s: &str) -> Result<f64, String> {
    let f: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if f > 0.0 && f <= 1.0 {
        Ok(f)
    } else {
        Err(format!("{f} is not in (0, 1]"))
    }
}

fn hostname() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults_and_flags() {
        let a = Args::try_parse_from(["migdra-controller"]).unwrap();
        assert!(a.command.is_none());
        assert_eq!(a.driver_name, "gpu.migdra.dev");
        assert_eq!(a.lease_name, "migdra-controller");
        assert_eq!(a.lease_duration_seconds, 15);
        assert_eq!(a.heartbeat_timeout(), Duration::from_secs(25));
        assert_eq!(a.heartbeat_timeout(), crate::liveness::DEFAULT_HEARTBEAT_TIMEOUT);
        assert_eq!(a.mass_expiry_threshold, 0.55);
        assert_eq!(a.max_concurrent_reconciles, 16);
        assert!(!a.keep_memory_counter);
        assert_eq!(MigMode::from(a.default_mig_mode), MigMode::Current);
        assert_eq!(a.process.worker_threads, 2);
        assert!(Args::try_parse_from(["migdra-controller", "--worker-threads", "0"]).is_err());
        assert_eq!(a.process.http_address, "0.0.0.0:8080".parse().unwrap());
        assert!(!a.identity().is_empty());

        let a = Args::try_parse_from([
            "migdra-controller",
            "--leader-elect=false",
            "--identity",
            "pod-1",
            "--driver-name",
            "gpu.example.com",
            "--log-format",
            "json",
        ])
        .unwrap();
        assert!(!a.leader_elect);
        assert_eq!(a.identity(), "pod-1");
        assert_eq!(a.driver_name, "gpu.example.com");
        assert_eq!(a.process.log_format, migdra_runtime::LogFormat::Json);

        assert!(
            Args::try_parse_from(["migdra-controller", "--leader-elect"])
                .unwrap()
                .leader_elect
        );
        let a = Args::try_parse_from(["migdra-controller", "print-crds"]).unwrap();
        assert!(matches!(a.command, Some(Command::PrintCrds)));
        assert!(Args::try_parse_from(["migdra-controller", "--lease-duration-seconds", "1"]).is_err());
        assert!(
            Args::try_parse_from(["migdra-controller", "--keep-memory-counter"])
                .unwrap()
                .keep_memory_counter
        );
        assert!(Args::try_parse_from(["migdra-controller", "--keep-memory-counter=maybe"]).is_err());
        let a = Args::try_parse_from(["migdra-controller", "--mass-expiry-threshold", "0.8"]).unwrap();
        assert_eq!(a.mass_expiry_threshold, 0.8);
        for bad in ["0", "1.5", "-0.2", "half"] {
            assert!(
                Args::try_parse_from(["migdra-controller", "--mass-expiry-threshold", bad]).is_err(),
                "{bad}"
            );
        }
    }
}
