//! Sparse streams: how a part of a sparse f32 vector travels between ranks, and the sums the
//! schedules compute from them.
//!
//! # Words
//! - **region**: a range `start..start+len` of the dense index space `0..n`.
//! - **segment**: one message: a [`Header`] and the entries of one region, either *sparse*
//!   (`count` indices relative to `start`, strictly increasing, then `count` f32 values) or
//!   *dense* (`len` f32 values, one per position of the region).
//! - **entry**: an (index, value) pair of a sparse vector.
//!
//! # Layout (little endian)
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `SPR1` |
//! | 4 | format: 0 sparse with u32 indices, 1 sparse with u64 indices, 2 dense |
//! | 5..8 | zero |
//! | 8..16 | `n`, the dense length of the whole vector |
//! | 16..24 | fingerprint of the call's other arguments (see [`Stamp`]) |
//! | 24..32 | region start |
//! | 32..40 | region length |
//! | 40..48 | count: entries (sparse) or `len` (dense) |
//! | 48..56 | a word of the sender's for the schedule (two-phase top-k: its local k-th magnitude) |
//! | 56.. | sparse: `count` indices (u32 when the region has at most 2³² positions, else u64), then `count` f32 values; dense: `len` f32 values |
//!
//! Indices are integers, never packed into floats. The **dense switch** (SparCML's byte rule):
//! a region is sent dense when its sparse form would not be smaller,
//! `count·(index bytes + 4) ≥ len·4` ([`prefers_dense`]).
//!
//! # Validation
//! [`SegView::parse`] checks everything before anything is read: magic, format, reserved bytes,
//! `n` and the fingerprint against this rank's (a different `n` is a
//! [`TransportError::Mismatch`], another fingerprint a [`TransportError::Protocol`] naming the
//! arguments), the region against what the schedule expects, the count against the region
//! and the caller's bound, the exact message length, and that indices are strictly increasing
//! inside the region. Nothing a peer sends can make this code panic or allocate more than the
//! message it sent (which the receive already bounded).

use chorus_transport::{Result, TransportError};

/// Bytes of a segment header.
pub const HEADER_BYTES: usize = 56;

const MAGIC: [u8; 4] = *b"SPR1";
const FORMAT_SPARSE32: u8 = 0;
const FORMAT_SPARSE64: u8 = 1;
const FORMAT_DENSE: u8 = 2;

/// Bytes of one index on the wire for a region of `len` positions: 4 when every relative
/// index fits in a u32 (`len ≤ 2³²`), else 8.
pub fn index_width(len: u64) -> usize {
    if len <= 1 << 32 {
        4
    } else {
        8
    }
}

/// Payload bytes of `count` entries of a region of `len` positions in sparse form.
pub fn sparse_bytes(count: u64, len: u64) -> u128 {
    count as u128 * (index_width(len) as u128 + 4)
}

/// Payload bytes of a region of `len` positions in dense form.
pub fn dense_bytes(len: u64) -> u128 {
    len as u128 * 4
}

/// SparCML's dense switch: `count` entries of a region of `len` positions are kept (and sent)
/// dense when the sparse form would not be smaller.
///
/// ```
/// use chorus_algorithms::sparse::stream::prefers_dense;
/// assert!(!prefers_dense(499, 1000)); // 499·8 < 1000·4
/// assert!(prefers_dense(500, 1000));
/// ```
pub fn prefers_dense(count: u64, len: u64) -> bool {
    sparse_bytes(count, len) >= dense_bytes(len)
}

/// The largest encoding of at most `max_entries` entries of a region of `len` positions:
/// what a receive must be able to hold.
pub fn max_segment_bytes(max_entries: u64, len: u64) -> usize {
    let payload = sparse_bytes(max_entries.min(len), len).min(dense_bytes(len));
    usize::try_from(payload)
        .unwrap_or(usize::MAX)
        .saturating_add(HEADER_BYTES)
}

