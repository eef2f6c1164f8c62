//! The RDMA protocol layer: what two ranks exchange to connect a queue pair, and how messages
//! travel through the receiver's ring of slots under credits. Pure state machines, tested
//! without a device; the verbs layer would execute the writes they describe.
//!
//! # Connecting
//! For every peer, a rank registers a receive ring of `slots` × `slot_bytes` bytes and an
//! 8-byte credit word, creates a reliable-connected (RC) queue pair, and publishes an
//! [`Endpoint`] through the rendezvous store: the queue pair's number and first packet
//! sequence number, the port's LID and GID, its path MTU, and where (address and remote key)
//! the peer may write. [`Endpoint::decode`] checks every field before anything is used;
//! [`path_mtu`] checks that the two ends can talk at all.
//!
//! # Messages
//! A message of `n` bytes travels as one or more chunks. The first chunk starts with a
//! [`HEADER_BYTES`]-byte header (tag and length, little-endian), so a receive whose tag or
//! length differs is caught before a byte reaches the caller's buffer, as over TCP. Each chunk
//! is one RDMA WRITE WITH IMMEDIATE into slot `seq % slots` of the peer's ring; the immediate
//! carries the chunk's sequence number (low 30 bits), a bit marking the message's last chunk
//! and a bit marking an abort notice. An RC queue pair delivers in order, so the receiver knows
//! which sequence number comes next, and any other is a protocol error, as is a chunk longer
//! than a slot or a message whose chunks do not add up to its header's length. A message may
//! be shorter than the receive's buffer (its length is the header's), never longer.
//!
//! # Aborts
//! A rank that gives up writes an abort notice (the rank it blames and its reason) into the
//! next slot, mid-message or not, and writes nothing after it. The last slot of every ring is
//! kept for it: it always has room.
//!
//! # Credits
//! The sender never has more than `slots - 1` chunks the receiver has not consumed (the last
//! slot is the abort notice's). The receiver
//! consumes a chunk once it has copied it out, and, once it has consumed half a ring since its
//! last report, writes its consumed count into the sender's credit word (an RDMA WRITE, no
//! completion at the sender). The count only grows and can never pass what was sent; a peer
//! that writes past its credits, or reports a count that breaks either rule, is a protocol
//! error, not a buffer overrun.

use std::fmt;
use std::ops::Range;

/// Version of the endpoint record and chunk format.
pub const VERSION: u8 = 1;
/// Bytes of the header at the start of a message's first chunk.
pub const HEADER_BYTES: usize = 16;
/// Smallest slot (a header and 48 bytes of payload).
pub const MIN_SLOT_BYTES: u32 = 64;
/// Largest slot (4 MiB).
pub const MAX_SLOT_BYTES: u32 = 1 << 22;
/// Most slots in a ring.
pub const MAX_SLOTS: u32 = 1 << 12;
/// Bytes of an encoded [`Endpoint`].
pub const ENDPOINT_BYTES: usize = 4 + 1 + 1 + 2 + 2 + 16 + 4 + 4 + 8 + 4 + 4 + 4 + 8 + 4;

const MAGIC: [u8; 4] = *b"CRDM";
const SEQ_MASK: u32 = 0x3fff_ffff;
const LAST_BIT: u32 = 1 << 31;
const ABORT_BIT: u32 = 1 << 30;
/// `culprit` value of an abort notice that blames no rank.
const NO_CULPRIT: u64 = u64::MAX;
const MTUS: [u16; 5] = [256, 512, 1024, 2048, 4096];

/// A violation of the protocol by the peer (or a bad record from the store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// An endpoint record that cannot be used.
    Endpoint(String),
    /// A chunk that breaks the chunk rules (order, length, credits).
    Chunk(String),
    /// A credit report that goes backwards or past what was sent.
    Credit(String),
    /// The next message's tag or length is not the posted receive's.
    Mismatch {
        /// The receive's tag.
        expected_tag: u64,
        /// The message's tag.
        got_tag: u64,
        /// The receive's length.
        expected_len: usize,
        /// The message's length.
        got_len: usize,
    },
    /// A call the state machine's state does not allow (a caller's error).
    Usage(&'static str),
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::Endpoint(w) => write!(f, "bad RDMA endpoint record: {w}"),
            ProtocolError::Chunk(w) => write!(f, "bad RDMA chunk: {w}"),
            ProtocolError::Credit(w) => write!(f, "bad RDMA credit report: {w}"),
            ProtocolError::Mismatch {
                expected_tag,
                got_tag,
                expected_len,
                got_len,
            } => write!(
                f,
                "message mismatch: expected tag {expected_tag:#x} of {expected_len} bytes, \
                 got tag {got_tag:#x} of {got_len} bytes"
            ),
            ProtocolError::Usage(w) => write!(f, "RDMA protocol misuse: {w}"),
        }
    }
}

impl std::error::Error for ProtocolError {}

/// What a rank publishes for one peer: its queue pair and where the peer may write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Port number on the device (1-based).
    pub port: u8,
    /// Largest path MTU the port supports, in bytes (256 … 4096).
    pub mtu: u16,
    /// The port's LID (InfiniBand); 0 on RoCE, where the GID addresses the port.
    pub lid: u16,
    /// The port's GID.
    pub gid: [u8; 16],
    /// Queue pair number (24 bits; 0 and 1 are the special QPs).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Address of the receive ring in the publisher's memory.
    pub ring_addr: u64,
    /// Remote key of the ring's registration.
    pub ring_rkey: u32,
    /// Slots in the ring (a power of two, 2 … [`MAX_SLOTS`]).
    pub slots: u32,
    /// Bytes per slot (a multiple of 64, [`MIN_SLOT_BYTES`] … [`MAX_SLOT_BYTES`]).
    pub slot_bytes: u32,
    /// Address of the credit word (8-byte aligned) the peer reports its consumption into.
    pub credit_addr: u64,
    /// Remote key of the credit word's registration.
    pub credit_rkey: u32,
}

