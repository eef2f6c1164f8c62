//! The shared-memory transport: ranks on one host exchange messages through byte rings in shared
//! memory, with no system call on the data path.
//!
//! # Segments
//!
//! Every rank creates one segment (an anonymous `memfd`, see [`sys`]) and publishes
//! `pid fd` in the rendezvous store; the peers on its host reopen it through
//! `/proc/<pid>/fd/<fd>` and map it; once every member said so in the store, the descriptors
//! are closed and only the mappings keep the memory alive. Nothing ever has a name in
//! `/dev/shm`, so a crash at any point leaves nothing behind.
//!
//! A segment holds, cache-line padded: a header (identity, state `live|closed|aborted`, the abort
//! notice, the owner's futex *bell* and *sleeping* flag, the direct allreduce's progress counter
//! and call descriptors), one inbound ring per peer, and the arena of the direct allreduce
//! ([`allreduce`]). Rings hold 256 KiB up to 32 members, then less, so that a host's rings
//! stay within 256 MiB up to 128 members ([`default_ring_bytes`]). A rank pre-faults the
//! parts it uses when it maps a segment: the header, the arena and, while the host's rings
//! hold at most 64 MiB (16 members at 256 KiB), the rings (in its own segment every inbound
//! one, in a peer's the one it writes); beyond that a ring's pages come in as it is used.
//!
//! # Rings
//!
//! The ring from `j` to `r` lives in `r`'s segment: `head` (bytes written, stored only by `j`) and
//! `tail` (bytes consumed, stored only by `r`), each on its own cache line, then `RING` data bytes.
//! A message is a record: a 64-byte header (magic, sequence number, tag, length), the payload,
//! and padding to a multiple of 64. The writer copies bytes in and publishes `head` with release
//! ordering; the reader loads `head` with acquire, copies out and publishes `tail` with release.
//! Large messages stream through in pieces, so the reader copies while the writer fills.
//! Everything a peer wrote is validated (counters within the ring, magic, sequence, length
//! against the receive's capacity) before use.
//!
//! # Waiting
//!
//! A blocked rank re-polls for a bounded time, then sets its *sleeping* flag, re-checks, and sleeps
//! on its bell with a 10 ms timeout. Whoever changes something a rank may wait for (head, tail,
//! progress counter, state) issues a sequentially consistent fence and, if the flag is set, bumps
//! the bell and wakes it. Every wake-up re-checks the state of the peers waited on and whether
//! their processes still run (pidfd), so a dead peer is reported within ~10 ms and a wait never
//! outlives its deadline. The handshake is checked exhaustively in `shm/model.rs`.

pub mod allreduce;
#[cfg(test)]
mod model;
pub(crate) mod sys;

use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use crate::rendezvous::StoreClient;
use crate::sweep::{deadline_passed, stuck_behind_others, sweep, Moved, Swept};
use crate::{
    check_ops, check_post, check_usable, AbortHandle, AbortNotice, Buf, Direction, Op, Request,
    Result, Transport, TransportError, Wait,
};
use sys::{Liveness, Mapping};

/// Cache line size used for padding.
pub const LINE: usize = 64;
const MAGIC: u64 = u64::from_le_bytes(*b"CHORUSHM");
const VERSION: u32 = 1;
const REC_MAGIC: u32 = u32::from_le_bytes(*b"CHSM");
const REC_HEADER: usize = 64;

// Header layout (byte offsets in a segment).
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_SIZE: usize = 12;
const H_RANK: usize = 16;
const H_PID: usize = 20;
const H_COMM: usize = 24;
const H_RING: usize = 32;
const H_ARENA: usize = 40;
const H_STATE: usize = LINE;
const H_BELL: usize = 2 * LINE;
const H_SLEEPING: usize = 3 * LINE;
pub(crate) const H_PROGRESS: usize = 4 * LINE;
/// Two call descriptors (call number, tag, length), one per call parity.
pub(crate) const H_DESC: usize = 5 * LINE;
const H_CULPRIT: usize = 7 * LINE;
const H_REASON_LEN: usize = 7 * LINE + 8;
const H_REASON: usize = 8 * LINE;
const MAX_REASON: usize = 512;
const HEADER_BYTES: usize = H_REASON + MAX_REASON;

const STATE_LIVE: u32 = 0;
const STATE_CLOSED: u32 = 1;
const STATE_ABORTED: u32 = 2;

/// How long a sleeping wait lasts before it re-checks the peers' liveness.
const SLEEP_SLICE: Duration = Duration::from_millis(10);
/// A writer publishes `head` (and a reader `tail`) at least every this many bytes, so that
/// the other side can start copying (refilling); a quarter of the ring where that is less
/// ([`piece`]).
const PIECE: usize = 64 * 1024;

/// The bytes between publications of `head` and `tail` on a ring of `ring` bytes: [`PIECE`],
/// or a quarter of a smaller ring (a whole line at least), so that the writer and the reader
/// of a message larger than the ring copy at the same time rather than by turns.
fn piece(ring: usize) -> usize {
    (ring / 4 / LINE * LINE).clamp(LINE, PIECE)
}

/// Tunables of the shared-memory transport. Every rank of a group must use the same values
/// (checked at connection).
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// Bytes of each ring (rounded up to a multiple of 64); `None` (the default): sized by
    /// the host's member count, [`default_ring_bytes`].
    pub ring_bytes: Option<usize>,
    /// Bytes of each half of the direct allreduce's arena: the chunk one round moves per rank.
    pub chunk_bytes: usize,
    /// How long a wait re-polls before it sleeps on the futex.
    pub spin: Duration,
}

impl Default for ShmOptions {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        ShmOptions {
            ring_bytes: None,
            chunk_bytes: 512 * 1024,
            // With fewer cores than ranks, spinning only delays the rank being waited for.
            spin: if cores >= 2 {
                Duration::from_micros(50)
            } else {
                Duration::from_micros(2)
            },
        }
    }
}

/// The ring size of a host with few members (at most 32): 256 KiB.
pub const DEFAULT_RING_BYTES: usize = 256 << 10;
/// The smallest ring [`default_ring_bytes`] gives: 16 KiB.
pub const MIN_RING_BYTES: usize = 16 << 10;
/// What a host's rings hold in all, at most, where their size is left to the member count
/// (from 4 to 128 members): 256 MiB. Every member's segment holds a ring from each member.
pub const HOST_RINGS_BUDGET: usize = 256 << 20;

