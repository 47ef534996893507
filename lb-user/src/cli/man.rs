//! The man pages' sections beyond what clap_mangen makes from the command line: CONFIGURATION
//! (the keys, read from the reference tables of docs/configuration.md, so page and doc list the
//! same keys), EXIT STATUS, FILES and EXAMPLES.

use std::io::Write;

/// The configuration guide the CONFIGURATION section is made from.
const CONFIGURATION_MD: &str = include_str!("../../../docs/configuration.md");

/// Write one man page for `cmd` (named `lb` or `lb-SUBCOMMAND`): clap_mangen's page with this
/// page's own sections before its VERSION.
///
/// # Errors
/// The writer's.
pub fn render(cmd: clap::Command, w: &mut dyn Write) -> std::io::Result<()> {
    let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut page)?;
    let page = String::from_utf8_lossy(&page);
    let at = page.find("\n.SH VERSION").map_or(page.len(), |i| i + 1);
    w.write_all(page[..at].as_bytes())?;
    w.write_all(sections(&name).as_bytes())?;
    w.write_all(page[at..].as_bytes())
}

/// Write `lb.1` and one page per subcommand (`lb-config-check.1`, ...) into `dir`.
///
/// # Errors
/// Creating or writing a file.
pub fn generate_to(cmd: clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    write_tree(cmd, dir)
}

fn write_tree(cmd: clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned() {
        write_tree(sub, dir)?;
    }
    let name = cmd.get_display_name().unwrap_or(cmd.get_name()).to_string();
    let mut file = std::fs::File::create(dir.join(format!("{name}.1")))?;
    render(cmd, &mut file)?;
    file.flush()
}

/// The extra sections of page `name`, in roff.
fn sections(name: &str) -> String {
    let mut out = String::new();
    if matches!(name, "lb" | "lb-run" | "lb-config-check") {
        out.push_str(&configuration());
    }
    out.push_str(EXIT_STATUS_HEAD);
    out.push_str(match name {
        "lb-run" => EXIT_RUN,
        "lb-config-check" => EXIT_CONFIG_CHECK,
        "lb-config-schema" => EXIT_CONFIG_SCHEMA,
        "lb-check" => EXIT_CHECK,
        _ => EXIT_ALL,
    });
    if matches!(name, "lb" | "lb-run" | "lb-config-check" | "lb-cleanup") {
        out.push_str(FILES);
    }
    if matches!(
        name,
        "lb" | "lb-run" | "lb-config-check" | "lb-config-schema"
    ) {
        out.push_str(EXAMPLES);
    }
    out.push_str(SEE_ALSO);
    out
}

/// The CONFIGURATION section: every table of the reference and its keys.
fn configuration() -> String {
    let mut out = String::from(
        ".SH CONFIGURATION\n\
         lb reads one TOML file (\\fB\\-\\-config\\fR, \\fBLB_CONFIG\\fR); flags and \\fBLB_*\\fR \
         variables win over it. Without a file, \\fB\\-\\-listen\\fR and \\fB\\-\\-server\\fR make \
         one balancer named \\fBdefault\\fR. The keys, by table (defaults and meanings in \
         docs/configuration.md):\n",
    );
    for (table, keys) in reference_keys(CONFIGURATION_MD) {
        out.push_str(&format!(
            ".TP\n\\fB{}\\fR\n{}\n",
            roff_escape(&table),
            roff_escape(&keys.join(", "))
        ));
    }
    out
}

/// `(table, keys)` from the `### ` headings and table rows of the `## Reference` part of the
/// configuration guide; a table whose first column is `kind` (discovery) gives one entry per
/// kind.
fn reference_keys(md: &str) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    let mut in_reference = false;
    let mut heading = String::new();
    let mut by_kind = false;
    for line in md.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            in_reference = h == "Reference";
        } else if !in_reference {
        } else if let Some(h) = line.strip_prefix("### ") {
            heading = h.replace('`', "");
        } else if line.starts_with("| kind |") {
            by_kind = true;
        } else if line.starts_with("| key |") {
            by_kind = false;
        } else if let Some(row) = line.strip_prefix("| `") {
            let cells: Vec<&str> = row.split(" | ").map(|c| c.trim_matches('`')).collect();
            let (table, key) = if by_kind && cells.len() > 1 {
                (format!("{heading}: kind = \"{}\"", cells[0]), cells[1])
            } else {
                (heading.clone(), cells[0])
            };
            match out.last_mut() {
                Some((t, keys)) if *t == table => keys.push(key.to_string()),
                _ => out.push((table, vec![key.to_string()])),
            }
        }
    }
    out
}

/// Text made safe for a roff line: backslashes and hyphens escaped, no leading dot.
fn roff_escape(s: &str) -> String {
    let s = s.replace('\\', "\\e").replace('-', "\\-");
    if s.starts_with('.') || s.starts_with('\'') {
        format!("\\&{s}")
    } else {
        s
    }
}

const EXIT_STATUS_HEAD: &str = ".SH \"EXIT STATUS\"\n";

const EXIT_ALL: &str = "\
.TP\n\\fB0\\fR\nSuccess (\\fBlb check\\fR: every balancer healthy).\n\
.TP\n\\fB1\\fR\nFailure: the daemon unreachable, a check unhealthy, an upgrade refused (the old \
lb serving on), the daemon unable to start its data path, a listener or its admin API.\n\
.TP\n\\fB2\\fR\nInvalid usage or configuration: a bad flag, a configuration \\fBlb config \
check\\fR refuses, an address already in use, a request the daemon refused as invalid (HTTP \
400, 404, 409, 413) or an unusable token file.\n";

