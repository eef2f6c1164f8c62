//! Top-k selection and the top-k compressed allreduce.
//!
//! # Selection
//! [`topk_exact`] partitions the magnitudes (`select_nth_unstable`, O(n), several passes and
//! an 8-byte key per element). [`ThresholdEstimator`] gets the *same* entries in about one
//! pass: it guesses a magnitude threshold — the previous step's, corrected, or one read from a
//! random sample of the vector — collects the candidates above it in one streaming pass, and
//! selects exactly among those few. A wrong guess costs one more pass (too few candidates: a
//! lower threshold; too many: a higher one), never a wrong answer.
//!
//! Order: by magnitude (the f32 bits without the sign, so NaN ranks above infinity and
//! `−0.0` equals `+0.0`), ties broken by the lower index; both selections return the same
//! sorted indices.
//!
//! # The compressed allreduce
//! [`topk_all_reduce`]: each rank adds its residual to its gradient (error feedback), selects
//! its local top-k, the chosen [`SparseAlgo`] sums the ranks' selections (two-phase keeps
//! about the global top-k of the sums, the others keep the whole union), and every rank
//! writes the same dense result. The residual keeps what was not applied: it is cleared
//! only where this rank's entry reached the result.

use chorus_transport::{Result, TransportError};

use super::stream::Stamp;
use super::two_phase::{self, TopkOutcome, TopkPlan};
use super::{
    mag, recursive_doubling, split_allgather, with_counting, Entries, SparseAlgo, SparseResult,
    WireStats,
};
use crate::{CollCtx, ReduceOp};

/// The sort key of element `i` with magnitude bits `m`: ascending keys are descending
/// magnitudes, then ascending indices (for `i < 2³²`).
#[inline]
fn key(m: u32, i: usize) -> u64 {
    ((!m as u64) << 32) | i as u64
}

#[inline]
fn key_index(k: u64) -> u64 {
    k & 0xffff_ffff
}

#[inline]
fn key_mag(k: u64) -> u32 {
    !((k >> 32) as u32)
}

/// Largest length whose indices fit the 32 low bits of a key.
const KEYED_MAX: usize = u32::MAX as usize + 1;

/// The indices of the `k` largest magnitudes of `g` (ties: lower index first), sorted, into
/// `out_idx` (cleared first). `k` above `g.len()` selects everything.
///
/// ```
/// use chorus_algorithms::sparse::topk_exact;
/// let mut idx = Vec::new();
/// topk_exact(&[0.5, -3.0, 2.0, 0.0, 3.0], 2, &mut idx);
/// assert_eq!(idx, [1, 4]);
/// topk_exact(&[1.0, 1.0, 1.0], 2, &mut idx);
/// assert_eq!(idx, [0, 1]);
/// ```
pub fn topk_exact(g: &[f32], k: usize, out_idx: &mut Vec<u64>) {
    out_idx.clear();
    let n = g.len();
    let k = k.min(n);
    if k == 0 {
        return;
    }
    if k == n {
        out_idx.extend(0..n as u64);
        return;
    }
    if n <= KEYED_MAX {
        let mut keys: Vec<u64> = g.iter().enumerate().map(|(i, &v)| key(mag(v), i)).collect();
        keys.select_nth_unstable(k - 1);
        out_idx.extend(keys[..k].iter().map(|&x| key_index(x)));
    } else {
        let mut idx: Vec<u64> = (0..n as u64).collect();
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            mag(g[b as usize]).cmp(&mag(g[a as usize])).then(a.cmp(&b))
        });
        idx.truncate(k);
        out_idx.extend_from_slice(&idx);
    }
    out_idx.sort_unstable();
}

/// Elements per block of the candidate scan: a block's maximum magnitude is computed first
/// (vectorised); only blocks that reach the threshold are scanned element by element.
const BLOCK: usize = 16;

/// Whether an element with magnitude bits `m` passes threshold `t`, as a 0/1 count. Both
/// are below 2³¹, so the comparison is a signed one, which baseline x86-64 (SSE2) vectorises
/// (an unsigned maximum would need SSE4.1).
#[inline]
fn hit(m: u32, t: u32) -> u32 {
    ((m as i32) >= (t as i32)) as u32
}

/// Whether any element of a block passes `t` (a fixed size, so the loop is unrolled and
/// vectorised).
#[inline]
fn block_hits(c: &[f32; BLOCK], t: u32) -> bool {
    c.iter().fold(0u32, |a, &v| a | hit(mag(v), t)) != 0
}

/// Candidate keys, in index order; `buf` keeps a block of room past the cap so a block is
/// stored without checks.
#[derive(Clone, Debug, Default)]
struct Cands {
    buf: Vec<u64>,
    len: usize,
    cap: usize,
}