/// The ring size for `members` ranks on a host, where [`ShmOptions::ring_bytes`] leaves it
/// open: [`DEFAULT_RING_BYTES`] up to 32 members, then the largest power of two that keeps
/// the `members`² rings within [`HOST_RINGS_BUDGET`], [`MIN_RING_BYTES`] at least (64
/// members: 64 KiB, 128: 16 KiB). Rings are only used where ranks exchange, but a job whose
/// ranks all exchange with all (alltoall) touches every one: at 256 KiB, 4 GiB of shared
/// memory at 128 ranks on a host. Every member derives the same size from the same count.
pub fn default_ring_bytes(members: usize) -> usize {
    let share = HOST_RINGS_BUDGET / members.max(1).saturating_mul(members.max(1));
    let pow2 = if share == 0 { 0 } else { 1 << share.ilog2() };
    pow2.clamp(MIN_RING_BYTES, DEFAULT_RING_BYTES)
}

/// Where things are in a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub members: usize,
    pub ring: usize,
    pub arena_half: usize,
}

impl Layout {
    /// The layout of `members` segments on a host, in a group of `size` ranks, with `opts`.
    fn new(opts: &ShmOptions, members: usize, size: usize) -> Layout {
        Layout {
            members,
            ring: opts
                .ring_bytes
                .unwrap_or_else(|| default_ring_bytes(members))
                .max(4 * LINE)
                .next_multiple_of(LINE),
            // The direct allreduce runs where every rank of the group is on this host.
            arena_half: if members == size {
                opts.chunk_bytes.max(4096).next_multiple_of(4096)
            } else {
                0
            },
        }
    }
    fn ring_stride(&self) -> usize {
        2 * LINE + self.ring
    }
    /// Offset of the control block of the ring whose sender is member index `slot`.
    fn ring_at(&self, slot: usize) -> usize {
        HEADER_BYTES.next_multiple_of(LINE) + slot * self.ring_stride()
    }
    pub(crate) fn arena(&self) -> usize {
        self.ring_at(self.members).next_multiple_of(4096)
    }
    fn total(&self) -> usize {
        (self.arena() + 2 * self.arena_half).next_multiple_of(4096)
    }
    /// Whether the rings are pre-faulted when the segments are mapped: while the host's
    /// rings (every member's segment holds one from each member) hold at most
    /// [`PREFAULT_HOST_RINGS_MAX`] bytes of data.
    fn prefault_rings(&self) -> bool {
        self.members
            .saturating_mul(self.members)
            .saturating_mul(self.ring)
            <= PREFAULT_HOST_RINGS_MAX
    }
    /// The parts of a segment pre-faulted when it is mapped: the header, the arena and, where
    /// [`Layout::prefault_rings`], the rings: in this rank's own segment (`ring: None`) every
    /// inbound ring, in a peer's the ring this rank writes (`Some(offset)`). Rings not
    /// pre-faulted fault in as they are used, a page at a time.
    fn prefault_parts(&self, ring: Option<usize>) -> Vec<std::ops::Range<usize>> {
        let mut parts = vec![0..HEADER_BYTES, self.arena()..self.total()];
        match (self.prefault_rings(), ring) {
            (true, None) => parts.push(self.ring_at(0)..self.ring_at(self.members)),
            (true, Some(at)) => parts.push(at..at + self.ring_stride()),
            (false, _) => {}
        }
        parts
    }
}

/// Bytes of a segment's rings pre-faulted when it is mapped, at most (see
/// [`Layout::prefault_rings`]): 16 members' rings of 256 KiB, or 64 members' of 16 KiB.
/// Beyond that, rings fault in as they are used: pre-faulting every ring of every segment
/// makes the host's shared memory grow as the square of its ranks whatever they exchange
/// (with 256 KiB rings at 128 ranks: 4 GiB, and 5 of the 8 s they took to start), where an
/// allreduce uses a few rings per rank.
const PREFAULT_HOST_RINGS_MAX: usize = 64 << 20;

struct Tx {
    next_ticket: u64,
    head_ticket: u64,
    seq: u64,
    /// Our `head` (we are its only writer).
    pos: u64,
    in_record: bool,
}

struct Rx {
    next_ticket: u64,
    head_ticket: u64,
    seq: u64,
    /// Our `tail` (we are its only writer).
    pos: u64,
    in_record: bool,
}

struct Peer {
    map: Mapping,
    /// Control block of our ring in the peer's segment (we send there).
    out_ring: usize,
    live: Liveness,
    tx: Tx,
    rx: Rx,
}

/// The shared-memory implementation of [`Transport`] over the ranks of one host (a subset of
/// the group: ranks elsewhere are not peers of this transport). Built by [`connect`] or
/// [`local_group`].
pub struct ShmTransport {
    rank: usize,
    size: usize,
    layout: Layout,
    me: Mapping,
    /// Member index of every rank (None: not on this host).
    slot: Vec<Option<usize>>,
    peers: Vec<Option<Peer>>,
    spin: Duration,
    /// While spinning, give the core away every this many polls: every poll when the host's
    /// members outnumber its cores (the rank waited for may be the one not running).
    yield_every: u64,
    broken: Option<String>,
    aborted: bool,
    /// Aborts requested from other threads (see [`AbortHandle`]), seen within a sleep slice.
    abort_request: Option<AbortHandle>,
    /// Peers the current wait depends on (reused buffer).
    involved: Vec<usize>,
    pub(crate) coll: allreduce::State,
    /// The process that made the transport (kept here, not only in the shared header, which
    /// the peers could overwrite).
    maker: u32,
}

fn rdv(msg: impl Into<String>) -> TransportError {
    TransportError::Rendezvous(msg.into())
}

fn io(during: &'static str, e: std::io::Error) -> TransportError {
    TransportError::io(None, during, e)
}

/// `members` (sorted) without `rank`, as ranges of consecutive ranks: what a rank reads from
/// the store about the others, a row at a time.
fn member_runs(members: &[usize], rank: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    for &j in members.iter().filter(|&&j| j != rank) {
        match runs.last_mut() {
            Some(r) if r.end == j => r.end += 1,
            _ => runs.push(j..j + 1),
        }
    }
    runs
}

