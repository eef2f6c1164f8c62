//! The system layer of the shared-memory transport: every `unsafe` block of it lives here, each
//! wrapping one system call or one access to the mapped segment.
//!
//! - [`memfd`]: an anonymous shared-memory file (`memfd_create` + `ftruncate`), sealed at its
//!   size. It has no name in any file system, so nothing is ever left in `/dev/shm`, whatever
//!   happens to the process: the kernel frees the memory when the last descriptor and mapping
//!   are gone. [`cannot_shrink`] checks a peer's segment for that seal before it is mapped.
//! - [`open_peer_fd`]: another process's memfd, reopened through `/proc/<pid>/fd/<fd>`.
//! - [`Mapping`]: a `MAP_SHARED` mapping, the parts of it a rank uses pre-faulted
//!   (`MADV_POPULATE_WRITE`: first touch costs ~10×),
//!   unmapped on drop, with bounds-checked accessors for atomics and byte ranges.
//! - [`futex_wait`] / [`futex_wake`]: process-shared futexes on a 32-bit word of a mapping; every
//!   wait has a timeout.
//! - [`Liveness`]: whether a peer process still runs (a pidfd polled without blocking, or
//!   `kill(pid, 0)` on kernels without pidfds).
//! - [`fork_generation`]: how many times this process's ancestors forked into it, counted by a
//!   `pthread_atfork` child handler (cheaper than `getpid`, a system call, on every check).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Turns a `-1` return into the thread's `errno`.
fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// The seals every segment gets once it has its size: it can neither shrink nor grow, and the
/// seals cannot be lifted. Peers open a segment read-write; one that shrank it would kill every
/// process that has it mapped with `SIGBUS` at its next access past the new end.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A new anonymous shared-memory file of `len` bytes (close-on-exec), sealed at that size.
pub fn memfd(name: &str, len: usize) -> io::Result<OwnedFd> {
    let cname = CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `cname` is a valid NUL-terminated string that outlives the call; the flags are
    // plain constants.
    let fd = check(unsafe {
        libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    } as _)?;
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    File::from(owned.try_clone()?).set_len(len as u64)?;
    // SAFETY: F_ADD_SEALS on a descriptor we own, with plain constant flags.
    check(unsafe { libc::fcntl(owned.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } as _)?;
    Ok(owned)
}

/// Whether the file behind `fd` is sealed against shrinking (as [`memfd`] seals its segments).
/// A file that takes no seals at all (not a memfd) is not.
pub fn cannot_shrink(fd: &OwnedFd) -> bool {
    // SAFETY: F_GET_SEALS on a live descriptor; it only reads the file's seals.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_SHRINK != 0
}

/// Opens the descriptor `fd` of process `pid` (a memfd it created) read-write. Whatever the
/// path names instead (a FIFO, a terminal) neither blocks the open nor becomes this process's
/// terminal; it fails the seal check that follows.
pub fn open_peer_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
        .open(format!("/proc/{pid}/fd/{fd}"))?;
    Ok(OwnedFd::from(f))
}

/// A shared mapping of a whole file; unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics, byte copies
// or slices whose exclusivity the transport's protocol guarantees (see the module docs of
// `shm`). The type is private to this crate, whose only users run that protocol.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared references hand out atomics, byte copies and read-only slices of
// ranges the protocol keeps unwritten while they live (`bytes`).
unsafe impl Sync for Mapping {}

/// The system's page size (4096 where it cannot be read).
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

impl Mapping {
    /// Maps `len` bytes of `fd` shared, readable and writable, with the pages pre-faulted.
    #[cfg(test)]
    pub fn map(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        Self::map_with(fd, len, libc::MAP_POPULATE)
    }

    /// Maps `len` bytes of `fd` shared, readable and writable, with only the pages of `parts`
    /// pre-faulted (for writing): the parts of a segment a rank uses (the header, the arena,
    /// and rings as [`super::Layout`] says; never the rings of the other ranks in a peer's
    /// segment: pre-faulting all of every peer's segment costs each rank the whole host's
    /// shared memory in page tables, at 128 ranks on a host 4 GiB each). Where the kernel
    /// cannot (before Linux 5.14) the pages are read in instead. Memory the system refuses
    /// (a cgroup's limit) is an error here, not a fault at first use.
    pub fn map_parts(
        fd: &OwnedFd,
        len: usize,
        parts: &[std::ops::Range<usize>],
    ) -> io::Result<Mapping> {
        let m = Self::map_with(fd, len, 0)?;
        for part in parts {
            m.prefault(part.clone())?;
        }
        Ok(m)
    }

