//! The compression quality check: the training demonstration of `examples/`.
//! Every codec (and top-k with error feedback) must end within 5 % of the dense final loss,
//! and the negative controls — sign and top-k without error feedback — must be rejected by
//! the same check, so the check can fail.

#[path = "../examples/compressed_training.rs"]
#[allow(dead_code)]
mod demo;

use demo::{train_threads, TrainConfig};

/// The example's own configuration (8 ranks as threads, 1,500 steps: about a second per
/// method), so the test checks what the demonstration prints.
fn cfg(method: &str) -> TrainConfig {
    TrainConfig {
        method: method.to_string(),
        ..TrainConfig::default()
    }
}

/// The check under test: final loss within 5 % of dense.
fn within_5_percent(loss: f64, dense: f64) -> bool {
    loss <= dense * 1.05
}

#[test]
fn compressed_training_tracks_dense_and_the_check_can_fail() {
    let dense = train_threads(&cfg("dense")).expect("dense run");
    assert!(
        dense.final_loss < 0.5 * dense.initial_loss,
        "the dense run did not learn: {dense:?}"
    );
    let mut report = vec![format!("dense {:.4}", dense.final_loss)];
    let mut failures = Vec::new();
    for m in [
        "fp16",
        "bf16",
        "int8",
        "int4",
        "ternary",
        "sign",
        "topk:0.01",
    ] {
        let r = train_threads(&cfg(m)).unwrap_or_else(|e| panic!("{m}: {e}"));
        report.push(format!(
            "{m} {:.4} ({:.0} B/step)",
            r.final_loss, r.bytes_per_step
        ));
        if !within_5_percent(r.final_loss, dense.final_loss) {
            failures.push(m);
        }
    }
    for m in ["sign,ef=off", "topk:0.01,ef=off"] {
        let r = train_threads(&cfg(m)).unwrap_or_else(|e| panic!("{m}: {e}"));
        report.push(format!("{m} {:.4} (negative control)", r.final_loss));
        if within_5_percent(r.final_loss, dense.final_loss) {
            failures.push(m);
        }
    }
    assert!(
        failures.is_empty(),
        "failed: {failures:?}\n{}",
        report.join("\n")
    );
    eprintln!("{}", report.join("\n"));
}
