//! The OCI image archive: an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/`) in
//! one tar. `index.json` names one multi-arch image index (annotated with the image's name, for
//! `ctr images import`, `podman load` and `skopeo copy oci-archive:`), which lists one manifest
//! per architecture; each manifest has a config (entrypoint /usr/bin/lb) and one gzip layer
//! holding only the static binary, on an empty base. Every tar entry is root's with mtime 0,
//! so equal binaries give equal digests.

use std::{collections::BTreeMap, io::Read as _, path::Path};

use anyhow::{Context as _, Result, bail, ensure};
use serde_json::{Value, json};

use super::{elf, payload::gzip, sha256_hex};
use crate::musl::Arch;

pub const INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// The binary's path in the image, and the entrypoint.
const ENTRYPOINT: &str = "/usr/bin/lb";

/// The image's name as the DaemonSets write it (`image: lb:VERSION`).
pub fn short_name(version: &str) -> String {
    format!("lb:{version}")
}

/// The same name in full, as containerd stores `lb:VERSION` (its `io.containerd.image.name`
/// annotation, which podman reads too).
pub fn full_name(version: &str) -> String {
    format!("docker.io/library/lb:{version}")
}

/// A blob: its bytes and the descriptor that names them.
struct Blob {
    media_type: &'static str,
    bytes: Vec<u8>,
}

impl Blob {
    fn json(media_type: &'static str, value: &Value) -> Result<Blob> {
        Ok(Blob {
            media_type,
            bytes: serde_json::to_vec(value)?,
        })
    }

    fn digest(&self) -> String {
        format!("sha256:{}", sha256_hex(&self.bytes))
    }

    fn descriptor(&self) -> Value {
        json!({"mediaType": self.media_type, "digest": self.digest(), "size": self.bytes.len()})
    }
}

/// The OCI platform of `arch`.
fn platform(arch: &Arch) -> Value {
    let mut p = json!({"architecture": arch.deb, "os": "linux"});
    if let Some(v) = arch.oci_variant {
        p["variant"] = json!(v);
    }
    p
}

/// A ustar header of a root-owned entry with mtime 0 (its path is set when appended).
fn header(kind: tar::EntryType, mode: u32, size: usize) -> Result<tar::Header> {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size as u64);
    h.set_uid(0);
    h.set_gid(0);
    h.set_username("root")?;
    h.set_groupname("root")?;
    h.set_mtime(0);
    Ok(h)
}

/// A tar of `usr/`, `usr/bin/` and `usr/bin/lb` (0755).
fn layer_tar(binary: &[u8]) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for dir in ["usr/", "usr/bin/"] {
        let mut h = header(tar::EntryType::Directory, 0o755, 0)?;
        b.append_data(&mut h, dir, std::io::empty())?;
    }
    let mut h = header(tar::EntryType::Regular, 0o755, binary.len())?;
    b.append_data(&mut h, ENTRYPOINT.trim_start_matches('/'), binary)?;
    Ok(b.into_inner()?)
}

/// The manifest of one architecture and the blobs it names (config, layer).
fn image(version: &str, arch: &Arch, binary: &[u8]) -> Result<(Blob, Vec<Blob>)> {
    let tar = layer_tar(binary)?;
    let layer = Blob {
        media_type: LAYER,
        bytes: gzip(&tar)?,
    };
    let mut config = json!({
        "architecture": arch.deb,
        "os": "linux",
        "config": {
            "Entrypoint": [ENTRYPOINT],
            "Labels": {"org.opencontainers.image.title": "lb",
                       "org.opencontainers.image.version": version},
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(&tar))]},
        "history": [{"created_by": "cargo xtask dist"}],
    });
    if let Some(v) = arch.oci_variant {
        config["variant"] = json!(v);
    }
    let config = Blob::json(CONFIG, &config)?;
    let manifest = Blob::json(
        MANIFEST,
        &json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": config.descriptor(),
            "layers": [layer.descriptor()],
        }),
    )?;
    Ok((manifest, vec![config, layer]))
}

