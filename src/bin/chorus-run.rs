//! `chorus-run`: start the ranks of a chorus job on this machine.
//!
//! ```text
//! chorus-run -n 4 -- python train.py --epochs 3
//! ```
//!
//! starts four copies of the command, each with the environment chorus reads
//! (`CHORUS_RANK`, `CHORUS_WORLD_SIZE`, `CHORUS_LOCAL_RANK`, `CHORUS_LOCAL_SIZE`, `CHORUS_ADDR`,
//! `CHORUS_TOKEN`) and, so that a PyTorch program runs unchanged, torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//! `CHORUS_ADDR` and `MASTER_PORT` name two different free ports: rank 0 hosts chorus's
//! rendezvous store on the first, torch's own store may use the second.
//!
//! Every line a rank writes is prefixed with `[rank] ` (stdout to our stdout, stderr to our
//! stderr). A line ends at `\n` or `\r` (a progress bar's redraw); part of a line goes out
//! once the rank pauses for [`PAUSE`] (a prompt), the rest of that line without a prefix.
//! When a rank fails (non-zero exit or a signal) the others get a short grace period
//! to exit on their own and are then killed; `chorus-run` exits with the failing rank's code
//! (128 + signal number for a signal). `--timeout` bounds the whole job (exit code 124).
//!
//! Limits:
//! - Killing is `SIGKILL` to each rank's own process. A process a rank started (the program
//!   a wrapper script runs without `exec`, a background process) is killed once the job was
//!   stopped (a failure, `--timeout`, a signal) and every rank is gone: `chorus-run` is the
//!   ranks' child subreaper, so what they leave behind is handed to it, and it stops that too
//!   (`SIGTERM`, then `SIGKILL` after [`ORPHAN_GRACE`]): what carries the job's environment
//!   (its `CHORUS_TOKEN`), not what moved itself elsewhere (a daemon under another subreaper)
//!   or started with an environment of its own (`env -i`), and not where `/proc` numbers
//!   another PID namespace's processes. After a job
//!   that succeeded, such a survivor is left running, and can keep a rank's output pipe open:
//!   `chorus-run` passes on what is on its way (however slowly its own output is read) but
//!   gives up on a pipe that stays open with nothing in it for [`DRAIN_GRACE`].
//! - The ranks stay in `chorus-run`'s process group, so a signal from the terminal (Ctrl-C,
//!   Ctrl-\\) reaches all of them directly. Each rank is started through util-linux's
//!   `setpriv --pdeathsig TERM` where the system has it (Debian always does): when
//!   `chorus-run` ends for any reason (a `SIGKILL` sent to it alone, a crash), the kernel sends
//!   every rank `SIGTERM`, so no rank outlives its launcher. Without `setpriv`, ranks of a
//!   launcher killed that way keep running.
//!
//! Signals: `SIGINT`, `SIGTERM`, `SIGHUP` and `SIGQUIT` sent to `chorus-run` (by `kill`, a
//! batch system, `docker stop`) are passed on to every rank still running and stop the job:
//! the ranks get [`STOP_GRACE`] to exit, then are killed; a second such signal kills them at
//! once. The same signals from the terminal are not passed on (the ranks got them already) but
//! stop the job the same way (a hangup's `SIGHUP` is passed on when `chorus-run` leads its
//! session, as under `ssh -t`: the kernel sent it to the leader alone). `SIGUSR1` and
//! `SIGUSR2` are passed on and the job goes on (a batch system's warning before a time limit,
//! say). A signal sent to the whole process group (`timeout`, `kill -- -PGID`) reaches the
//! ranks twice, directly and passed on; the same signal from the same sender again within a
//! second counts once. Signals `chorus-run` was started ignoring (`nohup`, `cmd &` in a
//! script) stay ignored, by it and by the ranks. A job stopped by a signal before anything
//! else decided its end (a rank's failure, `--timeout`) ends with that signal: `chorus-run`
//! then kills itself with it (`SIGQUIT`: exits with 131, no core file; as a container's first
//! process, exits with 128 + the signal), so a shell sees the same status as if the ranks had
//! run without a launcher.
#![forbid(unsafe_code)]