/// What every segment of one call carries so that ranks called with different arguments fail
/// instead of mixing their data: the dense length and a fingerprint of everything else the
/// ranks must agree on; and a word of the sender's own (`aux`, not checked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    /// The dense length of the vector.
    pub n: u64,
    /// FNV-1a of the other arguments ([`Stamp::new`]).
    pub params: u64,
    /// Sent as is; the receiver reads the sender's in [`Header::aux`].
    pub aux: u64,
}

impl Stamp {
    /// A stamp for length `n` and the arguments `params` (any words the ranks must agree on).
    pub fn new(n: u64, params: &[u64]) -> Stamp {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for w in params {
            for b in w.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        Stamp {
            n,
            params: h,
            aux: 0,
        }
    }

    /// The same stamp sending `aux`.
    pub fn with_aux(self, aux: u64) -> Stamp {
        Stamp { aux, ..self }
    }
}

/// The fields of a segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Dense form.
    pub dense: bool,
    /// Index bytes (sparse form).
    pub width: usize,
    /// The call's stamp.
    pub stamp: Stamp,
    /// Region start.
    pub start: u64,
    /// Region length.
    pub len: u64,
    /// Entries (sparse) or `len` (dense).
    pub count: u64,
    /// The sender's word ([`Stamp::aux`]).
    pub aux: u64,
}

