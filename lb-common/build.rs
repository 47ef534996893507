//! Derives [`CONNECT_PIN_LAYOUT`](../src/pins.rs) from the source that defines what the pinned
//! connect-time maps hold: every line of `src/*.rs` that is not blank and not a comment, hashed
//! with 64-bit FNV-1a. A change to a type, a size, a constant or a name changes the number, so
//! a new lb rebuilds pins whose meaning it cannot be sure of; a change to a comment does not.
//! The hash is lb-common's own (`src/fnv.rs`).

#[path = "src/fnv.rs"]
mod fnv;

use std::{fs, path::Path};

fn main() {
    let src = Path::new("src");
    let mut files: Vec<_> = fs::read_dir(src)
        .expect("lb-common/src")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    let mut hash = fnv::FNV_OFFSET;
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
        let text = fs::read_to_string(file).expect("lb-common source");
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with("//") {
                continue;
            }
            hash = fnv::fnv1a(fnv::fnv1a(hash, line.as_bytes()), b"\n");
        }
    }
    println!("cargo:rerun-if-changed=src");
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("layout.rs");
    fs::write(
        out,
        format!(
            "/// Layout of the pinned connect-time objects, derived from lb-common's source by\n/// `build.rs` (see there): a new lb adopts pinned maps only of its own layout and\n/// definitions, and rebuilds the others.\npub const CONNECT_PIN_LAYOUT: u64 = {hash:#018x};\n"
        ),
    )
    .expect("write layout.rs");
}