use std::ffi::{c_int, OsString};
use std::fs::File;
use std::io::{self, IsTerminal, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{kill_process, Pid, Signal};
use signal_hook::consts::signal::{SIGHUP, SIGINT, SIGPIPE, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2};
use signal_hook::iterator::exfiltrator::origin::{Origin, WithOrigin};
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;
use signal_hook::low_level::{emulate_default_handler, signal_name};

/// How often the wait loop polls the ranks.
const POLL_INTERVAL: Duration = Duration::from_millis(5);
/// After one rank failed, how long the others may take to exit on their own (a chorus rank
/// usually notices a lost peer quickly and reports it) before they are killed.
const KILL_GRACE: Duration = Duration::from_millis(250);
/// After every rank has exited, how long an output pipe may stay open with nothing coming
/// through it before it is given up (a background process of a rank holds it).
const DRAIN_GRACE: Duration = Duration::from_secs(1);
/// A line longer than this is passed on in pieces of this size, each with its own prefix.
const MAX_LINE: usize = 64 * 1024;
/// A rank's partial line (a prompt, a progress bar) is passed on once its output pauses this
/// long.
const PAUSE: Duration = Duration::from_millis(100);

/// Where a [`Prefixer`] passes its pieces: a piece, whether it continues a line part of which
/// went out already, and whether it ends its line on the screen (`\n`; after a `\r` the line
/// is still there).
type Sink<'a> = &'a dyn Fn(&[u8], bool, bool);
/// Largest accepted `-n`.
const MAX_RANKS: usize = 4096;
/// Root host used with `--netns-prefix`: the first host of the namespace testbed that
/// `tests/netns/cluster.sh` builds (hosts 10.78.0.1..N on eth0).
const NETNS_ROOT_HOST: &str = "10.78.0.1";
/// Exit code for a job stopped by `--timeout` (the code `timeout(1)` uses).
const EXIT_TIMEOUT: i32 = 124;
/// Exit code for a bad command line.
const EXIT_USAGE: i32 = 2;
/// After a signal that stops the job, how long the ranks may take to exit before they are
/// killed (`docker stop` waits as long before it kills).
const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long what the ranks of a stopped job left running has to exit once asked to (see
/// [`kill_orphans`]) before it is killed.
const ORPHAN_GRACE: Duration = Duration::from_secs(2);
/// How long [`kill_orphans`] goes on at most (no signal is looked at meanwhile).
const ORPHAN_DEADLINE: Duration = Duration::from_secs(7);
/// How often a running job's orphans that exited are reaped.
const ORPHAN_REAP_EVERY: Duration = Duration::from_secs(1);
/// The signals `chorus-run` catches and passes on to its ranks.
const CAUGHT: [c_int; 6] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2];

const USAGE: &str = "\
Usage: chorus-run [OPTIONS] -n N [--] CMD [ARGS...]

Start N ranks of CMD on this machine with the environment chorus (and torchrun-style
programs) read, prefix their output with the rank, and stop the job when a rank fails.

Options:
  -n, -np, --nproc N    number of ranks to start (1..=4096; required)
      --addr HOST:PORT  rendezvous root address given to the ranks as CHORUS_ADDR
                        (default: 127.0.0.1 and a free port; see --netns-prefix)
      --token T         shared secret given as CHORUS_TOKEN
                        (default: 32 fresh random hex digits from /dev/urandom)
      --timeout SECS    kill the whole job after SECS seconds and exit with 124
      --env K=V         extra variable for every rank (repeatable; wins over ours,
                        except CHORUS_TOKEN: use --token)
      --no-prefix       pass the ranks' output through unchanged
      --netns-prefix P  run rank r as `ip netns exec P<r+1> CMD...` (the namespace testbed
                        of tests/netns/cluster.sh, one emulated host per rank, e.g.
                        --netns-prefix chorus-h); CHORUS_ADDR then defaults to
                        10.78.0.1:PORT (host 1's eth0; --addr overrides it) and every
                        rank is LOCAL_RANK 0 of LOCAL_SIZE 1
  -h, --help            print this help
      --version         print the version

Each rank r gets CHORUS_RANK=r CHORUS_WORLD_SIZE=N CHORUS_LOCAL_RANK=r CHORUS_LOCAL_SIZE=N
CHORUS_ADDR CHORUS_TOKEN CHORUS_RUN_NPROC=N, and RANK WORLD_SIZE LOCAL_RANK
LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT (a second free port, for torch's own store).
Stdin goes to rank 0 only. If stdout is a pipe whose reader exits (| head), the ranks get
SIGPIPE, as they would writing to it themselves.

Exit status: 0 if every rank succeeded; else the first failing rank's exit code
(128 + signal number if it was killed by a signal; of ranks that fail together, one killed
by a signal comes first); 124 on --timeout; 2 for a bad command line, or when chorus-run
is itself one of several tasks of another launcher (SLURM_STEP_NUM_TASKS,
OMPI_COMM_WORLD_SIZE, PMI_SIZE, CHORUS_RUN_NPROC, or torchrun's WORLD_SIZE above 1: each
task would run a job of its own; set
CHORUS_RUN_NESTED=1 if that is meant; the Slurm and MPI counts are not looked at when
stdin is a terminal, as in an interactive srun --pty shell, or when SLURM_PTY_PORT is set); 127 (126) if CMD could not be found
(executed); 1 if chorus-run could not start the job (no free port, no /dev/urandom).
SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the job: sent to chorus-run they are passed on
to the ranks (from the terminal the ranks got them already), the ranks get 10 s to exit and
are then killed (at once on a second such signal), and chorus-run ends by the same signal
(SIGQUIT: exit status 131), unless a rank failed first. SIGUSR1 and SIGUSR2 are passed on
to the ranks and the job goes on. Signals ignored when chorus-run starts (nohup) stay
ignored.
";

/// What the command line asked for.
#[derive(Debug, Default)]
struct Options {
    /// Number of ranks.
    nproc: usize,
    /// `--addr`.
    addr: Option<String>,
    /// `--token`.
    token: Option<String>,
    /// `--timeout`.
    timeout: Option<Duration>,
    /// `--no-prefix`.
    no_prefix: bool,
    /// `--netns-prefix`.
    netns_prefix: Option<String>,
    /// `--env K=V`, in order.
    extra_env: Vec<(String, String)>,
    /// The command and its arguments.
    command: Vec<OsString>,
}

/// Outcome of parsing the command line.
enum Parsed {
    /// Run a job.
    Run(Options),
    /// Print this text to stdout and exit 0 (`--help`, `--version`).
    Print(String),
}

/// Parses the arguments after the program name. Errors are one-line messages for the user.
fn parse_args(args: Vec<OsString>) -> Result<Parsed, String> {
    let mut opts = Options::default();
    let mut nproc: Option<usize> = None;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str() else {
            // Not an option (all options are ASCII): the command starts here.
            opts.command.push(arg);
            break;
        };
        if text == "--" {
            break;
        }
        if !text.starts_with('-') || text == "-" {
            opts.command.push(arg);
            break;
        }
        // `--name=value` is accepted for the long options that take a value.
        let (name, inline) = match text.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_string(), Some(v.to_string())),
            _ => (text.to_string(), None),
        };
        let mut value = |what: &str| -> Result<String, String> {
            if let Some(v) = inline.clone() {
                return Ok(v);
            }
            match args.next() {
                Some(v) => v
                    .into_string()
                    .map_err(|_| format!("{name}: {what} is not valid UTF-8")),
                None => Err(format!("{name} needs {what}")),
            }
        };
        if inline.is_some() && matches!(name.as_str(), "--help" | "--version" | "--no-prefix") {
            return Err(format!("{name} takes no value (got {text:?})"));
        }
        match name.as_str() {
            "-h" | "--help" => return Ok(Parsed::Print(USAGE.to_string())),
            "--version" => {
                return Ok(Parsed::Print(format!(
                    "chorus-run {}\n",
                    env!("CARGO_PKG_VERSION")
                )))
            }
            "-n" | "-np" | "--nproc" => nproc = Some(parse_nproc(&value("a number of ranks")?)?),
            "--addr" => opts.addr = Some(parse_addr(&value("HOST:PORT")?)?),
            "--token" => {
                let token = value("a token")?;
                if token.trim().is_empty() {
                    // A blank CHORUS_TOKEN means none: authentication would be off, silently.
                    return Err("--token must not be empty or blank".into());
                }
                opts.token = Some(token);
            }
            "--timeout" => opts.timeout = Some(parse_timeout(&value("SECS")?)?),
            "--no-prefix" => opts.no_prefix = true,
            "--netns-prefix" => {
                let prefix = value("a namespace prefix")?;
                if prefix.is_empty() {
                    return Err("--netns-prefix must not be empty".into());
                }
                opts.netns_prefix = Some(prefix);
            }
            "--env" => {
                let kv = value("K=V")?;
                match kv.split_once('=') {
                    // The job's token is this launcher's to give (it also marks what the job
                    // started, for the clean-up), and a blank one would turn authentication
                    // off, silently.
                    Some(("CHORUS_TOKEN", _)) => {
                        return Err("--env CHORUS_TOKEN=...: give the token with --token".into())
                    }
                    Some((k, v)) if !k.is_empty() => {
                        opts.extra_env.push((k.to_string(), v.to_string()))
                    }
                    _ => return Err(format!("--env expects K=V, got {kv:?}")),
                }
            }
            _ => {
                // `-n4` / `-np4`: glued short forms.
                if let Some(n) = text.strip_prefix("-np").or_else(|| text.strip_prefix("-n")) {
                    if n.bytes().all(|b| b.is_ascii_digit()) {
                        nproc = Some(parse_nproc(n)?);
                        continue;
                    }
                }
                return Err(format!("unknown option {text:?}"));
            }
        }
    }
    opts.command.extend(args);
    opts.nproc = nproc.ok_or("the number of ranks is required: -n N")?;
    if opts.command.is_empty() {
        return Err("no command given: chorus-run -n N -- CMD [ARGS...]".into());
    }
    Ok(Parsed::Run(opts))
}

/// Parses `-n`: 1..=[`MAX_RANKS`].
fn parse_nproc(text: &str) -> Result<usize, String> {
    // Digits only, as the ranks' own parser takes numbers (no sign).
    let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
    match text.parse::<usize>() {
        Ok(n) if digits && (1..=MAX_RANKS).contains(&n) => Ok(n),
        _ => Err(format!(
            "-n expects a number of ranks in 1..={MAX_RANKS}, got {text:?}"
        )),
    }
}

/// Checks `HOST:PORT` (IPv6 as `[addr]:port`) and returns it unchanged.
fn parse_addr(text: &str) -> Result<String, String> {
    // The ranks' own parser: what it refuses, each rank would refuse at init.
    match chorus::config::parse_chorus_addr("--addr", text) {
        Ok((_, 0)) => Err(format!(
            "--addr {text:?}: port 0 is not a port ranks can meet at"
        )),
        Ok(_) => Ok(text.to_string()),
        Err(e) => Err(e),
    }
}

/// Parses `--timeout`: a positive number of seconds, fractions allowed.
fn parse_timeout(text: &str) -> Result<Duration, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() && secs < 1e9 => {
            Ok(Duration::from_secs_f64(secs))
        }
        _ => Err(format!(
            "--timeout expects a positive number of seconds, got {text:?}"
        )),
    }
}

/// The host part of `HOST:PORT`, without IPv6 brackets (the form `MASTER_ADDR` takes).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Two distinct TCP ports that were free on 127.0.0.1 a moment ago, for the ranks to use
/// (drawn where no other program's `bind(0)` takes them meanwhile: see
/// [`chorus_transport::rendezvous::free_local_ports`]).
fn free_ports() -> io::Result<(u16, u16)> {
    let p = chorus_transport::rendezvous::free_local_ports(2)?;
    Ok((p[0], p[1]))
}

