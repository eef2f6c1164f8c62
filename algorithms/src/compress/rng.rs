//! Seeded random numbers for stochastic rounding.
//!
//! - [`Rng`]: a xoshiro256++ generator whose 256-bit state is filled by splitmix64 from a
//!   `(seed, stream)` pair, so each rank of a run gets its own reproducible stream
//!   (`Rng::new(run_seed, rank)`).
//! - [`Dither`]: the per-element uniforms of one encode call. Drawing them one by one from a
//!   sequential generator would serialise the rounding loop; instead [`LANES`] xorshift32
//!   generators, seeded from the [`Rng`], step side by side (shifts and xors only, which
//!   vectorise on any x86-64), and element `k` of a run of values takes lane `k mod LANES`.
//!   xorshift32 is a weak generator by modern standards, but each lane's outputs are uniform
//!   over its full period and the lanes start at independent points: all stochastic rounding
//!   needs is an unbiased uniform per value.
//!
//! Neither is cryptographic.

/// splitmix64's increment (2^64 divided by the golden ratio).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// One step of splitmix64: advances `state` and returns a well-mixed word.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(GOLDEN_GAMMA);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded, reproducible random stream (xoshiro256++).
///
/// ```
/// use chorus_algorithms::compress::Rng;
/// let mut a = Rng::new(42, 3);
/// let mut b = Rng::new(42, 3);
/// assert_eq!(a.next_u64(), b.next_u64());
/// assert_ne!(Rng::new(42, 4).next_u64(), Rng::new(42, 3).next_u64());
/// let u = a.next_f32();
/// assert!((0.0..1.0).contains(&u));
/// ```
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// The stream `stream` (e.g. the rank) of the generator seeded with `seed`.
    pub fn new(seed: u64, stream: u64) -> Rng {
        // Two splitmix64 sequences, one from the seed and one from the stream (offset so that
        // stream 0 does not repeat the seed's sequence), combined word by word.
        let mut a = seed;
        let mut b = stream ^ 0x6a09_e667_f3bc_c908;
        let mut s = [0u64; 4];
        for w in &mut s {
            *w = splitmix64(&mut a) ^ splitmix64(&mut b).rotate_left(29);
        }
        if s == [0; 4] {
            s[0] = GOLDEN_GAMMA; // the one state xoshiro cannot leave
        }
        Rng { s }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// A uniform float in `[0, 1)` with 24 random bits.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }
}

/// Generators stepping side by side in a [`Dither`].
pub(crate) const LANES: usize = 16;

/// Uniforms for the values of one encode call: [`LANES`] xorshift32 generators.
#[derive(Clone, Debug)]
pub(crate) struct Dither {
    state: [u32; LANES],
}

impl Dither {
    /// Lanes seeded from `rng` (never zero, the one state xorshift cannot leave).
    pub(crate) fn new(rng: &mut Rng) -> Dither {
        let mut state = [0u32; LANES];
        for pair in state.chunks_exact_mut(2) {
            let v = rng.next_u64();
            pair[0] = (v as u32).max(1);
            pair[1] = ((v >> 32) as u32).max(1);
        }
        Dither { state }
    }

    /// The next uniform of every lane, centred: in `(−0.5, 0.5)`, on the odd multiples of
    /// 2⁻²⁴ (2²³ values, symmetric about zero, never ±0.5).
    #[inline(always)]
    pub(crate) fn next_centred(&mut self) -> [f32; LANES] {
        let mut u = [0f32; LANES];
        for (x, u) in self.state.iter_mut().zip(&mut u) {
            *x ^= *x << 13;
            *x ^= *x >> 17;
            *x ^= *x << 5;
            // The top 24 bits as a signed number, made odd; i32 to f32 vectorises on any
            // x86-64.
            *u = ((*x as i32 >> 8) | 1) as f32 * (1.0 / (1u32 << 24) as f32);
        }
        u
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = {
            let mut r = Rng::new(1, 0);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(1, 0);
        assert!(a.iter().all(|&v| v == r.next_u64()));
        for (seed, stream) in [(0, 0), (1, 1), (0, 1), (2, 0)] {
            assert_ne!(Rng::new(seed, stream).next_u64(), a[0]);
        }
        // The all-zero state is never produced (it would emit zeros forever).
        let mut z = Rng::new(0, 0);
        assert!((0..4).any(|_| z.next_u64() != 0));
    }

    /// Mean, and the fraction in each eighth of [0, 1), of many draws: a chi-square-like check
    /// with a generous fixed bound (deterministic: fixed seeds).
    fn check_uniform(mut draw: impl FnMut() -> f32) {
        const N: usize = 80_000;
        let mut bins = [0usize; 8];
        let mut sum = 0.0f64;
        for _ in 0..N {
            let u = draw();
            assert!((0.0..1.0).contains(&u), "{u}");
            sum += f64::from(u);
            bins[(u * 8.0) as usize] += 1;
        }
        let mean = sum / N as f64;
        // The standard deviation of the mean is sqrt(1/12/N) ≈ 0.001.
        assert!((mean - 0.5).abs() < 0.006, "mean {mean}");
        let expect = N as f64 / 8.0;
        let chi2: f64 = bins
            .iter()
            .map(|&b| (b as f64 - expect).powi(2) / expect)
            .sum();
        // 7 degrees of freedom: P(chi2 > 30) < 1e-4.
        assert!(chi2 < 30.0, "chi2 {chi2} bins {bins:?}");
    }

    #[test]
    fn next_f32_is_uniform() {
        let mut r = Rng::new(7, 9);
        check_uniform(|| r.next_f32());
    }

    #[test]
    fn dither_is_uniform_along_and_across_lanes() {
        let mut r = Rng::new(3, 0);
        let mut d = Dither::new(&mut r);
        let mut buf = Vec::new();
        check_uniform(|| {
            if buf.is_empty() {
                buf.extend(d.next_centred().map(|u| u + 0.5));
            }
            buf.pop().unwrap()
        });
        // One lane on its own, and the first draw of many fresh dithers.
        check_uniform(|| d.next_centred()[5] + 0.5);
        check_uniform(|| Dither::new(&mut r).next_centred()[0] + 0.5);
        // Neighbouring lanes are not copies of each other.
        let same = (0..1000)
            .filter(|_| {
                let u = d.next_centred();
                assert!(u.iter().all(|v| v.abs() < 0.5));
                u[0] == u[1]
            })
            .count();
        assert!(same < 5, "{same}");
    }
}