impl Endpoint {
    /// The record as stored: magic, version, then the fields little-endian.
    pub fn encode(&self) -> [u8; ENDPOINT_BYTES] {
        let mut b = [0u8; ENDPOINT_BYTES];
        let mut w = Writer { b: &mut b, at: 0 };
        w.put(&MAGIC);
        w.put(&[VERSION, self.port]);
        w.put(&self.mtu.to_le_bytes());
        w.put(&self.lid.to_le_bytes());
        w.put(&self.gid);
        w.put(&self.qpn.to_le_bytes());
        w.put(&self.psn.to_le_bytes());
        w.put(&self.ring_addr.to_le_bytes());
        w.put(&self.ring_rkey.to_le_bytes());
        w.put(&self.slots.to_le_bytes());
        w.put(&self.slot_bytes.to_le_bytes());
        w.put(&self.credit_addr.to_le_bytes());
        w.put(&self.credit_rkey.to_le_bytes());
        debug_assert_eq!(w.at, ENDPOINT_BYTES);
        b
    }

    /// Parses and checks a record from the store.
    pub fn decode(b: &[u8]) -> Result<Endpoint, ProtocolError> {
        let bad = |w: String| Err(ProtocolError::Endpoint(w));
        if b.len() != ENDPOINT_BYTES {
            return bad(format!("{} bytes, expected {ENDPOINT_BYTES}", b.len()));
        }
        if b[..4] != MAGIC {
            return bad("not an RDMA endpoint record (bad magic)".into());
        }
        if b[4] != VERSION {
            return bad(format!(
                "version {} (this rank speaks {VERSION}): ranks run different chorus releases",
                b[4]
            ));
        }
        let mut r = Reader { b, at: 5 };
        let e = Endpoint {
            port: r.u8(),
            mtu: r.u16(),
            lid: r.u16(),
            gid: r.array(),
            qpn: r.u32(),
            psn: r.u32(),
            ring_addr: r.u64(),
            ring_rkey: r.u32(),
            slots: r.u32(),
            slot_bytes: r.u32(),
            credit_addr: r.u64(),
            credit_rkey: r.u32(),
        };
        e.check()?;
        Ok(e)
    }

    /// Checks every field's range (what [`Endpoint::decode`] applies).
    pub fn check(&self) -> Result<(), ProtocolError> {
        let bad = |w: String| Err(ProtocolError::Endpoint(w));
        if self.port == 0 {
            return bad("port 0 (ports count from 1)".into());
        }
        if !MTUS.contains(&self.mtu) {
            return bad(format!("MTU {} is not one of {MTUS:?}", self.mtu));
        }
        if self.lid == 0 && self.gid == [0; 16] {
            return bad("neither a LID nor a GID".into());
        }
        // Unicast LIDs are 0x0001..=0xbfff; 0xc000 and up are multicast (and 0xffff the
        // permissive LID), never a queue pair's address.
        if self.lid >= 0xc000 {
            return bad(format!("LID {:#x} is not a unicast LID", self.lid));
        }
        if self.qpn < 2 || self.qpn > 0x00ff_ffff {
            return bad(format!("queue pair number {:#x}", self.qpn));
        }
        if self.psn > 0x00ff_ffff {
            return bad(format!("packet sequence number {:#x}", self.psn));
        }
        if !self.slots.is_power_of_two() || !(2..=MAX_SLOTS).contains(&self.slots) {
            return bad(format!(
                "{} slots (a power of two in 2..={MAX_SLOTS})",
                self.slots
            ));
        }
        if self.slot_bytes % 64 != 0
            || !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&self.slot_bytes)
        {
            return bad(format!(
                "{}-byte slots (a multiple of 64 in {MIN_SLOT_BYTES}..={MAX_SLOT_BYTES})",
                self.slot_bytes
            ));
        }
        let ring_bytes = u64::from(self.slots) * u64::from(self.slot_bytes);
        if self.ring_addr == 0 || self.ring_addr.checked_add(ring_bytes).is_none() {
            return bad(format!(
                "ring at {:#x} of {ring_bytes} bytes",
                self.ring_addr
            ));
        }
        if self.credit_addr == 0
            || self.credit_addr % 8 != 0
            || self.credit_addr.checked_add(8).is_none()
        {
            return bad(format!("credit word at {:#x}", self.credit_addr));
        }
        Ok(())
    }
}

/// The path MTU two ends use: the smaller of their ports' MTUs. Fails where one end is
/// addressed by LID only and the other by GID only (InfiniBand against RoCE).
pub fn path_mtu(local: &Endpoint, remote: &Endpoint) -> Result<u16, ProtocolError> {
    if (local.lid == 0) != (remote.lid == 0) {
        return Err(ProtocolError::Endpoint(format!(
            "link layers differ: local LID {}, peer LID {} (InfiniBand against RoCE?)",
            local.lid, remote.lid
        )));
    }
    Ok(local.mtu.min(remote.mtu))
}

struct Writer<'a> {
    b: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, s: &[u8]) {
        self.b[self.at..self.at + s.len()].copy_from_slice(s);
        self.at += s.len();
    }
}

/// Reads fields from a buffer whose length was checked first.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        a.copy_from_slice(&self.b[self.at..self.at + N]);
        self.at += N;
        a
    }
    fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// The immediate value of a chunk's write: low 30 bits of its sequence number, and whether it
