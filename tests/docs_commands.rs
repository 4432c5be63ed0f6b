//! Every `gpufit …` / `cargo run … -- …` command in the fenced code blocks of
//! README.md and docs/*.md runs as written: the test binary stands in for
//! `gpufit`, in a temp directory with its own HOME and history, and each
//! command must exit 0 (a server command must answer `/healthz`, a command
//! whose exit code the docs give must exit with it). Commands that cannot
//! run here are listed in [`SKIPPED`] with the reason; a skip that matches
//! nothing fails, so the list cannot go stale.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

/// (a substring of the command, why it is not run here).
const SKIPPED: &[(&str, &str)] = &[
    ("--gpu auto", "needs a local NVIDIA GPU (NVML)"),
    ("gpus --live", "needs a local NVIDIA GPU (NVML)"),
    ("--backend nvml", "needs a local NVIDIA GPU (NVML)"),
    (
        "--inventory gpus.yaml",
        "needs the operator's GPU inventory file",
    ),
    (
        "python train.py",
        "needs the user's training script and a GPU",
    ),
    (" ... ", "placeholder `...` for the user's own flags"),
    (
        "gpufit controller --history sqlite:/var/lib",
        "needs a Kubernetes API server",
    ),
    (
        "--token-file /etc/gpufit/token",
        "site paths of an installed controller (/etc/gpufit, /var/lib/gpufit)",
    ),
];

/// How long one command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct DocCommand {
    file: String,
    line: usize,
    text: String,
}

/// The `gpufit` commands of the fenced code blocks of one Markdown file.
fn commands_in(file: &Path) -> Vec<DocCommand> {
    let text = std::fs::read_to_string(file).unwrap();
    let name = file
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or(file)
        .display()
        .to_string();
    let mut out = Vec::new();
    let mut in_block = false;
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            pending = None;
            continue;
        }
        if !in_block {
            continue;
        }
        let (start, mut joined) = match pending.take() {
            Some((s, prev)) => (s, prev + " " + line.trim()),
            None => (i + 1, line.trim().to_string()),
        };
        if let Some(rest) = joined.strip_suffix('\\') {
            joined = rest.trim_end().to_string();
            pending = Some((start, joined));
            continue;
        }
        let code = strip_comment(&joined);
        for part in split_commands(&code) {
            let part = part.trim().trim_start_matches("$ ").trim();
            if let Some(cmd) = as_gpufit(part) {
                out.push(DocCommand {
                    file: name.clone(),
                    line: start,
                    text: cmd,
                });
            }
        }
    }
    out
}

/// The line without a trailing `# comment` (outside quotes).
fn strip_comment(line: &str) -> String {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev.is_whitespace() => return line[..i].trim_end().to_string(),
            _ => {}
        }
        prev = c;
    }
    line.to_string()
}

/// Splits on `;` and `&&` outside quotes (a pipe stays one command).
fn split_commands(line: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut cur = String::new();
    let mut quote = None;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, '\'' | '"') => {
                quote = Some(c);
                cur.push(c);
            }
            (Some(q), c) if c == q => {
                quote = None;
                cur.push(c);
            }
            (None, ';') => parts.push(std::mem::take(&mut cur)),
            (None, '&') if chars.peek() == Some(&'&') => {
                chars.next();
                parts.push(std::mem::take(&mut cur));
            }
            _ => cur.push(c),
        }
    }
    parts.push(cur);
    parts
}

/// `gpufit ARGS` for a command that runs gpufit, `cargo run … -- ARGS`
/// rewritten so.
fn as_gpufit(part: &str) -> Option<String> {
    if part.starts_with("gpufit ") || part == "gpufit" {
        return Some(part.to_string());
    }
    if part.starts_with("cargo run") {
        let (_, args) = part.split_once(" -- ")?;
        return Some(format!("gpufit {}", args.trim()));
    }
    None
}

