//! Readings from outside the measured processes: resident memory and CPU time from /proc, the
//! machine's load average, and `/metrics` of a component (plain HTTP on loopback for migdra's
//! processes, the API server through the admin client, the kubelet over HTTPS).

use std::{fs, time::Duration};

use anyhow::{Context as _, bail};
use kube::Client;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::prom::Metrics;

/// Resident memory of a process in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// The most resident memory a process has had since it started (its high-water mark), KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU time (user + system) a process has used so far.
pub fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the command.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second()))
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux configuration the kernel ships (USER_HZ).
fn clock_ticks_per_second() -> f64 {
    100.0
}

/// The 1-minute load average.
pub fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// The machine: cores, memory, CPU model.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory_gib = fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0.0, |kib| kib as f64 / 1024.0 / 1024.0);
    let model = fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores, {memory_gib:.0} GiB, {model}")
}

/// `GET /metrics` over plain HTTP/1.0 from a loopback port (migdra's processes).
pub async fn scrape_http(port: u16) -> anyhow::Result<Metrics> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut body = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut body))
        .await
        .context("reading /metrics timed out")??;
    let text = String::from_utf8_lossy(&body);
    let Some((head, payload)) = text.split_once("\r\n\r\n") else {
        bail!("no HTTP response from 127.0.0.1:{port}");
    };
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!(
            "/metrics on port {port}: {}",
            head.lines().next().unwrap_or_default()
        );
    }
    Ok(Metrics::parse(payload))
}

/// `GET path` through a kube client (the API server's `/metrics`, the kubelet's).
pub async fn scrape_client(client: &Client, path: &str) -> anyhow::Result<Metrics> {
    let text = client
        .request_text(http::Request::get(path).body(Vec::new())?)
        .await
        .with_context(|| format!("GET {path}"))?;
    Ok(Metrics::parse(&text))
}

/// A client for the kubelet's HTTPS port (self-signed serving certificate; the bench cluster
/// lets anonymous clients read it).
pub fn kubelet_client(port: u16) -> anyhow::Result<Client> {
    let mut config = kube::Config::new(format!("https://127.0.0.1:{port}").parse()?);
    config.accept_invalid_certs = true;
    Ok(Client::try_from(config)?)
}

/// A client for a control-plane component's HTTPS port (the scheduler's `/metrics`) with the
/// admin credentials of `kubeconfig` (self-signed serving certificate).
pub async fn component_client(kubeconfig: &std::path::Path, port: u16) -> anyhow::Result<Client> {
    let mut config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubeconfig)?,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    config.cluster_url = format!("https://127.0.0.1:{port}").parse()?;
    config.root_cert = None;
    config.accept_invalid_certs = true;
    Ok(Client::try_from(config)?)
}