/// Rank `j`'s segment as it published it (`v`, from `shm/seg/j`), checked, opened and mapped
/// (pre-faulting the parts this rank, of member index `my_slot`, touches): the peer.
fn attach_peer(
    j: usize,
    v: &[u8],
    layout: &Layout,
    my_slot: usize,
    size: usize,
    comm_id: u64,
) -> Result<Peer> {
    if let Some(why) = v.strip_prefix(b"error: ") {
        return Err(rdv(format!(
            "rank {j} could not set up its shared memory: {}",
            crate::frame::peer_text(why)
        )));
    }
    let text = String::from_utf8_lossy(v);
    let mut it = text.split(' ').map(str::parse::<i64>);
    let (pid, pfd, ring, arena) = match (it.next(), it.next(), it.next(), it.next(), it.next()) {
        (Some(Ok(p)), Some(Ok(f)), Some(Ok(r)), Some(Ok(a)), None)
            if p > 0 && p <= u32::MAX as i64 && (0..=i32::MAX as i64).contains(&f) =>
        {
            (p as u32, f as i32, r, a)
        }
        _ => {
            return Err(rdv(format!(
                "rank {j} published a malformed segment {text:?}"
            )))
        }
    };
    // Options first, from the store: a peer with other sizes is refused before anything
    // is opened or mapped.
    if ring != layout.ring as i64 || arena != layout.arena_half as i64 {
        return Err(rdv(format!(
            "rank {j}'s shared segment does not match this communicator or its options \
         (it has ring {ring} B, chunk {arena} B; this rank ring {} B, chunk {} B: \
         set CHORUS_SHM_RING_BYTES / CHORUS_SHM_CHUNK_BYTES alike on every rank)",
            layout.ring, layout.arena_half
        )));
    }
    let pfd = sys::open_peer_fd(pid, pfd).map_err(|e| {
        rdv(format!(
            "cannot open rank {j}'s shared segment /proc/{pid}/fd/{pfd}: {e} \
         (different pid namespace? use CHORUS_TRANSPORT=tcp)"
        ))
    })?;
    // A segment that can shrink could be cut short under this rank's mapping, and the next
    // access past its end would be SIGBUS instead of an error.
    if !sys::cannot_shrink(&pfd) {
        return Err(rdv(format!(
            "rank {j}'s shared segment is not sealed at its size (another chorus release, or \
         not a chorus segment); use CHORUS_TRANSPORT=tcp"
        )));
    }
    // The parts of it this rank touches: the header, the ring it writes, the arena.
    let mine = layout.ring_at(my_slot);
    let map = Mapping::map_parts(&pfd, layout.total(), &layout.prefault_parts(Some(mine)))
        .map_err(|e| rdv(format!("cannot map rank {j}'s shared segment: {e}")))?;
    let ok = map.u64_at(H_MAGIC).load(Ordering::Acquire) == MAGIC
        && map.u32_at(H_VERSION).load(Ordering::Relaxed) == VERSION
        && map.u32_at(H_SIZE).load(Ordering::Relaxed) == size as u32
        && map.u32_at(H_RANK).load(Ordering::Relaxed) == j as u32
        && map.u32_at(H_PID).load(Ordering::Relaxed) == pid
        && map.u64_at(H_COMM).load(Ordering::Relaxed) == comm_id
        && map.u64_at(H_RING).load(Ordering::Relaxed) == layout.ring as u64
        && map.u64_at(H_ARENA).load(Ordering::Relaxed) == layout.arena_half as u64;
    if !ok {
        return Err(rdv(format!(
            "rank {j}'s shared segment does not match this communicator or its options \
         (ring {} B, chunk {} B)",
            layout.ring, layout.arena_half
        )));
    }
    Ok(Peer {
        map,
        out_ring: mine,
        live: Liveness::watch(pid),
        tx: Tx {
            next_ticket: 0,
            head_ticket: 0,
            seq: 0,
            pos: 0,
            in_record: false,
        },
        rx: Rx {
            next_ticket: 0,
            head_ticket: 0,
            seq: 0,
            pos: 0,
            in_record: false,
        },
    })
}

/// Waits for what every other member of `members` published under `prefix` (`prefix{j}`),
/// a row of consecutive ranks at a time, handing each to `each(j, value)` in rank order.
fn get_each_member(
    store: &mut StoreClient,
    prefix: &str,
    members: &[usize],
    rank: usize,
    deadline: Instant,
    mut each: impl FnMut(usize, Vec<u8>) -> Result<()>,
) -> Result<()> {
    for run in member_runs(members, rank) {
        store.get_each(prefix, run, deadline, &mut each)?;
    }
    Ok(())
}

/// Builds the shared-memory transport among `members` (sorted global ranks on this host,
/// including `rank`) through the rendezvous store. Every member must call it with the same
/// members and options.
pub fn connect(
    store: &mut StoreClient,
    rank: usize,
    size: usize,
    comm_id: u64,
    members: &[usize],
    opts: &ShmOptions,
    deadline: Instant,
) -> Result<ShmTransport> {
    if !members.windows(2).all(|w| w[0] < w[1])
        || !members.contains(&rank)
        || members.iter().any(|&m| m >= size)
    {
        return Err(TransportError::InvalidArgument(format!(
            "shm members {members:?} of a group of {size} must be sorted and contain rank {rank}"
        )));
    }
    let layout = Layout::new(opts, members.len(), size);
    let made = sys::memfd(&format!("chorus-{comm_id:016x}-{rank}"), layout.total())
        .map_err(|e| io("memfd_create", e))
        .and_then(|fd| {
            let me = Mapping::map_parts(&fd, layout.total(), &layout.prefault_parts(None))
                .map_err(|e| io("mmap", e))?;
            Ok((fd, me))
        });
    let (fd, me) = match made {
        Ok(m) => m,
        Err(e) => {
            // Where the others wait for this rank's segment: they fail at once, saying why,
            // rather than at their deadline.
            let _ = store.set(&format!("shm/seg/{rank}"), format!("error: {e}").as_bytes());
            return Err(e);
        }
    };
    me.u64_at(H_MAGIC).store(MAGIC, Ordering::Relaxed);
    me.u32_at(H_VERSION).store(VERSION, Ordering::Relaxed);
    me.u32_at(H_SIZE).store(size as u32, Ordering::Relaxed);
    me.u32_at(H_RANK).store(rank as u32, Ordering::Relaxed);
    me.u32_at(H_PID)
        .store(std::process::id(), Ordering::Relaxed);
    me.u64_at(H_COMM).store(comm_id, Ordering::Relaxed);
    me.u64_at(H_RING)
        .store(layout.ring as u64, Ordering::Relaxed);
    me.u64_at(H_ARENA)
        .store(layout.arena_half as u64, Ordering::Release);
    store.set(
        &format!("shm/seg/{rank}"),
        format!(
            "{} {} {} {}",
            std::process::id(),
            fd.as_raw_fd(),
            layout.ring,
            layout.arena_half
        )
        .as_bytes(),
    )?;

    let mut slot = vec![None; size];
    for (i, &m) in members.iter().enumerate() {
        slot[m] = Some(i);
    }
    let my_slot = slot[rank].expect("member");
    let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
    let mut attach = || -> Result<()> {
        get_each_member(store, "shm/seg/", members, rank, deadline, |j, v| {
            peers[j] = Some(attach_peer(j, &v, &layout, my_slot, size, comm_id)?);
            Ok(())
        })
    };
    if let Err(e) = attach() {
        // Tell the others, who would otherwise wait for this rank until their timeout.
        let _ = store.set(
            &format!("shm/mapped/{rank}"),
            format!("error: {e}").as_bytes(),
        );
        return Err(e);
    }
    // Once every member mapped every segment, the descriptors can go: the mappings alone keep
    // the memory, and the kernel frees it when the last one is gone.
    store.set(&format!("shm/mapped/{rank}"), b"1")?;
    get_each_member(
        store,
        "shm/mapped/",
        members,
        rank,
        deadline,
        |j, v| match v.strip_prefix(b"error: ") {
            Some(why) => Err(rdv(format!(
                "rank {j} could not attach the shared segments of this host: {}",
                crate::frame::peer_text(why)
            ))),
            None => Ok(()),
        },
    )?;
    drop(fd);
    Ok(ShmTransport {
        rank,
        size,
        layout,
        me,
        slot,
        peers,
        spin: opts.spin,
        yield_every: if members.len() > std::thread::available_parallelism().map_or(1, |n| n.get())
        {
            1
        } else {
            64
        },
        broken: None,
        aborted: false,
        abort_request: None,
        involved: Vec::new(),
        coll: allreduce::State::default(),
        maker: std::process::id(),
    })
}

