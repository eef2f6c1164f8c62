//! The direct same-host allreduce: every rank reduces its share straight from the peers' shared
//! arenas, with no message at all.
//!
//! Words: the *arena* of a rank is the part of its segment the others read, in two *halves*
//! used alternately; a *round* moves one *chunk* of the buffer (at most a half); a chunk is cut
//! into `p` *slices* at cache-line boundaries ([`slice_bounds`]); the *progress counter* of a
//! rank counts the phases it has finished, over the communicator's whole life.
//!
//! Steps of a round over chunk `c` in half `h` (large buffers):
//! 1. copy-in: copy my input chunk into my half `h`; publish (progress + 1); wait until every
//!    peer's progress reached mine;
//! 2. reduce: my slice `r` of my half `h` ⊕= slice `r` of every peer's half `h`, the peers in
//!    ascending rank order (my own input first, so a float's rounding can depend on which
//!    rank owns its slice; every rank copies out the same result), then `finish` (Avg's
//!    division); publish; wait for every peer;
//! 3. copy-out: slice `k` of chunk `c` of my output = slice `k` of rank `k`'s half `h`.
//!
//! Small buffers (at most [`SMALL_BYTES`]) use one round of one phase: copy-in, publish, wait,
//! then every rank reduces the whole buffer from all arenas itself (same order on every rank,
//! so the results are identical) — one synchronisation instead of two.
//!
//! Why two halves suffice without a third wait: before a rank writes half `h` in round `t`, it
//! finished round `t − 1`, whose first wait saw every peer's copy-in of round `t − 1`, which
//! every peer did only after finishing all reads of round `t − 2` — the last use of half `h`.
//!
//! Bytes through memory per byte of result and rank: copy-in 2, reduce (p−1)/p reads plus a
//! slice read-modify-write, copy-out 2 — about 5.5 at p = 2 (DESIGN.md §5). Chunks of
//! [`super::ShmOptions::chunk_bytes`] keep a round's slices in cache.
//!
//! Mismatches: before its first copy-in of a call a rank writes a descriptor (call number,
//! tag, length) in the slot of the call's parity; the first wait compares every peer's with its
//! own. While waiting on a peer, a message from that peer sitting in the ring means it runs a
//! different collective: both are reported as [`TransportError::Mismatch`].

use std::sync::atomic::{fence, Ordering};
use std::time::Instant;

use super::{ShmTransport, Stall, H_DESC, H_PROGRESS, H_SLEEPING, LINE};
use crate::{Result, Tag, TransportError};

/// Buffers up to this many bytes take the one-phase path.
pub const SMALL_BYTES: usize = 16 * 1024;

/// How the caller combines elements (this crate knows no dtypes).
pub struct Reducer<'a> {
    /// Size of one element in bytes (slices never split an element).
    pub elem_size: usize,
    /// `dst[i] = dst[i] ⊕ src[i]` over equal-length byte slices of whole elements.
    pub reduce: &'a dyn Fn(&mut [u8], &[u8]),
    /// Applied once to every fully reduced piece (Avg's division by the group size; a no-op
    /// for other ops).
    pub finish: &'a dyn Fn(&mut [u8]),
}

/// Per-transport state of the direct allreduce.
#[derive(Debug, Default)]
pub struct State {
    calls: u64,
    rounds: u64,
    epoch: u64,
}

/// Byte bounds `[start, end)` of slice `k` of a chunk of `len` bytes of `elem`-byte elements cut
/// into `parts` slices on cache-line boundaries where the element size allows.
pub fn slice_bounds(len: usize, elem: usize, parts: usize, k: usize) -> (usize, usize) {
    let unit = if LINE % elem == 0 { LINE } else { elem };
    let lines = len.div_ceil(unit);
    let at = |i: usize| (lines * i / parts * unit).min(len);
    (at(k), at(k + 1))
}

/// Bytes per round for an arena half of `half` bytes: the largest multiple of the element size
/// and of a cache line that fits (of the element size alone where no such multiple does).
/// Never more than `half` for an element of at most `half` bytes (the caller refuses larger).
pub fn chunk_bytes(half: usize, elem: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let lcm = LINE / gcd(LINE, elem) * elem;
    let unit = if lcm <= half { lcm } else { elem };
    half / unit * unit
}

