//! A [`Transport`] over any [`Nic`]: the [`protocol`](super::protocol) state machines driven
//! by the caller's requests, with the TCP transport's semantics (per-peer order, tags checked,
//! shorter messages, partial sends, deadlines, abort notices, closed peers).

use std::time::Instant;

use super::nic::{Completion, Nic, NicError};
use super::protocol::{Arrival, Incoming, ProtocolError, Receiver, Sender};
use crate::sweep::{deadline_passed, stuck_behind_others, sweep, timeout_peer, Moved, Swept};
use crate::{
    check_ops, check_post, check_usable, AbortHandle, AbortNotice, Buf, Direction, Op, Request,
    Result, Transport, TransportError, Wait,
};

struct Peer {
    tx: Sender,
    rx: Receiver,
    tx_next_ticket: u64,
    /// Ticket of the send at the head of the queue (its message started while `tx` is busy).
    tx_head: u64,
    rx_next_ticket: u64,
    rx_head: u64,
    /// The head receive's progress.
    incoming: Option<Incoming>,
    /// The peer's abort notice: culprit and reason.
    notice: Option<(Option<usize>, String)>,
}

/// The RDMA transport over the NIC `N`.
pub struct RdmaTransport<N: Nic> {
    rank: usize,
    size: usize,
    nic: N,
    peers: Vec<Option<Peer>>,
    completions: Vec<Completion>,
    broken: Option<String>,
    aborted: bool,
    /// Aborts requested from other threads, looked at between the NIC's 10 ms waits.
    abort_request: Option<AbortHandle>,
}

impl<N: Nic> RdmaTransport<N> {
    /// Fail with an abort requested through the handle, after telling the peers.
    fn check_abort_request(&mut self) -> Result<()> {
        let requested = self.abort_request.as_ref().and_then(AbortHandle::requested);
        crate::requested_abort(requested, |n| self.abort(n))
    }

    /// The transport of `rank` in a group of `size` whose queue pairs `nic` holds; checks
    /// every endpoint it was given.
    pub fn new(rank: usize, size: usize, nic: N) -> Result<RdmaTransport<N>> {
        if rank >= size || nic.group_size() != size {
            return Err(TransportError::InvalidArgument(format!(
                "rank {rank} of a group of {size} over a NIC that holds a group of {}",
                nic.group_size()
            )));
        }
        let mut peers = Vec::with_capacity(size);
        for j in 0..size {
            if j == rank {
                peers.push(None);
                continue;
            }
            let (local, remote) = (nic.local(j), nic.remote(j));
            for e in [local, remote] {
                e.check().map_err(|e| protocol(j, e))?;
            }
            super::protocol::path_mtu(local, remote).map_err(|e| protocol(j, e))?;
            peers.push(Some(Peer {
                tx: Sender::new(remote),
                rx: Receiver::new(local),
                tx_next_ticket: 0,
                tx_head: 0,
                rx_next_ticket: 0,
                rx_head: 0,
                incoming: None,
                notice: None,
            }));
        }
        Ok(RdmaTransport {
            rank,
            size,
            nic,
            peers,
            completions: Vec::new(),
            broken: None,
            aborted: false,
            abort_request: None,
        })
    }

    fn fail(&mut self, e: TransportError) -> TransportError {
        if e.is_recoverable() {
            return e;
        }
        // A peer that gave up said why; that notice (which names the rank at fault) is more
        // useful than our own symptom (a closed peer, a failed write).
        let e = match e {
            TransportError::PeerAborted { .. } => e,
            other => self.notice().unwrap_or(other),
        };
        if self.broken.is_none() {
            self.broken = Some(e.to_string());
        }
        e
    }

