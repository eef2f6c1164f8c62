//! The communicator users hold.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use chorus_algorithms::allreduce::{self, Algorithm};
use chorus_algorithms::{CollCtx, DType, Element, ReduceOp};
use chorus_transport::hybrid::{self, Choice};
use chorus_transport::rendezvous::StoreServer;
use chorus_transport::shm::allreduce::Reducer;
use chorus_transport::shm::ShmOptions;
use chorus_transport::tcp::{self, MeshOptions, Rendezvous, TcpOptions};
use chorus_transport::{AbortNotice, Op, Request, Transport, TransportError, Wait};

/// The process something (a communicator, a queue, a request) was made in: a child forked
/// since must not use it, as its connections, threads and calls are the parent's.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Process {
    pid: u32,
    forks: u64,
}

impl Process {
    /// This process (installing the fork counter on first use).
    pub(crate) fn this() -> Process {
        Process {
            pid: std::process::id(),
            forks: chorus_transport::fork_generation(),
        }
    }

    /// An invalid-usage error for `op` on `rank` in a child forked from this process: one
    /// atomic load when it is not one.
    pub(crate) fn check(&self, op: &'static str, rank: usize) -> Result<(), CommError> {
        if chorus_transport::fork_generation() == self.forks {
            return Ok(());
        }
        Err(CommError::new(
            ErrorKind::InvalidUsage,
            op,
            format!(
                "this communicator was made by process {}, and this is process {}, forked \
                 from it: a child cannot use its parent's communicator (its connections, threads \
                 and calls are the parent's); make a new one in the child",
                self.pid,
                std::process::id()
            ),
        )
        .at_rank(rank)
        .with_usable(false))
    }
}

/// Aborts a [`Communicator`] from any thread, also while a call runs on it (as
/// `ncclCommAbort`): get one with [`Communicator::abort_handle`] before handing the
/// communicator to the thread that may hang in it.
///
/// The running call (or, when none runs, the communicator's next call) tells every peer,
/// whose calls then fail at once naming this rank, and fails with an error; the communicator
/// is unusable afterwards. Over TCP a waiting call notices at once, over shared memory within
/// 10 ms (RDMA likewise); a call that is not waiting notices when it next waits or ends. A
/// split or dup connecting its new group stops waiting within 10 ms (the set-up goes on
/// alone until it connects or fails, bounded by the init timeout, and is dropped). Clones
/// share the request; the first reason wins.
#[derive(Clone, Debug)]
pub struct AbortHandle {
    inner: chorus_transport::AbortHandle,
    rank: usize,
}

impl AbortHandle {
    /// Request the abort, for `reason`.
    pub fn abort(&self, reason: &str) {
        self.inner.request(AbortNotice {
            culprit: None,
            reason: format!("rank {} aborted the communicator: {reason}", self.rank),
        });
    }

    /// Whether an abort was requested.
    pub fn is_requested(&self) -> bool {
        self.inner.is_requested()
    }

    /// Wake the transport from a poll (the queue's point-to-point progress), asking nothing.
    pub(crate) fn wake(&self) {
        self.inner.wake();
    }

    /// Whether the peers have been told (by a call that noticed the request, or by
    /// [`Communicator::abort`]).
    pub fn is_done(&self) -> bool {
        self.inner.acted()
    }
}

use crate::algo_spec::{AlgoSpec, Allowed};
use crate::config::{Config, MAX_WORLD_SIZE};
use crate::error::{CommError, ErrorKind};
use crate::log::{self, Level};
use crate::select::{self, AlgoFilter, LinkSource, Next, Selector, TrialPlan, Tuner};
use crate::tune_file::{self, Decision, Key, Section, TuneFile};

/// Per-call options of an allreduce.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AllReduceOptions {
    /// Force an algorithm (`None`: the selector decides).
    pub algorithm: Option<Algorithm>,
    /// Override the communicator's timeout for this call: at least 1 ms (`Duration::MAX` is
    /// no limit).
    pub timeout: Option<Duration>,
}

/// How an allreduce call takes part in tuning its size bucket (see [`crate::select`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timing {
    /// Not at all.
    None,
    /// It is an online trial: timed and recorded.
    Online,
    /// It is part of a revisit: recorded (the tuner leaves each block's untimed first call
    /// out); `rival`: it runs the rival.
    Revisit { rival: bool },
}

/// A group of ranks that run collectives together.
///
/// Collectives must be called by every rank in the same order with matching arguments (count,
/// dtype, op); a mismatch is detected and reported as [`ErrorKind::Mismatch`] on the ranks that
/// see it. Errors of the bad-argument kind leave the communicator usable (the refused call
/// still counts as this rank's: every rank makes the same calls, refused ones included; refused
/// on some ranks only, the next call fails as a mismatch); any error involving a
/// peer (lost, timed out, misbehaving) makes it unusable: this rank tells its peers (so they fail
/// fast, naming the rank at fault) and every later call fails.
pub struct Communicator {
    rank: usize,
    size: usize,
    config: Config,
    transport: Box<dyn Transport>,
    _rendezvous: Option<Rendezvous>,
    seq: u32,
    scratch: Vec<u8>,
    broken: Option<String>,
    /// The process that made it, and its fork generation (a child forked since must not use
    /// it: see `check_process`).
    process: Process,
    /// Aborts requested from other threads, installed in the transport.
    abort_handle: chorus_transport::AbortHandle,
    selector: Selector,
    /// Per-bucket online tuning of the allreduce schedule ([`crate::select`]).
    tuner: Tuner,
    /// Whether the allreduce schedule is tuned (`CHORUS_TUNE`, [`Communicator::set_tuning`]).
    tuning: bool,
    /// Where tuning decisions are kept across launches (`CHORUS_TUNE_FILE`).
    tune_file: Option<TuneState>,
    /// What `CHORUS_ALGO` allows the collectives other than the allreduce (whose choices
    /// live in the selector), resolved at init.
    algos: Allowed,
    /// Which communicator of this process it is (a compressor's state is tied to one).
    pub(crate) serial: u64,
}

/// The number of communicators this process made.
static COMMS_MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A communicator's tuning file ([`crate::tune_file`]).
struct TuneState {
    path: std::path::PathBuf,
    /// Its section for this communicator, as this communicator's decisions leave it (rank 0
    /// writes it after every change).
    section: Section,
    /// Rank 0's writer, which keeps the file's reads, writes and syncs out of the calls.
    writer: Option<TuneWriter>,
    /// Without a writer (its thread did not start): a write in the call failed and was
    /// reported (later failures are not).
    warned: bool,
}

/// Rank 0's writes of the tuning file, on a thread of their own: a decision is made inside a
/// call whose peers wait for it, and a slow or hung file system (NFS) must not hold them up.
/// The thread writes the newest section it has been given (older ones waiting are skipped);
/// dropping the writer waits (up to [`TUNE_WRITE_GRACE`]) for what was given, so that a
/// program's last decisions reach the file before it exits. (A process that exits without
/// dropping rank 0's communicator, `std::process::exit` or C's `exit` without
/// `chorus_comm_destroy`, may lose the decisions of its last moments.)
struct TuneWriter {
    tx: Option<std::sync::mpsc::Sender<Section>>,
    done: std::sync::mpsc::Receiver<()>,
    /// The process that started the thread (a forked child has no such thread).
    pid: u32,
}

/// How long dropping a communicator waits for its tuning file's last write.
const TUNE_WRITE_GRACE: Duration = Duration::from_secs(10);

impl TuneWriter {
    /// The writer of `path`, or `None` if its thread cannot start (rank 0 then writes in
    /// the call).
    fn start(path: std::path::PathBuf) -> Option<TuneWriter> {
        let (tx, rx) = std::sync::mpsc::channel::<Section>();
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("chorus-tune-file".into())
            .spawn(move || {
                let mut warned = false;
                while let Ok(mut section) = rx.recv() {
                    while let Ok(newer) = rx.try_recv() {
                        section = newer;
                    }
                    store_section(&path, section, &mut warned);
                }
                let _ = done_tx.send(());
            })
            .ok()?;
        Some(TuneWriter {
            tx: Some(tx),
            done,
            pid: std::process::id(),
        })
    }
}

impl Drop for TuneWriter {
    fn drop(&mut self) {
        self.tx.take();
        if std::process::id() == self.pid {
            let _ = self.done.recv_timeout(TUNE_WRITE_GRACE);
        }
    }
}

/// Writes rank 0's `section` into the tuning file at `path`; a failure is reported once
/// (`warned`) and fails nothing. The writes of this process go one at a time (each reads the
/// file, merges its section and replaces the file), so that the writers of a communicator and
/// its duplicates, which share the file, do not drop each other's sizes.
fn store_section(path: &std::path::Path, section: Section, warned: &mut bool) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Err(e) = TuneFile::store(path, section) {
        if !*warned {
            *warned = true;
            log::log(
                Level::Warn,
                Some(0),
                format_args!("tuning file {}: decisions not kept: {e}", path.display()),
            );
        }
    }
}

/// A store this rank hosts during init: dropped while still held (a step failed), it stays
/// up a few seconds on a thread of its own (`tcp::linger_store`).
struct Lingering(Option<chorus_transport::rendezvous::StoreServer>, Duration);

impl Drop for Lingering {
    fn drop(&mut self) {
        if let Some(server) = self.0.take() {
            tcp::linger_store(server, self.1);
        }
    }
}

/// A rank's own settings, read at init (see [`Communicator::build`]).
struct LocalSettings {
    choice: Choice,
    /// `CHORUS_TRANSPORT` as set, for the ranks' comparison of their choices (`rdma` runs as
    /// `auto` but is named as set).
    asked: String,
    filter: AlgoFilter,
    algos: crate::algo_spec::Allowed,
    env_link: (Option<f64>, Option<f64>),
    tuning: bool,
    tcp: TcpOptions,
}

/// This rank's settings from `config` and its `CHORUS_*` variables, each checked.
fn local_settings(config: &Config) -> Result<LocalSettings, CommError> {
    let (rank, size) = (config.rank, config.size);
    let choice = match config.transport.as_deref() {
        None => Choice::Auto,
        Some(s) if s.trim().eq_ignore_ascii_case("rdma") => {
            // Every rank of a host falls back alike (the reason is the host's: its library,
            // its devices): one warning from the job's first rank and from the first rank of
            // each host a launcher numbered, the others at INFO. Only what is logged is probed.
            let level = if rank == 0 || config.local_rank == Some(0) {
                Level::Warn
            } else {
                Level::Info
            };
            if size > 1 && log::enabled(level) {
                log::log(
                    level,
                    Some(rank),
                    format_args!("CHORUS_TRANSPORT=rdma: {}", rdma_fallback_reason()),
                );
            }
            Choice::Auto
        }
        Some(s) => Choice::parse(s).ok_or_else(|| {
            CommError::invalid(
                "init",
                format!("CHORUS_TRANSPORT={s:?}: expected tcp, shm, rdma or auto"),
            )
        })?,
    };
    let spec = config.algo.as_deref().unwrap_or("");
    let parsed = AlgoSpec::parse(spec).map_err(|e| CommError::invalid("init", e))?;
    let filter = AlgoFilter::from_spec(&parsed, spec)?;
    let algos = parsed.resolve();
    let env_link = crate::select::link_from_env()?;
    let env_link = crate::select::link_from_config(config, env_link)?;
    let tuning = crate::select::tune_from_env()?;
    let mut tcp = TcpOptions::default();
    if let Some(us) = env_parse::<u64>("CHORUS_TCP_SPIN_US")? {
        tcp.spin = Duration::from_micros(us);
    }
    tcp.socket_buffer = env_parse::<usize>("CHORUS_SOCKET_BUFFER")?;
    let quickack = std::env::var("CHORUS_TCP_QUICKACK").unwrap_or_default();
    if let Some(on) = crate::config::parse_switch("CHORUS_TCP_QUICKACK", &quickack)? {
        tcp.quickack = on;
    }
    if let Some(secs) = env_parse::<u64>("CHORUS_TCP_KEEPALIVE")? {
        tcp.keepalive = keepalive_of(secs)?;
    }
    let (congestion, required) = tcp_congestion_from_env()?;
    tcp.congestion = congestion;
    tcp.congestion_required = required;
    Ok(LocalSettings {
        choice,
        asked: config.transport.clone().unwrap_or_default(),
        filter,
        algos,
        env_link,
        tuning,
        tcp,
    })
}

