//! The quantized codecs on the CPU: float blocks quantized into packed rows, packed rows
//! dequantized into float blocks (every layer, or a run of layers), packed rows of one format
//! transcoded into another — byte for byte what the torch reference
//! (python/kvtier/codecs/quant.py) and the CUDA kernels (kernels/kvtier_codecs.cu) write: the
//! same codes, the same fp16 scale and zero-point bytes, the same decoded values. The formats are
//! those [`QuantFormat`] describes (what attention reads); a caller hands them over as the 10
//! int64s of python/kvtier/codecs/layout.py ([`PackedFormat::from_layout`]).
//!
//! The rounding rule, every step one IEEE fp32 operation (Rust never contracts a multiply and an
//! add into an FMA, whatever the target features):
//! - per group, its minimum and maximum, compared as integers of the same order ([`key`]): exact,
//!   so the reduction order cannot matter, and -0 sorts below +0;
//! - symmetric: `s = fp16(max(|min|, |max|) * fp32(1/qmax))`, `q = rint(x / s')` in
//!   `[-qmax, qmax]`; asymmetric: `s = fp16((max - min) * fp32(1/levels))`, `z = fp16(min)`,
//!   `q = rint((x - z) / s')` in `[0, levels]`; `s' = s` where `s > 0`, else 1; `fp16()` clamps
//!   to ±65504, then rounds to nearest even;
//! - `rint` then clamp equals clamp then `rint` (the bounds are integers), and for `|v| <= 255`,
//!   `v + 1.5 * 2^23` rounds `v` to an integer, ties to even, into the sum's low mantissa bits:
//!   each code is a division, two comparisons and one add, in loops the compiler vectorizes;
//! - decoding: `q * s`, then `+ z` when asymmetric; into fp16 saturating at ±65504 (as
//!   `saturate_to` in python/kvtier/codecs/base.py), bf16 rounded to nearest even, fp32 as it is.
//!
//! Where torch may differ: a group whose minimum (or maximum) is a zero and that holds both +0
//! and -0 — torch's `amin` returns whichever zero its reduction order meets last (it differs
//! between CPUs); here the minimum is -0 and the maximum +0, so only the sign of a zero point or
//! of a decoded zero can differ. NaN is outside the contract (pools never hold one: appends
//! refuse non-finite K/V).
//!
//! Every call checks its whole input first (the format against the block dimensions and the row
//! size, every buffer's length), so an `Err` means nothing was written. Work items are one
//! (block, layer) each: every section of a row is layer-major, so an item reads and writes bytes
//! no other item touches; an item converts one (K/V, head) tile at a time through an fp32
//! scratch tile. Calls with enough work run their items on rayon's pool.

use std::ops::Range;

use rayon::prelude::*;

use crate::driver::on_pool;
use crate::error::{invalid, Result};
use crate::kernels::{Encoding, Kernels, Scalar};
use crate::layout::{FloatDtype, QuantFormat};
use crate::rotation::{check_signs, rotate_scaled, unrotate};
use crate::{Exec, Isa};

/// The int64s of a packed format: `bits, asymmetric, key_per_channel, group, codes, k_scale,
/// k_zero, v_scale, v_zero, row_bytes, rotated` (python/kvtier/codecs/layout.py, `layout`).
pub const LAYOUT_LEN: usize = 11;

/// Below this many values a call runs on the calling thread: waking a pool costs more.
const PARALLEL_MIN_VALUES: usize = 1 << 16;

const FP16_MAX: f32 = 65504.0;
/// `1.5 * 2^23`: added to a value of magnitude at most `2^22`, it leaves the value rounded to an
/// integer (ties to even) in the sum's low mantissa bits.
const ROUNDER: f32 = 12_582_912.0;

/// The sizes of one block: `[layers, 2, heads, block, dim]` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockDims {
    pub layers: usize,
    pub heads: usize,
    pub block: usize,
    pub dim: usize,
}

