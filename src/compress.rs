//! Compressed and sparse allreduce: the [`Compressor`] a user keeps per tensor, its spec
//! grammar, and the [`Communicator`] calls that use it.
//!
//! # Spec grammar
//!
//! `method[:argument][,key=value]…`, case-insensitive, spaces ignored:
//!
//! | method | meaning |
//! |---|---|
//! | `fp16` (`f16`), `bf16` | cast to 16 bits (round to nearest) |
//! | `int8`, `int4` | per-chunk scale, stochastic rounding (unbiased) |
//! | `sign` (`1bit`) | 1 bit per value and a per-chunk scale (biased: error feedback on) |
//! | `ternary` | TernGrad: per-chunk scale, stochastic {−1, 0, +1} (unbiased) |
//! | `topk:R` | keep the fraction `R` (0 < R ≤ 1) of largest magnitudes (biased: error feedback on) |
//!
//! | key | values | default |
//! |---|---|---|
//! | `ef` | `on`/`off` (`1`/`0`, `true`/`false`) | on for `sign` and `topk`, off otherwise |
//! | `min_bytes` | tensors smaller than this many bytes (in their own dtype) go uncompressed | 16384 |
//! | `chunk` | elements per scale (quantized codecs) | 1024 |
//! | `clip` | `on`/`off`: ternary clips at 2.5σ | off |
//! | `schedule` | `scatter_gather` (`sg`) or `integer_ring` (`ring`) | the codec's |
//! | `algo` | top-k: `two_phase`, `dsar`, `sparse_rd` | `two_phase` |
//! | `seed` | the random streams' seed (each rank draws its own stream, and each compressor of a process its own: the n-th created, the n-th) | 0 |
//!
//! ```
//! use chorus::Compressor;
//! let c = Compressor::new("int8,ef=on,chunk=512")?;
//! assert_eq!(c.spec().to_string(), "int8,ef=on,chunk=512,min_bytes=16384,seed=0");
//! assert!(Compressor::new("topk:0").is_err());
//! # Ok::<(), chorus::CommError>(())
//! ```

use std::fmt;

use chorus_algorithms::compress::{
    self, Codec, CompressedOptions, Residual, Rng, Schedule, DEFAULT_CHUNK,
};
use chorus_algorithms::sparse::{
    self, SparseAlgo, SparseResult, SparseVec, TopkOptions, TopkState,
};
use chorus_algorithms::{DType, ReduceOp};

use crate::comm::{call_bits, tag_base, Call, CollKind, Communicator};
use crate::error::CommError;
use crate::AllReduceOptions;

/// Tensors below this many bytes go uncompressed unless the spec says otherwise.
pub const DEFAULT_MIN_BYTES: usize = 16 << 10;

/// What a compressor does to a tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// A quantizing codec.
    Quantize(Codec),
    /// Top-k sparsification keeping the fraction `ratio` of the values.
    TopK {
        /// Fraction of the values each rank contributes, in (0, 1].
        ratio: f64,
    },
}

/// A parsed compressor spec (see the [module documentation](self) for the grammar).
#[derive(Clone, Debug, PartialEq)]
pub struct CompressorSpec {
    /// The method.
    pub method: Method,
    /// Error feedback: keep what compression lost and add it to the next call's input.
    pub error_feedback: bool,
    /// Tensors smaller than this many bytes go through the plain allreduce.
    pub min_bytes: usize,
    /// Elements per scale (quantized codecs).
    pub chunk: usize,
    /// Schedule of a quantized allreduce (`None`: the codec's default).
    pub schedule: Option<Schedule>,
    /// Algorithm of a top-k allreduce.
    pub sparse_algo: SparseAlgo,
    /// Seed of the random streams (each rank and compressor draws a stream of its own:
    /// rank `r`'s `k`-th compressor of the process, stream `r ^ (k << 32)`).
    pub seed: u64,
}

