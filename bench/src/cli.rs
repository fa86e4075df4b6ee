//! Command line of `migdra-bench`; every flag can also come from an environment variable
//! (`make bench BENCH_NODES=100,500,2000`).

use std::path::PathBuf;

use clap::Parser;

/// The measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Measure {
    /// Scheduling throughput.
    B1,
    /// Cold publish and no-op resync.
    B2,
    /// Controller steady state (runs with B2).
    B3,
    /// Prepare latency.
    B4,
    /// Pod start.
    B5,
    /// Memory.
    B6,
    /// Packing.
    B7,
}

/// migdra benchmark: brings up the e2e cluster, simulates GPU nodes and prints one table of
/// B1–B7, each figure next to its anchor measured in the same run.
#[derive(Debug, Parser)]
#[command(name = "migdra-bench", version)]
pub struct Args {
    /// Node counts for the controller measures (B2, B3, B6), ascending; the fleet grows.
    #[arg(long, env = "BENCH_NODES", value_delimiter = ',', default_value = "100,500")]
    pub nodes: Vec<usize>,
    /// Simulated node counts B1 runs at, each with every phase; the fleet grows, so each
    /// size runs once the controller measures at the node counts below it are done. A size
    /// above `--upstream-controllers-max-nodes` is refused: B1 needs kube-scheduler.
    #[arg(
        long,
        env = "BENCH_B1_NODES",
        value_delimiter = ',',
        default_value = "100,1000"
    )]
    pub b1_nodes: Vec<usize>,
    /// Pods per B1 run (each with one 1g.10gb claim); the 1,000 take about 9
    /// minutes for both phases on a 2-core machine.
    #[arg(long, env = "BENCH_B1_PODS", default_value_t = 1000)]
    pub b1_pods: usize,
    /// B1's phases in order: `anchor` (static MIG, the bare devices the issue names), `migdra`,
    /// `migdra-1g10gb-only` (migdra under a MigPolicy offering what the anchor offers),
    /// `anchor-nvidia-attributes` (the static devices as NVIDIA's driver describes them),
    /// `nvidia-dynamic-mig` (the peer: NVIDIA's DynamicMIG pools and claims) and
    /// `anchor-beside`; a phase may repeat (`anchor,migdra,anchor` shows order effects). The
    /// ratios are `migdra` against `anchor` and against `nvidia-dynamic-mig`, each one's last
    /// run; the note gives the others. migdra's phases come first by default: a phase right
    /// after migdra's pools are restored also measures the API server taking in the
    /// controller's republish, which at 1,000 nodes slows every pod's binding.
    #[arg(
        long,
        env = "BENCH_B1_ORDER",
        value_enum,
        value_delimiter = ',',
        default_value = "migdra,migdra-1g10gb-only,anchor,anchor-nvidia-attributes,nvidia-dynamic-mig"
    )]
    pub b1_order: Vec<crate::measure::scheduling::Phase>,
    /// Above this many simulated nodes B2's bare-client floor is not run: its copies of every
    /// slice sit next to the controller's, and at 2,000 nodes one copy already takes the API
    /// server to about 11 GiB of a 24 GiB machine.
    #[arg(long, env = "BENCH_FLOOR_MAX_NODES", default_value_t = 1000)]
    pub floor_max_nodes: usize,
    /// Above this many simulated nodes, kube-scheduler and kube-controller-manager are stopped
    /// before the fleet grows, for B2/B3/B6 and the rest of the run. Those measures do not
    /// involve them, and each caches every slice: at 2,000 nodes they held 3.5 and 3.2 GiB
    /// next to an API server at 13 to 17 GiB, which ran the 24 GiB machine out of memory.
    #[arg(long, env = "BENCH_UPSTREAM_CONTROLLERS_MAX_NODES", default_value_t = 1000)]
    pub upstream_controllers_max_nodes: usize,
    /// The client-side API rate of kube-scheduler and kube-controller-manager
    /// (`--kube-api-qps`; burst twice that). Unset: upstream's defaults, 50 and 20 QPS. At
    /// 20 QPS the controller manager's ResourceClaim controller (a claim created per pod from
    /// its template, then the pod's status) caps B1 at about 10 pods/s, whatever the devices.
    #[arg(long, env = "BENCH_CONTROL_PLANE_QPS")]
    pub control_plane_api_qps: Option<u32>,
    /// Pod creations in flight at once (B1, node creation).
    #[arg(long, env = "BENCH_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Slice writers in flight at once for the bare-client floor of B2, one pool per writer:
    /// the controller's reconcile concurrency (`--max-concurrent-reconciles`, 16 by default;
    /// 0 = every pool at once, as controllers before that flag).
    #[arg(long, env = "BENCH_FLOOR_CONCURRENCY", default_value_t = 16)]
    pub floor_concurrency: usize,
    /// Pods of each kind (with and without a claim) B5 starts one at a time.
    #[arg(long, env = "BENCH_B5_PODS", default_value_t = 20)]
    pub b5_pods: usize,
    /// MIG pods B4 starts one at a time after B6, on top of B5's and the 26 after them, so
    /// that its p99 rests on more than one or two prepares: rounds of up to the node's 56
    /// placements, each round deleted before the next.
    #[arg(long, env = "BENCH_B4_EXTRA_PODS", default_value_t = 112)]
    pub b4_extra_pods: usize,
    /// Length of the steady-state window (B3), seconds.
    #[arg(long, env = "BENCH_STEADY_SECONDS", default_value_t = 60)]
    pub steady_seconds: u64,
    /// Who the simulated plugins write their GpuNodes and heartbeat Leases as.
    #[arg(
        long,
        env = "BENCH_PLUGIN_IDENTITY",
        value_enum,
        default_value = "service-account"
    )]
    pub plugin_identity: PluginIdentity,
    /// The simulated plugins' heartbeat interval (the plugin's default).
    #[arg(long, env = "BENCH_HEARTBEAT_INTERVAL_SECONDS", default_value_t = 15)]
    pub heartbeat_interval_seconds: u32,
    /// Also measure a second build of migdra's controller in the same run: after the
    /// controller measures (B2, B3, B6) with the binaries the cluster started with
    /// (`MIGDRA_BIN_DIR`), switch to the `migdra-controller` in this directory and measure
    /// them again (rows marked before/after).
    #[arg(long, env = "BENCH_AFTER_BIN_DIR")]
    pub after_bin_dir: Option<PathBuf>,
    /// The bare-client floor's concurrency for the `--after-bin-dir` controller.
    #[arg(long, env = "BENCH_AFTER_FLOOR_CONCURRENCY", default_value_t = 16)]
    pub after_floor_concurrency: usize,
    /// Measures to run (default: all).
    #[arg(long, env = "BENCH_ONLY", value_enum, value_delimiter = ',')]
    pub only: Vec<Measure>,
    /// Runs the controller with `--keep-memory-counter` (the GPU-memory counter a Kueue quota
    /// counts is published), to measure what it costs the scheduler.
    #[arg(long, env = "BENCH_KEEP_MEMORY_COUNTER")]
    pub keep_memory_counter: bool,
    /// A label for this run in the result file (e.g. `before`, `after`).
    #[arg(long, env = "BENCH_LABEL", default_value = "")]
    pub label: String,
    /// Directory for the result file (default: <target>/bench).
    #[arg(long, env = "BENCH_OUT")]
    pub out: Option<PathBuf>,
    /// Seconds of CPU profile taken from kube-scheduler in each B1 phase, from the phase's
    /// first pod (`/debug/pprof/profile`); 0: none. Each goes next to the result file
    /// (`scheduler-<phase>-<time>.pprof`, with `go tool pprof -top` of it when `go` is on
    /// PATH), and the heaviest functions into B1's notes. Keep it shorter than a phase.
    #[arg(long, env = "BENCH_SCHEDULER_PROFILE_SECONDS", default_value_t = 0)]
    pub scheduler_profile_seconds: u64,
}

