//! Endpoint exchange through the rendezvous store: every rank publishes the [`Endpoint`] it
//! made for each peer and reads the one each peer made for it, checked field by field and
//! against its own (the link layers must match).

use std::time::Instant;

use super::protocol::{path_mtu, Endpoint};
use crate::rendezvous::StoreClient;
use crate::{Result, TransportError};

/// Where `from` publishes its endpoint for `to`: the ones for one rank form a row (the
/// sender's index last) that it reads in one request.
fn key(from: usize, to: usize) -> String {
    format!("{}{from}", row(to))
}

fn row(to: usize) -> String {
    format!("rdma/ep/{to}/")
}

/// Publishes `local[j]` (this rank's endpoint for peer `j`; `None` at this rank's own index)
/// and returns, at each peer's index, the endpoint that peer published for this rank with
/// the path MTU the two agree on. Fails naming the peer whose record is bad, and with a
/// timeout when a peer publishes nothing before `deadline`.
pub fn exchange_endpoints(
    store: &mut StoreClient,
    rank: usize,
    local: &[Option<Endpoint>],
    deadline: Instant,
) -> Result<Vec<Option<(Endpoint, u16)>>> {
    let size = local.len();
    if rank >= size
        || local[rank].is_some()
        || local
            .iter()
            .enumerate()
            .any(|(j, e)| j != rank && e.is_none())
    {
        return Err(TransportError::InvalidArgument(format!(
            "rank {rank} needs an endpoint for every other rank of {size}, and none for itself"
        )));
    }
    for (j, e) in local.iter().enumerate() {
        if let Some(e) = e {
            e.check()
                .map_err(|e| TransportError::InvalidArgument(e.to_string()))?;
            store.set(&key(rank, j), &e.encode())?;
        }
    }
    let mut out: Vec<Option<(Endpoint, u16)>> = Vec::with_capacity(size);
    for run in [0..rank, rank + 1..size] {
        if run.start == rank + 1 {
            out.push(None); // this rank's own index
        }
        let read = store.get_each(&row(rank), run, deadline, |j, raw| {
            let bad = |what: String| TransportError::Rendezvous(format!("rank {j}: {what}"));
            let mine = local[j].as_ref().expect("checked above");
            let theirs = Endpoint::decode(&raw).map_err(|e| bad(e.to_string()))?;
            let mtu = path_mtu(mine, &theirs).map_err(|e| bad(e.to_string()))?;
            out.push(Some((theirs, mtu)));
            Ok(())
        });
        // `out` holds every index before the one waited for.
        read.map_err(|e| match e {
            TransportError::Timeout { waited, .. } => TransportError::Timeout {
                peer: Some(out.len()),
                waited,
            },
            other => other,
        })?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::StoreServer;
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    use std::time::Duration;

    fn endpoint(rank: usize, peer: usize) -> Endpoint {
        Endpoint {
            port: 1,
            mtu: if rank == 2 { 1024 } else { 4096 },
            lid: 1 + rank as u16,
            gid: [0; 16],
            qpn: 0x100 + (rank * 8 + peer) as u32,
            psn: 7,
            ring_addr: 0x1000_0000,
            ring_rkey: 3,
            slots: 16,
            slot_bytes: 4096,
            credit_addr: 0x2000_0000,
            credit_rkey: 4,
        }
    }

    fn server() -> (StoreServer, SocketAddr) {
        let s =
            StoreServer::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), b"t").unwrap();
        let a = s.local_addr();
        (s, a)
    }

    #[test]
    fn every_rank_gets_what_its_peers_made_for_it() {
        let (_server, addr) = server();
        let n = 3;
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                std::thread::spawn(move || {
                    let deadline = Instant::now() + Duration::from_secs(10);
                    let mut store = StoreClient::connect(addr, b"t", deadline).unwrap();
                    let local: Vec<_> = (0..n)
                        .map(|j| (j != rank).then(|| endpoint(rank, j)))
                        .collect();
                    exchange_endpoints(&mut store, rank, &local, deadline).unwrap()
                })
            })
            .collect();
        for (rank, h) in hs.into_iter().enumerate() {
            let got = h.join().unwrap();
            for (j, e) in got.iter().enumerate() {
                match e {
                    None => assert_eq!(j, rank),
                    Some((e, mtu)) => {
                        assert_eq!(*e, endpoint(j, rank));
                        assert_eq!(*mtu, if rank == 2 || j == 2 { 1024 } else { 4096 });
                    }
                }
            }
        }
    }

    #[test]
    fn bad_or_missing_records_name_the_peer() {
        let (_server, addr) = server();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut store = StoreClient::connect(addr, b"t", deadline).unwrap();
        // Rank 1 published garbage for rank 0; rank 2 published nothing.
        store.set(&key(1, 0), b"not an endpoint").unwrap();
        let local = vec![None, Some(endpoint(0, 1)), Some(endpoint(0, 2))];
        let err = exchange_endpoints(&mut store, 0, &local, deadline).unwrap_err();
        assert!(
            matches!(&err, TransportError::Rendezvous(w) if w.starts_with("rank 1:")),
            "{err}"
        );
        let mut ok = endpoint(1, 0);
        ok.lid = 0; // RoCE against this rank's InfiniBand port
        ok.gid = [1; 16];
        store.set(&key(1, 0), &ok.encode()).unwrap();
        let err = exchange_endpoints(&mut store, 0, &local, deadline).unwrap_err();
        assert!(err.to_string().contains("link layers differ"), "{err}");
        store.set(&key(1, 0), &endpoint(1, 0).encode()).unwrap();
        let soon = Instant::now() + Duration::from_millis(200);
        let err = exchange_endpoints(&mut store, 0, &local, soon).unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { peer: Some(2), .. }),
            "{err}"
        );
        // Rank 3 of 4 has rank 0's record, waits for rank 1's: the timeout names rank 1.
        store.set(&key(0, 3), &endpoint(0, 3).encode()).unwrap();
        let local3: Vec<_> = (0..4).map(|j| (j != 3).then(|| endpoint(3, j))).collect();
        let soon = Instant::now() + Duration::from_millis(200);
        let err = exchange_endpoints(&mut store, 3, &local3, soon).unwrap_err();
        assert!(
            matches!(err, TransportError::Timeout { peer: Some(1), .. }),
            "{err}"
        );
        // A caller's mistake: an endpoint for itself.
        let err = exchange_endpoints(&mut store, 1, &local, deadline).unwrap_err();
        assert!(matches!(err, TransportError::InvalidArgument(_)), "{err}");
    }
}
