//! Allreduce across four emulated hosts: network namespaces on a bridge, 1 gbit links
//! (`tests/netns/cluster.sh`), one rank per host, each a real process started with
//! `ip netns exec`.
//!
//! The test builds a cluster of its own (namespaces `chorus-t<id>-h1..4` and `-sw`, `<id>`
//! random, so parallel runs never collide), removes it when it ends — also when it fails — and
//! also removes clusters that earlier runs left behind when they were killed (those whose
//! owner's lock, `/run/chorus-netns/chorus-t<id>.owner`, nobody holds). Inside the cluster:
//!
//! 1. ranks started directly with `CHORUS_SOCKET_IFNAME=eth0`: allreduce of a few dtypes, ops
//!    and sizes checked exactly; every rank's sockets are on its eth0 address (read from the
//!    kernel's socket table), and its `CHORUS_DEBUG=INFO` line names that address; then a
//!    split into pairs of hosts and a communicator joined through a unique id (rank 0 makes
//!    it, a broadcast shares it), each checked the same way;
//! 2. ranks started by `chorus-run --netns-prefix` without `CHORUS_SOCKET_IFNAME`: the default
//!    interface choice works across hosts and never picks `lo` (the unique id's store is not
//!    on `lo` either; these hosts have no other interface than eth0, so this does not tell
//!    the route to `CHORUS_ADDR` from the first interface that is not loopback);
//! 3. `CHORUS_SOCKET_IFNAME=lo` across hosts: every rank fails with an error within the
//!    rendezvous timeout instead of hanging;
//! 4. torchrun's variables with `MASTER_ADDR` a name the root host resolves to 127.0.1.1 (as
//!    Debian maps a host's own name; `/etc/netns/<host>/hosts`, written and removed by the
//!    test) and the others to its eth0 address: the job forms, data over eth0;
//! 5. the same name, all ranks in one namespace but given two host ids: the job forms;
//! 6. a host falls silent (its link down) while the ranks are idle between calls: with
//!    `CHORUS_TCP_KEEPALIVE=3` the next allreduce fails at once on the others.
//!
//! It needs root (`ip netns`, `tc`). Where namespaces cannot be made it fails and says why;
//! `CHORUS_SKIP_NETNS=1` skips it (prints a `SKIPPED` line). Every job runs under a watchdog.

mod common;

use std::collections::BTreeSet;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use chorus::{Communicator, Config, DType, ReduceOp};
use common::check_one;

/// This test's name, which child ranks pass to the test binary to run only it.
const TEST_NAME: &str = "allreduce_across_four_namespace_hosts";
/// Set in child ranks: which check to run (`check`, `check-small`, `lo`).
const CHILD_ENV: &str = "CHORUS_NETNS_CHILD";
/// Hosts in the cluster, one rank each.
const HOSTS: usize = 4;
/// Link rate of the cluster.
const RATE: &str = "1gbit";
/// Addresses of the hosts: host i (1-based) is `SUBNET.i` on its eth0 (see cluster.sh).
const SUBNET: [u8; 3] = [10, 78, 0];
/// A job that is still running after this is killed and the test fails.
const WATCHDOG: Duration = Duration::from_secs(90);
/// Rendezvous timeout of the ranks expected to fail (scenario 3).
const SHORT_INIT_TIMEOUT_SECS: u64 = 3;
/// Token shared by the ranks of a job.
const TOKEN: &str = "netns-test-token";
/// Element counts checked: empty, one, odd, and 1 MiB of f32 plus an odd tail.
const COUNTS: [usize; 5] = [0, 1, 7, 1023, (1 << 18) + 3];

/// The eth0 address of host `i` (1-based).
fn host_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(SUBNET[0], SUBNET[1], SUBNET[2], i as u8)
}

/// `tests/netns/cluster.sh`.
fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/netns/cluster.sh")
}

/// Runs `cluster.sh ARGS` for the namespaces of `prefix` (bounded: a stuck `ip` or `tc` fails
/// it after two minutes); Err(output) when it fails.
fn cluster_sh(prefix: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new("timeout")
        .args(["-k", "5", "120", "bash"])
        .arg(script())
        .args(args)
        .env("CHORUS_NETNS_PREFIX", prefix)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run bash {}: {e}", script().display()))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!(
            "cluster.sh {args:?} failed ({}): {text}",
            out.status
        ))
    }
}

/// Where a test's cluster `<prefix>` has its owner's lock, `<prefix>.owner`: held (`flock`)
/// for as long as the cluster is in use, and released by the kernel when its process dies,
/// whatever PID namespace it ran in (process ids repeat across runs in PID namespaces, as in
/// CI, so they cannot tell a live run from a dead one).
const OWNER_DIR: &str = "/run/chorus-netns";

fn owner_path(prefix: &str) -> PathBuf {
    PathBuf::from(OWNER_DIR).join(format!("{prefix}.owner"))
}

/// Whether some process holds the owner's lock of cluster `prefix` (a file that is not there
/// has no owner).
fn owned(prefix: &str) -> bool {
    use rustix::fs::{flock, FlockOperation};
    let Ok(f) = std::fs::File::open(owner_path(prefix)) else {
        return false;
    };
    // Taken (and released when `f` closes) only when nobody holds it.
    flock(&f, FlockOperation::NonBlockingLockExclusive).is_err()
}

