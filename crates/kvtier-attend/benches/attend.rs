//! Time per call of the kernel at the decode shapes of benchmarks/attend_cpu.py (SmolLM2 at 512
//! and 4096 tokens, and 1024 and 2048 between them where splitting a call over threads starts
//! to pay; Llama-3-8B 4 x 528), over blocks all at level 0, all int8 (symmetric, per
//! token), all int4, all int2 and all rotated int2 (asymmetric, keys per channel, values in
//! groups of 32 as the shipped codecs group them), with no Python in the way:
//! `cargo bench -p kvtier-attend [-- FILTER]`. Prints figures (best mean of several batches),
//! never passes or fails. `KVTIER_BENCH_ISA=scalar` runs the portable loops;
//! `KVTIER_BENCH_CALLS=N` makes N calls of each case on one thread and times nothing (for
//! `perf stat`, whose counts a shared machine disturbs less than the clock).

use std::time::Instant;

use kvtier_attend::{attend, Exec, FloatDtype, Inputs, Isa, Outputs, Pool, PoolDesc, Problem};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mix {
    Level0,
    Int8,
    Int4,
    Int2,
    Int2Rot,
}

/// Values a group of the shipped int4 and int2 codecs (python/kvtier/codecs/quant.py).
const VALUE_GROUP: usize = 32;

/// The rotation's signs for rotated pools of head size `d` (any ±1 will do for timing).
fn signs(d: usize) -> Vec<f32> {
    (0..d)
        .map(|i| if i % 3 == 1 { -1.0 } else { 1.0 })
        .collect()
}

struct Shape {
    name: &'static str,
    seqs: usize,
    tokens: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    dtype: FloatDtype,
}

impl Shape {
    /// One decode step (a query per sequence) of `seqs` sequences over `max_blocks` blocks.
    fn decode_step(&self, seqs: usize, max_blocks: usize, layer: usize) -> Problem {
        Problem {
            seqs,
            queries: 1,
            q_heads: self.hq,
            kv_heads: self.hkv,
            block_size: B,
            head_dim: self.d,
            max_blocks,
            layer,
            scale: 1.0 / (self.d as f32).sqrt(),
        }
    }
}

const B: usize = 16;

/// fp16 bits of a value in [2^-7, 2^-5): small scales, like real ones
fn small_f16(rng: &mut Rng) -> [u8; 2] {
    let exp = 8 + (rng.next() % 2) as u16;
    ((exp << 10) | (rng.next() % 1024) as u16).to_le_bytes()
}