/// ends its message.
pub fn immediate(seq: u64, last: bool) -> u32 {
    (seq as u32 & SEQ_MASK) | if last { LAST_BIT } else { 0 }
}

/// One RDMA WRITE WITH IMMEDIATE the sender posts: the header (first chunk only) and then
/// `payload` of the message, gathered into the peer's ring at `remote_offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Chunk sequence number on this connection.
    pub seq: u64,
    /// Byte offset of the target slot in the peer's ring.
    pub remote_offset: u64,
    /// The message header, for a message's first chunk.
    pub header: Option<[u8; HEADER_BYTES]>,
    /// The range of the message's bytes this chunk carries.
    pub payload: Range<usize>,
    /// The immediate value ([`immediate`]).
    pub imm: u32,
}

impl Chunk {
    /// Bytes the write puts on the wire (header and payload).
    pub fn len(&self) -> usize {
        self.header.map_or(0, |h| h.len()) + self.payload.len()
    }

    /// Whether the chunk carries no byte at all (never: a first chunk has its header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The abort notice's write: `bytes` (culprit, then reason) at `remote_offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AbortWrite {
    /// Byte offset of the target slot in the peer's ring.
    pub remote_offset: u64,
    /// The notice.
    pub bytes: Vec<u8>,
    /// The immediate value.
    pub imm: u32,
}

fn header(tag: u64, len: usize) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&tag.to_le_bytes());
    h[8..].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// The sending half of a connection: chunks messages into the peer's ring, one message at a
/// time, within the credits the peer reported.
#[derive(Debug)]
pub struct Sender {
    slots: u32,
    slot_bytes: usize,
    /// Chunks written so far.
    sent: u64,
    /// Chunks the peer has reported consumed.
    consumed: u64,
    current: Option<Outgoing>,
    /// An abort notice was written: nothing more goes.
    aborted: bool,
}

#[derive(Debug)]
struct Outgoing {
    tag: u64,
    len: usize,
    /// Payload bytes handed to chunks so far.
    next: usize,
    header_sent: bool,
}

impl Sender {
    /// A sender writing into the ring `peer` published.
    pub fn new(peer: &Endpoint) -> Sender {
        Sender {
            slots: peer.slots,
            slot_bytes: peer.slot_bytes as usize,
            sent: 0,
            consumed: 0,
            current: None,
            aborted: false,
        }
    }

    /// Starts a message of `len` bytes with `tag`; the previous one must be done.
    pub fn start(&mut self, tag: u64, len: usize) -> Result<(), ProtocolError> {
        if self.current.is_some() {
            return Err(ProtocolError::Usage("a message is still being sent"));
        }
        if self.aborted {
            return Err(ProtocolError::Usage("the connection was aborted"));
        }
        self.current = Some(Outgoing {
            tag,
            len,
            next: 0,
            header_sent: false,
        });
        Ok(())
    }

    /// Free slots in the peer's ring for messages (its last slot is kept for an abort notice).
    pub fn credits(&self) -> u32 {
        if self.aborted {
            return 0;
        }
        (u64::from(self.slots) - 1 - (self.sent - self.consumed)) as u32
    }

    /// Whether no message is in progress.
    pub fn idle(&self) -> bool {
        self.current.is_none()
    }

    /// The next chunk of the current message, taking what of its first `available` bytes
    /// is not yet sent (as much as a slot holds); `None` when there is no message, no credit,
    /// or no new byte available. Every chunk carries at least one byte of the message, but
    /// the header-only chunk of an empty message. Whatever is available goes, however little: holding bytes
    /// back to fill a slot could wait on a peer that waits on them.
    pub fn next_chunk(&mut self, available: usize) -> Option<Chunk> {
        if self.credits() == 0 {
            return None;
        }
        let out = self.current.as_mut()?;
        let available = available.min(out.len);
        let room = self.slot_bytes - if out.header_sent { 0 } else { HEADER_BYTES };
        let take = available.saturating_sub(out.next).min(room);
        // The header waits for the first byte (a slot and a write saved), except for an
        // empty message, which is its header.
        if take == 0 && (out.header_sent || out.len > 0) {
            return None;
        }
        let head = (!out.header_sent).then(|| header(out.tag, out.len));
        let payload = out.next..out.next + take;
        out.next += take;
        out.header_sent = true;
        let last = out.next == out.len;
        let seq = self.sent;
        self.sent += 1;
        if last {
            self.current = None;
        }
        Some(Chunk {
            seq,
            remote_offset: (seq % u64::from(self.slots)) * self.slot_bytes as u64,
            header: head,
            payload,
            imm: immediate(seq, last),
        })
    }

    /// The chunk [`next_chunk`](Self::next_chunk) gave last was not posted (the NIC refused
    /// it): its sequence number is taken back, so that the abort notice that follows carries
    /// the number the peer expects next. The message cannot go on (the transport is broken).
    pub fn unpost(&mut self) {
        if !self.aborted && self.sent > self.consumed {
            self.sent -= 1;
            self.current = None;
        }
    }

    /// The abort notice to write into the peer's ring (whatever the credits: its slot is
    /// kept), blaming `culprit`, with `reason` cut to fit the slot. Nothing is sent after it;
    /// `None` if a notice was written already.
    pub fn abort(&mut self, culprit: Option<usize>, reason: &str) -> Option<AbortWrite> {
        if self.aborted {
            return None;
        }
        let room = self.slot_bytes - 8;
        let mut cut = reason.len().min(room);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut bytes = Vec::with_capacity(8 + cut);
        bytes.extend_from_slice(&culprit.map_or(NO_CULPRIT, |c| c as u64).to_le_bytes());
        bytes.extend_from_slice(&reason.as_bytes()[..cut]);
        let seq = self.sent;
        self.sent += 1;
        self.aborted = true;
        self.current = None;
        Some(AbortWrite {
            remote_offset: (seq % u64::from(self.slots)) * self.slot_bytes as u64,
            bytes,
            imm: (seq as u32 & SEQ_MASK) | ABORT_BIT,
        })
    }

