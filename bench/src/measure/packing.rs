//! B7, packing: runs the packing simulation ([`crate::packing`]) and reports, summed over
//! every catalog GPU model, how many claims each device order placed as a share of the
//! exhaustive best placement (short arrival-only streams), and the mean acceptance on long
//! streams with releases; the naive (NVIDIA's) order is the anchor.

use std::fmt::Write as _;

use migdra_api::{catalog, policy::DeviceOrder};

use crate::{
    packing::{
        arrivals, first_fit, first_fit_arrivals, optimum, optimum_online, plan, random_stream,
        stream_profiles,
    },
    table::Row,
};

const ORDERS: [DeviceOrder; 3] = [DeviceOrder::Packed, DeviceOrder::Naive, DeviceOrder::Spread];
const SHORT_STREAMS: u64 = 300;
const SHORT_LEN: usize = 8;
const LONG_STREAMS: u64 = 100;
const LONG_LEN: usize = 400;
const LONG_GPUS: u32 = 2;

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

/// Runs the simulation over every catalog model: its totals and the per-model tables as text.
pub fn simulate() -> (PackingTotals, String) {
    let mut totals = PackingTotals::default();
    let mut text = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(
        text,
        "Short arrival-only streams: {SHORT_STREAMS} streams of {SHORT_LEN} claims on 1 GPU (claims placed, summed)\n  \
         best placement = exhaustive search over placements, every claim that fits is placed (the best any order can do)\n  \
         best subset    = exhaustive search that may also refuse claims (an offline bound no scheduler reaches)"
    );
    let _ = writeln!(
        text,
        "{:<16} {:>8} {:>8} {:>8} {:>15} {:>12}   {:>14}",
        "model", "packed", "naive", "spread", "best placement", "best subset", "packed = best"
    );
    for model in catalog::models() {
        let geometry = model.geometry();
        let profiles = stream_profiles(&geometry);
        let plans: Vec<_> = ORDERS.iter().map(|o| plan(model, 1, *o)).collect();
        let mut placed = [0usize; 3];
        let (mut online, mut offline, mut packed_optimal) = (0, 0, 0);
        for seed in 1..=SHORT_STREAMS {
            let requests = arrivals(random_stream(&profiles, seed, SHORT_LEN, 0));
            let best = optimum_online(&geometry, 1, &requests);
            online += best;
            offline += optimum(&geometry, 1, &requests);
            for (i, p) in plans.iter().enumerate() {
                let n = first_fit_arrivals(p, &requests);
                placed[i] += n;
                if i == 0 && n == best {
                    packed_optimal += 1;
                }
            }
        }
        let _ = writeln!(
            text,
            "{:<16} {:>8} {:>8} {:>8} {:>15} {:>12}   {:>7}/{SHORT_STREAMS}",
            model.key, placed[0], placed[1], placed[2], online, offline, packed_optimal
        );
        for (total, n) in totals
            .short
            .iter_mut()
            .zip([placed[0], placed[1], placed[2], online])
        {
            *total += n as f64;
        }
        totals.models += 1;
    }
    let _ = writeln!(
        text,
        "\nLong streams with releases: {LONG_STREAMS} streams of {LONG_LEN} claims on {LONG_GPUS} GPUs, mean hold 6 arrivals (acceptance %)"
    );
    let _ = writeln!(
        text,
        "{:<16} {:>8} {:>8} {:>8}",
        "model", "packed", "naive", "spread"
    );
    for model in catalog::models() {
        let profiles = stream_profiles(&model.geometry());
        let plans: Vec<_> = ORDERS.iter().map(|o| plan(model, LONG_GPUS, *o)).collect();
        let mut accepted = [0usize; 3];
        for seed in 1..=LONG_STREAMS {
            let events = random_stream(&profiles, seed, LONG_LEN, 6);
            for (i, p) in plans.iter().enumerate() {
                accepted[i] += first_fit(p, &events).0;
            }
        }
        let pct = accepted.map(|a| 100.0 * a as f64 / (LONG_STREAMS as usize * LONG_LEN) as f64);
        let _ = writeln!(
            text,
            "{:<16} {:>7.1}% {:>7.1}% {:>7.1}%",
            model.key, pct[0], pct[1], pct[2]
        );
        for (total, v) in totals.long.iter_mut().zip(pct) {
            *total += v / catalog::models().len() as f64;
        }
    }
    (totals, text)
}

/// The B7 row, and the simulation's tables for the result file.
pub fn run() -> (Row, String) {
    let (t, text) = simulate();
    let pct = |i: usize| 100.0 * t.short[i] / t.short[3];
    (
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
            note: "bench/src/packing.rs, release build; full output in the result file".into(),
        },
        text,
    )
}
