//! The codec against a plain re-implementation of the rounding rule written here element by
//! element (group index per value, `round_ties_even`, no keys, no tricks), both instruction sets
//! and thread counts against each other, transcodes against decode-then-encode, and the checks.
//! (Bit-exactness against the torch reference itself: tests/test_codecs_native.py.)

use super::*;
use crate::half::{f16_to_f32, f32_to_f16};

/// The layout of python/kvtier/codecs/quant.py's sections for `dims`: codes, k_scale, k_zero,
/// v_scale, v_zero, in that order.
fn packed(
    bits: u8,
    asymmetric: bool,
    key_per_channel: bool,
    group: usize,
    d: BlockDims,
) -> PackedFormat {
    let BlockDims {
        layers,
        heads,
        block,
        dim,
    } = d;
    let codes = layers * 2 * heads * block * dim * usize::from(bits) / 8;
    let v_groups = block * dim / group;
    let k_groups = if key_per_channel { dim } else { v_groups };
    let (k, v) = (layers * heads * k_groups * 2, layers * heads * v_groups * 2);
    let mut at = codes;
    let mut next = |len: usize, present: bool| {
        if !present {
            return 0;
        }
        let off = at;
        at += len;
        off
    };
    let k_scale = next(k, true);
    let k_zero = next(k, asymmetric);
    let v_scale = next(v, true);
    let v_zero = next(v, asymmetric);
    PackedFormat {
        format: QuantFormat {
            bits,
            asymmetric,
            key_per_channel,
            rotated: false,
            group,
            codes: 0,
            k_scale,
            k_zero,
            v_scale,
            v_zero,
        },
        row_bytes: at,
    }
}

const DIMS: BlockDims = BlockDims {
    layers: 2,
    heads: 3,
    block: 8,
    dim: 32,
};

fn formats() -> Vec<PackedFormat> {
    let mut out = Vec::new();
    for bits in [8, 4, 2] {
        for asym in [false, true] {
            for kpc in [false, true] {
                for group in [32, 8, 2] {
                    if bits == 2 && group == 2 {
                        continue; // a group of 2 is fine; 4 codes a byte span two groups: kept below
                    }
                    out.push(packed(bits, asym, kpc, group, DIMS));
                }
            }
        }
    }
    out.push(packed(2, true, false, 2, DIMS));
    out
}

/// xorshift64*: a deterministic stream without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Roughly normal: a sum of uniforms, centred.
    fn normal(&mut self) -> f32 {
        (0..4)
            .map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum::<f32>()
            * 1.7
            - 3.4
    }
}

/// `n` blocks of values whose tiles cycle through the cases the rule must get right.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    let tile = DIMS.block * DIMS.dim;
    let total = n * DIMS.layers * 2 * DIMS.heads * tile;
    let mut x: Vec<f32> = (0..total).map(|_| r.normal()).collect();
    let step = 2f32.powi(-24);
    for (i, t) in x.chunks_exact_mut(tile).enumerate() {
        match i % 12 {
            0 => t.fill(0.0),
            1 => t.fill(-0.0),
            2 => t.fill(1.5),
            3 => t.iter_mut().for_each(|v| *v *= 1e-7), // subnormal scales
            4 => t.iter_mut().for_each(|v| *v *= 1.4 * 127.0 * step), // scales at the edge
            5 => t.iter_mut().for_each(|v| *v = v.signum() * 65504.0), // scales round up
            6 => t.iter_mut().for_each(|v| *v *= 1e6),  // beyond fp16
            7 => t
                .iter_mut()
                .enumerate()
                .for_each(|(j, v)| *v = (j % 15) as f32 + 0.5), // ties
            8 => t.iter_mut().step_by(5).for_each(|v| *v *= 100.0), // outliers
            9 => t.iter_mut().for_each(|v| *v = v.abs() + 0.0), // +0 floor below
            10 => t.iter_mut().for_each(|v| *v = -v.abs() - 2.0),
            _ => {}
        }
    }
    x
}

fn fp16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| f32_to_f16(*v).to_le_bytes())
        .collect()
}

fn bf16_bytes(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|v| crate::half::f32_to_bf16(*v).to_le_bytes())
        .collect()
}

fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn widen_all(bytes: &[u8], dtype: FloatDtype) -> Vec<f32> {
    match dtype {
        FloatDtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        FloatDtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        FloatDtype::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| crate::half::bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
    }
}

/// The rule, value by value: one block `x` (`[L, 2, H, B, D]` f32) into a row of `p`.
fn reference_encode(p: &PackedFormat, d: BlockDims, x: &[f32]) -> Vec<u8> {
    let f = p.format;
    let mut row = vec![0u8; p.row_bytes];
    let (b_n, d_n, h_n) = (d.block, d.dim, d.heads);
    let (q_lo, q_hi, inv) = code_range(f.bits, f.asymmetric);
    for l in 0..d.layers {
        for kv in 0..2 {
            for h in 0..h_n {
                let t = (l * 2 + kv) * h_n + h;
                let tile = &x[t * b_n * d_n..][..b_n * d_n];
                let per_channel = kv == 0 && f.key_per_channel;
                let group_of = |b: usize, dd: usize| {
                    if per_channel {
                        dd
                    } else {
                        b * (d_n / f.group) + dd / f.group
                    }
                };
                let groups = if per_channel {
                    d_n
                } else {
                    b_n * d_n / f.group
                };
                let (sc_off, z_off) = if kv == 0 {
                    (f.k_scale, f.k_zero)
                } else {
                    (f.v_scale, f.v_zero)
                };
                let base = (l * h_n + h) * groups;
                let mut s_of = vec![0f32; groups];
                let mut z_of = vec![0f32; groups];
                for g in 0..groups {
                    let members: Vec<f32> = (0..b_n * d_n)
                        .filter(|&e| group_of(e / d_n, e % d_n) == g)
                        .map(|e| tile[e])
                        .collect();
                    // -0 below +0
                    let less = |a: f32, b: f32| {
                        a < b || (a == b && a.is_sign_negative() && !b.is_sign_negative())
                    };
                    let mn = members
                        .iter()
                        .copied()
                        .reduce(|a, b| if less(b, a) { b } else { a })
                        .unwrap();
                    let mx = members
                        .iter()
                        .copied()
                        .reduce(|a, b| if less(a, b) { b } else { a })
                        .unwrap();
                    let round16 = |v: f32| f32_to_f16(v.clamp(-65504.0, 65504.0));
                    let s = if f.asymmetric {
                        let z = round16(mn);
                        row[z_off + 2 * (base + g)..][..2].copy_from_slice(&z.to_le_bytes());
                        z_of[g] = f16_to_f32(z);
                        round16((mx - mn) * inv)
                    } else {
                        round16(mn.abs().max(mx.abs()) * inv)
                    };
                    row[sc_off + 2 * (base + g)..][..2].copy_from_slice(&s.to_le_bytes());
                    let s = f16_to_f32(s);
                    s_of[g] = if s > 0.0 { s } else { 1.0 };
                }
                let per = 8 / usize::from(f.bits);
                let codes = f.codes + t * b_n * d_n / per;
                for e in 0..b_n * d_n {
                    let g = group_of(e / d_n, e % d_n);
                    let v = if f.asymmetric {
                        tile[e] - z_of[g]
                    } else {
                        tile[e]
                    };
                    let q = (v / s_of[g]).round_ties_even().clamp(q_lo, q_hi) as i32;
                    let field = (q as u32 & ((1u32 << f.bits) - 1)) as u8;
                    row[codes + e / per] |= field << (usize::from(f.bits) * (e % per));
                }
            }
        }
    }
    row
}

fn encode(p: &PackedFormat, dtype: FloatDtype, blocks: &[u8], exec: Exec) -> Vec<u8> {
    let n = blocks.len() / (DIMS.layers * 2 * DIMS.heads * DIMS.block * DIMS.dim * dtype.size());
    let mut rows = vec![0xa5u8; n * p.row_bytes];
    let src: Vec<&[u8]> = blocks.chunks_exact(blocks.len() / n).collect();
    let mut dst: Vec<&mut [u8]> = rows.chunks_exact_mut(p.row_bytes).collect();
    quantize(DIMS, dtype, p, &src, &mut dst, &[], exec).unwrap();
    rows
}

