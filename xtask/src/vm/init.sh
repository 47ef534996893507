#!/bin/sh
# Guest init for `cargo xtask vm-test` (busybox sh, PID 1 in an initramfs).
# Mounts what the tests need, loads the modules listed in /etc/lb-vm/modules, runs each test
# executable in /etc/lb-vm/tests one test at a time (the whole list /etc/lb-vm/repeat times,
# stopping after a round with a failure), prints one result line and powers off.
# iproute2 is always called by full path: busybox sh prefers its own `ip` applet.

export PATH=/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm /run /tmp /var /root
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
ln -sf /run /var/run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t bpf bpf /sys/fs/bpf
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null

# An RCU stall ends the guest at once with its stacks, as a soft lockup does through the
# command line (kernel.panic_on_rcu_stall, 4.18+); the run then stops within seconds of a hang.
echo 1 >/proc/sys/kernel/panic_on_rcu_stall 2>/dev/null ||
    echo "LB_VM: kernel.panic_on_rcu_stall is not settable"

/usr/sbin/ip link set lo up
# The kernel starts init with 1024 open files (hard 4096); lb with 1000 spliced pairs needs over
# 2000. Hosts and CI give 20000 or more; so does the guest.
ulimit -n 65536

while read -r m; do
    [ -n "$m" ] || continue
    insmod "/lib/modules/lb-vm/$m.ko" || echo "LB_VM: insmod $m failed"
done </etc/lb-vm/modules

# LB_BIN, LBT_BIN and the LB_VM_* variables the tests read.
. /etc/lb-vm/env
export LB_VM_KERNEL="$(uname -r)"
echo "LB_VM_BOOTED kernel=$LB_VM_KERNEL"

status=0
passed=0
failed=0
skipped=0
cd /tmp
rounds=$(cat /etc/lb-vm/repeat 2>/dev/null || echo 1)
round=1
while [ "$round" -le "$rounds" ] && [ "$status" = 0 ]; do
    [ "$rounds" = 1 ] || echo "LB_VM: round $round of $rounds at $(cut -d' ' -f1 /proc/uptime) s"
    while read -r t; do
        [ -n "$t" ] || continue
        # The guest's uptime tells which binary took the time when a run is cut by the timeout.
        echo "LB_VM: running $t at $(cut -d' ' -f1 /proc/uptime) s"
        # The exit status survives the pipe through a file; busybox sh has no pipefail here.
        # Extra arguments (a test name filter) from `cargo xtask vm-test -- ARGS`, split on spaces.
        # shellcheck disable=SC2046
        ( "$t" --test-threads=1 --nocapture $(cat /etc/lb-vm/args); echo $? >/tmp/rc ) 2>&1 |
            tee /tmp/test.log
        rc=$(cat /tmp/rc 2>/dev/null || echo 255)
        if [ "$rc" != 0 ]; then
            status=$rc
            # What lb and the kernel said, for a failure seen only in CI.
            for f in /tmp/lb-test-*.log; do
                [ -f "$f" ] || continue
                echo "LB_VM: state changes, warnings and errors in $f"
                grep -E 'state changed|WARN|ERROR' "$f" | tail -n 30
                echo "LB_VM: last lines of $f"
                tail -n 10 "$f"
            done
            echo "LB_VM: kernel log"
            dmesg | tail -n 30
        fi
        line=$(grep '^test result:' /tmp/test.log | tail -n 1)
        p=$(echo "$line" | sed -n 's/.* \([0-9][0-9]*\) passed.*/\1/p')
        f=$(echo "$line" | sed -n 's/.* \([0-9][0-9]*\) failed.*/\1/p')
        i=$(echo "$line" | sed -n 's/.* \([0-9][0-9]*\) ignored.*/\1/p')
        # A test that skips prints "SKIP <name>: <reason>" and returns Ok, which libtest counts as
        # passed: move those from passed to skipped.
        s=$(grep -o 'SKIP [A-Za-z0-9_:]*: ' /tmp/test.log | wc -l)
        passed=$((passed + ${p:-0} - s))
        failed=$((failed + ${f:-0}))
        skipped=$((skipped + ${i:-0} + s))
        if [ -z "$line" ] && [ "$status" = 0 ]; then
            status=254
        fi
    done </etc/lb-vm/tests
    round=$((round + 1))
done

echo "LB_VM: every binary ran at $(cut -d' ' -f1 /proc/uptime) s"
sync
echo "LB_VM_RESULT status=$status passed=$passed failed=$failed skipped=$skipped"
sync
poweroff -f
