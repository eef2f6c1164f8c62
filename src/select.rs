//! Choosing the allreduce schedule: a cost table filled once per communicator, cheapest entry
//! wins (NCCL's tuning model).
//!
//! # The table
//! One row per power-of-two message size (`2^0 … 2^48` bytes), one column per
//! [`Algorithm`]: the modelled time [`Algorithm::cost`] of that schedule over this
//! communicator's ranks and link. A call of `n` bytes uses the row of the next power of two
//! `≥ n` and the cheapest allowed column.
//!
//! # The link (α, β)
//! - **measured** at init by a short probe over the communicator's own transport ([`probe`]):
//!   every rank exchanges messages with its ring neighbours — small ones for the latency α,
//!   256 KiB ones for the per-byte time β — then the ranks agree on the largest (slowest)
//!   figures, so every rank fills the same table and picks the same schedule. Bounded: a few
//!   dozen messages, well under 50 ms on loopback or a gigabit link;
//! - or **configured** with `CHORUS_ALPHA_US` (microseconds per message) and `CHORUS_BETA_GBPS`
//!   (GB/s, 1 GB = 1e9 bytes), or in code with `Config::alpha_us` and `Config::beta_gbps`
//!   (which win over the variables); a figure that is set replaces the measured one, and with
//!   both set no probe runs.
//!
//! # Overrides
//! `CHORUS_ALGO` edits the table in NCCL's grammar ([`AlgoFilter::parse`]): `ring,tree` allows
//! only those, `^ring` everything but the ring (and the double tree, which only a list naming
//! it allows), `allreduce:^ring;broadcast:tree` scopes a list
//! to one collective (lists for other collectives are left to them). `AllReduceOptions::
//! algorithm` forces a schedule for one call. With `CHORUS_DEBUG=INFO` rank 0 logs the link and
//! which schedule covers which sizes.
//!
//! # Online tuning
//! The α–β model ranks the schedules well at the extremes but misses by up to 2× in between
//! (kernel buffers, segment pipelining, wake-ups on oversubscribed cores are not in it). So the
//! table is only the prior: unless `CHORUS_TUNE=0` (or `off`), the first allreduce of every
//! size bucket (power of two, as the table's rows) times the allowed schedules (for large
//! buckets only those the model puts within [`PLAUSIBLE`]× of its cheapest, or
//! [`PLAUSIBLE_CPU_BOUND`]× when some host runs more ranks than it has cores, and within
//! [`PLAUSIBLE`]× of the least work all ranks then share the cores for) and the bucket keeps
//! the fastest one.
//! - **Small buckets** (up to [`DEDICATED_MAX_BYTES`]): the first call runs dedicated trials
//!   (of every allowed schedule; where the model puts the bucket in the bandwidth-bound range,
//!   of those within [`DEDICATED_PLAUSIBLE`]× of its cheapest) on a zeroed buffer of its size
//!   (and a second one as the source when the call is out of place) before doing the caller's
//!   work: each candidate once
//!   untimed, then back-to-back repetitions (up to [`TRIAL_PASS_REPS`], as many as fit in
//!   [`TRIAL_PASS_TIME`]; on links where the bytes matter, enough to carry
//!   [`TRIAL_BLOCK_BYTES`] as far as that time allows, so that a link's burst allowance does
//!   not time a schedule faster than its loop: [`Selector::min_block_calls`]), in
//!   interleaved passes (as many as fit [`TRIAL_TIME`], at
//!   most [`TRIAL_MAX_PASSES`], and at least [`TRIAL_MIN_PASSES`] where they fit
//!   [`TRIAL_MAX_TIME`]). The model sizes the first pass; the ranks agree on its times (the
//!   largest of each candidate's) and those size the rest ([`TrialPlan::after_first_pass`]),
//!   so the trials' time holds whatever the probe measured;
//!   a candidate's time is the median over passes of the mean run of a pass (a loop of calls
//!   sees the mean; the median drops disturbed passes either way). Where the model sized
//!   the first pass shorter than the later ones for some candidate and at least two passes
//!   follow, the first pass is left out for every candidate (and at least
//!   [`TRIAL_MIN_PASSES`] follow it where they fit [`TRIAL_MAX_TIME`]): its few runs per
//!   candidate are sized by what the probe misjudged, and the first runs of a schedule at a
//!   new size are slow. Short passes let the
//!   candidates sample the same spells of a crowded host; passes much shorter than that miss
//!   how a schedule runs in a loop. Only that first call is slower: a few dozen milliseconds
//!   for latency-bound buckets, a few hundred for the largest.
//! - **Large buckets**: the caller's own calls are the trials, one call or one block per
//!   candidate (at most
//!   [`ONLINE_CANDIDATES`] unless some host runs more ranks than cores, when every plausible
//!   one is tried, each in a block of an untimed call and [`ONLINE_CPU_BOUND_RUNS`] timed
//!   ones, the fastest of which counts; worst modelled first so that the calls after the
//!   trials follow a likely winner), so nothing is run twice; the bucket is decided after
//!   the last trial.
//!   Before the first, every candidate runs once untimed on a zeroed buffer of at most
//!   [`DEDICATED_MAX_BYTES`] (so that no candidate pays for connections that have not
//!   carried bulk data yet), and the communicator's scratch memory is grown to the buffer's
//!   size (so that no candidate pays for it); after the decision a winner that did not run
//!   last runs once more the same way (TCP restarts the window of a connection left idle,
//!   and the winner's sat idle through the last trial).
//! - **Tied large buckets**: on links (no host runs more ranks than cores), where the model
//!   puts every plausible candidate of a large bucket within [`MODEL_TIE`] of its cheapest
//!   (typically the ring and halving-doubling at a power of two: the same bytes, a few α
//!   apart), no trials run: one call of each cannot tell them apart, and the switch costs.
//!   The bucket takes the schedule of the nearest smaller bucket within [`INHERIT_SPAN`] rows
//!   that is decided on one of the tied (by its trials, or by such a tie in turn): on the
//!   1 gbit testbed the 2 MiB bucket's trials put halving-doubling 16 % behind the ring, and
//!   8 MiB, tied, then ran the model's halving-doubling at 113 MB/s against the ring's 119.
//!   With no such bucket the model's cheapest at the call's size stands.
//!
//! - **Revisits**: which schedule wins can change after the trials (another job takes the
//!   cores, ranks sharing a core fall into another rhythm, a link gets busier), and short
//!   trials can pick the loser of two close schedules. So the schedules the trials timed within
//!   [`RIVAL_WITHIN`]× of the winner stay its rivals (on links in buckets with dedicated trials
//!   where the latency weighs more than the bytes, and in every bucket when some host runs
//!   more ranks than cores: [`Selector::revisits`]), and the
//!   bucket re-times them on the
//!   caller's calls: after [`REVISIT_FIRST_GAP`] blocks of calls, a block of the next rival's
//!   calls, then a block of the bucket's schedule (a block lasts about [`REVISIT_BLOCK`],
//!   [`REVISIT_MIN_WINDOW`] to [`REVISIT_MAX_WINDOW`] calls; the first call of each is not
//!   timed, as the schedule changes there). The ranks agree on the two mean times (one
//!   16-byte allreduce), and the rival's time over the schedule's joins that rival's
//!   evidence (its last
//!   [`REVISIT_EVIDENCE`] ratios). One pair of blocks decides nothing where ranks share cores:
//!   a schedule's blocks there vary up to 2× within one run as the ranks fall in and out of
//!   step. So a rival takes over only when the median of at least [`REVISIT_CONFIRM`] ratios,
//!   most of them wins, puts it faster by more than [`REVISIT_MARGIN`] (the old schedule then
//!   becomes the rival revisited next, with the same evidence inverted; the other rivals' is
//!   forgotten, as it was against the old schedule). A revisit that favours the rival without
//!   that confirmation retimes the same rival after the first gap; otherwise the gap to the
//!   next revisit doubles (up to [`REVISIT_MAX_GAP`] blocks) and a rival whose median is
//!   slower than [`RIVAL_DROP`]× over at least [`RIVAL_DROP_AFTER`] ratios is dropped. The
//!   cost is a block of a slower rival now and then, a share that halves with every revisit
//!   that keeps the schedule; a bucket with no rival left is settled for good. Every gap is
//!   also long enough for the revisit after it to cost at most [`REVISIT_BUDGET`] of the calls'
//!   time, by the rival's expected ratio (its evidence so far; [`UNSEEN_RIVAL_RATIO`] before
//!   its first revisit): rivals that may win are re-timed soon, rivals far behind rarely, and
//!   a short loop of calls does not pay for blocks of a slow rival. Every call of a
//!   revisit is the caller's own and its result is as exact as any schedule's, but sums of
//!   floating-point values may differ in the last bits from call to call when the schedule
//!   changes (force one schedule, or `CHORUS_TUNE=0`, for bitwise repeatable results).
//! - **Neighbours**: a large bucket whose trials put the winner ahead of every other candidate
//!   by at least [`INHERIT_LEAD`]× passes that schedule on: a fresh large bucket within
//!   [`INHERIT_SPAN`] rows of it (a factor of 4 in size) takes it without trials, as long as
//!   its own trials would have tried it, and passes it on in turn. Above [`DEDICATED_MAX_BYTES`] the calls are
//!   bandwidth-bound and a wide lead does not flip within a few rows, while trials there cost
//!   most: on 4 ranks sharing 2 cores, a 64 MiB loop of 32 calls spent about a tenth of its
//!   time on the trial calls of schedules 1.6× slower than the ring that won them. Close
//!   decisions pass nothing on this way (tied buckets take theirs, above).
//!
//! Every rank times the same trials; the per-rank figures of every candidate are then
//! allreduced with `max`, so every rank holds the same vector and picks the same schedule.
//! The model's choice stays unless another beat it by more than [`KEEP_MODEL_MARGIN`] while
//! the model put it more than that margin behind (schedules the model cannot tell apart, such
//! as the ring and halving-doubling on large messages where ranks share cores, are decided by
//! the trials, unless those put them within [`TRIAL_TIE`] of each other).
//! Ranks that disagree about `CHORUS_TUNE` fail init. Trials, a revisit's rival calls and the
//! agreements carry their own collective kinds in the tag, so ranks that disagree about tuning
//! (`Communicator::set_tuning` on some ranks, or different counts in one call) fail with a
//! mismatch instead of mixing messages; in buckets with no trial calls
//! (tied large buckets, buckets with one candidate) such ranks may run different schedules,
//! whose step tags differ, and fail by a tag mismatch or at the timeout. Forced schedules
//! (`CHORUS_ALGO` naming one, or the option) are never tuned. `CHORUS_DEBUG=INFO` logs every
//! decision and every revisit with the times measured.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use chorus_algorithms::allreduce::{self, Algorithm};
use chorus_algorithms::cost::Link;
use chorus_algorithms::{CollCtx, DType, ReduceOp};
use chorus_transport::{Result as TResult, TransportError};

use crate::algo_spec::AlgoSpec;
use crate::comm::{Call, CollKind, Communicator};
use crate::error::CommError;
use crate::log::{self, Level};
use crate::tune_file::Decision;

/// Rows of the cost table: message sizes `2^0 … 2^(ROWS−1)` bytes.
pub const ROWS: usize = 49;

/// Small messages exchanged by the probe (the first [`PROBE_WARMUP`] are not timed).
const PROBE_SMALL: usize = 12;
/// Large messages exchanged by the probe (the first [`PROBE_WARMUP`] are not timed).
const PROBE_LARGE: usize = 3;
/// Untimed warm-up exchanges of each kind.
const PROBE_WARMUP: usize = 1;
/// Bytes of the probe's small messages.
const PROBE_SMALL_BYTES: usize = 8;
/// Bytes of the probe's large messages.
const PROBE_LARGE_BYTES: usize = 256 * 1024;

