//! What `file` says of a binary, read from its ELF header: a 64-bit little-endian executable
//! for the expected machine, statically linked (no `PT_INTERP`: no dynamic loader to find).

use anyhow::{Context as _, Result, ensure};

use crate::musl::Arch;

/// `PT_INTERP`: the program header naming the dynamic loader.
const PT_INTERP: u32 = 3;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Check that `bin` is a static 64-bit little-endian ELF executable for `arch`.
///
/// # Errors
/// Names what differs.
pub fn check(bin: &[u8], arch: &Arch) -> Result<()> {
    ensure!(
        bin.starts_with(b"\x7fELF") && bin.get(4) == Some(&2) && bin.get(5) == Some(&1),
        "not a 64-bit little-endian ELF file"
    );
    let machine = u16_at(bin, 18).context("truncated ELF header")?;
    ensure!(
        machine == arch.elf_machine,
        "ELF machine {machine}, where {} is {}",
        arch.triple,
        arch.elf_machine
    );
    let phoff = u64_at(bin, 32).context("truncated ELF header")?;
    let phentsize = u16_at(bin, 54).context("truncated ELF header")?;
    let phnum = u16_at(bin, 56).context("truncated ELF header")?;
    for i in 0..u64::from(phnum) {
        let at = usize::try_from(phoff + i * u64::from(phentsize))?;
        let kind = u32_at(bin, at).context("truncated program headers")?;
        ensure!(
            kind != PT_INTERP,
            "dynamically linked (it names a loader): not the static musl build"
        );
    }
    Ok(())
}
