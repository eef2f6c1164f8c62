//! Data-parallel training of a small MLP whose gradients go through chorus, once per
//! compression method, printing the final loss of each: does compression keep training on
//! track?
//!
//! A fixed random "teacher" MLP labels Gaussian inputs; a "student" MLP learns it by SGD. Each
//! rank draws its own batches; every step the ranks average their gradients with a plain or a
//! compressed allreduce and take the same step, so the replicas stay identical (checked).
//!
//! ```text
//! cargo run --release --example compressed_training                 # 8 ranks, 1500 steps, every method
//! cargo run --release --example compressed_training -- --steps 300 dense int8 'topk:0.01,ef=off'
//! ```
//! Ranks are threads of this process by default (`--ranks N`); under a launcher
//! (`chorus-run -n 8 target/release/examples/compressed_training`) each process is a rank.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use chorus::{Communicator, Compressor, Config, ReduceOp};
use chorus_transport::rendezvous::StoreServer;

/// One training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Ranks (data-parallel replicas).
    pub ranks: usize,
    /// SGD steps.
    pub steps: usize,
    /// Samples per rank per step.
    pub batch: usize,
    /// Input dimension.
    pub dim: usize,
    /// Hidden units of the student (the teacher has half as many).
    pub hidden: usize,
    /// Learning rate.
    pub lr: f32,
    /// Seed of the teacher, the initial student and the data.
    pub seed: u64,
    /// `dense` or a compressor spec (`int8`, `topk:0.01,ef=off`, …).
    pub method: String,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            ranks: 8,
            steps: 1500,
            batch: 16,
            dim: 32,
            hidden: 64,
            lr: 0.05,
            seed: 7,
            method: "dense".into(),
        }
    }
}

/// What a run ended with.
#[derive(Clone, Debug)]
pub struct TrainResult {
    /// Mean squared error on a fixed held-out set, averaged over the last 5 % of the steps.
    pub final_loss: f64,
    /// The same at the start.
    pub initial_loss: f64,
    /// Bytes a rank sent per step, averaged over steps and ranks (dense reports a ring's).
    pub bytes_per_step: f64,
    /// Parameters (gradient length).
    pub params: usize,
}

/// splitmix64: a small deterministic generator for the model and data.
struct Gen(u64);

impl Gen {
    fn new(seed: u64, stream: u64) -> Gen {
        Gen(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F) ^ 0x1234_5678)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
    }
}

/// A one-hidden-layer tanh MLP with a scalar output, parameters in one flat vector laid out
/// `w1 (hidden×dim) | b1 (hidden) | w2 (hidden) | b2`.
struct Mlp {
    dim: usize,
    hidden: usize,
}

impl Mlp {
    fn params(&self) -> usize {
        self.hidden * self.dim + 2 * self.hidden + 1
    }

    fn init(&self, g: &mut Gen, scale: f32) -> Vec<f32> {
        let mut w = vec![0.0; self.params()];
        let (d, h) = (self.dim, self.hidden);
        for v in &mut w[..h * d] {
            *v = g.normal() * scale / (d as f32).sqrt();
        }
        for v in &mut w[h * d + h..h * d + 2 * h] {
            *v = g.normal() * scale / (h as f32).sqrt();
        }
        w
    }

    /// Output for one input; fills `act` with the hidden activations.
    fn forward(&self, w: &[f32], x: &[f32], act: &mut [f32]) -> f32 {
        let (d, h) = (self.dim, self.hidden);
        let (w1, rest) = w.split_at(h * d);
        let (b1, rest) = rest.split_at(h);
        let (w2, b2) = rest.split_at(h);
        let mut y = b2[0];
        for j in 0..h {
            let z: f32 = w1[j * d..(j + 1) * d]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum::<f32>()
                + b1[j];
            act[j] = z.tanh();
            y += w2[j] * act[j];
        }
        y
    }

    /// Adds the gradient of ½·(y − t)²/batch for one sample to `grad`; returns the loss term.
    fn backward(
        &self,
        w: &[f32],
        x: &[f32],
        t: f32,
        batch: usize,
        act: &mut [f32],
        grad: &mut [f32],
    ) -> f32 {
        let (d, h) = (self.dim, self.hidden);
        let y = self.forward(w, x, act);
        let dy = (y - t) / batch as f32;
        let w2 = &w[h * d + h..h * d + 2 * h];
        let (g1, rest) = grad.split_at_mut(h * d);
        let (gb1, rest) = rest.split_at_mut(h);
        let (gw2, gb2) = rest.split_at_mut(h);
        gb2[0] += dy;
        for j in 0..h {
            gw2[j] += dy * act[j];
            let dz = dy * w2[j] * (1.0 - act[j] * act[j]);
            gb1[j] += dz;
            for (g, xi) in g1[j * d..(j + 1) * d].iter_mut().zip(x) {
                *g += dz * xi;
            }
        }
        0.5 * (y - t) * (y - t)
    }
}

