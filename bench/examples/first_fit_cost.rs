//! Prints, for each device order of an 8×H100 node, how many devices the scheduler's allocator
//! evaluates (CEL selectors) before the first fit for common requests, on an empty and on
//! partly filled nodes, next to the long-stream packing acceptance of the same order (B7's
//! second table, H100 on two GPUs).
//!
//! `cargo run --release -p migdra-bench --example first_fit_cost`

use migdra_api::catalog;
use migdra_bench::{
    first_fit::{Order, Request, cost_after, mean_while_filling, states},
    packing::{first_fit, random_stream, stream_profiles},
};

fn main() -> anyhow::Result<()> {
    let model =
        catalog::model("H100-80GB").ok_or_else(|| anyhow::anyhow!("H100-80GB is not in the catalog"))?;
    let requests = [
        Request::Profile("1g.10gb"),
        Request::Profile("2g.20gb"),
        Request::Profile("3g.40gb"),
        Request::AtLeastGib(19),
        Request::AtLeastGib(39),
    ];
    println!("Selector evaluations before (and including) the first fit, one 8×H100 node, no whole GPUs");
    println!("(devices in use are skipped without an evaluation; '-' = nothing fits)\n");
    for (state, fill) in states() {
        println!("node: {state}");
        print!("  {:<20}", "order");
        for r in &requests {
            print!(" {:>14}", r.name());
        }
        println!();
        for order in Order::ALL {
            let plan = order.plan(model, 8);
            print!("  {:<20}", order.name());
            for r in requests {
                let cost = cost_after(&plan, &fill, r);
                let cell = match cost.hit {
                    Some(_) => cost.evaluations.to_string(),
                    None => format!("- ({})", cost.evaluations),
                };
                print!(" {cell:>14}");
            }
            println!();
        }
        println!();
    }
    let profiles = stream_profiles(&model.geometry());
    println!("B1's workload on one node (56 × 1g.10gb, one at a time) and packing, by order:");
    println!(
        "  {:<20} {:>26} {:>32}",
        "order", "mean evaluations per claim", "long-stream acceptance (2 GPUs)"
    );
    for order in Order::ALL {
        let (mean, placed) = mean_while_filling(&order.plan(model, 8), Request::Profile("1g.10gb"), 56);
        let plan = order.plan(model, 2);
        let (mut accepted, mut total) = (0, 0);
        for seed in 1..=100 {
            let events = random_stream(&profiles, seed, 400, 6);
            let (a, r) = first_fit(&plan, &events);
            accepted += a;
            total += a + r;
        }
        println!(
            "  {:<20} {:>20.1} ({placed} placed) {:>31.1}%",
            order.name(),
            mean,
            100.0 * accepted as f64 / total.max(1) as f64
        );
    }
    Ok(())
}