fn decode(
    p: &PackedFormat,
    rows: &[u8],
    layers: Range<usize>,
    dtype: FloatDtype,
    exec: Exec,
) -> Vec<u8> {
    let n = rows.len() / p.row_bytes;
    let per = layers.len() * 2 * DIMS.heads * DIMS.block * DIMS.dim * dtype.size();
    if per == 0 {
        return Vec::new();
    }
    let mut out = vec![0x5au8; n * per];
    let src: Vec<&[u8]> = rows.chunks_exact(p.row_bytes).collect();
    let mut dst: Vec<&mut [u8]> = out.chunks_exact_mut(per).collect();
    dequantize(DIMS, p, layers, &src, dtype, &mut dst, &[], exec).unwrap();
    out
}

const DTYPES: [FloatDtype; 3] = [FloatDtype::F32, FloatDtype::F16, FloatDtype::Bf16];

fn in_dtype(x: &[f32], dtype: FloatDtype) -> Vec<u8> {
    match dtype {
        FloatDtype::F32 => f32_bytes(x),
        FloatDtype::F16 => fp16_bytes(
            &x.iter()
                .map(|v| v.clamp(-65504.0, 65504.0))
                .collect::<Vec<_>>(),
        ),
        FloatDtype::Bf16 => bf16_bytes(x),
    }
}

#[test]
fn quantize_writes_the_rows_the_rule_gives_value_by_value() {
    let n = 2;
    for p in formats() {
        for dtype in DTYPES {
            let blocks = in_dtype(&values(n, 7), dtype);
            let x = widen_all(&blocks, dtype);
            let per = x.len() / n;
            let want: Vec<u8> = x
                .chunks_exact(per)
                .flat_map(|b| reference_encode(&p, DIMS, b))
                .collect();
            for isa in [Isa::Scalar, Isa::Auto] {
                let got = encode(&p, dtype, &blocks, Exec { threads: 1, isa });
                assert!(got == want, "{:?} {dtype:?} {isa:?}", p.format);
            }
        }
    }
}

#[test]
fn dequantize_is_q_times_s_plus_z_in_each_output_dtype() {
    for p in formats() {
        let f = p.format;
        let rows = encode(
            &p,
            FloatDtype::F32,
            &f32_bytes(&values(1, 3)),
            Exec::default(),
        );
        let all = decode(
            &p,
            &rows,
            0..DIMS.layers,
            FloatDtype::F32,
            Exec {
                threads: 1,
                isa: Isa::Scalar,
            },
        );
        let got = widen_all(&all, FloatDtype::F32);
        // value by value from the row's bytes
        let (b_n, d_n, h_n) = (DIMS.block, DIMS.dim, DIMS.heads);
        let per = 8 / usize::from(f.bits);
        for (e, &v) in got.iter().enumerate() {
            let t = e / (b_n * d_n);
            let (l, kv, h) = (t / (2 * h_n), (t / h_n) % 2, t % h_n);
            let (b, dd) = ((e % (b_n * d_n)) / d_n, e % d_n);
            let per_channel = kv == 0 && f.key_per_channel;
            let groups = if per_channel {
                d_n
            } else {
                b_n * d_n / f.group
            };
            let g = (l * h_n + h) * groups
                + if per_channel {
                    dd
                } else {
                    b * (d_n / f.group) + dd / f.group
                };
            let half = |off: usize| {
                f16_to_f32(u16::from_le_bytes([
                    rows[off + 2 * g],
                    rows[off + 2 * g + 1],
                ]))
            };
            let byte = rows[f.codes + e / per];
            let field = ((u32::from(byte) >> (u32::from(f.bits) * (e % per) as u32))
                & ((1u32 << f.bits) - 1)) as u8;
            let q = if f.asymmetric {
                f32::from(field)
            } else {
                let sign = 1i16 << (f.bits - 1);
                f32::from((i16::from(field) ^ sign) - sign)
            };
            let (s_off, z_off) = if kv == 0 {
                (f.k_scale, f.k_zero)
            } else {
                (f.v_scale, f.v_zero)
            };
            let want = if f.asymmetric {
                q * half(s_off) + half(z_off)
            } else {
                q * half(s_off)
            };
            assert_eq!(v.to_bits(), want.to_bits(), "{f:?} value {e}");
        }
        for dtype in DTYPES {
            let want = match dtype {
                FloatDtype::F32 => all.clone(),
                FloatDtype::F16 => fp16_bytes(
                    &got.iter()
                        .map(|v| v.clamp(-65504.0, 65504.0))
                        .collect::<Vec<_>>(),
                ),
                FloatDtype::Bf16 => bf16_bytes(&got),
            };
            for isa in [Isa::Scalar, Isa::Auto] {
                let out = decode(&p, &rows, 0..DIMS.layers, dtype, Exec { threads: 1, isa });
                assert!(out == want, "{f:?} {dtype:?} {isa:?}");
            }
        }
    }
}

