//! Starts each of gpufit's servers (the sidecar, the controller in
//! `--no-kubernetes` mode, the admission webhook over TLS) as a child
//! process under a given open-file limit, holds idle connections to it,
//! and measures `/healthz` latency and the growth of its log per kind of
//! line. Shared by `tests/serving.rs` (small scale) and
//! `benches/idle_connections.rs` (5,000 connections) through `#[path]`.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    Sidecar,
    Controller,
    Webhook,
}

impl Server {
    pub const ALL: [Server; 3] = [Server::Sidecar, Server::Controller, Server::Webhook];

    pub fn name(self) -> &'static str {
        match self {
            Server::Sidecar => "sidecar",
            Server::Controller => "controller --no-kubernetes",
            Server::Webhook => "webhook (TLS)",
        }
    }
}

/// Log lines with the time each was read.
type Log = Arc<Mutex<Vec<(Instant, String)>>>;

/// A started server; killed when dropped.
pub struct Running {
    child: Child,
    pub addr: SocketAddr,
    tls: Option<Arc<rustls::ClientConfig>>,
    log: Log,
    _dir: tempfile::TempDir,
    /// The Kubernetes API the webhook's controller watches: it accepts and
    /// never answers, so the watches wait quietly.
    _silent_api: Option<std::net::TcpListener>,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// Sets the open-file limit of this process (soft and hard); needs root to
/// raise the hard limit.
pub fn set_own_limit(n: u64) -> Result<(), String> {
    use nix::sys::resource::{setrlimit, Resource};
    setrlimit(Resource::RLIMIT_NOFILE, n, n)
        .map_err(|e| format!("cannot set this process's open-file limit to {n}: {e}"))
}

/// Starts `which` from the binary `bin` with soft and hard open-file limits
/// `nofile`, and waits until its `/healthz` answers.
pub fn start(bin: &str, which: Server, nofile: u64) -> Result<Running, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let history = format!("sqlite:{}", dir.path().join("h.db").display());
    let mut cmd = Command::new(bin);
    let mut tls = None;
    let mut silent_api = None;
    let mut addr = listen.clone();
    match which {
        Server::Sidecar => {
            cmd.args(["sidecar", "--backend", "simulate", "--listen", &listen]);
        }
        Server::Controller => {
            cmd.args(["controller", "--no-kubernetes", "--listen", &listen])
                .args(["--history", &history]);
        }
        Server::Webhook => {
            let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()])
                .map_err(|e| format!("rcgen: {e}"))?;
            let (crt, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
            std::fs::write(&crt, cert.cert.pem()).map_err(|e| e.to_string())?;
            std::fs::write(&key, cert.key_pair.serialize_pem()).map_err(|e| e.to_string())?;
            tls = Some(client_config(&cert.cert.pem())?);
            let silent = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
            let api = silent.local_addr().map_err(|e| e.to_string())?;
            let kubeconfig = dir.path().join("kubeconfig");
            std::fs::write(
                &kubeconfig,
                format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://{api}\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\nusers:\n- name: u\n  user:\n    token: x\n"
                ),
            )
            .map_err(|e| e.to_string())?;
            silent_api = Some(silent);
            let webhook_port = free_port()?;
            addr = format!("127.0.0.1:{webhook_port}");
            cmd.args(["controller", "--no-leader-election", "--listen", &listen])
                .args(["--history", &history])
                .args(["--webhook-listen", &addr])
                .arg("--tls-cert")
                .arg(&crt)
                .arg("--tls-key")
                .arg(&key)
                .env("KUBECONFIG", &kubeconfig);
        }
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // SAFETY: between fork and exec only setrlimit runs, a plain system
    // call (async-signal-safe), with no allocation or lock.
    unsafe {
        cmd.pre_exec(move || {
            use nix::sys::resource::{setrlimit, Resource};
            setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile)
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32))
        });
    }
    let mut child = cmd.spawn().map_err(|e| {
        format!("cannot start {bin} with an open-file limit of {nofile} (raising the hard limit needs root): {e}")
    })?;
    let log: Log = Arc::default();
    if let Some(stderr) = child.stderr.take() {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut l) = log.lock() {
                    l.push((Instant::now(), line));
                }
            }
        });
    }
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let running = Running {
        child,
        addr,
        tls,
        log,
        _dir: dir,
        _silent_api: silent_api,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut running = running;
    loop {
        if running.healthz(Duration::from_secs(2)).is_ok() {
            return Ok(running);
        }
        if let Ok(Some(status)) = running.child.try_wait() {
            return Err(format!(
                "{} exited at start ({status}):\n{}",
                which.name(),
                running.log_text()
            ));
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} did not answer /healthz within 60 s:\n{}",
                which.name(),
                running.log_text()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A TLS client trusting only the test certificate.
fn client_config(ca_pem: &str) -> Result<Arc<rustls::ClientConfig>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        let c = c.map_err(|e| format!("pem: {e}"))?;
        roots.add(c).map_err(|e| format!("trust anchor: {e}"))?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// The status code of an HTTP/1.1 answer's first line.
fn read_status(r: &mut impl Read) -> Result<u16, String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n") {
        match r.read(&mut byte) {
            Ok(0) => return Err("connection closed before an answer".into()),
            Ok(_) => head.push(byte[0]),
            Err(e) => return Err(format!("reading the answer: {e}")),
        }
        if head.len() > 200 {
            return Err("no status line".into());
        }
    }
    let line = String::from_utf8_lossy(&head);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP status line: {line:?}"))
}

