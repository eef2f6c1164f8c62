//! The transport a communicator uses: every peer on this host through shared memory
//! ([`crate::shm`]), every other peer through TCP ([`crate::tcp`]), behind one [`Transport`].
//!
//! The choice is made at rendezvous ([`connect`]): the TCP mesh publishes each rank's host
//! identity ([`host_identity`](crate::tcp::host_identity): hostname, boot id, network and PID
//! namespaces); ranks with equal identities are on one host. `Choice::Tcp` keeps everything
//! on TCP; `Choice::Shm` requires every rank on this host. Every rank publishes its choice and
//! all must agree, otherwise every rank fails with the same clear error.
//!
//! Waits that involve only one kind of peer are handed to that transport as they are (its own
//! spin-then-sleep); a wait mixing both polls each without blocking and backs off up to
//! [`MIXED_MAX_SLEEP`] between rounds.

use std::time::{Duration, Instant};

use crate::rendezvous::StoreClient;
use crate::shm::{self, ShmOptions, ShmTransport};
use crate::tcp::TcpTransport;
use crate::{
    AbortHandle, AbortNotice, Direction, Op, Request, Result, Transport, TransportError, Wait,
};

/// Longest pause between two polls of a wait that involves both shm and TCP peers.
pub const MIXED_MAX_SLEEP: Duration = Duration::from_micros(200);

/// How often a wait on shm and TCP peers at once looks whether its shm peers' processes
/// still live (a dead one that did not close its segment).
const PROCESS_CHECK: Duration = Duration::from_millis(10);

/// Which transport to use for peers on this host (`CHORUS_TRANSPORT`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Shared memory for peers on this host, TCP for the others (the default).
    Auto,
    /// TCP for every peer.
    Tcp,
    /// Shared memory for every peer; fails if some rank is on another host.
    Shm,
}

impl Choice {
    /// Parses `auto`, `tcp` or `shm` (case-insensitive; empty is `auto`).
    pub fn parse(s: &str) -> Option<Choice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(Choice::Auto),
            "tcp" => Some(Choice::Tcp),
            "shm" => Some(Choice::Shm),
            _ => None,
        }
    }

    /// The name accepted by [`Choice::parse`].
    pub fn name(self) -> &'static str {
        match self {
            Choice::Auto => "auto",
            Choice::Tcp => "tcp",
            Choice::Shm => "shm",
        }
    }
}

/// TCP and shared memory behind one [`Transport`], routing each peer to one of them.
pub struct HybridTransport {
    tcp: TcpTransport,
    shm: Option<ShmTransport>,
    via_shm: Vec<bool>,
    broken: Option<String>,
    /// Reused for reordering a mixed wait's ops.
    swaps: Vec<(usize, usize)>,
    /// When a mixed wait last looked whether its shm peers' processes live: kept across
    /// waits, so that a progress loop of short polls (each shorter than [`PROCESS_CHECK`])
    /// still looks.
    process_checked: Instant,
}

