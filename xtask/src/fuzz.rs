//! `cargo xtask fuzz [--seconds N] [--target NAME]`: build the fuzz targets of `fuzz/` with the
//! pinned nightly (cargo-fuzz: optimized, debug assertions and overflow checks on, address
//! sanitizer) and run each for N seconds on its seed corpus; print each one's executions and
//! coverage, and fail naming the target and the input that crashed, hung or allocated without
//! bound.
//!
//! Each target runs on `fuzz/target/corpus/TARGET` (kept between runs; what libFuzzer finds is
//! added there) with the checked-in seeds of `fuzz/corpus/TARGET`. Findings go to
//! `fuzz/artifacts/TARGET/`, libFuzzer's log to `fuzz/target/logs/TARGET.log`.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::util::root;

/// One input's time limit (seconds): past it libFuzzer reports a hang. The entries bound their
/// own async work at 10 s (`lb::fuzz::LIMIT`) and panic, so this is a backstop.
const INPUT_TIMEOUT_S: u64 = 15;
/// The process's memory limit (MiB); the address sanitizer alone takes about 500 MiB.
const RSS_LIMIT_MB: u64 = 2048;
/// The largest single allocation (MiB) before libFuzzer reports it: no parser has a reason to
/// allocate more at once for an input of a few KiB.
const MALLOC_LIMIT_MB: u64 = 256;

/// What one target's run gave.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Outcome {
    /// The target's name.
    pub target: String,
    /// Inputs executed (`stat::number_of_executed_units`).
    pub execs: u64,
    /// Coverage points reached (libFuzzer's `cov:`, edges of the instrumented code).
    pub cov: u64,
    /// Features (libFuzzer's `ft:`: edges with hit counts, comparisons).
    pub ft: u64,
    /// Inputs in the corpus at the end (`corp:`).
    pub corpus: u64,
    /// Seconds run.
    pub seconds: f64,
    /// What libFuzzer found (`SUMMARY: libFuzzer: ...` or a Rust panic), if anything.
    pub finding: Option<String>,
    /// The input that shows it (`Test unit written to PATH`).
    pub artifact: Option<PathBuf>,
}

impl Outcome {
    /// The line `cargo xtask fuzz` prints for it.
    pub fn line(&self) -> String {
        let mut l = format!(
            "fuzz {}: {} execs in {:.0} s, cov {}, ft {}, corpus {}",
            self.target, self.execs, self.seconds, self.cov, self.ft, self.corpus
        );
        if let Some(f) = &self.finding {
            l.push_str(&format!(": FOUND {f}"));
        }
        if let Some(a) = &self.artifact {
            l.push_str(&format!(" (input: {})", a.display()));
        }
        l
    }
}

/// The fuzz crate's directory.
fn dir() -> PathBuf {
    root().join("fuzz")
}

/// The targets, as `fuzz/Cargo.toml` lists them (`[[bin]]` names), in its order.
///
/// # Errors
/// The manifest is missing or lists none.
pub fn targets() -> Result<Vec<String>> {
    let path = dir().join("Cargo.toml");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let doc: toml::Table = text
        .parse()
        .with_context(|| format!("cannot parse {}", path.display()))?;
    let names: Vec<String> = doc
        .get("bin")
        .and_then(toml::Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|b| b.get("name")?.as_str().map(str::to_string))
        .collect();
    ensure!(
        !names.is_empty(),
        "{} lists no [[bin]] target",
        path.display()
    );
    Ok(names)
}

/// Build every target with the pinned nightly (`cargo fuzz build`).
///
/// # Errors
/// The build failing, or the toolchain or cargo-fuzz missing (`cargo xtask setup`).
pub fn build() -> Result<()> {
    let toolchain = crate::setup::bpf_toolchain()?;
    let args = ["run", toolchain.as_str(), "cargo", "fuzz", "build"];
    eprintln!("xtask: (fuzz) rustup {}", args.join(" "));
    let status = Command::new("rustup")
        .args(args)
        .current_dir(dir())
        .status()
        .context("cannot run rustup")?;
    ensure!(status.success(), "cargo fuzz build failed ({status})");
    Ok(())
}

