//! Which message sizes to run and how many iterations each one gets.
//!
//! Two conventions meet here:
//! - nccl-tests: sizes `-b`, `-b·f`, `-b·f²`, … `≤ -e` (or `-b`, `-b+i`, … with `-i`), and
//!   exactly `-n` timed iterations after `-w` warm-up ones.
//! - the peers harness (`peers/src/bench_common.h`, used when `-B BUDGET` is given): the grid
//!   also ends at `-e` itself when the geometric steps miss it (so does `--format peers`
//!   alone), each size gets `clamp(BUDGET / size, -m, -n)` timed iterations and
//!   `max(1, min(-w, iters / 2))` warm-up ones.
//!
//! A size is turned into an element count by rounding down to whole elements; sizes smaller
//! than one element are skipped, and sizes that round to the count of the previous one are
//! not repeated.

/// How the size grid advances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Multiply by this factor (at least 2).
    Factor(u64),
    /// Add this many bytes (at least 1).
    Bytes(u64),
}

/// The size grid, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeGrid {
    /// First size.
    pub min_bytes: u64,
    /// Last size (inclusive bound).
    pub max_bytes: u64,
    /// How sizes advance.
    pub step: Step,
    /// Append `max_bytes` when the steps do not land on it (the peers harness's rule).
    pub include_max: bool,
}

/// One size to run: its byte size (a whole number of elements) and element count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizePoint {
    /// `count × element size`.
    pub bytes: u64,
    /// Number of elements.
    pub count: u64,
}

impl SizeGrid {
    /// The raw byte sizes before rounding to elements.
    fn raw(&self) -> Vec<u64> {
        let mut out = Vec::new();
        let mut s = self.min_bytes;
        while s <= self.max_bytes {
            out.push(s);
            let next = match self.step {
                Step::Factor(f) => s.checked_mul(f.max(2)),
                Step::Bytes(b) => s.checked_add(b.max(1)),
            };
            match next {
                // A zero minimum would never grow by a factor: go on from one byte.
                Some(n) if n > s => s = n,
                Some(_) if s == 0 => s = 1,
                _ => break,
            }
        }
        out
    }

    /// The sizes to run for elements of `elt_size` bytes.
    pub fn points(&self, elt_size: u64) -> Vec<SizePoint> {
        assert!(elt_size > 0, "element size must be positive");
        let mut raw = self.raw();
        if self.include_max && !raw.is_empty() && raw.last() != Some(&self.max_bytes) {
            raw.push(self.max_bytes);
        }
        let mut out: Vec<SizePoint> = Vec::with_capacity(raw.len());
        for bytes in raw {
            let count = bytes / elt_size;
            if count == 0 || out.last().is_some_and(|p| p.count == count) {
                continue;
            }
            out.push(SizePoint {
                bytes: count * elt_size,
                count,
            });
        }
        out
    }
}

/// How many warm-up and timed iterations a size gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IterPolicy {
    /// `-n`: timed iterations, or the maximum of them with a budget.
    pub iters: u64,
    /// `-w`: warm-up iterations (an upper bound with a budget).
    pub warmup: u64,
    /// `-m`: the minimum of timed iterations with a budget.
    pub min_iters: u64,
    /// `-B`: bytes per size that choose the iteration count.
    pub budget: Option<u64>,
}