/// A cluster of namespace hosts that is removed when dropped, also while unwinding from a
/// failed assertion.
struct Cluster {
    /// Namespace prefix: hosts are `<prefix>-h1..N`.
    prefix: String,
    /// The owner's lock (see [`OWNER_DIR`]), held until the cluster is removed.
    _owner: std::fs::File,
}

impl Cluster {
    /// Builds `hosts` hosts with links of `rate` under a prefix of its own: random, and locked
    /// as this process's before anything is built.
    fn up(hosts: usize, rate: &str) -> Result<Cluster, String> {
        use rustix::fs::{flock, FlockOperation};
        remove_stale_clusters();
        let mut id = [0u8; 4];
        getrandom::getrandom(&mut id).map_err(|e| format!("getrandom: {e}"))?;
        let prefix = format!("chorus-t{:08x}", u32::from_le_bytes(id));
        std::fs::create_dir_all(OWNER_DIR).map_err(|e| format!("{OWNER_DIR}: {e}"))?;
        let owner = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(owner_path(&prefix))
            .map_err(|e| format!("{}: {e}", owner_path(&prefix).display()))?;
        if let Err(e) = flock(&owner, FlockOperation::NonBlockingLockExclusive) {
            let _ = std::fs::remove_file(owner_path(&prefix));
            return Err(format!("{}: flock: {e}", owner_path(&prefix).display()));
        }
        let cluster = Cluster {
            prefix,
            _owner: owner,
        };
        cluster_sh(&cluster.prefix, &["up", &hosts.to_string(), rate])?;
        Ok(cluster)
    }

    /// Namespace of host `i` (1-based).
    fn host(&self, i: usize) -> String {
        format!("{}-h{i}", self.prefix)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        match cluster_sh(&self.prefix, &["down"]) {
            // Gone: the owner's file goes too (its lock with it, when `_owner` closes).
            Ok(_) => {
                let _ = std::fs::remove_file(owner_path(&self.prefix));
            }
            Err(e) => eprintln!("netns test: could not remove cluster {}: {e}", self.prefix),
        }
    }
}

/// The prefix of a name this test makes (`chorus-t<id>-h<n>` or `chorus-t<id>-sw`), if it is
/// one: `chorus-t<id>`.
fn test_prefix(name: &str) -> Option<String> {
    let rest = name.strip_prefix("chorus-t")?;
    let (id, host) = rest.split_once('-')?;
    let id_ok = !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit());
    let host_ok = host == "sw"
        || host
            .strip_prefix('h')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    (id_ok && host_ok).then(|| format!("chorus-t{id}"))
}

/// Removes what earlier runs of this test left (a run killed by a signal cannot run its
/// `Drop`): the namespaces and hosts files of every test cluster whose owner's lock nobody
/// holds (see [`OWNER_DIR`]). A cluster of a run still going keeps its lock and is left alone.
fn remove_stale_clusters() {
    let mut names: Vec<String> = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.split_whitespace().next().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let hosts_dirs: Vec<PathBuf> = std::fs::read_dir("/etc/netns")
        .map(|dirs| dirs.flatten().map(|d| d.path()).collect())
        .unwrap_or_default();
    names.extend(
        hosts_dirs
            .iter()
            .filter_map(|d| Some(d.file_name()?.to_string_lossy().into_owned())),
    );
    let stale: BTreeSet<String> = names
        .iter()
        .filter_map(|n| test_prefix(n))
        .filter(|p| !owned(p))
        .collect();
    for prefix in stale {
        eprintln!("netns test: removing cluster {prefix} left by an earlier run");
        match cluster_sh(&prefix, &["down"]) {
            Ok(_) => {
                let _ = std::fs::remove_file(owner_path(&prefix));
            }
            Err(e) => eprintln!("netns test: {e}"),
        }
        // Hosts files of scenario 4.
        for d in &hosts_dirs {
            let name = d.file_name().map(|n| n.to_string_lossy().into_owned());
            if name.and_then(|n| test_prefix(&n)).as_deref() == Some(prefix.as_str()) {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

/// What one process printed, and how it ended.
struct Finished {
    status: Option<ExitStatus>,
    output: String,
}

/// Starts `cmd` with both output streams drained on threads (so a chatty process never
/// blocks on a full pipe).
fn start(mut cmd: Command) -> Result<(Child, JoinHandle<String>), String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", cmd.get_program()))?;
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let err_reader = thread::spawn(move || {
        let mut s = Vec::new();
        let _ = err.read_to_end(&mut s);
        s
    });
    let reader = thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        let mut text = String::from_utf8_lossy(&s).into_owned();
        text.push_str(&String::from_utf8_lossy(
            &err_reader.join().unwrap_or_default(),
        ));
        text
    });
    Ok((child, reader))
}

/// Waits for every process; kills them all once [`WATCHDOG`] has passed (their status is
/// then `None`).
fn wait_all(started: Vec<(Child, JoinHandle<String>)>) -> Vec<Finished> {
    let deadline = Instant::now() + WATCHDOG;
    let mut children: Vec<(Child, Option<ExitStatus>)> = Vec::with_capacity(started.len());
    let mut readers = Vec::with_capacity(started.len());
    for (child, reader) in started {
        children.push((child, None));
        readers.push(reader);
    }
    let mut timed_out = false;
    while children.iter().any(|(_, s)| s.is_none()) {
        if Instant::now() >= deadline {
            timed_out = true;
            for (child, status) in children.iter_mut().filter(|(_, s)| s.is_none()) {
                let _ = child.kill();
                let _ = child.wait();
                *status = None;
            }
            break;
        }
        for (child, status) in children.iter_mut().filter(|(_, s)| s.is_none()) {
            *status = child.try_wait().unwrap_or(None);
        }
        thread::sleep(Duration::from_millis(10));
    }
    children
        .into_iter()
        .zip(readers)
        .map(|((_, status), reader)| {
            let mut output = reader.join().unwrap_or_default();
            if timed_out && status.is_none() {
                output.push_str(&format!("\n[killed by the watchdog after {WATCHDOG:?}]\n"));
            }
            Finished { status, output }
        })
        .collect()
}

/// The command that runs this test binary as a child rank of kind `kind`.
fn child_args(kind: &str) -> (PathBuf, Vec<&'static str>, (&'static str, String)) {
    let exe = std::env::current_exe().expect("path of the test binary");
    let args = vec![TEST_NAME, "--exact", "--nocapture", "--test-threads=1"];
    (exe, args, (CHILD_ENV, kind.to_string()))
}

