//! The one HTTP/1.1 server behind every port gpufit listens on: the
//! sidecar's API, the controller's API + `/metrics`, and the admission
//! webhook (over TLS). Each caller brings its routes (a handler) and a
//! [`ServeConfig`]; this module owns how connections are held:
//!
//! - **A connection cap below the descriptor limit.** At the first server
//!   the soft `RLIMIT_NOFILE` is raised to the hard one; every server's cap
//!   is lowered to that limit less [`ServeConfig::fd_reserve`] (said once in
//!   the log), and all servers of the process share that budget. Past a cap
//!   the oldest idle connection is closed to make room; a newcomer is
//!   refused only when every held connection is answering a request.
//! - **Timeouts.** A connection must send a complete request head within
//!   [`ServeConfig::idle_timeout`] of opening or of its last answer (hyper's
//!   header-read timer, which starts when the connection begins waiting, so
//!   one limit closes an idle keep-alive connection and a client trickling
//!   its head alike); a TLS client must finish its handshake within
//!   [`ServeConfig::tls_handshake_timeout`]. Once the head is in, the
//!   body must be in within [`ServeConfig::body_timeout`]: a stalled body
//!   is cut off, its request answered 408 and its connection closed
//!   ([`Body`]). So the whole request (head and body) is read in bounded
//!   time on every server, whatever its handler does with the body.
//! - **A stalled body holds no place.** A connection whose only request is
//!   still waiting for body bytes counts as idle when a newcomer needs its
//!   place: it is answered 408 and closed, so thousands of clients that
//!   send a head and one byte cannot keep new requests out until their
//!   timeout.
//! - **Accept errors** (out of descriptors and the like) back off, free a
//!   descriptor by closing the oldest idle connection, and are logged at most
//!   once a second per error kind, with the count of those left out.
//! - **Graceful drain**: when the caller's shutdown future resolves, the
//!   listener closes, idle connections close, and requests in flight get up
//!   to [`ServeConfig::drain_timeout`] to finish.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// What every handler answers.
pub type Reply = Response<Full<Bytes>>;

/// How one server treats its connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// Names the server in its log lines (`sidecar`, `controller`, `webhook`).
    pub name: &'static str,
    /// Most connections held at once; lowered to the descriptor limit less
    /// [`Self::fd_reserve`].
    pub max_connections: usize,
    /// Descriptors kept out of every connection cap: the process's own
    /// files, history database and outgoing connections.
    pub fd_reserve: u64,
    /// A connection that sends no complete request head this long after it
    /// opened, or after its last answer, is closed.
    pub idle_timeout: Duration,
    /// A TLS client that has not finished its handshake this long after
    /// connecting is dropped.
    pub tls_handshake_timeout: Duration,
    /// A request whose body is not in this long after its head is
    /// answered 408 and its connection closed.
    pub body_timeout: Duration,
    /// How long requests in flight may still run after shutdown.
    pub drain_timeout: Duration,
    /// First pause after a failed accept; doubled on each failure in a row.
    pub accept_backoff: Duration,
    /// Longest pause after failed accepts.
    pub max_accept_backoff: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            name: "http",
            max_connections: 4096,
            fd_reserve: 128,
            idle_timeout: Duration::from_secs(30),
            tls_handshake_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
            accept_backoff: Duration::from_millis(5),
            // Short enough that a probe queued behind a descriptor shortage
            // is still answered within a probe's timeout.
            max_accept_backoff: Duration::from_millis(100),
        }
    }
}

/// Raises the soft open-file limit to the hard one, once per process, and
/// returns the soft limit then in force (None where it cannot be read).
pub fn descriptor_limit() -> Option<u64> {
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    *LIMIT.get_or_init(raise_descriptor_limit)
}

fn raise_descriptor_limit() -> Option<u64> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};
    let (soft, hard) = match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the open-file limit: connection caps are not checked against it");
            return None;
        }
    };
    // Linux refuses an infinite RLIMIT_NOFILE; its own ceiling is nr_open.
    let target = if hard == RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(soft)
    } else {
        hard
    };
    if target <= soft {
        return Some(soft);
    }
    match setrlimit(Resource::RLIMIT_NOFILE, target, hard) {
        Ok(()) => Some(target),
        Err(e) => {
            tracing::warn!(error = %e, soft, hard, "cannot raise the open-file limit to the hard one: connection caps follow the soft one");
            Some(soft)
        }
    }
}

