//! What the RDMA transport needs of a NIC, and an emulated NIC that moves the bytes between
//! threads of one process as an RC queue pair would (in order, whole writes), so the
//! transport runs the conformance suite without a device.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::protocol::Endpoint;

/// A completion of a peer's WRITE WITH IMMEDIATE into this rank's ring for that peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The writer.
    pub peer: usize,
    /// The immediate value.
    pub imm: u32,
    /// Bytes written.
    pub byte_len: u32,
}

/// A NIC failure concerning one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NicError {
    /// The peer's queue pair is gone (it closed, or its process ended).
    Closed,
    /// Anything else the NIC reports.
    Failed(String),
}

/// The verbs the RDMA transport uses: one reliable-connected queue pair per peer, this rank's
/// ring and credit word for each peer, and the peer's ring and credit word as remote memory.
///
/// For a NIC over real verbs: [`Nic::with_ring`] must not hand out a slice of memory the
/// device may be writing (other slots are written while one is read): copy the slot's bytes
/// out through a raw pointer; credit writes complete nowhere at the receiving end, so
/// [`Nic::wait`] must also look at the credit words, not only at the completion queue; and
/// every WRITE WITH IMMEDIATE consumes a posted receive, so the receive queue is refilled as
/// completions are polled.
pub trait Nic: Send {
    /// The number of ranks of the group whose queue pairs it holds (this rank's included).
    fn group_size(&self) -> usize;
    /// The endpoint this rank published for `peer` (its ring and credit word).
    fn local(&self, peer: usize) -> &Endpoint;
    /// The endpoint `peer` published for this rank (the ring this rank writes into).
    fn remote(&self, peer: usize) -> &Endpoint;
    /// Posts an RDMA WRITE WITH IMMEDIATE of `parts`, gathered, to `peer`'s ring at `offset`.
    /// The parts may be reused when this returns.
    fn write_imm(
        &mut self,
        peer: usize,
        offset: u64,
        parts: &[&[u8]],
        imm: u32,
    ) -> Result<(), NicError>;
    /// Posts an RDMA WRITE of `value` into `peer`'s credit word.
    fn write_credit(&mut self, peer: usize, value: u64) -> Result<(), NicError>;
    /// Appends the completions of writes into this rank's rings, oldest first per peer.
    fn poll(&mut self, out: &mut Vec<Completion>);
    /// Whether `peer`'s queue pair is gone (after its completions were polled).
    fn closed(&self, peer: usize) -> bool;
    /// This rank's ring for `peer`, read by `f`.
    fn with_ring<R>(&self, peer: usize, f: impl FnOnce(&[u8]) -> R) -> R;
    /// The count `peer` last wrote into this rank's credit word for it.
    fn credit(&self, peer: usize) -> u64;
    /// Waits until something may have arrived, or `until`.
    fn wait(&mut self, until: Instant);
}

/// The receiver's ring of one direction and its completions (immediate, bytes) not yet polled.
type RingAndQueue = (Vec<u8>, VecDeque<(u32, u32)>);

/// One direction between two ranks: the receiver's ring, its completion queue, and the
/// sender's credit word.
struct Lane {
    ring: Mutex<RingAndQueue>,
    credit: AtomicU64,
}

/// A rank's doorbell: a counter bumped by every write into its memory.
#[derive(Default)]
struct Doorbell {
    rings: Mutex<u64>,
    cv: Condvar,
}

impl Doorbell {
    fn ring(&self) {
        *self.rings.lock().unwrap() += 1;
        self.cv.notify_all();
    }
}

struct Shared {
    /// `lanes[from][to]`.
    lanes: Vec<Vec<Option<Lane>>>,
    bells: Vec<Doorbell>,
    gone: Vec<AtomicBool>,
}

/// An emulated NIC: the ranks of a group are threads of one process, a write is a copy into
/// the peer's ring under a lock, then a completion in the peer's queue. Dropping one closes its
/// queue pairs.
pub struct MemNic {
    rank: usize,
    shared: Arc<Shared>,
    endpoints: Vec<Endpoint>,
    remotes: Vec<Endpoint>,
    seen: u64,
}

/// What `rank` of a group of `n` emulated NICs publishes for `peer`.
fn endpoint(rank: usize, peer: usize, n: usize, slots: u32, slot_bytes: u32) -> Endpoint {
    Endpoint {
        port: 1,
        mtu: 4096,
        lid: 1 + rank as u16,
        gid: [0; 16],
        qpn: 0x100 + (rank * n + peer) as u32,
        psn: 0,
        ring_addr: 0x1000_0000 * (1 + peer as u64),
        ring_rkey: 1,
        slots,
        slot_bytes,
        credit_addr: 0x8000_0000_0000 + 8 * peer as u64,
        credit_rkey: 2,
    }
}

