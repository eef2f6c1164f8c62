//! Splitting a communicator into groups: [`Communicator::split`] (MPI's `MPI_Comm_split`,
//! NCCL's `ncclCommSplit`, what `torch.distributed.new_group` builds) and
//! [`Communicator::dup`].
//!
//! Every rank of the parent says which group it joins (a color, or none) and where it ranks
//! in it (a key). Two small allgathers over the parent settle the groups: the first shares
//! the (color, key) pairs, from which every rank computes its group and rank in it; then the
//! first rank of each group of two or more binds a fresh rendezvous store on its own data
//! address, and the second allgather tells the group where it is. The group then builds a
//! communicator as [`Communicator::new`] does (its own connections, shared-memory segments,
//! link probe and settings check), through that store.
//!
//! The new communicators are independent of the parent: each has its own connections, so
//! calls on one never meet the other's messages, and either may be dropped first.

use std::net::SocketAddr;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_algorithms::collectives::allgather;
use chorus_algorithms::{DType, ReduceOp};
use chorus_transport::rendezvous::StoreServer;
use chorus_transport::TransportError;

use crate::comm::{Call, CollKind};
use crate::error::{CommError, ErrorKind};
use crate::log::{self, Level};
use crate::{Communicator, Config};

/// One rank's (color, key): a flag byte (1: has a color), 3 zero bytes, the color (u32 LE)
/// and the key (i64 LE).
const CHOICE: usize = 16;
/// The second round: a state byte ([`NOT_FIRST`], [`STORE_AT`], [`NO_STORE`]), the length of
/// the address and the address (`ip:port`, at most 62 bytes).
const WHERE: usize = 64;
/// The flag byte of a rank that refused its own color.
const REFUSED: u8 = 2;
const NOT_FIRST: u8 = 0;
const STORE_AT: u8 = 1;
const NO_STORE: u8 = 2;

/// Which group a rank joins: its members (parent ranks, in their order in the group).
pub(crate) fn group_of(choices: &[(Option<u32>, i64)], rank: usize) -> Vec<usize> {
    let Some(color) = choices[rank].0 else {
        return Vec::new();
    };
    let mut members: Vec<usize> = (0..choices.len())
        .filter(|&r| choices[r].0 == Some(color))
        .collect();
    members.sort_by_key(|&r| (choices[r].1, r));
    members
}

fn encode_choice(color: Option<u32>, key: i64) -> [u8; CHOICE] {
    let mut rec = [0u8; CHOICE];
    rec[0] = u8::from(color.is_some());
    rec[4..8].copy_from_slice(&color.unwrap_or(0).to_le_bytes());
    rec[8..16].copy_from_slice(&key.to_le_bytes());
    rec
}

fn decode_choice(rec: &[u8]) -> Result<(Option<u32>, i64), String> {
    let color = u32::from_le_bytes(rec[4..8].try_into().expect("4 bytes"));
    let key = i64::from_le_bytes(rec[8..16].try_into().expect("8 bytes"));
    match rec[0] {
        0 => Ok((None, key)),
        1 => Ok((Some(color), key)),
        b => Err(format!("malformed split record (flag {b})")),
    }
}

fn encode_where(state: u8, addr: Option<SocketAddr>) -> [u8; WHERE] {
    let mut rec = [0u8; WHERE];
    rec[0] = state;
    if let Some(a) = addr {
        let s = a.to_string();
        // An IPv6 address with its scope and port is at most 55 characters.
        let n = s.len().min(WHERE - 2);
        rec[1] = n as u8;
        rec[2..2 + n].copy_from_slice(&s.as_bytes()[..n]);
    }
    rec
}