/// `n` connected shared-memory transports in this process (rank `i` at index `i`), for tests.
/// Move each into its own thread before using them together.
pub fn local_group(n: usize, opts: &ShmOptions) -> Result<Vec<ShmTransport>> {
    use crate::rendezvous::StoreServer;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let server = StoreServer::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), b"test")?;
    let addr = server.local_addr();
    let members: Vec<usize> = (0..n).collect();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let members = members.clone();
            let opts = opts.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut store = StoreClient::connect(addr, b"test", deadline)?;
                connect(&mut store, rank, n, 0x5eed, &members, &opts, deadline)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for h in handles {
        out.push(h.join().map_err(|_| rdv("shm setup thread panicked"))??);
    }
    Ok(out)
}

impl ShmTransport {
    /// Whether `peer` is reached through this transport.
    pub fn has_peer(&self, peer: usize) -> bool {
        matches!(self.peers.get(peer), Some(Some(_)))
    }

    /// Whether every rank of the group is on this host (the direct allreduce needs it).
    pub fn covers_group(&self) -> bool {
        self.layout.members == self.size && self.layout.arena_half > 0
    }

    fn fail(&mut self, e: TransportError) -> TransportError {
        if !e.is_recoverable() && self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        e
    }

    fn peer_ref(&self, peer: usize) -> Result<&Peer> {
        match self.peers.get(peer) {
            Some(Some(p)) => Ok(p),
            _ => Err(TransportError::InvalidArgument(format!(
                "peer {peer} is not another rank of this host's group (this is rank {} of {})",
                self.rank, self.size
            ))),
        }
    }

    /// Wakes `peer` if it sleeps. Call after publishing something it may wait for.
    fn notify(map: &Mapping) {
        fence(Ordering::SeqCst);
        if map.u32_at(H_SLEEPING).load(Ordering::Relaxed) != 0 {
            map.u32_at(H_BELL).fetch_add(1, Ordering::SeqCst);
            sys::futex_wake(map.u32_at(H_BELL));
        }
    }

    fn notify_all(&self) {
        for p in self.peers.iter().flatten() {
            p.map.u32_at(H_BELL).fetch_add(1, Ordering::SeqCst);
            sys::futex_wake(p.map.u32_at(H_BELL));
        }
    }

    /// For a wait that polls this transport without blocking in it (the hybrid transport's
    /// waits on shm and TCP peers at once): the error of the first of `peers` that stopped
    /// (closed, aborted, or, with `check_process`, dead), if one did.
    pub(crate) fn gone_among(
        &self,
        peers: impl IntoIterator<Item = usize>,
        check_process: bool,
    ) -> Option<TransportError> {
        peers
            .into_iter()
            .find_map(|j| self.peer_gone(j, check_process))
    }

    /// For tests: peer `j`'s process is taken for `pid`'s (one that has exited, to stand for
    /// a peer killed without closing its segment).
    #[cfg(test)]
    pub(crate) fn watch_peer_as(&mut self, j: usize, pid: u32) {
        if let Some(p) = self.peers.get_mut(j).and_then(Option::as_mut) {
            p.live = Liveness::watch(pid);
        }
    }

    /// The error for a peer that stopped: closed, aborted (with its notice) or dead.
    fn peer_gone(&self, j: usize, check_process: bool) -> Option<TransportError> {
        let p = self.peers.get(j)?.as_ref()?;
        match p.map.u32_at(H_STATE).load(Ordering::Acquire) {
            STATE_LIVE => {}
            STATE_ABORTED => {
                let c = p.map.u64_at(H_CULPRIT).load(Ordering::Relaxed);
                let n =
                    (p.map.u32_at(H_REASON_LEN).load(Ordering::Relaxed) as usize).min(MAX_REASON);
                let mut r = vec![0u8; n];
                p.map.read(H_REASON, &mut r);
                return Some(TransportError::PeerAborted {
                    peer: j,
                    culprit: usize::try_from(c).ok().filter(|&c| c < self.size),
                    reason: crate::frame::peer_text(&r),
                });
            }
            _ => return Some(TransportError::PeerClosed { peer: j }),
        }
        if check_process && !p.live.alive() {
            return Some(TransportError::PeerClosed { peer: j });
        }
        None
    }

    /// One step of a blocked wait on the peers in `self.involved`: fails if one of them is gone
    /// or the deadline passed; otherwise re-polls (first `spin`), then arms and sleeps on the
    /// bell. The caller re-checks its condition after every call.
    ///
    /// A peer found gone fails the wait only at the second look: the first returns so that the
    /// caller re-checks its condition once more. A peer publishes everything it sends before it
    /// marks itself closed (release; the state is read with acquire), so what it sent between
    /// the caller's last check and its exit is seen there. Without that second look, a rank
    /// whose peers finished their last collective and dropped the communicator could fail that
    /// collective with all its data already in place (seen once in the 7-thread sweep).
    pub(crate) fn stall(&mut self, w: &mut Stall, deadline: Instant) -> Result<()> {
        if let Err(e) = self.check_abort_request() {
            self.disarm();
            w.armed = None;
            return Err(e);
        }
        for i in 0..self.involved.len() {
            if let Some(e) = self.peer_gone(self.involved[i], w.armed.is_some()) {
                self.disarm();
                w.armed = None;
                if !w.gone_seen {
                    w.gone_seen = true;
                    return Ok(());
                }
                return Err(e);
            }
        }
        let now = Instant::now();
        if now >= deadline {
            self.disarm();
            return Err(TransportError::Timeout {
                peer: self.involved.first().copied(),
                waited: now - w.start,
            });
        }
        if let Some(b) = w.armed.take() {
            sys::futex_wait(self.me.u32_at(H_BELL), b, (deadline - now).min(SLEEP_SLICE));
            self.disarm();
            return Ok(());
        }
        if now - w.start < self.spin {
            w.polls += 1;
            if w.polls % self.yield_every == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            return Ok(());
        }
        // Arm: announce the sleep, then let the caller re-check before sleeping (see `model`).
        self.me.u32_at(H_SLEEPING).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        w.armed = Some(self.me.u32_at(H_BELL).load(Ordering::SeqCst));
        Ok(())
    }

