//! The handles of each kind (communicators, compressors, requests) this process has handed to
//! C and not yet taken back, by address: a pointer that is not among them (destroyed or freed
//! already, or never a handle) is refused instead of being used.
//!
//! Each entry records the process it was made in (the fork generation,
//! [`chorus_transport::fork_generation`], and the pid): in a forked child, the entries copied
//! from its parent are told apart as the parent's (whose handles the child may not free or
//! complete). The registries are locked
//! around `fork()` by `pthread_atfork` handlers, so the child's copy is never one that a
//! parent's thread (which the child does not have) held locked at the fork.
//!
//! What this cannot see: a handle destroyed and its address then reused for a new handle of
//! the same kind (the stale pointer then names the new one). A destroy racing with a call on
//! another thread is seen: calls on a communicator or a compressor are counted in under its
//! registry's lock, which the destroy takes to refuse while one is inside (and, for a
//! communicator, to close it to new calls while it waits for its nonblocking ones).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

/// The communicators handed to C and not yet destroyed.
pub(crate) static COMMS: Handles = Handles::new();
/// The compressors handed to C and not yet destroyed.
pub(crate) static COMPRESSORS: Handles = Handles::new();
/// The requests handed to C and not yet completed or freed.
pub(crate) static REQUESTS: Handles = Handles::new();

/// The registries, in the order the fork handlers lock them.
static ALL: [&Handles; 3] = [&COMMS, &COMPRESSORS, &REQUESTS];

/// The process a handle was made in: the fork generation and the process id (a child made
/// by a raw `clone`, which runs no fork handlers, still has a pid of its own).
type Maker = (u64, u32);

type Entries = BTreeMap<usize, Maker>;

/// One kind's registry: address to the process the handle was made in.
pub(crate) struct Handles {
    set: Mutex<Entries>,
}

/// Where a pointer stands in a registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// A live handle of this process.
    Live,
    /// A handle a process this one was forked from had live at the fork.
    Parents,
    /// Neither.
    Unknown,
}

/// A registry, locked: while held, no handle of its kind is added or taken.
pub(crate) struct Locked {
    entries: MutexGuard<'static, Entries>,
    me: Maker,
}

impl Locked {
    /// Where `p` stands.
    pub(crate) fn known<T>(&self, p: *const T) -> Known {
        match self.entries.get(&(p as usize)) {
            Some(&m) if m == self.me => Known::Live,
            Some(_) => Known::Parents,
            None => Known::Unknown,
        }
    }

    /// Records `p` as handed out by this process.
    pub(crate) fn add<T>(&mut self, p: *const T) {
        self.entries.insert(p as usize, self.me);
    }

    /// Takes `p` back: whether it was a live handle of this process (it is not any more).
    pub(crate) fn take<T>(&mut self, p: *const T) -> bool {
        if self.known(p) != Known::Live {
            return false;
        }
        self.entries.remove(&(p as usize)).is_some()
    }

    /// Forgets `p` whoever made it (a forked child giving up its copy of a parent's handle,
    /// which it may not free): later uses of it are refused. Whether it was there.
    pub(crate) fn forget<T>(&mut self, p: *const T) -> bool {
        self.entries.remove(&(p as usize)).is_some()
    }
}

impl Handles {
    pub(crate) const fn new() -> Handles {
        Handles {
            set: Mutex::new(BTreeMap::new()),
        }
    }

    /// The registry, locked.
    pub(crate) fn lock(&'static self) -> Locked {
        install_fork_handlers();
        // The generation first: its first call installs the handler that counts forks.
        let me = (chorus_transport::fork_generation(), std::process::id());
        Locked {
            // Nothing panics while holding it; a poisoned map is still a map.
            entries: self.set.lock().unwrap_or_else(PoisonError::into_inner),
            me,
        }
    }

    /// Records `p` as handed out by this process.
    pub(crate) fn add<T>(&'static self, p: *const T) {
        self.lock().add(p);
    }
}

thread_local! {
    /// The registries the forking thread locked before `fork()`, until after it.
    static HELD: RefCell<Vec<MutexGuard<'static, Entries>>> = const { RefCell::new(Vec::new()) };
}

extern "C" fn before_fork() {
    // Never a panic out of here (no unwinding through C): a thread whose thread locals are
    // gone (a fork from a destructor) or in use (a fork from a signal handler that interrupted
    // these handlers) forks without locking, as before these handlers existed.
    let _ = HELD.try_with(|held| {
        if let Ok(mut held) = held.try_borrow_mut() {
            if held.try_reserve(ALL.len()).is_ok() {
                for h in ALL {
                    held.push(h.set.lock().unwrap_or_else(PoisonError::into_inner));
                }
            }
        }
    });
}

extern "C" fn after_fork() {
    // In the child as in the parent: unlocks (no allocation; the vector keeps its capacity).
    let _ = HELD.try_with(|held| {
        if let Ok(mut held) = held.try_borrow_mut() {
            held.clear();
        }
    });
}

fn install_fork_handlers() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain `extern "C" fn`s that live as long as the program. `before_fork` runs
        // in the parent before the fork and takes the registries' locks (never held while
        // another is taken, so no order to break); `after_fork` runs in the parent and in the
        // child (then the only thread) and releases them: atomic stores and, at most, a
        // futex wake, with no allocation.
        let rc =
            unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
        if rc != 0 {
            eprintln!(
                "chorus: pthread_atfork failed ({rc}): a child forked while another thread \
                 registers a handle may block"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_live_from_add_to_take() {
        static H: Handles = Handles::new();
        let a = Box::new(1u64);
        let p: *const u64 = &*a;
        assert_eq!(H.lock().known(p), Known::Unknown);
        H.add(p);
        assert_eq!(H.lock().known(p), Known::Live);
        assert!(H.lock().take(p));
        assert!(!H.lock().take(p), "taken twice");
        assert_eq!(H.lock().known(p), Known::Unknown);
        // An entry of an earlier generation (a parent's) is known, not live: not taken, but
        // forgotten.
        H.lock()
            .entries
            .insert(p as usize, (u64::MAX, std::process::id()));
        assert_eq!(H.lock().known(p), Known::Parents);
        assert!(!H.lock().take(p));
        assert!(H.lock().forget(p));
        assert_eq!(H.lock().known(p), Known::Unknown);
    }
}
