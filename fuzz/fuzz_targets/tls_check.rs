//! A server's answer to the tls health check's ClientHello (`lb::fuzz::tls_check`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::tls_check(data);
});
