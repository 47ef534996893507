//! An HTTP CONNECT proxy's answer head (`lb::fuzz::connect_answer`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::connect_answer(data);
});