    /// The peer's report of chunks consumed (its credit word). Counts only grow and never pass
    /// what was sent.
    pub fn on_credit(&mut self, consumed: u64) -> Result<(), ProtocolError> {
        // The abort notice is never consumed; a report may not count it.
        let sent = self.sent - u64::from(self.aborted);
        if consumed < self.consumed || consumed > sent {
            return Err(ProtocolError::Credit(format!(
                "{consumed} chunks consumed, after {} reported and with {sent} sent",
                self.consumed
            )));
        }
        self.consumed = consumed;
        Ok(())
    }
}

/// A receive the caller posted: its tag, its capacity, and the bytes delivered so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    /// Expected tag.
    pub tag: u64,
    /// The buffer's length: the most the message may hold.
    pub capacity: usize,
    /// The message's length, once its header arrived.
    pub len: Option<usize>,
    /// Bytes delivered so far.
    pub got: usize,
}

impl Incoming {
    /// A receive of at most `capacity` bytes with `tag`.
    pub fn new(tag: u64, capacity: usize) -> Incoming {
        Incoming {
            tag,
            capacity,
            len: None,
            got: 0,
        }
    }

    /// Whether the whole message arrived.
    pub fn done(&self) -> bool {
        self.len == Some(self.got)
    }
}

/// A copy the caller makes out of its ring into the receive's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// Bytes in the ring.
    pub from: Range<usize>,
    /// Bytes of the message.
    pub to: Range<usize>,
}

/// The receiving half of a connection: checks the chunks that completed in its ring, in order,
/// and hands them to the posted receives.
#[derive(Debug)]
pub struct Receiver {
    slots: u32,
    slot_bytes: usize,
    /// Chunks that completed (arrived in the ring).
    arrived: u64,
    /// Chunks copied out.
    consumed: u64,
    /// The consumed count last written to the sender.
    reported: u64,
    /// Lengths and last-flags of arrived, unconsumed chunks, oldest first.
    pending: std::collections::VecDeque<(usize, bool)>,
    /// The peer's abort notice arrived.
    aborted: bool,
}

/// What a completion brought.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// A chunk of a message (deliver it with [`Receiver::deliver`]).
    Chunk,
    /// The peer's abort notice: the rank it blames and its reason. Nothing follows it.
    Abort {
        /// The rank the peer blames, if any.
        culprit: Option<usize>,
        /// The peer's reason.
        reason: String,
    },
}

impl Receiver {
    /// A receiver for the ring `own` describes (this rank's own endpoint for the peer).
    pub fn new(own: &Endpoint) -> Receiver {
        Receiver {
            slots: own.slots,
            slot_bytes: own.slot_bytes as usize,
            arrived: 0,
            consumed: 0,
            reported: 0,
            pending: Default::default(),
            aborted: false,
        }
    }

    /// A completion of the peer's write: its immediate value and byte count, and `ring`, this
    /// connection's ring memory (read for an abort notice).
    pub fn on_completion(
        &mut self,
        imm: u32,
        byte_len: u32,
        ring: &[u8],
    ) -> Result<Arrival, ProtocolError> {
        let bad = |w: String| Err(ProtocolError::Chunk(w));
        if self.aborted {
            return bad("a write after the peer's abort notice".into());
        }
        let want = self.arrived as u32 & SEQ_MASK;
        if imm & SEQ_MASK != want {
            return bad(format!(
                "sequence number {} where {want} was next",
                imm & SEQ_MASK
            ));
        }
        let is_abort = imm & ABORT_BIT != 0;
        // Messages may fill all slots but the last; the abort notice may take that one.
        let limit = u64::from(self.slots) - u64::from(!is_abort);
        if self.arrived - self.consumed >= limit {
            return bad(format!(
                "chunk {} written past the peer's credits ({} of {} slots unconsumed)",
                self.arrived,
                self.arrived - self.consumed,
                self.slots
            ));
        }
        let len = byte_len as usize;
        if len > self.slot_bytes {
            return bad(format!("{len} bytes in a {}-byte slot", self.slot_bytes));
        }
        let slot = (self.arrived % u64::from(self.slots)) as usize * self.slot_bytes;
        self.arrived += 1;
        if is_abort {
            if ring.len() < slot + len {
                return Err(ProtocolError::Usage("ring shorter than its slots"));
            }
            self.aborted = true;
            // A notice too short for its culprit still ends the connection as a notice.
            if len < 8 {
                return Ok(Arrival::Abort {
                    culprit: None,
                    reason: "(an abort notice cut short)".into(),
                });
            }
            let culprit = u64::from_le_bytes(ring[slot..slot + 8].try_into().unwrap());
            let reason = crate::frame::peer_text(&ring[slot + 8..slot + len]);
            return Ok(Arrival::Abort {
                culprit: usize::try_from(culprit)
                    .ok()
                    .filter(|_| culprit != NO_CULPRIT),
                reason,
            });
        }
        self.pending.push_back((len, imm & LAST_BIT != 0));
        Ok(Arrival::Chunk)
    }

