//! The AVX2 + FMA + F16C implementation of [`Kernels`], with explicit intrinsics: the score
//! tile a register block of (rows x tokens) dot products reduced by `vhaddps`, the value tile a
//! register block of (rows x 8-float columns), both compiled once per encoding of the block's
//! elements ([`load8`]: fp32 loaded, fp16 widened by `vcvtph2ps`, int8, 4-bit and 2-bit codes
//! turned into f32 eight at a time in registers, each shared by the tile's rows), and an exp of
//! Cephes' polynomial (max relative error ~2 ulp). [`Kernels::enter`] runs the driver's loops
//! compiled with the same features.
//!
//! [`Avx2`] can only be built by [`Avx2::detect`], on a CPU that has the three features: that is
//! what makes the calls into the `#[target_feature]` functions below sound. Each trait method
//! checks its slices' lengths before it hands their pointers on.

use std::arch::x86_64::*;

use super::{old_scale, Encoding, Kernels, Scalar, TileDims};
use crate::layout::FloatDtype;

/// Proof that this CPU has AVX2, FMA and F16C.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2(());

impl Avx2 {
    pub fn detect() -> Option<Self> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Self(()))
    }
}

// ---- loading a tile's elements --------------------------------------------------------------

// The encodings as const parameters: the tile loops below are compiled once per encoding, each
// load of 8 elements a few instructions in registers (no widened copy of the tile).
const E_F32: u8 = 0;
const E_F16: u8 = 1;
const E_BF16: u8 = 2;
const E_I8: u8 = 3;
const E_U8: u8 = 4;
const E_I4: u8 = 5;
const E_U4: u8 = 6;
const E_I2: u8 = 7;
const E_U2: u8 = 8;

/// The encoding an `E_*` constant stands for.
const fn encoding(e: u8) -> Encoding {
    match e {
        E_F32 => Encoding::F32,
        E_F16 => Encoding::F16,
        E_BF16 => Encoding::Bf16,
        E_I8 => Encoding::I8,
        E_U8 => Encoding::U8,
        E_I4 => Encoding::I4,
        E_U4 => Encoding::U4,
        E_I2 => Encoding::I2,
        _ => Encoding::U2,
    }
}

/// Calls `$f::<E>($args)` with `E` the const of the runtime encoding `$enc`.
macro_rules! by_encoding {
    ($enc:expr, $f:ident($($arg:expr),*)) => {
        match $enc {
            Encoding::F32 => $f::<E_F32>($($arg),*),
            Encoding::F16 => $f::<E_F16>($($arg),*),
            Encoding::Bf16 => $f::<E_BF16>($($arg),*),
            Encoding::I8 => $f::<E_I8>($($arg),*),
            Encoding::U8 => $f::<E_U8>($($arg),*),
            Encoding::I4 => $f::<E_I4>($($arg),*),
            Encoding::U4 => $f::<E_U4>($($arg),*),
            Encoding::I2 => $f::<E_I2>($($arg),*),
            Encoding::U2 => $f::<E_U2>($($arg),*),
        }
    };
}

// SAFETY (every `unsafe` block in this impl): `self` exists only where the CPU has the features
// the callees are compiled for, and the asserts bound every pointer access the callees make.
impl Kernels for Avx2 {
    fn enter<R>(self, f: impl FnOnce() -> R) -> R {
        unsafe { enter(f) }
    }

    fn scores(self, q: &[f32], k: &[f32], dims: TileDims, out: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        assert!(q.len() >= rows * d && k.len() >= n * d && out.len() >= rows * n);
        let k = k.as_ptr().cast::<u8>();
        unsafe { scores::<E_F32>(q.as_ptr(), k, d, rows, n, out.as_mut_ptr()) }
    }

    fn scores_enc(
        self,
        q: &[f32],
        k: &[u8],
        enc: Encoding,
        dims: TileDims,
        tile: &mut [f32],
        out: &mut [f32],
    ) {
        let TileDims { d, rows, n } = dims;
        if enc != Encoding::F32 && d % 8 != 0 {
            return Scalar.scores_enc(q, k, enc, dims, tile, out);
        }
        assert!(q.len() >= rows * d && k.len() >= enc.bytes(n * d) && out.len() >= rows * n);
        let (q, k, out) = (q.as_ptr(), k.as_ptr(), out.as_mut_ptr());
        unsafe { by_encoding!(enc, scores(q, k, d, rows, n, out)) }
    }