/// 16 bytes from `/dev/urandom` as 32 lowercase hex digits.
fn random_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The environment of one rank, in the order it is applied (later entries win).
fn rank_env(
    opts: &Options,
    rank: usize,
    root_addr: &str,
    master_port: u16,
    token: &str,
) -> Vec<(String, String)> {
    let size = opts.nproc;
    // In the namespace testbed every rank is an emulated host of its own.
    let (local_rank, local_size) = if opts.netns_prefix.is_some() {
        (0, 1)
    } else {
        (rank, size)
    };
    let mut env = vec![
        ("CHORUS_RANK".to_string(), rank.to_string()),
        ("CHORUS_WORLD_SIZE".to_string(), size.to_string()),
        ("CHORUS_LOCAL_RANK".to_string(), local_rank.to_string()),
        ("CHORUS_LOCAL_SIZE".to_string(), local_size.to_string()),
        ("CHORUS_ADDR".to_string(), root_addr.to_string()),
        ("CHORUS_TOKEN".to_string(), token.to_string()),
        // Marks a rank of chorus-run: a chorus-run started as one is refused (nested_launch).
        ("CHORUS_RUN_NPROC".to_string(), size.to_string()),
        ("RANK".to_string(), rank.to_string()),
        ("WORLD_SIZE".to_string(), size.to_string()),
        ("LOCAL_RANK".to_string(), local_rank.to_string()),
        ("LOCAL_WORLD_SIZE".to_string(), local_size.to_string()),
        ("MASTER_ADDR".to_string(), host_of(root_addr).to_string()),
        ("MASTER_PORT".to_string(), master_port.to_string()),
    ];
    env.extend(opts.extra_env.iter().cloned());
    env
}

/// Cuts one stream of a rank's output into the pieces passed on, each to go out with the
/// rank's prefix unless it continues a line (see [`Output`]). A line ends at `\n` or at `\r`
/// (a progress bar redrawing its line; `\r\n` ends one line). A line longer than
/// [`MAX_LINE`] is passed on in pieces, each ended with a newline. Bytes are not decoded.
struct Prefixer {
    /// Bytes of the current line not passed on yet.
    held: Vec<u8>,
    /// Part of the current line went out already (see [`Prefixer::pause`]): the rest goes out
    /// without a prefix.
    mid_line: bool,
    /// The last byte passed on was a `\r`: a `\n` right after it ends the same line.
    after_cr: bool,
}

impl Prefixer {
    fn new() -> Self {
        Prefixer {
            held: Vec::with_capacity(256),
            mid_line: false,
            after_cr: false,
        }
    }

    /// Takes the next bytes of the stream; passes on every line they end.
    fn feed(&mut self, mut input: &[u8], out: Sink<'_>) {
        while !input.is_empty() {
            if std::mem::take(&mut self.after_cr) && input[0] == b'\n' {
                out(b"\n", true, true);
                input = &input[1..];
                continue;
            }
            let room = MAX_LINE - self.held.len();
            // One byte past the room: a line of exactly MAX_LINE bytes keeps its own end.
            let window = &input[..input.len().min(room + 1)];
            match window.iter().position(|&b| b == b'\n' || b == b'\r') {
                Some(i) => {
                    // `\r\n` in one piece ends one line (a blank one too).
                    let end = if window[i] == b'\r' && input.get(i + 1) == Some(&b'\n') {
                        i + 1
                    } else {
                        i
                    };
                    self.held.extend_from_slice(&input[..=end]);
                    self.after_cr = input[end] == b'\r';
                    self.pass(out);
                    input = &input[end + 1..];
                }
                None => {
                    let take = window.len().min(room);
                    self.held.extend_from_slice(&window[..take]);
                    input = &input[take..];
                    if self.held.len() == MAX_LINE {
                        self.held.push(b'\n');
                        self.pass(out);
                    }
                }
            }
        }
    }

    /// Passes on what is held (a whole line, or the end of one).
    fn pass(&mut self, out: Sink<'_>) {
        out(&self.held, self.mid_line, self.held.last() == Some(&b'\n'));
        self.held.clear();
        self.mid_line = false;
    }

    /// Whether part of a line is held, waiting for its end.
    fn holds_part(&self) -> bool {
        !self.held.is_empty()
    }

    /// The stream paused in the middle of a line (a prompt, a progress bar): pass that part
    /// on now; the rest of the line follows without a prefix.
    fn pause(&mut self, out: Sink<'_>) {
        if self.holds_part() {
            self.pass(out);
            self.mid_line = true;
        }
    }

    /// End of the stream: a line without its end gets a newline.
    fn finish(&mut self, out: Sink<'_>) {
        if self.holds_part() || self.mid_line {
            self.held.push(b'\n');
            self.pass(out);
        }
    }
}

/// What a reader thread is doing, as the drain after the ranks' exit reads it.
const READING: u8 = 0;
const PASSING: u8 = 1;
const DONE: u8 = 2;

/// Copies `input` (one of a rank's pipes) to `output` through a [`Prefixer`]: a partial line
/// is passed on after [`PAUSE`] without more input. Write errors (our output closed) are
/// ignored, but the input is still drained so that the rank never blocks on a full pipe (a
/// closed stdout is reported to the wait loop, which passes `SIGPIPE` on to the ranks).
/// `state` says whether the thread waits for input or passes output on. Returns at end of
/// input.
fn prefix_stream<R: Read + AsFd>(mut input: R, output: Sink<'_>, state: &AtomicU8) {
    let mut lines = Prefixer::new();
    let mut buf = vec![0u8; MAX_LINE];
    let pause = Timespec {
        tv_sec: 0,
        tv_nsec: PAUSE.as_nanos() as _,
    };
    loop {
        state.store(READING, Ordering::Relaxed);
        if lines.holds_part() {
            let mut fds = [PollFd::new(&input, PollFlags::IN)];
            match poll(&mut fds, Some(&pause)) {
                Ok(0) => {
                    state.store(PASSING, Ordering::Relaxed);
                    lines.pause(output);
                    continue;
                }
                // A signal came: look again, the pause not over.
                Err(rustix::io::Errno::INTR) => continue,
                _ => {}
            }
        }
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        state.store(PASSING, Ordering::Relaxed);
        lines.feed(&buf[..n], output);
    }
    state.store(PASSING, Ordering::Relaxed);
    lines.finish(output);
}

/// One of our outputs (stdout, stderr), written to by the streams of every rank.
struct Output {
    /// The stream whose line is still open on this output (part of a line that went out
    /// after a pause, or a line a `\r` returned to), if one is.
    open_line: Mutex<Option<usize>>,
    write: fn(&[u8]),
}

/// Stream ID of `chorus-run`'s own messages (a rank's stdout is `2·rank`, its stderr
/// `2·rank + 1`).
const OURS: usize = usize::MAX;
static STDOUT: Output = Output {
    open_line: Mutex::new(None),
    write: to_stdout,
};
static STDERR: Output = Output {
    open_line: Mutex::new(None),
    write: to_stderr,
};

impl Output {
    /// Writes a piece of stream `id` (see [`compose`]), under the lock that keeps the pieces
    /// of streams apart. When our stdout and stderr are one file (a terminal), they share one
    /// open line: a rank's progress bar on stderr is ended before another's line on stdout.
    fn put(&self, id: usize, prefix: &[u8], body: &[u8], continues: bool, ends: bool) {
        let track = if std::ptr::eq(self, &STDERR) && *ONE_FILE.get_or_init(one_file) {
            &STDOUT.open_line
        } else {
            &self.open_line
        };
        let mut open = track.lock().unwrap_or_else(PoisonError::into_inner);
        (self.write)(&compose(&mut open, id, prefix, body, continues, ends));
    }
}

/// Whether our stdout and stderr are the same file.
static ONE_FILE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn one_file() -> bool {
    let (out, err) = (
        rustix::fs::fstat(io::stdout()),
        rustix::fs::fstat(io::stderr()),
    );
    matches!((out, err), (Ok(a), Ok(b)) if a.st_dev == b.st_dev && a.st_ino == b.st_ino)
}

/// The bytes that put a piece of stream `id` on an output whose open line is `open`: a line
/// another stream left open is ended first (its rest then starts a line of its own, with its
/// prefix); the piece is prefixed unless it continues this stream's open line. A progress
/// bar's `\r` that starts a line shows nothing.
fn compose(
    open: &mut Option<usize>,
    id: usize,
    prefix: &[u8],
    body: &[u8],
    continues: bool,
    ends: bool,
) -> Vec<u8> {
    let ours = *open == Some(id);
    // A bare `\r` on a line of its own, or a line end whose line another stream already
    // ended: nothing to show.
    if body == b"\r" && !(continues && ours) || continues && !ours && body == b"\n" {
        return Vec::new();
    }
    let mut piece = Vec::with_capacity(1 + prefix.len() + body.len());
    if open.is_some() && !ours {
        piece.push(b'\n');
    }
    if !(continues && ours) {
        piece.extend_from_slice(prefix);
    }
    piece.extend_from_slice(body);
    *open = (!ends).then_some(id);
    piece
}

