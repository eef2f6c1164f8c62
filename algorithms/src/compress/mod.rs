//! Compressed allreduce: codecs that shrink f32 gradients on the wire, and the schedules that
//! reduce with them without letting the error grow with the number of ranks.
//!
//! # Codecs ([`Codec`])
//! | codec | bits per value | per chunk | rounding | bias |
//! |---|---|---|---|---|
//! | `fp16`, `bf16` | 16 | — | to nearest | none beyond rounding |
//! | `int8`, `int4` | 8, 4 | f32 step | stochastic | unbiased |
//! | `ternary` (`-clip`) | 2 | f32 step | stochastic to {−1, 0, 1} | unbiased (clipped: outliers) |
//! | `sign` (`1bit`) | 1 | f32 scale | sign × mean magnitude | biased: use error feedback |
//!
//! A **chunk** is a run of [`DEFAULT_CHUNK`] (or the caller's `chunk`) consecutive values
//! sharing one scale; the last chunk may be shorter. Encoded chunks are laid out one after the
//! other, each as its scale followed by its packed codes, so the encoding of a run of whole
//! chunks is a contiguous byte range ([`Codec::encoded_len`]). Random draws come from a
//! seeded [`Rng`] that each rank keeps, so runs are reproducible.
//!
//! Everything decoded comes from a peer and is checked: lengths, scales (finite, not
//! negative) and codes; a failure is a [`CodecError`], never a panic.
//!
//! # Schedules ([`Schedule`], [`all_reduce_compressed`])
//! - **scatter-gather** (any codec; the default for fp16, bf16 and sign): quantize once per
//!   owner, all-to-all, the owner sums in f32 and re-quantizes once, the allgather forwards
//!   codes undecoded;
//! - **integer domain** (int8, int4, ternary; their default): a range per chunk shared by all
//!   ranks, so codes add up exactly as integers and nothing is re-quantized.
//!
//! See [`allreduce`] for the steps, volumes and the wire format.
//!
//! # Error feedback ([`Residual`])
//! `p = g + e; send C(p); e ← p − decode(C(p))`: what a biased codec drops is carried to the
//! next call instead of being lost. The residual is state the caller keeps per tensor. It is on
//! by default for biased codecs ([`CompressedOptions::new`]).
//!
//! ```
//! use chorus_algorithms::compress::{Codec, Rng, DEFAULT_CHUNK};
//! let x: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.01).sin()).collect();
//! let codec = Codec::parse("int8").unwrap();
//! let mut bytes = vec![0u8; codec.encoded_len(x.len(), DEFAULT_CHUNK)];
//! codec.encode(&x, DEFAULT_CHUNK, &mut bytes, &mut Rng::new(1, 0));
//! let mut y = vec![0f32; x.len()];
//! codec.decode(&bytes, DEFAULT_CHUNK, &mut y).unwrap();
//! // Each value is within one step (its chunk's largest magnitude / 127).
//! assert!(x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1.0 / 127.0));
//! assert_eq!(bytes.len(), 3000 + 3 * 4);
//! ```

pub mod allreduce;
mod cast;
mod pack;
mod rng;
mod sign;
mod stochastic;

use std::fmt;
use std::str::FromStr;

use chorus_transport::TransportError;

pub use allreduce::{all_reduce_compressed, plan, Plan};
pub use rng::Rng;

use crate::ParseNameError;
use cast::Half;
use stochastic::Levels;

/// The default number of values sharing one scale (DESIGN §3: 512–4096).
pub const DEFAULT_CHUNK: usize = 1024;

/// Values handled at once by the kernels (stack buffers); a multiple of 8 so packed blocks
/// start on byte boundaries.
const BLOCK: usize = 256;

/// How decoded values land in the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Overwrite.
    Set,
    /// Accumulate.
    Add,
    /// Subtract (error feedback: `residual −= decoded`).
    Sub,
}

