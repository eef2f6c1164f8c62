//! Joining a communicator through a unique id, as NCCL's `ncclGetUniqueId` and
//! `ncclCommInitRank`: one process makes an id ([`UniqueId::new`]), hands its bytes to every
//! rank by whatever means it has (an MPI broadcast, a torch store, a file), and each rank builds
//! its communicator from it ([`Config::from_unique_id`], then [`Communicator::new`]).
//!
//! Making an id starts a rendezvous store in the making process, on a free port of an address
//! other hosts can reach (the interface of `CHORUS_SOCKET_IFNAME`, else the one that routes to
//! `CHORUS_ADDR` or `MASTER_ADDR` when a launcher set one, else the first that is neither
//! loopback nor docker, and loopback where there is no other:
//! [`chorus_transport::ifaddr::select_unrooted`]), with a fresh
//! random secret that authenticates every connection of the job. The id carries the store's
//! address and the secret. A rank of the job built in the making process takes the store over
//! (it lives as long as that communicator); otherwise the store stays until the process exits,
//! so the making process must outlive the job's init, as with NCCL.
//!
//! Layout (128 bytes): `chorusid` (8), version 1 (1), address length (1), the address as
//! `ip:port` (64, zero-padded), the secret (32), zeros (22).
//!
//! [`Communicator::new`]: crate::Communicator::new
//! [`Config::from_unique_id`]: crate::Config::from_unique_id

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Mutex;

use chorus_transport::rendezvous::StoreServer;

use crate::error::CommError;

/// Bytes in a [`UniqueId`].
pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &[u8; 8] = b"chorusid";
const VERSION: u8 = 1;
const ADDR_AT: usize = 10;
const ADDR_MAX: usize = 64;
const SECRET_AT: usize = ADDR_AT + ADDR_MAX;
const SECRET_LEN: usize = 32;

/// Stores made by [`UniqueId::new`] in this process and not yet taken over by a communicator,
/// by address.
static MADE: Mutex<Option<HashMap<String, StoreServer>>> = Mutex::new(None);

/// What every rank of a job needs to join it: the address of a rendezvous store and a secret.
/// See the [module documentation](self).
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl UniqueId {
    /// Make an id: start a rendezvous store in this process and draw a secret.
    ///
    /// Errors: `CHORUS_SOCKET_IFNAME` that matches no interface, no free port, no randomness.
    pub fn new() -> Result<UniqueId, CommError> {
        UniqueId::new_on(store_ip()?)
    }

    /// [`UniqueId::new`] with the store on `ip` (an address of this host every rank reaches;
    /// `127.0.0.1` for a job on one host).
    pub fn new_on(ip: IpAddr) -> Result<UniqueId, CommError> {
        let mut secret = [0u8; SECRET_LEN];
        getrandom::getrandom(&mut secret).map_err(|e| {
            CommError::new(
                crate::ErrorKind::System,
                "unique_id",
                format!("getrandom: {e}"),
            )
        })?;
        let server = StoreServer::bind(SocketAddr::new(ip, 0), hex(&secret).as_bytes())
            .map_err(|e| CommError::from_transport("unique_id", e))?;
        // The id's secret is its own: every rank that proves it is one of the job's, however
        // many (the size is not known yet).
        server.exempt_proven();
        let addr = server.local_addr().to_string();
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8] = VERSION;
        // An IPv6 address with its scope and port is at most 55 characters.
        bytes[9] = addr.len() as u8;
        bytes[ADDR_AT..ADDR_AT + addr.len()].copy_from_slice(addr.as_bytes());
        bytes[SECRET_AT..SECRET_AT + SECRET_LEN].copy_from_slice(&secret);
        MADE.lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(addr, server);
        Ok(UniqueId { bytes })
    }

    /// The id's bytes, to hand to the other ranks.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    /// An id from bytes another process made: checks the length, the magic, the version and
    /// the address (an invalid-argument error otherwise).
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId, CommError> {
        let bad = |why: &str| CommError::invalid("init", format!("not a chorus unique id: {why}"));
        let bytes: [u8; UNIQUE_ID_BYTES] = b
            .try_into()
            .map_err(|_| bad(&format!("{} bytes, need {UNIQUE_ID_BYTES}", b.len())))?;
        if &bytes[..8] != MAGIC {
            return Err(bad("wrong magic"));
        }
        if bytes[8] != VERSION {
            return Err(bad(&format!(
                "version {} (another chorus release), this is {VERSION}",
                bytes[8]
            )));
        }
        let n = usize::from(bytes[9]);
        let addr_ok = n <= ADDR_MAX
            && std::str::from_utf8(&bytes[ADDR_AT..ADDR_AT + n])
                .ok()
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .is_some_and(|a| a.port() != 0);
        if !addr_ok {
            return Err(bad("no store address"));
        }
        Ok(UniqueId { bytes })
    }

    /// The store's address, `ip:port`.
    pub(crate) fn root_addr(&self) -> String {
        let n = usize::from(self.bytes[9]).min(ADDR_MAX);
        String::from_utf8_lossy(&self.bytes[ADDR_AT..ADDR_AT + n]).into_owned()
    }

    /// The secret, as the token of every connection.
    pub(crate) fn token(&self) -> String {
        hex(&self.bytes[SECRET_AT..SECRET_AT + SECRET_LEN])
    }
}

