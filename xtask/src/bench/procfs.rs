//! What the bench reads of the kernel's accounting: a process's CPU time and parent
//! (`/proc/PID/stat`), the machine's CPU time (`/proc/stat`), the kernel memory TCP sockets hold
//! (`/proc/net/sockstat`, `/proc/slabinfo`) and the CPU time of waited-for children.

/// Fields of /proc/PID/stat the bench reads.
#[derive(Clone, Copy, Debug)]
pub struct ProcStat {
    /// Parent pid.
    pub ppid: u32,
    /// utime + stime in seconds.
    pub cpu_secs: f64,
}

/// Read /proc/PID/stat.
pub fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(0) ppid(1) ... utime(11) stime(12).
    let ppid = f.get(1)?.parse().ok()?;
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ProcStat {
        ppid,
        cpu_secs: ticks / clock_ticks(),
    })
}

fn clock_ticks() -> f64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .map_or(100.0, |t| t as f64)
}

/// Jiffies from the `cpu` line of /proc/stat: (softirq, total).
pub fn cpu_jiffies() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return (0, 0);
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest fields are inside user/nice).
    let total = f.iter().take(8).sum();
    (f.get(6).copied().unwrap_or(0), total)
}

/// Kernel memory held by TCP sockets (bytes): buffer pages from /proc/net/sockstat
/// (`TCP: ... mem N`, N in pages) plus the socket objects themselves (the `TCP`, `TCPv6` and
/// `sock_inode_cache` slabs of /proc/slabinfo, active objects × object size). Idle sockets hold
/// almost no buffers, so the objects are most of it.
pub fn kernel_socket_bytes() -> u64 {
    let sockstat = std::fs::read_to_string("/proc/net/sockstat").unwrap_or_default();
    let pages = sockstat
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let i = f.iter().position(|w| *w == "mem")?;
            f.get(i + 1)?.parse::<u64>().ok()
        })
        .unwrap_or(0);
    let slabinfo = std::fs::read_to_string("/proc/slabinfo").unwrap_or_default();
    let objects: u64 = ["TCP", "TCPv6", "sock_inode_cache"]
        .iter()
        .filter_map(|name| slab(&slabinfo, name))
        .map(|(active, size)| active * size)
        .sum();
    pages * 4096 + objects
}

/// Memory the kernel charges to the TCP sockets of the host's network namespace and of
/// `namespaces` (bytes): for each socket, what sock_diag reports as its receive queue, write
/// queue, forward allocation and option memory (`ss -tanm`'s `skmem` `r`, `w`, `f` and `o`),
/// plus the socket object (the `TCP` slab's object size). Exact where [`kernel_socket_bytes`] is
/// not: the kernel adds to the `mem` of /proc/net/sockstat only in per-CPU batches of up to
/// `net.core.mem_pcpu_rsv` pages (256, 1 MiB, by default), so that figure stood at 262 pages
/// with one TCP socket open on an idle machine.
///
/// # Errors
/// `ss` (or `ip netns exec`) fails.
pub fn tcp_socket_memory(namespaces: &[&str]) -> anyhow::Result<u64> {
    let slabinfo = std::fs::read_to_string("/proc/slabinfo").unwrap_or_default();
    let object = slab(&slabinfo, "TCP").map_or(0, |(_, size)| size);
    let mut total = 0;
    let mut outputs = vec![lb_tests::sh("ss", &["-tanmH"])?];
    for ns in namespaces {
        outputs.push(lb_tests::sh("ip", &["netns", "exec", ns, "ss", "-tanmH"])?);
    }
    for out in outputs {
        for skmem in out.split("skmem:(").skip(1) {
            let fields = skmem.split(')').next().unwrap_or_default();
            let charged: u64 = fields
                .split(',')
                .filter_map(|f| {
                    let digits = f.find(|c: char| c.is_ascii_digit())?;
                    let (name, value) = f.split_at(digits);
                    matches!(name, "r" | "w" | "f" | "o").then(|| value.parse::<u64>().ok())?
                })
                .sum();
            total += charged + object;
        }
    }
    Ok(total)
}

/// Slab cache `name` in `slabinfo` (the text of /proc/slabinfo): its active objects and their
/// size (bytes).
fn slab(slabinfo: &str, name: &str) -> Option<(u64, u64)> {
    slabinfo.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        if f.first() != Some(&name) {
            return None;
        }
        Some((f.get(1)?.parse().ok()?, f.get(3)?.parse().ok()?))
    })
}

/// CPU seconds used by waited-for children of this process so far.
pub fn children_cpu_secs() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_CHILDREN).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 / 1e6;
        t(u.user_time()) + t(u.system_time())
    })
}