impl Communicator {
    /// Split this communicator into disjoint groups, as `MPI_Comm_split` and `ncclCommSplit`
    /// do: the ranks that pass the same `color` form a new communicator, in which they are
    /// ranked by `key` (ties by their rank here). A rank that passes `None` joins no group and
    /// gets `Ok(None)` (`MPI_UNDEFINED`, `NCCL_SPLIT_NOCOLOR`).
    ///
    /// A collective: every rank of this communicator calls it, in the same place among its
    /// other calls. The new communicator has its own connections (and shared-memory segments,
    /// and link measurement), made through a rendezvous store that the group's first rank
    /// hosts on its data address; it takes this communicator's configuration (timeouts,
    /// token, `CHORUS_ALGO` and the other `Config` settings) with the group's rank and size;
    /// the settings read from the environment at init (`CHORUS_TUNE`, `CHORUS_ALPHA_US`,
    /// `CHORUS_BETA_GBPS`, `CHORUS_TCP_*`, `CHORUS_SHM_*`) are read again, and
    /// [`Communicator::set_tuning`] is not carried over. It is independent of this
    /// one: both stay usable, either may be dropped first, and the two may be used from two
    /// threads at once. As with any two communicators, ranks that use both from one thread
    /// must call them in the same order.
    ///
    /// Errors: this communicator's errors for the exchanges (a rank that calls something
    /// else gives every rank an error: a mismatch, or the error its peers' abort brings), and
    /// the new communicator's init errors (within the init timeout)
    /// on the ranks of a group that could not connect; the ranks of the other groups are not
    /// affected.
    pub fn split(
        &mut self,
        color: Option<u32>,
        key: i64,
    ) -> Result<Option<Communicator>, CommError> {
        self.split_raw(color.map_or(-1, i64::from), key)
    }

    /// [`Communicator::split`] with the color as C passes it: `-1` for none, `0..=u32::MAX` a
    /// color. Any other color is refused on every rank after the first exchange: this rank
    /// gets an invalid-argument error, the others a mismatch naming it, and no rank waits for
    /// its timeout. All ranks stay usable.
    pub fn split_raw(&mut self, color: i64, key: i64) -> Result<Option<Communicator>, CommError> {
        if !(-1..=i64::from(u32::MAX)).contains(&color) {
            return Err(self.refuse_split(&format!(
                "color {color}: need 0..=4294967295, or -1 for none"
            )));
        }
        let color = u32::try_from(color).ok();
        let all = self.exchange_choices(encode_choice(color, key))?;
        self.split_as_chosen(color, &all)
    }

    /// Takes part in a split (or [`Communicator::dup`], [`Communicator::split_by_host`]: all
    /// splits) as a rank that refuses its own arguments, `why` (a bad color; in C, also a NULL
    /// output pointer): this rank gets an invalid-argument error saying why, the others a
    /// mismatch naming it, and no rank waits for its timeout. All ranks stay usable. For
    /// bindings, whose checks of their own arguments would otherwise leave the other ranks
    /// waiting.
    #[doc(hidden)]
    pub fn refuse_split(&mut self, why: &str) -> CommError {
        let mut mine = encode_choice(None, 0);
        mine[0] = REFUSED;
        match self.exchange_choices(mine) {
            Err(e) => e.with_detail(&format!(" (this rank took part to refuse it: {why})")),
            Ok(_) => CommError::invalid("split", why.to_string()).at_rank(self.rank()),
        }
    }

    /// The first exchange of a split: every rank's (color, key) record, this rank's `mine`;
    /// a mismatch on every rank that did not refuse when a rank did.
    fn exchange_choices(&mut self, mine: [u8; CHOICE]) -> Result<Vec<u8>, CommError> {
        const OP: &str = "split";
        let (rank, size) = (self.rank(), self.size());
        let mut all = vec![0u8; CHOICE * size];
        self.run_call(
            Call::new(OP, CollKind::Split, DType::Uint8, ReduceOp::Max),
            &[],
            |ctx| allgather::run(allgather::Algorithm::Ring, ctx, Some(&mine), &mut all),
        )?;
        if mine[0] == REFUSED {
            return Ok(all);
        }
        let refusing: Vec<usize> = all
            .chunks_exact(CHOICE)
            .enumerate()
            .filter(|(_, rec)| rec[0] == REFUSED)
            .map(|(r, _)| r)
            .collect();
        if let Some(&culprit) = refusing.first() {
            return Err(CommError::new(
                ErrorKind::Mismatch,
                OP,
                format!(
                    "rank(s) {refusing:?} refused their own arguments of the split (an invalid \
                     color, or nowhere to put the new communicator), so no rank splits"
                ),
            )
            .at_rank(rank)
            .with_peer(culprit)
            .with_usable(true));
        }
        Ok(all)
    }

