//! The AVX2 + FMA + F16C implementation of [`Kernels`], with explicit intrinsics: fp16 widened
//! by `vcvtph2ps`, int8 and nibble codes turned into f32 eight at a time, the score tile a
//! register block of (rows x tokens) dot products reduced by `vhaddps`, the value tile a
//! register block of (rows x 8-float columns), and an exp of Cephes' polynomial (max relative
//! error ~2 ulp).
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

// SAFETY (every `unsafe` block in this impl): `self` exists only where the CPU has the features
// the callees are compiled for, and the asserts bound every pointer access the callees make.
impl Kernels for Avx2 {
    fn scores(self, q: &[f32], k: &[f32], dims: TileDims, out: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        assert!(q.len() >= rows * d && k.len() >= n * d && out.len() >= rows * n);
        unsafe { scores(q.as_ptr(), k.as_ptr(), d, rows, n, out.as_mut_ptr()) }
    }

    fn accumulate(self, w: &[f32], v: &[f32], dims: TileDims, alpha: &[f32], acc: &mut [f32]) {
        let TileDims { d, rows, n } = dims;
        assert!(w.len() >= rows * n && v.len() >= n * d && acc.len() >= rows * d);
        assert!(alpha.len() >= rows);
        let (w, v, alpha, acc) = (w.as_ptr(), v.as_ptr(), alpha.as_ptr(), acc.as_mut_ptr());
        unsafe { accumulate(w, v, dims, alpha, acc) }
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

    fn affine_channels(self, x: &mut [f32], d: usize, s: &[f32], z: Option<&[f32]>) {
        assert!(s.len() >= d && z.is_none_or(|z| z.len() >= d));
        unsafe { affine_channels(x, d, s, z) }
    }
}

// ---- scores -----------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores(q: *const f32, k: *const f32, d: usize, rows: usize, n: usize, out: *mut f32) {
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(4);
        let (q, out) = (q.add(r * d), out.add(r * n));
        match nr {
            // (rows, tokens) register blocks that fit 16 registers with their operands
            1 => score_rows::<1, 8>(q, k, d, n, out),
            2 => score_rows::<2, 4>(q, k, d, n, out),
            3 => score_rows::<3, 3>(q, k, d, n, out),
            _ => score_rows::<4, 2>(q, k, d, n, out),
        }
        r += nr;
    }
}

/// `NR` rows against all `n` tokens, `NT` tokens a tile, the rest one at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_rows<const NR: usize, const NT: usize>(
    q: *const f32,
    k: *const f32,
    d: usize,
    n: usize,
    out: *mut f32,
) {
    let mut t = 0;
    while t + NT <= n {
        score_tile::<NR, NT>(q, k.add(t * d), d, out.add(t), n);
        t += NT;
    }
    while t < n {
        score_tile::<NR, 1>(q, k.add(t * d), d, out.add(t), n);
        t += 1;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_tile<const NR: usize, const NT: usize>(
    q: *const f32,
    k: *const f32,
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
            *kv = _mm256_loadu_ps(k.add(t * d + i));
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
                    v += *q.add(r * d + e) * *k.add(t * d + e);
                }
                *out.add(r * ld + t) = v;
            }
            c += 4;
        }
    }
}

