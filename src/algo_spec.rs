//! The grammar of `CHORUS_ALGO` (NCCL's `NCCL_ALGO`), checked in full at init.
//!
//! A value is `;`-separated sections. Each is an optional `collective:` and a `,`-separated
//! list of schedule names; `^` in front of the list excludes the names instead of allowing
//! only them. The first section may go without a collective and then applies to every
//! collective it leaves a schedule (each takes the names it knows; one that knows none of the
//! names allowed, or all of those excluded, is left alone: `^ring,tree` leaves the broadcast
//! its two, `recursive_halving` is about the reduce-scatter alone), except that an exclusion
//! always applies to the allreduce; every later section must name its collective. (The
//! allgather's recursive doubling and the reduce-scatter's recursive halving run the ring
//! where the ranks are not a power of two, whatever the value allows.) A later section for a collective replaces
//! what an earlier one said for it. Names and collectives are case-insensitive, and `-` or `_`
//! in them are optional (`all-reduce`, `AllReduce`, `halving-doubling`).
//!
//! Everything is checked at init, so that a typo fails there, naming itself, rather than being
//! ignored: an unknown collective, a later section without one, a name no collective (or not
//! the named one) knows, a name given to a collective that has a single schedule, a `^`
//! followed by no name, and a value that leaves a collective no schedule.

use chorus_algorithms::allreduce::Algorithm;
use chorus_algorithms::collectives::{
    allgather, alltoall, broadcast, reduce, reduce_scatter, scan,
};

/// The collectives whose schedule `CHORUS_ALGO` chooses, as written in messages.
pub(crate) const CHOOSABLE: [&str; 8] = [
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reduce_scatter",
    "alltoall",
    "scan",
    "exscan",
];

/// The collectives that run one schedule: a section may name them only to say nothing.
const SINGLE: [&str; 7] = [
    "gather", "scatter", "gatherv", "scatterv", "barrier", "send", "recv",
];

/// `s` without case, `-` or `_`: how collectives are compared.
fn squash(s: &str) -> String {
    s.chars()
        .filter(|c| *c != '_' && *c != '-')
        .collect::<String>()
        .to_ascii_lowercase()
}

/// The schedule names of collective `coll` (any spelling), or `None` for one without a choice.
pub(crate) fn schedule_names(coll: &str) -> Option<Vec<&'static str>> {
    Some(match squash(coll).as_str() {
        "allreduce" => Algorithm::ALL.iter().map(|a| a.name()).collect(),
        "broadcast" => broadcast::Algorithm::ALL.iter().map(|a| a.name()).collect(),
        "reduce" => reduce::Algorithm::ALL.iter().map(|a| a.name()).collect(),
        "allgather" => allgather::Algorithm::ALL.iter().map(|a| a.name()).collect(),
        "reducescatter" => reduce_scatter::Algorithm::ALL
            .iter()
            .map(|a| a.name())
            .collect(),
        "alltoall" => alltoall::Algorithm::ALL.iter().map(|a| a.name()).collect(),
        "scan" | "exscan" => scan::Algorithm::ALL.iter().map(|a| a.name()).collect(),
        _ => return None,
    })
}

/// One section of a value.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Section {
    /// The collective (squashed), or `None` for every collective.
    coll: Option<String>,
    exclude: bool,
    /// The names, squashed.
    names: Vec<String>,
}

/// A checked `CHORUS_ALGO` value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AlgoSpec {
    sections: Vec<Section>,
}