/// Whether no value is NaN or ±∞ (an integer OR over the exponent test, which vectorises).
fn all_finite(v: &[f32]) -> bool {
    v.iter().fold(0u32, |acc, x| {
        acc | u32::from(x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
    }) == 0
}

/// `out (op)= v` element by element.
#[inline]
fn apply(mode: Mode, out: &mut [f32], v: &[f32]) {
    let pairs = out.iter_mut().zip(v);
    match mode {
        Mode::Set => pairs.for_each(|(o, &x)| *o = x),
        Mode::Add => pairs.for_each(|(o, &x)| *o += x),
        Mode::Sub => pairs.for_each(|(o, &x)| *o -= x),
    }
}

/// Why encoded bytes could not be decoded. The output is then partly written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CodecError {
    /// The bytes do not have the length the codec gives the number of values.
    Length {
        /// [`Codec::encoded_len`] of the output's length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A chunk's scale is NaN or infinite: the encoder's input held NaN or ±∞ there (or the
    /// bytes are corrupt).
    NonFinite {
        /// The chunk's index.
        chunk: usize,
    },
    /// Bytes no encoder produces: a negative scale, a reserved code, non-zero padding.
    Invalid {
        /// The chunk's index.
        chunk: usize,
        /// What was wrong.
        what: &'static str,
    },
    /// A chunk size of zero.
    ZeroChunk,
}

impl fmt::Display for CodecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CodecError::Length { expected, got } => write!(
                f,
                "compressed data of {got} bytes where {expected} were expected"
            ),
            CodecError::NonFinite { chunk } => write!(
                f,
                "chunk {chunk} has a NaN or infinite scale (its input held NaN or inf)"
            ),
            CodecError::Invalid { chunk, what } => {
                write!(f, "chunk {chunk} is not valid compressed data: {what}")
            }
            CodecError::ZeroChunk => f.write_str("a chunk size of zero"),
        }
    }
}

impl std::error::Error for CodecError {}

impl From<CodecError> for TransportError {
    /// An invalid argument: bytes handed to a decoder directly. (The schedules report bad
    /// bytes from a peer with the peer's rank instead.)
    fn from(e: CodecError) -> Self {
        TransportError::InvalidArgument(format!("decode: {e}"))
    }
}

/// A gradient codec. See the [module documentation](self) for the formats and bounds.
///
/// ```
/// use chorus_algorithms::compress::{Codec, Schedule};
/// let c = Codec::parse("ternary-clip").unwrap();
/// assert_eq!(c, Codec::Ternary { clip: true });
/// assert_eq!(c.name(), "ternary-clip");
/// assert!(c.integer_ring());
/// assert_eq!(Codec::Sign.default_schedule(), Schedule::ScatterGather);
/// assert_eq!(Codec::Int4.encoded_len(2048, 1024), 2 * (4 + 512));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    /// IEEE half precision, round to nearest, as a cast: beyond ±65504 is ±∞ (a sum that
    /// overflows reads ±∞ on every rank, as in an fp16 allreduce).
    F16,
    /// bfloat16, round to nearest even.
    Bf16,
    /// 8-bit integers in −127..=127 with a step per chunk, stochastic rounding.
    Int8,
    /// 4-bit integers in −7..=7 with a step per chunk, stochastic rounding.
    Int4,
    /// One bit per value (its sign) and the chunk's mean magnitude.
    Sign,
    /// TernGrad: {−1, 0, 1} times the chunk's largest magnitude, stochastic; with `clip`, the
    /// range is capped at 2.5 root mean squares of the chunk.
    Ternary {
        /// Clip the range at 2.5σ.
        clip: bool,
    },
}

impl Codec {
    /// Every codec.
    pub const ALL: [Codec; 7] = [
        Codec::F16,
        Codec::Bf16,
        Codec::Int8,
        Codec::Int4,
        Codec::Sign,
        Codec::Ternary { clip: false },
        Codec::Ternary { clip: true },
    ];