// ---- values -----------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate(
    w: *const f32,
    v: *const f32,
    dims: TileDims,
    alpha: *const f32,
    acc: *mut f32,
) {
    let TileDims { d, rows, n } = dims;
    let mut r = 0;
    while r < rows {
        let nr = (rows - r).min(4);
        let (w, alpha, acc) = (w.add(r * n), alpha.add(r), acc.add(r * d));
        // columns: as many 8-float registers per row as keep 8 chains of FMAs in flight
        let mut i = 0;
        macro_rules! columns {
            ($nr:literal, $nd:literal) => {{
                while i + 8 * $nd <= d {
                    value_tile::<$nr, $nd>(w, v.add(i), d, n, alpha, acc.add(i));
                    i += 8 * $nd;
                }
                while i + 8 <= d {
                    value_tile::<$nr, 1>(w, v.add(i), d, n, alpha, acc.add(i));
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
        for e in i..d {
            for rr in 0..nr {
                let mut a = *acc.add(rr * d + e) * *alpha.add(rr);
                for t in 0..n {
                    a += *w.add(rr * n + t) * *v.add(t * d + e);
                }
                *acc.add(rr * d + e) = a;
            }
        }
        r += nr;
    }
}

/// `acc[r][0..8*ND] = alpha[r] * acc[r][..] + sum over t of w[r][t] * v[t][0..8*ND]` for `NR`
/// rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn value_tile<const NR: usize, const ND: usize>(
    w: *const f32,
    v: *const f32,
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
            *vv = _mm256_loadu_ps(v.add(t * d + 8 * c));
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
    let n8 = n & !7;
    let rows = s.len() / n;
    // first every row's maximum and new running maximum, then the exps: the rows' exps are
    // then independent of each other, and the CPU overlaps them
    for r in 0..rows {
        let row = &s[r * n..(r + 1) * n];
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in row.chunks_exact(8) {
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(c.as_ptr()));
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
        let mb = row[n8..].iter().copied().fold(_mm_cvtss_f32(h), f32::max);
        if mb == f32::NEG_INFINITY {
            (alpha[r], lb[r]) = (1.0, 0.0); // a row with nothing to see: left as it is
        } else {
            let m_new = m[r].max(mb);
            (alpha[r], lb[r], m[r]) = (old_scale(m[r], m_new), 1.0, m_new);
        }
    }
    // scores minus their row's maximum (a row with nothing to see stays -inf: exp 0)
    for r in 0..rows {
        if lb[r] != 0.0 {
            let mv = _mm256_set1_ps(m[r]);
            let row = &mut s[r * n..(r + 1) * n];
            let mut chunks = row.chunks_exact_mut(8);
            for c in &mut chunks {
                _mm256_storeu_ps(
                    c.as_mut_ptr(),
                    _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv),
                );
            }
            chunks.into_remainder().iter_mut().for_each(|x| *x -= m[r]);
        }
    }
    // the exps, four independent ones in flight
    let mut blocks = s.chunks_exact_mut(32);
    for c in &mut blocks {
        let p = c.as_mut_ptr();
        let e = [0, 8, 16, 24].map(|o| exp8(_mm256_loadu_ps(p.add(o))));
        for (o, e) in [0, 8, 16, 24].into_iter().zip(e) {
            _mm256_storeu_ps(p.add(o), e);
        }
    }
    for c in blocks.into_remainder().chunks_mut(8) {
        let mut pad = [f32::NEG_INFINITY; 8];
        pad[..c.len()].copy_from_slice(c);
        _mm256_storeu_ps(pad.as_mut_ptr(), exp8(_mm256_loadu_ps(pad.as_ptr())));
        let len = c.len();
        c.copy_from_slice(&pad[..len]);
    }
    // the rows' sums
    for r in 0..rows {
        if lb[r] == 0.0 {
            continue;
        }
        let row = &s[r * n..(r + 1) * n];
        let mut sum = _mm256_setzero_ps();
        for c in row.chunks_exact(8) {
            sum = _mm256_add_ps(sum, _mm256_loadu_ps(c.as_ptr()));
        }
        lb[r] = hsum(sum) + row[n8..].iter().sum::<f32>();
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

// ---- conversions ------------------------------------------------------------------------------

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen(src: &[u8], enc: Encoding, dst: &mut [f32]) {
    let n = dst.len();
    let (s, o) = (src.as_ptr(), dst.as_mut_ptr());
    let n8 = n & !7;
    let mut i = 0;
    match enc {
        Encoding::F32 => {
            while i < n8 {
                _mm256_storeu_ps(o.add(i), _mm256_loadu_ps(s.add(4 * i).cast()));
                i += 8;
            }
        }
        Encoding::F16 => {
            while i < n8 {
                let h = _mm_loadu_si128(s.add(2 * i).cast());
                _mm256_storeu_ps(o.add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
        }
        Encoding::Bf16 => {
            while i < n8 {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(s.add(2 * i).cast()));
                _mm256_storeu_ps(o.add(i), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h)));
                i += 8;
            }
        }
        Encoding::I8 => {
            while i < n8 {
                let b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(s.add(i).cast()));
                _mm256_storeu_ps(o.add(i), _mm256_cvtepi32_ps(b));
                i += 8;
            }
        }
        Encoding::U8 => {
            while i < n8 {
                let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(s.add(i).cast()));
                _mm256_storeu_ps(o.add(i), _mm256_cvtepi32_ps(b));
                i += 8;
            }
        }
        Encoding::I4 | Encoding::U4 => {
            // 8 nibbles of a little-endian u32, element e in bits 4e..4e+4
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let fifteen = _mm256_set1_epi32(15);
            let eight = _mm256_set1_epi32(8);
            let signed = enc == Encoding::I4;
            while i < n8 {
                let word = s.add(i / 2).cast::<u32>().read_unaligned();
                let nib = _mm256_and_si256(
                    _mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts),
                    fifteen,
                );
                let v = if signed {
                    _mm256_sub_epi32(_mm256_xor_si256(nib, eight), eight)
                } else {
                    nib
                };
                _mm256_storeu_ps(o.add(i), _mm256_cvtepi32_ps(v));
                i += 8;
            }
        }
    }
    if i < n {
        // the tail starts on a whole byte: i is a multiple of 8
        Scalar.widen(&src[enc.bytes(i)..], enc, &mut dst[i..]);
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

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn affine_channels(x: &mut [f32], d: usize, s: &[f32], z: Option<&[f32]>) {
    let d8 = d & !7;
    for row in x.chunks_exact_mut(d) {
        let p = row.as_mut_ptr();
        let mut i = 0;
        while i < d8 {
            let sv = _mm256_loadu_ps(s.as_ptr().add(i));
            let v = _mm256_loadu_ps(p.add(i));
            let v = match z {
                Some(z) => _mm256_fmadd_ps(v, sv, _mm256_loadu_ps(z.as_ptr().add(i))),
                None => _mm256_mul_ps(v, sv),
            };
            _mm256_storeu_ps(p.add(i), v);
            i += 8;
        }
        for e in d8..d {
            row[e] = row[e] * s[e] + z.map_or(0.0, |z| z[e]);
        }
    }
}
