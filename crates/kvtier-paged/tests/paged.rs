//! The public API against references written element by element: where each layout keeps a
//! token's K and V (vLLM's `reshape_and_cache` formulas), each token's key norm, the refusals.

use kvtier_paged::{
    blocks_key_norms, copy_rows, element_bytes, write_token, Beyond, Blocks, Geometry, Layout,
};

/// Where `(kv, h, n, d)` is in a cache block of `layout` (its first element 0).
fn cache_index(layout: Layout, g: Geometry, kv: usize, h: usize, n: usize, d: usize) -> usize {
    let (nn, dd) = (g.tokens, g.dim);
    let region = (2 * h + kv) * nn * dd;
    match (layout, kv) {
        (Layout::Channels, _) => h * g.head_stride + n * g.token_stride + kv * dd + d,
        (Layout::CpuVec, 0) => region + d * nn + n,
        (Layout::CpuVec, _) => region + n * dd + d,
        (Layout::CpuAmx, 0) => {
            region + 2 * ((n / 16) * 16 * (dd / 2) + (d / 2) * 16 + n % 16) + d % 2
        }
        (Layout::CpuAmx, _) => region + (d / 16) * nn * 16 + (n / 2) * 32 + (d % 16) * 2 + n % 2,
    }
}

/// bf16 bits of `x` (truncated).
fn bf16(x: f32) -> u16 {
    (x.to_bits() >> 16) as u16
}