    fn accumulate(self, w: &[f32], v: &[f32], dims: TileDims, alpha: &[f32], acc: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        assert!(w.len() >= rows * n && v.len() >= n * d && acc.len() >= rows * d);
        assert!(alpha.len() >= rows);
        let (w, v, alpha, acc) = (w.as_ptr(), v.as_ptr(), alpha.as_ptr(), acc.as_mut_ptr());
        unsafe { accumulate::<E_F32>(w, v.cast(), dims, alpha, acc) }
    }

    #[allow(clippy::too_many_arguments)]
    fn accumulate_enc(
        self,
        w: &[f32],
        v: &[u8],
        enc: Encoding,
        dims: TileDims,
        alpha: &[f32],
        tile: &mut [f32],
        acc: &mut [f32],
    ) {
        let TileDims { d, rows, n } = dims;
        if enc != Encoding::F32 && d % 8 != 0 {
            return Scalar.accumulate_enc(w, v, enc, dims, alpha, tile, acc);
        }
        assert!(w.len() >= rows * n && v.len() >= enc.bytes(n * d) && acc.len() >= rows * d);
        assert!(alpha.len() >= rows);
        let (w, v, alpha, acc) = (w.as_ptr(), v.as_ptr(), alpha.as_ptr(), acc.as_mut_ptr());
        unsafe { by_encoding!(enc, accumulate(w, v, dims, alpha, acc)) }
    }

    fn accumulate_groups_enc(
        self,
        w: &[f32],
        v: &[u8],
        enc: Encoding,
        dims: TileDims,
        group: usize,
        alpha: &[f32],
        tile: &mut [f32],
        acc: &mut [f32],
    ) {
        let TileDims { d, rows, n } = dims;
        if !d.is_multiple_of(8)
            || group == 0
            || !group.is_multiple_of(8)
            || !d.is_multiple_of(group)
        {
            return Scalar.accumulate_groups_enc(w, v, enc, dims, group, alpha, tile, acc);
        }
        assert!(w.len() >= (d / group) * rows * n && v.len() >= enc.bytes(n * d));
        assert!(acc.len() >= rows * d && alpha.len() >= rows);
        let (w, v, alpha, acc) = (w.as_ptr(), v.as_ptr(), alpha.as_ptr(), acc.as_mut_ptr());
        unsafe { by_encoding!(enc, accumulate_groups(w, v, dims, group, alpha, acc)) }
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
        let rows = s.len() / n;
        assert!(m.len() >= rows && l.len() >= rows && alpha.len() >= rows && lb.len() >= rows);
        unsafe { softmax(s, n, m, l, alpha, lb) }
    }

    fn scale(self, x: &mut [f32], a: f32) {
        unsafe { scale(x, a) }
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
        let rows = out.len() / d.max(1);
        assert!(q.len() >= rows * d && z.is_none_or(|z| z.len() >= d));
        assert!(z.is_none() || dots.len() >= rows);
        unsafe { scale_rows(q, s, z, &mut out[..rows * d], dots) }
    }

    fn add_dots(self, x: &[f32], y: &[f32], out: &mut [f32]) {
        let n = y.len();
        assert!(x.len() >= out.len() * n);
        unsafe { add_dots(x, y, out) }
    }

    fn widen(self, src: &[u8], enc: Encoding, dst: &mut [f32]) {
        assert!(src.len() >= enc.bytes(dst.len()));
        unsafe { widen(src, enc, dst) }
    }

    fn narrow(self, src: &[f32], dtype: FloatDtype, dst: &mut [u8]) {
        assert!(dst.len() >= dtype.size() * src.len());
        if dtype == FloatDtype::F16 {
            unsafe { narrow_f16(src, dst) }
        } else {
            Scalar.narrow(src, dtype, dst);
        }
    }

