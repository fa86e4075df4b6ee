//! Command line of `migdra-kubelet-plugin`. Every flag can also come from an environment
//! variable, which is how the Helm chart's DaemonSet configures it.

use std::{ffi::OsString, net::SocketAddr, path::PathBuf, time::Duration};

use clap::Parser;
use migdra_api::inventory::DEFAULT_DRIVER_NAME;
use migdra_runtime::ProcessArgs;

/// migdra kubelet plugin: creates the MIG instance of each allocated ResourceClaim on this
/// node, hands it to containers through CDI, and destroys it once the pod is gone.
#[derive(Debug, Parser)]
#[command(name = "migdra-kubelet-plugin", version, after_help = GPU_CHECK_HELP)]
pub struct Args {
    /// Name of this node (from the downward API in a DaemonSet).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// DRA driver name; must match the DeviceClasses and the controller.
    #[arg(long, env = "DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,
    /// The kubelet's root directory (sockets go under plugins/ and plugins_registry/).
    #[arg(long, env = "KUBELET_ROOT_DIR", default_value = "/var/lib/kubelet")]
    pub kubelet_root_dir: PathBuf,
    /// Directory for per-claim CDI specs (the runtime's dynamic CDI directory).
    #[arg(long, env = "CDI_ROOT", default_value = "/var/run/cdi")]
    pub cdi_dir: PathBuf,
    /// Path of libnvidia-ml.so (default: libnvidia-ml.so.1 in the driver root's library
    /// directories for this architecture, else the loader's search path).
    #[arg(long, env = "NVML_LIB_PATH")]
    pub nvml_lib_path: Option<PathBuf>,
    /// Directory of the checkpoint and lock file (default: <kubelet-root-dir>/plugins/<driver>).
    #[arg(long, env = "STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Where /proc is (for /proc/devices and the MIG capability files).
    #[arg(long, env = "PROC_ROOT", default_value = "/proc")]
    pub proc_root: PathBuf,
    /// Host path of the NVIDIA driver installation whose files containers get: `/` for a
    /// driver installed on the host, `/run/nvidia/driver` for NVIDIA's driver container.
    #[arg(long, env = "DRIVER_ROOT", default_value = "/")]
    pub driver_root: PathBuf,
    /// Where this process sees the driver root (a DaemonSet mounts it elsewhere, e.g.
    /// `/driver-root`). Default: the driver root itself.
    #[arg(long, env = "DRIVER_ROOT_MOUNT")]
    pub driver_root_mount: Option<PathBuf>,
    /// Where this process sees the host's `/` (the `nvidia-cdi-hook` binary runs on the
    /// host, so it is looked up here).
    #[arg(long, env = "HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,
    /// Host path of NVIDIA's `nvidia-cdi-hook` that the CDI specs name; when it does not exist
    /// containers get the soname links as bind mounts and no hooks (with a warning event).
    #[arg(long, env = "NVIDIA_CDI_HOOK_PATH", default_value = crate::driver_files::DEFAULT_HOOK_PATH)]
    pub nvidia_cdi_hook_path: PathBuf,
    /// An `nvidia-cdi-hook` in this container (the plugin image carries one at
    /// /usr/local/bin/nvidia-cdi-hook) to install at --nvidia-cdi-hook-path on the host at
    /// start, replacing what differs. Unset: the specs use the host's own hook.
    #[arg(long, env = "NVIDIA_CDI_HOOK_SOURCE")]
    pub nvidia_cdi_hook_source: Option<PathBuf>,
    /// Where this process sees the host's `/dev` (for `/dev/nvidiactl` and `/dev/nvidia-uvm*`,
    /// which every CUDA container needs).
    #[arg(long, env = "DEV_ROOT", default_value = "/dev")]
    pub dev_root: PathBuf,
    /// File holding the kernel boot ID.
    #[arg(long, env = "BOOT_ID_PATH", default_value = "/proc/sys/kernel/random/boot_id")]
    pub boot_id_path: PathBuf,
    /// Address of the gRPC health endpoint (grpc.health.v1) for kubelet gRPC probes.
    #[arg(long, env = "GRPC_HEALTH_ADDRESS", default_value = "0.0.0.0:51515")]
    pub grpc_health_address: SocketAddr,
    /// Seconds between inventory refreshes and heartbeats (renewals of the node's heartbeat
    /// Lease).
    #[arg(long, env = "HEARTBEAT_INTERVAL_SECONDS", default_value_t = 15)]
    pub heartbeat_interval_seconds: u64,
    /// Namespace of the node's heartbeat Lease (`<node>.<driver>`): the controller's, where
    /// it watches them (the chart passes the pod's namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "migdra-system")]
    pub heartbeat_namespace: String,
    /// Seconds between full re-sends of the device health list to the kubelet.
    #[arg(long, env = "HEALTH_RESEND_INTERVAL_SECONDS", default_value_t = 10)]
    pub health_resend_interval_seconds: u64,
    /// Seconds a call waits for the node lock held by another plugin instance.
    #[arg(long, env = "LOCK_TIMEOUT_SECONDS", default_value_t = 30)]
    pub lock_timeout_seconds: u64,
    /// Seconds one NVML call may take; a call still running then fails its claim with "NVML is
    /// not answering" and marks its GPU unhealthy until it returns (a node-wide call, or all
    /// GPUs: the node stops being offered). Keep it well inside the kubelet's 45 s per call.
    #[arg(long, env = "NVML_CALL_TIMEOUT_SECONDS", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub nvml_call_timeout_seconds: u64,
    /// Seconds between passes that release recorded claims whose ResourceClaim is gone (0
    /// disables them; a pass also runs at start).
    #[arg(long, env = "STALE_CLAIM_GC_INTERVAL_SECONDS", default_value_t = 300)]
    pub stale_claim_gc_interval_seconds: u64,
    /// Names this plugin instance's kubelet sockets (`dra-<instance>.sock`,
    /// `<driver>-<instance>-reg.sock`) so that an old and a new instance can run side by side
    /// during a rolling update (kubelet 1.33 or newer, DaemonSet `maxSurge` > 0). The chart
    /// passes the pod UID. Empty: the fixed names `dra.sock` and `<driver>-reg.sock`.
    #[arg(long, env = "POD_UID", default_value = "")]
    pub plugin_instance: String,
    /// Logging, the HTTP endpoint, threads and the kubeconfig.
    #[command(flatten)]
    pub process: ProcessArgs,
}