/// The descriptors connections may use under `limit`: the limit less the
/// reserve, the reserve being at most half the limit.
fn budget(limit: u64, reserve: u64) -> usize {
    let b = limit.saturating_sub(reserve.min(limit / 2)).max(1);
    usize::try_from(b).unwrap_or(usize::MAX)
}

/// The connection cap of a server under `limit`, and whether it was lowered.
fn effective_cap(cfg: &ServeConfig, limit: Option<u64>) -> (usize, usize, bool) {
    let wanted = cfg.max_connections.max(1);
    let budget = limit.map_or(usize::MAX, |l| budget(l, cfg.fd_reserve));
    (wanted.min(budget), budget, wanted > budget)
}

// === the connections held, all servers of the process together ===

/// One held connection: whether it is answering a request, how to ask it
/// to close, and whether it was asked (its descriptor is freed only when
/// its task ends, so it still counts until then).
struct Slot {
    server: u64,
    busy: Arc<AtomicUsize>,
    /// Of the requests in flight, those still waiting for body bytes.
    reading: Arc<AtomicUsize>,
    close: Arc<Notify>,
    closing: bool,
}

impl Slot {
    /// Whether closing the connection loses no answer being computed: no
    /// request in flight, or only requests still waiting for their body
    /// (those are answered 408).
    fn idle(&self) -> bool {
        let busy = self.busy.load(Ordering::Acquire);
        busy == 0 || busy <= self.reading.load(Ordering::Acquire)
    }
}

#[derive(Default)]
struct Held {
    next_id: u64,
    /// By id, so oldest first.
    slots: BTreeMap<u64, Slot>,
    /// Open slots (not closing) by server.
    per_server: HashMap<u64, usize>,
    /// Slots asked to close whose descriptor is not yet freed.
    closing: usize,
}

impl Held {
    /// Asks the oldest idle connection (of `server` when given) to close.
    fn evict_oldest_idle(&mut self, server: Option<u64>) -> bool {
        let victim = self
            .slots
            .values_mut()
            .find(|s| !s.closing && server.is_none_or(|id| s.server == id) && s.idle());
        match victim {
            Some(slot) => {
                slot.closing = true;
                slot.close.notify_one();
                let server = slot.server;
                self.closing += 1;
                if let Some(n) = self.per_server.get_mut(&server) {
                    *n = n.saturating_sub(1);
                }
                true
            }
            None => false,
        }
    }

    fn remove(&mut self, id: u64) {
        let Some(slot) = self.slots.remove(&id) else {
            return;
        };
        if slot.closing {
            self.closing = self.closing.saturating_sub(1);
        } else if let Some(n) = self.per_server.get_mut(&slot.server) {
            *n = n.saturating_sub(1);
        }
    }

    /// Open slots (not closing) of `server` and of all servers.
    fn open(&self, server: u64) -> (usize, usize) {
        let mine = self.per_server.get(&server).copied().unwrap_or(0);
        (mine, self.slots.len().saturating_sub(self.closing))
    }
}

/// What [`Registry::admit`] decided.
enum Admit {
    Yes(SlotGuard),
    /// Every held connection is answering a request: refuse the newcomer.
    Refused,
    /// Too many connections are still closing: wait for their descriptors.
    Wait,
}

/// Every connection the process's servers hold: descriptors are a
/// per-process resource, so one server's idle clients can make room for
/// another's.
#[derive(Default)]
struct Registry {
    held: Mutex<Held>,
    /// Signalled each time a connection's descriptor is freed.
    released: Notify,
}

/// A held connection's place; dropping it gives the place back.
struct SlotGuard {
    registry: Arc<Registry>,
    id: u64,
    busy: Arc<AtomicUsize>,
    reading: Arc<AtomicUsize>,
    close: Arc<Notify>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.registry.lock().remove(self.id);
        self.registry.released.notify_waiters();
    }
}