    /// Pre-faults the pages of `part` (clipped to the mapping) for writing; where the kernel
    /// does not know how, by reading them.
    fn prefault(&self, part: std::ops::Range<usize>) -> io::Result<()> {
        let page = page_size();
        let start = part.start / page * page;
        let end = part.end.min(self.len).next_multiple_of(page).min(self.len);
        if start >= end {
            return Ok(());
        }
        // SAFETY: `start..end` lies inside this mapping (clipped above; `start` page-aligned,
        // as is the mapping), which lives as long as `self`. MADV_POPULATE_WRITE only faults
        // the pages in, as writes would, without changing their contents.
        let r = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(start).cast(),
                end - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINVAL) {
                return Err(e);
            }
            // A kernel without it (before 5.14): a read of every page maps it (a write would
            // change what the peer shares).
            for off in (start..end).step_by(page) {
                self.u64_at(off).load(Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn map_with(fd: &OwnedFd, len: usize, populate: libc::c_int) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let actual = File::from(fd.try_clone()?).metadata()?.len();
        if actual < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("shared segment has {actual} bytes, {len} expected"),
            ));
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint) of a file at least `len`
        // bytes long (checked above); the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | populate,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mapping { ptr, len })
    }

    fn check_range(&self, off: usize, len: usize, align: usize) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len) && off % align == 0,
            "shared segment access {off}+{len} (align {align}) outside {} bytes",
            self.len
        );
    }

    /// The 64-bit atomic at byte offset `off` (8-aligned, in bounds; panics otherwise: offsets
    /// come from the transport's own layout, never from a peer).
    pub fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check_range(off, 8, 8);
        // SAFETY: in bounds and 8-aligned (checked; the mapping is page-aligned); AtomicU64 has
        // the layout of u64 and any bit pattern is valid; the memory lives as long as `self`.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
    }

    /// The 32-bit atomic at byte offset `off` (4-aligned, in bounds).
    pub fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.check_range(off, 4, 4);
        // SAFETY: as for `u64_at`, with 4-byte alignment.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// How many pages of `part` (page-aligned, inside the mapping) are in memory: for shared
    /// memory, the pages of the segment that exist (tests of what is pre-faulted).
    #[cfg(test)]
    pub fn resident_pages(&self, part: std::ops::Range<usize>) -> usize {
        let page = page_size();
        assert!(part.start % page == 0 && part.start <= part.end && part.end <= self.len);
        let pages = (part.end - part.start).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the range lies inside this live mapping (checked above, page-aligned as the
        // mapping is) and `vec` holds one byte per page of it, as mincore writes.
        let r = unsafe {
            libc::mincore(
                self.ptr.as_ptr().add(part.start).cast(),
                part.end - part.start,
                vec.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "mincore: {}", io::Error::last_os_error());
        vec.iter().filter(|&&b| b & 1 != 0).count()
    }

    /// Copies `src` into the mapping at `off`.
    pub fn write(&self, off: usize, src: &[u8]) {
        self.check_range(off, src.len(), 1);
        // SAFETY: the destination range is inside the mapping (checked) and cannot overlap
        // `src`, a Rust slice of this process's own memory or of another mapping's range the
        // protocol keeps disjoint. Writers of this range are excluded by the protocol; a
        // misbehaving peer could only change byte values, which are valid for any pattern.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
        }
    }

    /// Copies `dst.len()` bytes at `off` out of the mapping.
    pub fn read(&self, off: usize, dst: &mut [u8]) {
        self.check_range(off, dst.len(), 1);
        // SAFETY: the source range is inside the mapping (checked); `dst` is exclusively
        // borrowed memory of this process, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        }
    }

    /// The bytes at `off..off + len`, to read while the protocol guarantees that no one writes
    /// them (a peer's published input or result).
    pub fn bytes(&self, off: usize, len: usize) -> &[u8] {
        self.check_range(off, len, 1);
        // SAFETY: in bounds (checked), u8 accepts any bit pattern, and the lifetime is tied to
        // the mapping. The protocol (counters with acquire/release, whose values are checked)
        // ensures nobody writes the range while the slice is used, provided the peers run this
        // protocol: the segments are shared only with the ranks of this host, processes of the
        // same user that could as well write this process's memory directly.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) }
    }

    /// The bytes at `off..off + len` for writing, while the protocol gives this rank exclusive
    /// use of the range (its own slice of its own segment). Takes `&mut self` on the owner's
    /// mapping so two such slices cannot coexist in this process.
    pub fn bytes_mut(&mut self, off: usize, len: usize) -> &mut [u8] {
        self.check_range(off, len, 1);
        // SAFETY: in bounds (checked); `&mut self` makes the slice unique within this process,
        // and the protocol keeps other processes from touching the range meanwhile (given peers
        // that run it; see `bytes`).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping created by `Mapping::map` and not yet unmapped;
        // no reference into it outlives `self` (accessors borrow `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Sleeps while `*word == expected`, for at most `timeout` (process-shared futex). Returns on
/// a wake-up, a timeout, a signal, or at once if the word already differs.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned 32-bit atomic for the duration of the call; the
    // timespec outlives the call; FUTEX_WAIT reads the word and never writes memory. Errors
    // (EAGAIN, ETIMEDOUT, EINTR) all mean "re-check", so the result is ignored.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every thread sleeping in [`futex_wait`] on `word` (in any process).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned 32-bit atomic; FUTEX_WAKE only uses its address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether a peer process still runs.
#[derive(Debug)]
pub enum Liveness {
    /// A peer in this very process (ranks as threads): alive as long as we are.
    SameProcess,
    /// A pidfd of the peer: readable once the process has exited (even before it is reaped,
    /// and immune to pid reuse).
    PidFd(OwnedFd),
    /// Fallback for kernels without pidfds: `kill(pid, 0)`.
    Pid(u32),
    /// The process had exited when it was looked for (`pidfd_open` found no such process):
    /// not `kill(pid, 0)`, which a process given its pid since would answer.
    Gone,
}

impl Liveness {
    /// Watches process `pid`.
    pub fn watch(pid: u32) -> Liveness {
        if pid == std::process::id() {
            return Liveness::SameProcess;
        }
        // SAFETY: pidfd_open takes a pid and flags by value; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0u32) };
        if fd >= 0 {
            // SAFETY: a fresh descriptor returned by pidfd_open, owned by nobody else.
            Liveness::PidFd(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
        } else if io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            Liveness::Gone
        } else {
            Liveness::Pid(pid)
        }
    }

    /// False once the process has exited.
    pub fn alive(&self) -> bool {
        match self {
            Liveness::SameProcess => true,
            Liveness::Gone => false,
            Liveness::PidFd(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout (never blocks).
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                !(n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
            }
            Liveness::Pid(pid) => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(*pid as libc::pid_t, 0) };
                r == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
            }
        }
    }
}

/// Forks into this process seen by the `pthread_atfork` child handler.
static FORKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static FORK_HANDLER: std::sync::Once = std::sync::Once::new();

extern "C" fn forked_child() {
    // Async-signal-safe: one atomic add, no allocation, no lock.
    FORKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// A number that changes in a child forked from this process (after the first call, which
/// installs the handler that counts forks: call it before anything worth protecting exists).
/// Equal numbers mean the same process.
pub fn fork_generation() -> u64 {
    FORK_HANDLER.call_once(|| {
        // SAFETY: registers only a child handler, a plain `extern "C" fn` that does one atomic
        // add (async-signal-safe, as a handler run after fork in a multi-threaded process must
        // be); the function lives as long as the program.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) };
        if rc != 0 {
            crate::note!("pthread_atfork failed ({rc}): a forked child is not recognised");
        }
    });
    FORKS.load(std::sync::atomic::Ordering::SeqCst)
}

/// Run `child` in a forked child of this process, which then ends with its return value as the
/// exit code; returns that code (tests only). `child` must keep to what is safe after a fork
/// in a multi-threaded process (glibc's allocator is).
#[cfg(test)]
pub(crate) fn in_forked_child(child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child runs `child` and ends with `_exit` (no atexit handlers, no unwinding
    // into the parent's frames); the parent only waits for it.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(101);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid);
    assert!(
        libc::WIFEXITED(status),
        "the child did not exit: status {status}"
    );
    libc::WEXITSTATUS(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_sees_another_fork_generation() {
        let before = fork_generation();
        assert_eq!(fork_generation(), before);
        // SAFETY: the child only reads an atomic and calls `_exit` (async-signal-safe).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = if fork_generation() != before { 0 } else { 1 };
            // SAFETY: ends the child at once, running nothing of the parent's.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child, `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(r, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status}"
        );
        assert_eq!(fork_generation(), before, "the parent's generation changed");
    }
    use std::sync::atomic::Ordering;

    #[test]
    fn memfd_map_share_and_reopen() {
        let fd = memfd("chorus-test", 4096).unwrap();
        let a = Mapping::map(&fd, 4096).unwrap();
        let reopened = open_peer_fd(std::process::id(), fd.as_raw_fd()).unwrap();
        let b = Mapping::map(&reopened, 4096).unwrap();
        a.u64_at(64).store(0xdead_beef, Ordering::Release);
        assert_eq!(b.u64_at(64).load(Ordering::Acquire), 0xdead_beef);
        a.write(100, b"hello");
        let mut out = [0u8; 5];
        b.read(100, &mut out);
        assert_eq!(&out, b"hello");
        assert!(Mapping::map(&fd, 8192).is_err(), "mapping past the end");
    }

    #[test]
    fn segments_are_sealed_at_their_size() {
        let fd = memfd("chorus-test", 8192).unwrap();
        assert!(cannot_shrink(&fd));
        // Neither this process nor a peer that reopened it can change its size.
        let reopened = open_peer_fd(std::process::id(), fd.as_raw_fd()).unwrap();
        assert!(cannot_shrink(&reopened));
        let f = File::from(reopened);
        assert!(f.set_len(4096).is_err(), "shrunk a sealed segment");
        assert!(f.set_len(16384).is_err(), "grew a sealed segment");
        assert_eq!(f.metadata().unwrap().len(), 8192);
        // A file that takes no seals is not taken for a sealed segment.
        let path = std::env::temp_dir().join(format!("chorus-seal-test-{}", std::process::id()));
        let plain = File::create(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(!cannot_shrink(&OwnedFd::from(plain)));
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_bounds_access_panics() {
        let fd = memfd("chorus-test", 4096).unwrap();
        let a = Mapping::map(&fd, 4096).unwrap();
        a.write(4090, &[0u8; 8]);
    }

    /// A wake from another process ends a wait on a shared word at once (FUTEX_WAKE, not
    /// the private form, which would leave the waiter to its timeout).
    #[test]
    fn futex_wake_reaches_a_waiter_in_another_process() {
        let fd = memfd("chorus-test", 4096).unwrap();
        let m = Mapping::map(&fd, 4096).unwrap();
        let word = m.u32_at(0);
        std::thread::scope(|s| {
            let waker = s.spawn(|| {
                in_forked_child(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    m.u32_at(0).store(1, Ordering::SeqCst);
                    futex_wake(m.u32_at(0));
                    0
                })
            });
            let t = std::time::Instant::now();
            while word.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(5) {
                futex_wait(word, 0, Duration::from_secs(5));
            }
            let took = t.elapsed();
            assert_eq!(waker.join().unwrap(), 0);
            assert_eq!(word.load(Ordering::SeqCst), 1);
            assert!(took < Duration::from_secs(2), "woken after {took:?}");
        });
        // A word that differs: no wait at all.
        let t = std::time::Instant::now();
        futex_wait(word, 7, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn futex_times_out_and_liveness_of_self() {
        let w = AtomicU32::new(5);
        let t = std::time::Instant::now();
        futex_wait(&w, 5, Duration::from_millis(20));
        assert!(t.elapsed() >= Duration::from_millis(15));
        futex_wait(&w, 6, Duration::from_secs(5)); // differs: returns at once
        futex_wake(&w);
        assert!(Liveness::watch(std::process::id()).alive());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let l = Liveness::watch(child.id());
        child.wait().unwrap();
        assert!(!l.alive());
        // Watched only after it exited and was reaped: gone, whatever has its pid now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let l = Liveness::watch(pid);
        assert!(matches!(l, Liveness::Gone), "{l:?}");
        assert!(!l.alive());
    }
}