/// Set when our stdout turned out to be a pipe with no reader left (`chorus-run ... | head`):
/// the wait loop then passes `SIGPIPE` on to the ranks, as their own writes would have
/// brought them with `--no-prefix`.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one whole line to our stdout (under its lock, so lines of ranks never mix).
fn to_stdout(line: &[u8]) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_all(line).and_then(|()| out.flush()) {
        if e.kind() == io::ErrorKind::BrokenPipe {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
        }
    }
}

/// Writes one whole line to our stderr.
fn to_stderr(line: &[u8]) {
    let _ = io::stderr().lock().write_all(line);
}

/// `chorus-run: ...` on stderr, as one line. Unlike `eprintln!`, a stderr that is a closed
/// pipe is ignored, not a panic: a panic here would leave the ranks running. While the job
/// runs, the line is written by another thread (see [`SAYER`]).
macro_rules! say {
    ($($arg:tt)*) => {
        say_line(format!("chorus-run: {}\n", format_args!($($arg)*)).into_bytes())
    };
}

/// While the job runs, where [`say!`] sends its lines: a thread that writes them, so that a
/// stalled stderr (a paused pager) cannot hold up the loop that kills ranks.
static SAYER: Mutex<Option<mpsc::Sender<Vec<u8>>>> = Mutex::new(None);

fn say_line(line: Vec<u8>) {
    let line = match SAYER
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
    {
        Some(tx) => match tx.send(line) {
            Ok(()) => return,
            Err(mpsc::SendError(line)) => line,
        },
        None => line,
    };
    STDERR.put(OURS, b"", &line, false, true);
}

/// One started rank.
struct Rank {
    child: Child,
    /// Exit status once reaped.
    status: Option<ExitStatus>,
}

/// How a failed rank's status maps to our exit code and a description.
fn describe(status: ExitStatus) -> (i32, String) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (code, format!("exited with status {code}")),
        (None, Some(sig)) => (128 + sig, format!("was killed by {}", name_of(sig))),
        _ => (1, format!("ended with {status}")),
    }
}

/// The signals this process ignores (`SigIgn` of `/proc/self/status`); none if it cannot
/// tell.
fn ignored_signals() -> Vec<c_int> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let mask = status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    (1..=64)
        .filter(|&sig| mask & (1u64 << (sig - 1)) != 0)
        .collect()
}

/// `"signal 15 (SIGTERM)"`.
fn name_of(sig: c_int) -> String {
    match signal_name(sig) {
        Some(name) => format!("signal {sig} ({name})"),
        None => format!("signal {sig}"),
    }
}

/// `"1 rank"` / `"3 ranks"`.
fn ranks(n: usize) -> String {
    if n == 1 {
        "1 rank".to_string()
    } else {
        format!("{n} ranks")
    }
}

fn main() {
    let opts = match parse_args(std::env::args_os().skip(1).collect()) {
        Ok(Parsed::Run(opts)) => opts,
        Ok(Parsed::Print(text)) => {
            to_stdout(text.as_bytes());
            return;
        }
        Err(msg) => {
            say!("{msg} (see chorus-run --help)");
            std::process::exit(EXIT_USAGE);
        }
    };
    // An interactive shell of a job step (`srun -n 8 --pty bash`) is one task however many
    // the step counts: its terminal says so.
    let interactive =
        std::io::stdin().is_terminal() || std::env::var_os("SLURM_PTY_PORT").is_some();
    if let Some(why) = nested_launch(&|k| std::env::var(k).ok(), interactive) {
        say!("{why}");
        std::process::exit(EXIT_USAGE);
    }
    let (code, stopped_by) = run(&opts);
    // End as the ranks did, by the signal (a shell then stops a loop on Ctrl-C). Not as the
    // init of a PID namespace (a container's first process), which the kernel does not let
    // kill itself that way: the exit code says the same there.
    let init = rustix::process::getpid().is_init();
    if let Some(sig) = stopped_by.filter(|&sig| sig != SIGQUIT && !init) {
        let _ = emulate_default_handler(sig);
    }
    std::process::exit(code);
}

/// Why this launcher should not run here: it was itself started as one of several tasks of
/// another launcher (`srun -N2 chorus-run -n 4 ...`), which would make several independent
/// jobs, each with a rank 0 of its own. `CHORUS_RUN_NESTED=1` allows it. An `interactive`
/// shell of a job step (`srun -n 8 --pty bash`, `mpirun -np 2 xterm`) is one task however
/// many the step counts: the Slurm and MPI counts are not looked at there; chorus-run's own
/// and torchrun's are (their ranks inherit the terminal of the shell that started them).
fn nested_launch(get: &dyn Fn(&str) -> Option<String>, interactive: bool) -> Option<String> {
    if get("CHORUS_RUN_NESTED").is_some_and(|v| v.trim() == "1") {
        return None;
    }
    // Each launcher's count, and whether it is looked at: the Slurm and MPI counts not from
    // an interactive shell; torchrun's WORLD_SIZE only with its run id (one left exported in
    // a shell says nothing); CHORUS_RUN_NPROC is what chorus-run gives its own ranks.
    let torchrun = get("TORCHELASTIC_RUN_ID").is_some();
    [
        ("SLURM_STEP_NUM_TASKS", !interactive),
        ("OMPI_COMM_WORLD_SIZE", !interactive),
        ("PMI_SIZE", !interactive),
        ("CHORUS_RUN_NPROC", true),
        ("WORLD_SIZE", torchrun),
    ]
    .into_iter()
    .filter_map(|(var, looked_at)| looked_at.then_some(var))
    .find_map(|var| {
        let n: usize = get(var)?.trim().parse().ok()?;
        (n > 1).then(|| {
            format!(
                "{var}={n}: chorus-run was started as one of {n} tasks of another launcher, \
                     and each would run a job of its own with a rank 0 of its own; start the \
                     program under that launcher directly (chorus reads its variables), or set \
                     CHORUS_RUN_NESTED=1 if independent jobs are meant"
            )
        })
    })
}

/// Runs the job and returns our exit code, and the signal that stopped the job if one did.
/// Our own messages are written by a thread of their own meanwhile (see [`SAYER`]); all of
/// them are written before this returns.
fn run(opts: &Options) -> (i32, Option<c_int>) {
    let (tx, lines) = mpsc::channel::<Vec<u8>>();
    let writer = thread::Builder::new()
        .name("messages".into())
        .spawn(move || {
            for line in lines {
                STDERR.put(OURS, b"", &line, false, true);
            }
        });
    if writer.is_ok() {
        *SAYER.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }
    let outcome = run_job(opts);
    drop(SAYER.lock().unwrap_or_else(PoisonError::into_inner).take());
    if let Ok(writer) = writer {
        let _ = writer.join();
    }
    outcome
}

