//! Samples, their summaries, and the outputs: a markdown table, a JSON file and SVG charts.

use std::{collections::BTreeMap, fmt::Write as _, path::Path};

use anyhow::{Context as _, Result};
use plotters::{coord::Shift, prelude::*};
use serde_json::{Value, json};

use super::contenders::Kind;

/// One measured quantity.
#[derive(Clone, Copy, Debug)]
pub struct MetricDef {
    /// Key in the JSON and in [`Results`].
    pub id: &'static str,
    /// Chart file (without `.svg`) the metric is drawn in.
    pub chart: &'static str,
    /// Row label; `{n}` stands for the number of idle connections.
    pub label: &'static str,
    /// Unit.
    pub unit: &'static str,
    /// Whether a larger value is better.
    pub higher_is_better: bool,
}

const fn m(
    id: &'static str,
    chart: &'static str,
    label: &'static str,
    unit: &'static str,
    higher_is_better: bool,
) -> MetricDef {
    MetricDef {
        id,
        chart,
        label,
        unit,
        higher_is_better,
    }
}

/// Every metric, in table order.
pub const METRICS: &[MetricDef] = &[
    m(
        "up1_gbit",
        "throughput",
        "1 bulk client→server, 1 conn",
        "Gbit/s",
        true,
    ),
    m(
        "down1_gbit",
        "throughput",
        "1 bulk server→client, 1 conn",
        "Gbit/s",
        true,
    ),
    m(
        "up8_gbit",
        "throughput",
        "1 bulk client→server, 8 conns",
        "Gbit/s",
        true,
    ),
    m(
        "down8_gbit",
        "throughput",
        "1 bulk server→client, 8 conns",
        "Gbit/s",
        true,
    ),
    m(
        "splice_share_up",
        "throughput",
        "1 bulk client→server, 1 conn: bytes spliced by the kernel",
        "%",
        true,
    ),
    m(
        "rr_p50_us",
        "latency",
        "2 64 B request/response p50",
        "µs",
        false,
    ),
    m(
        "rr_p99_us",
        "latency",
        "2 64 B request/response p99",
        "µs",
        false,
    ),
    m(
        "cps",
        "connections",
        "3 new connections (1 round trip each)",
        "conn/s",
        true,
    ),
    m(
        "cpu_proxy_up",
        "cpu",
        "4 proxy CPU, client→server",
        "CPU s/GiB",
        false,
    ),
    m(
        "cpu_proxy_down",
        "cpu",
        "4 proxy CPU, server→client",
        "CPU s/GiB",
        false,
    ),
    m(
        "cpu_client_up",
        "cpu",
        "4 client CPU, client→server",
        "CPU s/GiB",
        false,
    ),
    m(
        "cpu_client_down",
        "cpu",
        "4 client CPU, server→client",
        "CPU s/GiB",
        false,
    ),
    m(
        "softirq_up",
        "softirq",
        "4 softirq share, client→server",
        "% of CPU",
        false,
    ),
    m(
        "softirq_down",
        "softirq",
        "4 softirq share, server→client",
        "% of CPU",
        false,
    ),
    m(
        "idle_rss_mib",
        "memory",
        "5 proxy RSS, {n} idle conns",
        "MiB",
        false,
    ),
    m(
        "idle_kernel_mib",
        "memory",
        "5 kernel socket memory, {n} idle conns",
        "MiB",
        false,
    ),
    m(
        "idle_rss_delta_kib_per_conn",
        "memory-per-conn",
        "5 proxy RSS growth per idle conn",
        "KiB",
        false,
    ),
    m(
        "failover_ms",
        "failover",
        "6 failover: blackhole → all clients on backup",
        "ms",
        false,
    ),
    m(
        "newcomer_wait_ms",
        "failover",
        "6 failover: longest wait of a client connecting during the outage",
        "ms",
        false,
    ),
    m(
        "newcomers_unserved",
        "failover",
        "6 failover: clients connecting during the outage not served (of 30)",
        "clients",
        false,
    ),
    m(
        "kill_total_ms",
        "failover",
        "7 kill {n} conns: blackhole → all closed",
        "ms",
        false,
    ),
    m(
        "kill_after_down_ms",
        "failover",
        "7 kill {n} conns: marked down → all closed",
        "ms",
        false,
    ),
    m(
        "upgrade_lost",
        "upgrade",
        "8 upgrade (lb upgrade, HAProxy -x -sf): idle connections lost (of 1,000)",
        "conns",
        false,
    ),
    m(
        "upgrade_refused",
        "upgrade",
        "8 upgrade: connects of the loop refused or reset",
        "conns",
        false,
    ),
    m(
        "upgrade_longest_ms",
        "upgrade",
        "8 upgrade: longest connection of the loop (connect to close)",
        "ms",
        false,
    ),
    m(
        "crash_lost",
        "crash",
        "9 kill -9, restarted 2 s later: held connections lost (of 1,000)",
        "conns",
        false,
    ),
    m(
        "crash_unserved",
        "crash",
        "9 kill -9: dials of the loop not served (of 140, one every 50 ms)",
        "dials",
        false,
    ),
];