/// A group of `n` emulated NICs whose rings have `slots` slots of `slot_bytes` bytes.
pub fn mem_group(n: usize, slots: u32, slot_bytes: u32) -> Vec<MemNic> {
    let bytes = slots as usize * slot_bytes as usize;
    let lanes = (0..n)
        .map(|from| {
            (0..n)
                .map(|to| {
                    (from != to).then(|| Lane {
                        ring: Mutex::new((vec![0; bytes], VecDeque::new())),
                        credit: AtomicU64::new(0),
                    })
                })
                .collect()
        })
        .collect();
    let shared = Arc::new(Shared {
        lanes,
        bells: (0..n).map(|_| Doorbell::default()).collect(),
        gone: (0..n).map(|_| AtomicBool::new(false)).collect(),
    });
    (0..n)
        .map(|rank| MemNic {
            rank,
            shared: shared.clone(),
            endpoints: (0..n)
                .map(|peer| endpoint(rank, peer, n, slots, slot_bytes))
                .collect(),
            remotes: (0..n)
                .map(|peer| endpoint(peer, rank, n, slots, slot_bytes))
                .collect(),
            seen: 0,
        })
        .collect()
}

impl MemNic {
    fn lane(&self, from: usize, to: usize) -> &Lane {
        self.shared.lanes[from][to]
            .as_ref()
            .expect("a lane between two ranks")
    }
}

impl Drop for MemNic {
    fn drop(&mut self) {
        self.shared.gone[self.rank].store(true, Ordering::SeqCst);
        for bell in &self.shared.bells {
            bell.ring();
        }
    }
}

impl Nic for MemNic {
    fn group_size(&self) -> usize {
        self.endpoints.len()
    }

    fn local(&self, peer: usize) -> &Endpoint {
        &self.endpoints[peer]
    }

    fn remote(&self, peer: usize) -> &Endpoint {
        &self.remotes[peer]
    }

    fn write_imm(
        &mut self,
        peer: usize,
        offset: u64,
        parts: &[&[u8]],
        imm: u32,
    ) -> Result<(), NicError> {
        if self.shared.gone[peer].load(Ordering::SeqCst) {
            return Err(NicError::Closed);
        }
        let lane = self.lane(self.rank, peer);
        let mut g = lane.ring.lock().unwrap();
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut at = offset as usize;
        if at + total > g.0.len() {
            return Err(NicError::Failed(format!(
                "remote access error: {total} bytes at {at} of a {}-byte ring",
                g.0.len()
            )));
        }
        for p in parts {
            g.0[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        g.1.push_back((imm, total as u32));
        drop(g);
        self.shared.bells[peer].ring();
        Ok(())
    }

    fn write_credit(&mut self, peer: usize, value: u64) -> Result<(), NicError> {
        if self.shared.gone[peer].load(Ordering::SeqCst) {
            return Err(NicError::Closed);
        }
        // This rank's consumption of `peer`'s chunks goes into the lane peer -> rank.
        self.lane(peer, self.rank)
            .credit
            .store(value, Ordering::SeqCst);
        self.shared.bells[peer].ring();
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        self.seen = *self.shared.bells[self.rank].rings.lock().unwrap();
        for peer in (0..self.shared.lanes.len()).filter(|&p| p != self.rank) {
            let mut g = self.lane(peer, self.rank).ring.lock().unwrap();
            out.extend(g.1.drain(..).map(|(imm, byte_len)| Completion {
                peer,
                imm,
                byte_len,
            }));
        }
    }

    fn closed(&self, peer: usize) -> bool {
        self.shared.gone[peer].load(Ordering::SeqCst)
            && self.lane(peer, self.rank).ring.lock().unwrap().1.is_empty()
    }

    fn with_ring<R>(&self, peer: usize, f: impl FnOnce(&[u8]) -> R) -> R {
        f(&self.lane(peer, self.rank).ring.lock().unwrap().0)
    }

    fn credit(&self, peer: usize) -> u64 {
        self.lane(self.rank, peer).credit.load(Ordering::SeqCst)
    }

    fn wait(&mut self, until: Instant) {
        let bell = &self.shared.bells[self.rank];
        let g = bell.rings.lock().unwrap();
        // Short slices: a wait is re-checked by the caller, which also watches its deadline.
        let slice = until
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(10));
        if *g == self.seen && !slice.is_zero() {
            drop(bell.cv.wait_timeout(g, slice).unwrap());
        }
    }
}