impl IterPolicy {
    /// `(warmup, timed)` iterations for a size of `bytes`.
    pub fn for_size(&self, bytes: u64) -> (u64, u64) {
        match self.budget {
            None => (self.warmup, self.iters.max(1)),
            Some(budget) => {
                let lo = self.min_iters.max(1);
                let hi = self.iters.max(lo);
                let iters = (budget / bytes.max(1)).clamp(lo, hi);
                let warmup = self.warmup.min(iters / 2).max(1);
                (warmup, iters)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: u64 = 1024;
    const M: u64 = 1024 * 1024;

    fn grid(min: u64, max: u64, step: Step, include_max: bool) -> SizeGrid {
        SizeGrid {
            min_bytes: min,
            max_bytes: max,
            step,
            include_max,
        }
    }

    fn bytes(points: &[SizePoint]) -> Vec<u64> {
        points.iter().map(|p| p.bytes).collect()
    }

    #[test]
    fn geometric_like_nccl_tests() {
        let p = grid(8, 32 * M, Step::Factor(2), false).points(4);
        assert_eq!(p.len(), 23);
        assert_eq!(p[0], SizePoint { bytes: 8, count: 2 });
        assert_eq!(p[22].bytes, 32 * M);
        assert_eq!(p[22].count, 8 * M);
    }

    #[test]
    fn peers_full_grid_ends_at_max() {
        // run_all.sh full: -b 8 -e 256M -f 4 -> 8, 32, ..., 128 MiB, then 256 MiB appended.
        let p = grid(8, 256 * M, Step::Factor(4), true).points(4);
        let b = bytes(&p);
        assert_eq!(b.len(), 14);
        assert_eq!(b[..3], [8, 32, 128]);
        assert_eq!(b[12], 128 * M);
        assert_eq!(b[13], 256 * M);
        // run_all.sh quick: -e 32M is on the grid, nothing appended.
        let q = bytes(&grid(8, 32 * M, Step::Factor(4), true).points(4));
        assert_eq!(q.len(), 12);
        assert_eq!(*q.last().unwrap(), 32 * M);
        // nccl-tests style does not append.
        let n = bytes(&grid(8, 256 * M, Step::Factor(4), false).points(4));
        assert_eq!(*n.last().unwrap(), 128 * M);
    }

    #[test]
    fn rounding_to_elements_like_bench_common() {
        // bench_common.h: sizes[n] = s / 4 * 4, max appended as max / 4 * 4.
        let p = grid(6, 1000, Step::Factor(3), true).points(4);
        assert_eq!(bytes(&p), vec![4, 16, 52, 160, 484, 1000]);
        let p = grid(6, 1001, Step::Factor(3), true).points(4);
        assert_eq!(*bytes(&p).last().unwrap(), 1000);
    }

    #[test]
    fn skips_sizes_below_one_element_and_duplicates() {
        let p = grid(1, 64, Step::Factor(2), false).points(8);
        assert_eq!(bytes(&p), vec![8, 16, 32, 64]);
        let p = grid(8, 20, Step::Bytes(1), false).points(4);
        assert_eq!(bytes(&p), vec![8, 12, 16, 20]);
        assert!(grid(1, 7, Step::Factor(2), true).points(8).is_empty());
        // max rounds to the last point's count: not repeated.
        let p = grid(8, 35, Step::Factor(4), true).points(4);
        assert_eq!(bytes(&p), vec![8, 32]);
    }

    #[test]
    fn additive_and_degenerate_grids() {
        let p = grid(K, 4 * K, Step::Bytes(K), false).points(4);
        assert_eq!(bytes(&p), vec![K, 2 * K, 3 * K, 4 * K]);
        assert!(grid(64, 8, Step::Factor(2), true).points(1).is_empty());
        let p = grid(0, 4, Step::Factor(2), false).points(1);
        assert_eq!(bytes(&p), vec![1, 2, 4]);
        // no overflow near u64::MAX
        let p = grid(u64::MAX / 2, u64::MAX, Step::Factor(4), false).points(1);
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn iterations_with_and_without_budget() {
        let plain = IterPolicy {
            iters: 20,
            warmup: 5,
            min_iters: 3,
            budget: None,
        };
        assert_eq!(plain.for_size(8), (5, 20));
        assert_eq!(plain.for_size(1 << 30), (5, 20));
        // run_all.sh full: -w 5 -n 200 -m 3 -B 2G
        let full = IterPolicy {
            iters: 200,
            warmup: 5,
            min_iters: 3,
            budget: Some(2 << 30),
        };
        assert_eq!(full.for_size(8), (5, 200));
        assert_eq!(full.for_size(32 * M), (5, 64));
        assert_eq!(full.for_size(128 * M), (5, 16));
        assert_eq!(full.for_size(256 * M), (4, 8));
        assert_eq!(full.for_size(2048 * M), (1, 3));
        // min above max: bench_common raises max to min
        let odd = IterPolicy {
            iters: 1,
            warmup: 0,
            min_iters: 4,
            budget: Some(1),
        };
        assert_eq!(odd.for_size(1 << 20), (1, 4));
    }
}
