//! Integration tests of the `chorus-run` launcher: real child processes (`sh -c` scripts).
//!
//! Every run is guarded by a watchdog: a job that does not end within [`WATCHDOG`] is killed
//! and the test fails, so a launcher that hangs (or fails to kill a `sleep 30` rank) cannot
//! hang the suite. Runtimes are never asserted tightly.

mod common;

use std::collections::BTreeSet;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Far below the 30 s that the sleeping ranks would take if nobody killed them.
const WATCHDOG: Duration = Duration::from_secs(15);

/// What one run of `chorus-run` produced.
struct Run {
    status: ExitStatus,
    stdout: Vec<u8>,
    stderr: String,
}

/// The `chorus-run` under test, without the variables of a launcher that may have started
/// the test suite itself (`srun -n2 cargo test`): it would refuse to run as one of its tasks.
fn launcher() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_chorus-run"));
    for var in common::OUTER_LAUNCHER_VARS {
        cmd.env_remove(var);
    }
    cmd
}

/// Whether this process may make a PID namespace (`unshare --pid`, root). Where it may not,
/// the test fails saying so, unless `CHORUS_SKIP_NETNS=1` (as the other tests that need root
/// namespaces), which makes this false and says SKIPPED past the harness's capture.
fn can_unshare_pid() -> bool {
    let can = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !can {
        assert!(
            std::env::var("CHORUS_SKIP_NETNS").is_ok_and(|v| v.trim() == "1"),
            "`unshare --pid` is not allowed here (needs root): set CHORUS_SKIP_NETNS=1 to skip \
             this test where that is impossible"
        );
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED: (CHORUS_SKIP_NETNS) `unshare --pid` is not allowed here\n",
        );
    }
    can
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(mut pipe: Box<dyn Read + Send>) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

/// Runs `chorus-run ARGS`, killing it (and failing the test) if it outlives [`WATCHDOG`].
fn chorus_run(args: &[&str]) -> Run {
    let mut child = launcher()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chorus-run");
    let stdout = drain(Box::new(child.stdout.take().unwrap()));
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let status = wait_watched(&mut child, &format!("{args:?}"));
    Run {
        status,
        stdout: stdout.join().unwrap(),
        stderr: String::from_utf8_lossy(&stderr.join().unwrap()).into_owned(),
    }
}

