//! An in-memory [`Transport`] for tests: the ranks of one group are threads of this process.
//!
//! It keeps the semantics the schedules rely on: per-(peer, direction) order of posted
//! requests, tag and length checks on the header of each message, partial sends limited by
//! [`Request::available`], back-pressure (at most `capacity` payload bytes in flight from one
//! rank to another, like a socket buffer), messages delivered in frames of at most `frame`
//! bytes (so receivers see partial progress), blocking waits with a deadline, and errors when
//! a peer dropped its transport or aborted.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use chorus_transport::{
    AbortNotice, Buf, Direction, Op, Request, Result, Tag, Transport, TransportError, Wait,
};

enum Frame {
    Header { tag: Tag, len: usize },
    Data(Vec<u8>),
}

/// Why a rank left the group.
#[derive(Clone)]
enum Gone {
    Closed,
    Aborted(AbortNotice),
}

struct State {
    /// `queues[from][to]`.
    queues: Vec<Vec<VecDeque<Frame>>>,
    /// Payload bytes queued from `from` to `to`.
    queued: Vec<Vec<usize>>,
    /// Payload bytes each rank has handed to the group, over its life.
    sent: Vec<u64>,
    gone: Vec<Option<Gone>>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    capacity: usize,
    frame: usize,
}

/// One rank of an in-memory group.
pub struct MemTransport {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    /// Per peer and direction (0 send, 1 recv): the next ticket to hand out.
    posted: Vec<[u64; 2]>,
    /// Per peer and direction: the ticket of the request allowed to move bytes.
    head: Vec<[u64; 2]>,
    /// Per peer: whether the head send already queued its header.
    header_sent: Vec<bool>,
    aborted: bool,
}

/// Creates `size` connected ranks with `capacity` bytes of buffering per direction and
/// messages cut into frames of at most `frame` bytes.
pub fn group(size: usize, capacity: usize, frame: usize) -> Vec<MemTransport> {
    assert!(capacity > 0 && frame > 0);
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queues: (0..size)
                .map(|_| (0..size).map(|_| VecDeque::new()).collect())
                .collect(),
            queued: vec![vec![0; size]; size],
            sent: vec![0; size],
            gone: vec![None; size],
        }),
        changed: Condvar::new(),
        capacity,
        frame,
    });
    (0..size)
        .map(|rank| MemTransport {
            rank,
            size,
            shared: shared.clone(),
            posted: vec![[0; 2]; size],
            head: vec![[0; 2]; size],
            header_sent: vec![false; size],
            aborted: false,
        })
        .collect()
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

fn gone_error(peer: usize, gone: &Gone) -> TransportError {
    match gone {
        Gone::Closed => TransportError::PeerClosed { peer },
        Gone::Aborted(n) => TransportError::PeerAborted {
            peer,
            culprit: n.culprit,
            reason: n.reason.clone(),
        },
    }
}

fn dir_index(d: Direction) -> usize {
    match d {
        Direction::Send => 0,
        Direction::Recv => 1,
    }
}

/// Reads how many payload bytes one rank of a group has sent, from any thread: the bytes the
/// transport itself moved, not what the schedule reports about itself.
#[derive(Clone)]
pub struct SentCounter {
    shared: Arc<Shared>,
    rank: usize,
}

impl SentCounter {
    pub fn get(&self) -> u64 {
        lock(&self.shared).sent[self.rank]
    }
}

impl MemTransport {
    /// A reader of this rank's payload bytes sent (message headers are not counted).
    pub fn sent_counter(&self) -> SentCounter {
        SentCounter {
            shared: self.shared.clone(),
            rank: self.rank,
        }
    }