/// Write the archive `out` holding one image per (architecture, static binary).
///
/// # Errors
/// Writing the file.
pub fn write(out: &Path, version: &str, images: &[(&Arch, Vec<u8>)]) -> Result<()> {
    let mut blobs: Vec<Blob> = Vec::new();
    let mut manifests = Vec::new();
    for (arch, binary) in images {
        let (manifest, parts) = image(version, arch, binary)?;
        let mut d = manifest.descriptor();
        d["platform"] = platform(arch);
        manifests.push(d);
        blobs.push(manifest);
        blobs.extend(parts);
    }
    let index = Blob::json(
        INDEX,
        &json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests}),
    )?;
    let mut top = index.descriptor();
    top["annotations"] = json!({
        "io.containerd.image.name": full_name(version),
        "org.opencontainers.image.ref.name": version,
    });
    blobs.push(index);
    let index_json =
        serde_json::to_vec(&json!({"schemaVersion": 2, "mediaType": INDEX, "manifests": [top]}))?;
    blobs.sort_by_key(Blob::digest);
    blobs.dedup_by_key(|b| b.digest());

    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: &str, data: &[u8], dir: bool| -> Result<()> {
        let mut h = if dir {
            header(tar::EntryType::Directory, 0o755, 0)?
        } else {
            header(tar::EntryType::Regular, 0o644, data.len())?
        };
        b.append_data(&mut h, path, data)?;
        Ok(())
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#, false)?;
    add("index.json", &index_json, false)?;
    add("blobs/", &[], true)?;
    add("blobs/sha256/", &[], true)?;
    for blob in &blobs {
        let hex = blob.digest().trim_start_matches("sha256:").to_string();
        add(&format!("blobs/sha256/{hex}"), &blob.bytes, false)?;
    }
    let bytes = b.into_inner()?;
    std::fs::write(out, bytes).with_context(|| format!("writing {}", out.display()))
}

/// A regular file read back from a tar.
struct Entry {
    mode: u32,
    uid: u64,
    bytes: Vec<u8>,
}

/// A tar's regular files by path.
type Files = BTreeMap<String, Entry>;

/// Every regular file of a tar by path (`./` and a leading `/` dropped); at most `limit`
/// entries.
fn read_tar(data: &[u8], limit: usize) -> Result<Files> {
    let mut out = BTreeMap::new();
    let mut archive = tar::Archive::new(data);
    for (n, entry) in archive.entries()?.enumerate() {
        ensure!(n < limit, "more than {limit} entries");
        let mut entry = entry?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = entry.path()?.to_string_lossy().into_owned();
        let path = path.trim_start_matches("./").trim_start_matches('/');
        let (mode, uid) = (entry.header().mode()?, entry.header().uid()?);
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes)?;
        out.insert(path.to_string(), Entry { mode, uid, bytes });
    }
    Ok(out)
}

/// The blob a descriptor names, its size and digest checked, and its media type `want`.
fn blob<'a>(files: &'a Files, desc: &Value, want: &str) -> Result<&'a [u8]> {
    let digest = desc["digest"]
        .as_str()
        .context("a descriptor without digest")?;
    ensure!(
        desc["mediaType"] == want,
        "{digest}: media type {} where {want} belongs",
        desc["mediaType"]
    );
    let hex = digest
        .strip_prefix("sha256:")
        .with_context(|| format!("{digest}: not a sha256 digest"))?;
    let bytes = &files
        .get(&format!("blobs/sha256/{hex}"))
        .with_context(|| format!("{digest}: no blobs/sha256/{hex} in the archive"))?
        .bytes;
    let size = desc["size"].as_u64().context("a descriptor without size")?;
    ensure!(
        bytes.len() as u64 == size,
        "{digest}: size {size} in its descriptor, {} in the archive",
        bytes.len()
    );
    let got = sha256_hex(bytes);
    ensure!(
        got == hex,
        "{digest}: the blob's content hashes to sha256:{got}"
    );
    Ok(bytes)
}

/// Read `path` back and check it holds exactly one image per `expect` entry (architecture,
/// static binary): index.json → image index → manifests → configs and layers, every digest and
/// size, each manifest's platform and config architecture, and the layer's /usr/bin/lb (the
/// binary's bytes, root-owned 0755, an ELF for that machine). Returns one line per image.
///
/// # Errors
/// The first thing that does not hold, named.
pub fn verify(path: &Path, version: &str, expect: &[(&Arch, Vec<u8>)]) -> Result<Vec<String>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let files = read_tar(&data, 64)?;
    let json = |name: &str| -> Result<Value> {
        let e = files.get(name).with_context(|| format!("no {name}"))?;
        serde_json::from_slice(&e.bytes).with_context(|| format!("{name} is not JSON"))
    };
    ensure!(json("oci-layout")?["imageLayoutVersion"] == "1.0.0");
    let top = json("index.json")?;
    let [desc] = top["manifests"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
    else {
        bail!("index.json must name exactly one image index");
    };
    ensure!(
        desc["annotations"]["io.containerd.image.name"] == full_name(version)
            && desc["annotations"]["org.opencontainers.image.ref.name"] == version,
        "index.json's names are {}",
        desc["annotations"]
    );
    let index: Value = serde_json::from_slice(blob(&files, desc, INDEX)?)?;
    let manifests = index["manifests"].as_array().context("no manifests")?;
    ensure!(
        manifests.len() == expect.len(),
        "{} manifests where {} architectures were packed",
        manifests.len(),
        expect.len()
    );
    let mut lines = Vec::new();
    for (arch, binary) in expect {
        let d = manifests
            .iter()
            .find(|d| d["platform"]["architecture"] == arch.deb)
            .with_context(|| format!("no manifest for {}", arch.deb))?;
        ensure!(
            d["platform"] == platform(arch),
            "platform {}",
            d["platform"]
        );
        let manifest: Value = serde_json::from_slice(blob(&files, d, MANIFEST)?)?;
        lines.push(image_checks(&files, &manifest, arch, binary)?);
    }
    Ok(lines)
}

