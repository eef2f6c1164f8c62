//! One rank of a benchmark: for every data type, op and size, check the result, time the
//! collective, and (on rank 0) print the figures.
//!
//! Per size and placement:
//! 1. warm up, barrier, time `iters` back-to-back calls on the same buffers (in place the
//!    buffer changes every call, as in nccl-tests: timing does not depend on the values), and
//!    reduce the time over ranks as `-a` says; with `--gap`, sleep and barrier before every
//!    timed call instead, and time each call on its own (a training step's compute between
//!    its collectives leaves the connections idle, which the back-to-back loop never does);
//! 2. check (`-c 1`): fill the input with `reference::test_value`s, poison the output, run the
//!    collective once, count wrong elements against `reference::expected`, sum over ranks;
//! 3. derive algbw and busbw, print.
//!
//! The check comes after the timed block, as in nccl-tests and the peers harness
//! (`peers/src/*.c`), so that the traffic before the clock starts is the same as theirs: the
//! warm-up calls only. On a rate-capped link (tbf) an extra call before the clock drains the
//! shaper's token bucket that the peers start with: on the 4-host 1 gbit testbed, 100 timed
//! calls of 32 KiB took 412.3 us each with the check first and 407.8 with no call before the
//! warm-up (`-c 0`), against the reference C ring's 407.9 (15 alternating launches each).
//!
//! A comparison (`--algo ring,tree,auto`, `--algo all`) runs several allreduce entries in one
//! launch: each is checked, then `--rounds` rounds each time one block of every entry, in an
//! order shuffled from round to round (the same on every rank), and each entry's row holds the
//! median of its rounds. A fixed order would always put the same entry behind the same other
//! one, and the switch between two schedules costs something that the block's untimed first
//! call does not always absorb: in a check with two names for the same schedule, the one that
//! always followed a different schedule came out 4–7 % slower.
//! Launches of 4 ranks on 2 cores settle into faster or slower modes for every schedule
//! alike; entries compared inside one launch, in interleaved blocks, share the mode, so the
//! ratio between them means something where separate launches' figures do not.

use std::io::Write;
use std::time::Duration;

use chorus::{AllReduceOptions, CommError, Communicator, DType, Element, ReduceOp};

use crate::calls;
use crate::cli::{Average, Options, Output, Placement};
use crate::collective::Collective;
use crate::data::{self, with_element};
use crate::progress::Progress;
use crate::report::{self, Compared, Groups, JsonContext, Measure, RowKey};
use crate::sizes::{SizePoint, Step};

// Errors are boxed: a `CommError` is large and travels up through every size's loop.

/// What the run found.
pub struct Outcome {
    /// Wrong elements over all ranks, sizes, types and ops (`None`: not checked).
    pub wrong: Option<u64>,
    /// Wrong elements this rank counted itself (the sum over ranks goes through the library
    /// under test, so a rank trusts its own count too).
    pub wrong_here: u64,
}

/// One entry run: what it is called and how each call is made.
pub struct Variant {
    /// The name in the header, rows and JSON (`ring`, `auto`, ...).
    pub label: String,
    /// The options of every call (the allreduce algorithm, `None` for the selector).
    pub call: AllReduceOptions,
}

/// A benchmark in progress on one rank.
pub struct Runner<'a> {
    comm: &'a mut Communicator,
    opts: &'a Options,
    dtypes: Vec<DType>,
    ops: Vec<ReduceOp>,
    /// One entry, or the entries of a comparison.
    variants: Vec<Variant>,
    /// The placements run: those asked for that the collective has (see
    /// [`calls::placements`]), or the one it has.
    placement: Placement,
    transport: &'static str,
    rank: usize,
    ranks: usize,
    progress: Progress,
    /// Sizes done / to do, for the progress line.
    done: usize,
    total: usize,
    wrong: u64,
    /// Wrong elements this rank counted itself.
    wrong_here: u64,
    busbw: Vec<f64>,
}