fn put_header(out: &mut Vec<u8>, format: u8, stamp: Stamp, start: u64, len: u64, count: u64) {
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[format, 0, 0, 0]);
    for w in [stamp.n, stamp.params, start, len, count, stamp.aux] {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

fn put_f32s(out: &mut Vec<u8>, vals: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(vals));
    } else {
        for v in vals {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Appends the segment of the entries `idx`/`val` (absolute indices, strictly increasing,
/// inside `start..start+len`) to `out`, dense when [`prefers_dense`] says so.
pub fn encode_sparse(
    out: &mut Vec<u8>,
    stamp: Stamp,
    start: u64,
    len: u64,
    idx: &[u64],
    val: &[f32],
) {
    debug_assert_eq!(idx.len(), val.len());
    let count = idx.len() as u64;
    if prefers_dense(count, len) {
        put_header(out, FORMAT_DENSE, stamp, start, len, len);
        let base = out.len();
        out.resize(base + len as usize * 4, 0);
        let body = &mut out[base..];
        for (&i, v) in idx.iter().zip(val) {
            let o = (i - start) as usize * 4;
            body[o..o + 4].copy_from_slice(&v.to_le_bytes());
        }
        return;
    }
    let width = index_width(len);
    let format = if width == 4 {
        FORMAT_SPARSE32
    } else {
        FORMAT_SPARSE64
    };
    put_header(out, format, stamp, start, len, count);
    let base = out.len();
    out.resize(base + idx.len() * width, 0);
    let body = &mut out[base..];
    if width == 4 {
        for (dst, &i) in body.chunks_exact_mut(4).zip(idx) {
            dst.copy_from_slice(&((i - start) as u32).to_le_bytes());
        }
    } else {
        for (dst, &i) in body.chunks_exact_mut(8).zip(idx) {
            dst.copy_from_slice(&(i - start).to_le_bytes());
        }
    }
    put_f32s(out, val);
}

/// Appends the dense segment of `vals`, the region `start..start+vals.len()`.
pub fn encode_dense(out: &mut Vec<u8>, stamp: Stamp, start: u64, vals: &[f32]) {
    let len = vals.len() as u64;
    put_header(out, FORMAT_DENSE, stamp, start, len, len);
    put_f32s(out, vals);
}

/// Where a received segment may lie and how many entries it may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The region must be exactly this (`Some`) or lie inside `0..n` (`None`).
    pub region: Option<(u64, u64)>,
    /// At most this many entries in sparse form.
    pub max_entries: u64,
}

/// A validated segment, read in place from the received bytes.
#[derive(Clone, Copy, Debug)]
pub struct SegView<'a> {
    /// Its header.
    pub header: Header,
    idx: &'a [u8],
    val: &'a [u8],
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

fn f32_at(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn protocol(peer: usize, what: String) -> TransportError {
    TransportError::Protocol { peer, what }
}

impl<'a> SegView<'a> {
    /// Validates `bytes`, a segment received from `peer`, against this rank's `stamp` and
    /// what the schedule expects (see the module documentation).
    pub fn parse(
        bytes: &'a [u8],
        peer: usize,
        stamp: Stamp,
        expect: Expect,
    ) -> Result<SegView<'a>> {
        let bad = |what: String| protocol(peer, format!("sparse segment: {what}"));
        if bytes.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes, shorter than its header",
                bytes.len()
            )));
        }
        if bytes[0..4] != MAGIC || bytes[5..8] != [0, 0, 0] {
            return Err(bad(
                "bad magic or reserved bytes (not a sparse stream)".into()
            ));
        }
        let format = bytes[4];
        let (n, params) = (le_u64(bytes, 8), le_u64(bytes, 16));
        let (start, len, count) = (le_u64(bytes, 24), le_u64(bytes, 32), le_u64(bytes, 40));
        let aux = le_u64(bytes, 48);
        if n != stamp.n {
            // Lengths in bytes of the dense vectors, as an allreduce of different counts.
            let bytes_of = |n: u64| usize::try_from(n.saturating_mul(4)).unwrap_or(usize::MAX);
            return Err(TransportError::Mismatch {
                peer,
                expected_tag: 0,
                got_tag: 0,
                expected_len: bytes_of(stamp.n),
                got_len: bytes_of(n),
            });
        }
        if params != stamp.params {
            return Err(protocol(
                peer,
                "sparse allreduce called with other arguments than on this rank (algorithm, \
                 top-k ratio, reduction, options, or a top-k state at another step)"
                    .into(),
            ));
        }
        let end = start.checked_add(len).filter(|&e| e <= n);
        let Some(end) = end else {
            return Err(bad(format!("region {start}+{len} outside 0..{n}")));
        };
        if let Some((s, l)) = expect.region {
            if (s, l) != (start, len) {
                return Err(bad(format!(
                    "region {start}..{end} where {s}..{} was expected",
                    s + l
                )));
            }
        }
        let body = &bytes[HEADER_BYTES..];
        let (dense, width) = match format {
            FORMAT_DENSE => (true, 0),
            FORMAT_SPARSE32 | FORMAT_SPARSE64 => {
                let width = if format == FORMAT_SPARSE32 { 4 } else { 8 };
                if width != index_width(len) {
                    return Err(bad(format!("{width}-byte indices for a region of {len}")));
                }
                (false, width)
            }
            f => return Err(bad(format!("unknown format {f}"))),
        };
        let header = Header {
            dense,
            width,
            stamp,
            start,
            len,
            count,
            aux,
        };
        if dense {
            if count != len || body.len() as u128 != dense_bytes(len) {
                return Err(bad(format!(
                    "dense region of {len} with count {count} in {} bytes",
                    body.len()
                )));
            }
            return Ok(SegView {
                header,
                idx: &[],
                val: body,
            });
        }
        if count > len || count > expect.max_entries {
            return Err(bad(format!(
                "{count} entries in a region of {len} (at most {} expected)",
                expect.max_entries.min(len)
            )));
        }
        if body.len() as u128 != sparse_bytes(count, len) {
            return Err(bad(format!(
                "{count} entries in {} bytes (truncated or padded)",
                body.len()
            )));
        }
        let (idx, val) = body.split_at(count as usize * width);
        let view = SegView { header, idx, val };
        let mut prev: Option<u64> = None;
        for i in view.rel_indices() {
            if i >= len || prev.is_some_and(|p| i <= p) {
                return Err(bad(format!(
                    "index {i} out of order or outside the region of {len}"
                )));
            }
            prev = Some(i);
        }
        Ok(view)
    }

    fn rel_indices(&self) -> impl Iterator<Item = u64> + 'a {
        let w = self.header.width.max(1);
        self.idx.chunks_exact(w).map(move |c| {
            if w == 4 {
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64
            } else {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_le_bytes(b)
            }
        })
    }

    /// The values, in order (dense: one per position of the region).
    pub fn values(&self) -> impl Iterator<Item = f32> + 'a {
        self.val.chunks_exact(4).map(f32_at)
    }

    /// Sparse form: the entries (absolute index, value); dense: every position.
    pub fn entries(&self) -> impl Iterator<Item = (u64, f32)> + 'a {
        let start = self.header.start;
        let dense = self.header.dense;
        let rel = self.rel_indices();
        let mut pos = 0u64;
        let mut rel = rel.fuse();
        self.values().map(move |v| {
            let i = if dense {
                pos += 1;
                pos - 1
            } else {
                rel.next().unwrap_or(0)
            };
            (start + i, v)
        })
    }

    /// Number of entries: `count` in sparse form, `len` in dense form.
    pub fn count(&self) -> u64 {
        self.header.count
    }

    /// Appends the entries to `idx`/`val`; with `skip_zeros`, the zero values of a dense
    /// segment are left out (positions nobody sent).
    pub fn append_to(&self, idx: &mut Vec<u64>, val: &mut Vec<f32>, skip_zeros: bool) {
        for (i, v) in self.entries() {
            // (Zero by its bits: with denormals flushed (DAZ), a kept subnormal compares
            // equal to 0.0, and the ranks would disagree on the count.)
            if !(skip_zeros && self.header.dense && super::mag(v) == 0) {
                idx.push(i);
                val.push(v);
            }
        }
    }

    /// `dst[i − dst_start] += v` for every entry (every position when dense); the region
    /// must lie inside `dst_start..dst_start + dst.len()`.
    pub fn add_to(&self, dst: &mut [f32], dst_start: u64) {
        let off = (self.header.start - dst_start) as usize;
        if self.header.dense {
            let d = &mut dst[off..off + self.header.len as usize];
            for (x, v) in d.iter_mut().zip(self.values()) {
                *x += v;
            }
        } else {
            for (i, v) in self.entries() {
                dst[(i - dst_start) as usize] += v;
            }
        }
    }

    /// `dst[i] = v` for every entry (every position when dense), `dst` spanning `0..n`.
    pub fn write_to(&self, dst: &mut [f32]) {
        if self.header.dense {
            let s = self.header.start as usize;
            let d = &mut dst[s..s + self.header.len as usize];
            if cfg!(target_endian = "little") {
                // Received bytes are 4-aligned when the receive buffer is; else copy per value.
                if let Ok(src) = bytemuck::try_cast_slice::<u8, f32>(self.val) {
                    d.copy_from_slice(src);
                    return;
                }
            }
            for (x, v) in d.iter_mut().zip(self.values()) {
                *x = v;
            }
        } else {
            for (i, v) in self.entries() {
                dst[i as usize] = v;
            }
        }
    }
}