/// One manifest's config and layer.
fn image_checks(files: &Files, manifest: &Value, arch: &Arch, binary: &[u8]) -> Result<String> {
    let config: Value = serde_json::from_slice(blob(files, &manifest["config"], CONFIG)?)?;
    ensure!(
        config["architecture"] == arch.deb && config["os"] == "linux",
        "{}: config says {}/{}",
        arch.deb,
        config["os"],
        config["architecture"]
    );
    ensure!(config["config"]["Entrypoint"] == json!([ENTRYPOINT]));
    let [layer] = manifest["layers"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
    else {
        bail!("{}: the manifest must have exactly one layer", arch.deb);
    };
    let gz = blob(files, layer, LAYER)?;
    let mut tar = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut tar)
        .with_context(|| format!("{}: the layer is not gzip", arch.deb))?;
    let diff_id = format!("sha256:{}", sha256_hex(&tar));
    ensure!(
        config["rootfs"]["diff_ids"] == json!([diff_id]),
        "{}: diff_ids {} but the layer's tar is {diff_id}",
        arch.deb,
        config["rootfs"]["diff_ids"]
    );
    let layer_files = read_tar(&tar, 16)?;
    let Entry {
        mode,
        uid,
        bytes: lb,
    } = layer_files
        .get(ENTRYPOINT.trim_start_matches('/'))
        .with_context(|| format!("{}: no {ENTRYPOINT} in the layer", arch.deb))?;
    ensure!(
        *mode & 0o7777 == 0o755 && *uid == 0,
        "{}: {ENTRYPOINT} has mode {mode:o}, uid {uid}",
        arch.deb
    );
    ensure!(
        lb.as_slice() == binary,
        "{}: the layer's {ENTRYPOINT} is not the packaged binary",
        arch.deb
    );
    elf::check(lb, arch)?;
    Ok(format!(
        "{}: manifest, config and layer ({} bytes gzip) verified, {ENTRYPOINT} sha256:{}",
        arch.deb,
        gz.len(),
        sha256_hex(lb)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::musl::{AARCH64, X86_64};

    /// A minimal ELF header of the given machine, static (no program headers).
    fn fake_elf(machine: u16) -> Vec<u8> {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[18..20].copy_from_slice(&machine.to_le_bytes());
        b
    }

    #[test]
    fn an_archive_reads_back_and_a_changed_byte_is_caught() -> Result<()> {
        let dir = lb_tests::TempDir::new("xtask-oci")?;
        let path = dir.path().join("lb.tar");
        let images = [(&X86_64, fake_elf(62)), (&AARCH64, fake_elf(183))];
        write(&path, "9.9.9", &images)?;
        let lines = verify(&path, "9.9.9", &images)?;
        assert_eq!(lines.len(), 2);
        assert!(lines[1].starts_with("arm64: "), "{lines:?}");
        // Another version's name, a binary swapped between architectures, a flipped byte.
        assert!(verify(&path, "9.9.8", &images).is_err());
        let swapped = [(&X86_64, fake_elf(183)), (&AARCH64, fake_elf(62))];
        assert!(verify(&path, "9.9.9", &swapped).is_err());
        let mut data = std::fs::read(&path)?;
        let needle = b"cargo xtask dist";
        let at = data
            .windows(needle.len())
            .position(|w| w == needle)
            .context("the config blob")?;
        data[at] ^= 1;
        std::fs::write(&path, &data)?;
        let err = verify(&path, "9.9.9", &images).expect_err("a changed blob");
        assert!(err.to_string().contains("hashes to"), "{err:#}");
        Ok(())
    }
}
