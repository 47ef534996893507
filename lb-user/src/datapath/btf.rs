//! Byte offsets of the kernel struct fields the sk_msg program reads, looked up in the
//! running kernel's BTF (`/sys/kernel/btf/vmlinux`), so one program object works on every kernel
//! build without CO-RE.
//!
//! The BTF layout (header, type records, string section) is the kernel's documented format:
//! <https://docs.kernel.org/bpf/btf.html>. Only what finding a struct member needs is decoded.
//!
//! Why not aya-obj's BTF (`aya_obj::btf::Btf`, 0.3.0 as aya 0.14 pins it): it parses this file
//! (`Btf::from_sys_fs`, `Btf::parse`), but its public API stops at a type's id
//! (`Btf::id_by_type_name_kind`). Reaching a struct's members needs `Btf::type_by_id`,
//! `Btf::types`, `Struct::members` and `Btf::string_at`, which are all `pub(crate)` there, and
//! `BtfType::Struct`'s fields are private. So the member offsets cannot be had from it without
//! re-parsing its own serialised bytes, which is this reader again.
//!
//! Minimum kernel: 5.4 with `CONFIG_DEBUG_INFO_BTF`.

use std::path::{Path, PathBuf};

/// Where the running kernel's BTF lives (kernel 5.4+ with `CONFIG_DEBUG_INFO_BTF`).
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

/// BTF magic number (`BTF_MAGIC`).
const MAGIC: u16 = 0xeb9f;

// Type kinds (`BTF_KIND_*`).
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_FWD: u32 = 7;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC: u32 = 12;
const KIND_FLOAT: u32 = 16;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_ENUM64: u32 = 19;

/// Why the kernel's BTF gave no offsets.
#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    /// The file could not be read.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The data does not start with the little-endian BTF magic.
    #[error("not little-endian BTF (bad magic)")]
    BadMagic,
    /// A header field or record points past the end of the data.
    #[error("truncated BTF")]
    Truncated,
    /// A type kind this reader does not know (it may carry data that would be misread as types).
    #[error("unknown BTF kind {kind} (newer kernel?)")]
    UnknownKind {
        /// The `BTF_KIND_*` number.
        kind: u32,
    },
    /// No struct of that name with members.
    #[error("kernel BTF has no struct {ty}")]
    NoStruct {
        /// The struct.
        ty: &'static str,
    },
    /// The struct has no such member (also through anonymous members).
    #[error("kernel BTF: struct {ty} has no field {field}")]
    NoField {
        /// The struct.
        ty: &'static str,
        /// The member.
        field: &'static str,
    },
    /// The member is a bitfield, so it has no byte offset.
    #[error("kernel BTF: {ty}.{field} is a bitfield")]
    Bitfield {
        /// The struct.
        ty: &'static str,
        /// The member.
        field: &'static str,
    },
}

/// Byte offsets the sk_msg program needs, each within its struct.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockOffsets {
    /// `struct sock::sk_socket` (pointer to `struct socket`).
    pub sk_socket: u32,
    /// `struct socket::file` (pointer to `struct file`).
    pub socket_file: u32,
    /// `struct file::f_flags` (unsigned int, `O_NONBLOCK` among them).
    pub file_f_flags: u32,
    /// `struct sock::sk_sndtimeo` (long, jiffies; `LONG_MAX` without `SO_SNDTIMEO`).
    pub sk_sndtimeo: u32,
    /// `struct tcp_sock::write_seq` (u32).
    pub write_seq: u32,
    /// `struct inet_connection_sock::icsk_ulp_ops` (pointer).
    pub ulp_ops: u32,
    /// `struct sk_msg::sk_redir` (pointer).
    pub msg_sk_redir: u32,
    /// `struct sock::sk_wmem_queued` (int, bytes).
    pub wmem_queued: u32,
    /// `struct sock::sk_sndbuf` (int, bytes).
    pub sndbuf: u32,
}

