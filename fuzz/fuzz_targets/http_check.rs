//! A server's answer to the http health check (`lb::fuzz::http_check`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::http_check(data);
});
