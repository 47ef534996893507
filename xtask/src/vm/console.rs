//! Reading a guest's serial console: the result line, skips and failures the tests printed,
//! the test that was running when the guest stopped, and the kernel's own alarms (a panic, a
//! soft lockup, an RCU stall, a hung task, an oops) with the stacks it printed after them.
//!
//! The guests boot with the stacks on the console and every lockup ending the kernel at once
//! (see [`KERNEL_ARGS`]), so a kernel that hangs ends the run within about 20 s of the hang,
//! not at the guest's timeout.

use std::time::Duration;

use super::{Outcome, guest};
use crate::util;

/// Kernel command-line arguments of every guest after its console:
/// - `loglevel=7`: every message up to `KERN_INFO` on the console, so the stacks a lockup prints
///   (`KERN_DEFAULT`, and `KERN_INFO` for the tasks `sched_show_task` shows) are not filtered out
///   as `quiet` filters them;
/// - `softlockup_panic=1 softlockup_all_cpu_backtrace=1`: a CPU stuck in the kernel for
///   2 × `watchdog_thresh` (20 s) prints the stacks of every CPU and panics;
/// - `hung_task_panic=1`: a task blocked uninterruptibly for `hung_task_timeout_secs` (120 s in
///   Debian's kernels) panics;
/// - `oops=panic`: an oops ends the guest instead of leaving a half-dead kernel running tests;
/// - `rcupdate.rcu_cpu_stall_timeout=30`: an RCU stall is reported after 30 s, not 21 s, so a
///   CPU stuck in the kernel meets the soft lockup detector (20 s, every CPU's stack) first;
///   the RCU report of 5.10 shows no stack of the CPU it waits for;
/// - `panic=-1`: a panic reboots at once, which `-no-reboot` turns into qemu exiting.
///
/// An RCU stall panics too: the init sets `kernel.panic_on_rcu_stall` (kernel 4.18+), which the
/// command line cannot set on 5.10 (`sysctl.` arguments came in 5.8 but not for every key).
/// Source of each argument: the kernel's `Documentation/admin-guide/kernel-parameters.txt`.
pub const KERNEL_ARGS: &str = "panic=-1 loglevel=7 softlockup_panic=1 \
                               softlockup_all_cpu_backtrace=1 hung_task_panic=1 oops=panic \
                               rcupdate.rcu_cpu_stall_timeout=30";

/// Lines that start a kernel alarm: from the first one on, the console holds the kernel's
/// account of what went wrong (messages of `kernel/watchdog.c`, `kernel/rcu/tree_stall.h`,
/// `kernel/hung_task.c`, `kernel/panic.c`, `drivers/tty/sysrq.c`, `arch/x86/mm/fault.c`).
const ALARMS: &[&str] = &[
    "BUG: soft lockup",
    "rcu: INFO:",
    "INFO: rcu_",
    "self-detected stall",
    "blocked for more than",
    "sysrq: Trigger a crash",
    "Kernel panic",
    "BUG: kernel NULL pointer",
    "BUG: unable to handle",
    "general protection fault",
    "Oops:",
    "WARNING: CPU:",
    "watchdog: BUG",
];

/// At most this many lines of a kernel alarm are kept for the summary (the whole console is
/// echoed as it comes and written to the log file anyway).
const ALARM_LINES: usize = 400;

/// How the guest's qemu ended.
#[derive(Debug)]
pub enum End {
    /// qemu exited (power-off, or a panic with `-no-reboot`).
    Exited,
    /// qemu was killed at the timeout.
    TimedOut,
}

/// A guest's console, complete or cut by the timeout.
#[derive(Debug)]
pub struct GuestLog {
    /// Every line, `\r` trimmed, without the `[label]` the echo adds.
    pub lines: Vec<String>,
    /// How it ended.
    pub ended: End,
    /// The timeout it ran under.
    pub limit: Duration,
}