/// Median and range of a metric's samples.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    /// Median.
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    fn of(samples: &[f64]) -> Option<Summary> {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if !n.is_multiple_of(2) {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Summary {
            median,
            min: v[0],
            max: v[n - 1],
        })
    }
}

/// Samples per metric and contender.
#[derive(Debug, Default)]
pub struct Results {
    samples: BTreeMap<String, BTreeMap<Kind, Vec<f64>>>,
}

impl Results {
    /// Add one sample.
    pub fn add(&mut self, id: &str, kind: Kind, value: f64) {
        self.samples
            .entry(id.to_string())
            .or_default()
            .entry(kind)
            .or_default()
            .push(value);
    }

    /// Summary of `id` for `kind`, when it has samples.
    pub fn summary(&self, id: &str, kind: Kind) -> Option<Summary> {
        Summary::of(self.samples.get(id)?.get(&kind)?)
    }

    /// Contenders with at least one sample of any metric.
    pub fn kinds_seen(&self) -> Vec<Kind> {
        Kind::ALL
            .into_iter()
            .filter(|k| self.samples.values().any(|m| m.contains_key(k)))
            .collect()
    }

    /// Metrics a contender should have but has no sample of.
    pub fn missing(&self) -> Vec<String> {
        let mut out = Vec::new();
        for def in METRICS {
            for kind in Kind::ALL {
                let applies = match def.id {
                    id if id.starts_with("cpu_proxy") || id.starts_with("idle_rss") => {
                        kind.is_proxy()
                    }
                    "failover_ms" | "newcomer_wait_ms" | "newcomers_unserved" | "kill_total_ms"
                    | "kill_after_down_ms" => kind.kills_sessions(),
                    "splice_share_up" => kind == Kind::LbBpf,
                    id if id.starts_with("upgrade_") || id.starts_with("crash_") => {
                        matches!(kind, Kind::LbBpf | Kind::LbConnect | Kind::Haproxy)
                    }
                    _ => true,
                };
                if applies && self.summary(def.id, kind).is_none() {
                    out.push(format!("{} / {}", def.id, kind.name()));
                }
            }
        }
        out
    }
}

fn label(def: &MetricDef, idle_conns: u32) -> String {
    def.label.replace("{n}", &thousands(idle_conns))
}