/// Starts one rank per host with `ip netns exec`, rendezvous at host 1 port `port`.
fn run_ranks(cluster: &Cluster, kind: &str, port: u16, env: &[(&str, &str)]) -> Vec<Finished> {
    let (exe, args, child_env) = child_args(kind);
    let mut started = Vec::new();
    for rank in 0..HOSTS {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &cluster.host(rank + 1)])
            .arg(&exe)
            .args(&args)
            .env(child_env.0, &child_env.1)
            .env("CHORUS_RANK", rank.to_string())
            .env("CHORUS_WORLD_SIZE", HOSTS.to_string())
            .env("CHORUS_ADDR", format!("{}:{port}", host_ip(1)))
            .env("CHORUS_TOKEN", TOKEN)
            .env("CHORUS_TIMEOUT", "30")
            .env("CHORUS_INIT_TIMEOUT", "30")
            .env_remove("CHORUS_SOCKET_IFNAME");
        for (k, v) in env {
            cmd.env(k, v);
        }
        match start(cmd) {
            Ok(s) => started.push(s),
            Err(e) => {
                let finished = wait_all(started);
                panic!("{e} (rank {rank}); {} ranks started before", finished.len());
            }
        }
    }
    wait_all(started)
}

/// Formats every rank's status and output, for failure messages.
fn dump(ranks: &[Finished]) -> String {
    ranks
        .iter()
        .enumerate()
        .map(|(r, f)| format!("--- rank {r}: {:?}\n{}", f.status, f.output))
        .collect::<Vec<_>>()
        .join("\n")
}

/// One check run inside the cluster; Err(what went wrong, with the ranks' output).
type Scenario = fn(&Cluster) -> Result<(), String>;

/// Scenario 1: `CHORUS_SOCKET_IFNAME=eth0`, ranks started directly.
fn eth0_scenario(cluster: &Cluster) -> Result<(), String> {
    let ranks = run_ranks(
        cluster,
        "check",
        29501,
        &[("CHORUS_SOCKET_IFNAME", "eth0"), ("CHORUS_DEBUG", "INFO")],
    );
    for (rank, f) in ranks.iter().enumerate() {
        if !f.status.is_some_and(|s| s.success()) {
            return Err(format!("eth0: rank {rank} failed\n{}", dump(&ranks)));
        }
        let ip = host_ip(rank + 1);
        if !f.output.contains(&format!("RANK-OK {rank} eth0={ip}")) {
            return Err(format!(
                "eth0: rank {rank} did not report\n{}",
                dump(&ranks)
            ));
        }
        // What chorus says it chose (CHORUS_DEBUG=INFO) must be the eth0 address too.
        let listening = f
            .output
            .lines()
            .find(|l| l.contains("listening on"))
            .unwrap_or("");
        if !listening.contains(&format!("listening on {ip}:")) {
            return Err(format!(
                "eth0: rank {rank} does not log listening on {ip}: {listening:?}\n{}",
                dump(&ranks)
            ));
        }
        // libtest may print "test NAME ... " before it on the same line.
        let sent = format!("rank {rank}: eth0 sent");
        for line in f
            .output
            .lines()
            .filter_map(|l| l.find(&sent).map(|i| &l[i..]))
        {
            eprintln!("  {line}");
        }
    }
    Ok(())
}