/// Schedules the model puts within this factor of its cheapest are tried on the caller's calls
/// (large buckets; on links not when the model ties them, [`MODEL_TIE`]). Large messages are
/// bandwidth-bound, where the model is reliable: the ring and halving-doubling tie, the tree
/// and recursive doubling move a third more bytes. Trying
/// those on the caller's data would cost a slow call and, on a real link, a congestion
/// episode that slows the calls after it.
pub const PLAUSIBLE: f64 = 1.25;
/// [`PLAUSIBLE`] when a host runs more ranks than it has cores: transfers are then bound by
/// the CPU (kernel copies, reductions and wake-ups of ranks sharing a core), not by the link
/// the α–β model describes, and a schedule the model puts behind (the pipelined tree, on 4
/// ranks sharing 2 cores) can win on large messages. Those candidates are then also held to
/// [`PLAUSIBLE`]× the least work all ranks share the cores for ([`Algorithm::host_work`]):
/// the tree does the ring's, recursive doubling 16/9 of it on 4 ranks (its forced runs took
/// 1.5–1.8× the ring's time at 8–64 MiB on 4 ranks sharing 2 cores, and its untimed and two
/// timed trial calls cost a 64 MiB loop of 37 calls about 5 %).
pub const PLAUSIBLE_CPU_BOUND: f64 = 3.0;
/// Dedicated trials of a bucket the model puts in the bandwidth-bound range (the best
/// schedule's modelled time more than [`BANDWIDTH_BOUND`]× its latency part) leave out the schedules it puts
/// more than this factor behind, as the caller's trials of large buckets do on links. There
/// the model ranks by bytes moved, which it knows; and a schedule that moves far more bytes
/// disturbs the others' trials: on 4 ranks sharing 2 cores, the ring's 2 MiB trial took
/// 1.9–2.2 ms beside the tree and 4.0–4.1 ms beside recursive doubling (which exchanges the
/// whole buffer at every step), against 1.8–2.5 ms in a loop, and lost its trials to schedules
/// 20–35 % slower in loops. Latency-bound buckets try every schedule: the model misranks them
/// (it puts the tree 2× behind recursive doubling at 8 B, where the two measure within 10 %).
pub const DEDICATED_PLAUSIBLE: f64 = PLAUSIBLE;
/// A bucket is bandwidth-bound ([`Selector::bandwidth_bound`]) when the model's cheapest
/// schedule takes more than this factor of its latency part: where the bytes dominate by an
/// order of magnitude. Near the crossover the model's ranking hangs on the probe's α, which
/// varies 4× from launch to launch where ranks share cores: on 4 ranks sharing 2 cores,
/// with a factor of 2, 32 KiB counted as bandwidth-bound when the probe read α ≈ 9 µs and
/// its trials left out recursive doubling and the tree, the two fastest there in loops
/// (58 and 73 µs against halving-doubling's 92).
pub const BANDWIDTH_BOUND: f64 = 16.0;
/// Largest bucket tuned with dedicated trials; larger ones tune on the caller's calls (unless
/// the model ties their candidates on links, [`MODEL_TIE`]).
pub const DEDICATED_MAX_BYTES: usize = 4 << 20;
/// Time of the dedicated trials of one bucket (the first pass modelled, the rest as measured).
pub const TRIAL_TIME: Duration = Duration::from_millis(100);
/// Time the dedicated trials of one bucket may take to run [`TRIAL_MIN_PASSES`] (as
/// [`TRIAL_TIME`]).
pub const TRIAL_MAX_TIME: Duration = Duration::from_millis(300);
/// Time of one candidate's timed repetitions in one pass of dedicated trials (as
/// [`TRIAL_TIME`]).
pub const TRIAL_PASS_TIME: Duration = Duration::from_millis(20);
/// Most timed repetitions of one candidate in one pass of dedicated trials (after one untimed).
/// Where ranks share cores, a schedule's speed shifts with how their turns fall, in spells of
/// a few milliseconds; short passes, interleaved, let every candidate sample the same spells.
/// Shorter runs mislead: on 4 ranks sharing 2 cores, out-of-place 2 MiB blocks of 2 calls
/// put halving-doubling level with the ring or ahead, blocks of 10 or more put the ring
/// 20-35 % ahead, as in a loop of calls.
pub const TRIAL_PASS_REPS: usize = 8;
/// Bytes of the buffer a candidate's block of trial calls, and a block of a revisit, carries
/// at least on links where the bytes matter ([`Selector::min_block_calls`]), as far as
/// [`TRIAL_PASS_TIME`] allows. A link that takes bursts faster than its rate (a token-bucket
/// shaper, a switch's buffers) serves a short block at the burst's speed when the blocks
/// around it left the link idle: on the 1 gbit testbed (4 hosts, `tc tbf` burst 128 KiB), 8
/// KiB blocks of 8 calls timed recursive doubling at 69–79 µs and halving-doubling at 114,
/// blocks of 100 calls 137 and 113 µs, as in a loop of calls; trials of 8-call blocks picked
/// the tree or recursive doubling and the loop ran 15–20 % behind halving-doubling.
pub const TRIAL_BLOCK_BYTES: usize = 1 << 20;
/// Fewest passes of dedicated trials counted in the median (the median needs a few): where
/// the first pass is left out ([`drop_first_pass`]), this many follow it as far as they fit
/// [`TRIAL_MAX_TIME`]. On the 4-host 1 gbit testbed, 8 KiB trials of 128-call blocks fit 3
/// passes; with the first left out, halving-doubling's median was the mean of a slow block
/// and a fast one (its first blocks at a new size run slow: 174.6 and 118.3 µs, where it
/// runs 116-120 in a loop), and the trials picked recursive doubling or the tree (129-138).
pub const TRIAL_MIN_PASSES: usize = 3;
/// Most passes of dedicated trials.
pub const TRIAL_MAX_PASSES: usize = 20;
/// A large bucket on links (no host runs more ranks than cores) whose plausible schedules the
/// model puts within this fraction of each other takes the model's choice without trials on
/// the caller's calls. There the schedules left (typically the ring and halving-doubling, at a
/// power of two) move the same bytes and differ by a few α in seconds of transfer; one timed
/// call of each cannot tell them apart, and the trial costs a switch of schedule. On the 4-host
/// 1 gbit testbed, forced, both ran at 119 MB/s at 8, 32 and 64 MiB (medians of 15 launches,
/// two runs); the one-call trials split between them (8 MiB: ring 9, halving-doubling 6 of
/// 15); and the trial cost a 64 MiB block of 3 timed calls 3 % (115.9 MB/s against the
/// forced ring's 119.4).
pub const MODEL_TIE: f64 = 0.01;
/// Most candidates of a bucket tuned on the caller's calls (no cap when some host runs more
/// ranks than cores: the model's ranking is weakest there).
pub const ONLINE_CANDIDATES: usize = 3;
/// Timed calls of each candidate of a bucket tuned on the caller's calls when some host runs
/// more ranks than cores, after one untimed call (on links: one call, timed). There the first
/// call of a schedule after another runs slow and by how much varies: on 4 ranks sharing
/// 2 cores, 8 MiB single-call trials timed the ring at 17.6–28.0 ms against 10.1–13.6 ms in
/// loops, put it 1.5× behind halving-doubling (12.7–14.9 ms in loops) and out of the rivals.
pub const ONLINE_CPU_BOUND_RUNS: usize = 2;
/// A schedule that measured faster than the model's choice replaces it only when it is faster
/// by more than this fraction.
pub const KEEP_MODEL_MARGIN: f64 = 0.05;
/// Trial times this close (a fraction) count as a tie, which the model's order breaks: on the
/// 1 gbit testbed the ring and halving-doubling at 128 KiB ran within 0.2 % of each other in
/// loops, the trials picked either by their noise (the ring in 6 of 10 launches), and the
/// ring's extra messages put 0.08 % more bytes on the link per call.
pub const TRIAL_TIE: f64 = 0.01;
/// After a bucket is decided, the schedules its trials timed within this factor of the winner
/// stay its rivals: they are re-timed now and then on the caller's calls (revisits; see the
/// module docs).
pub const RIVAL_WITHIN: f64 = 1.5;
/// A rival whose revisits put it slower than this factor of the bucket's schedule (the median
/// of at least [`RIVAL_DROP_AFTER`] ratios) is dropped (not revisited again).
pub const RIVAL_DROP: f64 = 1.3;
/// Revisits of a rival before it can be dropped.
pub const RIVAL_DROP_AFTER: usize = 3;
/// A rival replaces the bucket's schedule when its revisits (the median of at least
/// [`REVISIT_CONFIRM`] ratios, most of them wins) put it faster by more than this fraction.
pub const REVISIT_MARGIN: f64 = 0.03;
/// Revisits of a rival before it can take over.
pub const REVISIT_CONFIRM: usize = 2;
/// Ratios kept per rival (the latest).
pub const REVISIT_EVIDENCE: usize = 5;
/// Time of one block of a revisit (the rival's calls, then as many of the bucket's schedule),
/// from the decided schedule's trial time; a block has [`REVISIT_MIN_WINDOW`] to
/// [`REVISIT_MAX_WINDOW`] calls.
pub const REVISIT_BLOCK: Duration = Duration::from_millis(10);
/// Fewest calls in one block of a revisit: the first is not timed, then as many as a pass of
/// dedicated trials ([`TRIAL_PASS_REPS`]): a few timed calls of a schedule whose calls vary by
/// 2× (ranks sharing cores) decide nothing, and short blocks miss how it runs in a loop.
pub const REVISIT_MIN_WINDOW: usize = TRIAL_PASS_REPS + 1;
/// Most calls in one block of a revisit.
pub const REVISIT_MAX_WINDOW: usize = 16;
/// Calls of a bucket between its decision and its first revisit, in blocks; the gap doubles
/// after every revisit that keeps the schedule (up to [`REVISIT_MAX_GAP`] blocks) and starts
/// again from here after one that switches.
pub const REVISIT_FIRST_GAP: usize = 4;
/// Longest gap between revisits, in blocks.
pub const REVISIT_MAX_GAP: usize = 1024;
/// Share of a bucket's call time that revisits may spend on rivals slower than its schedule,
/// by the rivals' expected ratios: a revisit of a rival expected `r`× as slow costs about
/// `window · (r − 1)` calls' time, so it waits at least `window · (r − 1) / REVISIT_BUDGET`
/// calls after the last revisit (and at least the doubling gap). Close rivals, the ones that
/// may win, are re-timed often; far ones rarely. Without the budget the first revisits came
/// after 4 blocks whatever the rival's cost: on the 4-host testbed a 200-call 8-byte loop
/// spent ~8 % of its time in 16-call blocks of a rival 1.8× slower.
pub const REVISIT_BUDGET: f64 = 0.04;
/// The expected ratio of a rival not revisited yet: as slow as the trials let a rival be
/// ([`RIVAL_WITHIN`]), not its trial ratio, which short trials under-estimate (on the
/// testbed, 8 B: halving-doubling 1.09× recursive doubling's time in the trials, 1.83× in its
/// first revisit).
pub const UNSEEN_RIVAL_RATIO: f64 = RIVAL_WITHIN;

/// The lead (the next fastest candidate's trial time over the winner's) with which a large
/// bucket's decision passes on to fresh large buckets near it (module docs, *Neighbours*).
/// Short trials misread a schedule by up to 1.75× now and then on crowded hosts, but the ring's
/// leads of 1.4–1.9× at 8–64 MiB on 4 ranks / 2 cores repeat launch after launch.
pub const INHERIT_LEAD: f64 = 1.3;
/// How many rows (powers of two) away a bucket's decision passes on.
pub const INHERIT_SPAN: usize = 2;

/// Which allreduce schedules `CHORUS_ALGO` allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlgoFilter {
    allowed: [bool; Algorithm::ALL.len()],
}

impl Default for AlgoFilter {
    /// Everything allowed except the double binary tree, which runs only when `CHORUS_ALGO`
    /// or an option names it: its cost model is not yet calibrated against measurements
    /// (on the 2-core test machine it lost to the single tree and the ring at every size).
    fn default() -> Self {
        let mut allowed = [true; Algorithm::ALL.len()];
        allowed[index(Algorithm::DoubleTree)] = false;
        AlgoFilter { allowed }
    }
}

/// The position of `a` in [`Algorithm::ALL`].
pub(crate) fn index(a: Algorithm) -> usize {
    Algorithm::ALL
        .iter()
        .position(|&b| b == a)
        .expect("every algorithm is in ALL")
}

impl AlgoFilter {
    /// Parses a `CHORUS_ALGO` value (NCCL's grammar, checked in full: [`AlgoSpec`]) for the
    /// allreduce: `;`-separated sections, each an optional `collective:` and a `,`-separated
    /// list of names, `^` in front of the list excluding them instead. A later section for the
    /// allreduce replaces an earlier one. The double binary tree stays out unless a list
    /// allows it by name (an exclusion list does not bring it in).
    ///
    /// ```
    /// use chorus::select::AlgoFilter;
    /// use chorus::Algorithm;
    /// let f = AlgoFilter::parse("allreduce:^ring;broadcast:ring").unwrap();
    /// assert!(!f.allows(Algorithm::Ring) && f.allows(Algorithm::Tree));
    /// assert!(!f.allows(Algorithm::DoubleTree));
    /// assert_eq!(AlgoFilter::parse("ring").unwrap().forced(), Some(Algorithm::Ring));
    /// assert!(AlgoFilter::parse("allreduce:warp").is_err());
    /// ```
    ///
    /// Errors (kind `InvalidArgument`): anything [`AlgoSpec::parse`] refuses (an unknown
    /// collective or schedule name, a later section without a collective), or a value that
    /// allows no allreduce schedule.
    pub fn parse(spec: &str) -> Result<AlgoFilter, CommError> {
        let parsed = AlgoSpec::parse(spec).map_err(|e| CommError::invalid("init", e))?;
        AlgoFilter::from_spec(&parsed, spec)
    }

    /// The allreduce's part of `parsed` (the value `spec`, checked already), as
    /// [`AlgoFilter::parse`] describes.
    pub fn from_spec(parsed: &AlgoSpec, spec: &str) -> Result<AlgoFilter, CommError> {
        let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
        let mut filter = AlgoFilter::default();
        if let Some(allowed) = parsed.allowed("allreduce", &names) {
            for (i, a) in Algorithm::ALL.into_iter().enumerate() {
                filter.allowed[i] = allowed[i]
                    && (a != Algorithm::DoubleTree || parsed.names("allreduce", &names, a.name()));
            }
        }
        if !filter.allowed.iter().any(|&a| a) {
            return Err(CommError::invalid(
                "init",
                format!(
                    "CHORUS_ALGO={spec:?}: no allreduce algorithm is left (double_tree is \
                     chosen only where the value names it: allreduce:double_tree)"
                ),
            ));
        }
        Ok(filter)
    }

    /// Whether `a` may be chosen.
    pub fn allows(&self, a: Algorithm) -> bool {
        self.allowed[index(a)]
    }

    /// The one schedule allowed, if only one is.
    pub fn forced(&self) -> Option<Algorithm> {
        let mut it = Algorithm::ALL.into_iter().filter(|&a| self.allows(a));
        match (it.next(), it.next()) {
            (Some(a), None) => Some(a),
            _ => None,
        }
    }
}

/// Where the link figures of a [`Selector`] come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkSource {
    /// Measured at init by [`probe`].
    Measured,
    /// From `CHORUS_ALPHA_US` / `CHORUS_BETA_GBPS` (a figure not set there was measured).
    Configured,
    /// Nothing to measure (one rank).
    Default,
}

/// The allreduce cost table of one communicator.
#[derive(Clone, Debug)]
pub struct Selector {
    ranks: usize,
    link: Link,
    source: LinkSource,
    filter: AlgoFilter,
    /// `best[b]`: the cheapest allowed schedule for `2^b` bytes.
    best: [Algorithm; ROWS],
    /// Some host runs more ranks than it has cores (see [`PLAUSIBLE_CPU_BOUND`]).
    cpu_bound: bool,
}

impl Selector {
    /// Fills the table for `ranks` ranks over `link`, choosing among what `filter` allows.
    ///
    /// ```
    /// use chorus::select::{AlgoFilter, LinkSource, Selector};
    /// use chorus::Algorithm;
    /// use chorus_algorithms::cost::Link;
    /// let s = Selector::new(4, Link::GIGABIT_ETHERNET, LinkSource::Default, AlgoFilter::default());
    /// assert_eq!(s.select(8), Algorithm::RecursiveDoubling);
    /// assert_eq!(s.select(64 << 20), Algorithm::HalvingDoubling); // same bytes as the ring, fewer messages
    /// ```
    pub fn new(ranks: usize, link: Link, source: LinkSource, filter: AlgoFilter) -> Selector {
        let mut best = [Algorithm::Ring; ROWS];
        for (b, slot) in best.iter_mut().enumerate() {
            let bytes = 1usize << b;
            *slot = Algorithm::ALL
                .into_iter()
                .filter(|&a| filter.allows(a))
                .map(|a| (a, a.cost(bytes, ranks, &link)))
                // Ties go to the earlier entry of `ALL` (the ring first).
                .fold(None, |acc: Option<(Algorithm, f64)>, (a, c)| match acc {
                    Some((_, best)) if best <= c => acc,
                    _ => Some((a, c)),
                })
                .map_or(Algorithm::Ring, |(a, _)| a);
        }
        Selector {
            ranks,
            link,
            source,
            filter,
            best,
            cpu_bound: false,
        }
    }

    /// The same table, marked as serving ranks that outnumber the cores of some host (every
    /// rank must pass the same value: it decides which schedules the tuner tries).
    pub fn with_cpu_bound(mut self, cpu_bound: bool) -> Selector {
        self.cpu_bound = cpu_bound;
        self
    }

    /// Whether some host runs more ranks than it has cores.
    pub fn cpu_bound(&self) -> bool {
        self.cpu_bound
    }

    /// The schedule the model picks for an allreduce of `bytes` bytes.
    pub fn select(&self, bytes: usize) -> Algorithm {
        self.best[bucket(bytes)]
    }

    /// The modelled time of `a` for `bytes` bytes over this communicator's ranks and link
    /// (seconds; the row of the table the tuner's trial plans are sorted by).
    pub fn modelled_cost(&self, a: Algorithm, bytes: usize) -> f64 {
        a.cost(bytes.max(1), self.ranks, &self.link)
    }

    /// The factor that brings a time of `a` on `bytes` bytes to the top size of their bucket,
    /// by the model: near 1 where the latency dominates, the ratio of the sizes where the
    /// bytes do (1 where the model says nothing). The same on every rank (the link is agreed).
    pub fn to_bucket_top(&self, a: Algorithm, bytes: usize) -> f64 {
        let top = 1usize << bucket(bytes);
        let (at_top, here) = (self.modelled_cost(a, top), self.modelled_cost(a, bytes));
        let scale = at_top / here;
        if here > 0.0 && scale.is_finite() && scale >= 1.0 {
            scale
        } else {
            1.0
        }
    }

    /// Whether a bucket of `bytes` bytes is revisited after its trials (see the module docs):
    /// every bucket when some host runs more ranks than cores; on links, buckets with dedicated
    /// trials where the model puts more of the time in the latency than in the bytes. Not the
    /// other buckets on links: their trials time blocks of at least [`TRIAL_BLOCK_BYTES`] as
    /// a loop runs them ([`Selector::min_block_calls`]), the schedules close enough to win
    /// move about the same bytes (the ring and halving-doubling), and a revisit costs a switch
    /// of schedule twice for a gain within the noise. On the 4-host 1 gbit testbed, 1000-call
    /// loops with revisits there ran up to 1.4 % (32 KiB), 0.8 % (128 KiB) and 0.5 % (512 KiB)
    /// slower than without, and without them within 0.1 % of the forced ring (medians of 4
    /// launches; `benches/results/2026-11-25-revisit-bands.md`).
    pub fn revisits(&self, bytes: usize) -> bool {
        self.cpu_bound || (bytes <= DEDICATED_MAX_BYTES && !self.bytes_weigh_more(bytes))
    }

    /// Whether, on links (no host runs more ranks than cores), the model puts at least as much
    /// of the cheapest schedule's time for `bytes` bytes in the bytes as in the latency.
    fn bytes_weigh_more(&self, bytes: usize) -> bool {
        if self.cpu_bound || bytes == 0 {
            return false;
        }
        let best = self.select(bytes);
        self.modelled_cost(best, bytes) >= 2.0 * self.modelled_cost(best, 0)
    }