fn thousands(n: u32) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Three significant digits, no exponent.
pub fn num(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn ratio(v: Option<Summary>, base: Option<Summary>) -> Option<f64> {
    let (v, b) = (v?, base?);
    (b.median.abs() > f64::EPSILON).then(|| v.median / b.median)
}

/// The markdown report: machine header, medians with ranges, and ratios.
pub fn markdown(res: &Results, machine: &Value, header: &str, idle_conns: u32) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{header}\n");
    let _ = writeln!(
        out,
        "Machine: {} × {} ({} cores), {} GiB RAM, kernel {}; {}; {}. Load average at start {}, at end {}. Run {} ({}).\n",
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or("?"),
        machine["cpus"],
        machine["mem_gib"],
        machine["kernel"].as_str().unwrap_or("?"),
        machine["haproxy"].as_str().unwrap_or("?"),
        machine["nginx"].as_str().unwrap_or("?"),
        machine["load_start"].as_str().unwrap_or("?"),
        machine["load_end"].as_str().unwrap_or("?"),
        machine["date"].as_str().unwrap_or("?"),
        machine["mode"].as_str().unwrap_or("?"),
    );
    let kinds = Kind::ALL;
    let _ = write!(out, "| scenario | unit |");
    for k in kinds {
        let _ = write!(out, " {} |", k.name());
    }
    let _ = write!(out, "\n| --- | --- |");
    for _ in kinds {
        let _ = write!(out, " ---: |");
    }
    out.push('\n');
    for def in METRICS {
        let _ = write!(out, "| {} | {} |", label(def, idle_conns), def.unit);
        for k in kinds {
            match res.summary(def.id, k) {
                Some(s) => {
                    let _ = write!(
                        out,
                        " **{}** <sub>{}–{}</sub> |",
                        num(s.median),
                        num(s.min),
                        num(s.max)
                    );
                }
                None => out.push_str(" n/a |"),
            }
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "\nMedian **bold**, min–max in small print. Ratios of medians, to direct / to HAProxy \
         (for throughput and conn/s above 1 is better, otherwise below 1 is better):\n"
    );
    let _ = write!(out, "| scenario |");
    for k in kinds.iter().skip(1) {
        let _ = write!(out, " {} |", k.name());
    }
    let _ = write!(out, "\n| --- |");
    for _ in kinds.iter().skip(1) {
        let _ = write!(out, " ---: |");
    }
    out.push('\n');
    for def in METRICS {
        let _ = write!(out, "| {} |", label(def, idle_conns));
        for &k in kinds.iter().skip(1) {
            let s = res.summary(def.id, k);
            let d = ratio(s, res.summary(def.id, Kind::Direct));
            let h = ratio(s, res.summary(def.id, Kind::Haproxy));
            let f = |r: Option<f64>| r.map_or_else(|| "–".to_string(), |r| format!("{r:.2}"));
            let _ = write!(out, " {} / {} |", f(d), f(h));
        }
        out.push('\n');
    }
    out
}

/// The JSON report: machine, options and every metric with samples, summaries and ratios.
pub fn json(res: &Results, machine: &Value, options: &Value, idle_conns: u32) -> Value {
    let metrics: Vec<Value> = METRICS
        .iter()
        .map(|def| {
            let per: serde_json::Map<String, Value> = Kind::ALL
                .into_iter()
                .filter_map(|k| {
                    let s = res.summary(def.id, k)?;
                    let samples = res.samples.get(def.id)?.get(&k)?.clone();
                    Some((
                        k.name().to_string(),
                        json!({
                            "median": s.median, "min": s.min, "max": s.max, "samples": samples,
                            "ratio_to_direct": ratio(Some(s), res.summary(def.id, Kind::Direct)),
                            "ratio_to_haproxy": ratio(Some(s), res.summary(def.id, Kind::Haproxy)),
                        }),
                    ))
                })
                .collect();
            json!({
                "id": def.id, "label": label(def, idle_conns), "unit": def.unit,
                "higher_is_better": def.higher_is_better, "results": per,
            })
        })
        .collect();
    json!({"machine": machine, "options": options, "metrics": metrics})
}

fn color(k: Kind) -> RGBColor {
    match k {
        Kind::Direct => RGBColor(140, 140, 140),
        Kind::LbBpf => RGBColor(31, 100, 180),
        Kind::LbConnect => RGBColor(120, 60, 170),
        Kind::LbUserspace => RGBColor(120, 170, 225),
        Kind::Haproxy => RGBColor(230, 125, 30),
        Kind::Nginx => RGBColor(60, 160, 70),
    }
}

fn panel(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    unit: &str,
    data: &[(Kind, Summary)],
) -> Result<()> {
    let ymax = data.iter().map(|(_, s)| s.max).fold(0.0f64, f64::max) * 1.15;
    let ymax = if ymax > 0.0 { ymax } else { 1.0 };
    let names: Vec<&str> = data.iter().map(|(k, _)| k.name()).collect();
    let n = data.len() as u32;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 15))
        .margin(8)
        .x_label_area_size(24)
        .y_label_area_size(52)
        .build_cartesian_2d((0u32..n).into_segmented(), 0f64..ymax)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .y_labels(6)
        .y_desc(unit)
        .x_labels(data.len())
        .x_label_formatter(&|x| match x {
            SegmentValue::CenterOf(i) => names.get(*i as usize).copied().unwrap_or("").to_string(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 11))
        .draw()?;
    for (i, (k, s)) in data.iter().enumerate() {
        let i = i as u32;
        let bar = Rectangle::new(
            [
                (SegmentValue::Exact(i), 0.0),
                (SegmentValue::Exact(i + 1), s.median),
            ],
            color(*k).filled(),
        );
        let mut bar = bar;
        bar.set_margin(0, 0, 12, 12);
        chart.draw_series(std::iter::once(bar))?;
        chart.draw_series(std::iter::once(PathElement::new(
            vec![
                (SegmentValue::CenterOf(i), s.min),
                (SegmentValue::CenterOf(i), s.max),
            ],
            BLACK.stroke_width(2),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            num(s.median),
            (SegmentValue::CenterOf(i), s.max + ymax * 0.02),
            ("sans-serif", 11).into_font().color(&BLACK),
        )))?;
    }
    Ok(())
}