    /// Whether a completed chunk waits to be delivered.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Delivers the oldest pending chunk into `recv`: checks a first chunk's header (read from
    /// `ring`, this connection's ring memory) against the receive, and the chunk's length
    /// against what the message still lacks. Returns the copy to make, or `None` when no chunk
    /// is pending or `recv` is complete. The chunk counts as consumed: copy before the next
    /// [`Receiver::credit_report`].
    pub fn deliver(
        &mut self,
        recv: &mut Incoming,
        ring: &[u8],
    ) -> Result<Option<Delivery>, ProtocolError> {
        if recv.done() {
            return Ok(None);
        }
        let Some(&(len, last)) = self.pending.front() else {
            return Ok(None);
        };
        let slot = (self.consumed % u64::from(self.slots)) as usize * self.slot_bytes;
        if ring.len() < slot + self.slot_bytes {
            return Err(ProtocolError::Usage("ring shorter than its slots"));
        }
        let mut from = slot..slot + len;
        let first = recv.len.is_none();
        if first {
            if len < HEADER_BYTES {
                return Err(ProtocolError::Chunk(format!(
                    "a first chunk of {len} bytes has no room for its header"
                )));
            }
            let tag = u64::from_le_bytes(ring[slot..slot + 8].try_into().unwrap());
            let got_len = u64::from_le_bytes(ring[slot + 8..slot + 16].try_into().unwrap());
            if tag != recv.tag || got_len > recv.capacity as u64 {
                return Err(ProtocolError::Mismatch {
                    expected_tag: recv.tag,
                    got_tag: tag,
                    expected_len: recv.capacity,
                    got_len: usize::try_from(got_len).unwrap_or(usize::MAX),
                });
            }
            recv.len = Some(got_len as usize);
            from.start += HEADER_BYTES;
        }
        let msg_len = recv.len.unwrap_or(0);
        let n = from.len();
        if n == 0 && !first {
            // Each would count as progress and hand the peer its credit back: a peer could
            // keep a receive from ever reaching its deadline.
            return Err(ProtocolError::Chunk(
                "an empty chunk in the middle of a message".into(),
            ));
        }
        if n > msg_len - recv.got {
            return Err(ProtocolError::Chunk(format!(
                "{n} bytes where the message lacks {}",
                msg_len - recv.got
            )));
        }
        let to = recv.got..recv.got + n;
        recv.got += n;
        if last != (recv.got == msg_len) {
            return Err(ProtocolError::Chunk(if last {
                format!("last chunk after {} of {msg_len} bytes", recv.got)
            } else {
                format!("the message's {msg_len} bytes arrived and no last chunk")
            }));
        }
        self.pending.pop_front();
        self.consumed += 1;
        Ok(Some(Delivery { from, to }))
    }

    /// The consumed count to write into the sender's credit word, once half a ring was
    /// consumed since the last report (or the whole ring would otherwise stay held); `None`
    /// while that has not happened.
    pub fn credit_report(&mut self) -> Option<u64> {
        let due = u64::from(self.slots / 2).max(1);
        if self.consumed - self.reported >= due {
            self.reported = self.consumed;
            Some(self.consumed)
        } else {
            None
        }
    }

