//! Bit packing.
//!
//! - **Codes** ([`pack_codes`], [`unpack_codes`]): small signed integers of `bits` ∈ {2, 4, 8}
//!   bits in two's complement, element `k` at bit `k·bits` of a little-endian bit stream (the
//!   low nibble of a byte comes first). The most negative pattern (−2, −8, −128) is never
//!   produced, so the codecs keep ranges symmetric, and the unpacker reports it, and any non-zero
//!   padding in the last byte, as invalid input.
//! - **Unsigned lanes of any width** ([`pack_uint`], [`unpack_uint`]): values below `2^w` for
//!   `w` ∈ 1..=32, `w` bits each, in the same bit order.
//! - **Blocks of sums** ([`pack_block`], [`unpack_block`]): how the integer-domain schedule
//!   sends its exact sums, `w = ⌈log₂(2·p·levels + 1)⌉` bits each, a block (at most 256
//!   values) at a time: widths up to 8 and above 16 as unsigned lanes; widths 9 to 16 as two
//!   planes, the low bytes of the block's values then their high `w − 8` bits as lanes (the
//!   same bytes for whole groups of 8 values, and byte-wise loops that vectorise).

/// Bytes of `n` values of `bits` bits, packed.
pub(crate) fn packed_len(n: usize, bits: u32) -> usize {
    (n * bits as usize).div_ceil(8)
}

/// Packs the codes `q` into `out` (exactly [`packed_len`] bytes; padding bits zero).
pub(crate) fn pack_codes(q: &[i8], bits: u32, out: &mut [u8]) {
    debug_assert_eq!(out.len(), packed_len(q.len(), bits));
    // Several codes are gathered at once as the bytes of one little-endian word, masked to
    // their width and shifted together (no per-code loop the compiler would not vectorise).
    let per_byte = (8 / bits) as usize;
    let whole = q.len() / per_byte * per_byte;
    match bits {
        8 => out.iter_mut().zip(q).for_each(|(o, &v)| *o = v as u8),
        4 => {
            for (o, p) in out.iter_mut().zip(q[..whole].chunks_exact(2)) {
                let w = u16::from_le_bytes([p[0] as u8, p[1] as u8]) & 0x0f0f;
                *o = (w | w >> 4) as u8;
            }
        }
        2 => {
            for (o, p) in out.iter_mut().zip(q[..whole].chunks_exact(4)) {
                let w = u32::from_le_bytes([p[0] as u8, p[1] as u8, p[2] as u8, p[3] as u8])
                    & 0x0303_0303;
                *o = (w | w >> 6 | w >> 12 | w >> 18) as u8;
            }
        }
        _ => unreachable!("code width {bits}"),
    }
    if whole < q.len() {
        let mask = (1u8 << bits) - 1;
        out[whole / per_byte] = q[whole..].iter().enumerate().fold(0u8, |b, (j, &v)| {
            b | (v as u8 & mask) << (bits as usize * j)
        });
    }
}