/// Waits for `child` (chorus-run `what`), killing it and failing the test after [`WATCHDOG`].
fn wait_watched(child: &mut Child, what: &str) -> ExitStatus {
    let deadline = Instant::now() + WATCHDOG;
    loop {
        if let Some(status) = child.try_wait().expect("wait for chorus-run") {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("watchdog: chorus-run {what} still running after {WATCHDOG:?}");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// The processes `pids()` still lists after up to 2 s (killed ranks take a moment to leave
/// /proc); those are then killed, so that a failing test leaves nothing behind.
fn still_running(pids: impl Fn() -> Vec<u32>) -> Vec<u32> {
    let mut left = pids();
    for _ in 0..100 {
        if left.is_empty() {
            break;
        }
        thread::sleep(Duration::from_millis(20));
        left = pids();
    }
    for pid in &left {
        let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
    }
    left
}

/// Splits `[r] text` lines into (r, text).
fn prefixed_lines(bytes: &[u8]) -> Vec<(usize, Vec<u8>)> {
    let text = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    if text.is_empty() {
        return Vec::new();
    }
    text.split(|&b| b == b'\n')
        .map(|line| {
            let close = line.iter().position(|&b| b == b']').expect("a prefix");
            assert_eq!(line[0], b'[', "line without prefix: {line:?}");
            let rank = std::str::from_utf8(&line[1..close])
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(line[close + 1], b' ');
            (rank, line[close + 2..].to_vec())
        })
        .collect()
}

#[test]
fn every_rank_gets_its_environment() {
    let script = "echo \"$CHORUS_RANK $CHORUS_WORLD_SIZE $CHORUS_LOCAL_RANK $CHORUS_LOCAL_SIZE \
                  $CHORUS_ADDR $CHORUS_TOKEN $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE \
                  $MASTER_ADDR $MASTER_PORT\"";
    let run = chorus_run(&["-n", "4", "--", "sh", "-c", script]);
    assert!(run.status.success(), "{}", run.stderr);
    let lines = prefixed_lines(&run.stdout);
    assert_eq!(lines.len(), 4);
    let mut ranks = BTreeSet::new();
    let mut shared = BTreeSet::new();
    for (prefix_rank, text) in lines {
        let text = String::from_utf8(text).unwrap();
        let f: Vec<&str> = text.split(' ').collect();
        assert_eq!(f.len(), 12, "{text}");
        let rank: usize = f[0].parse().unwrap();
        assert_eq!(prefix_rank, rank, "prefix names the rank that wrote");
        assert_eq!(
            &f[1..4],
            ["4", f[0], "4"],
            "world size, local rank, local size"
        );
        assert_eq!(&f[6..10], [f[0], "4", f[0], "4"], "torchrun variables");
        let (host, port) = f[4].rsplit_once(':').unwrap();
        assert_eq!(host, "127.0.0.1");
        assert_eq!(f[10], "127.0.0.1");
        assert_ne!(port, f[11], "MASTER_PORT is a second port");
        let token = f[5];
        assert!(token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()));
        ranks.insert(rank);
        shared.insert((f[4].to_string(), token.to_string(), f[11].to_string()));
    }
    assert_eq!(ranks, (0..4).collect());
    assert_eq!(
        shared.len(),
        1,
        "all ranks share address, token and MASTER_PORT"
    );
}

#[test]
fn overrides_and_extra_variables() {
    let run = chorus_run(&[
        "--addr",
        "10.1.2.3:4567",
        "--token=secret",
        "--env",
        "EXTRA=a=b",
        "--env",
        "CHORUS_TIMEOUT=9",
        "-np",
        "2",
        "sh",
        "-c",
        "echo $CHORUS_ADDR $CHORUS_TOKEN $EXTRA $CHORUS_TIMEOUT $MASTER_ADDR",
    ]);
    assert!(run.status.success(), "{}", run.stderr);
    let ranks: BTreeSet<usize> = prefixed_lines(&run.stdout)
        .into_iter()
        .map(|(rank, text)| {
            assert_eq!(text, b"10.1.2.3:4567 secret a=b 9 10.1.2.3");
            rank
        })
        .collect();
    assert_eq!(ranks, BTreeSet::from([0, 1]));
}

/// A rank's own `PATH` (`--env PATH=...`) without the helpers the launcher starts ranks
/// through (`setpriv`) still starts them: the launcher finds those in its own `PATH`.
#[test]
fn a_ranks_own_path_does_not_hide_the_launchers_helpers() {
    let run = chorus_run(&[
        "--env",
        "PATH=/nonexistent",
        "-n",
        "2",
        "/bin/sh",
        "-c",
        "echo $PATH",
    ]);
    assert!(run.status.success(), "{:?} {}", run.status, run.stderr);
    let lines = prefixed_lines(&run.stdout);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines.iter().all(|(_, t)| t == b"/nonexistent"), "{lines:?}");
}

#[test]
fn output_is_prefixed_per_stream_and_line() {
    // Two lines to stdout (the last one unterminated and not UTF-8), one to stderr.
    let script = "printf 'out %s\\n' $CHORUS_RANK; echo \"err $CHORUS_RANK\" >&2; \
                  printf 'tail\\377'";
    let run = chorus_run(&["--nproc", "3", "--", "sh", "-c", script]);
    assert!(run.status.success(), "{}", run.stderr);
    let out = prefixed_lines(&run.stdout);
    assert_eq!(out.len(), 6);
    for rank in 0..3 {
        let mine: Vec<Vec<u8>> = out
            .iter()
            .filter(|(r, _)| *r == rank)
            .map(|(_, t)| t.clone())
            .collect();
        assert_eq!(
            mine,
            [format!("out {rank}").into_bytes(), b"tail\xff".to_vec()]
        );
        assert!(run.stderr.contains(&format!("[{rank}] err {rank}\n")));
    }
    assert!(!String::from_utf8_lossy(&run.stdout).contains("err"));
}

#[test]
fn no_prefix_passes_output_through() {
    let run = chorus_run(&["--no-prefix", "-n", "1", "--", "echo", "plain"]);
    assert!(run.status.success());
    assert_eq!(run.stdout, b"plain\n");
}

#[test]
fn a_failing_rank_stops_the_job_with_its_code() {
    // Rank 1 fails; the others would sleep for 30 s and must be killed.
    let script = "if [ \"$CHORUS_RANK\" = 1 ]; then echo bye; exit 3; fi; exec sleep 30";
    let run = chorus_run(&["-n", "3", "--", "sh", "-c", script]);
    assert_eq!(run.status.code(), Some(3), "{}", run.stderr);
    assert!(
        run.stderr
            .contains("chorus-run: rank 1 exited with status 3 (killing the other 2 ranks)"),
        "{}",
        run.stderr
    );
    assert_eq!(prefixed_lines(&run.stdout), [(1, b"bye".to_vec())]);
}

#[test]
fn runs_in_a_pid_namespace_whose_session_leader_is_outside() {
    // As in a container (CI's): the session leader lives in the parent PID namespace, so the
    // kernel reports this process's session as 0. The launcher once panicked on that.
    if !can_unshare_pid() {
        return;
    }
    // `--kill-child`: killing unshare (the watchdog) kills the launcher in the namespace, and
    // with it (the namespace's init) every rank.
    let mut child = Command::new("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(env!("CARGO_BIN_EXE_chorus-run"))
        .args(["-n", "2", "--", "sh", "-c", "echo ok"])
        .env_remove("SLURM_STEP_NUM_TASKS")
        .env_remove("OMPI_COMM_WORLD_SIZE")
        .env_remove("PMI_SIZE")
        .env_remove("CHORUS_RUN_NPROC")
        .env_remove("TORCHELASTIC_RUN_ID")
        .env_remove("CHORUS_RUN_NESTED")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start unshare");
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let status = wait_watched(&mut child, "in a PID namespace");
    let err = String::from_utf8_lossy(&err.join().unwrap()).into_owned();
    assert!(status.success(), "{status:?}: {err}");
    let lines = prefixed_lines(&out.join().unwrap());
    assert_eq!(lines.len(), 2, "{lines:?}");
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_signal() {
    let script = "if [ \"$CHORUS_RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 30";
    let run = chorus_run(&["-n", "2", "--", "sh", "-c", script]);
    assert_eq!(run.status.code(), Some(128 + 9), "{}", run.stderr);
    assert!(
        run.stderr.contains("rank 0 was killed by signal 9"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_background_process_holding_the_output_does_not_hang_the_launcher() {
    // `sleep` is a child of the shell, so killing the rank leaves it holding the output
    // pipe; the launcher must still return.
    // It sleeps far longer than the watchdog, so a launcher that waited for the pipe to close
    // fails the test; the odd duration marks it for the sweep below.
    let script = "if [ \"$CHORUS_RANK\" = 1 ]; then exit 5; fi; sleep 61.7183; true";
    let run = chorus_run(&["-n", "2", "--", "sh", "-c", script]);
    still_running(|| processes_with("61.7183"));
    assert_eq!(run.status.code(), Some(5), "{}", run.stderr);
}

/// The pids of running processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(marker) {
            pids.push(pid);
        }
    }
    pids
}

#[test]
fn a_closed_stderr_does_not_leave_ranks_running() {
    // `chorus-run ... 2>&1 | true`: its stderr is a pipe nobody reads. Reporting the failed
    // rank there must not kill the launcher before it stops the others.
    let marker = "29.4171";
    let script =
        format!("if [ \"$CHORUS_RANK\" = 1 ]; then sleep 0.3; exit 3; fi; exec sleep {marker}");
    let mut child = launcher()
        .args(["-n", "3", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chorus-run");
    drop(child.stderr.take());
    let status = wait_watched(&mut child, "with a closed stderr");
    let left = still_running(|| processes_with(marker));
    assert!(
        left.is_empty(),
        "ranks left running: {left:?} (launcher {status})"
    );
    assert_eq!(status.code(), Some(3), "{status}");
}

#[test]
fn a_closed_stdout_ends_ranks_that_keep_writing() {
    // `chorus-run -n 2 -- yes | head -1`: once the reader has gone, the ranks get SIGPIPE,
    // as with --no-prefix (where their own writes bring it), and the job ends with 141.
    let mut child = launcher()
        .args(["-n", "2", "--", "sh", "-c", "exec yes"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chorus-run");
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 64];
    out.read_exact(&mut first).expect("some output");
    drop(out);
    let stderr = drain(Box::new(child.stderr.take().unwrap()));
    let status = wait_watched(&mut child, "with a closed stdout");
    let stderr = String::from_utf8_lossy(&stderr.join().unwrap()).into_owned();
    assert_eq!(status.code(), Some(128 + 13), "{status}: {stderr}");
    assert!(stderr.contains("passed SIGPIPE on"), "{stderr}");
}

/// A `SIGTERM` (passed on to the ranks) or `SIGKILL` (which the launcher cannot catch) sent
/// to the launcher alone must not leave its ranks running: after a `SIGKILL` they get the
/// parent-death signal (`setpriv --pdeathsig`, where the system has it).
#[test]
fn ranks_do_not_outlive_a_killed_launcher() {
    let has_setpriv = Command::new("setpriv")
        .args(["--pdeathsig", "TERM", "--", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_setpriv {
        // Debian's util-linux (essential) has it; elsewhere the launcher cannot promise this.
        assert!(
            std::env::var("CHORUS_SKIP_SETPRIV").is_ok_and(|v| v.trim() == "1"),
            "no setpriv with --pdeathsig here: install util-linux, or set CHORUS_SKIP_SETPRIV=1 \
             to skip this test"
        );
        // Past the test harness's capture of eprint!, so that the skip shows.
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"SKIPPED: (CHORUS_SKIP_SETPRIV) no setpriv with --pdeathsig here\n",
        );
        return;
    }
    for (signal, marker) in [("TERM", "28.6123"), ("KILL", "28.6124")] {
        let mut child = launcher()
            .args(["-n", "3", "--", "sleep", marker])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chorus-run");
        // The ranks, not the launcher (whose command line names them too).
        let launcher = child.id();
        let ranks = || {
            let mut pids = processes_with(marker);
            pids.retain(|&p| p != launcher);
            pids
        };
        // Up only once each runs `sleep`: `setpriv` sets the death signal just before it
        // execs, and until then (or while a fresh child still shows the launcher's command
        // line) a rank killed with the launcher would be orphaned by the test's timing.
        let execed = || {
            let mut pids = ranks();
            pids.retain(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim_end() == "sleep")
            });
            pids
        };
        let started = Instant::now();
        while execed().len() < 3 && started.elapsed() < WATCHDOG {
            thread::sleep(Duration::from_millis(20));
        }
        let up = execed();
        if up.len() != 3 {
            let up = ranks();
            let _ = child.kill();
            let _ = child.wait();
            for pid in &up {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
            panic!("the ranks did not start: {up:?}");
        }
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status();
        let status = child.wait().expect("wait for chorus-run");
        let left = still_running(ranks);
        assert!(
            left.is_empty(),
            "SIG{signal} to the launcher ({status}) left ranks running: {left:?}"
        );
    }
}

/// A stopped job leaves nothing of its own running: the program a rank's wrapper script
/// started without `exec` is stopped too, once its rank was (it is handed to the launcher, the
/// ranks' child subreaper, when its rank dies). Only processes of the job: one a rank started
/// with another environment (`env -i`: not the job's, as far as the launcher can tell) is
/// left alone.
#[test]
fn a_stopped_job_stops_what_its_ranks_started_and_only_that() {
    let (ours, other) = ("29.4419", "29.5531");
    let script = format!(
        "if [ \"$CHORUS_RANK\" = 1 ]; then sleep 0.5; exit 3; fi; env -i sleep {other} & \
         sleep {ours}; echo after"
    );
    let out = launcher()
        .args(["-n", "2", "--", "sh", "-c", &script])
        .stdin(Stdio::null())
        .output()
        .expect("run chorus-run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let spared = processes_with(other);
    for pid in &spared {
        let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
    }
    let left = still_running(|| processes_with(ours));
    // The job's failure: rank 1's exit status.
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(left.is_empty(), "left running: {left:?}\n{stderr}");
    assert_eq!(spared.len(), 1, "{spared:?}\n{stderr}");
    assert!(
        stderr.contains("stopped 1 process the ranks left running"),
        "{stderr}"
    );
}

/// Two hundred ranks under a soft limit of 256 open files (two pipes each would pass it): the
/// launcher raises its limit toward the hard one, and the job runs.
#[test]
fn many_ranks_fit_a_low_open_file_limit() {
    let outer = format!(
        "ulimit -Sn 256 && exec '{}' -n 200 -- sleep 1",
        env!("CARGO_BIN_EXE_chorus-run")
    );
    let hard = Command::new("sh")
        .args(["-c", "ulimit -Hn"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    if hard.parse::<u64>().is_ok_and(|h| h < 512) {
        panic!("the hard limit of open files here ({hard}) is below what this test needs");
    }
    let mut sh = Command::new("sh");
    for var in common::OUTER_LAUNCHER_VARS {
        sh.env_remove(var);
    }
    let run = sh
        .args(["-c", &outer])
        .stdin(Stdio::null())
        .output()
        .expect("run chorus-run");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{}: {stderr}", run.status);
}

/// A launcher started with its stdout as a channel of lines, for tests that act while the
/// job runs.
struct Live {
    child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: thread::JoinHandle<String>,
    /// Every stdout line received so far.
    seen: Vec<String>,
}

impl Live {
    fn start(args: &[&str]) -> Live {
        Live::spawn(launcher().args(args))
    }

    /// Another program that starts the launcher (a wrapper), with the same clean variables.
    fn start_program(program: &str, args: &[&str]) -> Live {
        let cleaned = launcher();
        let mut wrapper = Command::new(program);
        for (k, v) in cleaned.get_envs() {
            match v {
                Some(v) => wrapper.env(k, v),
                None => wrapper.env_remove(k),
            };
        }
        Live::spawn(wrapper.args(args))
    }

    fn spawn(cmd: &mut Command) -> Live {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start chorus-run");
        let (tx, lines) = std::sync::mpsc::channel();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        thread::spawn(move || {
            for line in std::io::BufRead::lines(out).map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            let _ = err.read_to_string(&mut text);
            text
        });
        Live {
            child,
            lines,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Waits until `n` stdout lines end with `text` (killing the job and failing the test
    /// after [`WATCHDOG`]).
    fn wait_for(&mut self, n: usize, text: &str) {
        let deadline = Instant::now() + WATCHDOG;
        while self.seen.iter().filter(|l| l.ends_with(text)).count() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!("waited for {n} lines {text:?}; saw {:?}", self.seen);
                }
            }
        }
    }

    fn signal(&self, name: &str) {
        let sent = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{name}");
    }

    /// Waits for the launcher; returns its status, every stdout line and its stderr.
    fn finish(mut self) -> (ExitStatus, Vec<String>, String) {
        let status = wait_watched(&mut self.child, "(live)");
        self.seen.extend(self.lines.iter());
        (status, self.seen, self.stderr.join().unwrap())
    }
}

/// `SIGUSR1` sent to the launcher reaches every rank and the job goes on; `SIGTERM` reaches
/// every rank, whose last words still come through, and the launcher ends by `SIGTERM`.
#[test]
fn signals_sent_to_the_launcher_reach_the_ranks() {
    use std::os::unix::process::ExitStatusExt;
    // dash runs a trap once the `sleep` of the moment ends: at most 0.1 s later.
    let script = "trap 'echo usr1' USR1; trap 'echo term; exit 7' TERM; echo up; i=0; \
                  while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; echo slept";
    let mut job = Live::start(&["-n", "3", "--", "sh", "-c", script]);
    job.wait_for(3, "] up");
    job.signal("USR1");
    job.wait_for(3, "] usr1");
    job.signal("TERM");
    let (status, lines, stderr) = job.finish();
    assert_eq!(status.signal(), Some(15), "{status}: {stderr}");
    for rank in 0..3 {
        for word in ["up", "usr1", "term"] {
            let line = format!("[{rank}] {word}");
            assert_eq!(
                lines.iter().filter(|l| **l == line).count(),
                1,
                "{line:?} in {lines:?}"
            );
        }
        assert!(
            stderr.contains(&format!("rank {rank} exited with status 7")),
            "{stderr}"
        );
    }
    assert!(!lines.iter().any(|l| l.ends_with("slept")), "{lines:?}");
    for said in [
        "got signal 10 (SIGUSR1) and passed it on to 3 ranks",
        "got signal 15 (SIGTERM) and passed it on to 3 ranks; stopping the job",
    ] {
        assert!(stderr.contains(said), "{said:?} in {stderr}");
    }
}

/// Ranks that ignore `SIGTERM` get the stop's grace (10 s); a second `SIGTERM` kills them at
/// once, and the launcher still ends by the first.
#[test]
fn a_second_stop_signal_kills_the_ranks_at_once() {
    use std::os::unix::process::ExitStatusExt;
    let marker = "28.7311";
    let script = format!("trap '' TERM; echo up; exec sleep {marker}");
    let mut job = Live::start(&["-n", "2", "--", "sh", "-c", &script]);
    job.wait_for(2, "] up");
    job.signal("TERM");
    // The launcher says it got the first before the second is sent: the second must not be
    // taken for the first.
    thread::sleep(Duration::from_millis(300));
    job.signal("TERM");
    let second = Instant::now();
    let (status, _, stderr) = job.finish();
    let took = second.elapsed();
    let left = still_running(|| processes_with(marker));
    assert!(left.is_empty(), "ranks left running: {left:?}");
    assert_eq!(status.signal(), Some(15), "{status}: {stderr}");
    assert!(
        stderr.contains("got signal 15 (SIGTERM) again: killed the 2 ranks still running"),
        "{stderr}"
    );
    // Not a timing claim: the 10 s grace would have passed, and this says it did not.
    assert!(took < Duration::from_secs(8), "{took:?}: {stderr}");
}

/// Signals sent from outside the launcher's PID namespace show no sender (pid 0): two of them
/// are two requests, not one signal that reached it twice (as from one known sender).
#[test]
fn signals_of_no_known_sender_are_never_merged() {
    if !can_unshare_pid() {
        return;
    }
    let marker = "28.7313";
    let script = format!("trap '' TERM; echo up; exec sleep {marker}");
    let exe = env!("CARGO_BIN_EXE_chorus-run");
    let args = [
        "--pid",
        "--fork",
        "--kill-child",
        exe,
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        &script,
    ];
    let mut job = Live::start_program("unshare", &args);
    job.wait_for(2, "] up");
    // The launcher: unshare's child (the first process of the namespace).
    let unshare = job.child.id();
    let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"));
    let Some(launcher) = children
        .ok()
        .and_then(|c| c.split_whitespace().next()?.parse::<u32>().ok())
    else {
        let _ = job.child.kill();
        eprintln!("SKIPPED: no /proc/PID/task/TID/children here (CONFIG_PROC_CHILDREN)");
        return;
    };
    let term = || {
        let sent = Command::new("kill")
            .args(["-TERM", &launcher.to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success());
    };
    term();
    thread::sleep(Duration::from_millis(300));
    term();
    let second = Instant::now();
    let (_, _, stderr) = job.finish();
    let took = second.elapsed();
    let left = still_running(|| processes_with(marker));
    assert!(left.is_empty(), "ranks left running: {left:?}");
    assert!(
        stderr.contains("again: killed the 2 ranks still running"),
        "{stderr}"
    );
    // Not a timing claim: merged, the second would have waited out the 10 s grace.
    assert!(took < Duration::from_secs(8), "{took:?}: {stderr}");
}

/// A prompt without a newline reaches the user while the rank waits for the answer (it would
/// otherwise be held until the line ends, and this test would wait for it forever).
#[test]
fn a_partial_line_goes_out_when_the_rank_pauses() {
    use std::io::Write;
    let mut child = launcher()
        .args([
            "-n",
            "1",
            "--",
            "sh",
            "-c",
            "printf 'name? '; read x; echo \"hi $x\"",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start chorus-run");
    let mut stdin = child.stdin.take().unwrap();
    let mut out = child.stdout.take().unwrap();
    let (tx, got) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + WATCHDOG;
    while !seen.ends_with(b"[0] name? ") {
        match got.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(bytes) => seen.extend(bytes),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no prompt; saw {:?}", String::from_utf8_lossy(&seen));
            }
        }
    }
    stdin.write_all(b"bob\n").unwrap();
    drop(stdin);
    let status = wait_watched(&mut child, "prompt");
    seen.extend(got.iter().flatten());
    assert!(status.success(), "{status}");
    assert_eq!(String::from_utf8_lossy(&seen), "[0] name? hi bob\n");
}

/// A rank that exits with its output still on the way (our stdout is read slowly, as by a
/// pager) loses none of it: the launcher waits for output it is passing on.
#[test]
fn output_read_slowly_after_the_ranks_exit_is_not_lost() {
    let mut child = launcher()
        .args([
            "-n",
            "1",
            "--",
            "sh",
            "-c",
            // Small enough to fit in the two pipes and the launcher's buffer: the rank exits
            // while most of it is still on the way.
            "head -c 100000 /dev/zero | tr '\\0' x | fold -w 99",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chorus-run");
    // Longer than the launcher's 1 s for a pipe that stays open with nothing in it.
    thread::sleep(Duration::from_millis(2500));
    let mut out = Vec::new();
    child.stdout.take().unwrap().read_to_end(&mut out).unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = wait_watched(&mut child, "slow reader");
    assert!(status.success(), "{status}: {err}");
    let lines = prefixed_lines(&out);
    let xs: usize = lines.iter().map(|(_, l)| l.len()).sum();
    assert_eq!(xs, 100_000, "{err}");
    assert!(!err.contains("still open"), "{err}");
}

/// A signal chorus-run was started ignoring (`nohup`, `trap '' HUP`) stays ignored, by it and
/// by the ranks (which inherit that): the job goes on to its end.
#[test]
fn signals_ignored_at_start_stay_ignored() {
    let outer = format!(
        "trap '' HUP; exec '{}' -n 2 -- sh -c 'echo up; sleep 1; echo done'",
        env!("CARGO_BIN_EXE_chorus-run")
    );
    let mut job = Live::start_program("sh", &["-c", &outer]);
    job.wait_for(2, "] up");
    job.signal("HUP");
    let (status, lines, stderr) = job.finish();
    assert!(status.success(), "{status}: {stderr}");
    assert_eq!(
        lines.iter().filter(|l| l.ends_with("] done")).count(),
        2,
        "{lines:?}"
    );
    assert!(!stderr.contains("SIGHUP"), "{stderr}");
}

/// `timeout` sends its signal to chorus-run and then to chorus-run's whole process group:
/// the two count as one stop, with its grace, not as a second signal that kills at once.
#[test]
fn a_signal_to_the_launcher_and_its_group_counts_once() {
    let script = "trap 'echo term; exit 7' TERM; echo up; i=0; \
                  while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done";
    let launcher = env!("CARGO_BIN_EXE_chorus-run");
    let mut job = Live::start_program(
        "timeout",
        &["2", launcher, "-n", "2", "--", "sh", "-c", script],
    );
    job.wait_for(2, "] up");
    let (status, lines, stderr) = job.finish();
    assert!(!stderr.contains("again"), "{stderr}");
    assert!(stderr.contains("got signal 15 (SIGTERM)"), "{stderr}");
    // Every rank ran its trap. (Once or twice: the signal reaches the ranks directly and passed
    // on, as the module's docs say, and a rank whose trap has begun runs it again for the
    // second; the shell then merely exits twice.)
    let termed: BTreeSet<&str> = lines
        .iter()
        .filter_map(|l| l.strip_suffix(" term"))
        .collect();
    assert_eq!(
        termed,
        BTreeSet::from(["[0]", "[1]"]),
        "{lines:?}: {stderr}"
    );
    // timeout(1) reports its command's death by a signal as 128 + the signal.
    assert_eq!(status.code(), Some(124), "{status}: {stderr}");
}

/// The same signal twice from one sender within a second is one request (what a signal to
/// the launcher and then to its process group looks like), not the second one that kills at
/// once; from another sender it is.
#[test]
fn the_same_signal_from_the_same_sender_right_after_counts_once() {
    use std::os::unix::process::ExitStatusExt;
    // The ranks outlive a SIGTERM: only a second request (or the 10 s grace) ends them.
    let script = "trap 'echo term' TERM; echo up; i=0; \
                  while [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done";
    let mut job = Live::start(&["-n", "2", "--", "sh", "-c", script]);
    job.wait_for(2, "] up");
    let pid = job.child.id();
    let twice = format!("kill -TERM {pid}; sleep 0.2; kill -TERM {pid}");
    assert!(Command::new("sh")
        .args(["-c", &twice])
        .status()
        .unwrap()
        .success());
    thread::sleep(Duration::from_millis(500));
    // Had the repeat counted, the ranks would have been killed at once.
    assert!(
        job.child.try_wait().unwrap().is_none(),
        "the job ended on the repeated signal"
    );
    job.signal("TERM"); // another sender: a second request
    let (status, _, stderr) = job.finish();
    assert_eq!(stderr.matches("again: killed").count(), 1, "{stderr}");
    assert_eq!(
        stderr.matches("got signal 15 (SIGTERM)").count(),
        2,
        "{stderr}"
    );
    assert_eq!(status.signal(), Some(15), "{status}: {stderr}");
}

#[test]
fn timeout_kills_the_job_with_124() {
    let run = chorus_run(&["--timeout", "1", "-n", "2", "--", "sleep", "30"]);
    assert_eq!(run.status.code(), Some(124), "{}", run.stderr);
    assert!(run.stderr.contains("timeout"), "{}", run.stderr);
}

/// Started as one of several tasks of another launcher (here, as srun would), chorus-run
/// refuses rather than start independent jobs, unless told they are meant.
#[test]
fn refuses_to_run_as_one_of_several_tasks_of_another_launcher() {
    let run = |vars: &[(&str, &str)], nested: Option<&str>| {
        let mut cmd = launcher();
        cmd.args(["-n", "2", "--", "true"])
            .envs(vars.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(v) = nested {
            cmd.env("CHORUS_RUN_NESTED", v);
        }
        let mut child = cmd.spawn().expect("start chorus-run");
        let mut err = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        (wait_watched(&mut child, "nested"), err)
    };
    let srun = [("SLURM_STEP_NUM_TASKS", "2")];
    let (status, err) = run(&srun, None);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("SLURM_STEP_NUM_TASKS=2"), "{err}");
    let (status, err) = run(&srun, Some("1"));
    assert!(status.success(), "{err}");
    // torchrun's workers (its run id with WORLD_SIZE; a WORLD_SIZE alone says nothing).
    let torchrun = [("TORCHELASTIC_RUN_ID", "none"), ("WORLD_SIZE", "2")];
    let (status, err) = run(&torchrun, None);
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(err.contains("WORLD_SIZE=2"), "{err}");
    let (status, err) = run(&torchrun[1..], None);
    assert!(status.success(), "{err}");
    // chorus-run's own ranks.
    let inner = env!("CARGO_BIN_EXE_chorus-run");
    let nested = chorus_run(&["-n", "2", "--", inner, "-n", "2", "--", "true"]);
    assert_eq!(nested.status.code(), Some(2), "{}", nested.stderr);
    assert!(
        nested.stderr.contains("CHORUS_RUN_NPROC=2"),
        "{}",
        nested.stderr
    );
}

#[test]
fn command_line_errors_and_help() {
    let run = chorus_run(&["--", "true"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(run.stderr.contains("-n N"), "{}", run.stderr);
    assert_eq!(chorus_run(&["-n", "0", "true"]).status.code(), Some(2));
    assert_eq!(chorus_run(&["-n", "2"]).status.code(), Some(2));
    assert_eq!(
        chorus_run(&["--frobnicate", "-n", "2", "true"])
            .status
            .code(),
        Some(2)
    );
    let help = chorus_run(&["--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).starts_with("Usage: chorus-run"));
    let version = chorus_run(&["--version"]);
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("chorus-run "));
    let missing = chorus_run(&["-n", "2", "--", "/nonexistent/chorus-test-program"]);
    assert_eq!(missing.status.code(), Some(127), "{}", missing.stderr);
}