#[test]
fn a_run_of_layers_decodes_as_that_part_of_the_whole_block() {
    let p = packed(4, true, true, 8, DIMS);
    let rows = encode(
        &p,
        FloatDtype::Bf16,
        &bf16_bytes(&values(3, 5)),
        Exec::default(),
    );
    let whole = decode(&p, &rows, 0..2, FloatDtype::F16, Exec::default());
    let layer = 2 * DIMS.heads * DIMS.block * DIMS.dim * 2;
    let second = decode(&p, &rows, 1..2, FloatDtype::F16, Exec::default());
    for (i, got) in second.chunks_exact(layer).enumerate() {
        assert_eq!(got, &whole[(2 * i + 1) * layer..][..layer], "block {i}");
    }
    assert!(decode(&p, &rows, 1..1, FloatDtype::F16, Exec::default()).is_empty());
}

#[test]
fn threads_and_instruction_sets_write_the_same_bytes() {
    // enough values to take the pool
    let dims = BlockDims { layers: 8, ..DIMS };
    let p = packed(2, true, true, 8, dims);
    let n = 8;
    let mut r = Rng(11);
    let x: Vec<f32> = (0..n * 8 * 2 * 3 * 8 * 32).map(|_| r.normal()).collect();
    let blocks = fp16_bytes(&x);
    let run = |exec: Exec| {
        let mut rows = vec![0u8; n * p.row_bytes];
        let src: Vec<&[u8]> = blocks.chunks_exact(blocks.len() / n).collect();
        let mut dst: Vec<&mut [u8]> = rows.chunks_exact_mut(p.row_bytes).collect();
        quantize(dims, FloatDtype::F16, &p, &src, &mut dst, &[], exec).unwrap();
        rows
    };
    let one = run(Exec {
        threads: 1,
        isa: Isa::Scalar,
    });
    assert_eq!(
        run(Exec {
            threads: 2,
            isa: Isa::Scalar
        }),
        one
    );
    assert_eq!(
        run(Exec {
            threads: 0,
            isa: Isa::Auto
        }),
        one
    );
}

#[test]
fn transcode_is_encoding_the_fp32_decode() {
    let fs = formats();
    for (i, a) in fs.iter().enumerate() {
        let b = &fs[(i * 7 + 3) % fs.len()];
        let rows = encode(
            a,
            FloatDtype::F16,
            &in_dtype(&values(2, 9), FloatDtype::F16),
            Exec::default(),
        );
        let fp32 = decode(a, &rows, 0..DIMS.layers, FloatDtype::F32, Exec::default());
        let want = encode(b, FloatDtype::F32, &fp32, Exec::default());
        for isa in [Isa::Scalar, Isa::Auto] {
            let mut got = vec![0u8; 2 * b.row_bytes];
            let src: Vec<&[u8]> = rows.chunks_exact(a.row_bytes).collect();
            let mut dst: Vec<&mut [u8]> = got.chunks_exact_mut(b.row_bytes).collect();
            transcode(DIMS, a, b, &src, &mut dst, &[], Exec { threads: 1, isa }).unwrap();
            assert!(got == want, "{:?} -> {:?} {isa:?}", a.format, b.format);
        }
    }
}

