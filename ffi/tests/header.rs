//! The checked-in `include/chorus.h` must be what cbindgen generates from the current source.
//! Run with `CHORUS_BLESS=1` to rewrite it after changing the C API.

use std::path::Path;

#[test]
fn header_matches_the_source() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    for name in [
        "chorus_allreduce",
        "chorus_comm_init_env",
        "CHORUS_INTERNAL_ERROR = 8",
        "CHORUS_BFLOAT16 = 9",
        "typedef struct chorus_comm chorus_comm;",
    ] {
        assert!(generated.contains(name), "generated header lacks {name:?}");
    }
    let path = dir.join("include/chorus.h");
    if std::env::var_os("CHORUS_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write include/chorus.h");
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        current == generated,
        "ffi/include/chorus.h is out of date with ffi/src: regenerate it with \
         `CHORUS_BLESS=1 cargo test -p chorus-ffi --test header` and check it in"
    );
}