impl Registry {
    fn global() -> Arc<Registry> {
        static REGISTRY: OnceLock<Arc<Registry>> = OnceLock::new();
        REGISTRY.get_or_init(Arc::default).clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection of `server`: past the server's cap its
    /// own oldest idle connection is asked to close, past the process's
    /// budget the oldest idle one of any server. A closing connection keeps
    /// its descriptor until its task ends, so at most `max_closing` may be
    /// closing at once: past that the newcomer waits.
    fn admit(
        self: &Arc<Self>,
        server: u64,
        cap: usize,
        budget: usize,
        max_closing: usize,
    ) -> Admit {
        let mut held = self.lock();
        let (mine, total) = held.open(server);
        let over_cap = mine >= cap;
        let over_budget = total >= budget;
        if (over_cap || over_budget) && held.closing >= max_closing {
            return Admit::Wait;
        }
        if over_cap && !held.evict_oldest_idle(Some(server)) {
            return Admit::Refused;
        }
        if over_budget && !over_cap && !held.evict_oldest_idle(None) {
            return Admit::Refused;
        }
        held.next_id += 1;
        let id = held.next_id;
        let busy = Arc::new(AtomicUsize::new(0));
        let reading = Arc::new(AtomicUsize::new(0));
        let close = Arc::new(Notify::new());
        held.slots.insert(
            id,
            Slot {
                server,
                busy: busy.clone(),
                reading: reading.clone(),
                close: close.clone(),
                closing: false,
            },
        );
        *held.per_server.entry(server).or_default() += 1;
        Admit::Yes(SlotGuard {
            registry: self.clone(),
            id,
            busy,
            reading,
            close,
        })
    }

    /// [`Self::admit`], waiting while connections are still closing.
    async fn admit_or_wait(
        self: &Arc<Self>,
        server: u64,
        cap: usize,
        budget: usize,
        max_closing: usize,
    ) -> Option<SlotGuard> {
        loop {
            let released = self.released.notified();
            match self.admit(server, cap, budget, max_closing) {
                Admit::Yes(g) => return Some(g),
                Admit::Refused => return None,
                // The timeout covers a release between `admit` and the wait.
                Admit::Wait => {
                    let _ = tokio::time::timeout(Duration::from_millis(20), released).await;
                }
            }
        }
    }
}

// === accept errors ===

/// Which accept errors count as one kind in the log.
type ErrorKey = (Option<i32>, std::io::ErrorKind);

/// Rate limit of the accept-error log: at most one line per `every` per
/// error kind; the lines left out are counted into the next one.
#[derive(Debug)]
struct AcceptLog {
    every: Duration,
    kinds: HashMap<ErrorKey, (Instant, u64)>,
}

impl AcceptLog {
    fn new(every: Duration) -> Self {
        AcceptLog {
            every,
            kinds: HashMap::new(),
        }
    }