/// [`run`]'s work.
fn run_job(opts: &Options) -> (i32, Option<c_int>) {
    // Caught before the first rank starts, so that none is left without its launcher's care.
    // Not those we were started ignoring (`nohup`, a script's `cmd &`): the ranks inherit
    // that, as they would without a launcher, and a caught one would not be ignored by them.
    let ignored = ignored_signals();
    let caught: Vec<c_int> = CAUGHT
        .into_iter()
        .filter(|&sig| !ignored.contains(&sig))
        .collect();
    let mut signals = match SignalsInfo::<WithOrigin>::new(caught) {
        Ok(signals) => Some(signals),
        Err(e) => {
            say!("cannot catch signals ({e}); they will not be passed on to the ranks");
            None
        }
    };

    let (chorus_port, master_port) = match free_ports() {
        Ok(ports) => ports,
        Err(e) => {
            say!("cannot find a free TCP port on 127.0.0.1: {e}");
            return (1, None);
        }
    };
    let root_addr = match (&opts.addr, &opts.netns_prefix) {
        (Some(addr), _) => addr.clone(),
        (None, Some(_)) => format!("{NETNS_ROOT_HOST}:{chorus_port}"),
        (None, None) => format!("127.0.0.1:{chorus_port}"),
    };
    let token = match &opts.token {
        Some(t) => t.clone(),
        None => match random_token() {
            Ok(t) => t,
            Err(e) => {
                say!("cannot read /dev/urandom for a token: {e}");
                return (1, None);
            }
        },
    };

    raise_open_files(opts.nproc);
    let pdeath = parent_death_prefix();
    // What a rank leaves behind when it dies (a wrapper script's program, started without
    // `exec`) comes to us rather than to init, so that a stopped job can stop it too.
    // Only where `/proc` numbers processes as we do (not after `unshare --pid` without a
    // `/proc` of its own): the sweep reads it to find them.
    let subreaper = proc_is_ours()
        && rustix::process::set_child_subreaper(Some(rustix::process::getpid())).is_ok();
    // What every rank, and what it starts, carries in its environment: the sweep stops only
    // processes of this job (as a container's first process, every orphan there is ours).
    let marker = format!("CHORUS_TOKEN={token}").into_bytes();
    // By its path in the launcher's PATH (see `in_path`).
    let ip = opts.netns_prefix.as_ref().and_then(|_| in_path("ip"));
    // The job could not be started whole: the ranks started so far, and what they started.
    // What the ranks left running, stopped (where this launcher is their subreaper), said.
    let stop_orphans = || {
        if !subreaper {
            return;
        }
        let killed = kill_orphans(&marker);
        if killed > 0 {
            say!(
                "stopped {killed} process{} the ranks left running",
                if killed == 1 { "" } else { "es" }
            );
        }
    };
    let abandon = |started: &mut Vec<Rank>| {
        stop_started(started);
        stop_orphans();
    };
    // Start the ranks, each with reader threads that report to `drained` when done.
    let (drained_tx, drained) = mpsc::channel::<()>();
    let mut readers: Vec<Arc<AtomicU8>> = Vec::new();
    let mut started: Vec<Rank> = Vec::with_capacity(opts.nproc);
    for rank in 0..opts.nproc {
        let argv: Vec<OsString> = pdeath.iter().chain(&opts.command).cloned().collect();
        let mut cmd = match &opts.netns_prefix {
            Some(prefix) => {
                let mut c = Command::new(ip.as_deref().unwrap_or(std::path::Path::new("ip")));
                c.arg("netns")
                    .arg("exec")
                    .arg(format!("{prefix}{}", rank + 1));
                c.args(&argv);
                c
            }
            None => {
                let mut c = Command::new(&argv[0]);
                c.args(&argv[1..]);
                c
            }
        };
        cmd.envs(rank_env(opts, rank, &root_addr, master_port, &token));
        cmd.stdin(if rank == 0 {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
        if !opts.no_prefix {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                abandon(&mut started);
                let program = cmd.get_program().to_string_lossy().into_owned();
                say!("cannot start rank {rank} ({program}): {e}");
                // As a shell's: 127 not found, 126 found but not executable; anything else
                // (out of file descriptors or processes) is this launcher's failure.
                let code = match e.kind() {
                    io::ErrorKind::NotFound => 127,
                    io::ErrorKind::PermissionDenied => 126,
                    _ => 1,
                };
                return (code, None);
            }
        };
        let prefix = format!("[{rank}] ").into_bytes();
        let mut spawned = Ok(());
        if let Some(out) = child.stdout.take() {
            let (tx, prefix) = (drained_tx.clone(), prefix.clone());
            let state = Arc::new(AtomicU8::new(READING));
            readers.push(state.clone());
            spawned = spawned.and(spawn_reader(rank, move || {
                let sink = |body: &[u8], continues, ends| {
                    STDOUT.put(2 * rank, &prefix, body, continues, ends);
                };
                prefix_stream(out, &sink, &state);
                state.store(DONE, Ordering::Relaxed);
                let _ = tx.send(());
            }));
        }
        if let Some(err) = child.stderr.take() {
            let tx = drained_tx.clone();
            let state = Arc::new(AtomicU8::new(READING));
            readers.push(state.clone());
            spawned = spawned.and(spawn_reader(rank, move || {
                let sink = |body: &[u8], continues, ends| {
                    STDERR.put(2 * rank + 1, &prefix, body, continues, ends);
                };
                prefix_stream(err, &sink, &state);
                state.store(DONE, Ordering::Relaxed);
                let _ = tx.send(());
            }));
        }
        started.push(Rank {
            child,
            status: None,
        });
        if let Err(e) = spawned {
            // Its output could not be passed on: stop the job rather than leave it blocked.
            abandon(&mut started);
            say!("cannot start a thread for the output of rank {rank}: {e}; stopped the job");
            return (1, None);
        }
    }
    drop(drained_tx);

    let job_end = opts.timeout.map(|t| Instant::now() + t);
    let mut ending = Ending::new();
    wait_all(
        &mut started,
        job_end,
        signals.as_mut(),
        &mut ending,
        subreaper,
    );
    let orphans_stopped = ending.failed;
    if orphans_stopped {
        stop_orphans();
    }

    // Let the readers pass on what the ranks wrote last, however slowly our own output takes
    // it (a pager, a slow link); but do not hang on a pipe that a surviving background
    // process of some rank still holds open: give up once every reader left has waited for
    // input, passing nothing on, for DRAIN_GRACE. A stop signal or the job's --timeout ends
    // this wait too.
    let mut done = 0;
    let mut quiet_since = Instant::now();
    while done < readers.len() {
        match drained.recv_timeout(POLL_INTERVAL) {
            Ok(()) => {
                done += 1;
                continue;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let now = Instant::now();
        if ending.take_signals(signals.as_mut(), &mut started) {
            say!("stopped waiting for the ranks' last output");
            break;
        }
        if job_end.is_some_and(|t| now >= t) {
            say!("timeout (--timeout) while passing on the ranks' last output; not waiting for it");
            if ending.exit_code == 0 {
                ending.exit_code = EXIT_TIMEOUT;
            }
            ending.failed = true;
            break;
        }
        if readers.iter().any(|r| r.load(Ordering::Relaxed) == PASSING) {
            quiet_since = now;
        } else if now.duration_since(quiet_since) >= DRAIN_GRACE {
            say!(
                "output of some rank is still open after all ranks exited \
                 (a background process of a rank survives it); not waiting for it"
            );
            break;
        }
    }
    // A stop signal or the timeout during that wait stops the job as it would have before:
    // what the ranks left running goes too.
    if ending.failed && !orphans_stopped {
        stop_orphans();
    }
    (ending.exit_code, ending.stopped_by)
}

/// How the job ends, as failures, the timeout and signals decide it.
struct Ending {
    exit_code: i32,
    /// A rank failed, the timeout passed, or a signal stopped the job: the exit code is set.
    failed: bool,
    /// The signal that stopped the job, if one did before anything else decided its end.
    stopped_by: Option<c_int>,
    /// A signal asked to stop the job (even after a rank failed).
    stopping: bool,
    /// When set, the ranks still running are killed at this instant.
    kill_at: Option<Instant>,
    /// The last signal a known process sent, its pid and when: the same again from the same
    /// sender right after is one signal that reached us twice (sent to us, then to our whole
    /// process group, as `timeout` and `kill -- -PGID` do), not a second request. Signals of
    /// no known sender (the terminal's, which reach us once per key press, and those sent from
    /// outside our PID namespace, which show pid 0) are never merged.
    last: Option<(c_int, i32, Instant)>,
    /// Whether we lead our session: a hangup's `SIGHUP` from the kernel then came to us
    /// alone, not to the ranks.
    session_leader: bool,
}

/// Whether this process leads its session, read from `/proc/self/stat` (its first field is
/// the process id, its sixth the session id, both as that `/proc` counts them). Not `getsid`:
/// inside a container whose session leader lives in the parent PID namespace the kernel
/// reports session 0, which rustix's `getsid` does not accept (it panics).
fn is_session_leader() -> bool {
    std::fs::read_to_string("/proc/self/stat").is_ok_and(|stat| session_leader_from_stat(&stat))
}

/// The part of [`is_session_leader`] that parses, apart for its test.
fn session_leader_from_stat(stat: &str) -> bool {
    let (Some(open), Some(mut fields)) = (stat.find(" ("), fields_after_name(stat)) else {
        return false;
    };
    let pid = stat[..open].trim().parse::<u64>().ok();
    // state, ppid, pgrp, session
    let session = fields.nth(3).and_then(|s| s.parse::<u64>().ok());
    pid.is_some() && session == pid
}

/// The fields of a `/proc/PID/stat` line after the command name, from the state on. The name
/// may hold spaces and parentheses: the fields after it start after the last ')'.
fn fields_after_name(stat: &str) -> Option<std::str::SplitAsciiWhitespace<'_>> {
    let close = stat.rfind(')')?;
    Some(stat[close + 1..].split_ascii_whitespace())
}

/// Within this, the same signal from the same sender counts once (see [`Ending::last`]).
const REPEAT: Duration = Duration::from_secs(1);

impl Ending {
    fn new() -> Ending {
        Ending {
            exit_code: 0,
            failed: false,
            stopped_by: None,
            stopping: false,
            kill_at: None,
            last: None,
            session_leader: is_session_leader(),
        }
    }

    /// Takes the signals caught since last time (see the module's docs); returns whether one
    /// asked to stop the job.
    fn take_signals(
        &mut self,
        signals: Option<&mut SignalsInfo<WithOrigin>>,
        ranks_: &mut [Rank],
    ) -> bool {
        let Some(signals) = signals else {
            return false;
        };
        let caught: Vec<Origin> = signals.pending().collect();
        let mut stop = false;
        for origin in caught {
            let sig = origin.signal;
            let now = Instant::now();
            let sender = origin.process.map(|p| p.pid).filter(|&pid| pid > 0);
            if let Some(sender) = sender {
                if self
                    .last
                    .is_some_and(|(s, from, at)| s == sig && from == sender && now - at < REPEAT)
                {
                    continue;
                }
                self.last = Some((sig, sender, now));
            }
            let running = ranks_running(ranks_);
            // From the terminal (the kernel sent it to the whole foreground process group)
            // the ranks got it too; sent to us alone, they did not. (A hangup's SIGHUP comes
            // from the kernel to the session's leader alone.)
            let from_terminal =
                matches!(origin.cause, Cause::Kernel) && !(sig == SIGHUP && self.session_leader);
            if !from_terminal {
                pass_on(ranks_, sig);
            }
            let told = if from_terminal {
                "from the terminal, as did the ranks".to_string()
            } else {
                format!("and passed it on to {}", ranks(running))
            };
            if sig == SIGUSR1 || sig == SIGUSR2 {
                say!("got {} {told}", name_of(sig));
                continue;
            }
            stop = true;
            if self.stopping {
                // Killed by the wait loop, which looks at `kill_at` right after this.
                self.kill_at = Some(now);
                say!(
                    "got {} again: killed the {} still running",
                    name_of(sig),
                    ranks(running)
                );
            } else {
                self.stopping = true;
                if !self.failed {
                    self.failed = true;
                    self.exit_code = 128 + sig;
                    self.stopped_by = Some(sig);
                }
                let grace = now + STOP_GRACE;
                self.kill_at = Some(self.kill_at.map_or(grace, |t| t.min(grace)));
                say!(
                    "got {} {told}; stopping the job: ranks still running after {} s are \
                     killed (at once on another such signal)",
                    name_of(sig),
                    STOP_GRACE.as_secs()
                );
            }
        }
        stop
    }
}

/// Waits for every rank; stops the job on the first failure, at `job_end` (`--timeout`), or
/// on a signal (see the module's docs), as `ending` records.
fn wait_all(
    ranks_: &mut [Rank],
    job_end: Option<Instant>,
    mut signals: Option<&mut SignalsInfo<WithOrigin>>,
    ending: &mut Ending,
    subreaper: bool,
) {
    let mut pipe_told = false;
    let mut reaped_at = Instant::now();
    loop {
        if subreaper && reaped_at.elapsed() >= ORPHAN_REAP_EVERY {
            // Orphans handed to us that exited meanwhile (a rank's daemonized helper): reaped,
            // as init would have, so that they do not pile up as zombies over a long job.
            reaped_at = Instant::now();
            let ranks_pids: Vec<u32> = ranks_.iter().map(|r| r.child.id()).collect();
            for (pid, zombie) in children_of(std::process::id()) {
                if zombie && !ranks_pids.contains(&(pid.as_raw_nonzero().get() as u32)) {
                    let _ =
                        rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG);
                }
            }
        }
        // The failures reaped in this pass: ranks that fail together (one crashed, the others
        // then lost it) are told apart below, the cause first.
        let mut fresh: Vec<(usize, ExitStatus)> = Vec::new();
        for (rank, r) in ranks_.iter_mut().enumerate() {
            if r.status.is_some() {
                continue;
            }
            let status = match r.child.try_wait() {
                Ok(Some(status)) => status,
                Ok(None) => continue,
                Err(e) => {
                    say!("cannot wait for rank {rank}: {e}; killing it");
                    let _ = r.child.kill();
                    match r.child.wait() {
                        Ok(status) => status,
                        Err(_) => ExitStatus::from_raw(1 << 8),
                    }
                }
            };
            r.status = Some(status);
            if status.success() || ending.kill_at.is_some_and(|t| Instant::now() >= t) {
                continue;
            }
            fresh.push((rank, status));
        }
        // Signals after reaping: a rank that died of Ctrl-C is reaped with the signal that
        // killed it already caught here, which then counts as the cause.
        ending.take_signals(signals.as_deref_mut(), ranks_);
        // A rank killed by a signal before one that exited with a code: the exit is most
        // likely its peers' reaction to it.
        fresh.sort_by_key(|&(rank, status)| (status.signal().is_none(), rank));
        for (rank, status) in fresh {
            let (code, what) = describe(status);
            if ending.failed {
                // Another rank failed too, on its own or because of the first (or of a
                // signal that stops the job).
                say!("rank {rank} {what}");
                continue;
            }
            ending.failed = true;
            ending.exit_code = code;
            ending.kill_at = Some(Instant::now() + KILL_GRACE);
            let running = ranks_running(ranks_);
            if running == 0 {
                say!("rank {rank} {what}");
            } else if running == 1 {
                say!("rank {rank} {what} (killing the other rank)");
            } else {
                say!("rank {rank} {what} (killing the other {running} ranks)");
            }
        }
        let running = ranks_running(ranks_);
        if running == 0 {
            return;
        }
        if !pipe_told && STDOUT_CLOSED.load(Ordering::Relaxed) {
            // Once: the ranks' output has nowhere to go, as for a program whose reader
            // exited. Those that do not ignore SIGPIPE end by it, and the job with them.
            pipe_told = true;
            pass_on(ranks_, SIGPIPE);
            say!(
                "our standard output was closed (its reader exited): passed SIGPIPE on to {}",
                ranks(running)
            );
        }
        let now = Instant::now();
        if !ending.failed && job_end.is_some_and(|t| now >= t) {
            // Killed just below, at `kill_at`.
            say!(
                "timeout: the job ran longer than --timeout; killed the {} still running",
                ranks(running)
            );
            ending.failed = true;
            ending.exit_code = EXIT_TIMEOUT;
            ending.kill_at = Some(now);
        }
        if ending.kill_at.is_some_and(|t| now >= t) {
            for r in ranks_.iter_mut().filter(|r| r.status.is_none()) {
                let _ = r.child.kill();
            }
            if ending.kill_at.is_some_and(|t| now >= t + UNKILLABLE_AFTER) {
                // In uninterruptible sleep (a hung driver or file system): SIGKILL waits for
                // it. The job's end is decided; the launcher does not wait on.
                let left: Vec<usize> = (0..ranks_.len())
                    .filter(|&k| ranks_[k].status.is_none())
                    .collect();
                say!(
                    "ranks {left:?} still run {} s after SIGKILL (in uninterruptible sleep?); \
                     not waiting for them",
                    UNKILLABLE_AFTER.as_secs()
                );
                return;
            }
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// How long killed ranks may take to die before the launcher stops waiting for them.
const UNKILLABLE_AFTER: Duration = Duration::from_secs(10);

/// Raises our soft limit of open files (toward the hard one) when `nproc` ranks' pipes (two
/// each, with room to spare) would not fit in it: the usual 1024 would stop a launch of some
/// 500 ranks with "too many open files". The ranks inherit the raised limit.
fn raise_open_files(nproc: usize) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let need = 2 * nproc as u64 + 64;
    let lim = getrlimit(Resource::Nofile);
    let Some(soft) = lim.current else {
        return; // unlimited
    };
    if soft >= need {
        return;
    }
    let raised = lim.maximum.map_or(need, |hard| need.min(hard));
    if raised > soft {
        let _ = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(raised),
                maximum: lim.maximum,
            },
        );
    }
}

/// Stops and reaps our children once every rank is reaped: processes the ranks left behind,
/// handed to us as their child subreaper, that carry `marker` in their environment (this job's
/// ranks and what they started; nothing else, even as a container's first process). They are
/// asked first (`SIGTERM`: a wrapper's program was told nothing of the job's stop) and given
/// [`ORPHAN_GRACE`] to exit, then killed; killing one hands us its own children, hence the
/// rounds, which end at [`ORPHAN_DEADLINE`] or when a round finds the same processes left as
/// the one before (stuck in the kernel, say). Returns how many were stopped.
fn kill_orphans(marker: &[u8]) -> usize {
    let me = std::process::id();
    let started = Instant::now();
    let ours = || -> Vec<(Pid, bool)> {
        children_of(me)
            .into_iter()
            .filter(|&(pid, zombie)| zombie || carries(pid, marker))
            .collect()
    };
    let live = |all: &[(Pid, bool)]| -> Vec<Pid> {
        all.iter()
            .filter_map(|&(pid, zombie)| (!zombie).then_some(pid))
            .collect()
    };
    // Reaped one by one (never `wait` for any child: none of ours is left but these).
    let reap = |pids: &[(Pid, bool)], until: Instant| {
        for &(pid, _) in pids {
            loop {
                match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
                    Ok(None) if Instant::now() < until => thread::sleep(Duration::from_millis(5)),
                    _ => break,
                }
            }
        }
    };
    let asked = ours();
    let mut stopped = live(&asked);
    for &pid in &stopped {
        let _ = kill_process(pid, Signal::TERM);
    }
    reap(&asked, started + ORPHAN_GRACE);
    let mut before: Vec<Pid> = Vec::new();
    while Instant::now() < started + ORPHAN_DEADLINE {
        let orphans = ours();
        let mut left = live(&orphans);
        left.sort_unstable_by_key(|p| p.as_raw_nonzero());
        if orphans.is_empty() || (!left.is_empty() && left == before) {
            break;
        }
        for &pid in &left {
            let _ = kill_process(pid, Signal::KILL);
            if !stopped.contains(&pid) {
                stopped.push(pid);
            }
        }
        reap(
            &orphans,
            (Instant::now() + Duration::from_secs(1)).min(started + ORPHAN_DEADLINE),
        );
        before = left;
    }
    stopped.len()
}

