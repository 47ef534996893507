//! File sizes of the product crates (`lb-user`, `lb-common`, `lb-ebpf`): a file over
//! [`LIMIT`] lines is a sign that a concern wants its own module, so no file may pass it. The
//! files that are over it today are listed in [`OVER`] with their length: one may shrink but
//! not grow, and one that gets under the limit must leave the list, so the list only ever gets
//! shorter. Inline test modules count like any other file.

use std::path::{Path, PathBuf};

/// Most lines a product file may have.
const LIMIT: usize = 600;

/// Files over [`LIMIT`] still waiting to be split, with the length they may not pass.
const OVER: &[(&str, usize)] = &[];

/// The repository root (this crate is `lb-user/`).
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("lb-user/ has a parent")
        .to_path_buf()
}

/// `*.rs` files under `dir`, recursively.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn product_files_stay_under_the_limit() {
    let root = root();
    let mut files = Vec::new();
    for krate in ["lb-user/src", "lb-common/src", "lb-ebpf/src"] {
        sources(&root.join(krate), &mut files);
    }
    assert!(files.len() > 50, "only {} source files found", files.len());
    let mut wrong = Vec::new();
    for file in &files {
        let name = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        let lines = std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .count();
        match OVER.iter().find(|(f, _)| *f == name) {
            Some((_, most)) if lines > *most => wrong.push(format!(
                "{name}: {lines} lines, more than the {most} it had (split it, do not grow it)"
            )),
            Some(_) if lines <= LIMIT => wrong.push(format!(
                "{name}: {lines} lines, under the limit now: remove it from OVER"
            )),
            None if lines > LIMIT => wrong.push(format!(
                "{name}: {lines} lines, over the limit of {LIMIT}: move a concern into a module \
                 of its own"
            )),
            _ => {}
        }
    }
    for (name, _) in OVER {
        if !root.join(name).exists() {
            wrong.push(format!("{name} is in OVER but does not exist"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
