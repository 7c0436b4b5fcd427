//! The kernel against a naive reference: every block decoded value by value from its bytes (a
//! decoder written here, apart from the crate's), softmax and sums in f64. Pools are built
//! here too, in the layouts of python/kvtier/attend/call.py, with blocks of one sequence spread
//! over float and quantized (int8, int4, int2) pools, skipped blocks, partial last blocks, GQA,
//! causal queries; each case runs the portable loops and (where the CPU has them) the AVX2 loops,
//! on one thread and on several.

use kvtier_attend::{
    attend, has_avx2, Error, Exec, FloatDtype, Inputs, Isa, Outputs, Pool, PoolDesc, Problem,
};

// ---- numbers ----------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// roughly normal, sd ~1
    fn normal(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
            .sum::<f32>()
            * 1.7
    }
}

fn f16_bits(x: f32) -> u16 {
    // round to nearest (ties away; any valid fp16 serves: the reference decodes these bits)
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if x == 0.0 || exp <= 0 {
        return sign;
    }
    assert!(exp < 31, "{x} out of fp16 range");
    let mant = (b & 0x7f_ffff) + 0x1000;
    let (exp, mant) = if mant & 0x80_0000 != 0 {
        (exp + 1, 0)
    } else {
        (exp, mant)
    };
    sign | ((exp as u16) << 10) | (mant >> 13) as u16
}

fn f16_value(h: u16) -> f32 {
    let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((h >> 10) & 31);
    let mant = f32::from(h & 0x3ff);
    sign * if exp == 0 {
        mant * 2f32.powi(-24)
    } else {
        (1.0 + mant / 1024.0) * 2f32.powi(exp - 15)
    }
}

fn bf16_bits(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16 // truncation: any bf16 serves
}

fn bf16_value(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

fn write_float(dtype: FloatDtype, x: f32, out: &mut Vec<u8>) {
    match dtype {
        FloatDtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        FloatDtype::F16 => out.extend_from_slice(&f16_bits(x).to_le_bytes()),
        FloatDtype::Bf16 => out.extend_from_slice(&bf16_bits(x).to_le_bytes()),
    }
}

fn read_float(dtype: FloatDtype, b: &[u8], i: usize) -> f32 {
    match dtype {
        FloatDtype::F32 => f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()),
        FloatDtype::F16 => f16_value(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
        FloatDtype::Bf16 => bf16_value(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])),
    }
}

// ---- pools ------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Shape {
    layers: usize,
    heads: usize,
    block: usize,
    dim: usize,
}

#[derive(Clone, Copy, Debug)]
enum Codec {
    Float(FloatDtype),
    Quant {
        bits: u8,
        asym: bool,
        per_channel: bool,
        group: Option<usize>,
    },
}

const INT8: Codec = Codec::Quant {
    bits: 8,
    asym: false,
    per_channel: false,
    group: None,
};
const INT4: Codec = grouped(4, 32);
const INT2: Codec = grouped(2, 32);
/// The sub-byte codes: every case that reads int4 runs again with int2 in its place.
const PACKED: [Codec; 2] = [INT4, INT2];

/// Asymmetric codes of `bits`, keys per channel, values per token in groups of `group` (KIVI,
/// as the built-in int4 and int2).
const fn grouped(bits: u8, group: usize) -> Codec {
    Codec::Quant {
        bits,
        asym: true,
        per_channel: true,
        group: Some(group),
    }
}

/// `codec` with its width swapped for `bits`'s (the same grouping).
fn with_bits(codec: Codec, bits: u8) -> Codec {
    match codec {
        Codec::Quant {
            asym,
            per_channel,
            group,
            ..
        } => Codec::Quant {
            bits,
            asym,
            per_channel,
            group,
        },
        float => float,
    }
}

/// Section offsets of a quantized row: codes, k_scale, k_zero, v_scale, v_zero, and its size.
fn quant_offsets(
    shape: Shape,
    bits: u8,
    asym: bool,
    per_channel: bool,
    group: usize,
) -> [usize; 6] {
    let Shape {
        layers: l,
        heads: h,
        block: b,
        dim: d,
    } = shape;
    let codes = l * 2 * h * b * d * usize::from(bits) / 8;
    let gv = b * d / group;
    let gk = if per_channel { d } else { gv };
    let (ks, vs) = (l * h * gk * 2, l * h * gv * 2);
    let z = usize::from(asym);
    let k_scale = codes;
    let k_zero = k_scale + ks;
    let v_scale = k_zero + z * ks;
    let v_zero = v_scale + vs;
    [0, k_scale, k_zero, v_scale, v_zero, v_zero + z * vs]
}