/// The training of one rank: returns its result and a digest of its final parameters (equal
/// on every rank when the replicas stayed identical).
pub fn train_rank(
    comm: &mut Communicator,
    cfg: &TrainConfig,
) -> Result<(TrainResult, u64), String> {
    let rank = comm.rank();
    let teacher_net = Mlp {
        dim: cfg.dim,
        hidden: cfg.hidden / 2,
    };
    let student = Mlp {
        dim: cfg.dim,
        hidden: cfg.hidden,
    };
    let teacher = teacher_net.init(&mut Gen::new(cfg.seed, 1), 2.0);
    let mut w = student.init(&mut Gen::new(cfg.seed, 2), 1.0);
    let mut act_t = vec![0.0; teacher_net.hidden];
    let mut act = vec![0.0; student.hidden];

    // A fixed held-out set, the same on every rank.
    let mut g = Gen::new(cfg.seed, 3);
    let test: Vec<(Vec<f32>, f32)> = (0..512)
        .map(|_| {
            let x: Vec<f32> = (0..cfg.dim).map(|_| g.normal()).collect();
            let t = teacher_net.forward(&teacher, &x, &mut act_t);
            (x, t)
        })
        .collect();
    let eval = |w: &[f32], act: &mut [f32]| {
        test.iter()
            .map(|(x, t)| {
                let y = student.forward(w, x, act);
                ((y - t) * (y - t)) as f64
            })
            .sum::<f64>()
            / test.len() as f64
    };
    let initial_loss = eval(&w, &mut act);

    let mut comp = match cfg.method.as_str() {
        "dense" => None,
        // The model is small: compress it whole, whatever its size.
        spec if spec.contains("min_bytes") => {
            Some(Compressor::new(spec).map_err(|e| e.to_string())?)
        }
        spec => Some(Compressor::new(&format!("{spec},min_bytes=0")).map_err(|e| e.to_string())?),
    };
    let mut data = Gen::new(cfg.seed, 1000 + rank as u64);
    let mut grad = vec![0.0f32; student.params()];
    let mut x = vec![0.0f32; cfg.dim];
    let mut bytes = 0u64;
    let p = comm.size() as u64;
    let mut tail_losses = Vec::new();
    for step in 0..cfg.steps {
        grad.iter_mut().for_each(|v| *v = 0.0);
        for _ in 0..cfg.batch {
            x.iter_mut().for_each(|v| *v = data.normal());
            let t = teacher_net.forward(&teacher, &x, &mut act_t);
            student.backward(&w, &x, t, cfg.batch, &mut act, &mut grad);
        }
        match &mut comp {
            None => {
                comm.all_reduce(&mut grad, ReduceOp::Avg)
                    .map_err(|e| e.to_string())?;
                bytes += (grad.len() * 4) as u64 * 2 * (p - 1) / p;
            }
            Some(c) => {
                let r = comm
                    .all_reduce_compressed(&mut grad, ReduceOp::Avg, c)
                    .map_err(|e| e.to_string())?;
                bytes += r.bytes_sent;
            }
        }
        // Linear decay to a tenth of the rate: the end of training averages out SGD noise,
        // so final losses compare methods rather than the last few batches.
        let lr = cfg.lr * (1.0 - 0.9 * step as f32 / cfg.steps as f32);
        for (wi, gi) in w.iter_mut().zip(&grad) {
            *wi -= lr * gi;
        }
        // The final loss: the mean of ten evaluations over the last 5 % of the steps.
        let tail = (cfg.steps / 20).max(1);
        if step + tail >= cfg.steps && (cfg.steps - 1 - step) % tail.div_ceil(10) == 0 {
            tail_losses.push(eval(&w, &mut act));
        }
    }
    let final_loss = if tail_losses.is_empty() {
        eval(&w, &mut act)
    } else {
        tail_losses.iter().sum::<f64>() / tail_losses.len() as f64
    };
    let digest = w.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3)
    });
    Ok((
        TrainResult {
            final_loss,
            initial_loss,
            bytes_per_step: bytes as f64 / cfg.steps.max(1) as f64,
            params: student.params(),
        },
        digest,
    ))
}