    /// The rest of a split once every rank's choice is known (`all`, checked by
    /// [`Communicator::exchange_choices`]).
    fn split_as_chosen(
        &mut self,
        color: Option<u32>,
        all: &[u8],
    ) -> Result<Option<Communicator>, CommError> {
        const OP: &str = "split";
        let (rank, size) = (self.rank(), self.size());
        let mut choices = Vec::with_capacity(size);
        for (r, rec) in all.chunks_exact(CHOICE).enumerate() {
            match decode_choice(rec) {
                Ok(c) => choices.push(c),
                Err(m) => {
                    // Every rank read the same records and fails alike; the communicator
                    // is not trusted further (its error says so, and so does it).
                    let why = format!("rank {r}: {m}");
                    self.abort(&format!("malformed split record of {why}"));
                    return Err(CommError::new(ErrorKind::Internal, OP, why)
                        .at_rank(rank)
                        .with_usable(false));
                }
            }
        }
        let members = group_of(&choices, rank);
        let first = members.first().copied();

        // The group's first rank hosts its store (not needed for a group of one).
        let mut server = None;
        let mut bind_error = None;
        let state = if first == Some(rank) && members.len() > 1 {
            match self.store_for_split(members.len()) {
                Ok(s) => {
                    let st = (STORE_AT, Some(s.local_addr()));
                    server = Some(s);
                    st
                }
                Err(e) => {
                    bind_error = Some(e);
                    (NO_STORE, None)
                }
            }
        } else {
            (NOT_FIRST, None)
        };
        let mine = encode_where(state.0, state.1);
        let mut all = vec![0u8; WHERE * size];
        self.run_collective(
            Call::new(OP, CollKind::Split, DType::Uint8, ReduceOp::Min),
            |ctx| allgather::run(allgather::Algorithm::Ring, ctx, Some(&mine), &mut all),
        )?;
        if let Some(e) = bind_error {
            return Err(e);
        }
        let (Some(color), Some(first)) = (color, first) else {
            return Ok(None);
        };
        let my_rank = members
            .iter()
            .position(|&r| r == rank)
            .expect("a rank is in its own group");
        let mut config = self.config().clone();
        config.rank = my_rank;
        config.size = members.len();
        config.host_store = Some(false);
        config.local_rank = None;
        config.local_size = None;
        if members.len() > 1 {
            let rec = &all[WHERE * first..WHERE * (first + 1)];
            let addr = match rec[0] {
                STORE_AT => {
                    let n = usize::from(rec[1]).min(WHERE - 2);
                    std::str::from_utf8(&rec[2..2 + n])
                        .ok()
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                }
                _ => None,
            };
            let Some(addr) = addr else {
                let why = if rec[0] == NO_STORE {
                    "could not start the rendezvous store of the new communicator (its own \
                     error says why)"
                } else {
                    "sent no address for the new communicator's rendezvous store"
                };
                return Err(CommError::new(
                    ErrorKind::Remote,
                    OP,
                    format!("rank {first}, the first of color {color}, {why}"),
                )
                .at_rank(rank)
                .with_peer(first)
                .with_usable(true));
            };
            config.root_addr = addr.to_string();
        }
        log::log(
            Level::Info,
            Some(rank),
            format_args!(
                "split: color {color}, rank {my_rank} of {} (ranks {:?} here)",
                members.len(),
                &members[..members.len().min(16)]
            ),
        );
        // The other members, as this communicator numbers them: one gone meanwhile ends the
        // set-up at once instead of at the init timeout.
        let others: Vec<usize> = members.iter().copied().filter(|&r| r != rank).collect();
        let built = self.build_watching_abort(config, server, &others);
        let child = built.map_err(|e| {
            let e = e.with_detail(&format!(
                " (the new communicator of color {color} in split, as rank {my_rank} of {}; \
                 rank {rank} of the one split)",
                members.len()
            ));
            if !self.is_usable() {
                // This communicator broke meanwhile (a member lost, an abort): said as it is.
                return e;
            }
            // The new group's own failure (its init): this communicator is unharmed, and
            // the error is told in its numbering.
            let peer = e.peer().and_then(|p| members.get(p).copied());
            let e = e.at_rank(rank).with_usable(true).without_peer();
            match peer {
                Some(p) => e.with_peer(p),
                None => e,
            }
        })?;
        Ok(Some(child))
    }

    /// The ranks on this rank's host, as a communicator of their own, in their order here
    /// (`MPI_Comm_split_type` with `MPI_COMM_TYPE_SHARED`; a node-local group for
    /// hierarchical schemes). A host is what shared memory goes by: `CHORUS_HOSTID` when set,
    /// else hostname, boot id, network and PID namespaces. Every rank calls it
    /// ([`Communicator::split`] with the host's place among the distinct hosts as color).
    pub fn split_by_host(&mut self) -> Result<Communicator, CommError> {
        let color = match self.host_identities() {
            None => 0,
            Some(hosts) => {
                let mut distinct: Vec<&String> = hosts.iter().collect();
                distinct.sort();
                distinct.dedup();
                let mine = &hosts[self.rank()];
                distinct.iter().position(|h| *h == mine).unwrap_or(0) as u32
            }
        };
        let key = self.rank() as i64;
        Ok(self
            .split(Some(color), key)?
            .expect("every rank passes a color"))
    }