    /// The codec of a name: `fp16`|`f16`, `bf16`, `int8`, `int4`, `sign`|`1bit`, `ternary`,
    /// `ternary-clip` (case-insensitive, `_` for `-` accepted).
    pub fn parse(s: &str) -> Option<Codec> {
        let name = s.trim().to_ascii_lowercase().replace('_', "-");
        Some(match name.as_str() {
            "fp16" | "f16" => Codec::F16,
            "bf16" => Codec::Bf16,
            "int8" => Codec::Int8,
            "int4" => Codec::Int4,
            "sign" | "1bit" => Codec::Sign,
            "ternary" => Codec::Ternary { clip: false },
            "ternary-clip" => Codec::Ternary { clip: true },
            _ => return None,
        })
    }

    /// The canonical name ([`Codec::parse`] accepts it).
    pub fn name(&self) -> &'static str {
        match self {
            Codec::F16 => "fp16",
            Codec::Bf16 => "bf16",
            Codec::Int8 => "int8",
            Codec::Int4 => "int4",
            Codec::Sign => "sign",
            Codec::Ternary { clip: false } => "ternary",
            Codec::Ternary { clip: true } => "ternary-clip",
        }
    }

    /// Whether decoding is systematically off from the input, so that error feedback should be
    /// on by default: only `sign`. The stochastic codecs are unbiased; fp16 and bf16 round to
    /// nearest. (Clipped ternary is biased on the few values beyond 2.5σ only, and counts as
    /// unbiased here, as in TernGrad.)
    pub fn is_biased(&self) -> bool {
        matches!(self, Codec::Sign)
    }

    /// Bits each value takes on the wire, without the per-chunk scales (32 bits per chunk,
    /// see [`Codec::encoded_len`]).
    pub fn bits_per_value(&self) -> f64 {
        match self.family() {
            Family::Half(_) => 16.0,
            Family::Stochastic(lv) => f64::from(lv.bits),
            Family::Sign => 1.0,
        }
    }

    /// Bytes of `n` encoded values with `chunk` values per scale, scales included.
    ///
    /// # Panics
    /// If `chunk` is zero.
    pub fn encoded_len(&self, n: usize, chunk: usize) -> usize {
        assert!(chunk > 0, "a chunk size of zero");
        let (full, rest) = (n / chunk, n % chunk);
        let bytes = |m: usize| match self.family() {
            Family::Half(_) => 2 * m,
            Family::Stochastic(lv) => stochastic::chunk_bytes(lv, m),
            Family::Sign => sign::chunk_bytes(m),
        };
        // (A chunk longer than `n` is never sized: it may be any value up to `usize::MAX`.)
        let whole = if full > 0 { full * bytes(chunk) } else { 0 };
        whole + if rest > 0 { bytes(rest) } else { 0 }
    }

    /// Encodes `x` into `out` (exactly [`Codec::encoded_len`] bytes), drawing the stochastic
    /// rounding from `rng`. A chunk holding NaN or ±∞ is encoded as such and fails to decode
    /// ([`CodecError::NonFinite`]), except in fp16 and bf16 which carry them.
    ///
    /// # Panics
    /// If `chunk` is zero or `out` has the wrong length.
    pub fn encode(&self, x: &[f32], chunk: usize, out: &mut [u8], rng: &mut Rng) {
        let want = self.encoded_len(x.len(), chunk);
        assert_eq!(out.len(), want, "encode: output of the wrong length");
        match self.family() {
            Family::Half(h) => cast::encode(h, x, out),
            Family::Stochastic(lv) => stochastic::encode(lv, x, chunk, out, rng),
            Family::Sign => sign::encode(x, chunk, out),
        }
    }

    /// Error feedback: encodes `x + residual` into `out` and leaves in `residual` what the
    /// encoding lost, `(x + residual) − decode(out)`.
    ///
    /// ```
    /// use chorus_algorithms::compress::{Codec, Rng};
    /// let g = [0.3f32, -1.0, 0.25, 0.0];
    /// let mut e = [0.0f32; 4];
    /// let mut out = vec![0u8; Codec::Sign.encoded_len(4, 4)];
    /// Codec::Sign.encode_with_feedback(&g, &mut e, 4, &mut out, &mut Rng::new(0, 0));
    /// let mut sent = [0.0f32; 4];
    /// Codec::Sign.decode(&out, 4, &mut sent).unwrap();
    /// for i in 0..4 {
    ///     assert!((sent[i] + e[i] - g[i]).abs() < 1e-6);
    /// }
    /// ```
    ///
    /// # Panics
    /// If `chunk` is zero, `residual` and `x` differ in length, or `out` has the wrong
    /// length.
    pub fn encode_with_feedback(
        &self,
        x: &[f32],
        residual: &mut [f32],
        chunk: usize,
        out: &mut [u8],
        rng: &mut Rng,
    ) {
        assert_eq!(x.len(), residual.len(), "residual of the wrong length");
        let want = self.encoded_len(x.len(), chunk);
        assert_eq!(out.len(), want, "encode: output of the wrong length");
        if matches!(self.family(), Family::Sign) {
            sign::encode_with_feedback(x, residual, chunk, out);
            return;
        }
        apply(Mode::Add, residual, x);
        self.encode(residual, chunk, out, rng);
        let mut pos = 0;
        for r in residual.chunks_mut(chunk) {
            let len = self.encoded_len(r.len(), chunk);
            // A chunk that held NaN or ±∞ fails to decode: its residual is dropped rather than
            // carried into every later call. fp16/bf16 encode each value alone: a non-finite
            // one (or one past the format's range, sent as ±∞) leaves NaN or ±∞ behind in its
            // own entry only, which is dropped; the rest of the chunk keeps its residual.
            let failed = self
                .decode_mode(&out[pos..pos + len], chunk, r, Mode::Sub)
                .is_err();
            if failed {
                r.fill(0.0);
            } else if !all_finite(r) {
                r.iter_mut()
                    .filter(|v| !v.is_finite())
                    .for_each(|v| *v = 0.0);
            }
            pos += len;
        }
    }

    /// Decodes `bytes` into `out`, overwriting it. The number of values is `out.len()`.
    pub fn decode(&self, bytes: &[u8], chunk: usize, out: &mut [f32]) -> Result<(), CodecError> {
        self.decode_mode(bytes, chunk, out, Mode::Set)
    }

    /// Decodes `bytes` and adds the values to `out`.
    pub fn decode_add(
        &self,
        bytes: &[u8],
        chunk: usize,
        out: &mut [f32],
    ) -> Result<(), CodecError> {
        self.decode_mode(bytes, chunk, out, Mode::Add)
    }

    pub(crate) fn decode_mode(
        &self,
        bytes: &[u8],
        chunk: usize,
        out: &mut [f32],
        mode: Mode,
    ) -> Result<(), CodecError> {
        if chunk == 0 {
            return Err(CodecError::ZeroChunk);
        }
        let expected = self.encoded_len(out.len(), chunk);
        if bytes.len() != expected {
            return Err(CodecError::Length {
                expected,
                got: bytes.len(),
            });
        }
        match self.family() {
            Family::Half(h) => {
                cast::decode(h, bytes, out, mode);
                Ok(())
            }
            Family::Stochastic(lv) => stochastic::decode(lv, bytes, chunk, out, mode),
            Family::Sign => sign::decode(bytes, chunk, out, mode),
        }
    }

    /// Whether the integer-domain schedule applies: int8, int4 and ternary.
    pub fn integer_ring(&self) -> bool {
        matches!(self.family(), Family::Stochastic(_))
    }

    /// The schedule used when none is asked for: integer domain where it applies, else
    /// scatter-gather.
    pub fn default_schedule(&self) -> Schedule {
        if self.integer_ring() {
            Schedule::IntegerRing
        } else {
            Schedule::ScatterGather
        }
    }

    /// A small number identifying the codec in message tags (0..7).
    pub(crate) fn id(&self) -> u64 {
        Codec::ALL.iter().position(|c| c == self).unwrap_or(0) as u64
    }

    fn family(&self) -> Family {
        match self {
            Codec::F16 => Family::Half(Half::F16),
            Codec::Bf16 => Family::Half(Half::Bf16),
            Codec::Int8 => Family::Stochastic(stochastic::INT8),
            Codec::Int4 => Family::Stochastic(stochastic::INT4),
            Codec::Sign => Family::Sign,
            Codec::Ternary { clip } => Family::Stochastic(stochastic::ternary(*clip)),
        }
    }

    /// The integer grid of a stochastic codec.
    pub(crate) fn levels(&self) -> Option<Levels> {
        match self.family() {
            Family::Stochastic(lv) => Some(lv),
            _ => None,
        }
    }
}