/// Scenario 2: no `CHORUS_SOCKET_IFNAME`; ranks started by `chorus-run --netns-prefix`, which
/// also supplies the rendezvous address (host 1's eth0 and a free port).
fn default_interface_scenario(cluster: &Cluster) -> Result<(), String> {
    let (exe, args, child_env) = child_args("check-small");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_chorus-run"));
    cmd.args(["--timeout", "60", "--netns-prefix"])
        .arg(format!("{}-h", cluster.prefix))
        .args(["-n", &HOSTS.to_string(), "--"])
        .arg(exe)
        .args(args)
        .env(child_env.0, child_env.1)
        .env("CHORUS_TIMEOUT", "30")
        .env("CHORUS_INIT_TIMEOUT", "30")
        .env_remove("CHORUS_SOCKET_IFNAME")
        .env_remove("CHORUS_ADDR");
    // Not the variables of a launcher that may have started the tests: chorus-run would
    // refuse to run as one of its tasks.
    for var in common::OUTER_LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    let job = wait_all(vec![start(cmd)?]);
    let f = &job[0];
    if !f.status.is_some_and(|s| s.success()) {
        return Err(format!(
            "default interface: chorus-run failed ({:?})\n{}",
            f.status, f.output
        ));
    }
    for rank in 0..HOSTS {
        // libtest may print "test NAME ... " before it on the same line.
        let (prefix, want) = (
            format!("[{rank}] "),
            format!("RANK-OK {rank} eth0={}", host_ip(rank + 1)),
        );
        if !f
            .output
            .lines()
            .any(|l| l.starts_with(&prefix) && l.ends_with(&want))
        {
            return Err(format!(
                "default interface: no line {want:?} in\n{}",
                f.output
            ));
        }
    }
    Ok(())
}

/// Scenario 3: `CHORUS_SOCKET_IFNAME=lo` cannot connect hosts: every rank must report an error
/// (not hang, not succeed) once the rendezvous timeout has passed.
fn loopback_scenario(cluster: &Cluster) -> Result<(), String> {
    let timeout = SHORT_INIT_TIMEOUT_SECS.to_string();
    let ranks = run_ranks(
        cluster,
        "lo",
        29503,
        &[
            ("CHORUS_SOCKET_IFNAME", "lo"),
            ("CHORUS_INIT_TIMEOUT", &timeout),
        ],
    );
    for (rank, f) in ranks.iter().enumerate() {
        let prefix = format!("EXPECTED-ERROR rank {rank}: after ");
        // The seconds the rank took to fail: within a few seconds of the init timeout (the
        // 30 s of the collectives would mean the init timeout was not applied).
        let took = f.output.lines().find_map(|l| {
            let rest = &l[l.find(&prefix)? + prefix.len()..];
            rest.split(" s:").next()?.parse::<f64>().ok()
        });
        let in_time = took.is_some_and(|s| s < SHORT_INIT_TIMEOUT_SECS as f64 + 5.0);
        if !f.status.is_some_and(|s| s.success()) || !in_time {
            return Err(format!(
                "lo: rank {rank} did not fail cleanly within {} s ({took:?})\n{}",
                SHORT_INIT_TIMEOUT_SECS + 5,
                dump(&ranks)
            ));
        }
    }
    // Ranks that got as far as the mesh say why they could not reach each other (one that
    // started late may time out earlier, waiting for the store).
    let says_why = ranks.iter().any(|f| {
        f.output
            .lines()
            .any(|l| l.contains("a loopback address") && l.contains("other host"))
    });
    if !says_why {
        return Err(format!(
            "lo: no rank said that a rank of another host listens on loopback\n{}",
            dump(&ranks)
        ));
    }
    Ok(())
}

/// The name scenario 4 gives the root host.
const ROOT_NAME: &str = "chorus-test-root";

/// `/etc/netns/<host>/hosts` files, which `ip netns exec` mounts over `/etc/hosts` in each
/// host; removed when dropped.
struct HostsFiles {
    dirs: Vec<PathBuf>,
    /// Whether `/etc/netns` was made here (removed again when empty).
    made_parent: bool,
}

