//! CPU profiles of kube-scheduler during B1's phases: where the scheduler's time goes, so a
//! gap between migdra and the static anchor can be put on a function rather than guessed.
//! The scheduler serves Go's `/debug/pprof/profile` (on by default, `--profiling`); the
//! bench's admin credentials may read it. A profile goes next to the result file; with `go`
//! on PATH, `go tool pprof -top` of it too, and the heaviest functions into the notes.

use std::{path::PathBuf, process::Command, time::Duration};

use anyhow::Context as _;
use kube::Client;

/// Where a phase's profile goes and how long it samples.
#[derive(Clone, Debug)]
pub struct ProfileRequest {
    /// Seconds of sampling.
    pub seconds: u64,
    /// The `.pprof` file.
    pub path: PathBuf,
}

/// Takes one CPU profile through `scheduler` (its HTTPS client) and summarises it: the
/// functions with the most samples of their own (`flat`) and, apart, those the DRA plugin
/// and the structured allocator spend under them (`cum`).
pub async fn take(scheduler: Client, request: ProfileRequest) -> anyhow::Result<String> {
    let uri = format!("/debug/pprof/profile?seconds={}", request.seconds);
    let response = tokio::time::timeout(
        Duration::from_secs(request.seconds + 30),
        scheduler.send(http::Request::get(&uri).body(kube::client::Body::empty())?),
    )
    .await
    .context("the profile did not arrive in time")?
    .with_context(|| format!("GET {uri}"))?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect_bytes()
        .await
        .context("reading the profile")?;
    anyhow::ensure!(
        status.is_success(),
        "GET {uri}: {status}: {}",
        String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
    );
    if let Some(dir) = request.path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&request.path, &bytes).with_context(|| format!("writing {}", request.path.display()))?;
    let summary = match top(&request.path, false).and_then(|flat| Ok((flat, top(&request.path, true)?))) {
        Ok((flat, cum)) => {
            let text = format!("# flat\n{flat}\n# cum\n{cum}\n");
            let top_path = request.path.with_extension("top.txt");
            std::fs::write(&top_path, text).with_context(|| format!("writing {}", top_path.display()))?;
            format!(
                "heaviest by own samples: {}; DRA plugin and allocator, cumulative: {}; ({})",
                heaviest(&flat, 5, |_| true),
                heaviest(&cum, 5, |name| name.contains("dynamicresources")
                    || name.contains("structured")),
                top_path.display()
            )
        }
        Err(e) => format!("profile written, not summarised ({e:#})"),
    };
    Ok(format!(
        "scheduler CPU profile {}: {summary}",
        request.path.display()
    ))
}

/// `go tool pprof -top` of `path`, sorted by own (`flat`) or cumulative samples.
fn top(path: &std::path::Path, cumulative: bool) -> anyhow::Result<String> {
    let mut command = Command::new("go");
    command.args(["tool", "pprof", "-top", "-nodecount=40"]);
    if cumulative {
        command.arg("-cum");
    }
    let output = command.arg(path).output().context("running go tool pprof")?;
    anyhow::ensure!(
        output.status.success(),
        "go tool pprof: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// One `-top` row: flat %, cum %, function.
#[derive(Debug, PartialEq)]
struct TopRow<'a> {
    flat_percent: &'a str,
    cum_percent: &'a str,
    function: &'a str,
}

/// Parses a `-top` row (`flat flat% sum% cum cum% function`); `None` for the headers.
fn parse_row(line: &str) -> Option<TopRow<'_>> {
    let mut rest = line.trim_start();
    let mut fields = [""; 5];
    for field in &mut fields {
        let end = rest.find(char::is_whitespace)?;
        *field = &rest[..end];
        rest = rest[end..].trim_start();
    }
    let [_flat, flat_percent, _sum, _cum, cum_percent] = fields;
    if !flat_percent.ends_with('%') || !cum_percent.ends_with('%') || rest.is_empty() {
        return None;
    }
    Some(TopRow {
        flat_percent,
        cum_percent,
        function: rest.trim_end(),
    })
}

/// The first `n` rows of `top` whose function `keep`s, as "function flat% / cum%".
fn heaviest(top: &str, n: usize, keep: impl Fn(&str) -> bool) -> String {
    let rows: Vec<String> = top
        .lines()
        .filter_map(parse_row)
        .filter(|r| keep(r.function))
        .take(n)
        .map(|r| {
            format!(
                "{} {} own / {} cum",
                short(r.function),
                r.flat_percent,
                r.cum_percent
            )
        })
        .collect();
    if rows.is_empty() {
        "none".into()
    } else {
        rows.join(", ")
    }
}

/// A Go function name without its module path (`k8s.io/…/structured.(*allocator).x` →
/// `structured.(*allocator).x`).
fn short(function: &str) -> &str {
    function.rsplit('/').next().unwrap_or(function)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOP: &str = "\
File: kube-scheduler
Type: cpu
Showing nodes accounting for 9.50s, 79.17% of 12s total
      flat  flat%   sum%        cum   cum%
     1.20s 10.00% 10.00%      1.50s 12.50%  runtime.mallocgc
     0.90s  7.50% 17.50%      4.00s 33.33%  k8s.io/dynamic-resource-allocation/structured/internal/experimental.(*allocator).allocateOne
     0.10s  0.83% 18.33%      6.00s 50.00%  k8s.io/kubernetes/pkg/scheduler/framework/plugins/dynamicresources.(*DynamicResources).Filter
         0     0% 18.33%      0.50s  4.17%  github.com/google/cel-go/interpreter.(*evalOr).Eval
";

    #[test]
    fn top_rows_are_parsed_and_filtered() {
        let rows: Vec<TopRow> = TOP.lines().filter_map(parse_row).collect();
        assert_eq!(rows.len(), 4, "{rows:?}");
        assert_eq!(rows[0].function, "runtime.mallocgc");
        assert_eq!(rows[3].flat_percent, "0%");
        assert_eq!(rows[3].cum_percent, "4.17%");
        assert_eq!(
            heaviest(TOP, 2, |_| true),
            "runtime.mallocgc 10.00% own / 12.50% cum, experimental.(*allocator).allocateOne 7.50% own / 33.33% cum"
        );
        assert_eq!(
            heaviest(TOP, 5, |f| f.contains("dynamicresources")),
            "dynamicresources.(*DynamicResources).Filter 0.83% own / 50.00% cum"
        );
        assert_eq!(heaviest(TOP, 5, |f| f.contains("nothing")), "none");
    }
}
