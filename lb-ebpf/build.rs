//! Rebuild the kernel programs when bpf-linker changes (it is the linker of the BPF target).
use which::which;

fn main() {
    if let Ok(linker) = which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