    /// The consumed count, if any consumption is unreported: for the end of a receive, so
    /// that a sender whose next message this rank does not receive yet is not left short of
    /// the slots of the last one.
    pub fn credit_flush(&mut self) -> Option<u64> {
        (self.consumed > self.reported).then(|| {
            self.reported = self.consumed;
            self.consumed
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn endpoint(slots: u32, slot_bytes: u32) -> Endpoint {
        Endpoint {
            port: 1,
            mtu: 4096,
            lid: 0,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x1234,
            psn: 0x00ab_cdef,
            ring_addr: 0x7f00_0000_0000,
            ring_rkey: 0x55,
            slots,
            slot_bytes,
            credit_addr: 0x7f00_1000_0000,
            credit_rkey: 0x66,
        }
    }

    #[test]
    fn endpoint_round_trips_and_rejects_bad_fields() {
        let e = endpoint(16, 4096);
        assert_eq!(Endpoint::decode(&e.encode()).unwrap(), e);
        type Spoil = fn(&mut Endpoint);
        let bad: Vec<(&str, Spoil)> = vec![
            ("port", |e| e.port = 0),
            ("mtu", |e| e.mtu = 1500),
            ("address", |e| e.gid = [0; 16]),
            ("qpn", |e| e.qpn = 1),
            ("qpn", |e| e.qpn = 1 << 24),
            ("psn", |e| e.psn = 1 << 24),
            ("slots", |e| e.slots = 12),
            ("slots", |e| e.slots = MAX_SLOTS * 2),
            ("slots", |e| e.slots = 1),
            ("slot bytes", |e| e.slot_bytes = 100),
            ("slot bytes", |e| e.slot_bytes = MAX_SLOT_BYTES * 2),
            ("ring", |e| e.ring_addr = 0),
            ("ring", |e| e.ring_addr = u64::MAX - 10),
            ("credit", |e| e.credit_addr = 0x7f00_1000_0004),
            ("credit", |e| e.credit_addr = u64::MAX - 7),
            ("lid", |e| e.lid = 0xc000),
            ("lid", |e| e.lid = 0xffff),
        ];
        for (what, spoil) in bad {
            let mut b = e.clone();
            spoil(&mut b);
            assert!(
                matches!(
                    Endpoint::decode(&b.encode()),
                    Err(ProtocolError::Endpoint(_))
                ),
                "{what}: {b:?}"
            );
        }
        let mut raw = e.encode();
        raw[4] = VERSION + 1;
        let err = Endpoint::decode(&raw).unwrap_err().to_string();
        assert!(err.contains("different chorus releases"), "{err}");
        raw = e.encode();
        raw[0] = b'X';
        assert!(Endpoint::decode(&raw).is_err());
        assert!(Endpoint::decode(&e.encode()[..ENDPOINT_BYTES - 1]).is_err());
    }

    #[test]
    fn path_mtu_takes_the_smaller_and_refuses_mixed_link_layers() {
        let a = endpoint(4, 64);
        let mut b = endpoint(4, 64);
        b.mtu = 1024;
        assert_eq!(path_mtu(&a, &b).unwrap(), 1024);
        b.lid = 7;
        assert!(path_mtu(&a, &b).is_err());
    }

    /// Two ends of a connection with the peer's ring in memory; writes land as an RC queue
    /// pair lands them: in order, whole.
    struct Wire {
        ring: Vec<u8>,
        /// Completions the receiver has not polled yet.
        completions: std::collections::VecDeque<(u32, u32)>,
        /// The sender's credit word.
        credit: u64,
    }

    impl Wire {
        fn new(e: &Endpoint) -> Wire {
            Wire {
                ring: vec![0; (e.slots * e.slot_bytes) as usize],
                completions: Default::default(),
                credit: 0,
            }
        }
        fn write(&mut self, c: &Chunk, msg: &[u8]) {
            let mut at = c.remote_offset as usize;
            if let Some(h) = c.header {
                self.ring[at..at + h.len()].copy_from_slice(&h);
                at += h.len();
            }
            self.ring[at..at + c.payload.len()].copy_from_slice(&msg[c.payload.clone()]);
            self.completions.push_back((c.imm, c.len() as u32));
        }
    }

    /// Writes all of `msg` (tag `tag`) as far as the credits go, and hands the completions to
    /// a fresh receiver: the sender, the receiver and the wire, for the test to deliver.
    fn written(e: &Endpoint, tag: u64, msg: &[u8]) -> (Sender, Receiver, Wire) {
        let (mut s, mut r, mut wire) = (Sender::new(e), Receiver::new(e), Wire::new(e));
        s.start(tag, msg.len()).unwrap();
        while let Some(c) = s.next_chunk(msg.len()) {
            wire.write(&c, msg);
        }
        for (imm, n) in std::mem::take(&mut wire.completions) {
            r.on_completion(imm, n, &wire.ring).unwrap();
        }
        (s, r, wire)
    }

    /// Sends `msgs` through one connection, stepping the sender (with availability growing in
    /// `step`-byte increments) and the receiver in an order drawn from `seed`; checks every
    /// byte and that the sender never held more than `slots` chunks unconsumed.
    fn transfer(slots: u32, slot_bytes: u32, msgs: &[Vec<u8>], step: usize, seed: u64) {
        let e = endpoint(slots, slot_bytes);
        let mut s = Sender::new(&e);
        let mut r = Receiver::new(&e);
        let mut wire = Wire::new(&e);
        let mut rng = seed | 1;
        let mut coin = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % 3
        };
        let (mut si, mut ri) = (0, 0);
        let mut avail: usize = 0;
        let mut recv: Option<(Incoming, Vec<u8>)> = None;
        for _ in 0..1_000_000 {
            if ri == msgs.len() {
                assert_eq!(si, msgs.len());
                return;
            }
            match coin() {
                0 if si < msgs.len() => {
                    if s.idle() {
                        s.start(si as u64 * 7 + 1, msgs[si].len()).unwrap();
                        avail = 0;
                    }
                    avail = avail.saturating_add(step).min(msgs[si].len());
                    if let Some(c) = s.next_chunk(avail) {
                        assert!(c.len() <= slot_bytes as usize);
                        wire.write(&c, &msgs[si]);
                        if s.idle() {
                            si += 1;
                        }
                    }
                    s.on_credit(wire.credit).unwrap();
                }
                _ => {
                    while let Some((imm, len)) = wire.completions.pop_front() {
                        assert_eq!(r.on_completion(imm, len, &wire.ring), Ok(Arrival::Chunk));
                    }
                    let (inc, buf) = recv.get_or_insert_with(|| {
                        // Some receives have room to spare: the message's length is its own.
                        let capacity = msgs[ri].len() + ri % 3 * 5;
                        (
                            Incoming::new(ri as u64 * 7 + 1, capacity),
                            vec![0xee; capacity],
                        )
                    });
                    while let Some(d) = r.deliver(inc, &wire.ring).unwrap() {
                        buf[d.to].copy_from_slice(&wire.ring[d.from]);
                    }
                    if inc.done() {
                        assert_eq!(inc.len, Some(msgs[ri].len()));
                        assert_eq!(buf[..msgs[ri].len()], msgs[ri], "message {ri}");
                        ri += 1;
                        recv = None;
                    }
                    if let Some(c) = r.credit_report() {
                        wire.credit = c;
                    }
                }
            }
            assert!(
                s.sent - s.consumed < u64::from(slots),
                "the last slot is kept"
            );
        }
        panic!("transfer did not finish: sent {si}, received {ri}");
    }

    fn message(n: usize, salt: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ salt).collect()
    }

    #[test]
    fn messages_of_every_shape_arrive_whole() {
        let sb = 64usize;
        let sizes = [
            0,
            1,
            sb - HEADER_BYTES,
            sb - HEADER_BYTES + 1,
            sb,
            10 * sb + 3,
            5000,
        ];
        let msgs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| message(n, i as u8))
            .collect();
        for (slots, step, seed) in [(2, usize::MAX, 1), (2, 7, 2), (4, 1, 3), (16, 100, 4)] {
            transfer(slots, sb as u32, &msgs, step, seed);
        }
    }

