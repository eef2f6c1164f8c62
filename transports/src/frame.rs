//! The header and trailer every message carries on a byte stream.
//!
//! ```text
//! offset size field
//!      0    1 magic      0xC4
//!      1    1 version    2 (bits 4..8) | kind (bits 0..4): 0 = data, 1 = abort notice
//!      2    1 seq        low 8 bits of the per-(sender, receiver) frame counter
//!      3    5 len        payload bytes that follow (up to 2^40 − 1)
//!      8    8 tag        the message tag
//! ```
//! then `len` payload bytes and a one-byte trailer: [`TRAILER_END`], or [`TRAILER_ABORT`]
//! when the sender gave up in the middle of the frame and padded the rest. Integers are
//! little-endian. The receiver validates every header field before it reads a payload byte,
//! and completes a receive only on the end trailer, holding back the payload's last byte
//! until it has read the trailer (so a receive's bytes reach the message's length only when
//! they are data: a schedule that forwards what has arrived never passes a padded frame on
//! as a whole message). A wrong magic, version or kind, a sequence
//! number other than the next one or a trailer that is neither value is a protocol error; a
//! tag other than the posted receive's, or a length larger than its buffer, is a mismatch —
//! never an allocation.
//!
//! The frame is small because on a rate-limited link every byte costs time: a 32 KiB
//! allreduce of 4 ranks over halving-doubling sends 4 messages per rank per call, and at
//! 1 gbit the 48-byte frames of version 1 (4-byte magic, 8-byte communicator id and sequence
//! number, 8-byte trailer) were 192 bytes, 1.5 µs of link time, of its 415 µs per call
//! (`benches/results/2026-11-25-wire-bytes.md`). What version 1 checked per frame is still
//! checked: the communicator id once per connection (in the hello and the authentication
//! context of `tcp::mesh`, a connection belongs to one communicator), and the sequence number
//! modulo 256 (TCP delivers in order; the check catches a receiver that lost its place, which
//! the tag check, naming the call and step, catches as well).

/// Size of the header in bytes.
pub const HEADER_LEN: usize = 16;
/// Size of the trailer in bytes.
pub const TRAILER_LEN: usize = 1;
/// The trailer of a complete frame.
pub const TRAILER_END: u8 = b'E';
/// The trailer of a frame whose payload is padding: the sender aborted, its notice follows.
pub const TRAILER_ABORT: u8 = b'A';
/// The magic byte.
pub const MAGIC: u8 = 0xC4;
/// Wire version.
pub const VERSION: u8 = 2;
/// The largest payload one frame can carry (the length field has 40 bits).
pub const MAX_PAYLOAD: u64 = (1 << 40) - 1;
/// The largest abort-notice payload accepted.
pub const MAX_ABORT_PAYLOAD: usize = 4096;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A message payload.
    Data,
    /// An abort notice: 8-byte culprit rank (`u64::MAX` = none), then a UTF-8 reason.
    Abort,
}

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Low 8 bits of the frame's sequence number.
    pub seq: u8,
    /// Tag.
    pub tag: u64,
    /// Payload length (at most [`MAX_PAYLOAD`]).
    pub len: u64,
}

/// Why a header was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// Not our magic.
    Magic(u8),
    /// Unknown version.
    Version(u8),
    /// The 40-byte header of version 1 (earlier releases), recognised by its magic.
    VersionOne,
    /// Unknown kind.
    Kind(u8),
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderError::Magic(m) => write!(f, "bad magic {m:#04x}"),
            HeaderError::VersionOne => {
                write!(
                    f,
                    "wire version 1 (the peer runs an older chorus), this is {VERSION}"
                )
            }
            HeaderError::Version(v) => write!(f, "unsupported wire version {v}"),
            HeaderError::Kind(k) => write!(f, "unknown frame kind {k}"),
        }
    }
}

/// Magic of the version-1 header, recognised only to name the version in the error.
const MAGIC_V1: [u8; 4] = *b"CHRS";

impl Header {
    /// Encode into `out`. `len` must be at most [`MAX_PAYLOAD`] (the transport refuses larger
    /// messages when they are posted).
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        debug_assert!(self.len <= MAX_PAYLOAD, "payload of {} bytes", self.len);
        out[0] = MAGIC;
        out[1] = VERSION << 4
            | match self.kind {
                Kind::Data => 0,
                Kind::Abort => 1,
            };
        out[2] = self.seq;
        out[3..8].copy_from_slice(&self.len.to_le_bytes()[..5]);
        out[8..16].copy_from_slice(&self.tag.to_le_bytes());
    }

    /// Decode and check magic, version and kind.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, HeaderError> {
        if b[0] != MAGIC {
            if b[0..4] == MAGIC_V1 {
                return Err(HeaderError::VersionOne);
            }
            return Err(HeaderError::Magic(b[0]));
        }
        if b[1] >> 4 != VERSION {
            return Err(HeaderError::Version(b[1] >> 4));
        }
        let kind = match b[1] & 0xf {
            0 => Kind::Data,
            1 => Kind::Abort,
            k => return Err(HeaderError::Kind(k)),
        };
        let mut len = [0u8; 8];
        len[..5].copy_from_slice(&b[3..8]);
        Ok(Header {
            kind,
            seq: b[2],
            len: u64::from_le_bytes(len),
            tag: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        })
    }
}

/// Encode an abort notice payload.
pub fn encode_abort(culprit: Option<usize>, reason: &str) -> Vec<u8> {
    // Cut at a character's start, so that the peer shows no broken character at the end.
    let mut cut = reason.len().min(MAX_ABORT_PAYLOAD - 8);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let reason = &reason.as_bytes()[..cut];
    let mut v = Vec::with_capacity(8 + reason.len());
    v.extend_from_slice(&culprit.map_or(u64::MAX, |c| c as u64).to_le_bytes());
    v.extend_from_slice(reason);
    v
}

