//! Building the full mesh of TCP connections through the rendezvous store.
//!
//! 1. The store host (rank 0 unless configured otherwise) starts the store; everyone connects.
//! 2. Rank 0 draws a random communicator id and publishes it.
//! 3. Every rank listens on its chosen address and publishes `addr/<rank>` = `ip:port` and
//!    `host/<rank>` = its host identity (hostname + boot id).
//! 4. Rank `i` connects to every rank `j < i` and accepts from every `j > i`. A connection opens
//!    with a 24-byte hello (magic `CHRH`, version, communicator id, from, to) and then the
//!    authentication handshake of [`crate::rendezvous`] with the context
//!    `data/<comm_id>/<from>/<to>`. Accepted connections are checked on their own threads, so a
//!    client that sends garbage or nothing is dropped (and logged) without delaying the job.

use std::collections::HashSet;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{TcpOptions, TcpTransport};
use crate::rendezvous::{
    accept_handshake_admitting, connect_handshake_or_retry, read_exact_before, StoreClient,
    StoreServer,
};
use crate::{Result, TransportError};

const HELLO_MAGIC: [u8; 4] = *b"CHRH";
/// The hello carries the wire version of the frames that follow, so ranks of releases with
/// different frames fail at connection time, not at their first message.
const HELLO_VERSION: u32 = crate::frame::VERSION as u32;
const HELLO_LEN: usize = 24;
/// How long an accepted connection may take to say hello and authenticate.
const HANDSHAKE_BUDGET: Duration = Duration::from_secs(10);

/// What [`connect`] needs.
#[derive(Clone, Debug)]
pub struct MeshOptions {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Address of the rendezvous store.
    pub store_addr: SocketAddr,
    /// Shared secret (may be empty: protocol check only).
    pub token: Vec<u8>,
    /// Local address to listen on for data connections.
    pub listen_ip: IpAddr,
    /// Whether `listen_ip` (then loopback) holds only when every rank runs on this host
    /// (the root's name resolved to a loopback address here, and the launcher did not say
    /// that the job stays on one host): otherwise the rank listens on the address of its
    /// route to a rank on another host, learnt from the store.
    pub listen_beyond_host: bool,
    /// Whether this rank starts the store at `store_addr`.
    pub host_store: bool,
    /// Where a store this rank hosts listens, when not at `store_addr` (the unspecified
    /// address and its port: every interface, for a root whose name resolves to loopback
    /// here and that other hosts reach by another address).
    pub store_bind: Option<SocketAddr>,
    /// Deadline for the whole rendezvous.
    pub timeout: Duration,
    /// Tunables of the resulting transport.
    pub tcp: TcpOptions,
}

impl MeshOptions {
    /// Rank `rank` of `size` on this host: the store at `store_addr` (hosted elsewhere),
    /// listening on 127.0.0.1, 30 s to connect, the default TCP options.
    pub fn loopback(rank: usize, size: usize, store_addr: SocketAddr, token: &[u8]) -> Self {
        MeshOptions {
            rank,
            size,
            store_addr,
            token: token.to_vec(),
            listen_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            listen_beyond_host: false,
            host_store: false,
            store_bind: None,
            timeout: Duration::from_secs(30),
            tcp: TcpOptions::default(),
        }
    }
}

/// What the rendezvous leaves behind besides the transport.
pub struct Rendezvous {
    /// The store server, if this rank hosts it (kept alive with the communicator).
    pub server: Option<StoreServer>,
    /// This rank's store connection.
    pub store: StoreClient,
    /// The communicator id.
    pub comm_id: u64,
    /// Host identity of every rank ([`host_identity`]), for same-host detection.
    pub hosts: Vec<String>,
    /// The data address every rank listens on.
    pub addrs: Vec<SocketAddr>,
}

/// This host's identity: `CHORUS_HOSTID` if set, else hostname, boot id, network namespace
/// and PID namespace. Ranks with equal identities may share memory. The network namespace is
/// part of it because separate namespaces stand for separate hosts (containers, the namespace
/// testbed), whose traffic must cross their links; the PID namespace because a peer's
/// segment is opened through `/proc/<pid>/fd`, which names another process in another PID
/// namespace (containers that share the host's network, `docker --network host`, still
/// talk over TCP).
pub fn host_identity() -> String {
    if let Ok(id) = std::env::var("CHORUS_HOSTID") {
        if !id.trim().is_empty() {
            return id.trim().to_string();
        }
    }
    let mut id = format!(
        "{}|{}|{}",
        machine_identity(),
        namespace("net"),
        namespace("pid")
    );
    if let Some(theirs) = proc_pid_elsewhere() {
        // This process's `/proc` is another PID namespace's (`unshare --pid` without a new
        // `/proc`): the shared-memory segments, opened through `/proc/<pid>/fd`, cannot be
        // reached from here, so this rank is a host of its own (TCP to every peer). Said
        // once per process.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            crate::note!(
                "/proc here counts processes of another PID namespace (this one is {theirs} \
             there, {} here): no shared memory with the ranks of this host",
                std::process::id()
            )
        });
        id.push_str(&format!("|alone:{theirs}"));
    }
    id
}

/// This process's id as `/proc` counts it, where that differs from its own (`/proc` is
/// another PID namespace's); `None` where they agree or `/proc` cannot tell.
fn proc_pid_elsewhere() -> Option<String> {
    let seen = std::fs::read_link("/proc/self").ok()?;
    let seen = seen.to_string_lossy().into_owned();
    (seen.parse::<u32>().ok()? != std::process::id()).then_some(seen)
}

