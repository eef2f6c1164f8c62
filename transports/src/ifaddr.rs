//! Choosing the local address to listen on.
//!
//! `CHORUS_SOCKET_IFNAME` follows NCCL's `NCCL_SOCKET_IFNAME` grammar: a comma-separated list
//! of interface-name prefixes; a leading `^` excludes the listed prefixes instead; a leading `=`
//! (after the optional `^`) makes the names exact instead of prefixes.
//!
//! | spec          | selects                                         |
//! |---------------|-------------------------------------------------|
//! | `eth`         | `eth0`, `eth1`, ... (prefix)                    |
//! | `eth,ib`      | interfaces starting with `eth` or `ib`          |
//! | `=eth0`       | exactly `eth0` (not `eth01`)                    |
//! | `^docker,lo`  | everything except `docker*` and `lo*`           |
//! | `^=eth0`      | everything except exactly `eth0`                |
//!
//! Spaces around names are ignored, as are empty names. With a spec, the first address (in
//! the kernel's order) of a matching interface is used, preferring the root address's family;
//! IPv6 link-local addresses are skipped (they need a scope id to be used).
//!
//! Without a spec: if the root address is a loopback (or unspecified) address the job is on
//! one host and loopback is right; otherwise use the local address the kernel would use to
//! reach the root (UDP connect + getsockname, no packet is sent), and never loopback — a
//! multi-host job on `lo` is an error with a message naming the variable to set.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use crate::{Result, TransportError};

/// One local interface address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfAddr {
    /// Interface name, e.g. "eth0".
    pub name: String,
    /// Address.
    pub addr: IpAddr,
}

/// Every IPv4/IPv6 address of every interface that is up (getifaddrs).
///
/// Errors: [`TransportError::Io`] when the system call fails.
pub fn list() -> Result<Vec<IfAddr>> {
    sys::interface_addrs()
        .map_err(|e| TransportError::io(None, "listing network interfaces (getifaddrs)", e))
}

/// Whether interface `name` matches an NCCL-grammar spec (see the [module
/// documentation](self)). An include spec without names matches nothing; an exclude spec
/// without names (`^`) matches everything.
pub fn matches_spec(spec: &str, name: &str) -> bool {
    let mut rest = spec.trim();
    let exclude = match rest.strip_prefix('^') {
        Some(r) => {
            rest = r.trim_start();
            true
        }
        None => false,
    };
    let exact = match rest.strip_prefix('=') {
        Some(r) => {
            rest = r;
            true
        }
        None => false,
    };
    let listed = rest
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| {
            if exact {
                name == p
            } else {
                name.starts_with(p)
            }
        });
    listed != exclude
}

/// The address this rank listens on, given an optional spec and the root's address.
///
/// An empty or blank spec counts as none. Errors: [`TransportError::InvalidArgument`] when
/// the spec matches no interface with a usable address (the message names the spec and lists
/// the interfaces); [`TransportError::Rendezvous`] when, without a spec, the root cannot be
/// routed to, or only through loopback; [`TransportError::Io`] when listing fails.
pub fn select(spec: Option<&str>, root: SocketAddr) -> Result<IpAddr> {
    match spec.map(str::trim).filter(|s| !s.is_empty()) {
        Some(spec) => select_by_spec(spec, root, &list()?),
        None => select_default(root, route_to),
    }
}

/// The address to host a store on before any peer is known (a unique id, as NCCL's
/// `ncclGetUniqueId`): with a spec, the first usable address of a matching interface (IPv4
/// first, loopback last); without one, the first usable address of an interface that is neither loopback nor
/// `docker*` (NCCL's default exclusions), IPv4 first, and loopback when there is none (a job on
/// one host).
pub fn select_unrooted(spec: Option<&str>) -> Result<IpAddr> {
    let v4_any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
    let addrs = list()?;
    match spec.map(str::trim).filter(|s| !s.is_empty()) {
        Some(spec) => select_by_spec(spec, v4_any, &addrs),
        None => Ok(first_outside(&addrs)),
    }
}

/// The first usable non-loopback, non-docker address (IPv4 first), else IPv4 loopback.
fn first_outside(addrs: &[IfAddr]) -> IpAddr {
    let outside: Vec<&IfAddr> = addrs
        .iter()
        .filter(|a| usable(&a.addr) && !a.addr.is_loopback() && !a.name.starts_with("docker"))
        .collect();
    outside
        .iter()
        .find(|a| a.addr.is_ipv4())
        .or(outside.first())
        .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.addr)
}