/// A pool of `slots` rows of random blocks: its descriptor fields (ptr 0) and bytes.
fn make_pool(
    codec: Codec,
    shape: Shape,
    slots: usize,
    override_layer: i64,
    rng: &mut Rng,
) -> (Vec<i64>, Vec<u8>) {
    let Shape {
        layers: l,
        heads: h,
        block: b,
        dim: d,
    } = shape;
    let mut bytes = Vec::new();
    match codec {
        Codec::Float(dtype) => {
            for _ in 0..slots * l * 2 * h * b * d {
                write_float(dtype, rng.normal(), &mut bytes);
            }
            let row = l * 2 * h * b * d * dtype.size();
            let code = match dtype {
                FloatDtype::F32 => 0,
                FloatDtype::F16 => 1,
                FloatDtype::Bf16 => 2,
            };
            let desc = vec![
                0,
                code,
                0,
                0,
                slots as i64,
                row as i64,
                l as i64,
                override_layer,
                0,
                -1,
                -1,
                -1,
                -1,
                -1,
                0,
                0,
            ];
            (desc, bytes)
        }
        Codec::Quant {
            bits,
            asym,
            per_channel,
            group,
        } => {
            let group = group.unwrap_or(d);
            let off = quant_offsets(shape, bits, asym, per_channel, group);
            let row_bytes = off[5];
            for _ in 0..slots {
                let mut row = vec![0u8; row_bytes];
                // random codes and scales: the reference decodes whatever is there
                let width = usize::from(bits);
                let per_byte = 8 / width;
                for t in 0..l * 2 * h * b * d {
                    let code = rng.below(1 << width) as u8;
                    row[t / per_byte] |= code << (width * (t % per_byte));
                }
                for (sec, lo, hi) in [
                    (1, 0.002, 0.05),
                    (2, -1.0, 1.0),
                    (3, 0.002, 0.05),
                    (4, -1.0, 1.0),
                ] {
                    let (start, end) = (off[sec], off[sec + 1]);
                    if (sec == 2 || sec == 4) && !asym {
                        continue;
                    }
                    // fewer levels, larger scales: values of a similar spread
                    let (lo, hi) = match (bits, sec) {
                        (8, _) => (lo, hi),
                        (4, _) => (lo * 16.0, hi),
                        (_, 1 | 3) => (0.2, 1.0),
                        _ => (lo, hi),
                    };
                    for at in (start..end).step_by(2) {
                        let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
                        row[at..at + 2]
                            .copy_from_slice(&f16_bits(lo + (hi - lo) * u).to_le_bytes());
                    }
                }
                bytes.extend_from_slice(&row);
            }
            let flags = i64::from(asym) + 2 * i64::from(per_channel);
            let z = |o: usize| if asym { o as i64 } else { -1 };
            let desc = vec![
                1,
                i64::from(bits),
                flags,
                0,
                slots as i64,
                row_bytes as i64,
                l as i64,
                override_layer,
                group as i64,
                off[0] as i64,
                off[1] as i64,
                z(off[2]),
                off[3] as i64,
                z(off[4]),
                0,
                0,
            ];
            (desc, bytes)
        }
    }
}