    /// A new communicator of the same ranks in the same order, with its own connections
    /// (`MPI_Comm_dup`): [`Communicator::split`] with one color. Calls on the copy never meet
    /// this one's messages, so a library can run its collectives apart from its caller's.
    pub fn dup(&mut self) -> Result<Communicator, CommError> {
        let key = self.rank() as i64;
        Ok(self
            .split(Some(0), key)?
            .expect("every rank passes a color"))
    }

    /// [`Communicator::build`] of a split's new communicator, on a thread of its own while this
    /// thread watches this communicator's abort handle and the new group's `others` (ranks of
    /// this communicator): an abort requested from another thread ends the wait within 10 ms,
    /// and one of `others` gone (its connection closed, its process dead, an abort notice)
    /// before this rank is connected in the new group, within [`LOST_CHECK`]; this
    /// communicator then fails as a call would (aborted, its peers
    /// told, so that the rest of the new group stops waiting too). The set-up goes on alone
    /// until it connects or fails (bounded by the init timeout), and a communicator it made is
    /// aborted, so that the rest of the new group hears why at its first call.
    fn build_watching_abort(
        &mut self,
        config: Config,
        server: Option<StoreServer>,
        others: &[usize],
    ) -> Result<Communicator, CommError> {
        const OP: &str = "split";
        if config.size == 1 {
            // Nothing to connect to.
            return Communicator::build(config, server, None);
        }
        let connected = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let args = Arc::new(Mutex::new(Some((config, server))));
        let (tx, rx) = mpsc::channel();
        let theirs = Arc::clone(&args);
        let flag = Arc::clone(&connected);
        let spawned = std::thread::Builder::new()
            .name("chorus-split".into())
            .spawn(move || {
                let taken = theirs.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some((config, server)) = taken {
                    if let Err(mpsc::SendError(Ok(mut orphan))) =
                        tx.send(Communicator::build(config, server, Some(&flag)))
                    {
                        // The caller gave up (an abort): the rest of the new group learns why
                        // at its first call rather than from a closed connection.
                        orphan.abort("the split that made this communicator was aborted there");
                    }
                }
            });
        if spawned.is_err() {
            // No thread to spare: set up here, without watching.
            let taken = args.lock().unwrap_or_else(|p| p.into_inner()).take();
            let (config, server) = taken.expect("the set-up thread never started");
            return Communicator::build(config, server, None);
        }
        let mut looked = std::time::Instant::now();
        loop {
            match rx.recv_timeout(Duration::from_millis(10)) {
                Ok(built) => return built,
                Err(RecvTimeoutError::Disconnected) => {
                    // A panic in the set-up: as for a panic in a call, the communicator split
                    // is aborted and its peers told.
                    let why = "internal error in the set-up of a split's new communicator";
                    self.abort(why);
                    return Err(CommError::new(ErrorKind::Internal, OP, why)
                        .at_rank(self.rank())
                        .with_usable(false));
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some(notice) = self.requested_abort() {
                        let why = format!(
                            "aborted by this rank: {} (while the new communicator of a split \
                             was connecting)",
                            notice.reason
                        );
                        return Err(self.fail(OP, TransportError::Aborted(why)));
                    }
                    // Until this rank's connections in the new group are made, no member can
                    // have ended its set-up (which ends with a collective of the group), so
                    // one gone is lost. Afterwards a member may have ended it and dropped
                    // this communicator (a program that needs only the new one), and one
                    // that died shows on the new group's own connections: not looked at.
                    if !connected.load(std::sync::atomic::Ordering::SeqCst)
                        && looked.elapsed() >= LOST_CHECK
                    {
                        looked = std::time::Instant::now();
                        if let Some(e) = self.lost_peer(others) {
                            return Err(self.fail(OP, e).with_detail(
                                " (while the new communicator of a split was connecting, with \
                                 that rank in it)",
                            ));
                        }
                    }
                }
            }
        }
    }

