//! Prints the packing simulation table: for each GPU model, how many MIG claims first fit
//! over each device order places, against the exhaustive optimum on short arrival-only
//! streams, and the acceptance rate on long streams with releases.
//!
//! Run: `cargo run --release -p migdra-api --example packing`

use migdra_api::{
    catalog,
    policy::{DeviceOrder, EffectivePolicy},
    slices::{
        PoolPlan,
        packing::{self, Event},
        plan_pool,
    },
};

const ORDERS: [DeviceOrder; 3] = [DeviceOrder::Packed, DeviceOrder::Naive, DeviceOrder::Spread];

fn plan(model: &catalog::GpuModel, gpus: u32, order: DeviceOrder) -> PoolPlan {
    let inventory: Vec<_> = (0..gpus).map(|m| model.inventory(m, true)).collect();
    plan_pool(
        &inventory,
        &EffectivePolicy {
            device_order: order,
            whole_gpus: false,
            ..Default::default()
        },
    )
}

fn main() {
    const SHORT_STREAMS: u64 = 300;
    const SHORT_LEN: usize = 8;
    const LONG_STREAMS: u64 = 100;
    const LONG_LEN: usize = 400;
    const GPUS: u32 = 2;
    println!(
        "Short arrival-only streams: {SHORT_STREAMS} streams of {SHORT_LEN} claims on 1 GPU (claims placed, summed)"
    );
    println!(
        "  best placement = exhaustive search over placements, every claim that fits is placed (the best any order can do)"
    );
    println!(
        "  best subset    = exhaustive search that may also refuse claims (an offline bound no scheduler reaches)"
    );
    println!(
        "{:<16} {:>8} {:>8} {:>8} {:>15} {:>12}   {:>14}",
        "model", "packed", "naive", "spread", "best placement", "best subset", "packed = best"
    );
    for model in catalog::models() {
        let geometry = model.geometry();
        let profiles = packing::stream_profiles(&geometry);
        let plans: Vec<_> = ORDERS.iter().map(|o| plan(model, 1, *o)).collect();
        let mut totals = [0usize; 3];
        let (mut online, mut offline, mut packed_optimal) = (0, 0, 0);
        for seed in 1..=SHORT_STREAMS {
            let requests: Vec<_> = packing::random_stream(&profiles, seed, SHORT_LEN, 0)
                .into_iter()
                .filter_map(|e| {
                    if let Event::Arrive { profile, .. } = e {
                        Some(profile)
                    } else {
                        None
                    }
                })
                .collect();
            let best = packing::optimum_online(&geometry, 1, &requests);
            online += best;
            offline += packing::optimum(&geometry, 1, &requests);
            for (i, p) in plans.iter().enumerate() {
                let placed = packing::first_fit_arrivals(p, &requests);
                totals[i] += placed;
                if i == 0 && placed == best {
                    packed_optimal += 1;
                }
            }
        }
        println!(
            "{:<16} {:>8} {:>8} {:>8} {:>15} {:>12}   {:>7}/{SHORT_STREAMS}",
            model.key, totals[0], totals[1], totals[2], online, offline, packed_optimal
        );
    }
    println!();
    println!(
        "Long streams with releases: {LONG_STREAMS} streams of {LONG_LEN} claims on {GPUS} GPUs, mean hold 6 arrivals (acceptance %)"
    );
    println!("{:<16} {:>8} {:>8} {:>8}", "model", "packed", "naive", "spread");
    for model in catalog::models() {
        let profiles = packing::stream_profiles(&model.geometry());
        let plans: Vec<_> = ORDERS.iter().map(|o| plan(model, GPUS, *o)).collect();
        let mut accepted = [0usize; 3];
        let mut total = 0;
        for seed in 1..=LONG_STREAMS {
            let events = packing::random_stream(&profiles, seed, LONG_LEN, 6);
            total += LONG_LEN;
            for (i, p) in plans.iter().enumerate() {
                accepted[i] += packing::first_fit(p, &events).0;
            }
        }
        let pct = |a: usize| 100.0 * a as f64 / total as f64;
        println!(
            "{:<16} {:>7.1}% {:>7.1}% {:>7.1}%",
            model.key,
            pct(accepted[0]),
            pct(accepted[1]),
            pct(accepted[2])
        );
    }
}