/// Value `(kv, head, t, i)` at `layer` of row `slot`, decoded by the rule of quant.py.
fn decode(
    codec: Codec,
    shape: Shape,
    bytes: &[u8],
    row_bytes: usize,
    slot: usize,
    layer: usize,
    at: [usize; 4],
) -> f32 {
    let Shape {
        heads: h,
        block: b,
        dim: d,
        ..
    } = shape;
    let [kv, head, t, i] = at;
    let row = &bytes[slot * row_bytes..(slot + 1) * row_bytes];
    let elem = (((layer * 2 + kv) * h + head) * b + t) * d + i;
    match codec {
        Codec::Float(dtype) => read_float(dtype, row, elem),
        Codec::Quant {
            bits,
            asym,
            per_channel,
            group,
        } => {
            let group = group.unwrap_or(d);
            let off = quant_offsets(shape, bits, asym, per_channel, group);
            // element e in bits (e % per_byte) * width.. of byte e / per_byte, low bits first
            let width = u32::from(bits);
            let per_byte = 8 / width as usize;
            let byte = u32::from(row[elem / per_byte]);
            let raw = (byte >> (width * (elem % per_byte) as u32)) & ((1 << width) - 1);
            let code = if asym || raw < 1 << (width - 1) {
                raw as f32
            } else {
                raw as f32 - (1u32 << width) as f32 // two's complement
            };
            let gv = b * d / group;
            let (groups, gi, scale_sec) = if kv == 0 && per_channel {
                (d, i, 1)
            } else if kv == 0 {
                (gv, t * (d / group) + i / group, 1)
            } else {
                (gv, t * (d / group) + i / group, 3)
            };
            let at = |sec: usize| {
                let p = off[sec] + 2 * ((layer * h + head) * groups + gi);
                f16_value(u16::from_le_bytes([row[p], row[p + 1]]))
            };
            let z = if asym { at(scale_sec + 1) } else { 0.0 };
            code * at(scale_sec) + z
        }
    }
}

// ---- the naive reference ----------------------------------------------------------------------

struct Case {
    shape: Shape,
    seqs: usize,
    queries: usize,
    q_heads: usize,
    lens: Vec<usize>,
    max_blocks: usize,
    layer: usize,
    codecs: Vec<Codec>,
    dtype: FloatDtype,
    /// fraction of blocks skipped, in 1/8ths
    skip_eighths: usize,
}

struct Built {
    descs: Vec<Vec<i64>>,
    bytes: Vec<Vec<u8>>,
    block_pool: Vec<i32>,
    block_slot: Vec<i32>,
    q: Vec<u8>,
    seq_lens: Vec<i32>,
}

fn build(case: &Case, rng: &mut Rng) -> Built {
    let sh = case.shape;
    let total_blocks: usize = case.lens.iter().map(|n| n.div_ceil(sh.block)).sum();
    let slots = total_blocks + 3;
    let mut descs = Vec::new();
    let mut bytes = Vec::new();
    for (i, &codec) in case.codecs.iter().enumerate() {
        // every other pool a one-layer staging pool read through layer_override
        let (shape, over) = if i % 2 == 1 {
            (Shape { layers: 1, ..sh }, 0)
        } else {
            (sh, -1)
        };
        let (d, b) = make_pool(codec, shape, slots, over, rng);
        descs.push(d);
        bytes.push(b);
    }
    let m = case.max_blocks;
    let mut block_pool = vec![-1i32; case.seqs * m];
    let mut block_slot = vec![0i32; case.seqs * m];
    let mut next_slot = vec![0usize; case.codecs.len()];
    for s in 0..case.seqs {
        for j in 0..case.lens[s].div_ceil(sh.block) {
            if rng.below(8) < case.skip_eighths {
                block_pool[s * m + j] = -1;
                block_slot[s * m + j] = 12345; // ignored
                continue;
            }
            let p = rng.below(case.codecs.len());
            block_pool[s * m + j] = p as i32;
            block_slot[s * m + j] = (slots - 1 - next_slot[p]) as i32; // from the top down
            next_slot[p] += 1;
        }
        // garbage past the end: ignored
        for j in case.lens[s].div_ceil(sh.block)..m {
            block_pool[s * m + j] = 99;
            block_slot[s * m + j] = -5;
        }
    }
    let mut q = Vec::new();
    for _ in 0..case.seqs * case.queries * case.q_heads * sh.dim {
        write_float(case.dtype, rng.normal(), &mut q);
    }
    Built {
        descs,
        bytes,
        block_pool,
        block_slot,
        q,
        seq_lens: case.lens.iter().map(|&n| n as i32).collect(),
    }
}

