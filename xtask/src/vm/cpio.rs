//! An initramfs in the `newc` cpio format the kernel unpacks: the `cpio` crate writes each
//! entry (header, name, data, padding) and the trailer; this adds every parent directory once
//! and refuses a path added twice.

use std::collections::BTreeSet;
use std::io::Write as _;

use anyhow::{Result, bail};
use cpio::NewcBuilder;

/// An initramfs being assembled in memory: directories are added for every parent path.
#[derive(Debug, Default)]
pub struct Archive {
    out: Vec<u8>,
    dirs: BTreeSet<String>,
    names: BTreeSet<String>,
    ino: u32,
}

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;

impl Archive {
    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) -> Result<()> {
        if !self.names.insert(name.to_string()) {
            bail!("initramfs: {name} added twice");
        }
        self.ino += 1;
        let Ok(filesize) = u32::try_from(data.len()) else {
            bail!("initramfs: {name} is larger than 4 GiB");
        };
        let mut entry = NewcBuilder::new(name)
            .ino(self.ino)
            .mode(mode)
            .nlink(if mode & S_IFDIR != 0 { 2 } else { 1 })
            .write(std::mem::take(&mut self.out), filesize);
        entry.write_all(data)?;
        self.out = entry.finish()?;
        Ok(())
    }

    /// Add `path` (relative, `a/b/c`) and its parents as directories, once each.
    ///
    /// # Errors
    /// Never in practice (a name clash with a file).
    pub fn dir(&mut self, path: &str) -> Result<()> {
        let mut so_far = String::new();
        for part in path.split('/').filter(|p| !p.is_empty()) {
            if !so_far.is_empty() {
                so_far.push('/');
            }
            so_far.push_str(part);
            if self.dirs.insert(so_far.clone()) {
                let name = so_far.clone();
                self.entry(&name, S_IFDIR | 0o755, &[])?;
            }
        }
        Ok(())
    }

    fn parent(&mut self, path: &str) -> Result<()> {
        if let Some((dir, _)) = path.rsplit_once('/') {
            self.dir(dir)?;
        }
        Ok(())
    }

    /// Add a regular file with permission bits `perm` (e.g. `0o755`).
    ///
    /// # Errors
    /// The same path twice, or a file over 4 GiB.
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> Result<()> {
        let path = path.trim_start_matches('/');
        self.parent(path)?;
        self.entry(path, S_IFREG | (perm & 0o7777), data)
    }

    /// Add a symbolic link `path` → `target`.
    ///
    /// # Errors
    /// The same path twice.
    pub fn symlink(&mut self, path: &str, target: &str) -> Result<()> {
        let path = path.trim_start_matches('/');
        self.parent(path)?;
        self.entry(path, S_IFLNK | 0o777, target.as_bytes())
    }

    /// Whether `path` was added.
    pub fn has(&self, path: &str) -> bool {
        self.names.contains(path.trim_start_matches('/'))
    }

    /// The finished archive.
    ///
    /// # Errors
    /// Never in practice.
    pub fn finish(self) -> Result<Vec<u8>> {
        Ok(cpio::newc::trailer(self.out)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_layout() -> Result<()> {
        let mut a = Archive::default();
        a.file("bin/x", 0o755, b"hello")?;
        assert!(a.has("/bin/x") && a.has("bin"));
        assert!(a.file("bin/x", 0o644, b"").is_err());
        let out = a.finish()?;
        assert!(out.len().is_multiple_of(4));
        // First entry: the directory `bin`, then the file, then the trailer.
        assert_eq!(&out[..6], b"070701");
        let text = String::from_utf8_lossy(&out);
        let bin = text.find("bin\0").expect("dir entry");
        let file = text.find("bin/x\0").expect("file entry");
        assert!(bin < file);
        assert!(text.contains("hello"));
        assert!(text.ends_with("TRAILER!!!\0\0\0\0") || text.contains("TRAILER!!!\0"));
        // The file header: mode 0100755, size 5.
        let hdr = &text[file - 110..file];
        assert_eq!(&hdr[14..22], "000081ed");
        assert_eq!(&hdr[54..62], "00000005");
        Ok(())
    }

    #[test]
    fn reads_back_with_the_crate_reader() -> Result<()> {
        let mut a = Archive::default();
        a.dir("etc/lb-vm")?;
        a.file("/opt/lb/lb", 0o755, b"\x7fELF and more")?;
        a.symlink("bin/sh", "/bin/busybox")?;
        a.file("etc/lb-vm/args", 0o644, b"")?;
        let mut rest: &[u8] = &a.finish()?;
        let mut seen = Vec::new();
        loop {
            let mut r = cpio::NewcReader::new(rest)?;
            let e = r.entry();
            if e.is_trailer() {
                break;
            }
            let (name, mode, nlink) = (e.name().to_string(), e.mode(), e.nlink());
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut r, &mut data)?;
            seen.push((name, mode, nlink, data));
            rest = r.finish()?;
        }
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "etc",
                "etc/lb-vm",
                "opt",
                "opt/lb",
                "opt/lb/lb",
                "bin",
                "bin/sh",
                "etc/lb-vm/args"
            ]
        );
        assert_eq!((seen[0].1, seen[0].2), (S_IFDIR | 0o755, 2));
        assert_eq!((seen[4].1, seen[4].2), (S_IFREG | 0o755, 1));
        assert_eq!(seen[4].3, b"\x7fELF and more");
        assert_eq!(
            (seen[6].1, &seen[6].3[..]),
            (S_IFLNK | 0o777, &b"/bin/busybox"[..])
        );
        assert!(seen[7].3.is_empty());
        Ok(())
    }
}