impl Cands {
    /// Empties it for at most `cap` candidates (the buffer only ever grows).
    fn reset(&mut self, cap: usize) {
        let room = cap.saturating_add(BLOCK);
        if self.buf.len() < room {
            self.buf.resize(room, 0);
        }
        self.len = 0;
        self.cap = cap;
    }

    /// [`Cands::scan`] for a whole block: the mask of a fixed-size block compiles to a vector
    /// compare and a move-mask.
    #[inline]
    fn scan_block(
        &mut self,
        chunk: &[f32; BLOCK],
        base: usize,
        t: &mut u32,
        order: &mut Vec<u64>,
    ) -> bool {
        let mut mask = 0u32;
        for (j, &v) in chunk.iter().enumerate() {
            mask |= hit(mag(v), *t) << j;
        }
        self.store(chunk, mask, base, t, order)
    }

    /// Adds the elements of `chunk` (at `base`) with magnitude bits `≥ t`; then, past the
    /// cap, raises `t` ([`Cands::raise`]). False when that did not help (many equal values).
    fn scan(&mut self, chunk: &[f32], base: usize, t: &mut u32, order: &mut Vec<u64>) -> bool {
        let mut mask = 0u32;
        for (j, &v) in chunk.iter().enumerate() {
            mask |= hit(mag(v), *t) << j;
        }
        self.store(chunk, mask, base, t, order)
    }

    /// Stores the elements of `chunk` whose bit is set in `mask`, one store per set bit.
    #[inline]
    fn store(
        &mut self,
        chunk: &[f32],
        mut mask: u32,
        base: usize,
        t: &mut u32,
        order: &mut Vec<u64>,
    ) -> bool {
        let out = &mut self.buf[self.len..self.len + chunk.len()];
        let mut n = 0;
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            out[n.min(j)] = key(mag(chunk[j]), base + j);
            n += 1;
            mask &= mask - 1;
        }
        self.len += n;
        self.len <= self.cap || self.raise(t, order)
    }

    /// Raises `t` to the magnitude of the `cap/2`-th best candidate and drops those below it,
    /// keeping index order. Exact: every element of the part already scanned that reaches the
    /// new threshold was a candidate. False when equal magnitudes keep more than `3/4` of the
    /// cap.
    fn raise(&mut self, t: &mut u32, order: &mut Vec<u64>) -> bool {
        let keep = (self.cap / 2).max(1);
        order.clear();
        order.extend_from_slice(&self.buf[..self.len]);
        let (_, &mut at, _) = order.select_nth_unstable(keep - 1);
        let nt = key_mag(at).max(*t);
        let mut w = 0;
        for r in 0..self.len {
            let x = self.buf[r];
            if key_mag(x) >= nt {
                self.buf[w] = x;
                w += 1;
            }
        }
        self.len = w;
        *t = nt;
        self.len <= self.cap / 4 * 3
    }

    fn keys(&mut self) -> &mut [u64] {
        &mut self.buf[..self.len]
    }
}

/// Collects the keys of the elements of `p` with magnitude bits `≥ t`, raising `t` whenever
/// more than the cap were collected; false when that did not help.
fn collect(p: &[f32], t: &mut u32, cand: &mut Cands, order: &mut Vec<u64>) -> bool {
    let blocks = p.chunks_exact(BLOCK);
    let tail = blocks.remainder();
    for (b, chunk) in blocks.enumerate() {
        let c: &[f32; BLOCK] = chunk.try_into().unwrap_or(&[0.0; BLOCK]);
        if block_hits(c, *t) && !cand.scan_block(c, b * BLOCK, t, order) {
            return false;
        }
    }
    cand.scan(tail, p.len() - tail.len(), t, order)
}

/// `res += data; data = 0` for one block; returns whether any new value passes `t`.
#[inline]
fn accumulate_block(d: &mut [f32; BLOCK], r: &mut [f32; BLOCK], t: u32) -> bool {
    let mut hits = 0u32;
    for (x, y) in d.iter_mut().zip(r.iter_mut()) {
        *y += *x;
        *x = 0.0;
        hits |= hit(mag(*y), t);
    }
    hits != 0
}

