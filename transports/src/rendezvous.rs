//! Rendezvous: a small authenticated key-value store hosted by the root, used by the ranks to
//! publish and look up their listening addresses, and the authentication handshake that every
//! connection (store and data plane) starts with.
//!
//! # Handshake (version 1)
//!
//! Run once on every new TCP connection, before anything else. `A` is the side that accepted
//! the connection, `C` the side that connected. All messages have a fixed size, so nothing a
//! peer sends can make this rank allocate or wait for more than a few dozen bytes.
//!
//! ```text
//! A -> C  HELLO    "CHRH" | version u8 = 1 | nonce_a [16]              21 bytes
//! C -> A  PROOF    "CHRH" | version u8 = 1 | nonce_c [16] | mac_c [32] 53 bytes
//! A -> C  VERDICT  status u8 | mac_a [32]                              33 bytes
//!
//! mac_X  = HMAC-SHA256(key = token,
//!                      "chorus-auth-v1" | role | u32le(len(context)) | context | nonce_a | nonce_c)
//! role   = b'C' for mac_c, b'A' for mac_a
//! status = 0 accepted (mac_a proves A knows the token too),
//!          1 rejected (mac_a is all zero; A closes the connection)
//! ```
//!
//! Both nonces are 16 fresh random bytes (`getrandom`), so a recorded proof cannot be replayed;
//! the role byte keeps a proof from being reflected back to its sender; the context (e.g.
//! `b"store"` or `b"data/<comm_id>/<from>/<to>"`) binds a proof to one kind of connection and one
//! pair of ranks. MACs are compared in constant time. With no token configured the handshake
//! runs with an empty key: it then checks the protocol and the context, not identity. Any
//! deviation (bad magic, other version, wrong MAC, a short read, the deadline) fails the
//! handshake; the caller drops the stream.
//!
//! # Store protocol (version 1, on a connection that passed the handshake with context `b"store"`)
//!
//! ```text
//! request   op u8 | key_len u16le | body_len u32le | key [key_len] | body [body_len]
//!   op 1 SET  body = the value                (0 ..= 64 KiB)
//!   op 2 GET  body = u64le wait in ms          (8 bytes; the server caps it at 60 s)
//!   op 3 ADD  body = i64le delta               (8 bytes)
//!   op 4 RUN  key = a prefix; body = u64le wait in ms | u64le first | u64le count (24 bytes)
//! response  status u8 | body_len u32le | body
//!   status 0 OK         SET: empty; GET: the value; ADD: i64le new value;
//!                       RUN: (u32le len | value) of keys prefix+first, prefix+(first+1)...
//!                       (the index in decimal), as many as exist in a row, at least 1, at
//!                       most count, at most 1 MiB in all
//!   status 1 NOT_YET    GET, RUN: the (first) key did not appear within the wait; empty
//!   status 2 ERROR      a UTF-8 message (<= 1 KiB): store full, key is not a counter, overflow
//! ```
//!
//! Keys are 1 ..= 256 bytes. A counter is a key whose value is 8 bytes (i64le); ADD creates it
//! at 0. A GET blocks on the server (a condition variable, no polling) until the key exists or
//! the wait the client sent expires; the client repeats GETs until its own deadline. A RUN
//! waits the same way for its first key, then answers with the longest row of keys that
//! exist: what every rank publishes (`addr/0`, `addr/1`...) is read in one request, not one
//! request per rank, once every rank has published it.
//!
//! The server checks every header field before it reads a body: a key or body length out of
//! range, a peer that closes mid-message or takes more than 10 s to finish a
//! message it started, or one that fails the handshake within 10 s, is dropped with one log
//! line on stderr (`chorus: store: ...`, rate-limited). The store holds at most 64 MiB in at
//! most 65 536 keys and serves at most 1024 connections at once (more of both for a job of more
//! ranks: [`StoreServer::bind_for_ranks`]); requests beyond those limits
//! get an ERROR response, and the other clients are never disturbed. So does an op this
//! server does not know (of a later release: it reads the body, up to 64 KiB, and answers). A connection beyond the
//! limit shuts down the oldest one still in its handshake, or is closed at once when every
//! connection is authenticated, so silent connections cannot keep clients out before they
//! authenticate. An authenticated client keeps its connection while it lives; one whose host
//! vanished (no FIN or RST) is ended by TCP keepalive probes (after about a minute).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::{Result, TransportError};

/// Role-specific context mixed into the handshake MAC (e.g. `b"store"`, or
/// `b"data/<comm_id>/<from>/<to>"`), so a proof for one connection is useless for another.
/// Both sides must pass the same bytes (at most [`MAX_CONTEXT_LEN`]).
pub type Context<'a> = &'a [u8];

/// The handshake context of store connections.
pub const STORE_CONTEXT: &[u8] = b"store";
/// Longest key the store accepts, in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Largest value the store accepts, in bytes.
pub const MAX_VALUE_LEN: usize = 64 * 1024;
/// Longest context [`accept_handshake`] and [`connect_handshake`] accept, in bytes.
pub const MAX_CONTEXT_LEN: usize = 1024;

const MAGIC: [u8; 4] = *b"CHRH";
const VERSION: u8 = 1;
const NONCE_LEN: usize = 16;
const MAC_LEN: usize = 32;
const MAC_LABEL: &[u8] = b"chorus-auth-v1";
const HELLO_LEN: usize = 4 + 1 + NONCE_LEN;
const PROOF_LEN: usize = 4 + 1 + NONCE_LEN + MAC_LEN;
const VERDICT_LEN: usize = 1 + MAC_LEN;
const VERDICT_OK: u8 = 0;
const VERDICT_REJECTED: u8 = 1;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_RUN: u8 = 4;
const STATUS_OK: u8 = 0;
const STATUS_NOT_YET: u8 = 1;
const STATUS_ERROR: u8 = 2;
const REQ_HEADER_LEN: usize = 1 + 2 + 4;
const RESP_HEADER_LEN: usize = 1 + 4;
const MAX_ERROR_LEN: usize = 1024;
/// Most value bytes (with their length words) one RUN response carries: the addresses of a
/// few thousand ranks (the answer is copied once more to be sent, per connection).
const MAX_RUN_BYTES: usize = 256 << 10;
/// Most keys one RUN response carries (it looks them up under the store's lock).
const MAX_RUN_KEYS: u64 = 4096;
/// Body of a RUN request: wait, first index, count.
const RUN_BODY_LEN: usize = 24;

/// How long a client may take to pass the handshake on a store connection.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the server waits for the rest of a request once its first byte arrived, and for a
/// client to take a response.
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a GET blocks on the server; clients repeat longer waits.
const MAX_GET_WAIT: Duration = Duration::from_secs(60);
/// Default limit a client waits for a SET or ADD response (and the slack added to a GET's wait).
const DEFAULT_CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(60);
/// How long after [`StoreClient::set_deadline`]'s instant an answer may still arrive (a
/// `get` asks the server to wait until that instant, and its answer takes a moment).
pub const DEADLINE_GRACE: Duration = Duration::from_secs(2);
/// How long before a client's bound the server's wait for a key ends, for its answer to
/// arrive in time.
const ANSWER_MARGIN: Duration = Duration::from_millis(500);
/// Longest single TCP connect attempt of a client.
const CONNECT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// First and largest pause between a client's connection attempts.
const CONNECT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const CONNECT_BACKOFF_MAX: Duration = Duration::from_millis(500);
/// How long after the first connection shut down during its handshake (by a listener at
/// its connection limit) new connections are still tried: long enough for a flood of idle
/// connections to pass or a slot to free up, short enough that a listener that closes every
/// connection (another job's, not a chorus process) fails the rank well before its deadline.
const CLOSED_RETRY_WINDOW: Duration = Duration::from_secs(10);

/// Whether a connection shut down during its handshake is worth trying again: before
/// `deadline`, and within [`CLOSED_RETRY_WINDOW`] of the `first` such shutdown.
pub(crate) fn retry_after_shutdown(first: Instant, deadline: Instant) -> bool {
    Instant::now() < deadline && first.elapsed() < CLOSED_RETRY_WINDOW
}
/// Stack of the per-connection threads (they hold a few small buffers and a 64 KiB value).
const CONN_STACK_SIZE: usize = 256 * 1024;

type HmacSha256 = Hmac<Sha256>;

// ---------------------------------------------------------------------------------------------
// Deadline-bounded I/O on a blocking stream.

/// Why a bounded read or write stopped.
#[derive(Debug)]
enum Wire {
    /// The peer closed (or reset) the connection.
    Closed,
    /// The deadline passed.
    Timeout,
    /// Another OS error.
    Io(io::Error),
}

impl From<io::Error> for Wire {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected
            | io::ErrorKind::WriteZero => Wire::Closed,
            _ => Wire::Io(e),
        }
    }
}

