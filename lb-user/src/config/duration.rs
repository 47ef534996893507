//! Durations as the config file writes them: `250ms`, `10s`, `1m30s` (humantime's syntax).

use std::{fmt, time::Duration};

use serde::{Deserialize, Deserializer, Serialize};

/// A duration written as `250ms`, `10s`, `1m` (humantime syntax).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(Dur)
            .map_err(serde::de::Error::custom)
    }
}

impl Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

/// A text that is not a duration.
#[derive(Debug, thiserror::Error)]
#[error("`{text}` is not a duration like 250ms, 10s or 1m ({source})")]
pub struct DurationError {
    /// The text as given.
    pub text: String,
    /// What humantime found wrong.
    #[source]
    pub source: humantime::DurationError,
}

/// Parse `250ms`, `10s`, `1m30s`.
///
/// # Errors
/// [`DurationError`] naming the text when it is not a duration.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    humantime::parse_duration(s.trim()).map_err(|source| DurationError {
        text: s.to_string(),
        source,
    })
}
