//! The α–β cost model of DESIGN.md §2, used by the selector to fill its cost table.
//!
//! A message of `b` bytes costs `α + b·β`; a schedule's cost is the sum over its sequential
//! steps. Computation (reduction) is not modelled: it overlaps the transfers in every schedule
//! that matters here.

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
}
