//! Where each rank's block lies in a buffer of the v-collectives (allgatherv, alltoallv,
//! gatherv, scatterv): back to back in rank order, or anywhere MPI's displacements put it.
//!
//! A [`Layout`] is in bytes and local to one rank: ranks agree on the counts (the messages
//! check them), each places the blocks in its own memory as it likes. A block of no bytes lies
//! nowhere (its displacement is ignored, as in MPI).

use std::ops::Range;

/// The byte range of every rank's block in one buffer, in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    blocks: Vec<Range<usize>>,
}

impl Layout {
    /// Blocks of `counts` bytes back to back from byte 0; `None` when they add up to more than
    /// `usize` holds.
    ///
    /// ```
    /// use chorus_algorithms::collectives::layout::Layout;
    /// let l = Layout::packed(&[3, 0, 2]).unwrap();
    /// assert_eq!((l.block(0), l.block(2), l.extent()), (0..3, 3..5, 5));
    /// assert_eq!(l.span(0..3), Some(0..5));
    /// ```
    pub fn packed(counts: &[usize]) -> Option<Layout> {
        let mut at = 0usize;
        let mut blocks = Vec::with_capacity(counts.len());
        for &c in counts {
            let end = at.checked_add(c)?;
            blocks.push(at..end);
            at = end;
        }
        Some(Layout { blocks })
    }