/// A pool of `slots` rows of `layers` layers, filled at `layer` only (the others stay zero pages
/// the kernel never reads): descriptor fields and bytes.
fn pool(
    mix: Mix,
    sh: &Shape,
    slots: usize,
    layers: usize,
    layer: usize,
    rng: &mut Rng,
) -> (Vec<i64>, Vec<u8>) {
    let (h, d) = (sh.hkv, sh.d);
    let values = 2 * h * B * d;
    match mix {
        Mix::Level0 => {
            let tile = values * sh.dtype.size();
            let row = layers * tile;
            let mut bytes = vec![0u8; slots * row];
            for slot in 0..slots {
                let at = slot * row + layer * tile;
                for v in bytes[at..at + tile].chunks_exact_mut(sh.dtype.size()) {
                    let x = rng.unit() * 2.0 - 1.0;
                    match sh.dtype {
                        FloatDtype::F32 => v.copy_from_slice(&x.to_le_bytes()),
                        _ => v.copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
                    }
                }
            }
            let code = i64::from(sh.dtype != FloatDtype::F32);
            (
                vec![
                    0,
                    code,
                    0,
                    0,
                    slots as i64,
                    row as i64,
                    layers as i64,
                    -1,
                    0,
                    -1,
                    -1,
                    -1,
                    -1,
                    -1,
                    0,
                    0,
                ],
                bytes,
            )
        }
        Mix::Int8 | Mix::Int4 | Mix::Int2 | Mix::Int2Rot => {
            let (bits, asym, per_channel, group) = match mix {
                Mix::Int8 => (8usize, false, false, d),
                Mix::Int4 => (4, true, true, VALUE_GROUP),
                _ => (2, true, true, VALUE_GROUP),
            };
            // per layer: codes, then K's and V's scales (and zero points)
            let codes = values * bits / 8;
            let gk = if per_channel { d } else { B * d / group };
            let (ks, vs) = (h * gk * 2, h * B * (d / group) * 2);
            let z = usize::from(asym);
            let (k_scale, k_zero) = (layers * codes, layers * (codes + ks));
            let v_scale = k_zero + z * layers * ks;
            let v_zero = v_scale + layers * vs;
            let row = v_zero + z * layers * vs;
            let mut bytes = vec![0u8; slots * row];
            for slot in 0..slots {
                let r = &mut bytes[slot * row..(slot + 1) * row];
                for c in &mut r[layer * codes..(layer + 1) * codes] {
                    *c = rng.next() as u8;
                }
                let mut sections = vec![(k_scale, ks), (v_scale, vs)];
                if asym {
                    sections.extend([(k_zero, ks), (v_zero, vs)]);
                }
                for (at, len) in sections {
                    let at = at + layer * len;
                    for x in r[at..at + len].chunks_exact_mut(2) {
                        x.copy_from_slice(&small_f16(rng));
                    }
                }
            }
            let zf = |o: usize| if asym { o as i64 } else { -1 };
            let desc = vec![
                1,
                bits as i64,
                i64::from(asym) + 2 * i64::from(per_channel) + 4 * i64::from(mix == Mix::Int2Rot),
                0,
                slots as i64,
                row as i64,
                layers as i64,
                -1,
                group as i64,
                0,
                k_scale as i64,
                zf(k_zero),
                v_scale as i64,
                zf(v_zero),
                0,
                0,
            ];
            (desc, bytes)
        }
    }
}

fn best_us(mut f: impl FnMut(), repeat: usize) -> f64 {
    f();
    let t0 = Instant::now();
    f();
    let one = t0.elapsed().as_secs_f64().max(1e-7);
    let per_batch = ((0.2 / repeat as f64 / one) as usize).clamp(1, 5000);
    let mut best = f64::INFINITY;
    for _ in 0..repeat {
        let t0 = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        best = best.min(t0.elapsed().as_secs_f64() / per_batch as f64);
    }
    best * 1e6
}

