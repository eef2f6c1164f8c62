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
    for m in demo::METHODS.into_iter().filter(|m| *m != "dense") {
        let r = train_threads(&cfg(m)).unwrap_or_else(|e| panic!("{m}: {e}"));
        let control = demo::is_negative_control(m);
        report.push(format!(
            "{m} {:.4} ({:.0} B/step){}",
            r.final_loss,
            r.bytes_per_step,
            if control { " negative control" } else { "" }
        ));
        // A method must pass the check; a negative control must fail it.
        if within_5_percent(r.final_loss, dense.final_loss) == control {
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
