//! Communicator configuration, explicit or read from the environment.
//!
//! Variables (explicit `CHORUS_*` wins over the launchers' ones):
//! - rank: `CHORUS_RANK`, else `RANK` (torchrun), `OMPI_COMM_WORLD_RANK` (Open MPI),
//!   `PMI_RANK` (MPICH/Hydra), `SLURM_PROCID` (Slurm).
//! - size: from the launcher that gave the rank: `CHORUS_WORLD_SIZE`, `WORLD_SIZE`,
//!   `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_STEP_NUM_TASKS` (the tasks of the srun step;
//!   a batch script, which has none, is rank 0 of 1 in an allocation of one task and refused
//!   in a larger one).
//! - local rank: `CHORUS_LOCAL_RANK`, else the rank's launcher's `LOCAL_RANK`,
//!   `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID` (started by srun, also
//!   `SLURM_LOCALID`), `SLURM_LOCALID`; ranks on this host:
//!   `CHORUS_LOCAL_SIZE`, else the rank's launcher's `LOCAL_WORLD_SIZE`,
//!   `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS` (Slurm: all of them when
//!   `SLURM_STEP_NUM_NODES=1`). Another launcher's variables, left in the environment of
//!   the process that started this one, are not read.
//! - root address: `CHORUS_ADDR` (`host:port`; IPv6 as `[addr]:port`), else `MASTER_ADDR` with
//!   port `CHORUS_PORT`, else `MASTER_PORT + 1` (torchrun's own store holds `MASTER_PORT`);
//!   for a rank srun started (`SLURM_PROCID`), else the first node of `SLURM_STEP_NODELIST`
//!   (where task 0 runs) with `CHORUS_PORT`, else a port made from `SLURM_JOB_ID` and
//!   `SLURM_STEP_ID` (20000..32000), so `srun -N2 -n8 prog` needs no variable.
//!   A single rank needs no rendezvous: it reads none of these and gets `127.0.0.1:0`.
//!   torchrun's jobs on one host at consecutive `MASTER_PORT`s collide (one's `MASTER_PORT +
//!   1` is the next one's `MASTER_PORT`): space them by two, or set `CHORUS_PORT`.
//! - `CHORUS_TOKEN` (else, under torchrun, Open MPI or Slurm, a token made from the job's id:
//!   `TORCHELASTIC_RUN_ID`, `OMPI_MCA_ess_base_jobid`, `SLURM_JOB_ID` and `SLURM_STEP_ID`,
//!   so that two jobs given one address do not mix), `CHORUS_TIMEOUT` (seconds, float;
//!   collectives), `CHORUS_INIT_TIMEOUT`
//!   (seconds; rendezvous), `CHORUS_SOCKET_IFNAME`, `CHORUS_TRANSPORT`, `CHORUS_ALGO`,
//!   `CHORUS_DEBUG` (read by [`crate::log`]).
//! - Read by the selector at init ([`crate::select`]): `CHORUS_ALPHA_US`, `CHORUS_BETA_GBPS`
//!   (link figures instead of the probe), `CHORUS_TUNE=0|off` (no online tuning of `auto`).
//! - `CHORUS_TUNE_FILE`: where tuning decisions are kept across launches
//!   ([`crate::tune_file`]).
//!
//! A variable set to an empty or blank string counts as unset. Errors name the missing or
//! malformed variable and what would fix it.

use std::net::Ipv6Addr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::CommError;

/// Default timeout of one collective: 5 minutes (a hung peer is reported, a slow large
/// collective on a slow link is not cut short).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Default timeout of the rendezvous (all ranks must have started within it).
pub const DEFAULT_INIT_TIMEOUT: Duration = Duration::from_secs(300);

/// Everything a communicator needs to start. Its `Debug` output shows whether a token is
/// set, not the token.
#[derive(Clone, PartialEq)]
pub struct Config {
    /// This rank, `0..size`.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank on this host, if the launcher said.
    pub local_rank: Option<usize>,
    /// Ranks on this host, if the launcher said (`CHORUS_LOCAL_SIZE`, `LOCAL_WORLD_SIZE`,
    /// ...). Fewer than `size`: the job spans hosts, which init needs to know when the root's
    /// name resolves to a loopback address here (see [`crate::Communicator::new`]).
    pub local_size: Option<usize>,
    /// `host:port` of the rendezvous store.
    pub root_addr: String,
    /// Shared secret authenticating every connection (`None`: protocol check only).
    pub token: Option<String>,
    /// Timeout of every collective.
    pub timeout: Duration,
    /// Timeout of the rendezvous.
    pub init_timeout: Duration,
    /// NCCL-grammar interface selection.
    pub socket_ifname: Option<String>,
    /// Whether this rank hosts the store: `None` = rank 0 does.
    pub host_store: Option<bool>,
    /// Forced transport: `auto` (the default), `tcp`, `shm`, or `rdma` (probes the RDMA devices,
    /// then falls back to TCP and says why: no NIC over real verbs yet).
    pub transport: Option<String>,
    /// Algorithm override in NCCL's `CHORUS_ALGO` grammar.
    pub algo: Option<String>,
    /// Where allreduce tuning decisions are kept across launches (`CHORUS_TUNE_FILE`, see
    /// [`crate::tune_file`]); set it on every rank or on none.
    pub tune_file: Option<PathBuf>,
    /// The link's latency in microseconds per message, instead of the probe's figure (wins
    /// over `CHORUS_ALPHA_US`; see [`crate::select`]). Set it the same on every rank, or on
    /// none: ranks with both figures configured skip the probe the others run.
    pub alpha_us: Option<f64>,
    /// The link's bandwidth in GB/s, instead of the probe's figure (wins over
    /// `CHORUS_BETA_GBPS`). Set it the same on every rank, or on none.
    pub beta_gbps: Option<f64>,
    /// `CHORUS_CHECK_CALLS`: before every collective the ranks compare what they were called
    /// with (collective, dtype, op, sizes, root), one small allgather per call, and fail alike
    /// on any difference, naming each rank's call. Off by default: most mismatches are caught
    /// without it, as messages arrive; this also catches those in which no rank receives a
    /// message (every rank a root), for debugging; the counts of alltoallv, gatherv and
    /// scatterv, which differ from rank to rank, are compared pair by pair (one small alltoall
    /// and allgather more). Set it the same on every rank. A rank that
    /// refuses its own arguments (a root's buffer of the wrong size) still takes part in the
    /// comparison, so the others fail at once, naming it, instead of waiting out their
    /// timeout (refusals the C and Python layers make before calling in, such as a NULL
    /// pointer, take no part in the comparison: the others wait out their timeout there).
    pub check_calls: bool,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("root_addr", &self.root_addr)
            .field("token", &self.token.as_ref().map(|_| "<secret>"))
            .field("timeout", &self.timeout)
            .field("init_timeout", &self.init_timeout)
            .field("socket_ifname", &self.socket_ifname)
            .field("host_store", &self.host_store)
            .field("transport", &self.transport)
            .field("algo", &self.algo)
            .field("tune_file", &self.tune_file)
            .field("alpha_us", &self.alpha_us)
            .field("beta_gbps", &self.beta_gbps)
            .field("check_calls", &self.check_calls)
            .finish()
    }
}

/// How the tokens made from a launcher's job ids begin (see [`Config::token_is_secret`]).
const JOB_TOKEN_PREFIX: &str = "chorus-job-";

impl Config {
    /// Whether the token is a secret someone chose (`CHORUS_TOKEN`, a unique id's), not one
    /// made from the launcher's job id (which keeps two jobs apart but anyone who can list
    /// the jobs knows) or none.
    pub fn token_is_secret(&self) -> bool {
        self.token
            .as_deref()
            .is_some_and(|t| !t.starts_with(JOB_TOKEN_PREFIX))
    }

    /// A configuration for `rank` of `size` with the store at `root_addr`, defaults elsewhere.
    pub fn new(rank: usize, size: usize, root_addr: impl Into<String>) -> Config {
        Config {
            rank,
            size,
            local_rank: None,
            local_size: None,
            root_addr: root_addr.into(),
            token: None,
            timeout: DEFAULT_TIMEOUT,
            init_timeout: DEFAULT_INIT_TIMEOUT,
            socket_ifname: None,
            host_store: None,
            transport: None,
            algo: None,
            tune_file: None,
            alpha_us: None,
            beta_gbps: None,
            check_calls: false,
        }
    }