/// `(out, mass)` in f64.
fn reference(case: &Case, b: &Built, scale: f64) -> (Vec<f64>, Vec<f64>) {
    let sh = case.shape;
    let (q_n, hq, d, m, bs) = (
        case.queries,
        case.q_heads,
        sh.dim,
        case.max_blocks,
        sh.block,
    );
    let group = hq / sh.heads;
    let mut out = vec![0.0; case.seqs * q_n * hq * d];
    let mut mass = vec![0.0; case.seqs * m];
    for s in 0..case.seqs {
        let n = case.lens[s];
        for i in 0..q_n {
            let pos = n - q_n + i;
            for h in 0..hq {
                let g = h / group;
                let qv: Vec<f64> = (0..d)
                    .map(|e| {
                        f64::from(read_float(
                            case.dtype,
                            &b.q,
                            ((s * q_n + i) * hq + h) * d + e,
                        ))
                    })
                    .collect();
                let mut scores = Vec::new(); // (token, score)
                for t in 0..=pos {
                    let j = t / bs;
                    let p = b.block_pool[s * m + j];
                    if p < 0 {
                        continue;
                    }
                    let p = p as usize;
                    let slot = b.block_slot[s * m + j] as usize;
                    let layer = if b.descs[p][7] >= 0 {
                        b.descs[p][7] as usize
                    } else {
                        case.layer
                    };
                    let shape = Shape {
                        layers: b.descs[p][6] as usize,
                        ..sh
                    };
                    let row = b.descs[p][5] as usize;
                    let dot: f64 = (0..d)
                        .map(|e| {
                            qv[e]
                                * f64::from(decode(
                                    case.codecs[p],
                                    shape,
                                    &b.bytes[p],
                                    row,
                                    slot,
                                    layer,
                                    [0, g, t % bs, e],
                                ))
                        })
                        .sum();
                    scores.push((t, dot * scale));
                }
                if scores.is_empty() {
                    continue;
                }
                let mx = scores.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
                let total: f64 = scores.iter().map(|x| (x.1 - mx).exp()).sum();
                for &(t, sc) in &scores {
                    let pr = (sc - mx).exp() / total;
                    let j = t / bs;
                    mass[s * m + j] += pr / (hq * q_n) as f64;
                    let p = b.block_pool[s * m + j] as usize;
                    let slot = b.block_slot[s * m + j] as usize;
                    let layer = if b.descs[p][7] >= 0 {
                        b.descs[p][7] as usize
                    } else {
                        case.layer
                    };
                    let shape = Shape {
                        layers: b.descs[p][6] as usize,
                        ..sh
                    };
                    let row = b.descs[p][5] as usize;
                    for e in 0..d {
                        let v = decode(
                            case.codecs[p],
                            shape,
                            &b.bytes[p],
                            row,
                            slot,
                            layer,
                            [1, g, t % bs, e],
                        );
                        out[((s * q_n + i) * hq + h) * d + e] += pr * f64::from(v);
                    }
                }
            }
        }
    }
    (out, mass)
}

fn problem(case: &Case, scale: f32) -> Problem {
    Problem {
        seqs: case.seqs,
        queries: case.queries,
        q_heads: case.q_heads,
        kv_heads: case.shape.heads,
        block_size: case.shape.block,
        head_dim: case.shape.dim,
        max_blocks: case.max_blocks,
        layer: case.layer,
        scale,
    }
}

fn pools(b: &Built) -> Vec<Pool<'_>> {
    b.descs
        .iter()
        .zip(&b.bytes)
        .enumerate()
        .map(|(i, (d, bytes))| Pool {
            desc: PoolDesc::from_fields(i, d).unwrap(),
            bytes,
        })
        .collect()
}

fn run(case: &Case, b: &Built, scale: f32, exec: Exec) -> Result<(Vec<f32>, Vec<f32>), Error> {
    let pools = pools(b);
    let inputs = Inputs {
        q: &b.q,
        dtype: case.dtype,
        seq_lens: &b.seq_lens,
        block_pool: &b.block_pool,
        block_slot: &b.block_slot,
        pools: &pools,
        rotation: &[],
    };
    let mut out = vec![0xAAu8; b.q.len()];
    let mut mass = vec![f32::NAN; case.seqs * case.max_blocks];
    attend(
        &problem(case, scale),
        &inputs,
        Outputs {
            out: &mut out,
            mass: &mut mass,
        },
        exec,
    )?;
    let out = (0..b.q.len() / case.dtype.size())
        .map(|i| read_float(case.dtype, &out, i))
        .collect();
    Ok((out, mass))
}

fn isas() -> Vec<Isa> {
    if has_avx2() {
        vec![Isa::Scalar, Isa::Avx2]
    } else {
        vec![Isa::Scalar]
    }
}

