//! End-to-end tests on a real cluster: upstream etcd, kube-apiserver, kube-scheduler,
//! kube-controller-manager and kubelet on containerd and runc, simulated GPUs, and migdra
//! installed by its Helm chart, its controller and kubelet plugin running in the chart's pods
//! from images built from the Dockerfile. One cluster is started for the whole suite; tests run
//! one after another and each leaves the GPUs empty, one plugin pod Ready and the release at
//! its installed values.
//!
//! Each theme module names its tests once, in `tests![...]`, which makes its `TESTS` table;
//! [`SUITE`] lists the modules in the order they run. A test function left out of its module's
//! `tests!` is dead code, which the build rejects.
//!
//! Run: `make e2e` (`cargo build --workspace --all-targets`, then `cargo test --workspace --test
//! e2e`; the same package selection for both, so nothing is compiled twice).

#![allow(clippy::unwrap_used)] // test code

/// Makes a module's `TESTS` table from its test functions, in the order given. Each test is an
/// `async fn(&mut Cluster) -> anyhow::Result<()>`; its name in the results is the function's,
/// its kind the theme module's name (`[day2] name`), so a filter can select a whole theme.
macro_rules! tests {
    ($($test:ident),+ $(,)?) => {
        pub(crate) const TESTS: &[$crate::support::Test] = &[$(
            $crate::support::Test {
                name: stringify!($test),
                module: module_path!(),
                run: |cluster| Box::pin($test(cluster)),
            }
        ),+];
    };
}

mod support;

mod allocation;
mod chart;
mod claim_status;
mod compat;
mod containerd;
mod containerd_faults;
mod day2;
mod faults;
mod kubectl_plugin;
mod kueue;
mod observability;
mod placement;
mod pool;
mod rolling_update;
mod sharing;

use std::{path::Path, sync::Arc, time::Instant};

use libtest_mimic::{Arguments, Failed, Trial};
use migdra_e2e::cluster::{Cluster, ClusterConfig};
use tokio::sync::Mutex;

use crate::support::{Test, settle};

/// The themes, in the order their tests run against the one cluster.
const SUITE: [&[Test]; 15] = [
    pool::TESTS,
    allocation::TESTS,
    claim_status::TESTS,
    placement::TESTS,
    sharing::TESTS,
    compat::TESTS,
    faults::TESTS,
    chart::TESTS,
    observability::TESTS,
    rolling_update::TESTS,
    day2::TESTS,
    kubectl_plugin::TESTS,
    kueue::TESTS,
    containerd::TESTS,
    containerd_faults::TESTS,
];

type Shared = Arc<Mutex<Cluster>>;

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads = Some(1); // one cluster, tests in order
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let tests: Vec<Test> = SUITE.concat();
    if args.list {
        let trials = tests
            .iter()
            .map(|test| Trial::test(test.name, || Ok(())).with_kind(test.theme()))
            .collect();
        libtest_mimic::run(&args, trials).exit();
    }
    let started = Instant::now();
    let cluster = match runtime.block_on(Cluster::start(ClusterConfig::default())) {
        Ok(cluster) => cluster,
        Err(e) => {
            eprintln!("e2e: cluster start failed: {e:?}");
            std::process::exit(1);
        }
    };
    eprintln!(
        "e2e: cluster up in {:.1}s; run dir {}",
        started.elapsed().as_secs_f64(),
        cluster.layout.run_dir.display()
    );
    let logs = cluster.layout.logs_dir();
    let shared: Shared = Arc::new(Mutex::new(cluster));
    let handle = runtime.handle().clone();
    let trials = tests
        .into_iter()
        .map(|test| {
            let theme = test.theme();
            let Test { name, run, .. } = test;
            let shared = shared.clone();
            let handle = handle.clone();
            let logs = logs.clone();
            Trial::test(name, move || {
                handle.block_on(async {
                    let mut cluster = shared.lock().await;
                    let started = Instant::now();
                    let result = run(&mut cluster).await;
                    eprintln!("e2e: {name} took {:.1}s", started.elapsed().as_secs_f64());
                    if result.is_err() {
                        // Leave the node and the GPUs as the next test expects them even
                        // after a failure.
                        if let Err(e) = cluster.restore().await {
                            eprintln!("e2e: restoring the node after {name} failed: {e:#}");
                        }
                        if let Err(e) = settle(&cluster).await {
                            eprintln!("e2e: cleanup after {name} failed: {e:#}");
                        }
                    }
                    result.map_err(|e| Failed::from(failure_report(name, &e, &logs)))
                })
            })
            .with_kind(theme)
        })
        .collect();
    let conclusion = libtest_mimic::run(&args, trials);
    runtime.block_on(async {
        let mut cluster = shared.lock().await;
        // The launcher's processes; migdra runs in pods.
        for name in ["containerd", "kubelet", "kube-apiserver"] {
            if let Some(kib) = cluster.rss_kib(name) {
                eprintln!(
                    "e2e: resident memory of {name} after the suite: {:.1} MiB",
                    kib as f64 / 1024.0
                );
            }
        }
        cluster.teardown();
    });
    eprintln!(
        "e2e: total {:.1}s; logs kept in {}",
        started.elapsed().as_secs_f64(),
        logs.display()
    );
    conclusion.exit();
}

/// What a failed test reports: the error and its causes, then where the rest is. The error's
/// backtrace goes to a file in the logs directory, not into the report: a backtrace is dozens
/// of lines, and a CI log that keeps only its tail would keep them and lose the message.
fn failure_report(name: &str, error: &anyhow::Error, logs: &Path) -> String {
    let file = logs.join(format!("failure-{name}.txt"));
    let saved = match std::fs::write(&file, format!("{error:?}\n")) {
        Ok(()) => format!("backtrace in {}", file.display()),
        Err(e) => format!("backtrace not saved ({}: {e})", file.display()),
    };
    format!("{error:#}\n({saved}; component logs in {})", logs.display())
}
