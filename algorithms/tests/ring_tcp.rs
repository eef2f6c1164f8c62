//! The ring allreduce over real TCP connections on loopback (one process, ranks as threads).

mod support;

use chorus_algorithms::{DType, ReduceOp};
use chorus_transport::tcp::local_group;
use support::sweep::{cases, sweep, RANKS};

fn tcp(p: usize) -> Vec<chorus_transport::tcp::TcpTransport> {
    local_group(p).expect("loopback group")
}

#[test]
fn every_dtype_and_op_small_counts_over_tcp() {
    let cases = cases(&DType::ALL, &ReduceOp::ALL, &[0, 1, 7, 1023]);
    sweep(&cases, &RANKS, tcp);
}

#[test]
fn large_counts_over_tcp() {
    let large = (1 << 20) + 3;
    let mut all = cases(&[DType::Float32], &[ReduceOp::Sum], &[large]);
    all.extend(cases(&[DType::Bfloat16], &[ReduceOp::Avg], &[large]));
    sweep(&all, &[2, 3, 4, 8], tcp);
}
