//! The module layering of `lb-user/src`: each module imports only from modules below it, so
//! the dependency arrows point one way (fuzz → cli → admin → daemon → discovery → proxy/health → metrics →
//! balancer → datapath → config/addr/net/kill → netns and the other leaves → lb-common). Read
//! from the sources, so a new import that points up fails here with the file and the module it
//! named.

use std::{collections::BTreeMap, path::Path};

/// Each module's layer; a module may use only modules of a lower layer.
const LAYERS: &[(&str, u32)] = &[
    ("addr", 0),
    ("singleflight", 0),
    ("errors", 0),
    ("files", 0),
    ("netns", 0),
    ("sock_diag", 0),
    ("http1", 0),
    ("server_state", 0),
    ("memory", 0),
    ("kill", 1),
    ("config", 1),
    ("handover", 1),
    ("net", 1),
    ("datapath", 2),
    ("balancer", 3),
    ("metrics", 4),
    ("proxy", 5),
    ("connect", 5),
    ("health", 5),
    ("discovery", 6),
    ("daemon", 7),
    ("admin", 8),
    ("cli", 9),
    // The fuzz targets' entry points reach every parser, the CLI's error message included.
    ("fuzz", 10),
];

fn layer(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|(_, l)| *l)
}

/// The first path segment of every `crate::` path in `text`, `use crate::{a, b::c}` included.
fn crate_refs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut item = String::new();
            let mut end = group.len();
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = j;
                    break;
                }
                if depth == 1 && c == ',' {
                    out.push(first_segment(&item));
                    item.clear();
                } else {
                    item.push(c);
                }
            }
            out.push(first_segment(&item));
            rest = &group[end..];
        } else {
            out.push(first_segment(rest));
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

fn first_segment(path: &str) -> String {
    path.trim()
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn imports_point_down() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let module = first_segment(&rel.to_string_lossy().replace(".rs", ""));
        if matches!(module.as_str(), "lib" | "main") {
            continue;
        }
        let own = layer(&module).unwrap_or_else(|| {
            panic!("module {module} ({}) has no layer in LAYERS", rel.display())
        });
        let text = std::fs::read_to_string(file).unwrap();
        for used in crate_refs(&text) {
            if used == module {
                continue;
            }
            *seen.entry(format!("{module} -> {used}")).or_default() += 1;
            match layer(&used) {
                Some(l) if l < own => {}
                Some(l) => wrong.push(format!(
                    "{}: {module} (layer {own}) uses {used} (layer {l})",
                    rel.display()
                )),
                None => wrong.push(format!("{}: uses unknown module {used}", rel.display())),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports pointing up or sideways:\n{}",
        wrong.join("\n")
    );
    // The scan saw real imports (a broken parser would pass vacuously).
    assert!(seen.contains_key("daemon -> balancer"), "{seen:?}");
    assert!(seen.contains_key("admin -> daemon"), "{seen:?}");
}

#[test]
fn parser_reads_grouped_imports() {
    let refs = crate_refs(
        "use crate::{\n    addr::ServerAddr,\n    balancer::{Balancer, Hold},\n};\nlet x = crate::net::connect;",
    );
    assert_eq!(refs, ["addr", "balancer", "net"]);
}