    /// Read the process environment. A `CHORUS_*` variable whose value is not UTF-8 is an
    /// error (read as unset, a `CHORUS_TOKEN` of other bytes would turn authentication off).
    pub fn from_env() -> Result<Config, CommError> {
        refuse_garbled_env()?;
        let get = |k: &str| std::env::var(k).ok();
        let config = Config::from_lookup(get)?;
        if let Some(why) = chorus_vars_below_launcher(&Lookup(&get), config.size) {
            crate::log::log(
                crate::log::Level::Warn,
                Some(config.rank),
                format_args!("{why}"),
            );
        }
        Ok(config)
    }

    /// Where the process environment places this rank, with the token it would use, when
    /// [`Config::from_env`] failed on another setting (a `CHORUS_TIMEOUT` that is not a
    /// number, say): enough to tell the others through the store. `None` when the placement
    /// itself is wrong.
    pub(crate) fn placement_from_env() -> Option<Config> {
        // A `CHORUS_*` value that is not UTF-8 would read as unset here: another launcher's
        // rank or address, or no token, would stand in for it.
        refuse_garbled_env().ok()?;
        let get = |k: &str| std::env::var(k).ok();
        let (mut config, job_token) = read_placement(&get).ok()?;
        config.token = token_of(&get).or(job_token);
        Some(config)
    }

    /// Read variables through `get` (testable without touching the process environment).
    ///
    /// See the [module documentation](self) for the variables. Errors: an invalid-argument
    /// [`CommError`] (op `"init"`) naming the variable when rank or size is missing or not a
    /// number, the size is 0 or above 1 048 576, the rank or local rank is not below the size,
    /// the address has no port or is malformed, there is no address for a job of several
    /// ranks, or a timeout is not a positive number of seconds.
    ///
    /// ```
    /// use std::collections::HashMap;
    /// use chorus::Config;
    ///
    /// let env: HashMap<&str, &str> = [
    ///     ("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"),
    ///     ("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500"),
    /// ].into();
    /// let c = Config::from_lookup(|k| env.get(k).map(|v| v.to_string()))?;
    /// assert_eq!((c.rank, c.size, c.local_rank), (1, 4, Some(1)));
    /// assert_eq!(c.root_addr, "node0:29501");
    /// # Ok::<(), chorus::CommError>(())
    /// ```
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, CommError> {
        read_config(&get).map_err(|message| CommError::invalid("init", message))
    }

    /// Rank `rank` of `size` joining through `id` (see [`crate::UniqueId`]): the store and
    /// secret come from the id, the other settings (timeouts, interface, transport,
    /// algorithms, ...) from the process environment as [`Config::from_env`] reads them;
    /// no variable giving a rank, size or address is needed. A `CHORUS_TOKEN` is not used:
    /// the id's secret authenticates the connections.
    pub fn from_unique_id(
        id: &crate::UniqueId,
        rank: usize,
        size: usize,
    ) -> Result<Config, CommError> {
        let mut config = Config::with_env_settings(rank, size, id.root_addr())?;
        config.token = Some(id.token());
        config.host_store = Some(false);
        Ok(config)
    }

    /// Rank `rank` of `size` with the store at `root_addr`, given by the caller, and the other
    /// settings (token, timeouts, interface, transport, algorithms, tuning file, call checks)
    /// from the process environment as [`Config::from_env`] reads them. What the C and Python
    /// `init(rank, size, addr, token)` build, as NCCL's explicit init still reads `NCCL_*`.
    pub fn with_env_settings(
        rank: usize,
        size: usize,
        root_addr: impl Into<String>,
    ) -> Result<Config, CommError> {
        refuse_garbled_env()?;
        let mut config = Config::new(rank, size, root_addr);
        read_settings(&|k| std::env::var(k).ok(), &mut config)
            .map_err(|message| CommError::invalid("init", message))?;
        Ok(config)
    }

    /// Whether this rank hosts the store.
    pub fn hosts_store(&self) -> bool {
        self.host_store.unwrap_or(self.rank == 0)
    }
}

/// An error naming the first variable of the process environment that chorus reads
/// (`CHORUS_*`, the launchers', [`OTHER_VARS_READ`]) whose value is not UTF-8: read as unset,
/// a `CHORUS_TOKEN` of other bytes would turn authentication off, a garbled setting would be
/// ignored silently, and a garbled rank or address would come from the next launcher in line.
fn refuse_garbled_env() -> Result<(), CommError> {
    let garbled = std::env::vars_os().find_map(|(k, v)| {
        let k = k.to_str()?;
        (v.to_str().is_none() && is_read(k)).then(|| k.to_string())
    });
    match garbled {
        Some(k) => Err(CommError::invalid(
            "init",
            format!("{k} is not valid UTF-8"),
        )),
        None => Ok(()),
    }
}

/// Whether chorus reads the environment variable `k` (see [`refuse_garbled_env`]).
fn is_read(k: &str) -> bool {
    k.starts_with("CHORUS_")
        || OTHER_VARS_READ.contains(&k)
        || LAUNCHERS.iter().any(|l| {
            [l.rank, l.size, l.launch_size, l.local_rank].contains(&k)
                || l.local_size == Some(k)
                || l.job.contains(&k)
        })
}

/// The variables chorus reads besides `CHORUS_*` and the launchers' ([`LAUNCHERS`]).
const OTHER_VARS_READ: &[&str] = &[
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURMD_NODENAME",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
];

/// The body of [`Config::from_lookup`]; errors are the message of the invalid-argument error.
fn read_config(get: &dyn Fn(&str) -> Option<String>) -> Result<Config, String> {
    let (mut config, job_token) = read_placement(get)?;
    read_settings(get, &mut config)?;
    if config.token.is_none() {
        config.token = job_token;
    }
    Ok(config)
}