    fn disarm(&self) {
        self.me.u32_at(H_SLEEPING).store(0, Ordering::Relaxed);
    }

    fn drive(&mut self, op: &mut Op<'_, '_>) -> Result<Moved> {
        let j = op.req.peer();
        self.peer_ref(j)?;
        match op.req.direction() {
            Direction::Send => {
                let buf: &[u8] = match &op.buf {
                    Buf::Send(b) => b,
                    Buf::Recv(b) => b,
                };
                self.drive_send(j, op.req, buf)
            }
            Direction::Recv => {
                let Buf::Recv(buf) = &mut op.buf else {
                    return Err(TransportError::InvalidArgument(
                        "a receive request needs a Buf::Recv buffer".into(),
                    ));
                };
                self.drive_recv(j, op.req, buf)
            }
        }
    }

    fn drive_send(&mut self, j: usize, req: &mut Request, buf: &[u8]) -> Result<Moved> {
        let ring = self.layout.ring;
        let p = self.peers[j].as_mut().expect("checked peer");
        if req.ticket() != Some(p.tx.head_ticket) {
            return Ok(Moved::NotHead);
        }
        let base = p.out_ring;
        let data = base + 2 * LINE;
        let tail = p.map.u64_at(base + LINE).load(Ordering::Acquire);
        let used = p.tx.pos.wrapping_sub(tail);
        if used > ring as u64 {
            return Err(TransportError::Protocol {
                peer: j,
                what: format!("ring consumer counter {tail} is ahead of the producer's"),
            });
        }
        let mut free = ring - used as usize;
        let mut moved = false;
        let mut published = p.tx.pos;
        if !p.tx.in_record {
            if free < REC_HEADER {
                return Ok(Moved::Blocked);
            }
            let mut h = [0u8; REC_HEADER];
            h[0..4].copy_from_slice(&REC_MAGIC.to_le_bytes());
            h[8..16].copy_from_slice(&p.tx.seq.to_le_bytes());
            h[16..24].copy_from_slice(&req.tag().to_le_bytes());
            h[24..32].copy_from_slice(&(req.len() as u64).to_le_bytes());
            // Records are 64-aligned and the ring a multiple of 64: a header never wraps.
            p.map.write(data + (p.tx.pos % ring as u64) as usize, &h);
            p.tx.pos += REC_HEADER as u64;
            p.tx.in_record = true;
            free -= REC_HEADER;
            moved = true;
        }
        let len = req.len();
        let piece = piece(ring);
        while req.bytes_done() < req.available() && free > 0 {
            let done = req.bytes_done();
            let n = (req.available() - done).min(free).min(piece);
            let at = (p.tx.pos % ring as u64) as usize;
            let first = n.min(ring - at);
            p.map.write(data + at, &buf[done..done + first]);
            if n > first {
                p.map.write(data, &buf[done + first..done + n]);
            }
            p.tx.pos += n as u64;
            req.advance(n);
            free -= n;
            moved = true;
            if p.tx.pos - published >= piece as u64 {
                p.map.u64_at(base).store(p.tx.pos, Ordering::Release);
                published = p.tx.pos;
                Self::notify(&p.map);
            }
        }
        if req.bytes_done() == len {
            let pad = len.next_multiple_of(LINE) - len;
            if free >= pad {
                p.tx.pos += pad as u64;
                p.tx.in_record = false;
                p.tx.seq += 1;
                p.tx.head_ticket += 1;
                req.set_complete();
                moved = true;
            }
        }
        if p.tx.pos != published {
            p.map.u64_at(base).store(p.tx.pos, Ordering::Release);
            Self::notify(&p.map);
        }
        Ok(if moved {
            Moved::Yes
        } else if req.bytes_done() == req.available() && req.bytes_done() < len {
            Moved::NeedsData
        } else {
            Moved::Blocked
        })
    }

    /// The producer counter of `j`'s ring at `base` and the bytes it puts after the consumer at
    /// `pos`, checked to lie within the ring. Every use of the counter reads it through here:
    /// the peer writes it, and a second, unchecked read could run past the ring.
    fn produced(&self, j: usize, base: usize, pos: u64) -> Result<(u64, u64)> {
        let head = self.me.u64_at(base).load(Ordering::Acquire);
        let avail = head.wrapping_sub(pos);
        if avail > self.layout.ring as u64 {
            return Err(TransportError::Protocol {
                peer: j,
                what: format!(
                    "ring producer counter {head} is not within the ring (consumer at {pos})"
                ),
            });
        }
        Ok((head, avail))
    }

    /// The header of the next record from `j`, if one is there (not consumed).
    fn peek_header(&self, j: usize) -> Result<Option<(u64, u64, u64)>> {
        let ring = self.layout.ring;
        let p = self.peers[j].as_ref().expect("checked peer");
        let base = self.layout.ring_at(self.slot[j].expect("member"));
        let (head, avail) = self.produced(j, base, p.rx.pos)?;
        if p.rx.in_record || avail < REC_HEADER as u64 {
            return Ok(None);
        }
        let mut h = [0u8; REC_HEADER];
        self.me
            .read(base + 2 * LINE + (p.rx.pos % ring as u64) as usize, &mut h);
        let word = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        if h[0..4] != REC_MAGIC.to_le_bytes() {
            return Err(TransportError::Protocol {
                peer: j,
                what: format!("bad record magic {:02x?}", &h[0..4]),
            });
        }
        if word(8) != p.rx.seq {
            return Err(TransportError::Protocol {
                peer: j,
                what: format!(
                    "sequence number {} where {} was expected",
                    word(8),
                    p.rx.seq
                ),
            });
        }
        Ok(Some((word(16), word(24), head)))
    }