    /// The fewest calls of a block of dedicated trials for a bucket of
    /// `bytes` bytes: on links (no host runs more ranks than cores) where the model puts at
    /// least as much of the cheapest schedule's time in the bytes as in the latency, enough
    /// calls to carry [`TRIAL_BLOCK_BYTES`]; else 1 (the time-based sizes alone). Where ranks
    /// share cores, short interleaved blocks sample the same spells ([`TRIAL_PASS_REPS`]).
    ///
    /// ```
    /// use chorus::select::{AlgoFilter, LinkSource, Selector, TRIAL_BLOCK_BYTES};
    /// use chorus_algorithms::cost::Link;
    /// let s = Selector::new(4, Link::GIGABIT_ETHERNET, LinkSource::Default, AlgoFilter::default());
    /// assert_eq!(s.min_block_calls(8), 1);
    /// assert_eq!(s.min_block_calls(8 << 10), TRIAL_BLOCK_BYTES / (8 << 10));
    /// assert_eq!(s.clone().with_cpu_bound(true).min_block_calls(8 << 10), 1);
    /// ```
    pub fn min_block_calls(&self, bytes: usize) -> usize {
        if !self.bytes_weigh_more(bytes) {
            return 1;
        }
        TRIAL_BLOCK_BYTES.div_ceil(bytes).max(1)
    }

    /// [`Selector::revisits`] for a bucket restored from a tuning file ([`crate::tune_file`]):
    /// rivals are re-timed only where some host runs more ranks than cores (the ranks' rhythm
    /// there changes from launch to launch). On links a restored bucket is settled: its
    /// rivals' blocks would run on connections the launch has not warmed (on the 4-host
    /// 1 gbit testbed they cost 200-call loops of 128 and 512 KiB 2.5 %).
    pub fn restored_revisits(&self, bytes: usize) -> bool {
        self.cpu_bound && self.revisits(bytes)
    }

    /// How the tuner tries the schedules for a first call of `bytes` bytes: every allowed one
    /// for dedicated trials (cheap, and the model is least reliable at mid sizes), else those
    /// the model puts within [`PLAUSIBLE`]× of the cheapest, at most [`ONLINE_CANDIDATES`]
    /// (with [`PLAUSIBLE_CPU_BOUND`] and no cap when some host runs more ranks than cores);
    /// cheapest modelled first.
    ///
    /// ```
    /// use chorus::select::{AlgoFilter, LinkSource, Selector};
    /// use chorus_algorithms::cost::Link;
    /// let s = Selector::new(4, Link::GIGABIT_ETHERNET, LinkSource::Default, AlgoFilter::default());
    /// let small = s.trial_plan(8);
    /// assert!(small.dedicated && small.candidates.len() > 1);
    /// assert_eq!(small.candidates[0].0, s.select(8));
    /// let large = s.trial_plan(64 << 20);
    /// assert!(!large.dedicated && large.candidates.len() <= 3);
    /// ```
    pub fn trial_plan(&self, bytes: usize) -> TrialPlan {
        let mut costs: Vec<(Algorithm, f64)> = Algorithm::ALL
            .into_iter()
            .filter(|&a| self.filter.allows(a))
            .map(|a| (a, self.modelled_cost(a, bytes)))
            .collect();
        // Stable: ties keep the order of `ALL`, as the table does.
        costs.sort_by(|x, y| x.1.total_cmp(&y.1));
        let best = costs.first().map_or(0.0, |c| c.1);
        let dedicated = bytes <= DEDICATED_MAX_BYTES;
        if dedicated && self.bandwidth_bound(bytes) {
            costs.retain(|c| c.1 <= DEDICATED_PLAUSIBLE * best);
        }
        if !dedicated {
            let plausible = if self.cpu_bound {
                PLAUSIBLE_CPU_BOUND
            } else {
                PLAUSIBLE
            };
            costs.retain(|c| c.1 <= plausible * best);
            if self.cpu_bound {
                // The cores bound the transfers: rank by the work all ranks share them for.
                let work = |a: Algorithm| a.host_work(bytes, self.ranks);
                let least = costs
                    .iter()
                    .map(|c| work(c.0))
                    .fold(f64::INFINITY, f64::min);
                costs.retain(|c| work(c.0) <= PLAUSIBLE * least);
            } else {
                costs.truncate(ONLINE_CANDIDATES);
            }
            let runs = if self.cpu_bound {
                ONLINE_CPU_BOUND_RUNS
            } else {
                1
            };
            return TrialPlan {
                candidates: costs.iter().map(|&(a, _)| (a, runs)).collect(),
                passes: 1,
                dedicated,
                min_reps: 1,
            };
        }
        let min_reps = self.min_block_calls(bytes);
        let (candidates, passes) = size_passes(&costs, min_reps);
        TrialPlan {
            candidates,
            passes,
            dedicated,
            min_reps,
        }
    }

    /// Whether a large bucket of `bytes` bytes with trial plan `plan` takes the model's choice
    /// without trials ([`MODEL_TIE`]): on links, when every candidate's modelled time is within
    /// that fraction of the cheapest's.
    ///
    /// ```
    /// use chorus::select::{AlgoFilter, LinkSource, Selector};
    /// use chorus_algorithms::cost::Link;
    /// let s = Selector::new(4, Link::GIGABIT_ETHERNET, LinkSource::Default, AlgoFilter::default());
    /// let big = 64 << 20;
    /// assert!(s.model_ties(&s.trial_plan(big), big));
    /// assert!(!s.model_ties(&s.trial_plan(8), 8), "dedicated trials");
    /// let crowded = s.clone().with_cpu_bound(true);
    /// assert!(!crowded.model_ties(&crowded.trial_plan(big), big));
    /// ```
    pub fn model_ties(&self, plan: &TrialPlan, bytes: usize) -> bool {
        let Some(first) = plan.candidates.first() else {
            return false;
        };
        let best = self.modelled_cost(first.0, bytes);
        !self.cpu_bound
            && !plan.dedicated
            && plan
                .candidates
                .iter()
                .all(|c| self.modelled_cost(c.0, bytes) <= (1.0 + MODEL_TIE) * best)
    }

    /// Whether the model puts `bytes` in the bandwidth-bound range: its cheapest schedule's
    /// time is more than [`BANDWIDTH_BOUND`]× that schedule's latency part.
    pub fn bandwidth_bound(&self, bytes: usize) -> bool {
        let best = self.select(bytes);
        self.modelled_cost(best, bytes) > BANDWIDTH_BOUND * self.modelled_cost(best, 0)
    }

    /// The link figures the table was filled with.
    pub fn link(&self) -> Link {
        self.link
    }

    /// Where they come from.
    pub fn source(&self) -> LinkSource {
        self.source
    }

    /// What `CHORUS_ALGO` allows.
    pub fn filter(&self) -> AlgoFilter {
        self.filter
    }

    /// One line for the log: the link and which schedule covers which sizes, e.g.
    /// `alpha 21.0 us, beta 2.50 GB/s (measured): recursive_doubling up to 2 KiB,
    /// halving_doubling up to 256 KiB, ring above`.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{} ranks, alpha {:.1} us, beta {:.2} GB/s ({}): ",
            self.ranks,
            self.link.alpha * 1e6,
            1e-9 / self.link.beta,
            match self.source {
                LinkSource::Measured => "measured",
                LinkSource::Configured => "configured",
                LinkSource::Default => "default",
            }
        );
        let mut b = 0;
        while b < ROWS {
            let a = self.best[b];
            let mut end = b;
            while end + 1 < ROWS && self.best[end + 1] == a {
                end += 1;
            }
            if end + 1 == ROWS {
                let _ = write!(s, "{a} {}", if b == 0 { "always" } else { "above" });
            } else {
                let _ = write!(s, "{a} up to {}, ", human(1usize << end));
            }
            b = end + 1;
        }
        s
    }
}

impl Selector {
    /// The selector of a freshly connected communicator: reads `CHORUS_ALPHA_US` /
    /// `CHORUS_BETA_GBPS` (already validated into `env`), probes the link when a figure is
    /// missing (and there is more than one rank), fills the table and logs it at INFO (rank 0).
    ///
    /// `crowded`: this rank's host runs more ranks than it has cores; the ranks agree (with an
    /// 8-byte allreduce) on whether any host does.
    pub(crate) fn for_communicator(
        comm: &mut Communicator,
        filter: AlgoFilter,
        env: (Option<f64>, Option<f64>),
        crowded: bool,
    ) -> Result<Selector, CommError> {
        let ranks = comm.size();
        let (link, source) = match env {
            // Also with the allreduce forced: the other collectives (and the sparse allreduce)
            // still choose by the link.
            _ if ranks == 1 => (Link::default(), LinkSource::Default),
            (Some(alpha), Some(beta)) => (Link { alpha, beta }, LinkSource::Configured),
            (alpha, beta) => {
                let mut measured = Link::default();
                comm.run_collective(
                    Call::new(
                        "init (link probe)",
                        CollKind::AllReduce,
                        DType::Float64,
                        ReduceOp::Max,
                    ),
                    |ctx| {
                        measured = probe(ctx)?;
                        Ok(())
                    },
                )?;
                let source = if alpha.is_some() || beta.is_some() {
                    LinkSource::Configured
                } else {
                    LinkSource::Measured
                };
                let link = Link {
                    alpha: alpha.unwrap_or(measured.alpha),
                    beta: beta.unwrap_or(measured.beta),
                };
                (link, source)
            }
        };
        let mut any_crowded = [u8::from(crowded)];
        if ranks > 1 && filter.forced().is_none() {
            comm.run_collective(
                Call::new(
                    "init (cores per host)",
                    CollKind::AllReduce,
                    DType::Uint8,
                    ReduceOp::Max,
                ),
                |ctx| {
                    allreduce::run(
                        Algorithm::RecursiveDoubling,
                        ctx,
                        None,
                        &mut any_crowded,
                        DType::Uint8,
                        ReduceOp::Max,
                    )
                },
            )?;
        }
        let probed = !matches!(env, (Some(_), Some(_)));
        if ranks > 1 && !probed && filter.forced().is_some() {
            // Neither collective above ran (the link configured, the allreduce forced): the
            // ranks still meet once before init returns, so that none drops the group's store
            // (its communicator freed at once) while another still reads it.
            comm.run_collective(
                Call::new(
                    "init (all set up)",
                    CollKind::Barrier,
                    DType::Uint8,
                    ReduceOp::Max,
                ),
                chorus_algorithms::collectives::barrier::run,
            )?;
        }
        let s = Selector::new(ranks, link, source, filter).with_cpu_bound(any_crowded[0] != 0);
        if comm.rank() == 0 {
            log::log(
                Level::Info,
                Some(0),
                format_args!("all_reduce algorithms: {}", s.describe()),
            );
        }
        Ok(s)
    }
}

/// The row of the table (and the tuner's bucket) of a call of `bytes` bytes: the exponent of
/// the next power of two.
pub(crate) fn bucket(bytes: usize) -> usize {
    bytes
        .max(1)
        .checked_next_power_of_two()
        .map_or(ROWS - 1, |b| b.trailing_zeros() as usize)
        .min(ROWS - 1)
}

/// How the schedules are tried for one bucket ([`Selector::trial_plan`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TrialPlan {
    /// The candidates, best modelled first, each with its timed repetitions per pass
    /// (dedicated trials; when tuned on the caller's calls, its timed calls: 1, or
    /// [`ONLINE_CPU_BOUND_RUNS`] after an untimed one when some host runs more ranks than
    /// cores).
    pub candidates: Vec<(Algorithm, usize)>,
    /// Passes over the candidates, each candidate's first run untimed (dedicated trials: 1
    /// to [`TRIAL_MAX_PASSES`], or from [`TrialPlan::after_first_pass`] the passes after the
    /// first, 0 to one less; else 1).
    pub passes: usize,
    /// Dedicated trials on the first call (else the caller's calls are the trials, unless
    /// [`Selector::model_ties`]).
    pub dedicated: bool,
    /// Timed repetitions a candidate runs per pass at least, as far as [`TRIAL_PASS_TIME`]
    /// allows ([`Selector::min_block_calls`]; 1 when tuned on the caller's calls).
    pub min_reps: usize,
}

impl TrialPlan {
    /// The rest of dedicated trials after their first pass, sized by the candidates' agreed
    /// `measured` mean times per run in that pass (seconds, in the order of `candidates`)
    /// instead of the model's: the repetitions of every later pass and how many passes
    /// follow, by the same rules ([`TRIAL_PASS_TIME`], [`TRIAL_TIME`], [`TRIAL_MIN_PASSES`]
    /// within [`TRIAL_MAX_TIME`], at most [`TRIAL_MAX_PASSES`] in all, the first included);
    /// where the first pass ran fewer repetitions of some candidate than the later ones
    /// will, which leaves it out of the median once two follow ([`drop_first_pass`]),
    /// [`TRIAL_MIN_PASSES`] follow it as far as they fit [`TRIAL_MAX_TIME`] with it.
    /// The model's per-byte time comes from a short probe that can be far off (on 4 ranks
    /// sharing 2 cores it read 0.15–0.37 GB/s where the ring moves 1.1–1.7 GB/s), and trials
    /// sized by it ran 3 passes of 5 runs at 512 KiB where 7–12 passes of 8 fit their time.
    pub fn after_first_pass(&self, measured: &[f64]) -> TrialPlan {
        debug_assert_eq!(measured.len(), self.candidates.len());
        let costs: Vec<(Algorithm, f64)> = self
            .candidates
            .iter()
            .zip(measured)
            .map(|(&(a, _), &t)| (a, t))
            .collect();
        let (candidates, passes) = size_passes(&costs, self.min_reps);
        let mut later = passes.saturating_sub(1);
        // Where the first pass is left out of the median ([`drop_first_pass`]), the median
        // still needs [`TRIAL_MIN_PASSES`] passes, as far as they fit [`TRIAL_MAX_TIME`]
        // with the first.
        if first_pass_shorter(&self.candidates, &candidates)
            && (1..TRIAL_MIN_PASSES).contains(&later)
        {
            let left = TRIAL_MAX_TIME.as_secs_f64() - pass_seconds(measured, &self.candidates);
            // `as` saturates: nothing left fits none, a pass of zero time the most.
            let fit = (left / pass_seconds(measured, &candidates)) as usize;
            later = later.max(fit.min(TRIAL_MIN_PASSES));
        }
        TrialPlan {
            candidates,
            passes: later,
            dedicated: self.dedicated,
            min_reps: self.min_reps,
        }
    }
}

/// Timed repetitions per pass of each candidate and the number of passes of dedicated trials,
/// from each candidate's time per run (`costs`, seconds): up to [`TRIAL_PASS_REPS`] runs (or
/// `min_reps`, when more), as many as fit [`TRIAL_PASS_TIME`]; as many passes as fit
/// [`TRIAL_TIME`] (at most [`TRIAL_MAX_PASSES`]), and at least [`TRIAL_MIN_PASSES`] where
/// they fit [`TRIAL_MAX_TIME`].
fn size_passes(costs: &[(Algorithm, f64)], min_reps: usize) -> (Vec<(Algorithm, usize)>, usize) {
    let reps = |c: f64| calls_within_pass(c, TRIAL_PASS_REPS.max(min_reps));
    let candidates: Vec<(Algorithm, usize)> = costs.iter().map(|&(a, c)| (a, reps(c))).collect();
    let times: Vec<f64> = costs.iter().map(|&(_, c)| c).collect();
    let pass = pass_seconds(&times, &candidates);
    // `as` saturates: a pass of zero time fits the most passes.
    let fit = |budget: Duration| ((budget.as_secs_f64() / pass) as usize).min(TRIAL_MAX_PASSES);
    let passes = match fit(TRIAL_TIME) {
        n if n >= TRIAL_MIN_PASSES => n,
        _ => fit(TRIAL_MAX_TIME).clamp(1, TRIAL_MIN_PASSES),
    };
    (candidates, passes)
}

/// The time of one pass of dedicated trials: each candidate's `reps` runs and its untimed
/// first one, at `times` (seconds per run, in the order of `reps`).
fn pass_seconds(times: &[f64], reps: &[(Algorithm, usize)]) -> f64 {
    times
        .iter()
        .zip(reps)
        .map(|(&t, &(_, n))| t * (n + 1) as f64)
        .sum()
}

