//! The inner loops, one block tile at a time, behind one trait with two implementations: the
//! portable [`Scalar`] and, on x86-64 CPUs with AVX2, FMA and F16C (checked at run time), the
//! explicit-intrinsics [`avx2::Avx2`]. The driver (`crate::driver`) is generic over the trait,
//! so each instruction set gets its own copy of it; each method handles a whole tile, so the
//! call into a `#[target_feature]` function costs once per block, not once per value.
//!
//! Every method checks the slice lengths it was given (`assert!`): the SIMD code reads and
//! writes through pointers only inside them.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

use crate::half::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::layout::FloatDtype;

/// Asks the CPU to bring every 64-byte line of `bytes` into its caches, and returns at once:
/// a block read from DRAM then overlaps the work on the block before it (blocks lie in rows
/// ~1 MB apart, in any order, where no hardware prefetcher can guess the next one). A no-op
/// off x86-64.
#[inline(always)]
pub(crate) fn prefetch(bytes: &[u8]) {
    prefetch_into::<TO_L1>(bytes);
}

/// `_MM_HINT_T0`: every cache level.
pub(crate) const TO_L1: i32 = 3;
/// `_MM_HINT_T1`: L2 and below, not L1 (a big tile fetched ahead crowds the current one out
/// of L1, not of L2).
pub(crate) const TO_L2: i32 = 2;

/// [`prefetch`] into the cache levels `HINT` names ([`TO_L1`], [`TO_L2`]).
#[inline(always)]
pub(crate) fn prefetch_into<const HINT: i32>(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::_mm_prefetch;
        const LINE: usize = 64;
        let p = bytes.as_ptr().cast::<i8>();
        let last = bytes.len().saturating_sub(1);
        // every line from the first byte's to the last byte's
        let lines = (p as usize + last) / LINE - p as usize / LINE + usize::from(!bytes.is_empty());
        for i in 0..lines {
            // SAFETY: a prefetch only hints the cache; it never faults, even where the address
            // is not mapped (here each lies in the line of a byte of `bytes`)
            unsafe { _mm_prefetch::<HINT>(p.wrapping_add(i * LINE)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// How the elements of a byte slice encode numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Encoding {
    F32,
    F16,
    Bf16,
    /// int8 two's complement
    I8,
    U8,
    /// two 4-bit codes a byte, the even element in the low nibble, two's complement
    I4,
    U4,
    /// four 2-bit codes a byte, element `4i + j` in bits `2j..2j + 2` of byte `i`, two's
    /// complement
    I2,
    U2,
}

impl Encoding {
    pub fn of_float(dtype: FloatDtype) -> Self {
        match dtype {
            FloatDtype::F32 => Self::F32,
            FloatDtype::F16 => Self::F16,
            FloatDtype::Bf16 => Self::Bf16,
        }
    }

    /// The codes of a quantized pool of `bits` (2, 4 or 8: what `PoolDesc` accepts), unsigned
    /// when `asymmetric`.
    pub fn of_codes(bits: u8, asymmetric: bool) -> Self {
        debug_assert!(matches!(bits, 2 | 4 | 8), "bits {bits}");
        match (bits, asymmetric) {
            (8, false) => Self::I8,
            (8, true) => Self::U8,
            (4, false) => Self::I4,
            (4, true) => Self::U4,
            (_, false) => Self::I2,
            (_, true) => Self::U2,
        }
    }

    /// Codes of fewer bits than a byte: `(bits, signed)`; element `i` lies in bits
    /// `bits * (i % per_byte)..` of byte `i / per_byte`, low bits first.
    pub const fn packed(self) -> Option<(u32, bool)> {
        match self {
            Self::I4 => Some((4, true)),
            Self::U4 => Some((4, false)),
            Self::I2 => Some((2, true)),
            Self::U2 => Some((2, false)),
            _ => None,
        }
    }

    /// Bytes holding `n` elements.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            Self::F32 => 4 * n,
            Self::F16 | Self::Bf16 => 2 * n,
            Self::I8 | Self::U8 => n,
            Self::I4 | Self::U4 | Self::I2 | Self::U2 => n.div_ceil(self.per_byte()),
        }
    }

    /// Elements that share one byte (1 for whole-byte encodings).
    pub fn per_byte(self) -> usize {
        self.packed().map_or(1, |(bits, _)| (8 / bits) as usize)
    }
}

/// The code in the low `bits` bits of `raw` as a number: two's complement when `signed`.
#[inline(always)]
fn packed_code(raw: u8, bits: u32, signed: bool) -> f32 {
    if signed {
        let sign = 1i8 << (bits - 1);
        f32::from((raw as i8 ^ sign) - sign)
    } else {
        f32::from(raw)
    }
}

/// The sizes of one tile product: `rows` rows against `n` tokens of `d` values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TileDims {
    pub d: usize,
    pub rows: usize,
    pub n: usize,
}