impl<'a> Runner<'a> {
    /// Prepare a run of one entry, or of a comparison when `opts.compare` is set.
    pub fn new(
        comm: &'a mut Communicator,
        opts: &'a Options,
        dtypes: Vec<DType>,
        ops: Vec<ReduceOp>,
        variants: Vec<Variant>,
    ) -> Runner<'a> {
        assert!(!variants.is_empty(), "a run needs an entry");
        let rank = comm.rank();
        let ranks = comm.size();
        let transport = comm.transport_name();
        let (out_ok, in_ok) = calls::placements(opts.collective);
        let asked = opts.placement;
        let mut placement = Placement {
            out_of_place: asked.out_of_place && out_ok,
            in_place: asked.in_place && in_ok,
        };
        if !placement.out_of_place && !placement.in_place {
            placement = Placement {
                out_of_place: out_ok,
                in_place: !out_ok,
            };
        }
        let total = ops.len()
            * dtypes
                .iter()
                .map(|d| opts.grid.points(d.size() as u64).len())
                .sum::<usize>();
        Runner {
            comm,
            opts,
            dtypes,
            ops,
            variants,
            placement,
            transport,
            rank,
            ranks,
            progress: Progress::for_rank(rank, opts.output == Output::Json),
            done: 0,
            total,
            wrong: 0,
            wrong_here: 0,
            busbw: Vec::new(),
        }
    }

    /// Print a line on rank 0's stdout (clearing the progress line first).
    fn print(&self, line: &str) {
        if self.rank != 0 {
            return;
        }
        self.progress.clear();
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }

    fn groups(&self) -> Groups {
        Groups {
            out_of_place: self.placement.out_of_place,
            in_place: self.placement.in_place,
        }
    }

    fn labels(&self) -> String {
        let labels: Vec<&str> = self.variants.iter().map(|v| v.label.as_str()).collect();
        labels.join(",")
    }

    fn header(&self) {
        let o = self.opts;
        let algorithm = self.labels();
        let it = &o.iters;
        let step = match o.grid.step {
            Step::Factor(f) => format!("{f}(factor)"),
            Step::Bytes(b) => format!("{b}(bytes)"),
        };
        match o.output {
            Output::Json => {}
            Output::Table => {
                self.print(&format!(
                    "# chorus-perf: ranks {}, transport {}, algorithm {}, collective {}, \
                     chorus {}",
                    self.ranks,
                    self.transport,
                    algorithm,
                    o.collective,
                    chorus::VERSION
                ));
                let iters = match it.budget {
                    None => format!("warmup iters: {} iters: {}", it.warmup, it.iters),
                    Some(b) => format!(
                        "warmup iters: <={} iters: {}..{} (budget {b} B per size)",
                        it.warmup,
                        it.min_iters,
                        it.iters.max(it.min_iters)
                    ),
                };
                self.print(&format!(
                    "#  minBytes {} maxBytes {} step: {step} {iters} validation: {} \
                     time: {}{}",
                    o.grid.min_bytes,
                    o.grid.max_bytes,
                    u8::from(o.check),
                    o.average.describe(),
                    gap_note(o.gap, " gap: ", " ms")
                ));
                if o.compare {
                    let algo = std::env::var("CHORUS_ALGO").unwrap_or_default();
                    self.print(&format!(
                        "#  comparison: {} rounds per size, each a block of every entry in \
                         shuffled order; median over rounds{}",
                        o.rounds,
                        if algo.is_empty() {
                            String::new()
                        } else {
                            format!("; auto under CHORUS_ALGO={algo}")
                        }
                    ));
                }
                self.print("#");
                let header = if o.compare {
                    report::compare_header()
                } else {
                    report::table_header(self.groups())
                };
                for line in header {
                    self.print(&line);
                }
            }
            Output::Peers => {
                let types: Vec<&str> = self.dtypes.iter().map(|d| d.name()).collect();
                // As the rows say: "none" for a collective that does not reduce.
                let ops: Vec<&str> = if self.opts.collective.reduces() {
                    self.ops.iter().map(|o| o.name()).collect()
                } else {
                    vec!["none"]
                };
                // The rows are out of place, or in place for a collective that has no other
                // placement (broadcast).
                let placement = if self.placement.out_of_place {
                    "out-of-place"
                } else {
                    "in-place"
                };
                self.print(&format!(
                    "# chorus-perf: nranks={}  {placement} {} {}  chorus {} transport={} \
                     algorithm={} time={}",
                    self.ranks,
                    types.join(","),
                    ops.join(","),
                    chorus::VERSION,
                    self.transport,
                    algorithm.replace(' ', "_"),
                    o.average.describe().replace(' ', "_"),
                ));
                self.print(&format!(
                    "# minbytes={} maxbytes={} factor={} warmup<={} iters=[{},{}] budget={} \
                     check={}{}",
                    o.grid.min_bytes,
                    o.grid.max_bytes,
                    match o.grid.step {
                        Step::Factor(f) => f.to_string(),
                        Step::Bytes(b) => format!("+{b}"),
                    },
                    it.warmup,
                    if it.budget.is_some() {
                        it.min_iters
                    } else {
                        it.iters
                    },
                    it.iters.max(it.min_iters),
                    it.budget
                        .map_or_else(|| "none".to_string(), |b| b.to_string()),
                    u8::from(o.check),
                    gap_note(o.gap, " gap_ms=", ""),
                ));
                self.print(&report::peers_header());
            }
        }
    }

    /// Run every type × op × size and print the footer.
    pub fn run(mut self) -> Result<Outcome, Box<CommError>> {
        self.header();
        for d in self.dtypes.clone() {
            for op in self.ops.clone() {
                with_element!(d, T => self.run_type::<T>(op))?;
            }
        }
        self.progress.clear();
        if self.opts.output == Output::Table {
            let wrong = self.opts.check.then_some(self.wrong);
            for line in report::table_footer(wrong, &self.busbw) {
                self.print(&line);
            }
        }
        Ok(Outcome {
            wrong: self.opts.check.then_some(self.wrong),
            wrong_here: self.wrong_here,
        })
    }

    fn run_type<T: Element>(&mut self, op: ReduceOp) -> Result<(), Box<CommError>> {
        let points = self.opts.grid.points(T::DTYPE.size() as u64);
        let Some(largest) = points.last() else {
            return Ok(());
        };
        let largest = calls::round_count(self.opts.collective, largest.count, self.ranks);
        let max = usize::try_from(largest)
            .map_err(|_| CommError::invalid("chorus-perf", "size too large for this machine"))?;
        let place = self.placement;
        // Out of place reads `send` (never modified, filled once) and writes `recv`;
        // in place works on `recv` alone.
        let send = if place.out_of_place {
            let mut s = data::zeros::<T>(max);
            data::fill(&mut s, self.rank, op, self.ranks);
            s
        } else {
            Vec::new()
        };
        let mut recv = data::zeros::<T>(max);
        if !self.opts.check {
            data::fill(&mut recv, self.rank, op, self.ranks);
        }
        let mut previous = None;
        for mut p in points {
            // The blocked collectives need a multiple of p elements: a size that rounds to the
            // size before it (zero included) is not measured again.
            p.count = calls::round_count(self.opts.collective, p.count, self.ranks);
            if previous == Some(p.count) {
                continue;
            }
            previous = Some(p.count);
            p.bytes = p.count * T::DTYPE.size() as u64;
            self.done += 1;
            self.progress.show(&format!(
                "chorus-perf: [{}/{}] {} {} {}",
                self.done,
                self.total,
                report::human_bytes(p.bytes),
                T::DTYPE,
                op
            ));
            let n = p.count as usize;
            if self.opts.compare {
                let compared = self.compare(&send[..n], &mut recv[..n], op, p)?;
                self.report_compared(T::DTYPE, op, p, &compared);
                continue;
            }
            let mut measures = Vec::with_capacity(2);
            if place.out_of_place {
                let m = self.measure(Some(&send[..n]), &mut recv[..n], op, p)?;
                measures.push((false, m));
            }
            if place.in_place {
                let m = self.measure(None, &mut recv[..n], op, p)?;
                measures.push((true, m));
            }
            self.report(T::DTYPE, op, p, &measures);
        }
        Ok(())
    }

    /// Check and time one size in one placement (`send` is `None` in place).
    fn measure<T: Element>(
        &mut self,
        send: Option<&[T]>,
        buf: &mut [T],
        op: ReduceOp,
        p: SizePoint,
    ) -> Result<Measure, Box<CommError>> {
        let (warmup, iters) = self.opts.iters.for_size(p.bytes);
        let seconds = self.time_block(0, send, buf, op, warmup, iters)?;
        let wrong = if self.opts.check {
            Some(self.check(0, send, buf, op)?)
        } else {
            None
        };
        let factor = self.opts.collective.busbw_factor(self.ranks);
        Ok(Measure::new(p.bytes, iters, seconds, factor, wrong))
    }

    /// One checked call of entry `v` (`send` is `None` in place): its wrong elements summed
    /// over ranks, also added to the run's count.
    fn check<T: Element>(
        &mut self,
        v: usize,
        send: Option<&[T]>,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<u64, Box<CommError>> {
        let coll = self.opts.collective;
        let counts = calls::v_counts(buf.len(), self.ranks);
        // Out of place, the output is poisoned first; a reduction's right result may hold the
        // poison (an 8-bit `bor` gives 255 often), so such a call runs again under a second
        // poison: an element left unwritten is wrong under one of them at least.
        let poisons: &[bool] = if send.is_some() && coll.reduces() {
            &[false, true]
        } else {
            &[false]
        };
        let mut local = 0;
        for &second in poisons {
            if send.is_some() {
                data::poison_with(buf, second);
            } else {
                calls::fill_in_place(coll, buf, self.rank, self.ranks, op);
            }
            calls::call(
                self.comm,
                coll,
                send,
                buf,
                op,
                &self.variants[v].call,
                &counts,
            )?;
            let poison = data::poison_value_of::<T>(second);
            local = local.max(calls::count_wrong(
                coll,
                send.is_none(),
                buf,
                self.rank,
                self.ranks,
                op,
                poison,
            ));
        }
        let mut total = [local];
        self.comm.all_reduce(&mut total, ReduceOp::Sum)?;
        // The sum goes through the library under test; the largest count of any rank too, so
        // that rank 0 reports a rank's wrong elements even if the sum lost them.
        let mut most = [local];
        self.comm.all_reduce(&mut most, ReduceOp::Max)?;
        self.wrong_here += local;
        if total[0] < local.max(most[0]) {
            eprintln!(
                "chorus-perf: rank {}: {} wrong elements on a rank ({local} here), but the sum \
                 over the ranks says {}",
                self.rank, most[0], total[0]
            );
        }
        let total = total[0].max(most[0]).max(local);
        self.wrong += total;
        Ok(total)
    }

    /// `untimed` calls of entry `v`, a barrier, then `iters` timed calls: the seconds per call,
    /// reduced over ranks as `-a` says. With `--gap`, every timed call comes after the gap's
    /// sleep and a barrier, and is timed on its own.
    fn time_block<T: Element>(
        &mut self,
        v: usize,
        send: Option<&[T]>,
        buf: &mut [T],
        op: ReduceOp,
        untimed: u64,
        iters: u64,
    ) -> Result<f64, Box<CommError>> {
        let coll = self.opts.collective;
        let call = &self.variants[v].call;
        let counts = calls::v_counts(buf.len(), self.ranks);
        for _ in 0..untimed {
            calls::call(self.comm, coll, send, buf, op, call, &counts)?;
        }
        let local =
            calls::seconds_per_call(self.comm, iters, self.opts.gap, self.opts.settle, |c| {
                calls::call(c, coll, send, buf, op, call, &counts)
            })?;
        self.over_ranks(local)
    }

    /// Check every entry of a comparison once, then time `--rounds` rounds of one block per
    /// entry (out of place; the first block of each entry after the full warm-up, later ones
    /// after one untimed call, as the schedule changes there). The size's iterations are
    /// split over the rounds.
    fn compare<T: Element>(
        &mut self,
        send: &[T],
        buf: &mut [T],
        op: ReduceOp,
        p: SizePoint,
    ) -> Result<Vec<Compared>, Box<CommError>> {
        let k = self.variants.len();
        let mut wrong = vec![None; k];
        if self.opts.check {
            for (v, w) in wrong.iter_mut().enumerate() {
                *w = Some(self.check(v, Some(send), buf, op)?);
            }
        }
        let (warmup, iters) = self.opts.iters.for_size(p.bytes);
        let rounds = self.opts.rounds.max(1);
        let per_round = iters.div_ceil(rounds).max(1);
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds as usize); k];
        for r in 0..rounds {
            for v in round_order(k, r) {
                let untimed = if r == 0 { warmup } else { warmup.min(1) };
                times[v].push(self.time_block(v, Some(send), buf, op, untimed, per_round)?);
            }
        }
        let factor = self.opts.collective.busbw_factor(self.ranks);
        Ok(times
            .iter()
            .zip(wrong)
            .map(|(t, w)| Compared::new(p.bytes, per_round * rounds, t, factor, w))
            .collect())
    }

    /// The time `-a` asks for.
    fn over_ranks(&mut self, local: f64) -> Result<f64, Box<CommError>> {
        let op = match self.opts.average {
            Average::Rank0 => return Ok(local),
            Average::Mean => ReduceOp::Avg,
            Average::Min => ReduceOp::Min,
            Average::Max => ReduceOp::Max,
        };
        let mut t = [local];
        self.comm.all_reduce(&mut t, op)?;
        Ok(t[0])
    }

    fn report(&mut self, dtype: DType, op: ReduceOp, p: SizePoint, measures: &[(bool, Measure)]) {
        let key = RowKey {
            size: p.bytes,
            // As nccl-tests prints it: the elements of one rank's block where the size is the
            // whole p-rank buffer (allgather, reduce-scatter, all-to-all, gather, scatter).
            count: if calls::blocked(self.opts.collective) {
                p.count / self.ranks as u64
            } else {
                p.count
            },
            dtype: dtype.name(),
            op: if self.opts.collective.reduces() {
                op.name()
            } else {
                "none"
            },
            root: if self.opts.collective.rooted() { 0 } else { -1 },
        };
        match self.opts.output {
            Output::Table => {
                let ms: Vec<Measure> = measures.iter().map(|(_, m)| *m).collect();
                self.busbw.extend(ms.iter().map(|m| m.busbw));
                self.print(&report::table_row(&key, &ms));
            }
            Output::Json => {
                let ctx = JsonContext {
                    collective: self.opts.collective.name(),
                    ranks: self.ranks,
                    algorithm: &self.variants[0].label,
                    transport: self.transport,
                    gap: self.opts.gap,
                };
                for (inplace, m) in measures {
                    self.print(&report::json_line(&ctx, &key, *inplace, m));
                }
            }
            Output::Peers => {
                // Out-of-place rows, as the peers print theirs; a collective that runs in
                // place only (broadcast) prints those.
                let only_in_place = measures.iter().all(|(inplace, _)| *inplace);
                for (_, m) in measures
                    .iter()
                    .filter(|(inplace, _)| !inplace || only_in_place)
                {
                    self.print(&report::peers_row(&key, m));
                }
                // What the selector ran, as a comment the harness skips: its launches keep
                // rank 0's stdout only, and a column of `auto` is read with its choices.
                if let Some(line) = self.schedule_comment(p.bytes) {
                    self.print(&line);
                }
            }
        }
    }

    /// `# schedule SIZE NAME tuned|model|direct` for an allreduce without `--algo`: the
    /// schedule its size bucket settled on after the size's calls (`tuned`), where tuning has
    /// not settled it (tuning off, or trials unfinished) the cost model's choice (`model`),
    /// and `shm direct` where every rank is on one host and the direct shared-memory
    /// allreduce runs instead of a schedule. (Under a `CHORUS_ALGO` that allows one schedule,
    /// that schedule is named.)
    fn schedule_comment(&mut self, bytes: u64) -> Option<String> {
        if self.opts.collective != Collective::AllReduce
            || self.variants[0].call.algorithm.is_some()
        {
            return None;
        }
        if self.comm.direct_shared_memory() {
            return Some(report::schedule_comment(bytes, "shm", "direct"));
        }
        let size = usize::try_from(bytes).ok()?;
        let (alg, how) = match self.comm.tuned_algorithm(size) {
            Some(a) => (a, "tuned"),
            None => (self.comm.selected_algorithm(size), "model"),
        };
        Some(report::schedule_comment(bytes, alg.name(), how))
    }
}