    #[test]
    fn the_sender_stops_at_its_credits() {
        let e = endpoint(4, 64);
        let mut s = Sender::new(&e);
        s.start(1, 64 * 10).unwrap();
        let chunks: Vec<Chunk> = std::iter::from_fn(|| s.next_chunk(640)).collect();
        assert_eq!(
            chunks.len(),
            3,
            "4 slots, the last kept for an abort notice"
        );
        assert_eq!(s.credits(), 0);
        assert!(s.next_chunk(640).is_none());
        s.on_credit(2).unwrap();
        assert_eq!(s.credits(), 2);
        assert_eq!(s.next_chunk(640).unwrap().remote_offset, 3 * 64);
        assert_eq!(s.next_chunk(640).unwrap().remote_offset, 0, "slot 0 again");
        assert!(s.on_credit(1).is_err(), "credits do not go back");
        assert!(s.on_credit(6).is_err(), "credits do not pass what was sent");
        assert!(matches!(s.start(2, 1), Err(ProtocolError::Usage(_))));
    }

    #[test]
    fn the_receiver_catches_a_peer_breaking_the_rules() {
        let e = endpoint(2, 64);
        let ring = vec![0u8; 128];
        // Out of order.
        let mut r = Receiver::new(&e);
        assert!(r.on_completion(immediate(1, true), 16, &ring).is_err());
        // Past the credits: with 2 slots, one message chunk may be unconsumed.
        let mut r = Receiver::new(&e);
        r.on_completion(immediate(0, false), 64, &ring).unwrap();
        let err = r.on_completion(immediate(1, false), 64, &ring).unwrap_err();
        assert!(err.to_string().contains("credits"), "{err}");
        // Longer than a slot.
        let mut r = Receiver::new(&e);
        assert!(r.on_completion(immediate(0, true), 65, &ring).is_err());

        // A first chunk too short for its header.
        let mut r = Receiver::new(&e);
        r.on_completion(immediate(0, true), 8, &ring).unwrap();
        assert!(r.deliver(&mut Incoming::new(1, 0), &ring).is_err());

        // A tag mismatch, a message longer than the receive, and chunk lengths against the
        // header's.
        let mut s = Sender::new(&e);
        let mut wire = Wire::new(&e);
        s.start(9, 10).unwrap();
        let c = s.next_chunk(10).unwrap();
        wire.write(&c, &[1; 10]);
        let (imm, n) = wire.completions[0];
        for (tag, capacity) in [(8, 10), (9, 9)] {
            let mut r = Receiver::new(&e);
            r.on_completion(imm, n, &wire.ring).unwrap();
            let err = r
                .deliver(&mut Incoming::new(tag, capacity), &wire.ring)
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    ProtocolError::Mismatch {
                        got_tag: 9,
                        got_len: 10,
                        ..
                    }
                ),
                "{err}"
            );
        }
        let mut r = Receiver::new(&e);
        // The same header but flagged as not the last chunk, with all 10 bytes in it.
        r.on_completion(imm & !LAST_BIT, n, &wire.ring).unwrap();
        assert!(r.deliver(&mut Incoming::new(9, 10), &wire.ring).is_err());
        // The last flag on a chunk that leaves the message short.
        let mut r = Receiver::new(&e);
        r.on_completion(imm, n - 4, &wire.ring).unwrap();
        assert!(r.deliver(&mut Incoming::new(9, 10), &wire.ring).is_err());
    }

    #[test]
    fn an_abort_notice_always_has_room_and_ends_the_connection() {
        let e = endpoint(4, 64);
        let mut s = Sender::new(&e);
        let mut r = Receiver::new(&e);
        let mut wire = Wire::new(&e);
        let msg = message(1000, 1);
        s.start(3, msg.len()).unwrap();
        while let Some(c) = s.next_chunk(msg.len()) {
            wire.write(&c, &msg);
        }
        assert_eq!(s.credits(), 0, "mid-message, out of credits");
        let reason = "ranks 2 and 3 disagree: é".repeat(5);
        let a = s.abort(Some(2), &reason).unwrap();
        assert!(a.bytes.len() <= 64);
        assert!(s.abort(None, "again").is_none(), "one notice");
        assert!(s.next_chunk(msg.len()).is_none());
        assert!(s.start(4, 1).is_err());
        wire.ring[a.remote_offset as usize..][..a.bytes.len()].copy_from_slice(&a.bytes);
        wire.completions.push_back((a.imm, a.bytes.len() as u32));
        let mut got = vec![];
        while let Some((imm, n)) = wire.completions.pop_front() {
            got.push(r.on_completion(imm, n, &wire.ring).unwrap());
        }
        assert_eq!(got[..3], [Arrival::Chunk, Arrival::Chunk, Arrival::Chunk]);
        match &got[3] {
            Arrival::Abort {
                culprit,
                reason: why,
            } => {
                assert_eq!(*culprit, Some(2));
                assert!(reason.starts_with(why.as_str()) && why.len() <= 56, "{why}");
            }
            other => panic!("{other:?}"),
        }
        assert!(r.on_completion(immediate(4, true), 16, &wire.ring).is_err());
        // A notice that blames no one.
        let mut s = Sender::new(&e);
        let mut r = Receiver::new(&e);
        let a = s.abort(None, "gave up").unwrap();
        wire.ring[..a.bytes.len()].copy_from_slice(&a.bytes);
        assert_eq!(
            r.on_completion(a.imm, a.bytes.len() as u32, &wire.ring),
            Ok(Arrival::Abort {
                culprit: None,
                reason: "gave up".into()
            })
        );
    }

    #[test]
    fn a_chunk_not_posted_leaves_its_number_to_the_abort_notice() {
        let e = endpoint(4, 64);
        let mut s = Sender::new(&e);
        let mut r = Receiver::new(&e);
        let mut wire = Wire::new(&e);
        let msg = message(100, 1);
        s.start(3, msg.len()).unwrap();
        let first = s.next_chunk(msg.len()).unwrap();
        wire.write(&first, &msg);
        // The second chunk is refused by the NIC: it never reaches the peer.
        let _refused = s.next_chunk(msg.len()).unwrap();
        s.unpost();
        let a = s.abort(Some(0), "send queue full").unwrap();
        wire.ring[a.remote_offset as usize..][..a.bytes.len()].copy_from_slice(&a.bytes);
        wire.completions.push_back((a.imm, a.bytes.len() as u32));
        let mut got = vec![];
        while let Some((imm, n)) = wire.completions.pop_front() {
            got.push(r.on_completion(imm, n, &wire.ring));
        }
        assert_eq!(got[0], Ok(Arrival::Chunk));
        assert_eq!(
            got[1],
            Ok(Arrival::Abort {
                culprit: Some(0),
                reason: "send queue full".into()
            }),
            "the peer takes the notice, not a sequence error"
        );
    }

    #[test]
    fn credits_are_reported_every_half_ring() {
        let e = endpoint(8, 64);
        let msg = message(48 + 64 * 6, 3);
        let (mut s, mut r, wire) = written(&e, 5, &msg);
        assert!(s.idle());
        assert_eq!(s.credits(), 0);
        let mut inc = Incoming::new(5, msg.len());
        let mut reports = vec![];
        while let Some(_d) = r.deliver(&mut inc, &wire.ring).unwrap() {
            reports.extend(r.credit_report());
        }
        assert!(inc.done());
        assert_eq!(
            reports,
            vec![4],
            "4 of 8 slots; the other 3 wait for the next report"
        );
        s.on_credit(4).unwrap();
        assert_eq!(s.credits(), 4);
    }

    #[test]
    fn chunks_carry_bytes() {
        let e = endpoint(4, 64);
        // The header waits for the first byte; an empty message is its header.
        let mut s = Sender::new(&e);
        s.start(1, 10).unwrap();
        assert!(s.next_chunk(0).is_none());
        let c = s.next_chunk(3).unwrap();
        assert_eq!((c.header.is_some(), c.payload), (true, 0..3));
        assert!(s.next_chunk(3).is_none(), "nothing new");
        let mut s = Sender::new(&e);
        s.start(1, 0).unwrap();
        assert_eq!(s.next_chunk(0).unwrap().len(), HEADER_BYTES);
        assert!(s.idle());

        // An empty chunk in the middle of a message is refused: each would count as
        // progress and earn the peer a credit, and a receive would never reach its deadline.
        let mut wire = Wire::new(&e);
        let mut s = Sender::new(&e);
        s.start(1, 10).unwrap();
        let c = s.next_chunk(3).unwrap();
        wire.write(&c, &[5; 10]);
        let mut r = Receiver::new(&e);
        let (imm, n) = wire.completions[0];
        r.on_completion(imm, n, &wire.ring).unwrap();
        r.on_completion(immediate(1, false), 0, &wire.ring).unwrap();
        let mut inc = Incoming::new(1, 10);
        assert!(r.deliver(&mut inc, &wire.ring).unwrap().is_some());
        let err = r.deliver(&mut inc, &wire.ring).unwrap_err();
        assert!(err.to_string().contains("empty chunk"), "{err}");
    }

    #[test]
    fn the_end_of_a_receive_returns_its_credits() {
        let e = endpoint(8, 64);
        let msg = message(48 + 64 * 2, 9);
        let (s, mut r, wire) = written(&e, 2, &msg);
        assert!(s.idle());
        let mut inc = Incoming::new(2, msg.len());
        while r.deliver(&mut inc, &wire.ring).unwrap().is_some() {}
        assert!(inc.done());
        assert_eq!(r.credit_report(), None, "3 of 8: not yet half a ring");
        assert_eq!(r.credit_flush(), Some(3));
        assert_eq!(r.credit_flush(), None);
    }

    #[test]
    fn a_short_abort_notice_is_still_a_notice() {
        let e = endpoint(4, 64);
        let mut r = Receiver::new(&e);
        let ring = vec![0u8; 256];
        let got = r.on_completion(ABORT_BIT, 3, &ring).unwrap();
        assert!(
            matches!(got, Arrival::Abort { culprit: None, .. }),
            "{got:?}"
        );
    }

    proptest! {
        #[test]
        fn garbage_records_never_panic(b in proptest::collection::vec(any::<u8>(), 0..100)) {
            let _ = Endpoint::decode(&b);
        }

        #[test]
        fn garbage_completions_never_panic(
            events in proptest::collection::vec((any::<u32>(), 0u32..200), 0..20),
            ring in proptest::collection::vec(any::<u8>(), 256),
        ) {
            let e = endpoint(4, 64);
            let mut r = Receiver::new(&e);
            let mut inc = Incoming::new(1, 100);
            for (imm, n) in events {
                if r.on_completion(imm, n, &ring).is_err() {
                    break;
                }
                match r.deliver(&mut inc, &ring) {
                    Ok(Some(d)) => prop_assert!(d.to.end <= 100 && d.from.end <= 256),
                    Ok(None) => {}
                    Err(_) => break,
                }
            }
        }

        #[test]
        fn random_traffic_arrives_whole(
            sizes in proptest::collection::vec(0usize..600, 1..8),
            slots_log in 1u32..4,
            step in 1usize..300,
            seed in any::<u64>(),
        ) {
            let msgs: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| message(n, i as u8))
                .collect();
            transfer(1 << slots_log, 64, &msgs, step, seed);
        }
    }
}
