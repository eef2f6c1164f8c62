//! The README's quick start: every rank contributes a gradient, everyone gets the average.
//!
//! ```text
//! cargo build --release --examples --bins
//! target/release/chorus-run -n 4 -- target/release/examples/quickstart
//! ```
use chorus::{Communicator, ReduceOp};

fn main() -> Result<(), chorus::CommError> {
    // Rank, size, rendezvous address and token come from the launcher's environment
    // (chorus-run, torchrun, srun; mpirun with CHORUS_ADDR exported).
    let mut comm = Communicator::from_env()?;
    let (rank, size) = (comm.rank(), comm.size());

    // Rank r holds r+1 everywhere; the average is (p+1)/2.
    let mut grad = vec![(rank + 1) as f32; 1 << 20];
    comm.all_reduce(&mut grad, ReduceOp::Avg)?;

    let want = (size + 1) as f32 / 2.0;
    assert!(grad.iter().all(|&g| g == want));
    println!(
        "rank {rank}/{size}: average {} on {} elements",
        grad[0],
        grad.len()
    );
    Ok(())
}