/// Whether the store of a job rooted at `root` (as `config` names it) listens on every
/// address: the root's name resolves to a loopback address here (Debian maps a host's own
/// name to 127.0.1.1: torchrun's MASTER_ADDR on the first node) and the launcher did not say
/// the job stays on this host, so ranks of other hosts reach the root by another address.
fn store_beyond_host(config: &Config, root: SocketAddr) -> bool {
    root.ip().is_loopback()
        && names_a_host(&config.root_addr)
        && config.socket_ifname.is_none()
        && config.local_size != Some(config.size)
}

/// The unspecified address of `root`'s family, at its port.
fn every_address(root: SocketAddr) -> SocketAddr {
    let any: IpAddr = if root.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    SocketAddr::new(any, root.port())
}

/// For a rank of several whose own settings are invalid (`e`): tells the others, where they
/// wait for its address, so that they fail at once naming it (see
/// [`tcp::announce_failure`]). Hosts the store for that if this rank is its host: `server`,
/// or a new one (not where a [`crate::UniqueId`] of this process made one, which keeps
/// serving for a later communicator of the id).
fn announce_failure(config: &Config, server: Option<StoreServer>, e: &CommError) {
    // A size beyond the limit is itself the error (init refuses it): no store is raised with
    // limits sized for it.
    if config.size <= 1 || config.size > MAX_WORLD_SIZE || config.rank >= config.size {
        return;
    }
    let Ok(root) = resolve(&config.root_addr) else {
        return;
    };
    let beyond = store_beyond_host(config, root);
    let id_store = server.is_none() && crate::unique_id::has_store(&config.root_addr);
    let opts = MeshOptions {
        rank: config.rank,
        size: config.size,
        store_addr: root,
        token: config.token.clone().unwrap_or_default().into_bytes(),
        listen_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
        listen_beyond_host: beyond,
        host_store: config.hosts_store() && !id_store,
        store_bind: beyond.then(|| every_address(root)),
        timeout: config.init_timeout,
        tcp: TcpOptions::default(),
    };
    tcp::announce_failure(&opts, server, e.message());
}

/// Checks that every rank has the same `settings` at init, through the rendezvous store (keys
/// of this communicator, `comm_id`): each rank publishes its values, rank 0 compares them all
/// and publishes a verdict that every rank reads (O(p) store traffic). A setting is (name,
/// (compared, shown)): ranks must agree on the compared text, and a message quotes the shown
/// one. A difference fails init on every rank with an error naming the setting, the two ranks
/// and their values.
fn agree_on_settings(
    store: &mut chorus_transport::rendezvous::StoreClient,
    comm_id: u64,
    rank: usize,
    size: usize,
    settings: &[(&str, (String, String))],
    deadline: Instant,
) -> Result<(), CommError> {
    const SEP: char = '\u{1f}';
    let started = Instant::now();
    let io = |e| CommError::from_transport("init", e);
    // A wait for what rank `j` writes that times out names it (the mesh has formed: it
    // started, and exited or hangs since).
    let waiting_for = |j: usize| {
        move |e| match e {
            TransportError::Timeout { peer: None, waited } => CommError::from_transport(
                "init",
                TransportError::Timeout {
                    peer: Some(j),
                    waited,
                },
            ),
            e => CommError::from_transport("init", e),
        }
    };
    let mine: String = settings
        .iter()
        .map(|(n, (c, v))| format!("{n}={c}{SEP}{v}\n"))
        .collect();
    store
        .set(&format!("settings/{comm_id:x}/{rank}"), mine.as_bytes())
        .map_err(io)?;
    if rank == 0 {
        let mut verdict = String::from("ok");
        for j in 1..size {
            let theirs = match store.get(&format!("settings/{comm_id:x}/{j}"), deadline) {
                Ok(t) => t,
                Err(e) => {
                    // The others wait for the verdict: they fail naming rank j too, not this
                    // rank, whose verdict never came.
                    if matches!(e, TransportError::Timeout { .. }) {
                        let _ = store.set(
                            &format!("settings/{comm_id:x}/verdict"),
                            format!("{TIMED_OUT}{j}").as_bytes(),
                        );
                    }
                    return Err(waiting_for(j)(e));
                }
            };
            let theirs = String::from_utf8_lossy(&theirs);
            if theirs == mine {
                continue;
            }
            // (compared, shown) of setting `name` in a rank's text.
            let value = |text: &str, name: &str| -> (String, String) {
                let v = text
                    .lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
                    .unwrap_or("(missing)");
                let (c, s) = v.split_once(SEP).unwrap_or((v, v));
                (c.to_string(), s.to_string())
            };
            let Some((name, (_, shown))) = settings
                .iter()
                .find(|(n, (c, _))| value(&theirs, n).0 != *c)
            else {
                continue; // the same values, written alike
            };
            verdict = format!(
                "ranks disagree about {name}: rank 0 has {shown}, rank {j} has {}; set the same \
                 value on every rank",
                value(&theirs, name).1
            );
            break;
        }
        store
            .set(&format!("settings/{comm_id:x}/verdict"), verdict.as_bytes())
            .map_err(io)?;
    }
    // A little past the deadline: rank 0 writes a verdict when its own wait ends there (if it
    // started much later, this rank gives up first, blaming no rank: rank 0 may be waiting
    // for another one).
    // (The store's bound, init's deadline, moves with it for this wait, and back.)
    store.set_deadline(deadline + VERDICT_GRACE);
    let verdict = store.get(
        &format!("settings/{comm_id:x}/verdict"),
        deadline + VERDICT_GRACE,
    );
    store.set_deadline(deadline);
    let verdict = verdict.map_err(io)?;
    if verdict == b"ok" {
        return Ok(());
    }
    let timed_out = std::str::from_utf8(&verdict)
        .ok()
        .and_then(|v| v.strip_prefix(TIMED_OUT)?.parse::<usize>().ok())
        .filter(|&j| j < size);
    if let Some(j) = timed_out {
        return Err(waiting_for(j)(TransportError::Timeout {
            peer: None,
            waited: started.elapsed(),
        }));
    }
    Err(CommError::new(
        ErrorKind::Mismatch,
        "init",
        chorus_transport::frame::peer_text(&verdict),
    ))
}

/// How long past the init deadline the ranks wait for rank 0's verdict on the settings (which
/// it may write at that deadline).
const VERDICT_GRACE: Duration = Duration::from_secs(2);

/// Rank 0's verdict on the ranks' settings when rank `j`'s never came: `TIMED_OUT` then `j`.
const TIMED_OUT: &str = "timed out waiting for rank ";

/// What a collective is, in the tag of its messages (bits 24..32). Every collective has its
/// own kind so that ranks calling different collectives are told so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[allow(dead_code)] // kinds are reserved as the collectives land
pub(crate) enum CollKind {
    AllReduce = 1,
    Barrier = 2,
    Broadcast = 3,
    Reduce = 4,
    AllGather = 5,
    ReduceScatter = 6,
    AllToAll = 7,
    Gather = 8,
    Scatter = 9,
    SendRecv = 10,
    SparseAllReduce = 11,
    CompressedAllReduce = 12,
    /// A tuning trial of an allreduce schedule (on a scratch buffer).
    AllReduceTrial = 13,
    /// The agreement on the times of the tuning trials.
    Tuning = 14,
    /// The comparison of the ranks' calls (`CHORUS_CHECK_CALLS`).
    CallCheck = 15,
    AllGatherV = 16,
    AllToAllV = 17,
    /// The exchanges of [`Communicator::split`].
    Split = 18,
    ReduceScatterV = 19,
    GatherV = 20,
    ScatterV = 21,
    Scan = 22,
    ExScan = 23,
    /// A call refused before it knew its collective's arguments (a binding's check): what it
    /// brings to the comparison of calls ([`Communicator::skip_refused_call`]).
    Refused = 24,
}

impl CollKind {
    fn name(code: u64) -> &'static str {
        match code {
            1 => "all_reduce",
            2 => "barrier",
            3 => "broadcast",
            4 => "reduce",
            5 => "all_gather",
            6 => "reduce_scatter",
            7 => "all_to_all",
            8 => "gather",
            9 => "scatter",
            10 => "send/recv",
            11 => "sparse_all_reduce",
            12 => "compressed_all_reduce",
            13 => "all_reduce tuning trial",
            14 => "all_reduce tuning agreement",
            15 => "call check",
            16 => "all_gather_v",
            17 => "all_to_all_v",
            18 => "split",
            19 => "reduce_scatter_v",
            20 => "gather_v",
            21 => "scatter_v",
            22 => "scan",
            23 => "exscan",
            24 => "a call",
            _ => "unknown collective",
        }
    }
}

/// What identifies one collective call: its name in errors, kind, dtype, op, and its timeout
/// (`None`: the communicator's). Made once per call and handed to [`Communicator::refusable`],
/// [`Communicator::run_call`] and the rest, so that they cannot disagree.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub name: &'static str,
    pub kind: CollKind,
    pub dtype: DType,
    pub op: ReduceOp,
    pub timeout: Option<Duration>,
}

impl Call {
    /// A call with the communicator's timeout.
    pub(crate) fn new(name: &'static str, kind: CollKind, dtype: DType, op: ReduceOp) -> Call {
        Call {
            name,
            kind,
            dtype,
            op,
            timeout: None,
        }
    }

    /// The same call with its own timeout (`None`: the communicator's).
    pub(crate) fn with_timeout(self, timeout: Option<Duration>) -> Call {
        Call { timeout, ..self }
    }
}

/// Tag layout: step (bits 0..16), dtype (16..20), op (20..24), collective (24..32), call
/// fingerprint (32..48, [`call_bits`]), per-communicator collective sequence number (48..64,
/// modulo 2^16: it only has to tell a call from its neighbours).
pub(crate) fn tag_base(seq: u32, kind: CollKind, dtype: DType, op: ReduceOp) -> u64 {
    (((seq & SEQ_MASK) as u64) << 48)
        | ((kind as u64) << 24)
        | (((op as i32 as u64) & 0xf) << 20)
        | (((dtype as i32 as u64) & 0xf) << 16)
}

/// The bits of a tag that hold [`call_bits`].
const ARGUMENT_BITS: u64 = 0xffff << 32;

