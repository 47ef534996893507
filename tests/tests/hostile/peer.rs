//! Hostile servers written with std sockets: a listener inside a test host's namespace
//! ([`Host::listen`]), each connection handled on a thread of its own by a behaviour the test
//! picks, with what each connection saw (how long it lived, bytes written and read) recorded.
//! Every loop is bounded (a stop flag checked every 50 ms, and 30 s per connection at most);
//! everything stops and is joined on drop.

use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::Result;
use lb_tests::Host;

/// Longest a connection is served.
const CONN_CAP: Duration = Duration::from_secs(30);
/// How often a blocked read or write looks at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// What one connection saw.
#[derive(Clone, Copy, Debug)]
pub struct Served {
    /// From accept until the behaviour ended (for most: until lb closed the connection).
    pub lifetime: Duration,
    /// Bytes the server wrote.
    pub written: u64,
    /// Bytes the server read.
    pub read: u64,
}

/// A connection as a behaviour sees it: the socket, the stop flag and its byte counts.
pub struct Conn {
    s: TcpStream,
    stop: Arc<AtomicBool>,
    start: Instant,
    written: u64,
    read: u64,
}

/// How a hostile server treats each connection.
pub type Behaviour = Arc<dyn Fn(&mut Conn) + Send + Sync>;

impl Conn {
    fn over(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.start.elapsed() > CONN_CAP
    }

    /// Read until the request head's blank line (or the end); false when it never came.
    pub fn read_head(&mut self) -> bool {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !self.over() {
            match self.s.read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => {
                    self.read += n as u64;
                    got.extend_from_slice(&buf[..n]);
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        return true;
                    }
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return false,
            }
        }
        false
    }

    /// Read (and count) until the peer closes or `within` passes; true when it closed.
    pub fn wait_closed(&mut self, within: Duration) -> bool {
        let start = Instant::now();
        let mut buf = [0u8; 65536];
        while !self.over() && start.elapsed() < within {
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(n) => self.read += n as u64,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return true,
            }
        }
        false
    }

    /// Write `bytes`; false once the peer is gone.
    pub fn write(&mut self, bytes: &[u8]) -> bool {
        let mut rest = bytes;
        while !rest.is_empty() && !self.over() {
            match self.s.write(rest) {
                Ok(0) => return false,
                Ok(n) => {
                    self.written += n as u64;
                    rest = &rest[n..];
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(_) => return false,
            }
        }
        rest.is_empty()
    }

    /// Write `chunk` again and again, one every `pace` (none: as fast as the peer takes them),
    /// until the peer is gone or `total` bytes are out.
    pub fn flood(&mut self, chunk: &[u8], total: u64, pace: Option<Duration>) {
        while self.written < total && !self.over() {
            if !self.write(chunk) {
                return;
            }
            if let Some(p) = pace {
                std::thread::sleep(p);
            }
        }
    }

    /// Stop sending (FIN), reading on.
    pub fn half_close(&mut self) {
        let _ = self.s.shutdown(std::net::Shutdown::Write);
    }
}

/// A hostile server on a test host.
pub struct Peer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    served: Arc<Mutex<Vec<Served>>>,
    accept: Option<JoinHandle<()>>,
}

impl Peer {
    /// Listen on `port` of `host` and serve each connection with `behave`.
    pub fn start(host: &Host, port: u16, behave: Behaviour) -> Result<Peer> {
        let l = host.listen(port)?;
        l.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(Mutex::new(Vec::new()));
        let (st, sv) = (stop.clone(), served.clone());
        let accept = std::thread::spawn(move || {
            let mut conns: Vec<JoinHandle<()>> = Vec::new();
            while !st.load(Ordering::Relaxed) {
                let Ok((s, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let (st, sv, behave) = (st.clone(), sv.clone(), behave.clone());
                conns.retain(|c| !c.is_finished());
                conns.push(std::thread::spawn(move || serve(s, st, &sv, &*behave)));
            }
            for c in conns {
                let _ = c.join();
            }
        });
        Ok(Peer {
            addr: host.addr(port),
            stop,
            served,
            accept: Some(accept),
        })
    }

    /// What every connection that ended saw, in the order they ended.
    pub fn served(&self) -> Vec<Served> {
        self.served.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

fn serve(
    s: TcpStream,
    stop: Arc<AtomicBool>,
    served: &Mutex<Vec<Served>>,
    behave: &dyn Fn(&mut Conn),
) {
    let _ = s.set_nonblocking(false);
    let _ = s.set_read_timeout(Some(TICK));
    let _ = s.set_write_timeout(Some(TICK));
    let mut c = Conn {
        s,
        stop,
        start: Instant::now(),
        written: 0,
        read: 0,
    };
    behave(&mut c);
    if let Ok(mut v) = served.lock() {
        v.push(Served {
            lifetime: c.start.elapsed(),
            written: c.written,
            read: c.read,
        });
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// 64 KiB that are not HTTP (nor anything else).
pub fn garbage() -> Vec<u8> {
    let mut x = 0x9e37_79b9_u32;
    (0..65536)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x.to_le_bytes()[0]
        })
        .collect()
}