/// Where [`read_config`] places this rank (rank, size, local rank and size, store address),
/// with no other setting read, and the token its launcher's job ids make, if any: the
/// ranks authenticate with it when `CHORUS_TOKEN` is unset.
fn read_placement(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<(Config, Option<String>), String> {
    let env = Lookup(get);

    let names = |field: fn(&Launcher) -> &'static str| {
        LAUNCHERS[1..]
            .iter()
            .map(field)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (launcher, rank) = LAUNCHERS
        .iter()
        .find_map(|l| env.value(l.rank).map(|v| (l, v)))
        .ok_or_else(|| {
            format!(
                "no rank: set CHORUS_RANK (launchers set one of {})",
                names(|l| l.rank)
            )
        })?;
    let rank_var = launcher.rank;
    let rank = parse_count(rank_var, &rank)?;
    // The size from the launcher that gave the rank, never another's: a rank and a size of
    // two launchers (a stale `RANK=0` in the shell, then `mpirun -np 4`) would make every
    // process rank 0 of 4.
    let (size_var, size) = match env.value(launcher.size) {
        Some(v) => (launcher.size, v),
        // Slurm's batch script (one process, whatever the allocation's task count) has no
        // step size: alone in an allocation of one task it is rank 0 of 1; in a larger one,
        // the ranks were meant to be started with srun.
        None if launcher.name == "Slurm" => match env.value("SLURM_NTASKS") {
            Some(n) if n != "1" => {
                return Err(format!(
                    "{rank_var} is set but not SLURM_STEP_NUM_TASKS: this process runs the \
                     batch script of an allocation of SLURM_NTASKS={n} tasks, not a task of \
                     srun; start the ranks with srun (or set CHORUS_RANK and \
                     CHORUS_WORLD_SIZE)"
                ))
            }
            _ => ("SLURM_NTASKS", "1".to_string()),
        },
        None if launcher.name == "chorus" => {
            return Err(format!(
                "{rank_var} is set but not {}: set it too",
                launcher.size
            ))
        }
        None => {
            return Err(format!(
                "{rank_var} is set but not {}: set both ({} sets them together), or \
                 CHORUS_RANK and CHORUS_WORLD_SIZE",
                launcher.size, launcher.name
            ))
        }
    };
    let size = parse_count(size_var, &size)?;
    check_other_launchers(&env, launcher, (rank_var, rank), (size_var, size))?;
    if size == 0 {
        return Err(format!("{size_var}=0: the world size must be at least 1"));
    }
    if size > MAX_WORLD_SIZE {
        return Err(format!(
            "{size_var}={size} is above the limit of {MAX_WORLD_SIZE} ranks"
        ));
    }
    if rank >= size {
        return Err(format!(
            "{rank_var}={rank} is not below {size_var}={size}: ranks are 0..{size}"
        ));
    }
    // Started by srun: Slurm gave the rank, or srun's MPI plugin did (`--mpi=pmi2` sets
    // PMI_RANK and PMI_SIZE) and Slurm's own task id and count agree. Never for Open MPI's
    // variables: mpirun starts its ranks itself (through daemons that srun started, whose
    // Slurm variables the ranks inherit and which say nothing of the ranks), nor for Hydra's
    // (`MPI_LOCALRANKID`, which srun's plugin does not set): its proxies may be srun's tasks,
    // whose ids match some ranks' by chance.
    let hydra = launcher.name == "MPICH/Hydra" && env.value("MPI_LOCALRANKID").is_some();
    let srun = launcher.name == "Slurm"
        || (launcher.name != "Open MPI"
            && !hydra
            && env.value("SLURM_PROCID") == Some(rank.to_string())
            && env.value("SLURM_STEP_NUM_TASKS") == Some(size.to_string()));
    // From `CHORUS_LOCAL_RANK` or the launcher that gave the rank, as the local size below:
    // a `LOCAL_RANK` left in the shell says nothing of an mpirun job's ranks. srun's MPI
    // plugin (`--mpi=pmi2`) gives no local rank of its own: Slurm's is the ranks'.
    let mut local_rank_vars = vec!["CHORUS_LOCAL_RANK", launcher.local_rank];
    if srun && launcher.name != "Slurm" {
        local_rank_vars.push("SLURM_LOCALID");
    }
    let local_rank = match env.first(&local_rank_vars) {
        None => None,
        Some((var, v)) => {
            let local = parse_count(var, &v)?;
            if local >= size {
                return Err(format!("{var}={local} is not below the world size {size}"));
            }
            Some((var, local))
        }
    };
    // From `CHORUS_LOCAL_SIZE` or the launcher that gave the rank (another's count, left in
    // the environment of a process that launched this one, says nothing of this job). Slurm
    // gives none per host, but a step on one node is on one host.
    let local_vars: Vec<&'static str> = ["CHORUS_LOCAL_SIZE"]
        .into_iter()
        .chain(launcher.local_size)
        .collect();
    let local_size = match env.first(&local_vars) {
        Some((var, v)) => {
            let local = parse_count(var, &v)?;
            if local == 0 || local > size {
                return Err(format!(
                    "{var}={local} is not a number of ranks on this host (1..={size})"
                ));
            }
            Some(local)
        }
        None if srun && env.value("SLURM_STEP_NUM_NODES").as_deref() == Some("1") => Some(size),
        None => None,
    };
    if let (Some((var, local)), Some(count)) = (local_rank, local_size) {
        if local >= count {
            return Err(format!(
                "{var}={local} is not below the number of ranks on this host ({count}): \
                 local ranks are 0..{count}"
            ));
        }
    }
    let local_rank = local_rank.map(|(_, local)| local);

    let (root_addr, slurm_token) = root_addr(&env, size, srun.then_some(rank))?;

    let mut config = Config::new(rank, size, root_addr);
    config.local_rank = local_rank;
    config.local_size = local_size;
    // The port srun's ranks meet at is made from the job and step ids, and another job's
    // step may land on it: ranks authenticate with those ids, so that such a collision
    // fails the handshake instead of mixing two jobs. Other launchers' job ids serve
    // alike where ranks meet at an address the user gave (two jobs given the same).
    let token = slurm_token.or_else(|| job_token(&env, launcher));
    Ok((config, token))
}

/// `CHORUS_TOKEN`: a secret, used exactly as given (not trimmed); empty or blank means none,
/// as for every variable.
fn token_of(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    get("CHORUS_TOKEN").filter(|t| !t.trim().is_empty())
}

/// The settings of `config` that do not place it in a job: token, timeouts, interface,
/// transport, algorithms, tuning file, call checks.
fn read_settings(get: &dyn Fn(&str) -> Option<String>, config: &mut Config) -> Result<(), String> {
    let env = Lookup(get);
    config.token = token_of(get);
    if let Some(v) = env.value("CHORUS_TIMEOUT") {
        config.timeout = parse_seconds("CHORUS_TIMEOUT", &v)?;
    }
    if let Some(v) = env.value("CHORUS_INIT_TIMEOUT") {
        config.init_timeout = parse_seconds("CHORUS_INIT_TIMEOUT", &v)?;
    }
    config.socket_ifname = env.value("CHORUS_SOCKET_IFNAME");
    config.transport = env
        .value("CHORUS_TRANSPORT")
        .map(|t| t.to_ascii_lowercase());
    config.algo = env.value("CHORUS_ALGO");
    config.tune_file = env.value(crate::tune_file::ENV).map(PathBuf::from);
    if let Some(v) = env.value("CHORUS_CHECK_CALLS") {
        config.check_calls = parse_switch("CHORUS_CHECK_CALLS", &v)
            .map_err(|e| e.message().to_string())?
            .unwrap_or(false);
    }
    Ok(())
}

/// A launcher's variables: the rank, the world size, and the size of the current launch as
/// the consistency check reads it (Slurm's step, not its allocation).
struct Launcher {
    name: &'static str,
    rank: &'static str,
    size: &'static str,
    launch_size: &'static str,
    /// Its count of ranks on this host, if it gives one.
    local_size: Option<&'static str>,
    /// Its rank on this host.
    local_rank: &'static str,
    /// The variables that together name its job (the same in every rank of one launch,
    /// another in the next): without `CHORUS_TOKEN`, ranks authenticate with them, so that
    /// another job meeting at the same address fails the handshake instead of joining.
    job: &'static [&'static str],
}

/// The launchers, in order of precedence (the first whose rank variable is set gives the rank).
const LAUNCHERS: &[Launcher] = &[
    Launcher {
        name: "chorus",
        rank: "CHORUS_RANK",
        size: "CHORUS_WORLD_SIZE",
        launch_size: "CHORUS_WORLD_SIZE",
        local_size: Some("CHORUS_LOCAL_SIZE"),
        local_rank: "CHORUS_LOCAL_RANK",
        job: &[],
    },
    Launcher {
        name: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        launch_size: "WORLD_SIZE",
        local_size: Some("LOCAL_WORLD_SIZE"),
        local_rank: "LOCAL_RANK",
        // The rendezvous id (`--rdzv-id`; a fresh one per launch with `--standalone`). Not
        // the restart count: a node that joins an elastic job later counts from 0.
        job: &["TORCHELASTIC_RUN_ID"],
    },
    Launcher {
        name: "Open MPI",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        launch_size: "OMPI_COMM_WORLD_SIZE",
        local_size: Some("OMPI_COMM_WORLD_LOCAL_SIZE"),
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        job: &["OMPI_MCA_ess_base_jobid"],
    },
    Launcher {
        name: "MPICH/Hydra",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        launch_size: "PMI_SIZE",
        local_size: Some("MPI_LOCALNRANKS"),
        local_rank: "MPI_LOCALRANKID",
        job: &[],
    },
    Launcher {
        name: "Slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_STEP_NUM_TASKS",
        launch_size: "SLURM_STEP_NUM_TASKS",
        local_size: None,
        local_rank: "SLURM_LOCALID",
        job: &["SLURM_JOB_ID", "SLURM_STEP_ID"],
    },
];

/// A token naming `launcher`'s job, from its job variables (all set, none blank), if it has
/// them.
fn job_token(env: &Lookup<'_>, launcher: &Launcher) -> Option<String> {
    if launcher.job.is_empty() {
        return None;
    }
    let parts: Option<Vec<String>> = launcher.job.iter().map(|v| env.value(v)).collect();
    Some(format!(
        "{JOB_TOKEN_PREFIX}{}-{}",
        launcher.name,
        parts?.join("-")
    ))
}

/// The variables through which the launchers chorus reads besides its own (torchrun, Open
/// MPI, MPICH/Hydra, Slurm) give a process its rank, the job's size and its place on its host.
/// A launcher of chorus's own (`chorus-perf --ranks`) removes them from the processes it
/// starts, whose ranks they do not describe.
pub fn other_launcher_variables() -> Vec<&'static str> {
    let mut vars: Vec<&'static str> = LAUNCHERS
        .iter()
        .filter(|l| l.name != "chorus")
        .flat_map(|l| {
            [l.rank, l.size, l.launch_size, l.local_rank]
                .into_iter()
                .chain(l.local_size)
        })
        .collect();
    vars.sort_unstable();
    vars.dedup();
    vars
}