/// A [`Communicator::check_call`] record, for people: collective, dtype, op and arguments.
fn describe_record(rec: &[u8]) -> String {
    let dtype = DType::ALL
        .into_iter()
        .find(|d| *d as i32 == i32::from(rec[1]))
        .map_or("?", DType::name);
    let op = ReduceOp::from_i32(i32::from(rec[2])).map_or("?", ReduceOp::name);
    let args: Vec<u64> = (0..usize::from(rec[3]).min(3))
        .map(|k| u64::from_le_bytes(rec[8 + 8 * k..16 + 8 * k].try_into().expect("8 bytes")))
        .collect();
    let kind = u64::from(rec[0]);
    // What the first argument counts: the sparse allreduce passes its dense length; the
    // compressed one the bytes of its values widened to float32.
    let unit = match kind {
        k if k == CollKind::SparseAllReduce as u64 => " elements",
        k if k == CollKind::CompressedAllReduce as u64 => " bytes as float32",
        _ => " bytes",
    };
    let args = match args.as_slice() {
        [total, digest]
            if kind == CollKind::AllGatherV as u64 || kind == CollKind::ReduceScatterV as u64 =>
        {
            format!(", {total} bytes in all, counts digest {digest:#x}")
        }
        [] => String::new(),
        [b, forced, tuning] if kind == CollKind::AllReduce as u64 => {
            let schedule = match *forced {
                0 => "chosen by chorus".to_string(),
                f => allreduce::Algorithm::ALL
                    .get(f as usize - 1)
                    .map_or("?".to_string(), |a| format!("forced {}", a.name())),
            };
            let tuning = match *tuning {
                0 => ", tuning off",
                1 => ", tuning on",
                _ => "",
            };
            format!(", {b} bytes, schedule {schedule}{tuning}")
        }
        [root] if kind == CollKind::GatherV as u64 || kind == CollKind::ScatterV as u64 => {
            format!(", root {root}")
        }
        [b] => format!(", {b}{unit}"),
        [b, root] => format!(", {b}{unit}, root {root}"),
        more => format!(", arguments {more:?}"),
    };
    // Only the reducing collectives have an op.
    let reduces = [
        CollKind::AllReduce,
        CollKind::Reduce,
        CollKind::ReduceScatter,
        CollKind::CompressedAllReduce,
        CollKind::ReduceScatterV,
        CollKind::Scan,
        CollKind::ExScan,
    ]
    .iter()
    .any(|&k| k as u64 == kind);
    let op = if reduces {
        format!(", {op}")
    } else {
        String::new()
    };
    if kind == CollKind::Refused as u64 {
        return "a call that refused its arguments (see that rank's error)".into();
    }
    if rec[4] != 0 {
        return format!(
            "{} ({dtype}{op}), refused its arguments (see that rank's error)",
            CollKind::name(kind)
        );
    }
    format!("{} ({dtype}{op}{args})", CollKind::name(kind))
}

/// Whether two tags name the same call (collective, dtype, op, sequence number) with other
/// arguments ([`call_bits`]); their step bits may differ too.
fn only_arguments_differ(a: u64, b: u64) -> bool {
    let d = a ^ b;
    d & ARGUMENT_BITS != 0 && d & !0xffff & !ARGUMENT_BITS == 0
}

/// The bits of the sequence number a tag keeps.
const SEQ_MASK: u32 = 0xffff;

/// The call fingerprint of a tag: 16 bits mixed from the arguments every rank must pass alike
/// beyond dtype and op (byte counts, the root), in bits 32..48. Ranks that pass different
/// counts usually fail on message lengths already; the fingerprint also catches the calls
/// whose messages happen to have equal lengths (halving-doubling on 2 ranks with 1 and 2
/// elements, say), or roots that differ by a multiple of 256 (the step bits keep 8 bits of
/// the root), which would otherwise return wrong results, with 65535 chances in 65536
/// (`CHORUS_CHECK_CALLS` compares the arguments themselves).
pub(crate) fn call_bits(args: &[u64]) -> u64 {
    // splitmix64's finaliser over the arguments in order.
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15;
    for &a in args {
        h = (h ^ a).wrapping_add(0x9e37_79b9_7f4a_7c15);
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        h ^= h >> 31;
    }
    (h & 0xffff) << 32
}

fn describe_tag(tag: u64) -> String {
    let dtype = DType::from_i32(((tag >> 16) & 0xf) as i32).map_or("?", |d| d.name());
    let op = ReduceOp::from_i32(((tag >> 20) & 0xf) as i32).map_or("?", |o| o.name());
    format!(
        "{} #{} ({dtype}, {op}, arguments {:04x}, step {})",
        CollKind::name((tag >> 24) & 0xff),
        tag >> 48,
        (tag >> 32) & 0xffff,
        tag & 0xffff
    )
}

/// A group of one: every collective is local.
struct Lone;

impl Transport for Lone {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn name(&self) -> &'static str {
        "none"
    }
    fn post(&mut self, req: &mut Request) -> chorus_transport::Result<()> {
        Err(TransportError::InvalidArgument(format!(
            "peer {} in a group of one",
            req.peer()
        )))
    }
    fn progress(&mut self, ops: &mut [Op<'_, '_>], _wait: Wait) -> chorus_transport::Result<bool> {
        if ops.is_empty() {
            Ok(true)
        } else {
            Err(TransportError::InvalidArgument(
                "no peers in a group of one".into(),
            ))
        }
    }
    fn abort(&mut self, _notice: &AbortNotice) {}
}

/// How long rank 0 waits at init for the tuning file to be read before it goes on without it
/// (at most half the call timeout, which bounds the others' wait for it).
const TUNE_FILE_READ_LIMIT: Duration = Duration::from_secs(10);

/// Whether the host of `addr` (`host:port`, `[v6]:port`) is a name other than localhost's,
/// not an address: a name that may resolve to loopback on its own host only.
pub(crate) fn names_a_host(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let lower = host.to_ascii_lowercase();
    // Digits and dots only: an address in a short form (`127.1`), as the resolver reads it.
    let numeric = host.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    host.parse::<IpAddr>().is_err()
        && !numeric
        && !matches!(
            lower.as_str(),
            "localhost"
                | "localhost.localdomain"
                | "localhost4"
                | "localhost4.localdomain4"
                | "localhost6"
                | "localhost6.localdomain6"
                | "ip6-localhost"
                | "ip6-loopback"
        )
        && !lower.ends_with(".localhost")
}

fn resolve(addr: &str) -> Result<SocketAddr, CommError> {
    let mut addrs = addr.to_socket_addrs().map_err(|e| {
        CommError::invalid("init", format!("cannot resolve root address {addr:?}: {e}"))
    })?;
    let all: Vec<SocketAddr> = addrs.by_ref().collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| {
            CommError::invalid("init", format!("root address {addr:?} resolves to nothing"))
        })
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>, CommError> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            v.trim().parse().map(Some).map_err(|_| {
                CommError::invalid("init", format!("{name}={v:?} is not a valid value"))
            })
        }
        _ => Ok(None),
    }
}

/// `CHORUS_TCP_KEEPALIVE=secs`: whole seconds, at most a day; 0 leaves silent hosts to the
/// kernel (no keepalive).
fn keepalive_of(secs: u64) -> Result<Option<Duration>, CommError> {
    if secs > 86_400 {
        return Err(CommError::invalid(
            "init",
            format!("CHORUS_TCP_KEEPALIVE={secs}: at most 86400 seconds (0 turns it off)"),
        ));
    }
    Ok((secs > 0).then(|| Duration::from_secs(secs)))
}

/// The congestion control chorus asks for when `CHORUS_TCP_CONGESTION` is unset, where the
/// kernel has it. Collectives keep every connection busy at once in lockstep; with BBR (the
/// system default on the machine that measured this) 8–64 MiB allreduce on the 4-host 1 gbit
/// testbed reached 105–116 MB/s, with cubic 119.2–119.4 (3 alternating sweeps each).
pub const DEFAULT_TCP_CONGESTION: &str = "cubic";

/// `CHORUS_TCP_CONGESTION`: the TCP congestion control of every connection, and whether it is
/// required. A name (of `/proc/sys/net/ipv4/tcp_available_congestion_control`, e.g. `reno`)
/// is required: the mesh fails if the kernel refuses it. `system` keeps the system's default.
/// Unset or empty: [`DEFAULT_TCP_CONGESTION`] where the kernel allows it, else the default.
fn tcp_congestion_from_env() -> Result<(Option<String>, bool), CommError> {
    let v = std::env::var("CHORUS_TCP_CONGESTION").unwrap_or_default();
    parse_tcp_congestion(&v)
}

fn parse_tcp_congestion(v: &str) -> Result<(Option<String>, bool), CommError> {
    let name = v.trim();
    if name.is_empty() {
        return Ok((Some(DEFAULT_TCP_CONGESTION.to_string()), false));
    }
    if name == "system" {
        return Ok((None, false));
    }
    // TCP_CA_NAME_MAX is 16 bytes with the terminating NUL.
    if name.len() > 15 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(CommError::invalid(
            "init",
            format!(
                "CHORUS_TCP_CONGESTION={v:?}: expected a congestion control name such as cubic"
            ),
        ));
    }
    Ok((Some(name.to_string()), true))
}

impl Communicator {
    /// Build from the environment (see [`Config::from_env`]). When a setting is invalid
    /// (a `CHORUS_TIMEOUT` that is not a number, say) but the rank, size and address are
    /// not, the others are told, as by [`Communicator::announce_init_failure`].
    pub fn from_env() -> Result<Communicator, CommError> {
        match Config::from_env() {
            Ok(config) => Communicator::new(config),
            Err(e) => match Config::placement_from_env() {
                Some(basics) => {
                    Communicator::announce_init_failure(&basics, &e);
                    Err(e.at_rank(basics.rank))
                }
                None => Err(e),
            },
        }
    }

    /// For bindings: this rank cannot build its communicator (`e`: its settings are invalid,
    /// say) whose rank, size, store address and token `config` gives. The others are told
    /// through the store, as when init fails inside [`Communicator::new`]: they fail at once,
    /// naming this rank and `e`, instead of waiting out their init timeout. Best effort,
    /// bounded by a few seconds; nothing for a group of one.
    pub fn announce_init_failure(config: &Config, e: &CommError) {
        announce_failure(config, None, e);
    }

    /// [`Communicator::announce_init_failure`] for rank `rank` of `size` joining through
    /// `id` ([`Config::from_unique_id`] failed).
    pub fn announce_unique_id_failure(
        id: &crate::UniqueId,
        rank: usize,
        size: usize,
        e: &CommError,
    ) {
        let mut basics = Config::new(rank, size, id.root_addr());
        basics.token = Some(id.token());
        basics.host_store = Some(false);
        announce_failure(&basics, None, e);
    }

    /// Build from an explicit configuration: rendezvous, then a full mesh of connections.
    pub fn new(config: Config) -> Result<Communicator, CommError> {
        Communicator::build(config, None, None)
    }