/// `residual += data; data = 0` in one pass, collecting the new residual's candidates like
/// [`collect`] (which stops collecting, not accumulating, when raising did not help).
fn accumulate_collect(
    data: &mut [f32],
    res: &mut [f32],
    t: &mut u32,
    cand: &mut Cands,
    order: &mut Vec<u64>,
) -> bool {
    let mut ok = true;
    let whole = data.len() / BLOCK * BLOCK;
    let (dh, dt) = data.split_at_mut(whole);
    let (rh, rt) = res.split_at_mut(whole);
    for (b, (d, r)) in dh
        .chunks_exact_mut(BLOCK)
        .zip(rh.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let (Ok(d), Ok(r)) = (
            <&mut [f32; BLOCK]>::try_from(d),
            <&mut [f32; BLOCK]>::try_from(r),
        ) else {
            continue; // chunks_exact gives whole blocks
        };
        if accumulate_block(d, r, *t) && ok {
            ok = cand.scan_block(r, b * BLOCK, t, order);
        }
    }
    for (x, y) in dt.iter_mut().zip(rt.iter_mut()) {
        *y += *x;
        *x = 0.0;
    }
    ok && cand.scan(rt, whole, t, order)
}

/// How a pass with the current guess went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum First {
    /// No pass yet.
    NotTried,
    /// At least `k` candidates, at most the cap.
    Enough,
    /// More than the cap.
    TooMany,
    /// Fewer than `k`.
    TooFew,
}

/// Finds the top-k of a vector with a magnitude threshold that is sampled, reused and
/// corrected across steps (see the module documentation). Keep one per tensor: the
/// threshold of one step is the first guess of the next.
///
/// ```
/// use chorus_algorithms::sparse::{topk_exact, ThresholdEstimator};
/// let g: Vec<f32> = (0..10_000).map(|i| ((i * 7919) % 10_007) as f32 - 5000.0).collect();
/// let (mut a, mut b) = (Vec::new(), Vec::new());
/// let mut est = ThresholdEstimator::default();
/// est.select(&g, 100, &mut a);
/// topk_exact(&g, 100, &mut b);
/// assert_eq!(a, b);
/// ```
#[derive(Clone, Debug)]
pub struct ThresholdEstimator {
    /// Magnitude bits to try first.
    threshold: Option<u32>,
    /// The k-th magnitude of the last selection (its growth is extrapolated).
    last_kth: Option<u32>,
    rng: u64,
    cand: Cands,
    /// A copy of the candidates to select in.
    order: Vec<u64>,
    sample: Vec<u32>,
    passes: u32,
    candidates: usize,
}

impl Default for ThresholdEstimator {
    fn default() -> Self {
        ThresholdEstimator::new(0x9e37_79b9_7f4a_7c15)
    }
}

impl ThresholdEstimator {
    /// Candidates collected per kept element when guessing (the target of the corrections):
    /// generous, as too many only cost a compaction during the pass while too few cost
    /// another pass.
    const SLACK: f64 = 1.6;
    /// The same when the guess is read from a sample (noisier: about ±12 % with
    /// [`Self::SAMPLE_HITS`]).
    const SAMPLE_SLACK: f64 = 2.0;
    /// Sampled elements per expected candidate above a sampled threshold.
    const SAMPLE_HITS: f64 = 64.0;

