//! Files lb reads from outside (the config file, credential and token files, state files, the
//! discovery file source) and files it writes: reads are bounded in size and take regular files
//! only, so `ca_file = "/dev/zero"` or a FIFO is refused instead of eating memory or hanging;
//! writes are atomic, private (mode 0600, directories 0700, whatever the umask) and durable (the
//! file and then its directory are synced).

use std::{
    fs::{File, OpenOptions},
    io::{self, Read as _, Write as _},
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

/// Most bytes lb reads of its config file: 4 MiB.
pub const CONFIG_LIMIT: u64 = 4 * 1024 * 1024;

/// Most bytes lb reads of any other file it is pointed at (credential, token, state and
/// discovery files): 1 MiB.
pub const INPUT_LIMIT: u64 = 1024 * 1024;

/// Mode of every file lb creates: owner read and write only.
pub const FILE_MODE: u32 = 0o600;

/// Mode of every directory lb creates: owner only.
pub const DIR_MODE: u32 = 0o700;

/// Why a bounded read refused a file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file could not be opened or read.
    #[error("cannot read it: {0}")]
    Io(#[source] io::Error),
    /// Not a regular file (a device, FIFO, socket or directory).
    #[error("not a regular file ({kind}); lb reads only regular files here")]
    NotRegular {
        /// What it is instead, e.g. `a character device`.
        kind: &'static str,
    },
    /// Larger than the limit.
    #[error("larger than {limit} bytes, the most lb reads of it")]
    TooLarge {
        /// The limit, in bytes.
        limit: u64,
    },
}

impl From<ReadError> for io::Error {
    fn from(e: ReadError) -> io::Error {
        match e {
            ReadError::Io(e) => e,
            other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
        }
    }
}

/// What a file that is not regular is, for the error.
fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a plain file"
    }
}

/// Read the regular file at `path` (symbolic links followed), at most `limit` bytes.
///
/// The type is checked before opening (so a FIFO does not block the open) and again on the
/// open descriptor; the read stops one byte past `limit`, so a file that grows meanwhile cannot
/// make lb read more.
///
/// # Errors
/// [`ReadError`]: not there or unreadable, not a regular file, or over `limit` bytes.
pub fn read_limited(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    let meta = std::fs::metadata(path).map_err(ReadError::Io)?;
    check_meta(&meta, limit)?;
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(ReadError::Io)?;
    check_meta(&f.metadata().map_err(ReadError::Io)?, limit)?;
    let mut out = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut out)
        .map_err(ReadError::Io)?;
    if out.len() as u64 > limit {
        return Err(ReadError::TooLarge { limit });
    }
    Ok(out)
}

/// [`read_limited`], as UTF-8 text.
///
/// # Errors
/// As [`read_limited`]; text that is not UTF-8 is [`ReadError::Io`] (`InvalidData`).
pub fn read_limited_string(path: &Path, limit: u64) -> Result<String, ReadError> {
    String::from_utf8(read_limited(path, limit)?)
        .map_err(|e| ReadError::Io(io::Error::new(io::ErrorKind::InvalidData, e)))
}

fn check_meta(meta: &std::fs::Metadata, limit: u64) -> Result<(), ReadError> {
    if !meta.file_type().is_file() {
        return Err(ReadError::NotRegular {
            kind: kind_of(meta.file_type()),
        });
    }
    if meta.len() > limit {
        return Err(ReadError::TooLarge { limit });
    }
    Ok(())
}

/// Create `dir` and its missing parents with mode 0700 (existing ones are left as they are).
///
/// # Errors
/// The I/O error.
pub fn create_private_dir_all(dir: &Path) -> io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
}

/// Write `bytes` to `path` atomically: a temporary file beside it (mode 0600, also under a
/// umask that would take bits away), fsync, rename over `path`, then fsync of the directory so
/// the rename itself survives a crash. Missing parent directories are created with mode 0700.
///
/// # Errors
/// The I/O error (a full or read-only file system: `ENOSPC`, `EROFS`); the previous file at
/// `path` is then untouched and the temporary file removed.
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    create_private_dir_all(&dir)?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}", std::process::id()));
    let tmp = dir.join(name);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(FILE_MODE)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The mode given to open(2) is masked by the umask: set it outright.
        f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    File::open(&dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lb-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_device_is_refused_without_reading_it() {
        let e = read_limited(Path::new("/dev/zero"), INPUT_LIMIT).unwrap_err();
        assert!(
            matches!(
                e,
                ReadError::NotRegular {
                    kind: "a character device"
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn a_file_over_the_limit_is_refused_and_one_at_it_read() {
        let d = temp_dir("limit");
        let f = d.join("big");
        std::fs::write(&f, vec![b'x'; 101]).unwrap();
        let e = read_limited(&f, 100).unwrap_err();
        assert!(matches!(e, ReadError::TooLarge { limit: 100 }), "{e}");
        assert!(e.to_string().contains("100 bytes"), "{e}");
        assert_eq!(read_limited(&f, 101).unwrap().len(), 101);
        let e = read_limited(&d, 100).unwrap_err();
        assert!(
            matches!(
                e,
                ReadError::NotRegular {
                    kind: "a directory"
                }
            ),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn written_files_and_dirs_are_private_whatever_the_umask() {
        let d = temp_dir("write");
        let path = d.join("sub/state.json");
        // A umask that would leave the file world-readable (0644) and the directory 0755.
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
        let r = write_private(&path, b"one");
        nix::sys::stat::umask(old);
        r.unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&d.join("sub")), 0o700);
        write_private(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(
            std::fs::read_dir(d.join("sub")).unwrap().count(),
            1,
            "no temporary left"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }
}