impl HostsFiles {
    /// Host `i` resolves [`ROOT_NAME`] to `ip(i)`.
    fn write(cluster: &Cluster, ip: impl Fn(usize) -> String) -> Result<HostsFiles, String> {
        let mut made = HostsFiles {
            dirs: Vec::new(),
            made_parent: !std::path::Path::new("/etc/netns").exists(),
        };
        for i in 1..=HOSTS {
            let dir = PathBuf::from("/etc/netns").join(cluster.host(i));
            if dir.exists() {
                return Err(format!("{} exists already", dir.display()));
            }
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            made.dirs.push(dir.clone());
            let text = format!("127.0.0.1 localhost\n{} {ROOT_NAME}\n", ip(i));
            std::fs::write(dir.join("hosts"), text)
                .map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(made)
    }
}

impl Drop for HostsFiles {
    fn drop(&mut self) {
        for dir in &self.dirs {
            let _ = std::fs::remove_dir_all(dir);
        }
        if self.made_parent {
            // Only if empty (another run's files stay).
            let _ = std::fs::remove_dir("/etc/netns");
        }
    }
}

/// Starts one rank per host as torchrun would (`RANK`, `WORLD_SIZE`, `MASTER_ADDR` the
/// root's name [`ROOT_NAME`]; none of chorus's own placement variables), rank r in host
/// `host_of(r)` with the variables `env_of(r)` besides, and waits for them.
fn torchrun_ranks(
    cluster: &Cluster,
    kind: &str,
    host_of: impl Fn(usize) -> usize,
    env_of: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Result<Vec<Finished>, String> {
    let (exe, args, child_env) = child_args(kind);
    let mut started = Vec::new();
    for rank in 0..HOSTS {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &cluster.host(host_of(rank))])
            .arg(&exe)
            .args(&args)
            .env(child_env.0, &child_env.1)
            .env("WORLD_SIZE", HOSTS.to_string())
            .env("MASTER_ADDR", ROOT_NAME)
            .env("CHORUS_TIMEOUT", "30")
            .env("CHORUS_INIT_TIMEOUT", "20");
        for k in [
            "CHORUS_RANK",
            "CHORUS_WORLD_SIZE",
            "CHORUS_ADDR",
            "CHORUS_SOCKET_IFNAME",
            "CHORUS_LOCAL_SIZE",
            "LOCAL_WORLD_SIZE",
        ] {
            cmd.env_remove(k);
        }
        cmd.envs(env_of(rank));
        match start(cmd) {
            Ok(s) => started.push(s),
            Err(e) => {
                let finished = wait_all(started);
                return Err(format!(
                    "{e} (rank {rank}); {} started before",
                    finished.len()
                ));
            }
        }
    }
    Ok(wait_all(started))
}

/// Scenario 4: torchrun's variables, `MASTER_ADDR` a name that the root host resolves to
/// 127.0.1.1 (as Debian's /etc/hosts maps a host's own name) and the others to its eth0
/// address, `LOCAL_WORLD_SIZE=1`: the root's store must listen beyond loopback and every
/// rank's data connections on eth0, or the other hosts never get in.
fn named_root_scenario(cluster: &Cluster) -> Result<(), String> {
    let _hosts = HostsFiles::write(cluster, |i| {
        if i == 1 {
            "127.0.1.1".to_string()
        } else {
            host_ip(1).to_string()
        }
    })?;
    let ranks = torchrun_ranks(
        cluster,
        "named-root",
        |rank| rank + 1,
        |rank| {
            vec![
                ("LOCAL_RANK", "0".to_string()),
                ("LOCAL_WORLD_SIZE", "1".to_string()),
                ("MASTER_PORT", "29504".to_string()),
                ("CHORUS_TOKEN", TOKEN.to_string()),
                ("CHORUS_DEBUG", "INFO".to_string()),
                ("RANK", rank.to_string()),
            ]
        },
    )?;
    for (rank, f) in ranks.iter().enumerate() {
        let ip = host_ip(rank + 1);
        if !f.status.is_some_and(|s| s.success())
            || !f.output.contains(&format!("RANK-OK {rank} eth0={ip}"))
        {
            return Err(format!("named root: rank {rank} failed\n{}", dump(&ranks)));
        }
        if !f.output.contains(&format!("listening on {ip}:")) {
            return Err(format!(
                "named root: rank {rank} does not log listening on {ip}\n{}",
                dump(&ranks)
            ));
        }
    }
    Ok(())
}

/// Scenario 5: the same name resolving to 127.0.1.1, all four ranks in host 1's namespace
/// but told they are two hosts (`CHORUS_HOSTID`), no local size: ranks that learn the hosts
/// first must not wait for one another, and stay on loopback.
fn one_network_scenario(cluster: &Cluster) -> Result<(), String> {
    let _hosts = HostsFiles::write(cluster, |_| "127.0.1.1".to_string())?;
    let ranks = torchrun_ranks(
        cluster,
        "one-network",
        |_| 1,
        |rank| {
            vec![
                ("MASTER_PORT", "29506".to_string()),
                ("CHORUS_HOSTID", format!("host-{}", rank / 2)),
                ("RANK", rank.to_string()),
            ]
        },
    )?;
    for (rank, f) in ranks.iter().enumerate() {
        if !f.status.is_some_and(|s| s.success())
            || !f.output.contains(&format!("ONE-NETWORK-OK {rank}"))
        {
            return Err(format!("one network: rank {rank} failed\n{}", dump(&ranks)));
        }
    }
    Ok(())
}

/// Scenario 6: after a barrier, the last host falls silent (its link goes down: no FIN, no
/// RST, as a host that loses power); the others stay idle for longer than the keepalive
/// time (`CHORUS_TCP_KEEPALIVE=3`), then allreduce: the call fails at once on each of them,
/// not at their 30 s timeout.
fn silent_host_scenario(cluster: &Cluster) -> Result<(), String> {
    let ranks = run_ranks(
        cluster,
        "silent-host",
        29507,
        &[
            ("CHORUS_SOCKET_IFNAME", "eth0"),
            ("CHORUS_TCP_KEEPALIVE", "3"),
        ],
    );
    let failed = |why: &str| Err(format!("a host falls silent: {why}\n{}", dump(&ranks)));
    if !ranks[HOSTS - 1].output.contains("SILENT") {
        return failed("the last host did not go silent");
    }
    for (rank, f) in ranks.iter().enumerate().take(HOSTS - 1) {
        let Some(line) = f.output.lines().find(|l| l.contains("FAST-FAIL")) else {
            return failed(&format!("rank {rank} did not report"));
        };
        let secs: f64 = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("after="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::INFINITY);
        if secs > 3.0 {
            return failed(&format!("rank {rank} failed after {secs} s, not at once"));
        }
        // Blaming the silent host: directly, or through the rank that found it silent.
        if !line.contains(&format!("rank {}", HOSTS - 1)) {
            return failed(&format!(
                "rank {rank}'s error does not name rank {}",
                HOSTS - 1
            ));
        }
        eprintln!("  {}", &line[line.find("FAST-FAIL").unwrap_or(0)..]);
    }
    Ok(())
}

