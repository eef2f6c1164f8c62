//! Gives the shared library its soname on Linux, so that programs linked with `-lchorus`
//! record `libchorus.so` (not the path it was built at) as the library they need.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libchorus.so");
    }
}