    /// An estimator whose samples are drawn from a generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        ThresholdEstimator {
            threshold: None,
            last_kth: None,
            rng: seed | 1,
            cand: Cands::default(),
            order: Vec::new(),
            sample: Vec::new(),
            passes: 0,
            candidates: 0,
        }
    }

    /// The magnitude it will try first next time, if it has one.
    pub fn threshold(&self) -> Option<f32> {
        self.threshold.map(f32::from_bits)
    }

    /// Passes over the vector the last selection made (1 when the guess was good).
    pub fn last_passes(&self) -> u32 {
        self.passes
    }

    /// Candidates the last selection's final pass collected (`≥ k` when it succeeded).
    pub fn last_candidates(&self) -> usize {
        self.candidates
    }

    /// Forgets the threshold (the next selection samples again).
    pub fn reset(&mut self) {
        self.threshold = None;
        self.last_kth = None;
    }

    /// `next` moved by half the growth of the k-th magnitude since the last selection (in
    /// log scale, clamped to 0.8…1.25): under error feedback the residual's magnitudes drift
    /// from step to step; half, because a guess too high costs a pass, too low only a
    /// compaction.
    fn extrapolate(&mut self, next: u32, kth: u32) -> u32 {
        let g = self
            .last_kth
            .map(|prev| (f32::from_bits(kth) / f32::from_bits(prev)).sqrt())
            .filter(|g| g.is_finite() && *g > 0.0)
            .map_or(1.0, |g| g.clamp(0.8, 1.25));
        self.last_kth = Some(kth);
        scale(next, g)
    }

    /// The indices of the `k` largest magnitudes of `g`, sorted: the same as [`topk_exact`],
    /// usually in one pass.
    pub fn select(&mut self, g: &[f32], k: usize, out_idx: &mut Vec<u64>) {
        self.passes = 0;
        let k = k.min(g.len());
        if !Self::worth_it(g.len(), k) {
            self.exact(g, k, out_idx);
            return;
        }
        let t = match self.threshold {
            Some(t) => t,
            None => self.sample_threshold(g.len(), k, Self::SAMPLE_SLACK, |i| g[i]),
        };
        self.refine(g, k, t, First::NotTried, out_idx);
    }

    /// `residual += data` then `data = 0` (error feedback: the residual becomes the vector to
    /// compress) and the top-k of the new residual into `out_idx`, the first guess checked in
    /// the same pass.
    ///
    /// # Panics
    /// If the lengths differ.
    pub fn select_accumulate(
        &mut self,
        data: &mut [f32],
        residual: &mut [f32],
        k: usize,
        out_idx: &mut Vec<u64>,
    ) {
        assert_eq!(
            data.len(),
            residual.len(),
            "data and residual lengths differ"
        );
        self.passes = 0;
        let n = data.len();
        let k = k.min(n);
        if !Self::worth_it(n, k) {
            for (x, y) in data.iter_mut().zip(residual.iter_mut()) {
                *y += *x;
                *x = 0.0;
            }
            self.exact(residual, k, out_idx);
            return;
        }
        let t = match self.threshold {
            Some(t) => t,
            None => self.sample_threshold(n, k, Self::SAMPLE_SLACK, |i| residual[i] + data[i]),
        };
        let mut t = t;
        self.cand.reset(Self::cap(k));
        let ok = accumulate_collect(data, residual, &mut t, &mut self.cand, &mut self.order);
        self.passes = 1;
        let first = if !ok {
            First::TooMany
        } else if self.cand.len < k {
            First::TooFew
        } else {
            First::Enough
        };
        self.refine(residual, k, t, first, out_idx);
    }

    /// Selecting among candidates pays when they are few; small or dense selections go
    /// straight to [`topk_exact`].
    fn worth_it(n: usize, k: usize) -> bool {
        k > 0 && (4 * BLOCK..=KEYED_MAX).contains(&n) && k.saturating_mul(8) <= n
    }

    /// Candidates at most; raising the threshold during a pass keeps half of it (`≥ k`).
    fn cap(k: usize) -> usize {
        k.saturating_mul(4).saturating_add(1024)
    }

    fn exact(&mut self, p: &[f32], k: usize, out_idx: &mut Vec<u64>) {
        topk_exact(p, k, out_idx);
        self.passes += 1;
        self.candidates = p.len();
        let kth = out_idx.iter().map(|&i| mag(p[i as usize])).min();
        self.threshold = kth.map(|m| scale(m, 0.85));
        self.last_kth = kth;
    }

    /// Collects with `t` (unless the `first` pass already did), moving the guess up or down
    /// until at least `k` and at most the cap are collected; falls back to [`topk_exact`]
    /// after a few tries.
    fn refine(&mut self, p: &[f32], k: usize, mut t: u32, first: First, out_idx: &mut Vec<u64>) {
        let n = p.len();
        let cap = Self::cap(k);
        let mut tried_low = false;
        let mut next = first;
        for _ in 0..5 {
            match next {
                First::Enough => {
                    self.finish(k, t, out_idx);
                    return;
                }
                First::TooMany => {
                    // A higher threshold.
                    let s = self.sample_threshold(n, k, Self::SAMPLE_SLACK, |i| p[i]);
                    t = if s > t { s } else { scale(t, 2.0) };
                }
                // Fewer than k non-zero elements: zeros are part of the top-k.
                First::TooFew if t <= 1 => break,
                First::TooFew => {
                    // A lower one.
                    let f = if tried_low { 3.0 } else { 2.0 };
                    let s = self.sample_threshold(n, k, f, |i| p[i]);
                    t = if s < t { s } else { scale(t, 0.5) };
                    tried_low = true;
                }
                First::NotTried => {}
            }
            self.cand.reset(cap);
            let ok = collect(p, &mut t, &mut self.cand, &mut self.order);
            self.passes += 1;
            next = if !ok {
                First::TooMany
            } else if self.cand.len < k {
                First::TooFew
            } else {
                First::Enough
            };
        }
        if let First::Enough = next {
            self.finish(k, t, out_idx);
            return;
        }
        self.exact(p, k, out_idx);
    }

    /// The exact top-k among the candidates collected with threshold `t` (at least `k`), and
    /// the next guess: the magnitude of the `SLACK·k`-th candidate; when fewer were collected,
    /// interpolated between `(t, candidates)` and `(k-th magnitude, k)` in log–log space.
    ///
    /// The candidates are in index order: the k-th key is found on a copy, and the kept
    /// indices come out of one filtering pass already sorted.
    fn finish(&mut self, k: usize, t: u32, out_idx: &mut Vec<u64>) {
        let c = self.cand.len;
        self.candidates = c;
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.extend_from_slice(self.cand.keys());
        let (_, &mut kth_key, rest) = order.select_nth_unstable(k - 1);
        let kth = key_mag(kth_key);
        let target = ((k as f64 * Self::SLACK) as usize).max(k + 1);
        let next = if c >= target {
            let at = target - k - 1;
            let (_, &mut m, _) = rest.select_nth_unstable(at);
            key_mag(m).max(1)
        } else {
            let (lt, lk) = (
                (f32::from_bits(t) as f64).ln(),
                (f32::from_bits(kth) as f64).ln(),
            );
            let e = (c as f64 / k as f64).ln() / (lt - lk);
            let f = if e.is_finite() && e < -0.1 {
                ((target as f64 / c as f64).ln() / e).exp().clamp(0.5, 1.0)
            } else {
                0.98
            };
            scale(t, f as f32)
        };
        self.threshold = Some(self.extrapolate(next, kth));
        self.order = order;
        out_idx.clear();
        out_idx.extend(
            self.cand
                .keys()
                .iter()
                .filter(|&&x| x <= kth_key)
                .map(|&x| key_index(x)),
        );
    }

    fn next_random(&mut self) -> u64 {
        // xorshift64*
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// The magnitude that about `factor·k` of `n` elements reach, read from a random sample
    /// of `value(i)`.
    fn sample_threshold(
        &mut self,
        n: usize,
        k: usize,
        factor: f64,
        value: impl Fn(usize) -> f32,
    ) -> u32 {
        let s = ((Self::SAMPLE_HITS * n as f64 / k as f64) as usize)
            .clamp(1024.min(n), (n / 4).max(1024.min(n)));
        let mut sample = std::mem::take(&mut self.sample);
        sample.clear();
        for _ in 0..s {
            let i = (((self.next_random() >> 32) * n as u64) >> 32) as usize;
            sample.push(mag(value(i)));
        }
        let pos = ((factor * k as f64 * s as f64 / n as f64).ceil() as usize).clamp(1, s);
        // Descending: the pos-th largest.
        sample.select_nth_unstable_by(pos - 1, |a, b| b.cmp(a));
        let t = sample[pos - 1].max(1);
        self.sample = sample;
        t
    }
}