impl CompressorSpec {
    /// Parses a spec; errors name the part that is wrong.
    pub fn parse(spec: &str) -> Result<CompressorSpec, String> {
        let cleaned: String = spec
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .to_ascii_lowercase();
        let mut parts = cleaned.split(',');
        let head = parts.next().unwrap_or_default();
        let (name, arg) = match head.split_once(':') {
            Some((n, a)) => (n, Some(a)),
            None => (head, None),
        };
        let method = match (name, arg) {
            ("topk" | "top_k" | "top-k", Some(a)) => {
                let ratio: f64 = a
                    .parse()
                    .map_err(|_| format!("topk ratio {a:?} is not a number"))?;
                if !(ratio > 0.0 && ratio <= 1.0) {
                    return Err(format!("topk ratio {ratio} is not in (0, 1]"));
                }
                Method::TopK { ratio }
            }
            ("topk" | "top_k" | "top-k", None) => {
                return Err("topk needs a ratio, e.g. topk:0.01".into())
            }
            (n, None) => Method::Quantize(Codec::parse(n).ok_or_else(|| {
                format!(
                    "unknown compression method {n:?} (expected fp16, bf16, int8, int4, sign, \
                     ternary or topk:R)"
                )
            })?),
            (n, Some(a)) => return Err(format!("method {n:?} takes no argument (got {a:?})")),
        };
        let mut s = CompressorSpec {
            method,
            error_feedback: match method {
                Method::Quantize(c) => c.is_biased(),
                Method::TopK { .. } => true,
            },
            min_bytes: DEFAULT_MIN_BYTES,
            chunk: DEFAULT_CHUNK,
            schedule: None,
            sparse_algo: SparseAlgo::TwoPhase,
            seed: 0,
        };
        let mut clip: Option<bool> = None;
        for kv in parts {
            let (k, v) = kv.split_once('=').unwrap_or((kv, "on"));
            let flag = |v: &str| match v {
                "on" | "1" | "true" | "yes" => Ok(true),
                "off" | "0" | "false" | "no" => Ok(false),
                _ => Err(format!("{k}={v:?}: expected on or off")),
            };
            let number = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| format!("{k}={v:?}: expected a non-negative integer"))
            };
            match k {
                "ef" | "error_feedback" => s.error_feedback = flag(v)?,
                "min_bytes" => s.min_bytes = number(v)? as usize,
                "chunk" => {
                    let c = number(v)?;
                    if !(16..=1 << 20).contains(&c) {
                        return Err(format!("chunk={c}: expected 16 to 1048576 elements"));
                    }
                    s.chunk = c as usize;
                }
                "clip" => clip = Some(flag(v)?),
                "schedule" => {
                    s.schedule = Some(match v {
                        "sg" | "scatter_gather" => Schedule::ScatterGather,
                        "ring" | "integer_ring" => Schedule::IntegerRing,
                        _ => {
                            return Err(format!("schedule={v:?}: expected scatter_gather or ring"))
                        }
                    })
                }
                "algo" => {
                    s.sparse_algo = v
                        .parse()
                        .map_err(|_| format!("algo={v:?}: expected two_phase, dsar or sparse_rd"))?
                }
                "seed" => s.seed = number(v)?,
                "" => {}
                _ => return Err(format!("unknown compressor option {k:?}")),
            }
        }
        match (&mut s.method, clip) {
            // `ternary-clip` (the name reports print) clips as `ternary,clip` does.
            (Method::Quantize(Codec::Ternary { clip: true }), Some(false)) => {
                return Err("ternary-clip with clip=off: choose one".into())
            }
            (Method::Quantize(Codec::Ternary { clip: c }), Some(on)) => *c = on,
            (Method::Quantize(Codec::Ternary { .. }), None) => {}
            (_, Some(true)) => return Err("clip applies to ternary only".into()),
            _ => {}
        }
        if let (Method::Quantize(c), Some(Schedule::IntegerRing)) = (s.method, s.schedule) {
            if !c.integer_ring() {
                return Err(format!(
                    "{} has no integer-domain ring (int8, int4 and ternary do)",
                    c.name()
                ));
            }
        }
        Ok(s)
    }

    /// Whether the method is top-k sparsification.
    pub fn is_topk(&self) -> bool {
        matches!(self.method, Method::TopK { .. })
    }
}