/// A packed row: its sections and grouping, and its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedFormat {
    pub format: QuantFormat,
    pub row_bytes: usize,
}

impl PackedFormat {
    /// Parses the [`LAYOUT_LEN`] int64s of a layout.
    pub fn from_layout(fields: &[i64]) -> Result<Self> {
        let bad = |reason: String| invalid("layout", reason);
        if fields.len() != LAYOUT_LEN {
            return Err(bad(format!(
                "expected {LAYOUT_LEN} int64s, got {}",
                fields.len()
            )));
        }
        let bits = match fields[0] {
            2 => 2,
            4 => 4,
            8 => 8,
            b => return Err(bad(format!("bits: expected 2, 4 or 8, got {b}"))),
        };
        let flag = |i: usize, name: &str| match fields[i] {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(bad(format!("{name}: expected 0 or 1, got {v}"))),
        };
        let asymmetric = flag(1, "asymmetric")?;
        let key_per_channel = flag(2, "key_per_channel")?;
        let rotated = flag(10, "rotated")?;
        let size = |i: usize, name: &str| {
            usize::try_from(fields[i])
                .map_err(|_| bad(format!("{name}: expected >= 0, got {}", fields[i])))
        };
        let zero = |i: usize, name: &str| if asymmetric { size(i, name) } else { Ok(0) };
        Ok(Self {
            format: QuantFormat {
                bits,
                asymmetric,
                key_per_channel,
                rotated,
                group: size(3, "group")?,
                codes: size(4, "codes offset")?,
                k_scale: size(5, "k_scale offset")?,
                k_zero: zero(6, "k_zero offset")?,
                v_scale: size(7, "v_scale offset")?,
                v_zero: zero(8, "v_zero offset")?,
            },
            row_bytes: size(9, "row_bytes")?,
        })
    }
}

/// Runs `$body` with `$k` the kernels `$isa` asks for (a `Result`).
macro_rules! with_isa {
    ($isa:expr, $k:ident => $body:expr) => {{
        match $isa {
            Isa::Scalar => {
                let $k = Scalar;
                $body;
                Ok(())
            }
            Isa::Auto | Isa::Avx2 => {
                #[cfg(target_arch = "x86_64")]
                if let Some($k) = crate::kernels::avx2::Avx2::detect() {
                    $body;
                    return Ok(());
                }
                if $isa == Isa::Avx2 {
                    return Err(invalid("isa", "this CPU lacks AVX2, FMA or F16C"));
                }
                let $k = Scalar;
                $body;
                Ok(())
            }
        }
    }};
}

/// Quantizes float blocks into packed rows: `src[i]` is one block (`[layers, 2, heads, block,
/// dim]` values of `dtype`, little-endian, any alignment), `dst[i]` its row of `to`.
pub fn quantize(
    dims: BlockDims,
    dtype: FloatDtype,
    to: &PackedFormat,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    rotation: &[f32],
    exec: Exec,
) -> Result<()> {
    let g = Geometry::new(dims, to, rotation, "dst")?;
    let layer_bytes = g.layer_values() * dtype.size();
    check_lens(
        "src",
        src.iter().map(|s| s.len()),
        layer_bytes * dims.layers,
    )?;
    check_rows("dst", src.len(), dst, g.row_bytes)?;
    let mut items = Vec::with_capacity(src.len() * dims.layers);
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        for (layer, out) in s.chunks_exact(layer_bytes).zip(g.split(d)) {
            items.push((layer, out));
        }
    }
    with_isa!(exec.isa, k => run(k, exec.threads, &g, &g, items, |k, sc, (src, mut out)| {
        quantize_layer(k, &g, dtype, src, &mut out, sc);
    }))
}