/// Each byte of 4-bit codes unpacked (low nibble first), sign-extended.
const NIBBLES: [[i8; 2]; 256] = {
    let mut t = [[0i8; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [((b as u8) << 4) as i8 >> 4, (b as u8) as i8 >> 4];
        b += 1;
    }
    t
};

/// Each byte of 2-bit codes unpacked (lowest pair first), sign-extended.
const PAIRS: [[i8; 4]; 256] = {
    let mut t = [[0i8; 4]; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 4 {
            t[b][j] = ((b as u8) << (6 - 2 * j)) as i8 >> 6;
            j += 1;
        }
        b += 1;
    }
    t
};

/// Unpacks [`packed_len`]`(q.len(), bits)` bytes into `q`. Returns `false` if a code is the
/// reserved pattern `−2^(bits−1)` or padding bits are set (the bytes did not come from
/// [`pack_codes`]); `q` is filled either way.
pub(crate) fn unpack_codes(bytes: &[u8], bits: u32, q: &mut [i8]) -> bool {
    debug_assert_eq!(bytes.len(), packed_len(q.len(), bits));
    // Per byte, the reserved pattern (sign bit set, all others clear) in any of its codes:
    // an OR over all bytes, which vectorises, then one test.
    let reserved = |b: u8| -> u8 {
        match bits {
            8 => u8::from(b == 0x80),
            4 => u8::from(b & 0x0f == 0x08) | u8::from(b & 0xf0 == 0x80),
            _ => (b >> 1) & !b & 0x55,
        }
    };
    let bad = bytes.iter().fold(0u8, |acc, &b| acc | reserved(b));
    let mut pad_ok = true;
    match bits {
        8 => q.iter_mut().zip(bytes).for_each(|(v, &b)| *v = b as i8),
        4 => {
            let whole = q.len() / 2 * 2;
            for (p, &b) in q[..whole].chunks_exact_mut(2).zip(bytes) {
                p.copy_from_slice(&NIBBLES[usize::from(b)]);
            }
            if whole < q.len() {
                let b = bytes[whole / 2];
                q[whole] = NIBBLES[usize::from(b)][0];
                pad_ok = b >> 4 == 0;
            }
        }
        2 => {
            let whole = q.len() / 4 * 4;
            for (p, &b) in q[..whole].chunks_exact_mut(4).zip(bytes) {
                p.copy_from_slice(&PAIRS[usize::from(b)]);
            }
            if whole < q.len() {
                let b = bytes[whole / 4];
                let tail = q.len() - whole;
                q[whole..].copy_from_slice(&PAIRS[usize::from(b)][..tail]);
                pad_ok = b >> (2 * tail) == 0;
            }
        }
        _ => unreachable!("code width {bits}"),
    }
    pad_ok && bad == 0
}

/// The smallest width holding every value in `0..=max`.
pub(crate) fn width_for(max: u32) -> u32 {
    (32 - max.leading_zeros()).max(1)
}

/// Calls `f::<W>(args)` with the width `w` (1..16) as a constant, so that the shifts of the
/// fixed-width kernels are constants too.
macro_rules! with_width {
    ($w:expr, $f:ident, $($arg:expr),*) => {
        match $w {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*),
            8 => $f::<8>($($arg),*),
            9 => $f::<9>($($arg),*),
            10 => $f::<10>($($arg),*),
            11 => $f::<11>($($arg),*),
            12 => $f::<12>($($arg),*),
            13 => $f::<13>($($arg),*),
            14 => $f::<14>($($arg),*),
            _ => $f::<15>($($arg),*),
        }
    };
}

/// [`pack_uint`] for widths below 16: eight values fill exactly `W` bytes, gathered in a
/// 128-bit word without branches.
fn pack_fixed<const W: u32>(v: &[u32], out: &mut [u8]) {
    let w = W as usize;
    let whole = v.len() / 8 * 8;
    for (o, g) in out.chunks_exact_mut(w).zip(v[..whole].chunks_exact(8)) {
        let acc = (0..8).fold(0u128, |a, k| a | u128::from(g[k]) << (k as u32 * W));
        o.copy_from_slice(&acc.to_le_bytes()[..w]);
    }
    let tail = &v[whole..];
    let acc = (0..tail.len()).fold(0u128, |a, k| a | u128::from(tail[k]) << (k as u32 * W));
    let start = whole / 8 * w;
    let rest = out.len() - start;
    out[start..].copy_from_slice(&acc.to_le_bytes()[..rest]);
}

/// [`unpack_uint`] for widths below 16 (see [`pack_fixed`]).
fn unpack_fixed<const W: u32>(bytes: &[u8], v: &mut [u32]) -> bool {
    let (w, mask) = (W as usize, (1u128 << W) - 1);
    let whole = v.len() / 8 * 8;
    let mut word = [0u8; 16];
    for (g, b) in v[..whole].chunks_exact_mut(8).zip(bytes.chunks_exact(w)) {
        word[..w].copy_from_slice(b);
        let acc = u128::from_le_bytes(word);
        for (k, x) in g.iter_mut().enumerate() {
            *x = (acc >> (k as u32 * W) & mask) as u32;
        }
    }
    let start = whole / 8 * w;
    let mut word = [0u8; 16];
    word[..bytes.len() - start].copy_from_slice(&bytes[start..]);
    let acc = u128::from_le_bytes(word);
    let tail = v.len() - whole;
    for (k, x) in v[whole..].iter_mut().enumerate() {
        *x = (acc >> (k as u32 * W) & mask) as u32;
    }
    // Bits past the last value are padding: zero.
    acc >> (tail as u32 * W) == 0
}