impl fmt::Display for CompressorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.method {
            Method::Quantize(Codec::Ternary { clip }) => {
                f.write_str("ternary")?;
                if clip {
                    f.write_str(",clip=on")?;
                }
            }
            Method::Quantize(c) => f.write_str(c.name())?,
            Method::TopK { ratio } => write!(f, "topk:{ratio}")?,
        }
        write!(f, ",ef={}", if self.error_feedback { "on" } else { "off" })?;
        match self.method {
            Method::Quantize(_) => {
                write!(f, ",chunk={}", self.chunk)?;
                match self.schedule {
                    Some(Schedule::ScatterGather) => f.write_str(",schedule=scatter_gather")?,
                    Some(Schedule::IntegerRing) => f.write_str(",schedule=integer_ring")?,
                    None => {}
                }
            }
            Method::TopK { .. } => write!(f, ",algo={}", self.sparse_algo.name())?,
        }
        write!(f, ",min_bytes={},seed={}", self.min_bytes, self.seed)
    }
}

/// What one compressed allreduce did, for reports and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompressionReport {
    /// Whether the tensor went compressed (false: below `min_bytes`, plain allreduce).
    pub compressed: bool,
    /// Bytes this rank put on the wire (payload, headers of the sparse streams included).
    pub bytes_sent: u64,
    /// Bytes this rank received.
    pub bytes_received: u64,
    /// Bytes of the tensor as f32 (twice its own for a 16-bit one, compressed or not).
    pub dense_bytes: u64,
    /// Top-k: values each rank contributed (k).
    pub k: Option<usize>,
    /// Top-k: non-zero values of the result.
    pub result_nnz: Option<usize>,
}

impl CompressionReport {
    /// Dense bytes over bytes sent: how much smaller than the tensor this rank's traffic was
    /// (a plain ring sends about 2·(p−1)/p of the tensor).
    pub fn ratio(&self) -> f64 {
        if self.bytes_sent == 0 {
            return 1.0;
        }
        self.dense_bytes as f64 / self.bytes_sent as f64
    }
}

/// Compression state of one tensor: the spec, the error-feedback residuals and the random
/// stream. Keep one per tensor (gradient bucket) and pass it to every call for that tensor;
/// a tensor of another size or dtype resets the residual. Used on another communicator, it
/// keeps what this rank's sends lost (the tensor's) and drops the residual of the sum this
/// rank owned (the other group's). Top-k's residual follows the tensor too, and its step
/// count and thresholds the communicator: every rank's compressor must have made the same
/// calls on it, or the next call fails as a mismatch; on another communicator they start
/// afresh (ranks from different groups would not agree on them).
///
/// Every rank must use the same spec, `min_bytes` included (a tensor compressed on one rank
/// and not on another fails as a mismatch). A call that fails after compressing (a peer's
/// NaN or inf, a lost peer) may leave the residual updated for a gradient that was never
/// applied: after a skipped step (a loss scaler's overflow), [`Compressor::reset`] it when
/// the codec is biased (`sign`, `topk`, error feedback on), or the next call adds back
/// about the skipped gradient's rounding error (for `sign`, about the gradient itself).
pub struct Compressor {
    spec: CompressorSpec,
    residual: Residual,
    topk: TopkState,
    /// The random streams, by stream number: a compressor used on a communicator where this
    /// process has another rank draws that rank's stream there (two processes never draw the
    /// same one), and each stream goes on from call to call (a compressor used on two
    /// communicators in turn does not start one over). At most [`MAX_STREAMS`], the least
    /// recently used dropped first.
    rng: Vec<(u64, Rng)>,
    /// Which compressor of this process it is (0 for the first): its random stream.
    instance: u64,
    /// The communicator ([`Communicator::serial`]) and dtype of the last call: the residual
    /// of the sum this rank owned belongs to that communicator's group, and a tensor of
    /// another dtype is another tensor.
    bound: Option<(u64, DType)>,
    staging: Vec<f32>,
    last: CompressionReport,
}