/// Whether a first pass of `first` repetitions per candidate ran fewer of some candidate
/// than the `later` passes will.
fn first_pass_shorter(first: &[(Algorithm, usize)], later: &[(Algorithm, usize)]) -> bool {
    first.iter().zip(later).any(|(&(_, f), &(_, l))| f < l)
}

/// Calls of `seconds` each that fit [`TRIAL_PASS_TIME`], from 1 to `most` (`most` for calls
/// of no measurable time).
fn calls_within_pass(seconds: f64, most: usize) -> usize {
    match seconds > 0.0 {
        // `as` saturates.
        true => ((TRIAL_PASS_TIME.as_secs_f64() / seconds) as usize).clamp(1, most),
        false => most,
    }
}

/// `CHORUS_TUNE`: whether allreduce schedules are tuned online (default on). Accepts
/// `1 on true yes` and `0 off false no`, case-insensitively.
pub fn tune_from_env() -> Result<bool, CommError> {
    parse_tune(&std::env::var("CHORUS_TUNE").unwrap_or_default())
}

/// Parses a `CHORUS_TUNE` value (empty: the default, on).
///
/// ```
/// use chorus::select::parse_tune;
/// assert!(parse_tune("").unwrap() && parse_tune("On").unwrap());
/// assert!(!parse_tune("0").unwrap() && !parse_tune("off").unwrap());
/// assert!(parse_tune("sometimes").is_err());
/// ```
pub fn parse_tune(v: &str) -> Result<bool, CommError> {
    Ok(crate::config::parse_switch("CHORUS_TUNE", v)?.unwrap_or(true))
}

/// Where the tuning of one bucket stands.
#[derive(Clone, Debug, PartialEq)]
enum Bucket {
    /// No call of this size yet.
    Fresh,
    /// Tuned on the caller's calls: the candidates, the times of those already tried (the
    /// fastest timed call of each one's block), and the block of calls of the one being
    /// tried: `runs` timed calls (after an untimed one when more than one), `done` of them
    /// made, `best`: the fastest of their times so far.
    Online {
        candidates: Vec<Algorithm>,
        times: Vec<f64>,
        runs: usize,
        done: usize,
        best: f64,
    },
    /// Decided (by trials, by a neighbour, or because there was nothing to try); `watch`:
    /// rivals still worth re-timing; `lead`: by how much the trials put `chosen` ahead of the
    /// next fastest candidate when that is at least [`INHERIT_LEAD`] (the decision passes on).
    Decided {
        chosen: Algorithm,
        watch: Option<Watch>,
        lead: Option<f64>,
    },
}

/// The revisits of a decided bucket: its rivals are re-timed on the caller's calls, each in a
/// block of `window` calls followed by a block of as many calls of the bucket's schedule (the
/// first call of a block untimed, as the schedules change there), every `gap` calls.
#[derive(Clone, Debug, PartialEq)]
struct Watch {
    /// Rivals in the order they are revisited.
    rivals: Vec<Rival>,
    /// Index in `rivals` of the next to revisit.
    turn: usize,
    /// Calls per block.
    window: usize,
    /// Calls between two revisits.
    gap: usize,
    /// Calls of the bucket's schedule left before the next revisit.
    countdown: usize,
    /// The revisit in progress.
    revisit: Option<Revisit>,
}

/// A rival of a decided bucket.
#[derive(Clone, Debug, PartialEq)]
struct Rival {
    algorithm: Algorithm,
    /// Its latest revisits' time ratios (rival over the bucket's schedule; below 1: the rival
    /// was faster), oldest first. Plain quotients and comparisons, no logarithms: every rank
    /// must reach the same decisions from the agreed times, and `ln`/`exp` may round
    /// differently in another host's maths library.
    evidence: Vec<f64>,
}

/// A revisit in progress.
#[derive(Clone, Debug, PartialEq)]
struct Revisit {
    rival: Algorithm,
    /// Calls of the revisit done (`0 .. 2 * window`).
    done: usize,
    /// Timed seconds of the rival's block and of the schedule's block.
    sums: [f64; 2],
}

impl Watch {
    /// The watch of a bucket decided on `chosen` by trial `times` of `candidates`: the others
    /// within [`RIVAL_WITHIN`] of its time, fastest first (none: no watch). Its blocks last
    /// about [`REVISIT_BLOCK`].
    fn after_trials(chosen: Algorithm, candidates: &[Algorithm], times: &[f64]) -> Option<Watch> {
        let own = candidates
            .iter()
            .zip(times)
            .find(|(&a, _)| a == chosen)
            .map(|(_, &t)| t)?;
        let mut rivals: Vec<(Algorithm, f64)> = candidates
            .iter()
            .zip(times)
            .filter(|(&a, &t)| a != chosen && t <= own * RIVAL_WITHIN)
            .map(|(&a, &t)| (a, t))
            .collect();
        if rivals.is_empty() || own.is_nan() || own <= 0.0 {
            return None;
        }
        rivals.sort_by(|x, y| x.1.total_cmp(&y.1));
        let block = REVISIT_BLOCK.as_secs_f64();
        let window = ((block / own).ceil() as usize).clamp(REVISIT_MIN_WINDOW, REVISIT_MAX_WINDOW);
        let gap = REVISIT_FIRST_GAP * window;
        let mut w = Watch {
            rivals: rivals
                .into_iter()
                .map(|r| Rival {
                    algorithm: r.0,
                    evidence: Vec::new(),
                })
                .collect(),
            turn: 0,
            window,
            gap,
            countdown: 0,
            revisit: None,
        };
        w.countdown = w.wait(gap);
        Some(w)
    }

    /// Calls before the revisit of the rival whose turn it is: at least `base`, and long enough
    /// for the revisit's expected cost to stay within [`REVISIT_BUDGET`] of the calls'
    /// time (capped at [`REVISIT_MAX_GAP`] blocks).
    fn wait(&self, base: usize) -> usize {
        let excess = (self.rivals[self.turn].expected_ratio() - 1.0).max(0.0);
        let budget = (self.window as f64 * excess / REVISIT_BUDGET).ceil() as usize;
        base.max(budget.min(REVISIT_MAX_GAP * self.window))
    }
}

impl Rival {
    /// Its time over the bucket's schedule's, as its revisits put it (the median of its
    /// evidence), or [`UNSEEN_RIVAL_RATIO`] before its first.
    fn expected_ratio(&self) -> f64 {
        if self.evidence.is_empty() {
            UNSEEN_RIVAL_RATIO
        } else {
            median(&mut self.evidence.clone())
        }
    }
}

/// The outcome of a revisit ([`Tuner::settle_revisit`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Revisited {
    /// The rival re-timed, and the bucket's schedule it was compared with.
    pub rival: Algorithm,
    pub chosen: Algorithm,
    /// Their agreed mean times per call (seconds).
    pub times: [f64; 2],
    /// The bucket's schedule from now on.
    pub now: Algorithm,
    /// The rival's evidence so far against the schedule it was compared with: revisits, and
    /// the median ratio of their times (rival over schedule).
    pub evidence: (usize, f64),
    /// Calls before the next revisit (`None`: no rival left, the bucket is settled).
    pub next_in: Option<usize>,
}

/// What the tuner says about the next call of a bucket.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Next {
    /// Use this schedule; nothing to time.
    Use(Algorithm),
    /// Run dedicated trials first, by this plan.
    Trials(TrialPlan),
    /// Use this schedule, time the call and [`Tuner::record`] it (trial `k` of the bucket).
    Online(Algorithm),
    /// A call of a revisit: use this schedule, time the call and [`Tuner::record_revisit`] it
    /// (which leaves each block's first call, after the switch of schedule, out). `rival`: the
    /// schedule is the rival's.
    Revisit { algorithm: Algorithm, rival: bool },
    /// Use this schedule from now on, one of candidates the model puts within [`MODEL_TIE`]
    /// of each other (`tied`: the others): the one the decided bucket of up to `after` bytes
    /// (a smaller one nearby) runs, or else the model's choice (log it).
    Tied {
        algorithm: Algorithm,
        tied: Vec<Algorithm>,
        after: Option<usize>,
    },
    /// Use this schedule from now on, taken without trials from the decided bucket of up to
    /// `from` bytes, whose trials put it `lead`× ahead of the next (log it).
    Inherit {
        algorithm: Algorithm,
        from: usize,
        lead: f64,
    },
}

/// Per-bucket tuning state of one communicator (see the module docs). Pure bookkeeping: the
/// communicator runs the trials and the agreement.
#[derive(Clone, Debug)]
pub(crate) struct Tuner {
    buckets: Vec<Bucket>,
}

impl Tuner {
    pub(crate) fn new() -> Tuner {
        Tuner {
            buckets: vec![Bucket::Fresh; ROWS],
        }
    }

    /// The schedule decided for `bytes`, if its bucket is decided.
    pub(crate) fn decided(&self, bytes: usize) -> Option<Algorithm> {
        match self.buckets[bucket(bytes)] {
            Bucket::Decided { chosen, .. } => Some(chosen),
            _ => None,
        }
    }

    /// What to do for a call of `bytes` bytes.
    pub(crate) fn next(&mut self, selector: &Selector, bytes: usize) -> Next {
        let b = bucket(bytes);
        match &mut self.buckets[b] {
            Bucket::Decided {
                chosen,
                watch: None,
                ..
            } => Next::Use(*chosen),
            Bucket::Decided {
                chosen,
                watch: Some(w),
                ..
            } => {
                if w.revisit.is_none() {
                    if w.countdown > 0 {
                        w.countdown -= 1;
                        return Next::Use(*chosen);
                    }
                    w.revisit = Some(Revisit {
                        rival: w.rivals[w.turn].algorithm,
                        done: 0,
                        sums: [0.0; 2],
                    });
                }
                let r = w.revisit.as_ref().expect("a revisit is in progress");
                let rival = r.done < w.window;
                Next::Revisit {
                    algorithm: if rival { r.rival } else { *chosen },
                    rival,
                }
            }
            Bucket::Online {
                candidates, times, ..
            } => Next::Online(candidates[times.len()]),
            Bucket::Fresh => {
                let plan = selector.trial_plan(bytes);
                if plan.candidates.len() <= 1 {
                    let a = plan
                        .candidates
                        .first()
                        .map_or(selector.select(bytes), |c| c.0);
                    self.buckets[b] = Bucket::Decided {
                        chosen: a,
                        watch: None,
                        lead: None,
                    };
                    return Next::Use(a);
                }
                if plan.dedicated {
                    return Next::Trials(plan);
                }
                if let Some((from, algorithm, lead)) = self.neighbour(b, &plan) {
                    self.buckets[b] = Bucket::Decided {
                        chosen: algorithm,
                        watch: None,
                        lead: Some(lead),
                    };
                    return Next::Inherit {
                        algorithm,
                        from: 1 << from,
                        lead,
                    };
                }
                if selector.model_ties(&plan, bytes) {
                    // What was measured breaks the model's tie: the schedule a smaller bucket
                    // nearby was decided on (by its trials, or by a tie before it), when it
                    // is one of the tied.
                    let nearby = self.smaller_decided(b, &plan);
                    let algorithm = nearby.map_or(plan.candidates[0].0, |(_, a)| a);
                    self.buckets[b] = Bucket::Decided {
                        chosen: algorithm,
                        watch: None,
                        lead: None,
                    };
                    return Next::Tied {
                        algorithm,
                        tied: plan
                            .candidates
                            .iter()
                            .map(|c| c.0)
                            .filter(|&a| a != algorithm)
                            .collect(),
                        after: nearby.map(|(n, _)| 1 << n),
                    };
                }
                // Worst modelled first, best last: the caller's calls after the trials find
                // the connections as a likely winner left them (a bandwidth-hungry loser's
                // queues and congestion windows have had the other trials to recover).
                let candidates: Vec<Algorithm> =
                    plan.candidates.iter().rev().map(|c| c.0).collect();
                let first = candidates[0];
                self.buckets[b] = Bucket::Online {
                    candidates,
                    times: Vec::new(),
                    runs: plan.candidates[0].1.max(1),
                    done: 0,
                    best: f64::INFINITY,
                };
                Next::Online(first)
            }
        }
    }

    /// The nearest decided bucket below row `b`, within [`INHERIT_SPAN`] rows, whose schedule
    /// is one of `plan`'s candidates: its row and schedule. On the 1 gbit testbed the 2 MiB
    /// bucket's trials put halving-doubling 16 % behind the ring and the 8 MiB bucket, tied in
    /// the model, took halving-doubling, its choice: 113 MB/s against the forced ring's 119
    /// (`benches/results/2026-11-25-wire-bytes.md`, run L).
    fn smaller_decided(&self, b: usize, plan: &TrialPlan) -> Option<(usize, Algorithm)> {
        (1..=INHERIT_SPAN)
            .filter_map(|d| b.checked_sub(d))
            .find_map(|n| match self.buckets[n] {
                Bucket::Decided { chosen, .. } if plan.candidates.iter().any(|c| c.0 == chosen) => {
                    Some((n, chosen))
                }
                _ => None,
            })
    }

    /// The nearest decided large bucket within [`INHERIT_SPAN`] rows of row `b` (below first
    /// at equal distance) whose decision passes on, when `plan` (row `b`'s trials) would try its
    /// schedule: its row, schedule and lead.
    fn neighbour(&self, b: usize, plan: &TrialPlan) -> Option<(usize, Algorithm, f64)> {
        let smallest = bucket(DEDICATED_MAX_BYTES) + 1;
        (1..=INHERIT_SPAN)
            .flat_map(|d| [b.checked_sub(d), Some(b + d)])
            .flatten()
            .filter(|&n| n >= smallest && n < ROWS)
            .find_map(|n| match self.buckets[n] {
                Bucket::Decided {
                    chosen,
                    lead: Some(lead),
                    ..
                } if plan.candidates.iter().any(|c| c.0 == chosen) => Some((n, chosen, lead)),
                _ => None,
            })
    }

    /// Records the time of a call of an online trial of `bytes` bytes (the first of a
    /// candidate's block is not counted when the block has more than one timed call). Returns
    /// the candidates and their times (this rank's; each the fastest timed call of its block)
    /// once the last block is in: the caller agrees on them across ranks and calls
    /// [`Tuner::decide`].
    ///
    /// The fastest call, not the mean: a block has at most [`ONLINE_CPU_BOUND_RUNS`] timed
    /// calls, and one of them stretched by a preemption (on 4 ranks sharing 2 cores, one of
    /// the ring's two 8 MiB trial calls once averaged 20.4 ms with the other, where its calls
    /// took 7.3–7.5 ms in other launches) decided a bucket, and the buckets that inherited
    /// from it, against the schedule the caller's loop ran fastest.
    pub(crate) fn record(
        &mut self,
        bytes: usize,
        seconds: f64,
    ) -> Option<(Vec<Algorithm>, Vec<f64>)> {
        let b = bucket(bytes);
        if let Bucket::Online {
            candidates,
            times,
            runs,
            done,
            best,
        } = &mut self.buckets[b]
        {
            // A block of more than one timed call starts with an untimed one.
            let block = if *runs > 1 { *runs + 1 } else { 1 };
            *done += 1;
            // Scaled to the bucket's top size: the caller's calls in one bucket may differ in
            // size up to 2× (gradient buckets of 17 and 25 MiB), and a candidate timed on the
            // smaller must not win for that. Online trials are for sizes whose bytes dominate,
            // where the time goes with the size.
            let scaled = seconds * (1usize << b) as f64 / bytes.max(1) as f64;
            if *runs == 1 || *done > 1 {
                *best = best.min(scaled);
            }
            if *done == block {
                times.push(*best);
                (*done, *best) = (0, f64::INFINITY);
                if times.len() == candidates.len() {
                    return Some((candidates.clone(), times.clone()));
                }
            }
        }
        None
    }