    /// Bind a store for a split's new group of `ranks` ranks on this rank's data address (any
    /// free port), authenticated with this communicator's token.
    fn store_for_split(&self, ranks: usize) -> Result<StoreServer, CommError> {
        let ip = self.data_ip().ok_or_else(|| {
            CommError::new(
                ErrorKind::Internal,
                "split",
                "no data address to host a store on",
            )
        })?;
        let token = self.config().token.clone().unwrap_or_default();
        StoreServer::bind_for_ranks(SocketAddr::new(ip, 0), token.as_bytes(), ranks).map_err(|e| {
            CommError::from_transport("split", e)
                .at_rank(self.rank())
                .with_usable(true)
        })
    }
}

/// How often the set-up of a split's new communicator looks whether a member is gone.
const LOST_CHECK: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_by_color_then_key_then_rank() {
        let c = [
            (Some(1), 5),
            (Some(0), 0),
            (None, 0),
            (Some(1), -3),
            (Some(0), 0),
            (Some(1), 5),
        ];
        assert_eq!(group_of(&c, 0), vec![3, 0, 5]);
        assert_eq!(group_of(&c, 5), vec![3, 0, 5]);
        assert_eq!(group_of(&c, 1), vec![1, 4]);
        assert_eq!(group_of(&c, 2), Vec::<usize>::new());
    }

    /// A split's set-up that cannot connect (its store never sees the group's other rank)
    /// ends within a moment of an abort requested from another thread, not at the init
    /// timeout; the communicator split is aborted.
    #[test]
    fn an_abort_ends_the_set_up_of_a_split() {
        let mut parent = Communicator::new(Config::new(0, 1, "127.0.0.1:0")).unwrap();
        let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"").unwrap();
        let mut config = Config::new(1, 2, store.local_addr().to_string());
        config.host_store = Some(false);
        config.transport = Some("tcp".into());
        config.init_timeout = Duration::from_secs(60);
        let handle = parent.abort_handle();
        let started = std::time::Instant::now();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            handle.abort("test");
        });
        let e = parent.build_watching_abort(config, None, &[]).unwrap_err();
        aborter.join().unwrap();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "took {took:?}");
        assert_eq!(e.kind(), ErrorKind::InvalidUsage, "{e}");
        assert!(e.to_string().contains("aborted"), "{e}");
        assert!(!parent.is_usable());
        // The next call says why.
        let e = parent.barrier().unwrap_err();
        assert!(e.to_string().contains("test"), "{e}");
    }

    /// A member of the new group that is gone (its connection to this rank closed) ends the
    /// set-up within a moment, naming it, not at the init timeout (60 s here); the
    /// communicator split is broken.
    #[test]
    fn a_lost_member_ends_the_set_up_of_a_split() {
        let parents_store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"").unwrap();
        let at = parents_store.local_addr().to_string();
        let make = move |rank: usize| {
            let mut c = Config::new(rank, 2, at.clone());
            c.host_store = Some(false);
            c.transport = Some("tcp".into());
            c.init_timeout = Duration::from_secs(30);
            c
        };
        let (m1, m0) = (make.clone(), make);
        let other = std::thread::spawn(move || Communicator::new(m1(1)).unwrap());
        let mut parent = Communicator::new(m0(0)).unwrap();
        // Rank 1 is gone: its communicator dropped, its connections closed.
        drop(other.join().unwrap());
        let store = StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"").unwrap();
        let mut config = Config::new(0, 2, store.local_addr().to_string());
        config.host_store = Some(false);
        config.transport = Some("tcp".into());
        config.init_timeout = Duration::from_secs(60);
        let started = std::time::Instant::now();
        let e = parent.build_watching_abort(config, None, &[1]).unwrap_err();
        let took = started.elapsed();
        assert!(took < Duration::from_secs(10), "took {took:?}: {e}");
        assert!(e.to_string().contains("rank 1"), "{e}");
        assert!(e.to_string().contains("split"), "{e}");
        assert!(!parent.is_usable());
        drop(parents_store);
    }

    #[test]
    fn records_round_trip() {
        for (color, key) in [(None, 0), (Some(0), -1), (Some(u32::MAX), i64::MIN)] {
            assert_eq!(
                decode_choice(&encode_choice(color, key)).unwrap(),
                (color, key)
            );
        }
        let mut bad = encode_choice(Some(3), 1);
        bad[0] = 7;
        assert!(decode_choice(&bad).is_err());
        let a: SocketAddr = "[fe80::1234:5678:9abc:def0%4294967295]:65535"
            .parse()
            .unwrap();
        let rec = encode_where(STORE_AT, Some(a));
        let n = usize::from(rec[1]);
        assert_eq!(std::str::from_utf8(&rec[2..2 + n]).unwrap(), a.to_string());
    }
}