/// The number of compressors this process created.
static CREATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl fmt::Debug for Compressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Compressor")
            .field("spec", &self.spec.to_string())
            .field("last", &self.last)
            .finish()
    }
}

impl Compressor {
    /// A compressor from a spec string (see the [module documentation](self)).
    pub fn new(spec: &str) -> Result<Compressor, CommError> {
        let spec = CompressorSpec::parse(spec).map_err(|m| {
            CommError::invalid("compressor", format!("compressor spec {spec:?}: {m}"))
        })?;
        Ok(Compressor::from_spec(spec))
    }

    /// A compressor from a parsed spec.
    pub fn from_spec(spec: CompressorSpec) -> Compressor {
        Compressor {
            spec,
            residual: Residual::default(),
            topk: TopkState::default(),
            rng: Vec::new(),
            instance: CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            bound: None,
            staging: Vec::new(),
            last: CompressionReport::default(),
        }
    }

    /// The spec.
    pub fn spec(&self) -> &CompressorSpec {
        &self.spec
    }

    /// What the last call did.
    pub fn last_report(&self) -> CompressionReport {
        self.last
    }

    /// Ties the state to communicator `serial` and `dtype` for the call about to run: a tensor
    /// of another dtype starts afresh; on another communicator, the residual of the sum this
    /// rank owned (its group's) is dropped, and what this rank's own sends lost (the
    /// tensor's) is kept.
    fn bind(&mut self, serial: u64, dtype: DType) {
        match self.bound {
            Some((_, d)) if d != dtype => self.reset(),
            Some((s, _)) if s != serial => {
                self.residual.owner = Vec::new();
                self.residual.owner_slice = 0..0;
                self.topk.leave_group();
            }
            _ => {}
        }
        self.bound = Some((serial, dtype));
    }

    /// Forget the residuals (e.g. after the model was reloaded).
    pub fn reset(&mut self) {
        self.residual = Residual::default();
        self.topk = TopkState::default();
    }

    /// The sum of the absolute residuals (what error feedback still owes), for diagnostics.
    /// (Both residuals of a quantizer: this rank's sends, and under scatter-gather the
    /// re-quantization of the slice it owns.)
    pub fn residual_norm1(&self) -> f64 {
        let norm = |r: &[f32]| r.iter().map(|v| v.abs() as f64).sum::<f64>();
        if self.spec.is_topk() {
            norm(&self.topk.residual)
        } else {
            norm(&self.residual.local) + norm(&self.residual.owner)
        }
    }

    /// A number per method for the tag, so ranks using different methods are told so.
    fn method_id(&self) -> u64 {
        match self.spec.method {
            Method::Quantize(Codec::F16) => 1,
            Method::Quantize(Codec::Bf16) => 2,
            Method::Quantize(Codec::Int8) => 3,
            Method::Quantize(Codec::Int4) => 4,
            Method::Quantize(Codec::Sign) => 5,
            Method::Quantize(Codec::Ternary { .. }) => 6,
            Method::TopK { .. } => 7,
        }
    }
}

/// The random streams a compressor keeps (one per rank it was used at).
const MAX_STREAMS: usize = 16;

/// The name of the compressed allreduce in errors.
const OP_COMPRESSED: &str = "all_reduce_compressed";