/// Decides, for every peer, shared memory or TCP (see the module docs) and builds the shared
/// segments with the peers on this host. `hosts[j]` is rank `j`'s host identity.
pub fn connect(
    tcp: TcpTransport,
    store: &mut StoreClient,
    hosts: &[String],
    choice: Choice,
    asked: &str,
    opts: &ShmOptions,
    deadline: Instant,
) -> Result<HybridTransport> {
    let (rank, size) = (tcp.rank(), tcp.size());
    if hosts.len() != size {
        return Err(TransportError::InvalidArgument(format!(
            "{} host identities for a group of {size}",
            hosts.len()
        )));
    }
    // The choice, then what the user set (for the message: `rdma` runs as `auto`).
    let asked = if asked.trim().is_empty() {
        choice.name()
    } else {
        asked.trim()
    };
    store.set(
        &format!("transport/{rank}"),
        format!("{} {asked}", choice.name()).as_bytes(),
    )?;
    store.get_each("transport/", 0..size, deadline, |j, theirs| {
        let (their_choice, their_ask) = match theirs.iter().position(|&b| b == b' ') {
            Some(i) => (&theirs[..i], &theirs[i + 1..]),
            None => (&theirs[..], &theirs[..]),
        };
        if their_choice != choice.name().as_bytes() {
            return Err(TransportError::Rendezvous(format!(
                "rank {j} uses CHORUS_TRANSPORT={}, rank {rank} uses {asked}: set the same \
                 value on every rank",
                crate::frame::peer_text(their_ask),
            )));
        }
        Ok(())
    })?;
    let members: Vec<usize> = match choice {
        Choice::Tcp => vec![rank],
        Choice::Auto | Choice::Shm => (0..size).filter(|&j| hosts[j] == hosts[rank]).collect(),
    };
    if choice == Choice::Shm && members.len() != size {
        let away: Vec<usize> = (0..size).filter(|j| !members.contains(j)).collect();
        return Err(TransportError::Rendezvous(format!(
            "CHORUS_TRANSPORT=shm needs every rank on one host, but ranks {away:?} are not on \
             rank {rank}'s host; use tcp or auto"
        )));
    }
    let shm = if members.len() > 1 {
        Some(shm::connect(
            store,
            rank,
            size,
            tcp.comm_id(),
            &members,
            opts,
            deadline,
        )?)
    } else {
        None
    };
    let via_shm = (0..size)
        .map(|j| j != rank && members.contains(&j))
        .collect();
    Ok(HybridTransport {
        tcp,
        shm,
        via_shm,
        broken: None,
        swaps: Vec::new(),
        process_checked: Instant::now(),
    })
}

impl HybridTransport {
    /// Whether messages to `peer` go through shared memory.
    pub fn uses_shm(&self, peer: usize) -> bool {
        self.via_shm.get(peer).copied().unwrap_or(false)
    }

    fn route(&self, peer: usize) -> bool {
        self.uses_shm(peer) && self.shm.is_some()
    }

    /// Polls both transports until something moves, everything completes or the deadline.
    fn mixed(&mut self, ops: &mut [Op<'_, '_>], k: usize, wait: Wait) -> Result<bool> {
        let (mut sleep, start) = (Duration::from_micros(1), Instant::now());
        let shm = self.shm.as_mut().expect("mixed waits have shm ops");
        let signature = |ops: &[Op<'_, '_>]| -> usize {
            ops.iter()
                .map(|o| {
                    o.req.bytes_done()
                        + o.req.is_complete() as usize
                        + o.req.message_len().is_some() as usize
                })
                .sum()
        };
        let before = signature(ops);
        let mut gone_seen = false;
        // Whether a peer process still lives costs a system call: looked at every
        // `PROCESS_CHECK` at most, counted across waits (the shared states, which say closed
        // and aborted, are read at every round), and again at the second look at a peer
        // found gone.
        loop {
            let (a, b) = ops.split_at_mut(k);
            let done_a = shm.progress(a, Wait::No)?;
            let done_b = self.tcp.progress(b, Wait::No)?;
            if done_a && done_b {
                return Ok(true);
            }
            let Some((deadline, poll)) = wait.until() else {
                return Ok(false);
            };
            if signature(ops) != before {
                if let Some(e) = crate::sweep::deadline_passed(wait, ops, start) {
                    // A notice any peer left says more than the timeout (it names the culprit).
                    return Err(self.tcp.abort_notice(true).unwrap_or(e));
                }
                return Ok(false);
            }
            let waiting_for_caller = ops.iter().all(|o| {
                o.req.is_complete()
                    || (o.req.direction() == Direction::Send
                        && o.req.bytes_done() == o.req.available()
                        && o.req.available() < o.req.len())
            });
            if waiting_for_caller {
                return Ok(false);
            }
            // A shm peer of this wait that stopped (closed, aborted, or dead, looked at every
            // `PROCESS_CHECK`) fails it now, as a wait on shm peers alone does, rather than at the
            // deadline: at the second look, after one more poll, so that what the peer sent
            // before it stopped is taken first.
            let involved = ops[..k]
                .iter()
                .filter(|o| !o.req.is_complete())
                .map(|o| o.req.peer());
            let check_process = gone_seen || self.process_checked.elapsed() >= PROCESS_CHECK;
            if check_process {
                self.process_checked = Instant::now();
            }
            if let Some(e) = shm.gone_among(involved, check_process) {
                if gone_seen {
                    return Err(e);
                }
                gone_seen = true;
                continue;
            }
            // A TCP peer's abort notice (read where its socket became readable, after the
            // ops were driven with what arrived) fails the wait now, as on TCP alone.
            if let Some(e) = self.tcp.abort_notice(false) {
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline && poll {
                return Ok(false);
            }
            if now >= deadline {
                // A notice any peer left says more than the timeout (it names the culprit).
                if let Some(e) = self.tcp.abort_notice(true) {
                    return Err(e);
                }
                let peer = ops
                    .iter()
                    .find(|o| !o.req.is_complete() && o.req.direction() == Direction::Recv)
                    .or_else(|| ops.iter().find(|o| !o.req.is_complete()))
                    .map(|o| o.req.peer());
                return Err(TransportError::Timeout {
                    peer,
                    waited: now - start,
                });
            }
            if sleep < Duration::from_micros(20) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(sleep.min(deadline - now));
            }
            sleep = (sleep * 2).min(MIXED_MAX_SLEEP);
        }
    }
}