/// Runs `cfg` on `cfg.ranks` threads of this process (a loopback store, one communicator per
/// thread) and checks the replicas ended identical.
pub fn train_threads(cfg: &TrainConfig) -> Result<TrainResult, String> {
    let token = "compressed-training-demo";
    let store = StoreServer::bind(
        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
        token.as_bytes(),
    )
    .map_err(|e| format!("store: {e}"))?;
    let addr = store.local_addr();
    let handles: Vec<_> = (0..cfg.ranks)
        .map(|rank| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let mut c = Config::new(rank, cfg.ranks, addr.to_string());
                c.token = Some(token.into());
                c.host_store = Some(false);
                c.timeout = Duration::from_secs(120);
                let mut comm = Communicator::new(c).map_err(|e| e.to_string())?;
                train_rank(&mut comm, &cfg)
            })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.join().map_err(|_| "a rank panicked".to_string())??);
    }
    drop(store);
    let (mut first, digest) = out[0].clone();
    if out.iter().any(|(_, d)| *d != digest) {
        return Err(format!("{}: the replicas diverged", cfg.method));
    }
    // Ranks that own more of the tensor send more: report the mean.
    first.bytes_per_step =
        out.iter().map(|(r, _)| r.bytes_per_step).sum::<f64>() / out.len() as f64;
    Ok(first)
}

/// Every method the demonstration compares, dense first; the last two (no error feedback
/// where the method needs it) are the negative controls.
pub const METHODS: [&str; 10] = [
    "dense",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "ternary",
    "sign",
    "topk:0.01",
    "sign,ef=off",
    "topk:0.01,ef=off",
];

/// Whether `method` is one of the negative controls of [`METHODS`].
pub fn is_negative_control(method: &str) -> bool {
    method.contains("ef=off")
}

#[allow(dead_code)] // the integration test includes this file for `train_threads`
fn main() {
    let mut cfg = TrainConfig::default();
    let mut methods: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> f64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} needs a number"))
        };
        match a.as_str() {
            "--ranks" => cfg.ranks = num("--ranks") as usize,
            "--steps" => cfg.steps = num("--steps") as usize,
            "--batch" => cfg.batch = num("--batch") as usize,
            "--hidden" => cfg.hidden = num("--hidden") as usize,
            "--lr" => cfg.lr = num("--lr") as f32,
            "--seed" => cfg.seed = num("--seed") as u64,
            "-h" | "--help" => {
                println!(
                    "usage: compressed_training [--ranks N] [--steps N] [--batch N] [--hidden N] \
                     [--lr X] [--seed N] [method ...]\nmethods: dense or a compressor spec; \
                     default: {}",
                    METHODS.join(" ")
                );
                return;
            }
            m => methods.push(m.to_string()),
        }
    }
    if methods.is_empty() {
        methods = METHODS.iter().map(|s| s.to_string()).collect();
    }
    let launched = std::env::var_os("RANK").is_some() || std::env::var_os("CHORUS_RANK").is_some();
    let mut comm = if launched {
        Some(Communicator::from_env().unwrap_or_else(|e| panic!("{e}")))
    } else {
        None
    };
    let ranks = comm.as_ref().map_or(cfg.ranks, |c| c.size());
    let show = comm.as_ref().map_or(true, |c| c.rank() == 0);
    if show {
        println!(
            "# teacher-student MLP, {ranks} ranks, {} steps, batch {}/rank, lr {}",
            cfg.steps, cfg.batch, cfg.lr
        );
        println!(
            "{:<22} {:>12} {:>12} {:>12} {:>14} {:>10}",
            "method", "initial_loss", "final_loss", "vs_dense", "bytes/step", "time_s"
        );
    }
    let mut dense = None;
    for m in methods {
        let cfg = TrainConfig {
            method: m.clone(),
            ..cfg.clone()
        };
        let t0 = Instant::now();
        let r = match &mut comm {
            Some(c) => train_rank(c, &cfg).map(|r| r.0),
            None => train_threads(&cfg),
        };
        let r = r.unwrap_or_else(|e| panic!("{m}: {e}"));
        if m == "dense" {
            dense = Some(r.final_loss);
        }
        if show {
            let vs = dense.map_or("-".to_string(), |d| {
                format!("{:+.1}%", (r.final_loss / d - 1.0) * 100.0)
            });
            println!(
                "{:<22} {:>12.4} {:>12.4} {:>12} {:>14.0} {:>10.1}",
                m,
                r.initial_loss,
                r.final_loss,
                vs,
                r.bytes_per_step,
                t0.elapsed().as_secs_f64()
            );
        }
    }
}
