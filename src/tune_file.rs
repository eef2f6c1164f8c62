//! The tuning file (`CHORUS_TUNE_FILE`): allreduce decisions kept across launches, as FFTW keeps
//! its wisdom and Open MPI reads a rules file.
//!
//! Online tuning ([`crate::select`]) times the schedules on the first call of every size bucket:
//! a few dozen to a few hundred milliseconds per bucket, spent again by every launch, with the
//! link saturated meanwhile. A job that is relaunched often (restarts from checkpoints, sweeps,
//! elastic training) can keep what those trials found instead: with `CHORUS_TUNE_FILE=PATH` set
//! on every rank (and tuning on), rank 0 reads the file at init and the ranks agree on its
//! decisions (one allreduce), so the buckets it holds start decided; rank 0 writes every new
//! decision back. Where some host runs more ranks than cores, a restored bucket keeps the
//! rivals its trials left and revisits re-time them, as after trials (the ranks' rhythm on
//! shared cores changes from launch to launch); on links it is settled (a rival's blocks would
//! run on connections the launch has not warmed: on the 4-host 1 gbit testbed they cost
//! 200-call loops of 128 and 512 KiB 2.5 %, against none for the settled bucket). Only decisions made by trials are kept: buckets decided by
//! the model alone (one candidate, tied or inherited schedules) cost nothing to decide again.
//!
//! # What must match
//! A file holds sections, one per kind of communicator ([`Key`]: ranks, hosts, ranks per host,
//! transport, whether a host runs more ranks than cores, the schedules `CHORUS_ALGO` allows). A
//! section is used only when its key equals the communicator's and its link figures are close
//! to the ones this communicator measured or was given (β within [`LINK_MATCH_BETA`]×, α within
//! [`LINK_MATCH_ALPHA`]×: the same network, not a 10× faster one); otherwise the communicator tunes as without a file and its decisions replace
//! the section.
//!
//! # Format
//! Text, one record per line:
//! ```text
//! chorus-tune 1
//! section ranks=4 hosts=4 per_host=1 transport=tcp cpu_bound=0 algos=ring,tree,halving_doubling,recursive_doubling alpha_us=21.5 beta_gbps=0.1195
//! bucket 32768 halving_doubling ring=0.000416 tree=0.000551 halving_doubling=0.000409 recursive_doubling=0.000553
//! ```
//! A `bucket` line gives the bucket's largest size (a power of two), the schedule chosen and
//! the agreed trial time (seconds per call) of every candidate. A file that cannot be read, does
//! not parse, is larger than [`MAX_FILE_BYTES`] or names an unknown schedule is not used (a
//! warning says why) and is not rewritten either: it may come from a newer release (another
//! header version, a schedule this one does not know) or be another program's file, and
//! replacing it would drop every section this release cannot read. Remove it, or name another
//! file, for decisions to be kept. It never fails a collective.
//!
//! # Caveats
//! Rank 0 replaces the file atomically (a temporary file of a name unique to the writer, synced,
//! then a rename); jobs writing the same file at the same time may lose each other's latest
//! decisions, never corrupt it. A path to anything but a regular file is refused, and so is a
//! symbolic link, even to a regular file: a link in a shared directory could otherwise make a
//! run read, or replace, the file it points to; name the file itself. The variable
//! must be set (to any path) on every rank or on none: ranks that disagree fail init, naming
//! it, as ranks that disagree about `CHORUS_TUNE` do.

use std::fmt::Write as _;
use std::path::Path;

use chorus_algorithms::allreduce::Algorithm;
use chorus_algorithms::cost::Link;

use crate::select::{index, ROWS};

/// The environment variable naming the file.
pub const ENV: &str = "CHORUS_TUNE_FILE";
/// The first line of a file of this version.
const HEADER: &str = "chorus-tune 1";
/// Files larger than this are not read (a few kilobytes per section is typical).
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Sections kept in one file (the oldest are dropped).
pub const MAX_SECTIONS: usize = 64;
/// A section's β (seconds per byte) must be within this factor of the communicator's: the
/// same class of network (1 against 10 gbit is 10×), allowing for the probe's spread (TCP
/// loopback streams measure 2.4–4.7 GB/s on the same machine).
pub const LINK_MATCH_BETA: f64 = 4.0;
/// A section's α must be within this factor of the communicator's (the probe's α varies up
/// to 4× from launch to launch where ranks share cores).
pub const LINK_MATCH_ALPHA: f64 = 8.0;