/// Run `target` for `seconds` on its corpus.
///
/// # Errors
/// The binary cannot be started or its log written (a finding is an [`Outcome`], not an
/// error).
pub fn run_one(target: &str, seconds: u64) -> Result<Outcome> {
    let fuzz = dir();
    let bin = fuzz
        .join("target/x86_64-unknown-linux-gnu/release")
        .join(target);
    let corpus = fuzz.join("target/corpus").join(target);
    let seeds = fuzz.join("corpus").join(target);
    let artifacts = fuzz.join("artifacts").join(target);
    let logs = fuzz.join("target/logs");
    for d in [&corpus, &artifacts, &logs] {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let log_path = logs.join(format!("{target}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot write {}", log_path.display()))?;
    let start = Instant::now();
    let status = Command::new(&bin)
        .arg(&corpus)
        .arg(&seeds)
        .arg(format!("-max_total_time={seconds}"))
        .arg(format!("-timeout={INPUT_TIMEOUT_S}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg(format!("-malloc_limit_mb={MALLOC_LIMIT_MB}"))
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg("-print_final_stats=1")
        .stdout(Stdio::null())
        .stderr(log)
        .status()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let text = std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut outcome = parse_log(target, &text);
    outcome.seconds = start.elapsed().as_secs_f64();
    if !status.success() && outcome.finding.is_none() {
        outcome.finding = Some(format!("exit {status}, see {}", log_path.display()));
    }
    Ok(outcome)
}

/// Run every target of `targets` for `seconds`, as many at a time as the machine has cores (a
/// libFuzzer process uses one); their results in the order of `targets`.
pub fn run_many(targets: &[String], seconds: u64) -> Vec<Result<Outcome>> {
    let jobs = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let mut results = Vec::with_capacity(targets.len());
    for batch in targets.chunks(jobs) {
        std::thread::scope(|scope| {
            let running: Vec<_> = batch
                .iter()
                .map(|t| scope.spawn(move || run_one(t, seconds)))
                .collect();
            for (t, handle) in batch.iter().zip(running) {
                results.push(
                    handle
                        .join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("the run of {t} panicked"))),
                );
            }
        });
    }
    results
}

/// The figures and the finding in libFuzzer's log.
fn parse_log(target: &str, log: &str) -> Outcome {
    let mut o = Outcome {
        target: target.to_string(),
        ..Outcome::default()
    };
    let field = |line: &str, name: &str| -> Option<u64> {
        let mut words = line.split_whitespace();
        words.find(|w| *w == name)?;
        let v = words.next()?;
        v.split('/').next()?.parse().ok()
    };
    for line in log.lines() {
        if line.starts_with('#') && line.contains("cov: ") {
            o.cov = field(line, "cov:").unwrap_or(o.cov);
            o.ft = field(line, "ft:").unwrap_or(o.ft);
            o.corpus = field(line, "corp:").unwrap_or(o.corpus);
            if let Some(n) = line
                .strip_prefix('#')
                .and_then(|l| l.split_whitespace().next())
                .and_then(|n| n.parse().ok())
            {
                o.execs = n;
            }
        } else if let Some(n) = line.strip_prefix("stat::number_of_executed_units: ") {
            o.execs = n.trim().parse().unwrap_or(o.execs);
        } else if let Some(s) = line.strip_prefix("SUMMARY: libFuzzer: ") {
            o.finding = Some(s.trim().to_string());
        } else if line.contains("panicked at ") && o.finding.is_none() {
            o.finding = Some(line.trim().to_string());
        } else if let Some(i) = line.find("Test unit written to ") {
            o.artifact = Some(PathBuf::from(
                line[i + "Test unit written to ".len()..].trim(),
            ));
        }
    }
    o
}

/// `cargo xtask fuzz`: build, then run `only` (every target when `None`) for `seconds` each, as
/// many at a time as there are cores.
///
/// # Errors
/// An unknown target, the build failing, or a target that found something (each named, with
/// its input).
pub fn run(seconds: u64, only: Option<&str>) -> Result<()> {
    let all = targets()?;
    check_seeds(&dir(), &all)?;
    let chosen: Vec<String> = match only {
        Some(t) if all.iter().any(|a| a == t) => vec![t.to_string()],
        Some(t) => bail!("no fuzz target {t:?}; there are {}", all.join(", ")),
        None => all,
    };
    build()?;
    let mut found = Vec::new();
    for outcome in run_many(&chosen, seconds) {
        let o = outcome?;
        eprintln!("xtask: {}", o.line());
        if o.finding.is_some() {
            found.push(o.line());
        }
    }
    if !found.is_empty() {
        bail!("fuzzing found:\n  {}", found.join("\n  "));
    }
    Ok(())
}

/// Every target has seeds in `fuzz/corpus/TARGET` (one without would start from nothing).
///
/// # Errors
/// Names a target without a seed.
pub fn check_seeds(fuzz: &Path, targets: &[String]) -> Result<()> {
    for t in targets {
        let d = fuzz.join("corpus").join(t);
        let n = std::fs::read_dir(&d).map(Iterator::count).unwrap_or(0);
        ensure!(n > 0, "fuzz target {t} has no seed in {}", d.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzer_figures_and_findings() {
        let done = "INFO: Seed: 1\n#2\tINITED cov: 10 ft: 11 corp: 2/30b exec/s: 0 rss: 400Mb\n\
                    #77842\tDONE   cov: 4861 ft: 12282 corp: 644/439Kb lim: 2699 exec/s: 8649 rss: 461Mb\n\
                    Done 77842 runs in 9 second(s)\nstat::number_of_executed_units: 77843\n";
        let o = parse_log("config", done);
        assert_eq!((o.execs, o.cov, o.ft, o.corpus), (77843, 4861, 12282, 644));
        assert_eq!(o.finding, None);
        let oom = "#1000\tNEW    cov: 300 ft: 400 corp: 20/1Kb lim: 4 exec/s: 0 rss: 400Mb\n\
                   ==640== ERROR: libFuzzer: out-of-memory (malloc(738197504))\n\
                   artifact_prefix='a/'; Test unit written to fuzz/artifacts/handover/oom-0281\n\
                   SUMMARY: libFuzzer: out-of-memory\n";
        let o = parse_log("handover", oom);
        assert_eq!((o.execs, o.cov), (1000, 300));
        assert_eq!(o.finding.as_deref(), Some("out-of-memory"));
        assert_eq!(
            o.artifact,
            Some(PathBuf::from("fuzz/artifacts/handover/oom-0281"))
        );
        assert!(
            o.line()
                .contains("FOUND out-of-memory (input: fuzz/artifacts/handover/oom-0281)")
        );
    }

    #[test]
    fn every_target_has_a_file_and_seeds() -> Result<()> {
        let targets = targets()?;
        for t in &targets {
            let src = dir().join("fuzz_targets").join(format!("{t}.rs"));
            assert!(src.is_file(), "{} missing", src.display());
        }
        check_seeds(&dir(), &targets)
    }
}
