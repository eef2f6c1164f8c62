//! The header every message carries on a byte stream.
//!
//! ```text
//! offset size field
//!      0    4 magic      b"CHRS"
//!      4    1 version    1
//!      5    1 kind       0 = data, 1 = abort notice
//!      6    2 reserved   0
//!      8    8 comm_id    communicator id agreed at rendezvous
//!     16    8 seq        per (sender, receiver) frame counter, starting at 0
//!     24    8 tag        the message tag
//!     32    8 len        payload bytes that follow
//! ```
//! All integers little-endian. The receiver validates every field before it reads a payload
//! byte: a wrong magic, version, communicator id or sequence number is a protocol error; a
//! length larger than the posted buffer is a mismatch — never an allocation.

/// Size of the header in bytes.
pub const HEADER_LEN: usize = 40;
/// The magic bytes.
pub const MAGIC: [u8; 4] = *b"CHRS";
/// Wire version.
pub const VERSION: u8 = 1;
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
    /// Communicator id.
    pub comm_id: u64,
    /// Sequence number.
    pub seq: u64,
    /// Tag.
    pub tag: u64,
    /// Payload length.
    pub len: u64,
}

/// Why a header was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeaderError {
    /// Not our magic.
    Magic([u8; 4]),
    /// Unknown version.
    Version(u8),
    /// Unknown kind or non-zero reserved bytes.
    Kind(u8),
    /// Reserved field not zero.
    Reserved(u16),
}

impl std::fmt::Display for HeaderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderError::Magic(m) => write!(f, "bad magic {m:02x?}"),
            HeaderError::Version(v) => write!(f, "unsupported wire version {v}"),
            HeaderError::Kind(k) => write!(f, "unknown frame kind {k}"),
            HeaderError::Reserved(r) => write!(f, "reserved field is {r:#x}, not 0"),
        }
    }
}

impl Header {
    /// Encode into `out`.
    pub fn encode(&self, out: &mut [u8; HEADER_LEN]) {
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = match self.kind {
            Kind::Data => 0,
            Kind::Abort => 1,
        };
        out[6..8].copy_from_slice(&0u16.to_le_bytes());
        out[8..16].copy_from_slice(&self.comm_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.seq.to_le_bytes());
        out[24..32].copy_from_slice(&self.tag.to_le_bytes());
        out[32..40].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Decode and check magic, version, kind and reserved bits.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, HeaderError> {
        let magic: [u8; 4] = b[0..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(HeaderError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(HeaderError::Version(b[4]));
        }
        let kind = match b[5] {
            0 => Kind::Data,
            1 => Kind::Abort,
            k => return Err(HeaderError::Kind(k)),
        };
        let reserved = u16::from_le_bytes([b[6], b[7]]);
        if reserved != 0 {
            return Err(HeaderError::Reserved(reserved));
        }
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().expect("8 bytes"));
        Ok(Header {
            kind,
            comm_id: u(8..16),
            seq: u(16..24),
            tag: u(24..32),
            len: u(32..40),
        })
    }
}

/// Encode an abort notice payload.
pub fn encode_abort(culprit: Option<usize>, reason: &str) -> Vec<u8> {
    let mut reason = reason.as_bytes();
    if reason.len() > MAX_ABORT_PAYLOAD - 8 {
        reason = &reason[..MAX_ABORT_PAYLOAD - 8];
    }
    let mut v = Vec::with_capacity(8 + reason.len());
    v.extend_from_slice(&culprit.map_or(u64::MAX, |c| c as u64).to_le_bytes());
    v.extend_from_slice(reason);
    v
}

/// Decode an abort notice payload.
pub fn decode_abort(p: &[u8]) -> (Option<usize>, String) {
    if p.len() < 8 {
        return (None, String::from_utf8_lossy(p).into_owned());
    }
    let c = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
    let culprit = if c == u64::MAX {
        None
    } else {
        usize::try_from(c).ok()
    };
    (culprit, String::from_utf8_lossy(&p[8..]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(comm_id: u64, seq: u64, tag: u64, len: u64, abort: bool) {
            let h = Header { kind: if abort { Kind::Abort } else { Kind::Data }, comm_id, seq, tag, len };
            let mut b = [0u8; HEADER_LEN];
            h.encode(&mut b);
            prop_assert_eq!(Header::decode(&b), Ok(h));
        }

        #[test]
        fn garbage_never_panics(b in proptest::array::uniform32(any::<u8>()), tail: [u8; 8]) {
            let mut full = [0u8; HEADER_LEN];
            full[..32].copy_from_slice(&b);
            full[32..].copy_from_slice(&tail);
            let _ = Header::decode(&full);
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let h = Header {
            kind: Kind::Data,
            comm_id: 1,
            seq: 2,
            tag: 3,
            len: 4,
        };
        let mut b = [0u8; HEADER_LEN];
        h.encode(&mut b);
        let mut m = b;
        m[0] = b'X';
        assert!(matches!(Header::decode(&m), Err(HeaderError::Magic(_))));
        let mut v = b;
        v[4] = 9;
        assert_eq!(Header::decode(&v), Err(HeaderError::Version(9)));
        let mut k = b;
        k[5] = 7;
        assert_eq!(Header::decode(&k), Err(HeaderError::Kind(7)));
        let mut r = b;
        r[6] = 1;
        assert_eq!(Header::decode(&r), Err(HeaderError::Reserved(1)));
    }

    #[test]
    fn abort_payload() {
        let p = encode_abort(Some(3), "rank 3 died");
        assert_eq!(decode_abort(&p), (Some(3), "rank 3 died".to_string()));
        let p = encode_abort(None, &"x".repeat(10_000));
        assert_eq!(p.len(), MAX_ABORT_PAYLOAD);
        assert_eq!(decode_abort(&p).0, None);
    }
}
