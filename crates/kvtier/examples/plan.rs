//! Times `plan()` and batch read updates over many blocks (the Rust side of `kvtier bench core`):
//! `cargo run --release -p kvtier --example plan -- [BLOCKS] [SEQUENCES]`.

use kvtier::{Config, Core};

/// A small xorshift: the timing needs spread-out values, not statistical quality.
fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    (0..n)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let blocks: u64 = args
        .next()
        .map_or(1_000_000, |s| s.parse().expect("blocks"));
    let seqs: u64 = args.next().map_or(1_000, |s| s.parse().expect("sequences"));
    let cfg = Config {
        block_size: 16,
        recent_window: 64,
        level_bytes: vec![4096, 2080, 1160],
        ..Config::default()
    };
    let mut core = Core::new(cfg).expect("core");
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let per_seq = blocks / seqs;
    for s in 0..seqs {
        let seq = core.add_sequence();
        let hashes: Vec<u64> = (s * per_seq..(s + 1) * per_seq).map(|h| h + 1).collect();
        let ids = core.append_blocks(seq, &hashes).expect("append").blocks;
        let mags: Vec<f32> = ids.iter().map(|_| (rng(&mut state) >> 40) as f32).collect();
        core.set_magnitude(&ids, &mags).expect("magnitude");
    }
    let t = std::time::Instant::now();
    let (id, moves) = {
        let p = core.plan().expect("plan");
        (p.id, p.moves.len())
    };
    let first = t.elapsed().as_secs_f64();
    core.commit(id).expect("commit");
    let steady = best_of(3, || {
        let id = core.plan().expect("plan").id;
        core.abort(id).expect("abort");
    });
    println!(
        "first plan {:.1} ms ({moves} moves), steady plan {:.1} ms",
        first * 1e3,
        steady * 1e3
    );
    let n = core.num_block_ids() as u64;
    let ids: Vec<u32> = (0..10 * blocks)
        .map(|_| (rng(&mut state) % n) as u32)
        .collect();
    let reads = best_of(3, || core.record_reads(&ids).expect("reads"));
    println!("reads {:.1} M/s", ids.len() as f64 / reads / 1e6);
}