/// This machine's network: the boot id and the network namespace, whatever `CHORUS_HOSTID`
/// or the host name (a UTS namespace's) say: ranks that share it share a loopback.
pub fn network_identity() -> String {
    format!(
        "{}|{}",
        proc_text("/proc/sys/kernel/random/boot_id"),
        namespace("net")
    )
}

/// This process's namespace of `kind` (`net` gives `net:[inode]`), or "" where it cannot be
/// read.
fn namespace(kind: &str) -> String {
    std::fs::read_link(format!("/proc/self/ns/{kind}"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The trimmed text of a `/proc` file, or "" where it cannot be read.
fn proc_text(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The physical machine: hostname and boot id (equal across network namespaces). Used to
/// count the ranks that share this machine's cores.
pub fn machine_identity() -> String {
    format!(
        "{}/{}",
        proc_text("/proc/sys/kernel/hostname"),
        proc_text("/proc/sys/kernel/random/boot_id")
    )
}

fn rdv(msg: impl Into<String>) -> TransportError {
    TransportError::Rendezvous(msg.into())
}

fn hello(comm_id: u64, from: usize, to: usize) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(&HELLO_MAGIC);
    h[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    h[8..16].copy_from_slice(&comm_id.to_le_bytes());
    h[16..20].copy_from_slice(&(from as u32).to_le_bytes());
    h[20..24].copy_from_slice(&(to as u32).to_le_bytes());
    h
}

fn context(comm_id: u64, from: usize, to: usize) -> String {
    format!("data/{comm_id:016x}/{from}/{to}")
}

/// Rendezvous through the store and connect a full mesh; returns the transport and the
/// rendezvous state.
pub fn connect(opts: &MeshOptions) -> Result<(TcpTransport, Rendezvous)> {
    connect_with(opts, None)
}

/// [`connect`] where this rank may already host the store: `server` (bound by the caller
/// before the others learned its address, as a communicator split does) is used and kept in
/// the returned [`Rendezvous`]; `opts.host_store` then does not apply. Without `server` this is
/// [`connect`].
pub fn connect_with(
    opts: &MeshOptions,
    server: Option<StoreServer>,
) -> Result<(TcpTransport, Rendezvous)> {
    let mut kept = server;
    let r = connect_keeping(opts, &mut kept);
    if let (Err(_), Some(server)) = (&r, kept.take()) {
        // This rank hosts the store and failed (a group size that differs from another
        // rank's, say): the store stays up a little longer, so that ranks still connecting
        // read why in it and fail saying so, rather than with a connection closed under them.
        linger_store(server, opts.timeout);
    }
    r
}

/// For a rank that cannot take part (its own configuration is invalid, `why`): joins the
/// rendezvous only to say so where the others wait for its address, so that they fail at
/// once naming it instead of waiting out their timeout. Hosts the store if `opts` says so
/// (and keeps it up a few seconds, for the others to read), publishes the communicator's id
/// if it is rank 0. Best effort, bounded by `opts.timeout`: what fails here is not reported
/// (the rank fails with its own error anyway).
pub fn announce_failure(opts: &MeshOptions, server: Option<StoreServer>, why: &str) {
    let mut kept = server;
    // Not the whole init timeout: this rank knows its error already, and a store that is not
    // up by then (its host failed too, and has exited) will not be.
    let deadline = crate::deadline_after(opts.timeout.min(ANNOUNCE_WITHIN));
    let announced = (|| -> Result<()> {
        let mut store = join_store(opts, &mut kept, deadline)?;
        // Only as the rank's one process: a second process given this rank (or another job
        // on this store) must not overwrite what the first one published.
        if store.add(&format!("claim/{}", opts.rank), 1)? != 1 {
            return Err(rdv(format!(
                "rank {} has joined this group already",
                opts.rank
            )));
        }
        if opts.rank == 0 {
            publish_comm_id(&mut store, opts.size)?;
        }
        let text = format!("error: rank {}: {why}", opts.rank);
        store.set(&format!("net/{}", opts.rank), text.as_bytes())?;
        store.set(&format!("addr/{}", opts.rank), text.as_bytes())?;
        Ok(())
    })();
    if let Err(e) = announced {
        crate::note!(
            "rank {}: could not tell the others why it fails: {e}",
            opts.rank
        );
    }
    if let Some(server) = kept.take() {
        linger_store(server, opts.timeout);
    }
}

/// How long [`announce_failure`] tries at most.
const ANNOUNCE_WITHIN: Duration = Duration::from_secs(10);

/// Starts the store if this rank hosts it (`server`, unless given) and connects to it.
fn join_store(
    opts: &MeshOptions,
    server: &mut Option<StoreServer>,
    deadline: Instant,
) -> Result<StoreClient> {
    if server.is_none() && opts.host_store {
        let bind = |at| StoreServer::bind_for_ranks(at, &opts.token, opts.size);
        *server = Some(match opts.store_bind {
            // (No fallback to the root's loopback address where this fails: ranks of other
            // hosts could not reach it, and would wait out their timeout.)
            Some(wide) => bind(wide)?,
            None => bind(opts.store_addr)?,
        });
    }
    // The hosted store's own address (its port, when asked for port 0), or the root's where
    // it listens on every address.
    let store_addr = server.as_ref().map_or(opts.store_addr, |s| {
        let at = s.local_addr();
        if at.ip().is_unspecified() {
            SocketAddr::new(opts.store_addr.ip(), at.port())
        } else {
            at
        }
    });
    let mut store = StoreClient::connect(store_addr, &opts.token, deadline)?;
    store.set_deadline(deadline);
    Ok(store)
}

/// Rank 0's part: a fresh communicator id and the group's size, for the others to read.
fn publish_comm_id(store: &mut StoreClient, size: usize) -> Result<u64> {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).map_err(|e| rdv(format!("getrandom: {e}")))?;
    let id = u64::from_le_bytes(b);
    let mut v = id.to_le_bytes().to_vec();
    v.extend((size as u64).to_le_bytes());
    store.set("comm_id", &v)?;
    Ok(id)
}

/// Keep `server` up for a few seconds (at most `timeout`) on a thread of its own, then drop
/// it: for a rank that hosts the store and failed during init, so that the others still
/// read the error it left there rather than a connection closed under them.
pub fn linger_store(server: StoreServer, timeout: Duration) {
    let linger = timeout.min(STORE_LINGER);
    let _ = std::thread::Builder::new()
        .name("chorus-store-linger".into())
        .spawn(move || {
            std::thread::sleep(linger);
            drop(server);
        });
}

/// How long a store whose host failed to connect stays up for the ranks still connecting.
const STORE_LINGER: Duration = Duration::from_secs(3);

/// [`connect_with`], the store it hosts (if any) in `server` until it is handed to the
/// rendezvous.
fn connect_keeping(
    opts: &MeshOptions,
    server: &mut Option<StoreServer>,
) -> Result<(TcpTransport, Rendezvous)> {
    let deadline = crate::deadline_after(opts.timeout);
    let (rank, size) = (opts.rank, opts.size);
    if size == 0 || rank >= size {
        return Err(TransportError::InvalidArgument(format!(
            "rank {rank} of size {size}"
        )));
    }
    let mut store = join_store(opts, server, deadline)?;
    let store_addr = store.addr();

    // Each rank joins once. A second process given the same rank (a launcher misconfigured,
    // or two jobs sharing one store address) is refused here, saying so, before it publishes
    // anything the others would take for the first one's (rank 0's id, an address).
    if store.add(&format!("claim/{rank}"), 1)? != 1 {
        return Err(rdv(format!(
            "rank {rank} has joined this group already: two processes were given rank {rank} \
             (or two jobs share the store at {store_addr})"
        )));
    }

    // Rank 0 publishes the communicator's id and its size; a rank given another size (a
    // unique id shared by ranks that passed different counts) says so where the others
    // wait for its address, and every rank fails at once naming it, instead of some forming a
    // smaller group silently and the rest waiting out their timeout. So does a rank that
    // fails otherwise before it published its address (it cannot listen, the store refuses
    // what it publishes): where the others wait for its address and network, and rank 0
    // where they wait for the communicator's id.
    let joined = (|| -> Result<(u64, TcpListener, SocketAddr)> {
        let comm_id = if rank == 0 {
            publish_comm_id(&mut store, size)?
        } else {
            let v = store
                .get("comm_id", deadline)
                .map_err(|e| absent_ranks(&mut store, size, e, Some(0)))?;
            if let Some(why) = v.strip_prefix(b"error: ") {
                return Err(rdv(crate::frame::peer_text(why)));
            }
            let word = |at: usize| -> Result<u64> {
                v.get(at..at + 8)
                    .filter(|_| v.len() == 16)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .ok_or_else(|| rdv("malformed communicator id in the store"))
            };
            let (id, theirs) = (word(0)?, word(8)?);
            if theirs != size as u64 {
                return Err(rdv(format!(
                    "rank {rank} was given a group of {size} ranks, rank 0 one of {theirs}: \
                     every rank must pass the same number of ranks"
                )));
            }
            id
        };
        store.set(&format!("host/{rank}"), host_identity().as_bytes())?;
        // Where this machine's network is (CHORUS_HOSTID aside): ranks that learn the hosts
        // first listen on loopback only if every rank shares it.
        let net = network_identity();
        let mine = format!("{net}#{}", u8::from(opts.listen_beyond_host));
        store.set(&format!("net/{rank}"), mine.as_bytes())?;
        let ip = listen_ip(opts, &mut store, &net, deadline)?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| {
            rdv(format!(
                "rank {rank} could not listen on {ip} for its data connections: {e} \
                 (CHORUS_SOCKET_IFNAME picks the interface)"
            ))
        })?;
        crate::deepen_backlog(&listener);
        let my_addr = listener
            .local_addr()
            .map_err(|e| TransportError::io(None, "getsockname", e))?;
        store.set(&format!("addr/{rank}"), my_addr.to_string().as_bytes())?;
        Ok((comm_id, listener, my_addr))
    })();
    let (comm_id, listener, my_addr) = match joined {
        Ok(j) => j,
        Err(e) => {
            let why = match &e {
                TransportError::Rendezvous(m) if m.starts_with("rank ") => m.clone(),
                other => format!("rank {rank} failed to join: {other}"),
            };
            let said = format!("error: {why}");
            let mut keys = vec![format!("net/{rank}"), format!("addr/{rank}")];
            if rank == 0 {
                keys.push("comm_id".into());
            }
            // Best effort, each bounded: the store itself may be what failed.
            for key in keys {
                let _ = store.set(&key, said.as_bytes());
            }
            return Err(e);
        }
    };

    // What every rank published, a request or so per row (each waited for in rank order).
    let mut addrs = Vec::with_capacity(size);
    store
        .get_each("addr/", 0..size, deadline, |j, a| {
            addrs.push(parse_peer_addr(j, &a)?);
            Ok(())
        })
        .map_err(|e| absent_ranks(&mut store, size, e, Some(addrs.len())))?;
    let mut hosts = Vec::with_capacity(size);
    store.get_each("host/", 0..size, deadline, |_, h| {
        hosts.push(String::from_utf8_lossy(&h).into_owned());
        Ok(())
    })?;
    // Their networks, for the hint below: needed only where a loopback address is involved
    // (no more store requests for a job across hosts).
    let involved = |j: usize| addrs[j].ip().is_loopback() || my_addr.ip().is_loopback();
    let mut nets = vec![String::new(); size];
    if (0..size).any(involved) {
        store.get_each("net/", 0..size, deadline, |j, n| {
            if involved(j) {
                let n = String::from_utf8_lossy(&n);
                nets[j] = n.rsplit_once('#').map_or(&*n, |(id, _)| id).to_string();
            }
            Ok(())
        })?;
    }

    // Accept from higher ranks on a background thread while connecting to lower ones.
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<(usize, TcpStream)>();
    let acceptor = {
        let stop = stop.clone();
        let token = opts.token.clone();
        listener
            .set_nonblocking(true)
            .map_err(|e| TransportError::io(None, "set_nonblocking", e))?;
        std::thread::Builder::new()
            .name(format!("chorus-accept-{rank}"))
            .spawn(move || accept_loop(listener, rank, size, comm_id, token, tx, stop, deadline))
            .map_err(|e| TransportError::io(None, "spawn acceptor", e))?
    };

    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let result = (|| -> Result<()> {
        // A rank in another network (another machine or network namespace) that listens on
        // a loopback address (CHORUS_SOCKET_IFNAME=lo, say) cannot be reached: said when the
        // wait for it ends. (Not by the host identity, which CHORUS_HOSTID or a PID namespace
        // makes differ on one network.)
        let known = |id: &str| id.split('|').all(|part| !part.is_empty());
        let elsewhere = |j: usize| known(&nets[j]) && known(&nets[rank]) && nets[j] != nets[rank];
        for (j, addr) in addrs.iter().enumerate().take(rank) {
            match dial(*addr, comm_id, rank, j, &opts.token, deadline) {
                Ok(st) => streams[j] = Some(st),
                // (Refused, or timed out, depending on what the other network does with
                // packets to its own loopback address.)
                Err(e @ (TransportError::Timeout { .. } | TransportError::Io { .. }))
                    if addr.ip().is_loopback() && elsewhere(j) =>
                {
                    return Err(rdv(format!(
                        "rank {rank}: {e}; rank {j} is on another host (or network namespace) \
                         and listens at {addr}, a loopback address (its CHORUS_SOCKET_IFNAME \
                         picks lo?), which this one cannot reach"
                    )))
                }
                Err(e) => return Err(e),
            }
        }
        let mut missing: HashSet<usize> = (rank + 1..size).collect();
        while !missing.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let mut m: Vec<_> = missing.iter().copied().collect();
                m.sort_unstable();
                let away: Vec<usize> = m.iter().copied().filter(|&j| elsewhere(j)).collect();
                let mine = addrs[rank];
                let hint = if away.is_empty() || !mine.ip().is_loopback() {
                    String::new()
                } else {
                    format!(
                        "; ranks {away:?} are on other hosts (or network namespaces), and this \
                         rank listens at {mine}, a loopback address (CHORUS_SOCKET_IFNAME picks \
                         lo?), which they cannot reach"
                    )
                };
                return Err(rdv(format!(
                    "rank {rank}: ranks {m:?} did not connect within the timeout{hint}"
                )));
            }
            match rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok((j, s)) if missing.remove(&j) => streams[j] = Some(s),
                Ok((j, _)) => {
                    crate::note!("rank {rank}: duplicate connection from rank {j} dropped")
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // The acceptor stops at the deadline: within a moment of it, this is the
                    // deadline (said above, naming the ranks), not an acceptor gone early.
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left < Duration::from_millis(200) {
                        std::thread::sleep(left);
                        continue;
                    }
                    return Err(rdv("acceptor thread ended early"));
                }
            }
        }
        Ok(())
    })();
    stop.store(true, Ordering::Relaxed);
    let _ = acceptor.join();
    result?;
    let transport = TcpTransport::from_streams(rank, comm_id, streams, &opts.tcp)?;
    // The store outlives this rendezvous (settings agreed, shared memory set up, splits): its
    // later requests carry deadlines of their own, not this one.
    store.clear_deadline();
    Ok((
        transport,
        Rendezvous {
            server: server.take(),
            store,
            comm_id,
            hosts,
            addrs,
        },
    ))
}