fn main() {
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let isa = match std::env::var("KVTIER_BENCH_ISA").as_deref() {
        Ok("scalar") => Isa::Scalar,
        _ => Isa::Auto,
    };
    let calls: Option<usize> = std::env::var("KVTIER_BENCH_CALLS")
        .ok()
        .and_then(|v| v.parse().ok());
    let shapes = [
        Shape {
            name: "smollm2-512",
            seqs: 1,
            tokens: 512,
            hq: 9,
            hkv: 3,
            d: 64,
            dtype: FloatDtype::F32,
        },
        Shape {
            name: "smollm2-1024",
            seqs: 1,
            tokens: 1024,
            hq: 9,
            hkv: 3,
            d: 64,
            dtype: FloatDtype::F32,
        },
        Shape {
            name: "smollm2-2048",
            seqs: 1,
            tokens: 2048,
            hq: 9,
            hkv: 3,
            d: 64,
            dtype: FloatDtype::F32,
        },
        Shape {
            name: "smollm2-4096",
            seqs: 1,
            tokens: 4096,
            hq: 9,
            hkv: 3,
            d: 64,
            dtype: FloatDtype::F32,
        },
        Shape {
            name: "llama3-4x528",
            seqs: 4,
            tokens: 528,
            hq: 32,
            hkv: 8,
            d: 128,
            dtype: FloatDtype::F16,
        },
    ];
    println!(
        "{:<14} {:<7} {:>10} {:>10} {:>10}",
        "case", "mix", "MB read", "1 thr us", "pool us"
    );
    for sh in &shapes {
        for (mix, mix_name) in [
            (Mix::Level0, "level0"),
            (Mix::Int8, "int8"),
            (Mix::Int4, "int4"),
            (Mix::Int2, "int2"),
            (Mix::Int2Rot, "int2-rot"),
        ] {
            let label = format!("{} {mix_name}", sh.name);
            if !filter.is_empty() && !filter.iter().any(|f| label.contains(f.as_str())) {
                continue;
            }
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let blocks = sh.tokens.div_ceil(B);
            let slots = sh.seqs * blocks;
            let (desc, bytes) = pool(mix, sh, slots, 1, 0, &mut rng);
            let pools = [Pool {
                desc: PoolDesc::from_fields(0, &desc).unwrap(),
                bytes: &bytes,
            }];
            let q: Vec<u8> = (0..sh.seqs * sh.hq * sh.d)
                .flat_map(|_| {
                    let x = rng.unit() * 2.0 - 1.0;
                    match sh.dtype {
                        FloatDtype::F32 => x.to_le_bytes().to_vec(),
                        _ => ((x.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
                    }
                })
                .collect();
            let seq_lens = vec![sh.tokens as i32; sh.seqs];
            let rotation = if mix == Mix::Int2Rot {
                signs(sh.d)
            } else {
                vec![]
            };
            let block_pool = vec![0i32; slots];
            let block_slot: Vec<i32> = (0..slots as i32).collect();
            let inputs = Inputs {
                q: &q,
                dtype: sh.dtype,
                seq_lens: &seq_lens,
                block_pool: &block_pool,
                block_slot: &block_slot,
                pools: &pools,
                rotation: &rotation,
            };
            let problem = sh.decode_step(sh.seqs, blocks, 0);
            let mut out = vec![0u8; q.len()];
            let mut mass = vec![0f32; slots];
            let mut time = |threads: usize| {
                best_us(
                    || {
                        let outputs = Outputs {
                            out: &mut out,
                            mass: &mut mass,
                        };
                        attend(&problem, &inputs, outputs, Exec { threads, isa }).unwrap();
                    },
                    25,
                )
            };
            if let Some(calls) = calls {
                // a fixed number of calls on this thread, for `perf stat` to count
                for _ in 0..calls {
                    let outputs = Outputs {
                        out: &mut out,
                        mass: &mut mass,
                    };
                    attend(&problem, &inputs, outputs, Exec { threads: 1, isa }).unwrap();
                }
                continue;
            }
            let (one, pooled) = (time(1), time(0));
            let used = bytes.len() as f64 / 1e6;
            println!(
                "{:<14} {mix_name:<7} {used:>10.3} {one:>10.1} {pooled:>10.1}",
                sh.name
            );
        }
    }
    if calls.is_none() {
        cold(&shapes[..], &filter, isa);
    }
}

/// Layers of a pool's row in the cold cases (SmolLM2's 30): a block's slice of one layer lies
/// `row_bytes` (~740 KB for fp32) from the next block's, never next to it.
const COLD_LAYERS: usize = 30;
/// Bytes written between two cold calls: more than the L3 cache, as a model's weights and its
/// other layers' KV stream through it between two calls at one layer.
const COLD_FLUSH: usize = 64 << 20;

/// SmolLM2 at 512 and 4096 tokens with the manager's layout (rows of 30 layers, blocks in
/// shuffled slots, layer 15 read), timed on one thread hot (the same call again and again) and
/// cold (64 MiB written before each call, so the blocks come from DRAM): the median per call.
/// Labels `cold <shape> <mix>`.
fn cold(shapes: &[Shape], filter: &[String], isa: Isa) {
    println!(
        "{:<19} {:<7} {:>10} {:>10} {:>10}",
        "cold case", "mix", "MB read", "hot us", "cold us"
    );
    let mut flush = vec![0u8; COLD_FLUSH];
    for sh in shapes
        .iter()
        .filter(|sh| matches!(sh.name, "smollm2-512" | "smollm2-4096"))
    {
        for mix_name in ["level0", "int8", "int4", "int2", "int2-rot", "ladder"] {
            let label = format!("cold {} {mix_name}", sh.name);
            if !filter.is_empty() && !filter.iter().any(|f| label.contains(f.as_str())) {
                continue;
            }
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let blocks = sh.tokens.div_ceil(B);
            // a level for each block: the ladder's newest quarter at level 0, then int8, the
            // rest int4 (benchmarks/attend_cpu.py's)
            let levels: Vec<Mix> = match mix_name {
                "level0" => vec![Mix::Level0],
                "int8" => vec![Mix::Int8],
                "int4" => vec![Mix::Int4],
                "int2" => vec![Mix::Int2],
                "int2-rot" => vec![Mix::Int2Rot],
                _ => vec![Mix::Level0, Mix::Int8, Mix::Int4],
            };
            let block_pool: Vec<i32> = (0..blocks)
                .map(|j| match levels.len() {
                    1 => 0,
                    _ if j >= blocks - blocks / 4 => 0,
                    _ if j >= blocks - blocks / 2 => 1,
                    _ => 2,
                })
                .collect();
            let made: Vec<(Vec<i64>, Vec<u8>)> = levels
                .iter()
                .map(|&mix| pool(mix, sh, blocks, COLD_LAYERS, 15, &mut rng))
                .collect();
            let pools: Vec<Pool> = made
                .iter()
                .enumerate()
                .map(|(i, (desc, bytes))| Pool {
                    desc: PoolDesc::from_fields(i, desc).unwrap(),
                    bytes,
                })
                .collect();
            // each block in a random slot of its pool
            let mut block_slot: Vec<i32> = (0..blocks as i32).collect();
            for i in (1..blocks).rev() {
                block_slot.swap(i, rng.next() as usize % (i + 1));
            }
            let used: f64 = block_pool
                .iter()
                .map(|&p| {
                    let (desc, _) = &made[p as usize];
                    (desc[5] as usize / COLD_LAYERS) as f64 / 1e6
                })
                .sum();
            let q: Vec<u8> = (0..sh.hq * sh.d)
                .flat_map(|_| (rng.unit() * 2.0 - 1.0).to_le_bytes())
                .collect();
            let seq_lens = [sh.tokens as i32];
            let rotation = if levels.contains(&Mix::Int2Rot) {
                signs(sh.d)
            } else {
                vec![]
            };
            let inputs = Inputs {
                q: &q,
                dtype: FloatDtype::F32,
                seq_lens: &seq_lens,
                block_pool: &block_pool,
                block_slot: &block_slot,
                pools: &pools,
                rotation: &rotation,
            };
            let problem = sh.decode_step(1, blocks, 15);
            let mut out = vec![0u8; q.len()];
            let mut mass = vec![0f32; blocks];
            let mut call = || {
                let outputs = Outputs {
                    out: &mut out,
                    mass: &mut mass,
                };
                let t0 = Instant::now();
                attend(&problem, &inputs, outputs, Exec { threads: 1, isa }).unwrap();
                t0.elapsed().as_secs_f64() * 1e6
            };
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let n = if sh.tokens > 1024 { 41 } else { 101 };
            call();
            let hot = median((0..4 * n).map(|_| call()).collect());
            let cold = median(
                (0..n)
                    .map(|i| {
                        flush.fill(i as u8);
                        std::hint::black_box(&mut flush);
                        call()
                    })
                    .collect(),
            );
            println!(
                "{:<19} {mix_name:<7} {used:>10.3} {hot:>10.1} {cold:>10.1}",
                format!("cold {}", sh.name)
            );
        }
    }
}