pub(crate) trait Kernels: Copy + Send + Sync {
    /// Runs `f` compiled for this instruction set: the driver's own loops, inlined into `f`,
    /// are vectorized for it too (the portable loops: as they are).
    fn enter<R>(self, f: impl FnOnce() -> R) -> R {
        f()
    }

    /// `out[r * n + t] = q[r] . k[t]` for `r < rows`, `t < n` (rows of `q` and `k` are `d`).
    fn scores(self, q: &[f32], k: &[f32], dims: TileDims, out: &mut [f32]);

    /// `acc[r] = alpha[r] * acc[r] + sum over t of w[r * n + t] * v[t]` for `r < rows` (rows
    /// of `v` and `acc`: `d`).
    fn accumulate(self, w: &[f32], v: &[f32], dims: TileDims, alpha: &[f32], acc: &mut [f32]);

    /// [`Kernels::scores`] against `n` rows of `d` elements of `src` in encoding `enc` (a
    /// block's K tile as it lies in its pool: any alignment). `tile` (`n * d` floats) is
    /// scratch the implementation may widen `src` into.
    fn scores_enc(
        self,
        q: &[f32],
        src: &[u8],
        enc: Encoding,
        dims: TileDims,
        tile: &mut [f32],
        out: &mut [f32],
    ) {
        let k = widened(self, src, enc, &mut tile[..dims.n * dims.d]);
        self.scores(q, k, dims, out);
    }

    /// [`Kernels::accumulate`] of `n` rows of `d` elements of `src` in encoding `enc` (a
    /// block's V tile as it lies in its pool); `tile` as for [`Kernels::scores_enc`].
    #[allow(clippy::too_many_arguments)]
    fn accumulate_enc(
        self,
        w: &[f32],
        src: &[u8],
        enc: Encoding,
        dims: TileDims,
        alpha: &[f32],
        tile: &mut [f32],
        acc: &mut [f32],
    ) {
        let v = widened(self, src, enc, &mut tile[..dims.n * dims.d]);
        self.accumulate(w, v, dims, alpha, acc);
    }

    /// [`Kernels::accumulate_enc`] of values grouped per token along `d` (`group` values a
    /// group, `d / group` groups a token), each group with weights of its own:
    /// `acc[r][cols of g] = alpha[r] * acc[r][cols of g] + sum over t of w[(g * rows + r) * n +
    /// t] * v[t][cols of g]` (the group's scale folded into `w`, so no pass rescales the codes).
    #[allow(clippy::too_many_arguments)]
    fn accumulate_groups_enc(
        self,
        w: &[f32],
        src: &[u8],
        enc: Encoding,
        dims: TileDims,
        group: usize,
        alpha: &[f32],
        tile: &mut [f32],
        acc: &mut [f32],
    ) {
        let TileDims { d, rows, n } = dims;
        let v = widened(self, src, enc, &mut tile[..n * d]);
        for (r, (acc, &a)) in acc[..rows * d]
            .chunks_exact_mut(d)
            .zip(&alpha[..rows])
            .enumerate()
        {
            if a != 1.0 {
                acc.iter_mut().for_each(|x| *x *= a);
            }
            for (g, cols) in acc.chunks_exact_mut(group).enumerate() {
                for (t, &p) in w[(g * rows + r) * n..][..n].iter().enumerate() {
                    for (x, y) in cols.iter_mut().zip(&v[t * d + g * group..][..group]) {
                        *x += p * y;
                    }
                }
            }
        }
    }

