//! The configuration file: parsed and validated (`lb::fuzz::config`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::config(data);
});
