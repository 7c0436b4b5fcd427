//! The rotation of rotated formats: `H = S diag(signs)`, `S` Sylvester's Hadamard matrix of the
//! head size (a power of two; `S S = D I`), `signs` the call's ±1 per column. A rotated format
//! stores each K/V head vector `x` as `x @ H / D`, which spreads outlier channels over all of
//! them; decoding is `y @ H^T`. Each product is Sylvester's transform (`log2(D)` passes of
//! butterflies, in the order python/kvtier/codecs/quant.py's reference takes too, so the sums
//! round alike) and a multiply by the signs: every step one IEEE fp32 operation.

/// `x @ H`: Sylvester's transform, then the signs (a query into the rotated basis).
pub(crate) fn rotate(x: &mut [f32], signs: &[f32]) {
    walsh_hadamard(x);
    for (v, &s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
}

/// `x @ H / D`, `over_d` being `1 / D`: a value as a rotated format stores it. A zero comes
/// out +0 (`+ 0.0`): the signs would make some -0, and a group holding both zeros has no one
/// minimum (torch's reduction picks either).
pub(crate) fn rotate_scaled(x: &mut [f32], signs: &[f32], over_d: f32) {
    walsh_hadamard(x);
    for (v, &s) in x.iter_mut().zip(signs) {
        *v = *v * (s * over_d) + 0.0; // s * over_d is exact: ±2^-k
    }
}

/// `x @ H^T`: the signs, then Sylvester's transform (a stored value, or a sum of them, back).
pub(crate) fn unrotate(x: &mut [f32], signs: &[f32]) {
    for (v, &s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
    walsh_hadamard(x);
}

/// `x` times Sylvester's Hadamard matrix of its length (a power of two; the matrix is
/// symmetric), in place: pass `h` = 1, 2, 4 ... turns each pair `(a, b)` of entries `h` apart
/// within a run of `2h` into `(a + b, a - b)`.
pub(crate) fn walsh_hadamard(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for pair in x.chunks_exact_mut(2 * h) {
            let (a, b) = pair.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b) {
                (*a, *b) = (*a + *b, *a - *b);
            }
        }
        h *= 2;
    }
}

/// Checks a call's `signs` for blocks of head size `dim`: `dim` values, each 1 or -1.
pub(crate) fn check_signs(signs: &[f32], dim: usize) -> Result<(), String> {
    if signs.len() != dim || signs.iter().any(|&x| x != 1.0 && x != -1.0) {
        return Err(format!(
            "a rotated format needs the rotation's {dim} signs, each 1 or -1; got {} values",
            signs.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sylvester's matrix by its recursion, `[[S, S], [S, -S]]`.
    fn sylvester(n: usize) -> Vec<Vec<f32>> {
        let mut s = vec![vec![1.0f32]];
        while s.len() < n {
            let m = s.len();
            let mut t = vec![vec![0.0; 2 * m]; 2 * m];
            for i in 0..m {
                for j in 0..m {
                    t[i][j] = s[i][j];
                    t[i][j + m] = s[i][j];
                    t[i + m][j] = s[i][j];
                    t[i + m][j + m] = -s[i][j];
                }
            }
            s = t;
        }
        s
    }

    #[test]
    fn the_transforms_are_the_products_by_the_matrix_and_invert_each_other() {
        let n = 16;
        let s = sylvester(n);
        let signs: Vec<f32> = (0..n)
            .map(|i| if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        rotate(&mut y, &signs);
        for j in 0..n {
            let want: f32 = (0..n).map(|i| x[i] * s[i][j] * signs[j]).sum();
            assert!((y[j] - want).abs() < 1e-5, "{j}");
        }
        let mut z = x.clone();
        rotate_scaled(&mut z, &signs, 1.0 / n as f32);
        unrotate(&mut z, &signs);
        for (a, b) in z.iter().zip(&x) {
            assert!((a - b).abs() < 1e-6);
        }
        assert!(check_signs(&signs, n).is_ok());
        assert!(check_signs(&signs[1..], n).is_err());
        assert!(check_signs(&[0.5; 16], n).is_err());
    }
}
