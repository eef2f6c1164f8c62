//! The system layer: libibverbs, loaded at run time (`dlopen`), so that a build with the `rdma`
//! feature needs neither the library nor its headers, and runs where neither exists.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::sync::OnceLock;

/// The library's soname (rdma-core).
pub const LIBRARY: &str = "libibverbs.so.1";

/// An RDMA device the library lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    /// The kernel's name for it (`mlx5_0`, `rxe0`, …).
    pub name: String,
}

/// Why no RDMA device can be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// libibverbs could not be loaded (`dlerror`'s words).
    NoLibrary(String),
    /// The library has no symbol this layer needs.
    NoSymbol(&'static str),
    /// The library loaded and lists no device (the reason, where the library gave one).
    NoDevice(String),
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::NoLibrary(why) => write!(f, "cannot load {LIBRARY}: {why}"),
            Unavailable::NoSymbol(s) => write!(f, "{LIBRARY} has no symbol {s}"),
            Unavailable::NoDevice(why) => write!(f, "no RDMA device: {why}"),
        }
    }
}

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// The devices of this host, probed once per process (loading the library and listing its
/// devices; the library stays loaded, as its providers expect).
pub fn probe() -> Result<Vec<Device>, Unavailable> {
    static PROBE: OnceLock<Result<Vec<Device>, Unavailable>> = OnceLock::new();
    PROBE.get_or_init(|| list_devices(LIBRARY)).clone()
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl* call
    // on this thread; it is copied at once.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Loads `library` and lists its devices.
fn list_devices(library: &str) -> Result<Vec<Device>, Unavailable> {
    let name = CString::new(library).map_err(|_| Unavailable::NoLibrary("bad name".into()))?;
    // SAFETY: `name` is a valid C string; dlopen has no other precondition. A library that
    // fails to load returns NULL, handled below.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(Unavailable::NoLibrary(dlerror_text()));
    }
    let sym = |s: &'static CStr| {
        // SAFETY: `handle` is a live handle from dlopen (never closed) and `s` a C string.
        let p = unsafe { libc::dlsym(handle, s.as_ptr()) };
        if p.is_null() {
            Err(Unavailable::NoSymbol(s.to_str().unwrap_or("?")))
        } else {
            Ok(p)
        }
    };
    let get_list = sym(c"ibv_get_device_list")?;
    let free_list = sym(c"ibv_free_device_list")?;
    let get_name = sym(c"ibv_get_device_name")?;
    // SAFETY: the three symbols are rdma-core's exported functions, whose C signatures
    // (verbs.h) the three types spell out.
    let (get_list, free_list, get_name) = unsafe {
        (
            std::mem::transmute::<*mut c_void, GetDeviceList>(get_list),
            std::mem::transmute::<*mut c_void, FreeDeviceList>(free_list),
            std::mem::transmute::<*mut c_void, GetDeviceName>(get_name),
        )
    };
    let mut n: c_int = 0;
    // SAFETY: ibv_get_device_list writes the count through the pointer and returns NULL (with
    // errno set) or an array of `n` device pointers, freed below with ibv_free_device_list.
    let list = unsafe { get_list(&mut n) };
    if list.is_null() {
        let err = std::io::Error::last_os_error();
        return Err(Unavailable::NoDevice(format!(
            "listing RDMA devices failed: {err} (no RDMA support in the kernel, or no \
             permission to its devices)"
        )));
    }
    let mut devices = Vec::new();
    for i in 0..n.max(0) as usize {
        // SAFETY: `list` holds `n` valid device pointers (and a NULL after them); each name
        // is a NUL-terminated string owned by the device, copied before the list is freed.
        let name = unsafe {
            let dev = *list.add(i);
            let s = if dev.is_null() {
                std::ptr::null()
            } else {
                get_name(dev)
            };
            if s.is_null() {
                continue;
            }
            CStr::from_ptr(s).to_string_lossy().into_owned()
        };
        devices.push(Device { name });
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once; no device pointer from
    // it is kept.
    unsafe { free_list(list) };
    if devices.is_empty() {
        return Err(Unavailable::NoDevice(
            "the library lists none (no RDMA NIC, and no rdma_rxe or siw soft device)".into(),
        ));
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_named() {
        let err = list_devices("libchorus-no-such-verbs.so.9").unwrap_err();
        assert!(matches!(err, Unavailable::NoLibrary(_)), "{err:?}");
        assert!(err.to_string().contains(LIBRARY), "{err}");
    }

    #[test]
    fn a_library_without_verbs_is_named() {
        // libc is always there and has no verbs.
        let err = list_devices("libc.so.6").unwrap_err();
        assert_eq!(err, Unavailable::NoSymbol("ibv_get_device_list"));
    }

    #[test]
    fn the_probe_answers_either_way() {
        // This machine has no RDMA device; a machine with one lists named devices.
        match probe() {
            Ok(devices) => assert!(devices.iter().all(|d| !d.name.is_empty())),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
        assert_eq!(probe(), probe(), "probed once");
    }
}