/// The kernels a codec uses.
enum Family {
    Half(Half),
    Stochastic(Levels),
    Sign,
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = ParseNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Codec::parse(s).ok_or_else(|| ParseNameError {
            what: "codec",
            input: s.to_string(),
            expected: "fp16, bf16, int8, int4, sign, ternary, ternary-clip",
        })
    }
}

/// How a compressed allreduce moves its codes (see [`allreduce`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Quantize per owner, all-to-all, owner sums in f32 and re-quantizes once, allgather of
    /// the codes. Any codec.
    ScatterGather,
    /// Shared range per chunk, exact integer sums, no re-quantization. int8, int4, ternary.
    IntegerRing,
}

impl Schedule {
    /// A short name for reports: `scatter-gather` or `integer`.
    pub fn name(&self) -> &'static str {
        match self {
            Schedule::ScatterGather => "scatter-gather",
            Schedule::IntegerRing => "integer",
        }
    }
}

/// What a compressed allreduce does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompressedOptions {
    /// The codec.
    pub codec: Codec,
    /// Values per scale (> 0; [`DEFAULT_CHUNK`] unless there is a reason).
    pub chunk: usize,
    /// The schedule; `None` picks [`Codec::default_schedule`].
    pub schedule: Option<Schedule>,
    /// Carry what compression lost to the next call (needs a [`Residual`]).
    pub error_feedback: bool,
}