#[test]
fn allreduce_across_four_namespace_hosts() {
    if let Ok(kind) = std::env::var(CHILD_ENV) {
        child(&kind);
        return;
    }
    if std::env::var("CHORUS_SKIP_NETNS").is_ok_and(|v| v.trim() == "1") {
        // Past the test harness's capture of print!, so that the skip shows.
        let line = format!("SKIPPED: {TEST_NAME}: CHORUS_SKIP_NETNS=1\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        return;
    }
    let cluster = Cluster::up(HOSTS, RATE).unwrap_or_else(|e| {
        panic!(
            "cannot build the namespace cluster (needs root and iproute2: ip netns, tc, \
             bridge; set CHORUS_SKIP_NETNS=1 to skip this test where that is impossible): {e}"
        )
    });
    let mut failures = Vec::new();
    let scenarios: [(&str, Scenario); 6] = [
        ("eth0", eth0_scenario),
        ("default interface", default_interface_scenario),
        ("lo", loopback_scenario),
        ("root name on loopback", named_root_scenario),
        ("root name on loopback, one network", one_network_scenario),
        // Last: it takes a host's link down (and up again).
        ("a host falls silent", silent_host_scenario),
    ];
    for (name, scenario) in scenarios {
        let began = Instant::now();
        let result = scenario(&cluster);
        eprintln!(
            "netns scenario {name}: {} in {:.1} s",
            if result.is_ok() { "ok" } else { "FAILED" },
            began.elapsed().as_secs_f64()
        );
        if let Err(e) = result {
            failures.push(e);
        }
    }
    drop(cluster);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The body of a child rank.
fn child(kind: &str) {
    match kind {
        "check" | "check-small" => check_rank(kind == "check", true),
        // Rank 0's store listens on every address and its own store connection runs over
        // loopback: the data sockets are checked through the log line instead.
        "named-root" => check_rank(false, false),
        "one-network" => {
            let mut c = Communicator::from_env().unwrap_or_else(|e| panic!("communicator: {e}"));
            let rank = c.rank();
            let n = check_one::<f32>(&mut c, 1001, ReduceOp::Sum, false);
            assert_eq!(n, 0, "rank {rank}: {n} wrong");
            c.barrier().unwrap_or_else(|e| panic!("barrier: {e}"));
            println!("ONE-NETWORK-OK {rank}");
        }
        "lo" => {
            let config = Config::from_env().expect("configuration from the environment");
            let rank = config.rank;
            let began = Instant::now();
            match Communicator::new(config) {
                Ok(_) => panic!(
                    "rank {rank}: a communicator across hosts was built on lo; it cannot work"
                ),
                Err(e) => println!(
                    "EXPECTED-ERROR rank {rank}: after {:.1} s: {e}",
                    began.elapsed().as_secs_f64()
                ),
            }
        }
        "silent-host" => {
            let mut c = Communicator::from_env().unwrap_or_else(|e| panic!("communicator: {e}"));
            let rank = c.rank();
            c.barrier().unwrap_or_else(|e| panic!("barrier: {e}"));
            // (Quiet for a moment first: every ACK of the barrier delivered, so that the
            // others' connections to this host are idle, as between a training step's calls.)
            thread::sleep(Duration::from_secs(1));
            if rank == HOSTS - 1 {
                let link = |state: &str| {
                    Command::new("ip")
                        .args(["link", "set", "eth0", state])
                        .status()
                        .is_ok_and(|s| s.success())
                };
                assert!(link("down"), "rank {rank}: cannot take eth0 down");
                println!("SILENT {rank}");
                thread::sleep(Duration::from_secs(14));
                link("up");
                // (Without closing anything: the others are gone.)
                std::process::exit(0);
            }
            // Idle for longer than the keepalive time: the probes find the host silent.
            thread::sleep(Duration::from_secs(8));
            let began = Instant::now();
            let mut x = [1.0f32; 1024];
            match c.all_reduce(&mut x, ReduceOp::Sum) {
                Ok(()) => panic!("rank {rank}: an allreduce with a silent host completed"),
                Err(e) => println!(
                    "FAST-FAIL rank {rank} after={:.1} s: {e}",
                    began.elapsed().as_secs_f64()
                ),
            }
            std::process::exit(0);
        }
        other => panic!("unknown {CHILD_ENV}={other:?}"),
    }
}

/// Builds the communicator, checks where its sockets are (all on eth0 when `strict_sockets`,
/// all but those of rank 0's store otherwise), then allreduces (all of [`COUNTS`]
/// with several dtypes and ops when `full`, fewer otherwise) against the reference.
fn check_rank(full: bool, strict_sockets: bool) {
    // Where not strict, rank 0's rendezvous store (MASTER_PORT + 1) may listen on every
    // address and be reached over loopback by rank 0 itself; every other socket is checked.
    let store_port: Option<u16> = (!strict_sockets).then(|| {
        let master: u16 = std::env::var("MASTER_PORT").unwrap().parse().unwrap();
        master + 1
    });
    // Inside its testbed host before anything connects: a rank that ran elsewhere would
    // send to the testbed's addresses through the host's own routes.
    let config = Config::from_env().unwrap_or_else(|e| panic!("configuration: {e}"));
    let rank = config.rank;
    let eth0 = eth0_address();
    assert_eq!(
        eth0,
        host_ip(rank + 1),
        "rank {rank} runs on the wrong host"
    );
    let mut c = Communicator::new(config).unwrap_or_else(|e| panic!("communicator: {e}"));
    check_sockets(rank, eth0, store_port);
    // The hosts share only the network: no other transport may carry their data.
    assert_eq!(
        c.transport_name(),
        "tcp",
        "rank {rank}: hosts of the testbed must talk over the network"
    );

    let mut cases: Vec<(DType, ReduceOp, &[usize])> = Vec::new();
    if full {
        for op in ReduceOp::ALL {
            cases.push((DType::Float32, op, &COUNTS));
        }
        for dt in [
            DType::Float64,
            DType::Int32,
            DType::Uint8,
            DType::Int64,
            DType::Bfloat16,
        ] {
            cases.push((dt, ReduceOp::Sum, &COUNTS));
            cases.push((dt, ReduceOp::Max, &COUNTS[..4]));
        }
    } else {
        cases.push((DType::Float32, ReduceOp::Sum, &[1, 1023, (1 << 18) + 3]));
        cases.push((DType::Int64, ReduceOp::Max, &[7]));
    }
    let (eth0_before, lo_before) = (tx_bytes("eth0"), tx_bytes("lo"));
    let mut payload = 0;
    let mut wrong = Vec::new();
    for (dt, op, counts) in cases {
        for &count in counts {
            for inplace in [true, false] {
                payload += count * dt.size();
                let n = match dt {
                    DType::Float32 => check_one::<f32>(&mut c, count, op, inplace),
                    DType::Float64 => check_one::<f64>(&mut c, count, op, inplace),
                    DType::Int32 => check_one::<i32>(&mut c, count, op, inplace),
                    DType::Uint8 => check_one::<u8>(&mut c, count, op, inplace),
                    DType::Int64 => check_one::<i64>(&mut c, count, op, inplace),
                    DType::Bfloat16 => check_one::<half::bf16>(&mut c, count, op, inplace),
                    other => unreachable!("no case uses {}", other.name()),
                };
                if n > 0 {
                    wrong.push(format!(
                        "{} {} count {count} inplace {inplace}: {n} wrong",
                        dt.name(),
                        op.name()
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "rank {rank}: {wrong:#?}");
    // The data went out through eth0, the shaped link: an allreduce of n bytes makes every
    // rank send at least about n (p-1)/p; half of n is a safe lower bound. Loopback carries
    // only rank 0's talk with its own rendezvous store.
    let (eth0_sent, lo_sent) = (tx_bytes("eth0") - eth0_before, tx_bytes("lo") - lo_before);
    assert!(
        eth0_sent >= payload as u64 / 2,
        "rank {rank}: eth0 sent {eth0_sent} bytes for {payload} bytes of allreduce input"
    );
    println!("rank {rank}: eth0 sent {eth0_sent} B, lo {lo_sent} B, allreduce input {payload} B");
    assert!(
        lo_sent <= eth0_sent / 10,
        "rank {rank}: lo sent {lo_sent} bytes (eth0 {eth0_sent})"
    );
    // A split across hosts: hosts {1, 3} and {2, 4} pair up, each pair through a store that
    // its first rank hosts on its eth0 address.
    let mut pair = c
        .split(Some((rank % 2) as u32), rank as i64)
        .unwrap_or_else(|e| panic!("rank {rank}: split: {e}"))
        .expect("every rank passes a color");
    assert_eq!(
        (pair.rank(), pair.size()),
        (rank / 2, HOSTS / 2),
        "rank {rank}"
    );
    assert_eq!(
        pair.transport_name(),
        "tcp",
        "rank {rank}: the pair's transport"
    );
    // Every namespace is a host of its own: each rank's host group is itself.
    let local = c
        .split_by_host()
        .unwrap_or_else(|e| panic!("rank {rank}: split_by_host: {e}"));
    assert_eq!(
        (local.rank(), local.size()),
        (0, 1),
        "rank {rank}: its host group"
    );
    drop(local);
    let n = check_one::<f32>(&mut pair, (1 << 16) + 1, ReduceOp::Sum, false);
    assert_eq!(n, 0, "rank {rank}: {n} wrong in the pair's allreduce");
    // A communicator joined through a unique id that rank 0 makes and the others get by a
    // broadcast (as an MPI program would): its store is on rank 0's eth0 (the interface of
    // CHORUS_SOCKET_IFNAME in scenario 1; in scenario 2 the route to CHORUS_ADDR, which is
    // also the first interface that is not loopback here).
    let mut id = [0u8; chorus::UNIQUE_ID_BYTES];
    if rank == 0 {
        let made = chorus::UniqueId::new().unwrap_or_else(|e| panic!("unique id: {e}"));
        id.copy_from_slice(made.as_bytes());
    }
    c.broadcast(&mut id, 0)
        .unwrap_or_else(|e| panic!("rank {rank}: broadcast of the id: {e}"));
    let id = chorus::UniqueId::from_bytes(&id).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let cfg = Config::from_unique_id(&id, rank, HOSTS).unwrap_or_else(|e| panic!("{e}"));
    let mut joined = Communicator::new(cfg)
        .unwrap_or_else(|e| panic!("rank {rank}: init through the unique id: {e}"));
    let n = check_one::<f64>(&mut joined, 4099, ReduceOp::Max, true);
    assert_eq!(
        n, 0,
        "rank {rank}: {n} wrong through the unique id's communicator"
    );
    // Sockets again, now that data has flowed and the pair and the joined communicator have
    // their own: still only on eth0.
    check_sockets(rank, eth0, store_port);
    drop(joined);
    drop(pair);
    c.barrier().unwrap_or_else(|e| panic!("final barrier: {e}"));
    println!("RANK-OK {rank} eth0={eth0}");
}

/// Bytes sent so far through interface `dev` of this namespace.
fn tx_bytes(dev: &str) -> u64 {
    let path = format!("/sys/class/net/{dev}/statistics/tx_bytes");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{path}: {text:?}: {e}"))
}

/// This namespace's eth0 IPv4 address.
fn eth0_address() -> Ipv4Addr {
    let addrs = chorus_transport::ifaddr::list().expect("list interfaces");
    addrs
        .iter()
        .find_map(|a| match a.addr {
            IpAddr::V4(ip) if a.name == "eth0" => Some(ip),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no IPv4 address on eth0: {addrs:?}"))
}

/// Socket state "established" in /proc/net/tcp.
const TCP_ESTABLISHED: u8 = 0x01;
/// Socket state "listen" in /proc/net/tcp.
const TCP_LISTEN: u8 = 0x0A;

/// The IPv4 TCP sockets of this network namespace: (state, local, remote). The namespace
/// holds one rank, so they are all this process's.
fn tcp_sockets(file: &str) -> Vec<(u8, SocketAddrV4, SocketAddrV4)> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("read {file}: {e}"));
    let addr = |s: &str| -> Option<SocketAddrV4> {
        let (ip, port) = s.split_once(':')?;
        // The kernel prints the address as the hex of its in-memory (network order) bytes
        // read as a native integer.
        let ip = u32::from_str_radix(ip, 16).ok()?;
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(SocketAddrV4::new(Ipv4Addr::from(ip.to_ne_bytes()), port))
    };
    text.lines()
        .skip(1)
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let parsed = (|| {
                Some((
                    u8::from_str_radix(f.get(3)?, 16).ok()?,
                    addr(f.get(1)?)?,
                    addr(f.get(2)?)?,
                ))
            })();
            parsed.unwrap_or_else(|| panic!("unexpected line in {file}: {line:?}"))
        })
        .collect()
}

/// Every listening or connected socket of this rank is on its eth0 address (none on `lo`),
/// and it is connected to every other host. With `store_port`, sockets of the store there
/// on rank 0's own side of it (listening on every address, or over loopback) are let be.
fn check_sockets(rank: usize, eth0: Ipv4Addr, store_port: Option<u16>) {
    let sockets = tcp_sockets("/proc/net/tcp");
    let mut peers = BTreeSet::new();
    for &(state, local, remote) in &sockets {
        if state != TCP_ESTABLISHED && state != TCP_LISTEN {
            continue;
        }
        let own_store = |a: SocketAddrV4| {
            Some(a.port()) == store_port && (a.ip().is_unspecified() || a.ip().is_loopback())
        };
        if rank == 0 && (own_store(local) || own_store(remote)) {
            continue;
        }
        assert_eq!(
            *local.ip(),
            eth0,
            "rank {rank}: socket {local} -> {remote} is not on eth0 ({eth0}); all: {sockets:?}"
        );
        if state == TCP_ESTABLISHED {
            peers.insert(*remote.ip());
        }
    }
    let others: BTreeSet<Ipv4Addr> = (1..=HOSTS)
        .filter(|&h| h != rank + 1)
        .map(host_ip)
        .collect();
    assert!(
        peers.is_superset(&others),
        "rank {rank}: connected to {peers:?}, expected every other host {others:?}"
    );
    // Nothing on IPv6 either (the rendezvous root is an IPv4 address).
    let v6 = std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    let v6_active = v6
        .lines()
        .skip(1)
        .filter(|l| {
            let state = l.split_whitespace().nth(3).unwrap_or("");
            state == "01" || state == "0A"
        })
        .count();
    assert_eq!(v6_active, 0, "rank {rank}: IPv6 sockets in use:\n{v6}");
}