impl std::fmt::Debug for UniqueId {
    /// The address only: the secret stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({})", self.root_addr())
    }
}

/// Where [`UniqueId::new`] hosts its store: the interface `CHORUS_SOCKET_IFNAME` names; else
/// the one that routes to the launcher's rendezvous host (`CHORUS_ADDR`, `MASTER_ADDR`), which
/// every rank reaches, unless that is a name resolving to loopback here; else the first that
/// is neither loopback nor docker.
fn store_ip() -> Result<IpAddr, CommError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let spec = var("CHORUS_SOCKET_IFNAME");
    if spec.is_none() {
        let host = var("CHORUS_ADDR").or_else(|| {
            var("MASTER_ADDR").map(|h| {
                let h = h.trim();
                if h.contains(':') && !h.starts_with('[') {
                    format!("[{h}]:1")
                } else {
                    format!("{h}:1")
                }
            })
        });
        // A name that resolves to loopback here (Debian's 127.0.1.1 for the host's own name)
        // says nothing of the hosts of the job: the other ranks may reach this one by
        // another address, so the store goes where an outside one would.
        let root = host.and_then(|h| {
            let r = h.trim().to_socket_addrs().ok()?.next()?;
            (!(r.ip().is_loopback() && crate::comm::names_a_host(h.trim()))).then_some(r)
        });
        if let Some(ip) = root.and_then(|r| chorus_transport::ifaddr::select(None, r).ok()) {
            return Ok(ip);
        }
    }
    chorus_transport::ifaddr::select_unrooted(spec.as_deref())
        .map_err(|e| CommError::from_transport("unique_id", e))
}

/// The store [`UniqueId::new`] made in this process at `addr`, if it is still here: the first
/// communicator built in this process through that id keeps it.
pub(crate) fn take_store(addr: &str) -> Option<StoreServer> {
    MADE.lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_mut()
        .and_then(|m| m.remove(addr))
}

/// Whether [`UniqueId::new`] made a store in this process at `addr` that is still here.
pub(crate) fn has_store(addr: &str) -> bool {
    MADE.lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .is_some_and(|m| m.contains_key(addr))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_garbage_is_refused() {
        let lo = IpAddr::from([127, 0, 0, 1]);
        let id = UniqueId::new_on(lo).unwrap();
        let back = UniqueId::from_bytes(id.as_bytes()).unwrap();
        assert_eq!(back, id);
        assert_eq!(back.token().len(), 2 * SECRET_LEN);
        assert!(back.root_addr().parse::<SocketAddr>().is_ok());
        assert!(!format!("{id:?}").contains(&id.token()));
        // Two ids: two stores, two secrets.
        let other = UniqueId::new_on(lo).unwrap();
        assert_ne!(other.token(), id.token());
        assert_ne!(other.root_addr(), id.root_addr());
        for (what, mut b) in [
            ("magic", *id.as_bytes()),
            ("version", *id.as_bytes()),
            ("length", *id.as_bytes()),
            ("address", *id.as_bytes()),
        ] {
            match what {
                "magic" => b[0] = b'x',
                "version" => b[8] = 9,
                "length" => b[9] = 200,
                _ => b[ADDR_AT] = b'z',
            }
            assert!(UniqueId::from_bytes(&b).is_err(), "{what}");
        }
        assert!(UniqueId::from_bytes(&[0u8; 12]).is_err());
        assert!(take_store(&id.root_addr()).is_some());
        assert!(take_store(&id.root_addr()).is_none());
        drop(take_store(&other.root_addr()));
    }
}