/// The magnitude bits of `f` times `m`, at least 1 (or `m` if that overflows).
fn scale(m: u32, f: f32) -> u32 {
    let x = f32::from_bits(m) * f;
    if x.is_finite() {
        mag(x).max(1)
    } else {
        m
    }
}

/// Options of [`topk_all_reduce`]; every rank must pass the same.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopkOptions {
    /// The fraction kept: `k = ⌈ratio·n⌉` entries per rank, `0 < ratio ≤ 1`.
    pub ratio: f64,
    /// Add the residual before selecting, keep what was not applied (recommended: top-k is
    /// biased).
    pub error_feedback: bool,
    /// The schedule that sums the selections ([`SparseAlgo::TwoPhase`] by default).
    pub algo: SparseAlgo,
    /// Two-phase: find the global threshold exactly every this many steps (estimated
    /// between; 0: only when the estimate fails).
    pub exact_every: u32,
    /// Two-phase: re-balance the regions every this many steps (0: only at the first).
    pub rebalance_every: u32,
}

impl Default for TopkOptions {
    /// `ratio` 1 %, error feedback, two-phase, exact threshold every 32 steps, re-balanced
    /// every 64 (Ok-Topk's periods).
    fn default() -> Self {
        TopkOptions {
            ratio: 0.01,
            error_feedback: true,
            algo: SparseAlgo::TwoPhase,
            exact_every: 32,
            rebalance_every: 64,
        }
    }
}

/// What [`topk_all_reduce`] keeps between steps for one tensor: the residual, the local
/// threshold estimator and the two-phase regions and global threshold. Every rank's state
/// must have seen the same calls (the step number travels with the data).
#[derive(Clone, Debug, Default)]
pub struct TopkState {
    /// Error feedback: what was not applied yet (empty until the first step with error
    /// feedback; then the tensor's length).
    pub residual: Vec<f32>,
    estimator: ThresholdEstimator,
    plan: TopkPlan,
    step: u64,
    sel_idx: Vec<u64>,
    sel_val: Vec<f32>,
}

impl TopkState {
    /// Forget what a group agreed on (the step count, the threshold estimator, the
    /// two-phase regions and global threshold) and keep the residual: for a tensor whose
    /// next calls run on another communicator, where ranks that come from different groups
    /// with equal step counts would otherwise pass the step check with different thresholds.
    pub fn leave_group(&mut self) {
        *self = TopkState {
            residual: std::mem::take(&mut self.residual),
            ..TopkState::default()
        };
    }