/// Read [`SockOffsets`] from the BTF file at `path` (normally [`VMLINUX_BTF`]).
///
/// # Errors
/// [`BtfError`]: the file cannot be read, is not BTF, or lacks one of the structs or fields
/// (named).
pub fn sock_offsets(path: &Path) -> Result<SockOffsets, BtfError> {
    let data = std::fs::read(path).map_err(|source| BtfError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let btf = Btf::parse(&data)?;
    Ok(SockOffsets {
        sk_socket: btf.member_offset("sock", "sk_socket")?,
        socket_file: btf.member_offset("socket", "file")?,
        file_f_flags: btf.member_offset("file", "f_flags")?,
        sk_sndtimeo: btf.member_offset("sock", "sk_sndtimeo")?,
        write_seq: btf.member_offset("tcp_sock", "write_seq")?,
        ulp_ops: btf.member_offset("inet_connection_sock", "icsk_ulp_ops")?,
        msg_sk_redir: btf.member_offset("sk_msg", "sk_redir")?,
        wmem_queued: btf.member_offset("sock", "sk_wmem_queued")?,
        sndbuf: btf.member_offset("sock", "sk_sndbuf")?,
    })
}

/// Read the offset of `struct sock::sk_err` (an `int`: the socket's pending error, which the
/// sockops program reports with a failed connect-time connect) from the BTF file at `path`.
///
/// # Errors
/// [`BtfError`], as [`sock_offsets`].
pub fn sk_err_offset(path: &Path) -> Result<u32, BtfError> {
    let data = std::fs::read(path).map_err(|source| BtfError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Btf::parse(&data)?.member_offset("sock", "sk_err")
}

/// One struct or union: its name and members (name offset, type id, bit offset).
struct Composite {
    name_off: u32,
    members: Vec<(u32, u32, u32)>,
}

/// The decoded part of a BTF blob: composites by type id, and the string section.
struct Btf<'a> {
    strings: &'a [u8],
    /// Indexed by type id (id 0 is `void`); `None` for kinds other than struct and union.
    types: Vec<Option<Composite>>,
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Btf<'a>, BtfError> {
        let u16_at = |o: usize| data.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        let u32_at = |o: usize| {
            data.get(o..o + 4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        if u16_at(0) != Some(MAGIC) {
            return Err(BtfError::BadMagic);
        }
        let bad = || BtfError::Truncated;
        let hdr_len = u32_at(4).ok_or_else(bad)? as usize;
        let type_off = u32_at(8).ok_or_else(bad)? as usize;
        let type_len = u32_at(12).ok_or_else(bad)? as usize;
        let str_off = u32_at(16).ok_or_else(bad)? as usize;
        let str_len = u32_at(20).ok_or_else(bad)? as usize;
        let types_start = hdr_len + type_off;
        let types_end = types_start + type_len;
        let strings = data
            .get(hdr_len + str_off..hdr_len + str_off + str_len)
            .ok_or_else(bad)?;
        if types_end > data.len() {
            return Err(bad());
        }
        let mut types = vec![None];
        let mut o = types_start;
        while o < types_end {
            let name_off = u32_at(o).ok_or_else(bad)?;
            let info = u32_at(o + 4).ok_or_else(bad)?;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            o += 12;
            let extra = match kind {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => 12 * vlen,
                KIND_ENUM | KIND_FUNC_PROTO => 8 * vlen,
                KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
                | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => 0,
                // A kind this parser does not know may carry data it would misread as types.
                kind => return Err(BtfError::UnknownKind { kind }),
            };
            let composite = if matches!(kind, KIND_STRUCT | KIND_UNION) {
                let mut members = Vec::with_capacity(vlen);
                for m in 0..vlen {
                    let at = o + 12 * m;
                    let offset = u32_at(at + 8).ok_or_else(bad)?;
                    // With kind_flag set, the low 24 bits are the bit offset (the high 8 the
                    // bitfield size).
                    let bits = if kind_flag {
                        offset & 0x00ff_ffff
                    } else {
                        offset
                    };
                    members.push((
                        u32_at(at).ok_or_else(bad)?,
                        u32_at(at + 4).ok_or_else(bad)?,
                        bits,
                    ));
                }
                Some(Composite { name_off, members })
            } else {
                None
            };
            types.push(composite);
            o += extra;
        }
        Ok(Btf { strings, types })
    }

    fn name(&self, off: u32) -> &[u8] {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// Byte offset of `field` in the struct named `ty`, looking through anonymous members.
    fn member_offset(&self, ty: &'static str, field: &'static str) -> Result<u32, BtfError> {
        let found = self
            .types
            .iter()
            .flatten()
            .find(|c| self.name(c.name_off) == ty.as_bytes() && !c.members.is_empty());
        let composite = found.ok_or(BtfError::NoStruct { ty })?;
        let bits = self
            .find_member(composite, field.as_bytes(), 0)
            .ok_or(BtfError::NoField { ty, field })?;
        if !bits.is_multiple_of(8) {
            return Err(BtfError::Bitfield { ty, field });
        }
        Ok(bits / 8)
    }

    fn find_member(&self, c: &Composite, field: &[u8], depth: u32) -> Option<u32> {
        for &(name_off, type_id, bits) in &c.members {
            let name = self.name(name_off);
            if name == field {
                return Some(bits);
            }
            if name.is_empty()
                && depth < 4
                && let Some(Some(inner)) = self.types.get(type_id as usize)
                && let Some(b) = self.find_member(inner, field, depth + 1)
            {
                return Some(bits + b);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cross-checked by hand with `bpftool btf dump file /sys/kernel/btf/vmlinux format raw`
    /// (6.18 here: 288, 16, 40, 512); asserted loosely so other kernel builds pass too.
    #[test]
    fn running_kernel_offsets() {
        let path = Path::new(VMLINUX_BTF);
        if !path.exists() {
            eprintln!("skipped: {VMLINUX_BTF} is missing (kernel without CONFIG_DEBUG_INFO_BTF)");
            return;
        }
        let o = sock_offsets(path).expect("offsets");
        assert!(
            o.sk_socket > 100 && o.sk_socket < 1024 && o.sk_socket.is_multiple_of(8),
            "{o:?}"
        );
        assert!(
            o.socket_file < 128 && o.socket_file.is_multiple_of(8),
            "{o:?}"
        );
        assert!(o.file_f_flags < 256, "{o:?}");
        assert!(
            o.sk_sndtimeo > 100 && o.sk_sndtimeo < 1024 && o.sk_sndtimeo.is_multiple_of(8),
            "{o:?}"
        );
        // Both past the embedded struct sock, within a few KiB.
        assert!(o.write_seq > o.sk_socket && o.write_seq < 4096, "{o:?}");
        assert!(
            o.ulp_ops > o.sk_socket && o.ulp_ops < 4096 && o.ulp_ops.is_multiple_of(8),
            "{o:?}"
        );
        // Past the scatterlist ring at the start of struct sk_msg.
        assert!(
            o.msg_sk_redir > 100 && o.msg_sk_redir < 1024 && o.msg_sk_redir.is_multiple_of(8),
            "{o:?}"
        );
        for off in [o.wmem_queued, o.sndbuf] {
            assert!(off > 100 && off < 1024 && off.is_multiple_of(4), "{o:?}");
        }
        let err = sk_err_offset(path).expect("sk_err");
        assert!(err > 100 && err < 1024 && err.is_multiple_of(4), "{err}");
    }

    #[test]
    fn refuses_what_is_not_btf() {
        let dir = std::env::temp_dir().join(format!("lb-kbtf-{}", std::process::id()));
        std::fs::write(&dir, b"not btf at all").expect("write");
        let e = sock_offsets(&dir).expect_err("garbage").to_string();
        let _ = std::fs::remove_file(&dir);
        assert!(e.contains("magic"), "{e}");
        let e = sock_offsets(Path::new("/nonexistent/btf"))
            .expect_err("missing")
            .to_string();
        assert!(e.contains("/nonexistent/btf"), "{e}");
    }
}
