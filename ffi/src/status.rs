//! Status codes, this thread's last error message, and the panic boundary every export runs in.

use std::any::Any;
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use chorus_core::{CommError, ErrorKind};

/// The result of every chorus call that can fail, returned as an `int32_t`.
///
/// The numbers are part of the ABI: they are explicit, never change meaning and are never
/// reused. `CHORUS_INVALID_ARGUMENT` and `CHORUS_UNSUPPORTED` leave the communicator usable;
/// after `CHORUS_SYSTEM_ERROR`, `CHORUS_REMOTE_ERROR`, `CHORUS_TIMEOUT` and `CHORUS_MISMATCH`
/// raised by a collective the communicator is unusable: call `chorus_comm_abort`, then
/// `chorus_comm_destroy`, and build a new one. `chorus_last_error()` tells the details, and
/// whether the communicator survived: the message of a call on one ends in
/// `[communicator still usable]` or `[communicator unusable: ...]`. It survives the
/// refusals (`CHORUS_INVALID_USAGE`) and a few failures that moved nothing on the wire: a
/// mismatch `CHORUS_CHECK_CALLS` finds before the call runs, a split's invalid color on some
/// rank, a transfer to this rank itself that found no partner.
#[allow(non_camel_case_types, clippy::upper_case_acronyms)]
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum chorus_status {
    /// Success.
    CHORUS_OK = 0,
    /// A bad argument: NULL pointer, unknown dtype/op/algorithm, wrong size, overlapping
    /// buffers. Nothing was sent, and the communicator is still usable, except where the
    /// error says otherwise (with `CHORUS_CHECK_CALLS`, an argument refused on one rank
    /// only once the others wait for it; a freed request's call that failed). A refused
    /// collective still takes its place in the order of collectives: every rank makes it,
    /// refused or not (do not retry it); refused on some ranks only, the others fail as a
    /// mismatch in that call (with `CHORUS_CHECK_CALLS`) or in the next.
    CHORUS_INVALID_ARGUMENT = 1,
    /// A call not allowed in this state: a communicator that is aborted or broken by an
    /// earlier error, or used from two threads at once.
    CHORUS_INVALID_USAGE = 2,
    /// An operating-system error (socket, bind, address resolution).
    CHORUS_SYSTEM_ERROR = 3,
    /// A peer was lost, aborted or sent garbage (`chorus_last_error` names it).
    CHORUS_REMOTE_ERROR = 4,
    /// A peer did not answer within the timeout.
    CHORUS_TIMEOUT = 5,
    /// Ranks called different collectives, or with different counts, dtypes or ops.
    CHORUS_MISMATCH = 6,
    /// Not supported by this build or for this combination of arguments.
    CHORUS_UNSUPPORTED = 7,
    /// A bug in chorus (an internal panic was caught at the C boundary).
    CHORUS_INTERNAL_ERROR = 8,
}

/// Every status, in numeric order.
const ALL_STATUSES: [chorus_status; 9] = [
    chorus_status::CHORUS_OK,
    chorus_status::CHORUS_INVALID_ARGUMENT,
    chorus_status::CHORUS_INVALID_USAGE,
    chorus_status::CHORUS_SYSTEM_ERROR,
    chorus_status::CHORUS_REMOTE_ERROR,
    chorus_status::CHORUS_TIMEOUT,
    chorus_status::CHORUS_MISMATCH,
    chorus_status::CHORUS_UNSUPPORTED,
    chorus_status::CHORUS_INTERNAL_ERROR,
];

impl chorus_status {
    /// The status of an error of class `kind`.
    pub fn from_kind(kind: ErrorKind) -> chorus_status {
        match kind {
            ErrorKind::InvalidArgument => chorus_status::CHORUS_INVALID_ARGUMENT,
            ErrorKind::InvalidUsage => chorus_status::CHORUS_INVALID_USAGE,
            ErrorKind::System => chorus_status::CHORUS_SYSTEM_ERROR,
            ErrorKind::Remote => chorus_status::CHORUS_REMOTE_ERROR,
            ErrorKind::Timeout => chorus_status::CHORUS_TIMEOUT,
            ErrorKind::Mismatch => chorus_status::CHORUS_MISMATCH,
            ErrorKind::Unsupported => chorus_status::CHORUS_UNSUPPORTED,
            ErrorKind::Internal => chorus_status::CHORUS_INTERNAL_ERROR,
        }
    }

    /// The status numbered `code`, if any.
    pub fn from_code(code: i32) -> Option<chorus_status> {
        ALL_STATUSES.into_iter().find(|s| *s as i32 == code)
    }

    /// A short description, NUL-terminated for C.
    pub fn describe(self) -> &'static CStr {
        match self {
            chorus_status::CHORUS_OK => c"success",
            chorus_status::CHORUS_INVALID_ARGUMENT => c"invalid argument",
            chorus_status::CHORUS_INVALID_USAGE => c"invalid usage",
            chorus_status::CHORUS_SYSTEM_ERROR => c"system error",
            chorus_status::CHORUS_REMOTE_ERROR => c"remote error (a peer was lost or misbehaved)",
            chorus_status::CHORUS_TIMEOUT => c"timeout",
            chorus_status::CHORUS_MISMATCH => c"mismatch across ranks",
            chorus_status::CHORUS_UNSUPPORTED => c"unsupported",
            chorus_status::CHORUS_INTERNAL_ERROR => c"internal error",
        }
    }
}

/// Why a call failed: the status it returns and the message `chorus_last_error` gives.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: chorus_status,
    pub(crate) message: String,
}