/// Dequantizes layers `layers` of packed rows into float blocks: `src[i]` a row of `from`,
/// `dst[i]` the block of those layers (`[layers.len(), 2, heads, block, dim]` values of
/// `dtype`).
#[allow(clippy::too_many_arguments)]
pub fn dequantize(
    dims: BlockDims,
    from: &PackedFormat,
    layers: Range<usize>,
    src: &[&[u8]],
    dtype: FloatDtype,
    dst: &mut [&mut [u8]],
    rotation: &[f32],
    exec: Exec,
) -> Result<()> {
    let g = Geometry::new(dims, from, rotation, "src")?;
    if layers.start > layers.end || layers.end > dims.layers {
        return Err(invalid(
            "layers",
            format!(
                "expected a run of the block's {} layers, got {}..{}",
                dims.layers, layers.start, layers.end
            ),
        ));
    }
    check_lens("src", src.iter().map(|s| s.len()), g.row_bytes)?;
    let layer_bytes = g.layer_values() * dtype.size();
    check_rows("dst", src.len(), dst, layer_bytes * layers.len())?;
    if layers.is_empty() {
        return Ok(());
    }
    let mut items = Vec::with_capacity(src.len() * layers.len());
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        for (l, out) in layers.clone().zip(d.chunks_exact_mut(layer_bytes)) {
            items.push((g.layer(s, l), out));
        }
    }
    with_isa!(exec.isa, k => run(k, exec.threads, &g, &g, items, |k, sc, (src, out)| {
        dequantize_layer(k, &g, &src, dtype, out, sc);
    }))
}

/// Repacks rows of `from` as rows of `to` (blocks of `dims`), the values between the two fp32
/// (never rounded to a model dtype), as the reference's decode-then-encode does.
pub fn transcode(
    dims: BlockDims,
    from: &PackedFormat,
    to: &PackedFormat,
    src: &[&[u8]],
    dst: &mut [&mut [u8]],
    rotation: &[f32],
    exec: Exec,
) -> Result<()> {
    let a = Geometry::new(dims, from, rotation, "src")?;
    let b = Geometry::new(dims, to, rotation, "dst")?;
    check_lens("src", src.iter().map(|s| s.len()), a.row_bytes)?;
    check_rows("dst", src.len(), dst, b.row_bytes)?;
    let mut items = Vec::with_capacity(src.len() * dims.layers);
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        for (l, out) in b.split(d).into_iter().enumerate() {
            items.push((a.layer(s, l), out));
        }
    }
    with_isa!(exec.isa, k => run(k, exec.threads, &a, &b, items, |k, sc, (src, mut out)| {
        for t in 0..2 * dims.heads {
            let x = &mut sc.x;
            dequantize_tile(k, &a, &src, t, x, &mut sc.w);
            b.rotate(x);
            quantize_tile(k, &b, t, x, &mut out, &mut sc.w);
        }
    }))
}

fn check_lens(what: &'static str, lens: impl Iterator<Item = usize>, want: usize) -> Result<()> {
    for (i, len) in lens.enumerate() {
        if len != want {
            return Err(invalid(
                what,
                format!("expected {want} bytes a row, row {i} has {len}"),
            ));
        }
    }
    Ok(())
}

fn check_rows(what: &'static str, n: usize, rows: &[&mut [u8]], want: usize) -> Result<()> {
    if rows.len() != n {
        return Err(invalid(
            what,
            format!("expected {n} rows (one per source row), got {}", rows.len()),
        ));
    }
    check_lens(what, rows.iter().map(|r| r.len()), want)
}

// ---- a checked format ---------------------------------------------------------------------------

/// A packed format checked against block dimensions: the byte range of every section's layer.
#[derive(Clone, Copy, Debug)]
struct Geometry<'r> {
    f: QuantFormat,
    /// a rotated format's signs (see [`crate::rotation`])
    signs: Option<&'r [f32]>,
    row_bytes: usize,
    heads: usize,
    dim: usize,
    layers: usize,
    /// values of one (layer, K/V, head) tile: `block * dim`
    tile: usize,
    /// code bytes of one tile
    code_tile: usize,
    /// groups of a key tile and of a value tile
    groups: [usize; 2],
    /// codes, k_scale, k_zero, v_scale, v_zero: (offset, bytes of one layer); zero points of
    /// a symmetric format have no bytes
    sections: [(usize, usize); 5],
}