    /// Steps done.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The local selection's estimator.
    pub fn estimator(&self) -> &ThresholdEstimator {
        &self.estimator
    }

    /// The global threshold two-phase will try next, if it has one.
    pub fn global_threshold(&self) -> Option<f32> {
        self.plan.threshold.map(f32::from_bits)
    }

    /// The two-phase region bounds in use (`p + 1` of them; empty before the first step).
    pub fn regions(&self) -> &[u64] {
        &self.plan.bounds
    }
}

/// What one [`topk_all_reduce`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TopkStats {
    /// Bytes this rank moved.
    pub wire: WireStats,
    /// Entries each rank selected.
    pub k: usize,
    /// Non-zero values of the result (the same on every rank).
    pub result_nnz: usize,
    /// Two-phase: whether the global threshold was found exactly this step.
    pub exact_threshold: bool,
}

/// The first word of a top-k stamp.
const KIND_TOPK: u64 = 0x544f_504b;

/// Top-k compressed allreduce of `data` in place: every rank selects the `k = ⌈ratio·n⌉`
/// largest magnitudes of `g + residual` (error feedback) or of `g`, the selections are
/// summed with `opts.algo`, and every rank ends with the same dense result (`op` `Sum`, or
/// `Avg`: divided by the number of ranks in f32), zero where nothing was kept.
///
/// With error feedback the residual becomes `g + residual`, then is cleared where this rank's
/// entry reached the result. [`SparseAlgo::TwoPhase`] keeps about `k` of the summed entries
/// (the global top-k; exactly when its threshold is exact); the other schedules keep the
/// whole union of the selections.
///
/// Errors: [`TransportError::InvalidArgument`] (nothing sent or changed) for an op other than
/// `Sum`/`Avg`, a ratio outside `(0, 1]`, or a residual of another length; otherwise those
/// of [`super::sparse_all_reduce`] (ranks with another `n`, other options or a state at
/// another step fail on every rank). After a transport error `data` and `state` are
/// unspecified.
pub fn topk_all_reduce(
    ctx: &mut CollCtx<'_>,
    data: &mut [f32],
    op: ReduceOp,
    opts: &TopkOptions,
    state: &mut TopkState,
) -> Result<TopkStats> {
    let invalid = |m: String| TransportError::InvalidArgument(format!("topk_all_reduce: {m}"));
    if !matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Err(invalid(format!("reduction {op} (only sum and avg)")));
    }
    if !(opts.ratio.is_finite() && opts.ratio > 0.0 && opts.ratio <= 1.0) {
        return Err(invalid(format!("ratio {} is not in (0, 1]", opts.ratio)));
    }
    let n = data.len();
    if opts.error_feedback {
        if state.residual.is_empty() {
            state.residual = vec![0.0; n];
        } else if state.residual.len() != n {
            return Err(invalid(format!(
                "the state's residual has {} elements, the tensor {n} (one state per tensor)",
                state.residual.len()
            )));
        }
    }
    let size = ctx.transport.size();
    let k = k_of(opts.ratio, n);
    let step = state.step;
    let exact_due = step == 0 || (opts.exact_every > 0 && step % opts.exact_every as u64 == 0);
    let rebalance_due =
        step == 0 || (opts.rebalance_every > 0 && step % opts.rebalance_every as u64 == 0);
    let stamp = Stamp::new(
        n as u64,
        &[
            KIND_TOPK,
            opts.algo.id(),
            k as u64,
            op as i32 as u64,
            step,
            opts.exact_every as u64,
            opts.rebalance_every as u64,
            u64::from(opts.error_feedback),
        ],
    );
    let TopkState {
        residual,
        estimator,
        plan,
        sel_idx,
        sel_val,
        ..
    } = state;
    // 1. The local top-k of g + residual (the residual becomes that sum, data zero) or of g.
    let p: &[f32] = if opts.error_feedback {
        estimator.select_accumulate(data, residual, k, sel_idx);
        residual
    } else {
        estimator.select(data, k, sel_idx);
        data
    };
    sel_val.clear();
    sel_val.extend(sel_idx.iter().map(|&i| p[i as usize]));
    // 2. Sum the selections.
    let entries = Entries {
        n: n as u64,
        idx: sel_idx,
        val: sel_val,
    };
    let bound = k as u64;
    let (out, wire) = with_counting(ctx, |c| {
        let whole = |result| TopkOutcome {
            result,
            threshold: 0,
            exact: true,
        };
        match opts.algo {
            SparseAlgo::RecursiveDoubling => {
                recursive_doubling::run(c, stamp, entries, bound).map(whole)
            }
            SparseAlgo::SplitAllgather => split_allgather::run(c, stamp, entries, bound).map(whole),
            SparseAlgo::TwoPhase => {
                let kth = sel_val.iter().map(|&v| mag(v)).min().unwrap_or(0);
                two_phase::topk(
                    c,
                    stamp,
                    entries,
                    kth,
                    bound,
                    plan,
                    exact_due,
                    rebalance_due,
                )
            }
        }
    })?;
    // 3. The result, the same on every rank.
    if !opts.error_feedback {
        data.fill(0.0);
    }
    let div = (op == ReduceOp::Avg).then_some(size as f32);
    let finish = |v: f32| div.map_or(v, |d| v / d);
    match &out.result {
        SparseResult::Sparse(v) => {
            for (&i, &x) in v.indices.iter().zip(&v.values) {
                data[i as usize] = finish(x);
            }
        }
        SparseResult::Dense(d) => {
            for (o, &x) in data.iter_mut().zip(d) {
                *o = finish(x);
            }
        }
    }
    // 4. Error feedback: clear where this rank's entry reached the result (its sum there
    //    passed the threshold).
    if opts.error_feedback {
        let t = out.threshold;
        match &out.result {
            // No threshold (the union schedules): every selected entry went into the sum,
            // also where it cancelled to zero, which a sparse result leaves out.
            _ if t == 0 => {
                for &i in sel_idx.iter() {
                    residual[i as usize] = 0.0;
                }
            }
            SparseResult::Dense(d) => {
                for &i in sel_idx.iter() {
                    if mag(d[i as usize]) >= t {
                        residual[i as usize] = 0.0;
                    }
                }
            }
            SparseResult::Sparse(v) => {
                let mut j = 0;
                for &i in sel_idx.iter() {
                    while j < v.indices.len() && v.indices[j] < i {
                        j += 1;
                    }
                    if j < v.indices.len() && v.indices[j] == i && mag(v.values[j]) >= t {
                        residual[i as usize] = 0.0;
                    }
                }
            }
        }
    }
    // NaN and ±∞ rank above every finite magnitude, so the selection holds one whenever the
    // accumulated values do. They went into this call's result (as in a dense allreduce);
    // those it could not carry (more than k) must not reach the next calls.
    if opts.error_feedback && sel_val.iter().any(|v| !v.is_finite()) {
        residual
            .iter_mut()
            .filter(|r| !r.is_finite())
            .for_each(|r| *r = 0.0);
    }
    state.step += 1;
    Ok(TopkStats {
        wire,
        k,
        result_nnz: out.result.nnz(),
        exact_threshold: out.exact,
    })
}