/// The kind of communicator a section is for: decisions carry over only between communicators
/// of the same kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key {
    /// Ranks.
    pub ranks: usize,
    /// Distinct hosts.
    pub hosts: usize,
    /// The most ranks on one host.
    pub per_host: usize,
    /// The transport's name (`tcp`, or the hybrid's name when some peers share memory).
    pub transport: String,
    /// Some host runs more ranks than it has cores.
    pub cpu_bound: bool,
    /// The schedules `CHORUS_ALGO` allows, comma-separated.
    pub algos: String,
}

impl Key {
    fn fields(&self) -> String {
        format!(
            "ranks={} hosts={} per_host={} transport={} cpu_bound={} algos={}",
            self.ranks,
            self.hosts,
            self.per_host,
            self.transport,
            u8::from(self.cpu_bound),
            self.algos
        )
    }
}

/// One bucket's decision as its trials left it.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The bucket's largest size in bytes (a power of two).
    pub bytes: usize,
    /// The schedule the bucket runs.
    pub chosen: Algorithm,
    /// The candidates tried and their agreed times per call (seconds), in trial order.
    pub times: Vec<(Algorithm, f64)>,
}

impl Decision {
    /// Checks what a file or a peer may have got wrong: a power-of-two size, positive finite
    /// times, distinct candidates, the chosen one among them.
    pub fn check(&self) -> Result<(), String> {
        if !self.bytes.is_power_of_two() {
            return Err(format!("bucket size {} is not a power of two", self.bytes));
        }
        if let Some((a, t)) = self
            .times
            .iter()
            .find(|(_, t)| !(t.is_finite() && *t > 0.0))
        {
            return Err(format!("time {t} of {a} is not a positive number"));
        }
        for (i, (a, _)) in self.times.iter().enumerate() {
            if self.times[..i].iter().any(|(b, _)| b == a) {
                return Err(format!("{a} is listed twice"));
            }
        }
        if !self.times.iter().any(|(a, _)| *a == self.chosen) {
            return Err(format!("the chosen {} was not tried", self.chosen));
        }
        Ok(())
    }
}

/// The decisions of one kind of communicator, and the link they were made on.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    /// Which communicators it is for.
    pub key: Key,
    /// The link (α, β) of the communicator that made the decisions.
    pub link: Link,
    /// One per bucket, by size.
    pub buckets: Vec<Decision>,
}

impl Section {
    /// Why the section's decisions do not apply on `link`, if they do not: β more than
    /// [`LINK_MATCH_BETA`]× apart, or α more than [`LINK_MATCH_ALPHA`]×.
    pub fn link_mismatch(&self, link: Link) -> Option<String> {
        let apart = |a: f64, b: f64, f: f64| a.max(b) > f * a.min(b);
        let (us, gbps) = (|l: Link| l.alpha * 1e6, |l: Link| 1e-9 / l.beta);
        let alpha = apart(self.link.alpha, link.alpha, LINK_MATCH_ALPHA);
        (alpha || apart(self.link.beta, link.beta, LINK_MATCH_BETA)).then(|| {
            format!(
                "made on a link of {:.1} us and {:.4} GB/s, this one has {:.1} us and {:.4} GB/s",
                us(self.link),
                gbps(self.link),
                us(link),
                gbps(link)
            )
        })
    }

    /// Sets the decision of `d`'s bucket (replacing one of the same size).
    pub fn set(&mut self, d: Decision) {
        match self.buckets.iter_mut().find(|b| b.bytes == d.bytes) {
            Some(b) => *b = d,
            None => {
                self.buckets.push(d);
                self.buckets.sort_by_key(|b| b.bytes);
            }
        }
    }
}

/// A parsed tuning file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TuneFile {
    /// Oldest first.
    pub sections: Vec<Section>,
}

