//! Plain text tables for the client commands: columns padded to their widest cell.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::balancer::{Hold, ServerStatus};

/// Render `rows` under `header`, two spaces between columns, each line indented by `indent`.
pub fn render(indent: &str, header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::from(indent);
        let last = cells.len().saturating_sub(1);
        for (i, (cell, w)) in cells.into_iter().zip(&widths).enumerate() {
            out.push_str(cell);
            if i < last {
                out.extend(std::iter::repeat_n(' ', w - cell.chars().count() + 2));
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// Seconds since `epoch_secs`, as `1.2s ago`, `3m ago`; `never` for none.
pub fn age(epoch_secs: Option<f64>) -> String {
    let Some(t) = epoch_secs else {
        return "never".into();
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let ago = (now - t).max(0.0);
    if ago < 60.0 {
        format!("{ago:.1}s ago")
    } else if ago < 3600.0 {
        format!("{:.0}m ago", ago / 60.0)
    } else {
        format!("{:.1}h ago", ago / 3600.0)
    }
}

/// The server table of `lb status` and `lb servers`.
pub fn servers(indent: &str, servers: &[ServerStatus]) -> String {
    let rows: Vec<Vec<String>> = servers
        .iter()
        .map(|s| {
            vec![
                s.address.to_string(),
                // A connect-time server the kernel marked suspect shows it beside its state.
                if s.suspect {
                    format!("{}+suspect", s.state.name())
                } else {
                    s.state.name().to_string()
                },
                if s.default { "yes" } else { "-" }.to_string(),
                match s.hold {
                    Hold::None => "-",
                    Hold::Drain => "drain",
                    Hold::Disabled => "disabled",
                }
                .to_string(),
                s.connections.to_string(),
                s.consecutive_failures.to_string(),
                age(s.last_check),
                s.last_error.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    render(
        indent,
        &[
            "SERVER",
            "STATE",
            "DEFAULT",
            "HOLD",
            "CONNS",
            "FAILS",
            "LAST CHECK",
            "ERROR",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up() {
        let t = render(
            "",
            &["A", "BB"],
            &[vec!["xxx".into(), "y".into()], vec!["z".into(), "w".into()]],
        );
        assert_eq!(t, "A    BB\nxxx  y\nz    w\n");
        assert_eq!(age(None), "never");
    }
}
