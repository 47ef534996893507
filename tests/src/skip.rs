//! Why a privileged test does not run: not root, or a kernel older than the feature it needs.

/// True when running as root (privileged tests skip otherwise, saying so).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Print why a test is skipped and return true when it must skip (not root).
pub fn skip_unless_root(test: &str) -> bool {
    if is_root() {
        return false;
    }
    eprintln!("SKIP {test}: needs root (network namespaces, BPF)");
    true
}

/// The running kernel's `(major, minor)`, from `/proc/sys/kernel/osrelease`.
pub fn kernel_version() -> Option<(u32, u32)> {
    parse_kernel_release(&std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?)
}

/// `(major, minor)` of a release string such as `6.1.0-57-amd64` or `6.12.117+deb12-amd64`.
fn parse_kernel_release(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// Print why a test is skipped and return true when the kernel is older than `min`; `feature`
/// names what the test needs (e.g. `"bpf_sock_destroy"`). The line has the form
/// `SKIP <test>: <reason>`, which `cargo xtask vm-test` lists in its summary.
pub fn skip_unless_kernel(test: &str, min: (u32, u32), feature: &str) -> bool {
    match kernel_version() {
        Some(v) if v >= min => false,
        v => {
            let running = v.map_or_else(|| "unknown".to_string(), |(a, b)| format!("{a}.{b}"));
            eprintln!(
                "SKIP {test}: needs {feature} (kernel {}.{}+), running {running}",
                min.0, min.1
            );
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_releases() {
        assert_eq!(parse_kernel_release("6.1.0-57-amd64\n"), Some((6, 1)));
        assert_eq!(parse_kernel_release("6.12.117+deb12-amd64"), Some((6, 12)));
        assert_eq!(parse_kernel_release("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(parse_kernel_release("garbage"), None);
        assert!((6, 1) < (6, 5) && (6, 12) >= (6, 5));
    }
}
