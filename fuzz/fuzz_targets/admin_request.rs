//! Raw HTTP/1.1 requests to the admin API: paths, queries and bodies (`lb::fuzz::admin_request`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::admin_request(data);
});