/// The report of a tensor below `min_bytes`, sent by the plain allreduce in its own dtype
/// (`tensor_bytes`: `dense_bytes`, its size as f32, for an f32 tensor, half of it for a
/// 16-bit one): a ring-like allreduce sends and receives about 2(p−1)/p of them.
/// A compressed allreduce sums or averages: any other op is refused, whatever the size.
fn compressed_op(op: ReduceOp) -> Result<(), CommError> {
    if matches!(op, ReduceOp::Sum | ReduceOp::Avg) {
        return Ok(());
    }
    Err(CommError::invalid(
        "all_reduce_compressed",
        format!(
            "compressed allreduce sums or averages; {} is not supported",
            op.name()
        ),
    ))
}

fn plain_report(dense_bytes: u64, tensor_bytes: u64, p: u64) -> CompressionReport {
    let moved = tensor_bytes * 2 * p.saturating_sub(1) / p.max(1);
    CompressionReport {
        compressed: false,
        bytes_sent: moved,
        bytes_received: moved,
        dense_bytes,
        k: None,
        result_nnz: None,
    }
}

impl Communicator {
    /// Allreduce of an f32 tensor through `comp` (sum or avg), in place. Every rank must
    /// pass a compressor of the same spec. Tensors below the spec's `min_bytes` go through the
    /// plain allreduce. The result is identical on every rank.
    ///
    /// ```no_run
    /// # fn demo(comm: &mut chorus::Communicator, grad: &mut [f32]) -> Result<(), chorus::CommError> {
    /// let mut comp = chorus::Compressor::new("int8")?; // one per tensor, kept across steps
    /// let report = comm.all_reduce_compressed(grad, chorus::ReduceOp::Avg, &mut comp)?;
    /// println!("sent {} bytes ({:.1}x smaller)", report.bytes_sent, report.ratio());
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_compressed(
        &mut self,
        buf: &mut [f32],
        op: ReduceOp,
        comp: &mut Compressor,
    ) -> Result<CompressionReport, CommError> {
        let call = Call::new(
            OP_COMPRESSED,
            CollKind::CompressedAllReduce,
            DType::Float32,
            op,
        );
        self.refusable(call, |c| c.compressed_as(buf, op, comp, DType::Float32))
    }