/// The address this rank listens on for data connections: `opts.listen_ip`, unless
/// `opts.listen_beyond_host` and some rank's network (`net/{j}` in the store: its network
/// identity, `#1` if it chooses this way too) is not this one's (`net`): then the address of
/// this host's route to the first such rank that does not choose this way (it publishes its
/// address without waiting). Ranks of other networks that all choose this way (they too
/// reached the root through a loopback name) are an error at once.
fn listen_ip(
    opts: &MeshOptions,
    store: &mut StoreClient,
    net: &str,
    deadline: Instant,
) -> Result<IpAddr> {
    if !opts.listen_beyond_host {
        return Ok(opts.listen_ip);
    }
    let mut elsewhere = None;
    let mut waiting = Vec::new();
    let mut read = 0;
    // (One request or so for the row: every rank publishes its network before it looks.)
    store
        .get_each("net/", 0..opts.size, deadline, |j, n| {
            read = j + 1;
            if let Some(why) = n.strip_prefix(b"error: ") {
                return Err(rdv(crate::frame::peer_text(why)));
            }
            if elsewhere.is_some() {
                return Ok(());
            }
            let n = String::from_utf8_lossy(&n);
            let (theirs, chooses) = n.rsplit_once('#').unwrap_or((&n, "0"));
            if theirs == net {
                return Ok(());
            }
            if chooses == "1" {
                waiting.push(j);
            } else {
                elsewhere = Some(j);
            }
            Ok(())
        })
        .map_err(|e| absent_ranks(store, opts.size, e, Some(read)))?;
    let Some(j) = elsewhere else {
        if waiting.is_empty() {
            return Ok(opts.listen_ip);
        }
        return Err(rdv(format!(
            "ranks {waiting:?}, on other hosts, also reached the rendezvous root through a name \
             that resolves to a loopback address: set CHORUS_ADDR (or MASTER_ADDR) to an \
             address every host reaches, or CHORUS_SOCKET_IFNAME"
        )));
    };
    let a = peer_addr(store, j, deadline)?;
    let ip = crate::ifaddr::select(None, a)?;
    if ip.is_loopback() {
        return Err(rdv(format!(
            "rank {j}, on another host, listens on {a}, a loopback address: the root's name \
             resolves to a loopback address there too; set CHORUS_ADDR (or MASTER_ADDR) to an \
             address every host reaches, or CHORUS_SOCKET_IFNAME"
        )));
    }
    crate::note!(
        "rank {}: the rendezvous root's name resolves to a loopback address here and rank {j} \
         runs on another host: listening on {ip}",
        opts.rank
    );
    Ok(ip)
}

