//! RDMA verbs (cargo feature `rdma`, on by default): the device probe, the protocol layer and
//! a transport over it.
//!
//! - [`probe`] loads libibverbs at run time and lists the host's RDMA devices, so a build with
//!   the feature needs neither the library nor its headers, and runs where neither exists.
//! - [`protocol`] is what an RDMA connection speaks: the endpoint record two ranks exchange
//!   through the rendezvous store, and messages as RDMA WRITE WITH IMMEDIATE chunks into the
//!   receiver's ring of slots under credits, with abort notices, every peer input checked.
//! - [`transport::RdmaTransport`] drives the protocol for the caller's requests over any
//!   [`nic::Nic`] (the handful of verbs it needs), with the TCP transport's semantics;
//!   [`nic::MemNic`] emulates a NIC between threads, and the transport passes the
//!   conformance suite on it;
//! - [`exchange_endpoints`] publishes and collects the endpoint records through the
//!   rendezvous store, each checked.
//!
//! What is not here yet is the NIC over real verbs (protection domain, registered rings,
//! RC queue pairs brought to RTS from the exchanged endpoints, posting and polling), so a
//! communicator never runs over RDMA: `CHORUS_TRANSPORT=rdma` asks [`fallback_reason`] and
//! runs over TCP (shared memory between the ranks of one host), saying why.

mod exchange;
pub mod nic;
pub mod protocol;
mod sys;
pub mod transport;

pub use exchange::exchange_endpoints;
pub use sys::{probe, Device, Unavailable, LIBRARY};

/// How [`fallback_reason`] ends: what a communicator that asked for RDMA runs over instead.
pub const FALLBACK: &str = "using TCP (shared memory between the ranks of a host)";

/// Why a communicator that asked for RDMA runs over TCP on this host: no usable device, with
/// the probe's reason, or devices that this release cannot drive yet.
pub fn fallback_reason() -> String {
    fallback_reason_for(&probe())
}

fn fallback_reason_for(probed: &Result<Vec<Device>, Unavailable>) -> String {
    match probed {
        Err(e) => format!("{e}; {FALLBACK}"),
        Ok(devices) => {
            let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
            format!(
                "RDMA device(s) {} found, but this release has no verbs NIC for its RDMA \
                 transport yet; {FALLBACK}",
                names.join(", ")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_says_why() {
        let none = fallback_reason_for(&Err(Unavailable::NoDevice("none listed".into())));
        assert_eq!(none, format!("no RDMA device: none listed; {FALLBACK}"));
        let lib = fallback_reason_for(&Err(Unavailable::NoLibrary("not found".into())));
        assert!(
            lib.starts_with("cannot load libibverbs.so.1: not found"),
            "{lib}"
        );
        let some = fallback_reason_for(&Ok(vec![
            Device {
                name: "mlx5_0".into(),
            },
            Device {
                name: "mlx5_1".into(),
            },
        ]));
        assert!(some.contains("mlx5_0, mlx5_1 found"), "{some}");
        assert!(some.ends_with(FALLBACK), "{some}");
        assert!(fallback_reason().ends_with(FALLBACK));
    }
}
