//! Every TOML config a reader may copy passes `lb config check --skip-files` (the same
//! validation, in process): the ```` ```toml ```` blocks of the Markdown files, the `*.toml` files
//! under `deploy/`, and the `*.toml: |` entries of the ConfigMaps in `deploy/`'s YAML; and each
//! of them again with one commented-out key (`# token_file = "..."`) uncommented. A block after
//! `<!-- fragment -->` is part of a config and only has to be TOML; one after
//! `<!-- invalid -->` shows what lb refuses and must be refused.

use std::{fs, path::Path};

use lb::config::{Config, ConfigError, CredentialFiles};

use super::{Marker, example_files, fenced_blocks, files_under, root, shown};

/// One TOML example and where it is.
#[derive(Debug)]
pub(super) struct Example {
    /// `file:line`, for messages.
    pub(super) origin: String,
    /// What it has to pass.
    pub(super) marker: Marker,
    /// The TOML.
    pub(super) text: String,
}

/// The ```` ```toml ```` blocks of the Markdown files.
fn markdown_examples(out: &mut Vec<Example>) {
    for file in example_files() {
        let text = fs::read_to_string(&file).expect("readable Markdown");
        for block in fenced_blocks(&text) {
            if block.lang == "toml" {
                out.push(Example {
                    origin: format!("{}:{}", shown(&file), block.line),
                    marker: block.marker,
                    text: block.text,
                });
            }
        }
    }
}

/// The `NAME.toml: |` entries of a YAML file (a ConfigMap's data): the indented lines below
/// the key, their common indentation removed.
fn yaml_toml_entries(file: &Path, text: &str, out: &mut Vec<Example>) {
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let key = line.trim_start();
        if key.starts_with('#') || !key.ends_with(".toml: |") {
            continue;
        }
        let key_indent = line.len() - key.len();
        let body: Vec<&str> = lines[i + 1..]
            .iter()
            .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > key_indent)
            .copied()
            .collect();
        let indent = body
            .iter()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.len() - l.trim_start().len())
            .min()
            .unwrap_or(0);
        let text = body
            .iter()
            .map(|l| l.get(indent..).unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        out.push(Example {
            origin: format!("{}:{}", shown(file), i + 1),
            marker: Marker::None,
            text,
        });
    }
}

/// The configs under `deploy/`: whole `*.toml` files and the ConfigMaps' entries.
fn deploy_examples(out: &mut Vec<Example>) {
    let deploy = root().join("deploy");
    let mut files = Vec::new();
    files_under(&deploy, "toml", &mut files);
    files.sort();
    for file in files {
        out.push(Example {
            origin: shown(&file),
            marker: Marker::None,
            text: fs::read_to_string(&file).expect("readable TOML"),
        });
    }
    let mut yaml = Vec::new();
    files_under(&deploy, "yaml", &mut yaml);
    yaml.sort();
    for file in yaml {
        let text = fs::read_to_string(&file).expect("readable YAML");
        yaml_toml_entries(&file, &text, out);
    }
}

/// The variants of a whole example with one commented-out key (`# token_file = "..."`)
/// uncommented in place: an optional key shown in a comment is checked too.
fn uncommented(example: &Example) -> Vec<Example> {
    if example.marker != Marker::None {
        return Vec::new();
    }
    let lines: Vec<&str> = example.text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(key) = line.trim_start().strip_prefix('#').map(str::trim_start) else {
            continue;
        };
        let one_key =
            !key.starts_with('[') && toml::from_str::<toml::Table>(key).is_ok_and(|t| t.len() == 1);
        if !one_key {
            continue;
        }
        let mut text = lines.clone();
        text[i] = key;
        let shown_key = key.split(" #").next().unwrap_or(key).trim();
        out.push(Example {
            origin: format!("{} with `{shown_key}` uncommented", example.origin),
            marker: Marker::None,
            text: text.join("\n"),
        });
    }
    out
}

/// Every example: the Markdown blocks, the configs under `deploy/`, and the variants of the
/// whole ones with a commented-out key uncommented.
pub(super) fn all_examples() -> Vec<Example> {
    let mut examples = Vec::new();
    markdown_examples(&mut examples);
    deploy_examples(&mut examples);
    let variants: Vec<Example> = examples.iter().flat_map(uncommented).collect();
    examples.extend(variants);
    examples
}

/// What is wrong with `example`, if anything.
fn problem(example: &Example) -> Option<String> {
    let checked = Config::from_toml_with(&example.text, &example.origin, CredentialFiles::Skip);
    match (example.marker, checked) {
        (Marker::None, Ok(_)) | (Marker::Invalid, Err(_)) => None,
        (Marker::None, Err(e)) => {
            // A parse error names its origin already.
            let why = match e {
                ConfigError::Parse { message, .. } => message,
                e => e.to_string(),
            };
            Some(format!(
                "{}: lb config check --skip-files refuses it: {why}",
                example.origin
            ))
        }
        (Marker::Invalid, Ok(_)) => Some(format!(
            "{}: marked <!-- invalid --> but lb config check accepts it",
            example.origin
        )),
        (Marker::Fragment, _) => toml::from_str::<toml::Table>(&example.text)
            .err()
            .map(|e| format!("{}: a fragment that is not TOML: {e}", example.origin)),
    }
}

#[test]
fn toml_examples_pass_config_check() {
    let examples = all_examples();
    let whole = examples.iter().filter(|e| e.marker == Marker::None).count();
    assert!(
        examples.iter().any(|e| e.origin.starts_with("docs/"))
            && examples.iter().any(|e| e.origin.starts_with("deploy/")),
        "no TOML example found under docs/ or deploy/: is the parser broken? {examples:#?}"
    );
    let wrong: Vec<String> = examples.iter().filter_map(problem).collect();
    assert!(
        wrong.is_empty(),
        "{} of {} TOML example(s) ({whole} whole configs, commented keys uncommented \
         included) do not pass (mark a partial one <!-- fragment -->, see CONTRIBUTING.md):\n{}",
        wrong.len(),
        examples.len(),
        wrong.join("\n")
    );
}

#[test]
fn commented_keys_are_uncommented_one_at_a_time() {
    let example = Example {
        origin: "x.md:1".into(),
        marker: Marker::None,
        text: "# A comment.\n# [admin]\na = 1\n# b = \"c\"   # why\n#   lb status\n".into(),
    };
    let variants = uncommented(&example);
    assert_eq!(variants.len(), 1, "{variants:#?}");
    assert_eq!(variants[0].origin, "x.md:1 with `b = \"c\"` uncommented");
    assert_eq!(
        variants[0].text,
        "# A comment.\n# [admin]\na = 1\nb = \"c\"   # why\n#   lb status"
    );
}

#[test]
fn configmap_entries_are_read_from_yaml() {
    let yaml =
        "data:\n  lb.toml: |\n    [admin]\n    listen = \"127.0.0.1:9901\"\n\n    x = 1\nkind: X\n";
    let mut out = Vec::new();
    yaml_toml_entries(Path::new("d.yaml"), yaml, &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].origin, "d.yaml:2");
    assert_eq!(out[0].text, "[admin]\nlisten = \"127.0.0.1:9901\"\n\nx = 1");
}