/// The running sum of a region `start..start+len`: sparse entries or dense values.
#[derive(Clone, Debug, PartialEq)]
pub enum Acc {
    /// Absolute indices (strictly increasing) and values.
    Sparse {
        /// Indices.
        idx: Vec<u64>,
        /// Values.
        val: Vec<f32>,
    },
    /// One value per position of the region, built by additions onto `+0.0` (so it never
    /// holds `−0.0`, which keeps sums identical whichever side adds).
    Dense(Vec<f32>),
}

impl Acc {
    /// Entries (sparse) or positions (dense).
    pub fn count(&self) -> u64 {
        match self {
            Acc::Sparse { idx, .. } => idx.len() as u64,
            Acc::Dense(v) => v.len() as u64,
        }
    }

    /// Appends this sum's segment for region `start..start+len`.
    pub fn encode(&self, out: &mut Vec<u8>, stamp: Stamp, start: u64, len: u64) {
        match self {
            Acc::Sparse { idx, val } => encode_sparse(out, stamp, start, len, idx, val),
            Acc::Dense(v) => encode_dense(out, stamp, start, v),
        }
    }

    /// Adds into `dst` (region starting at `start`).
    pub fn add_to(&self, dst: &mut [f32], start: u64) {
        match self {
            Acc::Sparse { idx, val } => {
                for (&i, &v) in idx.iter().zip(val) {
                    dst[(i - start) as usize] += v;
                }
            }
            Acc::Dense(v) => {
                for (x, &y) in dst.iter_mut().zip(v) {
                    *x += y;
                }
            }
        }
    }
}

