//! `--ranks N`: run N local ranks of this same program and present them as one.
//!
//! Each child gets `CHORUS_RANK`, `CHORUS_WORLD_SIZE`, `CHORUS_LOCAL_RANK`,
//! `CHORUS_LOCAL_SIZE`, `CHORUS_ADDR=127.0.0.1:<free port>` and a fresh `CHORUS_TOKEN`, and the command line minus
//! `--ranks`. Rank 0's stdout is shown, the others' discarded; every rank's stderr is shown
//! with a `[r] ` prefix. When one rank fails, the others get a short grace period to report
//! their own view of the failure, then are killed; the exit status is the failing rank's.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::progress::{parse_relay, CLEAR_LINE, RELAY_ENV};

/// How long the other ranks may run on after one failed before they are killed.
const GRACE: Duration = Duration::from_secs(3);
/// How often the children are polled.
const POLL: Duration = Duration::from_millis(20);
/// Exit status when a rank died by a signal or could not be started.
const EXIT_RANK_FAILED: i32 = 3;

/// A free TCP port on 127.0.0.1 (free when asked; the rendezvous root binds it moments
/// later), below the kernel's ephemeral range where it leaves room, so that no outgoing
/// connection takes it meanwhile (see [`chorus_transport::rendezvous::free_local_ports`]).
pub fn free_port() -> io::Result<u16> {
    let ports = chorus_transport::rendezvous::free_local_ports(1)
        .map_err(|e| io::Error::other(e.to_string()))?;
    ports
        .first()
        .copied()
        .ok_or_else(|| io::Error::other("no free port"))
}

/// 16 random bytes from /dev/urandom as 32 hex digits.
pub fn random_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(hex(&bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The launcher's terminal: serialises the children's lines and keeps the relayed progress
/// line (if any) below them.
struct Console {
    /// Whether progress lines are drawn (the launcher's stderr is a terminal).
    draw_progress: bool,
    /// The progress text currently shown.
    progress: Option<String>,
}

impl Console {
    fn write(&mut self, to_stdout: bool, bytes: &[u8]) {
        let mut err = io::stderr().lock();
        if self.progress.is_some() {
            let _ = err.write_all(CLEAR_LINE.as_bytes());
            let _ = err.flush();
        }
        if to_stdout {
            let mut out = io::stdout().lock();
            let _ = out.write_all(bytes);
            let _ = out.flush();
        } else {
            let _ = err.write_all(bytes);
        }
        if let Some(p) = &self.progress {
            let _ = write!(err, "{p}");
        }
        let _ = err.flush();
    }

    fn set_progress(&mut self, text: &str) {
        if !self.draw_progress {
            return;
        }
        let mut err = io::stderr().lock();
        let _ = write!(err, "{CLEAR_LINE}{text}");
        let _ = err.flush();
        self.progress = (!text.is_empty()).then(|| text.to_string());
    }
}

/// Copy `pipe` line by line to the console: rank 0's stdout as is, stderr with a prefix.
fn pump(
    pipe: impl Read + Send + 'static,
    rank: usize,
    to_stdout: bool,
    console: Arc<Mutex<Console>>,
) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let mut console = console.lock().unwrap_or_else(|e| e.into_inner());
            if to_stdout {
                console.write(true, &line);
                continue;
            }
            let text = String::from_utf8_lossy(&line);
            if let Some(p) = parse_relay(text.trim_end_matches(['\n', '\r'])) {
                console.set_progress(p);
                continue;
            }
            let mut prefixed = format!("[{rank}] ").into_bytes();
            prefixed.extend_from_slice(&line);
            if !prefixed.ends_with(b"\n") {
                prefixed.push(b'\n');
            }
            console.write(false, &prefixed);
        }
    })
}

/// A short description of how a child ended.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => "ended".to_string(),
    }
}

/// Run `ranks` copies of this program with `args`; returns the exit status for the launcher.
/// `progress`: draw rank 0's progress on this terminal.
pub fn launch(ranks: usize, args: &[String], progress: bool) -> i32 {
    match launch_inner(ranks, args, progress) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("chorus-perf: cannot start {ranks} ranks: {e}");
            EXIT_RANK_FAILED
        }
    }
}

fn launch_inner(ranks: usize, args: &[String], progress: bool) -> io::Result<i32> {
    let exe = std::env::current_exe()?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let token = random_token()?;
    let console = Arc::new(Mutex::new(Console {
        draw_progress: progress,
        progress: None,
    }));

    // Another launcher's rank variables (chorus-run's, torchrun's, an MPI's, Slurm's around
    // this one) do not describe the ranks started here.
    let outer = chorus::config::other_launcher_variables();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(ranks);
    let mut pumps = Vec::new();
    for r in 0..ranks {
        let mut cmd = Command::new(&exe);
        for var in &outer {
            cmd.env_remove(var);
        }
        cmd.args(args)
            .env("CHORUS_RANK", r.to_string())
            .env("CHORUS_WORLD_SIZE", ranks.to_string())
            .env("CHORUS_LOCAL_RANK", r.to_string())
            // All on this host; set, since a launcher around this one (chorus-run) leaves
            // its own count in the environment.
            .env("CHORUS_LOCAL_SIZE", ranks.to_string())
            .env("CHORUS_ADDR", &addr)
            .env("CHORUS_TOKEN", &token)
            .env_remove(RELAY_ENV)
            .stdin(Stdio::null())
            .stdout(if r == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped());
        if r == 0 && progress {
            cmd.env(RELAY_ENV, "relay");
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(io::Error::new(e.kind(), format!("rank {r}: {e}")));
            }
        };
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, r, true, Arc::clone(&console)));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, r, false, Arc::clone(&console)));
        }
        children.push(Some(child));
    }

    // Wait for every rank; after the first failure, give the others GRACE, then kill them.
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut deadline: Option<Instant> = None;
    let mut killed = Vec::new();
    while children.iter().any(Option::is_some) {
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait()? {
                None => {}
                Some(status) => {
                    if !status.success() && failure.is_none() {
                        failure = Some((r, status));
                        deadline = Some(Instant::now() + GRACE);
                    }
                    *slot = None;
                }
            }
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            for (r, slot) in children.iter_mut().enumerate() {
                if let Some(child) = slot {
                    let _ = child.kill();
                    let _ = child.wait();
                    killed.push(r);
                    *slot = None;
                }
            }
        }
        thread::sleep(POLL);
    }
    for p in pumps {
        let _ = p.join();
    }
    console
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .set_progress("");

    let Some((rank, status)) = failure else {
        return Ok(0);
    };
    // Status 1 is "wrong results", already reported in rank 0's table.
    if status.code() != Some(1) || !killed.is_empty() {
        eprintln!("chorus-perf: rank {rank} {}", describe(status));
    }
    if !killed.is_empty() {
        eprintln!("chorus-perf: stopped ranks {killed:?} that were still running");
    }
    Ok(status.code().unwrap_or(EXIT_RANK_FAILED))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_fresh_hex() {
        let a = random_token().unwrap();
        let b = random_token().unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        assert_eq!(hex(&[0, 0xab, 7]), "00ab07");
    }

    #[test]
    fn free_port_is_bindable() {
        let p = free_port().unwrap();
        assert!(p > 0);
        drop(std::net::TcpListener::bind(("127.0.0.1", p)).unwrap());
    }
}
