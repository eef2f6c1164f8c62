//! Every conversion from a C pointer to a Rust reference, in one place. Each helper checks for
//! NULL (an invalid-argument [`Failure`] naming the parameter) and states what it relies on.

use std::ffi::{c_char, c_void, CStr};

use std::sync::atomic::Ordering;

use crate::registry::{Known, COMMS};
use crate::status::Failure;
use crate::{chorus_comm, chorus_options, Entered};

/// The communicator behind `p`, counted as in a call (`chorus_comm::active`) until the
/// returned guard drops: NULL, a pointer that is not a live communicator (destroyed already,
/// or never one) and one being destroyed are refused. Checked and counted under the
/// registry's lock, which `chorus_comm_destroy` takes to see whether a call is inside and to
/// close the communicator to new ones, so that a destroy on another thread cannot free it
/// in between, or while the guard lives.
///
/// # Safety
/// `p` is NULL or was returned by `chorus_comm_init*` (destroyed or not).
pub(crate) unsafe fn comm<'a>(
    p: *const chorus_comm,
) -> Result<(&'a chorus_comm, Entered<'a>), Failure> {
    // SAFETY: as the caller promised.
    unsafe { enter(p, false) }
}

/// [`comm`], also for a communicator being destroyed (for `chorus_comm_abort`, which cuts a
/// destroy's wait short; the destroy frees it once the abort has returned).
///
/// # Safety
/// As for [`comm`].
pub(crate) unsafe fn comm_even_closing<'a>(
    p: *const chorus_comm,
) -> Result<(&'a chorus_comm, Entered<'a>), Failure> {
    // SAFETY: as the caller promised.
    unsafe { enter(p, true) }
}

/// [`comm`] and [`comm_even_closing`].
///
/// # Safety
/// As for [`comm`].
unsafe fn enter<'a>(
    p: *const chorus_comm,
    even_closing: bool,
) -> Result<(&'a chorus_comm, Entered<'a>), Failure> {
    if p.is_null() {
        return Err(Failure::invalid("comm is NULL"));
    }
    let registry = COMMS.lock();
    if registry.known(p) == Known::Unknown {
        return Err(Failure::invalid(format!(
            "comm {p:p} is not a live communicator (destroyed already, or never one)"
        )));
    }
    // SAFETY: registered (this process's, or a forked parent's copy), so made by
    // `Box::into_raw` and not taken back; it is not while the registry's lock is held, and
    // once counted in below, not until the guard drops (a destroy refuses while one is).
    let c = unsafe { &*p };
    if !even_closing && c.closing.load(Ordering::SeqCst) {
        return Err(Failure::invalid(format!(
            "comm {p:p} is being destroyed by another thread"
        )));
    }
    let entered = Entered::new(&c.active);
    drop(registry);
    Ok((c, entered))
}

/// Hand a communicator to C.
pub(crate) fn into_raw(c: chorus_comm) -> *mut chorus_comm {
    let p = Box::into_raw(Box::new(c));
    COMMS.add(p);
    p
}

/// Store `value` through the out-parameter `p` named `what`.
///
/// # Safety
/// `p` is NULL or valid for writing a `T` (aligned).
pub(crate) unsafe fn write_out<T>(p: *mut T, value: T, what: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    check_aligned(p, what)?;
    // SAFETY: non-NULL and aligned (checked), and the caller promises it is valid for writes
    // of a `T`.
    unsafe { p.write(value) };
    Ok(())
}

/// Refuses a pointer that is not aligned for `T` (NULL passes: checked where it matters).
pub(crate) fn check_aligned<T>(p: *const T, what: &str) -> Result<(), Failure> {
    if p as usize % std::mem::align_of::<T>() != 0 {
        return Err(Failure::invalid(format!(
            "{what} ({p:p}) is not aligned for its type ({} bytes)",
            std::mem::align_of::<T>()
        )));
    }
    Ok(())
}

/// Check an out-parameter before doing work whose result it will receive.
pub(crate) fn check_out<T>(p: *mut T, what: &str) -> Result<(), Failure> {
    if p.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    // Before anything is made or done that the failed write would lose (a compressor, a
    // completed request).
    check_aligned(p, what)
}

/// The UTF-8 string at `p` (`None` for NULL).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays alive during the call.
pub(crate) unsafe fn opt_str<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's promise.
    let c = unsafe { CStr::from_ptr(p) };
    c.to_str()
        .map(Some)
        .map_err(|_| Failure::invalid(format!("{what} is not valid UTF-8")))
}

