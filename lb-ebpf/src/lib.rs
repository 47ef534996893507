//! Empty library so that `lb-user` can name `lb-ebpf` as a build dependency; the programs are in
//! the `lb-ebpf` binary target, built for `bpfel-unknown-none` by `lb-user/build.rs`.
#![no_std]