/// Runs `case` on every instruction set and thread count, against the reference.
fn check(case: &Case, seed: u64) {
    let mut rng = Rng(seed | 1);
    let b = build(case, &mut rng);
    let scale = 1.0 / (case.shape.dim as f32).sqrt();
    let (want_out, want_mass) = reference(case, &b, f64::from(scale));
    // the output's own rounding, plus fp32 accumulation
    let (atol, rtol) = match case.dtype {
        FloatDtype::F32 => (2e-5, 2e-5),
        FloatDtype::F16 => (1e-3, 2e-3),
        FloatDtype::Bf16 => (8e-3, 1e-2),
    };
    for isa in isas() {
        for threads in [1, 2] {
            let (out, mass) = run(case, &b, scale, Exec { threads, isa }).unwrap();
            for (i, (&got, &want)) in out.iter().zip(&want_out).enumerate() {
                let err = (f64::from(got) - want).abs();
                assert!(
                    err <= atol + rtol * want.abs(),
                    "{isa:?} threads {threads}: out[{i}] = {got}, expected {want} ({case_dims:?})",
                    case_dims = (
                        case.shape,
                        case.queries,
                        case.q_heads,
                        &case.lens,
                        &case.codecs
                    )
                );
            }
            for (j, (&got, &want)) in mass.iter().zip(&want_mass).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() <= 1e-5,
                    "{isa:?} threads {threads}: mass[{j}] = {got}, expected {want}"
                );
            }
        }
    }
}

fn case(
    shape: Shape,
    queries: usize,
    q_heads: usize,
    lens: &[usize],
    codecs: &[Codec],
    dtype: FloatDtype,
) -> Case {
    let max_blocks = lens
        .iter()
        .map(|n| n.div_ceil(shape.block))
        .max()
        .unwrap_or(0)
        + 1;
    Case {
        shape,
        seqs: lens.len(),
        queries,
        q_heads,
        lens: lens.to_vec(),
        max_blocks,
        layer: 1,
        codecs: codecs.to_vec(),
        dtype,
        skip_eighths: 1,
    }
}

const SHAPE: Shape = Shape {
    layers: 2,
    heads: 2,
    block: 16,
    dim: 64,
};

// ---- cases ------------------------------------------------------------------------------------

#[test]
fn every_float_pool_dtype() {
    for (i, dt) in [FloatDtype::F32, FloatDtype::F16, FloatDtype::Bf16]
        .into_iter()
        .enumerate()
    {
        check(
            &case(SHAPE, 1, 4, &[37, 80], &[Codec::Float(dt)], FloatDtype::F32),
            10 + i as u64,
        );
    }
}

#[test]
fn every_quant_format() {
    let mut seed = 100;
    for bits in [2u8, 4, 8] {
        for asym in [false, true] {
            for per_channel in [false, true] {
                for group in [None, Some(16), Some(8), Some(2)] {
                    let codec = Codec::Quant {
                        bits,
                        asym,
                        per_channel,
                        group,
                    };
                    seed += 1;
                    // one row (rows < tokens: the scaled-query path) and many (the tile path)
                    check(&case(SHAPE, 1, 2, &[45], &[codec], FloatDtype::F32), seed);
                    check(
                        &case(SHAPE, 5, 8, &[45], &[codec], FloatDtype::F32),
                        seed + 1000,
                    );
                }
            }
        }
    }
}

#[test]
fn mixed_pools_in_one_sequence_decode_and_prefill() {
    for (k, packed) in (0u64..).zip(PACKED) {
        let codecs = [
            Codec::Float(FloatDtype::F16),
            INT8,
            packed,
            Codec::Float(FloatDtype::F32),
        ];
        for (seed, q_n) in [(1u64, 1usize), (2, 3), (3, 16), (4, 21)] {
            check(
                &case(SHAPE, q_n, 4, &[130, 21, 64, 97], &codecs, FloatDtype::F32),
                seed + 100 * k,
            );
        }
    }
    // the whole ladder in one sequence
    let ladder = [Codec::Float(FloatDtype::F16), INT8, INT4, INT2];
    check(
        &case(SHAPE, 3, 4, &[130, 21, 64, 97], &ladder, FloatDtype::F32),
        5,
    );
}