/// The byte length of `count` elements of `elem` bytes, or an invalid-argument failure when it
/// does not fit in memory.
pub(crate) fn byte_len(count: usize, elem: usize, what: &str) -> Result<usize, Failure> {
    count
        .checked_mul(elem)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Failure::invalid(format!(
                "{what}: {count} elements of {elem} bytes do not fit in memory"
            ))
        })
}

/// A buffer checked when a call is issued and made into a slice when the call runs, which for
/// the nonblocking calls is later and on the communicator's queue thread, and for the blocking
/// ones after the nonblocking calls issued before them have ended (they may use the same
/// memory: no slice of it may exist meanwhile).
#[derive(Clone, Copy)]
pub(crate) struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `RawBuf` is an address and a length. Making a slice of it is `unsafe`, and whoever
// does relies on the C caller's promise that the memory stays valid and untouched until the
// call completes, whichever thread runs it.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// The `len` bytes at `p` (`len` from [`byte_len`]); NULL is accepted only when `len` is 0.
    pub(crate) fn new(p: *const c_void, len: usize, what: &str) -> Result<RawBuf, Failure> {
        if len > 0 && p.is_null() {
            return Err(Failure::invalid(format!("{what} is NULL")));
        }
        Ok(RawBuf {
            ptr: p.cast::<u8>().cast_mut(),
            len,
        })
    }

    /// How many bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes, to read.
    ///
    /// # Safety
    /// The memory is valid for reading `len` bytes while the slice lives, and nothing writes it
    /// meanwhile (the other buffer of the call was checked apart from it).
    pub(crate) unsafe fn get<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: non-NULL (checked in `new`), `len` ≤ isize::MAX, readable by the promise.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// The memory is valid for reading and writing `len` bytes while the slice lives, and
    /// nothing else accesses it meanwhile.
    pub(crate) unsafe fn get_mut<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: non-NULL (checked in `new`), `len` ≤ isize::MAX, exclusively ours by the
        // promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The byte ranges of a communicator's live transfers (`chorus_isend`, `chorus_irecv`, their
/// batches, and `chorus_send`/`chorus_recv` while transfers run): no receive's may overlap
/// another transfer's, as the transport holds a read or write view of each until its request
/// is waited for (or, given up, until it ends). Each is `(id, start, end, written)`.
#[derive(Default)]
pub(crate) struct LiveBuffers {
    next: u64,
    list: Vec<(u64, usize, usize, bool)>,
}

/// [`LiveBuffers`], shared by a communicator and the leases of its transfers.
pub(crate) type Live = std::sync::Arc<std::sync::Mutex<LiveBuffers>>;

fn lock_live(live: &Live) -> std::sync::MutexGuard<'_, LiveBuffers> {
    live.lock().unwrap_or_else(|p| p.into_inner())
}

/// A transfer's hold on its buffer's range in [`LiveBuffers`], let go when dropped (with the
/// buffer, once the request is waited for or the given-up transfer ends).
pub(crate) struct Lease {
    live: Live,
    id: u64,
    /// The process that took it: in a child forked since, the list is the parent's copy,
    /// whose lock a parent's thread may have held at the fork, and is left alone.
    pid: u32,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            lock_live(&self.live).list.retain(|e| e.0 != self.id);
        }
    }
}

/// A lease on `buf` for a transfer that writes it (`written`) or reads it; refused when the
/// range overlaps a live transfer's and either of the two writes (sends may share memory).
/// An empty buffer takes no lease.
pub(crate) fn lease(live: &Live, buf: RawBuf, written: bool) -> Result<Option<Lease>, Failure> {
    lease_all(live, &[(buf, written)], false).map(|mut l| l.pop().flatten())
}