/// Whether an address can be listened on and reached by peers without extra information.
fn usable(addr: &IpAddr) -> bool {
    match addr {
        IpAddr::V4(a) => !a.is_unspecified() && !a.is_multicast() && !a.is_broadcast(),
        IpAddr::V6(a) => {
            let link_local = (a.segments()[0] & 0xffc0) == 0xfe80;
            !a.is_unspecified() && !a.is_multicast() && !link_local
        }
    }
}

/// With a spec: the first usable address of a matching interface, preferring the family of
/// the root's address, and a loopback address only when the root's is one (a job on one
/// host) or nothing else matches: an exclusion such as `^docker` also matches `lo`, which
/// comes first in the kernel's order, and ranks on other hosts cannot reach it.
fn select_by_spec(spec: &str, root: SocketAddr, addrs: &[IfAddr]) -> Result<IpAddr> {
    let candidates: Vec<&IfAddr> = addrs
        .iter()
        .filter(|a| matches_spec(spec, &a.name) && usable(&a.addr))
        .collect();
    let loopback_wanted = root.ip().is_loopback();
    let fits = |a: &&&IfAddr, family: bool, loopback: bool| {
        (!family || a.addr.is_ipv4() == root.is_ipv4())
            && (!loopback || a.addr.is_loopback() == loopback_wanted)
    };
    let best = [(true, true), (false, true), (true, false)]
        .into_iter()
        .find_map(|(family, loopback)| candidates.iter().find(|a| fits(a, family, loopback)));
    match best.or(candidates.first()) {
        Some(a) => Ok(a.addr),
        None => Err(TransportError::InvalidArgument(format!(
            "CHORUS_SOCKET_IFNAME={spec:?} matches no interface with a usable address; \
             interfaces that are up: {}",
            describe(addrs)
        ))),
    }
}

/// "lo (127.0.0.1, ::1), eth0 (10.0.0.2)", in the kernel's order.
fn describe(addrs: &[IfAddr]) -> String {
    let mut names: Vec<(&str, Vec<String>)> = Vec::new();
    for a in addrs {
        match names.iter_mut().find(|(n, _)| *n == a.name) {
            Some((_, v)) => v.push(a.addr.to_string()),
            None => names.push((&a.name, vec![a.addr.to_string()])),
        }
    }
    if names.is_empty() {
        return "none".into();
    }
    names
        .iter()
        .map(|(n, v)| format!("{n} ({})", v.join(", ")))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The local address the kernel would use to send to `root` (no packet is sent).
fn route_to(root: SocketAddr) -> io::Result<IpAddr> {
    let any: SocketAddr = if root.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(any)?;
    // Connecting a UDP socket to port 0 fails on some systems; any port gives the same route.
    let mut target = root;
    if target.port() == 0 {
        target.set_port(9);
    }
    socket.connect(target)?;
    Ok(socket.local_addr()?.ip())
}

/// Without a spec: loopback for a one-host job, else the route's source address.
fn select_default(
    root: SocketAddr,
    route: impl Fn(SocketAddr) -> io::Result<IpAddr>,
) -> Result<IpAddr> {
    let ip = root.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return Ok(match ip {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        });
    }
    let local = route(root).map_err(|e| {
        TransportError::Rendezvous(format!(
            "this host has no route to the rendezvous root {root} ({e}); check CHORUS_ADDR / \
             MASTER_ADDR, or set CHORUS_SOCKET_IFNAME to the interface to use"
        ))
    })?;
    if local.is_loopback() || !usable(&local) {
        return Err(TransportError::Rendezvous(format!(
            "the rendezvous root {root} is reached from this host through {local}, which other \
             hosts cannot use; set CHORUS_SOCKET_IFNAME to the interface of the network that \
             connects the hosts (e.g. CHORUS_SOCKET_IFNAME=eth0)"
        )));
    }
    Ok(local)
}

/// The one place with `unsafe` in this module: reading the getifaddrs list.
mod sys {
    use std::ffi::CStr;
    use std::io;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use std::ptr;

    use super::IfAddr;

    /// Owns the list returned by `getifaddrs` and frees it when dropped, whichever way the
    /// reading function returns.
    struct List(*mut libc::ifaddrs);

    impl Drop for List {
        fn drop(&mut self) {
            // SAFETY: the pointer came from a successful getifaddrs call, is freed only here,
            // and no reference into the list outlives `self` (the readers copy what they keep).
            unsafe { libc::freeifaddrs(self.0) }
        }
    }

