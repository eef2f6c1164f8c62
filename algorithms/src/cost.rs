//! The α–β cost model of DESIGN.md §2, used by the selector to fill its cost table.
//!
//! A message of `b` bytes costs `α + b·β`; a schedule's cost is the sum over its sequential
//! steps. Reductions that overlap the transfers (the ring, halving-doubling and the tree reduce
//! each segment while the next arrives) are not modelled; recursive doubling reduces a whole
//! message only after it arrived, so it also pays [`REDUCE_SECONDS_PER_BYTE`] per byte and
//! round.

/// The cost parameters of a link between two ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Seconds per message (latency of one small message, software overhead included).
    pub alpha: f64,
    /// Seconds per byte (inverse bandwidth of one stream).
    pub beta: f64,
}

impl Link {
    /// TCP over loopback on a small VM: ~15 µs per message, ~2.5 GB/s per stream
    /// (DESIGN.md §5 measures 2.4–4.7 GB/s; the lower end is the safe planning figure).
    pub const TCP_LOOPBACK: Link = Link {
        alpha: 15e-6,
        beta: 1.0 / 2.5e9,
    };

    /// A 1 Gbit/s Ethernet link: ~60 µs per message, 119.6 MB/s of TCP payload (DESIGN.md §5).
    pub const GIGABIT_ETHERNET: Link = Link {
        alpha: 60e-6,
        beta: 1.0 / 119.6e6,
    };

    /// A link with the given latency (seconds) and bandwidth (bytes per second).
    pub fn new(latency_s: f64, bandwidth_bytes_per_s: f64) -> Link {
        Link {
            alpha: latency_s,
            beta: 1.0 / bandwidth_bytes_per_s,
        }
    }
}

impl Default for Link {
    /// [`Link::TCP_LOOPBACK`].
    fn default() -> Self {
        Link::TCP_LOOPBACK
    }
}

/// Ring allreduce (reduce-scatter then allgather): `2(p−1)α + 2(p−1)/p·nβ` for `n` bytes over
/// `p` ranks; zero for one rank.
///
/// ```
/// use chorus_algorithms::cost::{ring_allreduce, Link};
/// let l = Link { alpha: 1e-5, beta: 1e-9 };
/// let t = ring_allreduce(1 << 20, 4, &l);
/// assert!((t - (6.0 * 1e-5 + 1.5 * (1u64 << 20) as f64 * 1e-9)).abs() < 1e-12);
/// ```
pub fn ring_allreduce(bytes: usize, ranks: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let p = ranks as f64;
    2.0 * (p - 1.0) * link.alpha + 2.0 * (p - 1.0) / p * bytes as f64 * link.beta
}

/// Seconds per byte of a reduction that does not overlap a transfer: `dst += src` reads two
/// buffers and writes one at memory speed (DESIGN.md §5: f32 `a += b` runs at 11–13 GB/s when
/// vectorised, 5.4 when not; the planning figure is the slower one).
pub const REDUCE_SECONDS_PER_BYTE: f64 = 1.0 / 5.4e9;

/// `(p', r)`: the largest power of two `p' ≤ p` and the `r = p − p'` ranks folded onto it.
pub(crate) fn fold(ranks: usize) -> (f64, f64) {
    let core = 1usize << ranks.ilog2();
    (core as f64, (ranks - core) as f64)
}

/// The two messages of `n` bytes that folding `r > 0` extra ranks adds to the critical path.
fn fold_cost(bytes: usize, extra: f64, link: &Link) -> f64 {
    if extra > 0.0 {
        2.0 * (link.alpha + bytes as f64 * link.beta)
    } else {
        0.0
    }
}

/// Recursive doubling: `log₂p'·(α + nβ + nγ)` with `γ` = [`REDUCE_SECONDS_PER_BYTE`] (each
/// round reduces the whole message after it arrived), plus `2(α + nβ)` when `p` is not a power
/// of two; zero for one rank.
///
/// ```
/// use chorus_algorithms::cost::{recursive_doubling_allreduce, Link, REDUCE_SECONDS_PER_BYTE};
/// let l = Link { alpha: 1e-5, beta: 1e-9 };
/// let round = 1e-5 + 8e-9 + 8.0 * REDUCE_SECONDS_PER_BYTE;
/// assert!((recursive_doubling_allreduce(8, 4, &l) - 2.0 * round).abs() < 1e-15);
/// assert!((recursive_doubling_allreduce(8, 5, &l) - 2.0 * round - 2.0 * (1e-5 + 8e-9)).abs() < 1e-15);
/// ```
pub fn recursive_doubling_allreduce(bytes: usize, ranks: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let (_, extra) = fold(ranks);
    let n = bytes as f64;
    // `ilog2`, not `f64::log2`: integer arithmetic, the same on every host (the choice made
    // from these costs must be).
    ranks.ilog2() as f64 * (link.alpha + n * link.beta + n * REDUCE_SECONDS_PER_BYTE)
        + fold_cost(bytes, extra, link)
}