impl Transport for HybridTransport {
    fn rank(&self) -> usize {
        self.tcp.rank()
    }

    fn size(&self) -> usize {
        self.tcp.size()
    }

    fn name(&self) -> &'static str {
        let others = self.size() - 1;
        match self.via_shm.iter().filter(|&&s| s).count() {
            0 => "tcp",
            n if n == others => "shm",
            _ => "shm+tcp",
        }
    }

    fn post(&mut self, req: &mut Request) -> Result<()> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Aborted(why.clone()));
        }
        if self.route(req.peer()) {
            self.shm.as_mut().expect("routed").post(req)
        } else {
            self.tcp.post(req)
        }
    }

    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Aborted(why.clone()));
        }
        let shm_ops = ops.iter().filter(|o| self.route(o.req.peer())).count();
        let r = if shm_ops == 0 {
            self.tcp.progress(ops, wait)
        } else if shm_ops == ops.len() {
            self.shm.as_mut().expect("routed").progress(ops, wait)
        } else {
            // Put the shm ops first, remembering the swaps to restore the caller's order.
            self.swaps.clear();
            let mut k = 0;
            for i in 0..ops.len() {
                if self.route(ops[i].req.peer()) {
                    if i != k {
                        ops.swap(i, k);
                        self.swaps.push((i, k));
                    }
                    k += 1;
                }
            }
            let r = self.mixed(ops, k, wait);
            for &(i, j) in self.swaps.iter().rev() {
                ops.swap(i, j);
            }
            r
        };
        // Broken for both kinds of peer: a failure through one transport alone included.
        if let Err(e) = &r {
            if !e.is_recoverable() && self.broken.is_none() {
                self.broken = Some(e.to_string());
            }
        }
        r
    }

    fn abort(&mut self, notice: &AbortNotice) {
        if let Some(s) = self.shm.as_mut() {
            s.abort(notice);
        }
        self.tcp.abort(notice);
    }

    fn set_abort_handle(&mut self, handle: AbortHandle) {
        if let Some(s) = self.shm.as_mut() {
            s.set_abort_handle(handle.clone());
        }
        self.tcp.set_abort_handle(handle);
    }

    fn shared_memory(&mut self) -> Option<&mut ShmTransport> {
        self.shm.as_mut().filter(|s| s.covers_group())
    }

    fn lost_peer(&mut self, peers: &[usize]) -> Option<TransportError> {
        let (by_shm, by_tcp): (Vec<usize>, Vec<usize>) =
            peers.iter().partition(|&&j| self.route(j));
        if let Some(e) = self.shm.as_mut().and_then(|s| s.lost_peer(&by_shm)) {
            return Some(e);
        }
        self.tcp.lost_peer(&by_tcp)
    }
}