/// Merges two sorted entry lists, summing equal indices.
pub fn merge(a: (&[u64], &[f32]), b: (&[u64], &[f32])) -> (Vec<u64>, Vec<f32>) {
    let (ai, av) = a;
    let (bi, bv) = b;
    let mut idx = Vec::with_capacity(ai.len() + bi.len());
    let mut val = Vec::with_capacity(ai.len() + bi.len());
    let (mut x, mut y) = (0, 0);
    while x < ai.len() && y < bi.len() {
        match ai[x].cmp(&bi[y]) {
            std::cmp::Ordering::Less => {
                idx.push(ai[x]);
                val.push(av[x]);
                x += 1;
            }
            std::cmp::Ordering::Greater => {
                idx.push(bi[y]);
                val.push(bv[y]);
                y += 1;
            }
            std::cmp::Ordering::Equal => {
                idx.push(ai[x]);
                val.push(av[x] + bv[y]);
                x += 1;
                y += 1;
            }
        }
    }
    idx.extend_from_slice(&ai[x..]);
    val.extend_from_slice(&av[x..]);
    idx.extend_from_slice(&bi[y..]);
    val.extend_from_slice(&bv[y..]);
    (idx, val)
}

/// One contribution to a region's sum.
pub enum Part<'a> {
    /// Entries held locally.
    Local(&'a [u64], &'a [f32]),
    /// A received segment.
    View(SegView<'a>),
}

impl Part<'_> {
    fn count(&self) -> u64 {
        match self {
            Part::Local(i, _) => i.len() as u64,
            Part::View(v) => v.count(),
        }
    }
    fn is_dense(&self) -> bool {
        matches!(self, Part::View(v) if v.header.dense)
    }
}