impl TuneFile {
    /// Parses a file's text. Errors name the line.
    ///
    /// ```
    /// use chorus::tune_file::TuneFile;
    /// let f = TuneFile::parse(
    ///     "chorus-tune 1\n\
    ///      section ranks=2 hosts=2 per_host=1 transport=tcp cpu_bound=0 algos=ring,tree \
    ///      alpha_us=20 beta_gbps=0.12\n\
    ///      bucket 1024 tree ring=0.0002 tree=0.0001\n",
    /// ).unwrap();
    /// assert_eq!(f.sections[0].buckets[0].chosen, chorus::Algorithm::Tree);
    /// assert!(TuneFile::parse("chorus-tune 1\nbucket 1024 tree tree=1\n").is_err());
    /// ```
    pub fn parse(text: &str) -> Result<TuneFile, String> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
        match lines.next() {
            Some((_, HEADER)) => {}
            // Another version's header (kept short: the line may be long).
            Some((_, l)) if l.starts_with("chorus-tune ") && l.len() <= 40 => {
                return Err(format!(
                    "the first line is {l:?}, not {HEADER:?}: a file of another version \
                     (from a newer release?)"
                ))
            }
            _ => return Err(format!("the first line is not {HEADER:?}")),
        }
        let mut file = TuneFile::default();
        for (n, line) in lines {
            let at = |msg: String| format!("line {n}: {msg}");
            let mut words = line.split_whitespace();
            match words.next() {
                None => {}
                Some(w) if w.starts_with('#') => {}
                Some("section") => {
                    let section = parse_section(words).map_err(at)?;
                    file.sections.push(section);
                }
                Some("bucket") => {
                    let d = parse_bucket(words).map_err(at)?;
                    let s = file
                        .sections
                        .last_mut()
                        .ok_or_else(|| at("a bucket before any section".into()))?;
                    if s.buckets.iter().any(|b| b.bytes == d.bytes) {
                        return Err(at(format!("bucket {} appears twice", d.bytes)));
                    }
                    s.set(d);
                }
                Some(w) => return Err(at(format!("unknown record {w:?}"))),
            }
        }
        Ok(file)
    }

    /// The file's text ([`TuneFile::parse`] reads it back).
    pub fn format(&self) -> String {
        let mut s = format!(
            "{HEADER}\n# allreduce schedules decided by chorus's tuning trials ({ENV}); \
             seconds per call\n"
        );
        for sec in &self.sections {
            let _ = writeln!(
                s,
                "section {} alpha_us={} beta_gbps={}",
                sec.key.fields(),
                sec.link.alpha * 1e6,
                1e-9 / sec.link.beta
            );
            for b in &sec.buckets {
                let _ = write!(s, "bucket {} {}", b.bytes, b.chosen);
                for (a, t) in &b.times {
                    let _ = write!(s, " {a}={t:e}");
                }
                s.push('\n');
            }
        }
        s
    }

    /// The section for `key`, if any.
    pub fn section(&self, key: &Key) -> Option<&Section> {
        self.sections.iter().find(|s| s.key == *key)
    }

    /// Puts `section` in as the newest section of its key (or adds it, dropping the oldest
    /// beyond [`MAX_SECTIONS`]: all of them, since a file read from disk may hold more than
    /// that). The file's section of that key, if its link matches, keeps the buckets
    /// `section` has no decision for: two communicators of one kind that write the file in
    /// turn (a communicator and its duplicate, jobs run one after another) each add their
    /// buckets rather than drop the other's. On another link the section is replaced.
    pub fn put(&mut self, mut section: Section) {
        if let Some(old) = self.section(&section.key) {
            if old.link_mismatch(section.link).is_none() {
                for b in &old.buckets {
                    if !section.buckets.iter().any(|d| d.bytes == b.bytes) {
                        section.set(b.clone());
                    }
                }
            }
        }
        self.sections.retain(|s| s.key != section.key);
        self.sections.push(section);
        let excess = self.sections.len().saturating_sub(MAX_SECTIONS);
        self.sections.drain(..excess);
    }

    /// Reads and parses the file at `path`: `Ok(None)` when there is none. Anything but a
    /// regular file (a FIFO, a device, a directory) is an error, never read: opening a FIFO
    /// would block until a writer came. So is a symbolic link, even to a regular file (see
    /// [`TuneFile::store`]). The path is checked before it is opened, for a clear message and so
    /// that a device is not even opened; what was opened is checked again (`open_regular`),
    /// since the path may name something else by then.
    pub fn read(path: &Path) -> Result<Option<TuneFile>, String> {
        use std::io::Read as _;
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => return Err(symlink_refusal()),
            Ok(m) if !m.is_file() => return Err("it is not a regular file".to_string()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot look at it: {e}")),
        }
        let Some(f) = open_regular(path)? else {
            return Ok(None);
        };
        let mut text = String::new();
        f.take(MAX_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("cannot read it: {e}"))?;
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(format!("it is larger than {MAX_FILE_BYTES} bytes"));
        }
        TuneFile::parse(&text).map(Some)
    }

    /// Writes `section` into the file at `path`: the file's other sections are kept, and the
    /// new text replaces the old atomically (written to a temporary file of a name no other
    /// process picks, synced, then renamed over it).
    ///
    /// Nothing is written unless the file is absent or read and parsed in full: a file that
    /// cannot be read (an I/O or permission error, larger than [`MAX_FILE_BYTES`]) or does not
    /// parse (a newer release's version or schedules, another program's file) is left as it
    /// is and the error says why, since replacing it would drop every section it holds. A path
    /// that names something other than a regular file (`/dev/null`, a FIFO, a directory) is
    /// refused, not replaced; so is a symbolic link, even to a regular file: replacing the
    /// link's target would let a link in a shared directory make a run clobber another file.
    pub fn store(path: &Path, section: Section) -> Result<(), String> {
        use std::io::Write as _;
        // The kinds of path refused whatever they hold, with messages of their own (`read`
        // checks them again, and its handle, to read nothing else).
        // The replacement keeps the file's permissions (one kept private stays so).
        let permissions = match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => return Err(symlink_refusal()),
            Ok(m) if !m.is_file() => {
                return Err("it is not a regular file; not replacing it".to_string())
            }
            Ok(m) => Some(m.permissions()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(format!("cannot look at it: {e}; not replacing it")),
        };
        // Only a file that is not there counts as empty.
        let mut file = match TuneFile::read(path) {
            Ok(Some(file)) => file,
            Ok(None) => TuneFile::default(),
            Err(e) => {
                return Err(format!(
                    "{e}; not replacing it, so as not to lose the sections it may hold \
                     (remove it, or name another file, to keep new decisions)"
                ))
            }
        };
        file.put(section);
        // Never larger than `read` takes (a file with long foreign sections could grow past
        // it, and then stay frozen): the oldest sections go first, the newest stays.
        let mut text = file.format();
        while text.len() as u64 > MAX_FILE_BYTES && file.sections.len() > 1 {
            file.sections.remove(0);
            text = file.format();
        }
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(format!(
                "its new section alone is larger than {MAX_FILE_BYTES} bytes; not writing it"
            ));
        }
        let name = path
            .file_name()
            .ok_or_else(|| "the path names no file".to_string())?;
        let mut nonce = [0u8; 8];
        getrandom::getrandom(&mut nonce).map_err(|e| format!("getrandom: {e}"))?;
        let mut tmp_name = name.to_os_string();
        tmp_name.push(format!(
            ".tmp.{}.{:016x}",
            std::process::id(),
            u64::from_le_bytes(nonce)
        ));
        let tmp = path.with_file_name(tmp_name);
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .and_then(|mut f| {
                if let Some(p) = permissions {
                    f.set_permissions(p)?;
                }
                f.write_all(text.as_bytes())?;
                f.sync_all()
            });
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(format!("cannot write {tmp:?}: {e}"));
        }
        // A symbolic link swapped in since the read is replaced itself, not its target: rename
        // does not follow a link at the destination.
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot replace it: {e}")
        })
    }
}