/// Recursive halving-doubling (Rabenseifner): `2·log₂p'·α + 2(p'−1)/p'·nβ`, plus `2(α + nβ)`
/// when `p` is not a power of two; zero for one rank.
///
/// ```
/// use chorus_algorithms::cost::{halving_doubling_allreduce, ring_allreduce, Link};
/// let l = Link { alpha: 1e-5, beta: 1e-9 };
/// // Same bytes as the ring, fewer messages, for a power of two.
/// let (hd, ring) = (halving_doubling_allreduce(1 << 20, 8, &l), ring_allreduce(1 << 20, 8, &l));
/// assert!((ring - hd - 8.0 * 1e-5).abs() < 1e-12);
/// ```
pub fn halving_doubling_allreduce(bytes: usize, ranks: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let (core, extra) = fold(ranks);
    2.0 * ranks.ilog2() as f64 * link.alpha
        + 2.0 * (core - 1.0) / core * bytes as f64 * link.beta
        + fold_cost(bytes, extra, link)
}

/// Pipelined binary tree with segments of `segment` bytes: `m = ⌈n/segment⌉` segments go up and
/// come down a tree of depth `d = ⌊log₂p⌋`; an inner rank receives two segments per step (one
/// per child) going up and sends two going down, so a step costs `α + 2sβ` and the critical
/// path is `2d + m − 1` steps (`d` to fill the pipe each way, then one per segment); zero for
/// one rank. A rank has at most `W` ([`crate::allreduce::tree::WINDOW`]) segments in
/// progress, and a leaf's segment is done only when it came back down: `d` steps up (each
/// rank reduces a whole segment before passing it on) and about one down (forwarded as its
/// bytes arrive), so past `d + 1 > W` (16 ranks and more) the segments follow each other
/// `(d + 1)/W` steps apart, not one.
///
/// ```
/// use chorus_algorithms::cost::{tree_allreduce, Link};
/// let l = Link { alpha: 1e-5, beta: 0.0 };
/// assert!((tree_allreduce(8, 4, 65536, &l) - 4.0 * 1e-5).abs() < 1e-15); // 2·2 + 1 − 1 steps
/// ```
pub fn tree_allreduce(bytes: usize, ranks: usize, segment: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let depth = ranks.ilog2() as f64;
    let segments = bytes.div_ceil(segment.max(1)).max(1) as f64;
    let s = bytes.min(segment) as f64;
    // With two ranks the root has one child: one segment per step each way.
    let fan_in = if ranks == 2 { 1.0 } else { 2.0 };
    let apart = window_spacing(depth, crate::allreduce::tree::WINDOW as f64);
    (2.0 * depth + (segments - 1.0) * apart) * (link.alpha + fan_in * s * link.beta)
}

/// Steps between segments of a pipelined tree of depth `depth` with `window` segments in
/// progress per rank: one, or a leaf's round trip `(depth + 1)/window` where the window, not
/// the links, sets the pace (see [`tree_allreduce`]).
fn window_spacing(depth: f64, window: f64) -> f64 {
    ((depth + 1.0) / window).max(1.0)
}

