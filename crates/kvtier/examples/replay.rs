//! Times a full-precision LRU replay of a Mooncake trace (JSONL path as the first argument):
//! `cargo run --release -p kvtier --example replay -- trace.jsonl 10000`.

use kvtier::sim::{Simulator, Trace};
use kvtier::{Config, PolicyKind, Tier, TierConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: replay TRACE.jsonl [CAPACITY_BLOCKS] [POLICY] [STEP_EVERY]");
    let capacity: u64 = args.next().map_or(10_000, |s| s.parse().expect("capacity"));
    let policy = PolicyKind::parse(&args.next().unwrap_or_else(|| "lru".into())).expect("policy");
    let text = std::fs::read_to_string(path).expect("read trace");
    let (mut offsets, mut hashes, mut inputs) = (vec![0u64], Vec::new(), Vec::new());
    for line in text.lines().filter(|l| !l.is_empty()) {
        // Minimal field extraction: this is a timing harness, not a parser.
        let ids = &line[line.find("\"hash_ids\": [").expect("hash_ids") + 13..];
        let ids = &ids[..ids.find(']').expect("]")];
        hashes.extend(
            ids.split(", ")
                .filter(|s| !s.is_empty())
                .map(|s| s.parse::<u64>().expect("id")),
        );
        offsets.push(hashes.len() as u64);
        let inp = &line[line.find("\"input_length\": ").expect("input_length") + 16..];
        inputs.push(inp[..inp.find(',').expect(",")].parse().expect("input"));
    }
    let cfg = Config {
        block_size: 512,
        level_bytes: vec![1],
        tiers: vec![TierConfig {
            tier: Tier::Device,
            budget_bytes: Some(capacity),
        }],
        policy,
        evict_on_full: true,
        pressure_only: true,
        ..Config::default()
    };
    let step_every: u64 = args.next().map_or(1, |s| s.parse().expect("step_every"));
    let trace = Trace::new(offsets, hashes, inputs).expect("trace");
    let mut best = f64::MAX;
    for _ in 0..5 {
        let mut sim = Simulator::new(cfg.clone(), trace.clone(), step_every).expect("sim");
        let t = std::time::Instant::now();
        sim.run(usize::MAX).expect("run");
        best = best.min(t.elapsed().as_secs_f64());
        eprintln!(
            "hits {} of {} blocks",
            sim.stats().hit_blocks,
            sim.stats().ref_blocks
        );
    }
    println!("best of 5: {:.2} ms", best * 1e3);
}