    /// Every IPv4/IPv6 address of every interface that is up.
    pub(super) fn interface_addrs() -> io::Result<Vec<IfAddr>> {
        let mut head: *mut libc::ifaddrs = ptr::null_mut();
        // SAFETY: `head` is a valid place for getifaddrs to store the list's address.
        if unsafe { libc::getifaddrs(&mut head) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let list = List(head);
        let mut out = Vec::new();
        let mut node = list.0;
        while !node.is_null() {
            // SAFETY: `node` is a non-null element of the list owned by `list`, which is not
            // freed before this function returns; the reference does not escape the loop.
            let ifa = unsafe { &*node };
            node = ifa.ifa_next;
            if ifa.ifa_flags & (libc::IFF_UP as libc::c_uint) == 0
                || ifa.ifa_addr.is_null()
                || ifa.ifa_name.is_null()
            {
                continue;
            }
            // SAFETY: `ifa_addr` is non-null and points to a socket address whose family field
            // is valid to read for every family; it lives as long as `list`.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            let addr = if family == libc::AF_INET {
                // SAFETY: for AF_INET the kernel stores a full `sockaddr_in` there;
                // read_unaligned copies it without assuming alignment.
                let sin = unsafe { ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in>()) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            } else if family == libc::AF_INET6 {
                // SAFETY: for AF_INET6 the kernel stores a full `sockaddr_in6` there;
                // read_unaligned copies it without assuming alignment.
                let sin6 =
                    unsafe { ptr::read_unaligned(ifa.ifa_addr.cast::<libc::sockaddr_in6>()) };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            } else {
                continue;
            };
            // SAFETY: `ifa_name` is a non-null, NUL-terminated string owned by `list`; it is
            // copied into a `String` before `list` is freed.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
                .to_string_lossy()
                .into_owned();
            out.push(IfAddr { name, addr });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn root(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn fake() -> Vec<IfAddr> {
        [
            ("lo", "127.0.0.1"),
            ("lo", "::1"),
            ("eth0", "fe80::1"),
            ("eth0", "10.0.0.2"),
            ("eth01", "10.1.0.2"),
            ("docker0", "172.17.0.1"),
            ("ib0", "fd00::5"),
        ]
        .iter()
        .map(|(n, a)| IfAddr {
            name: n.to_string(),
            addr: v4(a),
        })
        .collect()
    }

    #[test]
    fn unrooted_selection_skips_loopback_and_docker() {
        let all = fake();
        assert_eq!(first_outside(&all), v4("10.0.0.2"));
        // Without IPv4 outside loopback and docker: the IPv6 one; with nothing: loopback.
        let v6_only: Vec<IfAddr> = all
            .iter()
            .filter(|a| a.name == "lo" || a.name == "docker0" || a.name == "ib0")
            .cloned()
            .collect();
        assert_eq!(first_outside(&v6_only), v4("fd00::5"));
        assert_eq!(first_outside(&all[..2]), v4("127.0.0.1"));
        assert_eq!(
            select_by_spec("ib", SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)), &all).unwrap(),
            v4("fd00::5")
        );
    }

    #[test]
    fn grammar_prefixes_exclusion_and_exact_names() {
        assert!(matches_spec("eth", "eth0"));
        assert!(matches_spec("eth", "eth12"));
        assert!(!matches_spec("eth", "ens3"));
        assert!(!matches_spec("eth", "lo"));
        assert!(matches_spec("eth,ib", "ib0"));
        assert!(matches_spec(" eth , ib ", "ib0"));
        assert!(matches_spec("eth,ib", "eth1"));
        assert!(!matches_spec("eth,ib", "docker0"));
        assert!(!matches_spec("^docker,lo", "docker0"));
        assert!(!matches_spec("^docker,lo", "lo"));
        assert!(matches_spec("^docker,lo", "eth0"));
        assert!(matches_spec("=eth0", "eth0"));
        assert!(!matches_spec("=eth0", "eth01"));
        assert!(!matches_spec("=eth0", "eth"));
        assert!(matches_spec("=eth0,ib0", "ib0"));
        assert!(!matches_spec("^=eth0", "eth0"));
        assert!(matches_spec("^=eth0", "eth01"));
        assert!(matches_spec("^=eth0", "lo"));
        // No names: include nothing, exclude nothing; empty entries are ignored.
        assert!(!matches_spec("", "eth0"));
        assert!(!matches_spec("=", "eth0"));
        assert!(matches_spec("^", "eth0"));
        assert!(matches_spec("eth,,", "eth0"));
    }

    #[test]
    fn spec_selection_prefers_root_family_and_skips_link_local() {
        let a = fake();
        assert_eq!(
            select_by_spec("eth", root("10.0.0.1:1"), &a).unwrap(),
            v4("10.0.0.2")
        );
        assert_eq!(
            select_by_spec("=eth01", root("10.0.0.1:1"), &a).unwrap(),
            v4("10.1.0.2")
        );
        assert_eq!(
            select_by_spec("lo", root("[::1]:1"), &a).unwrap(),
            v4("::1")
        );
        assert_eq!(
            select_by_spec("lo", root("127.0.0.1:1"), &a).unwrap(),
            v4("127.0.0.1")
        );
        assert_eq!(
            select_by_spec("^lo,eth", root("10.0.0.1:1"), &a).unwrap(),
            v4("172.17.0.1")
        );
        // Only an IPv6 address matches: used even for an IPv4 root.
        assert_eq!(
            select_by_spec("ib", root("10.0.0.1:1"), &a).unwrap(),
            v4("fd00::5")
        );
        // An exclusion matches lo too: not taken for a root on another address (its peers
        // could not reach it), taken for a loopback root, and when nothing else matches.
        assert_eq!(
            select_by_spec("^docker", root("10.0.0.1:1"), &a).unwrap(),
            v4("10.0.0.2")
        );
        assert_eq!(
            select_by_spec("^docker", root("127.0.0.1:1"), &a).unwrap(),
            v4("127.0.0.1")
        );
        assert_eq!(
            select_by_spec("^eth,docker,ib", root("10.0.0.1:1"), &a).unwrap(),
            v4("127.0.0.1")
        );
        let unrooted = SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0));
        assert_eq!(
            select_by_spec("^docker", unrooted, &a).unwrap(),
            v4("10.0.0.2")
        );
    }

    #[test]
    fn spec_matching_nothing_names_spec_and_interfaces() {
        let e = select_by_spec("wlan", root("10.0.0.1:1"), &fake()).unwrap_err();
        assert!(matches!(e, TransportError::InvalidArgument(_)), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("CHORUS_SOCKET_IFNAME=\"wlan\""), "{msg}");
        assert!(msg.contains("lo (127.0.0.1, ::1)"), "{msg}");
        assert!(msg.contains("eth0 (fe80::1, 10.0.0.2)"), "{msg}");
        let e = select_by_spec("eth", root("10.0.0.1:1"), &[]).unwrap_err();
        assert!(
            e.to_string().contains("interfaces that are up: none"),
            "{e}"
        );
    }

    #[test]
    fn default_selection_without_a_spec() {
        let never = |_: SocketAddr| -> io::Result<IpAddr> { panic!("no route lookup expected") };
        assert_eq!(
            select_default(root("127.0.0.1:5"), never).unwrap(),
            v4("127.0.0.1")
        );
        assert_eq!(
            select_default(root("127.3.4.5:5"), never).unwrap(),
            v4("127.0.0.1")
        );
        assert_eq!(select_default(root("[::1]:5"), never).unwrap(), v4("::1"));
        assert_eq!(
            select_default(root("0.0.0.0:5"), never).unwrap(),
            v4("127.0.0.1")
        );
        let via = |ip: &'static str| move |_: SocketAddr| Ok(v4(ip));
        assert_eq!(
            select_default(root("10.0.0.1:5"), via("10.0.0.2")).unwrap(),
            v4("10.0.0.2")
        );
        let e = select_default(root("10.0.0.1:5"), via("127.0.0.1")).unwrap_err();
        assert!(e.to_string().contains("CHORUS_SOCKET_IFNAME"), "{e}");
        let unreachable = |_: SocketAddr| Err(io::Error::from(io::ErrorKind::NetworkUnreachable));
        let e = select_default(root("10.0.0.1:5"), unreachable).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("no route") && msg.contains("CHORUS_SOCKET_IFNAME"),
            "{msg}"
        );
    }

    #[test]
    fn list_contains_loopback() {
        let all = list().unwrap();
        assert!(
            all.iter()
                .any(|a| a.name == "lo" && a.addr == v4("127.0.0.1")),
            "{all:?}"
        );
    }

    #[test]
    fn select_on_this_host() {
        assert!(select(None, root("127.0.0.1:4000")).unwrap().is_loopback());
        assert!(select(Some("  "), root("127.0.0.1:4000"))
            .unwrap()
            .is_loopback());
        assert_eq!(
            select(Some("lo"), root("127.0.0.1:4000")).unwrap(),
            v4("127.0.0.1")
        );
        assert_eq!(
            select(Some("=lo"), root("127.0.0.1:4000")).unwrap(),
            v4("127.0.0.1")
        );
        let e = select(Some("no-such-if"), root("127.0.0.1:4000")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("no-such-if") && msg.contains("lo ("), "{msg}");
        // A remote root: either a non-loopback route exists, or the error says what to set.
        match select(None, root("192.0.2.1:4000")) {
            Ok(ip) => assert!(!ip.is_loopback(), "{ip}"),
            Err(e) => assert!(e.to_string().contains("CHORUS_SOCKET_IFNAME"), "{e}"),
        }
    }
}
