//! A hand-over frame from another lb (`lb::fuzz::handover`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::handover(data);
});