impl CompressedOptions {
    /// The defaults for `codec`: [`DEFAULT_CHUNK`], its default schedule, error feedback for
    /// biased codecs.
    pub fn new(codec: Codec) -> CompressedOptions {
        CompressedOptions {
            codec,
            chunk: DEFAULT_CHUNK,
            schedule: None,
            error_feedback: codec.is_biased(),
        }
    }

    /// The schedule that will run.
    pub fn schedule(&self) -> Schedule {
        self.schedule
            .unwrap_or_else(|| self.codec.default_schedule())
    }
}

/// Error-feedback state the caller keeps per tensor: the residual of this rank's sends
/// (`local`, one value per element) and of the re-quantization of the slice it owns
/// (`owner`, scatter-gather only). The schedule zeroes `local` when the tensor's length
/// changes, and `owner` when the owned slice does (another length, group size or rank).
/// (Start from `Residual::default()` for a new tensor or group.)
///
/// A call that fails (an input with NaN or ±∞ fails on every rank) may leave both updated for
/// the pieces this rank had already encoded, as if they had been applied (they then carry that
/// call's quantization error in place of what they held). Where the owned slice's sum held
/// NaN or ±∞ (an input's, or an overflow of f32), whether the call failed or carried them
/// (fp16, bf16), the owner residual is left as it was for the whole piece the sum is encoded
/// in (the owned slice; for tensors over 2^18 values, pieces of at least 65536 values and about
/// a sixteenth of the tensor), and no residual ever takes a non-finite value. A caller that skips the step (a loss scaler after an overflow) can go
/// on, or start over with `Residual::default()`.
#[derive(Clone, Debug, Default)]
pub struct Residual {
    /// What this rank's encodings lost, per element of the tensor.
    pub local: Vec<f32>,
    /// What the owner's re-quantization lost, per element of the owned slice.
    pub owner: Vec<f32>,
    /// The elements of the tensor `owner` belongs to.
    pub owner_slice: std::ops::Range<usize>,
}