/// Whether process `pid`'s environment holds `marker` (a `NAME=value` entry), as
/// `/proc/PID/environ` shows it (what it started with).
fn carries(pid: Pid, marker: &[u8]) -> bool {
    std::fs::read(format!("/proc/{}/environ", pid.as_raw_nonzero()))
        .is_ok_and(|env| env.split(|&b| b == 0).any(|entry| entry == marker))
}

/// Whether `/proc` numbers processes as this process does: not so in a PID namespace that has
/// no `/proc` of its own (`unshare --pid` without `--mount-proc`), where its ids would name
/// other processes.
fn proc_is_ours() -> bool {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str()?.parse::<u32>().ok())
        == Some(std::process::id())
}

/// The processes whose parent is `parent`, and whether each has exited (a zombie), from
/// `/proc/*/stat` (the state and parent fields follow the command name in parentheses).
fn children_of(parent: u32) -> Vec<(Pid, bool)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
            .and_then(Pid::from_raw)
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(mut fields) = fields_after_name(&stat) else {
            continue;
        };
        let (state, ppid) = (fields.next(), fields.next());
        if ppid.and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            out.push((pid, state == Some("Z")));
        }
    }
    out
}

/// Sends `sig` to every rank still running. A rank that exited since it was last reaped has
/// not been waited for, so its process ID still names it (a zombie): the signal cannot reach
/// an unrelated process.
fn pass_on(ranks_: &[Rank], sig: c_int) {
    let Some(signal) = Signal::from_named_raw(sig) else {
        return;
    };
    for r in ranks_.iter().filter(|r| r.status.is_none()) {
        let Some(pid) = Pid::from_raw(r.child.id() as i32) else {
            continue;
        };
        // A rank that is already gone (ESRCH) needs nothing.
        let _ = kill_process(pid, signal);
    }
}