    fn drive_recv(&mut self, j: usize, req: &mut Request, buf: &mut [u8]) -> Result<Moved> {
        let ring = self.layout.ring;
        if req.ticket() != Some(self.peers[j].as_ref().expect("peer").rx.head_ticket) {
            return Ok(Moved::NotHead);
        }
        let mut moved = false;
        if let Some((tag, len, _)) = self.peek_header(j)? {
            if tag != req.tag() || len > req.len() as u64 {
                return Err(TransportError::Mismatch {
                    peer: j,
                    expected_tag: req.tag(),
                    got_tag: tag,
                    expected_len: req.len(),
                    got_len: usize::try_from(len).unwrap_or(usize::MAX),
                });
            }
            req.set_message_len(len as usize);
            let p = self.peers[j].as_mut().expect("peer");
            p.rx.pos += REC_HEADER as u64;
            p.rx.in_record = true;
            moved = true;
        }
        let base = self.layout.ring_at(self.slot[j].expect("member"));
        let data = base + 2 * LINE;
        let pos = self.peers[j].as_ref().expect("peer").rx.pos;
        let (_, avail) = self.produced(j, base, pos)?;
        let mut avail = avail as usize;
        let p = self.peers[j].as_mut().expect("peer");
        if !p.rx.in_record {
            return Ok(Moved::Blocked);
        }
        let msg_len = req.message_len().expect("header seen");
        let piece = piece(ring);
        let mut published = p.rx.pos;
        while req.bytes_done() < msg_len && avail > 0 {
            let done = req.bytes_done();
            let n = (msg_len - done).min(avail).min(piece);
            let at = (p.rx.pos % ring as u64) as usize;
            let first = n.min(ring - at);
            self.me.read(data + at, &mut buf[done..done + first]);
            if n > first {
                self.me.read(data, &mut buf[done + first..done + n]);
            }
            p.rx.pos += n as u64;
            avail -= n;
            req.advance(n);
            moved = true;
            if p.rx.pos - published >= piece as u64 && avail > 0 {
                // The writer may refill what was read while the rest is copied.
                self.me
                    .u64_at(base + LINE)
                    .store(p.rx.pos, Ordering::Release);
                Self::notify(&p.map);
                published = p.rx.pos;
            }
        }
        if req.bytes_done() == msg_len {
            let pad = msg_len.next_multiple_of(LINE) - msg_len;
            if avail >= pad {
                p.rx.pos += pad as u64;
                p.rx.in_record = false;
                p.rx.seq += 1;
                p.rx.head_ticket += 1;
                req.set_complete();
                moved = true;
            }
        }
        if moved {
            self.me
                .u64_at(base + LINE)
                .store(p.rx.pos, Ordering::Release);
            Self::notify(&p.map);
            Ok(Moved::Yes)
        } else {
            Ok(Moved::Blocked)
        }
    }
}

/// The state of one blocked wait (see [`ShmTransport::stall`]).
#[derive(Debug)]
pub(crate) struct Stall {
    start: Instant,
    polls: u64,
    armed: Option<u32>,
    /// A peer was found gone once: the next look that finds it fails the wait.
    gone_seen: bool,
}

impl Stall {
    pub(crate) fn new() -> Stall {
        Stall {
            start: Instant::now(),
            polls: 0,
            armed: None,
            gone_seen: false,
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn lost_peer(&mut self, peers: &[usize]) -> Option<TransportError> {
        peers.iter().find_map(|&j| self.peer_gone(j, true))
    }

    fn size(&self) -> usize {
        self.size
    }

    fn name(&self) -> &'static str {
        "shm"
    }

    fn post(&mut self, req: &mut Request) -> Result<()> {
        check_post(&self.broken, req)?;
        self.peer_ref(req.peer())?;
        let p = self.peers[req.peer()].as_mut().expect("checked");
        let t = match req.direction() {
            Direction::Send => &mut p.tx.next_ticket,
            Direction::Recv => &mut p.rx.next_ticket,
        };
        req.set_ticket(*t);
        *t += 1;
        Ok(())
    }

    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        check_usable(&self.broken)?;
        check_ops(ops)?;
        self.check_abort_request()?;
        for op in ops.iter() {
            self.peer_ref(op.req.peer())?;
        }
        let mut stall: Option<Stall> = None;
        let started = Instant::now();
        loop {
            let Swept {
                moved,
                all_done,
                blocked,
                needs_data,
            } = match sweep(ops, |op| self.drive(op)) {
                Ok(s) => s,
                Err(e) => {
                    self.disarm();
                    return Err(self.fail(e));
                }
            };
            if all_done || moved {
                self.disarm();
                if let Some(e) = (!all_done)
                    .then(|| deadline_passed(wait, ops, started))
                    .flatten()
                {
                    return Err(self.fail(e));
                }
                return Ok(all_done);
            }
            let Some((deadline, poll)) = wait.until() else {
                return Ok(false);
            };
            if !blocked {
                self.disarm();
                if needs_data {
                    return Ok(false);
                }
                return Err(stuck_behind_others());
            }
            let w = stall.get_or_insert_with(|| {
                self.involved.clear();
                // Receives first: the timeout names the peer we wait to hear from.
                for dir in [Direction::Recv, Direction::Send] {
                    for op in ops.iter() {
                        let j = op.req.peer();
                        if !op.req.is_complete()
                            && op.req.direction() == dir
                            && !self.involved.contains(&j)
                        {
                            self.involved.push(j);
                        }
                    }
                }
                Stall::new()
            });
            if let Err(e) = self.stall(w, deadline) {
                // (Its only timeout is the deadline's: a poll's end, not an error.)
                if poll && matches!(e, TransportError::Timeout { .. }) {
                    return Ok(false);
                }
                return Err(self.fail(e));
            }
        }
    }

    fn set_abort_handle(&mut self, handle: AbortHandle) {
        // The waits sleep in slices of `SLEEP_SLICE` and look at the handle between them.
        self.abort_request = Some(handle);
    }

    fn abort(&mut self, notice: &AbortNotice) {
        if self.aborted {
            return;
        }
        self.aborted = true;
        if self.broken.is_none() {
            self.broken = Some(format!("aborted by this rank: {}", notice.reason));
        }
        if self.forked() {
            // Only the parent speaks for this rank in the shared segments.
            return;
        }
        let reason = notice.reason.as_bytes();
        let mut n = reason.len().min(MAX_REASON);
        while !notice.reason.is_char_boundary(n) {
            n -= 1;
        }
        self.me.write(H_REASON, &reason[..n]);
        self.me
            .u32_at(H_REASON_LEN)
            .store(n as u32, Ordering::Relaxed);
        self.me.u64_at(H_CULPRIT).store(
            notice.culprit.map_or(u64::MAX, |c| c as u64),
            Ordering::Relaxed,
        );
        self.me
            .u32_at(H_STATE)
            .store(STATE_ABORTED, Ordering::Release);
        self.notify_all();
    }
}

impl ShmTransport {
    /// Fail with an abort requested through the handle, after telling the peers.
    pub(crate) fn check_abort_request(&mut self) -> Result<()> {
        let requested = self.abort_request.as_ref().and_then(AbortHandle::requested);
        crate::requested_abort(requested, |n| Transport::abort(self, n))
    }