/// The kernel's alarm in `lines`: from the first line that starts one ([`ALARMS`]) to the end,
/// at most [`ALARM_LINES`] lines; empty when the kernel raised none.
pub fn kernel_alarm(lines: &[String]) -> Vec<String> {
    let Some(first) = lines
        .iter()
        .position(|l| ALARMS.iter().any(|a| l.contains(a)))
    else {
        return Vec::new();
    };
    lines[first..].iter().take(ALARM_LINES).cloned().collect()
}

/// Alarms of a kernel that locked up (rather than crashed or warned): a CPU stuck in the
/// kernel, a grace period that never ends, a task that never wakes.
const LOCKUPS: &[&str] = &[
    "soft lockup",
    "rcu: INFO:",
    "INFO: rcu_",
    "self-detected stall",
    "detected stalls",
    "blocked for more than",
];

/// The first line of `alarm` ([`kernel_alarm`]) when it is a lockup ([`LOCKUPS`]), trimmed.
pub fn lockup(alarm: &[String]) -> Option<String> {
    let first = alarm.first()?;
    LOCKUPS
        .iter()
        .any(|l| first.contains(l))
        .then(|| first.trim().to_string())
}

/// The test a libtest executable was running when the log stops: the name in its last
/// `test NAME ... ` line unless its verdict (`ok`, `FAILED`, `ignored`) follows, on that line
/// or, when a kernel message cut in after the `...` (the console is shared), on a later one.
pub fn running_test(lines: &[String]) -> Option<String> {
    let at = lines.iter().rposition(|l| l.starts_with("test "))?;
    let (name, rest) = lines[at].strip_prefix("test ")?.split_once(" ...")?;
    let verdict = |s: &str| {
        let s = s.trim();
        ["ok", "FAILED", "ignored"]
            .iter()
            .any(|v| s == *v || s.starts_with(&format!("{v},")) || s.starts_with(&format!("{v} ")))
    };
    let done =
        verdict(without_kernel(rest)) || lines[at + 1..].iter().any(|l| verdict(without_kernel(l)));
    (!done).then(|| name.to_string())
}

/// What a program printed on a console line before a kernel message cut in: the text before
/// the first printk timestamp (`[   37.901201] `), all of it when there is none.
fn without_kernel(line: &str) -> &str {
    let stamp = line.match_indices('[').find(|(at, _)| {
        let tail = &line[at + 1..];
        let Some((inside, _)) = tail.split_once(']') else {
            return false;
        };
        let t = inside.trim_start();
        !t.is_empty() && t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.')
    });
    match stamp {
        Some((at, _)) => &line[..at],
        None => line,
    }
}

/// A smoke run passes only when every test of [`guest::SMOKE`] passed: one that matched no
/// test (renamed) or skipped (a kernel without what it needs) proved nothing.
pub fn check_smoke(outcome: &mut Outcome) {
    let c = &outcome.counts;
    if outcome.error.is_none() && (c.passed as usize != guest::SMOKE.len() || c.skipped > 0) {
        outcome.error = Some(format!(
            "the smoke subset has {} tests: {} passed, {} skipped",
            guest::SMOKE.len(),
            c.passed,
            c.skipped
        ));
    }
}

/// Pull the result line, skips, failures and any kernel alarm out of the serial log.
pub fn read_log(log: &GuestLog, outcome: &mut Outcome) {
    read_tests(&log.lines, outcome);
    outcome.kernel_alarm = kernel_alarm(&log.lines);
    let Some(result) = log.lines.iter().find_map(|l| {
        let at = l.find("LB_VM_RESULT ")?;
        Some(l[at..].to_string())
    }) else {
        let why = match (&log.ended, outcome.kernel_alarm.first()) {
            (_, Some(alarm)) => format!(
                "no result line: the guest kernel stopped the run ({})",
                alarm.trim()
            ),
            (End::TimedOut, None) => format!(
                "no result line: the guest did not finish within {} s",
                log.limit.as_secs()
            ),
            (End::Exited, None) => {
                "no result line: the guest stopped before the tests finished".into()
            }
        };
        outcome.error = Some(format!("{why}{}", last_started(&log.lines)));
        return;
    };
    let field = |key: &str| -> Option<i64> {
        result.split_whitespace().find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k == key).then(|| v.parse().ok()).flatten()
        })
    };
    let count = |key: &str| field(key).and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
    outcome.status = field("status").unwrap_or(-1);
    outcome.counts.passed = count("passed");
    outcome.counts.failed = count("failed");
    outcome.counts.skipped = count("skipped");
    if outcome.status != 0 && outcome.counts.failed == 0 && outcome.failures.is_empty() {
        outcome.error = Some(format!(
            "the test executable exited with {} without a failed test (crash?)",
            outcome.status
        ));
    }
}

