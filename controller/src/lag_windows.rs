//! What the control plane's recent speed was: the longest slice watch lag, and how much later
//! than the one before it each plugin heartbeat renewal reaches the controller. Both are kept
//! over two consecutive windows, so an observation counts for one to two [`WINDOW`]s and then
//! is forgotten.

use std::time::{Duration, Instant};

/// How long an observation stays recent: between one and two of these.
pub const WINDOW: Duration = Duration::from_secs(60);

/// A value per window: the current one and the one before it.
#[derive(Debug)]
struct Windows<T> {
    start: Instant,
    current: T,
    previous: T,
}

impl<T: Default> Windows<T> {
    fn new(now: Instant) -> Self {
        Self {
            start: now,
            current: T::default(),
            previous: T::default(),
        }
    }

    /// Moves on to the window `now` falls in.
    fn rotate(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.start);
        if age >= 2 * WINDOW {
            self.previous = T::default();
            self.current = T::default();
            self.start = now;
        } else if age >= WINDOW {
            self.previous = std::mem::take(&mut self.current);
            self.start += WINDOW;
        }
    }
}

/// The longest duration observed recently.
#[derive(Debug)]
pub struct RecentMax(Windows<Duration>);

impl RecentMax {
    pub fn new(now: Instant) -> Self {
        Self(Windows::new(now))
    }

    pub fn record(&mut self, now: Instant, value: Duration) {
        self.0.rotate(now);
        self.0.current = self.0.current.max(value);
    }

    /// The longest recent observation (zero when there is none).
    pub fn get(&mut self, now: Instant) -> Duration {
        self.0.rotate(now);
        self.0.current.max(self.0.previous)
    }
}

/// Upper bounds of the delay buckets, in milliseconds; one more bucket holds the rest.
const BOUNDS_MS: [u64; 21] = [
    100, 250, 500, 1_000, 2_000, 3_000, 4_000, 5_000, 6_000, 8_000, 10_000, 12_000, 15_000, 20_000, 25_000,
    30_000, 40_000, 50_000, 60_000, 90_000, 120_000,
];

#[derive(Debug, Default)]
struct Buckets {
    counts: [u32; BOUNDS_MS.len() + 1],
}

/// Recent delays, bucketed: a quantile of them costs a walk over the buckets, and a record
/// one increment, however many plugins beat.
#[derive(Debug)]
pub struct RecentDelays(Windows<Buckets>);

impl RecentDelays {
    pub fn new(now: Instant) -> Self {
        Self(Windows::new(now))
    }

    pub fn record(&mut self, now: Instant, delay: Duration) {
        self.0.rotate(now);
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_MS.iter().position(|b| ms <= *b).unwrap_or(BOUNDS_MS.len());
        let count = &mut self.0.current.counts[bucket];
        *count = count.saturating_add(1);
    }

    /// The `q` quantile of the recent delays, as the upper bound of its bucket (so never an
    /// underestimate; `Duration::MAX` past the last bound), or `None` with fewer than
    /// `min_samples` observations.
    pub fn quantile(&mut self, now: Instant, q: f64, min_samples: u64) -> Option<Duration> {
        self.0.rotate(now);
        let Windows {
            current, previous, ..
        } = &self.0;
        let counts: Vec<u64> = (current.counts.iter().zip(&previous.counts))
            .map(|(a, b)| u64::from(*a) + u64::from(*b))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 || total < min_samples {
            return None;
        }
        // The rank of the quantile, 1-based: the smallest delay with at least q of them at or
        // below it.
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        let bucket = counts.iter().position(|count| {
            seen += count;
            seen >= rank
        });
        Some(
            bucket
                .and_then(|b| BOUNDS_MS.get(b))
                .map_or(Duration::MAX, |ms| Duration::from_millis(*ms)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, secs: u64) -> Instant {
        t0 + Duration::from_secs(secs)
    }

    #[test]
    fn a_maximum_counts_as_recent_for_one_to_two_windows() {
        let t0 = Instant::now();
        let mut lag = RecentMax::new(t0);
        lag.record(at(t0, 10), Duration::from_secs(20));
        lag.record(at(t0, 20), Duration::from_secs(5));
        assert_eq!(lag.get(at(t0, 59)), Duration::from_secs(20));
        // The next window still remembers it as the previous one's maximum.
        lag.record(at(t0, 70), Duration::from_secs(3));
        assert_eq!(lag.get(at(t0, 119)), Duration::from_secs(20));
        // A window later, only the 3 s of the window before is left.
        assert_eq!(lag.get(at(t0, 121)), Duration::from_secs(3));
        // Nothing for two whole windows: forgotten.
        assert_eq!(lag.get(at(t0, 400)), Duration::ZERO);
        lag.record(at(t0, 401), Duration::from_secs(1));
        assert_eq!(lag.get(at(t0, 402)), Duration::from_secs(1));
    }

    #[test]
    fn a_delay_quantile_is_its_buckets_upper_bound_and_needs_enough_samples() {
        let t0 = Instant::now();
        let mut delays = RecentDelays::new(t0);
        assert_eq!(delays.quantile(t0, 0.99, 1), None, "nothing observed");
        for _ in 0..98 {
            delays.record(t0, Duration::from_millis(40));
        }
        delays.record(t0, Duration::from_millis(7_500));
        delays.record(t0, Duration::from_secs(11));
        assert_eq!(delays.quantile(t0, 0.99, 200), None, "100 samples, 200 asked for");
        assert_eq!(delays.quantile(t0, 0.5, 20), Some(Duration::from_millis(100)));
        // The 99th of 100 is the 7.5 s delay: its bucket is bounded by 8 s.
        assert_eq!(delays.quantile(t0, 0.99, 20), Some(Duration::from_secs(8)));
        assert_eq!(delays.quantile(t0, 1.0, 20), Some(Duration::from_secs(12)));
        delays.record(t0, Duration::from_secs(600));
        assert_eq!(
            delays.quantile(t0, 1.0, 20),
            Some(Duration::MAX),
            "past the last bound"
        );
    }

    #[test]
    fn delays_are_forgotten_after_two_windows() {
        let t0 = Instant::now();
        let mut delays = RecentDelays::new(t0);
        for _ in 0..30 {
            delays.record(t0, Duration::from_secs(9));
        }
        assert_eq!(
            delays.quantile(at(t0, 90), 0.99, 20),
            Some(Duration::from_secs(10))
        );
        for _ in 0..30 {
            delays.record(at(t0, 130), Duration::from_millis(200));
        }
        // The 9 s delays were two windows ago: only the 200 ms ones are left.
        assert_eq!(
            delays.quantile(at(t0, 130), 0.99, 20),
            Some(Duration::from_millis(250))
        );
        assert_eq!(delays.quantile(at(t0, 400), 0.99, 20), None);
    }
}