    /// A peer's abort notice, if one arrived (one that names a culprit first).
    fn notice(&self) -> Option<TransportError> {
        let notices = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(j, p)| Some((j, p.as_ref()?.notice.as_ref()?)));
        let (peer, (culprit, reason)) = notices
            .clone()
            .find(|(_, (c, _))| c.is_some())
            .or_else(|| notices.clone().next())?;
        Some(TransportError::PeerAborted {
            peer,
            culprit: *culprit,
            reason: reason.clone(),
        })
    }

    /// Takes the NIC's completions into the peers' receivers, and the peers' credit reports.
    fn take_completions(&mut self) -> Result<()> {
        // The buffer is kept across polls (this runs at every turn of a wait).
        let mut completions = std::mem::take(&mut self.completions);
        completions.clear();
        self.nic.poll(&mut completions);
        let delivered = self.deliver_completions(&completions);
        self.completions = completions;
        delivered?;
        for j in 0..self.size {
            if let Some(Some(p)) = self.peers.get_mut(j) {
                p.tx.on_credit(self.nic.credit(j))
                    .map_err(|e| protocol(j, e))?;
            }
        }
        Ok(())
    }

    /// Hands polled completions to the peers' receivers.
    fn deliver_completions(&mut self, completions: &[Completion]) -> Result<()> {
        for c in completions {
            let Some(Some(p)) = self.peers.get_mut(c.peer) else {
                continue;
            };
            let arrival = self
                .nic
                .with_ring(c.peer, |ring| p.rx.on_completion(c.imm, c.byte_len, ring))
                .map_err(|e| protocol(c.peer, e))?;
            if let Arrival::Abort { culprit, reason } = arrival {
                // A culprit outside the group is no one's.
                p.notice = Some((culprit.filter(|&c| c < self.size), reason));
            }
        }
        Ok(())
    }

    fn drive(&mut self, op: &mut Op<'_, '_>) -> Result<Moved> {
        let j = op.req.peer();
        let nic = &mut self.nic;
        let p = crate::peer_entry(&mut self.peers, j, self.rank, self.size)?;
        match op.req.direction() {
            Direction::Send => {
                if op.req.ticket() != Some(p.tx_head) {
                    return Ok(Moved::NotHead);
                }
                let buf: &[u8] = match &op.buf {
                    Buf::Send(b) => b,
                    Buf::Recv(b) => b,
                };
                if p.tx.idle() {
                    p.tx.start(op.req.tag(), op.req.len())
                        .map_err(|e| protocol(j, e))?;
                }
                let mut moved = false;
                while let Some(c) = p.tx.next_chunk(op.req.available()) {
                    let payload = &buf[c.payload.clone()];
                    let parts: &[&[u8]] = match &c.header {
                        Some(h) => &[h, payload],
                        None => &[payload],
                    };
                    if let Err(e) = nic.write_imm(j, c.remote_offset, parts, c.imm) {
                        p.tx.unpost();
                        return Err(nic_err(j, e));
                    }
                    op.req.advance(c.payload.len());
                    moved = true;
                    if p.tx.idle() {
                        op.req.set_complete();
                        p.tx_head += 1;
                        return Ok(Moved::Yes);
                    }
                }
                // Nothing went: bytes (or an empty message's header) wait for credits, or every
                // available byte went and only the caller can make more.
                Ok(if moved {
                    Moved::Yes
                } else if op.req.available() > op.req.bytes_done() || op.req.is_empty() {
                    Moved::Blocked
                } else {
                    Moved::NeedsData
                })
            }
            Direction::Recv => {
                if op.req.ticket() != Some(p.rx_head) {
                    return Ok(Moved::NotHead);
                }
                let Buf::Recv(buf) = &mut op.buf else {
                    return Err(TransportError::InvalidArgument(
                        "a receive request needs a Buf::Recv buffer".into(),
                    ));
                };
                let inc = p
                    .incoming
                    .get_or_insert_with(|| Incoming::new(op.req.tag(), op.req.len()));
                let mut moved = false;
                loop {
                    let step = nic.with_ring(j, |ring| {
                        let d = p.rx.deliver(inc, ring)?;
                        if let Some(d) = &d {
                            buf[d.to.clone()].copy_from_slice(&ring[d.from.clone()]);
                        }
                        Ok::<_, ProtocolError>(d)
                    });
                    match step.map_err(|e| protocol(j, e))? {
                        Some(d) => {
                            moved = true;
                            op.req.advance(d.to.len());
                        }
                        None => break,
                    }
                }
                if let Some(len) = inc.len {
                    if op.req.message_len().is_none() {
                        op.req.set_message_len(len);
                        moved = true;
                    }
                }
                if let Some(c) = p.rx.credit_report() {
                    // A peer that is gone needs no credits (what it sent is still delivered).
                    match nic.write_credit(j, c) {
                        Ok(()) | Err(NicError::Closed) => {}
                        Err(e) => return Err(nic_err(j, e)),
                    }
                }
                if inc.done() {
                    if let Some(c) = p.rx.credit_flush() {
                        match nic.write_credit(j, c) {
                            Ok(()) | Err(NicError::Closed) => {}
                            Err(e) => return Err(nic_err(j, e)),
                        }
                    }
                    op.req.set_complete();
                    p.incoming = None;
                    p.rx_head += 1;
                    return Ok(Moved::Yes);
                }
                Ok(if moved { Moved::Yes } else { Moved::Blocked })
            }
        }
    }

    /// The error for a wait that cannot go on: a peer's abort notice, or a closed peer this
    /// wait needs.
    fn stuck(&self, ops: &[Op<'_, '_>]) -> Option<TransportError> {
        if let Some(e) = self.notice() {
            return Some(e);
        }
        ops.iter()
            .filter(|o| !o.req.is_complete())
            .map(|o| o.req.peer())
            .find(|&j| self.nic.closed(j))
            .map(|peer| TransportError::PeerClosed { peer })
    }
}