    /// Block `j` of `counts[j]` bytes at byte `displs[j]`; `None` when the lists differ in
    /// length or a block ends beyond `usize`. Empty blocks are put at `0..0`.
    ///
    /// ```
    /// use chorus_algorithms::collectives::layout::Layout;
    /// let l = Layout::displaced(&[2, 0, 2], &[4, 99, 0]).unwrap();
    /// assert_eq!((l.block(0), l.block(1), l.block(2)), (4..6, 0..0, 0..2));
    /// assert_eq!((l.extent(), l.total()), (6, 4));
    /// assert_eq!(l.span(0..3), None);
    /// assert!(Layout::displaced(&[2, 2], &[0, 1]).unwrap().overlap().is_some());
    /// ```
    pub fn displaced(counts: &[usize], displs: &[usize]) -> Option<Layout> {
        if counts.len() != displs.len() {
            return None;
        }
        let blocks = counts
            .iter()
            .zip(displs)
            .map(|(&c, &d)| match c {
                0 => Some(0..0),
                _ => Some(d..d.checked_add(c)?),
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Layout { blocks })
    }

    /// Blocks of `counts[j]` elements of `elem` bytes, back to back (`displs` `None`) or at
    /// `displs[j]` elements (an empty block's displacement ignored); `None` when the lists
    /// differ in length or a byte offset goes beyond what memory can hold (`isize::MAX`).
    ///
    /// ```
    /// use chorus_algorithms::collectives::layout::Layout;
    /// let l = Layout::of_elements(&[1, 0, 2], Some(&[3, usize::MAX, 0]), 4).unwrap();
    /// assert_eq!((l.block(0), l.block(1), l.block(2), l.extent()), (12..16, 0..0, 0..8, 16));
    /// assert_eq!(Layout::of_elements(&[1, 2], None, 4).unwrap().block(1), 4..12);
    /// assert_eq!(Layout::of_elements(&[1], Some(&[usize::MAX / 2]), 4), None);
    /// ```
    pub fn of_elements(counts: &[usize], displs: Option<&[usize]>, elem: usize) -> Option<Layout> {
        let bytes: Vec<usize> = counts
            .iter()
            .map(|c| c.checked_mul(elem))
            .collect::<Option<_>>()?;
        let layout = match displs {
            None => Layout::packed(&bytes)?,
            Some(d) if d.len() == counts.len() => {
                let at: Vec<usize> = d
                    .iter()
                    .zip(counts)
                    .map(|(&d, &c)| if c == 0 { Some(0) } else { d.checked_mul(elem) })
                    .collect::<Option<_>>()?;
                Layout::displaced(&bytes, &at)?
            }
            Some(_) => return None,
        };
        (layout.extent() <= isize::MAX as usize).then_some(layout)
    }

    /// How many blocks (ranks).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether there are no blocks at all.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The bytes of block `j`.
    pub fn block(&self, j: usize) -> Range<usize> {
        self.blocks[j].clone()
    }

    /// How many bytes the buffer needs: the largest end of a block.
    pub fn extent(&self) -> usize {
        self.blocks.iter().map(|b| b.end).max().unwrap_or(0)
    }

    /// The bytes of all blocks, `None` when that overflows (overlapping blocks count twice).
    pub fn checked_total(&self) -> Option<usize> {
        self.blocks
            .iter()
            .try_fold(0usize, |t, b| t.checked_add(b.len()))
    }

    /// The bytes of all blocks (see [`Layout::checked_total`]; saturates).
    pub fn total(&self) -> usize {
        self.checked_total().unwrap_or(usize::MAX)
    }

    /// The bytes of blocks `r` when they lie back to back in rank order (empty blocks
    /// anywhere), so that they can travel as one slice; `None` when they do not.
    pub fn span(&self, r: Range<usize>) -> Option<Range<usize>> {
        let mut at: Option<Range<usize>> = None;
        for b in &self.blocks[r] {
            if b.is_empty() {
                continue;
            }
            at = match at {
                None => Some(b.clone()),
                Some(a) if a.end == b.start => Some(a.start..b.end),
                Some(_) => return None,
            };
        }
        Some(at.unwrap_or(0..0))
    }

    /// Two blocks that share a byte (the lower rank first), if any.
    pub fn overlap(&self) -> Option<(usize, usize)> {
        let mut order: Vec<usize> = (0..self.blocks.len())
            .filter(|&j| !self.blocks[j].is_empty())
            .collect();
        order.sort_by_key(|&j| self.blocks[j].start);
        order.windows(2).find_map(|w| {
            (self.blocks[w[0]].end > self.blocks[w[1]].start)
                .then(|| (w[0].min(w[1]), w[0].max(w[1])))
        })
    }

    /// A description of what is wrong with this layout for a buffer of `len` bytes (blocks
    /// beyond it; overlapping blocks when `writable`), or `None` when it fits.
    pub fn misfit(&self, len: usize, writable: bool) -> Option<String> {
        if let Some(j) = (0..self.blocks.len()).find(|&j| self.blocks[j].end > len) {
            return Some(format!(
                "block {j} (bytes {:?}) lies beyond the {len}-byte buffer",
                self.blocks[j]
            ));
        }
        if writable {
            if let Some((a, b)) = self.overlap() {
                return Some(format!(
                    "the blocks of ranks {a} and {b} overlap ({:?} and {:?})",
                    self.blocks[a], self.blocks[b]
                ));
            }
        }
        None
    }

    /// `buf` cut into the blocks, in rank order.
    ///
    /// # Panics
    /// If the blocks overlap or lie beyond `buf` (see [`Layout::misfit`]).
    pub fn pieces<'a>(&self, buf: &'a mut [u8]) -> Vec<&'a mut [u8]> {
        let mut order: Vec<usize> = (0..self.blocks.len())
            .filter(|&j| !self.blocks[j].is_empty())
            .collect();
        order.sort_by_key(|&j| self.blocks[j].start);
        let mut out: Vec<&'a mut [u8]> =
            (0..self.blocks.len()).map(|_| Default::default()).collect();
        let (mut rest, mut at) = (buf, 0usize);
        for j in order {
            let b = &self.blocks[j];
            let tail = std::mem::take(&mut rest);
            let (_, tail) = tail.split_at_mut(b.start - at);
            let (piece, tail) = tail.split_at_mut(b.len());
            out[j] = piece;
            rest = tail;
            at = b.end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_the_blocks_in_rank_order() {
        let l = Layout::displaced(&[2, 0, 3, 1], &[5, 0, 0, 8]).unwrap();
        assert_eq!(l.misfit(9, true), None);
        assert!(l.misfit(8, false).unwrap().contains("block 3"));
        let mut buf: Vec<u8> = (0..9).collect();
        let p = l.pieces(&mut buf);
        assert_eq!(p[0], &[5, 6][..]);
        assert!(p[1].is_empty());
        assert_eq!(p[2], &[0, 1, 2][..]);
        assert_eq!(p[3], &[8][..]);
    }

    #[test]
    fn spans_and_overlaps() {
        let l = Layout::displaced(&[2, 0, 3, 1], &[0, 7, 2, 5]).unwrap();
        assert_eq!(l.span(0..4), Some(0..6));
        assert_eq!(l.span(1..3), Some(2..5));
        let gap = Layout::displaced(&[2, 2], &[0, 3]).unwrap();
        assert_eq!((gap.span(0..2), gap.overlap()), (None, None));
        let back = Layout::displaced(&[2, 2], &[2, 0]).unwrap();
        assert_eq!((back.span(0..2), back.span(1..2)), (None, Some(0..2)));
        let over = Layout::displaced(&[3, 1, 2], &[0, 9, 2]).unwrap();
        assert_eq!(over.overlap(), Some((0, 2)));
        assert!(over.misfit(10, true).unwrap().contains("ranks 0 and 2"));
        assert_eq!(over.misfit(10, false), None);
        assert_eq!(Layout::displaced(&[1], &[usize::MAX]), None);
        assert_eq!(Layout::displaced(&[1], &[]), None);
    }
}