/// `setpriv --pdeathsig TERM --` when this system's `setpriv` takes it (tried once on
/// `true`), else nothing: the prefix of every rank's command that has the kernel send the rank
/// `SIGTERM` when `chorus-run` ends, however it ends. (`setpriv` sets it and then executes the
/// command in the same process; a missing command still exits with 127.)
fn parent_death_prefix() -> Vec<OsString> {
    // By its path in the launcher's PATH: a rank's own PATH (`--env PATH=...`) may lack it.
    let Some(setpriv) = in_path("setpriv") else {
        return Vec::new();
    };
    let prefix: Vec<OsString> = [setpriv.into_os_string()]
        .into_iter()
        .chain(["--pdeathsig", "TERM", "--"].iter().map(OsString::from))
        .collect();
    let works = Command::new(&prefix[0])
        .args(&prefix[1..])
        .arg("true")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if works {
        prefix
    } else {
        Vec::new()
    }
}

/// Where `program` is in the launcher's own `PATH` (the first executable file of that name),
/// so that the helpers it starts ranks through (`setpriv`, `ip`) are found whatever `PATH`
/// the ranks are given.
fn in_path(program: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(program))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Starts a thread that passes on rank `rank`'s output (an error, not a panic, when the system
/// refuses one: a panic would leave the ranks running).
fn spawn_reader(rank: usize, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    thread::Builder::new()
        .name(format!("rank {rank} output"))
        .spawn(f)
        .map(drop)
}

/// Kills and reaps the ranks started so far (the job could not be started whole).
fn stop_started(started: &mut [Rank]) {
    for r in started {
        let _ = r.child.kill();
        let _ = r.child.wait();
    }
}