    /// Moves what can be moved for one op; returns whether anything moved.
    fn step_op(&mut self, st: &mut State, op: &mut Op<'_, '_>) -> Result<bool> {
        let req = &mut *op.req;
        let peer = req.peer();
        let d = dir_index(req.direction());
        let Some(ticket) = req.ticket() else {
            return Err(TransportError::InvalidUsage(
                "progress on a request that was not posted".into(),
            ));
        };
        if ticket != self.head[peer][d] {
            return Ok(false); // an earlier request to this peer goes first
        }
        let mut moved = false;
        match &mut op.buf {
            Buf::Send(buf) => {
                if buf.len() < req.len() || req.direction() != Direction::Send {
                    return Err(TransportError::InvalidArgument("bad send buffer".into()));
                }
                if let Some(g) = &st.gone[peer] {
                    return Err(gone_error(peer, g));
                }
                if !self.header_sent[peer] {
                    st.queues[self.rank][peer].push_back(Frame::Header {
                        tag: req.tag(),
                        len: req.len(),
                    });
                    self.header_sent[peer] = true;
                    moved = true;
                }
                while req.bytes_done() < req.available()
                    && st.queued[self.rank][peer] < self.shared.capacity
                {
                    let n = (req.available() - req.bytes_done())
                        .min(self.shared.frame)
                        .min(self.shared.capacity - st.queued[self.rank][peer]);
                    let from = req.bytes_done();
                    st.queues[self.rank][peer].push_back(Frame::Data(buf[from..from + n].to_vec()));
                    st.queued[self.rank][peer] += n;
                    st.sent[self.rank] += n as u64;
                    req.advance(n);
                    moved = true;
                }
                if req.bytes_done() == req.len() {
                    req.set_complete();
                    self.header_sent[peer] = false;
                    self.head[peer][d] += 1;
                    moved = true;
                }
            }
            Buf::Recv(buf) => {
                if buf.len() < req.len() || req.direction() != Direction::Recv {
                    return Err(TransportError::InvalidArgument("bad recv buffer".into()));
                }
                loop {
                    if let Some(len) = req.message_len() {
                        if req.bytes_done() == len {
                            req.set_complete();
                            self.head[peer][d] += 1;
                            moved = true;
                            break;
                        }
                    }
                    let Some(frame) = st.queues[peer][self.rank].pop_front() else {
                        if let Some(g) = &st.gone[peer] {
                            return Err(gone_error(peer, g));
                        }
                        break;
                    };
                    moved = true;
                    match frame {
                        Frame::Header { tag, len } => {
                            if req.message_len().is_some() {
                                return Err(TransportError::Protocol {
                                    peer,
                                    what: "header inside a message".into(),
                                });
                            }
                            if tag != req.tag() || len > req.len() {
                                return Err(TransportError::Mismatch {
                                    peer,
                                    expected_tag: req.tag(),
                                    got_tag: tag,
                                    expected_len: req.len(),
                                    got_len: len,
                                });
                            }
                            req.set_message_len(len);
                        }
                        Frame::Data(data) => {
                            let from = req.bytes_done();
                            let fits =
                                matches!(req.message_len(), Some(l) if from + data.len() <= l);
                            if !fits {
                                return Err(TransportError::Protocol {
                                    peer,
                                    what: "data outside a message".into(),
                                });
                            }
                            buf[from..from + data.len()].copy_from_slice(&data);
                            st.queued[peer][self.rank] -= data.len();
                            req.advance(data.len());
                        }
                    }
                }
            }
        }
        Ok(moved)
    }
}

impl Transport for MemTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &'static str {
        "mem"
    }

    fn post(&mut self, req: &mut Request) -> Result<()> {
        if self.aborted {
            return Err(TransportError::Aborted("aborted".into()));
        }
        if req.peer() >= self.size {
            return Err(TransportError::InvalidArgument(format!(
                "peer {} out of range",
                req.peer()
            )));
        }
        let slot = &mut self.posted[req.peer()][dir_index(req.direction())];
        req.set_ticket(*slot);
        *slot += 1;
        Ok(())
    }

    fn progress(&mut self, ops: &mut [Op<'_, '_>], wait: Wait) -> Result<bool> {
        if self.aborted {
            return Err(TransportError::Aborted("aborted".into()));
        }
        let start = Instant::now();
        let shared = self.shared.clone();
        let mut st = lock(&shared);
        loop {
            let mut moved = false;
            for op in ops.iter_mut() {
                if !op.req.is_complete() {
                    moved |= self.step_op(&mut st, op)?;
                }
            }
            if moved {
                shared.changed.notify_all();
            }
            let all_complete = ops.iter().all(|op| op.req.is_complete());
            if all_complete || moved {
                return Ok(all_complete);
            }
            let Some((deadline, poll)) = wait.until() else {
                return Ok(false);
            };
            let now = Instant::now();
            if now >= deadline && poll {
                return Ok(false);
            }
            if now >= deadline {
                let peer = ops
                    .iter()
                    .find(|o| !o.req.is_complete())
                    .map(|o| o.req.peer());
                return Err(TransportError::Timeout {
                    peer,
                    waited: now - start,
                });
            }
            st = shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn abort(&mut self, notice: &AbortNotice) {
        let mut st = lock(&self.shared);
        st.gone[self.rank] = Some(Gone::Aborted(notice.clone()));
        self.aborted = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for MemTransport {
    fn drop(&mut self) {
        let mut st = lock(&self.shared);
        if st.gone[self.rank].is_none() {
            st.gone[self.rank] = Some(Gone::Closed);
        }
        self.shared.changed.notify_all();
    }
}
