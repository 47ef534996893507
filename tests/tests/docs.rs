//! The documentation cannot rot silently: every relative link in the Markdown files (README,
//! CONTRIBUTING, CHANGELOG, `docs/`, `bench/README.md`, `deploy/`) resolves to a file or
//! directory, and a `#anchor` to a heading of the file it names; the README's headline figures
//! are the medians of the generated `bench/results/latest.md`; the TOML examples pass
//! `lb config check` ([`config_examples`]) and the JSON Schema the `lb` binary prints with
//! `lb config schema` ([`schema`]; build `lb` first); the `lb ...` command lines parse with
//! lb's own command line ([`commands`]); the metrics reference lists exactly the registered
//! families ([`metrics`]); the Grafana dashboard queries only exported series ([`grafana`]); the
//! configuration reference's defaults and a few facts stated in words agree with the code
//! ([`facts`]).
//! No root needed.
//!
//! `CHANGELOG.md` is history: its links are checked, its examples and command lines are not (a
//! renamed flag must not force rewriting what was true then).

// A test target's root resolves modules beside it, as a crate root does: these live in docs/.
#[path = "docs/commands.rs"]
mod commands;
#[path = "docs/config_examples.rs"]
mod config_examples;
#[path = "docs/facts.rs"]
mod facts;
#[path = "docs/grafana.rs"]
mod grafana;
#[path = "docs/metrics.rs"]
mod metrics;
#[path = "docs/schema.rs"]
mod schema;

use std::{
    collections::{BTreeMap, HashSet},
    fs,
    path::{Path, PathBuf},
};

/// The repository root (this crate is `tests/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// Files named `*.{ext}` under `dir`, recursively.
fn files_under(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, ext, out);
        } else if path.extension().is_some_and(|e| e == ext) {
            out.push(path);
        }
    }
}

/// `*.md` files under `dir`, recursively.
fn markdown_under(dir: &Path, out: &mut Vec<PathBuf>) {
    files_under(dir, "md", out);
}

/// The Markdown files whose links are checked: the documents and the dated results
/// (`bench/results/<date>.md`). The generated `bench/results/latest.md` is left out: it has no
/// links of its own to keep.
fn checked_files() -> Vec<PathBuf> {
    let root = root();
    let mut files: Vec<PathBuf> = [
        "README.md",
        "CONTRIBUTING.md",
        "CHANGELOG.md",
        "bench/README.md",
    ]
    .iter()
    .map(|f| root.join(f))
    .filter(|p| p.exists())
    .collect();
    markdown_under(&root.join("docs"), &mut files);
    markdown_under(&root.join("deploy"), &mut files);
    if let Ok(dir) = std::fs::read_dir(root.join("bench/results")) {
        files.extend(dir.filter_map(Result::ok).map(|e| e.path()).filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".md") && n.starts_with(|c: char| c.is_ascii_digit()))
        }));
    }
    files.sort();
    files
}

/// The Markdown files whose examples and command lines are checked: all but the history and
/// the dated results.
fn example_files() -> Vec<PathBuf> {
    checked_files()
        .into_iter()
        .filter(|f| !f.ends_with("CHANGELOG.md") && !f.starts_with(root().join("bench/results")))
        .collect()
}

/// `file` relative to the repository root, for messages.
fn shown(file: &Path) -> String {
    file.strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string()
}

/// What the HTML comment on the line before a fenced block says about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Marker {
    /// No marker: a whole example, checked as it stands.
    None,
    /// `<!-- fragment -->`: part of a config (only its TOML syntax is checked).
    Fragment,
    /// `<!-- invalid -->`: an example of what lb refuses (it must be refused).
    Invalid,
}

/// One fenced code block of a Markdown file.
#[derive(Debug)]
struct Fenced {
    /// The line number of its opening fence (1-based).
    line: usize,
    /// The info string after the fence: `toml`, `sh`, or empty.
    lang: String,
    /// The marker on the last non-blank line before the fence.
    marker: Marker,
    /// The lines between the fences.
    text: String,
}

/// The fenced code blocks of `text`.
fn fenced_blocks(text: &str) -> Vec<Fenced> {
    let mut out = Vec::new();
    let mut open: Option<Fenced> = None;
    let mut last_prose = "";
    for (i, line) in text.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (&mut open, fence) {
            (Some(_), Some(_)) => {
                out.extend(open.take());
                // A marker belongs to the one block after it.
                last_prose = "";
            }
            (Some(block), None) => {
                block.text.push_str(line);
                block.text.push('\n');
            }
            (None, Some(lang)) => {
                let marker = match last_prose.trim() {
                    "<!-- fragment -->" => Marker::Fragment,
                    "<!-- invalid -->" => Marker::Invalid,
                    _ => Marker::None,
                };
                open = Some(Fenced {
                    line: i + 1,
                    lang: lang.trim().to_string(),
                    marker,
                    text: String::new(),
                });
            }
            (None, None) if !line.trim().is_empty() => last_prose = line,
            (None, None) => {}
        }
    }
    out
}

/// The lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// `line` with its code spans blanked, so a `](x)` inside backticks is not a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
            out.push(' ');
        } else if in_code {
            out.push(' ');
        } else {
            out.push(c);
        }
    }
    out
}

