//! The handles of one kind (communicators, compressors, requests) this process has handed to C
//! and not yet taken back, by address: a pointer that is not among them (destroyed or freed
//! already, never a handle, or a forked parent's) is refused instead of being used.
//!
//! A forked child gets a registry of its own the first time it looks (the parent's, copied
//! at the fork, may be locked by a parent's thread that the child does not have); the parent's
//! copy is kept, read only with `try_lock`, to tell the parent's handles apart.
//!
//! What this cannot see: a handle destroyed and its address then reused for a new handle of
//! the same kind (the stale pointer then names the new one), and a destroy racing with a call
//! on another thread (the caller's race, as documented on each destroy).

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// One process's handles of one kind.
pub(crate) struct Registry {
    pid: u32,
    set: Mutex<BTreeSet<usize>>,
    /// In a forked child: the parent's registry as copied at the fork.
    parent: *const Registry,
}

// SAFETY: `parent` points to a registry that is never freed and is only read through its
// mutex (with `try_lock`); the rest is a pid and a mutex.
unsafe impl Sync for Registry {}
// SAFETY: as above.
unsafe impl Send for Registry {}

/// Where a pointer stands in a registry's process line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// A live handle of this process.
    Live,
    /// A live handle of a process this one was forked from (at the fork), or possibly one:
    /// a registry a parent's thread held locked at the fork cannot be looked into.
    Parents,
    /// Neither.
    Unknown,
}

/// The registry of one kind of handle: a static holding this process's [`Registry`].
pub(crate) struct Handles(AtomicPtr<Registry>);

impl Handles {
    pub(crate) const fn new() -> Handles {
        Handles(AtomicPtr::new(std::ptr::null_mut()))
    }

    /// This process's registry (made on first use, and again in a forked child).
    fn current(&self) -> &'static Registry {
        let me = std::process::id();
        let mut current = self.0.load(Ordering::SeqCst);
        // SAFETY: non-NULL pointers here come from `Box::into_raw` below and are never freed,
        // so they stay valid for the life of the process (and of a forked child's copy).
        while current.is_null() || unsafe { (*current).pid } != me {
            let fresh = Box::into_raw(Box::new(Registry {
                pid: me,
                set: Mutex::new(BTreeSet::new()),
                parent: current,
            }));
            match self
                .0
                .compare_exchange(current, fresh, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => current = fresh,
                Err(other) => {
                    // Another thread of this process installed one first: use that one.
                    // SAFETY: `fresh` was made above and shared with no one.
                    drop(unsafe { Box::from_raw(fresh) });
                    current = other;
                }
            }
        }
        // SAFETY: as above; the registry of this process, never freed.
        unsafe { &*current }
    }

    /// The set of this process's live handles, locked (while held, none is added or taken).
    pub(crate) fn lock(&self) -> MutexGuard<'static, BTreeSet<usize>> {
        // Nothing panics while holding it; a poisoned set is still a set.
        self.current()
            .set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records `p` as handed out.
    pub(crate) fn add<T>(&self, p: *const T) {
        self.lock().insert(p as usize);
    }

    /// Takes `p` back: whether it was a live handle of this process (it is not any more).
    pub(crate) fn take<T>(&self, p: *const T) -> bool {
        self.lock().remove(&(p as usize))
    }

    /// Where `p` stands: live here, a parent's, or neither.
    pub(crate) fn known<T>(&self, p: *const T) -> Known {
        if self.lock().contains(&(p as usize)) {
            return Known::Live;
        }
        if self.in_a_parent(p as usize) {
            Known::Parents
        } else {
            Known::Unknown
        }
    }

    /// Whether `p` was (or, with a registry locked at the fork, may have been) a live handle
    /// of a process this one was forked from, at the fork.
    pub(crate) fn in_a_parent(&self, p: usize) -> bool {
        let mut parent = self.current().parent;
        while !parent.is_null() {
            // SAFETY: registries are never freed (see `current`).
            let r = unsafe { &*parent };
            match r.set.try_lock() {
                Ok(set) if set.contains(&p) => return true,
                Ok(_) => {}
                // Locked by a thread the child does not have: cannot tell, so not refused.
                Err(std::sync::TryLockError::WouldBlock) => return true,
                Err(std::sync::TryLockError::Poisoned(set)) => {
                    if set.into_inner().contains(&p) {
                        return true;
                    }
                }
            }
            parent = r.parent;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_are_live_from_add_to_take() {
        static H: Handles = Handles::new();
        let a = Box::new(1u64);
        let p: *const u64 = &*a;
        assert_eq!(H.known(p), Known::Unknown);
        H.add(p);
        assert_eq!(H.known(p), Known::Live);
        assert!(H.take(p));
        assert!(!H.take(p), "taken twice");
        assert_eq!(H.known(p), Known::Unknown);
    }
}
