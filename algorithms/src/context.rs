//! What a schedule needs to run one collective: the transport, a deadline, the tag space of
//! this call and a reusable scratch buffer.

use std::time::Instant;

use chorus_transport::{Tag, Transport, TransportError};

/// Alignment of the slices handed out by [`CollCtx::scratch`] (a cache line; also enough for
/// every element type, so the reduce kernels take their fast, aligned path).
pub const SCRATCH_ALIGN: usize = 64;

/// The context of one collective call on one rank.
///
/// ```
/// # use chorus_algorithms::CollCtx;
/// # fn demo(t: &mut dyn chorus_transport::Transport) {
/// let mut scratch = Vec::new();
/// let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
/// let seq = 42u64; // the communicator's collective counter
/// let mut ctx = CollCtx { transport: t, deadline, tag_base: seq << 16, scratch: &mut scratch };
/// assert_eq!(ctx.tag(3), (42 << 16) | 3);
/// assert_eq!(ctx.scratch(1000).len(), 1000);
/// # }
/// ```
pub struct CollCtx<'a> {
    /// The group to run over; its rank and size are the collective's.
    pub transport: &'a mut dyn Transport,
    /// Every wait of the call fails with a timeout at this instant.
    pub deadline: Instant,
    /// The upper bits of every tag of this call (the caller's sequence number and collective
    /// kind); the low 16 bits are the step, see [`CollCtx::tag`].
    pub tag_base: u64,
    /// Scratch memory kept by the caller across calls; grows, never shrinks.
    pub scratch: &'a mut Vec<u8>,
}

impl<'a> CollCtx<'a> {
    /// The tag of step `step` of this call: `tag_base | step`. `step` must be below 2^16.
    pub fn tag(&self, step: u64) -> Tag {
        debug_assert!(step < 1 << 16, "step {step} does not fit in 16 bits");
        self.tag_base | step
    }

    /// A [`SCRATCH_ALIGN`]-aligned scratch slice of `bytes` bytes (contents unspecified).
    pub fn scratch(&mut self, bytes: usize) -> &mut [u8] {
        aligned_scratch(self.scratch, bytes)
    }

    /// The transport and a scratch slice at once (the two borrows a schedule holds
    /// together). An error when the scratch cannot be allocated (too large for the address
    /// space, or refused by the system), not the end of the process: its size is a multiple
    /// of the caller's buffer, or what other ranks' figures decide.
    pub fn transport_and_scratch(
        &mut self,
        bytes: usize,
    ) -> chorus_transport::Result<(&mut dyn Transport, &mut [u8])> {
        let scratch = try_aligned_scratch(self.scratch, bytes)?;
        Ok((&mut *self.transport, scratch))
    }
}

/// [`aligned_scratch`] for a size that the caller's buffer or other ranks' figures decide
/// (the entries a sparse message may hold): an error, not the end of the process, when it
/// cannot be allocated.
fn try_aligned_scratch(buf: &mut Vec<u8>, bytes: usize) -> chorus_transport::Result<&mut [u8]> {
    let Some(need) = bytes.checked_add(SCRATCH_ALIGN - 1) else {
        return Err(no_memory(bytes));
    };
    if buf.len() < need {
        // Sizes above PROBE_ABOVE are asked for on their own first (the allocation below
        // would end the process instead); smaller ones are not (a probe's free would move the
        // C allocator's threshold for fresh mappings, and the buffer would come from the heap,
        // zeroed page by page).
        let fits = |n: usize| n <= PROBE_ABOVE || Vec::<u8>::new().try_reserve_exact(n).is_ok();
        let sizes = [grown(buf.len(), need), need];
        *buf = Vec::new();
        let size = sizes
            .into_iter()
            .find(|&n| fits(n))
            .ok_or_else(|| no_memory(bytes))?;
        *buf = vec![0u8; size];
    }
    Ok(aligned_scratch(buf, bytes))
}

/// Allocations this large come from fresh mappings whatever the C allocator's dynamic
/// threshold (glibc's largest is 32 MiB on 64-bit systems).
const PROBE_ABOVE: usize = 32 << 20;

/// `n` zeroed values, or an error of the call (not the end of the process) where the system
/// refuses the memory.
pub(crate) fn try_zeroed<T: Clone + Default>(n: usize) -> chorus_transport::Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| no_memory(n.saturating_mul(std::mem::size_of::<T>())))?;
    v.resize(n, T::default());
    Ok(v)
}

fn no_memory(bytes: usize) -> TransportError {
    TransportError::Io {
        peer: None,
        during: "allocating scratch memory",
        source: std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("{bytes} bytes of scratch memory for this call"),
        ),
    }
}

/// The size a scratch of `len` bytes grows to for `need`: at least double, so that sizes
/// creeping upward do not allocate (and fault in) afresh at every step.
fn grown(len: usize, need: usize) -> usize {
    need.max(len.saturating_mul(2))
}

fn aligned_scratch(buf: &mut Vec<u8>, bytes: usize) -> &mut [u8] {
    let need = bytes + SCRATCH_ALIGN - 1;
    if buf.len() < need {
        // A fresh zeroed allocation (the old contents need not survive): large ones are the
        // system's zero pages until written, so a receive buffer sized for the most that may
        // arrive takes memory only for what does.
        let size = grown(buf.len(), need);
        *buf = Vec::new();
        *buf = vec![0u8; size];
    }
    let misalign = buf.as_ptr() as usize % SCRATCH_ALIGN;
    let start = (SCRATCH_ALIGN - misalign) % SCRATCH_ALIGN;
    &mut buf[start..start + bytes]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_too_large_to_allocate_is_an_error() {
        let mut v = Vec::new();
        for bytes in [usize::MAX, usize::MAX - SCRATCH_ALIGN, isize::MAX as usize] {
            let e = try_aligned_scratch(&mut v, bytes).unwrap_err();
            assert!(e.to_string().contains("allocating scratch memory"), "{e}");
        }
        assert!(v.is_empty());
        assert_eq!(try_aligned_scratch(&mut v, 100).unwrap().len(), 100);
    }

    #[test]
    fn scratch_is_aligned_and_grows_without_shrinking() {
        let mut v = Vec::new();
        for bytes in [0, 1, 100, 5000, 10] {
            let s = aligned_scratch(&mut v, bytes);
            assert_eq!(s.len(), bytes);
            assert_eq!(s.as_ptr() as usize % SCRATCH_ALIGN, 0);
        }
        assert!(v.len() >= 5000);
        // Growth at least doubles: sizes creeping upward do not allocate at every step.
        let before = v.len();
        aligned_scratch(&mut v, before);
        assert!(v.len() >= 2 * before, "{} after {before}", v.len());
        let before = v.len();
        try_aligned_scratch(&mut v, before).unwrap();
        assert!(v.len() >= 2 * before, "{} after {before}", v.len());
    }
}
