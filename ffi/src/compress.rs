//! Compressed allreduce from C: `chorus_compressor` (state kept per tensor) and
//! `chorus_allreduce_compressed`.

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, TryLockError};

use chorus_core::{CompressionReport, Compressor};

use crate::registry::Known;
use crate::status::{chorus_status as S, guard, Failure};
use crate::{ptr, DtypeArg, OpArg};

/// Compression state of one tensor (gradient bucket): the method, its options and the
/// error-feedback residual. Opaque.
///
/// Create it with `chorus_compressor_create`, keep one per tensor across steps, free it with
/// `chorus_compressor_destroy`. Calls using one compressor must not overlap in time.
pub struct chorus_compressor {
    /// Calls inside that use it (counted under the registry's lock, see [`enter`]):
    /// `chorus_compressor_destroy` refuses to free it meanwhile.
    active: AtomicUsize,
    inner: Mutex<Compressor>,
    /// What the last call did: read by `chorus_compressor_report` without waiting for (or
    /// disturbing) a call that holds `inner`.
    report: Mutex<CompressionReport>,
}

/// What the last `chorus_allreduce_compressed` on a compressor did. Versioned by its first
/// field: set `size = sizeof(chorus_compression_report)` before the call. A library older than
/// the header accepts a larger struct, fills the fields it knows and zeroes the rest (and
/// leaves `size` as it was).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct chorus_compression_report {
    /// `sizeof(chorus_compression_report)`. Required.
    pub size: usize,
    /// 1 when the tensor went compressed, 0 when it was below the spec's `min_bytes`.
    pub compressed: i32,
    /// Bytes this rank sent.
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Bytes of the tensor as 32-bit floats.
    pub dense_bytes: u64,
    /// Top-k: values each rank contributed (0 for quantized methods).
    pub k: u64,
    /// Top-k: non-zero values of the result (0 for quantized methods).
    pub result_nnz: u64,
}

/// Create a compressor from a spec: `method[:argument][,key=value]...`, methods `fp16`,
/// `bf16`, `int8`, `int4`, `sign`, `ternary`, `topk:R` (0 < R <= 1); keys `ef=on|off`
/// (error feedback; default on for sign and topk), `min_bytes=N` (smaller tensors go
/// uncompressed; default 16384), `chunk=N` (elements per scale, default 1024), `clip=on`
/// (ternary, 2.5 sigma), `schedule=scatter_gather|ring`, `algo=two_phase|dsar|sparse_rd`
/// (top-k), `seed=N`. Example: `"int8"`, `"sign,ef=off"`, `"topk:0.01"`. A spec that does not
/// parse is `CHORUS_INVALID_ARGUMENT` and `*out` is left untouched.
///
/// # Safety
/// `out` is NULL or valid for writing a pointer; `spec` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn chorus_compressor_create(
    out: *mut *mut chorus_compressor,
    spec: *const c_char,
) -> i32 {
    guard("chorus_compressor_create", || {
        ptr::check_out(out, "out")?;
        // SAFETY: NULL or NUL-terminated by the caller's promise.
        let spec = unsafe { ptr::opt_str(spec, "spec")? }
            .ok_or_else(|| Failure::invalid("spec is NULL"))?;
        let c = Compressor::new(spec)?;
        let raw = Box::into_raw(Box::new(chorus_compressor {
            active: AtomicUsize::new(0),
            report: Mutex::new(c.last_report()),
            inner: Mutex::new(c),
        }));
        crate::registry::COMPRESSORS.add(raw);
        // SAFETY: checked non-NULL above, writable by the caller's promise.
        unsafe { ptr::write_out(out, raw, "out") }
    })
}

/// Free a compressor. NULL is a no-op. While another thread is inside a call using it, it is
/// not freed: this fails with `CHORUS_INVALID_USAGE`. A compressor freed already (using it,
/// or freeing it again) is refused with `CHORUS_INVALID_ARGUMENT`, unless a compressor created
/// since took its address (the stale pointer then names that one).
///
/// # Safety
/// `comp` is NULL or was returned by `chorus_compressor_create`; no other thread starts a call
/// with it during or after this one.
#[no_mangle]
pub unsafe extern "C" fn chorus_compressor_destroy(comp: *mut chorus_compressor) -> i32 {
    guard("chorus_compressor_destroy", || {
        if comp.is_null() {
            return Ok(());
        }
        // Checked and taken out under the registry's lock, under which calls count themselves
        // in (`enter`): none is inside once it is out, and none can enter after.
        let mut registry = crate::registry::COMPRESSORS.lock();
        match registry.known(comp) {
            Known::Unknown => {
                return Err(Failure::invalid(format!(
                    "comp {comp:p} is not a live compressor (destroyed already, or never one)"
                )))
            }
            Known::Parents => {
                // A forked child's copy of its parent's compressor: not freed (a parent's
                // thread may have held its locks at the fork), but no longer usable here.
                registry.forget(comp);
                return Ok(());
            }
            Known::Live => {}
        }
        // SAFETY: live in the registry, so made by `Box::into_raw` and not freed; it stays so
        // while the registry's lock is held.
        let c = unsafe { &*comp };
        if c.active.load(Ordering::SeqCst) > 0 {
            return Err(Failure::new(
                S::CHORUS_INVALID_USAGE,
                "the compressor is in use by a call of another thread",
            )
            .not_freed());
        }
        registry.take(comp);
        drop(registry);
        // SAFETY: made by `Box::into_raw` in `chorus_compressor_create`, no call inside
        // (checked above) and none can start (just taken out of the registry, under the lock
        // calls enter by): ownership comes back exactly once.
        drop(unsafe { Box::from_raw(comp) });
        Ok(())
    })
}

