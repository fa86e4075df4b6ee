//! A reader for the Prometheus text format, enough for the figures the bench takes from the
//! components' own `/metrics`: counter and gauge values by name and labels, and histograms
//! (buckets, sum, count) with bucket-interpolated quantiles.

use std::collections::BTreeMap;

/// One sample line: metric name, labels, value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Metric name as exposed (with `_total`, `_bucket`, … suffixes).
    pub name: String,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Value.
    pub value: f64,
}

/// A parsed exposition.
#[derive(Clone, Debug, Default)]
pub struct Metrics(Vec<Sample>);

/// A histogram: cumulative buckets by upper bound, sum and count.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound, cumulative count), ascending; the last bound is +Inf.
    pub buckets: Vec<(f64, f64)>,
    /// Sum of observations.
    pub sum: f64,
    /// Number of observations.
    pub count: f64,
}

impl Histogram {
    /// Mean observation; `None` when empty.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile interpolated linearly inside its bucket (as PromQL's
    /// `histogram_quantile`); the upper bound of the last finite bucket when it falls in +Inf.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut lower = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank {
                if bound.is_infinite() {
                    return Some(lower.0);
                }
                let in_bucket = cumulative - lower.1;
                if in_bucket <= 0.0 {
                    return Some(bound);
                }
                return Some(lower.0 + (bound - lower.0) * (rank - lower.1) / in_bucket);
            }
            lower = (bound, cumulative);
        }
        Some(lower.0)
    }

    /// The observations of both (same buckets; a bucket only one has counts for it alone).
    pub fn plus(&self, other: &Histogram) -> Histogram {
        self.combine(other, |a, b| a + b)
    }

    /// Observations added since `before` (same buckets).
    pub fn since(&self, before: &Histogram) -> Histogram {
        self.combine(before, |a, b| a - b)
    }

    /// Bucket by bucket (matched by bound; missing in `other`: 0), sum and count: `op`.
    fn combine(&self, other: &Histogram, op: impl Fn(f64, f64) -> f64) -> Histogram {
        let theirs = |bound: f64| {
            other
                .buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map_or(0.0, |(_, c)| *c)
        };
        Histogram {
            buckets: self.buckets.iter().map(|&(b, c)| (b, op(c, theirs(b)))).collect(),
            sum: op(self.sum, other.sum),
            count: op(self.count, other.count),
        }
    }
}

impl Metrics {
    /// Parses the text format; lines it does not understand are skipped.
    pub fn parse(text: &str) -> Self {
        Self(text.lines().filter_map(parse_line).collect())
    }

    /// Distinct metric names starting with `prefix` (to say what was there when an expected
    /// metric was not).
    pub fn names_with_prefix(&self, prefix: &str) -> Vec<String> {
        let names: std::collections::BTreeSet<&str> = self
            .0
            .iter()
            .map(|s| s.name.as_str())
            .filter(|n| n.starts_with(prefix))
            .collect();
        names.into_iter().map(str::to_string).collect()
    }