    fn affine_tokens(self, x: &mut [f32], d: usize, group: usize, s: &[f32], z: Option<&[f32]>) {
        let groups = x.len() / group;
        assert!(s.len() >= groups && z.is_none_or(|z| z.len() >= groups));
        if !group.is_multiple_of(8) {
            return Scalar.affine_tokens(x, d, group, s, z);
        }
        unsafe { affine_tokens(x, group, s, z) }
    }
}

/// Calls `f`, which LLVM inlines here and compiles with the features.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn enter<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Elements `i..i + 8` of `src` as f32 (`i` a multiple of 8 for the packed encodings: whole
/// bytes).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load8<const E: u8>(src: *const u8, i: usize) -> __m256 {
    match E {
        E_F32 => _mm256_loadu_ps(src.add(4 * i).cast()),
        E_F16 => _mm256_cvtph_ps(_mm_loadu_si128(src.add(2 * i).cast())),
        E_BF16 => {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.add(2 * i).cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
        E_I8 => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(src.add(i).cast()))),
        E_U8 => _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(src.add(i).cast()))),
        E_I4 => unpack8(src.add(i / 2), 4, true),
        E_U4 => unpack8(src.add(i / 2), 4, false),
        E_I2 => unpack8(src.add(i / 4), 2, true),
        _ => unpack8(src.add(i / 4), 2, false),
    }
}

/// 8 codes of `bits` (4 or 2) packed low bits first in the `bits` bytes at `src`, as f32: two's
/// complement when `signed`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unpack8(src: *const u8, bits: u32, signed: bool) -> __m256 {
    // the codes' bytes in every 32-bit lane (2-bit: the 16-bit word twice, one `vpbroadcastw`;
    // its upper copy leaves the lane in the shift below)
    let words = if bits == 4 {
        _mm256_set1_epi32(src.cast::<i32>().read_unaligned())
    } else {
        _mm256_set1_epi16(src.cast::<i16>().read_unaligned())
    };
    // element e's bits (b * e..b * (e + 1)) shifted to the top of its lane, then down to the
    // bottom: arithmetically (sign-extended) when signed
    let b = bits as i32;
    let up = _mm256_sllv_epi32(
        words,
        _mm256_setr_epi32(
            32 - b,
            32 - 2 * b,
            32 - 3 * b,
            32 - 4 * b,
            32 - 5 * b,
            32 - 6 * b,
            32 - 7 * b,
            32 - 8 * b,
        ),
    );
    let down = _mm256_set1_epi32(32 - b);
    let v = if signed {
        _mm256_srav_epi32(up, down)
    } else {
        _mm256_srlv_epi32(up, down)
    };
    _mm256_cvtepi32_ps(v)
}

/// Element `i` of `src` as f32 (the tails of rows whose length is not a multiple of 8).
#[inline]
unsafe fn load1<const E: u8>(src: *const u8, i: usize) -> f32 {
    let enc = encoding(E);
    let mut x = [0f32; 4];
    // a packed element: widen its byte's elements and keep the one asked for
    let per = enc.per_byte();
    let at = i - i % per;
    let bytes = std::slice::from_raw_parts(src.add(enc.bytes(at)), enc.bytes(per));
    Scalar.widen(bytes, enc, &mut x[..per]);
    x[i - at]
}

// ---- scores -----------------------------------------------------------------------------------

/// `out[r * n + t] = q[r] . k[t]`, `k` `n` rows of `d` elements of encoding `E` (`d` a multiple
/// of 8 unless `E` is fp32).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores<const E: u8>(
    q: *const f32,
    k: *const u8,
    d: usize,
    rows: usize,
    n: usize,
    out: *mut f32,
) {
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(4);
        let (q, out) = (q.add(r * d), out.add(r * n));
        match nr {
            // (rows, tokens) register blocks that fit 16 registers with their operands
            1 => score_rows::<E, 1, 8>(q, k, d, n, out),
            2 => score_rows::<E, 2, 4>(q, k, d, n, out),
            3 => score_rows::<E, 3, 3>(q, k, d, n, out),
            _ => score_rows::<E, 4, 2>(q, k, d, n, out),
        }
        r += nr;
    }
}