const CODES: usize = 0;
const SCALE: [usize; 2] = [1, 3];
const ZERO: [usize; 2] = [2, 4];
const NAMES: [&str; 5] = ["codes", "k_scale", "k_zero", "v_scale", "v_zero"];

impl<'r> Geometry<'r> {
    fn new(
        dims: BlockDims,
        p: &PackedFormat,
        rotation: &'r [f32],
        what: &'static str,
    ) -> Result<Self> {
        let BlockDims {
            layers,
            heads,
            block,
            dim,
        } = dims;
        for (name, v) in [
            ("layers", layers),
            ("heads", heads),
            ("block", block),
            ("dim", dim),
        ] {
            if v == 0 {
                return Err(invalid("dims", format!("{name}: expected a positive size")));
            }
        }
        let f = p.format;
        f.check_dim(dim).map_err(|r| invalid(what, r))?;
        let overflow = || invalid(what, "the row's size overflows");
        let m = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let tile = m(block, dim)?;
        let code_tile = tile / f.per_byte();
        let (k_groups, v_groups) = f.groups(block, dim);
        let k_bytes = m(m(heads, k_groups)?, 2)?;
        let v_bytes = m(m(heads, v_groups)?, 2)?;
        let zero = |bytes: usize| if f.asymmetric { bytes } else { 0 };
        let sections = [
            (f.codes, m(m(2, heads)?, code_tile)?),
            (f.k_scale, k_bytes),
            (f.k_zero, zero(k_bytes)),
            (f.v_scale, v_bytes),
            (f.v_zero, zero(v_bytes)),
        ];
        let mut spans = Vec::with_capacity(5);
        for (i, &(at, per_layer)) in sections.iter().enumerate() {
            if per_layer == 0 {
                continue;
            }
            let end = at.checked_add(m(per_layer, layers)?).ok_or_else(overflow)?;
            if end > p.row_bytes {
                return Err(invalid(
                    what,
                    format!(
                        "{}: bytes {at}..{end} lie past the row's {} bytes",
                        NAMES[i], p.row_bytes
                    ),
                ));
            }
            spans.push((at, end, i));
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(invalid(
                    what,
                    format!(
                        "sections {} and {} overlap",
                        NAMES[pair[0].2], NAMES[pair[1].2]
                    ),
                ));
            }
        }
        let signs = if f.rotated {
            check_signs(rotation, dim).map_err(|r| invalid("rotation", r))?;
            Some(rotation)
        } else {
            None
        };
        Ok(Self {
            f,
            signs,
            row_bytes: p.row_bytes,
            heads,
            dim,
            layers,
            tile,
            code_tile,
            groups: [k_groups, v_groups],
            sections,
        })
    }

    /// A tile's values as a rotated format stores them (each row `x @ H / D`), if it is one.
    fn rotate(&self, x: &mut [f32]) {
        if let Some(signs) = self.signs {
            let over_d = 1.0 / self.dim as f32;
            for row in x.chunks_exact_mut(self.dim) {
                rotate_scaled(row, signs, over_d);
            }
        }
    }

    /// A rotated format's decoded tile turned back (each row `y @ H^T`), clamped to fp16's
    /// range as the reference's decode clamps it and its zeros +0 (as the rotation leaves
    /// them: a transcode's groups then have one minimum), if it is one.
    fn unrotate(&self, x: &mut [f32]) {
        if let Some(signs) = self.signs {
            for row in x.chunks_exact_mut(self.dim) {
                unrotate(row, signs);
            }
            x.iter_mut()
                .for_each(|v| *v = v.clamp(-FP16_MAX, FP16_MAX) + 0.0);
        }
    }

    /// Values of one layer of a block: `2 * heads * block * dim`.
    fn layer_values(&self) -> usize {
        2 * self.heads * self.tile
    }

    /// Whether tile `t` (`kv * heads + head`) is grouped per channel.
    fn per_channel(&self, t: usize) -> bool {
        t < self.heads && self.f.key_per_channel
    }

    /// Layer `l`'s sections of `row` (a checked row: `row_bytes` long).
    fn layer<'a>(&self, row: &'a [u8], l: usize) -> Sections<&'a [u8]> {
        let at = |i: usize| {
            let (off, per_layer) = self.sections[i];
            &row[off + l * per_layer..][..per_layer]
        };
        Sections {
            codes: at(CODES),
            scale: SCALE.map(at),
            zero: ZERO.map(at),
        }
    }

    /// Every layer's sections of `row`, for writing (disjoint: checked by [`Geometry::new`]).
    fn split<'a>(&self, row: &'a mut [u8]) -> Vec<Sections<&'a mut [u8]>> {
        let mut order: Vec<usize> = (0..5).filter(|&i| self.sections[i].1 > 0).collect();
        order.sort_unstable_by_key(|&i| self.sections[i].0);
        let mut pieces: [std::vec::IntoIter<&'a mut [u8]>; 5] = Default::default();
        let (mut rest, mut at) = (row, 0);
        for i in order {
            let (off, per_layer) = self.sections[i];
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
            let (section, tail) = tail.split_at_mut(per_layer * self.layers);
            pieces[i] = section
                .chunks_exact_mut(per_layer)
                .collect::<Vec<_>>()
                .into_iter();
            (rest, at) = (tail, off + per_layer * self.layers);
        }
        let mut next = |i: usize| pieces[i].next().unwrap_or_default();
        (0..self.layers)
            .map(|_| Sections {
                codes: next(CODES),
                scale: [next(SCALE[0]), next(SCALE[1])],
                zero: [next(ZERO[0]), next(ZERO[1])],
            })
            .collect()
    }
}