/// [`lease`] for every buffer of a batch, all or none: each is checked against the
/// transfers live before the batch only (its buffers among themselves were checked apart
/// already, by [`check_receives_apart`]), so a batch of n against L live transfers costs
/// n·L, not n². With `batch`, an error names the op (`ops[i]`).
pub(crate) fn lease_all(
    live: &Live,
    bufs: &[(RawBuf, bool)],
    batch: bool,
) -> Result<Vec<Option<Lease>>, Failure> {
    let mut l = lock_live(live);
    for (i, &(buf, written)) in bufs.iter().enumerate() {
        if buf.len == 0 {
            continue;
        }
        let start = buf.ptr as usize;
        let Some(end) = start.checked_add(buf.len) else {
            return Err(Failure::invalid(format!(
                "{}the buffer runs past the end of the address space ({:#x} + {} bytes)",
                if batch {
                    format!("ops[{i}]: ")
                } else {
                    String::new()
                },
                start,
                buf.len
            )));
        };
        if let Some(&(_, _, _, theirs)) = l
            .list
            .iter()
            .find(|&&(_, a, b, w)| start < b && a < end && (written || w))
        {
            let which = if batch {
                format!("ops[{i}]: ")
            } else {
                String::new()
            };
            return Err(Failure::invalid(format!(
                "{which}the buffer of this {} overlaps that of a live {} (issued and not yet \
                 waited for): wait for that request first",
                if written { "receive" } else { "send" },
                if theirs { "receive" } else { "send" }
            )));
        }
    }
    let pid = std::process::id();
    let mut out = Vec::with_capacity(bufs.len());
    for &(buf, written) in bufs {
        if buf.len == 0 {
            out.push(None);
            continue;
        }
        let id = l.next;
        l.next += 1;
        // (Checked above: it does not wrap.)
        l.list
            .push((id, buf.ptr as usize, buf.ptr as usize + buf.len, written));
        out.push(Some(Lease {
            live: std::sync::Arc::clone(live),
            id,
            pid,
        }));
    }
    Ok(out)
}

/// The buffer of a `chorus_isend`, read by the communicator's thread until the transfer
/// completes, and its lease.
pub(crate) struct Outgoing {
    buf: RawBuf,
    /// Held for its `Drop`.
    _lease: Option<Lease>,
}

impl Outgoing {
    pub(crate) fn new(buf: RawBuf, lease: Option<Lease>) -> Outgoing {
        Outgoing { buf, _lease: lease }
    }
}

/// The buffer of a `chorus_irecv`, written by the communicator's thread until the transfer
/// completes, and its lease.
pub(crate) struct Incoming {
    buf: RawBuf,
    /// Held for its `Drop`.
    _lease: Option<Lease>,
}

impl Incoming {
    pub(crate) fn new(buf: RawBuf, lease: Option<Lease>) -> Incoming {
        Incoming { buf, _lease: lease }
    }
}

impl chorus_core::SendBuffer for Outgoing {
    fn send_bytes(&self) -> &[u8] {
        // SAFETY: the caller of `chorus_isend` promised the memory stays valid and unwritten
        // until the request completes; the queue reads it only while the transfer is live.
        unsafe { self.buf.get() }
    }
    fn send_len(&self) -> usize {
        self.buf.len()
    }
}

impl chorus_core::RecvBuffer for Incoming {
    fn recv_bytes(&mut self) -> &mut [u8] {
        // SAFETY: the caller of `chorus_irecv` promised the memory stays valid and untouched
        // until the request completes; the queue writes it only while the transfer is live,
        // through this one slice at a time (`&mut self`).
        unsafe { self.buf.get_mut() }
    }
    fn recv_len(&self) -> usize {
        self.buf.len()
    }
}

/// `send` to read and `recv` to write, for a call running now; when they `overlap`, `send` is
/// read from a copy made first in `copy` (the shared slice of it gone before `recv`'s mutable
/// one is made).
///
/// # Safety
/// As [`RawBuf::get`] for `send` and [`RawBuf::get_mut`] for `recv` while the slices live,
/// and `overlap` is false only when the two are disjoint.
pub(crate) unsafe fn apart(
    send: RawBuf,
    recv: RawBuf,
    overlap: bool,
    copy: &mut Vec<u8>,
) -> (&[u8], &mut [u8]) {
    if overlap {
        // SAFETY: readable by the caller's promise; the slice ends with the copy.
        copy.extend_from_slice(unsafe { send.get() });
        // SAFETY: writable and otherwise untouched by the caller's promise.
        (copy.as_slice(), unsafe { recv.get_mut() })
    } else {
        // SAFETY: as promised, and disjoint.
        unsafe { (send.get(), recv.get_mut()) }
    }
}

/// The `n` counts (`size_t`) at `p`, copied; NULL (with `n` > 0) or a misaligned pointer is
/// an error.
///
/// # Safety
/// Unless NULL or misaligned, `p` is valid for reading `n` `size_t` values during the call.
pub(crate) unsafe fn counts(p: *const usize, n: usize, what: &str) -> Result<Vec<usize>, Failure> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    if p as usize % std::mem::align_of::<usize>() != 0 {
        return Err(Failure::invalid(format!(
            "{what} is not aligned for size_t"
        )));
    }
    // SAFETY: non-NULL and aligned, valid for `n` values by the caller's promise (`n` is the
    // communicator's size, at most 2^20, so the byte length fits isize).
    Ok(unsafe { std::slice::from_raw_parts(p, n) }.to_vec())
}