#[test]
fn gqa_ratios_head_dims_block_sizes() {
    let mut seed = 200;
    for ratio in [1, 2, 4, 8] {
        for dim in [64, 80, 128, 256] {
            for block in [16, 32] {
                seed += 1;
                let shape = Shape {
                    layers: 2,
                    heads: 2,
                    block,
                    dim,
                };
                // the default group of 32 where head_dim allows it, else 16 (head_dim 80)
                let group = if dim % 32 == 0 { 32 } else { 16 };
                for (k, bits) in (0u64..).zip([4, 2]) {
                    let codecs = [Codec::Float(FloatDtype::Bf16), INT8, grouped(bits, group)];
                    check(
                        &case(
                            shape,
                            2,
                            2 * ratio,
                            &[block * 2 + 3, 9],
                            &codecs,
                            FloatDtype::F32,
                        ),
                        seed + 1000 * k,
                    );
                }
            }
        }
    }
}

#[test]
fn odd_head_dims_and_block_sizes() {
    // tails of every loop: D not a multiple of 8, blocks of 5 and 1 tokens
    for (seed, dim, block) in [(300u64, 12, 5), (301, 6, 1), (302, 20, 7), (303, 36, 3)] {
        let shape = Shape {
            layers: 2,
            heads: 3,
            block,
            dim,
        };
        let sym_g2 = Codec::Quant {
            bits: 4,
            asym: false,
            per_channel: false,
            group: Some(2),
        };
        // 2-bit codes where a token's codes fill whole bytes (dim a multiple of 4)
        let widths: &[u8] = if dim % 4 == 0 { &[4, 2] } else { &[4] };
        for (k, &bits) in (0u64..).zip(widths) {
            let codecs = [
                Codec::Float(FloatDtype::F32),
                Codec::Float(FloatDtype::F16),
                INT8,
                with_bits(sym_g2, bits),
            ];
            check(
                &case(shape, 3, 6, &[29, 4, 17], &codecs, FloatDtype::F32),
                seed + 100 * k,
            );
        }
    }
}

#[test]
fn fp16_and_bf16_queries_and_outputs() {
    for (k, packed) in (0u64..).zip(PACKED) {
        let codecs = [Codec::Float(FloatDtype::F16), INT8, packed];
        let seed = 400 + 10 * k;
        check(
            &case(SHAPE, 2, 4, &[70, 33], &codecs, FloatDtype::F16),
            seed,
        );
        check(
            &case(SHAPE, 2, 4, &[70, 33], &codecs, FloatDtype::Bf16),
            seed + 1,
        );
    }
}

#[test]
fn skipped_blocks_and_queries_that_see_nothing() {
    // every block skipped: zeros out, zero mass
    let mut c = case(SHAPE, 2, 4, &[40, 17], &[INT8], FloatDtype::F32);
    c.skip_eighths = 8;
    check(&c, 500);
    // most skipped, with prefill (early queries may see only skipped blocks)
    for (k, packed) in (0u64..).zip(PACKED) {
        let mut c = case(
            SHAPE,
            20,
            4,
            &[40, 50, 23],
            &[INT8, packed],
            FloatDtype::F32,
        );
        c.skip_eighths = 6;
        check(&c, 501 + 10 * k);
    }
}

#[test]
fn long_sequences_split_over_threads() {
    // large enough to run on a pool, with sequences cut into runs of blocks
    let shape = Shape {
        layers: 1,
        heads: 2,
        block: 16,
        dim: 128,
    };
    for (k, packed) in (0u64..).zip(PACKED) {
        let codecs = [Codec::Float(FloatDtype::F32), packed, INT8]; // pool 1: staging
        let mut c = case(shape, 1, 16, &[2100, 900], &codecs, FloatDtype::F32);
        c.layer = 0;
        check(&c, 600 + 10 * k);
    }
}

