//! A discovery file: JSON list, JSON object or TOML (`lb::fuzz::discovery_file`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::discovery_file(data);
});