/// The `n` entries of type `T` at `p`, borrowed for the call; NULL (with `n` > 0) or a
/// misaligned pointer is an error.
///
/// # Safety
/// Unless NULL or misaligned, `p` is valid for reading `n` values of `T` (`n` small enough for
/// their bytes to fit `isize`) during the call, and every bit pattern of them is a valid `T`.
pub(crate) unsafe fn array<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::invalid(format!("{what} is NULL")));
    }
    if p as usize % std::mem::align_of::<T>() != 0 {
        return Err(Failure::invalid(format!("{what} is misaligned")));
    }
    // SAFETY: non-NULL and aligned, valid for `n` values by the caller's promise.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Fail unless every receive range of `ranges` (`(start, len, is_receive, index)`) is apart
/// from every other range, receive or not; ranges that are not receives may overlap each
/// other (one buffer sent to several peers). Empty ranges overlap nothing. Sorts `ranges`.
pub(crate) fn check_receives_apart(
    mut ranges: Vec<(usize, usize, bool, usize)>,
) -> Result<(), Failure> {
    ranges.retain(|r| r.1 > 0);
    ranges.sort_unstable_by_key(|r| r.0);
    let overlap = |a: usize, b: usize| {
        Failure::invalid(format!(
            "ops[{}].buf and ops[{}].buf overlap: a receive's buffer must be apart from every \
             other buffer of the batch",
            a.min(b),
            a.max(b)
        ))
    };
    // The furthest end so far of any range, and of any receive, with the entry's index: in
    // start order, a range overlaps an earlier one exactly when it starts before that end.
    let mut any: Option<(usize, usize)> = None;
    let mut recv: Option<(usize, usize)> = None;
    for &(start, len, is_recv, i) in &ranges {
        let end = start.saturating_add(len);
        if let Some((_, j)) = recv.filter(|&(e, _)| start < e) {
            return Err(overlap(j, i));
        }
        if let Some((_, j)) = any.filter(|&(e, _)| is_recv && start < e) {
            return Err(overlap(j, i));
        }
        if any.map_or(true, |(e, _)| end > e) {
            any = Some((end, i));
        }
        if is_recv && recv.map_or(true, |(e, _)| end > e) {
            recv = Some((end, i));
        }
    }
    Ok(())
}

/// Fail unless the byte ranges `[a, a + a_len)` and `[b, b + b_len)` are disjoint (empty
/// ranges never overlap), for calls that have no in-place form. Called before making a shared
/// and a mutable slice of two buffers.
pub(crate) fn check_apart(
    a: *const c_void,
    a_len: usize,
    b: *const c_void,
    b_len: usize,
    what: &str,
) -> Result<(), Failure> {
    let (a, b) = (a as usize, b as usize);
    if a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len) {
        return Err(Failure::invalid(format!("{what} overlap")));
    }
    Ok(())
}

/// [`check_apart`] for calls whose in-place form is one buffer being this rank's block of the
/// other: the error says which (`in_place`, e.g. "sendbuf at recvbuf + rank × sendcount").
pub(crate) fn check_apart_or_block(
    a: *const c_void,
    a_len: usize,
    b: *const c_void,
    b_len: usize,
    in_place: &str,
) -> Result<(), Failure> {
    check_apart(a, a_len, b, b_len, "").map_err(|_| {
        Failure::invalid(format!(
            "sendbuf and recvbuf overlap without being in place (in place is {in_place})"
        ))
    })
}

/// [`check_apart`] for calls that take equal pointers as in place: the error says so.
pub(crate) fn check_disjoint(
    a: *const c_void,
    a_len: usize,
    b: *const c_void,
    b_len: usize,
    what: &str,
) -> Result<(), Failure> {
    check_apart(a, a_len, b, b_len, what).map_err(|_| {
        Failure::invalid(format!(
            "{what} overlap without being the same buffer (pass equal pointers for in place)"
        ))
    })
}

/// The largest versioned struct (options, report) accepted: a guard against a garbage `size`
/// field.
pub(crate) const MAX_VERSIONED_SIZE: usize = 4096;