/// The identity of the simulated plugins' writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PluginIdentity {
    /// As a real plugin: the chart's kubelet-plugin ServiceAccount with a token bound to the
    /// node, one client per node; the clients share one connection pool. The admission policy checks every write, and
    /// API Priority and Fairness classifies it by the chart's FlowSchemas.
    ServiceAccount,
    /// The bench's admin client, shared: exempt from API Priority and Fairness and from the
    /// admission policy, so it understates how late renewals get on a busy API server.
    Admin,
}

impl PluginIdentity {
    /// How the table names it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::ServiceAccount => {
                "the plugin's ServiceAccount, a node-bound token per node over shared connections"
            }
            Self::Admin => {
                "the cluster admin over shared connections (exempt from API Priority and Fairness)"
            }
        }
    }
}

impl Args {
    /// Refuses combinations that cannot run: B1 at a size where kube-scheduler is stopped.
    pub fn check(&self) -> anyhow::Result<()> {
        if self.runs(Measure::B1)
            && let Some(n) = self
                .b1_nodes
                .iter()
                .find(|n| **n > self.upstream_controllers_max_nodes)
        {
            anyhow::bail!(
                "B1 at {n} nodes needs kube-scheduler, which the bench stops above {} nodes \
                 (BENCH_UPSTREAM_CONTROLLERS_MAX_NODES); raise that or lower BENCH_B1_NODES",
                self.upstream_controllers_max_nodes
            );
        }
        Ok(())
    }