/// The data address rank `j` published (waiting for it until `deadline`), or the error it
/// left there instead.
fn peer_addr(store: &mut StoreClient, j: usize, deadline: Instant) -> Result<SocketAddr> {
    let a = store
        .get(&format!("addr/{j}"), deadline)
        .map_err(|e| waiting_for(e, j))?;
    parse_peer_addr(j, &a)
}

/// Rank `j`'s published data address `a`, or the error it left there instead.
fn parse_peer_addr(j: usize, a: &[u8]) -> Result<SocketAddr> {
    if let Some(why) = a.strip_prefix(b"error: ") {
        return Err(rdv(crate::frame::peer_text(why)));
    }
    std::str::from_utf8(a)
        .ok()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .ok_or_else(|| rdv(format!("rank {j} published a malformed address")))
}

/// A wait on the store for something every rank publishes (`comm_id`, `addr/j`...) that
/// ended at the deadline: if ranks never claimed their place, the error names them, with the
/// store's address (a few more requests, on a failure path only, each bounded by a short
/// grace); otherwise the timeout names `stuck`, the rank whose record it waited for (one
/// that joined, then hung or failed without saying so).
fn absent_ranks(
    store: &mut StoreClient,
    size: usize,
    e: TransportError,
    stuck: Option<usize>,
) -> TransportError {
    let TransportError::Timeout { peer: None, waited } = e else {
        return e;
    };
    let e = TransportError::Timeout {
        peer: stuck.filter(|&j| j < size),
        waited,
    };
    // (The client's bound is the instant given plus DEADLINE_GRACE.)
    store.set_deadline(
        Instant::now() + ABSENT_QUERY_GRACE.saturating_sub(crate::rendezvous::DEADLINE_GRACE),
    );
    let mut missing = Vec::new();
    for k in 0..size {
        // Adding 0 reads the count without claiming anything.
        match store.add(&format!("claim/{k}"), 0) {
            Ok(0) => missing.push(k),
            Ok(_) => {}
            Err(_) => return e,
        }
    }
    if missing.is_empty() {
        return e;
    }
    TransportError::NotJoined {
        missing,
        size,
        store: store.addr(),
        waited,
    }
}