/// Decode an abort notice payload.
pub fn decode_abort(p: &[u8]) -> (Option<usize>, String) {
    if p.len() < 8 {
        return (None, peer_text(p));
    }
    let c = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
    let culprit = if c == u64::MAX {
        None
    } else {
        usize::try_from(c).ok()
    };
    (culprit, peer_text(&p[8..]))
}

/// Text a peer sent (an abort notice's reason), as this rank shows it in errors and logs:
/// invalid UTF-8 replaced, and control characters (newlines, terminal escapes), line and
/// paragraph separators and invisible format characters (bidirectional overrides and
/// isolates, zero-width characters, tag characters) escaped, so that a peer's bytes cannot
/// forge log lines, drive a terminal or make a message read otherwise than it is.
pub fn peer_text(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    if !text.chars().any(hidden) {
        return text.into_owned();
    }
    text.chars()
        .map(|c| {
            if hidden(c) {
                c.escape_default().collect()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Whether `peer_text` escapes `c`: control characters, and the characters of Unicode's
/// format category (Cf) and line and paragraph separators (Zl, Zp) that change how the text
/// around them is shown, or are not shown at all.
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00AD}'
                | '\u{0600}'..='\u{0605}'
                | '\u{061C}'
                | '\u{06DD}'
                | '\u{070F}'
                | '\u{180E}'
                | '\u{200B}'..='\u{200F}'
                | '\u{2028}'..='\u{202E}'
                | '\u{2060}'..='\u{206F}'
                | '\u{FEFF}'
                | '\u{FFF9}'..='\u{FFFB}'
                | '\u{E0000}'..='\u{E007F}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(seq: u8, tag: u64, len in 0..=MAX_PAYLOAD, abort: bool) {
            let h = Header { kind: if abort { Kind::Abort } else { Kind::Data }, seq, tag, len };
            let mut b = [0u8; HEADER_LEN];
            h.encode(&mut b);
            prop_assert_eq!(Header::decode(&b), Ok(h));
        }

        #[test]
        fn garbage_never_panics(b in proptest::array::uniform16(any::<u8>())) {
            let _ = Header::decode(&b);
        }

        /// A valid header with one byte changed: refused, or decoded to exactly what those
        /// bytes say (every byte of a header means something).
        #[test]
        fn corrupted_headers_decode_exactly_or_not_at_all(
            seq: u8, tag: u64, len in 0..=MAX_PAYLOAD, abort: bool,
            at in 0..HEADER_LEN, byte: u8,
        ) {
            let h = Header { kind: if abort { Kind::Abort } else { Kind::Data }, seq, tag, len };
            let mut b = [0u8; HEADER_LEN];
            h.encode(&mut b);
            b[at] = byte;
            if let Ok(d) = Header::decode(&b) {
                let mut again = [0u8; HEADER_LEN];
                d.encode(&mut again);
                prop_assert_eq!(again, b);
            }
        }
    }

    #[test]
    fn layout() {
        let h = Header {
            kind: Kind::Abort,
            seq: 0x12,
            tag: 0x0102_0304_0506_0708,
            len: MAX_PAYLOAD,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        assert_eq!(
            b,
            [0xC4, 0x21, 0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 8, 7, 6, 5, 4, 3, 2, 1]
        );
    }

    #[test]
    fn rejects_bad_fields() {
        let h = Header {
            kind: Kind::Data,
            seq: 2,
            tag: 3,
            len: 4,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        let mut m = b;
        m[0] = b'X';
        assert_eq!(Header::decode(&m), Err(HeaderError::Magic(b'X')));
        let mut v = b;
        v[1] = 0x30;
        assert_eq!(Header::decode(&v), Err(HeaderError::Version(3)));
        let mut k = b;
        k[1] = 0x27;
        assert_eq!(Header::decode(&k), Err(HeaderError::Kind(7)));
        // The 40-byte header of version 1 is named as such.
        let mut old = [0u8; HEADER_LEN];
        old[..5].copy_from_slice(b"CHRS\x01");
        let e = Header::decode(&old).unwrap_err();
        assert_eq!(e, HeaderError::VersionOne);
        assert!(e.to_string().contains("older chorus"), "{e}");
    }

    #[test]
    fn abort_payload() {
        let p = encode_abort(Some(3), "rank 3 died");
        assert_eq!(decode_abort(&p), (Some(3), "rank 3 died".to_string()));
        assert_eq!(peer_text(b"a\nb\x1b[31mc\xff"), "a\\nb\\u{1b}[31mc\u{fffd}");
        // A right-to-left override, a line separator, a zero-width space, a tag character.
        assert_eq!(
            peer_text("x\u{202E}y\u{2028}z\u{200B}w\u{E0041}".as_bytes()),
            "x\\u{202e}y\\u{2028}z\\u{200b}w\\u{e0041}"
        );
        assert_eq!(peer_text("ünïcode ok".as_bytes()), "ünïcode ok");
        let p = encode_abort(None, &"x".repeat(10_000));
        assert_eq!(p.len(), MAX_ABORT_PAYLOAD);
        assert_eq!(decode_abort(&p).0, None);
        // Cut before a character that would not fit whole: no replacement character.
        let long = format!("{}é and more", "x".repeat(MAX_ABORT_PAYLOAD - 9));
        let (_, text) = decode_abort(&encode_abort(None, &long));
        assert_eq!(text, "x".repeat(MAX_ABORT_PAYLOAD - 9));
    }
}
