//! Summaries of measured samples: count, p50, p99 (nearest rank) and mean, in the units the
//! table prints. Every figure of the table goes through here, so the quantile rule is one.

use std::time::Duration;

/// A set of samples in seconds.
#[derive(Clone, Debug, Default)]
pub struct Samples(Vec<f64>);

/// What the table prints of a [`Samples`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub count: usize,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

impl Samples {
    /// Adds a duration sample.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d.as_secs_f64());
    }

    /// Adds a sample in seconds.
    pub fn push_secs(&mut self, s: f64) {
        self.0.push(s);
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True without samples.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The summary; `None` without samples.
    pub fn summary(&self) -> Option<Summary> {
        if self.0.is_empty() {
            return None;
        }
        let mut sorted = self.0.clone();
        sorted.sort_by(f64::total_cmp);
        let mean = sorted.iter().sum::<f64>() / sorted.len() as f64;
        Some(Summary {
            count: sorted.len(),
            p50: nearest_rank(&sorted, 0.50),
            p99: nearest_rank(&sorted, 0.99),
            mean,
        })
    }
}

/// The nearest-rank quantile of sorted, non-empty samples: the smallest sample with at least
/// `q` of all samples at or below it.
fn nearest_rank(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Milliseconds with a precision that suits the magnitude.
pub fn ms(seconds: f64) -> String {
    let ms = seconds * 1000.0;
    if ms < 10.0 {
        format!("{ms:.2} ms")
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{seconds:.2} s")
    }
}

/// A summary as `p50 x / p99 y (n=…)`, in milliseconds.
pub fn latency(summary: &Summary) -> String {
    format!(
        "p50 {} / p99 {} (n={})",
        ms(summary.p50),
        ms(summary.p99),
        summary.count
    )
}

/// KiB as MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut s = Samples::default();
        for v in (1..=100).rev() {
            s.push_secs(f64::from(v));
        }
        let sum = s.summary().expect("samples");
        assert_eq!(sum.count, 100);
        assert_eq!(sum.p50, 50.0);
        assert_eq!(sum.p99, 99.0);
        assert_eq!(sum.mean, 50.5);

        let mut one = Samples::default();
        one.push(Duration::from_millis(250));
        let sum = one.summary().expect("one sample");
        assert_eq!((sum.p50, sum.p99), (0.25, 0.25));
        assert!(Samples::default().summary().is_none());
    }

    #[test]
    fn formats_by_magnitude() {
        assert_eq!(ms(0.00123), "1.23 ms");
        assert_eq!(ms(0.2504), "250 ms");
        assert_eq!(ms(12.345), "12.35 s");
        assert_eq!(mib(20480), "20.0 MiB");
    }
}
