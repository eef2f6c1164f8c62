//! Errors a [`crate::Communicator`] returns.

use std::fmt;

use chorus_transport::TransportError;

/// The class of an error; the C ABI maps each to a fixed status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A bad argument (wrong buffer length, unknown name). The communicator is still usable;
    /// a refused collective still counts as this rank's call (see [`crate::Communicator`]).
    InvalidArgument,
    /// A call not allowed in this state (e.g. using an aborted communicator).
    InvalidUsage,
    /// An operating-system error (socket, bind, ...).
    System,
    /// A peer died, closed its connection, aborted or sent garbage.
    Remote,
    /// A peer did not answer within the timeout.
    Timeout,
    /// Ranks called different collectives or with different counts/dtypes/ops.
    Mismatch,
    /// Not supported (feature not built, combination not implemented).
    Unsupported,
    /// A bug in chorus.
    Internal,
}

impl ErrorKind {
    /// A short lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::InvalidUsage => "invalid usage",
            ErrorKind::System => "system error",
            ErrorKind::Remote => "remote error",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Mismatch => "mismatch across ranks",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Internal => "internal error",
        }
    }
}

/// An error from a communicator call: which rank, which operation, which peer, what happened,
/// and whether the communicator can still be used.
#[derive(Debug)]
pub struct CommError {
    kind: ErrorKind,
    rank: Option<usize>,
    op: &'static str,
    peer: Option<usize>,
    message: String,
    usable: bool,
    source: Option<Box<TransportError>>,
}

impl CommError {
    /// A new error. Whether the communicator survives it follows from `kind` (an invalid
    /// argument or an unsupported request leaves it usable); [`CommError::with_usable`]
    /// changes that.
    pub fn new(kind: ErrorKind, op: &'static str, message: impl Into<String>) -> Self {
        CommError {
            kind,
            rank: None,
            op,
            peer: None,
            message: message.into(),
            usable: matches!(kind, ErrorKind::InvalidArgument | ErrorKind::Unsupported),
            source: None,
        }
    }

    /// An invalid-argument error (communicator still usable).
    pub fn invalid(op: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, op, message)
    }

    /// Wrap a transport error raised during `op`.
    pub fn from_transport(op: &'static str, e: TransportError) -> Self {
        let kind = match &e {
            TransportError::PeerClosed { .. }
            | TransportError::PeerAborted { .. }
            | TransportError::Protocol { .. } => ErrorKind::Remote,
            TransportError::Timeout { .. } | TransportError::NotJoined { .. } => ErrorKind::Timeout,
            TransportError::Mismatch { .. } => ErrorKind::Mismatch,
            TransportError::Io { .. } | TransportError::Rendezvous(_) => ErrorKind::System,
            TransportError::InvalidArgument(_) => ErrorKind::InvalidArgument,
            TransportError::InvalidUsage(_) | TransportError::Aborted(_) => ErrorKind::InvalidUsage,
        };
        CommError {
            kind,
            rank: None,
            op,
            peer: e.culprit(),
            message: e.to_string(),
            usable: e.is_recoverable(),
            source: Some(Box::new(e)),
        }
    }

    /// The same error without its source: for reporting one failure to several requests.
    pub(crate) fn copy(&self) -> CommError {
        CommError {
            kind: self.kind,
            rank: self.rank,
            op: self.op,
            peer: self.peer,
            message: self.message.clone(),
            usable: self.usable,
            source: None,
        }
    }

    /// Set the operation that failed.
    pub(crate) fn with_op(mut self, op: &'static str) -> Self {
        self.op = op;
        self
    }

    /// Set the rank that reports the error.
    pub fn at_rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Set the peer involved.
    pub fn with_peer(mut self, peer: usize) -> Self {
        self.peer = Some(peer);
        self
    }

    /// Forget the peer (one named in another numbering of the ranks).
    pub(crate) fn without_peer(mut self) -> Self {
        self.peer = None;
        self
    }

    /// Append detail to the message.
    pub fn with_detail(mut self, detail: &str) -> Self {
        self.message.push_str(detail);
        self
    }

    /// Override whether the communicator survives.
    pub fn with_usable(mut self, usable: bool) -> Self {
        self.usable = usable;
        self
    }

    /// The class of error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The rank that reports it, if known.
    pub fn rank(&self) -> Option<usize> {
        self.rank
    }
    /// The operation ("all_reduce", "init", ...).
    pub fn op(&self) -> &'static str {
        self.op
    }
    /// The peer rank at fault or involved, if known.
    pub fn peer(&self) -> Option<usize> {
        self.peer
    }
    /// The detail message.
    pub fn message(&self) -> &str {
        &self.message
    }
    /// Whether the communicator can still be used. When false, drop it (or call
    /// [`crate::Communicator::abort`]) and build a new one.
    pub fn is_usable(&self) -> bool {
        self.usable
    }
    /// The transport error underneath, if any.
    pub fn transport_error(&self) -> Option<&TransportError> {
        self.source.as_deref()
    }
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chorus: ")?;
        if let Some(r) = self.rank {
            write!(f, "rank {r}: ")?;
        }
        write!(
            f,
            "{} failed ({}): {}",
            self.op,
            self.kind.as_str(),
            self.message
        )?;
        match self.op {
            // No communicator yet (or none involved): nothing to say about one.
            op if op.starts_with("init") || op == "unique_id" || op == "compressor" => Ok(()),
            _ if self.usable => write!(f, " [communicator still usable]"),
            _ => write!(f, " [communicator unusable: abort it and create a new one]"),
        }
    }
}

impl std::error::Error for CommError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_rank_peer_op_and_usability() {
        let e = CommError::from_transport("all_reduce", TransportError::PeerClosed { peer: 3 })
            .at_rank(1);
        let s = e.to_string();
        assert!(s.contains("rank 1"), "{s}");
        assert!(s.contains("rank 3"), "{s}");
        assert!(s.contains("all_reduce"), "{s}");
        assert!(s.contains("unusable"), "{s}");
        assert_eq!(e.kind(), ErrorKind::Remote);
        assert_eq!(e.peer(), Some(3));
        let e = CommError::invalid("all_reduce", "recv buffer too short");
        assert!(e.is_usable());
        assert!(e.to_string().contains("still usable"));
        // Before a communicator exists there is none to speak of.
        let e = CommError::from_transport("init", TransportError::PeerClosed { peer: 3 });
        assert!(!e.to_string().contains("communicator"), "{e}");
        let e = CommError::invalid("unique_id", "no address");
        assert!(e.to_string().ends_with("no address"), "{e}");
        let e = CommError::new(ErrorKind::Internal, "init (tuning file)", "bad");
        assert!(e.to_string().ends_with("bad"), "{e}");
    }
}