const EXIT_RUN: &str = "\
.TP\n\\fB0\\fR\nA clean shutdown (SIGTERM, SIGINT) or a hand\\-over to a new lb (\\fBlb \
upgrade\\fR).\n\
.TP\n\\fB1\\fR\nThe data path, a listener or the admin API cannot start; a supervisor may \
restart it.\n\
.TP\n\\fB2\\fR\nAn invalid configuration, or one of its listeners or its admin address already \
in use: starting again would fail the same way (the systemd unit does not restart on 2).\n";

const EXIT_CONFIG_CHECK: &str = "\
.TP\n\\fB0\\fR\nThe file is valid (warnings, if any, are printed to standard error).\n\
.TP\n\\fB2\\fR\nThe file cannot be read, does not parse, or a value is refused: the message \
names the file, the key, the value and the reason.\n";

const EXIT_CONFIG_SCHEMA: &str = "\
.TP\n\\fB0\\fR\nThe schema was printed.\n\
.TP\n\\fB1\\fR\nStandard output could not take it.\n";

const EXIT_CHECK: &str = "\
.TP\n\\fB0\\fR\nHealthy.\n\
.TP\n\\fB1\\fR\nUnhealthy, or the daemon unreachable.\n\
.TP\n\\fB2\\fR\nA request the daemon refused as invalid (an unknown balancer).\n";

const FILES: &str = "\
.SH FILES\n\
.TP\n\\fI/etc/lb/lb.toml\\fR\nThe configuration file of the shipped systemd unit.\n\
.TP\n\\fI/var/lib/lb/\\fR\nState files (\\fBstate_file\\fR), mode 0600.\n\
.TP\n\\fI/run/lb/\\fR\nRuntime files, such as an admin \\fBunix_socket\\fR.\n\
.TP\n\\fI/sys/fs/bpf/lb/default\\fR\nThe connect\\-time pins (\\fB[datapath] pin_dir\\fR), \
removed by \\fBlb cleanup\\fR.\n";

const EXAMPLES: &str = "\
.SH EXAMPLES\n\
.nf\n\
lb config check /etc/lb/lb.toml\n\
lb config schema > lb.schema.json\n\
lb run \\-\\-config /etc/lb/lb.toml\n\
lb run \\-\\-listen 127.0.0.1:6444 \\-\\-server 198.18.0.2:6443 \\-\\-server 198.18.0.3:6443\n\
lb status\n\
lb servers drain \\-b default 198.18.0.3:6443\n\
lb check \\-\\-timeout 2s\n\
lb upgrade\n\
.fi\n";

const SEE_ALSO: &str = "\
.SH \"SEE ALSO\"\n\
The guides in docs/: configuration.md, troubleshooting.md, admin\\-api.md, upgrade.md.\n";

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::*;

    fn page(cmd: clap::Command) -> String {
        let mut out = Vec::new();
        render(cmd, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn pages_have_the_sections_a_reader_looks_for() {
        let lb = page(crate::cli::Cli::command());
        for section in [
            ".SH NAME",
            ".SH SYNOPSIS",
            ".SH CONFIGURATION",
            ".SH \"EXIT STATUS\"",
            ".SH FILES",
            ".SH EXAMPLES",
        ] {
            assert!(lb.contains(section), "lb.1 has no {section}");
        }
        // The name once: `lb \- A client...`, not `lb \- lb: ...`.
        assert!(
            lb.contains("\nlb \\- A client\\-side TCP load balancer"),
            "{lb}"
        );
        let mut cmd = crate::cli::Cli::command();
        cmd.build();
        let run = cmd.find_subcommand("run").unwrap().clone();
        let run = page(run);
        assert!(run.contains("\\fB2\\fR\nAn invalid configuration"), "{run}");
    }

    #[test]
    fn configuration_lists_the_reference_keys() {
        let keys = reference_keys(CONFIGURATION_MD);
        let find = |t: &str| keys.iter().find(|(table, _)| table == t).map(|(_, k)| k);
        let admin = find("[admin]").unwrap();
        assert!(admin.contains(&"listen".to_string()), "{admin:?}");
        let health = find("[balancer.health]").unwrap();
        assert!(health.contains(&"interval".to_string()), "{health:?}");
        assert!(health.contains(&"timeout".to_string()), "{health:?}");
        assert!(find("Discovery keys: kind = \"dns\"").is_some(), "{keys:?}");
    }

    #[test]
    fn writes_one_page_per_command() {
        let dir = std::env::temp_dir().join(format!("lb-man-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        generate_to(crate::cli::Cli::command(), &dir).unwrap();
        for page in [
            "lb.1",
            "lb-run.1",
            "lb-config.1",
            "lb-config-check.1",
            "lb-config-schema.1",
        ] {
            assert!(dir.join(page).is_file(), "{page}");
        }
        let check = std::fs::read_to_string(dir.join("lb-config-check.1")).unwrap();
        assert!(check.contains(".SH EXAMPLES"), "{check}");
        let schema = std::fs::read_to_string(dir.join("lb-config-schema.1")).unwrap();
        assert!(
            schema.contains("Print a JSON Schema of the config file"),
            "{schema}"
        );
        assert!(schema.contains("\\fB1\\fR\nStandard output"), "{schema}");
        let config = std::fs::read_to_string(dir.join("lb-config.1")).unwrap();
        assert!(config.contains("lb\\-config\\-schema"), "{config}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