    /// One block of the online softmax for each row of `s` (`n` scores each): with `mb` the
    /// row's maximum, `m[r]` becomes `max(m[r], mb)`, the row `exp(s - m[r])` (0 below -87),
    /// `lb[r]` its sum, `alpha[r]` = `exp(m_old - m[r])` (0 from -inf), `l[r] = l[r] * alpha[r]
    /// + lb[r]`. A row that is all -inf becomes zeros with `alpha` 1 and `lb` 0.
    fn softmax(
        self,
        s: &mut [f32],
        n: usize,
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        lb: &mut [f32],
    );

    /// `x[i] *= a`.
    fn scale(self, x: &mut [f32], a: f32);

    /// For each row `r` of `q` (rows of `s.len()`): `out[r] = q[r] * s` elementwise and, with
    /// `z`, `dots[r] = q[r] . z` (per-channel key scales and zero points: `q . (code * s + z)
    /// = (q * s) . code + q . z`).
    fn scale_rows(self, q: &[f32], s: &[f32], z: Option<&[f32]>, out: &mut [f32], dots: &mut [f32]);

    /// `out[r] += x[r] . y` for each row `r` of `x` (rows of `y.len()`).
    fn add_dots(self, x: &[f32], y: &[f32], out: &mut [f32]);

    /// `dst[i]` = element `i` of `src` (`dst.len()` elements).
    fn widen(self, src: &[u8], enc: Encoding, dst: &mut [f32]);

    /// `dst` = `src` narrowed to `dtype`, rounding to nearest even.
    fn narrow(self, src: &[f32], dtype: FloatDtype, dst: &mut [u8]);

    /// Dequantizes rows of `d` values grouped per token, in place: value `i` of row `t` is
    /// `x * s[t * (d / group) + i / group] (+ z[...])`.
    fn affine_tokens(self, x: &mut [f32], d: usize, group: usize, s: &[f32], z: Option<&[f32]>);
}

/// `src`'s elements as f32: in place when they are fp32 and 4-aligned (on a little-endian CPU),
/// else widened into `tile`.
fn widened<'t, K: Kernels>(k: K, src: &'t [u8], enc: Encoding, tile: &'t mut [f32]) -> &'t [f32] {
    if enc == Encoding::F32 && cfg!(target_endian = "little") {
        // SAFETY: every 4-byte pattern is a valid f32; align_to hands back only the aligned
        // middle.
        let (head, mid, _) = unsafe { src.align_to::<f32>() };
        if head.is_empty() && mid.len() >= tile.len() {
            return &mid[..tile.len()];
        }
    }
    k.widen(src, enc, tile);
    tile
}

/// `exp(m_old - m_new)`: what an accumulator kept against `m_old` is scaled by (0 from -inf).
#[inline]
pub(crate) fn old_scale(m_old: f32, m_new: f32) -> f32 {
    if m_old == m_new {
        1.0
    } else if m_old == f32::NEG_INFINITY {
        0.0
    } else {
        (m_old - m_new).exp()
    }
}

/// The portable implementation: plain loops (which the compiler vectorizes where it can).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

impl Kernels for Scalar {
    fn scores(self, q: &[f32], k: &[f32], dims: TileDims, out: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        let (q, k, out) = (&q[..rows * d], &k[..n * d], &mut out[..rows * n]);
        for (qr, out) in q.chunks_exact(d).zip(out.chunks_exact_mut(n)) {
            for (kt, o) in k.chunks_exact(d).zip(out.iter_mut()) {
                *o = qr.iter().zip(kt).map(|(a, b)| a * b).sum();
            }
        }
    }

    fn accumulate(self, w: &[f32], v: &[f32], dims: TileDims, alpha: &[f32], acc: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        let (w, v, acc) = (&w[..rows * n], &v[..n * d], &mut acc[..rows * d]);
        for ((wr, acc), &a) in w
            .chunks_exact(n)
            .zip(acc.chunks_exact_mut(d))
            .zip(&alpha[..rows])
        {
            if a != 1.0 {
                acc.iter_mut().for_each(|x| *x *= a);
            }
            for (&p, vt) in wr.iter().zip(v.chunks_exact(d)) {
                for (x, y) in acc.iter_mut().zip(vt) {
                    *x += p * y;
                }
            }
        }
    }