    /// [`Communicator::all_reduce_compressed`] of values the caller holds as `dtype` (widened
    /// to f32 here): the dtype goes into the call's tag, so ranks that pass float16 and float32
    /// tensors of one length fail instead of returning results rounded differently.
    fn compressed_as(
        &mut self,
        buf: &mut [f32],
        op: ReduceOp,
        comp: &mut Compressor,
        dtype: DType,
    ) -> Result<CompressionReport, CommError> {
        const OP: &str = "all_reduce_compressed";
        self.check_usable(OP)?;
        compressed_op(op).map_err(|e| e.at_rank(self.rank()))?;
        let dense_bytes = std::mem::size_of_val(buf) as u64;
        let p = self.size() as u64;
        // (An empty tensor too, whatever min_bytes: the plain allreduce sends nothing for it,
        // so ranks whose min_bytes differ still agree there.)
        if std::mem::size_of_val(buf) < comp.spec.min_bytes || buf.is_empty() {
            // (Only float32 here: `all_reduce_compressed_raw` sends other dtypes' small
            // tensors through the plain allreduce in their own dtype.)
            self.all_reduce_with(None, buf, op, &AllReduceOptions::default())?;
            comp.last = plain_report(dense_bytes, dense_bytes, p);
            return Ok(comp.last);
        }
        let rank = self.rank() as u64;
        self.check_call(
            Call::new(OP, CollKind::CompressedAllReduce, dtype, op),
            &[dense_bytes],
        )?;
        comp.bind(self.serial, dtype);
        let tag = tag_base(self.next_seq(), CollKind::CompressedAllReduce, dtype, op)
            | call_bits(&[dense_bytes])
            | (comp.method_id() << 12);
        let spec = comp.spec.clone();
        let mut report = CompressionReport {
            compressed: true,
            dense_bytes,
            ..Default::default()
        };
        match spec.method {
            Method::Quantize(codec) => {
                let opts = CompressedOptions {
                    codec,
                    chunk: spec.chunk,
                    schedule: spec.schedule,
                    error_feedback: spec.error_feedback,
                };
                // Tensors of one rank round with streams of their own: with one stream, two
                // buckets of a size would draw the same dither, element for element. (The
                // stream is the rank and the compressor's number, side by side.)
                let stream = rank ^ (comp.instance << 32);
                // Most recently used last; the least recently used goes when full.
                let entry = match comp.rng.iter().position(|(s, _)| *s == stream) {
                    Some(at) => comp.rng.remove(at),
                    None => {
                        if comp.rng.len() == MAX_STREAMS {
                            comp.rng.remove(0);
                        }
                        (stream, Rng::new(spec.seed, stream))
                    }
                };
                comp.rng.push(entry);
                let last = comp.rng.len() - 1;
                let rng = &mut comp.rng[last].1;
                let residual = spec.error_feedback.then_some(&mut comp.residual);
                let mut wire = compress::WireStats::default();
                self.run_tagged(OP, tag, None, |ctx| {
                    wire = compress::all_reduce_compressed(ctx, buf, op, &opts, rng, residual)?;
                    Ok(())
                })?;
                report.bytes_sent = wire.bytes_sent;
                report.bytes_received = wire.bytes_received;
            }
            Method::TopK { ratio } => {
                let opts = TopkOptions {
                    ratio,
                    error_feedback: spec.error_feedback,
                    algo: spec.sparse_algo,
                    ..TopkOptions::default()
                };
                // A tensor of another length starts afresh (every rank sees the same length,
                // or the call fails as a mismatch anyway).
                if !comp.topk.residual.is_empty() && comp.topk.residual.len() != buf.len() {
                    comp.topk = TopkState::default();
                }
                let state = &mut comp.topk;
                let mut stats = None;
                self.run_tagged(OP, tag, None, |ctx| {
                    stats = Some(sparse::topk_all_reduce(ctx, buf, op, &opts, state)?);
                    Ok(())
                })?;
                let s = stats.expect("set on success");
                report.bytes_sent = s.wire.bytes_sent;
                report.bytes_received = s.wire.bytes_received;
                report.k = Some(s.k);
                report.result_nnz = Some(s.result_nnz);
            }
        }
        comp.last = report;
        Ok(report)
    }