#[test]
fn fp32_pool_not_four_aligned_is_widened() {
    let c = case(
        SHAPE,
        1,
        2,
        &[40],
        &[Codec::Float(FloatDtype::F32)],
        FloatDtype::F32,
    );
    let mut rng = Rng(77);
    let mut b = build(&c, &mut rng);
    let scale = 0.125;
    let (want, _) = reference(&c, &b, f64::from(scale));
    // the same bytes one byte into a buffer
    let mut shifted = vec![0u8];
    shifted.extend_from_slice(&b.bytes[0]);
    b.bytes[0] = shifted;
    let pools: Vec<Pool<'_>> = vec![Pool {
        desc: PoolDesc::from_fields(0, &b.descs[0]).unwrap(),
        bytes: &b.bytes[0][1..],
    }];
    let mut out = vec![0u8; b.q.len()];
    let mut mass = vec![0f32; c.max_blocks];
    for isa in isas() {
        attend(
            &problem(&c, scale),
            &Inputs {
                q: &b.q,
                dtype: c.dtype,
                seq_lens: &b.seq_lens,
                block_pool: &b.block_pool,
                block_slot: &b.block_slot,
                pools: &pools,
                rotation: &[],
            },
            Outputs {
                out: &mut out,
                mass: &mut mass,
            },
            Exec { threads: 1, isa },
        )
        .unwrap();
        for (i, w) in want.iter().enumerate() {
            let got = f64::from(read_float(FloatDtype::F32, &out, i));
            assert!((got - w).abs() < 2e-5 + 2e-5 * w.abs());
        }
    }
}

// ---- errors -----------------------------------------------------------------------------------