/// Why a symbolic link is neither read nor written through.
fn symlink_refusal() -> String {
    format!(
        "{ENV} names a symbolic link, which is neither read nor replaced (a link in a shared \
         directory could make a run replace the file it points to); name the file itself"
    )
}

/// Opens `path` to read it, without following a symbolic link or blocking on a FIFO
/// (`O_NOFOLLOW`, `O_NONBLOCK`: a FIFO opens at once instead of blocking until a writer
/// comes), and checks that what was opened is a regular file:
/// `Ok(None)` when nothing is there. The handle is checked, not the path, so that a FIFO, a
/// device or a directory swapped in after a check of the path is not read.
fn open_regular(path: &Path) -> Result<Option<std::fs::File>, String> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            // A link fails the open with ELOOP, whose message ("too many levels of symbolic
            // links") would not say what to do.
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(symlink_refusal());
            }
            return Err(format!("cannot open it: {e}"));
        }
    };
    let m = f
        .metadata()
        .map_err(|e| format!("cannot look at it: {e}"))?;
    if !m.is_file() {
        return Err("it is not a regular file".to_string());
    }
    Ok(Some(f))
}

fn parse_section<'a>(words: impl Iterator<Item = &'a str>) -> Result<Section, String> {
    let mut f: [Option<&str>; 8] = [None; 8];
    const NAMES: [&str; 8] = [
        "ranks",
        "hosts",
        "per_host",
        "transport",
        "cpu_bound",
        "algos",
        "alpha_us",
        "beta_gbps",
    ];
    for w in words {
        let (k, v) = w
            .split_once('=')
            .ok_or_else(|| format!("{w:?} is not key=value"))?;
        let i = NAMES
            .iter()
            .position(|n| *n == k)
            .ok_or_else(|| format!("unknown section field {k:?}"))?;
        if f[i].replace(v).is_some() {
            return Err(format!("field {k} appears twice"));
        }
    }
    let get = |i: usize| f[i].ok_or_else(|| format!("the section has no {}", NAMES[i]));
    let count = |i: usize| -> Result<usize, String> {
        get(i)?
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("{} is not a positive count", NAMES[i]))
    };
    let positive = |i: usize| -> Result<f64, String> {
        get(i)?
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| format!("{} is not a positive number", NAMES[i]))
    };
    let cpu_bound = match get(4)? {
        "0" => false,
        "1" => true,
        v => return Err(format!("cpu_bound={v:?}: expected 0 or 1")),
    };
    let key = Key {
        ranks: count(0)?,
        hosts: count(1)?,
        per_host: count(2)?,
        transport: get(3)?.to_string(),
        cpu_bound,
        algos: get(5)?.to_string(),
    };
    let link = Link {
        alpha: positive(6)? * 1e-6,
        beta: 1e-9 / positive(7)?,
    };
    Ok(Section {
        key,
        link,
        buckets: Vec::new(),
    })
}