impl Runner<'_> {
    fn report_compared(&mut self, dtype: DType, op: ReduceOp, p: SizePoint, rows: &[Compared]) {
        let key = RowKey {
            size: p.bytes,
            count: p.count,
            dtype: dtype.name(),
            op: op.name(),
            root: -1,
        };
        let labels: Vec<&str> = self.variants.iter().map(|v| v.label.as_str()).collect();
        let forced: Vec<bool> = self
            .variants
            .iter()
            .map(|v| v.call.algorithm.is_some())
            .collect();
        match self.opts.output {
            Output::Table | Output::Peers => {
                self.busbw.extend(rows.iter().map(|c| c.measure.busbw));
                for line in report::compare_rows(&key, &labels, rows, &forced) {
                    self.print(&line);
                }
            }
            Output::Json => {
                for (label, c) in labels.iter().zip(rows) {
                    let ctx = JsonContext {
                        collective: self.opts.collective.name(),
                        ranks: self.ranks,
                        algorithm: label,
                        transport: self.transport,
                        gap: self.opts.gap,
                    };
                    self.print(&report::json_line(&ctx, &key, false, &c.measure));
                }
            }
        }
    }
}

/// `--gap` for a header: `before` milliseconds `after`, or nothing without a gap.
fn gap_note(gap: Option<Duration>, before: &str, after: &str) -> String {
    gap.map_or_else(String::new, |g| {
        format!("{before}{}{after}", g.as_secs_f64() * 1e3)
    })
}

/// The order of the entries in round `round` of a comparison: a shuffle (Fisher–Yates driven
/// by a 64-bit mix of the round number), the same on every rank.
pub fn round_order(entries: usize, round: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..entries).collect();
    let mut x = round.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for i in (1..entries).rev() {
        // splitmix64 step
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let j = (z % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::round_order;

    /// Every round runs every entry once; over many rounds each entry follows each other one.
    #[test]
    fn rounds_shuffle_every_entry() {
        let k = 6;
        let mut follows = vec![vec![0; k]; k];
        for r in 0..200 {
            let mut o = round_order(k, r);
            assert_eq!(o, round_order(k, r), "deterministic");
            for w in o.windows(2) {
                follows[w[1]][w[0]] += 1;
            }
            o.sort_unstable();
            assert_eq!(o, (0..k).collect::<Vec<_>>());
        }
        for (a, row) in follows.iter().enumerate() {
            for (b, &n) in row.iter().enumerate() {
                assert!(a == b || n > 10, "{a} after {b}: {n}");
            }
        }
        assert_eq!(round_order(1, 7), vec![0]);
        assert!(round_order(0, 7).is_empty());
    }
}