impl Failure {
    /// This failure of a destroy call: the object was left as it was.
    pub(crate) fn not_freed(mut self) -> Failure {
        self.message.push_str("; it was not freed");
        self
    }

    /// An invalid-argument failure.
    pub(crate) fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            status: chorus_status::CHORUS_INVALID_ARGUMENT,
            message: message.into(),
        }
    }

    /// A failure with an explicit status.
    pub(crate) fn new(status: chorus_status, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }
}

impl From<CommError> for Failure {
    fn from(e: CommError) -> Failure {
        Failure {
            status: chorus_status::from_kind(e.kind()),
            message: e.to_string(),
        }
    }
}

thread_local! {
    /// This thread's last error message (empty after a successful call).
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Replace this thread's last error message.
fn set_last_error(message: &str) {
    // An interior NUL would cut the message short in C; it never comes from chorus itself.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // After this thread's locals are destroyed (a call from an `atexit` handler or a C++
    // static destructor: glibc's `exit` destroys the main thread's first), the message is
    // lost rather than the call panicking outside its guard.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = c);
}

/// Puts back a message saved from [`last_error_ptr`] (`chorus_set_last_error`).
pub(crate) fn restore_last_error(message: &str) {
    set_last_error(message);
}

/// A pointer to this thread's last error message, valid until this thread's next call into
/// chorus (other than `chorus_last_error`, `chorus_status_string` and `chorus_version`).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// The text of a panic payload.
fn panic_message(p: &(dyn Any + Send)) -> &str {
    p.downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| p.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)")
}

/// The panic boundary: runs `body` for the export `name`, records the message of a failure as
/// this thread's last error (named after `name`: a library error's leading `chorus: ` becomes
/// `name: `, a message naming no chorus function gets `name: ` in front), and
/// turns a panic into `CHORUS_INTERNAL_ERROR`. Every export that can fail goes through here.
/// `SIGPIPE` is blocked in this thread meanwhile (see [`crate::sigpipe`]).
pub(crate) fn guard(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> i32 {
    let _sigpipe = crate::sigpipe::SigpipeBlock::new();
    set_last_error("");
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => chorus_status::CHORUS_OK as i32,
        Ok(Err(f)) => {
            if let Some(rest) = f.message.strip_prefix("chorus: ") {
                // A library error ("chorus: rank 0: all_reduce failed ..."): named after the
                // C function called instead.
                set_last_error(&format!("{name}: {rest}"));
            } else if f.message.starts_with("chorus") {
                set_last_error(&f.message);
            } else {
                set_last_error(&format!("{name}: {}", f.message));
            }
            f.status as i32
        }
        Err(p) => {
            let f = internal_error(p);
            set_last_error(&format!("{name}: {}", f.message));
            f.status as i32
        }
    }
}

/// The failure a caught panic (payload `p`) becomes. The payload is dropped inside a
/// `catch_unwind` of its own: a payload whose drop panics in turn must not unwind further.
pub(crate) fn internal_error(p: Box<dyn Any + Send>) -> Failure {
    let message = format!(
        "internal error (a bug in chorus, please report it): {}",
        panic_message(&*p)
    );
    if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(p))) {
        // Leaked: dropping this payload could panic again.
        std::mem::forget(again);
    }
    Failure::new(chorus_status::CHORUS_INTERNAL_ERROR, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: the pointer is this thread's message, alive until the next call.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn codes_are_fixed_and_distinct() {
        let codes: Vec<i32> = ALL_STATUSES.iter().map(|s| *s as i32).collect();
        assert_eq!(codes, (0..9).collect::<Vec<_>>());
        for s in ALL_STATUSES {
            assert_eq!(chorus_status::from_code(s as i32), Some(s));
        }
        assert_eq!(chorus_status::from_code(9), None);
        assert_eq!(chorus_status::from_code(-1), None);
        let kinds = [
            (ErrorKind::InvalidArgument, 1),
            (ErrorKind::InvalidUsage, 2),
            (ErrorKind::System, 3),
            (ErrorKind::Remote, 4),
            (ErrorKind::Timeout, 5),
            (ErrorKind::Mismatch, 6),
            (ErrorKind::Unsupported, 7),
            (ErrorKind::Internal, 8),
        ];
        for (k, code) in kinds {
            assert_eq!(chorus_status::from_kind(k) as i32, code, "{k:?}");
        }
    }

    #[test]
    fn guard_records_failures_and_catches_panics() {
        assert_eq!(guard("f", || Ok(())), 0);
        assert_eq!(last(), "");
        assert_eq!(guard("f", || Err(Failure::invalid("bad count"))), 1);
        assert_eq!(last(), "f: bad count");
        let code = guard("g", || panic!("boom"));
        assert_eq!(code, chorus_status::CHORUS_INTERNAL_ERROR as i32);
        assert!(last().contains("boom"), "{}", last());
        assert!(last().starts_with("g: internal error"), "{}", last());
        assert_eq!(guard("f", || Ok(())), 0);
        assert_eq!(last(), "", "a successful call clears the message");
        guard("f", || Err(Failure::invalid("nul\0inside")));
        assert_eq!(last(), "f: nul\\0inside");
        // A library error is named after the C function instead of "chorus".
        let e = CommError::invalid("all_reduce", "recv buffer too short").at_rank(2);
        assert_eq!(guard("chorus_allreduce", || Err(e.into())), 1);
        assert!(
            last().starts_with("chorus_allreduce: rank 2: all_reduce failed"),
            "{}",
            last()
        );
    }
}