/// `NR` rows against all `n` tokens, `NT` tokens a tile, the rest one at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_rows<const E: u8, const NR: usize, const NT: usize>(
    q: *const f32,
    k: *const u8,
    d: usize,
    n: usize,
    out: *mut f32,
) {
    let mut t = 0;
    while t + NT <= n {
        score_tile::<E, NR, NT>(q, k, t * d, d, out.add(t), n);
        t += NT;
    }
    while t < n {
        score_tile::<E, NR, 1>(q, k, t * d, d, out.add(t), n);
        t += 1;
    }
}

/// Rows `0..NR` of `q` against the `NT` rows of `k` from element `at` on.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_tile<const E: u8, const NR: usize, const NT: usize>(
    q: *const f32,
    k: *const u8,
    at: usize,
    d: usize,
    out: *mut f32,
    ld: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NT]; NR];
    let d8 = d & !7;
    let mut i = 0;
    while i < d8 {
        let mut kv = [_mm256_setzero_ps(); NT];
        for (t, kv) in kv.iter_mut().enumerate() {
            *kv = load8::<E>(k, at + t * d + i);
        }
        for (r, acc) in acc.iter_mut().enumerate() {
            let qv = _mm256_loadu_ps(q.add(r * d + i));
            for (a, &kv) in acc.iter_mut().zip(&kv) {
                *a = _mm256_fmadd_ps(qv, kv, *a);
            }
        }
        i += 8;
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut c = 0;
        while c < NT {
            let lane = |j: usize| {
                if c + j < NT {
                    acc[c + j]
                } else {
                    _mm256_setzero_ps()
                }
            };
            let h = _mm256_hadd_ps(
                _mm256_hadd_ps(lane(0), lane(1)),
                _mm256_hadd_ps(lane(2), lane(3)),
            );
            let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
            let mut lanes = [0f32; 4];
            _mm_storeu_ps(lanes.as_mut_ptr(), sums);
            for (j, &sum) in lanes.iter().enumerate().take((NT - c).min(4)) {
                let t = c + j;
                let mut v = sum;
                for e in d8..d {
                    v += *q.add(r * d + e) * load1::<E>(k, at + t * d + e);
                }
                *out.add(r * ld + t) = v;
            }
            c += 4;
        }
    }
}

// ---- values -----------------------------------------------------------------------------------

/// `acc[r] = alpha[r] * acc[r] + sum over t of w[r * n + t] * v[t]`, `v` `n` rows of `d`
/// elements of encoding `E` (`d` a multiple of 8 unless `E` is fp32).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate<const E: u8>(
    w: *const f32,
    v: *const u8,
    dims: TileDims,
    alpha: *const f32,
    acc: *mut f32,
) {
    let TileDims { d, rows, n } = dims;
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(4);
        let (w, alpha, acc) = (w.add(r * n), alpha.add(r), acc.add(r * d));
        let i = value_columns::<E>(nr, w, v, 0..d, d, n, alpha, acc);
        for e in i..d {
            for rr in 0..nr {
                let mut a = *acc.add(rr * d + e) * *alpha.add(rr);
                for t in 0..n {
                    a += *w.add(rr * n + t) * load1::<E>(v, t * d + e);
                }
                *acc.add(rr * d + e) = a;
            }
        }
        r += nr;
    }
}

/// [`Kernels::accumulate_groups_enc`]: [`accumulate`]'s tiles, a group's columns at a time,
/// each with its group's weights (`group` a multiple of 8 dividing `d`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_groups<const E: u8>(
    w: *const f32,
    v: *const u8,
    dims: TileDims,
    group: usize,
    alpha: *const f32,
    acc: *mut f32,
) {
    let TileDims { d, rows, n } = dims;
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(4);
        let (alpha, acc) = (alpha.add(r), acc.add(r * d));
        for g in 0..d / group {
            let w = w.add((g * rows + r) * n);
            value_columns::<E>(nr, w, v, g * group..(g + 1) * group, d, n, alpha, acc);
        }
        r += nr;
    }
}