    /// [`Communicator::new`], where this rank may already host the rendezvous store (`server`,
    /// bound at `config.root_addr`: the first rank of a split's new group). `connected` is set
    /// once this rank's connections to every other rank are made: until then no other rank
    /// can have ended its own set-up (that ends with a collective of the group).
    pub(crate) fn build(
        config: Config,
        server: Option<StoreServer>,
        connected: Option<&std::sync::atomic::AtomicBool>,
    ) -> Result<Communicator, CommError> {
        let (rank, size) = (config.rank, config.size);
        let fail = |e: CommError| e.at_rank(rank);
        if size == 0 || rank >= size {
            return Err(fail(CommError::invalid(
                "init",
                format!("rank {rank} is not in 0..{size}"),
            )));
        }
        if size > MAX_WORLD_SIZE {
            return Err(fail(CommError::invalid(
                "init",
                format!("{size} ranks is above the limit of {MAX_WORLD_SIZE} ranks"),
            )));
        }
        // This rank's own settings. One that is invalid fails init here, and the rank still
        // says so where the others wait for its address (they fail at once, naming it, rather
        // than wait out their init timeout).
        let local = local_settings(&config).and_then(|l| {
            // With peers: the root's address, and where the data connections listen
            // (CHORUS_SOCKET_IFNAME).
            if size == 1 {
                return Ok((l, None));
            }
            let root = resolve(&config.root_addr)?;
            let listen_ip = chorus_transport::ifaddr::select(config.socket_ifname.as_deref(), root)
                .map_err(|e| CommError::from_transport("init", e))?;
            Ok((l, Some((root, listen_ip))))
        });
        let (
            LocalSettings {
                choice,
                asked,
                filter,
                algos,
                env_link,
                tuning,
                tcp: tcp_opts,
            },
            route,
        ) = match local {
            Ok(l) => l,
            Err(e) => {
                announce_failure(&config, server, &e);
                return Err(fail(e));
            }
        };
        // This host runs more ranks than it has cores (the tuner's view of the link, below).
        let mut crowded = false;
        // Distinct hosts and the most ranks on one (the tuning file's key).
        let mut layout = (1, 1);
        // A store this process made for a unique id is kept by its first communicator (taken
        // once the configuration is known to be good: a rank refused above told the others
        // through it, and leaves it serving).
        let server = server.or_else(|| crate::unique_id::take_store(&config.root_addr));
        if let Some(s) = &server {
            // Every rank keeps a connection to it for the communicator's life.
            s.fit_ranks(size);
        }
        // (`route` is set exactly when there are peers.)
        let (transport, rendezvous): (Box<dyn Transport>, Option<Rendezvous>) = match route {
            None => (Box::new(Lone), None),
            Some((root, listen_ip)) => {
                // The root's name resolves to a loopback address here (Debian maps a host's own
                // name to 127.0.1.1: torchrun's MASTER_ADDR on the first node) and the launcher
                // did not say the job stays on this host: the ranks of other hosts reach the
                // root by another address. The store listens on every address, and the data
                // connections on the interface that reaches the other hosts, if any.
                let beyond = store_beyond_host(&config, root);
                let secret = config.token_is_secret();
                if beyond && config.hosts_store() {
                    // Without a token, anyone who reaches the host could write to the store.
                    let level = if secret { Level::Info } else { Level::Warn };
                    log::log(
                        level,
                        Some(rank),
                        format_args!(
                        "the rendezvous root {} resolves to {} here: its store listens on every \
                         address, for ranks of other hosts (LOCAL_WORLD_SIZE or \
                         CHORUS_LOCAL_SIZE equal to the world size keeps it on loopback){}",
                        config.root_addr,
                        root.ip(),
                        if secret {
                            ""
                        } else {
                            "; CHORUS_TOKEN is not set, so its connections are not \
                             authenticated by a secret"
                        }
                    ),
                    );
                }
                let opts = MeshOptions {
                    rank,
                    size,
                    store_addr: root,
                    token: config.token.clone().unwrap_or_default().into_bytes(),
                    listen_ip,
                    listen_beyond_host: beyond,
                    host_store: config.hosts_store(),
                    store_bind: beyond.then(|| every_address(root)),
                    timeout: config.init_timeout,
                    tcp: tcp_opts,
                };
                if !secret && rank == 0 {
                    log::log(
                        Level::Info,
                        Some(rank),
                        format_args!(
                            "CHORUS_TOKEN is not set: connections are checked{}, not \
                             authenticated by a secret",
                            if config.token.is_some() {
                                " (for the launcher's job id)"
                            } else {
                                ""
                            }
                        ),
                    );
                }
                // Waits spin (yielding the core at every poll) before they sleep in epoll, even
                // with more ranks than cores: a yielding spinner hands its core to the peer that
                // must send, and skips a wake-up (8 B allreduce, 4 ranks on 2 cores: ~45 µs spinning
                // against ~70 µs sleeping, on loopback and across namespaces alike).
                // One deadline for every step of the rendezvous (the mesh keeps to its own of the
                // same length, taken as it starts): a store host that stops answering after the
                // mesh must not stretch init past CHORUS_INIT_TIMEOUT by each step's own timeout.
                let init_deadline = chorus_transport::deadline_after(config.init_timeout);
                let (t, mut r) = tcp::connect_with(&opts, server)
                    .map_err(|e| fail(CommError::from_transport("init", e)))?;
                r.store.set_deadline(init_deadline);
                // Should a step below fail on this rank while it hosts the store, the store stays
                // up a few seconds, so that the others read the error it left there.
                let mut hosted = Lingering(r.server.take(), config.init_timeout);
                // Settings every rank must share to pick the same schedules (each rank reads its
                // own environment): told apart here, naming the setting, rather than as a
                // mismatch or a timeout at some later call.
                // (name, what is compared, what a message shows): CHORUS_ALGO by its effect, so
                // that `Ring` and `ring;` agree.
                let shown = |v: String| (v.clone(), v);
                // The shared-memory options are read here, so that a rank with an invalid value
                // is named to the others (which would otherwise wait for its segments until the
                // init timeout); ranks whose values differ but are valid are told apart when the
                // segments are attached.
                let shm_opts = shm_options();
                let shm_setting = match &shm_opts {
                    Ok(_) => ("valid".to_string(), "valid values".to_string()),
                    Err(e) => ("invalid".to_string(), e.message().to_string()),
                };
                let settings = [
                    (
                        "CHORUS_ALGO",
                        (
                            format!("{filter:?} {algos:?}"),
                            format!("{:?}", config.algo.as_deref().map(str::trim)),
                        ),
                    ),
                    (
                        "CHORUS_ALPHA_US (or Config::alpha_us)",
                        shown(format!("{:?}", env_link.0)),
                    ),
                    (
                        "CHORUS_BETA_GBPS (or Config::beta_gbps)",
                        shown(format!("{:?}", env_link.1)),
                    ),
                    ("CHORUS_TUNE", shown(format!("{tuning}"))),
                    (
                        "CHORUS_CHECK_CALLS",
                        shown(format!("{}", config.check_calls)),
                    ),
                    (
                        "CHORUS_TUNE_FILE (set or not)",
                        shown(format!("{}", config.tune_file.is_some())),
                    ),
                    (
                        "CHORUS_SHM_RING_BYTES / CHORUS_SHM_CHUNK_BYTES",
                        shm_setting,
                    ),
                ];
                agree_on_settings(
                    &mut r.store,
                    r.comm_id,
                    rank,
                    size,
                    &settings,
                    init_deadline,
                )
                .map_err(fail)?;
                // Peers on this host through shared memory, the others through TCP.
                let shm_opts = shm_opts.map_err(fail)?;
                let t = hybrid::connect(
                    t,
                    &mut r.store,
                    &r.hosts,
                    choice,
                    &asked,
                    &shm_opts,
                    init_deadline,
                )
                .map_err(|e| fail(CommError::from_transport("init", e)))?;
                if let Some(c) = connected {
                    c.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                // The store outlives init (splits, duplicates): its later requests carry deadlines
                // of their own.
                r.store.clear_deadline();
                r.server = hosted.0.take();
                let on_my_host = r.hosts.iter().filter(|h| **h == r.hosts[rank]).count();
                let mut distinct = r.hosts.clone();
                distinct.sort();
                distinct.dedup();
                let per_host = distinct
                    .iter()
                    .map(|d| r.hosts.iter().filter(|h| *h == d).count())
                    .max()
                    .unwrap_or(1);
                layout = (distinct.len(), per_host);
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                crowded = on_my_host > cores;
                log::log(
                    Level::Info,
                    Some(rank),
                    format_args!(
                        "connected {size} ranks over {}, listening on {}, communicator {:#x}",
                        t.name(),
                        r.addrs[rank],
                        r.comm_id
                    ),
                );
                (Box::new(t), Some(r))
            }
        };
        let abort_handle = chorus_transport::AbortHandle::new();
        let mut transport = transport;
        transport.set_abort_handle(abort_handle.clone());
        let mut comm = Communicator {
            serial: COMMS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            rank,
            size,
            config,
            transport,
            _rendezvous: rendezvous,
            seq: 0,
            scratch: Vec::new(),
            broken: None,
            process: Process::this(),
            abort_handle,
            selector: Selector::new(size, Default::default(), LinkSource::Default, filter),
            tuner: Tuner::new(),
            tuning,
            tune_file: None,
            algos,
        };
        comm.selector = Selector::for_communicator(&mut comm, filter, env_link, crowded)?;
        if comm.rank == 0 && size > 1 && comm.direct_shared_memory() {
            // The table just logged is not what runs here.
            log::log(
                Level::Info,
                Some(0),
                format_args!(
                    "all_reduce: every rank is on this host: the direct shared-memory \
                     allreduce runs, not the schedules above (an algorithm option, or a \
                     CHORUS_ALGO that allows the allreduce other schedules than by default, \
                     runs them)"
                ),
            );
        }
        if let Some(path) = comm.config.tune_file.clone() {
            // Only where schedules are tuned (the same on every rank).
            if tuning && size > 1 && filter.forced().is_none() && !comm.direct_shared_memory() {
                let algos: Vec<&str> = Algorithm::ALL
                    .into_iter()
                    .filter(|&a| filter.allows(a))
                    .map(Algorithm::name)
                    .collect();
                let key = Key {
                    ranks: size,
                    hosts: layout.0,
                    per_host: layout.1,
                    transport: comm.transport.name().to_string(),
                    cpu_bound: comm.selector.cpu_bound(),
                    algos: algos.join(","),
                };
                comm.open_tune_file(path, key)?;
            }
        }
        Ok(comm)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Every rank's host identity, as the rendezvous gathered it (`None` in a group of one).
    pub(crate) fn host_identities(&self) -> Option<&[String]> {
        self._rendezvous.as_ref().map(|r| r.hosts.as_slice())
    }

    /// The IP address this rank's data connections listen on (`None` in a group of one).
    pub(crate) fn data_ip(&self) -> Option<std::net::IpAddr> {
        self._rendezvous.as_ref().map(|r| r.addrs[self.rank].ip())
    }

    /// The configuration it was built from (with the timeout [`Communicator::set_timeout`]
    /// set since).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Sets the timeout of this communicator's later calls and transfers (what
    /// `CHORUS_TIMEOUT` set at init): each fails when it has not completed within it. From
    /// 1 ms to one year, as `CHORUS_TIMEOUT`; a communicator made from this one (split, dup)
    /// starts from it. Ranks may set different timeouts. The torch backend sets the process
    /// group's timeout here when `CHORUS_TIMEOUT` is not set.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), CommError> {
        let secs = timeout.as_secs_f64();
        if crate::config::timeout_from_secs(secs).is_none() {
            return Err(CommError::invalid(
                "set_timeout",
                format!("a timeout of {secs} s: it must be at least 1 ms and at most one year"),
            )
            .at_rank(self.rank));
        }
        self.config.timeout = timeout;
        Ok(())
    }

    /// Name of the transport in use: "tcp", "shm" (every peer on this host), "shm+tcp" (some
    /// of each), "none" for a group of one.
    pub fn transport_name(&self) -> &'static str {
        self.transport.name()
    }

    /// Whether the communicator can still run collectives: not once it failed, nor once an
    /// abort was asked for (through its [`AbortHandle`], carried out by the next call).
    pub fn is_usable(&self) -> bool {
        self.is_unbroken() && !self.abort_handle.is_requested()
    }

    /// Whether no failure broke the communicator (an abort asked for and not yet carried out
    /// aside).
    pub(crate) fn is_unbroken(&self) -> bool {
        self.broken.is_none()
    }

    /// The algorithm an allreduce of `bytes` bytes uses with default options once its size
    /// bucket is tuned: the one tuning chose, or (before, or with tuning off) the cheapest
    /// that `CHORUS_ALGO` allows in this communicator's cost table (see [`crate::select`]).
    /// Every rank returns the same. (When every rank is on one host and `CHORUS_ALGO` is
    /// unset, allreduce uses the direct shared-memory schedule instead.)
    pub fn selected_algorithm(&self, bytes: usize) -> Algorithm {
        self.tuner
            .decided(bytes)
            .unwrap_or_else(|| self.selector.select(bytes))
    }

    /// Whether allreduces that force no algorithm take the direct shared-memory allreduce
    /// instead of a message schedule: every rank is on this host (the transport has shared
    /// memory to all of them) and `CHORUS_ALGO` says nothing about the allreduce (sections
    /// for other collectives leave it alone). Schedules are then neither selected nor tuned.
    /// Every rank returns the same.
    pub fn direct_shared_memory(&mut self) -> bool {
        !self.algos.allreduce_restricted && self.transport.shared_memory().is_some()
    }