impl fmt::Display for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wire::Closed => write!(f, "connection closed"),
            Wire::Timeout => write!(f, "deadline passed"),
            Wire::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Time left until `deadline`, or `None` when it passed. Never returns a zero duration (the
/// socket timeout setters reject zero).
fn remaining(deadline: Instant) -> Option<Duration> {
    let left = deadline.checked_duration_since(Instant::now())?;
    if left.is_zero() {
        None
    } else {
        Some(left.max(Duration::from_millis(1)))
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Fill `buf` from `stream` before `deadline`.
fn read_exact_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), Wire> {
    let mut got = 0;
    while got < buf.len() {
        let left = remaining(deadline).ok_or(Wire::Timeout)?;
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(Wire::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// [`read_exact_by`] for the other modules: the whole of `buf` before `deadline`, however
/// the bytes are spread in time (a per-read timeout would let a peer that sends a byte now and
/// then hold the reader far longer); a closed connection or the deadline is an error naming
/// `what`.
pub(crate) fn read_exact_before(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    what: &str,
) -> Result<()> {
    let started = Instant::now();
    // Timeouts and I/O errors as in the handshake this read belongs to.
    read_exact_by(stream, buf, deadline).map_err(|w| match w {
        Wire::Closed => {
            TransportError::Rendezvous(format!("the peer closed the connection during the {what}"))
        }
        w => handshake_error(w, started, true),
    })
}

/// Write all of `buf` to `stream` before `deadline`.
fn write_all_by(stream: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<(), Wire> {
    let mut sent = 0;
    while sent < buf.len() {
        let left = remaining(deadline).ok_or(Wire::Timeout)?;
        stream.set_write_timeout(Some(left))?;
        match stream.write(&buf[sent..]) {
            Ok(0) => return Err(Wire::Closed),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || is_timeout(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked while holding it; the data (a map,
    // a list of handles) stays consistent because every critical section is a few assignments.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------------------------
// Handshake.

fn random_nonce() -> Result<[u8; NONCE_LEN]> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce).map_err(|e| {
        TransportError::Rendezvous(format!(
            "could not get random bytes for the handshake nonce from the OS: {e}"
        ))
    })?;
    Ok(nonce)
}

/// The MAC one side sends; `role` is b'C' (connecting side) or b'A' (accepting side).
fn handshake_mac(
    token: &[u8],
    role: u8,
    context: &[u8],
    nonce_a: &[u8; NONCE_LEN],
    nonce_c: &[u8; NONCE_LEN],
) -> HmacSha256 {
    // HMAC takes keys of any length (longer ones are hashed first), so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(token)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    mac.update(MAC_LABEL);
    mac.update(&[role]);
    // The context is at most MAX_CONTEXT_LEN bytes (checked by the callers).
    mac.update(&(context.len() as u32).to_le_bytes());
    mac.update(context);
    mac.update(nonce_a);
    mac.update(nonce_c);
    mac
}

/// Turn a wire error during the handshake into a transport error.
fn handshake_error(w: Wire, started: Instant, accepting: bool) -> TransportError {
    match w {
        Wire::Closed if accepting => TransportError::Rendezvous(
            "the peer closed the connection during the authentication handshake (a rank that \
             gave up, or not a chorus process?)"
                .into(),
        ),
        Wire::Closed => TransportError::Rendezvous(
            "the peer closed the connection during the authentication handshake; is it a \
             chorus process of this job and version, and below its connection limit?"
                .into(),
        ),
        Wire::Timeout => TransportError::Timeout {
            peer: None,
            waited: started.elapsed(),
        },
        Wire::Io(e) => TransportError::io(None, "authentication handshake", e),
    }
}

fn check_context(context: &[u8]) -> Result<()> {
    if context.len() > MAX_CONTEXT_LEN {
        return Err(TransportError::InvalidArgument(format!(
            "handshake context of {} bytes is longer than the limit of {MAX_CONTEXT_LEN}",
            context.len()
        )));
    }
    Ok(())
}

fn check_magic_version(msg: &[u8], what: &str) -> Result<()> {
    if msg[..4] != MAGIC {
        return Err(TransportError::Rendezvous(format!(
            "the peer is not speaking the chorus handshake (bad magic in its {what}); \
             is the address right, and is it a chorus process?"
        )));
    }
    if msg[4] != VERSION {
        return Err(TransportError::Rendezvous(format!(
            "the peer uses handshake version {} where this build uses {VERSION}; \
             run the same chorus version on every rank",
            msg[4]
        )));
    }
    Ok(())
}

/// Put `stream` in blocking mode, run `f`, then restore the stream's read and write timeouts.
fn with_saved_timeouts<T>(
    stream: &mut TcpStream,
    f: impl FnOnce(&mut TcpStream) -> Result<T>,
) -> Result<T> {
    let io_err = |e| TransportError::io(None, "authentication handshake", e);
    stream.set_nonblocking(false).map_err(io_err)?;
    let read_timeout = stream.read_timeout().map_err(io_err)?;
    let write_timeout = stream.write_timeout().map_err(io_err)?;
    let out = f(stream);
    let restored = stream
        .set_read_timeout(read_timeout)
        .and_then(|()| stream.set_write_timeout(write_timeout));
    let out = out?;
    restored.map_err(io_err)?;
    Ok(out)
}

/// Accepting side of the handshake, run on a freshly accepted stream (blocking, bounded by
/// `deadline`). Returns an error on any deviation; the caller drops the stream.
///
/// The stream is switched to blocking mode (and left in it); its read and write timeouts are
/// restored before returning. See the [module documentation](self) for the messages.
///
/// Errors: [`TransportError::Rendezvous`] when the peer is not a chorus process of this
/// version or does not prove knowledge of `token` for `context` (the peer is then told it was
/// rejected); [`TransportError::Timeout`] at the deadline; [`TransportError::Io`] otherwise.
pub fn accept_handshake(
    stream: &mut TcpStream,
    token: &[u8],
    context: Context<'_>,
    deadline: Instant,
) -> Result<()> {
    accept_handshake_admitting(stream, token, context, deadline, || true)
}

/// [`accept_handshake`], asking `admit` once the peer has proven itself, before telling it
/// so: false (the connection was shut down meanwhile to make way for newer ones, see
/// [`StoreServer`]) fails the handshake instead. Whoever shuts connections down does so only
/// to those `admit` has not answered true for (both under one lock), so a peer told it is in
/// never finds its connection closed for that.
pub(crate) fn accept_handshake_admitting(
    stream: &mut TcpStream,
    token: &[u8],
    context: Context<'_>,
    deadline: Instant,
    admit: impl FnOnce() -> bool,
) -> Result<()> {
    check_context(context)?;
    let started = Instant::now();
    with_saved_timeouts(stream, |stream| {
        let wire = |w| handshake_error(w, started, true);
        let nonce_a = random_nonce()?;
        let mut hello = [0u8; HELLO_LEN];
        hello[..4].copy_from_slice(&MAGIC);
        hello[4] = VERSION;
        hello[5..].copy_from_slice(&nonce_a);
        write_all_by(stream, &hello, deadline).map_err(wire)?;

        let mut proof = [0u8; PROOF_LEN];
        read_exact_by(stream, &mut proof, deadline).map_err(wire)?;
        check_magic_version(&proof, "proof")?;
        let mut nonce_c = [0u8; NONCE_LEN];
        nonce_c.copy_from_slice(&proof[5..5 + NONCE_LEN]);
        let mac_c = &proof[5 + NONCE_LEN..];

        let mut verdict = [0u8; VERDICT_LEN];
        let expected = handshake_mac(token, b'C', context, &nonce_a, &nonce_c);
        if expected.verify_slice(mac_c).is_err() {
            verdict[0] = VERDICT_REJECTED;
            // Best effort: tell the peer why it is being dropped, but never wait long for it.
            let soon = deadline.min(Instant::now() + Duration::from_secs(1));
            let _ = write_all_by(stream, &verdict, soon);
            return Err(TransportError::Rendezvous(
                "authentication failed: the peer's proof does not match; CHORUS_TOKEN (or the \
                 unique id, or with neither the launcher's job id) differs between ranks, or \
                 the peer belongs to another job or communicator"
                    .into(),
            ));
        }
        if !admit() {
            return Err(TransportError::Rendezvous(
                "the connection was shut down during its handshake to make way for newer ones \
                 (too many connections at once)"
                    .into(),
            ));
        }
        verdict[0] = VERDICT_OK;
        let mac_a = handshake_mac(token, b'A', context, &nonce_a, &nonce_c).finalize();
        verdict[1..].copy_from_slice(&mac_a.into_bytes());
        write_all_by(stream, &verdict, deadline).map_err(wire)?;
        Ok(())
    })
}

/// Connecting side of the handshake, run on a freshly connected stream (blocking, bounded by
/// `deadline`). Returns an error on any deviation; the caller drops the stream.
///
/// The stream is switched to blocking mode (and left in it); its read and write timeouts are
/// restored before returning. Errors as for [`accept_handshake`]; in particular a peer that
/// rejects this side's proof, or cannot prove knowledge of `token` itself, gives
/// [`TransportError::Rendezvous`] with a message starting "authentication failed".
pub fn connect_handshake(
    stream: &mut TcpStream,
    token: &[u8],
    context: Context<'_>,
    deadline: Instant,
) -> Result<()> {
    connect_handshake_or_retry(stream, token, context, deadline).map_err(|(e, _)| e)
}

/// [`connect_handshake`], its error paired with whether a new connection may succeed where
/// this one failed: true when the peer closed or reset the connection before its verdict (a
/// listener at its connection limit shuts down connections still in their handshake, as the
/// store and the mesh do under a flood of idle connections), false for a rejected proof, a
/// peer of another protocol or version, and a timeout.
pub(crate) fn connect_handshake_or_retry(
    stream: &mut TcpStream,
    token: &[u8],
    context: Context<'_>,
    deadline: Instant,
) -> std::result::Result<(), (TransportError, bool)> {
    check_context(context).map_err(|e| (e, false))?;
    let started = Instant::now();
    let closed = std::cell::Cell::new(false);
    let out = with_saved_timeouts(stream, |stream| {
        let wire = |w: Wire| {
            closed.set(matches!(w, Wire::Closed));
            handshake_error(w, started, false)
        };
        let mut hello = [0u8; HELLO_LEN];
        read_exact_by(stream, &mut hello, deadline).map_err(wire)?;
        check_magic_version(&hello, "greeting")?;
        let mut nonce_a = [0u8; NONCE_LEN];
        nonce_a.copy_from_slice(&hello[5..]);

        let nonce_c = random_nonce()?;
        let mac_c = handshake_mac(token, b'C', context, &nonce_a, &nonce_c).finalize();
        let mut proof = [0u8; PROOF_LEN];
        proof[..4].copy_from_slice(&MAGIC);
        proof[4] = VERSION;
        proof[5..5 + NONCE_LEN].copy_from_slice(&nonce_c);
        proof[5 + NONCE_LEN..].copy_from_slice(&mac_c.into_bytes());
        write_all_by(stream, &proof, deadline).map_err(wire)?;

        let mut verdict = [0u8; VERDICT_LEN];
        read_exact_by(stream, &mut verdict, deadline).map_err(wire)?;
        match verdict[0] {
            VERDICT_OK => {}
            VERDICT_REJECTED => {
                return Err(TransportError::Rendezvous(
                    "authentication failed: the peer rejected this rank's proof; CHORUS_TOKEN \
                     (or the unique id) differs between ranks, or the address belongs to \
                     another job or communicator"
                        .into(),
                ))
            }
            other => {
                return Err(TransportError::Rendezvous(format!(
                    "the peer sent an invalid handshake verdict ({other}); is it a chorus \
                     process of the same version?"
                )))
            }
        }
        let expected = handshake_mac(token, b'A', context, &nonce_a, &nonce_c);
        if expected.verify_slice(&verdict[1..]).is_err() {
            return Err(TransportError::Rendezvous(
                "authentication failed: the peer accepted this rank but could not prove it knows \
                 the token; CHORUS_TOKEN (or the unique id, or with neither the launcher's job \
                 id) differs between ranks, or something else listens on this address"
                    .into(),
            ));
        }
        Ok(())
    });
    out.map_err(|e| (e, closed.get()))
}

// ---------------------------------------------------------------------------------------------
// Store: shared state and limits.

/// Limits of one server (constants in production, smaller in tests).
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_store_bytes: usize,
    max_keys: usize,
    max_connections: usize,
    handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_store_bytes: 64 << 20,
            max_keys: 65_536,
            max_connections: 1024,
            handshake_timeout: HANDSHAKE_TIMEOUT,
        }
    }
}

impl Limits {
    /// The default limits, raised to fit `ranks` ranks: a connection each, 32 keys and
    /// 4 KiB each (a rank of a job across hosts publishes about 1 KiB: its address, host,
    /// network, settings, segments or endpoints).
    fn for_ranks(ranks: usize) -> Limits {
        let d = Limits::default();
        Limits {
            max_connections: d.max_connections.max(ranks.saturating_add(64)),
            max_keys: d.max_keys.max(ranks.saturating_mul(32)),
            max_store_bytes: d.max_store_bytes.max(ranks.saturating_mul(4096)),
            ..d
        }
    }
}

/// The key-value map and its byte count (keys plus values).
#[derive(Default)]
struct Store {
    map: HashMap<Vec<u8>, Vec<u8>>,
    bytes: usize,
}

/// Open connections, so that dropping the server can close them and join their threads.
#[derive(Default)]
struct Conns {
    closed: bool,
    next_id: u64,
    streams: HashMap<u64, TcpStream>,
    /// Connections not yet through the handshake, oldest first: at the connection limit the
    /// oldest of them is shut down for a newcomer, so that connections that stay silent
    /// cannot keep clients out (an authenticated client is never dropped for one).
    unproven: VecDeque<u64>,
    threads: Vec<JoinHandle<()>>,
}

/// Keeps a server's stderr output (the store's, a rank's data listener's) to a few lines per
/// window however many clients misbehave.
pub(crate) struct LogLimiter {
    prefix: String,
    state: Mutex<(Instant, u32, u64)>,
}

impl LogLimiter {
    const WINDOW: Duration = Duration::from_secs(10);
    const LINES_PER_WINDOW: u32 = 20;

    /// Lines begin `prefix: `.
    pub(crate) fn new(prefix: impl Into<String>) -> Self {
        LogLimiter {
            prefix: prefix.into(),
            state: Mutex::new((Instant::now(), 0, 0)),
        }
    }

    pub(crate) fn log(&self, msg: fmt::Arguments<'_>) {
        // Decided under the lock, written after it (a full stderr blocks the write, and
        // must not block other threads' decisions with it).
        let (said_suppressed, say) = {
            let mut st = lock(&self.state);
            let (start, lines, suppressed) = &mut *st;
            let mut said = 0;
            if start.elapsed() >= Self::WINDOW {
                said = *suppressed;
                *start = Instant::now();
                *lines = 0;
                *suppressed = 0;
            }
            let say = *lines < Self::LINES_PER_WINDOW;
            if say {
                *lines += 1;
            } else {
                *suppressed += 1;
            }
            (said, say)
        };
        let prefix = &self.prefix;
        if said_suppressed > 0 {
            crate::note!("{prefix}: {said_suppressed} similar messages suppressed");
        }
        if say {
            crate::note!("{prefix}: {msg}");
        }
    }
}

impl Drop for LogLimiter {
    /// The count of a flood's last window, which no later message reported.
    fn drop(&mut self) {
        let suppressed = lock(&self.state).2;
        if suppressed > 0 {
            crate::note!("{}: {suppressed} similar messages suppressed", self.prefix);
        }
    }
}

struct Shared {
    token: Vec<u8>,
    /// Raised (never lowered) once a job's size is known ([`StoreServer::fit_ranks`]).
    limits: Mutex<Limits>,
    store: Mutex<Store>,
    changed: Condvar,
    shutdown: AtomicBool,
    /// Whether connections that proved the token are left out of the connection limit
    /// ([`StoreServer::exempt_proven`]).
    proven_exempt: AtomicBool,
    conns: Mutex<Conns>,
    log: LogLimiter,
}

// ---------------------------------------------------------------------------------------------
// Store: requests.

/// A validated request.
#[derive(Debug, PartialEq, Eq)]
enum Request {
    Set {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Get {
        key: Vec<u8>,
        wait: Duration,
    },
    Add {
        key: Vec<u8>,
        delta: i64,
    },
    Run {
        prefix: Vec<u8>,
        wait: Duration,
        first: u64,
        count: u64,
    },
    Unknown {
        op: u8,
    },
}

/// Check a request header; returns (op, key length, body length). Pure, so every bound can be
/// tested without a socket; nothing is allocated before it passed.
fn parse_request_header(h: &[u8; REQ_HEADER_LEN]) -> Result<(u8, usize, usize), String> {
    let op = h[0];
    let key_len = u16::from_le_bytes([h[1], h[2]]) as usize;
    let body_len = u32::from_le_bytes([h[3], h[4], h[5], h[6]]) as usize;
    if key_len == 0 || key_len > MAX_KEY_LEN {
        return Err(format!(
            "key length {key_len} outside 1..={MAX_KEY_LEN} (op {op})"
        ));
    }
    let body_ok = match op {
        OP_SET => body_len <= MAX_VALUE_LEN,
        OP_GET | OP_ADD => body_len == 8,
        OP_RUN => body_len == RUN_BODY_LEN,
        // Read, and answered with an error: a client of a later release learns that this
        // store does not know its request, and its connection stays usable.
        _ => body_len <= MAX_VALUE_LEN,
    };
    if !body_ok {
        return Err(format!("body length {body_len} invalid for op {op}"));
    }
    Ok((op, key_len, body_len))
}

/// The response to send: status and body.
struct Response {
    status: u8,
    body: Vec<u8>,
}

impl Response {
    fn ok(body: Vec<u8>) -> Self {
        Response {
            status: STATUS_OK,
            body,
        }
    }
    fn error(msg: String) -> Self {
        let mut body = msg.into_bytes();
        body.truncate(MAX_ERROR_LEN);
        Response {
            status: STATUS_ERROR,
            body,
        }
    }
}

impl Shared {
    fn serve(&self, req: Request) -> Response {
        match req {
            Request::Set { key, value } => self.set(key, value),
            Request::Get { key, wait } => self.get(&key, wait),
            Request::Add { key, delta } => self.add(key, delta),
            Request::Run {
                prefix,
                wait,
                first,
                count,
            } => self.run(&prefix, wait, first, count),
            Request::Unknown { op } => Response::error(format!(
                "unknown request op {op} (a client of another chorus release?)"
            )),
        }
    }

    /// Insert or replace, within the byte and key limits.
    fn put(&self, store: &mut Store, key: Vec<u8>, value: Vec<u8>) -> Result<(), String> {
        let old = store.map.get(&key).map(|v| key.len() + v.len());
        let limits = *lock(&self.limits);
        if old.is_none() && store.map.len() >= limits.max_keys {
            return Err(format!(
                "store full: it already holds {} keys (the limit)",
                store.map.len()
            ));
        }
        let bytes = store.bytes - old.unwrap_or(0) + key.len() + value.len();
        if bytes > limits.max_store_bytes {
            return Err(format!(
                "store full: {bytes} bytes would exceed the limit of {}",
                limits.max_store_bytes
            ));
        }
        store.bytes = bytes;
        store.map.insert(key, value);
        self.changed.notify_all();
        Ok(())
    }

    fn set(&self, key: Vec<u8>, value: Vec<u8>) -> Response {
        let mut store = lock(&self.store);
        match self.put(&mut store, key, value) {
            Ok(()) => Response::ok(Vec::new()),
            Err(e) => Response::error(e),
        }
    }

    fn add(&self, key: Vec<u8>, delta: i64) -> Response {
        let mut store = lock(&self.store);
        let current = match store.map.get(&key) {
            None => 0,
            Some(v) => match <[u8; 8]>::try_from(v.as_slice()) {
                Ok(b) => i64::from_le_bytes(b),
                Err(_) => {
                    return Response::error(format!(
                        "key holds a value of {} bytes, not an 8-byte counter",
                        v.len()
                    ))
                }
            },
        };
        let Some(new) = current.checked_add(delta) else {
            return Response::error(format!("counter overflow: {current} + {delta}"));
        };
        match self.put(&mut store, key, new.to_le_bytes().to_vec()) {
            Ok(()) => Response::ok(new.to_le_bytes().to_vec()),
            Err(e) => Response::error(e),
        }
    }

    fn get(&self, key: &[u8], wait: Duration) -> Response {
        match self.wait_for(key, wait) {
            Ok(store) => Response::ok(store.map.get(key).cloned().unwrap_or_default()),
            Err(not_yet) => not_yet,
        }
    }

    /// The store, locked, once `key` exists in it (waiting up to `wait`, at most
    /// [`MAX_GET_WAIT`], on the condition variable); else the answer to give (not yet, or
    /// shutting down).
    fn wait_for(&self, key: &[u8], wait: Duration) -> Result<MutexGuard<'_, Store>, Response> {
        let deadline = Instant::now() + wait.min(MAX_GET_WAIT);
        let mut store = lock(&self.store);
        loop {
            if store.map.contains_key(key) {
                return Ok(store);
            }
            if self.shutdown.load(Ordering::SeqCst) {
                return Err(Response::error("the store server is shutting down".into()));
            }
            let Some(left) = remaining(deadline) else {
                return Err(Response {
                    status: STATUS_NOT_YET,
                    body: Vec::new(),
                });
            };
            store = self
                .changed
                .wait_timeout(store, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Shared {
    /// Keys `prefix{first}`, `prefix{first + 1}`... in a row, as many as exist (at most
    /// `count`, within [`MAX_RUN_BYTES`]), once the first exists (waiting for it as
    /// [`get`](Self::get) does).
    fn run(&self, prefix: &[u8], wait: Duration, first: u64, count: u64) -> Response {
        let key = |i: u64| [prefix, i.to_string().as_bytes()].concat();
        if count == 0 || first.checked_add(count).is_none() {
            return Response::error(format!("invalid run: {count} keys from index {first}"));
        }
        let first_key = key(first);
        if first_key.len() > MAX_KEY_LEN {
            return Response::error(format!("run keys would exceed {MAX_KEY_LEN} bytes"));
        }
        let store = match self.wait_for(&first_key, wait) {
            Ok(store) => store,
            Err(not_yet) => return not_yet,
        };
        let mut body = Vec::new();
        for i in first..first + count.min(MAX_RUN_KEYS) {
            let Some(v) = store.map.get(&key(i)) else {
                break;
            };
            if i > first && body.len() + 4 + v.len() > MAX_RUN_BYTES {
                break;
            }
            body.extend_from_slice(&(v.len() as u32).to_le_bytes());
            body.extend_from_slice(v);
        }
        Response::ok(body)
    }
}

/// Read one request. `Ok(None)`: the client closed the connection between requests.
fn read_request(stream: &mut TcpStream) -> Result<Option<Request>, String> {
    // Idle wait for the first byte: no timeout (an authenticated client may keep its
    // connection for the whole job); dropping the server shuts the socket down to end it.
    let mut header = [0u8; REQ_HEADER_LEN];
    stream
        .set_read_timeout(None)
        .map_err(|e| format!("socket error: {e}"))?;
    loop {
        match stream.read(&mut header[..1]) {
            Ok(0) => return Ok(None),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return match Wire::from(e) {
                    Wire::Closed => Ok(None),
                    w => Err(format!("socket error: {w}")),
                }
            }
        }
    }
    // The rest of the message must follow promptly.
    let deadline = Instant::now() + SERVER_IO_TIMEOUT;
    let short = |w: Wire| format!("incomplete request ({w})");
    read_exact_by(stream, &mut header[1..], deadline).map_err(short)?;
    let (op, key_len, body_len) = parse_request_header(&header)?;
    let mut key = vec![0u8; key_len];
    read_exact_by(stream, &mut key, deadline).map_err(short)?;
    let mut body = vec![0u8; body_len];
    read_exact_by(stream, &mut body, deadline).map_err(short)?;
    let eight = |b: &[u8]| <[u8; 8]>::try_from(b).map_err(|_| "bad body".to_string());
    Ok(Some(match op {
        OP_SET => Request::Set { key, value: body },
        OP_GET => Request::Get {
            key,
            wait: Duration::from_millis(u64::from_le_bytes(eight(&body)?)),
        },
        OP_RUN => Request::Run {
            prefix: key,
            wait: Duration::from_millis(u64::from_le_bytes(eight(&body[..8])?)),
            first: u64::from_le_bytes(eight(&body[8..16])?),
            count: u64::from_le_bytes(eight(&body[16..])?),
        },
        OP_ADD => Request::Add {
            key,
            delta: i64::from_le_bytes(eight(&body)?),
        },
        op => Request::Unknown { op },
    }))
}

/// One connection's thread: handshake, then requests until the client leaves.
fn serve_connection(shared: &Shared, stream: &mut TcpStream, peer: SocketAddr, id: u64) {
    let _ = stream.set_nodelay(true);
    let deadline = Instant::now() + lock(&shared.limits).handshake_timeout;
    // Proven: no longer one of those shut down for a newcomer (unless it already was).
    let admit = || {
        let mut conns = lock(&shared.conns);
        let before = conns.unproven.len();
        conns.unproven.retain(|i| *i != id);
        conns.unproven.len() < before
    };
    if let Err(e) =
        accept_handshake_admitting(stream, &shared.token, STORE_CONTEXT, deadline, admit)
    {
        if !shared.shutdown.load(Ordering::SeqCst) {
            match e {
                TransportError::Timeout { waited, .. } => shared.log.log(format_args!(
                    "rejected connection from {peer}: no complete handshake within {:.1} s",
                    waited.as_secs_f64()
                )),
                e => shared
                    .log
                    .log(format_args!("rejected connection from {peer}: {e}")),
            }
        }
        return;
    }
    loop {
        let req = match read_request(stream) {
            Ok(Some(req)) => req,
            Ok(None) => return,
            Err(e) => {
                if !shared.shutdown.load(Ordering::SeqCst) {
                    shared
                        .log
                        .log(format_args!("dropped connection from {peer}: {e}"));
                }
                return;
            }
        };
        let resp = shared.serve(req);
        let mut out = Vec::with_capacity(RESP_HEADER_LEN + resp.body.len());
        out.push(resp.status);
        out.extend_from_slice(&(resp.body.len() as u32).to_le_bytes());
        out.extend_from_slice(&resp.body);
        if let Err(e) = write_all_by(stream, &out, Instant::now() + SERVER_IO_TIMEOUT) {
            if !shared.shutdown.load(Ordering::SeqCst) {
                shared.log.log(format_args!(
                    "dropped connection from {peer}: could not send a response ({e})"
                ));
            }
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Store: server.

const LISTENER: mio::Token = mio::Token(0);
const WAKER: mio::Token = mio::Token(1);

/// The key-value store server: runs on background threads until dropped.
///
/// One thread accepts connections (woken by `mio`, so dropping the server stops it at once);
/// each connection gets its own thread. Dropping the server closes every connection (clients
/// then see the store as closed) and joins all threads.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    waker: mio::Waker,
    accept: Option<JoinHandle<()>>,
    /// The process that started it: a child forked since has none of its threads, and shares
    /// its sockets with the parent.
    pid: u32,
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Bind `addr` (port 0 picks a free port) and serve clients that know `token`.
    ///
    /// Errors: [`TransportError::Io`] when the address cannot be bound (in use, not local) or
    /// the accept thread cannot be started.
    pub fn bind(addr: SocketAddr, token: &[u8]) -> Result<StoreServer> {
        Self::bind_with(addr, token, Limits::default())
    }

    /// Leave the connections that proved the token out of the connection limit: for a store
    /// whose token is a secret of its own (a unique id's), bound before the job's size is
    /// known, so that a job larger than the limit still gets in. Only those still in their
    /// handshake (strangers among them) are then limited. Not for a token others may know
    /// (one made from a launcher's job id): whoever proves it could open connections without
    /// end. Nothing without a token.
    pub fn exempt_proven(&self) {
        self.shared.proven_exempt.store(true, Ordering::Relaxed);
    }

    /// Make room for a job of `ranks` ranks (as [`StoreServer::bind_for_ranks`]) in a store
    /// bound before the size was known (a unique id's).
    pub fn fit_ranks(&self, ranks: usize) {
        let fit = Limits::for_ranks(ranks);
        let mut l = lock(&self.shared.limits);
        l.max_connections = l.max_connections.max(fit.max_connections);
        l.max_keys = l.max_keys.max(fit.max_keys);
        l.max_store_bytes = l.max_store_bytes.max(fit.max_store_bytes);
    }

    /// [`StoreServer::bind`] for a job of `ranks` ranks, each of which keeps a connection for
    /// its communicator's life: room for all of them and some more (splits, stray
    /// connections) beyond the default 1024 connections and 65 536 keys.
    pub fn bind_for_ranks(addr: SocketAddr, token: &[u8], ranks: usize) -> Result<StoreServer> {
        Self::bind_with(addr, token, Limits::for_ranks(ranks))
    }

    fn bind_with(addr: SocketAddr, token: &[u8], limits: Limits) -> Result<StoreServer> {
        let io = |during| move |e| TransportError::io(None, during, e);
        let listener = TcpListener::bind(addr).map_err(|e| {
            TransportError::Rendezvous(format!(
                "could not listen on {addr} for the store: {e} (port in use, or not an address \
                 of this host? check CHORUS_ADDR / MASTER_ADDR and the port)"
            ))
        })?;
        let local = listener.local_addr().map_err(io("store bind"))?;
        crate::deepen_backlog(&listener);
        listener.set_nonblocking(true).map_err(io("store bind"))?;
        let mut listener = mio::net::TcpListener::from_std(listener);
        let poll = mio::Poll::new().map_err(io("store bind"))?;
        poll.registry()
            .register(&mut listener, LISTENER, mio::Interest::READABLE)
            .map_err(io("store bind"))?;
        let waker = mio::Waker::new(poll.registry(), WAKER).map_err(io("store bind"))?;
        let shared = Arc::new(Shared {
            token: token.to_vec(),
            limits: Mutex::new(limits),
            store: Mutex::new(Store::default()),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            proven_exempt: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            log: LogLimiter::new("store"),
        });
        let sh = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("chorus-store-accept".into())
            .spawn(move || accept_loop(&sh, listener, poll))
            .map_err(io("starting the store thread"))?;
        Ok(StoreServer {
            addr: local,
            shared,
            waker,
            accept: Some(accept),
            pid: std::process::id(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: mio::net::TcpListener, mut poll: mio::Poll) {
    let mut events = mio::Events::with_capacity(8);
    loop {
        // The timeout retries accept after errors such as EMFILE, which leave the connection
        // in the backlog without a new readiness edge.
        if let Err(e) = poll.poll(&mut events, Some(Duration::from_millis(500))) {
            if e.kind() != io::ErrorKind::Interrupted {
                shared.log.log(format_args!("poll failed: {e}"));
                thread::sleep(Duration::from_millis(50));
            }
        }
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        loop {
            match listener.accept() {
                Ok((stream, peer)) => admit(shared, TcpStream::from(OwnedFd::from(stream)), peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    shared.log.log(format_args!("accept failed: {e}"));
                    break;
                }
            }
        }
    }
}

/// Register an accepted connection and start its thread, unless the server is at its limit
/// or shutting down.
fn admit(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let mut conns = lock(&shared.conns);
    if conns.closed {
        return;
    }
    conns.threads.retain(|t| !t.is_finished());
    let max = lock(&shared.limits).max_connections;
    // Under a secret token (`exempt_proven`), connections that proved it are the job's ranks:
    // only those still in their handshake count against the limit. Otherwise every one does.
    let counted = if shared.proven_exempt.load(Ordering::Relaxed) && !shared.token.is_empty() {
        conns.unproven.len()
    } else {
        conns.streams.len()
    };
    // (Said once `conns` is let go: a log line may block on a full stderr.)
    let mut evicted = false;
    if counted >= max {
        match conns.unproven.pop_front() {
            Some(oldest) => {
                if let Some(s) = conns.streams.remove(&oldest) {
                    let _ = s.shutdown(Shutdown::Both);
                }
                evicted = true;
            }
            None => {
                drop(conns);
                shared.log.log(format_args!(
                    "refused connection from {peer}: already serving {max} connections"
                ));
                return;
            }
        }
    }
    // A client whose host died (no FIN or RST ever comes) would hold its slot and thread
    // until the server is dropped: keepalive probes end its connection within about the
    // data connections' default (best effort: a system that refuses them keeps the rest).
    let _ = crate::tcp::set_keepalive(
        &socket2::SockRef::from(&stream),
        crate::tcp::DEFAULT_KEEPALIVE,
    );
    let say_evicted = || {
        if evicted {
            shared.log.log(format_args!(
                "serving {max} connections: shut down the oldest one still in its handshake \
                 for {peer}"
            ));
        }
    };
    // mio accepts sockets in non-blocking mode; this thread-per-connection server blocks.
    let clone = match stream
        .set_nonblocking(false)
        .and_then(|()| stream.try_clone())
    {
        Ok(c) => c,
        Err(e) => {
            drop(conns);
            say_evicted();
            shared
                .log
                .log(format_args!("dropped connection from {peer}: {e}"));
            return;
        }
    };
    let id = conns.next_id;
    conns.next_id += 1;
    conns.streams.insert(id, clone);
    conns.unproven.push_back(id);
    let sh = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("chorus-store-conn".into())
        .stack_size(CONN_STACK_SIZE)
        .spawn(move || {
            let mut stream = stream;
            serve_connection(&sh, &mut stream, peer, id);
            let _ = stream.shutdown(Shutdown::Both);
            let mut conns = lock(&sh.conns);
            conns.streams.remove(&id);
            conns.unproven.retain(|i| *i != id);
        });
    let failed = match spawned {
        Ok(t) => {
            conns.threads.push(t);
            None
        }
        Err(e) => {
            conns.streams.remove(&id);
            conns.unproven.retain(|i| *i != id);
            Some(e)
        }
    };
    drop(conns);
    say_evicted();
    if let Some(e) = failed {
        shared.log.log(format_args!(
            "dropped connection from {peer}: cannot start a thread: {e}"
        ));
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: the threads are the parent's (not here to join) and the sockets
            // are shared with the parent, whose store must go on. Leave everything be.
            // (`Shared` stays referenced by those threads' copies: nothing is freed. No lock is
            // taken either: a parent's thread may have held it at the fork.)
            if let Some(t) = self.accept.take() {
                std::mem::forget(t);
            }
            return;
        }
        self.shared.shutdown.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        let threads = {
            let mut conns = lock(&self.shared.conns);
            conns.closed = true;
            for s in conns.streams.values() {
                let _ = s.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut conns.threads)
        };
        // Taking the lock orders this notification after any waiter's flag check.
        drop(lock(&self.shared.store));
        self.shared.changed.notify_all();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for t in threads {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Store: client.

/// A client connection to the store.
///
/// After an I/O error, a timeout while waiting for a response, or an invalid response, the
/// connection is in an unknown state: every later call fails; connect again.
pub struct StoreClient {
    stream: TcpStream,
    addr: SocketAddr,
    io_timeout: Duration,
    /// No request waits past this ([`set_deadline`](Self::set_deadline)).
    bound: Option<Instant>,
    broken: Option<String>,
}

impl fmt::Debug for StoreClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreClient")
            .field("addr", &self.addr)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// Connection errors worth retrying while the server may still be starting.
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::TimedOut
            | io::ErrorKind::WouldBlock
            | io::ErrorKind::Interrupted
    )
}

/// `count` distinct TCP ports that were free on 127.0.0.1 a moment ago (bound all at once,
/// then released for the caller to bind), drawn below the kernel's ephemeral range where it
/// leaves room (20000 up to its start). The kernel hands ports of that range to every
/// `bind(0)` and outgoing connection on the machine, and one of those could take a port
/// between its release here and the caller's bind; a client retrying to connect to a port
/// there before its server listens could also be joined to itself. Where there is no such
/// room, ports the kernel picks.
pub fn free_local_ports(count: usize) -> io::Result<Vec<u16>> {
    const LOW: u16 = 20000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut seed = [0u8; 8];
    let span = u64::from(ephemeral_low.saturating_sub(LOW));
    // (Room for many more than asked: else tries would mostly meet ports already drawn.)
    if span > 1000 && count as u64 <= span / 8 && getrandom::getrandom(&mut seed).is_ok() {
        let mut x = u64::from_le_bytes(seed);
        for _ in 0..64 {
            let mut held: Vec<(u16, TcpListener)> = Vec::with_capacity(count);
            while held.len() < count {
                // A linear congruential step is plenty to spread the tries.
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                let port = LOW + ((x >> 33) % span) as u16;
                if held.iter().any(|&(p, _)| p == port) {
                    continue;
                }
                match TcpListener::bind((Ipv4Addr::LOCALHOST, port)) {
                    Ok(l) => held.push((port, l)),
                    Err(_) => break,
                }
            }
            if held.len() == count {
                return Ok(held.into_iter().map(|(p, _)| p).collect());
            }
        }
    }
    let held = (0..count)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<io::Result<Vec<_>>>()?;
    held.iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect()
}

/// For tests: `f(rank, store)` for ranks `0..n`, each on a thread of its own, around a fresh
/// store on loopback (token `b"t"`); the results in rank order.
#[cfg(test)]
pub(crate) fn on_local_store<R: Send + 'static>(
    n: usize,
    f: impl Fn(usize, SocketAddr) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let server = StoreServer::bind((Ipv4Addr::LOCALHOST, 0).into(), b"t").unwrap();
    let addr = server.local_addr();
    let hs: Vec<_> = (0..n)
        .map(|rank| {
            let f = f.clone();
            thread::spawn(move || f(rank, addr))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Whether a connected socket is joined to itself (same address at both ends): a client
/// that retries connecting to a local port nobody listens on yet can get this when the
/// kernel gives it that port as its own.
pub(crate) fn is_self_connected(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(a), Ok(b)) if a == b)
}

impl StoreClient {
    /// Connect (retrying until `deadline` while the server is not up yet) and authenticate.
    ///
    /// Refused connections are retried with a backoff from 10 ms to 500 ms, so ranks may
    /// start before the root. Errors: [`TransportError::Rendezvous`] when the deadline passes
    /// without a connection, or authentication fails (see [`connect_handshake`]);
    /// [`TransportError::Io`] for errors not worth retrying (e.g. network unreachable);
    /// [`TransportError::Timeout`] when the server accepts but does not finish the handshake.
    pub fn connect(addr: SocketAddr, token: &[u8], deadline: Instant) -> Result<StoreClient> {
        let started = Instant::now();
        let mut backoff = CONNECT_BACKOFF_MIN;
        let mut attempts = 0u32;
        // The last connection shut down during its handshake (why, and when the first was).
        let mut shut_down: Option<(String, Instant)> = None;
        let closed = |why: &str, attempts: u32| {
            TransportError::Rendezvous(format!(
                "the store at {addr}: {why} ({attempts} attempts in {:.1} s)",
                started.elapsed().as_secs_f64()
            ))
        };
        loop {
            let Some(left) = remaining(deadline) else {
                if let Some((why, _)) = &shut_down {
                    return Err(closed(why, attempts));
                }
                return Err(TransportError::Rendezvous(format!(
                    "could not reach the store at {addr} within {:.1} s ({attempts} attempts); \
                     is the root rank running, and do CHORUS_ADDR / MASTER_ADDR and the port \
                     point at it?",
                    started.elapsed().as_secs_f64()
                )));
            };
            attempts += 1;
            match TcpStream::connect_timeout(&addr, left.min(CONNECT_ATTEMPT_TIMEOUT)) {
                Ok(mut stream) if !is_self_connected(&stream) => {
                    let _ = stream.set_nodelay(true);
                    let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
                    match connect_handshake_or_retry(&mut stream, token, STORE_CONTEXT, hs_deadline)
                    {
                        Ok(()) => {
                            return Ok(StoreClient {
                                stream,
                                addr,
                                io_timeout: DEFAULT_CLIENT_IO_TIMEOUT,
                                bound: None,
                                broken: None,
                            })
                        }
                        // Shut down during the handshake (the server was at its connection
                        // limit): a new connection may get in, for a while; then (or at the
                        // deadline) this error is the answer.
                        Err((e, true)) => {
                            let why = match e {
                                TransportError::Rendezvous(why) => why,
                                other => other.to_string(),
                            };
                            let first = shut_down.map_or_else(Instant::now, |(_, at)| at);
                            if !retry_after_shutdown(first, deadline) {
                                return Err(closed(&why, attempts));
                            }
                            shut_down = Some((why, first));
                        }
                        // The last try ran into the deadline after earlier ones were shut
                        // down: those say more than the timeout.
                        Err((e, _)) => {
                            let late = matches!(e, TransportError::Timeout { .. })
                                && remaining(deadline).is_none();
                            return match shut_down {
                                Some((why, _)) if late => Err(closed(&why, attempts)),
                                _ => Err(e),
                            };
                        }
                    }
                }
                // Nobody listened yet, and the kernel picked the very port it called as this
                // side's port: TCP's simultaneous open joined the socket to itself. Not the
                // store: the socket is dropped, and the connect retried.
                Ok(_) => shut_down = None,
                Err(e) if retryable(&e) => shut_down = None,
                Err(e) => return Err(TransportError::io(None, "connecting to the store", e)),
            }
            if let Some(left) = remaining(deadline) {
                thread::sleep(backoff.min(left));
            }
            backoff = (backoff * 2).min(CONNECT_BACKOFF_MAX);
        }
    }

    /// The store's address, as connected to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How long [`set`](Self::set) and [`add`](Self::add) wait for the server's answer
    /// (default 60 s, clamped to 1 ms ..= 1 day); also the slack added to a
    /// [`get`](Self::get)'s own deadline.
    pub fn set_io_timeout(&mut self, timeout: Duration) {
        self.io_timeout = timeout.clamp(Duration::from_millis(1), Duration::from_secs(86_400));
    }

    /// Let no request wait for the server past `deadline` (plus [`DEADLINE_GRACE`] for an
    /// answer already on its way): a server that stalls then is a
    /// [`TransportError::Timeout`] near the caller's own deadline (a rendezvous's), not up to
    /// the I/O timeout later.
    pub fn set_deadline(&mut self, deadline: Instant) {
        self.bound = Some(deadline + DEADLINE_GRACE);
    }

    /// How long a wait for a key may last: until `deadline`, or [`ANSWER_MARGIN`] before
    /// the bound [`set_deadline`](Self::set_deadline) set if sooner (a wait the server
    /// stretched past the bound would end the connection there: a timeout before it leaves
    /// the connection usable). A caller may still wait a little past the instant it gave
    /// `set_deadline`, within [`DEADLINE_GRACE`] (for what another rank writes when its own
    /// wait ends there).
    fn wait_until(&self, deadline: Instant) -> Instant {
        self.bound
            .map_or(deadline, |b| deadline.min(b - ANSWER_MARGIN))
    }

    /// Undo [`set_deadline`](Self::set_deadline): the requests of a later phase (with
    /// deadlines of their own) are bounded by those and the I/O timeout only.
    pub fn clear_deadline(&mut self) {
        self.bound = None;
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Set `key` to `value` (overwrites).
    ///
    /// Errors: [`TransportError::InvalidArgument`] for a key outside 1..=256 bytes or a value
    /// over 64 KiB (the connection stays usable); [`TransportError::Rendezvous`] when the store
    /// is full or the server went away.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        if value.len() > MAX_VALUE_LEN {
            return Err(TransportError::InvalidArgument(format!(
                "store value for key {key:?} is {} bytes; the limit is {MAX_VALUE_LEN}",
                value.len()
            )));
        }
        let deadline = Instant::now() + self.io_timeout;
        let (status, body) = self.request(OP_SET, key, value, deadline)?;
        match status {
            STATUS_OK if body.is_empty() => Ok(()),
            _ => Err(self.unexpected(key, status, &body)),
        }
    }

    /// Wait until `key` exists, then return its value.
    ///
    /// The server blocks the request (no polling) for up to 60 s at a time; longer waits are
    /// split into several requests. Errors: [`TransportError::Timeout`] when the key did not
    /// appear before `deadline` (the connection stays usable); others as for
    /// [`set`](Self::set).
    pub fn get(&mut self, key: &str, deadline: Instant) -> Result<Vec<u8>> {
        check_key(key)?;
        let deadline = self.wait_until(deadline);
        let started = Instant::now();
        loop {
            if let Some(value) = self.waiting_request(OP_GET, key, &[], deadline, started)? {
                return Ok(value);
            }
        }
    }

    /// One request (`op`: GET or RUN) that the server holds until its key exists or the wait
    /// ends, its body the wait and then `rest`: `Some(answer)`, or `None` when the key has
    /// not appeared yet and `deadline` is still ahead (a timeout, counted from `started`,
    /// once it has passed).
    fn waiting_request(
        &mut self,
        op: u8,
        key: &str,
        rest: &[u8],
        deadline: Instant,
        started: Instant,
    ) -> Result<Option<Vec<u8>>> {
        // Ask the server to wait at most until our deadline (rounded up to whole ms, so a
        // sub-millisecond remainder still gets one look at the store).
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left.min(MAX_GET_WAIT);
        let wait_ms = u64::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u64::MAX);
        let resp_deadline = Instant::now() + wait + self.io_timeout;
        let body = [&wait_ms.to_le_bytes()[..], rest].concat();
        let (status, answer) = self.request(op, key, &body, resp_deadline)?;
        match status {
            STATUS_OK => Ok(Some(answer)),
            STATUS_NOT_YET if answer.is_empty() => match Instant::now() >= deadline {
                true => Err(TransportError::Timeout {
                    peer: None,
                    waited: started.elapsed(),
                }),
                false => Ok(None),
            },
            _ => Err(self.unexpected(key, status, &answer)),
        }
    }

    /// Wait for the values of keys `{prefix}{i}` for `i` in `indices`, in that order, and
    /// hand each to `each(i, value)` as it arrives; an error from `each` ends the wait and is
    /// returned. One request reads every key that exists in a row from the first one still
    /// needed, so a row that every rank has published costs one request, not one per key;
    /// a missing key is waited for as [`get`](Self::get) waits (so `each` sees `i` no sooner
    /// than a loop of `get`s would). Errors: as for [`get`](Self::get).
    pub fn get_each(
        &mut self,
        prefix: &str,
        indices: std::ops::Range<usize>,
        deadline: Instant,
        mut each: impl FnMut(usize, Vec<u8>) -> Result<()>,
    ) -> Result<()> {
        if indices.is_empty() {
            return Ok(());
        }
        check_key(prefix)?;
        check_key(&format!("{prefix}{}", indices.end - 1))?;
        let deadline = self.wait_until(deadline);
        let started = Instant::now();
        let mut next = indices.start;
        while next < indices.end {
            let range = [next as u64, (indices.end - next) as u64];
            let rest: Vec<u8> = range.iter().flat_map(|w| w.to_le_bytes()).collect();
            let Some(answer) = self.waiting_request(OP_RUN, prefix, &rest, deadline, started)?
            else {
                continue;
            };
            let Some(values) = split_run(&answer, indices.end - next) else {
                let msg = format!(
                    "the store at {} sent a malformed answer ({} bytes) for the keys from \
                     {prefix}{next}; is it a chorus store of the same version?",
                    self.addr,
                    answer.len()
                );
                self.broken = Some(msg.clone());
                return Err(TransportError::Rendezvous(msg));
            };
            for v in values {
                each(next, v.to_vec())?;
                next += 1;
            }
        }
        Ok(())
    }

    /// Atomically add `delta` to the counter `key` (created at 0) and return the new value.
    ///
    /// A counter is stored as 8 bytes (i64, little-endian), so [`get`](Self::get) on it
    /// returns those bytes. Errors: [`TransportError::Rendezvous`] when the key holds a value
    /// that is not 8 bytes long, on overflow, or as for [`set`](Self::set).
    pub fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let deadline = Instant::now() + self.io_timeout;
        let (status, body) = self.request(OP_ADD, key, &delta.to_le_bytes(), deadline)?;
        match (status, <[u8; 8]>::try_from(body.as_slice())) {
            (STATUS_OK, Ok(b)) => Ok(i64::from_le_bytes(b)),
            _ => Err(self.unexpected(key, status, &body)),
        }
    }

    /// The error for a response that is well-formed but not a success.
    fn unexpected(&mut self, key: &str, status: u8, body: &[u8]) -> TransportError {
        if status == STATUS_ERROR {
            // A refusal by the server; the connection is still in a known state.
            return TransportError::Rendezvous(format!(
                "the store refused the request for key {key:?}: {}",
                crate::frame::peer_text(body)
            ));
        }
        let msg = format!(
            "the store at {} sent an invalid response (status {status}, {} bytes) for key \
             {key:?}; is it a chorus store of the same version?",
            self.addr,
            body.len()
        );
        self.broken = Some(msg.clone());
        TransportError::Rendezvous(msg)
    }

    /// Send one request and read its response (validated header, bounded body).
    fn request(
        &mut self,
        op: u8,
        key: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(u8, Vec<u8>)> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Rendezvous(format!(
                "store connection unusable after an earlier error ({why}); connect again"
            )));
        }
        let deadline = self.bound.map_or(deadline, |b| deadline.min(b));
        let out = self.exchange(op, key, body, deadline);
        if let Err(e) = &out {
            self.broken = Some(e.to_string());
        }
        out
    }

    fn exchange(
        &mut self,
        op: u8,
        key: &str,
        body: &[u8],
        deadline: Instant,
    ) -> Result<(u8, Vec<u8>)> {
        let started = Instant::now();
        let addr = self.addr;
        let wire = |w: Wire| match w {
            Wire::Closed => TransportError::Rendezvous(format!(
                "the store server at {addr} closed the connection (the root rank exited or \
                 crashed?)"
            )),
            Wire::Timeout => TransportError::Timeout {
                peer: None,
                waited: started.elapsed(),
            },
            Wire::Io(e) => TransportError::io(None, "store request", e),
        };
        let mut msg = Vec::with_capacity(REQ_HEADER_LEN + key.len() + body.len());
        msg.push(op);
        msg.extend_from_slice(&(key.len() as u16).to_le_bytes());
        msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(body);
        write_all_by(&mut self.stream, &msg, deadline).map_err(wire)?;

        let mut header = [0u8; RESP_HEADER_LEN];
        read_exact_by(&mut self.stream, &mut header, deadline).map_err(wire)?;
        let status = header[0];
        let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
        let limit = match status {
            STATUS_OK if op == OP_RUN => MAX_RUN_BYTES,
            STATUS_OK => MAX_VALUE_LEN,
            STATUS_NOT_YET => 0,
            STATUS_ERROR => MAX_ERROR_LEN,
            _ => {
                return Err(TransportError::Rendezvous(format!(
                    "the store at {addr} sent an unknown response status {status}; is it a \
                     chorus store of the same version?"
                )))
            }
        };
        if len > limit {
            return Err(TransportError::Rendezvous(format!(
                "the store at {addr} announced a {len}-byte response (limit {limit}); is it a \
                 chorus store of the same version?"
            )));
        }
        let mut resp = vec![0u8; len];
        read_exact_by(&mut self.stream, &mut resp, deadline).map_err(wire)?;
        Ok((status, resp))
    }
}

/// The values of a RUN response: 1 ..= `most` of them, each `u32le len | value`, filling
/// `body` exactly; `None` for anything else.
fn split_run(body: &[u8], most: usize) -> Option<Vec<&[u8]>> {
    let mut values = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let value = rest.get(4..4usize.checked_add(len)?)?;
        if value.len() > MAX_VALUE_LEN || values.len() == most {
            return None;
        }
        values.push(value);
        rest = &rest[4 + len..];
    }
    (!values.is_empty()).then_some(values)
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(TransportError::InvalidArgument(format!(
            "store key of {} bytes; keys must be 1..={MAX_KEY_LEN} bytes",
            key.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, SocketAddrV4};
    use std::sync::mpsc;

    fn localhost() -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
    }

    fn secs(s: u64) -> Instant {
        Instant::now() + Duration::from_secs(s)
    }

    /// A burst of clients reaching the store at once (a large job's ranks at init) all get in:
    /// with std's backlog of 128 the kernel dropped part of the burst, and those clients waited
    /// out their handshake timeout and failed (512 at once failed here).
    #[test]
    fn a_burst_of_clients_all_get_in() {
        // No more than the kernel lets wait (`net.core.somaxconn`, 4096 by default since 5.4).
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(128);
        let n = cap.min(512);
        let server = StoreServer::bind_for_ranks(localhost(), b"tok", n).unwrap();
        let addr = server.local_addr();
        let gate = Arc::new(std::sync::Barrier::new(n));
        let started = Instant::now();
        let clients: Vec<_> = (0..n)
            .map(|r| {
                let gate = Arc::clone(&gate);
                thread::Builder::new()
                    .stack_size(128 << 10)
                    .spawn(move || {
                        gate.wait();
                        let mut c = StoreClient::connect(addr, b"tok", secs(60))?;
                        c.set(&format!("addr/{r}"), b"x")
                    })
                    .unwrap()
            })
            .collect();
        for c in clients {
            c.join().unwrap().unwrap();
        }
        let took = started.elapsed();
        assert!(took < Duration::from_secs(8), "took {took:?}");
    }

    /// Run `f` on a thread and fail the test if it does not finish within `limit` (a
    /// watchdog against hangs, far above the expected time).
    fn watchdog<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(limit)
            .expect("watchdog: the test body hung or panicked")
    }

    /// A connected pair of streams (accepted, connected).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind(localhost()).unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        (a, c)
    }

    fn handshake_pair(
        token_a: &'static [u8],
        ctx_a: &'static [u8],
        token_c: &'static [u8],
        ctx_c: &'static [u8],
    ) -> (Result<()>, Result<()>) {
        let (mut a, mut c) = pair();
        let t = thread::spawn(move || accept_handshake(&mut a, token_a, ctx_a, secs(5)));
        let rc = connect_handshake(&mut c, token_c, ctx_c, secs(5));
        (t.join().unwrap(), rc)
    }

    #[test]
    fn handshake_succeeds_with_same_token_and_context() {
        watchdog(Duration::from_secs(30), || {
            let (ra, rc) = handshake_pair(b"secret", b"data/1/0/1", b"secret", b"data/1/0/1");
            ra.unwrap();
            rc.unwrap();
            let (ra, rc) = handshake_pair(b"", b"store", b"", b"store");
            ra.unwrap();
            rc.unwrap();
        });
    }

    #[test]
    fn handshake_fails_on_both_sides_with_wrong_token_or_context() {
        watchdog(Duration::from_secs(30), || {
            for (ta, ca, tc, cc) in [
                (&b"secret"[..], &b"store"[..], &b"other"[..], &b"store"[..]),
                (b"secret", b"data/1/0/1", b"secret", b"data/1/1/0"),
                (b"", b"store", b"x", b"store"),
            ] {
                let (ra, rc) = handshake_pair(ta, ca, tc, cc);
                let ea = ra.unwrap_err().to_string();
                let ec = rc.unwrap_err().to_string();
                assert!(ea.contains("authentication failed"), "{ea}");
                assert!(ec.contains("authentication failed"), "{ec}");
                assert!(ec.contains("CHORUS_TOKEN"), "{ec}");
            }
        });
    }

    #[test]
    fn handshake_restores_timeouts_and_times_out_on_silence() {
        watchdog(Duration::from_secs(30), || {
            let (_a, mut c) = pair();
            c.set_read_timeout(Some(Duration::from_secs(7))).unwrap();
            let t0 = Instant::now();
            let e = connect_handshake(&mut c, b"t", b"store", t0 + Duration::from_millis(200))
                .unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            assert!(t0.elapsed() >= Duration::from_millis(200));
            assert_eq!(c.read_timeout().unwrap(), Some(Duration::from_secs(7)));
        });
    }

    #[test]
    fn a_stalled_server_is_a_timeout_at_the_clients_deadline() {
        watchdog(Duration::from_secs(30), || {
            // A "server" that completes the handshake, then never answers.
            let listener = TcpListener::bind(localhost()).unwrap();
            let addr = listener.local_addr().unwrap();
            let stall = thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                accept_handshake(&mut s, b"tok", STORE_CONTEXT, secs(10)).unwrap();
                thread::sleep(Duration::from_secs(6));
            });
            let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            let t0 = Instant::now();
            c.set_deadline(t0 + Duration::from_millis(300));
            let e = c.set("k", b"v").unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            let waited = t0.elapsed();
            assert!(
                waited >= Duration::from_millis(300)
                    && waited < DEADLINE_GRACE + Duration::from_millis(1500),
                "{waited:?}"
            );
            stall.join().unwrap();
        });
    }

    #[test]
    fn a_cleared_deadline_no_longer_bounds_later_requests() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();
            let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            c.set_deadline(Instant::now() + Duration::from_millis(50));
            thread::sleep(Duration::from_millis(60) + DEADLINE_GRACE);
            // Past the bound, a wait for a key set late would fail at once; cleared, it lasts
            // until its own deadline.
            c.clear_deadline();
            let setter = thread::spawn(move || {
                thread::sleep(Duration::from_millis(300));
                let mut s = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                s.set("late", b"v").unwrap();
            });
            assert_eq!(c.get("late", secs(5)).unwrap(), b"v");
            setter.join().unwrap();
        });
    }

    #[test]
    fn a_wait_past_the_bound_times_out_there_and_leaves_the_connection_usable() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let mut c = StoreClient::connect(server.local_addr(), b"tok", secs(10)).unwrap();
            let t0 = Instant::now();
            c.set_deadline(t0 + Duration::from_millis(300));
            let e = c.get("never", secs(20)).unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            let e = c
                .get_each("never/", 0..2, secs(20), |_, _| Ok(()))
                .unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            // (Answered before the bound: the connection still works.)
            c.clear_deadline();
            c.set("k", b"v").unwrap();
            assert_eq!(c.get("k", secs(5)).unwrap(), b"v");
        });
    }

    #[test]
    fn set_get_add_from_several_threads() {
        watchdog(Duration::from_secs(60), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();
            let n = 6;
            let threads: Vec<_> = (0..n)
                .map(|i| {
                    thread::spawn(move || {
                        let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                        c.set(&format!("addr/{i}"), format!("value {i}").as_bytes())
                            .unwrap();
                        for _ in 0..10 {
                            c.add("counter", 1).unwrap();
                        }
                        for j in 0..n {
                            let v = c.get(&format!("addr/{j}"), secs(10)).unwrap();
                            assert_eq!(v, format!("value {j}").as_bytes());
                        }
                        c.add("done", 1).unwrap()
                    })
                })
                .collect();
            let mut finals: Vec<i64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
            finals.sort_unstable();
            assert_eq!(finals, (1..=n as i64).collect::<Vec<_>>());
            let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            assert_eq!(c.add("counter", 0).unwrap(), 10 * n as i64);
            assert_eq!(c.add("counter", -5).unwrap(), 10 * n as i64 - 5);
            assert_eq!(
                c.get("counter", secs(1)).unwrap(),
                (10 * n as i64 - 5).to_le_bytes()
            );
            // Overwrite, empty values, a non-counter key and overflow.
            c.set("k", b"").unwrap();
            assert_eq!(c.get("k", secs(1)).unwrap(), b"");
            c.set("k", b"abc").unwrap();
            assert_eq!(c.get("k", secs(1)).unwrap(), b"abc");
            let e = c.add("k", 1).unwrap_err().to_string();
            assert!(e.contains("not an 8-byte counter"), "{e}");
            c.add("big", i64::MAX).unwrap();
            let e = c.add("big", 1).unwrap_err().to_string();
            assert!(e.contains("overflow"), "{e}");
            // Server refusals leave the connection usable.
            assert_eq!(c.get("k", secs(1)).unwrap(), b"abc");
        });
    }

    #[test]
    fn client_rejects_bad_keys_and_values_locally() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"").unwrap();
            let mut c = StoreClient::connect(server.local_addr(), b"", secs(10)).unwrap();
            assert!(matches!(
                c.set("", b"x"),
                Err(TransportError::InvalidArgument(_))
            ));
            let long = "k".repeat(MAX_KEY_LEN + 1);
            assert!(matches!(
                c.set(&long, b"x"),
                Err(TransportError::InvalidArgument(_))
            ));
            let big = vec![7u8; MAX_VALUE_LEN + 1];
            assert!(matches!(
                c.set("k", &big),
                Err(TransportError::InvalidArgument(_))
            ));
            // The largest allowed key and value work, and the connection is still usable.
            let key = "k".repeat(MAX_KEY_LEN);
            c.set(&key, &big[..MAX_VALUE_LEN]).unwrap();
            assert_eq!(c.get(&key, secs(5)).unwrap().len(), MAX_VALUE_LEN);
        });
    }

    #[test]
    fn get_waits_for_a_later_set() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();
            let waiter = thread::spawn(move || {
                let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                c.get("late", secs(20))
            });
            thread::sleep(Duration::from_millis(200));
            let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            c.set("late", b"here").unwrap();
            assert_eq!(waiter.join().unwrap().unwrap(), b"here");
        });
    }

    #[test]
    fn rows_of_keys_are_read_in_order_as_they_appear() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();
            let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            // 0..3 now, 3 and 4 later (4 before 3): handed over in order, each once.
            for i in 0..3 {
                c.set(&format!("row/{i}"), format!("v{i}").as_bytes())
                    .unwrap();
            }
            let reader = thread::spawn(move || {
                let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                let mut seen = Vec::new();
                c.get_each("row/", 1..5, secs(20), |i, v| {
                    seen.push((i, String::from_utf8(v).unwrap()));
                    Ok(())
                })
                .map(|()| seen)
            });
            thread::sleep(Duration::from_millis(200));
            c.set("row/4", b"v4").unwrap();
            thread::sleep(Duration::from_millis(100));
            c.set("row/3", b"v3").unwrap();
            let seen = reader.join().unwrap().unwrap();
            let want: Vec<_> = (1..5).map(|i| (i, format!("v{i}"))).collect();
            assert_eq!(seen, want);

            // A row needs a prefix (a key of the store).
            assert!(matches!(
                c.get_each("", 0..2, secs(5), |_, _| Ok(())),
                Err(TransportError::InvalidArgument(_))
            ));
            // An empty range asks nothing; the callback's error ends the read at once.
            c.get_each("none/", 3..3, Instant::now(), |_, _| panic!("called"))
                .unwrap();
            let mut calls = 0;
            let e = c
                .get_each("row/", 0..5, secs(20), |i, _| {
                    calls += 1;
                    match i {
                        2 => Err(TransportError::Rendezvous("stop at 2".into())),
                        _ => Ok(()),
                    }
                })
                .unwrap_err();
            assert!(
                e.to_string().contains("stop at 2") && calls == 3,
                "{e} {calls}"
            );
            // A key that never appears: a timeout after the ones before it, and the
            // connection stays usable.
            let t0 = Instant::now();
            let mut got = Vec::new();
            let e = c
                .get_each("row/", 3..7, t0 + Duration::from_millis(300), |i, _| {
                    got.push(i);
                    Ok(())
                })
                .unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            assert!(t0.elapsed() >= Duration::from_millis(300));
            assert_eq!(got, [3, 4]);
            assert_eq!(c.get("row/0", secs(5)).unwrap(), b"v0");
            // Keys too long for the store are refused before anything is sent.
            let long = "k".repeat(MAX_KEY_LEN - 1);
            assert!(matches!(
                c.get_each(&long, 9..11, secs(5), |_, _| Ok(())),
                Err(TransportError::InvalidArgument(_))
            ));
            assert_eq!(c.get("row/1", secs(5)).unwrap(), b"v1");
        });
    }

    #[test]
    fn rows_larger_than_one_answer_come_in_several() {
        watchdog(Duration::from_secs(60), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let mut c = StoreClient::connect(server.local_addr(), b"tok", secs(10)).unwrap();
            // More keys than one answer carries.
            let many = MAX_RUN_KEYS as usize + 10;
            for i in 0..many {
                c.set(&format!("small/{i}"), i.to_string().as_bytes())
                    .unwrap();
            }
            let mut seen = 0;
            c.get_each("small/", 0..many, secs(30), |i, v| {
                assert_eq!((i, v), (seen, seen.to_string().into_bytes()));
                seen += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, many);
            // 40 values of 64 KiB: 2.5 MiB, more than one answer carries.
            let n = 40;
            for i in 0..n {
                c.set(&format!("big/{i}"), &vec![i as u8; MAX_VALUE_LEN])
                    .unwrap();
            }
            let mut seen = 0;
            c.get_each("big/", 0..n, secs(30), |i, v| {
                assert_eq!(i, seen);
                assert!(v.len() == MAX_VALUE_LEN && v.iter().all(|&b| b == i as u8));
                seen += 1;
                Ok(())
            })
            .unwrap();
            assert_eq!(seen, n);
        });
    }

    #[test]
    fn the_server_refuses_runs_it_cannot_serve() {
        let shared = Shared {
            token: Vec::new(),
            limits: Mutex::new(Limits::default()),
            store: Mutex::new(Store::default()),
            changed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            proven_exempt: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            log: LogLimiter::new("test"),
        };
        let wait = Duration::ZERO;
        for (first, count) in [(0, 0), (u64::MAX, 1), (1, u64::MAX)] {
            let r = shared.run(b"p/", wait, first, count);
            assert_eq!(r.status, STATUS_ERROR, "{first} {count}");
        }
        let long = vec![b'k'; MAX_KEY_LEN];
        assert_eq!(shared.run(&long, wait, 0, 1).status, STATUS_ERROR);
        assert_eq!(shared.run(b"p/", wait, 0, 1).status, STATUS_NOT_YET);
        shared.set(b"p/0".to_vec(), b"a".to_vec());
        shared.set(b"p/1".to_vec(), b"".to_vec());
        shared.set(b"p/3".to_vec(), b"c".to_vec());
        let r = shared.run(b"p/", wait, 0, u64::MAX / 2);
        assert_eq!(r.status, STATUS_OK);
        assert_eq!(r.body, [1, 0, 0, 0, b'a', 0, 0, 0, 0]);
        assert_eq!(split_run(&r.body, 2), Some(vec![&b"a"[..], &b""[..]]));
        assert_eq!(split_run(&r.body, 1), None);
        for bad in [&[][..], &[1, 0, 0], &[2, 0, 0, 0, b'a'], &[0, 0, 0, 0, 9]] {
            assert_eq!(split_run(bad, 5), None, "{bad:?}");
        }
    }

    #[test]
    fn get_times_out_cleanly_and_connection_stays_usable() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let mut c = StoreClient::connect(server.local_addr(), b"tok", secs(10)).unwrap();
            let t0 = Instant::now();
            let e = c.get("never", t0 + Duration::from_millis(300)).unwrap_err();
            assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
            assert!(t0.elapsed() >= Duration::from_millis(300));
            // A deadline already in the past still looks once.
            c.set("now", b"1").unwrap();
            assert_eq!(c.get("now", Instant::now()).unwrap(), b"1");
            assert!(matches!(
                c.get("never", Instant::now()),
                Err(TransportError::Timeout { .. })
            ));
        });
    }

    #[test]
    fn wrong_token_is_rejected_and_good_clients_keep_working() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"right").unwrap();
            let addr = server.local_addr();
            let mut good = StoreClient::connect(addr, b"right", secs(10)).unwrap();
            good.set("a", b"1").unwrap();
            for _ in 0..3 {
                let e = StoreClient::connect(addr, b"wrong", secs(10)).unwrap_err();
                let msg = e.to_string();
                assert!(msg.contains("authentication failed"), "{msg}");
                assert!(msg.contains("CHORUS_TOKEN"), "{msg}");
            }
            assert_eq!(good.get("a", secs(5)).unwrap(), b"1");
            let mut good2 = StoreClient::connect(addr, b"right", secs(10)).unwrap();
            assert_eq!(good2.get("a", secs(5)).unwrap(), b"1");
        });
    }

    /// Reads until the server closes the connection (or the watchdog fires).
    fn wait_closed_by_server(mut s: TcpStream) {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("expected the server to close the connection: {e}"),
            }
        }
    }

    #[test]
    fn garbage_clients_do_not_disturb_good_ones() {
        watchdog(Duration::from_secs(60), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();

            // Says nothing at all (holds its connection).
            let silent = TcpStream::connect(addr).unwrap();
            // Random bytes instead of a proof.
            let mut noise = TcpStream::connect(addr).unwrap();
            let mut junk = [0u8; 4096];
            getrandom::getrandom(&mut junk).unwrap();
            let _ = noise.write_all(&junk);
            // A proof with the right magic but cut off in the middle.
            let mut cut = TcpStream::connect(addr).unwrap();
            let _ = cut.write_all(b"CHRH\x01abc");
            drop(cut);
            // Authenticated, then claims a 4 GiB value; and one that claims a huge key.
            let mut liar = TcpStream::connect(addr).unwrap();
            connect_handshake(&mut liar, b"tok", STORE_CONTEXT, secs(5)).unwrap();
            let mut hdr = vec![OP_SET];
            hdr.extend_from_slice(&4u16.to_le_bytes());
            hdr.extend_from_slice(&u32::MAX.to_le_bytes());
            hdr.extend_from_slice(b"key!");
            liar.write_all(&hdr).unwrap();
            let mut liar2 = TcpStream::connect(addr).unwrap();
            connect_handshake(&mut liar2, b"tok", STORE_CONTEXT, secs(5)).unwrap();
            liar2.write_all(&[OP_GET, 0xff, 0xff, 8, 0, 0, 0]).unwrap();
            // Authenticated, then an op this server does not know: an ERROR answer.
            let mut odd = TcpStream::connect(addr).unwrap();
            connect_handshake(&mut odd, b"tok", STORE_CONTEXT, secs(5)).unwrap();
            odd.write_all(&[99, 1, 0, 0, 0, 0, 0, b'k']).unwrap();
            // Authenticated, then stops mid-request and disconnects.
            let mut quitter = TcpStream::connect(addr).unwrap();
            connect_handshake(&mut quitter, b"tok", STORE_CONTEXT, secs(5)).unwrap();
            quitter.write_all(&[OP_SET, 3, 0]).unwrap();
            drop(quitter);

            // Good clients work meanwhile, well before the silent client's handshake deadline.
            let t0 = Instant::now();
            let goods: Vec<_> = (0..3)
                .map(|i| {
                    thread::spawn(move || {
                        let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                        for r in 0..20 {
                            c.set(&format!("g{i}/{r}"), &[i as u8; 100]).unwrap();
                            assert_eq!(
                                c.get(&format!("g{i}/{r}"), secs(5)).unwrap(),
                                [i as u8; 100]
                            );
                        }
                    })
                })
                .collect();
            for g in goods {
                g.join().unwrap();
            }
            eprintln!("good clients done in {:?}", t0.elapsed());

            // The server closed the liars' connections without reading the claimed bodies.
            wait_closed_by_server(liar);
            wait_closed_by_server(liar2);
            let mut answer = [0u8; RESP_HEADER_LEN];
            odd.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            odd.read_exact(&mut answer).unwrap();
            let mut why = vec![0u8; u32::from_le_bytes(answer[1..].try_into().unwrap()) as usize];
            odd.read_exact(&mut why).unwrap();
            assert_eq!(answer[0], STATUS_ERROR);
            let why = String::from_utf8(why).unwrap();
            assert!(why.contains("unknown request op 99"), "{why}");
            wait_closed_by_server(noise);
            drop(silent);
        });
    }

    #[test]
    fn request_header_bounds_are_checked_before_reading() {
        let h = |op: u8, k: u16, b: u32| {
            let mut x = [0u8; REQ_HEADER_LEN];
            x[0] = op;
            x[1..3].copy_from_slice(&k.to_le_bytes());
            x[3..7].copy_from_slice(&b.to_le_bytes());
            x
        };
        assert_eq!(parse_request_header(&h(OP_SET, 1, 0)), Ok((OP_SET, 1, 0)));
        assert_eq!(
            parse_request_header(&h(OP_SET, 256, 65536)),
            Ok((OP_SET, 256, 65536))
        );
        assert_eq!(parse_request_header(&h(OP_GET, 5, 8)), Ok((OP_GET, 5, 8)));
        assert_eq!(parse_request_header(&h(OP_ADD, 5, 8)), Ok((OP_ADD, 5, 8)));
        assert_eq!(parse_request_header(&h(OP_RUN, 5, 24)), Ok((OP_RUN, 5, 24)));
        assert_eq!(parse_request_header(&h(9, 5, 100)), Ok((9, 5, 100)));
        for bad in [
            h(OP_SET, 0, 1),
            h(OP_SET, 257, 1),
            h(OP_SET, u16::MAX, 1),
            h(OP_SET, 1, 65537),
            h(OP_SET, 1, u32::MAX),
            h(OP_GET, 1, 9),
            h(OP_GET, 1, u32::MAX),
            h(OP_ADD, 1, 0),
            h(0, 1, u32::MAX),
            h(OP_RUN, 1, 8),
            h(OP_RUN, 1, 25),
            h(5, 1, 65537),
            h(255, 0, 8),
        ] {
            assert!(parse_request_header(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn store_connections_probe_a_silent_client() {
        let server = StoreServer::bind(localhost(), b"tok").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut c = StoreClient::connect(server.local_addr(), b"tok", deadline).unwrap();
        c.set("k", b"v").unwrap();
        let conns = lock(&server.shared.conns);
        assert_eq!(conns.streams.len(), 1);
        for s in conns.streams.values() {
            let sock = socket2::SockRef::from(s);
            assert!(sock.keepalive().unwrap());
            assert_eq!(
                sock.keepalive_time().unwrap(),
                crate::tcp::DEFAULT_KEEPALIVE / 3
            );
        }
    }

    #[test]
    fn a_large_job_gets_room_for_every_rank() {
        let (small, d) = (Limits::for_ranks(8), Limits::default());
        assert_eq!(
            (small.max_connections, small.max_keys),
            (d.max_connections, d.max_keys)
        );
        assert_eq!(small.max_store_bytes, d.max_store_bytes);
        let big = Limits::for_ranks(5000);
        assert_eq!((big.max_connections, big.max_keys), (5064, 160_000));
        assert_eq!(big.max_store_bytes, d.max_store_bytes);
        // Past 16 384 ranks, 4 KiB a rank.
        let huge = Limits::for_ranks(1 << 20);
        assert_eq!(huge.max_store_bytes, 4 << 30);
        // A store bound before the size was known (a unique id's) is raised, never lowered.
        let server = StoreServer::bind(localhost(), b"tok").unwrap();
        server.fit_ranks(1 << 20);
        server.fit_ranks(8);
        let l = *lock(&server.shared.limits);
        assert_eq!(
            (l.max_connections, l.max_keys, l.max_store_bytes),
            ((1 << 20) + 64, 32 << 20, 4 << 30)
        );
    }

    /// With a secret token (`exempt_proven`), clients that proved they know it do not count
    /// against the connection limit (a job larger than the default limit, joined through a
    /// unique id whose store never learnt the size): more of them than the limit all get in
    /// and are served.
    #[test]
    fn proven_clients_beyond_the_limit_are_served() {
        watchdog(Duration::from_secs(30), || {
            let limits = Limits {
                max_connections: 2,
                ..Limits::default()
            };
            let server = StoreServer::bind_with(localhost(), b"k", limits).unwrap();
            server.exempt_proven();
            let addr = server.local_addr();
            let mut clients: Vec<StoreClient> = (0..6)
                .map(|_| StoreClient::connect(addr, b"k", secs(10)).unwrap())
                .collect();
            for (i, c) in clients.iter_mut().enumerate() {
                c.set(&format!("k{i}"), b"v").unwrap();
            }
            for c in clients.iter_mut() {
                assert_eq!(c.get("k5", secs(5)).unwrap(), b"v");
            }
        });
    }

    #[test]
    fn silent_connections_at_the_limit_make_way_for_clients() {
        watchdog(Duration::from_secs(30), || {
            let limits = Limits {
                max_connections: 3,
                handshake_timeout: Duration::from_secs(20),
                ..Limits::default()
            };
            let server = StoreServer::bind_with(localhost(), b"k", limits).unwrap();
            let addr = server.local_addr();
            let mut first = StoreClient::connect(addr, b"k", secs(10)).unwrap();
            first.set("a", b"1").unwrap();
            // More silent connections than the server serves, each wanting 20 s to time out.
            let silent: Vec<_> = (0..5).map(|_| TcpStream::connect(addr).unwrap()).collect();
            let t0 = Instant::now();
            let mut second = StoreClient::connect(addr, b"k", secs(10)).unwrap();
            assert_eq!(second.get("a", secs(5)).unwrap(), b"1");
            assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
            // The authenticated client was not the one made way for.
            first.set("b", b"2").unwrap();
            assert_eq!(second.get("b", secs(5)).unwrap(), b"2");
            drop(silent);
        });
    }

    #[test]
    fn store_limits_refuse_without_dropping_the_client() {
        watchdog(Duration::from_secs(30), || {
            let limits = Limits {
                max_store_bytes: 1000,
                max_keys: 3,
                max_connections: 2,
                handshake_timeout: Duration::from_millis(300),
            };
            let server = StoreServer::bind_with(localhost(), b"", limits).unwrap();
            let addr = server.local_addr();
            let mut c = StoreClient::connect(addr, b"", secs(10)).unwrap();
            for k in ["a", "b", "c"] {
                c.set(k, b"x").unwrap();
            }
            let e = c.set("d", b"x").unwrap_err().to_string();
            assert!(e.contains("store full"), "{e}");
            let e = c.set("a", &[0u8; 1000]).unwrap_err().to_string();
            assert!(e.contains("store full"), "{e}");
            c.set("a", &[0u8; 900]).unwrap();
            assert_eq!(c.get("b", secs(1)).unwrap(), b"x");

            // Connection limit: a second client fits, a third is closed at once, and tries
            // again until its deadline, saying why it failed ...
            let c2 = StoreClient::connect(addr, b"", secs(10)).unwrap();
            let t0 = Instant::now();
            let e = StoreClient::connect(addr, b"", t0 + Duration::from_millis(500))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("closed the connection") && e.contains("attempts"),
                "{e}"
            );
            assert!(
                t0.elapsed() >= Duration::from_millis(400),
                "{:?}",
                t0.elapsed()
            );
            // ... and gets in once a slot frees up before then (clients waiting for a
            // leaving rank's slot, or pushed out by a flood of newcomers, are not lost).
            let third = thread::spawn(move || StoreClient::connect(addr, b"", secs(10)));
            thread::sleep(Duration::from_millis(300));
            drop(c2);
            let mut c3 = third.join().unwrap().unwrap();
            assert_eq!(c3.get("b", secs(1)).unwrap(), b"x");
            drop(c3);
            // A silent client is dropped after the handshake deadline, freeing its slot.
            let silent = TcpStream::connect(addr).unwrap();
            wait_closed_by_server(silent);
            let mut ok = None;
            for _ in 0..50 {
                match StoreClient::connect(addr, b"", secs(10)) {
                    Ok(c) => {
                        ok = Some(c);
                        break;
                    }
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            }
            assert!(ok.is_some(), "a slot should free up once clients leave");
        });
    }

    #[test]
    fn free_local_ports_are_distinct_and_below_the_ephemeral_range() {
        let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok());
        for _ in 0..20 {
            let ports = free_local_ports(3).unwrap();
            assert_eq!(ports.len(), 3);
            assert!(ports[0] != ports[1] && ports[1] != ports[2] && ports[0] != ports[2]);
            for &p in &ports {
                if let Some(low) = low.filter(|&l| l > 21000) {
                    assert!((20000..low).contains(&p), "{p} (ephemeral from {low})");
                }
            }
        }
    }

    #[test]
    fn connect_retries_until_the_server_starts() {
        watchdog(Duration::from_secs(30), || {
            // Find a free port, release it, and start the server there a little later.
            let port = free_local_ports(1).unwrap()[0];
            let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
            let client = thread::spawn(move || {
                let mut c = StoreClient::connect(addr, b"tok", secs(10))?;
                c.get("x", secs(10))
            });
            thread::sleep(Duration::from_millis(300));
            let server = StoreServer::bind(addr, b"tok").unwrap();
            let mut c = StoreClient::connect(server.local_addr(), b"tok", secs(10)).unwrap();
            c.set("x", b"up").unwrap();
            assert_eq!(client.join().unwrap().unwrap(), b"up");
        });
    }

    #[test]
    fn connect_gives_up_at_the_deadline_with_advice() {
        watchdog(Duration::from_secs(30), || {
            let port = TcpListener::bind(localhost())
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let addr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
            let t0 = Instant::now();
            let e = StoreClient::connect(addr, b"", t0 + Duration::from_millis(300))
                .unwrap_err()
                .to_string();
            assert!(t0.elapsed() >= Duration::from_millis(300));
            assert!(e.contains("could not reach the store"), "{e}");
            assert!(e.contains("CHORUS_ADDR"), "{e}");
        });
    }

    #[test]
    fn dropping_the_server_stops_its_threads_and_fails_clients() {
        watchdog(Duration::from_secs(30), || {
            let server = StoreServer::bind(localhost(), b"tok").unwrap();
            let addr = server.local_addr();
            let mut idle = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
            let waiter = thread::spawn(move || {
                let mut c = StoreClient::connect(addr, b"tok", secs(10)).unwrap();
                c.get("never", secs(60))
            });
            let silent = TcpStream::connect(addr).unwrap();
            thread::sleep(Duration::from_millis(200));
            let t0 = Instant::now();
            drop(server);
            eprintln!("server dropped in {:?}", t0.elapsed());
            // The blocked GET fails instead of waiting its minute.
            let e = waiter.join().unwrap().unwrap_err().to_string();
            assert!(e.contains("shutting down") || e.contains("closed"), "{e}");
            let e = idle.set("k", b"v").unwrap_err().to_string();
            assert!(e.contains("closed the connection"), "{e}");
            wait_closed_by_server(silent);
            // Nobody listens any more.
            assert!(TcpStream::connect(addr).is_err());
        });
    }
}
