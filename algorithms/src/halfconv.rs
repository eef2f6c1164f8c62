//! bf16 ↔ f32 conversions written branch-free on the bit patterns, so that a loop calling
//! them per element vectorises (half's slice helper converts bf16 one element at a time through
//! a branchy scalar routine and runs the reduce kernel at a third of the speed).
//!
//! Results equal `half`'s conversions bit for bit (round to nearest even, NaNs quieted on
//! narrowing), which the tests check. f16 keeps half's slice helpers: they use the F16C
//! instructions when the CPU has them, faster than any portable bit manipulation.

/// bf16 bits to f32: bf16 is the upper half of an f32.
#[inline(always)]
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, rounding to nearest even.
#[inline(always)]
pub(crate) fn f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    // Round to nearest even: add just under half an ulp, plus one if the kept lsb is odd.
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) | 0x0040) as u16;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn widening_matches_half_for_every_pattern() {
        for bits in 0..=u16::MAX {
            let (got, want) = (bf16_to_f32(bits), bf16::from_bits(bits).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
        }
    }

    #[test]
    fn narrowing_matches_half() {
        let mut probes: Vec<u32> = (0..=u32::MAX).step_by(65_521).collect();
        for hi in 0..=u16::MAX as u32 {
            // Each bf16 value, its neighbours and the rounding boundaries below the next one.
            for lo in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                probes.push(hi << 16 | lo);
            }
        }
        for bits in probes {
            let f = f32::from_bits(bits);
            let want = bf16::from_f32(f);
            let got = bf16::from_bits(f32_to_bf16(f));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "bf16 of {f:e} ({bits:#x}): got {:#x} want {:#x}",
                got.to_bits(),
                want.to_bits()
            );
        }
    }
}