/// Allreduce of `count` elements of `buf` in place through `comp`: `dtype` is
/// `CHORUS_FLOAT32`, `CHORUS_FLOAT16` or `CHORUS_BFLOAT16` (16-bit inputs are reduced in
/// float32), `op` is `CHORUS_SUM` or `CHORUS_AVG`. Every rank passes a compressor of the same
/// spec for the same tensor; the result is identical on every rank. A compressor another
/// call is using meanwhile refuses this one (`CHORUS_INVALID_USAGE`), which still uses up the
/// call's place in the order of collectives (as any refusal), unless that other call is on
/// this communicator: calls on one communicator must not overlap either.
///
/// # Safety
/// `comm` is NULL or a live communicator; `comp` is NULL or a live compressor; `buf` is NULL (only when `count == 0`) or valid for reading and writing
/// `count` elements of `dtype`.
#[no_mangle]
pub unsafe extern "C" fn chorus_allreduce_compressed(
    comm: *mut crate::chorus_comm,
    buf: *mut c_void,
    count: usize,
    dtype: DtypeArg,
    op: OpArg,
    comp: *mut chorus_compressor,
) -> i32 {
    guard("chorus_allreduce_compressed", || {
        // SAFETY: NULL or live by the caller's promise.
        let (c, _entered) = unsafe { ptr::comm(comm)? };
        c.queue.check_process()?;
        let checked = || -> Result<_, Failure> {
            // SAFETY: NULL or a compressor's address by the caller's promise.
            let (comp, entered) = unsafe { enter(comp)? };
            let dtype = dtype.get()?;
            let op = op.get()?;
            let bytes = ptr::byte_len(count, dtype.size(), "count")?;
            Ok((
                comp,
                entered,
                dtype,
                op,
                ptr::RawBuf::new(buf, bytes, "buf")?,
            ))
        };
        // A compressor in use by another call (or broken) refuses this one as an argument
        // does: the call's place goes.
        let (comp, _comp_entered, dtype, op, buf, mut state) =
            match checked().and_then(|(comp, entered, dtype, op, buf)| {
                Ok((comp, entered, dtype, op, buf, lock(comp)?))
            }) {
                Ok(v) => v,
                Err(f) => {
                    if c.size > 1 {
                        // Refused here, perhaps on this rank only: the call's place goes.
                        crate::skip_refused_call(c);
                    }
                    return Err(f);
                }
            };
        // The slice is made inside `with`, after the calls issued before this one (which may
        // use the same memory) have ended.
        let r = c.with_collective(|c| {
            // SAFETY: valid for `bytes` writable bytes by the caller's promise, not accessed
            // elsewhere during the call.
            c.all_reduce_compressed_raw(unsafe { buf.get_mut() }, dtype, op, &mut state)?;
            Ok(())
        });
        *comp.report.lock().unwrap_or_else(|e| e.into_inner()) = state.last_report();
        // Unlocked before the call counts itself out (`_comp_entered`): once out, a destroy
        // may free the lock.
        drop(state);
        r
    })
}