/// The subcommand that checks this node's GPUs instead of running the plugin.
const GPU_CHECK: &str = "gpu-check";

const GPU_CHECK_HELP: &str = "Subcommand:\n  gpu-check  check that migdra understands this node's GPUs \
     (see `migdra-kubelet-plugin gpu-check --help`)";

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    /// No subcommand: the invocation the chart and e2e use.
    Plugin(Box<Args>),
    GpuCheck(crate::gpu_check::GpuCheckArgs),
}

impl Invocation {
    /// Parses `argv` (program name first). `gpu-check` as the first argument selects the
    /// subcommand with its own flags (it needs no `--node-name`); anything else is the
    /// plugin's command line, parsed exactly as without subcommands.
    pub fn try_parse_from<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
        if argv.get(1).is_some_and(|a| a == GPU_CHECK) {
            argv.remove(1);
            return crate::gpu_check::GpuCheckArgs::try_parse_from(argv).map(Invocation::GpuCheck);
        }
        Args::try_parse_from(argv).map(|a| Invocation::Plugin(Box::new(a)))
    }

    /// Parses the process' arguments, exiting with clap's message on an error.
    pub fn parse() -> Self {
        Self::try_parse_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }
}

impl Args {
    /// The state directory: the flag, else `<kubelet-root-dir>/plugins/<driver>`.
    pub fn resolved_state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| self.kubelet_root_dir.join("plugins").join(&self.driver_name))
    }

    /// At least a second: never a busy loop.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_secs(self.heartbeat_interval_seconds.max(1))
    }

    /// At least a second.
    pub fn health_resend_interval(&self) -> Duration {
        Duration::from_secs(self.health_resend_interval_seconds.max(1))
    }

    pub fn resolved_driver_root_mount(&self) -> PathBuf {
        self.driver_root_mount
            .clone()
            .unwrap_or_else(|| self.driver_root.clone())
    }

    pub fn lock_timeout(&self) -> Duration {
        Duration::from_secs(self.lock_timeout_seconds)
    }

    pub fn nvml_call_timeout(&self) -> Duration {
        Duration::from_secs(self.nvml_call_timeout_seconds)
    }

    /// Zero means disabled.
    pub fn stale_claim_gc_interval(&self) -> Duration {
        Duration::from_secs(self.stale_claim_gc_interval_seconds)
    }
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
    fn defaults_and_derived_settings() {
        let a = Args::try_parse_from(["migdra-kubelet-plugin", "--node-name", "n1"]).unwrap();
        assert_eq!(a.node_name, "n1");
        assert_eq!(a.driver_name, "gpu.migdra.dev");
        assert_eq!(
            a.resolved_state_dir(),
            PathBuf::from("/var/lib/kubelet/plugins/gpu.migdra.dev")
        );
        assert_eq!(a.cdi_dir, PathBuf::from("/var/run/cdi"));
        assert_eq!(a.proc_root, PathBuf::from("/proc"));
        assert_eq!(a.boot_id_path, PathBuf::from("/proc/sys/kernel/random/boot_id"));
        assert_eq!(a.process.http_address, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(a.grpc_health_address, "0.0.0.0:51515".parse().unwrap());
        assert_eq!(a.process.worker_threads, 2);
        assert!(
            Args::try_parse_from([
                "migdra-kubelet-plugin",
                "--node-name",
                "n1",
                "--worker-threads",
                "0"
            ])
            .is_err()
        );
        assert_eq!(a.heartbeat_interval(), Duration::from_secs(15));
        assert_eq!(a.heartbeat_namespace, "migdra-system");
        assert_eq!(a.health_resend_interval(), Duration::from_secs(10));
        assert_eq!(a.lock_timeout(), Duration::from_secs(30));
        assert_eq!(a.stale_claim_gc_interval(), Duration::from_secs(300));
        assert_eq!(a.process.log_format, migdra_runtime::LogFormat::Text);
        assert!(a.nvml_lib_path.is_none());
        assert_eq!(a.driver_root, PathBuf::from("/"));
        assert_eq!(a.resolved_driver_root_mount(), PathBuf::from("/"));
        assert_eq!(a.host_root, PathBuf::from("/"));
        assert_eq!(a.nvidia_cdi_hook_path, PathBuf::from("/usr/bin/nvidia-cdi-hook"));
        assert!(a.nvidia_cdi_hook_source.is_none(), "the host's hook unless told");
        assert_eq!(a.dev_root, PathBuf::from("/dev"));
        assert_eq!(a.plugin_instance, "", "no instance: the fixed socket names");

        let a = Args::try_parse_from([
            "migdra-kubelet-plugin",
            "--node-name=n1",
            "--state-dir=/s",
            "--heartbeat-interval-seconds=0",
            "--log-format=json",
            "--driver-root=/run/nvidia/driver",
        ])
        .unwrap();
        assert_eq!(
            a.resolved_driver_root_mount(),
            PathBuf::from("/run/nvidia/driver"),
            "the driver root is seen at its host path unless a mount is named"
        );
        let mounted = Args::try_parse_from([
            "migdra-kubelet-plugin",
            "--node-name=n1",
            "--driver-root=/run/nvidia/driver",
            "--driver-root-mount=/driver-root",
        ])
        .unwrap();
        assert_eq!(
            mounted.resolved_driver_root_mount(),
            PathBuf::from("/driver-root")
        );
        assert_eq!(a.resolved_state_dir(), PathBuf::from("/s"));
        assert_eq!(
            a.heartbeat_interval(),
            Duration::from_secs(1),
            "never a busy loop"
        );
        assert_eq!(a.process.log_format, migdra_runtime::LogFormat::Json);
    }

    #[test]
    fn gpu_check_is_a_subcommand_without_node_name_and_the_default_is_unchanged() {
        use crate::gpu_check::{GpuCheckArgs, OutputFormat};
        GpuCheckArgs::command().debug_assert();
        let Ok(Invocation::GpuCheck(a)) = Invocation::try_parse_from([
            "migdra-kubelet-plugin",
            "gpu-check",
            "--read-only",
            "--gpu=1",
            "-o",
            "json",
            "--nvml-lib-path=/x/libnvidia-ml.so.1",
        ]) else {
            panic!("gpu-check parses without --node-name")
        };
        assert!(a.read_only);
        assert_eq!(a.gpu, Some(1));
        assert_eq!(a.output, OutputFormat::Json);
        assert_eq!(a.proc_root, PathBuf::from("/proc"));
        assert_eq!(a.driver_root, PathBuf::from("/"));
        assert_eq!(a.host_root, PathBuf::from("/"));
        assert!(a.driver_root_mount.is_none());
        let Ok(Invocation::Plugin(p)) =
            Invocation::try_parse_from(["migdra-kubelet-plugin", "--node-name=n1"])
        else {
            panic!("no subcommand runs the plugin")
        };
        assert_eq!(p.node_name, "n1");
        assert!(
            Invocation::try_parse_from(["migdra-kubelet-plugin"]).is_err(),
            "the plugin still needs --node-name"
        );
        assert!(
            Invocation::try_parse_from(["migdra-kubelet-plugin", "--node-name=n1", "gpu-check"]).is_err(),
            "gpu-check is only a subcommand in first position"
        );
        let env: Vec<_> = GpuCheckArgs::command()
            .get_arguments()
            .filter(|a| a.get_long().is_some_and(|l| l != "help" && l != "version"))
            .map(|a| {
                (
                    a.get_long().unwrap().to_string(),
                    a.get_env().map(|e| e.to_string_lossy().into_owned()),
                )
            })
            .collect();
        assert!(
            env.iter().all(|(_, e)| e.is_some()),
            "every gpu-check flag has an env var: {env:?}"
        );
    }

    #[test]
    fn every_flag_has_its_environment_variable() {
        let env: Vec<(String, String)> = Args::command()
            .get_arguments()
            .filter_map(|a| {
                Some((
                    a.get_long()?.to_string(),
                    a.get_env()?.to_string_lossy().into_owned(),
                ))
            })
            .collect();
        let expected = [
            ("node-name", "NODE_NAME"),
            ("driver-name", "DRIVER_NAME"),
            ("kubelet-root-dir", "KUBELET_ROOT_DIR"),
            ("cdi-dir", "CDI_ROOT"),
            ("nvml-lib-path", "NVML_LIB_PATH"),
            ("state-dir", "STATE_DIR"),
            ("proc-root", "PROC_ROOT"),
            ("driver-root", "DRIVER_ROOT"),
            ("driver-root-mount", "DRIVER_ROOT_MOUNT"),
            ("host-root", "HOST_ROOT"),
            ("nvidia-cdi-hook-path", "NVIDIA_CDI_HOOK_PATH"),
            ("nvidia-cdi-hook-source", "NVIDIA_CDI_HOOK_SOURCE"),
            ("dev-root", "DEV_ROOT"),
            ("boot-id-path", "BOOT_ID_PATH"),
            ("grpc-health-address", "GRPC_HEALTH_ADDRESS"),
            ("heartbeat-interval-seconds", "HEARTBEAT_INTERVAL_SECONDS"),
            ("heartbeat-namespace", "POD_NAMESPACE"),
            ("health-resend-interval-seconds", "HEALTH_RESEND_INTERVAL_SECONDS"),
            ("lock-timeout-seconds", "LOCK_TIMEOUT_SECONDS"),
            ("nvml-call-timeout-seconds", "NVML_CALL_TIMEOUT_SECONDS"),
            (
                "stale-claim-gc-interval-seconds",
                "STALE_CLAIM_GC_INTERVAL_SECONDS",
            ),
            ("plugin-instance", "POD_UID"),
            ("kubeconfig", "KUBECONFIG"),
            ("log-format", "LOG_FORMAT"),
            ("log-level", "LOG_LEVEL"),
            ("http-address", "HTTP_ADDRESS"),
            ("worker-threads", "WORKER_THREADS"),
        ];
        let expected: Vec<(String, String)> = expected
            .iter()
            .map(|(f, e)| (f.to_string(), e.to_string()))
            .collect();
        assert_eq!(env, expected);
    }
}
