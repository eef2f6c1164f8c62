//! What rank 0 prints: the nccl-tests table, JSON lines, or the peers harness's rows.
//!
//! Every function here returns text and has no side effect, so the formats are unit-tested.

use std::fmt::Write as _;
use std::time::Duration;

/// The figures of one timed run (one size, one of out-of-place / in-place).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measure {
    /// Timed iterations.
    pub iters: u64,
    /// Time of one operation in microseconds (after the `-a` reduction over ranks).
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (1 GB = 1e9 B).
    pub algbw: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
    /// Wrong elements over all ranks; `None` when not checked (`-c 0`).
    pub wrong: Option<u64>,
}

impl Measure {
    /// Figures for `bytes` moved in `seconds` per operation; `factor` converts algbw to busbw.
    pub fn new(bytes: u64, iters: u64, seconds: f64, factor: f64, wrong: Option<u64>) -> Measure {
        let algbw = if seconds > 0.0 {
            bytes as f64 / seconds / 1e9
        } else {
            0.0
        };
        Measure {
            iters,
            time_us: seconds * 1e6,
            algbw,
            busbw: algbw * factor,
            wrong,
        }
    }
}

/// Which of the two column groups a table shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    /// The out-of-place group.
    pub out_of_place: bool,
    /// The in-place group.
    pub in_place: bool,
}

/// The key columns of a row.
#[derive(Clone, Debug, PartialEq)]
pub struct RowKey<'a> {
    /// Bytes: per rank, or the whole p-rank buffer for the collectives that split it into
    /// blocks (as nccl-tests counts them).
    pub size: u64,
    /// Elements: of `size`, or of one rank's block where `size` is the whole buffer (as
    /// nccl-tests prints them).
    pub count: u64,
    /// Data type name.
    pub dtype: &'a str,
    /// Reduction name (`none` for collectives that do not reduce).
    pub op: &'a str,
    /// Root rank, or -1 when the collective has none.
    pub root: i64,
}

const GROUP_TITLES: &str = "     time   algbw   busbw #wrong";
const GROUP_UNITS: &str = "     (us)  (GB/s)  (GB/s)       ";

/// The three header lines above the rows: the group titles, column names and units.
pub fn table_header(groups: Groups) -> Vec<String> {
    let mut titles = format!("{:<52}", "#");
    let mut names = String::from("#       size         count      type   redop    root");
    let mut units = format!("{:<52}", "#        (B)    (elements)");
    for (on, title) in [
        (groups.out_of_place, "out-of-place"),
        (groups.in_place, "in-place"),
    ] {
        if on {
            let _ = write!(titles, "{title:^32}");
            names.push_str(GROUP_TITLES);
            units.push_str(GROUP_UNITS);
        }
    }
    vec![
        titles.trim_end().to_string(),
        names,
        units.trim_end().to_string(),
    ]
}

/// A time in microseconds in 7 columns: 2 decimals below 100 us, 1 below 10 ms, none above.
pub fn format_time_us(t: f64) -> String {
    if t >= 10_000.0 {
        format!("{t:7.0}")
    } else if t >= 100.0 {
        format!("{t:7.1}")
    } else {
        format!("{t:7.2}")
    }
}

/// One row of the table, with one [`Measure`] per column group the header shows.
pub fn table_row(key: &RowKey<'_>, groups: &[Measure]) -> String {
    let mut row = format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
        key.size, key.count, key.dtype, key.op, key.root
    );
    for m in groups {
        let wrong = m.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
        let _ = write!(
            row,
            "  {}  {:6.2}  {:6.2} {:>6}",
            format_time_us(m.time_us),
            m.algbw,
            m.busbw,
            wrong
        );
    }
    row
}

/// The footer: out-of-bounds count with OK/FAILED, and the average busbw over every printed
/// figure (both groups, like nccl-tests).
pub fn table_footer(total_wrong: Option<u64>, busbw: &[f64]) -> Vec<String> {
    let wrong = match total_wrong {
        Some(0) => "0 OK".to_string(),
        Some(n) => format!("{n} FAILED"),
        None => "N/A (not checked)".to_string(),
    };
    let avg = if busbw.is_empty() {
        0.0
    } else {
        busbw.iter().sum::<f64>() / busbw.len() as f64
    };
    vec![
        format!("# Out of bounds values : {wrong}"),
        format!("# Avg bus bandwidth    : {avg:.4}"),
        "#".to_string(),
    ]
}