    /// Sum of the samples named `name` whose labels include every `(key, value)` of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        // Starting from 0.0: `Sum` for floats starts at -0.0, which an empty match would print.
        self.matching(name, labels).fold(0.0, |total, s| total + s.value)
    }

    /// Samples named `name` whose labels include `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|have| have == v))
        })
    }

    /// The histogram `name` (without suffix), merged over the series whose labels include
    /// `labels` and satisfy `keep`.
    pub fn histogram(
        &self,
        name: &str,
        labels: &[(&str, &str)],
        keep: impl Fn(&BTreeMap<String, String>) -> bool,
    ) -> Histogram {
        let bucket_name = format!("{name}_bucket");
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for s in self.matching(&bucket_name, labels).filter(|s| keep(&s.labels)) {
            let Some(le) = s.labels.get("le").and_then(|v| parse_value(v)) else {
                continue;
            };
            // Order buckets by bound; f64 bits of non-negative numbers sort like the numbers.
            let entry = buckets.entry(le.to_bits()).or_insert((le, 0.0));
            entry.1 += s.value;
        }
        let sum_name = format!("{name}_sum");
        let count_name = format!("{name}_count");
        Histogram {
            buckets: buckets.into_values().collect(),
            sum: self
                .matching(&sum_name, labels)
                .filter(|s| keep(&s.labels))
                .map(|s| s.value)
                .sum(),
            count: self
                .matching(&count_name, labels)
                .filter(|s| keep(&s.labels))
                .map(|s| s.value)
                .sum(),
        }
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        other => other.parse().ok(),
    }
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, rest, labels) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            (
                &line[..open],
                &line[close + 1..],
                parse_labels(&line[open + 1..close]),
            )
        }
        None => {
            let space = line.find(' ')?;
            (&line[..space], &line[space..], BTreeMap::new())
        }
    };
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = &rest[eq + 1..];
        let Some(body) = after.strip_prefix('"') else {
            break;
        };
        let mut value = String::new();
        let mut chars = body.char_indices();
        let mut end = body.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, escaped)) = chars.next() {
                        value.push(if escaped == 'n' { '\n' } else { escaped });
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        labels.insert(key, value);
        rest = &body[end..];
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP migdra_controller_slice_writes_total ResourceSlice writes
# TYPE migdra_controller_slice_writes_total counter
migdra_controller_slice_writes_total{operation="create"} 2500
migdra_controller_slice_writes_total{operation="delete"} 3
plain_gauge 7.5
dra_grpc_operations_duration_seconds_bucket{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodePrepareResources",le="0.01"} 2
dra_grpc_operations_duration_seconds_bucket{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodePrepareResources",le="0.1"} 10
dra_grpc_operations_duration_seconds_bucket{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodePrepareResources",le="+Inf"} 10
dra_grpc_operations_duration_seconds_sum{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodePrepareResources"} 0.4
dra_grpc_operations_duration_seconds_count{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodePrepareResources"} 10
dra_grpc_operations_duration_seconds_count{driver_name="gpu.migdra.dev",method_name="/v1.DRAPlugin/NodeUnprepareResources"} 4
escaped{msg="a \"quoted\" value, with comma",x="y"} 1
"#;

    #[test]
    fn counters_by_labels() {
        let m = Metrics::parse(TEXT);
        assert_eq!(m.sum("migdra_controller_slice_writes_total", &[]), 2503.0);
        assert_eq!(
            m.sum("migdra_controller_slice_writes_total", &[("operation", "create")]),
            2500.0
        );
        assert_eq!(m.sum("plain_gauge", &[]), 7.5);
        assert_eq!(m.sum("absent", &[]), 0.0);
        let escaped: Vec<_> = m.matching("escaped", &[("x", "y")]).collect();
        assert_eq!(escaped.len(), 1);
        assert_eq!(escaped[0].labels["msg"], "a \"quoted\" value, with comma");
    }

    #[test]
    fn histogram_quantiles_interpolate_inside_buckets() {
        let m = Metrics::parse(TEXT);
        let h = m.histogram("dra_grpc_operations_duration_seconds", &[], |l| {
            l.get("method_name")
                .is_some_and(|v| v.ends_with("NodePrepareResources"))
        });
        assert_eq!(h.count, 10.0);
        assert_eq!(h.mean(), Some(0.04));
        // Rank 5 of 10: 3 of the 8 observations in (0.01, 0.1].
        let p50 = h.quantile(0.5).expect("observations");
        assert!((p50 - (0.01 + 0.09 * 3.0 / 8.0)).abs() < 1e-12, "{p50}");
        let empty = h.since(&h);
        assert_eq!(empty.count, 0.0);
        assert_eq!(empty.quantile(0.5), None);
    }

    #[test]
    fn two_windows_add_up_to_the_whole() {
        let h = |buckets: &[(f64, f64)], sum: f64| Histogram {
            buckets: buckets.to_vec(),
            sum,
            count: buckets.last().map_or(0.0, |b| b.1),
        };
        let first = h(&[(0.01, 2.0), (0.1, 3.0), (f64::INFINITY, 3.0)], 0.1);
        let second = h(&[(0.01, 0.0), (0.1, 4.0), (f64::INFINITY, 5.0)], 2.3);
        let both = first.plus(&second);
        assert_eq!(both.buckets, [(0.01, 2.0), (0.1, 7.0), (f64::INFINITY, 8.0)]);
        assert_eq!((both.count, both.sum), (8.0, 2.4));
        assert_eq!(both.since(&second).buckets, first.buckets);
    }
}