/// Refuses a rank taken from one launcher's variables while another launcher's say this
/// process is one of more: left over from another launch (a shell that exported `RANK=0
/// WORLD_SIZE=1`, then `mpirun -np 4`), they would make every process rank 0 of a job of its
/// own, silently. Launchers nested the usual way (torchrun under srun or mpirun) give the inner
/// one at least as many ranks, and the `CHORUS_*` variables are taken as meant (with a
/// warning when they make fewer ranks, [`chorus_vars_below_launcher`]). So are torchrun's in
/// a worker it started (`TORCHELASTIC_RUN_ID` set: `srun -n 4 torchrun --standalone ...` runs
/// four jobs of their own), and every launcher's under `CHORUS_RUN_NESTED=1`.
fn check_other_launchers(
    env: &Lookup<'_>,
    chosen: &Launcher,
    (rank_var, rank): (&str, usize),
    (size_var, size): (&str, usize),
) -> Result<(), String> {
    if chosen.name == "chorus"
        || env
            .value("CHORUS_RUN_NESTED")
            .is_some_and(|v| v.trim() == "1")
    {
        return Ok(());
    }
    if chosen.name == "torchrun" && env.value("TORCHELASTIC_RUN_ID").is_some() {
        // torchrun's agent set this worker's variables itself: an outer launcher that started
        // more processes started several torchrun jobs (a sweep), not stale variables.
        return Ok(());
    }
    // mpirun (Open MPI, Hydra) inside a Slurm allocation starts its ranks through daemons
    // that srun started, one per node: the ranks inherit the daemons' step, whose task count
    // is the number of nodes, not of ranks.
    let mpi = matches!(chosen.name, "Open MPI" | "MPICH/Hydra");
    for other in LAUNCHERS
        .iter()
        .filter(|l| l.name != chosen.name && l.name != "chorus")
        .filter(|l| !(mpi && l.name == "Slurm"))
    {
        let (Some(_), Some(v)) = (env.value(other.rank), env.value(other.launch_size)) else {
            continue;
        };
        let Ok(theirs) = v.parse::<usize>() else {
            continue;
        };
        if theirs > size {
            return Err(format!(
                "{rank_var}={rank} and {size_var}={size} ({}'s variables) make this process \
                 rank {rank} of {size}, but {}={theirs} ({}'s) says it is one of {theirs}: \
                 variables left over from another launch? Unset those that do not belong to \
                 this one, or set CHORUS_RANK and CHORUS_WORLD_SIZE",
                chosen.name, other.launch_size, other.name
            ));
        }
    }
    Ok(())
}

/// A warning when `CHORUS_WORLD_SIZE` (taken as meant, see [`check_other_launchers`]) is
/// below another launcher's count of processes: several processes then take one rank (init
/// fails or hangs), or each is a job of its own, which is right only when a wrapper meant to
/// cut the launch into several chorus jobs, and otherwise silent (`CHORUS_RANK=0
/// CHORUS_WORLD_SIZE=1` left exported in a shell that then runs torchrun).
fn chorus_vars_below_launcher(env: &Lookup<'_>, size: usize) -> Option<String> {
    if env
        .value("CHORUS_RUN_NESTED")
        .is_some_and(|v| v.trim() == "1")
        || env.value("CHORUS_RUN_NPROC").is_some()
    {
        // Independent jobs inside another launcher's, as chorus-run allows, or chorus-run's
        // own ranks (in an interactive shell of a Slurm step, say): set as meant.
        return None;
    }
    env.value("CHORUS_RANK")?;
    env.value("CHORUS_WORLD_SIZE")?;
    LAUNCHERS
        .iter()
        .filter(|l| l.name != "chorus")
        .find_map(|other| {
            env.value(other.rank)?;
            let theirs: usize = env.value(other.launch_size)?.parse().ok()?;
            (theirs > size).then(|| {
                format!(
                    "CHORUS_WORLD_SIZE={size} takes precedence over {}={theirs} ({}'s): this \
                 process is in a chorus job of {size} while {} started {theirs}; if CHORUS_RANK \
                 and CHORUS_WORLD_SIZE are left over from another launch, unset them",
                    other.launch_size, other.name, other.name
                )
            })
        })
}

/// The largest world size accepted, from the environment and by [`crate::Communicator::new`]
/// (a guard against a garbled variable or argument, which would otherwise size per-rank
/// tables before any peer is heard from; not a design limit).
pub const MAX_WORLD_SIZE: usize = 1 << 20;
/// The largest timeout accepted: one year.
const MAX_TIMEOUT_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// A timeout of `secs` seconds, if it is one chorus takes (`CHORUS_TIMEOUT`,
/// [`crate::Communicator::set_timeout`], `chorus_comm_set_timeout`, `chorus-perf -T`): from
/// 1 ms to one year (NaN and infinities refused).
pub fn timeout_from_secs(secs: f64) -> Option<Duration> {
    (0.001..=MAX_TIMEOUT_SECS)
        .contains(&secs)
        .then(|| Duration::from_secs_f64(secs))
}

/// Variable lookup with blank values treated as unset.
struct Lookup<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Lookup<'_> {
    /// The trimmed value of `name`, if set and not blank.
    fn value(&self, name: &str) -> Option<String> {
        (self.0)(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    /// The first of `names` that is set, with its value.
    fn first(&self, names: &[&'static str]) -> Option<(&'static str, String)> {
        names.iter().find_map(|&n| self.value(n).map(|v| (n, v)))
    }
}

/// An on/off variable's value (`name=v`): `None` when empty (the default stands), else on for
/// `1`/`on`/`true`/`yes` and off for `0`/`off`/`false`/`no`, in any case.
pub(crate) fn parse_switch(name: &str, v: &str) -> Result<Option<bool>, CommError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" => Ok(None),
        "1" | "on" | "true" | "yes" => Ok(Some(true)),
        "0" | "off" | "false" | "no" => Ok(Some(false)),
        _ => Err(CommError::invalid(
            "init",
            format!("{name}={v:?}: expected on or off (1 or 0)"),
        )),
    }
}

/// Whether `value` is written in decimal digits alone (`parse` would also take a `+`).
fn all_digits(value: &str) -> bool {
    !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit())
}

fn parse_count(var: &str, value: &str) -> Result<usize, String> {
    value
        .parse::<usize>()
        .ok()
        .filter(|_| all_digits(value))
        .ok_or_else(|| format!("{var}={value:?} is not a non-negative integer"))
}

fn parse_port(var: &str, value: &str) -> Result<u16, String> {
    value
        .parse::<u16>()
        .ok()
        .filter(|_| all_digits(value))
        .ok_or_else(|| format!("{var}={value:?} is not a port number (0..=65535)"))
}

fn parse_seconds(var: &str, value: &str) -> Result<Duration, String> {
    let secs: f64 = value.parse().map_err(|_| {
        format!("{var}={value:?} is not a number of seconds (e.g. {var}=30 or {var}=2.5)")
    })?;
    timeout_from_secs(secs).ok_or_else(|| {
        format!(
            "{var}={value:?}: the timeout must be at least 0.001 (1 ms) and at most one year, \
             in seconds"
        )
    })
}

/// Whether `host` looks like a host name or IPv4 address (letters, digits, `-`, `.`, `_`).
fn is_host_name(host: &str) -> bool {
    !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
}

/// `host` and `port` as one address string, IPv6 in brackets.
fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Parse `CHORUS_ADDR`: `host:port` or `[ipv6]:port`.
pub fn parse_chorus_addr(var: &str, value: &str) -> Result<(String, u16), String> {
    let (host, port) = if let Some(rest) = value.strip_prefix('[') {
        let (ip, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("{var}={value:?}: missing ']' after the IPv6 address"))?;
        if ip.parse::<Ipv6Addr>().is_err() {
            return Err(format!("{var}={value:?}: {ip:?} is not an IPv6 address"));
        }
        let port = after
            .strip_prefix(':')
            .ok_or_else(|| format!("{var}={value:?} has no port; use {var}=[{ip}]:port"))?;
        (ip, port)
    } else {
        let (host, port) = value.rsplit_once(':').ok_or_else(|| {
            format!(
                "{var}={value:?} has no port; use {var}=host:port (rank 0's host and a free \
                 port, e.g. {value}:29400)"
            )
        })?;
        if host.contains(':') {
            return Err(format!(
                "{var}={value:?}: write an IPv6 address in brackets, {var}=[address]:port"
            ));
        }
        if !is_host_name(host) {
            return Err(format!(
                "{var}={value:?}: {host:?} is not a host name or address"
            ));
        }
        (host, port)
    };
    Ok((host.to_string(), parse_port(var, port)?))
}