/// Copy what the last `chorus_allreduce_compressed` on `comp` did into `*report` (whose
/// `size` field must be set: at least this library's `sizeof(chorus_compression_report)`,
/// at most 4096). It may be called while a call on `comp` runs (from another thread): it does
/// not wait for that call and reports the one before.
///
/// # Safety
/// `comp` is NULL or a live compressor; `report` is NULL or points to `size` writable bytes
/// (its `size` field).
#[no_mangle]
pub unsafe extern "C" fn chorus_compressor_report(
    comp: *const chorus_compressor,
    report: *mut chorus_compression_report,
) -> i32 {
    guard("chorus_compressor_report", || {
        // SAFETY: NULL or a compressor's address by the caller's promise.
        let (comp, _entered) = unsafe { enter(comp)? };
        ptr::check_out(report, "report")?;
        // SAFETY: non-NULL; the first field, `size`, is always present.
        let size = unsafe { report.cast::<usize>().read_unaligned() };
        let ours = std::mem::size_of::<chorus_compression_report>();
        if size < ours || size > ptr::MAX_VERSIONED_SIZE {
            return Err(Failure::invalid(format!(
                "report: size field is {size}, expected sizeof(chorus_compression_report) = {ours}"
            )));
        }
        let r = *comp.report.lock().unwrap_or_else(|e| e.into_inner());
        if size > ours {
            // SAFETY: the caller says `size` bytes are writable at `report`; a newer header's
            // fields this library does not know read as zero.
            unsafe { std::ptr::write_bytes(report.cast::<u8>().add(ours), 0, size - ours) };
        }
        let out = chorus_compression_report {
            size,
            compressed: r.compressed as i32,
            bytes_sent: r.bytes_sent,
            bytes_received: r.bytes_received,
            dense_bytes: r.dense_bytes,
            k: r.k.unwrap_or(0) as u64,
            result_nnz: r.result_nnz.unwrap_or(0) as u64,
        };
        // SAFETY: non-NULL and a whole report is writable there (its size field, at least
        // ours, says so).
        unsafe { report.write_unaligned(out) };
        Ok(())
    })
}

/// The compressor behind `p`, counted as in use (by `chorus_compressor_destroy`) until the
/// returned guard drops. Checked and counted under the registry's lock, so that a destroy
/// cannot free it in between. NULL, unknown pointers and a forked parent's compressors are
/// refused (a parent's thread may have held its locks at the fork).
///
/// # Safety
/// `p` is NULL or was returned by `chorus_compressor_create` (destroyed or not).
unsafe fn enter<'a>(
    p: *const chorus_compressor,
) -> Result<(&'a chorus_compressor, crate::Entered<'a>), Failure> {
    if p.is_null() {
        return Err(Failure::invalid("comp is NULL"));
    }
    let registry = crate::registry::COMPRESSORS.lock();
    match registry.known(p) {
        Known::Live => {}
        Known::Parents => {
            return Err(Failure::new(
                S::CHORUS_INVALID_USAGE,
                format!(
                    "comp {p:p} was created before this process was forked: a forked child \
                     cannot use its parent's compressor (create one of its own)"
                ),
            ))
        }
        Known::Unknown => {
            return Err(Failure::invalid(format!(
                "comp {p:p} is not a live compressor (destroyed already, or never one)"
            )))
        }
    }
    // SAFETY: live in the registry, so made by `Box::into_raw` and not freed; counted in
    // before the lock is released, it is not freed until the guard drops.
    let comp = unsafe { &*p };
    let entered = crate::Entered::new(&comp.active);
    drop(registry);
    Ok((comp, entered))
}

fn lock(comp: &chorus_compressor) -> Result<std::sync::MutexGuard<'_, Compressor>, Failure> {
    match comp.inner.try_lock() {
        Ok(g) => Ok(g),
        Err(TryLockError::WouldBlock) => Err(Failure::new(
            S::CHORUS_INVALID_USAGE,
            "the compressor is in use by another thread (calls on one compressor must not \
             overlap)",
        )),
        Err(TryLockError::Poisoned(_)) => Err(Failure::new(
            S::CHORUS_INTERNAL_ERROR,
            "the compressor is unusable after an internal error; destroy it",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destroy_refuses_while_a_call_is_inside() {
        let mut comp: *mut chorus_compressor = std::ptr::null_mut();
        // SAFETY: `comp` is writable, the spec NUL-terminated.
        let st = unsafe { chorus_compressor_create(&mut comp, c"int8".as_ptr()) };
        assert_eq!(st, S::CHORUS_OK as i32);
        // A call inside (as `chorus_compressor_report` or `chorus_allreduce_compressed` is
        // between its check of the pointer and its return).
        // SAFETY: made just above.
        let (_, inside) = unsafe { enter(comp) }.unwrap();
        // SAFETY: live; the call inside keeps it so.
        let st = unsafe { chorus_compressor_destroy(comp) };
        assert_eq!(st, S::CHORUS_INVALID_USAGE as i32);
        let mut report = chorus_compression_report {
            size: std::mem::size_of::<chorus_compression_report>(),
            ..Default::default()
        };
        // SAFETY: still live; `report` is writable with its size set.
        let st = unsafe { chorus_compressor_report(comp, &mut report) };
        assert_eq!(st, S::CHORUS_OK as i32);
        drop(inside);
        // SAFETY: live, no call inside any more.
        assert_eq!(
            unsafe { chorus_compressor_destroy(comp) },
            S::CHORUS_OK as i32
        );
        // SAFETY: freed: refused by the registry without being read.
        assert!(unsafe { enter(comp) }.is_err());
        // SAFETY: as above.
        let st = unsafe { chorus_compressor_report(comp, &mut report) };
        assert_eq!(st, S::CHORUS_INVALID_ARGUMENT as i32);
    }
}