/// Number of ranks not yet reaped.
fn ranks_running(ranks_: &[Rank]) -> usize {
    ranks_.iter().filter(|r| r.status.is_none()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nesting_under_a_terminal_is_judged_by_launcher() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        // An interactive shell of a job step: one task whatever Slurm or MPI count.
        let srun = env(&[("SLURM_STEP_NUM_TASKS", "8")]);
        assert!(nested_launch(&srun, false).is_some());
        assert_eq!(nested_launch(&srun, true), None);
        // A rank of chorus-run, or a torchrun worker, inherits the terminal: still refused.
        let ours = env(&[("CHORUS_RUN_NPROC", "2")]);
        assert!(nested_launch(&ours, true).is_some_and(|m| m.contains("CHORUS_RUN_NPROC=2")));
        let torch = env(&[("TORCHELASTIC_RUN_ID", "x"), ("WORLD_SIZE", "4")]);
        assert!(nested_launch(&torch, true).is_some_and(|m| m.contains("WORLD_SIZE=4")));
        assert_eq!(nested_launch(&env(&[("WORLD_SIZE", "4")]), false), None);
        let allowed = env(&[("CHORUS_RUN_NPROC", "2"), ("CHORUS_RUN_NESTED", "1")]);
        assert_eq!(nested_launch(&allowed, false), None);
    }

    #[test]
    fn a_blank_token_is_refused() {
        let args = |t: &str| {
            ["-n", "2", "--token", t, "true"]
                .map(OsString::from)
                .to_vec()
        };
        for blank in ["", " ", "\t\n"] {
            let e = parse_args(args(blank)).err().unwrap();
            assert!(e.contains("--token"), "{e}");
        }
        assert!(parse_args(args(" s ")).is_ok());
        // Nor through --env, which would also unmark what the job started for the clean-up.
        for kv in ["CHORUS_TOKEN=", "CHORUS_TOKEN=x"] {
            let e = parse_args(
                ["-n", "2", "--env", kv, "true"]
                    .map(OsString::from)
                    .to_vec(),
            )
            .err()
            .unwrap();
            assert!(e.contains("--token"), "{e}");
        }
    }

    #[test]
    fn rank_counts_are_digits_only() {
        let n = |t: &str| parse_nproc(t);
        assert_eq!(n("4"), Ok(4));
        for bad in ["+4", "-4", " 4", "4 ", "", "0", "0x4"] {
            assert!(n(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn helpers_are_found_in_the_launchers_path() {
        // `sh` is on every PATH the tests run with; a name that is nowhere is not found.
        let sh = in_path("sh").expect("sh in PATH");
        assert!(sh.is_absolute() && sh.ends_with("sh"), "{sh:?}");
        assert!(in_path("chorus-no-such-program").is_none());
    }

    #[test]
    fn session_leader_is_read_after_the_command_name() {
        let stat = |comm: &str, session: u32| format!("42 ({comm}) S 1 42 {session} 0 -1 4194560");
        assert!(session_leader_from_stat(&stat("chorus-run", 42)));
        assert!(!session_leader_from_stat(&stat("chorus-run", 7)));
        // A session leader outside this PID namespace shows as 0.
        assert!(!session_leader_from_stat(&stat("chorus-run", 0)));
        assert!(session_leader_from_stat(&stat("a) S 1 1 1 (b", 42)));
        assert!(!session_leader_from_stat(&stat("a (b", 7)));
        assert!(!session_leader_from_stat("42 (cut"));
        assert!(!session_leader_from_stat(""));
        // This process, against procps' reading of its session (scripts/test.sh installs
        // procps): the test runner is no session leader; a child made one by setsid is.
        let me = std::process::id();
        let sid = std::process::Command::new("ps")
            .args(["-o", "sid=", "-p", &me.to_string()])
            .output()
            .expect("ps (procps)");
        let sid: u32 = String::from_utf8_lossy(&sid.stdout).trim().parse().unwrap();
        assert_eq!(is_session_leader(), sid == me, "ps reads session {sid}");
    }

    /// What the prefixer writes for `pieces` fed in turn, with a pause after those marked.
    fn pieces(pieces: &[(&[u8], bool)]) -> Vec<u8> {
        let out = std::cell::RefCell::new(Vec::new());
        let open = std::cell::RefCell::new(None);
        let write = |body: &[u8], continues, ends| {
            let bytes = compose(&mut open.borrow_mut(), 7, b"[7] ", body, continues, ends);
            out.borrow_mut().extend_from_slice(&bytes);
        };
        let mut p = Prefixer::new();
        for &(bytes, pause) in pieces {
            p.feed(bytes, &write);
            if pause {
                p.pause(&write);
            }
        }
        p.finish(&write);
        out.into_inner()
    }

    fn collect(input: &[u8]) -> Vec<u8> {
        pieces(&[(input, false)])
    }

    #[test]
    fn prefixes_lines_and_terminates_the_last() {
        assert_eq!(collect(b""), b"");
        assert_eq!(collect(b"a\n\nb"), b"[7] a\n[7] \n[7] b\n");
        assert_eq!(collect(b"\xff\xfe\n"), b"[7] \xff\xfe\n");
        // Pieces of one line in separate reads make one line.
        assert_eq!(
            pieces(&[(b"ab", false), (b"c\nd", false)]),
            b"[7] abc\n[7] d\n"
        );
    }

    #[test]
    fn carriage_returns_end_lines_and_pauses_pass_parts_on() {
        // A progress bar: each redraw gets the prefix after the carriage return.
        assert_eq!(collect(b"\r 10%\r 20%\n"), b"[7]  10%\r[7]  20%\n");
        // \r\n ends one line, also split across reads, and a blank one shows.
        assert_eq!(collect(b"\r\n\r\n"), b"[7] \r\n[7] \r\n");
        assert_eq!(collect(b"a\r\nb\r\n"), b"[7] a\r\n[7] b\r\n");
        assert_eq!(
            pieces(&[(b"a\r", false), (b"\nb\n", false)]),
            b"[7] a\r\n[7] b\n"
        );
        // A prompt goes out when the stream pauses; the answer's line continues it.
        assert_eq!(
            pieces(&[(b"name? ", true), (b"ok\nnext\n", false)]),
            b"[7] name? ok\n[7] next\n"
        );
        // A part that went out and nothing after it: the stream's end ends the line.
        assert_eq!(
            pieces(&[(b"dots..", true), (b"..", true)]),
            b"[7] dots....\n"
        );
        // A pause with nothing held passes nothing on.
        assert_eq!(
            pieces(&[(b"a\n", true), (b"b\n", false)]),
            b"[7] a\n[7] b\n"
        );
    }

    /// A line one rank left open (a prompt, a progress bar) is ended before another rank's
    /// line, and its rest starts a line of its own, with its prefix: no piece of output ever
    /// goes out under another rank's prefix.
    #[test]
    fn lines_left_open_are_ended_before_another_rank_writes() {
        let mut open = None;
        let mut out = Vec::new();
        let mut put = |id: usize, body: &[u8], continues, ends| {
            let prefix = if id == OURS {
                String::new()
            } else {
                format!("[{id}] ")
            };
            out.extend(compose(
                &mut open,
                id,
                prefix.as_bytes(),
                body,
                continues,
                ends,
            ));
        };
        put(0, b"name? ", false, false);
        put(1, b"hello\n", false, true);
        put(0, b"bob\n", true, true);
        put(0, b" 10%\r", false, false);
        put(0, b" 20%\r", false, false);
        put(1, b"x\n", false, true);
        // Two progress bars: each rank's redraws on lines of their own.
        put(0, b"\r", false, false);
        put(0, b"30%", false, false);
        put(1, b"\r", false, false);
        put(1, b"5%", false, false);
        put(0, b"\r", true, false);
        put(0, b"\n", true, true);
        put(OURS, b"chorus-run: y\n", false, true);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[0] name? \n[1] hello\n[0] bob\n[0]  10%\r[0]  20%\r\n[1] x\n\
             [0] 30%\n[1] 5%\nchorus-run: y\n"
        );
    }

    #[test]
    fn splits_overlong_lines() {
        let long = vec![b'x'; MAX_LINE + 10];
        let out = collect(&long);
        let lines: Vec<&[u8]> = out.split(|&b| b == b'\n').collect();
        assert_eq!(lines.len(), 3); // two pieces and the empty tail
        assert_eq!(lines[0].len(), 4 + MAX_LINE);
        assert_eq!(lines[1].len(), 4 + 10);
        // A line of exactly MAX_LINE bytes keeps its own newline: no empty line after it.
        let mut exact = vec![b'x'; MAX_LINE];
        exact.push(b'\n');
        let out = collect(&exact);
        assert_eq!(out.len(), 4 + MAX_LINE + 1);
        assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
    }

    #[test]
    fn parses_the_command_line() {
        let args = |s: &[&str]| s.iter().map(OsString::from).collect::<Vec<_>>();
        let Ok(Parsed::Run(o)) = parse_args(args(&[
            "-np",
            "3",
            "--env=A=b=c",
            "--timeout",
            "0.5",
            "--",
            "echo",
            "-n",
        ])) else {
            panic!("should parse");
        };
        assert_eq!(o.nproc, 3);
        assert_eq!(o.extra_env, vec![("A".into(), "b=c".into())]);
        assert_eq!(o.timeout, Some(Duration::from_millis(500)));
        assert_eq!(o.command, args(&["echo", "-n"]));
        assert!(matches!(parse_args(args(&["-n4", "true"])), Ok(Parsed::Run(o)) if o.nproc == 4));
        assert!(parse_args(args(&["true"])).is_err());
        assert!(parse_args(args(&["-n", "0", "true"])).is_err());
        assert!(parse_args(args(&["-n", "2"])).is_err());
        assert!(parse_args(args(&["--addr", "nohost", "-n", "2", "true"])).is_err());
        // As the ranks' own parser: bare IPv6, spaces and port 0 are refused here, once.
        for bad in ["::1:80", "a b:80", "host:0", "host:x"] {
            assert!(
                parse_args(args(&["--addr", bad, "-n", "2", "true"])).is_err(),
                "{bad}"
            );
        }
        for good in ["[::1]:80", "node-1.example:29400", "10.0.0.1:5000"] {
            assert!(
                parse_args(args(&["--addr", good, "-n", "2", "true"])).is_ok(),
                "{good}"
            );
        }
        assert!(parse_args(args(&["--bogus", "-n", "2", "true"])).is_err());
        // Switches take no value: `--no-prefix=false` must not turn prefixing off.
        for bad in ["--no-prefix=false", "--help=1", "--version=x"] {
            let e = parse_args(args(&[bad, "-n", "2", "true"])).err();
            assert!(
                e.as_deref().is_some_and(|e| e.contains("takes no value")),
                "{bad}: {e:?}"
            );
        }
    }

    #[test]
    fn master_addr_is_the_bare_host() {
        assert_eq!(host_of("10.0.0.1:29500"), "10.0.0.1");
        assert_eq!(host_of("[::1]:29500"), "::1");
    }
}