/// How long [`absent_ranks`] may take to ask the store who joined.
const ABSENT_QUERY_GRACE: Duration = Duration::from_secs(2);

/// Connects to rank `to`'s data port `addr` and authenticates (retrying while it is refused
/// or shut down mid-handshake, until `deadline`); every error names `to`.
fn dial(
    addr: SocketAddr,
    comm_id: u64,
    from: usize,
    to: usize,
    token: &[u8],
    deadline: Instant,
) -> Result<TcpStream> {
    dial_tries(addr, comm_id, from, to, token, deadline).map_err(|e| match waiting_for(e, to) {
        // The handshake's own errors do not know whom they were talking to.
        TransportError::Rendezvous(m) if !names_rank(&m, to) => {
            TransportError::Rendezvous(format!("rank {to} at {addr}: {m}"))
        }
        e => e,
    })
}

/// `e`, a timeout naming rank `j` where it named nobody.
fn waiting_for(e: TransportError, j: usize) -> TransportError {
    match e {
        TransportError::Timeout { peer: None, waited } => TransportError::Timeout {
            peer: Some(j),
            waited,
        },
        e => e,
    }
}

/// Whether `text` names rank `j` ("rank 1", not "rank 12").
fn names_rank(text: &str, j: usize) -> bool {
    let at = format!("rank {j}");
    text.match_indices(&at)
        .any(|(i, _)| !text[i + at.len()..].starts_with(|c: char| c.is_ascii_digit()))
}