/// Parse `MASTER_ADDR`: a host without a port (an IPv6 address with or without brackets).
fn parse_master_addr(value: &str) -> Result<String, String> {
    let bare = value
        .strip_prefix('[')
        .and_then(|v| v.strip_suffix(']'))
        .unwrap_or(value);
    if bare.parse::<Ipv6Addr>().is_ok() || is_host_name(bare) {
        return Ok(bare.to_string());
    }
    Err(format!(
        "MASTER_ADDR={value:?} is not a host name or address (without a port: the port comes \
         from MASTER_PORT, or set CHORUS_ADDR=host:port)"
    ))
}

/// The first host of a Slurm node list (`node[01-03,07],gpu5` gives `node01`), where
/// Slurm starts task 0 of a step (block and cyclic distributions); `None` for a list it
/// cannot read.
fn first_slurm_host(list: &str) -> Option<String> {
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let (mut host, mut rest) = (String::new(), list[..end].trim());
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = open + rest[open..].find(']')?;
        // The first number of the first range, zero padding kept.
        let first = rest[open + 1..close].split(',').next()?.split('-').next()?;
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    is_host_name(&host).then_some(host)
}

/// The port of a Slurm step's rendezvous when none is given: the same on every task of the
/// step, different for other steps and jobs (mostly), below the kernel's usual ephemeral
/// range (32768 up), from `SLURM_JOB_ID` and `SLURM_STEP_ID`.
fn slurm_port(job: u64, step: u64) -> u16 {
    let mix = job.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    20000 + ((mix >> 32) % 12000) as u16
}