impl AlgoSpec {
    /// Parses and checks `spec` (see the module documentation); an empty value says nothing.
    /// The error names the value and what is wrong with it.
    ///
    /// ```
    /// use chorus::algo_spec::AlgoSpec;
    /// let s = AlgoSpec::parse("ring;broadcast:^ring").unwrap();
    /// assert_eq!(s.allowed("broadcast", &["tree", "ring"]), Some(vec![true, false]));
    /// assert_eq!(s.allowed("reduce", &["tree", "ring"]), Some(vec![false, true]));
    /// assert!(AlgoSpec::parse("allreduc:ring").is_err());
    /// assert!(AlgoSpec::parse("allreduce:tree;ring").is_err());
    /// assert!(AlgoSpec::parse("broadcast:rnig").is_err());
    /// assert!(AlgoSpec::parse("allreduce:^").is_err());
    /// ```
    pub fn parse(spec: &str) -> Result<AlgoSpec, String> {
        let bad = |msg: String| format!("CHORUS_ALGO={spec:?}: {msg}");
        let mut sections = Vec::new();
        for (k, part) in spec
            .split(';')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .enumerate()
        {
            let (coll, list) = match part.split_once(':') {
                Some((c, l)) => (Some(squash(c.trim())), l.trim()),
                None if k == 0 => (None, part),
                None => {
                    return Err(bad(format!(
                        "section {part:?} names no collective (only the first section may \
                         leave it out, to apply to every collective)"
                    )))
                }
            };
            let (exclude, list) = match list.strip_prefix('^') {
                Some(l) => (true, l),
                None => (false, list),
            };
            let names: Vec<String> = list
                .split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(squash)
                .collect();
            if exclude && names.is_empty() {
                return Err(bad(format!(
                    "section {part:?} excludes no name after '^' (a variable left empty?)"
                )));
            }
            match &coll {
                Some(c) => {
                    if let Some(known) = schedule_names(c) {
                        for n in &names {
                            if !known.iter().any(|k| squash(k) == *n) {
                                return Err(bad(format!(
                                    "{n:?} is not a schedule of {c} (expected {})",
                                    known.join(", ")
                                )));
                            }
                        }
                    } else if SINGLE.iter().any(|s| squash(s) == *c) {
                        if !names.is_empty() {
                            return Err(bad(format!(
                                "{c} has a single schedule: there is nothing to choose"
                            )));
                        }
                    } else {
                        return Err(bad(format!(
                            "unknown collective {c:?} (expected {}, or no collective for all)",
                            CHOOSABLE.join(", ")
                        )));
                    }
                }
                None => {
                    for n in &names {
                        let known = CHOOSABLE.iter().any(|c| {
                            schedule_names(c).is_some_and(|v| v.iter().any(|k| squash(k) == *n))
                        });
                        if !known {
                            return Err(bad(format!("{n:?} is not a schedule of any collective")));
                        }
                    }
                }
            }
            sections.push(Section {
                coll,
                exclude,
                names,
            });
        }
        let parsed = AlgoSpec { sections };
        for c in CHOOSABLE {
            let names = schedule_names(c).expect("choosable");
            if let Some(a) = parsed.allowed(c, &names) {
                if !a.iter().any(|&x| x) {
                    return Err(bad(format!("no {c} schedule is left")));
                }
            }
        }
        Ok(parsed)
    }

    /// Which of `names` (collective `coll`'s schedules, in its order) the value allows, or
    /// `None` where it says nothing about `coll`.
    pub fn allowed(&self, coll: &str, names: &[&str]) -> Option<Vec<bool>> {
        let s = self.effective(coll, names)?;
        Some(
            names
                .iter()
                .map(|n| s.names.contains(&squash(n)) != s.exclude)
                .collect(),
        )
    }

    /// Whether the section in effect for `coll` (of schedules `names`) names schedule `name`,
    /// to allow or to exclude it.
    pub fn names(&self, coll: &str, names: &[&str], name: &str) -> bool {
        self.effective(coll, names)
            .is_some_and(|s| s.names.contains(&squash(name)))
    }

    /// The last section that says something about `coll`, whose schedules are `names`.
    fn effective(&self, coll: &str, names: &[&str]) -> Option<&Section> {
        let coll = squash(coll);
        self.sections.iter().rev().find(|s| match &s.coll {
            Some(c) => *c == coll,
            // A section for every collective applies to each collective it leaves a schedule:
            // one that knows none of the names it allows, or all of those it excludes, is left
            // alone; except that an exclusion naming an allreduce schedule always applies to
            // the allreduce (excluding every allreduce schedule is an error, not a value that
            // says nothing), and one naming none leaves it alone (`^chain`, for the scans, keeps
            // the direct shared-memory allreduce).
            None => {
                let named = names
                    .iter()
                    .filter(|n| s.names.contains(&squash(n)))
                    .count();
                match (s.exclude, coll == "allreduce") {
                    (true, true) => named > 0,
                    (true, false) => named < names.len(),
                    (false, _) => named > 0,
                }
            }
        })
    }

    /// Whether the value says anything about collective `coll`.
    pub fn restricts(&self, coll: &str) -> bool {
        schedule_names(coll).is_some_and(|names| self.allowed(coll, &names).is_some())
    }
}

/// What a checked value allows, resolved once per communicator so that calls do no work for
/// it: for each collective with a choice, which of its schedules (in the order of its `ALL`)
/// may run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Allowed {
    /// The value says something about the allreduce (its choices live in the selector).
    pub allreduce_restricted: bool,
    pub broadcast: Vec<bool>,
    pub reduce: Vec<bool>,
    pub allgather: Vec<bool>,
    pub reduce_scatter: Vec<bool>,
    pub alltoall: Vec<bool>,
    pub scan: Vec<bool>,
    pub exscan: Vec<bool>,
}