fn dial_tries(
    addr: SocketAddr,
    comm_id: u64,
    from: usize,
    to: usize,
    token: &[u8],
    deadline: Instant,
) -> Result<TcpStream> {
    let (mut backoff, start) = (Duration::from_millis(5), Instant::now());
    // The last try shut down mid-handshake, and when the first was.
    let mut shut_down: Option<(TransportError, Instant)> = None;
    // When the tries began to be refused (the peer listened before it published `addr`: a
    // refusal means its listener is gone).
    let mut refused_since: Option<Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            if let Some((e, _)) = shut_down {
                // The tries were shut down mid-handshake: say so rather than "timed out".
                return Err(e);
            }
            return Err(TransportError::Timeout {
                peer: Some(to),
                waited: start.elapsed(),
            });
        }
        match TcpStream::connect_timeout(&addr, left) {
            Ok(s) if crate::rendezvous::is_self_connected(&s) => {
                // A peer of this host that is gone left its port free, and the kernel joined
                // this socket to itself (a simultaneous open): as refused, try again.
                drop(s);
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Ok(mut s) => {
                refused_since = None;
                s.set_nodelay(true)
                    .map_err(|e| TransportError::io(Some(to), "setsockopt", e))?;
                s.set_write_timeout(Some(left))
                    .map_err(|e| TransportError::io(Some(to), "setsockopt", e))?;
                // A peer at its limit of connections mid-handshake (a flood of silent ones)
                // shuts the oldest down, perhaps this one: a new connection may get in.
                let outcome = match s.write_all(&hello(comm_id, from, to)) {
                    Err(e) => {
                        let closed = matches!(
                            e.kind(),
                            std::io::ErrorKind::ConnectionReset
                                | std::io::ErrorKind::ConnectionAborted
                                | std::io::ErrorKind::BrokenPipe
                                | std::io::ErrorKind::UnexpectedEof
                        );
                        Err((TransportError::io(Some(to), "hello", e), closed))
                    }
                    Ok(()) => connect_handshake_or_retry(
                        &mut s,
                        token,
                        context(comm_id, from, to).as_bytes(),
                        deadline,
                    ),
                };
                match outcome {
                    Ok(()) => {}
                    // For a while (a flood passes), and not past the deadline.
                    Err((e, true)) => {
                        let first = shut_down.map_or_else(Instant::now, |(_, at)| at);
                        if !crate::rendezvous::retry_after_shutdown(first, deadline) {
                            return Err(e);
                        }
                        let left = deadline.saturating_duration_since(Instant::now());
                        shut_down = Some((e, first));
                        drop(s);
                        std::thread::sleep(backoff.min(left));
                        backoff = (backoff * 2).min(Duration::from_millis(200));
                        continue;
                    }
                    Err((e, _)) => {
                        // Into the deadline after earlier tries were shut down: those say more.
                        let late = matches!(e, TransportError::Timeout { .. })
                            && Instant::now() >= deadline;
                        return match shut_down {
                            Some((earlier, _)) if late => Err(earlier),
                            _ => Err(e),
                        };
                    }
                }
                s.set_write_timeout(None)
                    .map_err(|e| TransportError::io(Some(to), "setsockopt", e))?;
                s.set_read_timeout(None)
                    .map_err(|e| TransportError::io(Some(to), "setsockopt", e))?;
                return Ok(s);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::TimedOut
                ) =>
            {
                if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    // Refused for a while: the peer exited, or gave up its init, after it
                    // published its address (a flood or a restart of the network stack
                    // passes within the window). Said now, naming it, not at the deadline.
                    let first = *refused_since.get_or_insert_with(Instant::now);
                    if !crate::rendezvous::retry_after_shutdown(first, deadline) {
                        let why = format!(
                            "its data port {addr} has refused connections for {:.0} s: rank \
                             {to} exited or gave up its init after publishing its address (its \
                             own error says why)",
                            first.elapsed().as_secs_f64()
                        );
                        return Err(TransportError::io(
                            Some(to),
                            "connect",
                            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, why),
                        ));
                    }
                }
                std::thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
            Err(e) => return Err(TransportError::io(Some(to), "connect", e)),
        }
    }
}

/// Incoming data connections not yet authenticated, oldest first: each with its id and a
/// handle to shut it down. At most [`pending_limit`] of them; a connection arriving when
/// they are all taken shuts the oldest down, so that connections that stay silent (or stall
/// mid-handshake) cannot keep a peer out, however many there are: a peer sends its hello as
/// soon as it connects and authenticates in one round trip. A connection leaves the registry
/// (under its lock) once its peer has proven itself and before it is told so, so no peer
/// told it is in finds its connection shut down.
type Pending = std::sync::Mutex<std::collections::VecDeque<(u64, TcpStream)>>;

fn lock(p: &Pending) -> std::sync::MutexGuard<'_, std::collections::VecDeque<(u64, TcpStream)>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

/// How many incoming data connections may be mid-handshake at once (one thread each).
fn pending_limit(size: usize) -> usize {
    4 * size + 64
}