impl ShmTransport {
    /// In-place (`send == None`) or out-of-place allreduce of `recv` over every rank of the
    /// group, through the shared arenas. Every rank must call it with the same length, tag and
    /// reducer semantics; `tag` identifies the call in mismatch reports.
    ///
    /// Errors: [`TransportError::InvalidUsage`] if some rank is not on this host (see
    /// [`ShmTransport::covers_group`]), [`TransportError::InvalidArgument`] for lengths that are
    /// not whole elements or differ (both leave the transport usable); otherwise the errors of a
    /// wait (peer closed or aborted, timeout) and [`TransportError::Mismatch`].
    pub fn all_reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        tag: Tag,
        deadline: Instant,
        red: &Reducer<'_>,
    ) -> Result<()> {
        crate::check_usable(&self.broken)?;
        self.check_abort_request()?;
        if !self.covers_group() {
            return Err(TransportError::InvalidUsage(
                "the shared-memory allreduce needs every rank on this host".into(),
            ));
        }
        let elem = red.elem_size;
        if elem == 0
            || elem > self.layout.arena_half
            || recv.len() % elem != 0
            || send.is_some_and(|s| s.len() != recv.len())
        {
            return Err(TransportError::InvalidArgument(format!(
                "allreduce of {} bytes (send {:?}) in elements of {elem} bytes",
                recv.len(),
                send.map(<[u8]>::len)
            )));
        }
        match self.run_all_reduce(send, recv, tag, deadline, red) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.disarm();
                Err(self.fail(e))
            }
        }
    }

    fn run_all_reduce(
        &mut self,
        send: Option<&[u8]>,
        recv: &mut [u8],
        tag: Tag,
        deadline: Instant,
        red: &Reducer<'_>,
    ) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let len = recv.len();
        let call = self.coll.calls;
        self.coll.calls += 1;
        let desc = H_DESC + (call % 2) as usize * LINE;
        self.me.u64_at(desc).store(call, Ordering::Relaxed);
        self.me.u64_at(desc + 8).store(tag, Ordering::Relaxed);
        self.me
            .u64_at(desc + 16)
            .store(len as u64, Ordering::Relaxed);

        let half = self.layout.arena_half;
        let small = len <= SMALL_BYTES.min(half);
        let chunk = if small {
            len.max(1)
        } else {
            chunk_bytes(half, red.elem_size)
        };
        let rounds = len.div_ceil(chunk).max(1);
        let mut check = Some((call, tag, len));
        for t in 0..rounds {
            let (lo, hi) = (t * chunk, ((t + 1) * chunk).min(len));
            let n = hi - lo;
            let off = self.layout.arena() + (self.coll.rounds % 2) as usize * half;
            self.coll.rounds += 1;

            // Copy-in, then wait until everyone's input of this round is there.
            self.me
                .write(off, send.map_or(&recv[lo..hi], |s| &s[lo..hi]));
            self.publish();
            self.wait_peers(check.take(), deadline)?;

            if small {
                // Everyone reduces the whole buffer, in ascending rank order.
                let out = &mut recv[lo..hi];
                for k in 0..size {
                    let src = if k == rank {
                        self.me.bytes(off, n)
                    } else {
                        self.peers[k].as_ref().expect("member").map.bytes(off, n)
                    };
                    if k == 0 {
                        out.copy_from_slice(src);
                    } else {
                        (red.reduce)(out, src);
                    }
                }
                (red.finish)(out);
                continue;
            }

            // Reduce my slice from every peer's arena into mine.
            let (a, b) = slice_bounds(n, red.elem_size, size, rank);
            {
                let dst = self.me.bytes_mut(off + a, b - a);
                for p in self.peers.iter().flatten() {
                    (red.reduce)(dst, p.map.bytes(off + a, b - a));
                }
                (red.finish)(dst);
            }
            self.publish();
            self.wait_peers(None, deadline)?;

            // Copy every reduced slice out.
            for k in 0..size {
                let (a, b) = slice_bounds(n, red.elem_size, size, k);
                let dst = &mut recv[lo + a..lo + b];
                if k == rank {
                    self.me.read(off + a, dst);
                } else {
                    self.peers[k]
                        .as_ref()
                        .expect("member")
                        .map
                        .read(off + a, dst);
                }
            }
        }
        Ok(())
    }

    /// Finish a phase: bump my progress counter (release) and wake sleeping peers.
    fn publish(&mut self) {
        self.coll.epoch += 1;
        self.me
            .u64_at(H_PROGRESS)
            .store(self.coll.epoch, Ordering::Release);
        fence(Ordering::SeqCst);
        for p in self.peers.iter().flatten() {
            if p.map.u32_at(H_SLEEPING).load(Ordering::Relaxed) != 0 {
                p.map.u32_at(super::H_BELL).fetch_add(1, Ordering::SeqCst);
                super::sys::futex_wake(p.map.u32_at(super::H_BELL));
            }
        }
    }

    /// Wait until every peer's progress counter reached mine; with `check`, then compare their
    /// call descriptors with (call, tag, len).
    fn wait_peers(&mut self, check: Option<(u64, Tag, usize)>, deadline: Instant) -> Result<()> {
        let target = self.coll.epoch;
        for j in 0..self.size {
            if j == self.rank {
                continue;
            }
            let mut stall: Option<Stall> = None;
            loop {
                let p = self.peers[j].as_ref().expect("member");
                let seen = p.map.u64_at(H_PROGRESS).load(Ordering::Acquire);
                // Every phase ends in a wait for all: a peer is at most one phase behind
                // (it has not published this one yet) or ahead (it published the next and
                // waits for this rank). Any other value is not from the protocol, and trusting
                // it would read the peer's data while it is still being written.
                if seen.abs_diff(target) > 1 {
                    return Err(TransportError::Protocol {
                        peer: j,
                        what: format!(
                            "its progress counter reads {seen} where this rank is at phase \
                             {target} (±1)"
                        ),
                    });
                }
                if seen >= target {
                    break;
                }
                if let Some((got_tag, got_len, _)) = self.peek_header(j)? {
                    // The peer may have reached the target, finished this call and sent its
                    // next message between our two looks: only a peer still behind while its
                    // next message waits is in a different call.
                    let p = self.peers[j].as_ref().expect("member");
                    if p.map.u64_at(H_PROGRESS).load(Ordering::Acquire) >= target {
                        break;
                    }
                    let (expected_tag, expected_len) = check.map_or((0, 0), |c| (c.1, c.2));
                    return Err(TransportError::Mismatch {
                        peer: j,
                        expected_tag,
                        got_tag,
                        expected_len,
                        got_len: usize::try_from(got_len).unwrap_or(usize::MAX),
                    });
                }
                let w = stall.get_or_insert_with(|| {
                    self.involved.clear();
                    self.involved.push(j);
                    Stall::new()
                });
                self.stall(w, deadline)?;
            }
            self.disarm();
            if let Some((call, tag, len)) = check {
                let m = &self.peers[j].as_ref().expect("member").map;
                let d = H_DESC + (call % 2) as usize * LINE;
                let (c, t, l) = (
                    m.u64_at(d).load(Ordering::Relaxed),
                    m.u64_at(d + 8).load(Ordering::Relaxed),
                    m.u64_at(d + 16).load(Ordering::Relaxed),
                );
                if c != call || t != tag || l != len as u64 {
                    return Err(TransportError::Mismatch {
                        peer: j,
                        expected_tag: tag,
                        got_tag: t,
                        expected_len: len,
                        got_len: usize::try_from(l).unwrap_or(usize::MAX),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{local_group, ShmOptions};
    use super::*;
    use crate::Transport;
    use std::time::Duration;

    #[test]
    fn slices_cover_the_chunk_on_line_boundaries() {
        for len in [0usize, 4, 60, 64, 100, 4096, 10_000, 65_536 + 12] {
            for elem in [1usize, 2, 4, 8] {
                if len % elem != 0 {
                    continue;
                }
                for parts in 1..=9 {
                    let mut at = 0;
                    for k in 0..parts {
                        let (a, b) = slice_bounds(len, elem, parts, k);
                        assert_eq!(a, at, "len {len} elem {elem} parts {parts} k {k}");
                        assert!(b >= a && b <= len);
                        assert!(a % 64 == 0 || a == len);
                        at = b;
                    }
                    assert_eq!(at, len);
                }
            }
        }
        assert_eq!(chunk_bytes(4096, 4), 4096);
        assert_eq!(chunk_bytes(1000, 8), 960);
        assert_eq!(chunk_bytes(1000, 3), 960);
        // An element that does not divide a line: whole elements and lines while they fit,
        // whole elements alone beyond; never more than the half.
        assert_eq!(chunk_bytes(4096, 96), 4032);
        assert_eq!(chunk_bytes(4096, 5000 / 2), 2500);
        for elem in 1..=4096 {
            let c = chunk_bytes(4096, elem);
            assert!(c <= 4096 && c >= elem && c % elem == 0, "{elem}: {c}");
        }
    }

    fn sum_u32(dst: &mut [u8], src: &[u8]) {
        for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
            let v = u32::from_ne_bytes(d.try_into().unwrap())
                .wrapping_add(u32::from_ne_bytes(s.try_into().unwrap()));
            d.copy_from_slice(&v.to_ne_bytes());
        }
    }

    fn on_ranks<R: Send + 'static>(
        n: usize,
        opts: &ShmOptions,
        f: impl Fn(usize, &mut ShmTransport) -> R + Send + Sync + Clone + 'static,
    ) -> Vec<R> {
        let g = local_group(n, opts).unwrap();
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(r, mut t)| {
                let f = f.clone();
                std::thread::spawn(move || f(r, &mut t))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    }

    #[test]
    fn sums_every_size_across_many_rounds() {
        let opts = ShmOptions {
            chunk_bytes: 4096, // many rounds for the larger sizes
            ..ShmOptions::default()
        };
        for n in [1usize, 2, 3, 5] {
            on_ranks(n, &opts, move |rank, t| {
                let red = Reducer {
                    elem_size: 4,
                    reduce: &sum_u32,
                    finish: &|_| {},
                };
                for (i, count) in [0usize, 1, 17, 4096, 5000, 40_000].into_iter().enumerate() {
                    let input: Vec<u32> =
                        (0..count).map(|k| (k as u32) * 3 + rank as u32).collect();
                    let want: Vec<u32> = (0..count)
                        .map(|k| (k as u32) * 3 * n as u32 + (n * (n - 1) / 2) as u32)
                        .collect();
                    let mut out = vec![0u8; count * 4];
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let inb = bytes_of(&input);
                    t.all_reduce(Some(&inb), &mut out, i as u64, deadline, &red)
                        .unwrap();
                    assert!(out == bytes_of(&want), "n {n} count {count}");
                    // In place, same data.
                    let mut buf = inb.clone();
                    t.all_reduce(None, &mut buf, 100 + i as u64, deadline, &red)
                        .unwrap();
                    assert!(buf == bytes_of(&want), "in place n {n} count {count}");
                }
                // Point-to-point still works after direct collectives.
                if n > 1 {
                    let to = (rank + 1) % n;
                    let from = (rank + n - 1) % n;
                    let mut b = [0u8; 3];
                    t.send_recv(to, 9, b"abc", from, 9, &mut b, Duration::from_secs(10))
                        .unwrap();
                    assert_eq!(&b, b"abc");
                }
            });
        }
    }

    fn bytes_of(v: &[u32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_ne_bytes()).collect()
    }

    #[test]
    fn mismatched_lengths_and_collectives_fail_on_every_rank() {
        let res = on_ranks(3, &ShmOptions::default(), |rank, t| {
            let red = Reducer {
                elem_size: 4,
                reduce: &sum_u32,
                finish: &|_| {},
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            let len = if rank == 1 { 400 } else { 800 };
            let mut b = vec![0u8; len];
            t.all_reduce(None, &mut b, 7, deadline, &red).unwrap_err()
        });
        for e in &res {
            assert!(
                matches!(
                    e,
                    TransportError::Mismatch { .. } | TransportError::PeerAborted { .. }
                ),
                "{e}"
            );
        }
        assert!(res
            .iter()
            .any(|e| matches!(e, TransportError::Mismatch { .. })));

        // Rank 0 runs a message-based step where rank 1 runs the direct allreduce.
        let res = on_ranks(2, &ShmOptions::default(), |rank, t| {
            let red = Reducer {
                elem_size: 4,
                reduce: &sum_u32,
                finish: &|_| {},
            };
            let deadline = Instant::now() + Duration::from_secs(20);
            if rank == 0 {
                let mut b = [0u8; 4];
                let r = t.send_recv(1, 55, &[1, 2, 3, 4], 1, 55, &mut b, Duration::from_secs(3));
                r.map(|_| ())
            } else {
                let mut b = vec![0u8; 64];
                t.all_reduce(None, &mut b, 7, deadline, &red)
            }
        });
        assert!(
            matches!(
                res[1],
                Err(TransportError::Mismatch {
                    peer: 0,
                    got_tag: 55,
                    ..
                })
            ),
            "{:?}",
            res[1]
        );
        assert!(res[0].is_err());
    }

    #[test]
    fn a_peer_that_leaves_is_reported() {
        let res = on_ranks(3, &ShmOptions::default(), |rank, t| {
            let red = Reducer {
                elem_size: 4,
                reduce: &sum_u32,
                finish: &|_| {},
            };
            if rank == 2 {
                return None; // drops its transport
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut b = vec![0u8; 1 << 20];
            Some(t.all_reduce(None, &mut b, 7, deadline, &red).unwrap_err())
        });
        for e in res.into_iter().flatten() {
            assert!(
                matches!(
                    e,
                    TransportError::PeerClosed { peer: 2 } | TransportError::PeerAborted { .. }
                ),
                "{e}"
            );
        }
    }

    #[test]
    fn a_progress_counter_the_protocol_cannot_produce_is_refused() {
        let done = std::sync::Arc::new(std::sync::Barrier::new(3));
        let res = on_ranks(3, &ShmOptions::default(), move |rank, t| {
            let red = Reducer {
                elem_size: 4,
                reduce: &sum_u32,
                finish: &|_| {},
            };
            if rank == 2 {
                // A corrupted peer: far ahead, as if it had finished every phase.
                t.me.u64_at(H_PROGRESS).store(u64::MAX, Ordering::Release);
                done.wait();
                return None;
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut b = vec![0u8; 1 << 16];
            let e = t.all_reduce(None, &mut b, 7, deadline, &red).unwrap_err();
            done.wait();
            Some(e)
        });
        for e in res.into_iter().flatten() {
            assert!(
                matches!(&e, TransportError::Protocol { peer: 2, what } if what.contains("progress")),
                "{e}"
            );
        }
    }
}
