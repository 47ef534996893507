//! A TOML error as lb prints it: toml's own lines (line, column, the line with a caret under the
//! value, the reason) with the full dotted key of that line on the first, `balancer[1].health.
//! interval` rather than the leaf `interval` the caret shows.

/// toml's message for `e` in `text`, the dotted key added to its first line when the error's
/// line holds one.
pub(super) fn message(e: &toml::de::Error, text: &str) -> String {
    let shown = e.to_string();
    let shown = shown.trim_end();
    let key = e.span().and_then(|span| key_at(text, span.start));
    match (key, shown.split_once('\n')) {
        (Some(key), Some((first, rest))) => format!("{first} (key `{key}`)\n{rest}"),
        _ => shown.to_string(),
    }
}

/// The dotted key whose line holds byte `at`: the table of the last header before it, each
/// array of tables with its index (`balancer[1]`), then the key on that line.
fn key_at(text: &str, at: usize) -> Option<String> {
    let before = text.get(..at)?;
    let mut arrays: Vec<(String, usize)> = Vec::new();
    let mut table = String::new();
    for line in before.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.split("]]").next()) {
            let name = name.trim().to_string();
            match arrays.iter_mut().find(|(n, _)| *n == name) {
                Some((_, count)) => *count += 1,
                None => arrays.push((name.clone(), 1)),
            }
            table = indexed(&name, &arrays);
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            table = indexed(name.trim(), &arrays);
        }
    }
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or("");
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    if key.is_empty() || key.starts_with('[') || key.starts_with('#') {
        return None;
    }
    Some(if table.is_empty() {
        key.to_string()
    } else {
        format!("{table}.{key}")
    })
}

/// `name` (`balancer.health`) with the index of the current element of each array of tables
/// it goes through (`balancer[1].health`).
fn indexed(name: &str, arrays: &[(String, usize)]) -> String {
    let mut out = String::new();
    let mut path = String::new();
    for part in name.split('.') {
        let part = part.trim();
        if !path.is_empty() {
            path.push('.');
            out.push('.');
        }
        path.push_str(part);
        out.push_str(part);
        if let Some((_, count)) = arrays.iter().find(|(n, _)| *n == path) {
            out.push_str(&format!("[{}]", count - 1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> String {
        let e = toml::from_str::<crate::config::Config>(text).unwrap_err();
        message(&e, text)
    }

    #[test]
    fn names_the_full_key() {
        let text = "[[balancer]]\nname = \"a\"\nlisten = [\"127.0.0.1:1\"]\nservers = [\"198.18.0.2:1\"]\n\n\
                    [[balancer]]\nname = \"b\"\nlisten = [\"127.0.0.1:2\"]\nservers = [\"198.18.0.2:2\"]\n\
                    [balancer.health]\ninterval = \"soon\"\n";
        let msg = parse(text);
        assert!(
            msg.starts_with(
                "TOML parse error at line 11, column 12 (key `balancer[1].health.interval`)\n"
            ),
            "{msg}"
        );
        assert!(msg.contains("11 | interval = \"soon\"\n"), "{msg}");
        let msg = parse("[datapath]\nmode = \"fast\"\n");
        assert!(msg.contains("(key `datapath.mode`)\n"), "{msg}");
        let msg = parse("shutdown_grace = 5\n");
        assert!(msg.contains("(key `shutdown_grace`)\n"), "{msg}");
    }

    #[test]
    fn a_line_without_a_key_keeps_tomls_text() {
        let msg = parse("[[balancer]\n");
        assert!(!msg.contains("(key"), "{msg}");
        assert!(msg.starts_with("TOML parse error at line 1"), "{msg}");
    }
}
