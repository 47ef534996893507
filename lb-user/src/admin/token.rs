//! The admin API's bearer token: read from `[admin] token_file` (its content without surrounding
//! white space), and read again whenever the file changes, so a rotated token takes effect
//! without a restart. The CLI reads the same file the same way.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::SystemTime,
};

use crate::files::{INPUT_LIMIT, ReadError, read_limited_string};

/// Longest token accepted, in bytes.
const MAX_TOKEN_BYTES: usize = 4096;

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read (missing, not a regular file, too large, not UTF-8).
    #[error("{0}")]
    Read(#[from] ReadError),
    /// Its metadata cannot be read.
    #[error("cannot read its metadata: {0}")]
    Metadata(#[source] std::io::Error),
    /// Only white space in it.
    #[error("the file is empty")]
    Empty,
    /// Longer than [`MAX_TOKEN_BYTES`].
    #[error("the token is longer than {MAX_TOKEN_BYTES} bytes")]
    TooLong,
}

/// Read a token file: its content without surrounding white space, which must not be empty.
///
/// # Errors
/// [`TokenError`] naming what is wrong with the file.
pub fn read_token(path: &Path) -> Result<String, TokenError> {
    let text = read_limited_string(path, INPUT_LIMIT)?;
    let token = text.trim();
    if token.is_empty() {
        return Err(TokenError::Empty);
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::TooLong);
    }
    Ok(token.to_string())
}

/// The token last read, and the file state it was read from.
#[derive(Debug, Default)]
pub(super) struct TokenCache {
    cached: Mutex<Option<CachedToken>>,
}

/// A token and the file state it was read from.
#[derive(Debug)]
struct CachedToken {
    path: PathBuf,
    modified: SystemTime,
    len: u64,
    token: Arc<str>,
}

impl TokenCache {
    /// The token of the file at `path`, read again when its modification time or length
    /// changed since the last read.
    ///
    /// # Errors
    /// [`TokenError`] when the file cannot be used.
    pub(super) fn get(&self, path: &Path) -> Result<Arc<str>, TokenError> {
        let meta = std::fs::metadata(path).map_err(TokenError::Metadata)?;
        let mtime = meta.modified().map_err(TokenError::Metadata)?;
        let mut cached = self.cached.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cached.as_ref()
            && c.path == path
            && c.modified == mtime
            && c.len == meta.len()
        {
            return Ok(c.token.clone());
        }
        let token: Arc<str> = read_token(path)?.into();
        *cached = Some(CachedToken {
            path: path.to_path_buf(),
            modified: mtime,
            len: meta.len(),
            token: token.clone(),
        });
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_file_rules() {
        let dir = std::env::temp_dir().join(format!("lb-admin-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        std::fs::write(&f, "  s3cret\n").unwrap();
        assert_eq!(read_token(&f).unwrap(), "s3cret");
        std::fs::write(&f, "\n").unwrap();
        assert!(matches!(read_token(&f), Err(TokenError::Empty)));
        std::fs::write(&f, "x".repeat(MAX_TOKEN_BYTES + 1)).unwrap();
        assert!(matches!(read_token(&f), Err(TokenError::TooLong)));
        assert!(matches!(
            read_token(&dir.join("missing")),
            Err(TokenError::Read(_))
        ));
        let cache = TokenCache::default();
        std::fs::write(&f, "one").unwrap();
        assert_eq!(&*cache.get(&f).unwrap(), "one");
        std::fs::write(&f, "second").unwrap();
        assert_eq!(
            &*cache.get(&f).unwrap(),
            "second",
            "a changed file is read again"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