    fn softmax(
        self,
        s: &mut [f32],
        n: usize,
        m: &mut [f32],
        l: &mut [f32],
        alpha: &mut [f32],
        lb: &mut [f32],
    ) {
        for (r, row) in s.chunks_exact_mut(n).enumerate() {
            let mb = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if mb == f32::NEG_INFINITY {
                row.fill(0.0);
                (alpha[r], lb[r]) = (1.0, 0.0);
                continue;
            }
            let m_new = m[r].max(mb);
            alpha[r] = old_scale(m[r], m_new);
            let mut sum = 0.0;
            for v in row.iter_mut() {
                let e = *v - m_new;
                *v = if e < -87.0 { 0.0 } else { e.exp() };
                sum += *v;
            }
            lb[r] = sum;
            l[r] = l[r] * alpha[r] + sum;
            m[r] = m_new;
        }
    }

    fn scale(self, x: &mut [f32], a: f32) {
        for v in x {
            *v *= a;
        }
    }

    fn scale_rows(
        self,
        q: &[f32],
        s: &[f32],
        z: Option<&[f32]>,
        out: &mut [f32],
        dots: &mut [f32],
    ) {
        let d = s.len();
        for (r, (o, q)) in out.chunks_exact_mut(d).zip(q.chunks_exact(d)).enumerate() {
            for ((o, &x), &sc) in o.iter_mut().zip(q).zip(s) {
                *o = x * sc;
            }
            if let Some(z) = z {
                dots[r] = q.iter().zip(z).map(|(a, b)| a * b).sum();
            }
        }
    }

    fn add_dots(self, x: &[f32], y: &[f32], out: &mut [f32]) {
        for (o, x) in out.iter_mut().zip(x.chunks_exact(y.len())) {
            *o += x.iter().zip(y).map(|(a, b)| a * b).sum::<f32>();
        }
    }

    fn widen(self, src: &[u8], enc: Encoding, dst: &mut [f32]) {
        let src = &src[..enc.bytes(dst.len())];
        match enc {
            Encoding::F32 => {
                for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Encoding::F16 => {
                for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            Encoding::Bf16 => {
                for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            Encoding::I8 => {
                for (o, &b) in dst.iter_mut().zip(src) {
                    *o = f32::from(b as i8);
                }
            }
            Encoding::U8 => {
                for (o, &b) in dst.iter_mut().zip(src) {
                    *o = f32::from(b);
                }
            }
            Encoding::I4 | Encoding::U4 | Encoding::I2 | Encoding::U2 => {
                let Some((bits, signed)) = enc.packed() else {
                    unreachable!("{enc:?} is packed")
                };
                let (per, mask) = (enc.per_byte(), (1u8 << bits) - 1);
                for (i, o) in dst.iter_mut().enumerate() {
                    let raw = (src[i / per] >> (bits as usize * (i % per))) & mask;
                    *o = packed_code(raw, bits, signed);
                }
            }
        }
    }

    fn narrow(self, src: &[f32], dtype: FloatDtype, dst: &mut [u8]) {
        let dst = &mut dst[..dtype.size() * src.len()];
        match dtype {
            FloatDtype::F32 => {
                for (o, v) in dst.chunks_exact_mut(4).zip(src) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            FloatDtype::F16 => {
                for (o, &v) in dst.chunks_exact_mut(2).zip(src) {
                    o.copy_from_slice(&f32_to_f16(v).to_le_bytes());
                }
            }
            FloatDtype::Bf16 => {
                for (o, &v) in dst.chunks_exact_mut(2).zip(src) {
                    o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
                }
            }
        }
    }

    fn affine_tokens(self, x: &mut [f32], d: usize, group: usize, s: &[f32], z: Option<&[f32]>) {
        let groups = x.len() / group;
        let s = &s[..groups];
        let z = z.map(|z| &z[..groups]);
        debug_assert_eq!(d % group, 0);
        for (g, vals) in x.chunks_exact_mut(group).enumerate() {
            let (sg, zg) = (s[g], z.map_or(0.0, |z| z[g]));
            for v in vals {
                *v = *v * sg + zg;
            }
        }
    }
}
