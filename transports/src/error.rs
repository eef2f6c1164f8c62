//! Errors of the transport layer.

use std::fmt;
use std::io;
use std::time::Duration;

/// What went wrong while moving bytes. Each variant names the peer where one is involved.
///
/// Usable afterwards: [`TransportError::InvalidArgument`] and [`TransportError::InvalidUsage`]
/// leave the transport as it was. Every other variant means the byte streams are no longer in a
/// known state: the transport must be dropped (after [`crate::Transport::abort`]).
#[derive(Debug)]
pub enum TransportError {
    /// The peer closed its connection (it exited, crashed or dropped the communicator).
    PeerClosed {
        /// The peer.
        peer: usize,
    },
    /// The peer gave up and said why (it may name another rank as the one at fault).
    PeerAborted {
        /// The peer that sent the abort notice.
        peer: usize,
        /// The rank it blames, if any.
        culprit: Option<usize>,
        /// Its reason.
        reason: String,
    },
    /// Nothing arrived before the deadline.
    Timeout {
        /// A peer the wait was blocked on, if one.
        peer: Option<usize>,
        /// How long was waited.
        waited: Duration,
    },
    /// Ranks that had not reached the rendezvous store when a wait for them ended at the
    /// deadline (not started, failed before init, or given another store address, port or
    /// token).
    NotJoined {
        /// The ranks that never claimed their place, ascending.
        missing: Vec<usize>,
        /// The group's size.
        size: usize,
        /// The store's address.
        store: std::net::SocketAddr,
        /// How long was waited.
        waited: Duration,
    },
    /// The peer sent bytes that are not a valid frame (bad magic, version, communicator id,
    /// sequence number).
    Protocol {
        /// The peer.
        peer: usize,
        /// What was wrong.
        what: String,
    },
    /// The peer's next message is not the one this rank expected: a different collective or
    /// step (tag), or a different size. Usually the ranks called collectives in different
    /// orders or with different arguments.
    Mismatch {
        /// The peer.
        peer: usize,
        /// Expected tag.
        expected_tag: u64,
        /// Tag that arrived.
        got_tag: u64,
        /// Expected length (capacity).
        expected_len: usize,
        /// Length that arrived.
        got_len: usize,
    },
    /// An operating-system error on the connection to a peer (or outside any peer).
    Io {
        /// The peer, if the error concerns one connection.
        peer: Option<usize>,
        /// What this rank was doing.
        during: &'static str,
        /// The error.
        source: io::Error,
    },
    /// Rendezvous failed: authentication, address exchange, store.
    Rendezvous(String),
    /// A bad argument (peer out of range, buffer too short). The transport is still usable.
    InvalidArgument(String),
    /// A call made in a state that does not allow it. The transport is still usable.
    InvalidUsage(String),
    /// The transport was aborted earlier and can no longer be used.
    Aborted(String),
}

impl TransportError {
    /// Whether the transport can still be used after this error.
    pub fn is_recoverable(&self) -> bool {
        matches!(
            self,
            TransportError::InvalidArgument(_) | TransportError::InvalidUsage(_)
        )
    }

    /// The peer most likely at fault, if the error names one.
    pub fn culprit(&self) -> Option<usize> {
        match self {
            TransportError::PeerClosed { peer } => Some(*peer),
            TransportError::PeerAborted { peer, culprit, .. } => culprit.or(Some(*peer)),
            TransportError::Timeout { peer, .. } => *peer,
            TransportError::NotJoined { missing, .. } => match missing[..] {
                [only] => Some(only),
                _ => None,
            },
            TransportError::Protocol { peer, .. } => Some(*peer),
            TransportError::Mismatch { peer, .. } => Some(*peer),
            TransportError::Io { peer, .. } => *peer,
            _ => None,
        }
    }

    pub(crate) fn io(peer: Option<usize>, during: &'static str, source: io::Error) -> Self {
        TransportError::Io {
            peer,
            during,
            source,
        }
    }
}

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportError::PeerClosed { peer } => {
                write!(
                    f,
                    "rank {peer} closed its connection (process exited or crashed?)"
                )
            }
            TransportError::PeerAborted {
                peer,
                culprit,
                reason,
            } => match culprit {
                Some(c) if c != peer => {
                    write!(f, "rank {peer} aborted because of rank {c}: {reason}")
                }
                _ => write!(f, "rank {peer} aborted: {reason}"),
            },
            TransportError::Timeout { peer, waited } => match peer {
                Some(p) => write!(
                    f,
                    "timed out after {:.1} s waiting for rank {p}",
                    waited.as_secs_f64()
                ),
                None => write!(f, "timed out after {:.1} s", waited.as_secs_f64()),
            },
            TransportError::NotJoined {
                missing,
                size,
                store,
                waited,
            } => {
                let who = match &missing[..] {
                    [one] => format!("rank {one}"),
                    many if many.len() <= 16 => format!("ranks {many:?}"),
                    many => format!("{} ranks (the first {:?})", many.len(), &many[..16]),
                };
                write!(
                    f,
                    "timed out after {:.1} s: {who} of {size} never reached the store at {store} \
                     (not started, failed before init, or given another store address, port \
                     or token)",
                    waited.as_secs_f64()
                )
            }
            TransportError::Protocol { peer, what } => {
                write!(f, "rank {peer} sent an invalid frame: {what}")
            }
            TransportError::Mismatch {
                peer,
                expected_tag,
                got_tag,
                expected_len,
                got_len,
            } => {
                if expected_tag != got_tag {
                    write!(
                        f,
                        "rank {peer} sent message tag {got_tag:#x} where tag {expected_tag:#x} was expected \
                         (ranks called different collectives, or in a different order)"
                    )
                } else if got_len > expected_len {
                    write!(
                        f,
                        "rank {peer} sent {got_len} bytes, more than the {expected_len} expected \
                         (ranks made the call with different counts or dtypes)"
                    )
                } else {
                    write!(
                        f,
                        "rank {peer} sent {got_len} bytes where {expected_len} were expected \
                         (ranks made the call with different counts or dtypes)"
                    )
                }
            }
            TransportError::Io {
                peer,
                during,
                source,
            } => match peer {
                Some(p) => write!(f, "I/O error with rank {p} during {during}: {source}"),
                None => write!(f, "I/O error during {during}: {source}"),
            },
            TransportError::Rendezvous(s) => write!(f, "rendezvous failed: {s}"),
            TransportError::InvalidArgument(s) => write!(f, "invalid argument: {s}"),
            TransportError::InvalidUsage(s) => write!(f, "invalid usage: {s}"),
            TransportError::Aborted(s) => write!(f, "transport was aborted earlier: {s}"),
        }
    }
}

impl std::error::Error for TransportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransportError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