    /// Whether this is a child forked from the process that made the transport.
    fn forked(&self) -> bool {
        self.maker != std::process::id()
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        if self.forked() {
            // The segments are shared with the parent, which still runs this rank.
            return;
        }
        if !self.aborted {
            self.me
                .u32_at(H_STATE)
                .store(STATE_CLOSED, Ordering::Release);
        }
        self.notify_all();
    }
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("layout", &self.layout)
            .field("broken", &self.broken)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_rings() -> ShmOptions {
        // A small ring makes every large test message wrap around many times.
        ShmOptions {
            ring_bytes: Some(4096 + 64),
            chunk_bytes: 8192,
            ..ShmOptions::default()
        }
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // a list of one range is what is meant
    fn the_other_members_are_read_a_row_at_a_time() {
        assert_eq!(member_runs(&[0, 1, 2, 3], 0), [1..4]);
        assert_eq!(member_runs(&[0, 1, 2, 3], 2), [0..2, 3..4]);
        assert_eq!(member_runs(&[1, 3, 4, 5, 8], 4), [1..2, 3..4, 5..6, 8..9]);
        assert!(member_runs(&[6], 6).is_empty());
    }

    #[test]
    fn conformance_shm() {
        crate::conformance::run_all(&|n| {
            local_group(n, &ShmOptions::default())
                .expect("local shm group")
                .into_iter()
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .collect()
        });
    }

    #[test]
    fn conformance_shm_small_rings() {
        let make = |n| {
            local_group(n, &small_rings())
                .expect("local shm group")
                .into_iter()
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .collect()
        };
        crate::conformance::ping_pong(&make);
        crate::conformance::ring_exchange_large(&make);
        crate::conformance::ordered_tags(&make);
        crate::conformance::nonblocking_and_partial(&make);
    }

    /// Rings too large to pre-fault from 2 members on (see [`Layout::prefault_rings`]): 4 of
    /// them hold more than [`PREFAULT_HOST_RINGS_MAX`].
    fn unfaulted_rings() -> ShmOptions {
        ShmOptions {
            ring_bytes: Some(PREFAULT_HOST_RINGS_MAX / 2),
            chunk_bytes: 8192,
            ..ShmOptions::default()
        }
    }

    /// A peer that trickles a large message: a schedule's loop of waits (each until the
    /// call's deadline, with work between them) ends at that deadline with a timeout,
    /// although every wait moves bytes.
    #[test]
    fn a_trickling_peer_does_not_outlast_the_deadline() {
        let mut group = local_group(2, &ShmOptions::default()).expect("local shm group");
        let len = 4 << 20;
        let mut sender = group.pop().unwrap();
        let mut receiver = group.pop().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let data = vec![1u8; len];
                let mut req = Request::send_partial(0, 9, len, 0);
                sender.post(&mut req).unwrap();
                // 1 KiB more every millisecond for 2 s at most: never the whole message.
                for k in 1..=2000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    req.set_available(k * 1024);
                    let _ = sender.progress(&mut [Op::send(&mut req, &data)], Wait::No);
                    std::thread::sleep(Duration::from_millis(1));
                }
                sender
            })
        };
        let mut b = vec![0u8; len];
        let mut req = Request::recv(1, 9, len);
        receiver.post(&mut req).unwrap();
        let outcome = crate::sweep::loop_of_waits(|w| {
            receiver.progress(&mut [Op::recv(&mut req, &mut b)], w)
        });
        stop.store(true, Ordering::SeqCst);
        crate::sweep::assert_timed_out(outcome, &req, len);
        drop(writer.join().unwrap());
    }

    #[test]
    fn rings_shrink_with_the_member_count_to_keep_the_host_within_budget() {
        let ring = |members| Layout::new(&ShmOptions::default(), members, members).ring;
        for members in 1..=32 {
            assert_eq!(ring(members), DEFAULT_RING_BYTES, "{members} members");
        }
        assert_eq!(ring(33), 128 << 10);
        assert_eq!(ring(64), 64 << 10);
        assert_eq!(ring(65), 32 << 10);
        assert_eq!(ring(128), 16 << 10);
        assert_eq!(ring(1000), MIN_RING_BYTES);
        assert_eq!(ring(usize::MAX), MIN_RING_BYTES);
        for members in 1..=128usize {
            let r = ring(members);
            assert!(r.is_power_of_two() && r >= MIN_RING_BYTES, "{members}: {r}");
            assert!(members * members * r <= HOST_RINGS_BUDGET, "{members}: {r}");
            // The largest power of two within the budget: twice as much would not fit.
            assert!(
                r == DEFAULT_RING_BYTES || members * members * 2 * r > HOST_RINGS_BUDGET,
                "{members}: {r}"
            );
        }
        // A size set in the options is taken whatever the member count (to a whole line),
        // and the direct allreduce's arena exists only where the whole group is on the host.
        let set = ShmOptions {
            ring_bytes: Some(4096 + 1),
            ..ShmOptions::default()
        };
        assert_eq!(Layout::new(&set, 128, 128).ring, 4096 + LINE);
        assert_eq!(Layout::new(&set, 4, 8).arena_half, 0);
        assert!(Layout::new(&set, 4, 4).arena_half > 0);
    }

    #[test]
    fn small_rings_publish_in_quarters() {
        assert_eq!(piece(DEFAULT_RING_BYTES), PIECE);
        assert_eq!(piece(16 << 10), 4 << 10);
        assert_eq!(piece(4096 + 64), 1024);
        assert_eq!(piece(4 * LINE), LINE);
        assert_eq!(piece(1 << 30), PIECE);
    }

    #[test]
    fn rings_are_pre_faulted_only_up_to_a_bound() {
        let layout = |members, ring| Layout {
            members,
            ring,
            arena_half: 8192,
        };
        // The default ring of a few members: up to 16 members pre-faulted, not beyond.
        let ring = DEFAULT_RING_BYTES;
        assert!(layout(16, ring).prefault_rings());
        assert!(!layout(17, ring).prefault_rings());
        // Smaller rings, more members.
        assert!(layout(64, 16 << 10).prefault_rings());
        assert!(!layout(65, 16 << 10).prefault_rings());
        // From 17 members on, the default sizes are never pre-faulted.
        for members in 17..=1024 {
            let l = Layout::new(&ShmOptions::default(), members, members);
            assert!(!l.prefault_rings(), "{members}");
        }
        let l = layout(17, ring);
        for parts in [l.prefault_parts(None), l.prefault_parts(Some(l.ring_at(5)))] {
            assert!(parts
                .iter()
                .all(|p| p.end <= l.ring_at(0) || p.start >= l.arena()));
            assert!(parts.contains(&(l.arena()..l.total())), "{parts:?}");
        }
        let l = layout(4, ring);
        assert!(l
            .prefault_parts(None)
            .contains(&(l.ring_at(0)..l.ring_at(4))));
        let mine = l.ring_at(2)..l.ring_at(3);
        assert!(l.prefault_parts(Some(mine.start)).contains(&mine));
    }

    #[test]
    fn rings_not_pre_faulted_fault_in_as_used() {
        // Counts pages of 4 KiB, which huge pages of shared memory would bring in by the
        // hundred.
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .unwrap_or_default();
        if sys::page_size() != 4096 || !(thp.is_empty() || thp.contains("[never]")) {
            eprintln!(
                "skipped: pages of {} bytes, shmem THP {thp:?}",
                sys::page_size()
            );
            return;
        }
        // Pre-faulted: every inbound ring's pages exist once the group is connected.
        let group = local_group(3, &small_rings()).expect("local shm group");
        let l = group[0].layout;
        let rings = l.ring_at(0) / 4096 * 4096..l.arena();
        let pages = group[0].me.resident_pages(rings.clone());
        assert_eq!(pages, rings.len() / 4096, "pre-faulted rings");
        drop(group);
        // Too large to pre-fault: none of the rings' pages exist until messages pass (the
        // header's last page may hold the first ring's control block), and a message of a
        // megabyte brings in about a megabyte of its ring.
        let mut group = local_group(3, &unfaulted_rings()).expect("local shm group");
        let l = group[0].layout;
        let rings = l.ring_at(0).next_multiple_of(4096)..l.arena();
        for t in &group {
            assert_eq!(t.me.resident_pages(rings.clone()), 0);
        }
        let msg: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
        let mut got = vec![0u8; msg.len()];
        let (a, b) = group.split_at_mut(1);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut s = Request::send(1, 9, msg.len());
        let mut r = Request::recv(0, 9, got.len());
        a[0].post(&mut s).unwrap();
        b[0].post(&mut r).unwrap();
        let handle = std::thread::scope(|sc| {
            let sender = sc.spawn(|| a[0].wait_all(&mut [Op::send(&mut s, &msg)], deadline));
            b[0].wait_all(&mut [Op::recv(&mut r, &mut got)], deadline)
                .unwrap();
            sender.join().unwrap()
        });
        handle.unwrap();
        assert!(got == msg, "the message arrived changed");
        let used = b[0].me.resident_pages(rings.clone());
        assert!(
            (200..=300).contains(&used),
            "{used} pages of the rings in use"
        );
        assert_eq!(group[2].me.resident_pages(rings), 0);
        // And the unfaulted rings carry every pattern the transport supports.
        let make = |n| {
            local_group(n, &unfaulted_rings())
                .expect("local shm group")
                .into_iter()
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .collect()
        };
        crate::conformance::ping_pong(&make);
        crate::conformance::all_to_all(&make);
        crate::conformance::ordered_tags(&make);
    }

    #[test]
    fn layout_is_aligned_and_disjoint() {
        let l = Layout {
            members: 3,
            ring: 4096,
            arena_half: 8192,
        };
        assert!(l.ring_at(0) >= HEADER_BYTES);
        assert_eq!(l.ring_at(0) % LINE, 0);
        assert_eq!(l.ring_at(1) - l.ring_at(0), 2 * LINE + 4096);
        assert!(l.arena() >= l.ring_at(3));
        assert_eq!(l.arena() % 4096, 0);
        assert!(l.total() >= l.arena() + 2 * 8192);
    }

    #[test]
    fn mismatched_options_are_refused() {
        let results = crate::rendezvous::on_local_store(2, |rank, addr| {
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut store = StoreClient::connect(addr, b"t", deadline).unwrap();
            let opts = ShmOptions {
                ring_bytes: Some(4096 * (rank + 1)),
                ..ShmOptions::default()
            };
            connect(&mut store, rank, 2, 1, &[0, 1], &opts, deadline).map(|_| ())
        });
        // Each rank fails: the first to check reports the mismatch and drops its segment, so
        // the other may instead find nothing to open.
        let errs: Vec<String> = results
            .into_iter()
            .map(|r| r.unwrap_err().to_string())
            .collect();
        assert!(
            errs.iter().any(|e| e.contains("does not match")),
            "{errs:?}"
        );
    }

    #[test]
    fn a_rank_that_cannot_make_its_segment_fails_the_others_at_once() {
        let got = crate::rendezvous::on_local_store(2, |rank, addr| {
            let start = Instant::now();
            let deadline = start + Duration::from_secs(30);
            let mut store = StoreClient::connect(addr, b"t", deadline).unwrap();
            // Rank 0 asks for rings no address space holds (256 TiB).
            let opts = ShmOptions {
                ring_bytes: Some(if rank == 0 { 1 << 47 } else { 4096 }),
                ..ShmOptions::default()
            };
            let r = connect(&mut store, rank, 2, 1, &[0, 1], &opts, deadline).map(|_| ());
            (r.unwrap_err().to_string(), start.elapsed())
        });
        let (e1, took) = &got[1];
        assert!(
            e1.contains("rank 0 could not set up its shared memory"),
            "{got:?}"
        );
        assert!(*took < Duration::from_secs(10), "{got:?}");
    }

    #[test]
    fn garbage_in_a_ring_is_a_protocol_error() {
        let mut g = local_group(2, &ShmOptions::default()).unwrap();
        let mut t1 = g.pop().unwrap();
        let t0 = g.pop().unwrap();
        // Rank 0 scribbles a record with a bad magic into its ring towards rank 1.
        let p = t0.peers[1].as_ref().unwrap();
        let base = p.out_ring;
        p.map.write(base + 2 * LINE, &[0xAB; 64]);
        p.map.u64_at(base).store(64, Ordering::Release);
        let mut b = [0u8; 8];
        let e = t1.recv(0, 1, &mut b, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, TransportError::Protocol { peer: 0, .. }), "{e}");
        // A head counter beyond the ring is caught too (on a fresh pair).
        let mut g = local_group(2, &ShmOptions::default()).unwrap();
        let mut t1 = g.pop().unwrap();
        let t0 = g.pop().unwrap();
        let p = t0.peers[1].as_ref().unwrap();
        p.map.u64_at(p.out_ring).store(1 << 40, Ordering::Release);
        let e = t1.recv(0, 1, &mut b, Duration::from_secs(5)).unwrap_err();
        assert!(matches!(e, TransportError::Protocol { peer: 0, .. }), "{e}");
        drop(t0);
    }

    #[test]
    fn a_forked_child_dropping_or_aborting_its_copy_leaves_the_rank_running() {
        let mut g = local_group(2, &ShmOptions::default()).unwrap();
        let mut t1 = g.pop().unwrap();
        let mut rank0 = g.pop();
        // The child (as a DataLoader worker would) aborts and drops its copy of rank 0; the
        // parent keeps its own (the closure runs in the child only).
        let code = sys::in_forked_child(|| {
            let mut t0 = rank0.take().unwrap();
            t0.abort(&AbortNotice {
                culprit: None,
                reason: "a forked child".into(),
            });
            drop(t0);
            0
        });
        assert_eq!(code, 0);
        // The parent's rank 0 still talks to rank 1...
        let mut t0 = rank0.take().unwrap();
        t0.send(1, 7, b"still here", Duration::from_secs(5))
            .unwrap();
        let mut b = [0u8; 10];
        t1.recv(0, 7, &mut b, Duration::from_secs(5)).unwrap();
        assert_eq!(&b, b"still here");
        // ... and rank 1 waiting on it sees it alive: a timeout, not a closed or aborted peer.
        let e = t1
            .recv(0, 8, &mut b, Duration::from_millis(200))
            .unwrap_err();
        assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
    }
}
