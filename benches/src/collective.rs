//! The collectives chorus-perf knows by name, and how each converts algorithm bandwidth into
//! bus bandwidth (DESIGN.md §1, the nccl-tests conventions).
//!
//! How each one is called, fed and checked is in `calls.rs`.

use std::fmt;

/// A collective the benchmark can be asked to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Every rank ends with the reduction of every rank's buffer.
    AllReduce,
    /// The root's buffer is copied to every rank.
    Broadcast,
    /// The root ends with the reduction of every rank's buffer.
    Reduce,
    /// Every rank ends with the concatenation of every rank's buffer.
    AllGather,
    /// Rank r ends with block r of the reduction.
    ReduceScatter,
    /// Rank r sends block j of its buffer to rank j.
    AllToAll,
    /// Allgather through the v-variant (`all_gather_v`), with equal blocks.
    AllGatherV,
    /// Alltoall through the v-variant (`all_to_all_v`), with equal blocks.
    AllToAllV,
    /// The root ends with the concatenation of every rank's buffer.
    Gather,
    /// The root sends block r of its buffer to rank r.
    Scatter,
    /// Pairs of ranks exchange buffers.
    SendRecv,
    /// Reduce-scatter through the v-variant (`reduce_scatter_v`), with equal blocks.
    ReduceScatterV,
    /// Gather through the v-variant (`gather_v`), with equal blocks.
    GatherV,
    /// Scatter through the v-variant (`scatter_v`), with equal blocks.
    ScatterV,
    /// Rank r ends with the reduction of the buffers of ranks 0..=r.
    Scan,
    /// Rank r ends with the reduction of the buffers of ranks 0..r (rank 0: unchanged).
    ExScan,
    /// No rank leaves before every rank has entered (no data: one row, of size 0).
    Barrier,
}

impl Collective {
    /// Every collective, in the order the usage text lists them.
    pub const ALL: [Collective; 17] = [
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::AllGather,
        Collective::ReduceScatter,
        Collective::AllToAll,
        Collective::AllGatherV,
        Collective::AllToAllV,
        Collective::Gather,
        Collective::Scatter,
        Collective::SendRecv,
        Collective::ReduceScatterV,
        Collective::GatherV,
        Collective::ScatterV,
        Collective::Scan,
        Collective::ExScan,
        Collective::Barrier,
    ];

    /// The subcommand name (nccl-tests' test names without `_perf`).
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "allreduce",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::AllGather => "allgather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::AllToAll => "alltoall",
            Collective::AllGatherV => "allgatherv",
            Collective::AllToAllV => "alltoallv",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::SendRecv => "sendrecv",
            Collective::ReduceScatterV => "reduce_scatterv",
            Collective::GatherV => "gatherv",
            Collective::ScatterV => "scatterv",
            Collective::Scan => "scan",
            Collective::ExScan => "exscan",
            Collective::Barrier => "barrier",
        }
    }

    /// Parse a subcommand name; `all_reduce` and `reducescatter` spellings are accepted too.
    pub fn from_name(name: &str) -> Option<Collective> {
        let squashed: String = name
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect::<String>()
            .to_ascii_lowercase();
        Collective::ALL
            .into_iter()
            .find(|c| c.name().replace('_', "") == squashed)
    }

    /// Whether the collective has a root (the `root` column then shows it; otherwise -1).
    pub fn rooted(self) -> bool {
        matches!(
            self,
            Collective::Broadcast
                | Collective::Reduce
                | Collective::Gather
                | Collective::Scatter
                | Collective::GatherV
                | Collective::ScatterV
        )
    }

    /// Whether the collective combines values (the `redop` column and `-o` apply).
    pub fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce
                | Collective::Reduce
                | Collective::ReduceScatter
                | Collective::ReduceScatterV
                | Collective::Scan
                | Collective::ExScan
        )
    }

    /// `busbw = algbw × factor` for `ranks` ranks: 2(p−1)/p for allreduce; (p−1)/p for the
    /// collectives whose size is the whole p-rank buffer; 1 for broadcast, reduce, sendrecv
    /// and the scans.
    pub fn busbw_factor(self, ranks: usize) -> f64 {
        let p = ranks.max(1) as f64;
        match self {
            Collective::AllReduce => 2.0 * (p - 1.0) / p,
            Collective::ReduceScatter
            | Collective::ReduceScatterV
            | Collective::GatherV
            | Collective::ScatterV
            | Collective::AllGather
            | Collective::AllToAll
            | Collective::AllGatherV
            | Collective::AllToAllV
            | Collective::Gather
            | Collective::Scatter => (p - 1.0) / p,
            // Scan: no nccl-tests convention; each rank's buffer crosses a link at least once.
            Collective::Broadcast
            | Collective::Reduce
            | Collective::SendRecv
            | Collective::Scan
            | Collective::ExScan => 1.0,
            // No bytes: its time is the figure (algbw and busbw print 0).
            Collective::Barrier => 0.0,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in Collective::ALL {
            assert_eq!(Collective::from_name(c.name()), Some(c));
        }
        assert_eq!(
            Collective::from_name("all_reduce"),
            Some(Collective::AllReduce)
        );
        assert_eq!(
            Collective::from_name("ReduceScatter"),
            Some(Collective::ReduceScatter)
        );
        assert_eq!(Collective::from_name("allreduce_perf"), None);
    }

    #[test]
    fn busbw_factors() {
        let ar = Collective::AllReduce;
        assert_eq!(ar.busbw_factor(1), 0.0);
        assert_eq!(ar.busbw_factor(2), 1.0);
        assert_eq!(ar.busbw_factor(4), 1.5);
        assert!((ar.busbw_factor(3) - 4.0 / 3.0).abs() < 1e-12);
        assert_eq!(Collective::AllGather.busbw_factor(4), 0.75);
        assert_eq!(Collective::ReduceScatter.busbw_factor(2), 0.5);
        assert_eq!(Collective::AllToAll.busbw_factor(8), 0.875);
        assert_eq!(Collective::Broadcast.busbw_factor(8), 1.0);
        assert_eq!(Collective::Reduce.busbw_factor(3), 1.0);
    }

    #[test]
    fn roots() {
        assert!(Collective::Broadcast.rooted() && !Collective::AllReduce.rooted());
    }
}
