//! B7, packing: runs the existing simulation (`api/examples/packing.rs`, built by `make
//! bench`) and reports, summed over every catalog GPU model, how many claims each device
//! order placed as a share of the exhaustive best placement (short arrival-only streams), and
//! the mean acceptance on long streams with releases; the naive (NVIDIA's) order is the
//! anchor.

use std::{path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::table::Row;

/// Column totals of the simulation's two tables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackingTotals {
    /// Models in the short-stream table.
    pub models: usize,
    /// Claims placed on short streams: packed, naive, spread, best placement.
    pub short: [f64; 4],
    /// Mean acceptance % on long streams: packed, naive, spread.
    pub long: [f64; 3],
}

/// Reads the simulation's output: rows of the short table have a model, five numbers and
/// `k/n`; rows of the long table a model and three percentages.
pub fn parse(output: &str) -> anyhow::Result<PackingTotals> {
    let mut totals = PackingTotals::default();
    let mut long_rows = 0usize;
    for line in output.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            [_, packed, naive, spread, best, _subset, ratio] if ratio.contains('/') => {
                let parsed: Result<Vec<f64>, _> = [packed, naive, spread, best]
                    .iter()
                    .map(|v| v.parse::<f64>())
                    .collect();
                let Ok(values) = parsed else { continue };
                for (total, v) in totals.short.iter_mut().zip(values) {
                    *total += v;
                }
                totals.models += 1;
            }
            [_, packed, naive, spread] if packed.ends_with('%') => {
                let parsed: Result<Vec<f64>, _> = [packed, naive, spread]
                    .iter()
                    .map(|v| v.trim_end_matches('%').parse::<f64>())
                    .collect();
                let Ok(values) = parsed else { continue };
                for (total, v) in totals.long.iter_mut().zip(values) {
                    *total += v;
                }
                long_rows += 1;
            }
            _ => {}
        }
    }
    if totals.models == 0 || long_rows == 0 {
        bail!("the packing simulation printed no table rows");
    }
    for v in &mut totals.long {
        *v /= long_rows as f64;
    }
    Ok(totals)
}

/// The B7 row from the simulation binary at `binary`, and its raw output.
pub fn run(binary: &Path) -> anyhow::Result<(Row, String)> {
    let output = Command::new(binary)
        .output()
        .with_context(|| format!("running {} (built by `make bench`)", binary.display()))?;
    if !output.status.success() {
        bail!(
            "{} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    let t = parse(&text)?;
    let pct = |i: usize| 100.0 * t.short[i] / t.short[3];
    Ok((
        Row {
            id: "B7",
            measure: format!(
                "packing simulation, {} GPU models: claims placed as % of the best placement",
                t.models
            ),
            value: format!(
                "packed {:.1}%, spread {:.1}%; long streams: packed {:.1}% accepted",
                pct(0),
                pct(2),
                t.long[0]
            ),
            anchor: format!(
                "naive (NVIDIA's) order: {:.1}%; long streams {:.1}%",
                pct(1),
                t.long[1]
            ),
            ratio: Some(t.short[0] / t.short[1]),
            goal: "unchanged or better",
            met: Some(t.short[0] >= t.short[1] && t.long[0] >= t.long[1]),
            note: "api/examples/packing.rs, release build; full output in the result file".into(),
        },
        text,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_both_tables() {
        let output = "\
Short arrival-only streams: 300 streams of 8 claims on 1 GPU (claims placed, summed)
model              packed    naive   spread  best placement  best subset    packed = best
A100-SXM4-40GB       1500     1400     1300            1550         1600       280/300
H100-80GB            1200     1100     1000            1250         1300       270/300

Long streams with releases: 100 streams of 400 claims on 2 GPUs, mean hold 6 arrivals (acceptance %)
model              packed    naive   spread
A100-SXM4-40GB      90.0%    80.0%    70.0%
H100-80GB           80.0%    70.0%    60.0%
";
        let t = parse(output).expect("tables");
        assert_eq!(t.models, 2);
        assert_eq!(t.short, [2700.0, 2500.0, 2300.0, 2800.0]);
        assert_eq!(t.long, [85.0, 75.0, 65.0]);
        assert!(parse("nothing here").is_err());
    }
}