/// One layer's sections of a row: codes, then K's and V's scales and zero points (empty when
/// symmetric).
#[derive(Debug)]
struct Sections<T> {
    codes: T,
    scale: [T; 2],
    zero: [T; 2],
}

/// Bytes `[t * len, (t + 1) * len)` of `s`, or `s` itself when it is empty.
#[inline]
fn part(s: &[u8], t: usize, len: usize) -> &[u8] {
    if s.is_empty() {
        s
    } else {
        &s[t * len..][..len]
    }
}

#[inline]
fn part_mut(s: &mut [u8], t: usize, len: usize) -> &mut [u8] {
    if s.is_empty() {
        s
    } else {
        &mut s[t * len..][..len]
    }
}

// ---- running the items ------------------------------------------------------------------------

/// A thread's scratch: a tile of values and what its groups need.
struct Scratch {
    x: Vec<f32>,
    w: Work,
}

struct Work {
    /// per group: `s'` (quantizing) or `s` (dequantizing), and `z`
    s: Vec<f32>,
    z: Vec<f32>,
    /// per group: the order keys of its minimum and maximum
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// a tile's codes, one a byte, before packing
    q: Vec<u8>,
}

impl Scratch {
    fn new(a: &Geometry<'_>, b: &Geometry) -> Self {
        let groups = a.groups.into_iter().chain(b.groups).max().unwrap_or(0);
        Self {
            x: vec![0.0; a.tile],
            w: Work {
                s: vec![0.0; groups],
                z: vec![0.0; groups],
                lo: vec![0; groups],
                hi: vec![0; groups],
                q: vec![0; a.tile],
            },
        }
    }
}

