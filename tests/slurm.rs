//! The Slurm integration, tested for real: a one-node Slurm cluster on
//! 127.0.0.1 (munged, slurmctld, slurmd from Debian) whose
//! TaskProlog/Prolog/Epilog are the project's `slurm/*.sh` hooks running the
//! test-built binary, with a running `gpufit controller --no-kubernetes` and
//! a simulate sidecar. (The controller's API those hooks call, in process:
//! tests/slurm_api.rs.)
//!
//! The Slurm binaries must be installed (`bash scripts/test.sh` installs
//! them); the cluster test fails, never skips, when they are missing.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gpufit::core::run::{FailureReason, RunRecord, RunSource};

#[path = "common/loopback.rs"]
mod loopback;
use loopback::{agent, call, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_gpufit");

/// A child process killed (and reaped) on drop.
struct Daemon {
    name: &'static str,
    child: Child,
}

impl Daemon {
    fn spawn(name: &'static str, cmd: &mut Command, log: &Path) -> Daemon {
        let out = std::fs::File::create(log).unwrap();
        let err = out.try_clone().unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Daemon { name, child }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

fn require(bins: &[&str]) {
    let missing: Vec<&str> = bins
        .iter()
        .copied()
        .filter(|b| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {b}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    assert!(
        missing.is_empty(),
        "Slurm test needs {missing:?} on PATH: install them with \
         `apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge` \
         (bash scripts/test.sh does it)"
    );
}

fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn http_ok(url: &str) -> bool {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_millis(500))
        .build()
        .get(url)
        .call()
        .is_ok()
}

/// One Slurm node on 127.0.0.1 whose hooks are the project's scripts.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    // Dropped in reverse: slurmd, slurmctld, munged.
    daemons: Vec<Daemon>,
}

impl Cluster {
    /// One node, `localhost`, with two GPUs.
    fn start(dir: &Path) -> Cluster {
        Cluster::start_nodes(dir, &["localhost"])
    }

    /// One slurmd per node name, all on this host (each on its own port,
    /// `slurmd -N <name>`); one node has two GPUs, several have one each.
    fn start_nodes(dir: &Path, nodes: &[&str]) -> Cluster {
        require(&[
            "munged",
            "mungekey",
            "slurmctld",
            "slurmd",
            "sbatch",
            "sinfo",
            "scontrol",
        ]);
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        for sub in ["munge", "state", "spool", "dev", "out"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        chmod(dir, 0o755);
        chmod(&dir.join("out"), 0o1777);
        let munge = dir.join("munge");
        run_ok(Command::new("mungekey").args([
            "--create",
            &format!("--keyfile={}", munge.join("munge.key").display()),
            "--bits=1024",
        ]));
        chmod(&munge.join("munge.key"), 0o600);
        // Fake GPUs: gres needs character devices (plain files are refused).
        for i in 0..2 {
            run_ok(Command::new("mknod").args([
                dir.join(format!("dev/nvidia{i}")).to_str().unwrap(),
                "c",
                "195",
                &i.to_string(),
            ]));
        }
        // Hook wrappers: set where the binary and the site config are, then
        // run the project's hook. The TaskProlog's wall time is recorded.
        let env_lines = format!(
            "export GPUFIT_BIN={BIN}\nexport GPUFIT_SLURM_CONFIG={}\n",
            dir.join("gpufit.toml").display()
        );
        let hooks = repo.join("slurm");
        write_exec(
            &dir.join("task_prolog.sh"),
            &format!(
                "#!/bin/sh\n{env_lines}s=$(date +%s%N)\n{}\ne=$(date +%s%N)\necho \"$SLURM_JOB_ID $s $e\" >> {}\nexit 0\n",
                hooks.join("task_prolog.sh").display(),
                dir.join("taskprolog.times").display()
            ),
        );
        std::fs::write(dir.join("taskprolog.times"), "").unwrap();
        chmod(&dir.join("taskprolog.times"), 0o666);
        for hook in ["prolog", "epilog"] {
            write_exec(
                &dir.join(format!("{hook}.sh")),
                &format!(
                    "#!/bin/sh\n{env_lines}export GPUFIT_LOG=info\nexec {} 2>>{}\n",
                    hooks.join(format!("{hook}.sh")).display(),
                    dir.join(format!("{hook}.log")).display()
                ),
            );
        }
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let (node_lines, gres_lines) = if let [only] = nodes {
            (
                format!("NodeName={only} CPUs={cpus} RealMemory=20000 Gres=gpu:2 State=UNKNOWN\n"),
                format!("NodeName={only} Name=gpu File={d}/dev/nvidia[0-1]\n"),
            )
        } else {
            // Each node its own slurmd port and its own fake GPU.
            let mut n = String::new();
            let mut g = String::new();
            for (i, name) in nodes.iter().enumerate() {
                n += &format!(
                    "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={} CPUs=1 RealMemory=5000 Gres=gpu:1 State=UNKNOWN\n",
                    free_port()
                );
                g += &format!("NodeName={name} Name=gpu File={d}/dev/nvidia{i}\n");
            }
            (n, g)
        };
        std::fs::write(
            &conf,
            format!(
                "ClusterName=test\nSlurmctldHost=localhost\nSlurmctldPort={}\nSlurmdPort={}\n\
                 SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n\
                 AuthInfo=socket={d}/munge/munge.socket.2\nStateSaveLocation={d}/state\n\
                 SlurmdSpoolDir={d}/spool/%n\nSlurmctldPidFile={d}/slurmctld.pid\n\
                 SlurmdPidFile={d}/slurmd-%n.pid\nSlurmctldLogFile={d}/slurmctld.log\n\
                 SlurmdLogFile={d}/slurmd-%n.log\nProctrackType=proctrack/linuxproc\n\
                 TaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
                 AccountingStorageType=accounting_storage/none\nSelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_Core\nMpiDefault=none\nReturnToService=2\n\
                 MailProg=/bin/true\nPrologFlags=Alloc\nProlog={d}/prolog.sh\n\
                 Epilog={d}/epilog.sh\nTaskProlog={d}/task_prolog.sh\nGresTypes=gpu\n\
                 {node_lines}PartitionName=debug Nodes={} Default=YES MaxTime=INFINITE State=UP\n",
                free_port(),
                free_port(),
                nodes.join(","),
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("gres.conf"),
            format!("AutoDetect=off\n{gres_lines}"),
        )
        .unwrap();

        let mut c = Cluster {
            dir: dir.to_path_buf(),
            conf: conf.clone(),
            daemons: Vec::new(),
        };
        c.daemons.push(Daemon::spawn(
            "munged",
            Command::new("munged").args([
                "--foreground",
                "--force",
                &format!("--key-file={}", munge.join("munge.key").display()),
                &format!("--socket={}", munge.join("munge.socket.2").display()),
                &format!("--pid-file={}", munge.join("munged.pid").display()),
                &format!("--log-file={}", munge.join("munged.log").display()),
                &format!("--seed-file={}", munge.join("munged.seed").display()),
            ]),
            &dir.join("munged.out"),
        ));
        wait_until("munged's socket", Duration::from_secs(10), || {
            munge.join("munge.socket.2").exists().then_some(())
        });
        c.daemons.push(Daemon::spawn(
            "slurmctld",
            Command::new("setsid")
                .args(["slurmctld", "-D", "-f"])
                .arg(&conf)
                .env("SLURM_CONF", &conf),
            &dir.join("slurmctld.out"),
        ));
        for name in nodes {
            c.daemons.push(Daemon::spawn(
                "slurmd",
                Command::new("setsid")
                    .args(["slurmd", "-D", "-N", name, "-f"])
                    .arg(&conf)
                    .env("SLURM_CONF", &conf),
                &dir.join(format!("slurmd-{name}.out")),
            ));
        }
        wait_until(
            "the Slurm nodes to be idle",
            Duration::from_secs(30),
            || {
                let out = c.cmd("sinfo").args(["-h", "-o", "%T"]).output().ok()?;
                (String::from_utf8_lossy(&out.stdout).trim() == "idle").then_some(())
            },
        );
        c
    }

    fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `sbatch --wait` a script with one GPU; returns the job id, its
    /// output, and whether it exited 0.
    fn sbatch(&self, extra: &[&str], env: &[(&str, &str)], script: &str) -> (String, String, bool) {
        self.sbatch_during(extra, env, script, |_, _| {})
    }

    /// Like [`Cluster::sbatch`]; a script that runs `$JOB_TEST_GATE`
    /// waits there while `during(job id, its GPU indices)` runs.
    fn sbatch_during(
        &self,
        extra: &[&str],
        env: &[(&str, &str)],
        script: &str,
        during: impl FnOnce(&str, &str),
    ) -> (String, String, bool) {
        let n = free_port();
        let path = self.dir.join(format!("job-{n}.sh"));
        let gate = self.dir.join("out").join(format!("gate-{n}"));
        write_exec(
            &gate,
            &format!(
                "#!/bin/sh\necho \"$SLURM_JOB_ID $SLURM_JOB_GPUS\" > {g}.tmp && mv {g}.tmp {g}.started\nwhile [ ! -e {g}.go ]; do sleep 0.05; done\n",
                g = gate.display()
            ),
        );
        write_exec(&path, script);
        let mut cmd = self.cmd("sbatch");
        cmd.args(["--wait", "--gres=gpu:1", "--parsable"]);
        // A test that sets its own `--output` (or none: `--output=`) sees
        // the job's output only through the Epilog.
        match extra.iter().find_map(|a| a.strip_prefix("--output=")) {
            Some(_) => {}
            None => {
                cmd.arg(format!("--output={}/out/%j.out", self.dir.display()));
            }
        }
        cmd.arg(format!("--chdir={}/out", self.dir.display()))
            .args(extra.iter().filter(|a| **a != "--output="))
            .arg(&path)
            .env("JOB_TEST_GATE", &gate)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        // sbatch's stdout is block-buffered into a pipe: the job id of a
        // gated job comes from the gate, the others' once sbatch has exited.
        let started = PathBuf::from(format!("{}.started", gate.display()));
        let mut during = Some(during);
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if let Some(f) = during.as_ref().and(std::fs::read_to_string(&started).ok()) {
                let (job, gpus) = f.trim().split_once(' ').unwrap_or((f.trim(), ""));
                if let Some(d) = during.take() {
                    d(job, gpus);
                }
                std::fs::write(format!("{}.go", gate.display()), "").unwrap();
            }
            if t.elapsed() > Duration::from_secs(90) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("sbatch --wait did not return within 90 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut stdout = String::new();
        let mut stderr = String::new();
        let _ = child.stdout.take().unwrap().read_to_string(&mut stdout);
        let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
        let id = stdout.trim().split(';').next().unwrap_or("").to_string();
        assert!(!id.is_empty(), "sbatch printed no job id: {stderr}");
        let output =
            std::fs::read_to_string(self.dir.join(format!("out/{id}.out"))).unwrap_or_default();
        (id, output, status.success())
    }

    /// The TaskProlog's wall time for a job (from the wrapper's record).
    fn task_prolog_time(&self, job: &str) -> Duration {
        let times = std::fs::read_to_string(self.dir.join("taskprolog.times")).unwrap();
        let line = times
            .lines()
            .find(|l| l.split(' ').next() == Some(job))
            .unwrap_or_else(|| panic!("no TaskProlog time for job {job} in {times}"));
        let n: Vec<u64> = line
            .split(' ')
            .skip(1)
            .map(|x| x.parse().unwrap())
            .collect();
        Duration::from_nanos(n[1] - n[0])
    }

    /// Waits until slurmctld has the job ended on every node (no longer
    /// COMPLETING: every node's Epilog has finished).
    fn wait_job_done(&self, job: &str) {
        wait_until(
            &format!("job {job}'s Epilogs to finish"),
            Duration::from_secs(30),
            || {
                let out = self
                    .cmd("scontrol")
                    .args(["show", "job", job])
                    .output()
                    .ok()?;
                let text = String::from_utf8_lossy(&out.stdout).to_string();
                let state = text
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("JobState="))?
                    .to_string();
                let done = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"]
                    .contains(&state.as_str())
                    && !text.contains("COMPLETING");
                done.then_some(())
            },
        );
    }

    fn write_config(&self, lines: &[String]) {
        let p = self.dir.join("gpufit.toml");
        std::fs::write(&p, lines.join("\n") + "\n").unwrap();
        chmod(&p, 0o644);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        while let Some(mut d) = self.daemons.pop() {
            d.stop();
        }
    }
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn write_exec(p: &Path, text: &str) {
    std::fs::write(p, text).unwrap();
    chmod(p, 0o755);
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `GPUFIT_*` variables a job printed with `env`.
fn gpufit_vars(output: &str) -> std::collections::BTreeMap<String, String> {
    output
        .lines()
        .filter(|l| l.starts_with("GPUFIT_"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const PRINT_ENV: &str = "#!/bin/sh\nenv | sort\necho job-ran\n";

/// Prints its environment, then waits at the test's gate (while the test
/// plays the training process's GPU memory on the simulate sidecar), and
/// states the micro batch it ran as the Hugging Face Trainer does: the
/// Epilog reads that from its output, which confirms the run's settings (a
/// job that states nothing is recorded unconfirmed, its peak a floor only).
const PRINT_ENV_GATED: &str = "#!/bin/sh\nenv | sort\n\"$JOB_TEST_GATE\"\necho \"  Instantaneous batch size per device = $GPUFIT_MICRO_BATCH_SIZE\"\necho job-ran\n";

/// Plays a training process of `job` using `bytes` on its GPU, then ending.
fn simulate_training(sidecar: &str, job: &str, gpus: &str, bytes: u64) {
    let gpu: u32 = gpus.split(',').next().unwrap_or("0").parse().unwrap_or(0);
    let pid: u32 = 40_000 + job.parse::<u32>().unwrap_or(0);
    let body = serde_json::json!({
        "pid": pid, "gpu": gpu, "job": {"slurm_job_id": job}, "memory_bytes": bytes
    });
    let (status, resp) = call(
        agent().post(&format!("{sidecar}/v1/simulate/processes")),
        Some(&body.to_string()),
    );
    assert_eq!(status, 200, "simulate process: {resp}");
    let (status, resp) = call(
        agent().delete(&format!("{sidecar}/v1/simulate/processes/{pid}")),
        None,
    );
    assert_eq!(status, 200, "end simulated process: {resp}");
}

/// Waits for a daemon's URL to answer; fails with its log when it exits.
fn wait_for_http(d: &mut Daemon, url: &str, log: &Path) {
    wait_until(
        &format!("{} at {url}", d.name),
        Duration::from_secs(20),
        || {
            if let Ok(Some(status)) = d.child.try_wait() {
                panic!(
                    "{} exited ({status}) before answering: {}",
                    d.name,
                    std::fs::read_to_string(log).unwrap_or_default()
                );
            }
            http_ok(url).then_some(())
        },
    );
}

fn start_controller(dir: &Path, history: &str) -> (Daemon, String) {
    start_controller_at(dir, history, free_port())
}

fn start_controller_at(dir: &Path, history: &str, port: u16) -> (Daemon, String) {
    let url = format!("http://127.0.0.1:{port}");
    let mut d = Daemon::spawn(
        "controller",
        Command::new(BIN)
            .args(["controller", "--no-kubernetes", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["--history", history, "--token-file"])
            .arg(dir.join("token"))
            .env("GPUFIT_LOG", "info"),
        &dir.join(format!("controller-{port}.log")),
    );
    let log = dir.join(format!("controller-{port}.log"));
    wait_for_http(&mut d, &format!("{url}/healthz"), &log);
    (d, url)
}

fn start_sidecar(dir: &Path) -> (Daemon, String) {
    start_sidecar_at(dir, "127.0.0.1", free_port())
}

/// A simulate sidecar listening on `host:port` (any 127.x.y.z is loopback).
fn start_sidecar_at(dir: &Path, host: &str, port: u16) -> (Daemon, String) {
    let url = format!("http://{host}:{port}");
    let log = dir.join(format!("sidecar-{host}.log"));
    let mut d = Daemon::spawn(
        "sidecar",
        Command::new(BIN)
            .args([
                "sidecar",
                "--backend",
                "simulate",
                "--simulate-gpus",
                "2",
                "--listen",
            ])
            .arg(format!("{host}:{port}"))
            .arg("--mapping-dir")
            .arg(dir.join("gpu-jobs"))
            .env("GPUFIT_LOG", "info"),
        &log,
    );
    wait_for_http(&mut d, &format!("{url}/healthz"), &log);
    (d, url)
}

/// Every record of `job` the controller has.
fn records_of_job(controller: &str, job: &str) -> Vec<RunRecord> {
    let runs: Vec<RunRecord> = agent()
        .get(&format!("{controller}/v1/runs?limit=1000"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    runs.into_iter()
        .filter(|r| r.job_id.as_deref() == Some(job))
        .collect()
}

fn runs_of_job(controller: &str, job: &str) -> Option<RunRecord> {
    let runs: Vec<RunRecord> = agent()
        .get(&format!("{controller}/v1/runs?limit=1000"))
        .call()
        .ok()?
        .into_json()
        .ok()?;
    runs.into_iter().find(|r| r.job_id.as_deref() == Some(job))
}

/// Every Slurm scenario runs in this one test, in order, on one cluster.
#[test]
fn slurm_jobs_get_settings_record_runs_and_fail_open() {
    let tmp = tempfile::Builder::new()
        .prefix("gpufit-slurm-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let cluster = Cluster::start(dir);
    std::fs::write(dir.join("token"), "test-token-0123456789abcdef\n").unwrap();
    chmod(&dir.join("token"), 0o600);
    std::fs::create_dir_all(dir.join("gpu-jobs")).unwrap();
    let state_dir = dir.join("gpufit-state");
    let config = |controller: &str, sidecar: Option<&str>| {
        let mut c = vec![
            format!("controller_url = \"{controller}\""),
            format!("token_file = \"{}\"", dir.join("token").display()),
            format!("state_dir = \"{}\"", state_dir.display()),
            format!("mapping_dir = \"{}\"", dir.join("gpu-jobs").display()),
        ];
        match sidecar {
            Some(url) => c.push(format!("sidecar_url = \"{url}\"")),
            None => c.push("gpu = \"NVIDIA A100-SXM4-80GB\"".to_string()),
        }
        c
    };
    let model = "meta-llama/Llama-3.1-8B";
    let workload_env = [
        ("GPUFIT_MODEL", model),
        ("GPUFIT_SEQ_LEN", "2048"),
        ("GPUFIT_GLOBAL_BATCH", "16"),
        ("GPUFIT_METHOD", "lora"),
        ("GPUFIT_LORA_RANK", "16"),
    ];
    let no_settings = |out: &str| {
        gpufit_vars(out)
            .keys()
            .all(|k| workload_env.iter().any(|(w, _)| w == k))
    };

    // 1. A job that does not ask for gpufit is left untouched.
    let blackhole = TcpListener::bind("127.0.0.1:0").unwrap();
    let hole = format!("http://{}", blackhole.local_addr().unwrap());
    cluster.write_config(&config(&hole, None));
    let (job, out, ok) = cluster.sbatch(&[], &[], PRINT_ENV);
    assert!(ok && out.contains("job-ran"), "job {job}: {out}");
    assert!(
        gpufit_vars(&out).is_empty(),
        "job {job} got gpufit variables: {out}"
    );
    assert!(out.contains("SLURM_JOB_GPUS="), "the job has a GPU: {out}");

    // 2. A controller that accepts connections and never answers: the job
    //    runs without settings; the TaskProlog's own budget ends the wait.
    let (job, out, ok) = cluster.sbatch(&[], &workload_env, PRINT_ENV);
    assert!(ok && out.contains("job-ran"), "job {job}: {out}");
    assert!(no_settings(&out), "no settings: {out}");
    let t = cluster.task_prolog_time(&job);
    assert!(
        t < Duration::from_secs(2),
        "TaskProlog took {t:?} with a hanging controller"
    );
    drop(blackhole);

    // 3. A job asking through its environment gets the settings of a
    //    suggestion from the controller, for the sidecar's GPU.
    let (mut controller, ctl_url) =
        start_controller(dir, &format!("sqlite:{}/history.db", dir.display()));
    let (_sidecar, side_url) = start_sidecar(dir);
    cluster.write_config(&config(&ctl_url, Some(&side_url)));
    let peak = 30 * (1u64 << 30);
    let (job1, out, ok) =
        cluster.sbatch_during(&[], &workload_env, PRINT_ENV_GATED, |job, gpus| {
            // While the job runs, the Prolog's mapping names it on its GPU.
            let mapped = std::fs::read_to_string(dir.join("gpu-jobs").join(gpus)).unwrap();
            assert_eq!(mapped.trim(), job, "mapping file of GPU {gpus}");
            // The TaskProlog's state, one file per job and node.
            let state = state_dir.join(format!("job-{job}.localhost.json"));
            assert!(state.is_file(), "{} while the job runs", state.display());
            simulate_training(&side_url, job, gpus, peak);
        });
    assert!(ok, "job {job1}: {out}");
    let vars = gpufit_vars(&out);
    for k in [
        "GPUFIT_MICRO_BATCH_SIZE",
        "GPUFIT_GRAD_ACCUM_STEPS",
        "GPUFIT_DTYPE",
        "GPUFIT_ACTIVATION_CHECKPOINTING",
        "GPUFIT_COMPILE",
        "GPUFIT_SUGGESTION_SOURCE",
        "GPUFIT_CONFIDENCE",
    ] {
        assert!(vars.contains_key(k), "job {job1} lacks {k}: {out}");
    }
    assert_eq!(vars["GPUFIT_SUGGESTION_SOURCE"], "heuristic", "{out}");
    let m: u32 = vars["GPUFIT_MICRO_BATCH_SIZE"].parse().unwrap();
    let a: u32 = vars["GPUFIT_GRAD_ACCUM_STEPS"].parse().unwrap();
    assert_eq!(m * a, 16, "global batch kept exactly: {vars:?}");
    let gpus: serde_json::Value = agent()
        .get(&format!("{side_url}/v1/gpus"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert!(
        gpus.to_string().contains(&vars["GPUFIT_GPU_MODEL"]),
        "GPU model {} is the sidecar's: {gpus}",
        vars["GPUFIT_GPU_MODEL"]
    );

    // 4. The Epilog recorded the run (settings used, success, the sidecar's
    //    peak) and removed the job's mapping and state files.
    let run = wait_until("the Epilog's run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job1)
    });
    assert!(run.result.success(), "{run:?}");
    assert_eq!(run.settings.micro_batch_size, m);
    assert_eq!(run.source, RunSource::Slurm);
    assert_eq!(run.seq_len, 2048);
    assert_eq!(run.gpu_model, vars["GPUFIT_GPU_MODEL"]);
    assert!(run.predicted_peak_bytes.is_some(), "{run:?}");
    assert_eq!(
        run.result.peak_memory_bytes,
        Some(peak),
        "peak from the sidecar: {run:?}"
    );
    assert!(
        !state_dir
            .join(format!("job-{job1}.localhost.json"))
            .exists(),
        "state file cleaned up"
    );
    assert!(
        std::fs::read_dir(dir.join("gpu-jobs"))
            .unwrap()
            .next()
            .is_none(),
        "the Epilog removes the job's mapping files"
    );

    // 5. The next job of the same key (asking through --comment this time,
    //    and running as an unprivileged user) learns from that run.
    let comment = format!(
        "--comment=team-a; gpufit: model={model} seq_len=2048 global_batch=16 method=lora lora_rank=16"
    );
    let (job2, out, ok) =
        cluster.sbatch(&["--uid=nobody", "--gid=nogroup", &comment], &[], PRINT_ENV);
    assert!(ok, "job {job2}: {out}");
    let vars2 = gpufit_vars(&out);
    let source = vars2
        .get("GPUFIT_SUGGESTION_SOURCE")
        .unwrap_or_else(|| panic!("job {job2} got no settings: {out}"));
    assert_ne!(
        source, "heuristic",
        "job {job2} should learn from job {job1}: {vars2:?}"
    );
    let run2 = wait_until("the second run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job2)
    });
    assert!(run2.result.success(), "{run2:?}");

    // 6. A job that runs out of memory is recorded as an OOM.
    let oom_script = "#!/bin/sh\necho 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.'\nexit 1\n";
    let (job3, out, ok) = cluster.sbatch(&[], &workload_env, oom_script);
    assert!(!ok, "job {job3} failed: {out}");
    let run3 = wait_until("the OOM run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job3)
    });
    assert!(!run3.result.success());
    assert_eq!(
        run3.result.failure_reason(),
        Some(FailureReason::Oom),
        "{run3:?}"
    );

    // 6b. The same with no `--output` (Slurm's default `slurm-<id>.out` in
    //     the working directory, which 22.05 does not name to the Epilog)
    //     and with `--output=%x-%j.out` (the Epilog has no job name).
    for (extra, file) in [
        (vec!["--output="], "slurm-{id}.out"),
        (
            vec!["--output=%x-%j.out", "--job-name=oomjob"],
            "oomjob-{id}.out",
        ),
    ] {
        let (job, _, ok) = cluster.sbatch(&extra, &workload_env, oom_script);
        assert!(!ok, "job {job} failed");
        let out_file = dir.join("out").join(file.replace("{id}", &job));
        let text = std::fs::read_to_string(&out_file)
            .unwrap_or_else(|e| panic!("{extra:?}: job output {}: {e}", out_file.display()));
        assert!(text.contains("CUDA out of memory"), "{text}");
        let run = wait_until("the OOM run record", Duration::from_secs(20), || {
            runs_of_job(&ctl_url, &job)
        });
        assert_eq!(
            run.result.failure_reason(),
            Some(FailureReason::Oom),
            "{extra:?}: {run:?}; epilog log: {}",
            std::fs::read_to_string(dir.join("epilog.log")).unwrap_or_default()
        );
    }

    // 6b'. A job its cgroup killed for host memory: slurmstepd writes
    //      `Detected 1 oom_kill event in StepId=…` into the job's output
    //      (this test cluster enforces no memory limit, so the job writes
    //      slurmstepd's line itself). Recorded `other_error` with host_oom,
    //      never a GPU OOM.
    let killed_script = "#!/bin/sh\necho \"slurmstepd: error: Detected 1 oom_kill event in StepId=$SLURM_JOB_ID.batch. Some of the step tasks have been OOM Killed.\" >&2\nexit 137\n";
    let (job, _, ok) = cluster.sbatch(&[], &workload_env, killed_script);
    assert!(!ok, "job {job} failed");
    let run = wait_until("the host-OOM run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job)
    });
    assert_eq!(
        run.result.failure_reason(),
        Some(FailureReason::OtherError),
        "{run:?}"
    );
    assert!(run.result.host_oom(), "{run:?}");

    // 6c. Output thrown away: the Epilog says (at info) it read nothing.
    let (job, _, _) = cluster.sbatch(&["--output=/dev/null"], &workload_env, oom_script);
    wait_until("the /dev/null run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job)
    });
    let log = std::fs::read_to_string(dir.join("epilog.log")).unwrap_or_default();
    assert!(
        log.lines()
            .any(|l| l.contains(&format!("job {job}: no output file could be read"))),
        "epilog log: {log}"
    );

    // 6d. A job that ignores GPUFIT_MICRO_BATCH_SIZE (it runs 16, or 8 if
    //     16 was injected) and says so in its result record, in the file
    //     the TaskProlog named: stored with what it ran (`ran_other`), the
    //     record's exact peak, and the next job learns from that batch.
    let ignoring = "#!/bin/sh\nif [ \"$GPUFIT_MICRO_BATCH_SIZE\" = 16 ]; then RAN=8; else RAN=16; fi\nprintf '{\"schema_version\":1,\"source\":\"track\",\"world_size\":1,\"injected\":{\"micro_batch_size\":%s},\"ran\":{\"micro_batch_size\":%s,\"gradient_accumulation_steps\":%s},\"peaks\":[{\"rank\":0,\"allocated_bytes\":40000000000,\"reserved_bytes\":42949672960}],\"tokens_per_sec\":4321.0,\"steps\":5,\"outcome\":\"completed\"}' \"$GPUFIT_MICRO_BATCH_SIZE\" \"$RAN\" $((16 / RAN)) > \"$GPUFIT_RESULT_FILE\"\necho ran=$RAN\necho job-ran\n";
    let (job5, out, ok) = cluster.sbatch(&[], &workload_env, ignoring);
    assert!(ok && out.contains("job-ran"), "job {job5}: {out}");
    let ran: u32 = out
        .lines()
        .find_map(|l| l.strip_prefix("ran="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("job {job5} printed its batch: {out}"));
    let run5 = wait_until("the mismatch run record", Duration::from_secs(20), || {
        runs_of_job(&ctl_url, &job5)
    });
    assert_eq!(run5.settings.micro_batch_size, ran, "{run5:?}");
    assert_eq!(run5.settings.gradient_accumulation_steps, 16 / ran);
    assert_eq!(
        run5.confirmation,
        gpufit::core::confirm::Confirmation::RanOther,
        "{run5:?}"
    );
    assert_eq!(run5.result.peak_memory_bytes, Some(40 << 30), "{run5:?}");
    assert_eq!(run5.result.tokens_per_sec, Some(4321.0));
    assert_eq!(run5.predicted_peak_bytes, None, "{run5:?}");
    assert!(
        !gpufit::core::result_record::slurm_result_path(&job5).exists(),
        "the Epilog removes the record file"
    );
    let (job6, out, ok) = cluster.sbatch(&[], &workload_env, PRINT_ENV);
    assert!(ok, "job {job6}: {out}");
    let reasoning = gpufit_vars(&out)
        .get("GPUFIT_REASONING")
        .cloned()
        .unwrap_or_default();
    assert!(
        reasoning.contains(&format!("micro batch {ran} measured 40.0 GiB")),
        "job {job6} learns from the batch job {job5} ran: {reasoning}"
    );

    // 7. Controller stopped: the job still runs, without gpufit variables,
    //    and the TaskProlog added well under 2 s.
    controller.stop();
    let (job4, out, ok) = cluster.sbatch(&[], &workload_env, PRINT_ENV);
    assert!(ok && out.contains("job-ran"), "job {job4}: {out}");
    assert!(no_settings(&out), "no settings: {out}");
    let t = cluster.task_prolog_time(&job4);
    assert!(
        t < Duration::from_secs(2),
        "TaskProlog took {t:?} with the controller down"
    );
}

/// The micro batch each node's task printed (`task on NODE: …=VALUE`).
fn task_micro_batches(out: &str, nodes: &[&str]) -> Vec<String> {
    nodes
        .iter()
        .map(|node| {
            let head = format!("task on {node}: GPUFIT_MICRO_BATCH_SIZE=");
            out.lines()
                .find_map(|l| l.strip_prefix(&head))
                .unwrap_or_else(|| panic!("no task ran on {node}: {out}"))
                .to_string()
        })
        .collect()
}

/// A job over two nodes (two slurmd on this host, nodes named by their
/// sidecar's loopback address so `{node}` in the sidecar URL reaches each
/// node's own sidecar): every node's Epilog reports its own peak, and the
/// job is one record with the larger node's peak, 2 of 2 nodes. A job one
/// of whose nodes never reports is one record, partial, 1 of 2.
#[test]
fn a_two_node_job_is_one_record_with_the_larger_nodes_peak() {
    let tmp = tempfile::Builder::new()
        .prefix("gpufit-slurm2-")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    // Node names that are loopback addresses: 127.0.0.0/8 is all
    // loopback on Linux, so each node's sidecar has its own address and
    // `http://{node}:PORT` needs no name resolution.
    let (a, b) = ("127.0.0.2", "127.0.0.3");
    let cluster = Cluster::start_nodes(dir, &[a, b]);
    std::fs::write(dir.join("token"), "test-token-0123456789abcdef\n").unwrap();
    chmod(&dir.join("token"), 0o600);
    std::fs::create_dir_all(dir.join("gpu-jobs")).unwrap();
    let state_dir = dir.join("gpufit-state");
    let history = format!("sqlite:{}/history.db", dir.display());
    let ctl_port = free_port();
    let (controller, ctl_url) = start_controller_at(dir, &history, ctl_port);
    let controller = std::cell::RefCell::new(controller);
    let port = free_port();
    let (_side_a, side_a) = start_sidecar_at(dir, a, port);
    let (mut side_b_daemon, side_b) = start_sidecar_at(dir, b, port);
    cluster.write_config(&[
        format!("controller_url = \"{ctl_url}\""),
        format!("token_file = \"{}\"", dir.join("token").display()),
        format!("state_dir = \"{}\"", state_dir.display()),
        format!("sidecar_url = \"http://{{node}}:{port}\""),
    ]);
    let workload_env = [
        ("GPUFIT_MODEL", "meta-llama/Llama-3.1-8B"),
        ("GPUFIT_SEQ_LEN", "2048"),
        ("GPUFIT_GLOBAL_BATCH", "16"),
        ("GPUFIT_METHOD", "lora"),
        ("GPUFIT_LORA_RANK", "16"),
    ];
    // One task per node (a TaskProlog, and the job's state, on each), then
    // the gate while the test plays each node's training process.
    let script = "#!/bin/sh\nsrun -N 2 --ntasks-per-node=1 sh -c 'echo \"task on $SLURMD_NODENAME: GPUFIT_MICRO_BATCH_SIZE=$GPUFIT_MICRO_BATCH_SIZE\"'\n\"$JOB_TEST_GATE\"\necho job-ran\n";
    let (peak_a, peak_b) = (30 * (1u64 << 30), 50 * (1u64 << 30));
    let started = Instant::now();
    let (job, out, ok) = cluster.sbatch_during(&["-N", "2"], &workload_env, script, |job, gpus| {
        for node in [a, b] {
            let state = state_dir.join(format!("job-{job}.{node}.json"));
            assert!(state.is_file(), "{} while the job runs", state.display());
        }
        simulate_training(&side_a, job, gpus, peak_a);
        simulate_training(&side_b, job, gpus, peak_b);
        // The controller restarts while the job runs: the TaskProlog asked
        // the first one, the Epilogs report to the second.
        controller.borrow_mut().stop();
        *controller.borrow_mut() = start_controller_at(dir, &history, ctl_port).0;
    });
    assert!(ok && out.contains("job-ran"), "job {job}: {out}");
    let micro = task_micro_batches(&out, &[a, b]);
    assert!(!micro[0].is_empty(), "the tasks got settings: {out}");
    assert_eq!(micro[0], micro[1], "every rank the same settings: {out}");
    cluster.wait_job_done(&job);
    let runs = records_of_job(&ctl_url, &job);
    assert_eq!(
        runs.len(),
        1,
        "one record of job {job}: {runs:?}; epilog log: {}",
        std::fs::read_to_string(dir.join("epilog.log")).unwrap_or_default()
    );
    let run = &runs[0];
    assert_eq!(
        run.result.peak_memory_bytes,
        Some(peak_b),
        "the larger node's peak: {run:?}"
    );
    assert_eq!(
        run.nodes
            .as_ref()
            .map(|n| (n.reported, n.expected, n.partial())),
        Some((2, 2, false)),
        "{run:?}"
    );
    assert_eq!(run.node.as_deref(), Some("127.0.0.2,127.0.0.3"));
    assert!(run.result.success(), "{run:?}");
    for node in [a, b] {
        assert!(
            !state_dir.join(format!("job-{job}.{node}.json")).exists(),
            "each node's Epilog removed its own state file"
        );
    }
    let full_job = started.elapsed();

    // b's report again (a retried Epilog) after one more restart: still
    // one record, unchanged.
    controller.borrow_mut().stop();
    *controller.borrow_mut() = start_controller_at(dir, &history, ctl_port).0;
    let mut again = run.clone();
    again.id = None;
    again.node = Some(b.into());
    again.nodes = Some(gpufit::core::run::NodeReports {
        reported: 1,
        expected: 2,
        without_peak: Vec::new(),
    });
    let (status, body) = call(
        agent()
            .post(&format!("{ctl_url}/v1/runs"))
            .set("Authorization", "Bearer test-token-0123456789abcdef"),
        Some(&serde_json::to_string(&again).unwrap()),
    );
    assert_eq!(status, 201, "{body}");
    let after = records_of_job(&ctl_url, &job);
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(&after[0], run, "a repeated node report changes nothing");

    // Node b's sidecar goes away while the job runs (after b's TaskProlog
    // saved its state): b's Epilog cannot read its peak and reports
    // without one. Both nodes reported, but the peak is a's only: the
    // record is partial and names b as the node without a peak.
    let (job3, out, ok) =
        cluster.sbatch_during(&["-N", "2"], &workload_env, script, |job, gpus| {
            assert!(state_dir.join(format!("job-{job}.{b}.json")).is_file());
            simulate_training(&side_a, job, gpus, peak_a);
            simulate_training(&side_b, job, gpus, peak_b);
            side_b_daemon.stop();
        });
    assert!(ok, "job {job3}: {out}");
    cluster.wait_job_done(&job3);
    let runs = records_of_job(&ctl_url, &job3);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(
        runs[0].result.peak_memory_bytes,
        Some(peak_a),
        "a's peak, not b's: {:?}",
        runs[0]
    );
    let n = runs[0].nodes.clone().expect("node counts");
    assert_eq!(
        (n.reported, n.expected, n.peaks(), n.partial()),
        (2, 2, 1, true),
        "{:?}",
        runs[0]
    );
    assert_eq!(n.without_peak, vec![b.to_string()]);
    assert!(
        !state_dir.join(format!("job-{job3}.{b}.json")).exists(),
        "b's Epilog ran and reported"
    );

    // Node b's sidecar is down: b's TaskProlog cannot tell its GPU, so b
    // keeps no state (its task still has the batch step's settings) and
    // its Epilog never reports. The record is written at a's report,
    // partial, 1 of 2, and stays so.
    let (job2, out, ok) =
        cluster.sbatch_during(&["-N", "2"], &workload_env, script, |job, gpus| {
            assert!(state_dir.join(format!("job-{job}.{a}.json")).is_file());
            assert!(!state_dir.join(format!("job-{job}.{b}.json")).exists());
            simulate_training(&side_a, job, gpus, peak_a);
        });
    assert!(ok, "job {job2}: {out}");
    let micro = task_micro_batches(&out, &[a, b]);
    assert_eq!(micro[0], micro[1], "every rank the same settings: {out}");
    cluster.wait_job_done(&job2);
    let runs = records_of_job(&ctl_url, &job2);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(runs[0].result.peak_memory_bytes, Some(peak_a));
    assert_eq!(
        runs[0]
            .nodes
            .as_ref()
            .map(|n| (n.reported, n.expected, n.partial())),
        Some((1, 2, true)),
        "{:?}",
        runs[0]
    );
    assert_eq!(runs[0].node.as_deref(), Some(a));
    eprintln!(
        "two-node job recorded in {full_job:?}; whole test {:?}",
        started.elapsed()
    );
}

/// `gpufit slurm task-prolog` on a MIG node, as slurmstepd runs it for a
/// job given one slice by `AutoDetect=nvml`: `CUDA_VISIBLE_DEVICES` names the
/// slice by its MIG UUID and `SLURM_JOB_GPUS` holds its gres index. The
/// simulate sidecar's card 0 has a 1g.5gb slice first and a 3g.20gb one
/// second; each job is planned for its own slice, not the card's first.
/// (No slurmd: Slurm cannot schedule simulated MIG devices; the hook reads
/// only its environment, the sidecar and a local history here.)
#[test]
fn a_mig_job_is_planned_for_the_slice_in_its_cuda_visible_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let port = free_port();
    let side = format!("http://127.0.0.1:{port}");
    let log = dir.join("sidecar-mig.log");
    let mut d = Daemon::spawn(
        "sidecar",
        Command::new(BIN)
            .args([
                "sidecar",
                "--backend",
                "simulate",
                "--simulate-model",
                "NVIDIA A100-SXM4-40GB",
                "--simulate-gpus",
                "1",
                "--simulate-mig",
                "0:1g.5gb,3g.20gb",
                "--listen",
            ])
            .arg(format!("127.0.0.1:{port}"))
            .env("GPUFIT_LOG", "info"),
        &log,
    );
    wait_for_http(&mut d, &format!("{side}/healthz"), &log);
    let (status, gpus) = call(agent().get(&format!("{side}/v1/gpus")), None);
    assert_eq!(status, 200, "{gpus}");
    // Each slice's UUID, memory and place (its gres index: slices in order).
    let slices: Vec<(String, String, u64)> = gpus["gpus"]
        .as_array()
        .expect("a GPU list")
        .iter()
        .filter(|g| g["mig"].is_object())
        .map(|g| {
            (
                g["mig"]["profile"].as_str().unwrap().to_string(),
                g["uuid"].as_str().unwrap().to_string(),
                g["memory_total_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        slices.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(),
        ["1g.5gb", "3g.20gb"],
        "{gpus}"
    );
    let config = dir.join("slurm.toml");
    std::fs::write(&config, "").unwrap();
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let prolog =
        |job: &str, visible: &str, gres: &str| -> std::collections::BTreeMap<String, String> {
            let out = Command::new(BIN)
                .args(["slurm", "task-prolog"])
                .env_clear()
                .env("PATH", std::env::var("PATH").unwrap_or_default())
                .env("GPUFIT_SLURM_CONFIG", &config)
                .env("GPUFIT_SIDECAR_URL", &side)
                .env(
                    "GPUFIT_HISTORY",
                    format!("sqlite:{}", dir.join("history.db").display()),
                )
                .env("GPUFIT_STATE_DIR", &state)
                .env("GPUFIT_TIMEOUT_MS", "1900")
                .env("SLURMD_NODENAME", "mig1")
                .env("SLURM_JOB_ID", job)
                .env("SLURM_JOB_GPUS", gres)
                .env("CUDA_VISIBLE_DEVICES", visible)
                .env("GPUFIT_MODEL", "Qwen/Qwen2.5-0.5B")
                .env("GPUFIT_METHOD", "lora")
                .env("GPUFIT_SEQ_LEN", "2048")
                .output()
                .expect("gpufit slurm task-prolog runs");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| l.strip_prefix("export "))
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
    let (small, big) = (&slices[0], &slices[1]);

    // The 3g.20gb slice (gres index 1): planned for its 20 GB; before, every
    // MIG job was planned for the card's first slice, the 1g.5gb.
    let v = prolog("301", &big.1, "1");
    assert_eq!(
        v.get("GPUFIT_GPU_MODEL").map(String::as_str),
        Some("NVIDIA A100-SXM4-40GB MIG 3g.20gb"),
        "{v:?}"
    );
    let peak: u64 = v["GPUFIT_PREDICTED_PEAK_BYTES"].parse().unwrap();
    assert!(
        peak > small.2 && peak <= big.2,
        "a plan for the 3g.20gb slice's {} bytes, more than the 1g.5gb holds: {peak}",
        big.2
    );
    let reasoning = &v["GPUFIT_REASONING"];
    assert!(
        reasoning.contains("MIG slice 3g.20gb") && reasoning.contains(big.1.as_str()),
        "the reasoning names the slice: {reasoning}"
    );

    // The 1g.5gb slice (gres index 0): planned for its 5 GB.
    let v = prolog("302", &small.1, "0");
    assert_eq!(
        v.get("GPUFIT_GPU_MODEL").map(String::as_str),
        Some("NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
        "{v:?}"
    );
    let peak: u64 = v["GPUFIT_PREDICTED_PEAK_BYTES"].parse().unwrap();
    assert!(
        peak <= small.2,
        "fits the 1g.5gb slice's {} bytes: {peak}",
        small.2
    );
    let micro = |v: &std::collections::BTreeMap<String, String>| -> u32 {
        v["GPUFIT_MICRO_BATCH_SIZE"].parse().unwrap()
    };
    let small_micro = micro(&v);
    assert!(v["GPUFIT_REASONING"].contains("MIG slice 1g.5gb"), "{v:?}");

    // A job given both slices: one set of settings for every rank, the
    // 1g.5gb's.
    let both = format!("{},{}", big.1, small.1);
    let v = prolog("303", &both, "0,1");
    assert_eq!(
        v.get("GPUFIT_GPU_MODEL").map(String::as_str),
        Some("NVIDIA A100-SXM4-40GB MIG 1g.5gb"),
        "{v:?}"
    );
    assert!(
        v["GPUFIT_REASONING"].contains("smallest of the job's 2 devices"),
        "{v:?}"
    );
    // Two ranks: the micro batch is per rank, the same as the slice alone's.
    assert_eq!(micro(&v), small_micro, "{v:?}");
}
