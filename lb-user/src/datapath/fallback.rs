//! Why `datapath.mode = "auto"` runs the userspace copy path: a short, fixed label for each kind
//! of [`DatapathError`] that stops the kernel data path from loading, for
//! `lb_datapath_fallback_info{reason}` (the full error chain stays in the log and in `/status`).

use super::DatapathError;

/// The kind of reason the kernel data path is off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// lb lacks capabilities the programs need.
    NotPrivileged,
    /// No usable cgroup v2 directory to attach to.
    Cgroup,
    /// The kernel lacks a program type, map type, helper or BTF the programs need.
    KernelFeature,
    /// The kernel refused to load or attach a program, or a map operation failed.
    LoadFailed,
    /// Anything else (the error names it).
    Other,
}

impl FallbackReason {
    /// Every reason, in label order of the docs.
    pub const ALL: [FallbackReason; 5] = [
        FallbackReason::NotPrivileged,
        FallbackReason::Cgroup,
        FallbackReason::KernelFeature,
        FallbackReason::LoadFailed,
        FallbackReason::Other,
    ];

    /// The label value: `not_privileged`, `cgroup`, `kernel_feature`, `load_failed`, `other`.
    pub fn label(self) -> &'static str {
        match self {
            FallbackReason::NotPrivileged => "not_privileged",
            FallbackReason::Cgroup => "cgroup",
            FallbackReason::KernelFeature => "kernel_feature",
            FallbackReason::LoadFailed => "load_failed",
            FallbackReason::Other => "other",
        }
    }
}

impl std::fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl DatapathError {
    /// The kind of this error, as a reason the kernel data path is off.
    pub fn fallback_reason(&self) -> FallbackReason {
        match self {
            DatapathError::NotPrivileged { .. } => FallbackReason::NotPrivileged,
            DatapathError::NoCgroup2
            | DatapathError::OpenCgroup { .. }
            | DatapathError::NotCgroup2(_) => FallbackReason::Cgroup,
            DatapathError::MissingFeature(_)
            | DatapathError::BlockingHelper { .. }
            | DatapathError::Btf(_)
            | DatapathError::NetnsCookie(_)
            | DatapathError::NothingToRun { .. } => FallbackReason::KernelFeature,
            DatapathError::Load(_)
            | DatapathError::Missing(_)
            | DatapathError::Program { .. }
            | DatapathError::Link { .. }
            | DatapathError::Swap { .. }
            | DatapathError::Map { .. } => FallbackReason::LoadFailed,
            DatapathError::NotHostPid
            | DatapathError::NotRequested
            | DatapathError::Dup { .. }
            | DatapathError::TableSlotBusy { .. }
            | DatapathError::Pins(_) => FallbackReason::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_their_reason() {
        let cases = [
            (
                DatapathError::NotPrivileged {
                    missing: "CAP_BPF".into(),
                },
                "not_privileged",
            ),
            (DatapathError::NoCgroup2, "cgroup"),
            (DatapathError::NotCgroup2("/x".into()), "cgroup"),
            (DatapathError::MissingFeature("sockhash"), "kernel_feature"),
            (DatapathError::Missing("lb_sockops"), "load_failed"),
            (DatapathError::NotRequested, "other"),
        ];
        for (e, want) in cases {
            assert_eq!(e.fallback_reason().label(), want, "{e}");
        }
    }
}