/// Skips and failed tests from libtest's lines.
fn read_tests(lines: &[String], outcome: &mut Outcome) {
    let mut in_failures = false;
    for line in lines {
        // libtest ends with "failures:" and the failed names indented by four spaces.
        if line == "failures:" {
            in_failures = true;
            continue;
        }
        if in_failures {
            match line.strip_prefix("    ") {
                Some(name) if !name.contains(' ') => {
                    if !outcome.failures.iter().any(|f| f == name) {
                        outcome.failures.push(name.to_string());
                    }
                }
                _ => in_failures = !line.is_empty() && line.starts_with("    "),
            }
        }
        if let Some(skip) = util::Skip::parse(line) {
            outcome.counts.skips.push(skip);
        }
        if let Some(rest) = line.strip_prefix("test ")
            && let Some((name, verdict)) = rest.split_once(" ... ")
        {
            if verdict.starts_with("FAILED") {
                if !outcome.failures.iter().any(|f| f == name) {
                    outcome.failures.push(name.to_string());
                }
            } else if verdict.starts_with("ignored") {
                outcome.counts.skips.push(util::Skip {
                    test: name.to_string(),
                    reason: verdict.to_string(),
                });
            }
        }
    }
}

/// Where a guest's log stops: the last test binary it started (with the guest's uptime then)
/// and the test running then (or the last test line), as `"; last binary ...; ..."` (empty
/// when neither is there).
fn last_started(lines: &[String]) -> String {
    let mut out = String::new();
    if let Some(bin) = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("LB_VM: running "))
    {
        out.push_str(&format!("; last binary started: {bin}"));
    }
    if let Some(test) = running_test(lines) {
        out.push_str(&format!("; test running: {test}"));
    } else if let Some(test) = lines.iter().rev().find(|l| l.starts_with("test ")) {
        out.push_str(&format!("; last test line: {test}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(lines: &[&str], ended: End) -> GuestLog {
        GuestLog {
            lines: lines.iter().map(|s| s.to_string()).collect(),
            ended,
            limit: Duration::from_secs(5),
        }
    }

    #[test]
    fn result_line_and_skips() {
        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "test a ... ok",
                    "test b ... SKIP b: needs bpf_sock_destroy (kernel 6.5+)",
                    "ok",
                    "test c ... ignored, slow",
                    "LB_VM_RESULT status=0 passed=1 failed=0 skipped=2",
                ],
                End::Exited,
            ),
            &mut o,
        );
        assert!(o.ok(), "{o:?}");
        assert_eq!((o.counts.passed, o.counts.skipped), (1, 2));
        let skips: Vec<String> = o.counts.skips.iter().map(ToString::to_string).collect();
        assert_eq!(
            skips,
            vec![
                "b: needs bpf_sock_destroy (kernel 6.5+)".to_string(),
                "c: ignored, slow".to_string()
            ]
        );
        assert!(o.kernel_alarm.is_empty());
    }

    #[test]
    fn failures_and_missing_marker() {
        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "test a ... FAILED",
                    "test b ... Error: client failed",
                    "FAILED",
                    "failures:",
                    "",
                    "failures:",
                    "    a",
                    "    b",
                    "",
                    "test result: FAILED. 2 passed; 2 failed; 0 ignored",
                    "LB_VM_RESULT status=101 passed=2 failed=2 skipped=0",
                ],
                End::Exited,
            ),
            &mut o,
        );
        assert!(!o.ok());
        assert_eq!(o.failures, vec!["a".to_string(), "b".to_string()]);
        assert_eq!(o.counts.failed, 2);

        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "LB_VM: running /opt/lb/tests/datapath at 12.5 s",
                    "test a ... ok",
                    "test b ... waiting",
                ],
                End::TimedOut,
            ),
            &mut o,
        );
        assert!(!o.ok());
        let e = o.error.as_deref().unwrap_or("");
        assert!(e.contains("within 5 s"), "{e}");
        assert!(
            e.contains("last binary started: /opt/lb/tests/datapath at 12.5 s")
                && e.contains("test running: b"),
            "{e}"
        );

        let mut o = Outcome::default();
        read_log(
            &log(
                &["LB_VM_RESULT status=101 passed=0 failed=0 skipped=0"],
                End::Exited,
            ),
            &mut o,
        );
        assert!(!o.ok(), "a crash without a failed test still fails");
    }

    /// The console of the 5.10 guest that hung (its first lines), and a sysrq crash.
    #[test]
    fn a_kernel_alarm_names_the_running_test_and_keeps_the_stacks() {
        let mut o = Outcome::default();
        read_log(
            &log(
                &[
                    "LB_VM: running /opt/lb/tests/connect_time_pins at 101.2 s",
                    "test connect_time_pins_adopt ... ok",
                    "test connect_time_pins_go_with_an_upgrade ... rcu: INFO: rcu_sched \
                     self-detected stall on CPU",
                    "watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [lb:8169]",
                    "Call Trace:",
                    " tcp_abort+0x1f/0x80",
                    "Kernel panic - not syncing: softlockup: hung tasks",
                ],
                End::Exited,
            ),
            &mut o,
        );
        assert!(!o.ok());
        let e = o.error.as_deref().unwrap_or("");
        assert!(
            e.contains("the guest kernel stopped the run")
                && e.contains("test running: connect_time_pins_go_with_an_upgrade"),
            "{e}"
        );
        assert_eq!(o.kernel_alarm.len(), 5, "{:?}", o.kernel_alarm);
        assert!(o.kernel_alarm.iter().any(|l| l.contains("tcp_abort")));
        assert!(lockup(&o.kernel_alarm).is_some_and(|l| l.contains("self-detected stall")));
        let crash = ["test a ... [    2.3] sysrq: Trigger a crash".to_string()];
        assert_eq!(lockup(&kernel_alarm(&crash)), None, "a crash is no lockup");

        assert_eq!(
            running_test(&["test a ... ok".to_string()]),
            None,
            "a test with its verdict is not running"
        );
        assert_eq!(
            running_test(&["test a ... ignored, slow".to_string()]),
            None
        );
        assert_eq!(
            running_test(&["test a ... [    2.341858] sysrq: Trigger a crash".to_string()]),
            Some("a".to_string())
        );
        // A kernel message after the `...`, the verdict on its own line later.
        let cut: Vec<String> = [
            "test a ... [   37.901201] IPv6: ADDRCONF(NETDEV_CHANGE): lbt338: link becomes ready",
            "some output of a",
            "ok",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(running_test(&cut), None);
        assert_eq!(running_test(&cut[..2]), Some("a".to_string()));
        assert_eq!(without_kernel("ok[    1.5] x"), "ok");
        assert_eq!(without_kernel("[a.b] ok"), "[a.b] ok");
    }

    #[test]
    fn a_smoke_run_needs_every_smoke_test_passed() {
        let n = guest::SMOKE.len();
        for (passed, skipped, ok) in [(n, 0, true), (n - 1, 0, false), (n - 1, 1, false)] {
            let mut o = Outcome::default();
            read_log(
                &log(
                    &[&format!(
                        "LB_VM_RESULT status=0 passed={passed} failed=0 skipped={skipped}"
                    )],
                    End::Exited,
                ),
                &mut o,
            );
            check_smoke(&mut o);
            assert_eq!(o.ok(), ok, "{passed} passed, {skipped} skipped: {o:?}");
        }
    }
}