    /// What `CHORUS_ALGO` allows the other collectives.
    pub(crate) fn algos(&self) -> &Allowed {
        &self.algos
    }

    /// The algorithm tuning settled on for allreduces of `bytes` bytes, if their size bucket
    /// is tuned (see [`crate::select`]).
    pub fn tuned_algorithm(&self, bytes: usize) -> Option<Algorithm> {
        self.tuner.decided(bytes)
    }

    /// Turn online tuning of the allreduce schedule on or off (the default is `CHORUS_TUNE`,
    /// on when unset). Every rank must make the same choice before the same call: ranks that
    /// differ, even for a few calls, step their tuners differently and may run different
    /// schedules later, failing with a mismatch at a call where they agree
    /// (`CHORUS_CHECK_CALLS` names the difference at the call itself). Buckets already tuned
    /// keep their choice. A communicator made from this one (split, dup) starts from
    /// `CHORUS_TUNE` again.
    pub fn set_tuning(&mut self, on: bool) {
        if on != self.tuning {
            // A revisit in progress would resume after calls it did not time: start afresh.
            self.tuner.drop_revisits();
        }
        self.tuning = on;
    }

    /// Whether allreduce schedules are tuned online.
    pub fn tuning(&self) -> bool {
        self.tuning
    }

    /// The cost table allreduce schedules are chosen from.
    pub fn selector(&self) -> &Selector {
        &self.selector
    }