/// One entry of a comparison at one size: the median over its rounds, and their spread.
#[derive(Clone, Debug, PartialEq)]
pub struct Compared {
    /// Figures of the median round (the mean of the two middle rounds for an even count).
    pub measure: Measure,
    /// The slowest round's time over the fastest's (1 when every round took as long).
    pub spread: f64,
    /// The per-call seconds of every round, in round order.
    pub rounds: Vec<f64>,
}

impl Compared {
    /// Figures from the per-call `seconds` of each round (at least one), `iters` timed
    /// iterations in all.
    pub fn new(
        bytes: u64,
        iters: u64,
        seconds: &[f64],
        factor: f64,
        wrong: Option<u64>,
    ) -> Compared {
        let t = sorted_finite(seconds.iter().copied());
        let median = median_of_sorted(&t);
        let spread = match (t.first(), t.last()) {
            (Some(&lo), Some(&hi)) if lo > 0.0 => hi / lo,
            _ => f64::NAN,
        };
        Compared {
            measure: Measure::new(bytes, iters, median, factor, wrong),
            spread,
            rounds: seconds.to_vec(),
        }
    }
}

/// The header of a comparison table.
pub fn compare_header() -> Vec<String> {
    vec![
        format!(
            "#{:>11}  {:>12}  {:>8}  {:>6}  {:<18}{}  spread",
            "size", "count", "type", "redop", "algorithm", GROUP_TITLES
        ),
        format!(
            "#{:>11}  {:>12}  {:>8}  {:>6}  {:<18}{}",
            "(B)", "(elements)", "", "", "", GROUP_UNITS
        )
        .trim_end()
        .to_string(),
    ]
}

/// The median over rounds of `best`'s time over `other`'s in the same round: `other`'s share
/// of `best`, paired by round (rounds run the entries close together in time, so slow phases
/// of the machine that last longer than a round cancel out).
fn paired_share(best: &Compared, other: &Compared) -> f64 {
    let ratios = best.rounds.iter().zip(&other.rounds).map(|(b, o)| b / o);
    median_of_sorted(&sorted_finite(ratios))
}

