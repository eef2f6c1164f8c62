//! Leveled logging to stderr, controlled by `CHORUS_DEBUG` (`WARN`, `INFO`, `TRACE`; default
//! `WARN`). Lines look like `chorus[rank 3] INFO: ...`.

use std::io::Write as _;
use std::sync::atomic::{AtomicU8, Ordering};

/// A log level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Problems and fallbacks.
    Warn = 1,
    /// Choices made (transport, algorithm, interface).
    Info = 2,
    /// Per-call detail.
    Trace = 3,
}

static LEVEL: AtomicU8 = AtomicU8::new(0);

impl Level {
    /// Parse `WARN|INFO|TRACE` (case-insensitive); `VERSION` counts as INFO as in NCCL.
    pub fn parse(s: &str) -> Option<Level> {
        match s.trim().to_ascii_uppercase().as_str() {
            "WARN" | "WARNING" => Some(Level::Warn),
            "INFO" | "VERSION" => Some(Level::Info),
            "TRACE" | "DEBUG" => Some(Level::Trace),
            _ => None,
        }
    }
}

/// The current level (read from `CHORUS_DEBUG` on first use).
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            let set = std::env::var("CHORUS_DEBUG").ok();
            let parsed = set.as_deref().and_then(Level::parse);
            if let (None, Some(v)) = (parsed, set.filter(|v| !v.trim().is_empty())) {
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "chorus WARN: CHORUS_DEBUG={v:?} is not WARN, INFO or TRACE; using WARN"
                );
            }
            let l = parsed.unwrap_or(Level::Warn);
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
        1 => Level::Warn,
        2 => Level::Info,
        _ => Level::Trace,
    }
}

/// Set the level for the whole process.
pub fn set_level(l: Level) {
    LEVEL.store(l as u8, Ordering::Relaxed);
}

/// Whether messages at `l` are printed.
pub fn enabled(l: Level) -> bool {
    l <= level()
}

/// Print one log line if `l` is enabled.
pub fn log(l: Level, rank: Option<usize>, msg: std::fmt::Arguments<'_>) {
    if enabled(l) {
        let lv = match l {
            Level::Warn => "WARN",
            Level::Info => "INFO",
            Level::Trace => "TRACE",
        };
        // Not `eprintln!`: a closed stderr (a daemon, `2>&-`) must not turn a log line into a
        // panic inside a collective.
        let mut err = std::io::stderr().lock();
        let _ = match rank {
            Some(r) => writeln!(err, "chorus[rank {r}] {lv}: {msg}"),
            None => writeln!(err, "chorus {lv}: {msg}"),
        };
    }
}