/// [`value_tile`] over columns `cols` of `nr` (1 to 4) rows, 8 at a time: as many 8-float
/// registers per row as keep 8 chains of FMAs in flight. Returns the first column left (fewer
/// than 8 remain).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn value_columns<const E: u8>(
    nr: usize,
    w: *const f32,
    v: *const u8,
    cols: std::ops::Range<usize>,
    d: usize,
    n: usize,
    alpha: *const f32,
    acc: *mut f32,
) -> usize {
    let (mut i, end) = (cols.start, cols.end);
    macro_rules! columns {
        ($nr:literal, $nd:literal) => {{
            while i + 8 * $nd <= end {
                value_tile::<E, $nr, $nd>(w, v, i, d, n, alpha, acc.add(i));
                i += 8 * $nd;
            }
            while i + 8 <= end {
                value_tile::<E, $nr, 1>(w, v, i, d, n, alpha, acc.add(i));
                i += 8;
            }
        }};
    }
    match nr {
        1 => columns!(1, 4),
        2 => columns!(2, 4),
        3 => columns!(3, 2),
        _ => columns!(4, 2),
    }
    i
}

/// `acc[r][0..8*ND] = alpha[r] * acc[r][..] + sum over t of w[r][t] * v[t][col..col + 8*ND]`
/// for `NR` rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn value_tile<const E: u8, const NR: usize, const ND: usize>(
    w: *const f32,
    v: *const u8,
    col: usize,
    d: usize,
    n: usize,
    alpha: *const f32,
    acc: *mut f32,
) {
    let mut a = [[_mm256_setzero_ps(); ND]; NR];
    for (r, a) in a.iter_mut().enumerate() {
        let scale = _mm256_broadcast_ss(&*alpha.add(r));
        for (c, a) in a.iter_mut().enumerate() {
            *a = _mm256_mul_ps(_mm256_loadu_ps(acc.add(r * d + 8 * c)), scale);
        }
    }
    for t in 0..n {
        let mut vv = [_mm256_setzero_ps(); ND];
        for (c, vv) in vv.iter_mut().enumerate() {
            *vv = load8::<E>(v, t * d + col + 8 * c);
        }
        for (r, a) in a.iter_mut().enumerate() {
            let p = _mm256_broadcast_ss(&*w.add(r * n + t));
            for (a, &vv) in a.iter_mut().zip(&vv) {
                *a = _mm256_fmadd_ps(p, vv, *a);
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (c, &a) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.add(r * d + 8 * c), a);
        }
    }
}

// ---- softmax pieces ---------------------------------------------------------------------------

