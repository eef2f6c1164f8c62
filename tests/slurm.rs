//! Ranks started as srun starts them: only Slurm's variables (task id, the step's task count
//! and node list, job and step ids, local id), no rendezvous address. They meet at the
//! step's first node on the port made from the job and step ids, and allreduce.

mod common;

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

use chorus::{Communicator, ReduceOp};
use common::{check_one, wait_job, Job};

const TEST_NAME: &str = "ranks_started_as_srun_starts_them_meet_without_an_address";
const CHILD: &str = "CHORUS_SLURM_TEST_CHILD";

#[test]
fn ranks_started_as_srun_starts_them_meet_without_an_address() {
    if std::env::var_os(CHILD).is_some() {
        let mut c = Communicator::from_env().unwrap_or_else(|e| panic!("communicator: {e}"));
        let n = check_one::<f64>(&mut c, 1000, ReduceOp::Sum, false);
        assert_eq!(n, 0, "rank {}: {n} wrong", c.rank());
        println!("SLURM-OK {}", c.rank());
        return;
    }
    let size = 3;
    // A job id whose port is free here now (the port is made from it, as on every task).
    let job = (std::process::id() as u64..)
        .take(50)
        .find(|&job| {
            let port = chorus::Config::from_lookup(|k| match k {
                "SLURM_PROCID" => Some("0".into()),
                "SLURM_STEP_NUM_TASKS" => Some(size.to_string()),
                "SLURM_STEP_NODELIST" => Some("localhost".into()),
                "SLURM_JOB_ID" => Some(job.to_string()),
                "SLURM_STEP_ID" => Some("0".into()),
                _ => None,
            })
            .ok()
            .and_then(|c| c.root_addr.rsplit_once(':')?.1.parse::<u16>().ok());
            port.is_some_and(|p| TcpListener::bind(("127.0.0.1", p)).is_ok())
        })
        .expect("a job id with a free port");
    let exe = std::env::current_exe().unwrap();
    let children = (0..size)
        .map(|rank| {
            let mut cmd = Command::new(&exe);
            cmd.args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_STEP_NUM_TASKS", size.to_string())
                .env("SLURM_STEP_NUM_NODES", "1")
                .env("SLURM_NTASKS", size.to_string())
                .env("SLURM_STEP_NODELIST", "localhost")
                .env("SLURM_JOB_ID", job.to_string())
                .env("SLURM_STEP_ID", "0")
                .env("CHORUS_TIMEOUT", "30")
                .env("CHORUS_INIT_TIMEOUT", "30")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for k in [
                "CHORUS_RANK",
                "CHORUS_WORLD_SIZE",
                "CHORUS_ADDR",
                "CHORUS_PORT",
                "RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "PMI_RANK",
                "PMI_SIZE",
                // Run inside a real Slurm job, its own would disagree with this fake step.
                "SLURMD_NODENAME",
                "CHORUS_LOCAL_RANK",
                "CHORUS_LOCAL_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "CHORUS_TOKEN",
            ] {
                cmd.env_remove(k);
            }
            cmd.spawn().expect("spawn a rank")
        })
        .collect();
    let server = common::store(); // unused by the ranks; Job keeps one
    let out = wait_job(Job { children, server }, Duration::from_secs(90));
    for (rank, (code, text)) in out.iter().enumerate() {
        assert!(
            *code == Some(0) && text.contains(&format!("SLURM-OK {rank}")),
            "rank {rank} ({code:?}):\n{text}"
        );
    }
}