/// Runs `f` on every item, on the pool when there is enough work (`a` and `b`: the formats read
/// and written, which size the scratch).
fn run<K: Kernels, T: Send>(
    k: K,
    threads: usize,
    a: &Geometry<'_>,
    b: &Geometry<'_>,
    items: Vec<T>,
    f: impl Fn(K, &mut Scratch, T) + Sync + Send,
) {
    let threads_n = if threads == 0 {
        rayon::current_num_threads()
    } else {
        threads
    };
    let values = items.len().saturating_mul(a.layer_values());
    if threads_n > 1 && items.len() > 1 && values >= PARALLEL_MIN_VALUES {
        on_pool(threads, || {
            items
                .into_par_iter()
                .for_each_init(|| Scratch::new(a, b), |sc, item| k.enter(|| f(k, sc, item)));
        });
    } else {
        let mut sc = Scratch::new(a, b);
        k.enter(|| {
            for item in items {
                f(k, &mut sc, item);
            }
        });
    }
}

// ---- one layer ------------------------------------------------------------------------------

fn quantize_layer<K: Kernels>(
    k: K,
    g: &Geometry<'_>,
    dtype: FloatDtype,
    src: &[u8],
    out: &mut Sections<&mut [u8]>,
    sc: &mut Scratch,
) {
    let enc = Encoding::of_float(dtype);
    let tile_bytes = g.tile * dtype.size();
    for (t, tile) in src.chunks_exact(tile_bytes).enumerate() {
        k.widen(tile, enc, &mut sc.x);
        g.rotate(&mut sc.x);
        quantize_tile(k, g, t, &sc.x, out, &mut sc.w);
    }
}

fn dequantize_layer<K: Kernels>(
    k: K,
    g: &Geometry<'_>,
    src: &Sections<&[u8]>,
    dtype: FloatDtype,
    out: &mut [u8],
    sc: &mut Scratch,
) {
    let tile_bytes = g.tile * dtype.size();
    for (t, out) in out.chunks_exact_mut(tile_bytes).enumerate() {
        dequantize_tile(k, g, src, t, &mut sc.x, &mut sc.w);
        if dtype == FloatDtype::F16 {
            sc.x.iter_mut()
                .for_each(|v| *v = v.clamp(-FP16_MAX, FP16_MAX));
        }
        k.narrow(&sc.x, dtype, out);
    }
}

// ---- one tile -------------------------------------------------------------------------------

/// An f32 as an i32 of the same order (-0 just below +0): the sign bit kept, the other bits of a
/// negative value flipped. Its own inverse.
#[inline(always)]
fn key(x: f32) -> i32 {
    let b = x.to_bits() as i32;
    b ^ (((b >> 31) as u32) >> 1) as i32
}

#[inline(always)]
fn unkey(k: i32) -> f32 {
    f32::from_bits((k ^ (((k >> 31) as u32) >> 1) as i32) as u32)
}

/// `(lo, hi, 1/n)`: the code range and the reciprocal the scale multiplies by, for `bits`
/// (`1/n` an fp32 constant rounded from the exact quotient, as quant.py's `np.float32(1 / n)`).
const fn code_range(bits: u8, asymmetric: bool) -> (f32, f32, f32) {
    match (bits, asymmetric) {
        (8, false) => (-127.0, 127.0, (1.0f64 / 127.0) as f32),
        (4, false) => (-7.0, 7.0, (1.0f64 / 7.0) as f32),
        (_, false) => (-1.0, 1.0, 1.0),
        (8, true) => (0.0, 255.0, (1.0f64 / 255.0) as f32),
        (4, true) => (0.0, 15.0, (1.0f64 / 15.0) as f32),
        (_, true) => (0.0, 3.0, (1.0f64 / 3.0) as f32),
    }
}