    /// [`Communicator::all_reduce_compressed`] on raw bytes of f32, f16 or bf16 elements (the
    /// C ABI's entry point); 16-bit inputs are widened to f32, reduced, and rounded back.
    pub fn all_reduce_compressed_raw(
        &mut self,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        comp: &mut Compressor,
    ) -> Result<CompressionReport, CommError> {
        let call = Call::new(OP_COMPRESSED, CollKind::CompressedAllReduce, dtype, op);
        self.refusable(call, |c| {
            const OP: &str = OP_COMPRESSED;
            let elem = dtype.size();
            if !matches!(dtype, DType::Float32 | DType::Float16 | DType::Bfloat16) {
                return Err(CommError::invalid(
                    OP,
                    format!(
                        "compressed allreduce takes float32, float16 or bfloat16, not {}",
                        dtype.name()
                    ),
                )
                .at_rank(c.rank()));
            }
            if buf.len() % elem != 0 {
                return Err(CommError::invalid(
                    OP,
                    format!(
                        "buffer of {} bytes is not a whole number of {} elements",
                        buf.len(),
                        dtype.name()
                    ),
                )
                .at_rank(c.rank()));
            }
            // The op first, whatever path the size takes (a small tensor is refused alike).
            compressed_op(op).map_err(|e| e.at_rank(c.rank()))?;
            let n = buf.len() / elem;
            if dtype != DType::Float32 && (buf.len() < comp.spec.min_bytes || buf.is_empty()) {
                // Below min_bytes (the tensor's own bytes): the plain allreduce, in the
                // caller's dtype, whose tag carries it, so ranks passing float16 and float32
                // tensors of one length fail here too instead of returning results rounded
                // differently.
                c.all_reduce_raw(None, buf, dtype, op, &AllReduceOptions::default())?;
                comp.last = plain_report(4 * n as u64, buf.len() as u64, c.size() as u64);
                return Ok(comp.last);
            }
            if dtype == DType::Float32 {
                // Aligned f32 (what C, numpy and torch hand over): in place, no staging copy.
                if let Ok(floats) = bytemuck::try_cast_slice_mut::<u8, f32>(buf) {
                    return c.all_reduce_compressed(floats, op, comp);
                }
            }
            let mut staging = std::mem::take(&mut comp.staging);
            staging.clear();
            match dtype {
                DType::Float32 => staging.extend(
                    buf.chunks_exact(4)
                        .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
                ),
                DType::Float16 => staging.extend(
                    buf.chunks_exact(2)
                        .map(|b| half::f16::from_ne_bytes([b[0], b[1]]).to_f32()),
                ),
                _ => staging.extend(
                    buf.chunks_exact(2)
                        .map(|b| half::bf16::from_ne_bytes([b[0], b[1]]).to_f32()),
                ),
            }
            debug_assert_eq!(staging.len(), n);
            let r = c.compressed_as(&mut staging, op, comp, dtype);
            if r.is_ok() {
                for (b, v) in buf.chunks_exact_mut(elem).zip(&staging) {
                    match dtype {
                        DType::Float32 => b.copy_from_slice(&v.to_ne_bytes()),
                        DType::Float16 => b.copy_from_slice(&half::f16::from_f32(*v).to_ne_bytes()),
                        _ => b.copy_from_slice(&half::bf16::from_f32(*v).to_ne_bytes()),
                    }
                }
            }
            comp.staging = staging;
            r
        })
    }

    /// The exact sum of every rank's sparse vector (all of the same dense length); the result,
    /// identical on every rank, is sparse or dense depending on how much it filled in.
    /// `algo: None` lets the cost model choose.
    pub fn sparse_all_reduce(
        &mut self,
        input: &SparseVec,
        algo: Option<SparseAlgo>,
    ) -> Result<SparseResult, CommError> {
        self.sparse_all_reduce_stats(input, algo).map(|r| r.0)
    }

    /// [`Communicator::sparse_all_reduce`], also returning the bytes this rank moved.
    pub fn sparse_all_reduce_stats(
        &mut self,
        input: &SparseVec,
        algo: Option<SparseAlgo>,
    ) -> Result<(SparseResult, sparse::WireStats), CommError> {
        const OP: &str = "sparse_all_reduce";
        let call = Call::new(OP, CollKind::SparseAllReduce, DType::Float32, ReduceOp::Sum);
        self.refusable(call, |c| {
            c.check_usable(OP)?;
            // Before anything runs (the agreement on the algorithm included): a bad input is
            // refused here, and with CHORUS_CHECK_CALLS the other ranks hear of it at once.
            input.validate().map_err(|m| c.invalid(OP, m))?;
            let algo = match algo {
                Some(a) => a,
                None => {
                    // Ranks must pick the same algorithm: agree on the densest input first
                    // (one small allreduce; pass `algo` to skip it).
                    let mut nnz = [input.nnz() as u64];
                    c.all_reduce(&mut nnz, ReduceOp::Max)?;
                    c.select_sparse(input.n, nnz[0] as usize)
                }
            };
            c.check_call(call, &[input.n as u64])?;
            let tag = tag_base(
                c.next_seq(),
                CollKind::SparseAllReduce,
                DType::Float32,
                ReduceOp::Sum,
            ) | call_bits(&[input.n as u64]);
            let mut out = None;
            c.run_tagged(OP, tag, None, |ctx| {
                out = Some(sparse::sparse_all_reduce(ctx, input, algo)?);
                Ok(())
            })?;
            Ok(out.expect("set on success"))
        })
    }