fn parse_bucket<'a>(mut words: impl Iterator<Item = &'a str>) -> Result<Decision, String> {
    let bytes = words
        .next()
        .and_then(|w| w.parse::<usize>().ok())
        .ok_or("a bucket needs its size in bytes")?;
    let chosen: Algorithm = words
        .next()
        .ok_or("a bucket needs its schedule")?
        .parse()
        .map_err(|e| format!("{e}"))?;
    let mut times = Vec::new();
    for w in words {
        let (a, t) = w
            .split_once('=')
            .ok_or_else(|| format!("{w:?} is not schedule=seconds"))?;
        let a: Algorithm = a.parse().map_err(|e| format!("{e}"))?;
        let t: f64 = t
            .parse()
            .map_err(|_| format!("{t:?} is not a number of seconds"))?;
        times.push((a, t));
    }
    let d = Decision {
        bytes,
        chosen,
        times,
    };
    d.check()?;
    Ok(d)
}

/// Numbers per bucket row in [`encode`]'s vector: the chosen schedule's index + 1, then one
/// time per schedule (0: not a candidate).
const SLOTS: usize = 1 + Algorithm::ALL.len();

/// The decisions as a vector of non-negative numbers, one row per bucket ([`ROWS`] rows), so
/// that an allreduce with `max` over it, with zeros from every other rank, hands rank 0's
/// decisions to all. Decisions whose chosen schedule `allowed` refuses are left out, and so are
/// the candidates it refuses.
///
/// ```
/// use chorus::tune_file::{decode, encode, Decision};
/// use chorus::Algorithm;
/// let d = Decision {
///     bytes: 4096,
///     chosen: Algorithm::Tree,
///     times: vec![(Algorithm::Ring, 2e-4), (Algorithm::Tree, 1e-4)],
/// };
/// let v = encode(&[d.clone()], |_| true);
/// assert_eq!(decode(&v).unwrap(), vec![d]);
/// assert!(decode(&encode(&[], |_| true)).unwrap().is_empty());
/// ```
pub fn encode(decisions: &[Decision], allowed: impl Fn(Algorithm) -> bool) -> Vec<f64> {
    let mut v = vec![0.0; ROWS * SLOTS];
    for d in decisions {
        let row = d.bytes.trailing_zeros() as usize;
        if d.check().is_err() || row >= ROWS || !allowed(d.chosen) {
            continue;
        }
        let at = row * SLOTS;
        v[at] = (index(d.chosen) + 1) as f64;
        for &(a, t) in d.times.iter().filter(|(a, _)| allowed(*a)) {
            v[at + 1 + index(a)] = t;
        }
    }
    v
}