/// Quantizes tile `t` (`kv * heads + head`) of a layer, values `x`, into `out`.
fn quantize_tile<K: Kernels>(
    k: K,
    g: &Geometry<'_>,
    t: usize,
    x: &[f32],
    out: &mut Sections<&mut [u8]>,
    w: &mut Work,
) {
    let f = &g.f;
    let kv = t / g.heads;
    let h = t % g.heads;
    let groups = g.groups[kv];
    let per_channel = g.per_channel(t);
    let (lo, hi) = (&mut w.lo[..groups], &mut w.hi[..groups]);
    if per_channel {
        // a group is a channel: min and max down the columns, a row at a time
        for (d, v) in x[..g.dim].iter().enumerate() {
            lo[d] = key(*v);
            hi[d] = key(*v);
        }
        for row in x.chunks_exact(g.dim).skip(1) {
            for ((l, u), v) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
                let k = key(*v);
                *l = (*l).min(k);
                *u = (*u).max(k);
            }
        }
    } else {
        for ((l, u), run) in lo
            .iter_mut()
            .zip(hi.iter_mut())
            .zip(x.chunks_exact(f.group))
        {
            let (mut a, mut b) = (i32::MAX, i32::MIN);
            for v in run {
                let k = key(*v);
                a = a.min(k);
                b = b.max(k);
            }
            (*l, *u) = (a, b);
        }
    }

    // scales and zero points: the fp32 values, clamped to fp16's range, narrowed into the row
    // (to nearest even), then read back as the values the codes divide by
    let (q_lo, q_hi, inv) = code_range(f.bits, f.asymmetric);
    let (s, z) = (&mut w.s[..groups], &mut w.z[..groups]);
    for (((s, z), &l), &u) in s.iter_mut().zip(z.iter_mut()).zip(lo.iter()).zip(hi.iter()) {
        let (mn, mx) = (unkey(l), unkey(u));
        let raw = if f.asymmetric {
            (mx - mn) * inv
        } else {
            mn.abs().max(mx.abs()) * inv
        };
        *s = raw.clamp(-FP16_MAX, FP16_MAX);
        *z = mn.clamp(-FP16_MAX, FP16_MAX);
    }
    let scale = part_mut(out.scale[kv], h, 2 * groups);
    k.narrow(s, FloatDtype::F16, scale);
    k.widen(scale, Encoding::F16, s);
    if f.asymmetric {
        let zero = part_mut(out.zero[kv], h, 2 * groups);
        k.narrow(z, FloatDtype::F16, zero);
        k.widen(zero, Encoding::F16, z);
    }
    for s in s.iter_mut() {
        *s = if *s > 0.0 { *s } else { 1.0 };
    }

    let codes = part_mut(out.codes, t, g.code_tile);
    let q: &mut [u8] = if f.bits == 8 {
        codes
    } else {
        &mut w.q[..g.tile]
    };
    let (s, z) = (&w.s[..groups], &w.z[..groups]);
    match (per_channel, f.asymmetric) {
        (true, true) => code_rows::<true>(x, s, z, q_lo, q_hi, q),
        (true, false) => code_rows::<false>(x, s, z, q_lo, q_hi, q),
        (false, true) => code_groups::<true>(x, f.group, s, z, q_lo, q_hi, q),
        (false, false) => code_groups::<false>(x, f.group, s, z, q_lo, q_hi, q),
    }
    if f.bits != 8 {
        pack(f.bits, &w.q[..g.tile], part_mut(out.codes, t, g.code_tile));
    }
}

/// One code: `rint(v / s)` clamped to `[lo, hi]`, as the low byte of its two's complement.
#[inline(always)]
fn code(v: f32, s: f32, lo: f32, hi: f32) -> u8 {
    let q = v / s;
    let q = if q > hi { hi } else { q };
    let q = if q < lo { lo } else { q };
    (q + ROUNDER).to_bits().wrapping_sub(ROUNDER.to_bits()) as u8
}