fn widen(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

/// The geometries a cache block may have: contiguous heads, and token-major (vLLM's `LBNHC`
/// pages: a token's heads side by side) for `channels`.
fn geometries(layout: Layout, h: usize, n: usize, d: usize) -> Vec<Geometry> {
    let head_major = Geometry::of((h, n, d), (n * 2 * d, 2 * d));
    if layout == Layout::Channels {
        vec![head_major, Geometry::of((h, n, d), (2 * d, h * 2 * d))]
    } else {
        vec![head_major]
    }
}

/// A cache of `blocks` blocks of `g` (bf16 bits) whose `(block, kv, h, n, d)` is a value of its
/// own, and that value's function.
fn cache_of(
    layout: Layout,
    g: Geometry,
    blocks: usize,
) -> (Vec<u16>, impl Fn(usize, usize, usize, usize, usize) -> f32) {
    let per = 2 * g.heads * g.tokens * g.dim;
    let value = |b: usize, kv: usize, h: usize, n: usize, d: usize| {
        ((b * 31 + kv * 17 + h * 7 + n * 3 + d) % 97) as f32 / 8.0 - 6.0
    };
    let mut cache = vec![0u16; blocks * per];
    for b in 0..blocks {
        for kv in 0..2 {
            for h in 0..g.heads {
                for n in 0..g.tokens {
                    for d in 0..g.dim {
                        cache[b * per + cache_index(layout, g, kv, h, n, d)] =
                            bf16(value(b, kv, h, n, d));
                    }
                }
            }
        }
    }
    (cache, value)
}

#[test]
fn copies_read_and_write_each_layouts_blocks_in_kvtiers_form() {
    let (h, n, d) = (2, 32, 64);
    for layout in [Layout::Channels, Layout::CpuVec, Layout::CpuAmx] {
        for g in geometries(layout, h, n, d) {
            let per = 2 * h * n * d;
            let (mut cache, value) = cache_of(layout, g, 5);
            let ids = [3i64, 0, 4];
            let blocks =
                Blocks::new(layout, g, 2, (cache.as_mut_ptr() as usize, per), &ids).unwrap();
            let mut out = vec![0u16; ids.len() * per];
            let addrs: Vec<u64> = (0..ids.len())
                .map(|i| out[i * per..].as_mut_ptr() as u64)
                .collect();
            unsafe { blocks.copy(&addrs, false) }.unwrap();
            for (i, &b) in ids.iter().enumerate() {
                for kv in 0..2 {
                    for hh in 0..h {
                        for t in 0..n {
                            for c in 0..d {
                                let got = out[i * per + ((kv * h + hh) * n + t) * d + c];
                                assert_eq!(
                                    widen(got),
                                    value(b as usize, kv, hh, t, c),
                                    "{layout:?}"
                                );
                            }
                        }
                    }
                }
            }
            // back into other blocks: they become the blocks read
            let into = [1i64, 2, 0];
            let target =
                Blocks::new(layout, g, 2, (cache.as_mut_ptr() as usize, per), &into).unwrap();
            unsafe { target.copy(&addrs, true) }.unwrap();
            let (want, _) = cache_of(layout, g, 5);
            for (&from, &to) in ids.iter().zip(&into) {
                let (from, to) = (from as usize * per, to as usize * per);
                assert_eq!(cache[to..to + per], want[from..from + per], "{layout:?}");
            }
        }
    }
}

#[test]
fn four_byte_elements_round_trip_in_the_layouts_that_take_them() {
    // sides that are multiples of the SIMD tiles (4 and 8), and sides that are not
    for (h, n, d) in [(2, 24, 40), (2, 16, 64), (2, 5, 6)] {
        for layout in [Layout::Channels, Layout::CpuVec] {
            for g in geometries(layout, h, n, d) {
                let per = 2 * h * n * d;
                let block: Vec<u32> = (0..per).map(|i| i as u32 * 7).collect();
                let mut cache = vec![0u32; per];
                let mut back = vec![0u32; per];
                let blocks =
                    Blocks::new(layout, g, 4, (cache.as_mut_ptr() as usize, per), &[0]).unwrap();
                unsafe {
                    blocks.copy(&[block.as_ptr() as u64], true).unwrap();
                    blocks.copy(&[back.as_mut_ptr() as u64], false).unwrap();
                }
                assert_eq!(back, block, "{layout:?}");
                for (kv, hh, t, ch) in [(0, 1, n - 1, 2), (1, 0, 3, d - 1)] {
                    let want = block[((kv * h + hh) * n + t) * d + ch];
                    assert_eq!(cache[cache_index(layout, g, kv, hh, t, ch)], want);
                }
            }
        }
    }
}

#[test]
fn a_scan_measures_each_tokens_key_norm_and_copies_what_it_checked() {
    let (h, n, d) = (3, 16, 32);
    for layout in [Layout::Channels, Layout::CpuVec, Layout::CpuAmx] {
        for g in geometries(layout, h, n, d) {
            let per = 2 * h * n * d;
            let (cache, value) = cache_of(layout, g, 3);
            let ids = [2i64, 1];
            let blocks = Blocks::new(layout, g, 2, (cache.as_ptr() as usize, per), &ids).unwrap();
            let mut out = vec![0u16; ids.len() * per];
            let addrs: Vec<u64> = (0..ids.len())
                .map(|i| out[i * per..].as_mut_ptr() as u64)
                .collect();
            let norms = unsafe { blocks.scan(2, Some(&addrs), f32::INFINITY) }
                .unwrap()
                .unwrap();
            let mut copied = vec![0u16; out.len()];
            for (i, &b) in ids.iter().enumerate() {
                for t in 0..n {
                    let want: f32 = (0..h)
                        .map(|hh| {
                            (0..d)
                                .map(|c| widen(bf16(value(b as usize, 0, hh, t, c))).powi(2))
                                .sum::<f32>()
                                .sqrt()
                        })
                        .sum::<f32>()
                        / h as f32;
                    let got = norms[i * n + t];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.max(1.0),
                        "{layout:?} {got} {want}"
                    );
                }
            }
            let addrs2: Vec<u64> = (0..ids.len())
                .map(|i| copied[i * per..].as_mut_ptr() as u64)
                .collect();
            unsafe { blocks.copy(&addrs2, false) }.unwrap();
            assert_eq!(out, copied, "{layout:?}: the scan's copy is the copy's");
        }
    }
}

#[test]
fn a_nan_an_infinity_or_a_value_past_the_limit_is_refused_in_k_or_v() {
    let (h, n, d) = (2, 16, 16);
    for layout in [Layout::Channels, Layout::CpuVec, Layout::CpuAmx] {
        let g = Geometry::of((h, n, d), (n * 2 * d, 2 * d));
        for (kv, bad, limit, want) in [
            (0, f32::NAN, f32::INFINITY, Beyond::Key),
            (1, f32::INFINITY, f32::INFINITY, Beyond::Value),
            (0, 100.0, 50.0, Beyond::Key),
            (1, -100.0, 50.0, Beyond::Value),
        ] {
            let (mut cache, _) = cache_of(layout, g, 1);
            cache[cache_index(layout, g, kv, 1, 5, 3)] = bf16(bad);
            let blocks = Blocks::new(layout, g, 2, (cache.as_ptr() as usize, 0), &[0]).unwrap();
            let outcome = unsafe { blocks.scan(2, None, limit) }.unwrap();
            assert_eq!(outcome, Err(want), "{layout:?} {bad}");
        }
    }
}