/// The decisions of [`encode`]'s vector, by size. Errors: a vector of another length, or a row
/// that is not a valid decision (the vector came from a peer).
pub fn decode(v: &[f64]) -> Result<Vec<Decision>, String> {
    if v.len() != ROWS * SLOTS {
        return Err(format!("{} numbers, expected {}", v.len(), ROWS * SLOTS));
    }
    let mut out = Vec::new();
    for (row, r) in v.chunks_exact(SLOTS).enumerate() {
        if r[0] == 0.0 {
            continue;
        }
        let chosen = Some(r[0])
            .filter(|c| c.fract() == 0.0 && *c >= 1.0 && *c <= Algorithm::ALL.len() as f64)
            .map(|c| Algorithm::ALL[c as usize - 1])
            .ok_or_else(|| format!("row {row}: {} names no schedule", r[0]))?;
        let times = Algorithm::ALL
            .into_iter()
            .zip(&r[1..])
            .filter(|(_, &t)| t != 0.0)
            .map(|(a, &t)| (a, t))
            .collect();
        let d = Decision {
            bytes: 1 << row,
            chosen,
            times,
        };
        d.check().map_err(|e| format!("row {row}: {e}"))?;
        out.push(d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key {
            ranks: 4,
            hosts: 4,
            per_host: 1,
            transport: "tcp".into(),
            cpu_bound: false,
            algos: "ring,tree,halving_doubling,recursive_doubling".into(),
        }
    }

    fn section() -> Section {
        Section {
            key: key(),
            link: Link {
                alpha: 21.5e-6,
                beta: 1.0 / 119.5e6,
            },
            buckets: vec![
                Decision {
                    bytes: 8,
                    chosen: Algorithm::RecursiveDoubling,
                    times: vec![
                        (Algorithm::Tree, 5.1e-5),
                        (Algorithm::RecursiveDoubling, 4.3e-5),
                    ],
                },
                Decision {
                    bytes: 32768,
                    chosen: Algorithm::HalvingDoubling,
                    times: vec![
                        (Algorithm::Ring, 4.16e-4),
                        (Algorithm::HalvingDoubling, 4.09e-4),
                    ],
                },
            ],
        }
    }

    #[test]
    fn format_parses_back() {
        let mut f = TuneFile::default();
        f.put(section());
        let mut other = section();
        other.key.ranks = 8;
        other.buckets.truncate(1);
        f.put(other);
        let back = TuneFile::parse(&f.format()).unwrap();
        assert_eq!(back.sections.len(), 2);
        assert_eq!(back.section(&key()).unwrap().buckets, section().buckets);
        let l = back.section(&key()).unwrap().link;
        assert!((l.alpha - 21.5e-6).abs() < 1e-12 && (l.beta * 119.5e6 - 1.0).abs() < 1e-9);
        // Putting a section of the same key replaces it.
        f.put(section());
        assert_eq!(f.sections.len(), 2);
        assert_eq!(f.sections[1].key, key());
    }

    /// Two writers of one kind of communicator on one link, in turn, each with some buckets:
    /// the file keeps both's, the newer decision where both have one; on another link the
    /// newer section replaces the older.
    #[test]
    fn put_keeps_the_buckets_of_an_earlier_writer_on_the_same_link() {
        let mut f = TuneFile::default();
        let mut first = section();
        first.buckets.truncate(1); // 8 B
        f.put(first);
        let mut second = section();
        second.buckets.remove(0); // 32 KiB
        let mut big = second.buckets[0].clone();
        big.bytes = 1 << 20;
        big.chosen = Algorithm::Ring;
        second.buckets.push(big.clone());
        f.put(second.clone());
        let sizes: Vec<usize> = f.sections[0].buckets.iter().map(|b| b.bytes).collect();
        assert_eq!((f.sections.len(), sizes), (1, vec![8, 32768, 1 << 20]));
        // The newer decision of a bucket both have wins.
        let mut third = section();
        third.buckets = vec![Decision {
            chosen: Algorithm::Ring,
            ..section().buckets[1].clone()
        }];
        f.put(third);
        let s = &f.sections[0];
        assert_eq!(s.buckets.len(), 3);
        assert_eq!(s.buckets[1].chosen, Algorithm::Ring);
        // Another link (10x the latency): only the new section's buckets.
        let mut elsewhere = section();
        elsewhere.link.alpha *= 10.0;
        elsewhere.buckets.truncate(1);
        f.put(elsewhere);
        assert_eq!(f.sections[0].buckets.len(), 1);
    }

    #[test]
    fn bad_files_name_the_line() {
        let good = section();
        let mut f = TuneFile::default();
        f.put(good);
        let text = f.format();
        let cases = [
            ("", "first line"),
            ("chorus-tune 2\n", "first line"),
            (
                "chorus-tune 1\nbucket 8 ring ring=1\n",
                "line 2: a bucket before any section",
            ),
            ("chorus-tune 1\nfoo\n", "line 2: unknown record"),
        ];
        for (t, want) in cases {
            let e = TuneFile::parse(t).unwrap_err();
            assert!(e.contains(want), "{t:?}: {e}");
        }
        let edits = [
            ("bucket 32768 ", "bucket 32767 ", "not a power of two"),
            ("ring=4.16e-4", "ring=-1", "not a positive number"),
            ("ring=4.16e-4", "ring=nan", "not a positive number"),
            ("ring=4.16e-4", "warp=4.16e-4", "unknown"),
            ("ring=4.16e-4", "halving_doubling=1e-4", "listed twice"),
            (
                "bucket 32768 halving_doubling",
                "bucket 32768 tree",
                "was not tried",
            ),
            ("ranks=4", "ranks=0", "not a positive count"),
            ("cpu_bound=0", "cpu_bound=2", "expected 0 or 1"),
            ("beta_gbps=", "beta_gbps=-", "not a positive number"),
            ("hosts=4 ", "", "has no hosts"),
            ("hosts=4 ", "hosts=4 hosts=4 ", "appears twice"),
        ];
        for (from, to, want) in edits {
            assert!(text.contains(from), "{from:?} not in {text}");
            let t = text.replacen(from, to, 1);
            let e = TuneFile::parse(&t).unwrap_err();
            assert!(e.contains(want) && e.starts_with("line "), "{to:?}: {e}");
        }
        let twice = text.clone() + "bucket 8 tree tree=1e-4\n";
        assert!(TuneFile::parse(&twice)
            .unwrap_err()
            .contains("appears twice"));
    }

    #[test]
    fn links_match_within_a_factor() {
        let s = section();
        assert!(s.link_mismatch(s.link).is_none());
        let near = Link {
            alpha: s.link.alpha * 7.9,
            beta: s.link.beta / 3.9,
        };
        assert!(s.link_mismatch(near).is_none());
        let faster = Link {
            alpha: s.link.alpha,
            beta: s.link.beta / 10.0,
        };
        let why = s.link_mismatch(faster).unwrap();
        assert!(
            why.contains("0.1195 GB/s") && why.contains("1.1950 GB/s"),
            "{why}"
        );
        let slower = Link {
            alpha: s.link.alpha * 9.0,
            beta: s.link.beta,
        };
        assert!(s.link_mismatch(slower).is_some());
    }

    #[test]
    fn put_drops_the_oldest_beyond_the_cap() {
        // A file read from disk may hold more sections than the cap: one put trims them all.
        let mut f = TuneFile::default();
        for ranks in 1..=MAX_SECTIONS + 5 {
            let mut s = section();
            s.key.ranks = ranks;
            f.sections.push(s);
        }
        let mut f = TuneFile::parse(&f.format()).unwrap();
        assert_eq!(f.sections.len(), MAX_SECTIONS + 5);
        let mut newest = section();
        newest.key.ranks = MAX_SECTIONS + 100;
        f.put(newest);
        assert_eq!(f.sections.len(), MAX_SECTIONS);
        // MAX_SECTIONS + 6 sections, the 6 oldest dropped.
        assert_eq!(f.sections[0].key.ranks, 7);
        assert_eq!(f.sections[MAX_SECTIONS - 1].key.ranks, MAX_SECTIONS + 100);
        // Replacing a section at the cap drops nothing else.
        let mut again = section();
        again.key.ranks = 7;
        f.put(again);
        assert_eq!(f.sections.len(), MAX_SECTIONS);
        assert_eq!(f.sections[0].key.ranks, 8);
        assert_eq!(f.sections[MAX_SECTIONS - 1].key.ranks, 7);
    }

    #[test]
    fn store_keeps_other_sections() {
        let dir = std::env::temp_dir().join(format!("chorus-tune-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tune.txt");
        assert_eq!(TuneFile::read(&path).unwrap(), None);
        TuneFile::store(&path, section()).unwrap();
        let mut other = section();
        other.key.transport = "hybrid".into();
        TuneFile::store(&path, other).unwrap();
        let back = TuneFile::read(&path).unwrap().unwrap();
        assert_eq!(back.sections.len(), 2);
        assert_eq!(back.sections[0].key, key());
        assert_eq!(back.sections[0].buckets, section().buckets);
        assert_eq!(back.sections[1].key.transport, "hybrid");
        // A file made private stays private when replaced.
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut third = section();
        third.key.transport = "shm".into();
        TuneFile::store(&path, third).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn store_never_writes_more_than_read_takes() {
        // Sections with long foreign keys (20 KiB each) fill the file near its limit: a new
        // one drops the oldest rather than freeze the file beyond what `read` takes.
        let dir = std::env::temp_dir().join(format!("chorus-tune-big-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tune.txt");
        let long = |k: usize| {
            let mut s = section();
            s.key.transport = format!("t{k}{}", "x".repeat(20 << 10));
            s
        };
        let mut f = TuneFile::default();
        for k in 0..50 {
            f.sections.push(long(k));
        }
        let text = f.format();
        assert!(text.len() as u64 <= MAX_FILE_BYTES);
        assert!(
            text.len() as u64 + (40 << 10) > MAX_FILE_BYTES,
            "{}",
            text.len()
        );
        std::fs::write(&path, &text).unwrap();
        for k in 50..53 {
            TuneFile::store(&path, long(k)).unwrap();
        }
        assert!(std::fs::metadata(&path).unwrap().len() <= MAX_FILE_BYTES);
        let back = TuneFile::read(&path).unwrap().unwrap();
        assert!(back.sections.len() < 53, "{}", back.sections.len());
        assert!(back
            .sections
            .last()
            .unwrap()
            .key
            .transport
            .starts_with("t52x"));
        assert!(back.sections[0].key.transport.starts_with('t'));
        // A section too large on its own is refused, the file left as it was.
        let before = std::fs::read(&path).unwrap();
        let mut huge = section();
        huge.key.transport = "y".repeat(MAX_FILE_BYTES as usize);
        assert!(TuneFile::store(&path, huge).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), before);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_that_cannot_be_read_are_left_untouched() {
        let dir = std::env::temp_dir().join(format!("chorus-tune-unread-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tune.txt");
        let mut current = TuneFile::default();
        current.put(section());
        let text = current.format();
        // What a newer release might write: another header version, then records this one
        // may or may not know.
        let newer = text.replacen(HEADER, "chorus-tune 2", 1) + "flags ranks=4 zero_copy=1\n";
        let unknown_schedule = text.replacen("ring=4.16e-4", "warp=4.16e-4", 1);
        assert_ne!(unknown_schedule, text);
        let cases: [(&str, Vec<u8>, &str); 5] = [
            ("a newer version", newer.into_bytes(), "first line"),
            (
                "an unknown schedule",
                unknown_schedule.into_bytes(),
                "unknown",
            ),
            (
                "oversized",
                vec![b'#'; MAX_FILE_BYTES as usize + 1],
                "larger than",
            ),
            (
                "not text",
                b"\x00\xffnot a tuning file\n".to_vec(),
                "cannot read",
            ),
            ("another file", b"garbage".to_vec(), "first line"),
        ];
        for (what, bytes, why) in cases {
            std::fs::write(&path, &bytes).unwrap();
            assert!(
                TuneFile::read(&path).unwrap_err().contains(why),
                "{what}: not refused"
            );
            let e = TuneFile::store(&path, section()).unwrap_err();
            assert!(
                e.contains(why) && e.contains("not replacing it"),
                "{what}: {e}"
            );
            assert!(
                std::fs::read(&path).unwrap() == bytes,
                "{what}: the file was replaced"
            );
        }
        let e = TuneFile::parse("chorus-tune 2\n").unwrap_err();
        assert!(e.contains("another version"), "{e}");
        // Once the file is removed, decisions are kept again; no temporary file is left.
        std::fs::remove_file(&path).unwrap();
        TuneFile::store(&path, section()).unwrap();
        let back = TuneFile::read(&path).unwrap().unwrap();
        assert_eq!(back.sections.len(), 1);
        assert_eq!(back.sections[0].buckets, section().buckets);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_regular_files_are_read_or_replaced() {
        let dir = std::env::temp_dir().join(format!("chorus-tune-kinds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A FIFO: opening it to read would block until a writer came.
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            assert!(TuneFile::read(&fifo)
                .unwrap_err()
                .contains("not a regular file"));
            assert!(TuneFile::store(&fifo, section())
                .unwrap_err()
                .contains("not a regular"));
            assert!(
                !std::fs::metadata(&fifo).unwrap().is_file(),
                "the FIFO was replaced"
            );
            // A FIFO swapped in after the path was checked: the open neither blocks (no
            // writer comes) nor lets it be read.
            assert!(open_regular(&fifo)
                .unwrap_err()
                .contains("not a regular file"));
        }
        // A directory.
        assert!(TuneFile::read(&dir)
            .unwrap_err()
            .contains("not a regular file"));
        assert!(TuneFile::store(&dir, section()).is_err());
        // A symbolic link, dangling or to a file: refused, to read or to write, and nothing
        // is written through it.
        let target = dir.join("target.txt");
        let link = dir.join("link.txt");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let refused = |e: &str| e.contains("symbolic link") && e.contains(ENV);
        let e = TuneFile::store(&link, section()).unwrap_err();
        assert!(refused(e.as_str()), "{e}");
        assert!(!target.exists(), "written through a dangling link");
        let e = TuneFile::read(&link).unwrap_err();
        assert!(refused(e.as_str()), "{e}");
        TuneFile::store(&target, section()).unwrap();
        let before = std::fs::read(&target).unwrap();
        let mut other = section();
        other.key.transport = "hybrid".into();
        let e = TuneFile::store(&link, other).unwrap_err();
        assert!(refused(e.as_str()), "{e}");
        let e = TuneFile::read(&link).unwrap_err();
        assert!(refused(e.as_str()), "{e}");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(
            std::fs::read(&target).unwrap() == before,
            "the link's target was replaced"
        );
        assert_eq!(TuneFile::read(&target).unwrap().unwrap().sections.len(), 1);
        // A link swapped in after the path was checked: the open does not follow it.
        let e = open_regular(&link).unwrap_err();
        assert!(refused(e.as_str()), "{e}");
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.contains(".tmp.")), "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
