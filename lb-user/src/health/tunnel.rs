//! The `tunnel` check: one long-lived WebSocket per server (`ws://` or `wss://`), pinged every
//! `interval`. The server is healthy while the socket is up and each pong arrives within
//! `timeout`; it is recorded unhealthy the moment the socket drops or a pong is late, and the
//! tunnel reconnects with backoff (`fast_interval` doubling up to `down_interval`).

use std::{collections::HashMap, sync::Arc, time::Duration};

use futures::{SinkExt as _, StreamExt as _};
use hyper::{body::Bytes, header::HOST};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    sync::{mpsc, oneshot},
    time::{Instant, sleep_until, timeout},
};
use tokio_tungstenite::{
    WebSocketStream, client_async,
    tungstenite::{Message, client::IntoClientRequest as _},
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::{CheckError, Shared, connect_tcp, http::target, jittered, tls};
use crate::{
    addr::ServerAddr, balancer::Balancer, config::HealthConfig, metrics::InflightGuard, net::Route,
};

/// A byte stream a WebSocket runs over: plain TCP or TLS.
pub(super) trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

type Ws = WebSocketStream<Box<dyn Io>>;

/// Answer to an on-demand ping: `Err` carries the reason.
type Reply = oneshot::Sender<Result<Duration, String>>;

/// Open the WebSocket to `server` as `cfg.url` says (the caller bounds the time).
///
/// # Errors
/// Connect, TLS or WebSocket handshake failures.
async fn connect(cfg: &HealthConfig, server: &ServerAddr, route: &Route) -> Result<Ws, CheckError> {
    let t = target(cfg.url.as_deref(), server, "ws", "wss")?;
    let tcp = connect_tcp(&super::http::connect_to(&t, server), route).await?;
    let io: Box<dyn Io> = if t.tls {
        Box::new(tls::handshake(cfg, &t.host, tcp, Some(&["http/1.1"])).await?)
    } else {
        Box::new(tcp)
    };
    let scheme = if t.tls { "wss" } else { "ws" };
    let mut req = format!("{scheme}://{}{}", t.authority, t.path).into_client_request()?;
    if let Some(host) = &cfg.host {
        let value = host
            .parse()
            .map_err(|_| CheckError::BadName(host.clone()))?;
        req.headers_mut().insert(HOST, value);
    }
    let (ws, _response) = client_async(req, io).await?;
    Ok(ws)
}

/// Send one ping and wait for its pong (the caller bounds the time).
async fn ping_pong(ws: &mut Ws, payload: Bytes) -> Result<(), CheckError> {
    ws.send(Message::Ping(payload.clone())).await?;
    loop {
        match ws.next().await {
            Some(Ok(Message::Pong(p))) if p == payload => return Ok(()),
            Some(Ok(Message::Close(_))) | None => return Err(CheckError::TunnelClosed),
            Some(Err(e)) => return Err(e.into()),
            Some(Ok(_)) => {}
        }
    }
}

/// A one-off tunnel check (no tunnel is kept: `health.loop = false` or a direct call): connect,
/// one ping, its pong, close.
///
/// # Errors
/// Why the tunnel could not be opened or did not answer.
pub(super) async fn check_once(
    cfg: &HealthConfig,
    server: &ServerAddr,
    route: &Route,
) -> Result<(), CheckError> {
    let mut ws = connect(cfg, server, route).await?;
    let result = ping_pong(&mut ws, Bytes::from_static(b"lb-check")).await;
    // Best effort: a peer that stopped reading must not hold the check past its result.
    let _ = timeout(Duration::from_millis(100), ws.close(None)).await;
    result
}

/// One running tunnel.
#[derive(Debug)]
struct Handle {
    cfg: HealthConfig,
    route: Route,
    cancel: CancellationToken,
    pings: mpsc::Sender<Reply>,
}

/// The tunnels of every balancer, keyed by (balancer, server).
#[derive(Debug, Default)]
pub(super) struct Tunnels {
    map: std::sync::Mutex<HashMap<(String, ServerAddr), Handle>>,
}

impl Tunnels {
    /// Keep exactly one tunnel per server in `specs` for `balancer`, restarting those whose
    /// config changed and closing those of servers that left.
    pub(super) fn ensure(
        &self,
        shared: &Arc<Shared>,
        balancer: &Arc<Balancer>,
        specs: &[ServerAddr],
        cfg: &HealthConfig,
        route: &Route,
    ) {
        let mut map = self.map.lock().expect("poisoned");
        map.retain(|(b, s), h| {
            let keep = *b != balancer.name
                || (specs.contains(s)
                    && h.cfg == *cfg
                    && h.route == *route
                    && !h.cancel.is_cancelled());
            if !keep {
                h.cancel.cancel();
            }
            keep
        });
        for spec in specs {
            let key = (balancer.name.clone(), spec.clone());
            if map.contains_key(&key) {
                continue;
            }
            let cancel = CancellationToken::new();
            let (tx, rx) = mpsc::channel(16);
            let task = Tunnel {
                shared: shared.clone(),
                balancer: balancer.clone(),
                spec: spec.clone(),
                cfg: cfg.clone(),
                route: route.clone(),
                cancel: cancel.clone(),
                pings: rx,
            };
            shared.tasks.spawn(task.run());
            map.insert(
                key,
                Handle {
                    cfg: cfg.clone(),
                    route: route.clone(),
                    cancel,
                    pings: tx,
                },
            );
        }
    }

    /// Close every tunnel of `balancer`.
    pub(super) fn stop(&self, balancer: &str) {
        self.map.lock().expect("poisoned").retain(|(b, _), h| {
            if b == balancer {
                h.cancel.cancel();
            }
            b != balancer
        });
    }

    /// Ping `server` over its running tunnel now; `None` when it has no tunnel.
    pub(super) fn ping(
        &self,
        balancer: &str,
        server: &ServerAddr,
    ) -> Option<impl Future<Output = Result<(), CheckError>> + use<>> {
        let pings = self
            .map
            .lock()
            .expect("poisoned")
            .get(&(balancer.to_string(), server.clone()))?
            .pings
            .clone();
        Some(async move {
            let (tx, rx) = oneshot::channel();
            pings
                .send(tx)
                .await
                .map_err(|_| CheckError::Tunnel("tunnel stopped".into()))?;
            match rx.await {
                Ok(Ok(_rtt)) => Ok(()),
                Ok(Err(reason)) => Err(CheckError::Tunnel(reason)),
                Err(_) => Err(CheckError::Tunnel("tunnel stopped".into())),
            }
        })
    }
}

/// The ping outstanding on a tunnel.
struct Pending {
    payload: Bytes,
    sent: Instant,
    periodic: bool,
    waiters: Vec<Reply>,
    /// Periodic pings count as running checks; on-demand ones are counted by their caller.
    _inflight: Option<InflightGuard>,
}

/// The task that keeps one tunnel.
struct Tunnel {
    shared: Arc<Shared>,
    balancer: Arc<Balancer>,
    spec: ServerAddr,
    cfg: HealthConfig,
    route: Route,
    cancel: CancellationToken,
    pings: mpsc::Receiver<Reply>,
}

impl Tunnel {
    fn first_backoff(&self) -> Duration {
        self.cfg
            .fast_interval
            .map_or(self.cfg.interval.0 / 2, |d| d.0)
            .min(self.max_backoff())
    }

    fn max_backoff(&self) -> Duration {
        self.cfg
            .down_interval
            .map_or(self.cfg.interval.0, |d| d.0)
            .max(self.cfg.interval.0)
    }

    fn record(&self, result: Result<(), CheckError>, took: Duration) {
        self.shared.record(&self.balancer, &self.spec, result, took);
    }

    async fn run(mut self) {
        let mut backoff = self.first_backoff();
        loop {
            let start = Instant::now();
            let connected = tokio::select! {
                () = self.cancel.cancelled() => return,
                r = timeout(self.cfg.timeout.0, connect(&self.cfg, &self.spec, &self.route)) => {
                    r.unwrap_or(Err(CheckError::Timeout(self.cfg.timeout.0)))
                }
            };
            match connected {
                Ok(ws) => {
                    info!(balancer = %self.balancer.name, server = %self.spec, "tunnel up");
                    self.record(Ok(()), start.elapsed());
                    backoff = self.first_backoff();
                    let Some(err) = self.session(ws).await else {
                        return;
                    };
                    info!(balancer = %self.balancer.name, server = %self.spec, error = %err, "tunnel down");
                    self.record(Err(err), Duration::ZERO);
                }
                Err(e) => {
                    debug!(balancer = %self.balancer.name, server = %self.spec, error = %e, "tunnel connect failed");
                    self.record(Err(e), start.elapsed());
                }
            }
            let until = Instant::now() + jittered(backoff);
            backoff = (backoff * 2).min(self.max_backoff());
            loop {
                tokio::select! {
                    () = self.cancel.cancelled() => return,
                    () = sleep_until(until) => break,
                    Some(reply) = self.pings.recv() => {
                        let _ = reply.send(Err("tunnel is down".into()));
                    }
                }
            }
        }
    }

    /// Ping every interval until the tunnel fails (`Some(why)`) or is cancelled (`None`).
    async fn session(&mut self, mut ws: Ws) -> Option<CheckError> {
        let interval = self.cfg.interval.0;
        let limit = self.cfg.timeout.0;
        let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut seq = 0u64;
        let mut pending: Option<Pending> = None;
        let far = Instant::now() + Duration::from_secs(86_400 * 365);
        let failure = loop {
            let deadline = pending.as_ref().map_or(far, |p| p.sent + limit);
            let mut send: Option<(bool, Option<Reply>)> = None;
            tokio::select! {
                () = self.cancel.cancelled() => {
                    let _ = timeout(Duration::from_millis(100), ws.close(None)).await;
                    return None;
                }
                msg = ws.next() => match msg {
                    Some(Ok(Message::Pong(p))) => {
                        if let Some(done) = pending.take_if(|x| x.payload == p) {
                            let rtt = done.sent.elapsed();
                            if done.periodic {
                                self.record(Ok(()), rtt);
                            }
                            for w in done.waiters {
                                let _ = w.send(Ok(rtt));
                            }
                        }
                    }
                    Some(Ok(Message::Close(_))) | None => break CheckError::TunnelClosed,
                    Some(Err(e)) => break e.into(),
                    Some(Ok(_)) => {}
                },
                _ = tick.tick() => {
                    if pending.is_none() {
                        send = Some((true, None));
                    }
                }
                Some(reply) = self.pings.recv() => match &mut pending {
                    Some(p) => p.waiters.push(reply),
                    None => send = Some((false, Some(reply))),
                },
                () = sleep_until(deadline) => break CheckError::PongTimeout(limit),
            }
            if let Some((periodic, waiter)) = send {
                seq += 1;
                let payload = Bytes::from(seq.to_be_bytes().to_vec());
                let p = Pending {
                    payload: payload.clone(),
                    sent: Instant::now(),
                    periodic,
                    waiters: waiter.into_iter().collect(),
                    _inflight: periodic.then(|| self.shared.metrics.inflight_guard()),
                };
                pending = Some(p);
                match timeout(limit, ws.send(Message::Ping(payload))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => break e.into(),
                    Err(_) => break CheckError::PongTimeout(limit),
                }
            }
        };
        if let Some(p) = pending {
            for w in p.waiters {
                let _ = w.send(Err(failure.to_string()));
            }
        }
        Some(failure)
    }
}