    /// Settles the bucket of `bytes` on the fastest of `candidates` by the agreed `times` and
    /// returns it. `modelled` holds the candidates' modelled costs: the model's choice (the
    /// cheapest) keeps the bucket unless the fastest beats it by more than
    /// [`KEEP_MODEL_MARGIN`], where the model itself tells the two apart by more than that
    /// margin (trials are short, and a few percent between them is noise more often than a
    /// real difference). Schedules the model cannot tell apart are decided by the trials,
    /// unless those put them within [`TRIAL_TIE`] of each other, when the model's choice stays.
    /// Equal times go to the better-modelled candidate.
    ///
    /// With `revisit` ([`Selector::revisits`]), the candidates close behind stay rivals.
    pub(crate) fn decide(
        &mut self,
        bytes: usize,
        candidates: &[Algorithm],
        times: &[f64],
        modelled: &[f64],
        revisit: bool,
    ) -> Algorithm {
        let faster = |i: usize, j: usize| {
            times[i] < times[j] || (times[i] == times[j] && modelled[i] < modelled[j])
        };
        let (mut fastest, mut model) = (0, 0);
        for i in 1..candidates.len() {
            if faster(i, fastest) {
                fastest = i;
            }
            if modelled[i] < modelled[model] {
                model = i;
            }
        }
        let margin = 1.0 + KEEP_MODEL_MARGIN;
        let keep = times[model] <= times[fastest] * (1.0 + TRIAL_TIE)
            || (times[model] <= times[fastest] * margin
                && modelled[fastest] > modelled[model] * margin);
        let chosen = if keep { model } else { fastest };
        let a = candidates[chosen];
        self.settle(bytes, a, candidates, times, revisit);
        a
    }

    /// Marks the bucket of `bytes` decided on `chosen` by trials that took `times` (the
    /// candidates close behind stay rivals with `revisit`, as in [`Tuner::decide`]).
    fn settle(
        &mut self,
        bytes: usize,
        chosen: Algorithm,
        candidates: &[Algorithm],
        times: &[f64],
        revisit: bool,
    ) {
        // The next fastest candidate's time over the winner's (a kept model's choice that
        // did not time fastest leads by less than 1).
        let own = candidates
            .iter()
            .zip(times)
            .find(|(&a, _)| a == chosen)
            .map_or(f64::NAN, |(_, &t)| t);
        let lead = candidates
            .iter()
            .zip(times)
            .filter(|(&a, _)| a != chosen)
            .map(|(_, &t)| t / own)
            .fold(f64::INFINITY, f64::min);
        self.buckets[bucket(bytes)] = Bucket::Decided {
            chosen,
            watch: revisit
                .then(|| Watch::after_trials(chosen, candidates, times))
                .flatten(),
            lead: (lead.is_finite() && lead >= INHERIT_LEAD).then_some(lead),
        };
    }

    /// Restores the bucket of `bytes` as an earlier launch's trials left it (a tuning file,
    /// [`crate::tune_file`]): decided on `chosen` (the trials' pick, or the rival a revisit put
    /// in its place) with the rivals their `times` leave (re-timed by revisits with
    /// `revisit`, as after trials). A bucket this communicator has already used is left as it
    /// is. Returns whether the bucket was restored.
    pub(crate) fn restore(
        &mut self,
        bytes: usize,
        chosen: Algorithm,
        candidates: &[Algorithm],
        times: &[f64],
        revisit: bool,
    ) -> bool {
        if self.buckets[bucket(bytes)] != Bucket::Fresh || !candidates.contains(&chosen) {
            return false;
        }
        self.settle(bytes, chosen, candidates, times, revisit);
        true
    }

    /// Records a call of a revisit of `bytes` bytes (`seconds`: its time on this rank, left out
    /// for the first call of each block). Returns the rival, the bucket's schedule and this
    /// rank's mean times per timed call of both once the revisit's last call is in: the caller
    /// agrees on them across ranks and calls [`Tuner::settle_revisit`].
    pub(crate) fn record_revisit(
        &mut self,
        bytes: usize,
        seconds: f64,
    ) -> Option<(Algorithm, Algorithm, [f64; 2])> {
        let Bucket::Decided {
            chosen,
            watch: Some(w),
            ..
        } = &mut self.buckets[bucket(bytes)]
        else {
            return None;
        };
        let r = w.revisit.as_mut()?;
        if r.done % w.window != 0 {
            r.sums[usize::from(r.done >= w.window)] += seconds;
        }
        r.done += 1;
        if r.done < 2 * w.window {
            return None;
        }
        let timed = (w.window - 1) as f64;
        Some((r.rival, *chosen, r.sums.map(|s| s / timed)))
    }

    /// Ends the revisit of the bucket of `bytes` by the agreed mean `times` of its rival and of
    /// its schedule, by the rule of the module docs: the rival takes over when its evidence
    /// confirms it faster by more than [`REVISIT_MARGIN`] (the old schedule becomes the rival
    /// revisited next, and revisits start again at the first gap); a revisit that favours the
    /// rival unconfirmed retimes it after the first gap; otherwise the schedule stays, the gap
    /// doubles, the next rival takes its turn, and a rival confirmed slower than
    /// [`RIVAL_DROP`] is dropped (with none left, the bucket is settled).
    pub(crate) fn settle_revisit(&mut self, bytes: usize, times: [f64; 2]) -> Option<Revisited> {
        let slot = &mut self.buckets[bucket(bytes)];
        let Bucket::Decided {
            chosen,
            watch: Some(w),
            lead,
        } = slot
        else {
            return None;
        };
        let r = w.revisit.take()?;
        let old = *chosen;
        let [rival_time, own_time] = times;
        let ratio = rival_time / own_time;
        let ev = &mut w.rivals[w.turn].evidence;
        // A time that is not a positive number (a clock that did not move) is no evidence.
        if ratio.is_finite() && ratio > 0.0 {
            ev.push(ratio);
            if ev.len() > REVISIT_EVIDENCE {
                ev.remove(0);
            }
        }
        let n = ev.len();
        let mid = median(&mut ev.clone());
        let wins = ev.iter().filter(|&&x| x < 1.0).count();
        let faster = 1.0 - REVISIT_MARGIN;
        let mut out = Revisited {
            rival: r.rival,
            chosen: old,
            times,
            now: old,
            evidence: (n, mid),
            next_in: None,
        };
        if n >= REVISIT_CONFIRM && mid < faster && 2 * wins > n {
            // The trials' lead no longer stands.
            *lead = None;
            *chosen = r.rival;
            let inverted: Vec<f64> = ev.iter().map(|x| 1.0 / x).collect();
            for other in &mut w.rivals {
                other.evidence.clear();
            }
            w.rivals[w.turn] = Rival {
                algorithm: old,
                evidence: inverted,
            };
            w.gap = REVISIT_FIRST_GAP * w.window;
            out.now = r.rival;
        } else if ratio < faster {
            // Favoured but not confirmed: the same rival again soon; the gap is unchanged.
            w.countdown = w.wait(REVISIT_FIRST_GAP * w.window);
            out.next_in = Some(w.countdown);
            return Some(out);
        } else {
            if n >= RIVAL_DROP_AFTER && mid > RIVAL_DROP {
                w.rivals.remove(w.turn);
            } else {
                w.turn += 1;
            }
            if w.rivals.is_empty() {
                let lead = *lead;
                *slot = Bucket::Decided {
                    chosen: old,
                    watch: None,
                    lead,
                };
                return Some(out);
            }
            w.turn %= w.rivals.len();
            w.gap = (w.gap * 2).min(REVISIT_MAX_GAP * w.window);
        }
        w.countdown = w.wait(w.gap);
        out.next_in = Some(w.countdown);
        Some(out)
    }

    /// The candidates of the bucket of `bytes` when it is tuned on the caller's calls and none
    /// has been timed yet (the communicator warms them up first).
    pub(crate) fn online_fresh(&self, bytes: usize) -> Option<Vec<Algorithm>> {
        match &self.buckets[bucket(bytes)] {
            Bucket::Online {
                candidates,
                times,
                done: 0,
                ..
            } if times.is_empty() => Some(candidates.clone()),
            _ => None,
        }
    }

    /// Drops every revisit in progress (tuning was turned off or on): each bucket keeps its
    /// schedule and waits its gap before the next.
    pub(crate) fn drop_revisits(&mut self) {
        for b in &mut self.buckets {
            if let Bucket::Decided { watch: Some(w), .. } = b {
                if w.revisit.take().is_some() {
                    w.countdown = w.wait(w.gap);
                }
            }
        }
    }

    /// Forgets an online trial or a revisit in progress (the call failed): an undecided
    /// bucket starts again, a revisit waits for its next turn.
    pub(crate) fn reset(&mut self, bytes: usize) {
        let b = bucket(bytes);
        match &mut self.buckets[b] {
            Bucket::Online { .. } => self.buckets[b] = Bucket::Fresh,
            Bucket::Decided { watch: Some(w), .. } if w.revisit.is_some() => {
                w.revisit = None;
                w.countdown = w.wait(w.gap);
            }
            _ => {}
        }
    }
}

/// One log line for a bucket that took a neighbour's schedule ([`Next::Inherit`]).
pub(crate) fn describe_inherited(
    bytes: usize,
    chosen: Algorithm,
    from: usize,
    lead: f64,
) -> String {
    format!(
        "all_reduce tuned for {} (bucket up to {}): {chosen}, as decided for the bucket up to {} \
         (its trials put it {lead:.2}x ahead of the next)",
        human(bytes),
        human(1usize << bucket(bytes)),
        human(from),
    )
}

/// One log line for a large bucket that takes the model's choice without trials.
pub(crate) fn describe_tied(
    bytes: usize,
    chosen: Algorithm,
    tied: &[Algorithm],
    after: Option<usize>,
) -> String {
    let names: Vec<&str> = tied.iter().map(|a| a.name()).collect();
    let why = match after {
        Some(from) => format!("as the bucket up to {} runs", human(from)),
        None => "the model's choice".into(),
    };
    format!(
        "all_reduce tuned for {} (bucket up to {}): {chosen}, {why}, without trials \
         (the model puts {} within {:.0} % of it on a link)",
        human(bytes),
        human(1usize << bucket(bytes)),
        names.join(", "),
        MODEL_TIE * 100.0
    )
}

/// One log line for a tuning decision.
pub(crate) fn describe_decision(
    bytes: usize,
    model: Algorithm,
    candidates: &[Algorithm],
    times: &[f64],
    chosen: Algorithm,
) -> String {
    let mut s = format!(
        "all_reduce tuned for {} (bucket up to {}): ",
        human(bytes),
        human(1usize << bucket(bytes))
    );
    for (a, t) in candidates.iter().zip(times) {
        let _ = write!(s, "{a} {:.1} us, ", t * 1e6);
    }
    let _ = write!(s, "-> {chosen} (model: {model})");
    s
}

/// One log line for the outcome of a revisit.
pub(crate) fn describe_revisit(bytes: usize, r: &Revisited) -> String {
    let mut s = format!(
        "all_reduce revisited {} (bucket up to {}): {} {:.1} us, {} {:.1} us \
         (median ratio {:.2} over {} revisits) -> {}",
        human(bytes),
        human(1usize << bucket(bytes)),
        r.rival,
        r.times[0] * 1e6,
        r.chosen,
        r.times[1] * 1e6,
        r.evidence.1,
        r.evidence.0,
        r.now
    );
    match r.next_in {
        Some(n) => {
            let _ = write!(s, " (next revisit in {n} calls)");
        }
        None => s.push_str(" (no rival left)"),
    }
    s
}

/// Whether dedicated trials leave their first pass out of every candidate's median: where
/// the model sized it (`first`, repetitions per candidate) shorter than the measured times
/// sized the `later` passes for some candidate, and at least two passes follow (so that one
/// disturbed pass still does not decide). The first pass's few runs are then sized by what
/// the probe misjudged, and it also holds each schedule's first runs at the size, which are
/// slow; with three passes in all, the minimum, it would be one of three values in the
/// median. The choice is the same for every candidate, so that all are scored over the same
/// passes.
pub fn drop_first_pass(first: &TrialPlan, later: &TrialPlan) -> bool {
    later.passes >= 2 && first_pass_shorter(&first.candidates, &later.candidates)
}

/// The trace line of dedicated trials of `bytes` bytes: every candidate's repetitions in the
/// first and later passes and this rank's mean run of each pass (µs, `runs[candidate][pass]`),
/// the passes left out of the median (`skip`) in brackets.
pub(crate) fn describe_passes(
    bytes: usize,
    first: &[(Algorithm, usize)],
    later: &[(Algorithm, usize)],
    runs: &[Vec<f64>],
    skip: usize,
) -> String {
    let mut s = format!("all_reduce trial passes for {}:", human(bytes));
    for ((&(a, f), &(_, l)), r) in first.iter().zip(later).zip(runs) {
        let _ = write!(s, " {} ({f}/{l} runs)", a.name());
        for (k, t) in r.iter().enumerate() {
            let us = t * 1e6;
            let _ = match k < skip {
                true => write!(s, " [{us:.1}]"),
                false => write!(s, " {us:.1}"),
            };
        }
        s.push(';');
    }
    s
}

