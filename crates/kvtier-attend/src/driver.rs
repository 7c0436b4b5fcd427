//! One call, after its checks: the work items, the online softmax over each item's blocks, and
//! the merge of a sequence's items into its output and block masses.
//!
//! A *row* is one (query, query head) pair: row `g * rows + i * group + hh` is query `i` at query
//! head `g * group + hh` of K/V head `g`, so the rows of a K/V head read one K/V tile per block,
//! and causal masking hides whole rows from early blocks (later queries come later in the rows).
//! An item walks blocks `j0..j1` of one sequence, every K/V head of a block in turn (a block's
//! row is read front to back, which the CPU's prefetchers follow): per (block, head) it computes
//! the rows' scores, then per row the block's maximum `mb`, the running maximum `m = max(m,
//! mb)`, the block's sum `lb = sum exp(s - m)` (kept per block for the mass), rescales the
//! accumulator by `exp(m_old - m)` when `m` grew, and adds the block's `exp(s - m) . V`. The
//! merge takes the items of a sequence, rescales each to the rows' common maximum, divides by
//! the total sum.

use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use crate::error::{invalid, Error, Result};
use crate::kernels::{prefetch, prefetch_into, Encoding, Kernels, TileDims, TO_L2};
use crate::layout::{Blocks, Dims, FloatDtype, Format, PoolDesc};
use crate::rotation::{check_signs, rotate, unrotate};
use crate::{Inputs, Outputs, Problem};

/// Below this many multiply-adds of scores (tokens x queries x query heads x head_dim), a call
/// runs on the calling thread: it takes less time than waking a pool's threads costs.
const PARALLEL_MIN_WORK: usize = 1 << 21;
/// A long sequence is cut into runs of at least this many blocks per item.
const MIN_SPLIT_BLOCKS: usize = 8;
/// Items per thread aimed at when sequences are cut (the slack evens out uneven items).
const ITEMS_PER_THREAD: usize = 4;

/// A checked call: sizes, the tables as indices, each pool's addressing.
pub(crate) struct Ctx<'a> {
    p: Problem,
    dtype: FloatDtype,
    q: &'a [u8],
    group: usize,
    rows: usize,
    seq_lens: Vec<usize>,
    /// blocks of each sequence (`ceil(len / B)`)
    blocks: Vec<usize>,
    block_pool: &'a [i32],
    block_slot: &'a [i32],
    pools: Vec<(Blocks, &'a [u8])>,
    /// a pool's per-token keys take a zero point per token: scores need each row's sum of q
    needs_q_sum: bool,
    /// the rotation's signs when some pool is rotated: the queries are rotated once and the
    /// rotated pools' values accumulate apart (see the crate's docs)
    rotation: Option<&'a [f32]>,
}

fn product(what: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| invalid(what, "the size overflows"))
}

