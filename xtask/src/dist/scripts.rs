//! The maintainer scripts both packages run. Installing or upgrading lb starts nothing (write
//! /etc/lb/lb.toml, then `systemctl enable --now lb`); an upgrade leaves a running lb running on
//! the old binary until `lb upgrade` hands over to the new one or the service restarts. Removing
//! the package (not upgrading it) stops and disables the unit and runs `lb cleanup`, which
//! detaches the connect-time programs a stopped lb left pinned: without the binary nothing
//! could remove them.

/// After the files are in place (install and upgrade): systemd rereads its units.
pub const AFTER_INSTALL: &str = "\
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload || true
fi
";

/// Before the files go, on removal only. `lb cleanup` is refused while a lb still holds the
/// pins (one started by hand, or a DaemonSet's on this node): those pins are that lb's, so the
/// removal goes on, saying so.
pub const BEFORE_REMOVE: &str = "\
if [ -d /run/systemd/system ]; then
    systemctl disable --now lb.service || true
fi
if [ -f /etc/lb/lb.toml ]; then
    set -- --config /etc/lb/lb.toml
else
    set --
fi
if ! /usr/bin/lb cleanup \"$@\"; then
    echo \"lb: lb cleanup did not finish (above); the package is removed anyway. Once no lb \
runs, removing the pin directory it names (rm -r) detaches what is left.\" >&2
fi
";

/// After the files are gone (removal and upgrade): systemd forgets the unit.
pub const AFTER_REMOVE: &str = AFTER_INSTALL;

/// A Debian maintainer script: `body` runs for the `actions` of `$1` (all when empty).
pub fn deb(actions: &[&str], body: &str) -> String {
    let mut s = String::from("#!/bin/sh\nset -e\n");
    if actions.is_empty() {
        s.push_str(body);
    } else {
        s.push_str(&format!("case \"$1\" in\n{})\n", actions.join("|")));
        for line in body.lines() {
            s.push_str(&format!("    {line}\n").replace("    \n", "\n"));
        }
        s.push_str("    ;;\nesac\n");
    }
    s.push_str("exit 0\n");
    s
}

/// An RPM scriptlet: `body` runs when `$1` (the count of lb packages left) is `when`, or
/// always.
pub fn rpm(when: Option<u32>, body: &str) -> String {
    match when {
        None => body.to_string(),
        Some(n) => {
            let mut s = format!("if [ \"$1\" -eq {n} ]; then\n");
            for line in body.lines() {
                s.push_str(&format!("    {line}\n").replace("    \n", "\n"));
            }
            s.push_str("fi\n");
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scripts are valid sh (`sh -n`), and the removal runs `lb cleanup` only for the
    /// removing actions.
    #[test]
    fn scripts_parse_and_clean_up_on_removal_only() -> anyhow::Result<()> {
        let prerm = deb(&["remove", "deconfigure"], BEFORE_REMOVE);
        assert!(prerm.contains("case \"$1\" in\nremove|deconfigure)\n"));
        assert!(prerm.contains("    if ! /usr/bin/lb cleanup \"$@\"; then\n"));
        let preun = rpm(Some(0), BEFORE_REMOVE);
        assert!(preun.starts_with("if [ \"$1\" -eq 0 ]; then\n"));
        for script in [prerm, preun, deb(&[], AFTER_INSTALL)] {
            let st = std::process::Command::new("sh")
                .args(["-n", "-c", &script])
                .status()?;
            assert!(st.success(), "sh -n refused:\n{script}");
        }
        Ok(())
    }
}