#[test]
fn what_the_kernels_cannot_take_is_refused_before_a_byte_is_touched() {
    let g = Geometry::of((1, 8, 8), (16, 16));
    let cache = [0u16; 4];
    let at = (cache.as_ptr() as usize, 0);
    assert!(Layout::parse("nhd")
        .unwrap_err()
        .0
        .contains("expected channels, cpu-vec or cpu-amx"));
    assert!(Blocks::new(Layout::Channels, g, 3, at, &[0])
        .unwrap_err()
        .0
        .contains("2- or 4-byte"));
    assert!(Blocks::new(Layout::CpuAmx, g, 2, at, &[0])
        .unwrap_err()
        .0
        .contains("multiples of 16"));
    assert!(Blocks::new(Layout::Channels, g, 2, at, &[-1])
        .unwrap_err()
        .0
        .contains("non-negative"));
    let blocks = Blocks::new(Layout::Channels, g, 2, at, &[0]).unwrap();
    assert!(unsafe { blocks.copy(&[], false) }
        .unwrap_err()
        .0
        .contains("one address a block"));
    assert!(unsafe { blocks.scan(0, None, 1.0) }
        .unwrap_err()
        .0
        .contains("not of 2-byte"));
    assert!(element_bytes(7)
        .unwrap_err()
        .0
        .contains("expected 0 (fp32)"));
    assert!(unsafe { copy_rows(&[1], &[], 4) }.is_err());
}

#[test]
fn a_token_is_written_once_checked_and_blocks_in_kvtiers_form_measured() {
    let (heads, dim) = (2, 8);
    let k: Vec<f32> = (0..heads * dim).map(|i| i as f32 - 3.0).collect();
    let v: Vec<f32> = (0..heads * dim).map(|i| 0.5 * i as f32).collect();
    let (mut k_dst, mut v_dst) = (vec![0f32; heads * dim], vec![0f32; heads * dim]);
    let dst = (
        k_dst.as_mut_ptr() as usize,
        v_dst.as_mut_ptr() as usize,
        dim,
    );
    let src = (k.as_ptr() as usize, v.as_ptr() as usize, dim);
    let norm = unsafe { write_token(dst, src, heads, dim, 0, f32::INFINITY) }
        .unwrap()
        .unwrap();
    let want = (0..heads)
        .map(|h| {
            k[h * dim..(h + 1) * dim]
                .iter()
                .map(|x| f64::from(*x).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .sum::<f64>()
        / heads as f64;
    assert!((norm - want).abs() < 1e-9 && k_dst == k && v_dst == v);
    let mut bad = v.clone();
    bad[3] = f32::NAN;
    let mut untouched = vec![7f32; heads * dim];
    let dst = (
        untouched.as_mut_ptr() as usize,
        untouched.as_mut_ptr() as usize,
        dim,
    );
    let src = (k.as_ptr() as usize, bad.as_ptr() as usize, dim);
    assert_eq!(
        unsafe { write_token(dst, src, heads, dim, 0, f32::INFINITY) }.unwrap(),
        Err(Beyond::Value)
    );
    assert!(untouched.iter().all(|&x| x == 7.0));

    // two blocks of kvtier's form, f32: K [heads, tokens, dim] then V
    let (tokens, per) = (4, 2 * heads * 4 * dim);
    let blocks: Vec<f32> = (0..2 * per).map(|i| (i % 13) as f32 - 6.0).collect();
    let norms = unsafe {
        blocks_key_norms(
            blocks.as_ptr() as usize,
            2,
            (heads, tokens, dim),
            0,
            f32::INFINITY,
        )
    }
    .unwrap()
    .unwrap();
    for b in 0..2 {
        for t in 0..tokens {
            let want: f32 = (0..heads)
                .map(|h| {
                    let at = b * per + (h * tokens + t) * dim;
                    blocks[at..at + dim]
                        .iter()
                        .map(|x| x * x)
                        .sum::<f32>()
                        .sqrt()
                })
                .sum::<f32>()
                / heads as f32;
            assert!((norms[b * tokens + t] - want).abs() < 1e-4);
        }
    }
    let mut rows = vec![0u8; 8];
    let src = [1u8, 2, 3, 4, 5, 6, 7, 8];
    unsafe { copy_rows(&[src.as_ptr() as u64], &[rows.as_mut_ptr() as u64], 8) }.unwrap();
    assert_eq!(rows, src);
}