/// The median of `xs` (the mean of the middle two for an even count; 0 for none). Sorts `xs`.
pub(crate) fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// One log line for the buckets restored from a tuning file.
pub(crate) fn describe_restored(path: &std::path::Path, decisions: &[Decision]) -> String {
    let list: Vec<String> = decisions
        .iter()
        .map(|d| format!("{} {}", human(d.bytes), d.chosen))
        .collect();
    format!(
        "all_reduce decisions of an earlier launch from {} (buckets up to): {}",
        path.display(),
        list.join(", ")
    )
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The configured latency accepted, in microseconds: a nanosecond to ten seconds.
pub const ALPHA_US_RANGE: (f64, f64) = (1e-3, 1e7);
/// The configured bandwidth accepted, in GB/s: a kilobyte per second to a petabyte per second
/// (outside, the model's figures overflow or vanish, and a tuning file could not keep them).
pub const BETA_GBPS_RANGE: (f64, f64) = (1e-6, 1e6);

/// Whether `x` lies in `range` (which rules out NaN and infinities).
fn in_range(x: f64, range: (f64, f64)) -> bool {
    x >= range.0 && x <= range.1
}

/// `CHORUS_ALPHA_US` and `CHORUS_BETA_GBPS`, validated: `(alpha seconds, beta seconds per
/// byte)`, each `None` when unset.
pub fn link_from_env() -> Result<(Option<f64>, Option<f64>), CommError> {
    let read = |name: &str, range: (f64, f64)| -> Result<Option<f64>, CommError> {
        match std::env::var(name) {
            Ok(v) if !v.trim().is_empty() => match v.trim().parse::<f64>() {
                Ok(x) if in_range(x, range) => Ok(Some(x)),
                _ => Err(CommError::invalid(
                    "init",
                    format!(
                        "{name}={v:?}: expected a number from {:e} to {:e}",
                        range.0, range.1
                    ),
                )),
            },
            _ => Ok(None),
        }
    };
    let alpha = read("CHORUS_ALPHA_US", ALPHA_US_RANGE)?.map(|us| us * 1e-6);
    let beta = read("CHORUS_BETA_GBPS", BETA_GBPS_RANGE)?.map(|gbps| 1.0 / (gbps * 1e9));
    Ok((alpha, beta))
}

/// [`Config::alpha_us`](crate::Config::alpha_us) and
/// [`Config::beta_gbps`](crate::Config::beta_gbps), validated, in place of the environment's
/// figures (`env`, from [`link_from_env`]) where they are set.
pub fn link_from_config(
    config: &crate::Config,
    env: (Option<f64>, Option<f64>),
) -> Result<(Option<f64>, Option<f64>), CommError> {
    let check = |name: &str, v: Option<f64>, range: (f64, f64)| match v {
        Some(x) if !in_range(x, range) => Err(CommError::invalid(
            "init",
            format!(
                "Config::{name} = {x}: expected a number from {:e} to {:e}",
                range.0, range.1
            ),
        )),
        _ => Ok(v),
    };
    let alpha = check("alpha_us", config.alpha_us, ALPHA_US_RANGE)?.map(|us| us * 1e-6);
    let beta =
        check("beta_gbps", config.beta_gbps, BETA_GBPS_RANGE)?.map(|gbps| 1.0 / (gbps * 1e9));
    Ok((alpha.or(env.0), beta.or(env.1)))
}

/// Measures the link between ring neighbours: every rank sends to `rank + 1` and receives from
/// `rank − 1`, first `PROBE_SMALL` messages of 8 bytes (α: the time of one exchange), then
/// `PROBE_LARGE` of 256 KiB (β: the extra time per byte), then an allreduce-max so that every
/// rank returns the same, slowest, figures. Must be called by every rank of a group of at
/// least two.
pub fn probe(ctx: &mut CollCtx<'_>) -> TResult<Link> {
    let (rank, size) = (ctx.transport.rank(), ctx.transport.size());
    let (right, left) = ((rank + 1) % size, (rank + size - 1) % size);
    let deadline = ctx.deadline;
    let remaining = || deadline.saturating_duration_since(Instant::now());
    let mut out = vec![0u8; PROBE_LARGE_BYTES];
    let mut inb = vec![0u8; PROBE_LARGE_BYTES];
    let mut time = |ctx: &mut CollCtx<'_>, step: u64, bytes: usize, rounds: usize| {
        let tag = ctx.tag(step);
        let mut times = Vec::with_capacity(rounds);
        for _ in 0..rounds {
            let t0 = Instant::now();
            let got = ctx.transport.send_recv(
                right,
                tag,
                &out[..bytes],
                left,
                tag,
                &mut inb[..bytes],
                remaining(),
            )?;
            if got != bytes {
                return Err(TransportError::Mismatch {
                    peer: left,
                    expected_tag: tag,
                    got_tag: tag,
                    expected_len: bytes,
                    got_len: got,
                });
            }
            times.push(t0.elapsed());
        }
        out[0] ^= 1; // keep the buffers used
                     // The median of the timed rounds: robust to one descheduled round.
        let mut timed: Vec<Duration> = times[PROBE_WARMUP..].to_vec();
        timed.sort();
        Ok(timed[timed.len() / 2].as_secs_f64())
    };
    let small = time(ctx, 0, PROBE_SMALL_BYTES, PROBE_SMALL)?;
    let large = time(ctx, 1, PROBE_LARGE_BYTES, PROBE_LARGE)?;
    let alpha = small;
    let beta = ((large - small) / (PROBE_LARGE_BYTES - PROBE_SMALL_BYTES) as f64).max(1e-12);
    // Agree: the slowest figures of any rank.
    let mut both = [alpha, beta];
    let mut agree = CollCtx {
        transport: &mut *ctx.transport,
        deadline,
        tag_base: ctx.tag_base | 0x100,
        scratch: &mut *ctx.scratch,
    };
    // Recursive doubling: ⌈log₂p⌉ steps, whose tags fit any group (the ring's 2(p−1) would
    // overflow the step field beyond 32 768 ranks).
    allreduce::run(
        Algorithm::RecursiveDoubling,
        &mut agree,
        None,
        bytemuck::cast_slice_mut(&mut both),
        DType::Float64,
        ReduceOp::Max,
    )?;
    Ok(Link {
        alpha: both[0],
        beta: both[1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisit_times_are_scaled_to_the_bucket_top_by_the_model() {
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let ring = Algorithm::Ring;
        // Where the bytes dominate (16 MiB bucket on 1 gbit), about the ratio of the sizes.
        let f = s.to_bucket_top(ring, 9 << 20);
        assert!((f - 16.0 / 9.0).abs() < 0.05, "{f}");
        // Where the latency does (a few bytes), about 1.
        let f = s.to_bucket_top(Algorithm::RecursiveDoubling, 5);
        assert!((1.0..1.01).contains(&f), "{f}");
        // A power of two is its own top; never below 1, never NaN.
        assert_eq!(s.to_bucket_top(ring, 1 << 20), 1.0);
        assert_eq!(s.to_bucket_top(ring, 0), 1.0);
        assert!(s.to_bucket_top(ring, usize::MAX).is_finite());
    }

    #[test]
    fn configured_link_figures_win_over_the_environment() {
        let mut c = crate::Config::new(0, 2, "127.0.0.1:1");
        let env = (Some(5e-6), Some(1e-9));
        assert_eq!(link_from_config(&c, env).unwrap(), env);
        c.alpha_us = Some(20.0);
        let (a, b) = link_from_config(&c, env).unwrap();
        assert!((a.unwrap() - 20e-6).abs() < 1e-12 && b == env.1);
        c.beta_gbps = Some(0.5);
        let (_, b) = link_from_config(&c, (None, None)).unwrap();
        assert!((b.unwrap() - 2e-9).abs() < 1e-18);
        // Out of range too: 1e300 GB/s would make β 0, 1e-320 infinite.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300, 1e-320] {
            c.beta_gbps = Some(bad);
            let e = link_from_config(&c, env).unwrap_err();
            assert!(e.to_string().contains("beta_gbps"), "{e}");
        }
        c.beta_gbps = None;
        for bad in [0.0, 1e-9, 1e12, f64::NAN] {
            c.alpha_us = Some(bad);
            let e = link_from_config(&c, env).unwrap_err();
            assert!(e.to_string().contains("alpha_us"), "{e}");
        }
    }

    #[test]
    fn grammar() {
        let only = |s: &str| AlgoFilter::parse(s).unwrap().forced();
        assert_eq!(only("ring"), Some(Algorithm::Ring));
        assert_eq!(only("allreduce:ring;broadcast:tree"), Some(Algorithm::Ring));
        assert_eq!(only("all_reduce : tree"), Some(Algorithm::Tree));
        assert_eq!(
            only("ring;allreduce:halving_doubling"),
            Some(Algorithm::HalvingDoubling)
        );
        assert_eq!(only("broadcast:ring"), None);
        let f = AlgoFilter::parse("ring,tree").unwrap();
        assert!(f.allows(Algorithm::Ring) && f.allows(Algorithm::Tree));
        assert!(!f.allows(Algorithm::HalvingDoubling) && f.forced().is_none());
        let f = AlgoFilter::parse("allreduce:^ring").unwrap();
        assert!(!f.allows(Algorithm::Ring) && f.allows(Algorithm::RecursiveDoubling));
        assert_eq!(AlgoFilter::parse("").unwrap(), AlgoFilter::default());
        assert!(AlgoFilter::parse("allreduce:nonsense").is_err());
        assert!(
            AlgoFilter::parse("^ring,tree,halving_doubling,recursive_doubling,double_tree")
                .is_err()
        );
    }

    #[test]
    fn trial_plans_follow_the_model_and_the_filter() {
        for link in [Link::TCP_LOOPBACK, Link::GIGABIT_ETHERNET] {
            for p in [2, 3, 4, 5, 8] {
                let s = Selector::new(p, link, LinkSource::Default, AlgoFilter::default());
                for b in [
                    1,
                    8,
                    1000,
                    1 << 16,
                    1 << 20,
                    4 << 20,
                    (4 << 20) + 1,
                    64 << 20,
                ] {
                    let plan = s.trial_plan(b);
                    assert!(!plan.candidates.is_empty());
                    // The model's choice first, every candidate allowed and plausible.
                    assert_eq!(plan.candidates[0].0, s.select(b), "p={p} b={b}");
                    let best = s.select(b).cost(b, p, &link);
                    for &(a, reps) in &plan.candidates {
                        assert!(AlgoFilter::default().allows(a));
                        assert!(plan.dedicated || a.cost(b, p, &link) <= PLAUSIBLE * best);
                        assert!((1..=TRIAL_PASS_REPS.max(plan.min_reps)).contains(&reps));
                        // Bandwidth-bound dedicated trials: only schedules the model puts
                        // within DEDICATED_PLAUSIBLE.
                        let bandwidth_bound =
                            best > BANDWIDTH_BOUND * s.select(b).cost(1, p, &link);
                        assert!(
                            !bandwidth_bound || a.cost(b, p, &link) <= DEDICATED_PLAUSIBLE * best
                        );
                    }
                    // Latency-bound buckets try every allowed schedule.
                    if plan.dedicated && best <= BANDWIDTH_BOUND * s.select(b).cost(1, p, &link) {
                        assert_eq!(
                            plan.candidates.len(),
                            Algorithm::ALL.len() - 1,
                            "p={p} b={b}"
                        );
                    }
                    assert_eq!(plan.dedicated, b <= DEDICATED_MAX_BYTES);
                    if !plan.dedicated {
                        assert!(plan.candidates.len() <= ONLINE_CANDIDATES);
                        assert!(plan.candidates.iter().all(|c| c.1 == 1) && plan.passes == 1);
                    }
                    assert!((1..=TRIAL_MAX_PASSES).contains(&plan.passes));
                }
            }
        }
        let tiny = Selector::new(
            4,
            Link::TCP_LOOPBACK,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        assert!(tiny.trial_plan(8).candidates.len() >= 2);
        assert!(tiny.trial_plan(8).candidates[0].1 > 1, "tiny trials repeat");
        // Large buckets on a link: the ring and halving-doubling only (the model's bandwidth
        // ranking holds); with more ranks than cores, the others within 3x too that do no
        // more than 1.25x the least work on the shared cores (the tree, not recursive doubling).
        let big = 64 << 20;
        let tried = |s: &Selector| -> Vec<Algorithm> {
            s.trial_plan(big).candidates.iter().map(|c| c.0).collect()
        };
        let linked = tried(&tiny);
        assert_eq!(linked.len(), 2, "{linked:?}");
        assert!(linked.contains(&Algorithm::Ring) && linked.contains(&Algorithm::HalvingDoubling));
        let crowded = tiny.clone().with_cpu_bound(true);
        assert!(crowded.cpu_bound() && !tiny.cpu_bound());
        let names = tried(&crowded);
        assert_eq!(
            names,
            [Algorithm::HalvingDoubling, Algorithm::Ring, Algorithm::Tree],
            "every plausible one"
        );
        assert!(names.iter().all(|&a| crowded.modelled_cost(a, big)
            <= PLAUSIBLE_CPU_BOUND * crowded.modelled_cost(crowded.select(big), big)));
        // Without the tree, the work rule leaves recursive doubling out all the same.
        let no_tree = Selector::new(
            4,
            Link::TCP_LOOPBACK,
            LinkSource::Default,
            AlgoFilter::parse("^tree,double_tree").unwrap(),
        )
        .with_cpu_bound(true);
        let left = tried(&no_tree);
        assert!(!left.contains(&Algorithm::RecursiveDoubling), "{left:?}");
        assert_eq!(left.len(), 2, "{left:?}");
        // A probe's figures on 4 ranks sharing 2 cores: 32 KiB tries every schedule (recursive
        // doubling and the tree win there in loops), 2 MiB only the ring and halving-doubling.
        let probed = Selector::new(
            4,
            Link::new(8.9e-6, 0.26e9),
            LinkSource::Measured,
            AlgoFilter::default(),
        );
        assert_eq!(
            probed.trial_plan(32 << 10).candidates.len(),
            Algorithm::ALL.len() - 1
        );
        let mut two_mib: Vec<Algorithm> = probed
            .trial_plan(2 << 20)
            .candidates
            .iter()
            .map(|c| c.0)
            .collect();
        two_mib.sort_by_key(|a| a.name());
        assert_eq!(two_mib, [Algorithm::HalvingDoubling, Algorithm::Ring]);
        // Such a probe's β is 4-6x too slow: the model sizes 512 KiB trials at a few passes of
        // few runs; the first pass's times size the rest as they fit the trial time.
        let plan = probed.trial_plan(512 << 10);
        assert!(plan.passes <= TRIAL_MIN_PASSES && plan.candidates.iter().all(|c| c.1 < 8));
        let measured: Vec<f64> = plan.candidates.iter().map(|_| 0.6e-3).collect();
        let rest = plan.after_first_pass(&measured);
        assert!(rest.dedicated);
        assert_eq!(
            rest.candidates.iter().map(|c| c.0).collect::<Vec<_>>(),
            plan.candidates.iter().map(|c| c.0).collect::<Vec<_>>()
        );
        assert!(rest.candidates.iter().all(|c| c.1 == TRIAL_PASS_REPS));
        let pass = 0.6e-3 * (TRIAL_PASS_REPS + 1) as f64 * plan.candidates.len() as f64;
        let fit = (TRIAL_TIME.as_secs_f64() / pass) as usize;
        assert_eq!(rest.passes, fit.min(TRIAL_MAX_PASSES) - 1);
        // Slower than modelled: fewer passes, within the longest trial time.
        let slow = plan.after_first_pass(&vec![0.2; plan.candidates.len()]);
        assert!(slow.candidates.iter().all(|c| c.1 == 1));
        assert_eq!(slow.passes, 0);
        let two = AlgoFilter::parse("ring,tree").unwrap();
        let s = Selector::new(4, Link::TCP_LOOPBACK, LinkSource::Default, two);
        for b in [8, 1 << 20, 64 << 20] {
            assert!(s
                .trial_plan(b)
                .candidates
                .iter()
                .all(|c| matches!(c.0, Algorithm::Ring | Algorithm::Tree)));
        }
    }

    #[test]
    fn revisits_retime_rivals_and_switch() {
        use Algorithm::{HalvingDoubling as Hd, RecursiveDoubling as Rd, Ring, Tree};
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let mut t = Tuner::new();
        let b = 8;
        let cands = [Rd, Tree, Hd, Ring];
        let m: Vec<f64> = cands.iter().map(|&a| s.modelled_cost(a, b)).collect();
        // 40 us: 16-call blocks. The tree (1.2x) and HD (1.45x) are rivals, the ring is not.
        let own = 40e-6;
        let times = [own, 1.2 * own, 1.45 * own, 1.6 * own];
        assert_eq!(t.decide(b, &cands, &times, &m, true), Rd);
        let window = ((REVISIT_BLOCK.as_secs_f64() / own).ceil() as usize)
            .clamp(REVISIT_MIN_WINDOW, REVISIT_MAX_WINDOW);
        assert_eq!(window, REVISIT_MAX_WINDOW);
        // Runs one revisit: the rival's block, then the schedule's; the first call of each
        // untimed. Returns what `record_revisit` handed back at the end.
        let revisit = |t: &mut Tuner, rival: Algorithm, chosen: Algorithm, secs: [f64; 2]| {
            for call in 0..2 * window {
                let is_rival = call < window;
                let expect = Next::Revisit {
                    algorithm: if is_rival { rival } else { chosen },
                    rival: is_rival,
                };
                assert_eq!(t.next(&s, b), expect, "call {call}");
                // The first call of each block (after the switch) is slow and left out: the
                // means below hold only if these 1000 s are ignored.
                let seconds = match call % window {
                    0 => 1e3,
                    _ if is_rival => secs[0],
                    _ => secs[1],
                };
                let got = t.record_revisit(b, seconds);
                assert_eq!(got.is_some(), call + 1 == 2 * window, "call {call}");
                if let Some((r, c, means)) = got {
                    assert_eq!((r, c), (rival, chosen));
                    for (m, s) in means.iter().zip(secs) {
                        assert!((m - s).abs() < 1e-12, "{means:?} {secs:?}");
                    }
                    return means;
                }
            }
            unreachable!()
        };
        let uses = |t: &mut Tuner, b: usize, n: usize, a: Algorithm| {
            for _ in 0..n {
                assert_eq!(t.next(&s, b), Next::Use(a));
            }
        };
        let gap = REVISIT_FIRST_GAP * window;
        // Calls before a revisit of a rival expected `ratio`x as slow, by the budget alone.
        let budget = |ratio: f64, window: usize| {
            (window as f64 * (ratio - 1.0) / REVISIT_BUDGET).ceil() as usize
        };
        // A rival not revisited yet is expected as slow as the trials admit: the first
        // revisit waits longer than the first gap.
        let unseen = budget(UNSEEN_RIVAL_RATIO, window);
        assert!(unseen > 2 * gap, "{unseen} {gap}");
        uses(&mut t, b, unseen, Rd);
        // The tree, close behind: kept as a rival; the gap doubles; HD's turn next (not
        // revisited yet: the budget's wait is longer than the doubled gap).
        let means = revisit(&mut t, Tree, Rd, [1.1 * own, own]);
        let out = t.settle_revisit(b, means).unwrap();
        assert_eq!((out.now, out.next_in), (Rd, Some(unseen)));
        uses(&mut t, b, unseen, Rd);
        // HD wins by more than the margin: one revisit is not enough; HD is retimed after the
        // first gap, and the second win confirms it: it takes over, RD is revisited next.
        let means = revisit(&mut t, Hd, Rd, [0.9 * own, own]);
        let out = t.settle_revisit(b, means).unwrap();
        assert_eq!((out.rival, out.now, out.next_in), (Hd, Rd, Some(gap)));
        assert_eq!(out.evidence.0, 1);
        uses(&mut t, b, gap, Rd);
        let means = revisit(&mut t, Hd, Rd, [0.9 * own, own]);
        let out = t.settle_revisit(b, means).unwrap();
        assert_eq!((out.rival, out.chosen, out.now), (Hd, Rd, Hd));
        assert_eq!(out.evidence.0, 2);
        assert!((out.evidence.1 - 0.9).abs() < 1e-9, "{:?}", out.evidence);
        assert_eq!(t.decided(b), Some(Hd));
        // RD is revisited next, expected 1/0.9 as slow: within the budget after the first gap.
        assert!(budget(1.0 / 0.9, window) <= gap);
        assert_eq!(out.next_in, Some(gap));
        uses(&mut t, b, gap, Hd);
        // Faster by less than the margin: no switch; the tree's turn (its evidence was
        // forgotten at the switch, so it waits as a rival not revisited yet).
        let means = revisit(&mut t, Rd, Hd, [(1.0 - REVISIT_MARGIN / 2.0) * own, own]);
        let out = t.settle_revisit(b, means).unwrap();
        assert_eq!((out.now, out.next_in), (Hd, Some(unseen)));
        uses(&mut t, b, unseen, Hd);
        // A failed call drops the revisit in progress; the bucket keeps its schedule and
        // waits the same gap.
        assert!(matches!(t.next(&s, b), Next::Revisit { rival: true, .. }));
        t.reset(b);
        assert_eq!(t.decided(b), Some(Hd));
        uses(&mut t, b, unseen, Hd);
        // So does turning tuning off or on in the middle of one.
        assert!(matches!(t.next(&s, b), Next::Revisit { rival: true, .. }));
        t.record_revisit(b, 0.0);
        t.drop_revisits();
        uses(&mut t, b, unseen, Hd);
        // Rivals far behind are dropped once at least RIVAL_DROP_AFTER revisits each confirm
        // it; with none left the bucket is settled for good.
        let mut revisits = std::collections::HashMap::new();
        let mut settled = false;
        for _ in 0..20 {
            let rival = loop {
                match t.next(&s, b) {
                    Next::Use(a) => assert_eq!(a, Hd),
                    Next::Revisit {
                        algorithm,
                        rival: true,
                    } => break algorithm,
                    other => panic!("{other:?}"),
                }
            };
            *revisits.entry(rival).or_insert(0) += 1;
            let mut means = None;
            for call in 0..2 * window {
                if call > 0 {
                    assert!(matches!(t.next(&s, b), Next::Revisit { .. }));
                }
                let secs = if call < window { 2.0 * own } else { own };
                means = t.record_revisit(b, secs);
            }
            let out = t.settle_revisit(b, means.unwrap().2).unwrap();
            assert_eq!(out.now, Hd);
            // Every rival measured 2x as slow: the next revisit waits out the budget.
            if let (Some(n), 2..) = (out.next_in, revisits.values().sum::<usize>()) {
                assert!(n >= budget(2.0, window).min(unseen), "{n}");
            }
            if out.next_in.is_none() {
                settled = true;
                break;
            }
        }
        assert!(settled);
        assert!(
            revisits.values().all(|&n| n >= RIVAL_DROP_AFTER),
            "{revisits:?}"
        );
        uses(&mut t, b, 100 * gap, Hd);
        // A win then a loss: no switch (the median of the two is within the margin), and the
        // loss doubles the gap as usual.
        let mut t = Tuner::new();
        assert_eq!(t.decide(b, &cands, &times, &m, true), Rd);
        uses(&mut t, b, unseen, Rd);
        let means = revisit(&mut t, Tree, Rd, [0.8 * own, own]);
        assert_eq!(t.settle_revisit(b, means).unwrap().next_in, Some(gap));
        uses(&mut t, b, gap, Rd);
        let means = revisit(&mut t, Tree, Rd, [1.2 * own, own]);
        let out = t.settle_revisit(b, means).unwrap();
        assert_eq!((out.now, out.next_in), (Rd, Some(unseen)));
        // Large buckets (one call is longer than a block): the fewest calls per block.
        let w = REVISIT_MIN_WINDOW;
        let big = 64 << 20;
        let pair = [Ring, Hd];
        let mp: Vec<f64> = pair.iter().map(|&a| s.modelled_cost(a, big)).collect();
        t.decide(big, &pair, &[0.5, 0.6], &mp, true);
        assert_eq!(t.decided(big), Some(Ring));
        uses(&mut t, big, budget(UNSEEN_RIVAL_RATIO, w), Ring);
        assert_eq!(
            t.next(&s, big),
            Next::Revisit {
                algorithm: Hd,
                rival: true
            }
        );
        // The gap stops doubling at its cap.
        let mut t = Tuner::new();
        t.decide(big, &pair, &[0.5, 0.6], &mp, true);
        let mut last = 0;
        for _ in 0..20 {
            while let Next::Use(_) = t.next(&s, big) {}
            t.record_revisit(big, 0.0);
            for _ in 1..2 * w {
                assert!(matches!(t.next(&s, big), Next::Revisit { .. }));
                t.record_revisit(big, 0.5);
            }
            let out = t.settle_revisit(big, [0.5, 0.5]).unwrap();
            assert_eq!(out.now, Ring);
            last = out.next_in.unwrap();
        }
        assert_eq!(last, REVISIT_MAX_GAP * w);
    }

    #[test]
    fn revisits_spend_a_bounded_share() {
        use Algorithm::{HalvingDoubling as Hd, RecursiveDoubling as Rd, Ring, Tree};
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let cands = [Rd, Tree, Hd, Ring];
        let m: Vec<f64> = cands.iter().map(|&a| s.modelled_cost(a, 8)).collect();
        // True per-call times (RD decided): both rivals slower, by up to what the trials
        // admit; the caller's loop sees every call, the rivals' included.
        for (bytes, own) in [(8, 40e-6), (64 << 20, 0.05)] {
            let truth = |a: Algorithm| match a {
                Tree => 1.3 * own,
                Hd => 1.45 * own,
                _ => own,
            };
            let mut t = Tuner::new();
            let trial = [own, 1.1 * own, 1.2 * own, 3.0 * own];
            assert_eq!(t.decide(bytes, &cands, &trial, &m, true), Rd);
            let (mut calls, mut spent) = (0usize, 0.0);
            let mut revisits = 0;
            for _ in 0..200_000 {
                let (a, rival) = match t.next(&s, bytes) {
                    Next::Use(a) => (a, None),
                    Next::Revisit { algorithm, rival } => (algorithm, Some(rival)),
                    other => panic!("{other:?}"),
                };
                calls += 1;
                spent += truth(a);
                if rival.is_some() {
                    if let Some((_, _, means)) = t.record_revisit(bytes, truth(a)) {
                        t.settle_revisit(bytes, means).unwrap();
                        revisits += 1;
                        // The slower calls so far stay within the budget of all calls'
                        // time (the schedule's own time is `own` per call).
                        let share = spent / (calls as f64 * own) - 1.0;
                        assert!(share <= REVISIT_BUDGET, "{bytes} B: {share} after {calls}");
                    }
                }
            }
            assert!(revisits >= 2, "{revisits}");
            // Settled for good: both rivals dropped, RD kept throughout.
            assert_eq!(t.next(&s, bytes), Next::Use(Rd));
            let share = spent / (calls as f64 * own) - 1.0;
            assert!(share < REVISIT_BUDGET / 4.0, "{bytes} B: {share}");
        }
    }

    #[test]
    fn median_of_passes() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0]), 3.0);
        assert_eq!(median(&mut [9.0, 1.0]), 5.0);
        assert_eq!(median(&mut [9.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn trace_of_trial_passes() {
        use Algorithm::*;
        let line = describe_passes(
            2 << 20,
            &[(Ring, 1), (HalvingDoubling, 1)],
            &[(Ring, 8), (HalvingDoubling, 7)],
            &[vec![4.8e-3, 2.0e-3, 2.2e-3], vec![5.0e-3, 3.0e-3, 3.1e-3]],
            1,
        );
        assert_eq!(
            line,
            "all_reduce trial passes for 2 MiB: ring (1/8 runs) [4800.0] 2000.0 2200.0; \
             halving_doubling (1/7 runs) [5000.0] 3000.0 3100.0;"
        );
    }

    #[test]
    fn blocks_on_links_carry_enough_bytes() {
        use Algorithm::*;
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let b = 8 << 10;
        let want = TRIAL_BLOCK_BYTES / b;
        assert!(want > TRIAL_PASS_REPS);
        assert_eq!(s.min_block_calls(b), want);
        let plan = s.trial_plan(b);
        assert!(plan.dedicated && plan.candidates.len() > 1);
        assert_eq!(plan.min_reps, want);
        let n = plan.candidates.len();
        // Later passes: `want` calls of 100 µs each fit TRIAL_PASS_TIME; of 1 ms, only 20.
        let rest = plan.after_first_pass(&vec![100e-6; n]);
        assert!(rest.candidates.iter().all(|c| c.1 == want), "{rest:?}");
        let fit = (TRIAL_PASS_TIME.as_secs_f64() / 1e-3) as usize;
        let rest = plan.after_first_pass(&vec![1e-3; n]);
        assert!(rest.candidates.iter().all(|c| c.1 == fit), "{rest:?}");
        // Latency-bound buckets, and hosts running more ranks than cores: the short blocks.
        assert_eq!(s.min_block_calls(8), 1);
        assert_eq!(s.trial_plan(8).min_reps, 1);
        let crowded = s.clone().with_cpu_bound(true);
        assert_eq!(crowded.min_block_calls(b), 1);
        let rest = crowded.trial_plan(b).after_first_pass(&vec![100e-6; n]);
        assert!(rest.candidates.iter().all(|c| c.1 == TRIAL_PASS_REPS));
        // Such buckets are settled by their trials; where ranks share cores they are
        // revisited, in time-based blocks (the rival's, then the schedule's).
        assert!(!s.revisits(b));
        assert!(crowded.revisits(b));
        let (revisit, calls) = (crowded.revisits(b), REVISIT_MAX_WINDOW);
        let mut t = Tuner::new();
        let cands = [HalvingDoubling, RecursiveDoubling];
        let m: Vec<f64> = cands.iter().map(|&a| s.modelled_cost(a, b)).collect();
        assert_eq!(
            t.decide(b, &cands, &[100e-6, 110e-6], &m, revisit),
            HalvingDoubling
        );
        let mut seen = Vec::new();
        for _ in 0..1_000_000 {
            match t.next(&s, b) {
                Next::Use(a) => assert_eq!(a, HalvingDoubling),
                Next::Revisit { rival, .. } => {
                    seen.push(rival);
                    if t.record_revisit(b, 100e-6).is_some() {
                        break;
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        let rivals = seen.iter().filter(|&&r| r).count();
        assert_eq!((rivals, seen.len()), (calls, 2 * calls));
    }

    #[test]
    fn a_left_out_first_pass_leaves_the_fewest_passes_counted() {
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let b = 8 << 10;
        let plan = s.trial_plan(b);
        let n = plan.candidates.len();
        assert_eq!(n, 4, "{plan:?}");
        // The testbed's 8 KiB: 4 candidates, blocks of 128 calls of ~130 µs (a pass of
        // 67 ms), the first pass sized short by the model. TRIAL_MAX_TIME fits 3 passes in
        // all, so 2 would follow the first; as it is left out, 3 follow it (they fit with
        // it).
        let first = TrialPlan {
            candidates: plan.candidates.iter().map(|&(a, _)| (a, 100)).collect(),
            ..plan.clone()
        };
        let rest = first.after_first_pass(&vec![130e-6; n]);
        assert!(rest.candidates.iter().all(|c| c.1 == 128), "{rest:?}");
        assert_eq!(rest.passes, TRIAL_MIN_PASSES);
        assert!(drop_first_pass(&first, &rest));
        // The first pass as long as the later ones counts: two follow, as before.
        let full = TrialPlan {
            candidates: plan.candidates.iter().map(|&(a, _)| (a, 128)).collect(),
            ..plan.clone()
        };
        let rest = full.after_first_pass(&vec![130e-6; n]);
        assert_eq!(rest.passes, TRIAL_MIN_PASSES - 1);
        assert!(!drop_first_pass(&full, &rest));
        // Only what fits TRIAL_MAX_TIME with the first pass follows: at 300 µs a call, a
        // first pass of 60 calls each (73 ms with 4 candidates) leaves room for two of 66.
        let long_first = TrialPlan {
            candidates: plan.candidates.iter().map(|&(a, _)| (a, 60)).collect(),
            ..plan.clone()
        };
        let rest = long_first.after_first_pass(&vec![300e-6; n]);
        assert!(rest.candidates.iter().all(|c| c.1 == 66), "{rest:?}");
        let room = TRIAL_MAX_TIME.as_secs_f64() - 300e-6 * 61.0 * n as f64;
        let fit = (room / (300e-6 * 67.0 * n as f64)) as usize;
        assert!(fit < TRIAL_MIN_PASSES, "{fit}");
        assert_eq!(rest.passes, fit.max(2));
    }

    #[test]
    fn first_trial_pass_left_out_only_when_short_and_followed() {
        use Algorithm::*;
        let plan = |reps: [usize; 2], passes| TrialPlan {
            candidates: vec![(Ring, reps[0]), (HalvingDoubling, reps[1])],
            passes,
            dedicated: true,
            min_reps: 1,
        };
        // The model gave the ring 1 run where its measured time fits 8: left out for both.
        assert!(drop_first_pass(&plan([1, 8], 1), &plan([8, 8], 2)));
        assert!(drop_first_pass(&plan([8, 1], 1), &plan([8, 8], 5)));
        // As long as the later passes (or longer): it counts.
        assert!(!drop_first_pass(&plan([8, 8], 1), &plan([8, 8], 5)));
        assert!(!drop_first_pass(&plan([8, 8], 1), &plan([3, 8], 5)));
        // Fewer than two passes after it: it counts, so that one pass does not decide.
        assert!(!drop_first_pass(&plan([1, 1], 1), &plan([8, 8], 1)));
        assert!(!drop_first_pass(&plan([1, 1], 1), &plan([8, 8], 0)));
    }

    #[test]
    fn tuner_states() {
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let mut t = Tuner::new();
        // Small: dedicated trials, decided by the agreed times (ties to the first).
        let Next::Trials(plan) = t.next(&s, 100) else {
            panic!("small buckets run dedicated trials")
        };
        let cands: Vec<Algorithm> = plan.candidates.iter().map(|c| c.0).collect();
        let model = |c: &[Algorithm], b: usize| -> Vec<f64> {
            c.iter().map(|&a| s.modelled_cost(a, b)).collect()
        };
        let m = model(&cands, 8);
        let mut times = vec![2.0; cands.len()];
        *times.last_mut().unwrap() = 1.0;
        assert_eq!(
            t.decide(100, &cands, &times, &model(&cands, 100), true),
            *cands.last().unwrap()
        );
        assert_eq!(t.decided(128), Some(*cands.last().unwrap()), "same bucket");
        assert_eq!(t.next(&s, 65), Next::Use(*cands.last().unwrap()));
        assert_eq!(t.decided(129), None);
        assert_eq!(
            t.decide(8, &cands, &vec![1.0; cands.len()], &m, true),
            cands[0]
        );
        // The model's choice stays unless another is faster by more than the margin.
        let mut close = vec![1.0; cands.len()];
        close[0] = 1.0 + KEEP_MODEL_MARGIN / 2.0;
        assert!(m[1] > m[0] * (1.0 + KEEP_MODEL_MARGIN), "{m:?}");
        assert_eq!(t.decide(8, &cands, &close, &m, true), cands[0]);
        let mut clear = vec![2.0; cands.len()];
        clear[0] = 1.0 + 2.0 * KEEP_MODEL_MARGIN;
        clear[1] = 1.0;
        assert_eq!(t.decide(8, &cands, &clear, &m, true), cands[1]);
        // Among the others, ties go to the better-modelled one.
        if cands.len() >= 3 {
            let mut tie = vec![1.0; cands.len()];
            tie[0] = 2.0;
            assert_eq!(t.decide(8, &cands, &tie, &m, true), cands[1]);
        }
        // Schedules the model cannot tell apart: the trials decide, unless they tie within
        // TRIAL_TIE, when the model's order does.
        let pair = [Algorithm::HalvingDoubling, Algorithm::Ring];
        let tied = [1.0, 1.0 + KEEP_MODEL_MARGIN / 10.0];
        assert_eq!(
            t.decide(8, &pair, &[1.02, 1.0], &tied, true),
            Algorithm::Ring
        );
        assert_eq!(
            t.decide(8, &pair, &[1.0 + TRIAL_TIE / 2.0, 1.0], &tied, true),
            Algorithm::HalvingDoubling
        );
        assert_eq!(
            t.decide(8, &pair, &[1.0, 1.0], &tied, true),
            Algorithm::HalvingDoubling
        );
        // Large on a link: the ring and halving-doubling tie in the model; with no smaller
        // bucket decided nearby its choice stands
        // without trials.
        let big = 5 << 20;
        let plan = s.trial_plan(big);
        assert!(plan.candidates.len() >= 2 && s.model_ties(&plan, big));
        let mut tied = Tuner::new();
        assert_eq!(
            tied.next(&s, big),
            Next::Tied {
                algorithm: plan.candidates[0].0,
                tied: plan.candidates[1..].iter().map(|c| c.0).collect(),
                after: None,
            }
        );
        assert_eq!(plan.candidates[0].0, s.select(big));
        assert_eq!(tied.decided(big), Some(s.select(big)));
        assert_eq!(tied.next(&s, big), Next::Use(s.select(big)));
        // A smaller bucket nearby decided on the other tied schedule: that breaks the tie, and
        // the tied bucket passes it on to the next tie.
        let other = plan.candidates[1].0;
        // A tuner whose bucket of `bytes` trials decided on `other`, 1.16x ahead.
        let decided_below = |bytes: usize| {
            let mut t = Tuner::new();
            t.restore(
                bytes,
                other,
                &[other, plan.candidates[0].0],
                &[1.0, 1.16],
                false,
            );
            t
        };
        let mut after = decided_below(2 << 20);
        let (b8, b32) = (8 << 20, 32 << 20);
        assert!(s.model_ties(&s.trial_plan(b8), b8) && s.model_ties(&s.trial_plan(b32), b32));
        assert_eq!(
            after.next(&s, b8),
            Next::Tied {
                algorithm: other,
                tied: vec![plan.candidates[0].0],
                after: Some(2 << 20),
            }
        );
        assert!(matches!(
            after.next(&s, b32),
            Next::Tied { algorithm, after: Some(a), .. } if algorithm == other && a == 8 << 20
        ));
        // Too far below (more than INHERIT_SPAN rows): the model's choice.
        let mut far = decided_below(512 << 10);
        assert!(matches!(far.next(&s, b8), Next::Tied { after: None, .. }));
        // A link whose latency sets them apart (1 ms per message): the caller's calls are the
        // trials, decided after the last.
        // (`model` keeps the gigabit link's costs: this section passes the 1 ms link's.)
        let s = Selector::new(
            4,
            Link::new(1e-3, 119.6e6),
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let plan = s.trial_plan(big);
        assert!(!s.model_ties(&plan, big));
        // Run worst modelled first.
        let cands: Vec<Algorithm> = plan.candidates.iter().rev().map(|c| c.0).collect();
        assert!(cands.len() >= 2, "{cands:?}");
        assert_eq!(*cands.last().unwrap(), s.select(big));
        for (i, &a) in cands.iter().enumerate() {
            assert_eq!(t.next(&s, big), Next::Online(a));
            let done = t.record(big, 1.0 + i as f64);
            assert_eq!(done.is_some(), i + 1 == cands.len());
            if let Some((c, times)) = done {
                assert_eq!((c, times.len()), (cands.clone(), cands.len()));
            }
        }
        assert_eq!(t.decided(big), None, "decided only once agreed");
        // A failed call starts the bucket again.
        t.reset(big);
        assert_eq!(t.next(&s, big), Next::Online(cands[0]));
        t.decide(
            big,
            &cands,
            &[3.0, 1.0, 2.0][..cands.len()],
            &cands
                .iter()
                .map(|&a| s.modelled_cost(a, big))
                .collect::<Vec<_>>(),
            s.revisits(big),
        );
        assert_eq!(t.decided(big), Some(cands[1]));
        // With more ranks than cores, each candidate's block is an untimed call and
        // ONLINE_CPU_BOUND_RUNS timed ones; a candidate's time is the fastest of them.
        let crowded = s.clone().with_cpu_bound(true);
        let mut tc = Tuner::new();
        let plan = crowded.trial_plan(big);
        assert!(plan.candidates.iter().all(|c| c.1 == ONLINE_CPU_BOUND_RUNS));
        let order: Vec<Algorithm> = plan.candidates.iter().rev().map(|c| c.0).collect();
        assert!(order.len() >= 2, "{order:?}");
        for (i, &a) in order.iter().enumerate() {
            for call in 0..=ONLINE_CPU_BOUND_RUNS {
                assert_eq!(tc.next(&crowded, big), Next::Online(a));
                assert_eq!(tc.online_fresh(big).is_some(), i == 0 && call == 0);
                // The untimed first call is slow; the timed ones take i+1 and, stretched,
                // 10(i+2).
                let seconds = match call {
                    0 => 100.0,
                    1 => (i + 1) as f64,
                    _ => (10 * (i + call)) as f64,
                };
                let done = tc.record(big, seconds);
                let last = i + 1 == order.len() && call == ONLINE_CPU_BOUND_RUNS;
                assert_eq!(done.is_some(), last);
                if let Some((c, times)) = done {
                    assert_eq!(c, order);
                    // Scaled to the bucket's top size.
                    let scale = (1usize << bucket(big)) as f64 / big as f64;
                    for (j, t) in times.iter().enumerate() {
                        assert!((t - (j + 1) as f64 * scale).abs() < 1e-9, "{times:?}");
                    }
                }
            }
        }
        // Calls of different sizes in one bucket: times per the bucket's size, so that the
        // candidate timed on the smaller call does not win for that.
        let mut ts = Tuner::new();
        let top = 1usize << bucket(big);
        let plan = s.trial_plan(big);
        let n = plan.candidates.len();
        let mut got = None;
        for i in 0..n {
            let _ = ts.next(&s, big);
            // Candidate i on a call of a size from just above half the bucket up, at one speed
            // per byte.
            let bytes = top / 2 + 1 + (top / 2 - 1) * i / n;
            assert_eq!(bucket(bytes), bucket(big));
            got = got.or(ts.record(bytes, bytes as f64 * 1e-9));
        }
        let (_, times) = got.expect("every candidate timed");
        for t in &times {
            assert!((t - top as f64 * 1e-9).abs() < 1e-12, "{times:?}");
        }
        // Large buckets on links are not revisited: the bucket's schedule from now on. Nor are
        // buckets with dedicated trials where the bytes weigh more than the latency; the
        // latency-bound ones are.
        assert!(!s.revisits(big) && !s.revisits(DEDICATED_MAX_BYTES) && s.revisits(8));
        assert!(s.clone().with_cpu_bound(true).revisits(big));
        for _ in 0..10_000 {
            assert_eq!(t.next(&s, big), Next::Use(cands[1]));
        }
        t.reset(big);
        assert_eq!(
            t.decided(big),
            Some(cands[1]),
            "reset leaves decided buckets"
        );
        // One candidate: nothing to try.
        let ring = AlgoFilter::parse("ring").unwrap();
        let s = Selector::new(4, Link::GIGABIT_ETHERNET, LinkSource::Default, ring);
        let mut t = Tuner::new();
        assert_eq!(t.next(&s, 100), Next::Use(Algorithm::Ring));
        assert_eq!(t.decided(100), Some(Algorithm::Ring));
    }

    #[test]
    fn cheapest_entry_wins_and_filters_edit_the_table() {
        let l = Link::TCP_LOOPBACK;
        let all = Selector::new(4, l, LinkSource::Default, AlgoFilter::default());
        for b in [0, 1, 8, 1000, 1 << 16, 1 << 20, 1 << 26] {
            let a = all.select(b);
            let row = b.max(1).next_power_of_two();
            let c = a.cost(row, 4, &l);
            for other in Algorithm::ALL {
                assert!(c <= other.cost(row, 4, &l), "{b}: {a} vs {other}");
            }
        }
        assert_eq!(all.select(8), Algorithm::RecursiveDoubling);
        let no_rd = AlgoFilter::parse("^recursive_doubling").unwrap();
        let s = Selector::new(4, l, LinkSource::Default, no_rd);
        assert_ne!(s.select(8), Algorithm::RecursiveDoubling);
        let ring = AlgoFilter::parse("ring").unwrap();
        let s = Selector::new(4, l, LinkSource::Default, ring);
        assert!([0, 8, 1 << 30, usize::MAX]
            .iter()
            .all(|&b| s.select(b) == Algorithm::Ring));
        assert!(s.describe().contains("ring always"), "{}", s.describe());
        assert!(
            all.describe().contains("recursive_doubling up to"),
            "{}",
            all.describe()
        );
    }

    #[test]
    fn wide_leads_pass_on_to_neighbouring_large_buckets() {
        use Algorithm::{HalvingDoubling as Hd, Ring, Tree};
        let link = Link::GIGABIT_ETHERNET;
        let s =
            Selector::new(4, link, LinkSource::Default, AlgoFilter::default()).with_cpu_bound(true);
        let (m4, m8, m32, m64) = (4 << 20, 8 << 20, 32 << 20, 64 << 20);
        let modelled =
            |c: &[Algorithm], b| -> Vec<f64> { c.iter().map(|&a| s.modelled_cost(a, b)).collect() };
        let cands: Vec<Algorithm> = s.trial_plan(m8).candidates.iter().map(|c| c.0).collect();
        assert!(cands.contains(&Ring) && cands.contains(&Hd), "{cands:?}");
        // Trial times putting the ring `lead`x ahead of every other candidate.
        let ring_ahead = |cands: &[Algorithm], lead: f64| -> Vec<f64> {
            cands
                .iter()
                .map(|&a| if a == Ring { 1.0 } else { lead })
                .collect()
        };
        let wide = ring_ahead(&cands, 1.6);
        // A wide lead at 8 MiB: 32 MiB (two rows up) takes the ring without trials, and 64 MiB
        // then follows 32 MiB; 128 MiB is three rows from 8 MiB but one from 64 MiB.
        let mut t = Tuner::new();
        t.decide(m8, &cands, &wide, &modelled(&cands, m8), true);
        let from8 = Next::Inherit {
            algorithm: Ring,
            from: m8,
            lead: 1.6,
        };
        assert_eq!(t.next(&s, m32), from8);
        assert_eq!(t.decided(m32), Some(Ring));
        assert_eq!(t.next(&s, m32), Next::Use(Ring));
        let from32 = Next::Inherit {
            algorithm: Ring,
            from: m32,
            lead: 1.6,
        };
        assert_eq!(t.next(&s, m64), from32);
        // Three rows away with nothing decided between: trials.
        let mut t = Tuner::new();
        t.decide(m8, &cands, &wide, &modelled(&cands, m8), true);
        assert!(matches!(t.next(&s, m64), Next::Online(_)));
        // From above as from below.
        let mut t = Tuner::new();
        t.decide(m32, &cands, &wide, &modelled(&cands, m32), true);
        assert!(matches!(t.next(&s, m8), Next::Inherit { from, .. } if from == m32));
        // A lead below INHERIT_LEAD passes nothing on.
        let mut t = Tuner::new();
        let close = ring_ahead(&cands, 1.2);
        t.decide(m8, &cands, &close, &modelled(&cands, m8), true);
        assert!(matches!(t.next(&s, m32), Next::Online(_)));
        // Buckets with dedicated trials pass nothing on: 4 MiB is one row below 8 MiB.
        let mut t = Tuner::new();
        let small: Vec<Algorithm> = s.trial_plan(m4).candidates.iter().map(|c| c.0).collect();
        let wide4 = ring_ahead(&small, 2.0);
        t.decide(m4, &small, &wide4, &modelled(&small, m4), true);
        assert!(matches!(t.next(&s, m8), Next::Online(_)));
        // A schedule the fresh bucket would not try (CHORUS_ALGO) is not taken.
        let no_tree = Selector::new(
            4,
            link,
            LinkSource::Default,
            AlgoFilter::parse("^tree").unwrap(),
        )
        .with_cpu_bound(true);
        let mut t = Tuner::new();
        let pair = [Tree, Ring];
        t.decide(m8, &pair, &[1.0, 1.5], &modelled(&pair, m8), true);
        assert_eq!(t.decided(m8), Some(Tree));
        assert!(matches!(t.next(&no_tree, m32), Next::Online(_)));
        assert!(matches!(t.next(&s, m64), Next::Online(_)));
        // A rival that takes over by its revisits ends the lead (1.35x in the trials, within
        // RIVAL_WITHIN: the tree stays a rival, then wins every revisit).
        let mut t = Tuner::new();
        let pair = [Tree, Ring];
        t.decide(m8, &pair, &[1.35, 1.0], &modelled(&pair, m8), true);
        assert_eq!(t.decided(m8), Some(Ring));
        let mut switched = false;
        for _ in 0..100_000 {
            match t.next(&s, m8) {
                Next::Use(_) => {}
                Next::Revisit { rival, .. } => {
                    let seconds = if rival { 0.5 } else { 1.0 };
                    if let Some((_, _, means)) = t.record_revisit(m8, seconds) {
                        if t.settle_revisit(m8, means).unwrap().now == Tree {
                            switched = true;
                            break;
                        }
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(switched);
        assert!(matches!(t.next(&s, m32), Next::Online(_)));
    }

    #[test]
    fn restored_buckets_are_decided_with_their_rivals_and_lead() {
        use Algorithm::{HalvingDoubling, Ring, Tree};
        let s = Selector::new(
            4,
            Link::GIGABIT_ETHERNET,
            LinkSource::Default,
            AlgoFilter::default(),
        );
        let mut t = Tuner::new();
        // A small bucket as an earlier launch's trials left it: decided, rivals revisited.
        let cands = [Ring, HalvingDoubling, Tree];
        // Restored buckets are re-timed only where ranks outnumber cores.
        assert!(!s.restored_revisits(4096));
        let crowded = s.clone().with_cpu_bound(true);
        assert!(crowded.revisits(4096));
        assert_eq!(crowded.restored_revisits(4096), crowded.revisits(4096));
        assert!(t.restore(4096, HalvingDoubling, &cands, &[1.1, 1.0, 3.0], true));
        assert_eq!(t.decided(3000), Some(HalvingDoubling));
        let Bucket::Decided {
            watch: Some(w),
            lead,
            ..
        } = &t.buckets[bucket(4096)]
        else {
            panic!(
                "a restored bucket keeps its close rivals: {:?}",
                t.buckets[bucket(4096)]
            )
        };
        let rivals: Vec<Algorithm> = w.rivals.iter().map(|r| r.algorithm).collect();
        assert_eq!(rivals, [Ring], "the tree is far behind");
        assert_eq!(*lead, None, "a close decision passes nothing on");
        // A chosen schedule that was not a candidate, or a bucket in use, is not restored.
        assert!(!t.restore(8, Tree, &[Ring], &[1.0], true));
        assert_eq!(t.decided(8), None);
        assert!(matches!(t.next(&s, 8), Next::Trials(_)));
        t.decide(8, &[Tree, Ring], &[1.0, 2.0], &[1.0, 1.0], true);
        assert!(!t.restore(8, Ring, &[Ring], &[1.0], true));
        assert_eq!(t.decided(8), Some(Tree));
        // A large bucket with a wide lead passes it on to its neighbours, as after trials.
        let big = 64 << 20;
        assert!(t.restore(big, Ring, &[Ring, Tree], &[1.0, 2.0], false));
        let next = t.next(&s, big / 4);
        assert!(
            matches!(next, Next::Inherit { algorithm: Ring, from, .. } if from == big),
            "{next:?}"
        );
    }
}