/// The sum of `parts` over the region `start..start+len`, added in the order given: dense
/// when any part is dense or the parts' entries together pass [`prefers_dense`], else the
/// sparse union (merged pairwise, as a balanced tree).
pub fn sum_parts(parts: &[Part<'_>], start: u64, len: u64) -> Acc {
    let total: u64 = parts.iter().map(Part::count).fold(0, u64::saturating_add);
    if parts.iter().any(Part::is_dense) || prefers_dense(total, len) {
        let mut d = vec![0f32; len as usize];
        for p in parts {
            match p {
                Part::Local(i, v) => {
                    for (&i, &v) in i.iter().zip(*v) {
                        d[(i - start) as usize] += v;
                    }
                }
                Part::View(v) => v.add_to(&mut d, start),
            }
        }
        return Acc::Dense(d);
    }
    let mut lists: Vec<(Vec<u64>, Vec<f32>)> = parts
        .iter()
        .map(|p| match p {
            Part::Local(i, v) => (i.to_vec(), v.to_vec()),
            Part::View(v) => {
                let mut l = (Vec::new(), Vec::new());
                v.append_to(&mut l.0, &mut l.1, false);
                l
            }
        })
        .collect();
    while lists.len() > 1 {
        let mut next = Vec::with_capacity(lists.len().div_ceil(2));
        let mut it = lists.into_iter();
        while let Some(a) = it.next() {
            match it.next() {
                Some(b) => next.push(merge((&a.0, &a.1), (&b.0, &b.1))),
                None => next.push(a),
            }
        }
        lists = next;
    }
    let (idx, val) = lists.pop().unwrap_or_default();
    Acc::Sparse { idx, val }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STAMP: Stamp = Stamp {
        n: 1000,
        params: 7,
        aux: 0,
    };
    const ANY: Expect = Expect {
        region: None,
        max_entries: u64::MAX,
    };

    fn seg(start: u64, len: u64, idx: &[u64], val: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_sparse(&mut out, STAMP, start, len, idx, val);
        out
    }

    #[test]
    fn round_trip_sparse_and_dense() {
        let b = seg(100, 50, &[100, 120, 149], &[1.0, -2.0, 3.5]);
        assert_eq!(b.len(), HEADER_BYTES + 3 * 8);
        let v = SegView::parse(&b, 1, STAMP, ANY).unwrap();
        assert!(!v.header.dense);
        let e: Vec<_> = v.entries().collect();
        assert_eq!(e, [(100, 1.0), (120, -2.0), (149, 3.5)]);
        // Half full: the dense switch.
        let idx: Vec<u64> = (0..5).map(|i| 10 + 2 * i).collect();
        let b = seg(10, 10, &idx, &[1.0; 5]);
        let v = SegView::parse(&b, 1, STAMP, ANY).unwrap();
        assert!(v.header.dense);
        assert_eq!(v.count(), 10);
        let mut d = vec![0.0; 1000];
        v.write_to(&mut d);
        assert_eq!(
            d[10..20],
            [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
        );
        let (mut i, mut x) = (Vec::new(), Vec::new());
        v.append_to(&mut i, &mut x, true);
        assert_eq!(i, idx);
        // Empty region, empty segment.
        let b = seg(0, 0, &[], &[]);
        assert_eq!(SegView::parse(&b, 1, STAMP, ANY).unwrap().count(), 0);
    }

    #[test]
    fn wide_regions_use_u64_indices() {
        let stamp = Stamp {
            n: 1 << 33,
            params: 0,
            aux: 3,
        };
        let mut b = Vec::new();
        encode_sparse(&mut b, stamp, 0, 1 << 33, &[5, (1 << 33) - 1], &[1.0, 2.0]);
        assert_eq!(b.len(), HEADER_BYTES + 2 * 12);
        let v = SegView::parse(&b, 0, stamp.with_aux(0), ANY).unwrap();
        assert_eq!(v.entries().last(), Some(((1 << 33) - 1, 2.0)));
        assert_eq!(v.header.aux, 3);
        assert_eq!(index_width(1 << 32), 4);
        assert_eq!(index_width((1 << 32) + 1), 8);
    }

    fn err(b: &[u8], expect: Expect) -> String {
        SegView::parse(b, 3, STAMP, expect).unwrap_err().to_string()
    }

    #[test]
    fn corrupted_segments_are_errors() {
        let good = seg(0, 1000, &[1, 5, 9], &[1.0, 2.0, 3.0]);
        assert!(SegView::parse(&good, 3, STAMP, ANY).is_ok());
        // Truncated anywhere.
        for cut in 0..good.len() {
            assert!(
                SegView::parse(&good[..cut], 3, STAMP, ANY).is_err(),
                "cut {cut}"
            );
        }
        // Padded.
        let mut b = good.clone();
        b.push(0);
        assert!(err(&b, ANY).contains("truncated or padded"));
        // Bad magic, format, reserved.
        for (at, v) in [(0, b'X'), (4, 9), (6, 1)] {
            let mut b = good.clone();
            b[at] = v;
            assert!(SegView::parse(&b, 3, STAMP, ANY).is_err());
        }
        // Another n: a mismatch naming both lengths.
        let mut b = good.clone();
        b[8..16].copy_from_slice(&2000u64.to_le_bytes());
        match SegView::parse(&b, 3, STAMP, ANY) {
            Err(TransportError::Mismatch {
                peer: 3,
                expected_len: 4000,
                got_len: 8000,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        // Other arguments.
        let mut b = good.clone();
        b[16] ^= 1;
        assert!(err(&b, ANY).contains("other arguments"));
        // Region outside n, or not the expected one.
        let mut b = good.clone();
        b[24..32].copy_from_slice(&1u64.to_le_bytes());
        assert!(err(&b, ANY).contains("outside"));
        let exact = Expect {
            region: Some((0, 500)),
            max_entries: 10,
        };
        assert!(err(&good, exact).contains("expected"));
        // Count above the bound, or above the region.
        let few = Expect {
            region: None,
            max_entries: 2,
        };
        assert!(err(&good, few).contains("entries"));
        let mut b = good.clone();
        b[40..48].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(SegView::parse(&b, 3, STAMP, ANY).is_err());
        // Unsorted, repeated, out of range indices.
        for bad in [[5u32, 1, 9], [1, 1, 9], [1, 5, 1000]] {
            let mut b = good.clone();
            for (k, i) in bad.iter().enumerate() {
                b[HEADER_BYTES + 4 * k..HEADER_BYTES + 4 * k + 4].copy_from_slice(&i.to_le_bytes());
            }
            assert!(err(&b, ANY).contains("out of order"), "{bad:?}");
        }
        // Dense with a wrong count or length.
        let mut d = Vec::new();
        encode_dense(&mut d, STAMP, 0, &[1.0; 8]);
        assert!(SegView::parse(&d, 3, STAMP, ANY).is_ok());
        let mut b = d.clone();
        b[40..48].copy_from_slice(&7u64.to_le_bytes());
        assert!(SegView::parse(&b, 3, STAMP, ANY).is_err());
        assert!(SegView::parse(&d[..d.len() - 4], 3, STAMP, ANY).is_err());
    }

    #[test]
    fn sums_are_identical_whichever_side_adds() {
        // −0.0 and +0.0 entries summed densely in either order give the same bits.
        let a = seg(0, 4, &[0, 1], &[-0.0, 5.0]);
        let b = seg(0, 4, &[0, 2], &[-0.0, -0.0]);
        let (va, vb) = (
            SegView::parse(&a, 0, STAMP, ANY).unwrap(),
            SegView::parse(&b, 0, STAMP, ANY).unwrap(),
        );
        let ab = sum_parts(&[Part::View(va), Part::View(vb)], 0, 4);
        let ba = sum_parts(&[Part::View(vb), Part::View(va)], 0, 4);
        let bits = |a: &Acc| match a {
            Acc::Dense(v) => v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            Acc::Sparse { .. } => panic!("dense expected"),
        };
        assert_eq!(bits(&ab), bits(&ba));
    }

    proptest! {
        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = SegView::parse(&bytes, 0, STAMP, ANY);
            // With a valid header in front, the body is still checked.
            let mut b = seg(0, 1000, &[], &[]);
            b.truncate(HEADER_BYTES);
            b.extend_from_slice(&bytes);
            let n = (bytes.len() / 8) as u64;
            b[40..48].copy_from_slice(&n.to_le_bytes());
            if let Ok(v) = SegView::parse(&b, 0, STAMP, ANY) {
                let mut d = vec![0.0; 1000];
                v.add_to(&mut d, 0);
            }
        }

        #[test]
        fn encode_parse_round_trip(
            mut idx in proptest::collection::btree_set(0u64..300, 0..300),
            start in 0u64..100,
        ) {
            let idx: Vec<u64> = std::mem::take(&mut idx).into_iter().map(|i| i + start).collect();
            let val: Vec<f32> = idx.iter().map(|&i| i as f32 + 0.5).collect();
            let b = seg(start, 300, &idx, &val);
            prop_assert!(b.len() <= max_segment_bytes(idx.len() as u64, 300));
            let v = SegView::parse(&b, 0, STAMP, Expect { region: Some((start, 300)), max_entries: idx.len() as u64 }).unwrap();
            let (mut i, mut x) = (Vec::new(), Vec::new());
            v.append_to(&mut i, &mut x, true);
            prop_assert_eq!(i, idx);
            prop_assert_eq!(x, val);
        }
    }
}