/// Payload bytes one rank moved in one call (message headers of the transport not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireStats {
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Bytes received.
    pub bytes_received: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in Codec::ALL {
            assert_eq!(Codec::parse(c.name()), Some(c));
            assert_eq!(c.to_string().to_uppercase().parse::<Codec>().unwrap(), c);
        }
        assert_eq!(Codec::parse("f16"), Some(Codec::F16));
        assert_eq!(Codec::parse("1bit"), Some(Codec::Sign));
        assert_eq!(
            Codec::parse("ternary_clip"),
            Some(Codec::Ternary { clip: true })
        );
        assert_eq!(Codec::parse("int2"), None);
        assert!("fp32".parse::<Codec>().is_err());
        let ids: Vec<u64> = Codec::ALL.iter().map(Codec::id).collect();
        assert_eq!(ids, (0..7).collect::<Vec<_>>());
    }

    #[test]
    fn lengths() {
        assert_eq!(Codec::F16.encoded_len(5, 2), 10);
        // A chunk longer than the values is sized by the values alone, however long.
        for c in [Codec::Int8, Codec::Int4, Codec::Sign, Codec::F16] {
            assert_eq!(c.encoded_len(3, usize::MAX), c.encoded_len(3, 3));
        }
        assert_eq!(Codec::Int8.encoded_len(0, 1024), 0);
        assert_eq!(Codec::Int8.encoded_len(1025, 1024), 4 + 1024 + 4 + 1);
        assert_eq!(Codec::Int4.encoded_len(3, 1024), 4 + 2);
        assert_eq!(Codec::Sign.encoded_len(9, 8), 4 + 1 + 4 + 1);
        assert_eq!(Codec::Ternary { clip: false }.encoded_len(5, 1024), 4 + 2);
        assert!(Codec::Sign.is_biased() && !Codec::Int8.is_biased());
        assert!(CompressedOptions::new(Codec::Sign).error_feedback);
        assert_eq!(
            CompressedOptions::new(Codec::Int4).schedule(),
            Schedule::IntegerRing
        );
    }

    #[test]
    fn bad_bytes_are_errors() {
        let mut out = [0f32; 10];
        for c in Codec::ALL {
            assert!(matches!(
                c.decode(&[0; 3], 4, &mut out),
                Err(CodecError::Length { .. })
            ));
            assert_eq!(c.decode(&[], 0, &mut out), Err(CodecError::ZeroChunk));
        }
        let mut bytes = vec![0u8; Codec::Int8.encoded_len(10, 4)];
        bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(
            Codec::Int8.decode(&bytes, 4, &mut out),
            Err(CodecError::NonFinite { chunk: 0 })
        );
        bytes[..4].copy_from_slice(&(-1.0f32).to_le_bytes());
        assert!(matches!(
            Codec::Int8.decode(&bytes, 4, &mut out),
            Err(CodecError::Invalid { chunk: 0, .. })
        ));
        // A finite step whose largest code would decode to infinity: no encoder sends it.
        bytes[..4].copy_from_slice(&(f32::MAX / 64.0).to_le_bytes());
        assert_eq!(
            Codec::Int8.decode(&bytes, 4, &mut out),
            Err(CodecError::NonFinite { chunk: 0 })
        );
        bytes[..4].copy_from_slice(&1.0f32.to_le_bytes());
        bytes[4] = 0x80; // −128 is reserved
        assert!(Codec::Int8.decode(&bytes, 4, &mut out).is_err());
        bytes[4] = 0x81;
        Codec::Int8.decode(&bytes, 4, &mut out).unwrap();
        assert_eq!(out[0], -127.0);
    }
}
