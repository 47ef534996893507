//! The VM runner's own check: a guest whose kernel crashes while a test runs ends the run at
//! once, and `cargo xtask vm-test` names that test and prints the kernel's stacks. Only
//! `cargo xtask vm-test --crash` runs this target, in a guest it boots for nothing else; libtest
//! ignores its test everywhere else, so it never runs on a host.

use anyhow::{Result, ensure};

/// Crash the kernel through magic SysRq `c` (`panic("sysrq triggered crash")`), as a
/// deadlocked lb would end a guest booted with `softlockup_panic=1`.
#[test]
#[ignore = "crashes the kernel it runs on: only cargo xtask vm-test --crash runs it, in a guest"]
fn guest_crash_is_reported() -> Result<()> {
    // A second guard against running this on a host: the guest's init sets LB_VM.
    ensure!(
        std::env::var_os("LB_VM").is_some(),
        "refusing to crash a kernel outside a vm-test guest (LB_VM is not set)"
    );
    std::fs::write("/proc/sys/kernel/sysrq", "1")?;
    std::fs::write("/proc/sysrq-trigger", "c")?;
    // Not reached: the kernel panics inside the write, and the guest powers off.
    anyhow::bail!("the kernel did not crash on SysRq c")
}