fn protocol(peer: usize, e: ProtocolError) -> TransportError {
    match e {
        ProtocolError::Mismatch {
            expected_tag,
            got_tag,
            expected_len,
            got_len,
        } => TransportError::Mismatch {
            peer,
            expected_tag,
            got_tag,
            expected_len,
            got_len,
        },
        // The transport never misuses its state machines; if one says so, the state is lost.
        other => TransportError::Protocol {
            peer,
            what: other.to_string(),
        },
    }
}

fn nic_err(peer: usize, e: NicError) -> TransportError {
    match e {
        NicError::Closed => TransportError::PeerClosed { peer },
        NicError::Failed(what) => TransportError::Protocol { peer, what },
    }
}

impl<N: Nic> Transport for RdmaTransport<N> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn name(&self) -> &'static str {
        "rdma"
    }

    fn post(&mut self, req: &mut Request) -> Result<()> {
        check_post(&self.broken, req)?;
        let p = crate::peer_entry(&mut self.peers, req.peer(), self.rank, self.size)?;
        let ticket = match req.direction() {
            Direction::Send => &mut p.tx_next_ticket,
            Direction::Recv => &mut p.rx_next_ticket,
        };
        req.set_ticket(*ticket);
        *ticket += 1;
        Ok(())
    }

    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        check_usable(&self.broken)?;
        check_ops(ops)?;
        let started = Instant::now();
        loop {
            self.check_abort_request()?;
            if let Err(e) = self.take_completions() {
                return Err(self.fail(e));
            }
            let Swept {
                moved,
                all_done,
                blocked,
                needs_data,
            } = match sweep(ops, |op| self.drive(op)) {
                Ok(s) => s,
                Err(e) => return Err(self.fail(e)),
            };
            if all_done {
                return Ok(true);
            }
            if moved {
                if let Some(e) = deadline_passed(wait, ops, started) {
                    return Err(self.fail(e));
                }
            }
            let (deadline, poll) = match wait.until() {
                Some(w) if !moved => w,
                _ => return Ok(false),
            };
            if !blocked {
                if needs_data {
                    return Ok(false);
                }
                return Err(stuck_behind_others());
            }
            // What already arrived was delivered; a notice or a closed peer ends the wait.
            if let Some(e) = self.stuck(ops) {
                return Err(self.fail(e));
            }
            if Instant::now() >= deadline && poll {
                return Ok(false);
            }
            if Instant::now() >= deadline {
                return Err(self.fail(TransportError::Timeout {
                    peer: timeout_peer(ops),
                    waited: started.elapsed(),
                }));
            }
            self.nic.wait(deadline);
        }
    }

    fn set_abort_handle(&mut self, handle: AbortHandle) {
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
        for j in 0..self.size {
            let Some(Some(p)) = self.peers.get_mut(j) else {
                continue;
            };
            if let Some(a) = p.tx.abort(notice.culprit, &notice.reason) {
                // A peer that is gone cannot be told.
                let _ = self.nic.write_imm(j, a.remote_offset, &[&a.bytes], a.imm);
            }
        }
    }
}