/// Targets of the inline links `[text](target)` on one line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else {
            break;
        };
        let target = after[..end].trim();
        // `[text](target "title")`: the title is not part of the target.
        let target = target.split_whitespace().next().unwrap_or("");
        out.push(target.to_string());
        rest = &after[end..];
    }
    out
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor the headings of a Markdown file define (a repeated one gets `-1`, `-2`, ...).
fn anchors(text: &str) -> HashSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = HashSet::new();
    for (_, line) in prose_lines(text) {
        let trimmed = line.trim_start();
        if !trimmed.starts_with('#') {
            continue;
        }
        let heading = trimmed.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

#[test]
fn relative_links_resolve() {
    let files = checked_files();
    assert!(
        files.iter().any(|f| f.ends_with("README.md")),
        "no README.md found under {}",
        root().display()
    );
    let mut broken = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = fs::read_to_string(file).expect("readable Markdown");
        let dir = file.parent().expect("a file has a directory");
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.is_empty()
                    || target.contains("://")
                    || target.starts_with("mailto:")
                    || target.starts_with('<')
                {
                    continue;
                }
                checked += 1;
                let (path, anchor) = match target.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (target.as_str(), None),
                };
                let resolved = if path.is_empty() {
                    file.clone()
                } else {
                    dir.join(path)
                };
                let at = format!("{}:{n}: {target}", shown(file));
                if !resolved.exists() {
                    broken.push(format!("{at}: no such file"));
                    continue;
                }
                let Some(anchor) = anchor else {
                    continue;
                };
                if resolved.extension().is_none_or(|e| e != "md") {
                    broken.push(format!("{at}: an anchor into a file that is not Markdown"));
                    continue;
                }
                let target_text = fs::read_to_string(&resolved).expect("readable Markdown");
                if !anchors(&target_text).contains(anchor) {
                    broken.push(format!("{at}: no heading with that anchor"));
                }
            }
        }
    }
    assert!(checked > 0, "no relative link found: is the parser broken?");
    assert!(
        broken.is_empty(),
        "{} broken link(s):\n{}",
        broken.len(),
        broken.join("\n")
    );
}

/// The cells of a Markdown table row, trimmed, without the outer pipes.
fn cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_start_matches('|')
        .trim_end_matches('|')
        .split('|')
        .map(|c| c.trim().to_string())
        .collect()
}

/// The median of a `latest.md` cell: `**9.09** <sub>7.73–9.97</sub>` gives `9.09`; `n/a` stays.
fn median(cell: &str) -> String {
    match cell.strip_prefix("**") {
        Some(rest) => rest.split("**").next().unwrap_or("").to_string(),
        None => cell.to_string(),
    }
}

/// The first table of `text` after the line `heading` (or of the whole text when `None`): its
/// header and rows.
fn first_table(text: &str, heading: Option<&str>) -> (Vec<String>, Vec<Vec<String>>) {
    let start = heading.map_or(0, |h| {
        text.lines()
            .position(|l| l.trim() == h)
            .unwrap_or_else(|| panic!("no line {h:?}"))
    });
    let table: Vec<&str> = text
        .lines()
        .skip(start)
        .skip_while(|l| !l.trim_start().starts_with('|'))
        .take_while(|l| l.trim_start().starts_with('|'))
        .collect();
    assert!(table.len() > 2, "no table after {heading:?}");
    let header = cells(table[0]);
    let rows = table[2..].iter().map(|l| cells(l)).collect();
    (header, rows)
}

#[test]
fn readme_headline_figures_are_the_latest_bench_medians() {
    let root = root();
    let readme = fs::read_to_string(root.join("README.md")).expect("README.md");
    let latest =
        fs::read_to_string(root.join("bench/results/latest.md")).expect("bench/results/latest.md");
    let (r_header, r_rows) = first_table(&readme, Some("## Headline figures"));
    let (l_header, l_rows) = first_table(&latest, None);
    let column = |name: &str| {
        l_header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("latest.md has no column {name:?}"))
    };
    let mut wrong = Vec::new();
    for row in &r_rows {
        let label = &row[0];
        let Some(l_row) = l_rows.iter().find(|r| &r[0] == label) else {
            wrong.push(format!("{label:?}: no such row in bench/results/latest.md"));
            continue;
        };
        for (name, cell) in r_header.iter().zip(row).skip(1) {
            let want = median(&l_row[column(name)]);
            if *cell != want {
                wrong.push(format!(
                    "{label:?} / {name}: README {cell}, latest.md {want}"
                ));
            }
        }
    }
    assert!(
        !r_rows.is_empty(),
        "the README's headline table has no rows"
    );
    assert!(
        wrong.is_empty(),
        "the README's headline figures differ from bench/results/latest.md (copy them again):\n{}",
        wrong.join("\n")
    );
}

#[cfg(test)]
mod unit {
    use super::*;

    #[test]
    fn slugs_follow_github() {
        assert_eq!(slug(" `[balancer.health]`"), "balancerhealth");
        assert_eq!(slug(" What `lb status` shows"), "what-lb-status-shows");
        assert_eq!(
            slug(" Scheduling: rise, fall and intervals"),
            "scheduling-rise-fall-and-intervals"
        );
    }

    #[test]
    fn fenced_blocks_carry_their_marker() {
        let text = "a\n<!-- fragment -->\n\n```toml\nx = 1\n```\n```sh\nlb status\n```\n";
        let blocks = fenced_blocks(text);
        assert_eq!(blocks.len(), 2);
        assert_eq!(
            (blocks[0].line, blocks[0].lang.as_str(), blocks[0].marker),
            (4, "toml", Marker::Fragment)
        );
        assert_eq!(blocks[0].text, "x = 1\n");
        assert_eq!(
            (blocks[1].lang.as_str(), blocks[1].marker),
            ("sh", Marker::None)
        );
    }

    #[test]
    fn links_inside_code_spans_are_not_links() {
        assert_eq!(link_targets("see [a](b.md) and `[c](d.md)`"), vec!["b.md"]);
        assert_eq!(link_targets("[a](b.md#x \"title\")"), vec!["b.md#x"]);
    }
}
