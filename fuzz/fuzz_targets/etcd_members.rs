//! An etcd member list answer's body (`lb::fuzz::etcd_members`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = lb::fuzz::etcd_members(data);
});