/// `exp(x)` for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, a degree-5
/// polynomial); 0 where `x < -87` (where the result would leave the normal range).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    let keep = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(-87.0));
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    let fx = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693_359_4), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.121_944_4e-4), x);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0));
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(pow2)), keep)
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax(
    s: &mut [f32],
    n: usize,
    m: &mut [f32],
    l: &mut [f32],
    alpha: &mut [f32],
    lb: &mut [f32],
) {
    let rows = s.len() / n;
    let n8 = n & !7;
    // the lanes of a row's last, partial 8 (loaded and stored masked: no copy of the tail)
    let tail = _mm256_cmpgt_epi32(
        _mm256_set1_epi32((n - n8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    );
    let tail_ps = _mm256_castsi256_ps(tail);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    for r in 0..rows {
        let p = s.as_mut_ptr().add(r * n);
        let mut mx = ninf;
        let mut c = 0;
        while c < n8 {
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(p.add(c)));
            c += 8;
        }
        if n8 < n {
            let x = _mm256_blendv_ps(ninf, _mm256_maskload_ps(p.add(n8), tail), tail_ps);
            mx = _mm256_max_ps(mx, x);
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let mb = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)));
        if mb == f32::NEG_INFINITY {
            std::slice::from_raw_parts_mut(p, n).fill(0.0);
            (alpha[r], lb[r]) = (1.0, 0.0); // a row with nothing to see: left as it is
            continue;
        }
        let m_new = m[r].max(mb);
        alpha[r] = old_scale(m[r], m_new);
        m[r] = m_new;
        // the row's exps (independent of each other: the CPU overlaps them) and their sum
        let mv = _mm256_set1_ps(m_new);
        let mut sum = _mm256_setzero_ps();
        let mut c = 0;
        while c < n8 {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(c)), mv));
            _mm256_storeu_ps(p.add(c), e);
            sum = _mm256_add_ps(sum, e);
            c += 8;
        }
        if n8 < n {
            let x = _mm256_maskload_ps(p.add(n8), tail);
            let e = _mm256_and_ps(exp8(_mm256_sub_ps(x, mv)), tail_ps);
            _mm256_maskstore_ps(p.add(n8), tail, e);
            sum = _mm256_add_ps(sum, e);
        }
        lb[r] = hsum(sum);
        l[r] = l[r] * alpha[r] + lb[r];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale(x: &mut [f32], a: f32) {
    let av = _mm256_set1_ps(a);
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        _mm256_storeu_ps(
            c.as_mut_ptr(),
            _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), av),
        );
    }
    for v in chunks.into_remainder() {
        *v *= a;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale_rows(q: &[f32], s: &[f32], z: Option<&[f32]>, out: &mut [f32], dots: &mut [f32]) {
    let d = s.len();
    let d8 = d & !7;
    for (r, o) in out.chunks_exact_mut(d).enumerate() {
        let (qp, op) = (q.as_ptr().add(r * d), o.as_mut_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < d8 {
            let qv = _mm256_loadu_ps(qp.add(i));
            _mm256_storeu_ps(
                op.add(i),
                _mm256_mul_ps(qv, _mm256_loadu_ps(s.as_ptr().add(i))),
            );
            if let Some(z) = z {
                acc = _mm256_fmadd_ps(qv, _mm256_loadu_ps(z.as_ptr().add(i)), acc);
            }
            i += 8;
        }
        for e in d8..d {
            o[e] = *qp.add(e) * s[e];
        }
        if let Some(z) = z {
            let tail: f32 = (d8..d).map(|e| *qp.add(e) * z[e]).sum();
            dots[r] = hsum(acc) + tail;
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_dots(x: &[f32], y: &[f32], out: &mut [f32]) {
    let n = y.len();
    let n8 = n & !7;
    for (r, o) in out.iter_mut().enumerate() {
        let xp = x.as_ptr().add(r * n);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n8 {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(xp.add(i)),
                _mm256_loadu_ps(y.as_ptr().add(i)),
                acc,
            );
            i += 8;
        }
        *o += hsum(acc) + (n8..n).map(|e| *xp.add(e) * y[e]).sum::<f32>();
    }
}

// ---- conversions ------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen(src: &[u8], enc: Encoding, dst: &mut [f32]) {
    let n8 = dst.len() & !7;
    let (s, o) = (src.as_ptr(), dst.as_mut_ptr());
    by_encoding!(enc, widen8(s, o, n8));
    if n8 < dst.len() {
        // the tail starts on a whole byte: n8 is a multiple of 8
        Scalar.widen(&src[enc.bytes(n8)..], enc, &mut dst[n8..]);
    }
}

/// `dst[..n8]` = elements `..n8` of `src` (`n8` a multiple of 8).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen8<const E: u8>(src: *const u8, dst: *mut f32, n8: usize) {
    let mut i = 0;
    while i < n8 {
        _mm256_storeu_ps(dst.add(i), load8::<E>(src, i));
        i += 8;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn narrow_f16(src: &[f32], dst: &mut [u8]) {
    let mut chunks = src.chunks_exact(8);
    let mut o = dst.as_mut_ptr();
    for c in &mut chunks {
        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(c.as_ptr()));
        _mm_storeu_si128(o.cast(), h);
        o = o.add(16);
    }
    let done = src.len() - chunks.remainder().len();
    Scalar.narrow(chunks.remainder(), FloatDtype::F16, &mut dst[2 * done..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn affine_tokens(x: &mut [f32], group: usize, s: &[f32], z: Option<&[f32]>) {
    for (g, vals) in x.chunks_exact_mut(group).enumerate() {
        let sv = _mm256_set1_ps(s[g]);
        let zv = _mm256_set1_ps(z.map_or(0.0, |z| z[g]));
        for c in vals.chunks_exact_mut(8) {
            let v = _mm256_fmadd_ps(_mm256_loadu_ps(c.as_ptr()), sv, zv);
            _mm256_storeu_ps(c.as_mut_ptr(), v);
        }
    }
}
