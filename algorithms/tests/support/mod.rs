//! Test helpers shared by the integration tests.
#![allow(dead_code)]

pub mod mem;
pub mod sweep;

use chorus_transport::Transport;

/// Runs `f(rank, transport)` on every rank of `transports`, one thread each, and returns the
/// results in rank order. A panicking rank fails the test.
pub fn run_group<T, R, F>(transports: Vec<T>, f: F) -> Vec<R>
where
    T: Transport + 'static,
    R: Send,
    F: Fn(usize, &mut dyn Transport) -> R + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = transports
            .into_iter()
            .enumerate()
            .map(|(rank, mut t)| {
                let f = &f;
                s.spawn(move || f(rank, &mut t))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}