/// Codes of rows of values grouped per channel: value `d` of every row by `s[d]` (and `z[d]`).
fn code_rows<const ASYM: bool>(x: &[f32], s: &[f32], z: &[f32], lo: f32, hi: f32, q: &mut [u8]) {
    let dim = s.len();
    for (row, out) in x.chunks_exact(dim).zip(q.chunks_exact_mut(dim)) {
        for (((o, &v), &s), &z) in out.iter_mut().zip(row).zip(s).zip(z) {
            *o = code(if ASYM { v - z } else { v }, s, lo, hi);
        }
    }
}

/// Codes of runs of `group` values, run `i` by `s[i]` (and `z[i]`).
fn code_groups<const ASYM: bool>(
    x: &[f32],
    group: usize,
    s: &[f32],
    z: &[f32],
    lo: f32,
    hi: f32,
    q: &mut [u8],
) {
    for (((run, out), &s), &z) in x
        .chunks_exact(group)
        .zip(q.chunks_exact_mut(group))
        .zip(s)
        .zip(z)
    {
        for (o, &v) in out.iter_mut().zip(run) {
            *o = code(if ASYM { v - z } else { v }, s, lo, hi);
        }
    }
}

/// Packs codes of `bits` (4 or 2), one a byte in `q`, `8 / bits` a byte into `out`, low bits
/// first.
fn pack(bits: u8, q: &[u8], out: &mut [u8]) {
    if bits == 4 {
        for (o, p) in out.iter_mut().zip(q.chunks_exact(2)) {
            *o = (p[0] & 0xf) | (p[1] << 4);
        }
    } else {
        for (o, p) in out.iter_mut().zip(q.chunks_exact(4)) {
            *o = (p[0] & 3) | ((p[1] & 3) << 2) | ((p[2] & 3) << 4) | (p[3] << 6);
        }
    }
}

/// Dequantizes tile `t` (`kv * heads + head`) of layer sections `src` into `x` (fp32).
fn dequantize_tile<K: Kernels>(
    k: K,
    g: &Geometry<'_>,
    src: &Sections<&[u8]>,
    t: usize,
    x: &mut [f32],
    w: &mut Work,
) {
    let f = &g.f;
    let kv = t / g.heads;
    let h = t % g.heads;
    let groups = g.groups[kv];
    let codes = part(src.codes, t, g.code_tile);
    k.widen(codes, Encoding::of_codes(f.bits, f.asymmetric), x);
    let s = &mut w.s[..groups];
    k.widen(part(src.scale[kv], h, 2 * groups), Encoding::F16, s);
    let z = &mut w.z[..groups];
    if f.asymmetric {
        k.widen(part(src.zero[kv], h, 2 * groups), Encoding::F16, z);
    }
    match (g.per_channel(t), f.asymmetric) {
        (true, true) => affine_rows::<true>(x, s, z),
        (true, false) => affine_rows::<false>(x, s, z),
        (false, true) => affine_groups::<true>(x, f.group, s, z),
        (false, false) => affine_groups::<false>(x, f.group, s, z),
    }
    g.unrotate(x);
}

/// `x = x * s[d] (+ z[d])` for value `d` of every row (a multiply, then an add: never fused).
fn affine_rows<const ASYM: bool>(x: &mut [f32], s: &[f32], z: &[f32]) {
    for row in x.chunks_exact_mut(s.len()) {
        for ((v, &s), &z) in row.iter_mut().zip(s).zip(z) {
            let p = *v * s;
            *v = if ASYM { p + z } else { p };
        }
    }
}

/// `x = x * s[i] (+ z[i])` for run `i` of `group` values.
fn affine_groups<const ASYM: bool>(x: &mut [f32], group: usize, s: &[f32], z: &[f32]) {
    for ((run, &s), &z) in x.chunks_exact_mut(group).zip(s).zip(z) {
        for v in run {
            let p = *v * s;
            *v = if ASYM { p + z } else { p };
        }
    }
}

#[cfg(test)]
mod tests;