#[test]
fn refuses_int2_blocks_whose_tokens_end_inside_a_byte() {
    let shape = Shape {
        layers: 2,
        heads: 1,
        block: 16,
        dim: 6,
    };
    for (bits, ok) in [(4, true), (2, false)] {
        let c = case(shape, 1, 2, &[20], &[grouped(bits, 2)], FloatDtype::F32);
        let b = build(&c, &mut Rng(11));
        match run(&c, &b, 0.5, Exec::default()) {
            Ok(_) => assert!(ok, "{bits}-bit codes of head_dim 6 read"),
            Err(Error::InvalidPool { pool: 0, reason }) => {
                assert!(!ok && reason.contains("multiple of 4"), "{reason}");
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn refuses_what_it_cannot_read() {
    let c = case(
        SHAPE,
        2,
        4,
        &[40, 17],
        &[INT8, Codec::Float(FloatDtype::F16)],
        FloatDtype::F32,
    );
    let mut rng = Rng(9);
    let good = build(&c, &mut rng);
    let try_with = |edit: &dyn Fn(&mut Built, &mut Problem)| {
        let mut b = Built {
            descs: good.descs.clone(),
            bytes: good.bytes.clone(),
            block_pool: good.block_pool.clone(),
            block_slot: good.block_slot.clone(),
            q: good.q.clone(),
            seq_lens: good.seq_lens.clone(),
        };
        let mut p = problem(&c, 0.125);
        edit(&mut b, &mut p);
        let pools: Vec<Pool<'_>> = b
            .descs
            .iter()
            .zip(&b.bytes)
            .enumerate()
            .map(|(i, (d, bytes))| PoolDesc::from_fields(i, d).map(|desc| Pool { desc, bytes }))
            .collect::<Result<_, _>>()?;
        let mut out = vec![0u8; p.seqs * p.queries * p.q_heads * p.head_dim * 4];
        let mut mass = vec![0f32; p.seqs * p.max_blocks];
        attend(
            &p,
            &Inputs {
                q: &b.q,
                dtype: FloatDtype::F32,
                seq_lens: &b.seq_lens,
                block_pool: &b.block_pool,
                block_slot: &b.block_slot,
                pools: &pools,
                rotation: &[],
            },
            Outputs {
                out: &mut out,
                mass: &mut mass,
            },
            Exec::default(),
        )
    };
    try_with(&|_, _| {}).unwrap();
    let slot_past = |b: &mut Built, _: &mut Problem| {
        let j = b.block_pool.iter().position(|&p| p == 0).unwrap();
        b.block_slot[j] = b.descs[0][4] as i32;
    };
    assert!(matches!(
        try_with(&slot_past),
        Err(Error::SlotOutOfRange { .. })
    ));
    let negative_slot = |b: &mut Built, _: &mut Problem| {
        let j = b.block_pool.iter().position(|&p| p == 1).unwrap();
        b.block_slot[j] = -1;
    };
    assert!(matches!(
        try_with(&negative_slot),
        Err(Error::SlotOutOfRange { .. })
    ));
    let pool_past = |b: &mut Built, _: &mut Problem| b.block_pool[0] = 2;
    assert!(matches!(
        try_with(&pool_past),
        Err(Error::PoolOutOfRange { .. })
    ));
    let short_pool = |b: &mut Built, _: &mut Problem| {
        let n = b.bytes[0].len();
        b.bytes[0].truncate(n - 1);
    };
    assert!(matches!(
        try_with(&short_pool),
        Err(Error::InvalidPool { .. })
    ));
    let row_too_small = |b: &mut Built, _: &mut Problem| b.descs[1][5] -= 2;
    assert!(matches!(
        try_with(&row_too_small),
        Err(Error::InvalidPool { .. })
    ));
    let section_past_row = |b: &mut Built, _: &mut Problem| b.descs[0][12] = b.descs[0][5] - 1;
    assert!(matches!(
        try_with(&section_past_row),
        Err(Error::InvalidPool { .. })
    ));
    let bad_bits = |b: &mut Built, _: &mut Problem| b.descs[0][1] = 3;
    assert!(matches!(
        try_with(&bad_bits),
        Err(Error::InvalidPool { .. })
    ));
    let layer_past = |_: &mut Built, p: &mut Problem| p.layer = 2;
    assert!(matches!(
        try_with(&layer_past),
        Err(Error::InvalidPool { .. })
    ));
    let too_long = |b: &mut Built, _: &mut Problem| b.seq_lens[1] = (c.max_blocks * 16 + 1) as i32;
    assert!(matches!(
        try_with(&too_long),
        Err(Error::InvalidArgument {
            what: "seq_lens",
            ..
        })
    ));
    let shorter_than_queries = |b: &mut Built, _: &mut Problem| b.seq_lens[1] = 1;
    assert!(matches!(
        try_with(&shorter_than_queries),
        Err(Error::InvalidArgument { .. })
    ));
    let heads = |_: &mut Built, p: &mut Problem| p.q_heads = 3;
    assert!(matches!(
        try_with(&heads),
        Err(Error::InvalidArgument { .. })
    ));
    let q_short = |b: &mut Built, _: &mut Problem| {
        b.q.pop();
    };
    assert!(matches!(
        try_with(&q_short),
        Err(Error::InvalidArgument { what: "q", .. })
    ));
    let table_short = |b: &mut Built, _: &mut Problem| {
        b.block_slot.pop();
    };
    assert!(matches!(
        try_with(&table_short),
        Err(Error::InvalidArgument { .. })
    ));
    let nan_scale = |_: &mut Built, p: &mut Problem| p.scale = f32::NAN;
    assert!(matches!(
        try_with(&nan_scale),
        Err(Error::InvalidArgument { .. })
    ));
    // A NaN or infinite query, anywhere in q (here in the last sequence's last value).
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let non_finite_q = move |b: &mut Built, _: &mut Problem| {
            let n = b.q.len();
            b.q[n - 4..].copy_from_slice(&bad.to_le_bytes());
        };
        assert!(matches!(
            try_with(&non_finite_q),
            Err(Error::InvalidArgument { what: "q", .. })
        ));
    }
}

#[test]
fn float_dtypes_tell_finite_values_from_nan_and_infinity() {
    // per dtype: finite values (one, minus zero, the largest, a subnormal, the most negative),
    // then NaN, infinity and minus infinity, as their bits
    let f32_bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let cases: [(FloatDtype, Vec<u32>, Vec<u32>); 3] = [
        (
            FloatDtype::F32,
            f32_bits(&[1.0, -0.0, f32::MAX, f32::MIN_POSITIVE / 2.0, f32::MIN]),
            f32_bits(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
        ),
        (
            FloatDtype::F16,
            vec![0x3c00, 0x8000, 0x7bff, 0x0001, 0xfbff],
            vec![0x7e00, 0x7c00, 0xfc00],
        ),
        (
            FloatDtype::Bf16,
            vec![0x3f80, 0x8000, 0x7f7f, 0x0001, 0xff7f],
            vec![0x7fc0, 0x7f80, 0xff80],
        ),
    ];
    for (dtype, finite, bad) in cases {
        let bytes = |values: &[u32]| -> Vec<u8> {
            values
                .iter()
                .flat_map(|&v| match dtype {
                    FloatDtype::F32 => v.to_ne_bytes().to_vec(),
                    _ => (v as u16).to_ne_bytes().to_vec(),
                })
                .collect()
        };
        assert!(dtype.all_finite(&bytes(&finite)), "{dtype:?}");
        for b in bad {
            let mut values = finite.clone();
            values.insert(2, b);
            assert!(!dtype.all_finite(&bytes(&values)), "{dtype:?} {b:#x}");
        }
    }
}