/// A double binary tree allreduce ([`crate::allreduce::double_tree`]): the two halves of
/// `bytes` go through two pipelined trees of depth `⌊log₂ranks⌋` at once, in segments of
/// `segment` bytes. Each rank forwards to children in one tree only: a pipeline step, with
/// [`tree_allreduce`]'s convention, costs `α + (f + 1)·sβ` for half-buffer segments of `s`
/// bytes and fan-out `f` (two segments down the tree where the rank is inner, one up the tree
/// where it is a leaf, on the same network port): `(2·depth + m − 1)·(α + (f + 1)·sβ)` with `m`
/// segments per half, `≈ 2·log₂p·α + 1.5·nβ` for large buffers (the single tree: `2nβ`),
/// as long as the window allows: the two halves share the tree's window of `W` segments, `W/2`
/// each, so past `depth + 1 > W/2` (4 ranks and more) the segments of a half follow each other
/// `2·(depth + 1)/W` steps apart (see [`tree_allreduce`]).
///
/// ```
/// use chorus_algorithms::cost::{double_tree_allreduce, Link};
/// let l = Link { alpha: 1e-5, beta: 0.0 };
/// assert!((double_tree_allreduce(8, 4, 65536, &l) - 4.0 * 1e-5).abs() < 1e-15);
/// ```
pub fn double_tree_allreduce(bytes: usize, ranks: usize, segment: usize, link: &Link) -> f64 {
    if ranks <= 1 {
        return 0.0;
    }
    let depth = ranks.ilog2() as f64;
    let half = bytes.div_ceil(2);
    let segments = half.div_ceil(segment.max(1)).max(1) as f64;
    let s = half.min(segment) as f64;
    // With two ranks each tree is one edge: a rank sends one half-segment down one tree and
    // one up the other per step.
    let per_step = if ranks == 2 { 2.0 } else { 3.0 };
    let apart = window_spacing(depth, crate::allreduce::tree::WINDOW as f64 / 2.0);
    (2.0 * depth + (segments - 1.0) * apart) * (link.alpha + per_step * s * link.beta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_latency_bound_small_and_bandwidth_bound_large() {
        let l = Link::default();
        assert_eq!(ring_allreduce(1 << 30, 1, &l), 0.0);
        let small = ring_allreduce(8, 8, &l);
        assert!((small - 14.0 * l.alpha) / small < 1e-3);
        // Large messages approach 2(p−1)/p · n · β.
        let n = 1usize << 30;
        let big = ring_allreduce(n, 2, &l);
        assert!((big - n as f64 * l.beta) / big < 1e-3);
    }

    #[test]
    fn recursive_schedules_fold() {
        let l = Link::default();
        for p in [2usize, 4, 8, 16] {
            // A power of two pays no fold; one more rank pays two messages of n bytes.
            let n = 1000;
            let extra = 2.0 * (l.alpha + n as f64 * l.beta);
            let d =
                recursive_doubling_allreduce(n, p + 1, &l) - recursive_doubling_allreduce(n, p, &l);
            assert!((d - extra).abs() < 1e-12, "p={p}");
            let d = halving_doubling_allreduce(n, p + 1, &l) - halving_doubling_allreduce(n, p, &l);
            assert!((d - extra).abs() < 1e-12, "p={p}");
        }
        assert_eq!(recursive_doubling_allreduce(8, 1, &l), 0.0);
        assert_eq!(halving_doubling_allreduce(8, 1, &l), 0.0);
        assert_eq!(tree_allreduce(8, 1, 1024, &l), 0.0);
    }

    #[test]
    fn double_tree_halves_the_tree_bandwidth_term_while_the_window_allows() {
        let l = Link::GIGABIT_ETHERNET;
        assert_eq!(double_tree_allreduce(8, 1, 1024, &l), 0.0);
        let n = 64 << 20;
        let near = |t: f64, floor: f64| t > floor && t < 1.1 * floor + 2000.0 * l.alpha;
        // Depth 1 (p = 3): two half-segments in progress per tree cover the round trip.
        let t = double_tree_allreduce(n, 3, 1 << 16, &l);
        assert!(near(t, 1.5 * n as f64 * l.beta), "{t}");
        assert!(t < 0.8 * tree_allreduce(n, 3, 1 << 16, &l));
        // Depth 2 (p = 4): the shared window sets the pace, (2 + 1)/2 steps apart.
        let t = double_tree_allreduce(n, 4, 1 << 16, &l);
        assert!(near(t, 1.5 * 1.5 * n as f64 * l.beta), "{t}");
        // Two ranks: each half crosses the one link in each direction, like the ring.
        let two = double_tree_allreduce(n, 2, 1 << 16, &l);
        assert!(two > n as f64 * l.beta && two < 1.1 * n as f64 * l.beta);
    }

    #[test]
    fn tree_pipelines_large_buffers_as_far_as_its_window_allows() {
        let l = Link::GIGABIT_ETHERNET;
        let n = 64 << 20;
        let near = |t: f64, floor: f64| t > floor && t < 1.1 * floor + 2000.0 * l.alpha;
        // Many segments: about 2nβ (every inner rank sends each byte to two children)...
        for p in [4, 8, 15] {
            let t = tree_allreduce(n, p, 1 << 16, &l);
            assert!(near(t, 2.0 * n as f64 * l.beta), "p={p}: {t}");
        }
        // ...until a leaf's round trip (d + 1 = 5 steps at p = 16) outgrows the window of 4.
        let t = tree_allreduce(n, 16, 1 << 16, &l);
        assert!(near(t, 2.0 * 1.25 * n as f64 * l.beta), "{t}");
    }
}