/// The options at `p` (`None` for NULL), checked against their `size` field.
///
/// A `size` below this version's struct is invalid (there is no older version); above it,
/// from a newer header, is accepted when every field this library does not know is zero
/// (unset), and unsupported otherwise.
///
/// # Safety
/// `p` is NULL or points to a `chorus_options` whose `size` field says how many bytes are
/// readable there.
pub(crate) unsafe fn options(p: *const chorus_options) -> Result<Option<chorus_options>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL; the first field, `size`, is always present.
    let size = unsafe { p.cast::<usize>().read_unaligned() };
    let ours = std::mem::size_of::<chorus_options>();
    if size < ours || size > MAX_VERSIONED_SIZE {
        return Err(Failure::invalid(format!(
            "options: size field is {size}, expected sizeof(chorus_options) = {ours} \
             (initialise the struct with CHORUS_OPTIONS_INIT)"
        )));
    }
    if size > ours {
        // SAFETY: the caller says `size` bytes are readable at `p`.
        let tail = unsafe { std::slice::from_raw_parts(p.cast::<u8>().add(ours), size - ours) };
        if tail.iter().any(|&b| b != 0) {
            return Err(Failure::new(
                crate::status::chorus_status::CHORUS_UNSUPPORTED,
                format!(
                    "options: the struct has {size} bytes with fields set that this library \
                     (chorus {}) does not know",
                    chorus_core::VERSION
                ),
            ));
        }
    }
    // SAFETY: `size` ≥ our struct's size, so a whole `chorus_options` is readable at `p`.
    Ok(Some(unsafe { p.read_unaligned() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_rules() {
        let b = [0u8; 16];
        let p = b.as_ptr().cast::<c_void>();
        // SAFETY: offsets stay inside `b`.
        let q = unsafe { p.cast::<u8>().add(8).cast::<c_void>() };
        assert!(check_disjoint(p, 8, q, 8, "x").is_ok());
        assert!(check_disjoint(p, 9, q, 8, "x").is_err());
        assert!(check_disjoint(q, 8, p, 9, "x").is_err());
        assert!(check_disjoint(p, 16, p, 16, "x").is_err());
        assert!(check_disjoint(p, 0, p, 16, "x").is_ok());
    }

    #[test]
    fn receives_of_a_batch_overlap_nothing() {
        let ok = |v: &[(usize, usize, bool)]| {
            let ranges = v
                .iter()
                .enumerate()
                .map(|(i, &(a, l, r))| (a, l, r, i))
                .collect();
            check_receives_apart(ranges).map_err(|f| f.message)
        };
        // Sends may share bytes; receives next to them are fine; empty ones overlap nothing.
        assert!(ok(&[
            (0, 8, false),
            (0, 8, false),
            (8, 8, true),
            (16, 4, true),
            (4, 0, true)
        ])
        .is_ok());
        let e = ok(&[(100, 8, true), (0, 8, false), (104, 8, false)]).unwrap_err();
        assert!(e.starts_with("ops[0].buf and ops[2].buf overlap"), "{e}");
        // A long send covering a later receive, past a short one in between.
        let e = ok(&[(0, 100, false), (10, 2, false), (50, 4, true)]).unwrap_err();
        assert!(e.starts_with("ops[0].buf and ops[2].buf"), "{e}");
        // Two receives.
        let e = ok(&[(0, 10, true), (9, 10, true)]).unwrap_err();
        assert!(e.starts_with("ops[0].buf and ops[1].buf"), "{e}");
        // A receive then a send inside it.
        let e = ok(&[(20, 1, false), (0, 100, true)]).unwrap_err();
        assert!(e.starts_with("ops[0].buf and ops[1].buf"), "{e}");
    }

    #[test]
    fn apart_copies_an_overlapping_input_first() {
        let mut b = [1u8, 2, 3, 4, 5, 6];
        let p = b.as_mut_ptr().cast::<c_void>();
        let send = RawBuf::new(p, 6, "send").unwrap();
        // SAFETY: offset inside `b`.
        let recv = RawBuf::new(unsafe { p.cast::<u8>().add(2) }.cast(), 2, "recv").unwrap();
        let mut copy = Vec::new();
        // SAFETY: `b` outlives the slices, which are used only here.
        let (s, r) = unsafe { apart(send, recv, true, &mut copy) };
        r.copy_from_slice(&s[4..6]);
        assert_eq!(s, [1, 2, 3, 4, 5, 6], "the input is read from the copy");
        assert_eq!(b, [1, 2, 5, 6, 5, 6]);
    }

    #[test]
    fn byte_len_rejects_overflow() {
        assert_eq!(byte_len(3, 4, "x").unwrap(), 12);
        assert!(byte_len(usize::MAX, 2, "x").is_err());
        assert!(byte_len(isize::MAX as usize, 2, "x").is_err());
    }
}