const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

impl Running {
    /// One `GET /healthz` on a new connection (TLS for the webhook): the
    /// time from connecting to the status line.
    pub fn healthz(&self, timeout: Duration) -> Result<Duration, String> {
        let t = Instant::now();
        let tcp = TcpStream::connect_timeout(&self.addr, timeout).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        tcp.set_write_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        let status = match &self.tls {
            None => {
                let mut tcp = tcp;
                tcp.write_all(HEALTHZ).map_err(|e| e.to_string())?;
                read_status(&mut tcp)?
            }
            Some(cfg) => {
                let name = rustls::pki_types::ServerName::try_from("localhost")
                    .map_err(|e| e.to_string())?;
                let conn =
                    rustls::ClientConnection::new(cfg.clone(), name).map_err(|e| e.to_string())?;
                let mut s = rustls::StreamOwned::new(conn, tcp);
                s.write_all(HEALTHZ).map_err(|e| e.to_string())?;
                read_status(&mut s)?
            }
        };
        if status != 200 {
            return Err(format!("/healthz answered {status}"));
        }
        Ok(t.elapsed())
    }

    /// Opens `n` connections that never send a byte; stops early after 50
    /// failures in a row. Returns the open ones.
    pub fn open_idle(&self, n: usize) -> Vec<TcpStream> {
        let mut open = Vec::with_capacity(n);
        let mut failed_in_a_row = 0;
        while open.len() < n && failed_in_a_row < 50 {
            match TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)) {
                Ok(s) => {
                    open.push(s);
                    failed_in_a_row = 0;
                }
                Err(_) => failed_in_a_row += 1,
            }
        }
        open
    }

    /// Opens `n` connections that each send a request head announcing a
    /// 1,000-byte body (to a route that reads its body: `path`) and one
    /// byte of it, then nothing: stalled bodies. Over TLS for the webhook.
    /// Stops early after 50 failures in a row. Returns the open ones, in
    /// the order opened.
    pub fn open_stalled(&self, n: usize, path: &str) -> Vec<Stalled> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
        );
        let mut open = Vec::with_capacity(n);
        let mut failed_in_a_row = 0;
        while open.len() < n && failed_in_a_row < 50 {
            match self.stall_one(head.as_bytes()) {
                Ok(s) => {
                    open.push(s);
                    failed_in_a_row = 0;
                }
                Err(_) => failed_in_a_row += 1,
            }
        }
        open
    }

    fn stall_one(&self, head: &[u8]) -> Result<Stalled, String> {
        let t = Duration::from_secs(5);
        let tcp = TcpStream::connect_timeout(&self.addr, t).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(t)).map_err(|e| e.to_string())?;
        tcp.set_write_timeout(Some(t)).map_err(|e| e.to_string())?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => {
                let mut tcp = tcp;
                tcp.write_all(head).map_err(|e| e.to_string())?;
                Ok(Stalled::Plain(tcp))
            }
            Some(cfg) => {
                let name = rustls::pki_types::ServerName::try_from("localhost")
                    .map_err(|e| e.to_string())?;
                let conn =
                    rustls::ClientConnection::new(cfg.clone(), name).map_err(|e| e.to_string())?;
                let mut s = rustls::StreamOwned::new(conn, tcp);
                s.write_all(head).map_err(|e| e.to_string())?;
                s.flush().map_err(|e| e.to_string())?;
                Ok(Stalled::Tls(Box::new(s)))
            }
        }
    }

    pub fn log_text(&self) -> String {
        self.log
            .lock()
            .map(|l| {
                l.iter()
                    .map(|(_, s)| s.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    }

    /// Log lines read within `[from, to]`, counted by kind.
    pub fn lines_by_kind(&self, from: Instant, to: Instant) -> BTreeMap<String, usize> {
        let mut kinds = BTreeMap::new();
        if let Ok(l) = self.log.lock() {
            for (_, line) in l.iter().filter(|(at, _)| *at >= from && *at <= to) {
                *kinds.entry(kind(line)).or_default() += 1;
            }
        }
        kinds
    }
}

/// A connection holding a stalled request body.
pub enum Stalled {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stalled {
    /// The status the server answered the stalled request with (waiting
    /// up to `timeout`).
    pub fn status(&mut self, timeout: Duration) -> Result<u16, String> {
        match self {
            Stalled::Plain(s) => {
                s.set_read_timeout(Some(timeout))
                    .map_err(|e| e.to_string())?;
                read_status(s)
            }
            Stalled::Tls(s) => {
                s.sock
                    .set_read_timeout(Some(timeout))
                    .map_err(|e| e.to_string())?;
                read_status(s)
            }
        }
    }
}

/// A log line's kind: the line without its time stamp, digits as `#`.
pub fn kind(line: &str) -> String {
    let rest = match line.split_once(' ') {
        Some((first, rest)) if first.starts_with(|c: char| c.is_ascii_digit()) => rest,
        _ => line,
    };
    let mut out = String::new();
    for c in rest.trim().chars() {
        if c.is_ascii_digit() {
            if !out.ends_with('#') {
                out.push('#');
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What one server did under idle connections.
#[derive(Debug)]
pub struct Figures {
    pub opened: usize,
    /// `/healthz` times of the tries that answered, sorted.
    pub answers: Vec<Duration>,
    /// Tries without an answer (with why).
    pub failures: Vec<String>,
    pub window: Duration,
    /// The log kind that grew most in the window, and its line count.
    pub worst_kind: Option<(String, usize)>,
}

impl Figures {
    pub fn median(&self) -> Option<Duration> {
        self.answers.get(self.answers.len() / 2).copied()
    }

    pub fn max(&self) -> Option<Duration> {
        self.answers.last().copied()
    }

    /// Most lines of one kind per second in the window.
    pub fn worst_lines_per_second(&self) -> f64 {
        self.worst_kind
            .as_ref()
            .map_or(0.0, |(_, n)| *n as f64 / self.window.as_secs_f64())
    }

    /// Whether every try answered within `limit` and no log kind grew by
    /// more than a line per second (a line at each end of the window allowed).
    pub fn passes(&self, limit: Duration) -> bool {
        let most_lines = self.window.as_secs_f64().ceil() as usize + 1;
        self.failures.is_empty()
            && self.max().is_some_and(|m| m < limit)
            && self
                .worst_kind
                .as_ref()
                .is_none_or(|(_, n)| *n <= most_lines)
    }
}

/// Holds `idle` idle connections to the server, then over `window` asks
/// `/healthz` `tries` times and counts the log lines by kind.
pub fn measure(run: &Running, idle: usize, tries: usize, window: Duration) -> Figures {
    let held = run.open_idle(idle);
    // Let the server accept (and evict) them all before asking.
    std::thread::sleep(Duration::from_millis(500));
    let from = Instant::now();
    let mut answers = Vec::new();
    let mut failures = Vec::new();
    for i in 0..tries {
        match run.healthz(Duration::from_secs(5)) {
            Ok(t) => answers.push(t),
            Err(e) => failures.push(e),
        }
        let next = from + window.mul_f64((i + 1) as f64 / tries as f64);
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
    let to = Instant::now();
    // Lines already read by then: give the reader thread a moment.
    std::thread::sleep(Duration::from_millis(100));
    let kinds = run.lines_by_kind(from, to);
    let opened = held.len();
    drop(held);
    answers.sort();
    Figures {
        opened,
        answers,
        failures,
        window: to - from,
        worst_kind: kinds.into_iter().max_by_key(|(_, n)| *n),
    }
}

/// A route of `which` that reads its request body.
pub fn body_route(which: Server) -> &'static str {
    match which {
        Server::Sidecar => "/v1/simulate/processes",
        Server::Controller => "/v1/runs",
        Server::Webhook => "/mutate",
    }
}

/// Holds `n` stalled request bodies ([`Running::open_stalled`]), then asks
/// `/healthz` `tries` times on new connections; the figures, and the
/// status the oldest stalled request was answered with (408 when the
/// server took its place back).
pub fn measure_stalled(
    run: &Running,
    which: Server,
    n: usize,
    tries: usize,
) -> (Figures, Option<u16>) {
    let from = Instant::now();
    let mut held = run.open_stalled(n, body_route(which));
    let mut answers = Vec::new();
    let mut failures = Vec::new();
    for _ in 0..tries {
        match run.healthz(Duration::from_secs(5)) {
            Ok(t) => answers.push(t),
            Err(e) => failures.push(e),
        }
    }
    answers.sort();
    let oldest = held
        .first_mut()
        .and_then(|s| s.status(Duration::from_secs(15)).ok());
    let f = Figures {
        opened: held.len(),
        answers,
        failures,
        window: from.elapsed(),
        worst_kind: None,
    };
    (f, oldest)
}
