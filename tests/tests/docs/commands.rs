//! Every `lb ...` command line the docs show parses with lb's own command line (clap's
//! `try_get_matches_from` on [`Cli`]; nothing runs): the lines of ```` ```sh ```` blocks, the
//! code spans starting with `lb `, `ExecStart=` of the systemd files under `deploy/` and the
//! `args:` of the containers running the `lb` image in `deploy/`'s YAML.
//!
//! In a block, a command is found after `&&`, `||`, `;` or a ` | ` pipe, past `sudo` and
//! `VAR=value` assignments; `lb` may be a path (`target/release/lb`). Two placeholders:
//! `a|b|c` inside a word (no spaces) stands for each alternative, and `<NAME>` for a value of
//! the kind [`PLACEHOLDERS`] gives. A code span may name a command without its arguments
//! (`lb servers`): it must not give a wrong subcommand, flag or value, but may leave required
//! ones out. A block's line is a whole command and must parse as it stands.

use std::fs;

use clap::{CommandFactory as _, error::ErrorKind};
use lb::cli::Cli;

use super::{example_files, fenced_blocks, files_under, prose_lines, root, shown};

/// The `<NAME>` placeholders and the words each stands for in the check (`<ARGS>`: any
/// arguments, none here).
const PLACEHOLDERS: &[(&str, &[&str])] = &[
    ("<ADDR>", &["198.18.0.2:6443"]),
    ("<ADDRESS>", &["198.18.0.2"]),
    ("<ARGS>", &[]),
    ("<DIR>", &["/usr/share/man/man1"]),
    ("<DURATION>", &["2s"]),
    ("<FILE>", &["/etc/lb/lb.toml"]),
    ("<NAME>", &["apiserver"]),
    ("<PORT>", &["6443"]),
];

/// How complete a shown command must be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shown {
    /// A line of a block or a unit: the whole command.
    Whole,
    /// A code span in prose: may name a command without its required arguments.
    Mention,
}

/// One `lb` command line as shown, and where.
#[derive(Debug)]
struct CommandLine {
    /// `file:line`.
    origin: String,
    /// The words after `lb`, placeholders not yet expanded.
    args: Vec<String>,
    /// How complete it must be.
    shown: Shown,
}

/// The words of a shell line: whitespace-separated, `'...'` and `"..."` quoting, a `#` comment
/// at the start of a word ending the line, `;` a word of its own.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in line.chars() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            } else {
                word.push(c);
            }
            continue;
        }
        match c {
            '\'' | '"' => {
                quote = Some(c);
                in_word = true;
            }
            '#' if !in_word => break,
            ';' | ' ' | '\t' => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
                if c == ';' {
                    words.push(";".into());
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The `lb` commands among `words`: each `&&`, `||`, `;`, `|` or `&` separated part that runs
/// `lb` (or a path ending in `/lb`) after any `sudo` and `VAR=value`, its redirections dropped.
fn lb_commands(words: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for part in words.split(|w| ["&&", "||", ";", "|", "&"].contains(&w.as_str())) {
        let mut rest = part
            .iter()
            .skip_while(|w| *w == "sudo" || is_assignment(w))
            .peekable();
        let Some(program) = rest.next() else {
            continue;
        };
        if program != "lb" && !program.ends_with("/lb") {
            continue;
        }
        let mut args = Vec::new();
        while let Some(w) = rest.next() {
            if [">", ">>", "<", "2>", "&>"].contains(&w.as_str()) {
                // The file it redirects to or from.
                rest.next();
                continue;
            }
            let redirection =
                !is_placeholder(w) && (w.starts_with(['>', '<']) || w.starts_with("2>"));
            if !redirection {
                args.push(w.clone());
            }
        }
        out.push(args);
    }
    out
}

/// `VAR=value` before a command.
fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_uppercase() || c == '_')
    })
}

/// `<NAME>`, as opposed to a redirection.
fn is_placeholder(word: &str) -> bool {
    word.starts_with('<') && word.contains('>')
}

/// Every command line `args` stands for: each alternative of an `a|b` word, each `<NAME>`
/// replaced by its words.
///
/// # Errors
/// A placeholder [`PLACEHOLDERS`] does not know.
fn expand(args: &[String]) -> Result<Vec<Vec<String>>, String> {
    let mut lines: Vec<Vec<String>> = vec![Vec::new()];
    for arg in args {
        let mut choices: Vec<Vec<String>> = Vec::new();
        for alternative in arg.split('|') {
            choices.push(fill(alternative)?);
        }
        lines = lines
            .iter()
            .flat_map(|line| {
                choices.iter().map(move |words| {
                    let mut l = line.clone();
                    l.extend(words.iter().cloned());
                    l
                })
            })
            .collect();
    }
    Ok(lines)
}