impl std::fmt::Debug for HybridTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridTransport")
            .field("via_shm", &self.via_shm)
            .field("shm", &self.shm)
            .field("tcp", &self.tcp)
            .finish()
    }
}

/// `n` hybrid transports in this process; rank `i` pretends to be on host `hosts[i]`, for tests
/// of mixed groups.
pub fn local_group(hosts: &[&str], choice: Choice) -> Result<Vec<HybridTransport>> {
    use crate::rendezvous::StoreServer;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let n = hosts.len();
    let tcps = crate::tcp::local_group(n)?;
    let server = StoreServer::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), b"test")?;
    let addr = server.local_addr();
    let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
    let handles: Vec<_> = tcps
        .into_iter()
        .map(|t| {
            let hosts = hosts.clone();
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut store = StoreClient::connect(addr, b"test", deadline)?;
                connect(
                    t,
                    &mut store,
                    &hosts,
                    choice,
                    choice.name(),
                    &ShmOptions::default(),
                    deadline,
                )
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for h in handles {
        out.push(
            h.join()
                .map_err(|_| TransportError::Rendezvous("setup thread panicked".into()))??,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conformance_hybrid_two_hosts() {
        // Ranks alternate between two hosts: every group mixes shm and TCP peers (n >= 3).
        crate::conformance::run_all(&|n| {
            let hosts: Vec<&str> = (0..n).map(|i| if i % 2 == 0 { "a" } else { "b" }).collect();
            let g = local_group(&hosts, Choice::Auto).expect("hybrid group");
            if n >= 3 {
                assert_eq!(g[0].name(), "shm+tcp");
                assert!(g[0].uses_shm(2) && !g[0].uses_shm(1));
            }
            g.into_iter()
                .map(|t| Box::new(t) as Box<dyn Transport>)
                .collect()
        });
    }

    #[test]
    fn a_mixed_wait_fails_at_once_when_its_shm_peer_stops() {
        // Ranks 0 and 1 share a host, rank 2 is elsewhere. Rank 1 waits to hear from both;
        // rank 0 goes away (its transport dropped, or aborted), rank 2 stays silent: rank 1
        // fails naming rank 0 at once, not at the deadline.
        for abort in [false, true] {
            let mut g = local_group(&["a", "a", "b"], Choice::Auto).unwrap();
            let t2 = g.pop().unwrap();
            let mut t1 = g.pop().unwrap();
            let mut t0 = g.pop().unwrap();
            assert!(t1.uses_shm(0) && !t1.uses_shm(2));
            let leaver = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                if abort {
                    t0.abort(&crate::AbortNotice {
                        culprit: None,
                        reason: "on purpose".into(),
                    });
                }
                drop(t0);
            });
            let (mut r0, mut r2) = (crate::Request::recv(0, 1, 8), crate::Request::recv(2, 1, 8));
            t1.post(&mut r0).unwrap();
            t1.post(&mut r2).unwrap();
            let (mut b0, mut b2) = ([0u8; 8], [0u8; 8]);
            let start = Instant::now();
            let e = t1
                .wait_all(
                    &mut [Op::recv(&mut r0, &mut b0), Op::recv(&mut r2, &mut b2)],
                    start + Duration::from_secs(30),
                )
                .unwrap_err();
            let took = start.elapsed();
            leaver.join().unwrap();
            assert!(
                took < Duration::from_secs(5),
                "abort {abort}: {e} after {took:?}"
            );
            assert!(
                matches!(
                    e,
                    TransportError::PeerClosed { peer: 0 }
                        | TransportError::PeerAborted { peer: 0, .. }
                ),
                "abort {abort}: {e}"
            );
            drop(t2);
        }
    }

    #[test]
    fn short_mixed_polls_notice_a_killed_shm_peer() {
        // Ranks 0 and 1 share a host, rank 2 is elsewhere. Rank 1 drives receives from both
        // in polls of 2 ms (as the nonblocking queue's progress loop does); rank 0's process
        // is gone without closing its segment (killed): a poll fails naming it within a few
        // process checks, not at the transfer's deadline.
        let mut g = local_group(&["a", "a", "b"], Choice::Auto).unwrap();
        let t2 = g.pop().unwrap();
        let mut t1 = g.pop().unwrap();
        let t0 = g.pop().unwrap();
        let mut exited = std::process::Command::new("true").spawn().unwrap();
        exited.wait().unwrap();
        t1.shm.as_mut().unwrap().watch_peer_as(0, exited.id());
        let (mut r0, mut r2) = (crate::Request::recv(0, 1, 8), crate::Request::recv(2, 1, 8));
        t1.post(&mut r0).unwrap();
        t1.post(&mut r2).unwrap();
        let (mut b0, mut b2) = ([0u8; 8], [0u8; 8]);
        let start = Instant::now();
        let mut polls = 0;
        let e = loop {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "not noticed after {polls} polls"
            );
            polls += 1;
            let mut ops = [Op::recv(&mut r0, &mut b0), Op::recv(&mut r2, &mut b2)];
            let wait = Wait::Poll(Instant::now() + Duration::from_millis(2));
            match t1.progress(&mut ops, wait) {
                Ok(done) => assert!(!done),
                Err(e) => break e,
            }
        };
        assert!(
            matches!(e, TransportError::PeerClosed { peer: 0 }),
            "{e} after {polls} polls"
        );
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{e} after {:?}",
            start.elapsed()
        );
        drop((t0, t2));
    }

    #[test]
    fn a_mixed_wait_fails_at_once_when_a_tcp_peer_aborts() {
        // Ranks 0 and 1 share a host, rank 2 is elsewhere. Rank 1 waits to hear from rank 0
        // (silent) and to send rank 2 more than its socket holds; rank 2 receives nothing and
        // aborts, its process (here: its transport) alive: rank 1 fails at once with rank 2's
        // notice, not at the deadline with a timeout.
        let mut g = local_group(&["a", "a", "b"], Choice::Auto).unwrap();
        let mut t2 = g.pop().unwrap();
        let mut t1 = g.pop().unwrap();
        let t0 = g.pop().unwrap();
        assert!(t1.uses_shm(0) && !t1.uses_shm(2));
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            t2.abort(&crate::AbortNotice {
                culprit: Some(2),
                reason: "on purpose".into(),
            });
            t2
        });
        let big = vec![7u8; 64 << 20];
        let (mut r0, mut s2) = (
            crate::Request::recv(0, 1, 8),
            crate::Request::send(2, 1, big.len()),
        );
        t1.post(&mut r0).unwrap();
        t1.post(&mut s2).unwrap();
        let mut b0 = [0u8; 8];
        let start = Instant::now();
        let e = t1
            .wait_all(
                &mut [Op::recv(&mut r0, &mut b0), Op::send(&mut s2, &big)],
                start + Duration::from_secs(30),
            )
            .unwrap_err();
        let took = start.elapsed();
        let t2 = aborter.join().unwrap();
        assert!(took < Duration::from_secs(5), "{e} after {took:?}");
        assert!(
            matches!(e, TransportError::PeerAborted { peer: 2, .. }),
            "{e}"
        );
        drop((t0, t2));
    }

    #[test]
    fn choices_route_and_disagreement_fails() {
        let mut g = local_group(&["h", "h", "h"], Choice::Auto).unwrap();
        assert_eq!(g[0].name(), "shm");
        assert!(g[1].shared_memory().is_some());
        let mut g = local_group(&["h", "h", "x"], Choice::Auto).unwrap();
        assert!(g[0].shared_memory().is_none(), "rank 2 is elsewhere");
        let g = local_group(&["h", "h"], Choice::Tcp).unwrap();
        assert_eq!(g[0].name(), "tcp");
        let e = local_group(&["h", "x"], Choice::Shm).unwrap_err();
        assert!(e.to_string().contains("one host"), "{e}");
        for c in ["tcp", "SHM", "auto", ""] {
            assert!(Choice::parse(c).is_some());
        }
        assert!(Choice::parse("udp").is_none());
    }
}