#[test]
fn zeros_order_minus_zero_below_plus_zero() {
    assert!(key(-0.0) < key(0.0));
    assert!(key(-1.0) < key(-0.0) && key(0.0) < key(f32::MIN_POSITIVE));
    assert!(key(f32::NEG_INFINITY) < key(f32::MIN) && key(f32::MAX) < key(f32::INFINITY));
    for v in [
        0.0,
        -0.0,
        1.5,
        -1.5,
        1e-42,
        -1e-42,
        f32::MAX,
        f32::NEG_INFINITY,
    ] {
        assert_eq!(unkey(key(v)).to_bits(), v.to_bits());
    }
    // an asymmetric group of +0 and -0: the zero point is -0, the scale +0
    let dims = BlockDims {
        layers: 1,
        heads: 1,
        block: 2,
        dim: 2,
    };
    let p = packed(8, true, false, 2, dims);
    let x = [0.0f32, -0.0, 0.0, 0.0, -0.0, 0.0, 1.0, 2.0];
    let mut row = vec![0u8; p.row_bytes];
    quantize(
        dims,
        FloatDtype::F32,
        &p,
        &[&f32_bytes(&x)],
        &mut [&mut row],
        &[],
        Exec::default(),
    )
    .unwrap();
    let half = |off: usize| u16::from_le_bytes([row[off], row[off + 1]]);
    assert_eq!(half(p.format.k_zero), 0x8000);
    assert_eq!(half(p.format.k_scale), 0x0000);
    assert_eq!(half(p.format.k_zero + 2), 0x0000);
}

#[test]
fn bad_input_is_refused_before_anything_is_written() {
    let p = packed(4, true, true, 8, DIMS);
    let blocks = f32_bytes(&values(1, 1));
    let mut row = vec![7u8; p.row_bytes];
    let exec = Exec::default();
    let q = |dims: BlockDims, p: &PackedFormat, src: &[&[u8]], row: &mut Vec<u8>| {
        let mut dst: Vec<&mut [u8]> = row.chunks_mut(p.row_bytes.max(1)).collect();
        quantize(dims, FloatDtype::F32, p, src, &mut dst, &[], exec)
    };
    let err = |r: Result<()>| r.unwrap_err().to_string();
    assert!(err(q(DIMS, &p, &[&blocks[4..]], &mut row)).contains("src"));
    assert!(err(q(DIMS, &p, &[&blocks, &blocks], &mut row)).contains("expected 2 rows"));
    assert!(err(q(BlockDims { dim: 30, ..DIMS }, &p, &[&blocks], &mut row)).contains("group 8"));
    assert!(err(q(BlockDims { block: 0, ..DIMS }, &p, &[&blocks], &mut row)).contains("block"));
    let short = PackedFormat {
        row_bytes: p.row_bytes - 2,
        ..p
    };
    let mut short_row = vec![7u8; short.row_bytes];
    assert!(err(q(DIMS, &short, &[&blocks], &mut short_row)).contains("v_zero"));
    let overlapping = PackedFormat {
        format: QuantFormat {
            v_scale: p.format.k_zero,
            ..p.format
        },
        ..p
    };
    assert!(err(q(DIMS, &overlapping, &[&blocks], &mut row)).contains("overlap"));
    assert!(row.iter().all(|&b| b == 7) && short_row.iter().all(|&b| b == 7));
    let mut out = vec![0u8; 16];
    let r = dequantize(
        DIMS,
        &p,
        1..3,
        &[&row],
        FloatDtype::F32,
        &mut [&mut out],
        &[],
        exec,
    );
    assert!(err(r).contains("layers"));
    let layout = [4, 1, 1, 8, 0, 10, 20, 30, 40, 50, 0];
    assert_eq!(
        PackedFormat::from_layout(&layout).unwrap().format.v_zero,
        40
    );
    assert!(PackedFormat::from_layout(&[3, 1, 1, 8, 0, 10, 20, 30, 40, 50, 0]).is_err());
    assert!(PackedFormat::from_layout(&layout[..10]).is_err());
    assert!(PackedFormat::from_layout(&[4, 1, 1, 8, 0, 10, 20, 30, 40, 50, 2]).is_err());
    assert!(PackedFormat::from_layout(&[4, 2, 1, 8, 0, 10, 20, 30, 40, 50, 0]).is_err());
    assert!(PackedFormat::from_layout(&[4, 1, 1, -8, 0, 10, 20, 30, 40, 50, 0]).is_err());
}