/// Packs `v` (each below `2^w`) in `w` bits each into `out` (exactly [`packed_len`] bytes).
pub(crate) fn pack_uint(v: &[u32], w: u32, out: &mut [u8]) {
    debug_assert!((1..=32).contains(&w));
    debug_assert_eq!(out.len(), packed_len(v.len(), w));
    match w {
        8 => out.iter_mut().zip(v).for_each(|(o, &x)| *o = x as u8),
        16 => {
            for (o, &x) in out.chunks_exact_mut(2).zip(v) {
                o.copy_from_slice(&(x as u16).to_le_bytes());
            }
        }
        32 => {
            for (o, &x) in out.chunks_exact_mut(4).zip(v) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        w if w < 16 => with_width!(w, pack_fixed, v, out),
        _ => {
            // A 64-bit accumulator: fewer than 32 bits pending before each value is added,
            // 32 of them written as soon as they are complete.
            let (mut acc, mut pending, mut o) = (0u64, 0u32, 0usize);
            for &x in v {
                acc |= u64::from(x) << pending;
                pending += w;
                if pending >= 32 {
                    out[o..o + 4].copy_from_slice(&(acc as u32).to_le_bytes());
                    o += 4;
                    acc >>= 32;
                    pending -= 32;
                }
            }
            let rest = out.len() - o;
            out[o..].copy_from_slice(&acc.to_le_bytes()[..rest]);
        }
    }
}

/// Unpacks [`packed_len`]`(v.len(), w)` bytes into `v`. Returns `false` if padding bits are
/// set; `v` is filled either way.
pub(crate) fn unpack_uint(bytes: &[u8], w: u32, v: &mut [u32]) -> bool {
    debug_assert!((1..=32).contains(&w));
    debug_assert_eq!(bytes.len(), packed_len(v.len(), w));
    match w {
        8 => v
            .iter_mut()
            .zip(bytes)
            .for_each(|(x, &b)| *x = u32::from(b)),
        16 => {
            for (x, b) in v.iter_mut().zip(bytes.chunks_exact(2)) {
                *x = u32::from(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        32 => {
            for (x, b) in v.iter_mut().zip(bytes.chunks_exact(4)) {
                *x = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        w if w < 16 => return with_width!(w, unpack_fixed, bytes, v),
        _ => {
            let mask = (1u64 << w) - 1;
            let (mut acc, mut pending, mut i) = (0u64, 0u32, 0usize);
            for x in v.iter_mut() {
                if pending < w {
                    // Refill 32 bits (fewer at the end of the buffer).
                    let mut word = [0u8; 4];
                    let take = (bytes.len() - i).min(4);
                    word[..take].copy_from_slice(&bytes[i..i + take]);
                    acc |= u64::from(u32::from_le_bytes(word)) << pending;
                    pending += 32;
                    i += take;
                }
                *x = (acc & mask) as u32;
                acc >>= w;
                pending -= w;
            }
            // What is left are padding bits and bytes never loaded: all must be zero.
            return acc == 0 && bytes[i..].iter().all(|&b| b == 0);
        }
    }
    true
}

/// Bytes of one block of `m` sums of width `w` in the layout of [`pack_block`].
pub(crate) fn block_len(m: usize, w: u32) -> usize {
    if (9..=16).contains(&w) {
        m + packed_len(m, w - 8)
    } else {
        packed_len(m, w)
    }
}

/// Packs one block of values `v` (each below `2^w`) for the wire, in [`block_len`] bytes:
/// widths up to 8 as [`pack_uint`]; widths 9 to 16 as two planes, the low bytes of all values
/// then their high `w − 8` bits packed (both loops vectorise or nearly, where a 9-to-16-bit
/// packing straddles machine words); wider ones as [`pack_uint`].
pub(crate) fn pack_block(v: &[u32], w: u32, out: &mut [u8]) {
    debug_assert_eq!(out.len(), block_len(v.len(), w));
    match w {
        1..=7 => with_small_width!(w, pack_small, v, 0, out),
        9..=15 => {
            let (lo, hi) = out.split_at_mut(v.len());
            lo.iter_mut().zip(v).for_each(|(o, &x)| *o = x as u8);
            with_small_width!(w - 8, pack_small, v, 8, hi);
        }
        16 => {
            let (lo, hi) = out.split_at_mut(v.len());
            lo.iter_mut().zip(v).for_each(|(o, &x)| *o = x as u8);
            hi.iter_mut().zip(v).for_each(|(o, &x)| *o = (x >> 8) as u8);
        }
        _ => pack_uint(v, w, out),
    }
}

/// Unpacks one block written by [`pack_block`] into `v`; `false` if padding bits are set.
pub(crate) fn unpack_block(bytes: &[u8], w: u32, v: &mut [u32]) -> bool {
    debug_assert_eq!(bytes.len(), block_len(v.len(), w));
    match w {
        1..=7 => with_small_width!(w, unpack_small, bytes, v),
        9..=16 => {
            let (lo, hi) = bytes.split_at(v.len());
            let ok = if w == 16 {
                v.iter_mut().zip(hi).for_each(|(x, &b)| *x = u32::from(b));
                true
            } else {
                with_small_width!(w - 8, unpack_small, hi, v)
            };
            v.iter_mut()
                .zip(lo)
                .for_each(|(x, &b)| *x = *x << 8 | u32::from(b));
            ok
        }
        _ => unpack_uint(bytes, w, v),
    }
}

/// Calls `f::<W>(args)` with the width `w` (1..8) as a constant.
macro_rules! with_small_width {
    ($w:expr, $f:ident, $($arg:expr),*) => {
        match $w {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            _ => $f::<7>($($arg),*),
        }
    };
}
use with_small_width;

/// `v[k] >> shift` (each below `2^W`, `W < 8`) packed in `W` bits each: eight values fill
/// exactly `W` bytes, gathered in one 64-bit word.
fn pack_small<const W: u32>(v: &[u32], shift: u32, out: &mut [u8]) {
    let w = W as usize;
    let whole = v.len() / 8 * 8;
    for (o, g) in out.chunks_exact_mut(w).zip(v[..whole].chunks_exact(8)) {
        let mut acc = 0u64;
        for (k, &x) in g.iter().enumerate() {
            acc |= u64::from(x >> shift) << (k as u32 * W);
        }
        o.copy_from_slice(&acc.to_le_bytes()[..w]);
    }
    let mut acc = 0u64;
    for (k, &x) in v[whole..].iter().enumerate() {
        acc |= u64::from(x >> shift) << (k as u32 * W);
    }
    let start = whole / 8 * w;
    let rest = out.len() - start;
    out[start..].copy_from_slice(&acc.to_le_bytes()[..rest]);
}

/// The inverse of [`pack_small`] (with no shift); `false` if padding bits are set.
fn unpack_small<const W: u32>(bytes: &[u8], v: &mut [u32]) -> bool {
    let (w, mask) = (W as usize, (1u64 << W) - 1);
    let whole = v.len() / 8 * 8;
    for (g, b) in v[..whole].chunks_exact_mut(8).zip(bytes.chunks_exact(w)) {
        let mut word = [0u8; 8];
        word[..w].copy_from_slice(b);
        let acc = u64::from_le_bytes(word);
        for (k, x) in g.iter_mut().enumerate() {
            *x = (acc >> (k as u32 * W) & mask) as u32;
        }
    }
    let start = whole / 8 * w;
    let mut word = [0u8; 8];
    word[..bytes.len() - start].copy_from_slice(&bytes[start..]);
    let acc = u64::from_le_bytes(word);
    let tail = v.len() - whole;
    for (k, x) in v[whole..].iter_mut().enumerate() {
        *x = (acc >> (k as u32 * W) & mask) as u32;
    }
    acc >> (tail as u32 * W) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn codes_round_trip(bits in prop::sample::select(vec![2u32, 4, 8]), seed in any::<u64>(), n in 0usize..70) {
            let lim = (1i32 << (bits - 1)) - 1;
            let mut s = seed;
            let q: Vec<i8> = (0..n).map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as i32 % (2 * lim + 1) - lim) as i8
            }).collect();
            let mut bytes = vec![0xaau8; packed_len(n, bits)];
            pack_codes(&q, bits, &mut bytes);
            let mut back = vec![0i8; n];
            prop_assert!(unpack_codes(&bytes, bits, &mut back));
            prop_assert_eq!(back, q);
        }

        #[test]
        fn uints_round_trip(w in 1u32..=32, seed in any::<u64>(), n in 0usize..70) {
            let mask = if w == 32 { u32::MAX } else { (1u32 << w) - 1 };
            let mut s = seed;
            let v: Vec<u32> = (0..n).map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 20) as u32 & mask
            }).collect();
            let mut bytes = vec![0x55u8; packed_len(n, w)];
            pack_uint(&v, w, &mut bytes);
            let mut back = vec![0u32; n];
            prop_assert!(unpack_uint(&bytes, w, &mut back));
            prop_assert_eq!(back, v);
        }
    }

    proptest! {
        #[test]
        fn blocks_round_trip(w in 1u32..=32, seed in any::<u64>(), n in 0usize..300) {
            let mask = if w == 32 { u32::MAX } else { (1u32 << w) - 1 };
            let mut s = seed;
            let v: Vec<u32> = (0..n).map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (s >> 20) as u32 & mask
            }).collect();
            let len = block_len(n, w);
            prop_assert!(len >= packed_len(n, w) && len <= packed_len(n, w) + 1);
            let mut bytes = vec![0x55u8; len];
            pack_block(&v, w, &mut bytes);
            let mut back = vec![0u32; n];
            prop_assert!(unpack_block(&bytes, w, &mut back));
            prop_assert_eq!(&back, &v);
            // A set padding bit (where there is one) is reported.
            let used = if (9..=16).contains(&w) { n * (w as usize - 8) % 8 } else { n * w as usize % 8 };
            if used != 0 {
                *bytes.last_mut().unwrap() |= 0x80;
                prop_assert!(!unpack_block(&bytes, w, &mut back));
            }
        }
    }

    #[test]
    fn reserved_codes_and_padding_are_reported() {
        let mut q = [0i8; 3];
        assert!(!unpack_codes(&[0x80, 0, 0], 8, &mut q));
        assert!(!unpack_codes(&[0x08, 0], 4, &mut q)); // −8 in the first nibble
        assert!(!unpack_codes(&[0x00, 0x10], 4, &mut q)); // padding nibble set
        assert!(unpack_codes(&[0x00, 0x0f], 4, &mut q));
        assert!(!unpack_codes(&[0x02], 2, &mut q)); // −2
        assert!(!unpack_codes(&[0x40], 2, &mut q)); // padding pair set
        assert!(unpack_codes(&[0x3f], 2, &mut q));
        let mut v = [0u32; 3];
        assert!(!unpack_uint(&[0, 0x80], 5, &mut v)); // 15 bits used of 16
        assert!(unpack_uint(&[0xff, 0x7f], 5, &mut v));
        assert_eq!(v, [31, 31, 31]);
    }

    #[test]
    fn widths() {
        assert_eq!(width_for(0), 1);
        assert_eq!(width_for(1), 1);
        assert_eq!(width_for(2), 2);
        assert_eq!(width_for(508), 9);
        assert_eq!(width_for(u32::MAX), 32);
    }
}
