//! Keeping `SIGPIPE` from killing a C program when a peer disconnects.
//!
//! Writing to a socket whose peer has gone raises `SIGPIPE`, whose default action ends the
//! process. Rust programs ignore it from startup and Python does too, but a C program usually
//! has the default, so a lost peer would kill the other ranks instead of giving them
//! `CHORUS_REMOTE_ERROR`. Changing the process's disposition behind the program's back would
//! be rude; instead, while a chorus call runs, `SIGPIPE` is blocked in the calling thread
//! (threads chorus starts during the call inherit the mask), and a `SIGPIPE` raised meanwhile
//! is taken off the thread's pending set before the old mask is restored. The write itself
//! then fails with `EPIPE`, which the transport reports as a lost peer.
//!
//! Cost: two or three system calls per chorus call (well under a microsecond).

use std::mem::MaybeUninit;

/// Blocks `SIGPIPE` in this thread until dropped.
pub(crate) struct SigpipeBlock {
    /// The mask to restore, or `None` when `SIGPIPE` was already blocked (then a pending
    /// `SIGPIPE` may be the program's own and is left alone).
    restore: Option<libc::sigset_t>,
}

fn sigpipe_set() -> libc::sigset_t {
    let mut set = MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigemptyset initialises the set it is given; sigaddset with a valid signal
    // number on an initialised set cannot fail.
    unsafe {
        libc::sigemptyset(set.as_mut_ptr());
        libc::sigaddset(set.as_mut_ptr(), libc::SIGPIPE);
        set.assume_init()
    }
}

impl SigpipeBlock {
    /// Block `SIGPIPE` in the calling thread.
    pub(crate) fn new() -> SigpipeBlock {
        let set = sigpipe_set();
        let mut old = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: both pointers are valid sigset_t locations; pthread_sigmask only fails on
        // a bad `how`, and SIG_BLOCK is valid.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, old.as_mut_ptr()) };
        if rc != 0 {
            return SigpipeBlock { restore: None };
        }
        // SAFETY: pthread_sigmask succeeded, so it wrote the old mask.
        let old = unsafe { old.assume_init() };
        // SAFETY: `old` is an initialised set.
        let was_blocked = unsafe { libc::sigismember(&old, libc::SIGPIPE) } == 1;
        SigpipeBlock {
            restore: (!was_blocked).then_some(old),
        }
    }
}

impl Drop for SigpipeBlock {
    fn drop(&mut self) {
        let Some(old) = self.restore else { return };
        let set = sigpipe_set();
        let mut pending = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: valid pointer to a sigset_t; sigpending fills it.
        if unsafe { libc::sigpending(pending.as_mut_ptr()) } == 0 {
            // SAFETY: sigpending succeeded, so the set is initialised.
            let pending = unsafe { pending.assume_init() };
            // SAFETY: initialised set, valid signal.
            if unsafe { libc::sigismember(&pending, libc::SIGPIPE) } == 1 {
                let zero = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: valid set and timeout; a NULL siginfo is allowed. Takes the pending
                // SIGPIPE (raised by our own write while it was blocked) without waiting.
                unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &zero) };
            }
        }
        // SAFETY: `old` is the mask this thread had; restoring it cannot fail with SIG_SETMASK.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked() -> bool {
        let mut cur = MaybeUninit::<libc::sigset_t>::uninit();
        // SAFETY: a NULL new set only reads the current mask into a valid location.
        unsafe {
            libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), cur.as_mut_ptr());
            libc::sigismember(cur.as_ptr(), libc::SIGPIPE) == 1
        }
    }

    #[test]
    fn blocks_swallows_and_restores() {
        std::thread::spawn(|| {
            assert!(!blocked());
            {
                let _g = SigpipeBlock::new();
                assert!(blocked());
                // A SIGPIPE raised at this thread while blocked stays pending...
                // SAFETY: raising a signal that is blocked in this thread only marks it
                // pending.
                unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
            }
            // ...and is taken away before the mask is restored (else the test process dies).
            assert!(!blocked());
        })
        .join()
        .unwrap();
    }
}
