//! A byte size on the command line of the small benchmark binaries (`src/bin`): a count with an
//! optional `K` or `M` suffix (powers of 1024). Included with `#[path]` by each of them.

/// `s` as bytes, or why not.
pub fn parse(s: &str) -> Result<usize, String> {
    let (num, mult) = match s.as_bytes().last() {
        Some(b'K' | b'k') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M' | b'm') => (&s[..s.len() - 1], 1 << 20),
        _ => (s, 1),
    };
    match num.parse::<usize>() {
        Ok(n) => n
            .checked_mul(mult)
            .ok_or_else(|| "size too large".to_string()),
        Err(_) => Err(format!("{s:?} is not a size")),
    }
}