    /// The sparse algorithm the cost model picks for `nnz` non-zeros per rank out of `n` on
    /// this communicator's link (every rank must pass the same figures to agree).
    pub fn select_sparse(&self, n: usize, nnz: usize) -> SparseAlgo {
        let link = self.selector().link();
        let p = self.size();
        SparseAlgo::ALL
            .into_iter()
            .map(|a| (a, a.cost(n, nnz, p, &link)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(a, _)| a)
            .unwrap_or(SparseAlgo::TwoPhase)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_is_tied_to_a_communicator_and_dtype() {
        let mut c = Compressor::new("int8").unwrap();
        let filled = |c: &mut Compressor| {
            c.residual.local = vec![1.0; 8];
            c.residual.owner = vec![2.0; 4];
            c.residual.owner_slice = 0..4;
        };
        c.bind(7, DType::Float32);
        filled(&mut c);
        // The same communicator and dtype: kept.
        c.bind(7, DType::Float32);
        assert_eq!((c.residual.local.len(), c.residual.owner.len()), (8, 4));
        c.topk.residual = vec![3.0; 8];
        // Another communicator: the owned sum's residual goes, this rank's stays (top-k's
        // too; that its step count starts afresh, tests/compression.rs shows).
        c.bind(8, DType::Float32);
        assert_eq!((c.residual.local.len(), c.residual.owner.len()), (8, 0));
        assert_eq!(c.topk.residual.len(), 8);
        assert_eq!(c.residual.owner_slice, 0..0);
        // Another dtype: another tensor.
        filled(&mut c);
        c.bind(8, DType::Float16);
        assert_eq!((c.residual.local.len(), c.residual.owner.len()), (0, 0));
    }

    #[test]
    fn grammar() {
        let p = |s: &str| CompressorSpec::parse(s);
        let s = p("int8").unwrap();
        assert_eq!(s.method, Method::Quantize(Codec::Int8));
        assert!(!s.error_feedback);
        assert!(p("sign").unwrap().error_feedback);
        assert!(!p("sign, ef = off").unwrap().error_feedback);
        assert!(p("TopK:0.01").unwrap().error_feedback);
        assert_eq!(p("topk:0.25").unwrap().method, Method::TopK { ratio: 0.25 });
        assert_eq!(
            p("ternary,clip").unwrap().method,
            Method::Quantize(Codec::Ternary { clip: true })
        );
        // The name reports print clips too; contradicting it is refused.
        for spec in ["ternary-clip", "ternary_clip", "ternary-clip,clip=on"] {
            assert_eq!(
                p(spec).unwrap().method,
                Method::Quantize(Codec::Ternary { clip: true }),
                "{spec}"
            );
        }
        assert_eq!(
            p("ternary,clip=off").unwrap().method,
            Method::Quantize(Codec::Ternary { clip: false })
        );
        assert_eq!(p("int4,min_bytes=0").unwrap().min_bytes, 0);
        assert_eq!(
            p("int8,schedule=sg").unwrap().schedule,
            Some(Schedule::ScatterGather)
        );
        for bad in [
            "",
            "int3",
            "topk",
            "topk:0",
            "topk:1.5",
            "topk:x",
            "int8:2",
            "int8,ef=maybe",
            "int8,chunk=3",
            "sign,clip",
            "fp16,schedule=ring",
            "int8,foo=1",
            "topk:0.1,algo=x",
            "ternary-clip,clip=off",
        ] {
            assert!(p(bad).is_err(), "{bad:?} parsed");
        }
        // Display round-trips.
        for s in [
            "int8",
            "sign,ef=off",
            "ternary,clip=on",
            "ternary-clip",
            "topk:0.01,algo=dsar",
            "bf16",
        ] {
            let a = p(s).unwrap();
            assert_eq!(p(&a.to_string()).unwrap(), a, "{s}");
        }
    }
}