/// A server command: the `--listen` address it serves on.
fn listen_addr(cmd: &str) -> Option<String> {
    let is_server = cmd.starts_with("gpufit sidecar") || cmd.starts_with("gpufit controller");
    let mut words = cmd.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--listen" {
            return is_server
                .then(|| words.next().map(str::to_string))
                .flatten();
        }
    }
    is_server.then(|| "0.0.0.0:9445".to_string())
}

struct Sandbox {
    dir: tempfile::TempDir,
    bin_dir: PathBuf,
}

impl Sandbox {
    fn new() -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let bin_dir = dir.path().join("bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        std::os::unix::fs::symlink(BIN, bin_dir.join("gpufit")).unwrap();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        // The files the README's commands name.
        std::fs::copy(
            repo.join("tests/fixtures/logs/torchtune_lora_single_device.log"),
            dir.path().join("train.log"),
        )
        .unwrap();
        let sb = Sandbox { dir, bin_dir };
        let setup = format!(
            "gpufit record --history sqlite:{d}/seed.db --model llama-3.1-8b --method lora --lora-rank 16 \
             --seq-len 2048 --gpu 'NVIDIA A100-SXM4-80GB' --micro-batch 2 --success true --peak-gb 30 >/dev/null && \
             gpufit history export --history sqlite:{d}/seed.db --output-file {d}/run_logs.jsonl",
            d = sb.dir.path().display()
        );
        let o = sb.shell(&setup).output().unwrap();
        assert!(
            o.status.success(),
            "setup: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        sb
    }

    fn shell(&self, cmd: &str) -> Command {
        let path = format!(
            "{}:{}",
            self.bin_dir.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut c = Command::new("sh");
        c.args(["-c", cmd])
            .current_dir(self.dir.path())
            .env("PATH", path)
            .env("HOME", self.dir.path())
            .env("XDG_DATA_HOME", self.dir.path().join("data"))
            .env(
                "GPUFIT_HISTORY",
                format!("sqlite:{}/history.db", self.dir.path().display()),
            )
            .env_remove("GPUFIT_OUTPUT")
            .env_remove("GPUFIT_GPU")
            .env_remove("GPUFIT_LOG")
            .stdin(Stdio::null());
        c
    }

    /// Runs a one-shot command to its end; (exit code, stderr).
    fn run(&self, cmd: &str) -> (Option<i32>, String) {
        let mut child = self
            .shell(cmd)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        loop {
            if child.try_wait().unwrap().is_some() {
                let o = child.wait_with_output().unwrap();
                return (o.status.code(), String::from_utf8_lossy(&o.stderr).into());
            }
            if t.elapsed() > COMMAND_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("`{cmd}` did not end within {COMMAND_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts a server command and checks it answers `/healthz`, then stops it.
    fn serve(&self, cmd: &str, addr: &str) -> Result<(), String> {
        // The server itself, not a shell around it, so that it is the one stopped.
        let cmd = cmd.trim_end_matches('&').trim();
        let mut child = self
            .shell(&format!("exec {cmd}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let url = format!("http://{}/healthz", addr.replace("0.0.0.0", "127.0.0.1"));
        let agent = ureq::AgentBuilder::new()
            .timeout(Duration::from_millis(500))
            .build();
        let t = Instant::now();
        let result = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Err(format!("exited ({status}) instead of serving"));
            }
            if agent.get(&url).call().is_ok() {
                break Ok(());
            }
            if t.elapsed() > Duration::from_secs(20) {
                break Err(format!("{url} did not answer within 20 s"));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let _ = child.kill();
        let o = child.wait_with_output().unwrap();
        result.map_err(|e| format!("{e}: {}", String::from_utf8_lossy(&o.stderr)))
    }
}

/// README.md and docs/*.md.
fn doc_files() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![repo.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(repo.join("docs"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The ```yaml blocks of a Markdown file, as (first line, text with the
/// list-item indentation of the fence removed).
fn yaml_blocks(file: &Path) -> Vec<(usize, String)> {
    let text = std::fs::read_to_string(file).unwrap();
    let mut out = Vec::new();
    let mut open: Option<(usize, usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start().len();
        match &mut open {
            None if line.trim_start() == "```yaml" => open = Some((i + 1, indent, String::new())),
            Some((at, _, body)) if line.trim_start() == "```" => {
                out.push((*at, std::mem::take(body)));
                open = None;
            }
            Some((_, fence, body)) => {
                body.push_str(line.get(*fence..).unwrap_or(line.trim_start()));
                body.push('\n');
            }
            None => {}
        }
    }
    out
}

/// Every YAML example in the docs parses (a reader pastes them).
#[test]
fn every_yaml_block_in_the_docs_parses() {
    let mut n = 0;
    let mut bad = Vec::new();
    for f in doc_files() {
        for (line, body) in yaml_blocks(&f) {
            n += 1;
            for doc in serde_yaml::Deserializer::from_str(&body) {
                if let Err(e) = serde_yaml::Value::deserialize(doc) {
                    bad.push(format!("{}:{line}: {e}", f.display()));
                }
            }
        }
    }
    assert!(n >= 4, "the docs lost their YAML examples ({n})");
    assert!(bad.is_empty(), "YAML that does not parse: {bad:#?}");
}

#[test]
fn every_documented_command_runs_as_written() {
    let files = doc_files();
    let commands: Vec<DocCommand> = files.iter().flat_map(|f| commands_in(f)).collect();

    let sandbox = Sandbox::new();
    let mut skip_used = vec![false; SKIPPED.len()];
    let mut ran = 0;
    let mut failures = Vec::new();
    let mut skipped = Vec::new();
    let started = Instant::now();
    for c in &commands {
        let padded = format!(" {} ", c.text);
        if let Some(i) = SKIPPED.iter().position(|(s, _)| padded.contains(s)) {
            skip_used[i] = true;
            skipped.push(format!(
                "{}:{}: `{}` ({})",
                c.file, c.line, c.text, SKIPPED[i].1
            ));
            continue;
        }
        ran += 1;
        let result = match listen_addr(&c.text) {
            Some(addr) => sandbox.serve(&c.text, &addr),
            None => match sandbox.run(&c.text) {
                (Some(0), _) => Ok(()),
                (code, err) => Err(format!("exit {code:?}: {err}")),
            },
        };
        if let Err(e) = result {
            failures.push(format!("{}:{}: `{}`: {e}", c.file, c.line, c.text));
        }
    }
    eprintln!(
        "ran {ran} documented command(s) in {:?}; skipped {}:\n  {}",
        started.elapsed(),
        skipped.len(),
        skipped.join("\n  ")
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let stale: Vec<&str> = SKIPPED
        .iter()
        .zip(&skip_used)
        .filter(|(_, used)| !**used)
        .map(|((s, _), _)| *s)
        .collect();
    assert!(stale.is_empty(), "skips that match no command: {stale:?}");
    // The extraction itself: the README alone has a dozen commands.
    assert!(ran >= 10, "only {ran} command(s) found: {commands:?}");
}

#[test]
fn the_extraction_joins_continuations_and_splits_sequences() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("x.md");
    std::fs::write(
        &md,
        "text gpufit models\n```sh\ngpufit estimate --model m \\\n  --seq-len 8   # a comment\n\
         gpufit models ; gpufit gpus && echo ok\ncargo run --release -- gpus 'a # b'\n\
         kubectl apply -f x # or: gpufit crd\n```\n",
    )
    .unwrap();
    let got: Vec<String> = commands_in(&md).into_iter().map(|c| c.text).collect();
    assert_eq!(
        got,
        vec![
            "gpufit estimate --model m --seq-len 8",
            "gpufit models",
            "gpufit gpus",
            "gpufit gpus 'a # b'",
        ]
    );
}