/// The words of one word with its placeholders filled: a placeholder alone gives its words
/// (maybe none), one inside a word its single word.
fn fill(word: &str) -> Result<Vec<String>, String> {
    let value = |name: &str| {
        PLACEHOLDERS
            .iter()
            .find(|(p, _)| *p == name)
            .map(|(_, words)| *words)
            .ok_or_else(|| format!("unknown placeholder {name} (add it to PLACEHOLDERS)"))
    };
    if let Some(words) = PLACEHOLDERS
        .iter()
        .find(|(p, _)| *p == word)
        .map(|(_, w)| w)
    {
        return Ok(words.iter().map(ToString::to_string).collect());
    }
    let mut out = String::new();
    let mut rest = word;
    while let Some(start) = rest.find('<') {
        let Some(len) = rest[start..].find('>') else {
            break;
        };
        out.push_str(&rest[..start]);
        let words = value(&rest[start..=start + len])?;
        out.push_str(&words.join(" "));
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    Ok(vec![out])
}

/// Parse one expanded line with lb's command line.
fn parse(args: &[String], shown: Shown) -> Result<(), String> {
    let argv = std::iter::once("lb".to_string()).chain(args.iter().cloned());
    match Cli::command().try_get_matches_from(argv) {
        Ok(_) => Ok(()),
        Err(e) => match (e.kind(), shown) {
            (ErrorKind::DisplayHelp | ErrorKind::DisplayVersion, _)
            | (
                ErrorKind::MissingSubcommand
                | ErrorKind::MissingRequiredArgument
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand,
                Shown::Mention,
            ) => Ok(()),
            _ => Err(e
                .render()
                .to_string()
                .lines()
                .next()
                .unwrap_or("")
                .to_string()),
        },
    }
}

/// The code spans of the prose of `text`, each with the line it starts on. As in CommonMark, a
/// span opened by a run of N backticks ends at the next run of exactly N, also on a later line
/// of its paragraph (a line break in it reads as a space); an unclosed run is literal text.
fn code_spans(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    for (n, line) in prose_lines(text).into_iter().chain([(0, "")]) {
        if !line.trim().is_empty() {
            paragraph.push((n, line));
            continue;
        }
        // The paragraph as one string, and where each of its lines starts in it.
        let joined: String = paragraph.iter().map(|(_, l)| format!("{l} ")).collect();
        let mut starts = Vec::new();
        let mut at = 0;
        for (n, l) in &paragraph {
            starts.push((at, *n));
            at += l.len() + 1;
        }
        let line_of = |pos: usize| {
            starts
                .iter()
                .rev()
                .find(|(start, _)| *start <= pos)
                .map_or(0, |(_, n)| *n)
        };
        let bytes = joined.as_bytes();
        let run_at = |i: usize| bytes[i..].iter().take_while(|b| **b == b'`').count();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] != b'`' {
                i += 1;
                continue;
            }
            let n = run_at(i);
            let close =
                (i + n..bytes.len()).find(|&j| run_at(j) == n && (j == 0 || bytes[j - 1] != b'`'));
            match close {
                Some(j) => {
                    out.push((line_of(i), joined[i + n..j].trim().to_string()));
                    i = j + n;
                }
                None => i += n,
            }
        }
        paragraph.clear();
    }
    out
}

/// The command lines of the Markdown files: lines of ```` ```sh ```` blocks (a trailing `\`
/// continues one) and code spans starting with `lb `.
fn markdown_commands(out: &mut Vec<CommandLine>) {
    for file in example_files() {
        let text = fs::read_to_string(&file).expect("readable Markdown");
        for block in fenced_blocks(&text) {
            if !["sh", "bash", "shell"].contains(&block.lang.as_str()) {
                continue;
            }
            let mut joined = String::new();
            for (i, line) in block.text.lines().enumerate() {
                let (line, continued) = match line.trim_end().strip_suffix('\\') {
                    Some(l) => (l, true),
                    None => (line, false),
                };
                joined.push_str(line);
                joined.push(' ');
                if continued {
                    continue;
                }
                for args in lb_commands(&shell_words(&joined)) {
                    out.push(CommandLine {
                        origin: format!("{}:{}", shown(&file), block.line + 1 + i),
                        args,
                        shown: Shown::Whole,
                    });
                }
                joined.clear();
            }
        }
        for (n, span) in code_spans(&text) {
            if !span.starts_with("lb ") {
                continue;
            }
            for args in lb_commands(&shell_words(&span)) {
                out.push(CommandLine {
                    origin: format!("{}:{n}", shown(&file)),
                    args,
                    shown: Shown::Mention,
                });
            }
        }
    }
}

