//! Error reporting shared by every module: an error with its sources on one line.

/// `e` and its sources, joined with ": " (for a log line or a status field).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}