    /// In-place allreduce: every rank ends with the reduction of everyone's `buf`.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_with(None, buf, op, &AllReduceOptions::default())
    }

    /// Out-of-place allreduce: `recv` gets the reduction of everyone's `send`.
    pub fn all_reduce_into<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.all_reduce_with(Some(send), recv, op, &AllReduceOptions::default())
    }

    /// Allreduce with options; in place when `send` is `None`.
    pub fn all_reduce_with<T: Element>(
        &mut self,
        send: Option<&[T]>,
        recv: &mut [T],
        op: ReduceOp,
        opts: &AllReduceOptions,
    ) -> Result<(), CommError> {
        let send = send.map(bytemuck::cast_slice::<T, u8>);
        self.all_reduce_raw(send, bytemuck::cast_slice_mut(recv), T::DTYPE, op, opts)
    }

    /// Allreduce on raw bytes holding elements of `dtype` (the C ABI's entry point).
    pub fn all_reduce_raw(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        opts: &AllReduceOptions,
    ) -> Result<(), CommError> {
        let call =
            Call::new("all_reduce", CollKind::AllReduce, dtype, op).with_timeout(opts.timeout);
        self.refusable(call, |c| {
            const OP: &str = "all_reduce";
            c.check_usable(OP)?;
            c.check_op(OP, dtype, op)?;
            if let Some(t) = opts.timeout.filter(|t| *t < Duration::from_millis(1)) {
                // One below 1 ms would fail the call before it could run, and leave the
                // communicator unusable. (`Duration::MAX` is no limit.)
                return Err(CommError::invalid(
                    OP,
                    format!(
                        "a timeout of {} s: it must be at least 1 ms",
                        t.as_secs_f64()
                    ),
                )
                .at_rank(c.rank));
            }
            if recv.len() % dtype.size() != 0 {
                return Err(CommError::invalid(
                    OP,
                    format!(
                        "buffer of {} bytes is not a whole number of {} elements",
                        recv.len(),
                        dtype.name()
                    ),
                )
                .at_rank(c.rank));
            }
            if let Some(s) = send {
                if s.len() != recv.len() {
                    return Err(CommError::invalid(
                        OP,
                        format!(
                            "send buffer has {} bytes, receive buffer {}",
                            s.len(),
                            recv.len()
                        ),
                    )
                    .at_rank(c.rank));
                }
            }
            // Compared first (with `check_calls`), before any tuning trial runs and before a tuned
            // call's clock starts. A forced schedule is part of the call: a rank that forces one
            // skips the tuner's step, so ranks that differ in it would fall out of step.
            let forced = opts.algorithm.map_or(0, |a| {
                1 + allreduce::Algorithm::ALL
                    .iter()
                    .position(|&x| x == a)
                    .unwrap_or(allreduce::Algorithm::ALL.len()) as u64
            });
            // So is tuning being on where the tuner steps: a rank with it off skips the step
            // too (not compared where no rank's tuner steps: a forced schedule, the direct
            // shared-memory allreduce, an empty buffer, one rank).
            let direct = opts.algorithm.is_none() && c.direct_shared_memory();
            let steps = opts.algorithm.is_none() && !direct && !recv.is_empty() && c.size > 1;
            // 0 off, 1 on, 2 not stepping (where it does not matter).
            let tuning = if steps { u64::from(c.tuning) } else { 2 };
            let args = [recv.len() as u64, forced, tuning];
            c.check_call(call, &args)?;
            if direct {
                // Every rank on this host: the direct shared-memory allreduce beats any message
                // schedule (it copies each byte fewer times). Forcing an algorithm bypasses it.
                return c.run_unchecked(call, &args, |ctx| {
                    shm_all_reduce(ctx, send, recv, dtype, op)
                });
            }
            let bytes = recv.len();
            let (algorithm, timing) = match opts.algorithm {
                Some(a) => (a, Timing::None),
                None if !c.tuning || c.size == 1 || bytes == 0 => {
                    (c.selected_algorithm(bytes), Timing::None)
                }
                None => match c.tuner.next(&c.selector, bytes) {
                    Next::Use(a) => (a, Timing::None),
                    Next::Online(a) => (a, Timing::Online),
                    Next::Trials(plan) => (
                        c.dedicated_trials(&plan, bytes, send.is_some(), dtype, op, opts)?,
                        Timing::None,
                    ),
                    Next::Revisit { algorithm, rival } => (algorithm, Timing::Revisit { rival }),
                    Next::Tied {
                        algorithm,
                        tied,
                        after,
                    } => {
                        c.log_tuning(|| select::describe_tied(bytes, algorithm, &tied, after));
                        (algorithm, Timing::None)
                    }
                    Next::Inherit {
                        algorithm,
                        from,
                        lead,
                    } => {
                        c.log_tuning(|| select::describe_inherited(bytes, algorithm, from, lead));
                        (algorithm, Timing::None)
                    }
                },
            };
            log::log(
                Level::Trace,
                Some(c.rank),
                format_args!(
                    "all_reduce {} x {} {} with {}",
                    recv.len() / dtype.size(),
                    dtype.name(),
                    op.name(),
                    algorithm.name()
                ),
            );
            if timing == Timing::Online {
                if let Some(candidates) = c.tuner.online_fresh(bytes) {
                    // Before the first trial: run every candidate once, untimed, so that none pays
                    // for TCP connections still in slow start, nor for growing the scratch
                    // memory (each warm-up grows it to what its schedule needs, or fails the
                    // call where the system refuses it).
                    for alg in candidates {
                        let r = c.tuning_warm_up(alg, bytes, dtype, op, opts.timeout);
                        if r.is_err() {
                            c.tuner.reset(bytes);
                            return r;
                        }
                    }
                }
            }
            // A rival's calls in a revisit carry the trial kind, so that a rank that does not
            // tune (and runs the bucket's schedule) fails with a mismatch instead of mixing
            // messages of two schedules.
            let kind = match timing {
                Timing::Revisit { rival: true, .. } => CollKind::AllReduceTrial,
                _ => CollKind::AllReduce,
            };
            let started = Instant::now();
            let r = c.run_unchecked(Call { kind, ..call }, &args, |ctx| {
                allreduce::run(algorithm, ctx, send, recv, dtype, op)
            });
            let seconds = started.elapsed().as_secs_f64();
            match timing {
                Timing::None => {}
                _ if r.is_err() => c.tuner.reset(bytes),
                Timing::Online => {
                    if let Some((candidates, times)) = c.tuner.record(bytes, seconds) {
                        let chosen = c
                            .agree_and_decide(bytes, &candidates, times, opts.timeout)
                            .inspect_err(|_| c.tuner.reset(bytes))?;
                        if chosen != algorithm {
                            // The winner's connections sat idle through the last trial, and TCP
                            // restarts an idle connection's window: warm them again, so that the
                            // caller's next call runs at the speed the trials measured.
                            c.tuning_warm_up(chosen, bytes, dtype, op, opts.timeout)?;
                        }
                    }
                }
                Timing::Revisit { .. } => {
                    // Scaled to the bucket's top size, as the trials' times are: calls of one
                    // bucket may differ in size up to 2×, and the rival's and the schedule's
                    // timed calls must not differ by the mix of sizes that fell to each.
                    let chosen = c.tuner.decided(bytes).unwrap_or(algorithm);
                    let scale = c.selector.to_bucket_top(chosen, bytes);
                    if let Some((_, _, times)) = c.tuner.record_revisit(bytes, seconds * scale) {
                        c.agree_revisit(bytes, times, opts.timeout)
                            .inspect_err(|_| c.tuner.reset(bytes))?;
                    }
                }
            }
            r
        })
    }

    /// Replaces every rank's tuning `times` by their largest over the ranks (the agreement
    /// every tuning decision starts from, so that all ranks decide alike).
    fn agree_max(&mut self, times: &mut [f64], timeout: Option<Duration>) -> Result<(), CommError> {
        self.run_collective(
            Call::new(
                "all_reduce (tuning agreement)",
                CollKind::Tuning,
                DType::Float64,
                ReduceOp::Max,
            )
            .with_timeout(timeout),
            |ctx| {
                allreduce::run(
                    Algorithm::RecursiveDoubling,
                    ctx,
                    None,
                    bytemuck::cast_slice_mut(times),
                    DType::Float64,
                    ReduceOp::Max,
                )
            },
        )
    }

    /// Agrees on the mean `times` of a revisit of the bucket of `bytes` across ranks (the
    /// largest of each), settles it and logs the outcome.
    fn agree_revisit(
        &mut self,
        bytes: usize,
        mut times: [f64; 2],
        timeout: Option<Duration>,
    ) -> Result<(), CommError> {
        self.agree_max(&mut times, timeout)?;
        if let Some(outcome) = self.tuner.settle_revisit(bytes, times) {
            self.log_tuning(|| select::describe_revisit(bytes, &outcome));
            if outcome.now != outcome.chosen {
                // The file keeps the schedule the bucket now runs.
                let size = 1 << select::bucket(bytes);
                let kept = self
                    .tune_file
                    .as_ref()
                    .and_then(|t| t.section.buckets.iter().find(|b| b.bytes == size).cloned());
                if let Some(mut d) = kept {
                    d.chosen = outcome.now;
                    self.remember(d);
                }
            }
        }
        Ok(())
    }

    /// Logs a tuning event at INFO on rank 0 (every rank decides alike; one line suffices).
    fn log_tuning(&self, line: impl FnOnce() -> String) {
        if self.rank == 0 {
            log::log(Level::Info, Some(0), format_args!("{}", line()));
        }
    }

    /// One untimed run of `alg` on a zeroed buffer of `bytes` bytes, at most
    /// [`select::DEDICATED_MAX_BYTES`] (enough to open the TCP windows it uses).
    fn tuning_warm_up(
        &mut self,
        alg: Algorithm,
        bytes: usize,
        dtype: DType,
        op: ReduceOp,
        timeout: Option<Duration>,
    ) -> Result<(), CommError> {
        let mut warm = vec![0u8; bytes.min(select::DEDICATED_MAX_BYTES)];
        warm.truncate(warm.len() / dtype.size() * dtype.size());
        self.run_collective(
            Call::new(
                "all_reduce (tuning warm-up)",
                CollKind::AllReduceTrial,
                dtype,
                op,
            )
            .with_timeout(timeout),
            |ctx| allreduce::run(alg, ctx, None, &mut warm, dtype, op),
        )
    }

    /// The dedicated tuning trials of the first call of a small bucket (see
    /// [`crate::select`]): every candidate of `plan` on a zeroed buffer of `bytes` bytes (from
    /// a second zeroed buffer when the call is `out_of_place`, as a schedule's copies and
    /// memory traffic differ between the two), once
    /// untimed and then its repetitions back to back, in passes: the first as `plan` sizes
    /// it, the rest as [`TrialPlan::after_first_pass`] sizes them from the first's agreed
    /// times; this rank's time of a candidate is the median over passes of a pass's mean run
    /// (leaving out the first pass where [`select::drop_first_pass`] says so).
    /// Returns the schedule agreed on.
    fn dedicated_trials(
        &mut self,
        plan: &TrialPlan,
        bytes: usize,
        out_of_place: bool,
        dtype: DType,
        op: ReduceOp,
        opts: &AllReduceOptions,
    ) -> Result<Algorithm, CommError> {
        const TRIAL: &str = "all_reduce (tuning trial)";
        let mut buf = vec![0u8; bytes];
        let src = out_of_place.then(|| vec![0u8; bytes]);
        // One pass: this rank's mean time per run of every candidate.
        let mut pass = |comm: &mut Self, plan: &TrialPlan| -> Result<Vec<f64>, CommError> {
            let mut means = Vec::with_capacity(plan.candidates.len());
            for &(alg, reps) in &plan.candidates {
                let mut started = Instant::now();
                for rep in 0..=reps {
                    // The first run of a pass only lines the ranks up.
                    if rep == 1 {
                        started = Instant::now();
                    }
                    comm.run_unchecked(
                        Call::new(TRIAL, CollKind::AllReduceTrial, dtype, op)
                            .with_timeout(opts.timeout),
                        &[bytes as u64],
                        |ctx| allreduce::run(alg, ctx, src.as_deref(), &mut buf, dtype, op),
                    )?;
                }
                // The mean of back-to-back runs, as a loop of calls sees it (the time of a
                // single run is skewed by where a rank sits in the schedule).
                means.push(started.elapsed().as_secs_f64() / reps as f64);
            }
            Ok(means)
        };
        // The first pass as the model sizes it; the rest as its times, agreed across ranks
        // (the largest of each candidate's) so that every rank runs the same passes, size it.
        let first = pass(self, plan)?;
        let mut runs: Vec<Vec<f64>> = first.iter().map(|&t| vec![t]).collect();
        let mut agreed = first;
        self.agree_max(&mut agreed, opts.timeout)?;
        let rest = plan.after_first_pass(&agreed);
        for _ in 0..rest.passes {
            for (r, t) in runs.iter_mut().zip(pass(self, &rest)?) {
                r.push(t);
            }
        }
        // The median pass, so that one disturbed pass (slow or lucky) does not decide; over
        // the later passes alone where the model sized the first short.
        let skip = usize::from(select::drop_first_pass(plan, &rest));
        if log::enabled(Level::Trace) {
            log::log(
                Level::Trace,
                Some(self.rank),
                format_args!(
                    "{}",
                    select::describe_passes(bytes, &plan.candidates, &rest.candidates, &runs, skip)
                ),
            );
        }
        let times: Vec<f64> = runs
            .iter_mut()
            .map(|r| select::median(&mut r[skip..]))
            .collect();
        let candidates: Vec<Algorithm> = plan.candidates.iter().map(|c| c.0).collect();
        self.agree_and_decide(bytes, &candidates, times, opts.timeout)
    }

    /// Agrees on the trial `times` of `candidates` across ranks (the largest of every
    /// candidate's), settles the bucket of `bytes` on the fastest and logs the decision.
    fn agree_and_decide(
        &mut self,
        bytes: usize,
        candidates: &[Algorithm],
        mut times: Vec<f64>,
        timeout: Option<Duration>,
    ) -> Result<Algorithm, CommError> {
        self.agree_max(&mut times, timeout)?;
        let modelled: Vec<f64> = candidates
            .iter()
            .map(|&a| self.selector.modelled_cost(a, bytes))
            .collect();
        let revisit = self.selector.revisits(bytes);
        let chosen = self
            .tuner
            .decide(bytes, candidates, &times, &modelled, revisit);
        let model = self.selector.select(bytes);
        self.log_tuning(|| select::describe_decision(bytes, model, candidates, &times, chosen));
        self.remember(Decision {
            bytes: 1 << select::bucket(bytes),
            chosen,
            times: candidates.iter().copied().zip(times).collect(),
        });
        Ok(chosen)
    }

    /// Reads the tuning file at `path` on rank 0 (waiting at most [`TUNE_FILE_READ_LIMIT`]),
    /// agrees on its decisions for this kind of communicator (`key`) across ranks and
    /// restores them (see [`crate::tune_file`]). A file that cannot be read is reported and
    /// left as it is; only the agreement can fail.
    fn open_tune_file(&mut self, path: std::path::PathBuf, key: Key) -> Result<(), CommError> {
        let link = self.selector.link();
        let filter = self.selector.filter();
        let mut found = Vec::new();
        if self.rank == 0 {
            let shown = path.display();
            // On a thread of its own, as the writes are: a hung file system (NFS) must not
            // hold rank 0 while the others wait for it in the agreement below.
            let (tx, rx) = std::sync::mpsc::channel();
            let reading = path.clone();
            let spawned = std::thread::Builder::new()
                .name("chorus tune-file read".into())
                .spawn(move || {
                    let _ = tx.send(TuneFile::read(&reading));
                });
            // Well within the others' wait for the agreement below (the call timeout).
            let limit = TUNE_FILE_READ_LIMIT.min(self.config.timeout / 2);
            let read = match spawned {
                Err(e) => Err(format!("no thread to read it: {e}")),
                Ok(_) => match rx.recv_timeout(limit) {
                    Ok(read) => read,
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(format!(
                        "not read within {:.1} s (a slow or hung file system?)",
                        limit.as_secs_f64()
                    )),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        Err("its reader failed (a panic)".to_string())
                    }
                },
            };
            match read {
                Ok(None) => self.log_tuning(|| format!("tuning file {shown}: none yet")),
                Err(e) => log::log(
                    Level::Warn,
                    Some(0),
                    format_args!(
                        "tuning file {shown} not used: {e} (left as it is: remove it, or name \
                         another file, to keep decisions)"
                    ),
                ),
                Ok(Some(file)) => match file.section(&key) {
                    None => self.log_tuning(|| {
                        format!(
                            "tuning file {shown}: no decisions for {} ranks like these",
                            key.ranks
                        )
                    }),
                    Some(s) => match s.link_mismatch(link) {
                        Some(why) => self.log_tuning(|| {
                            format!("tuning file {shown}: decisions not used, {why}")
                        }),
                        None => found = s.buckets.clone(),
                    },
                },
            }
        }
        // Rank 0's decisions reach every rank (the others add zeros).
        let mut agreed = tune_file::encode(&found, |a| filter.allows(a));
        self.agree_max(&mut agreed, None)?;
        let decisions = tune_file::decode(&agreed).map_err(|e| {
            CommError::new(
                ErrorKind::Internal,
                "init (tuning file)",
                format!("the agreed decisions do not decode: {e}"),
            )
            .at_rank(self.rank)
        })?;
        for d in &decisions {
            let (candidates, times): (Vec<Algorithm>, Vec<f64>) = d.times.iter().copied().unzip();
            let revisit = self.selector.restored_revisits(d.bytes);
            self.tuner
                .restore(d.bytes, d.chosen, &candidates, &times, revisit);
        }
        if !decisions.is_empty() {
            self.log_tuning(|| select::describe_restored(&path, &decisions));
        }
        let writer = if self.rank == 0 {
            TuneWriter::start(path.clone())
        } else {
            None
        };
        self.tune_file = Some(TuneState {
            path,
            section: Section {
                key,
                link,
                buckets: decisions,
            },
            writer,
            warned: false,
        });
        Ok(())
    }

    /// Keeps a bucket's decision in the tuning file, if there is one (rank 0's writer thread
    /// writes it; a failure is reported once and does not fail the call).
    fn remember(&mut self, d: Decision) {
        let Some(state) = self.tune_file.as_mut() else {
            return;
        };
        if d.check().is_err() {
            return;
        }
        state.section.set(d);
        if self.rank != 0 {
            return;
        }
        match state.writer.as_ref().and_then(|w| w.tx.as_ref()) {
            Some(tx) if tx.send(state.section.clone()).is_ok() => {}
            _ => store_section(&state.path, state.section.clone(), &mut state.warned),
        }
    }

    /// Run one of the library's own collectives (tuning trials and agreements, the link
    /// probe): [`Communicator::run_unchecked`] without arguments. Every rank makes these alike
    /// by construction, so [`Config::check_calls`] does not compare them (nor add its latency
    /// to the trials' times).
    pub(crate) fn run_collective(
        &mut self,
        call: Call,
        schedule: impl FnOnce(&mut CollCtx<'_>) -> chorus_transport::Result<()>,
    ) -> Result<(), CommError> {
        self.run_unchecked(call, &[], schedule)
    }

    /// Run one of the caller's collectives: with [`Config::check_calls`], the ranks first
    /// compare their calls ([`Communicator::check_call`]); then
    /// [`Communicator::run_unchecked`].
    pub(crate) fn run_call(
        &mut self,
        call: Call,
        args: &[u64],
        schedule: impl FnOnce(&mut CollCtx<'_>) -> chorus_transport::Result<()>,
    ) -> Result<(), CommError> {
        // (Both refuse an unusable communicator: the comparison's allgather, and then
        // `run_unchecked`.)
        self.check_call(call, args)?;
        self.run_unchecked(call, args, schedule)
    }

    /// Run one collective: checks the communicator is usable, gives the schedule a context
    /// (transport, deadline from `timeout` or the communicator's default, a fresh tag base
    /// carrying the sequence number, `kind`, `dtype`, `op` and the fingerprint of `args`, the
    /// call's arguments every rank must pass alike: byte counts, the root, [`call_bits`]), and
    /// turns a transport error into a [`CommError`] (aborting the communicator when it is not
    /// recoverable). Every collective goes through here.
    pub(crate) fn run_unchecked(
        &mut self,
        call: Call,
        args: &[u64],
        schedule: impl FnOnce(&mut CollCtx<'_>) -> chorus_transport::Result<()>,
    ) -> Result<(), CommError> {
        self.check_usable(call.name)?;
        let tag = tag_base(self.next_seq(), call.kind, call.dtype, call.op) | call_bits(args);
        self.run_tagged(call.name, tag, call.timeout, schedule)
    }

    /// With [`Config::check_calls`]: the ranks compare what this call was made with (one
    /// allgather of a 32-byte record each) and fail alike, naming each rank's call, where
    /// they differ. The communicator stays usable then: no rank sent any of the call's data.
    pub(crate) fn check_call(&mut self, call: Call, args: &[u64]) -> Result<(), CommError> {
        self.compare_calls(call, args, false)
    }

    /// With [`Config::check_calls`], runs `call` (one of the caller's collectives, `kind`),
    /// and when it refuses its arguments on this rank before any of it ran (an invalid
    /// argument, no sequence number taken), still takes part in the comparison of calls with
    /// a record saying so: the other ranks, in the comparison of the same call, fail at once
    /// naming this rank instead of waiting out their timeout. This rank returns its own
    /// error, after the comparison (which waits for the others, as every checked call's
    /// does). Ranks that all refuse compare equal and each returns its own error. Without
    /// the check, the refused call's sequence number goes ([`Communicator::skip_refused_call`]).
    pub(crate) fn refusable<R>(
        &mut self,
        call: Call,
        body: impl FnOnce(&mut Self) -> Result<R, CommError>,
    ) -> Result<R, CommError> {
        let seq = self.seq;
        let r = body(self);
        let Err(e) = r else {
            return r;
        };
        let refused = e.kind() == ErrorKind::InvalidArgument && e.is_usable();
        if !(refused && self.seq == seq && self.broken.is_none()) {
            return Err(e);
        }
        if !self.config.check_calls && self.size > 1 {
            self.skip_refused_call();
            return Err(e);
        }
        // The comparison's mismatch (the others made their call) is expected. If it fails
        // otherwise (no other rank came within the timeout, a peer is gone), the
        // communicator is broken: the caller still learns of its own argument, and that the
        // communicator did not survive.
        match self.compare_calls(call, &[], true) {
            Err(c) if !c.is_usable() => Err(e
                .with_detail(&format!(
                    "; then the comparison of calls (CHORUS_CHECK_CALLS) failed: {c}"
                ))
                .with_usable(false)),
            _ => Err(e),
        }
    }

    /// The comparison of [`Communicator::check_call`]: one allgather of a 32-byte record per
    /// rank (`refused`: this rank refused its arguments and runs nothing after it).
    fn compare_calls(&mut self, call: Call, args: &[u64], refused: bool) -> Result<(), CommError> {
        let Call {
            name,
            kind,
            dtype,
            op,
            timeout,
        } = call;
        const RECORD: usize = 32;
        if !self.config.check_calls || self.size == 1 {
            return Ok(());
        }
        let mut mine = [0u8; RECORD];
        mine[0] = kind as u8;
        mine[1] = dtype as i32 as u8;
        mine[2] = op as i32 as u8;
        mine[3] = args.len().min(3) as u8;
        mine[4] = u8::from(refused);
        for (k, a) in args.iter().take(3).enumerate() {
            mine[8 + 8 * k..16 + 8 * k].copy_from_slice(&a.to_le_bytes());
        }
        let all = self.gather_check_records(name, timeout, DType::Uint8, &mine)?;
        let records: Vec<&[u8]> = all.chunks_exact(RECORD).collect();
        if records.iter().all(|r| *r == records[0]) {
            return Ok(());
        }
        // Each distinct call with the ranks that made it, in rank order.
        let mut groups: Vec<(&[u8], Vec<usize>)> = Vec::new();
        for (r, rec) in records.iter().enumerate() {
            match groups.iter_mut().find(|g| g.0 == *rec) {
                Some(g) => g.1.push(r),
                None => groups.push((rec, vec![r])),
            }
        }
        let calls: Vec<String> = groups
            .iter()
            .take(4)
            .map(|(rec, ranks)| {
                let shown: Vec<String> = ranks.iter().take(8).map(|r| r.to_string()).collect();
                let more = if ranks.len() > 8 { ", …" } else { "" };
                format!("rank {}{more}: {}", shown.join(", "), describe_record(rec))
            })
            .collect();
        Err(CommError::new(
            ErrorKind::Mismatch,
            name,
            format!(
                "ranks called different collectives or with different arguments \
                 (CHORUS_CHECK_CALLS): {}",
                calls.join("; ")
            ),
        )
        .at_rank(self.rank)
        .with_usable(true))
    }

    /// [`Communicator::run_call`] for the collectives whose counts differ from rank to rank
    /// (alltoallv, gatherv, scatterv): with [`Config::check_calls`], after the comparison of
    /// calls, the ranks also compare their counts pair by pair (`pairs(p)`: the elements this
    /// rank sends to each rank, and those it expects from each; computed only then).
    pub(crate) fn run_call_pairs(
        &mut self,
        call: Call,
        args: &[u64],
        pairs: impl FnOnce(usize) -> (Vec<u64>, Vec<u64>),
        schedule: impl FnOnce(&mut CollCtx<'_>) -> chorus_transport::Result<()>,
    ) -> Result<(), CommError> {
        self.check_call(call, args)?;
        if self.config.check_calls && self.size > 1 {
            let (sends, recvs) = pairs(self.size);
            self.compare_pair_counts(call, &sends, &recvs)?;
        }
        self.run_unchecked(call, args, schedule)
    }

    /// The pairwise comparison of [`Communicator::run_call_pairs`]: `sends[j]` elements to rank
    /// `j` against what `j` expects from this rank, in one alltoall and one allgather of small
    /// records; the ranks fail alike where a pair disagrees, naming it. The communicator stays
    /// usable: none of the call's data was sent.
    fn compare_pair_counts(
        &mut self,
        call: Call,
        sends: &[u64],
        recvs: &[u64],
    ) -> Result<(), CommError> {
        let p = self.size;
        debug_assert!(sends.len() == p && recvs.len() == p);
        let out: Vec<u8> = sends.iter().flat_map(|c| c.to_le_bytes()).collect();
        let mut theirs = vec![0u8; 8 * p];
        let word = |b: &[u8], k: usize| u64::from_le_bytes(b[8 * k..8 * k + 8].try_into().unwrap());
        let tag = tag_base(
            self.next_seq(),
            CollKind::CallCheck,
            DType::Uint64,
            ReduceOp::Sum,
        );
        let allowed = [false, true]; // pairwise
        self.run_tagged(call.name, tag, call.timeout, |ctx| {
            chorus_algorithms::collectives::alltoall::run(ctx, Some(&out), &mut theirs, &allowed)
        })?;
        // This rank's first disagreement: (peer + 1, what it sends, what this rank expects).
        let mut mine = [0u8; 24];
        if let Some(j) = (0..p).find(|&j| word(&theirs, j) != recvs[j]) {
            mine[..8].copy_from_slice(&(j as u64 + 1).to_le_bytes());
            mine[8..16].copy_from_slice(&word(&theirs, j).to_le_bytes());
            mine[16..].copy_from_slice(&recvs[j].to_le_bytes());
        }
        let all = self.gather_check_records(call.name, call.timeout, DType::Uint64, &mine)?;
        let Some((r, rec)) = all
            .chunks_exact(24)
            .enumerate()
            .find(|(_, rec)| word(rec, 0) != 0)
        else {
            return Ok(());
        };
        let (j, sent, expected) = (word(rec, 0) - 1, word(rec, 1), word(rec, 2));
        Err(CommError::new(
            ErrorKind::Mismatch,
            call.name,
            format!(
                "rank {r} expects {expected} elements from rank {j}, which sends it {sent} \
                 (CHORUS_CHECK_CALLS)"
            ),
        )
        .at_rank(self.rank)
        .with_usable(true))
    }

    /// Every rank's `mine` (records of one length), in rank order: the allgather of the
    /// checks of [`Config::check_calls`] (`kind` tells the checks apart in the tag).
    fn gather_check_records(
        &mut self,
        name: &'static str,
        timeout: Option<Duration>,
        kind: DType,
        mine: &[u8],
    ) -> Result<Vec<u8>, CommError> {
        let mut all = vec![0u8; mine.len() * self.size];
        let tag = tag_base(self.next_seq(), CollKind::CallCheck, kind, ReduceOp::Max);
        self.run_tagged(name, tag, timeout, |ctx| {
            chorus_algorithms::collectives::allgather::run(
                chorus_algorithms::collectives::allgather::Algorithm::Ring,
                ctx,
                Some(mine),
                &mut all,
            )
        })?;
        Ok(all)
    }

    /// [`Communicator::run_collective`] with an explicit tag base and without advancing the
    /// collective sequence number: for point-to-point calls, which only two ranks make.
    pub(crate) fn run_tagged(
        &mut self,
        name: &'static str,
        tag: u64,
        timeout: Option<Duration>,
        schedule: impl FnOnce(&mut CollCtx<'_>) -> chorus_transport::Result<()>,
    ) -> Result<(), CommError> {
        self.check_usable(name)?;
        let timeout = timeout.unwrap_or(self.config.timeout);
        let mut ctx = CollCtx {
            transport: &mut *self.transport,
            deadline: chorus_transport::deadline_after(timeout),
            tag_base: tag,
            scratch: &mut self.scratch,
        };
        let r = schedule(&mut ctx);
        let r = r.map_err(|e| self.fail(name, e));
        // An abort requested while the call ran, after its last wait: the peers are told now.
        self.settle_abort();
        r
    }

    /// Block until every rank reached the barrier.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        self.run_call(
            Call::new("barrier", CollKind::Barrier, DType::Uint8, ReduceOp::Max),
            &[],
            chorus_algorithms::collectives::barrier::run,
        )
    }

    /// Give up: tell every peer (so they fail fast naming this rank) and make this communicator
    /// unusable. Never blocks for longer than a short bounded time. From another thread, while
    /// a call runs, use [`Communicator::abort_handle`].
    pub fn abort(&mut self, reason: &str) {
        if let Err(e) = self.check_process("abort") {
            // A forked child: the connections are the parent's, which still runs this rank.
            self.broken.get_or_insert_with(|| e.to_string());
            return;
        }
        let notice = AbortNotice {
            culprit: None,
            reason: format!("rank {} aborted the communicator: {reason}", self.rank),
        };
        // Through the handle too, so that it reads requested and done alike.
        self.abort_handle.request(notice.clone());
        self.transport
            .abort(&self.abort_handle.requested().unwrap_or(notice));
        self.abort_handle.mark_acted();
        if self.broken.is_none() {
            self.broken = Some(format!("aborted: {reason}"));
        }
    }

    /// A handle that aborts this communicator from another thread, also while a call runs on
    /// it (see [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            inner: self.abort_handle.clone(),
            rank: self.rank,
        }
    }

    /// Whether one of `peers` is gone, as the transport sees it without a call (see
    /// [`Transport::lost_peer`]).
    pub(crate) fn lost_peer(&mut self, peers: &[usize]) -> Option<TransportError> {
        self.transport.lost_peer(peers)
    }

    /// The abort requested through the handle, if any.
    pub(crate) fn requested_abort(&self) -> Option<AbortNotice> {
        self.abort_handle.requested()
    }

    /// Carry out an abort requested through the handle while no call ran (the peers have not
    /// been told yet).
    pub(crate) fn settle_abort(&mut self) {
        if self.check_process("abort").is_err() {
            // A forked child: only the parent speaks for this rank.
            return;
        }
        if self.abort_handle.is_requested() && !self.abort_handle.acted() {
            if let Some(n) = self.abort_handle.requested() {
                self.transport.abort(&n);
                self.abort_handle.mark_acted();
                self.broken.get_or_insert(n.reason);
            }
        }
    }

    /// The transport, for the queue's point-to-point progress (`queue::p2p`), which posts and
    /// progresses requests of its own between calls.
    pub(crate) fn transport_mut(&mut self) -> &mut dyn Transport {
        &mut *self.transport
    }

    /// For a collective this rank refused before it ran (an argument check of a binding, or
    /// of chorus itself), without `CHORUS_CHECK_CALLS`: the call's sequence number goes, as if
    /// it had run. Ranks that all refused stay in step; where only this one did (a root's
    /// buffer), the others' messages of that call are not taken for this rank's next call
    /// (which would return them as its result, one call behind from then on): that call
    /// fails as a mismatch instead, and every rank learns of it. With `CHORUS_CHECK_CALLS`,
    /// this rank takes part in the comparison of calls as one that refused (waiting for the
    /// others, within the timeout): ranks that made the call fail there at once, saying so,
    /// and the ranks stay in step. Nothing for one rank, or on a broken communicator.
    #[doc(hidden)]
    pub fn skip_refused_call(&mut self) {
        if self.size == 1 || self.broken.is_some() {
            return;
        }
        if !self.config.check_calls {
            self.next_seq();
            return;
        }
        // (A comparison that fails otherwise than as a mismatch broke the communicator:
        // its next call says so.)
        let call = Call::new(
            "refused call",
            CollKind::Refused,
            DType::Uint8,
            ReduceOp::Sum,
        );
        let _ = self.compare_calls(call, &[], true);
    }

    pub(crate) fn next_seq(&mut self) -> u32 {
        let s = self.seq;
        self.seq = self.seq.wrapping_add(1);
        s
    }

    /// An error when called in a child forked from the process that made the communicator:
    /// its connections and segments are shared with the parent, which still runs this rank.
    pub(crate) fn check_process(&self, op: &'static str) -> Result<(), CommError> {
        self.process.check(op, self.rank)
    }

    pub(crate) fn check_usable(&mut self, op: &'static str) -> Result<(), CommError> {
        self.check_process(op)?;
        self.settle_abort();
        match &self.broken {
            None => Ok(()),
            Some(why) => Err(CommError::new(
                ErrorKind::InvalidUsage,
                op,
                format!(
                    "the communicator is unusable after an earlier error ({why}); create a new one"
                ),
            )
            .at_rank(self.rank)
            .with_usable(false)),
        }
    }

    /// Turn a transport error into a communicator error; on a peer-related error, abort so that
    /// the other ranks hear about it now rather than at their timeout.
    pub(crate) fn fail(&mut self, op: &'static str, e: TransportError) -> CommError {
        let mismatch_detail = match &e {
            TransportError::Mismatch {
                expected_tag,
                got_tag,
                ..
            } if expected_tag != got_tag => Some(format!(
                "; this rank is in {}, rank {} sent a message of {}{}",
                describe_tag(*expected_tag),
                e.culprit().unwrap_or(usize::MAX),
                describe_tag(*got_tag),
                if only_arguments_differ(*expected_tag, *got_tag) {
                    " (the same call with other arguments: ranks passed different counts or \
                     roots)"
                } else {
                    ""
                }
            )),
            _ => None,
        };
        let recoverable = e.is_recoverable();
        if !recoverable {
            let culprit = e.culprit();
            let reason = format!("rank {} failed in {op}: {e}", self.rank);
            // An abort requested from another thread that a part of the transport (shared
            // memory or TCP) noticed: every part tells its peers the requested reason.
            let notice = match (&e, self.abort_handle.requested()) {
                (TransportError::Aborted(_), Some(n)) => n,
                _ => AbortNotice {
                    culprit,
                    reason: reason.clone(),
                },
            };
            self.transport.abort(&notice);
            self.abort_handle.mark_acted();
            self.broken = Some(reason);
        }
        let mut err = CommError::from_transport(op, e).at_rank(self.rank);
        if let Some(d) = mismatch_detail {
            err = err.with_detail(&d);
        }
        log::log(Level::Warn, Some(self.rank), format_args!("{err}"));
        err
    }
}