/// How many entries top-k keeps of `n` at `ratio`: ⌈ratio·n⌉, at least 1 (none of none), at
/// most `n`. The product's rounding error (0.07 × 100 is 7.000000000000001 in binary) is
/// taken off first, so that a ratio that names a whole count gives that count.
pub fn k_of(ratio: f64, n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let x = ratio * n as f64;
    // A few units in the last place of x: far below 1 for any n a tensor can have.
    let x = x - x.abs() * 4.0 * f64::EPSILON;
    (x.ceil() as usize).clamp(1, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaving_a_group_keeps_the_residual_only() {
        let mut s = TopkState {
            residual: vec![1.5; 4],
            step: 9,
            ..TopkState::default()
        };
        s.estimator.threshold = Some(77);
        s.plan.bounds = vec![0, 2, 4];
        s.plan.threshold = Some(5);
        s.sel_idx = vec![1];
        s.leave_group();
        assert_eq!(s.residual, [1.5; 4]);
        assert_eq!(
            (s.step, s.estimator.threshold, s.plan.threshold),
            (0, None, None)
        );
        assert!(s.plan.bounds.is_empty() && s.sel_idx.is_empty());
    }
    use proptest::prelude::*;

    fn reference(g: &[f32], k: usize) -> Vec<u64> {
        let mut idx: Vec<u64> = (0..g.len() as u64).collect();
        idx.sort_by(|&a, &b| mag(g[b as usize]).cmp(&mag(g[a as usize])).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_unstable();
        idx
    }

    #[test]
    fn k_is_the_ratio_of_n_rounded_up_without_binary_noise() {
        assert_eq!(
            k_of(0.07, 100),
            7,
            "0.07 × 100 is 7.000000000000001 in binary"
        );
        assert_eq!(k_of(0.07, 101), 8);
        assert_eq!(k_of(0.5, 3), 2);
        assert_eq!(k_of(0.01, 1000), 10);
        assert_eq!(k_of(0.01, 1001), 11);
        assert_eq!(k_of(1e-9, 10), 1, "at least one");
        assert_eq!(k_of(0.3, 0), 0, "none of none");
        assert_eq!(k_of(1.0, 1 << 40), 1 << 40, "the whole of a large tensor");
        assert_eq!(k_of(0.5, (1 << 40) + 1), (1 << 39) + 1);
        // Every ratio in hundredths names its count exactly where the product is whole.
        for h in 1..=100u32 {
            for n in [100usize, 1000, 12_300, 1_048_600] {
                let whole = n / 100 * h as usize;
                assert_eq!(
                    k_of(f64::from(h) / 100.0, n),
                    whole.max(1),
                    "{h}/100 of {n}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn exact_matches_sorting(
            g in proptest::collection::vec(-100i32..100, 0..400),
            k in 0usize..450,
        ) {
            // Small integers: many ties, broken by index.
            let g: Vec<f32> = g.into_iter().map(|x| x as f32 / 4.0).collect();
            let mut idx = Vec::new();
            topk_exact(&g, k, &mut idx);
            prop_assert_eq!(&idx, &reference(&g, k));
            let mut est = ThresholdEstimator::new(k as u64);
            let mut e = Vec::new();
            est.select(&g, k, &mut e);
            prop_assert_eq!(&e, &idx);
        }

        #[test]
        fn estimator_matches_exact_on_large_vectors(
            seed in any::<u64>(), k in 1usize..300, scale_exp in -20i32..20,
        ) {
            let mut est = ThresholdEstimator::new(seed);
            let mut rng = seed | 1;
            let g: Vec<f32> = (0..5000).map(|_| {
                rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
                ((rng >> 40) as f32 - 8_388_608.0) * 2f32.powi(scale_exp)
            }).collect();
            let (mut a, mut b) = (Vec::new(), Vec::new());
            // Twice: a sampled guess, then the corrected one.
            for _ in 0..2 {
                est.select(&g, k, &mut a);
                topk_exact(&g, k, &mut b);
                prop_assert_eq!(&a, &b);
            }
        }
    }

    #[test]
    fn special_values() {
        let g = [f32::NAN, 1.0, f32::INFINITY, -0.0, 0.0, -5.0];
        let mut idx = Vec::new();
        topk_exact(&g, 3, &mut idx);
        assert_eq!(idx, [0, 2, 5]);
        // Fewer non-zeros than k: zeros by index.
        topk_exact(&[0.0, 2.0, 0.0, 0.0], 2, &mut idx);
        assert_eq!(idx, [0, 1]);
        let mut big = vec![0.0f32; 1000];
        big[500] = 1.0;
        let mut est = ThresholdEstimator::default();
        est.select(&big, 10, &mut idx);
        assert_eq!(idx, reference(&big, 10));
    }

    fn gaussianish(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                let mut acc = 0.0;
                for _ in 0..4 {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    acc += (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                }
                acc
            })
            .collect()
    }

    #[test]
    fn estimator_converges_to_one_pass() {
        let n = 200_000;
        let k = n / 100;
        let mut est = ThresholdEstimator::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut passes = Vec::new();
        for step in 0..6 {
            // Similar vectors from step to step, as gradients are.
            let g = gaussianish(n, 1 + step);
            est.select(&g, k, &mut a);
            topk_exact(&g, k, &mut b);
            assert_eq!(a, b, "step {step}");
            passes.push(est.last_passes());
            assert!(est.last_candidates() >= k);
            assert!(est.last_candidates() <= ThresholdEstimator::cap(k));
        }
        // After the first guess, one pass per step with a few candidates per kept element.
        assert!(passes[1..].iter().all(|&p| p == 1), "{passes:?}");
        assert!(est.last_candidates() < 2 * k, "{}", est.last_candidates());
    }

    #[test]
    fn accumulate_matches_two_passes() {
        let n = 50_000;
        let k = 500;
        let mut est = ThresholdEstimator::default();
        let mut residual = vec![0.0f32; n];
        for step in 0..4 {
            let g = gaussianish(n, 10 + step);
            let mut want_r: Vec<f32> = residual.iter().zip(&g).map(|(r, x)| r + x).collect();
            let mut want = Vec::new();
            topk_exact(&want_r, k, &mut want);
            let mut data = g.clone();
            let mut got = Vec::new();
            est.select_accumulate(&mut data, &mut residual, k, &mut got);
            assert_eq!(got, want);
            assert_eq!(residual, want_r);
            assert!(data.iter().all(|&x| x == 0.0));
            // Clear what was "sent", like error feedback does.
            for &i in &got {
                want_r[i as usize] = 0.0;
                residual[i as usize] = 0.0;
            }
        }
        assert_eq!(est.last_passes(), 1);
    }
}