impl AlgoSpec {
    /// The schedules this value allows each collective.
    pub(crate) fn resolve(&self) -> Allowed {
        let of = |coll: &str| {
            let names = schedule_names(coll).expect("a collective with a choice");
            self.allowed(coll, &names)
                .unwrap_or_else(|| vec![true; names.len()])
        };
        // A value that leaves the allreduce what it has by default (`^double_tree`: the double
        // tree runs only where a list names it) restricts nothing: the direct shared-memory
        // allreduce stays.
        let allreduce_default: Vec<bool> = Algorithm::ALL
            .iter()
            .map(|&a| a != Algorithm::DoubleTree)
            .collect();
        let allreduce_restricted = schedule_names("allreduce")
            .and_then(|names| self.allowed("allreduce", &names))
            .is_some_and(|allowed| allowed != allreduce_default);
        Allowed {
            allreduce_restricted,
            broadcast: of("broadcast"),
            reduce: of("reduce"),
            allgather: of("allgather"),
            reduce_scatter: of("reduce_scatter"),
            alltoall: of("alltoall"),
            scan: of("scan"),
            exscan: of("exscan"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BCAST: [&str; 2] = ["tree", "ring"];

    #[test]
    fn an_exclusion_of_other_collectives_leaves_the_allreduce_alone() {
        let s = AlgoSpec::parse("^chain").unwrap();
        assert!(!s.restricts("allreduce"));
        assert_eq!(s.resolve().scan, vec![true, false]);
        assert!(AlgoSpec::parse("^ring").unwrap().restricts("allreduce"));
        assert!(!AlgoSpec::parse("^linear").unwrap().restricts("allreduce"));
        // What the allreduce has anyway: no restriction (the direct shared-memory one stays).
        for same in ["^double_tree", "allreduce:^double_tree"] {
            assert!(
                !AlgoSpec::parse(same)
                    .unwrap()
                    .resolve()
                    .allreduce_restricted,
                "{same}"
            );
        }
        assert!(
            AlgoSpec::parse("double_tree")
                .unwrap()
                .resolve()
                .allreduce_restricted
        );
    }

    #[test]
    fn sections_apply_in_order() {
        let s = AlgoSpec::parse("tree;broadcast:ring").unwrap();
        assert_eq!(s.allowed("broadcast", &BCAST), Some(vec![false, true]));
        assert_eq!(s.allowed("reduce", &BCAST), Some(vec![true, false]));
        // A section for every collective leaves alone one that knows none of its names.
        assert_eq!(
            s.allowed("all_gather", &["ring", "recursive_doubling"]),
            None
        );
        let s = AlgoSpec::parse("recursive_halving").unwrap();
        assert!(!s.restricts("allreduce") && s.restricts("reduce_scatter"));
        let s = AlgoSpec::parse("halving-doubling").unwrap();
        assert_eq!(s.allowed("broadcast", &BCAST), None);
        assert!(s.restricts("allreduce") && !s.restricts("broadcast"));
        // Exclusions, in any spelling.
        let s = AlgoSpec::parse(" Broad_Cast : ^ TREE ").unwrap();
        assert_eq!(s.allowed("broadcast", &BCAST), Some(vec![false, true]));
        assert_eq!(s.allowed("all-reduce", &BCAST), None);
        let s = AlgoSpec::parse("^ring").unwrap();
        assert_eq!(
            s.allowed("reduce_scatter", &["ring", "recursive_halving"]),
            Some(vec![false, true])
        );
        // An exclusion for every collective that would leave one none leaves it alone.
        let s = AlgoSpec::parse("^ring,tree").unwrap();
        assert_eq!(s.allowed("broadcast", &BCAST), None);
        assert_eq!(
            s.allowed("allgather", &["ring", "recursive_doubling"]),
            Some(vec![false, true])
        );
        assert_eq!(AlgoSpec::parse("").unwrap(), AlgoSpec::default());
        assert_eq!(AlgoSpec::parse(" ; ").unwrap(), AlgoSpec::default());
        assert!(AlgoSpec::parse("gather:").is_ok());
        // The all-to-all's two schedules.
        let s = AlgoSpec::parse("ring;alltoall:pairwise").unwrap();
        assert_eq!(s.resolve().alltoall, vec![false, true]);
        assert_eq!(s.resolve().broadcast, vec![false, true]);
        assert_eq!(
            AlgoSpec::parse("linear").unwrap().resolve().alltoall,
            vec![true, false]
        );
        assert_eq!(
            AlgoSpec::parse("tree").unwrap().resolve().alltoall,
            vec![true, true]
        );
    }

    #[test]
    fn mistakes_are_refused_naming_themselves() {
        for (spec, says) in [
            ("allreduc:ring", "unknown collective"),
            ("allreduce:tree;ring", "names no collective"),
            ("broadcast:rnig", "not a schedule of broadcast"),
            ("broadcast:halving_doubling", "not a schedule of broadcast"),
            ("warp", "not a schedule of any collective"),
            ("gather:tree", "single schedule"),
            ("alltoall:ring", "not a schedule of alltoall"),
            ("alltoall:^linear,pairwise", "no alltoall schedule is left"),
            ("broadcast:^tree,ring", "no broadcast schedule is left"),
            ("broadcast:", "no broadcast schedule is left"),
            ("allreduce:^", "excludes no name"),
            ("^", "excludes no name"),
            ("ring;allreduce:^ , ", "excludes no name"),
        ] {
            let e = AlgoSpec::parse(spec).unwrap_err();
            assert!(e.contains(says) && e.contains(spec), "{spec}: {e}");
        }
    }
}