/// The rendezvous address from `CHORUS_ADDR`, or `MASTER_ADDR` with `CHORUS_PORT` /
/// `MASTER_PORT + 1`; for a rank Slurm gave (`slurm`), else the first node of the step
/// with `CHORUS_PORT` or a port made from the job and step ids; or loopback port 0 for a
/// single rank.
fn root_addr(
    env: &Lookup<'_>,
    size: usize,
    srun_rank: Option<usize>,
) -> Result<(String, Option<String>), String> {
    let mut token = None;
    if size == 1 {
        // One rank needs no rendezvous: address variables left from another job (a stale
        // `MASTER_ADDR` without its port) must not stop it.
        return Ok(("127.0.0.1:0".to_string(), None));
    }
    let (var, host, port) = if let Some(v) = env.value("CHORUS_ADDR") {
        let (host, port) = parse_chorus_addr("CHORUS_ADDR", &v)?;
        ("CHORUS_ADDR", host, port)
    } else if let Some(v) = env.value("MASTER_ADDR") {
        let host = parse_master_addr(&v)?;
        let port = if let Some(p) = env.value("CHORUS_PORT") {
            ("CHORUS_PORT", parse_port("CHORUS_PORT", &p)?)
        } else if let Some(p) = env.value("MASTER_PORT") {
            let master = parse_port("MASTER_PORT", &p)?;
            if master == 0 {
                return Err(
                    "MASTER_PORT=0 is not a port ranks can meet at (chorus uses MASTER_PORT + \
                     1); set a port, or CHORUS_PORT"
                        .to_string(),
                );
            }
            let port = master.checked_add(1).ok_or_else(|| {
                "MASTER_PORT=65535 leaves no port for chorus (it uses MASTER_PORT + 1); \
                 set CHORUS_PORT"
                    .to_string()
            })?;
            ("MASTER_PORT", port)
        } else {
            return Err(
                "MASTER_ADDR is set but neither CHORUS_PORT nor MASTER_PORT; set one of them, \
                 or CHORUS_ADDR=host:port"
                    .to_string(),
            );
        };
        (port.0, host, port.1)
    } else if let Some((list, rank)) = env.value("SLURM_STEP_NODELIST").zip(srun_rank) {
        let host = first_slurm_host(&list).ok_or_else(|| {
            format!(
                "SLURM_STEP_NODELIST={list:?}: cannot read its first host; set CHORUS_ADDR or \
                 MASTER_ADDR"
            )
        })?;
        // Task 0 hosts the store there; on another node (srun -m arbitrary) it could not.
        if let Some(node) = env
            .value("SLURMD_NODENAME")
            .filter(|n| rank == 0 && *n != host)
        {
            return Err(format!(
                "task 0 runs on {node}, not on the first node {host} of \
                 SLURM_STEP_NODELIST={list:?}, where the ranks would meet: set CHORUS_ADDR \
                 (or MASTER_ADDR and MASTER_PORT) to {node} and a free port"
            ));
        }
        let port = match env.value("CHORUS_PORT") {
            Some(p) => ("CHORUS_PORT", parse_port("CHORUS_PORT", &p)?),
            None => {
                let id = |var: &str| -> Result<u64, String> {
                    let v = env.value(var).ok_or_else(|| {
                        format!("{var} is not set: set CHORUS_PORT (or CHORUS_ADDR)")
                    })?;
                    v.parse::<u64>()
                        .map_err(|_| format!("{var}={v:?} is not a number; set CHORUS_PORT"))
                };
                let (job, step) = (id("SLURM_JOB_ID")?, id("SLURM_STEP_ID")?);
                token = Some(format!("{JOB_TOKEN_PREFIX}slurm-{job}-step-{step}"));
                ("SLURM_JOB_ID", slurm_port(job, step))
            }
        };
        (port.0, host, port.1)
    } else {
        return Err(format!(
            "no rendezvous address for {size} ranks: set CHORUS_ADDR=host:port (rank 0's \
             host and a free port), or MASTER_ADDR and MASTER_PORT (under srun, the first \
             node of the step is taken)"
        ));
    };
    if port == 0 && size > 1 {
        return Err(format!(
            "{var} gives port 0, which the other ranks cannot find; choose a fixed free port"
        ));
    }
    Ok((join_host_port(&host, port), token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_read_is_checked_for_garbled_bytes() {
        // Every quoted upper-case name in this file that is a variable read (not a value such
        // as "TCP") is one `refuse_garbled_env` checks, so that the list cannot fall behind.
        let values = ["TCP", "TRUE"];
        let src = include_str!("config.rs");
        let mut names = std::collections::BTreeSet::new();
        for piece in src.split('"').skip(1).step_by(2) {
            let name = piece.len() > 2
                && piece.starts_with(|c: char| c.is_ascii_uppercase())
                && piece
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if name && !values.contains(&piece) {
                names.insert(piece);
            }
        }
        assert!(names.contains("SLURM_PROCID") && names.contains("MASTER_PORT"));
        for n in names {
            assert!(is_read(n), "{n} is read but not checked for garbled bytes");
        }
        assert!(!is_read("SLURM_JOB_NAME") && !is_read("HOME"));
    }
    use crate::ErrorKind;
    use std::collections::HashMap;

    #[test]
    fn debug_output_hides_the_token() {
        let mut c = Config::new(0, 2, "127.0.0.1:1");
        c.token = Some("hunter2-secret".into());
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("token: Some(\"<secret>\")"), "{shown}");
    }

    #[test]
    fn chorus_variables_below_another_launchers_count_are_warned_about() {
        let warn = |vars: &[(&str, &str)]| {
            let env: HashMap<String, String> = vars
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let get = |k: &str| env.get(k).cloned();
            let size = Config::from_lookup(get).unwrap().size;
            chorus_vars_below_launcher(&Lookup(&get), size)
        };
        // Left over in a shell that then ran torchrun --nproc 4.
        let leftover = [
            ("CHORUS_RANK", "0"),
            ("CHORUS_WORLD_SIZE", "1"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let w = warn(&leftover).expect("a warning");
        assert!(w.contains("WORLD_SIZE=4") && w.contains("torchrun"), "{w}");
        // chorus-run sets both alike; torchrun alone has no CHORUS_* variables.
        let mut both = leftover;
        both[0].1 = "2";
        both[1].1 = "4";
        assert_eq!(warn(&both), None);
        // A rank of chorus-run (its marker) inside a larger launch: its variables are meant.
        let mut ours = leftover.to_vec();
        ours.push(("CHORUS_RUN_NPROC", "1"));
        assert_eq!(warn(&ours), None);
        assert_eq!(warn(&leftover[2..]), None);
    }

    #[test]
    fn switches_take_on_and_off_words() {
        let q = "CHORUS_TCP_QUICKACK";
        assert_eq!(parse_switch(q, "").unwrap(), None);
        assert_eq!(parse_switch(q, " ").unwrap(), None);
        for on in ["1", "on", "TRUE", " yes "] {
            assert_eq!(parse_switch(q, on).unwrap(), Some(true), "{on}");
        }
        for off in ["0", "Off", "false", "no"] {
            assert_eq!(parse_switch(q, off).unwrap(), Some(false), "{off}");
        }
        let e = parse_switch(q, "2").unwrap_err().to_string();
        assert!(
            e.contains("CHORUS_TCP_QUICKACK=\"2\"") && e.contains("on or off"),
            "{e}"
        );
    }

    /// `Config::from_lookup` over `vars` (returns the same large error type it does).
    #[allow(clippy::result_large_err)]
    fn config(vars: &[(&str, &str)]) -> Result<Config, CommError> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| env.get(k).cloned())
    }

    /// The error for `vars`, checked to be an "init" invalid-argument error naming `var`.
    fn error_naming(vars: &[(&str, &str)], var: &str) -> String {
        let e = config(vars).expect_err("expected an error");
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert_eq!(e.op(), "init", "{e}");
        let msg = e.message().to_string();
        assert!(msg.contains(var), "{var} not named in: {msg}");
        msg
    }

    const ADDR: (&str, &str) = ("CHORUS_ADDR", "10.0.0.1:4000");

    /// mpirun in a Slurm allocation starts its ranks through daemons srun started, one per
    /// node: the ranks see the daemons' step (4 tasks: the nodes), which neither refuses them
    /// nor makes them srun's ranks (whose address would be a derived port).
    #[test]
    fn mpirun_inside_a_slurm_allocation() {
        let c = config(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_STEP_NUM_NODES", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NODELIST", "node[1-4]"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "0"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
        assert_eq!((c.local_rank, c.local_size), (Some(1), Some(2)));
        assert_eq!(c.root_addr, "10.0.0.1:4000");
        assert_eq!(c.token, None);
        // Its ranks' own rank and size happening to match the daemons' step changes nothing.
        let c = config(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_STEP_NODELIST", "node[1-4]"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "0"),
        ]);
        let e = c.expect_err("no address but Slurm's");
        assert!(e.message().contains("no rendezvous address"), "{e}");
        // torchrun's leftovers are still caught.
        error_naming(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
                ("OMPI_COMM_WORLD_RANK", "3"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
            ],
            "OMPI_COMM_WORLD_SIZE",
        );
    }

    /// The local rank comes from the launcher that gave the rank, as the local size does.
    #[test]
    fn local_rank_of_another_launcher_is_not_read() {
        let c = config(&[
            ("LOCAL_RANK", "7"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.local_rank, c.local_size), (Some(0), Some(2)));
        let c = config(&[
            ("CHORUS_RANK", "0"),
            ("CHORUS_WORLD_SIZE", "1"),
            ("LOCAL_RANK", "3"),
        ])
        .unwrap();
        assert_eq!(c.local_rank, None);
        let msg = error_naming(
            &[
                ("CHORUS_RANK", "0"),
                ("CHORUS_WORLD_SIZE", "4"),
                ("CHORUS_LOCAL_RANK", "3"),
                ("CHORUS_LOCAL_SIZE", "2"),
                ADDR,
            ],
            "CHORUS_LOCAL_RANK=3",
        );
        assert!(msg.contains("ranks on this host (2)"), "{msg}");
    }

    /// srun's MPI plugin (`--mpi=pmi2`) gives PMI_RANK and PMI_SIZE but no local rank:
    /// Slurm's task id on the node is the ranks'.
    #[test]
    fn srun_with_pmi2_takes_slurms_local_rank() {
        let c = config(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (3, 4, Some(1)));
    }

    /// mpiexec (Hydra) in a Slurm allocation of two nodes: its proxies are srun's tasks, and
    /// rank 0's task id matches by chance. Its ranks are not srun's: rank 0 does not take an
    /// address from Slurm's variables where rank 1 finds none.
    #[test]
    fn hydra_under_slurm_is_not_srun() {
        let rank = |r: &'static str| {
            config(&[
                ("PMI_RANK", r),
                ("PMI_SIZE", "2"),
                ("MPI_LOCALRANKID", r),
                ("SLURM_PROCID", "0"),
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_JOB_ID", "77"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_STEP_NODELIST", "node[1-2]"),
                ("SLURMD_NODENAME", "node1"),
            ])
            .map(|c| (c.root_addr, c.token))
            .map_err(|e| e.to_string())
        };
        // No address given: neither rank takes one from Slurm's variables.
        let (a, b) = (rank("0"), rank("1"));
        assert!(a.is_err() && b.is_err(), "{a:?} {b:?}");
    }

    /// One rank reads no address: a stale `MASTER_ADDR` without its port does not stop it.
    #[test]
    fn a_single_rank_reads_no_address() {
        for stale in [
            ("MASTER_ADDR", "node0"),
            ("MASTER_ADDR", "node0:29500"),
            ("CHORUS_ADDR", "nohost"),
        ] {
            let c = config(&[("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "1"), stale]).unwrap();
            assert_eq!(c.root_addr, "127.0.0.1:0", "{stale:?}");
        }
    }

    #[test]
    fn numbers_are_plain_digits() {
        for (var, bad) in [
            ("CHORUS_RANK", "+1"),
            ("CHORUS_WORLD_SIZE", "+4"),
            ("CHORUS_ADDR", "h:+80"),
            ("CHORUS_TIMEOUT", "1e-10"),
            ("CHORUS_INIT_TIMEOUT", "0.0009"),
        ] {
            let mut vars = vec![("CHORUS_RANK", "1"), ("CHORUS_WORLD_SIZE", "4"), ADDR];
            vars.retain(|(k, _)| *k != var);
            vars.push((var, bad));
            error_naming(&vars, var);
        }
        let c = config(&[
            ("CHORUS_RANK", "1"),
            ("CHORUS_WORLD_SIZE", "4"),
            ADDR,
            ("CHORUS_TIMEOUT", "0.001"),
            ("CHORUS_TOKEN", "   "),
        ])
        .unwrap();
        assert_eq!(c.timeout, Duration::from_millis(1));
        assert_eq!(c.token, None, "a blank token counts as unset");
    }

    #[test]
    fn explicit_chorus_variables() {
        let c = config(&[
            ("CHORUS_RANK", "2"),
            ("CHORUS_WORLD_SIZE", "4"),
            ("CHORUS_LOCAL_RANK", "0"),
            ADDR,
            ("CHORUS_TOKEN", " s3cret "),
            ("CHORUS_TIMEOUT", "2.5"),
            ("CHORUS_INIT_TIMEOUT", "60"),
            ("CHORUS_SOCKET_IFNAME", "^docker,lo"),
            ("CHORUS_TRANSPORT", "TCP"),
            ("CHORUS_ALGO", "allreduce:ring"),
            ("CHORUS_TUNE_FILE", "/var/tmp/chorus.tune"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (2, 4, Some(0)));
        assert_eq!(c.root_addr, "10.0.0.1:4000");
        assert_eq!(c.token.as_deref(), Some(" s3cret "));
        assert_eq!(c.timeout, Duration::from_millis(2500));
        assert_eq!(c.init_timeout, Duration::from_secs(60));
        assert_eq!(c.socket_ifname.as_deref(), Some("^docker,lo"));
        assert_eq!(c.transport.as_deref(), Some("tcp"));
        assert_eq!(c.algo.as_deref(), Some("allreduce:ring"));
        assert_eq!(c.tune_file, Some(PathBuf::from("/var/tmp/chorus.tune")));
        assert_eq!(c.host_store, None);
        assert!(!c.hosts_store());
    }

    /// Without CHORUS_TOKEN, ranks of torchrun, Open MPI and Slurm authenticate with their
    /// job's id: another job given the same address (no token either) fails the handshake
    /// instead of joining. CHORUS_TOKEN wins; a launcher without a job id gives none.
    #[test]
    fn launchers_job_ids_make_the_token() {
        let torchrun = |id: &str| {
            config(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "10.0.0.1"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", id),
            ])
            .unwrap()
            .token
        };
        assert_eq!(torchrun("abc").as_deref(), Some("chorus-job-torchrun-abc"));
        let mut c = Config::new(0, 2, "h:1");
        c.token = torchrun("abc");
        assert!(!c.token_is_secret(), "a job id is no secret");
        c.token = Some("s3cret".into());
        assert!(c.token_is_secret());
        assert_ne!(torchrun("abc"), torchrun("abd"));
        let ompi = |job: &str, extra: &[(&'static str, &'static str)]| {
            let mut vars = vec![
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ADDR,
                ("OMPI_MCA_ess_base_jobid", job),
            ];
            vars.extend_from_slice(extra);
            config(&vars).unwrap().token
        };
        assert_eq!(
            ompi("1840775169", &[]).as_deref(),
            Some("chorus-job-Open MPI-1840775169")
        );
        assert_eq!(
            ompi("1840775169", &[("CHORUS_TOKEN", "mine")]).as_deref(),
            Some("mine")
        );
        // srun's ranks at a port the user gave: the job and step.
        let c = config(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("CHORUS_PORT", "4000"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "3"),
        ])
        .unwrap();
        assert_eq!(c.token.as_deref(), Some("chorus-job-Slurm-7-3"));
        // No job id: no token.
        let c = config(&[("RANK", "0"), ("WORLD_SIZE", "2"), ADDR]).unwrap();
        assert_eq!(c.token, None);
        let c = config(&[("PMI_RANK", "0"), ("PMI_SIZE", "2"), ADDR]).unwrap();
        assert_eq!(c.token, None);
    }

    #[test]
    fn defaults_when_optional_variables_are_absent_or_blank() {
        let c = config(&[
            ("CHORUS_RANK", "0"),
            ("CHORUS_WORLD_SIZE", "2"),
            ADDR,
            ("CHORUS_TOKEN", ""),
            ("CHORUS_TIMEOUT", "  "),
            ("CHORUS_SOCKET_IFNAME", ""),
        ])
        .unwrap();
        assert_eq!(c.local_rank, None);
        assert_eq!(c.token, None);
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.init_timeout, DEFAULT_INIT_TIMEOUT);
        assert_eq!(c.socket_ifname, None);
        assert_eq!(c.transport, None);
        assert!(c.hosts_store());
    }

    #[test]
    fn chorus_variables_win_over_launchers() {
        let c = config(&[
            ("CHORUS_RANK", "1"),
            ("CHORUS_WORLD_SIZE", "3"),
            ("CHORUS_LOCAL_RANK", "1"),
            ("CHORUS_ADDR", "root:5000"),
            ("RANK", "7"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "3"),
            ("MASTER_ADDR", "other"),
            ("MASTER_PORT", "29500"),
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "9"),
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "6"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (1, 3, Some(1)));
        assert_eq!(c.root_addr, "root:5000");
    }

    #[test]
    fn another_launchers_larger_job_is_refused_not_joined_alone() {
        // torchrun's variables left in the shell, then `mpirun -np 4`: refused, naming both.
        let e = config(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ADDR,
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("WORLD_SIZE=1") && e.contains("OMPI_COMM_WORLD_SIZE=4"),
            "{e}"
        );
        // ... or `srun -n 4` (the step's size).
        let e = config(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ADDR,
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("SLURM_STEP_NUM_TASKS=4"), "{e}");
        // The rank's own launcher gives the size, not the first size variable set.
        let e = config(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("WORLD_SIZE", "4"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((e.rank, e.size), (5, 8));
        // Nested the usual way: torchrun under srun (2 tasks, 8 ranks), mpirun in an
        // allocation of 64 tasks (no step).
        let c = config(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_NUM_TASKS", "2"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.size), (5, 8));
        let c = config(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "64"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size), (1, 4));
        // Several torchrun jobs under one launch (`srun -n 4 torchrun --standalone --nproc 2`):
        // a worker's variables, set by torchrun's agent, are meant; so are any launcher's
        // under CHORUS_RUN_NESTED=1.
        let nested = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
        ];
        assert!(config(&nested).is_err());
        let mut worker = nested.to_vec();
        worker.push(("TORCHELASTIC_RUN_ID", "sweep-3"));
        let c = config(&worker).unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
        let mut told = nested.to_vec();
        told.push(("CHORUS_RUN_NESTED", "1"));
        let c = config(&told).unwrap();
        assert_eq!((c.rank, c.size), (1, 2));
    }

    #[test]
    fn torchrun() {
        let c = config(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (3, 4, Some(1)));
        assert_eq!(c.local_size, None);
        assert_eq!(c.root_addr, "node0:29501");
        // Two hosts of two ranks.
        let c = config(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(c.local_size, Some(2));
        // Another launcher's count (a torchrun worker's environment, inherited by a process
        // that runs a job of its own) is not read.
        let c = config(&[
            ("CHORUS_RANK", "0"),
            ("CHORUS_WORLD_SIZE", "1"),
            ("LOCAL_WORLD_SIZE", "8"),
        ])
        .unwrap();
        assert_eq!(c.local_size, None);
        // A Slurm step on one node is on one host.
        let c = config(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_STEP_NUM_NODES", "1"),
            ADDR,
        ])
        .unwrap();
        assert_eq!(c.local_size, Some(4));
        for bad in ["0", "5", "x"] {
            error_naming(
                &[
                    ("RANK", "3"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", bad),
                    ADDR,
                ],
                "LOCAL_WORLD_SIZE",
            );
        }
        // CHORUS_PORT overrides MASTER_PORT + 1.
        let c = config(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("CHORUS_PORT", "31000"),
        ])
        .unwrap();
        assert_eq!(c.root_addr, "node0:31000");
    }

    #[test]
    fn open_mpi() {
        let c = config(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (5, 8, Some(1)));
    }

    #[test]
    fn mpich_hydra() {
        let c = config(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "2"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (2, 3, Some(2)));
        let c = config(&[("PMI_RANK", "0"), ("PMI_SIZE", "3"), ADDR]).unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (0, 3, None));
    }

    #[test]
    fn slurm() {
        let c = config(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "16"),
            ("SLURM_LOCALID", "2"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!((c.rank, c.size, c.local_rank), (6, 16, Some(2)));
        assert_eq!(c.root_addr, "10.1.2.3:1235");
        // srun -n 4 inside an allocation of 16 tasks: the step's size.
        let c = config(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ADDR,
        ])
        .unwrap();
        assert_eq!((c.rank, c.size), (3, 4));
        // The batch script itself (no srun step) of an allocation of 8 tasks: refused, not
        // rank 0 of 8 waiting for 7 ranks nobody starts.
        let e = error_naming(
            &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8"), ADDR],
            "SLURM_NTASKS=8",
        );
        assert!(e.contains("srun"), "{e}");
        // ... and of an allocation of one task: rank 0 of 1.
        let c = config(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]).unwrap();
        assert_eq!((c.rank, c.size), (0, 1));
    }

    #[test]
    fn garbled_chorus_variables_are_refused_by_every_env_reader() {
        // In a child process (the environment is the process's): a CHORUS_TOKEN that is not
        // UTF-8 must not read as "no token" when the caller gives rank, size and address.
        const CHILD: &str = "CHORUS_TEST_GARBLED_CHILD";
        if std::env::var_os(CHILD).is_some() {
            let e = Config::with_env_settings(0, 2, "127.0.0.1:1").unwrap_err();
            println!("REFUSED: {e}");
            let e = Config::from_env().unwrap_err();
            println!("REFUSED: {e}");
            return;
        }
        use std::os::unix::ffi::OsStrExt;
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "config::tests::garbled_chorus_variables_are_refused_by_every_env_reader",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .env("CHORUS_TOKEN", std::ffi::OsStr::from_bytes(b"se\xffcret"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(text.matches("REFUSED: ").count(), 2, "{text}");
        assert!(text.contains("CHORUS_TOKEN is not valid UTF-8"), "{text}");
    }

    #[test]
    fn slurm_steps_meet_at_their_first_node() {
        for (list, first) in [
            ("node01", Some("node01")),
            ("node[01-03,07]", Some("node01")),
            ("gpu[007],cpu[1-2]", Some("gpu007")),
            ("rack[1-2]-n[3-4],x", Some("rack1-n3")),
            ("a,b", Some("a")),
            ("n[x-y]", None),
            ("n[1", None),
            ("n]1[", None),
            ("", None),
        ] {
            assert_eq!(first_slurm_host(list).as_deref(), first, "{list:?}");
        }
        let step = |list: &str, step: &str| {
            config(&[
                ("SLURM_PROCID", "3"),
                ("SLURM_STEP_NUM_TASKS", "8"),
                ("SLURM_STEP_NODELIST", list),
                ("SLURM_JOB_ID", "123456"),
                ("SLURM_STEP_ID", step),
            ])
        };
        let a = step("node[04-05]", "0").unwrap().root_addr;
        let (host, port) = a.split_once(':').unwrap();
        assert_eq!(host, "node04");
        let port: u16 = port.parse().unwrap();
        assert!((20000..32000).contains(&port), "{port}");
        // The same on every task; another step of the job meets elsewhere.
        assert_eq!(step("node[04-05]", "0").unwrap().root_addr, a);
        assert_ne!(step("node[04-05]", "1").unwrap().root_addr, a);
        // CHORUS_PORT and MASTER_ADDR win; an unreadable list is an error naming it.
        let c = config(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("CHORUS_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!(c.root_addr, "n1:4000");
        let c = config(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(c.root_addr, "head:29501");
        error_naming(
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_STEP_NODELIST", "n[a]"),
            ],
            "SLURM_STEP_NODELIST",
        );
        // The derived port comes with a token of the job and step (another job's step that
        // lands on the port fails to authenticate); CHORUS_TOKEN wins.
        let c = step("node[04-05]", "0").unwrap();
        assert_eq!(c.token.as_deref(), Some("chorus-job-slurm-123456-step-0"));
        assert!(!c.token_is_secret());
        assert_ne!(step("node[04-05]", "1").unwrap().token, c.token);
        // Task 0 on another node than the list's first: refused, naming both.
        let e = error_naming(
            &[
                ("SLURM_PROCID", "0"),
                ("SLURM_STEP_NUM_TASKS", "2"),
                ("SLURM_STEP_NODELIST", "n[1-2]"),
                ("SLURMD_NODENAME", "n2"),
                ("SLURM_JOB_ID", "7"),
                ("SLURM_STEP_ID", "0"),
            ],
            "SLURM_STEP_NODELIST",
        );
        assert!(e.contains("task 0 runs on n2"), "{e}");
        // srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE too: still srun's ranks.
        let c = config(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
            ("SLURM_JOB_ID", "7"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap();
        assert!(c.root_addr.starts_with("n1:"), "{}", c.root_addr);
        // Only for ranks srun started: torchrun under srun brings its own MASTER_ADDR.
        error_naming(
            &[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("SLURM_STEP_NODELIST", "n[1-2]"),
            ],
            "CHORUS_ADDR",
        );
    }

    #[test]
    fn rank_and_size_come_from_one_launcher() {
        // A stale `RANK=0` in the shell (no WORLD_SIZE), then `mpirun -np 4`: refused, not
        // rank 0 of 4 in every process.
        let e = error_naming(
            &[
                ("RANK", "0"),
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ADDR,
            ],
            "WORLD_SIZE",
        );
        assert!(e.contains("RANK is set"), "{e}");
        error_naming(
            &[("CHORUS_RANK", "1"), ("WORLD_SIZE", "4"), ADDR],
            "CHORUS_WORLD_SIZE",
        );
    }

    #[test]
    fn rank_and_size_errors_name_the_variable() {
        let msg = error_naming(
            &[("CHORUS_RANK", "4"), ("CHORUS_WORLD_SIZE", "4"), ADDR],
            "CHORUS_RANK",
        );
        assert!(msg.contains("CHORUS_WORLD_SIZE"), "{msg}");
        error_naming(&[("RANK", "9"), ("WORLD_SIZE", "2"), ADDR], "RANK=9");
        error_naming(
            &[("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "0"), ADDR],
            "CHORUS_WORLD_SIZE=0",
        );
        error_naming(
            &[("CHORUS_RANK", "x"), ("CHORUS_WORLD_SIZE", "2"), ADDR],
            "CHORUS_RANK",
        );
        error_naming(
            &[("CHORUS_RANK", "-1"), ("CHORUS_WORLD_SIZE", "2"), ADDR],
            "CHORUS_RANK",
        );
        error_naming(
            &[("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "2.0"), ADDR],
            "CHORUS_WORLD_SIZE",
        );
        error_naming(&[("PMI_RANK", "0"), ("PMI_SIZE", "four"), ADDR], "PMI_SIZE");
        error_naming(
            &[
                ("CHORUS_RANK", "0"),
                ("CHORUS_WORLD_SIZE", "99999999999"),
                ADDR,
            ],
            "CHORUS_WORLD_SIZE",
        );
        error_naming(&[("CHORUS_WORLD_SIZE", "2"), ADDR], "CHORUS_RANK");
        error_naming(&[("CHORUS_RANK", "0"), ADDR], "CHORUS_WORLD_SIZE");
        let msg = error_naming(&[], "CHORUS_RANK");
        assert!(msg.contains("SLURM_PROCID"), "{msg}");
        error_naming(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "2"),
                ADDR,
            ],
            "LOCAL_RANK=2",
        );
        error_naming(
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "a"),
                ADDR,
            ],
            "LOCAL_RANK",
        );
    }

    #[test]
    fn timeouts() {
        let base = [("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "1")];
        let with = |k: &'static str, v: &'static str| {
            let mut vars = base.to_vec();
            vars.push((k, v));
            vars
        };
        assert_eq!(
            config(&with("CHORUS_TIMEOUT", "2.5")).unwrap().timeout,
            Duration::from_secs_f64(2.5)
        );
        assert_eq!(
            config(&with("CHORUS_TIMEOUT", " 10 ")).unwrap().timeout,
            Duration::from_secs(10)
        );
        for bad in ["0", "-1", "abc", "NaN", "inf", "1e30", "5s"] {
            error_naming(&with("CHORUS_TIMEOUT", bad), "CHORUS_TIMEOUT");
            error_naming(&with("CHORUS_INIT_TIMEOUT", bad), "CHORUS_INIT_TIMEOUT");
        }
    }

    #[test]
    fn addresses() {
        let two = [("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "2")];
        let addr = |vars: &[(&'static str, &'static str)]| {
            let mut all = two.to_vec();
            all.extend_from_slice(vars);
            config(&all)
                .map(|c| c.root_addr)
                .map_err(|e| e.message().to_string())
        };
        let err = |vars: &[(&'static str, &'static str)], var: &str| {
            let mut all = two.to_vec();
            all.extend_from_slice(vars);
            error_naming(&all, var)
        };
        assert_eq!(
            addr(&[("CHORUS_ADDR", "[::1]:1234")]).unwrap(),
            "[::1]:1234"
        );
        assert!(
            addr(&[("CHORUS_ADDR", "[fe80::1%eth0]:1234")]).is_err(),
            "scoped IPv6 is not supported in CHORUS_ADDR"
        );
        assert_eq!(
            addr(&[("CHORUS_ADDR", "node-1.example:80")]).unwrap(),
            "node-1.example:80"
        );
        assert_eq!(
            addr(&[("CHORUS_ADDR", " 10.0.0.1:4000 ")]).unwrap(),
            "10.0.0.1:4000"
        );
        let msg = err(&[("CHORUS_ADDR", "10.0.0.1")], "CHORUS_ADDR");
        assert!(msg.contains("no port"), "{msg}");
        err(&[("CHORUS_ADDR", "[::1]")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "[::1")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "::1:1234")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "host:http")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "host:70000")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", ":1234")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "a b:1234")], "CHORUS_ADDR");
        err(&[("CHORUS_ADDR", "host:0")], "CHORUS_ADDR");
        // MASTER_ADDR forms.
        let m = |a: &'static str| addr(&[("MASTER_ADDR", a), ("MASTER_PORT", "29500")]);
        assert_eq!(m("::1").unwrap(), "[::1]:29501");
        assert_eq!(m("[::1]").unwrap(), "[::1]:29501");
        assert_eq!(m("127.0.0.1").unwrap(), "127.0.0.1:29501");
        err(
            &[("MASTER_ADDR", "node0:29500"), ("MASTER_PORT", "29500")],
            "MASTER_ADDR",
        );
        err(&[("MASTER_ADDR", "node0")], "MASTER_PORT");
        err(
            &[("MASTER_ADDR", "node0"), ("MASTER_PORT", "65535")],
            "CHORUS_PORT",
        );
        err(
            &[("MASTER_ADDR", "node0"), ("MASTER_PORT", "x")],
            "MASTER_PORT",
        );
        err(
            &[("MASTER_ADDR", "node0"), ("MASTER_PORT", "0")],
            "MASTER_PORT=0",
        );
        err(
            &[("MASTER_ADDR", "node0"), ("CHORUS_PORT", "x")],
            "CHORUS_PORT",
        );
        // No address at all: fine for one rank, an error naming CHORUS_ADDR for more.
        let msg = err(&[], "CHORUS_ADDR");
        assert!(msg.contains("MASTER_ADDR"), "{msg}");
        let c = config(&[("CHORUS_RANK", "0"), ("CHORUS_WORLD_SIZE", "1")]).unwrap();
        assert_eq!(c.root_addr, "127.0.0.1:0");
        let c = config(&[
            ("CHORUS_RANK", "0"),
            ("CHORUS_WORLD_SIZE", "1"),
            ("CHORUS_ADDR", "127.0.0.1:0"),
        ])
        .unwrap();
        assert_eq!(c.root_addr, "127.0.0.1:0");
    }
}
