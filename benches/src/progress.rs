//! The one-line progress indicator rank 0 shows on a terminal.
//!
//! Shown only when stderr is a terminal and the output is not JSON. Under `--ranks` the
//! ranks' stderr is a pipe to the launcher, so the launcher tells rank 0 (through
//! [`RELAY_ENV`]) to send progress as marked lines instead; the launcher draws them on its
//! own terminal (see `launch.rs`).

use std::io::{IsTerminal, Write};

/// Set to `relay` by the launcher in rank 0's environment when the launcher draws progress.
pub const RELAY_ENV: &str = "CHORUS_PERF_PROGRESS";
/// Start of a relayed progress line; the rest of the line is the text (empty: clear).
pub const RELAY_MARK: &str = "\u{1}chorus-perf-progress ";

/// Erase the current terminal line.
pub const CLEAR_LINE: &str = "\r\x1b[K";

/// Where progress goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Nowhere.
    Off,
    /// Drawn in place on this process's stderr.
    Terminal,
    /// Sent to the launcher as marked lines on stderr.
    Relay,
}

impl Progress {
    /// The mode for this rank: only rank 0, never with JSON output, never on non-terminals.
    pub fn for_rank(rank: usize, json: bool) -> Progress {
        if rank != 0 || json {
            Progress::Off
        } else if std::env::var(RELAY_ENV).is_ok_and(|v| v == "relay") {
            Progress::Relay
        } else if std::io::stderr().is_terminal() {
            Progress::Terminal
        } else {
            Progress::Off
        }
    }

    /// Show `text` (replacing what was shown).
    pub fn show(self, text: &str) {
        let mut err = std::io::stderr().lock();
        let _ = match self {
            Progress::Off => return,
            Progress::Terminal => write!(err, "{CLEAR_LINE}{text}"),
            Progress::Relay => writeln!(err, "{RELAY_MARK}{text}"),
        };
        let _ = err.flush();
    }

    /// Remove the indicator.
    pub fn clear(self) {
        let mut err = std::io::stderr().lock();
        let _ = match self {
            Progress::Off => return,
            Progress::Terminal => write!(err, "{CLEAR_LINE}"),
            Progress::Relay => writeln!(err, "{RELAY_MARK}"),
        };
        let _ = err.flush();
    }
}

/// If `line` (without its newline) is a relayed progress line, its text.
pub fn parse_relay(line: &str) -> Option<&str> {
    line.strip_prefix(RELAY_MARK)
        .or_else(|| (line == RELAY_MARK.trim_end()).then_some(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relay_lines() {
        assert_eq!(
            parse_relay(&format!("{RELAY_MARK}3/9 float")),
            Some("3/9 float")
        );
        assert_eq!(parse_relay(RELAY_MARK), Some(""));
        assert_eq!(parse_relay(RELAY_MARK.trim_end()), Some(""));
        assert_eq!(parse_relay("chorus-perf-progress 3/9"), None);
        assert_eq!(parse_relay("error: rank 1 closed"), None);
    }

    #[test]
    fn only_rank_zero_without_json() {
        assert_eq!(Progress::for_rank(1, false), Progress::Off);
        assert_eq!(Progress::for_rank(0, true), Progress::Off);
    }
}