/// The finite values of `xs`, in increasing order.
fn sorted_finite(xs: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = xs.filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The median of sorted values (the mean of the middle two for an even count; NaN for none).
fn median_of_sorted(v: &[f64]) -> f64 {
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The rows of one size of a comparison, one per entry (`labels[i]`, `rows[i]`), then a
/// comment naming the fastest forced schedule (`forced[i]`) by median and every other
/// entry's share of it: the best's median time over the entry's, then the median of the
/// same ratio taken round by round, e.g.
/// `#  best schedule: ring; auto 97.2 % (paired by round 98.0 %)`.
pub fn compare_rows(
    key: &RowKey<'_>,
    labels: &[&str],
    rows: &[Compared],
    forced: &[bool],
) -> Vec<String> {
    let mut out: Vec<String> = labels
        .iter()
        .zip(rows)
        .map(|(label, c)| {
            let m = &c.measure;
            let wrong = m.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
            format!(
                "{:>12}  {:>12}  {:>8}  {:>6}  {:<18}  {}  {:6.2}  {:6.2} {:>6}  {:5.2}x",
                key.size,
                key.count,
                key.dtype,
                key.op,
                label,
                format_time_us(m.time_us),
                m.algbw,
                m.busbw,
                wrong,
                c.spread
            )
        })
        .collect();
    let best = rows
        .iter()
        .zip(forced)
        .enumerate()
        // A schedule whose result was wrong is no yardstick, however fast.
        .filter(|(_, (c, &f))| {
            f && c.measure.time_us.is_finite() && c.measure.wrong.unwrap_or(0) == 0
        })
        .min_by(|a, b| a.1 .0.measure.time_us.total_cmp(&b.1 .0.measure.time_us))
        .map(|(i, _)| i);
    if let Some(b) = best {
        let t_best = rows[b].measure.time_us;
        let mut line = format!("#  best schedule: {}", labels[b]);
        for (i, c) in rows.iter().enumerate() {
            if i != b && !forced[i] {
                if c.measure.wrong.unwrap_or(0) != 0 {
                    // Its result was wrong: a share of it would say nothing.
                    let _ = write!(line, "; {} wrong", labels[i]);
                    continue;
                }
                let share = 100.0 * t_best / c.measure.time_us;
                let _ = write!(line, "; {} {share:.1} %", labels[i]);
                let paired = paired_share(&rows[b], c);
                if paired.is_finite() {
                    let _ = write!(line, " (paired by round {:.1} %)", 100.0 * paired);
                }
            }
        }
        out.push(line);
    }
    out
}

/// The context of a JSON record.
#[derive(Clone, Debug, PartialEq)]
pub struct JsonContext<'a> {
    /// Collective name.
    pub collective: &'a str,
    /// Number of ranks.
    pub ranks: usize,
    /// Algorithm (`auto` when the selector chooses).
    pub algorithm: &'a str,
    /// Transport name.
    pub transport: &'a str,
    /// `--gap`, if any.
    pub gap: Option<Duration>,
}

/// `--gap` as a JSON value: milliseconds, or `null`.
pub fn json_gap(gap: Option<Duration>) -> String {
    gap.map_or_else(
        || "null".to_string(),
        |g| json_number(g.as_secs_f64() * 1e3, 3),
    )
}

/// Quote a string for JSON.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON number (`null` for NaN and infinities, which JSON cannot hold).
pub fn json_number(x: f64, decimals: usize) -> String {
    if x.is_finite() {
        format!("{x:.decimals$}")
    } else {
        "null".to_string()
    }
}

/// One JSON object (no trailing newline) for one size and placement.
pub fn json_line(ctx: &JsonContext<'_>, key: &RowKey<'_>, inplace: bool, m: &Measure) -> String {
    let wrong = m
        .wrong
        .map_or_else(|| "null".to_string(), |w| w.to_string());
    format!(
        "{{\"collective\":{},\"size\":{},\"count\":{},\"type\":{},\"op\":{},\"root\":{},\
         \"inplace\":{},\"ranks\":{},\"algorithm\":{},\"transport\":{},\"iters\":{},\
         \"gap_ms\":{},\"time_us\":{},\"algbw\":{},\"busbw\":{},\"wrong\":{}}}",
        json_string(ctx.collective),
        key.size,
        key.count,
        json_string(key.dtype),
        json_string(key.op),
        key.root,
        inplace,
        ctx.ranks,
        json_string(ctx.algorithm),
        json_string(ctx.transport),
        m.iters,
        json_gap(ctx.gap),
        json_number(m.time_us, 3),
        json_number(m.algbw, 6),
        json_number(m.busbw, 6),
        wrong
    )
}

/// The column header of the peers format (`bench_print_header` of bench_common.h).
pub fn peers_header() -> String {
    format!(
        "#{:>14} {:>12} {:>6} {:>6} {:>6} {:>12} {:>12} {:>12} {:>8}",
        "size(B)",
        "count",
        "type",
        "redop",
        "iters",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "#wrong"
    )
}

/// One row of the peers format (`bench_print_row` of bench_common.h); an unchecked run
/// prints 0 wrong, since summarize.py needs a number.
pub fn peers_row(key: &RowKey<'_>, m: &Measure) -> String {
    format!(
        "{:>15} {:>12} {:>6} {:>6} {:>6} {:>12.2} {:>12.4} {:>12.4} {:>8}",
        key.size,
        key.count,
        key.dtype,
        key.op,
        m.iters,
        m.time_us,
        m.algbw,
        m.busbw,
        m.wrong.unwrap_or(0)
    )
}

/// The comment after a peers row of an allreduce without `--algo`: which schedule the size
/// ran (`how`: `tuned`, `model` where tuning did not settle it, `direct` for the direct
/// shared-memory allreduce). Lines starting with `#` are skipped by the harness's parsers;
/// `benches/peers/allreduce_table.py` reads these.
pub fn schedule_comment(bytes: u64, schedule: &str, how: &str) -> String {
    format!("# schedule {bytes} {schedule} {how}")
}

/// Bytes in a human unit for the progress line (`8 B`, `32 KiB`, `1.5 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        let div = 1u64 << shift;
        if bytes >= div {
            return if bytes % div == 0 {
                format!("{} {unit}", bytes / div)
            } else {
                format!("{:.1} {unit}", bytes as f64 / div as f64)
            };
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: Groups = Groups {
        out_of_place: true,
        in_place: true,
    };

    fn key() -> RowKey<'static> {
        RowKey {
            size: 33_554_432,
            count: 8_388_608,
            dtype: "float",
            op: "sum",
            root: -1,
        }
    }

    #[test]
    fn header_matches_nccl_tests_columns() {
        let h = table_header(BOTH);
        assert_eq!(
            h[1],
            "#       size         count      type   redop    root     time   algbw   busbw \
             #wrong     time   algbw   busbw #wrong"
        );
        assert_eq!(
            h[2],
            concat!(
                "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)",
                "            (us)  (GB/s)  (GB/s)"
            )
        );
        assert!(h[0].starts_with('#'));
        assert_eq!(h[0].find("out-of-place"), Some(62));
        assert_eq!(h[0].find("in-place"), Some(96));
        let only_in = table_header(Groups {
            out_of_place: false,
            in_place: true,
        });
        assert!(!only_in[0].contains("out-of-place"));
        assert_eq!(only_in[1].matches("#wrong").count(), 1);
    }

    /// The median (odd and even round counts), the spread, and the best-schedule line.
    #[test]
    fn comparison_rows() {
        let c = Compared::new(1000, 15, &[3e-6, 1e-6, 2e-6], 1.5, Some(0));
        assert!((c.measure.time_us - 2.0).abs() < 1e-9);
        assert!((c.spread - 3.0).abs() < 1e-9);
        assert_eq!(c.measure.iters, 15);
        let even = Compared::new(1000, 4, &[4e-6, 1e-6, 2e-6, 3e-6], 1.0, None);
        assert!((even.measure.time_us - 2.5).abs() < 1e-9);
        let k = key();
        let rows = [
            Compared::new(1000, 5, &[2e-6], 1.5, Some(0)),
            Compared::new(1000, 5, &[1e-6], 1.5, Some(0)),
            Compared::new(1000, 5, &[1.25e-6], 1.5, Some(0)),
        ];
        let lines = compare_rows(&k, &["ring", "tree", "auto"], &rows, &[true, true, false]);
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[3],
            "#  best schedule: tree; auto 80.0 % (paired by round 80.0 %)"
        );
        let header = compare_header();
        assert_eq!(
            lines[0].len(),
            header[0].len(),
            "\n{}\n{}",
            header[0],
            lines[0]
        );
        assert!(lines[1].contains(" tree ") && lines[1].ends_with(" 1.00x"));
        // Paired by round: the median of the per-round ratios, not the ratio of medians.
        let a = Compared::new(1000, 3, &[1.0, 2.0, 3.0], 1.0, None);
        let b = Compared::new(1000, 3, &[3.0, 1.0, 1.9], 1.0, None);
        let auto = Compared::new(1000, 3, &[1.0, 2.0, 3.0], 1.0, None);
        // b has the best median (1.9); a/auto = 1, 1, 1; b/auto = 3, 0.5, 0.633: median 0.633
        let lines = compare_rows(&k, &["a", "b", "auto"], &[a, b, auto], &[true, true, false]);
        assert_eq!(
            lines[3],
            "#  best schedule: b; auto 95.0 % (paired by round 63.3 %)"
        );
        // without a forced entry there is no best line
        assert_eq!(compare_rows(&k, &["auto"], &rows[..1], &[false]).len(), 1);
        // auto's own result wrong: no share of it
        let bad_auto = Compared::new(1000, 5, &[1.25e-6], 1.5, Some(3));
        let lines = compare_rows(
            &k,
            &["ring", "tree", "auto"],
            &[rows[0].clone(), rows[1].clone(), bad_auto],
            &[true, true, false],
        );
        assert_eq!(lines[3], "#  best schedule: tree; auto wrong");
    }

    #[test]
    fn row_lines_up_with_header() {
        let m = Measure::new(33_554_432, 20, 0.0125, 1.0, Some(0));
        let row = table_row(&key(), &[m, m]);
        let header = &table_header(BOTH)[1];
        assert_eq!(row.len(), header.len());
        // every column ends where its header name ends
        let ends = |s: &str| -> Vec<usize> {
            let b = s.as_bytes();
            (1..b.len())
                .filter(|&i| b[i] != b' ' && !matches!(b.get(i + 1), Some(n) if *n != b' '))
                .collect()
        };
        assert_eq!(ends(header), ends(&row), "\n{header}\n{row}");
        assert!(row.contains("  12500  "));
        assert!(row.contains("    2.68    2.68      0"));
        let unchecked = table_row(&key(), &[Measure::new(8, 1, 1e-5, 1.0, None)]);
        assert!(unchecked.ends_with("   N/A"));
    }

    #[test]
    fn measure_and_time_format() {
        let m = Measure::new(2_000_000, 10, 0.001, 1.5, None);
        assert!((m.algbw - 2.0).abs() < 1e-12);
        assert!((m.busbw - 3.0).abs() < 1e-12);
        assert!((m.time_us - 1000.0).abs() < 1e-9);
        assert_eq!(format_time_us(10.594), "  10.59");
        assert_eq!(format_time_us(738.13), "  738.1");
        assert_eq!(format_time_us(289206.02), " 289206");
        assert_eq!(Measure::new(8, 1, 0.0, 1.0, None).algbw, 0.0);
    }

    #[test]
    fn footer() {
        assert_eq!(
            table_footer(Some(0), &[1.0, 2.0]),
            vec![
                "# Out of bounds values : 0 OK",
                "# Avg bus bandwidth    : 1.5000",
                "#"
            ]
        );
        assert_eq!(
            table_footer(Some(3), &[])[0],
            "# Out of bounds values : 3 FAILED"
        );
    }

    #[test]
    fn json_line_format() {
        let ctx = JsonContext {
            collective: "allreduce",
            ranks: 2,
            algorithm: "ring",
            transport: "tcp",
            gap: None,
        };
        let m = Measure::new(33_554_432, 20, 0.0125, 1.0, Some(0));
        assert_eq!(
            json_line(&ctx, &key(), false, &m),
            "{\"collective\":\"allreduce\",\"size\":33554432,\"count\":8388608,\
             \"type\":\"float\",\"op\":\"sum\",\"root\":-1,\"inplace\":false,\"ranks\":2,\
             \"algorithm\":\"ring\",\"transport\":\"tcp\",\"iters\":20,\"gap_ms\":null,\
             \"time_us\":12500.000,\
             \"algbw\":2.684355,\"busbw\":2.684355,\"wrong\":0}"
        );
        let m = Measure::new(8, 1, 0.0, 1.0, None);
        let line = json_line(&ctx, &key(), true, &m);
        assert!(line.contains("\"inplace\":true"));
        assert!(line.contains("\"wrong\":null"));
        let ctx = JsonContext {
            gap: Some(Duration::from_millis(30)),
            ..ctx
        };
        assert!(json_line(&ctx, &key(), true, &m).contains("\"gap_ms\":30.000,"));
        assert_eq!(json_string("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
        assert_eq!(json_number(f64::INFINITY, 3), "null");
    }

    #[test]
    fn schedule_comment_is_a_comment() {
        let line = schedule_comment(2 << 20, "ring", "tuned");
        assert_eq!(
            schedule_comment(8, "shm", "direct"),
            "# schedule 8 shm direct"
        );
        assert_eq!(line, "# schedule 2097152 ring tuned");
        assert!(line.starts_with('#'));
    }

    #[test]
    fn peers_format_matches_bench_common() {
        // Rows copied from peers/results (printed by bench_print_header / bench_print_row).
        assert_eq!(
            peers_header(),
            "#       size(B)        count   type  redop  iters     time(us)  algbw(GB/s)  \
             busbw(GB/s)   #wrong"
        );
        let m = Measure {
            iters: 64,
            time_us: 37150.08,
            algbw: 0.9032,
            busbw: 0.9032,
            wrong: Some(0),
        };
        assert_eq!(
            peers_row(&key(), &m),
            "       33554432      8388608  float    sum     64     37150.08       0.9032       \
             0.9032        0"
        );
        // summarize.py: 9 fields, the first all digits
        let row = peers_row(&key(), &m);
        let parts: Vec<_> = row.split_whitespace().collect();
        assert_eq!(parts.len(), 9);
        assert!(parts[0].bytes().all(|b| b.is_ascii_digit()));
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(8), "8 B");
        assert_eq!(human_bytes(32 * 1024), "32 KiB");
        assert_eq!(human_bytes(256 << 20), "256 MiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
        assert_eq!(human_bytes(2 << 30), "2 GiB");
    }
}