/// The command lines of `deploy/`: `ExecStart=` of the systemd files, and the `args:` (a JSON
/// array) of a container whose `image:` on the line before is `lb`'s.
fn deploy_commands(out: &mut Vec<CommandLine>) {
    let deploy = root().join("deploy");
    let mut files = Vec::new();
    for ext in ["service", "conf", "yaml"] {
        files_under(&deploy, ext, &mut files);
    }
    files.sort();
    for file in files {
        let text = fs::read_to_string(&file).expect("readable file");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let line = line.trim();
            let origin = format!("{}:{}", shown(&file), i + 1);
            if let Some(exec) = line.strip_prefix("ExecStart=") {
                for args in lb_commands(&shell_words(exec)) {
                    out.push(CommandLine {
                        origin: origin.clone(),
                        args,
                        shown: Shown::Whole,
                    });
                }
            } else if let Some(array) = line.strip_prefix("args:")
                && i > 0
                && lines[i - 1].trim().starts_with("image: lb:")
            {
                let args: Vec<String> = serde_json::from_str(array.trim())
                    .unwrap_or_else(|e| panic!("{origin}: args is not a JSON array: {e}"));
                out.push(CommandLine {
                    origin,
                    args,
                    shown: Shown::Whole,
                });
            }
        }
    }
}

/// What is wrong with `line`, if anything.
fn problems(line: &CommandLine) -> Vec<String> {
    let as_shown = format!("`lb {}`", line.args.join(" "));
    match expand(&line.args) {
        Err(e) => vec![format!("{}: {as_shown}: {e}", line.origin)],
        Ok(expanded) => expanded
            .iter()
            .filter_map(|args| {
                let error = parse(args, line.shown).err()?;
                let parsed = format!("`lb {}`", args.join(" "));
                let from = if parsed == as_shown {
                    String::new()
                } else {
                    format!(" (from {as_shown})")
                };
                Some(format!("{}: {parsed}{from}: {error}", line.origin))
            })
            .collect(),
    }
}

#[test]
fn shown_command_lines_parse() {
    let mut lines = Vec::new();
    markdown_commands(&mut lines);
    deploy_commands(&mut lines);
    for (what, count) in [
        (
            "a block line",
            lines.iter().filter(|l| l.shown == Shown::Whole).count(),
        ),
        (
            "a code span",
            lines.iter().filter(|l| l.shown == Shown::Mention).count(),
        ),
        (
            "a deploy file",
            lines
                .iter()
                .filter(|l| l.origin.starts_with("deploy/"))
                .count(),
        ),
    ] {
        assert!(
            count > 0,
            "no lb command line in {what}: is the parser broken?"
        );
    }
    let wrong: Vec<String> = lines.iter().flat_map(problems).collect();
    assert!(
        wrong.is_empty(),
        "{} of {} shown lb command line(s) do not parse (placeholders: `a|b`, `<NAME>`; see \
         CONTRIBUTING.md):\n{}",
        wrong.len(),
        lines.len(),
        wrong.join("\n")
    );
}

#[test]
fn shell_lines_split_into_lb_commands() {
    let words = shell_words(
        "sudo LB_LOG=debug target/release/lb run --listen '[::1]:6444' # comment | lb x",
    );
    assert_eq!(
        lb_commands(&words),
        vec![vec!["run", "--listen", "[::1]:6444"]]
    );
    let words = shell_words("install x && lb config check f; lb completions bash > out");
    assert_eq!(
        lb_commands(&words),
        vec![vec!["config", "check", "f"], vec!["completions", "bash"]]
    );
    assert!(lb_commands(&shell_words("cargo xtask run -- lb status")).is_empty());
}

#[test]
fn code_spans_follow_commonmark() {
    let text = "a `lb\nstatus` b ```` ```toml ```` `x`\n\n`lb check`\n```sh\n`lb no`\n```\n";
    assert_eq!(
        code_spans(text),
        vec![
            (1, "lb status".to_string()),
            (2, "```toml".to_string()),
            (2, "x".to_string()),
            (4, "lb check".to_string())
        ]
    );
}

#[test]
fn placeholders_expand() {
    let args: Vec<String> = ["servers", "drain|kill", "<NAME>:<PORT>", "<ARGS>"]
        .map(String::from)
        .to_vec();
    assert_eq!(
        expand(&args).unwrap(),
        vec![
            vec!["servers", "drain", "apiserver:6443"],
            vec!["servers", "kill", "apiserver:6443"]
        ]
    );
    assert!(expand(&["<WHAT>".to_string()]).is_err());
}

#[test]
fn a_wrong_command_does_not_parse() {
    let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
    assert!(parse(&args("servers"), Shown::Mention).is_ok());
    assert!(parse(&args("servers"), Shown::Whole).is_err());
    assert!(parse(&args("status --no-such-flag"), Shown::Mention).is_err());
    assert!(parse(&args("run --datapath fast"), Shown::Mention).is_err());
    assert!(parse(&args("config check --skip-files f"), Shown::Whole).is_ok());
}