impl<'a> Ctx<'a> {
    pub fn new(p: &Problem, inputs: &Inputs<'a>, outputs: &Outputs<'_>) -> Result<Self> {
        let (s_n, q_n, hq, hkv, b, d, m) = (
            p.seqs,
            p.queries,
            p.q_heads,
            p.kv_heads,
            p.block_size,
            p.head_dim,
            p.max_blocks,
        );
        for (what, v) in [
            ("queries", q_n),
            ("q_heads", hq),
            ("kv_heads", hkv),
            ("block_size", b),
            ("head_dim", d),
        ] {
            if v == 0 {
                return Err(invalid(what, "expected a positive number"));
            }
        }
        if hq % hkv != 0 {
            return Err(invalid(
                "q_heads",
                format!("{hq} query heads is not a multiple of {hkv} K/V heads"),
            ));
        }
        if !p.scale.is_finite() {
            return Err(invalid(
                "scale",
                format!("expected a finite number, got {}", p.scale),
            ));
        }
        let q_len = product("q", &[s_n, q_n, hq, d, inputs.dtype.size()])?;
        if inputs.q.len() != q_len {
            return Err(invalid(
                "q",
                format!(
                    "expected {q_len} bytes ([{s_n}, {q_n}, {hq}, {d}]), got {}",
                    inputs.q.len()
                ),
            ));
        }
        // The softmax drops a NaN score: a NaN query would come back as a row of zeros with
        // zero mass, an answer that looks right. Checked here, where q is read anyway.
        if !inputs.dtype.all_finite(inputs.q) {
            return Err(invalid(
                "q",
                "expected finite values, got NaN or inf; nothing was computed or recorded",
            ));
        }
        if outputs.out.len() != q_len {
            return Err(invalid(
                "out",
                format!(
                    "expected {q_len} bytes (q's shape and dtype), got {}",
                    outputs.out.len()
                ),
            ));
        }
        let table = product("block table", &[s_n, m])?;
        for (what, len) in [
            ("mass", outputs.mass.len()),
            ("block_pool", inputs.block_pool.len()),
            ("block_slot", inputs.block_slot.len()),
        ] {
            if len != table {
                return Err(invalid(
                    what,
                    format!("expected {table} values ([{s_n}, {m}]), got {len}"),
                ));
            }
        }
        if inputs.seq_lens.len() != s_n {
            return Err(invalid(
                "seq_lens",
                format!("expected {s_n} values, got {}", inputs.seq_lens.len()),
            ));
        }
        let capacity = product("block table", &[m, b])?;
        let mut seq_lens = Vec::with_capacity(s_n);
        for &n in inputs.seq_lens {
            match usize::try_from(n) {
                Ok(n) if n >= q_n && n <= capacity => seq_lens.push(n),
                _ => {
                    return Err(invalid(
                        "seq_lens",
                        format!(
                            "expected each in [{q_n} queries, {capacity} tokens of the block \
                             table], got {n}"
                        ),
                    ))
                }
            }
        }
        let dims = Dims {
            heads: hkv,
            block: b,
            dim: d,
        };
        let pools = inputs
            .pools
            .iter()
            .enumerate()
            .map(|(i, pool)| {
                Ok((
                    pool.desc.check(i, dims, p.layer, pool.bytes.len())?,
                    pool.bytes,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks: Vec<usize> = seq_lens.iter().map(|n| n.div_ceil(b)).collect();
        for (s, &nb) in blocks.iter().enumerate() {
            for j in 0..nb {
                let pool = inputs.block_pool[s * m + j];
                if pool == -1 {
                    continue;
                }
                let desc: &PoolDesc =
                    match usize::try_from(pool).ok().and_then(|i| inputs.pools.get(i)) {
                        Some(pool) => &pool.desc,
                        None => {
                            return Err(Error::PoolOutOfRange {
                                seq: s,
                                block: j,
                                pool: i64::from(pool),
                                max: inputs.pools.len() as i64 - 1,
                            })
                        }
                    };
                let slot = inputs.block_slot[s * m + j];
                if usize::try_from(slot).map_or(true, |slot| slot >= desc.slots) {
                    return Err(Error::SlotOutOfRange {
                        seq: s,
                        block: j,
                        pool: pool as usize,
                        slot: i64::from(slot),
                        slots: desc.slots,
                    });
                }
            }
        }
        let group = hq / hkv;
        let needs_q_sum = pools.iter().any(|(blocks, _)| match blocks.format {
            Format::Quant(f) => f.asymmetric && !f.key_per_channel && f.group == d,
            Format::Float(_) => false,
        });
        let rotation = if pools.iter().any(|(blocks, _)| blocks.rotated()) {
            let signs = inputs.rotation;
            check_signs(signs, d).map_err(|reason| invalid("rotation", reason))?;
            Some(signs)
        } else {
            None
        };
        Ok(Self {
            p: *p,
            dtype: inputs.dtype,
            q: inputs.q,
            group,
            rows: q_n * group,
            seq_lens,
            blocks,
            block_pool: inputs.block_pool,
            block_slot: inputs.block_slot,
            pools,
            needs_q_sum,
            rotation,
        })
    }
}

/// Blocks ahead of the one being computed whose bytes are prefetched (see `Ctx::prefetch_head`).
const PREFETCH_AHEAD: usize = 1;

impl Ctx<'_> {
    /// The pool's layout and the row of block `j` of sequence `s`; `None` when it is skipped.
    #[inline(always)]
    fn block(&self, s: usize, j: usize) -> Option<(&Blocks, &[u8])> {
        let e = s * self.p.max_blocks + j;
        let pool = usize::try_from(self.block_pool[e]).ok()?;
        let (blocks, bytes) = &self.pools[pool];
        Some((blocks, blocks.row(bytes, self.block_slot[e] as usize)))
    }

    /// Prefetches what head `g` of block `j` of sequence `s` reads at the call's layer, if the
    /// block exists: a quantized block's K and V codes, scales and zero points (a few small
    /// runs that a cold call otherwise waits on one by one: cold SmolLM2 int8/int4 calls ~20-30%
    /// faster), into L1; a float block's K and V tiles into L2 only. Into L1, those (8 KB in
    /// fp32) crowded the current tile out: hot 4096-token calls up to 3x slower (AMD EPYC).
    /// Into L2, cold SmolLM2 calls (a decode step's, behind the model's weights) took 10-20%
    /// less at 512 and 4,096 tokens, hot 4,096-token fp32 ones up to ~15% more (Intel Xeon,
    /// `cargo bench -p kvtier-attend -- cold`).
    #[inline(always)]
    fn prefetch_head(&self, s: usize, j: usize, g: usize) {
        if j >= self.blocks[s] {
            return;
        }
        let Some((blocks, row)) = self.block(s, j) else {
            return;
        };
        let Format::Quant(fmt) = blocks.format else {
            prefetch_into::<TO_L2>(&row[blocks.k + g * blocks.head..][..blocks.head]);
            prefetch_into::<TO_L2>(&row[blocks.v + g * blocks.head..][..blocks.head]);
            return;
        };
        prefetch(&row[blocks.k + g * blocks.head..][..blocks.head]);
        prefetch(&row[blocks.v + g * blocks.head..][..blocks.head]);
        let (kh, vh) = (2 * blocks.k_groups, 2 * blocks.v_groups);
        prefetch(&row[blocks.k_scale + g * kh..][..kh]);
        prefetch(&row[blocks.v_scale + g * vh..][..vh]);
        if fmt.asymmetric {
            prefetch(&row[blocks.k_zero + g * kh..][..kh]);
            prefetch(&row[blocks.v_zero + g * vh..][..vh]);
        }
    }
}

/// Blocks `j0..j1` of sequence `s`, every K/V head (a block's row is read front to back).
#[derive(Clone, Copy, Debug)]
struct Item {
    s: usize,
    j0: usize,
    j1: usize,
}

/// An item's working memory, reused from item to item on one thread.
struct Scratch {
    /// the item's rows of scaled queries, `[rows, D]`
    q: Vec<f32>,
    /// queries times per-channel key scales, `[rows, D]`
    q_scaled: Vec<f32>,
    /// per row: the sum of its query (per-token asymmetric keys' zero term)
    q_sum: Vec<f32>,
    /// `[rows, B]`: scores, then probabilities
    p: Vec<f32>,
    /// `[rows, B]`: probabilities times per-token value scales
    w: Vec<f32>,
    /// per row: the accumulator's rescaling, the block's sum of probabilities, q . z of
    /// per-channel keys' zero points
    alpha: Vec<f32>,
    lb: Vec<f32>,
    bias: Vec<f32>,
    /// per row of every K/V head: the sum over tokens of p_t * z_t of values' zero points,
    /// rescaled as the accumulator is, added to each of its values at the item's end
    z_acc: Vec<f32>,
    k_tile: Vec<f32>,
    v_tile: Vec<f32>,
    /// one block's scales and zero points, K's and V's
    ks: Vec<f32>,
    kz: Vec<f32>,
    vs: Vec<f32>,
    vz: Vec<f32>,
    /// values grouped along the head: `vs` and `vz` group-major, `[groups of a token, B]`
    vs_t: Vec<f32>,
    vz_t: Vec<f32>,
    /// with rotated pools: the rotated queries and their sums, the rotated values' zero terms,
    /// and per row the rescaling each accumulator still owes (the online softmax rescales the
    /// one a block adds to; the other catches up when next added to, or at the item's end)
    q_rot: Vec<f32>,
    q_sum_rot: Vec<f32>,
    z_rot: Vec<f32>,
    owed: Vec<f32>,
    owed_rot: Vec<f32>,
    alpha_owed: Vec<f32>,
    /// per value group of a token, the block's weights `p * s` (`[groups][rows][B]`)
    w_groups: Vec<f32>,
}

impl Scratch {
    fn new(c: &Ctx<'_>) -> Self {
        let (r, b, d) = (c.rows, c.p.block_size, c.p.head_dim);
        // scales and zero points of a block's head: as many as the largest format has groups
        let groups = c
            .pools
            .iter()
            .map(|(blocks, _)| blocks.k_groups.max(blocks.v_groups))
            .max()
            .unwrap_or(0);
        let quant = groups > 0;
        let rot = c.rotation.is_some();
        // value groups a token, in formats that group values along the head
        let value_groups = c
            .pools
            .iter()
            .filter_map(|(blocks, _)| match blocks.format {
                Format::Quant(f) if f.group > 0 => Some(d / f.group),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        Self {
            q: vec![0.0; c.p.kv_heads * r * d],
            q_scaled: vec![0.0; if quant { r * d } else { 0 }],
            q_sum: vec![0.0; c.p.kv_heads * r],
            p: vec![0.0; r * b],
            w: vec![0.0; if quant { r * b } else { 0 }],
            alpha: vec![0.0; r],
            lb: vec![0.0; r],
            bias: vec![0.0; r],
            z_acc: vec![0.0; c.p.kv_heads * r],
            k_tile: vec![0.0; b * d],
            v_tile: vec![0.0; b * d],
            ks: vec![0.0; groups],
            kz: vec![0.0; groups],
            vs: vec![0.0; groups],
            vz: vec![0.0; groups],
            vs_t: vec![0.0; value_groups * b],
            vz_t: vec![0.0; value_groups * b],
            q_rot: vec![0.0; if rot { c.p.kv_heads * r * d } else { 0 }],
            q_sum_rot: vec![0.0; if rot { c.p.kv_heads * r } else { 0 }],
            z_rot: vec![0.0; if rot { c.p.kv_heads * r } else { 0 }],
            owed: vec![1.0; if rot { c.p.kv_heads * r } else { 0 }],
            owed_rot: vec![1.0; if rot { c.p.kv_heads * r } else { 0 }],
            alpha_owed: vec![0.0; if rot { r } else { 0 }],
            w_groups: vec![0.0; value_groups * r * b],
        }
    }
}

/// Runs the item: leaves `part` = `[m: rows][l: rows][acc: rows * D]` (and, with rotated pools,
/// `[acc_rot: rows * D]`, their values' sum in the rotated basis) and `stats` = per block
/// (`j - j0`) per row, the running maximum after it and the block's sum relative to it.
#[inline(always)] // into `Kernels::enter`'s frame: compiled for the kernels' instruction set
fn run_item<K: Kernels>(
    k: K,
    c: &Ctx<'_>,
    it: Item,
    sc: &mut Scratch,
    part: &mut [f32],
    stats: &mut [f32],
) {
    let Problem {
        queries: q_n,
        q_heads: hq,
        block_size: b,
        head_dim: d,
        ..
    } = c.p;
    let (rows, group, hkv) = (c.rows, c.group, c.p.kv_heads);
    let all = hkv * rows; // rows of every K/V head: head g's are g * rows..
    let n = c.seq_lens[it.s];
    let (m_all, rest) = part.split_at_mut(all);
    let (l_all, rest) = rest.split_at_mut(all);
    let (acc_all, acc_rot_all) = rest.split_at_mut(all * d);
    m_all.fill(f32::NEG_INFINITY);
    l_all.fill(0.0);
    acc_all.fill(0.0);
    acc_rot_all.fill(0.0);
    for st in stats.chunks_exact_mut(2) {
        st[0] = f32::NEG_INFINITY;
        st[1] = 0.0;
    }
    let Scratch {
        q: q_all,
        q_scaled,
        q_sum: q_sum_all,
        p: probs,
        w,
        alpha,
        lb,
        bias,
        z_acc: z_acc_all,
        k_tile,
        v_tile,
        ks,
        kz,
        vs,
        vz,
        vs_t,
        vz_t,
        q_rot: q_rot_all,
        q_sum_rot: q_sum_rot_all,
        z_rot: z_rot_all,
        owed: owed_all,
        owed_rot: owed_rot_all,
        alpha_owed,
        w_groups,
    } = sc;
    z_acc_all.fill(0.0);
    z_rot_all.fill(0.0);
    owed_all.fill(1.0);
    owed_rot_all.fill(1.0);
    // row g * rows + i * group + hh: query i at query head g * group + hh
    for g in 0..hkv {
        for i in 0..q_n {
            let at = ((it.s * q_n + i) * hq + g * group) * d;
            let size = c.dtype.size();
            let src = &c.q[at * size..(at + group * d) * size];
            let r = g * rows + i * group;
            k.widen(
                src,
                Encoding::of_float(c.dtype),
                &mut q_all[r * d..(r + group) * d],
            );
        }
    }
    k.scale(&mut q_all[..all * d], c.p.scale);
    if let Some(signs) = c.rotation {
        q_rot_all.copy_from_slice(&q_all[..all * d]);
        for row in q_rot_all.chunks_exact_mut(d) {
            rotate(row, signs);
        }
    }
    if c.needs_q_sum {
        for (sum, qrow) in q_sum_all.iter_mut().zip(q_all.chunks_exact(d)) {
            *sum = qrow.iter().sum();
        }
        for (sum, qrow) in q_sum_rot_all.iter_mut().zip(q_rot_all.chunks_exact(d)) {
            *sum = qrow.iter().sum();
        }
    }

    // the first blocks' bytes are on their way while the first is computed; then each head
    // of a block asks for the same head of the block `PREFETCH_AHEAD` on
    for j in it.j0..it.j1.min(it.j0 + PREFETCH_AHEAD) {
        for g in 0..hkv {
            c.prefetch_head(it.s, j, g);
        }
    }
    for j in it.j0..it.j1 {
        let Some((blocks, row)) = c.block(it.s, j) else {
            continue; // skipped
        };
        let base = j * b;
        let nv = (n - base).min(b);
        // rows of queries that see none of this block: the first rows (earlier queries)
        let r0 = (base + q_n).saturating_sub(n) * group;
        let nr = rows - r0;
        // a rotated block: the rotated queries score it, its values go to the rotated sum
        let rot = blocks.rotated();
        let (q_for, q_sum_for) = if rot {
            (&*q_rot_all, &*q_sum_rot_all)
        } else {
            (&*q_all, &*q_sum_all)
        };
        for g in 0..hkv {
            c.prefetch_head(it.s, j + PREFETCH_AHEAD, g);
            let q = &q_for[g * rows * d..(g + 1) * rows * d];
            let q_sum = &q_sum_for[g * rows..(g + 1) * rows];
            let m = &mut m_all[g * rows..(g + 1) * rows];
            let l = &mut l_all[g * rows..(g + 1) * rows];
            let qr = &q[r0 * d..rows * d];
            let s = &mut probs[..nr * nv];
            let dims = TileDims { d, rows: nr, n: nv };

            // scores
            match blocks.format {
                Format::Float(dtype) => {
                    let src = &row[blocks.k + g * blocks.head..][..nv * d * dtype.size()];
                    k.scores_enc(qr, src, Encoding::of_float(dtype), dims, k_tile, s);
                }
                Format::Quant(fmt) => {
                    let enc = Encoding::of_codes(fmt.bits, fmt.asymmetric);
                    let codes = &row[blocks.k + g * blocks.head..][..enc.bytes(nv * d)];
                    let sections = 2 * blocks.k_groups * g;
                    if fmt.key_per_channel {
                        k.widen(
                            &row[blocks.k_scale + sections..][..2 * d],
                            Encoding::F16,
                            &mut ks[..d],
                        );
                        // q . (code * s + z) = (q * s) . code + q . z: the rows are scaled
                        // (once for the block's tokens), the codes read as they lie
                        let zero = fmt.asymmetric.then(|| {
                            k.widen(
                                &row[blocks.k_zero + sections..][..2 * d],
                                Encoding::F16,
                                &mut kz[..d],
                            );
                            &kz[..d]
                        });
                        let (qs, bias) = (&mut q_scaled[..nr * d], &mut bias[..nr]);
                        k.scale_rows(qr, &ks[..d], zero, qs, bias);
                        k.scores_enc(qs, codes, enc, dims, k_tile, s);
                        if zero.is_some() {
                            for (srow, &b) in s.chunks_exact_mut(nv).zip(&*bias) {
                                srow.iter_mut().for_each(|x| *x += b);
                            }
                        }
                    } else {
                        let per_token = d / fmt.group;
                        let ng = nv * per_token;
                        k.widen(
                            &row[blocks.k_scale + sections..][..2 * ng],
                            Encoding::F16,
                            &mut ks[..ng],
                        );
                        let zero = fmt.asymmetric.then(|| {
                            k.widen(
                                &row[blocks.k_zero + sections..][..2 * ng],
                                Encoding::F16,
                                &mut kz[..ng],
                            );
                            &kz[..ng]
                        });
                        if per_token == 1 {
                            // one group a token: q . (code * s_t + z_t) = s_t (q . code) + z_t sum(q)
                            k.scores_enc(qr, codes, enc, dims, k_tile, s);
                            match zero {
                                Some(z) => {
                                    for (srow, &qs) in s.chunks_exact_mut(nv).zip(&q_sum[r0..]) {
                                        for ((x, &st), &zt) in srow.iter_mut().zip(&ks[..nv]).zip(z)
                                        {
                                            *x = *x * st + zt * qs;
                                        }
                                    }
                                }
                                None => {
                                    for srow in s.chunks_exact_mut(nv) {
                                        for (x, &st) in srow.iter_mut().zip(&ks[..nv]) {
                                            *x *= st;
                                        }
                                    }
                                }
                            }
                        } else {
                            let kt = &mut k_tile[..nv * d];
                            k.widen(codes, enc, kt);
                            k.affine_tokens(kt, d, fmt.group, &ks[..ng], zero);
                            k.scores(qr, kt, dims, s);
                        }
                    }
                }
            }

            // causal mask: row r (query i) sees tokens up to position n - Q + i
            if base + nv + q_n > n + 1 {
                for (ri, srow) in s.chunks_exact_mut(nv).enumerate() {
                    let pos = n - q_n + (r0 + ri) / group;
                    let visible = pos + 1 - base;
                    if visible < nv {
                        srow[visible..].fill(f32::NEG_INFINITY);
                    }
                }
            }

            // online softmax: the block's probabilities (relative to each row's new maximum)
            let (alpha, lb) = (&mut alpha[..nr], &mut lb[..nr]);
            k.softmax(s, nv, &mut m[r0..], &mut l[r0..], alpha, lb);
            let st = &mut stats[((j - it.j0) * all + g * rows) * 2..][..rows * 2];
            for (ri, &sum) in lb.iter().enumerate() {
                if sum > 0.0 {
                    st[2 * (r0 + ri)] = m[r0 + ri];
                    st[2 * (r0 + ri) + 1] = sum;
                }
            }
            let heads = g * rows..(g + 1) * rows;
            for z_all in [&mut *z_acc_all, &mut *z_rot_all] {
                if let Some(z) = z_all.get_mut(g * rows + r0..(g + 1) * rows) {
                    for (z, &a) in z.iter_mut().zip(&*alpha) {
                        *z *= a;
                    }
                }
            }
            let (acc_all_for, z_acc) = if rot {
                (&mut *acc_rot_all, &mut z_rot_all[heads.clone()])
            } else {
                (&mut *acc_all, &mut z_acc_all[heads.clone()])
            };
            let acc = &mut acc_all_for[g * rows * d..(g + 1) * rows * d];
            // with rotated pools, the accumulator added to pays what it owes of the rescaling
            // with this block's; the other owes this block's too
            let alpha: &[f32] = if c.rotation.is_some() {
                let (mine, other) = if rot {
                    (&mut owed_rot_all[heads.clone()], &mut owed_all[heads])
                } else {
                    (&mut owed_all[heads.clone()], &mut owed_rot_all[heads])
                };
                for (ri, &a) in alpha.iter().enumerate() {
                    alpha_owed[ri] = mine[r0 + ri] * a;
                    mine[r0 + ri] = 1.0;
                    other[r0 + ri] *= a;
                }
                &alpha_owed[..nr]
            } else {
                &*alpha
            };

            // values
            let acc_rows = &mut acc[r0 * d..rows * d];
            match blocks.format {
                Format::Float(dtype) => {
                    let src = &row[blocks.v + g * blocks.head..][..nv * d * dtype.size()];
                    let enc = Encoding::of_float(dtype);
                    k.accumulate_enc(s, src, enc, dims, alpha, v_tile, acc_rows);
                }
                Format::Quant(fmt) => {
                    let enc = Encoding::of_codes(fmt.bits, fmt.asymmetric);
                    let codes = &row[blocks.v + g * blocks.head..][..enc.bytes(nv * d)];
                    let sections = 2 * blocks.v_groups * g;
                    let per_token = d / fmt.group;
                    let ng = nv * per_token;
                    k.widen(
                        &row[blocks.v_scale + sections..][..2 * ng],
                        Encoding::F16,
                        &mut vs[..ng],
                    );
                    let zero = fmt.asymmetric.then(|| {
                        k.widen(
                            &row[blocks.v_zero + sections..][..2 * ng],
                            Encoding::F16,
                            &mut vz[..ng],
                        );
                        &vz[..ng]
                    });
                    if per_token == 1 {
                        // sum_t p_t (code_t * s_t + z_t) = sum_t (p_t s_t) code_t + sum_t p_t z_t
                        let wr = &mut w[..nr * nv];
                        for (wrow, srow) in wr.chunks_exact_mut(nv).zip(s.chunks_exact(nv)) {
                            for ((o, &pt), &st) in wrow.iter_mut().zip(srow).zip(&vs[..nv]) {
                                *o = pt * st;
                            }
                        }
                        k.accumulate_enc(wr, codes, enc, dims, alpha, v_tile, acc_rows);
                        if let Some(z) = zero {
                            // sum_t p_t z_t, the same for each of the row's D values: kept
                            // apart (rescaled as the row is) and added once, in `settle`
                            k.add_dots(s, z, &mut z_acc[r0..]);
                        }
                    } else {
                        // sum_t p_t (code_t * s_tg + z_tg) over group g's values: the weights
                        // p_t s_tg, a set per group, read the codes as they lie; sum_t p_t z_tg
                        // added to the group's values after. The scales and zero points are
                        // turned group-major first, so that both are loops along the tokens.
                        let vs_g = by_group(&vs[..ng], per_token, &mut vs_t[..ng]);
                        let wg = &mut w_groups[..per_token * nr * nv];
                        for (wg, sg) in wg.chunks_exact_mut(nr * nv).zip(vs_g.chunks_exact(nv)) {
                            for (wrow, srow) in wg.chunks_exact_mut(nv).zip(s.chunks_exact(nv)) {
                                for ((o, &pt), &st) in wrow.iter_mut().zip(srow).zip(sg) {
                                    *o = pt * st;
                                }
                            }
                        }
                        k.accumulate_groups_enc(
                            wg, codes, enc, dims, fmt.group, alpha, v_tile, acc_rows,
                        );
                        if let Some(z) = zero {
                            let vz_g = by_group(z, per_token, &mut vz_t[..ng]);
                            for (arow, srow) in acc_rows.chunks_exact_mut(d).zip(s.chunks_exact(nv))
                            {
                                let groups = arow.chunks_exact_mut(fmt.group);
                                for (cols, zg) in groups.zip(vz_g.chunks_exact(nv)) {
                                    let zs: f32 =
                                        srow.iter().zip(zg).map(|(&pt, &zt)| pt * zt).sum();
                                    cols.iter_mut().for_each(|x| *x += zs);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // the rescaling still owed, then the values' zero points' terms
    if c.rotation.is_some() {
        for (acc, owed) in [
            (&mut *acc_all, &*owed_all),
            (&mut *acc_rot_all, &*owed_rot_all),
        ] {
            for (arow, &f) in acc.chunks_exact_mut(d).zip(owed) {
                if f != 1.0 {
                    k.scale(arow, f);
                }
            }
        }
    }
    for (acc, z_all) in [(acc_all, &*z_acc_all), (acc_rot_all, &*z_rot_all)] {
        for (arow, &z) in acc.chunks_exact_mut(d).zip(z_all) {
            if z != 0.0 {
                arow.iter_mut().for_each(|a| *a += z);
            }
        }
    }
}

/// `x`, token-major `[tokens, groups]`, group-major into `out` (`[groups, tokens]`), returned.
#[inline(always)]
fn by_group<'o>(x: &[f32], groups: usize, out: &'o mut [f32]) -> &'o [f32] {
    let tokens = x.len() / groups;
    for (t, row) in x.chunks_exact(groups).enumerate() {
        for (g, &v) in row.iter().enumerate() {
            out[g * tokens + t] = v;
        }
    }
    out
}

/// Merges a sequence's items into its output rows (`out`, `[Q, Hq, D]` of the dtype) and its
/// block masses (`mass`, `[M]`).
#[inline(always)] // as `run_item`
fn finish<K: Kernels>(
    k: K,
    c: &Ctx<'_>,
    items: &[Item],
    parts: &[&[f32]],
    stats: &[&[f32]],
    out: &mut [u8],
    mass: &mut [f32],
) {
    let Problem {
        queries: q_n,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        ..
    } = c.p;
    let (rows, group) = (c.rows, c.group);
    let all = hkv * rows;
    let mut rows_out = vec![0.0f32; q_n * hq * d];
    let mut o_rot = vec![0.0f32; if c.rotation.is_some() { d } else { 0 }];
    mass.fill(0.0);
    for gr in 0..all {
        let mx = parts
            .iter()
            .map(|part| part[gr])
            .fold(f32::NEG_INFINITY, f32::max);
        if mx == f32::NEG_INFINITY {
            continue; // sees no key: zeros
        }
        let (g, r) = (gr / rows, gr % rows);
        let (i, hh) = (r / group, r % group);
        let o = &mut rows_out[(i * hq + g * group + hh) * d..][..d];
        let mut total = 0.0;
        o_rot.fill(0.0);
        for part in parts {
            let (pm, pl) = (part[gr], part[all + gr]);
            if pl == 0.0 {
                continue;
            }
            let f = (pm - mx).exp();
            total += pl * f;
            let pa = &part[2 * all + gr * d..][..d];
            for (o, &a) in o.iter_mut().zip(pa) {
                *o += a * f;
            }
            if let Some(pa) = part.get(2 * all + all * d + gr * d..2 * all + all * d + (gr + 1) * d)
            {
                for (o, &a) in o_rot.iter_mut().zip(pa) {
                    *o += a * f;
                }
            }
        }
        if let Some(signs) = c.rotation {
            unrotate(&mut o_rot, signs);
            for (o, &x) in o.iter_mut().zip(&o_rot) {
                *o += x;
            }
        }
        let inv = 1.0 / total;
        k.scale(o, inv);
        // the running maximum only grows: few distinct values, one exp each
        let (mut last_m, mut factor) = (f32::NAN, 0.0);
        for (it, st) in items.iter().zip(stats) {
            for (jj, st) in st.chunks_exact(2 * all).enumerate() {
                let (mj, lj) = (st[2 * gr], st[2 * gr + 1]);
                if lj == 0.0 {
                    continue;
                }
                if mj != last_m {
                    last_m = mj;
                    factor = (mj - mx).exp() * inv;
                }
                mass[it.j0 + jj] += lj * factor;
            }
        }
    }
    k.scale(mass, 1.0 / (hq * q_n) as f32);
    k.narrow(&rows_out, c.dtype, out);
}

/// The items of a call, by sequence then block: one per sequence, or runs of `chunk` blocks.
fn plan(c: &Ctx<'_>, chunk: usize) -> Vec<Item> {
    let mut items = Vec::new();
    for (s, &nb) in c.blocks.iter().enumerate() {
        let mut j0 = 0;
        while j0 < nb {
            let j1 = nb.min(j0.saturating_add(chunk));
            items.push(Item { s, j0, j1 });
            j0 = j1;
        }
    }
    items
}

/// Runs `f` on `threads` threads: 0, rayon's global pool; n, a pool of n built on first use.
pub(crate) fn on_pool<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    static POOLS: Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(Vec::new());
    if threads == 0 {
        return f();
    }
    let pool = {
        let mut pools = POOLS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match pools.iter().find(|(n, _)| *n == threads) {
            Some((_, pool)) => Some(pool.clone()),
            None => rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .ok()
                .map(|pool| {
                    let pool = Arc::new(pool);
                    pools.push((threads, pool.clone()));
                    pool
                }),
        }
    };
    match pool {
        Some(pool) => pool.install(f),
        None => f(), // no threads to be had: rayon's global pool
    }
}

/// Splits `buf` into consecutive pieces of `sizes`.
fn split_mut(mut buf: &mut [f32], sizes: impl Iterator<Item = usize>) -> Vec<&mut [f32]> {
    let mut out = Vec::new();
    for size in sizes {
        let (piece, rest) = std::mem::take(&mut buf).split_at_mut(size);
        out.push(piece);
        buf = rest;
    }
    out
}

pub(crate) fn run<K: Kernels>(k: K, c: &Ctx<'_>, outputs: Outputs<'_>, threads: usize) {
    let Problem {
        seqs,
        queries: q_n,
        q_heads: hq,
        kv_heads: hkv,
        head_dim: d,
        max_blocks: m_blocks,
        ..
    } = c.p;
    if seqs == 0 {
        return;
    }
    let threads_n = if threads == 0 {
        rayon::current_num_threads()
    } else {
        threads
    };
    let work: usize = c
        .seq_lens
        .iter()
        .map(|&n| n.saturating_mul(q_n * hq * d))
        .fold(0, usize::saturating_add);
    let parallel = threads_n > 1 && work >= PARALLEL_MIN_WORK;
    let chunk = if parallel && seqs < ITEMS_PER_THREAD * threads_n {
        let total: usize = c.blocks.iter().sum();
        MIN_SPLIT_BLOCKS.max(total.div_ceil(ITEMS_PER_THREAD * threads_n))
    } else {
        usize::MAX
    };
    let items = plan(c, chunk);
    let rows = c.rows;
    let all = hkv * rows;
    let part_len = all * (d + 2) + if c.rotation.is_some() { all * d } else { 0 };
    let mut parts = vec![0.0f32; items.len() * part_len];
    let stat_lens = || items.iter().map(|it| (it.j1 - it.j0) * all * 2);
    let mut stats = vec![0.0f32; stat_lens().sum()];
    let out_len = q_n * hq * d * c.dtype.size();
    // items of each sequence: a run of `items`
    let mut seq_items = vec![0..0; seqs];
    for (x, it) in items.iter().enumerate() {
        let r = &mut seq_items[it.s];
        if r.start == r.end {
            *r = x..x + 1;
        } else {
            r.end = x + 1;
        }
    }

    if parallel {
        on_pool(threads, || {
            let work: Vec<_> = items
                .iter()
                .zip(parts.chunks_exact_mut(part_len))
                .zip(split_mut(&mut stats, stat_lens()))
                .collect();
            work.into_par_iter().for_each_init(
                || Scratch::new(c),
                |sc, ((&it, part), st)| k.enter(|| run_item(k, c, it, sc, part, st)),
            );
            let part_refs: Vec<&[f32]> = parts.chunks_exact(part_len).collect();
            let stat_refs: Vec<&[f32]> = split_ref(&stats, stat_lens());
            outputs
                .out
                .par_chunks_exact_mut(out_len)
                .zip(outputs.mass.par_chunks_exact_mut(m_blocks.max(1)))
                .enumerate()
                .for_each(|(s, (out, mass))| {
                    let r = seq_items[s].clone();
                    let (its, ps, sts) = (&items[r.clone()], &part_refs[r.clone()], &stat_refs[r]);
                    k.enter(|| finish(k, c, its, ps, sts, out, mass));
                });
        });
    } else {
        let mut sc = Scratch::new(c);
        for ((&it, part), st) in items
            .iter()
            .zip(parts.chunks_exact_mut(part_len))
            .zip(split_mut(&mut stats, stat_lens()))
        {
            k.enter(|| run_item(k, c, it, &mut sc, part, st));
        }
        let part_refs: Vec<&[f32]> = parts.chunks_exact(part_len).collect();
        let stat_refs: Vec<&[f32]> = split_ref(&stats, stat_lens());
        for (s, (out, mass)) in outputs
            .out
            .chunks_exact_mut(out_len)
            .zip(outputs.mass.chunks_exact_mut(m_blocks.max(1)))
            .enumerate()
        {
            let r = seq_items[s].clone();
            let (its, ps, sts) = (&items[r.clone()], &part_refs[r.clone()], &stat_refs[r]);
            k.enter(|| finish(k, c, its, ps, sts, out, mass));
        }
    }
}

/// Splits `buf` into consecutive pieces of `sizes`.
fn split_ref(mut buf: &[f32], sizes: impl Iterator<Item = usize>) -> Vec<&[f32]> {
    let mut out = Vec::new();
    for size in sizes {
        let (piece, rest) = buf.split_at(size);
        out.push(piece);
        buf = rest;
    }
    out
}