    /// Some(lines left out since the last one) when `e` is to be logged now.
    fn note(&mut self, e: &std::io::Error, now: Instant) -> Option<u64> {
        let key = (e.raw_os_error(), e.kind());
        match self.kinds.get_mut(&key) {
            Some((last, skipped)) if now.duration_since(*last) < self.every => {
                *skipped += 1;
                None
            }
            Some((last, skipped)) => {
                *last = now;
                Some(std::mem::take(skipped))
            }
            None => {
                self.kinds.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// Out of descriptors (process or system): closing an idle connection frees one.
fn out_of_descriptors(e: &std::io::Error) -> bool {
    use nix::errno::Errno;
    matches!(e.raw_os_error(), Some(c) if c == Errno::EMFILE as i32 || c == Errno::ENFILE as i32)
}

// === serving ===

/// Each server's id in the registry.
fn next_server_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Serves `handler` on `listener` (over TLS when `tls` is given) until
/// `shutdown` resolves, then drains (see the module's documentation).
pub async fn serve<H, F>(
    listener: TcpListener,
    cfg: &ServeConfig,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let name = cfg.name;
    let limit = descriptor_limit();
    let (cap, budget, lowered) = effective_cap(cfg, limit);
    if lowered {
        tracing::warn!(
            server = name,
            wanted = cfg.max_connections,
            cap,
            limit = limit.unwrap_or(0),
            reserve = cfg.fd_reserve,
            "connection cap lowered to the open-file limit less the reserve: raise LimitNOFILE / ulimit -n to hold more"
        );
    }
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(server = name, %addr, cap, "listening");
    }
    let registry = Registry::global();
    // Closing connections hold descriptors beyond the budget: half the
    // reserve at most.
    let max_closing = usize::try_from(cfg.fd_reserve / 2).unwrap_or(64).max(1);
    let server = next_server_id();
    let handler = Arc::new(handler);
    let graceful = GracefulShutdown::new();
    let mut conns = tokio::task::JoinSet::new();
    let mut errors = AcceptLog::new(Duration::from_secs(1));
    let mut backoff = cfg.accept_backoff;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    backoff = cfg.accept_backoff;
                    let slot = registry.admit_or_wait(server, cap, budget, max_closing).await;
                    let Some(slot) = slot else {
                        tracing::debug!(server = name, "every connection busy: refusing one");
                        continue; // drops the stream
                    };
                    conns.spawn(connection(
                        stream,
                        slot,
                        tls.clone(),
                        handler.clone(),
                        graceful.watcher(),
                        cfg.clone(),
                    ));
                }
                Err(e) => {
                    if let Some(skipped) = errors.note(&e, Instant::now()) {
                        tracing::warn!(server = name, error = %e, repeats_not_logged = skipped, "accept failed; backing off");
                    }
                    if out_of_descriptors(&e) {
                        registry.lock().evict_oldest_idle(None);
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(cfg.max_accept_backoff);
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let drained = tokio::time::timeout(cfg.drain_timeout, async {
        graceful.shutdown().await;
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            server = name,
            open = conns.len(),
            "requests still running after the drain timeout: closing them"
        );
        conns.shutdown().await;
    }
}

/// One connection: the TLS handshake when asked, then HTTP/1.1 until the
/// client goes, the idle timeout, a shutdown, or its slot being taken back.
async fn connection<H, F>(
    stream: tokio::net::TcpStream,
    slot: SlotGuard,
    tls: Option<tokio_rustls::TlsAcceptor>,
    handler: Arc<H>,
    watcher: Watcher,
    cfg: ServeConfig,
) where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    let _ = stream.set_nodelay(true);
    let evicted = Arc::new(AtomicBool::new(false));
    let abort = Arc::new(Abort::default());
    let http = Http {
        busy: slot.busy.clone(),
        reading: slot.reading.clone(),
        abort: abort.clone(),
        evicted: evicted.clone(),
        handler,
        watcher,
        idle_timeout: cfg.idle_timeout,
        body_timeout: cfg.body_timeout,
    };
    let run = async move {
        match tls {
            None => http.serve(TokioIo::new(stream)).await,
            Some(acceptor) => {
                match tokio::time::timeout(cfg.tls_handshake_timeout, acceptor.accept(stream)).await
                {
                    Ok(Ok(s)) => http.serve(TokioIo::new(s)).await,
                    Ok(Err(e)) => {
                        tracing::debug!(server = cfg.name, error = %e, "TLS handshake failed")
                    }
                    Err(_) => tracing::debug!(server = cfg.name, "TLS handshake timed out"),
                }
            }
        }
    };
    tokio::pin!(run);
    tokio::select! {
        _ = &mut run => {}
        _ = slot.close.notified() => {
            // Taken back to make room: an idle connection closes now; one
            // that just started a request answers it, then closes; one
            // whose request waits for its body has it cut off (408).
            evicted.store(true, Ordering::Release);
            if slot.busy.load(Ordering::Acquire) > 0 {
                abort.fire();
                run.await;
            }
        }
    }
}

/// What serving HTTP on one connection needs.
struct Http<H> {
    busy: Arc<AtomicUsize>,
    reading: Arc<AtomicUsize>,
    abort: Arc<Abort>,
    evicted: Arc<AtomicBool>,
    handler: Arc<H>,
    watcher: Watcher,
    idle_timeout: Duration,
    body_timeout: Duration,
}

/// Counts a request in flight for as long as it lives (also when the
/// connection drops it).
struct Busy(Arc<AtomicUsize>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl<H, F> Http<H>
where
    H: Fn(Request<Body>) -> F + Send + Sync + 'static,
    F: Future<Output = Reply> + Send + 'static,
{
    async fn serve<I>(self, io: I)
    where
        I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let Http {
            busy,
            reading,
            abort,
            evicted,
            handler,
            watcher,
            idle_timeout,
            body_timeout,
        } = self;
        let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
            busy.fetch_add(1, Ordering::AcqRel);
            let guard = Busy(busy.clone());
            let cut = Arc::new(AtomicBool::new(false));
            let req = req
                .map(|b| Body::new(b, body_timeout, abort.clone(), reading.clone(), cut.clone()));
            let fut = handler(req);
            let evicted = evicted.clone();
            async move {
                let mut resp = fut.await;
                let cut = cut.load(Ordering::Acquire);
                if cut {
                    // Whatever the handler made of a body it never got.
                    resp = body_timed_out(body_timeout);
                }
                if cut || evicted.load(Ordering::Acquire) {
                    resp.headers_mut().insert(
                        hyper::header::CONNECTION,
                        hyper::header::HeaderValue::from_static("close"),
                    );
                }
                drop(guard);
                Ok::<_, Infallible>(resp)
            }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(idle_timeout)
            .serve_connection(io, svc);
        if let Err(e) = watcher.watch(conn).await {
            tracing::debug!(error = %e, "connection ended with an error");
        }
    }
}

// === request bodies ===

/// Cuts off the body a connection's request is waiting for (the connection
/// was taken back to make room). One request at a time per HTTP/1.1
/// connection, so one waker.
#[derive(Default)]
struct Abort {
    fired: AtomicBool,
    waker: futures::task::AtomicWaker,
}

impl Abort {
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        self.waker.wake();
    }
}

/// Why a request's body could not be read whole.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("the request body was not sent within {0:?} of its head: send the body at once")]
    TimedOut(Duration),
    #[error("the request body was still incomplete when the server needed the connection's place")]
    Evicted,
    #[error("cannot read the request body: {0}")]
    Read(#[from] hyper::Error),
}

/// A request's body as every handler reads it: hyper's, cut off with
/// [`BodyError`] once [`ServeConfig::body_timeout`] has passed since the
/// head, or when its connection is taken back while waiting for it. Either
/// way the request is answered 408 and its connection closed, whatever the
/// handler answered. While the body is incomplete, the request does not
/// keep its connection's place ([`Slot::idle`]).
pub struct Body {
    inner: Incoming,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
    abort: Arc<Abort>,
    /// The connection's count of requests waiting for body bytes; Some
    /// while this one is counted in it.
    reading: Option<Arc<AtomicUsize>>,
    /// Set when the body was cut off.
    cut: Arc<AtomicBool>,
}

impl Body {
    fn new(
        inner: Incoming,
        timeout: Duration,
        abort: Arc<Abort>,
        reading: Arc<AtomicUsize>,
        cut: Arc<AtomicBool>,
    ) -> Self {
        use hyper::body::Body as _;
        let reading = (!inner.is_end_stream()).then(|| {
            reading.fetch_add(1, Ordering::AcqRel);
            reading
        });
        Body {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            abort,
            reading,
            cut,
        }
    }

    /// The body is whole (or failed): no longer waiting for bytes.
    fn done(&mut self) {
        if let Some(r) = self.reading.take() {
            r.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        self.done();
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BodyError>>> {
        use std::task::Poll;
        let this = self.get_mut();
        if this.cut.load(Ordering::Acquire) {
            return Poll::Ready(None);
        }
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                this.done();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                if hyper::body::Body::is_end_stream(&this.inner) {
                    this.done();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.done();
                Poll::Ready(Some(Err(BodyError::Read(e))))
            }
            Poll::Pending => {
                // Registered before the check, so a fire in between wakes us.
                this.abort.waker.register(cx.waker());
                let why = if this.abort.fired.load(Ordering::Acquire) {
                    BodyError::Evicted
                } else if this.deadline.as_mut().poll(cx).is_ready() {
                    BodyError::TimedOut(this.timeout)
                } else {
                    return Poll::Pending;
                };
                this.cut.store(true, Ordering::Release);
                this.done();
                Poll::Ready(Some(Err(why)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.cut.load(Ordering::Acquire) || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The answer to a request whose body was cut off.
fn body_timed_out(timeout: Duration) -> Reply {
    let msg = serde_json::json!({
        "error": format!("request timeout: the whole request (head and body) must arrive within {timeout:?} of its head; send the body at once")
    });
    let mut r = Response::new(Full::new(Bytes::from(msg.to_string())));
    *r.status_mut() = hyper::StatusCode::REQUEST_TIMEOUT;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(code: i32) -> std::io::Error {
        std::io::Error::from_raw_os_error(code)
    }

    #[test]
    fn accept_errors_are_logged_once_a_second_per_kind_with_the_rest_counted() {
        let mut log = AcceptLog::new(Duration::from_secs(1));
        let t0 = Instant::now();
        let emfile = nix::errno::Errno::EMFILE as i32;
        let enfile = nix::errno::Errno::ENFILE as i32;
        assert_eq!(log.note(&err(emfile), t0), Some(0));
        // Another kind has its own budget.
        assert_eq!(log.note(&err(enfile), t0), Some(0));
        let logged = (1..1000)
            .filter(|i| {
                log.note(&err(emfile), t0 + Duration::from_micros(900 * i))
                    .is_some()
            })
            .count();
        assert_eq!(logged, 0, "within the second");
        assert_eq!(
            log.note(&err(emfile), t0 + Duration::from_millis(1000)),
            Some(999)
        );
        assert_eq!(
            log.note(&err(enfile), t0 + Duration::from_millis(1000)),
            Some(0)
        );
    }

    #[test]
    fn the_cap_stays_below_the_descriptor_limit_less_the_reserve() {
        let cfg = ServeConfig {
            max_connections: 1024,
            fd_reserve: 128,
            ..ServeConfig::default()
        };
        assert_eq!(effective_cap(&cfg, Some(1024)), (896, 896, true));
        assert_eq!(effective_cap(&cfg, Some(65_536)), (1024, 65_408, false));
        assert_eq!(effective_cap(&cfg, None).0, 1024);
        // A tiny limit keeps half for connections rather than none.
        assert_eq!(effective_cap(&cfg, Some(100)).0, 50);
        assert!(descriptor_limit().is_some_and(|l| l > 0));
    }

    #[test]
    fn past_the_cap_the_oldest_idle_connection_makes_room() {
        let reg = Arc::new(Registry::default());
        let admit = |server, cap, budget| match reg.admit(server, cap, budget, 1) {
            Admit::Yes(g) => Ok(g),
            Admit::Refused => Err("refused"),
            Admit::Wait => Err("wait"),
        };
        let a = admit(1, 2, 100).expect("first");
        let b = admit(1, 2, 100).expect("second");
        b.busy.fetch_add(1, Ordering::AcqRel);
        let c = admit(1, 2, 100).expect("third takes the idle first's place");
        // The first was asked to close (a stored permit).
        let first_close = a.close.clone();
        assert!(futures::FutureExt::now_or_never(first_close.notified()).is_some());
        c.busy.fetch_add(1, Ordering::AcqRel);
        // The first still holds its descriptor: the next waits for it.
        assert_eq!(admit(1, 2, 100).err(), Some("wait"));
        drop(a);
        // Both held ones busy: the next is refused.
        assert_eq!(admit(1, 2, 100).err(), Some("refused"));
        // Another server under its own cap, but the process budget is
        // spent: the newcomer is refused while every held one is busy.
        assert_eq!(admit(2, 10, 2).err(), Some("refused"));
        c.busy.fetch_sub(1, Ordering::AcqRel);
        let d = admit(2, 10, 2).expect("an idle one of another server goes");
        assert_eq!(reg.lock().slots.len(), 3, "the closing one still counts");
        drop(c);
        assert_eq!(reg.lock().slots.len(), 2);
        drop((b, d));
        let held = reg.lock();
        assert_eq!((held.slots.len(), held.closing), (0, 0));
        assert!(held.per_server.values().all(|n| *n == 0));
    }
}