impl<N: Nic> std::fmt::Debug for RdmaTransport<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("broken", &self.broken)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::nic::{mem_group, MemNic};
    use super::*;
    use crate::conformance;

    fn group(slots: u32, slot_bytes: u32) -> impl Fn(usize) -> Vec<Box<dyn Transport>> {
        move |n| {
            mem_group(n, slots, slot_bytes)
                .into_iter()
                .enumerate()
                .map(|(rank, nic)| {
                    Box::new(RdmaTransport::<MemNic>::new(rank, n, nic).unwrap())
                        as Box<dyn Transport>
                })
                .collect()
        }
    }

    #[test]
    fn conformance_over_the_emulated_nic() {
        conformance::run_all(&group(16, 64 << 10));
    }

    #[test]
    fn conformance_with_a_small_ring() {
        // Two slots of 64 bytes: one message chunk in flight, every credit report needed.
        conformance::ordered_tags(&group(2, 64));
        conformance::nonblocking_and_partial(&group(2, 64));
        conformance::shorter_message(&group(2, 64));
        conformance::abort_mid_message(&group(4, 4096));
    }

    #[test]
    fn a_sender_gets_its_credits_back_at_the_end_of_each_receive() {
        // 16 slots of 64 bytes, reported every 8 consumed: after a 7-chunk message, the next
        // of 9 chunks fits only if the receiver returned the first message's slots, though it
        // receives nothing more until that send completed.
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;
        let sent = Arc::new(AtomicBool::new(false));
        let m1 = vec![1u8; 48 + 64 * 6];
        let m2 = vec![2u8; 48 + 64 * 8];
        let t = Duration::from_secs(5);
        conformance::on_group(&group(16, 64), 2, move |rank, tr| {
            if rank == 0 {
                tr.send(1, 1, &m1, t).unwrap();
                tr.send(1, 2, &m2, t).unwrap();
                sent.store(true, Ordering::SeqCst);
            } else {
                let mut b = vec![0u8; m2.len()];
                assert_eq!(tr.recv(0, 1, &mut b, t).unwrap(), m1.len());
                let until = std::time::Instant::now() + t;
                while !sent.load(Ordering::SeqCst) {
                    assert!(
                        std::time::Instant::now() < until,
                        "the second send is stuck"
                    );
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(tr.recv(0, 2, &mut b, t).unwrap(), m2.len());
                assert_eq!(b, m2);
            }
        });
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// A peer whose NIC writes whatever it likes (immediates, lengths, bytes, credit
        /// words) and then goes away: every receive and send ends at once with data or an
        /// error other than a timeout (their deadlines are 20 s away), never a hang.
        #[test]
        fn a_lying_peer_gets_an_error_not_a_hang(
            writes in proptest::collection::vec(
                (proptest::prelude::any::<u32>(), 0usize..=64, proptest::prelude::any::<u64>(),
                 proptest::collection::vec(proptest::prelude::any::<u8>(), 16)),
                1..12,
            ),
            honest_prefix in 0u32..4,
        ) {
            use std::time::Duration;
            let mut nics = mem_group(2, 4, 64);
            let mut liar = nics.pop().unwrap();
            let mut t = RdmaTransport::new(0, 2, nics.pop().unwrap()).unwrap();
            for (k, (imm, len, credit, bytes)) in writes.iter().enumerate() {
                // Sometimes start with well-formed sequence numbers, to reach deeper checks.
                let imm = if (k as u32) < honest_prefix { (k as u32) | (imm & (3 << 30)) } else { *imm };
                let mut data = bytes.clone();
                data.resize(*len, 0xab);
                let slot = (k % 4) as u64 * 64;
                let _ = liar.write_imm(0, slot, &[&data], imm);
                let _ = liar.write_credit(0, *credit);
            }
            drop(liar);
            let start = Instant::now();
            let mut b = vec![0u8; 100];
            let r = t.recv(1, 7, &mut b, Duration::from_secs(20));
            let s = t.send(1, 8, &[1u8; 300], Duration::from_secs(20));
            proptest::prop_assert!(start.elapsed() < Duration::from_secs(5));
            match r {
                Ok(n) => proptest::prop_assert!(n <= 100),
                Err(e) => proptest::prop_assert!(
                    !matches!(e, TransportError::Timeout { .. }), "receive: {}", e
                ),
            }
            if let Err(e) = s {
                proptest::prop_assert!(!matches!(e, TransportError::Timeout { .. }), "send: {}", e);
            }
        }
    }

    #[test]
    fn a_rank_or_size_the_nic_does_not_hold_is_refused() {
        for (rank, size) in [(0, 3), (2, 2), (1, 1)] {
            let nic = mem_group(2, 4, 64).remove(0);
            match RdmaTransport::new(rank, size, nic) {
                Err(TransportError::InvalidArgument(m)) => assert!(m.contains("group of 2"), "{m}"),
                Err(e) => panic!("rank {rank} of {size}: {e}"),
                Ok(_) => panic!("rank {rank} of {size}: accepted"),
            }
        }
    }

    #[test]
    fn bad_endpoints_are_refused() {
        let mut nics = mem_group(2, 4, 64);
        let nic = nics.remove(0);
        // A ring of 3 slots is not a power of two.
        struct Bad(MemNic, super::super::protocol::Endpoint);
        impl Nic for Bad {
            fn group_size(&self) -> usize {
                self.0.group_size()
            }
            fn local(&self, p: usize) -> &super::super::protocol::Endpoint {
                self.0.local(p)
            }
            fn remote(&self, _: usize) -> &super::super::protocol::Endpoint {
                &self.1
            }
            fn write_imm(&mut self, p: usize, o: u64, b: &[&[u8]], i: u32) -> Result<(), NicError> {
                self.0.write_imm(p, o, b, i)
            }
            fn write_credit(&mut self, p: usize, v: u64) -> Result<(), NicError> {
                self.0.write_credit(p, v)
            }
            fn poll(&mut self, out: &mut Vec<Completion>) {
                self.0.poll(out)
            }
            fn closed(&self, p: usize) -> bool {
                self.0.closed(p)
            }
            fn with_ring<R>(&self, p: usize, f: impl FnOnce(&[u8]) -> R) -> R {
                self.0.with_ring(p, f)
            }
            fn credit(&self, p: usize) -> u64 {
                self.0.credit(p)
            }
            fn wait(&mut self, until: Instant) {
                self.0.wait(until)
            }
        }
        let mut e = nic.remote(1).clone();
        e.slots = 3;
        let err = RdmaTransport::new(0, 2, Bad(nic, e)).unwrap_err();
        assert!(
            matches!(&err, TransportError::Protocol { peer: 1, what } if what.contains("3 slots")),
            "{err}"
        );
    }
}