#[allow(clippy::too_many_arguments)]
fn accept_loop(
    listener: TcpListener,
    rank: usize,
    size: usize,
    comm_id: u64,
    token: Vec<u8>,
    tx: mpsc::Sender<(usize, TcpStream)>,
    stop: Arc<AtomicBool>,
    deadline: Instant,
) {
    let token = Arc::new(token);
    let pending: Arc<Pending> = Arc::default();
    let mut next_id = 0u64;
    // Strangers and a shortage of descriptors are said a few times, not once a connection.
    let log = Arc::new(crate::rendezvous::LogLimiter::new(format!("rank {rank}")));
    while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        match listener.accept() {
            Ok((stream, from_addr)) => {
                let Ok(handle) = stream.try_clone() else {
                    crate::note!("rank {rank}: cannot keep a handle of {from_addr}, dropped");
                    continue;
                };
                let id = next_id;
                next_id += 1;
                let evicted = {
                    let mut p = lock(&pending);
                    let oldest = (p.len() >= pending_limit(size))
                        .then(|| p.pop_front())
                        .flatten();
                    p.push_back((id, handle));
                    oldest
                };
                // (Said with `pending` let go: a log line may block on a full stderr.)
                if let Some((_, oldest)) = evicted {
                    let who = oldest.peer_addr().map(|a| a.to_string());
                    let _ = oldest.shutdown(std::net::Shutdown::Both);
                    log.log(format_args!(
                        "{} connections mid-handshake, shutting down the oldest ({}) for \
                         {from_addr}",
                        pending_limit(size),
                        who.unwrap_or_else(|_| "?".into())
                    ));
                }
                let tx = tx.clone();
                let token = token.clone();
                let pending_c = pending.clone();
                let log = log.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("chorus-hs-{rank}"))
                    .spawn(move || {
                        let hs_deadline = (Instant::now() + HANDSHAKE_BUDGET).min(deadline);
                        // Proven: out of the registry, so never shut down for a newcomer
                        // (unless it was already, then the handshake fails).
                        let admit = || {
                            let mut p = lock(&pending_c);
                            let before = p.len();
                            p.retain(|(i, _)| *i != id);
                            p.len() < before
                        };
                        let result = check_incoming(
                            stream,
                            (rank, size, comm_id),
                            &token,
                            hs_deadline,
                            admit,
                        );
                        lock(&pending_c).retain(|(i, _)| *i != id);
                        match result {
                            Ok((j, s)) => {
                                let _ = tx.send((j, s));
                            }
                            Err(e) => log.log(format_args!(
                                "dropped data connection from {from_addr}: {e}"
                            )),
                        }
                    });
                if spawned.is_err() {
                    lock(&pending).retain(|(i, _)| *i != id);
                    crate::note!("rank {rank}: cannot spawn handshake thread");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                let hint = if e.raw_os_error() == Some(libc::EMFILE)
                    || e.raw_os_error() == Some(libc::ENFILE)
                {
                    " (out of file descriptors: raise `ulimit -n`; a job of p ranks needs \
                     about p per rank)"
                } else {
                    ""
                };
                log.log(format_args!("cannot accept data connections: {e}{hint}"));
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn check_incoming(
    mut s: TcpStream,
    (rank, size, comm_id): (usize, usize, u64),
    token: &[u8],
    deadline: Instant,
    admit: impl FnOnce() -> bool,
) -> Result<(usize, TcpStream)> {
    let io = |e| TransportError::io(None, "handshake", e);
    s.set_nonblocking(false).map_err(io)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    s.set_read_timeout(Some(left)).map_err(io)?;
    s.set_write_timeout(Some(left)).map_err(io)?;
    let mut h = [0u8; HELLO_LEN];
    read_exact_before(&mut s, &mut h, deadline, "hello")?;
    if h[0..4] != HELLO_MAGIC {
        return Err(rdv("not a chorus connection (bad hello magic)"));
    }
    let version = u32::from_le_bytes(h[4..8].try_into().expect("4"));
    if version != HELLO_VERSION {
        return Err(rdv(format!(
            "hello version {version} (another chorus release, with other data frames), this is {HELLO_VERSION}"
        )));
    }
    let id = u64::from_le_bytes(h[8..16].try_into().expect("8"));
    let from = u32::from_le_bytes(h[16..20].try_into().expect("4")) as usize;
    let to = u32::from_le_bytes(h[20..24].try_into().expect("4")) as usize;
    if id != comm_id {
        return Err(rdv(format!(
            "hello for communicator {id:#x}, this is {comm_id:#x}"
        )));
    }
    if to != rank || from <= rank || from >= size {
        return Err(rdv(format!(
            "hello from {from} to {to} is not expected here"
        )));
    }
    accept_handshake_admitting(
        &mut s,
        token,
        context(comm_id, from, to).as_bytes(),
        deadline,
        admit,
    )?;
    s.set_read_timeout(None).map_err(io)?;
    s.set_write_timeout(None).map_err(io)?;
    Ok((from, s))
}

/// `n` connected transports over loopback in this process (rank `i` at index `i`), for tests.
/// Move each into its own thread before using them together.
pub fn local_group(n: usize) -> Result<Vec<TcpTransport>> {
    let server = StoreServer::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), b"test")?;
    let addr = server.local_addr();
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            std::thread::spawn(move || {
                connect(&MeshOptions::loopback(rank, n, addr, b"test")).map(|(t, _)| t)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for h in handles {
        out.push(h.join().map_err(|_| rdv("rendezvous thread panicked"))??);
    }
    drop(server);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_that_learn_the_hosts_first_stay_on_loopback_on_one_host() {
        // What init asks for when the root's name resolves to loopback here and the job may
        // span hosts: rank 0's store on every address, each rank's listener chosen after the
        // hosts are known. All ranks on this host: loopback, and the mesh forms.
        let port = crate::rendezvous::free_local_ports(1).unwrap()[0];
        let root = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port);
        let hs: Vec<_> = (0..3)
            .map(|rank| {
                std::thread::spawn(move || {
                    connect(&MeshOptions {
                        listen_beyond_host: true,
                        host_store: rank == 0,
                        store_bind: Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)),
                        ..MeshOptions::loopback(rank, 3, root, b"t")
                    })
                    .map(|(_, r)| r.addrs)
                })
            })
            .collect();
        for h in hs {
            let addrs = h.join().unwrap().unwrap();
            assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
        }
    }

    #[test]
    fn silent_connections_do_not_keep_a_peer_out() {
        // Before rank 1 dials rank 0, more connections than rank 0 handshakes at once reach
        // its data port and say nothing. Rank 1 must still get in, long before they would
        // time out (HANDSHAKE_BUDGET).
        let got = crate::rendezvous::on_local_store(2, |rank, addr| {
            let start = Instant::now();
            let mut silent = Vec::new();
            if rank == 1 {
                let deadline = Instant::now() + Duration::from_secs(20);
                let mut store = StoreClient::connect(addr, b"t", deadline).unwrap();
                let a = store.get("addr/0", deadline).unwrap();
                let a: SocketAddr = std::str::from_utf8(&a).unwrap().parse().unwrap();
                for _ in 0..pending_limit(2) + 8 {
                    silent.push(TcpStream::connect(a).unwrap());
                }
            }
            let r = connect(&MeshOptions::loopback(rank, 2, addr, b"t"));
            drop(silent);
            (r.err().map(|e| e.to_string()), start.elapsed())
        });
        for (e, took) in &got {
            assert!(e.is_none(), "{got:?}");
            assert!(*took < HANDSHAKE_BUDGET / 2, "{got:?}");
        }
    }

    #[test]
    fn a_peer_whose_port_refuses_is_named_before_the_deadline() {
        // Rank 0 published its address, then exited: its port refuses connections.
        let gone = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = gone.local_addr().unwrap();
        drop(gone);
        let start = Instant::now();
        let e = dial(addr, 7, 1, 0, b"t", start + Duration::from_secs(120)).unwrap_err();
        // Not at the first refusal (a listener being replaced, a flood), not at the deadline.
        let took = start.elapsed();
        assert!(
            took > Duration::from_secs(8) && took < Duration::from_secs(30),
            "{e} after {took:?}"
        );
        assert_eq!(e.culprit(), Some(0), "{e}");
        assert!(e.to_string().contains("refused connections"), "{e}");
    }

    #[test]
    fn a_dial_shut_down_mid_handshake_tries_again() {
        // As a peer at its limit of connections mid-handshake does to the oldest: the first
        // connection is closed after its hello; the second is served. The dial gets in.
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let (comm_id, token) = (7u64, b"t".to_vec());
        let server = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(10);
            let (mut first, _) = listener.accept().unwrap();
            let mut h = [0u8; HELLO_LEN];
            std::io::Read::read_exact(&mut first, &mut h).unwrap();
            drop(first);
            let (mut second, _) = listener.accept().unwrap();
            std::io::Read::read_exact(&mut second, &mut h).unwrap();
            assert_eq!(h, hello(comm_id, 1, 0));
            crate::rendezvous::accept_handshake(
                &mut second,
                &token,
                context(comm_id, 1, 0).as_bytes(),
                deadline,
            )
            .map(|()| second)
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let dialed = dial(addr, comm_id, 1, 0, b"t", deadline);
        assert!(dialed.is_ok(), "{:?}", dialed.err());
        assert!(server.join().unwrap().is_ok());
        // A peer that keeps closing: the dial ends at its deadline with that reason.
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let t0 = Instant::now();
        let closer = std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            while t0.elapsed() < Duration::from_secs(1) {
                match listener.accept() {
                    Ok((c, _)) => drop(c),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        let e = dial(addr, comm_id, 1, 0, b"t", t0 + Duration::from_millis(600)).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        assert!(
            t0.elapsed() >= Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
        closer.join().unwrap();
    }

    #[test]
    fn a_rank_that_cannot_listen_fails_the_others_at_once() {
        // Rank 1 is told to listen on an address of no interface here (TEST-NET-1, which
        // nothing routes): it cannot, and rank 0 hears why from the store at once.
        if TcpListener::bind((Ipv4Addr::new(192, 0, 2, 1), 0)).is_ok() {
            eprintln!("note: 192.0.2.1 can be bound here (ip_nonlocal_bind?); nothing to test");
            return;
        }
        let got = crate::rendezvous::on_local_store(2, |rank, addr| {
            let start = Instant::now();
            let listen_ip = if rank == 1 {
                IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1))
            } else {
                IpAddr::V4(Ipv4Addr::LOCALHOST)
            };
            let r = connect(&MeshOptions {
                listen_ip,
                ..MeshOptions::loopback(rank, 2, addr, b"t")
            });
            (r.err().map(|e| e.to_string()), start.elapsed())
        });
        let (e0, took) = &got[0];
        let e0 = e0.as_deref().expect("rank 0 connected alone");
        assert!(
            e0.contains("rank 1 could not listen on 192.0.2.1"),
            "{got:?}"
        );
        assert!(*took < Duration::from_secs(10), "{got:?}");
    }

    #[test]
    fn a_rank_that_joined_and_went_silent_is_named_at_the_timeout() {
        // Rank 1 claims its place (and rank 0's id is there), then publishes nothing: rank
        // 0's wait for its address ends at the deadline naming it, and within a few seconds.
        let got = crate::rendezvous::on_local_store(2, |rank, addr| {
            let start = Instant::now();
            if rank == 1 {
                let deadline = start + Duration::from_secs(10);
                let mut c = StoreClient::connect(addr, b"t", deadline).unwrap();
                assert_eq!(c.add("claim/1", 1).unwrap(), 1);
                std::thread::sleep(Duration::from_secs(3));
                return (None, start.elapsed());
            }
            let r = connect(&MeshOptions {
                timeout: Duration::from_secs(1),
                ..MeshOptions::loopback(rank, 2, addr, b"t")
            });
            (r.err(), start.elapsed())
        });
        let (e, took) = &got[0];
        let e = e.as_ref().expect("rank 0 connected alone");
        assert!(
            matches!(e, TransportError::Timeout { peer: Some(1), .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("waiting for rank 1"), "{e}");
        assert!(*took < Duration::from_secs(6), "{took:?}");
    }

    #[test]
    fn a_rank_is_named_by_its_whole_number() {
        assert!(names_rank("rank 1 at x: y", 1));
        assert!(names_rank("from rank 1", 1));
        assert!(!names_rank("rank 12 at x", 1));
        assert!(names_rank("rank 12 and rank 1: y", 1));
        assert!(!names_rank("ranks 1", 1));
    }

    #[test]
    fn a_handshake_that_fails_names_the_peer() {
        // Whatever listens at rank 1's address answers the hello with garbage: the error
        // names rank 1 and its address (the handshake alone knows neither).
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = l.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = s.write_all(&[0x5a; 256]);
            std::thread::sleep(Duration::from_millis(200));
        });
        let deadline = Instant::now() + Duration::from_secs(3);
        let e = dial(addr, 7, 0, 1, b"t", deadline).unwrap_err();
        assert!(e.to_string().contains(&format!("rank 1 at {addr}")), "{e}");
        peer.join().unwrap();
    }
}
