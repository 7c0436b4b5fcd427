//! Scalar fp16 and bf16 conversions, bit for bit what torch does: widening is exact, narrowing
//! rounds to nearest even (fp16 overflows to infinity, a NaN stays a NaN; bf16 NaN is written
//! as torch writes it, 0x7fc0). The SIMD path widens with F16C and narrows with it the same way.

/// An IEEE binary16 value's bits, widened to f32 (exact).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let mant = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if mant == 0 => sign,
        // subnormal: mant * 2^-24, exact in f32
        0 => sign | (mant as f32 * (1.0 / 16_777_216.0)).to_bits(),
        31 => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

/// f32 narrowed to binary16 bits, rounding to nearest even (F. Giesen's branch-light method).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    const F16_OVERFLOW: u32 = (127 + 16) << 23; // 65536: rounds to infinity and above
    const DENORM_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let abs = bits & 0x7fff_ffff;
    let h = if abs >= F16_OVERFLOW {
        if abs > 0x7f80_0000 {
            0x7e00 // NaN
        } else {
            0x7c00
        }
    } else if abs < (113 << 23) {
        // below fp16's smallest normal: let the FPU round the subnormal for us
        let sum = f32::from_bits(abs) + f32::from_bits(DENORM_MAGIC);
        (sum.to_bits() - DENORM_MAGIC) as u16
    } else {
        let odd = (abs >> 13) & 1;
        let rebiased = abs
            .wrapping_add(((15u32).wrapping_sub(127)) << 23)
            .wrapping_add(0xfff)
            + odd;
        (rebiased >> 13) as u16
    };
    h | sign
}

/// A bfloat16 value's bits, widened to f32 (exact).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

/// f32 narrowed to bfloat16 bits, rounding to nearest even.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return 0x7fc0;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_every_finite_value() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if x.is_nan() {
                assert!(f16_to_f32(f32_to_f16(x)).is_nan());
            } else {
                assert_eq!(f32_to_f16(x), h, "{h:#06x} -> {x}");
            }
        }
    }

    #[test]
    fn f16_rounds_to_nearest_even() {
        // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties to the even mantissa (1)
        assert_eq!(f32_to_f16(1.0 + 1.0 / 2048.0), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 / 2048.0), 0x3c02);
        assert_eq!(f32_to_f16(65519.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(-1e-8), 0x8000);
        assert_eq!(f32_to_f16(6e-8), 0x0001);
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, up to even
        assert_eq!(f32_to_bf16(f32::NAN), 0x7fc0);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }
}