/// Why `CHORUS_TRANSPORT=rdma` runs over TCP (and shared memory between the ranks of a host).
#[cfg(feature = "rdma")]
pub(crate) fn rdma_fallback_reason() -> String {
    chorus_transport::rdma::fallback_reason()
}

/// Why `CHORUS_TRANSPORT=rdma` runs over TCP (and shared memory between the ranks of a host).
#[cfg(not(feature = "rdma"))]
pub(crate) fn rdma_fallback_reason() -> String {
    "this chorus was built without the `rdma` cargo feature; using TCP (shared memory between the ranks of a host)".into()
}

/// The shared-memory transport's tunables, from `CHORUS_SHM_RING_BYTES` and
/// `CHORUS_SHM_CHUNK_BYTES` (every rank must use the same values).
fn shm_options() -> Result<ShmOptions, CommError> {
    let mut o = ShmOptions::default();
    if let Some(b) = env_parse::<usize>("CHORUS_SHM_RING_BYTES")? {
        o.ring_bytes = Some(b.clamp(4096, 1 << 30));
    }
    if let Some(b) = env_parse::<usize>("CHORUS_SHM_CHUNK_BYTES")? {
        o.chunk_bytes = b.clamp(4096, 1 << 30);
    }
    Ok(o)
}

/// The direct same-host allreduce of [`chorus_transport::shm::allreduce`], with this crate's
/// reduce kernels.
fn shm_all_reduce(
    ctx: &mut CollCtx<'_>,
    send: Option<&[u8]>,
    recv: &mut [u8],
    dtype: DType,
    op: ReduceOp,
) -> chorus_transport::Result<()> {
    let size = ctx.transport.size();
    let reduce = |d: &mut [u8], s: &[u8]| chorus_algorithms::reduce::reduce_bytes(dtype, op, d, s);
    let finish = |d: &mut [u8]| {
        if op == ReduceOp::Avg {
            chorus_algorithms::reduce::finish_avg_bytes(dtype, d, size)
        }
    };
    let red = Reducer {
        elem_size: dtype.size(),
        reduce: &reduce,
        finish: &finish,
    };
    let (tag, deadline) = (ctx.tag(0), ctx.deadline);
    match ctx.transport.shared_memory() {
        Some(shm) => shm.all_reduce(send, recv, tag, deadline, &red),
        None => Err(TransportError::InvalidUsage(
            "no shared-memory transport".into(),
        )),
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // An abort requested through the handle and not yet carried out (no call ran since):
        // the peers are told its reason, not only that the connections closed.
        self.settle_abort();
        // Dropping closes every connection; peers still in a collective see the close at once.
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("transport", &self.transport.name())
            .field("broken", &self.broken)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank whose settings never come (it died after the connections formed): rank 0 and
    /// the others, waiting for rank 0's verdict, all time out naming that rank.
    #[test]
    fn a_rank_whose_settings_never_come_is_named_by_every_rank() {
        use chorus_transport::rendezvous::{StoreClient, StoreServer};
        let server = StoreServer::bind("127.0.0.1:0".parse().unwrap(), b"t").unwrap();
        let addr = server.local_addr();
        let hs: Vec<_> = [0usize, 1]
            .into_iter()
            .map(|rank| {
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_millis(800);
                    let mut store =
                        StoreClient::connect(addr, b"t", Instant::now() + Duration::from_secs(10))
                            .unwrap();
                    // Bound as init bounds it: the wait for rank 0's verdict still lasts past
                    // the deadline, where rank 0 writes it.
                    store.set_deadline(deadline);
                    let settings = [("CHORUS_ALGO", ("ring".to_string(), "ring".to_string()))];
                    agree_on_settings(&mut store, 7, rank, 3, &settings, deadline).unwrap_err()
                })
            })
            .collect();
        for (rank, h) in hs.into_iter().enumerate() {
            let e = h.join().unwrap();
            assert_eq!(e.kind(), ErrorKind::Timeout, "rank {rank}: {e}");
            assert_eq!(e.peer(), Some(2), "rank {rank}: {e}");
        }
    }

    #[test]
    fn root_names_that_may_be_loopback_on_their_host_only() {
        for named in ["node0:29501", "gpu-7.cluster:1", "NODE0:2", "[node0]:3"] {
            assert!(names_a_host(named), "{named}");
        }
        for not in [
            "127.0.0.1:1",
            "127.0.1.1:1",
            "[::1]:1",
            "10.0.0.1:5",
            "localhost:1",
            "LocalHost:1",
            "localhost6.localdomain6:1",
            "127.1:1",
            "ip6-localhost:1",
            "a.localhost:1",
        ] {
            assert!(!names_a_host(not), "{not}");
        }
    }

    #[test]
    fn keepalive_seconds() {
        assert_eq!(keepalive_of(0).unwrap(), None);
        assert_eq!(keepalive_of(3).unwrap(), Some(Duration::from_secs(3)));
        assert_eq!(
            keepalive_of(86_400).unwrap(),
            Some(Duration::from_secs(86_400))
        );
        let e = keepalive_of(86_401).unwrap_err().to_string();
        assert!(e.contains("CHORUS_TCP_KEEPALIVE=86401"), "{e}");
    }

    #[test]
    fn tcp_congestion_names() {
        let preferred = (Some(DEFAULT_TCP_CONGESTION.to_string()), false);
        assert_eq!(parse_tcp_congestion("").unwrap(), preferred);
        assert_eq!(parse_tcp_congestion("system").unwrap(), (None, false));
        assert_eq!(
            parse_tcp_congestion(" reno ").unwrap(),
            (Some("reno".to_string()), true)
        );
        assert!(parse_tcp_congestion("a_name_that_is_too_long").is_err());
        assert!(parse_tcp_congestion("cu bic").is_err());
        assert!(parse_tcp_congestion("../x").is_err());
    }

    #[test]
    fn tag_layout_round_trips() {
        let t = tag_base(7, CollKind::AllReduce, DType::Float32, ReduceOp::Max) | 3;
        let d = describe_tag(t);
        assert!(d.contains("all_reduce #7"), "{d}");
        let late = tag_base(
            SEQ_MASK + 8,
            CollKind::AllReduce,
            DType::Float32,
            ReduceOp::Max,
        );
        assert!(
            describe_tag(late).contains("all_reduce #7"),
            "the sequence number wraps"
        );
        assert_eq!(late >> 48, 7);
        // The fingerprint's bits, and only those (with the step's), count as other arguments.
        let base = tag_base(9, CollKind::Broadcast, DType::Int32, ReduceOp::Sum);
        let args = base | 0x1234 << 32;
        assert!(
            describe_tag(args).contains("arguments 1234"),
            "{}",
            describe_tag(args)
        );
        assert!(only_arguments_differ(base | 5, args | 6));
        assert!(!only_arguments_differ(base, base | 1 << 48), "another call");
        assert!(
            !only_arguments_differ(base, base | 1 << 24),
            "another collective"
        );
        assert!(!only_arguments_differ(base, base | 7), "only the step");
        assert!(d.contains("float"), "{d}");
        assert!(d.contains("max"), "{d}");
        assert!(d.contains("step 3"), "{d}");
    }

    #[test]
    fn call_bits_tell_arguments_apart() {
        assert_eq!(call_bits(&[]) & !0xffff_0000_0000, 0);
        assert_eq!(call_bits(&[4, 0]), call_bits(&[4, 0]));
        assert_ne!(call_bits(&[4]), call_bits(&[8]));
        // Counts and roots ranks plausibly confuse: distinct fingerprints.
        let mut seen = std::collections::HashSet::new();
        for bytes in [4u64, 8, 12, 16] {
            for root in [0u64, 256] {
                assert!(seen.insert(call_bits(&[bytes, root])), "{bytes} {root}");
            }
        }
        // Spread: 65536 byte counts fill most of the 65536 values (1 − 1/e of them at random).
        let values: std::collections::HashSet<u64> =
            (0..65536u64).map(|n| call_bits(&[n * 4])).collect();
        assert!(values.len() > 40_000, "{}", values.len());
    }

    #[test]
    fn group_of_one_is_local() {
        let mut c = Communicator::new(Config::new(0, 1, "127.0.0.1:0")).unwrap();
        let mut v = vec![1.5f32, 2.0, 3.0];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, [1.5, 2.0, 3.0]);
        c.all_reduce(&mut v, ReduceOp::Avg).unwrap();
        assert_eq!(v, [1.5, 2.0, 3.0]);
        c.barrier().unwrap();
        let e = c
            .all_reduce_into(&[1.0f32], &mut v, ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.is_usable());
        // A per-call timeout below 1 ms is refused, as `set_timeout` refuses one.
        let opts = AllReduceOptions {
            timeout: Some(Duration::from_micros(10)),
            ..Default::default()
        };
        let e = c
            .all_reduce_with(None, &mut v, ReduceOp::Sum, &opts)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("1 ms"), "{e}");
        assert!(c.is_usable());
    }

    #[test]
    fn rank_counts_out_of_range_are_refused_before_rendezvous() {
        // Nothing listens at port 1: a count that got past the check would wait there.
        for (rank, size) in [
            (0, 0),
            (2, 2),
            (0, MAX_WORLD_SIZE + 1),
            (0, i32::MAX as usize),
        ] {
            let started = Instant::now();
            let e = Communicator::new(Config::new(rank, size, "127.0.0.1:1")).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{rank}/{size}: {e}");
            assert!(started.elapsed() < Duration::from_secs(5), "{rank}/{size}");
        }
    }
}