/// One SVG per chart group under `dir`, a panel per metric (bar: median; line: min–max).
///
/// # Errors
/// Drawing or file failure.
pub fn charts(res: &Results, dir: &Path, idle_conns: u32) -> Result<Vec<String>> {
    let mut groups: Vec<&str> = METRICS.iter().map(|d| d.chart).collect();
    groups.dedup();
    let mut files = Vec::new();
    for group in groups {
        let defs: Vec<&MetricDef> = METRICS.iter().filter(|d| d.chart == group).collect();
        let cols = defs.len().min(2);
        let rows = defs.len().div_ceil(cols);
        let file = format!("{group}.svg");
        let path = dir.join(&file);
        let root =
            SVGBackend::new(&path, (460 * cols as u32, 280 * rows as u32)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((rows, cols));
        for (def, area) in defs.iter().zip(areas.iter()) {
            let data: Vec<(Kind, Summary)> = Kind::ALL
                .into_iter()
                .filter_map(|k| Some((k, res.summary(def.id, k)?)))
                .collect();
            if data.is_empty() {
                continue;
            }
            panel(area, &label(def, idle_conns), def.unit, &data)
                .with_context(|| format!("chart {}", def.id))?;
        }
        root.present()?;
        files.push(file);
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_median_and_range() {
        let s = Summary::of(&[5.0, 1.0, 3.0, f64::NAN]).expect("samples");
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 5.0));
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).expect("samples");
        assert_eq!(s.median, 2.5);
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn missing_lists_what_a_contender_lacks() {
        let mut r = Results::default();
        for def in METRICS {
            for k in Kind::ALL {
                r.add(def.id, k, 1.0);
            }
        }
        assert!(r.missing().is_empty());
        let mut r = Results::default();
        r.add("cps", Kind::Direct, 1.0);
        let missing = r.missing();
        assert!(missing.contains(&"cps / nginx".to_string()));
        assert!(!missing.contains(&"cpu_proxy_up / direct".to_string()));
        assert!(!missing.contains(&"failover_ms / nginx".to_string()));
        assert!(!missing.contains(&"splice_share_up / haproxy".to_string()));
        assert!(missing.contains(&"splice_share_up / lb bpf".to_string()));
        assert!(!missing.contains(&"splice_share_up / lb connect".to_string()));
        assert!(missing.contains(&"cpu_proxy_up / lb connect".to_string()));
        assert!(missing.contains(&"kill_after_down_ms / lb connect".to_string()));
        assert!(missing.contains(&"crash_lost / lb connect".to_string()));
        assert!(!missing.contains(&"crash_lost / nginx".to_string()));
    }

    #[test]
    fn formats() {
        assert_eq!(num(1234.4), "1234");
        assert_eq!(num(12.34), "12.3");
        assert_eq!(num(0.01234), "0.012");
        assert_eq!(thousands(10000), "10,000");
    }
}