    /// Whether `m` runs.
    pub fn runs(&self, m: Measure) -> bool {
        self.only.is_empty() || self.only.contains(&m)
    }

    /// Where the result file (and the scheduler profiles) go: `--out`, or `bench/` in the
    /// target directory this binary runs from.
    pub fn out_dir(&self) -> anyhow::Result<PathBuf> {
        if let Some(out) = &self.out {
            return Ok(out.clone());
        }
        let exe = std::env::current_exe()?;
        let exe_dir = exe.parent().map(PathBuf::from).unwrap_or_default();
        Ok(exe_dir
            .parent()
            .map_or_else(|| exe_dir.clone(), PathBuf::from)
            .join("bench"))
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_defaults_and_lists() {
        Args::command().debug_assert();
        let a = Args::try_parse_from(["migdra-bench"]).expect("defaults");
        assert_eq!(a.nodes, [100, 500]);
        assert_eq!(a.b1_pods, 1000);
        assert_eq!(a.b1_nodes, [100, 1000]);
        use crate::measure::scheduling::Phase;
        assert_eq!(
            a.b1_order,
            [
                Phase::Migdra,
                Phase::MigdraOneProfile,
                Phase::Anchor,
                Phase::AnchorNvidiaAttributes,
                Phase::NvidiaDynamicMig
            ]
        );
        let a = Args::try_parse_from([
            "migdra-bench",
            "--b1-nodes",
            "1000",
            "--b1-order",
            "nvidia-dynamic-mig,migdra",
        ])
        .expect("B1 sizes and the peer");
        assert_eq!(a.b1_nodes, [1000]);
        assert_eq!(a.b1_order, [Phase::NvidiaDynamicMig, Phase::Migdra]);
        assert!(Args::try_parse_from(["migdra-bench", "--b1-order", "nvidia"]).is_err());
        assert!(Args::try_parse_from(["migdra-bench", "--b1-nodes", "100,many"]).is_err());
        let a = Args::try_parse_from(["migdra-bench", "--b1-order", "migdra,anchor,migdra"]).expect("order");
        assert_eq!(a.b1_order, [Phase::Migdra, Phase::Anchor, Phase::Migdra]);
        assert!(a.runs(Measure::B1) && a.runs(Measure::B7));
        let a = Args::try_parse_from(["migdra-bench", "--nodes", "2000", "--only", "b2,b3"]).expect("flags");
        assert_eq!(a.nodes, [2000]);
        assert!(a.runs(Measure::B3) && !a.runs(Measure::B1));
        assert_eq!(a.plugin_identity, PluginIdentity::ServiceAccount);
        assert!(a.check().is_ok());
        let a = Args::try_parse_from(["migdra-bench", "--b1-nodes", "100,2000"]).expect("sizes");
        assert!(a.check().is_err(), "B1 above the scheduler's limit");
        let a = Args::try_parse_from(["migdra-bench", "--b1-nodes", "2000", "--only", "b2"]).expect("sizes");
        assert!(a.check().is_ok(), "B1 does not run");
        let a = Args::try_parse_from(["migdra-bench", "--plugin-identity", "admin"]).expect("identity");
        assert_eq!(a.plugin_identity, PluginIdentity::Admin);
    }
}
