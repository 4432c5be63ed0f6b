//! Job attribution: which Kubernetes pod or Slurm job a GPU process belongs to.
//!
//! Tried in this order for each PID (host PID namespace; in a DaemonSet the
//! sidecar needs `hostPID: true` or the host's `/proc` mounted, see `--proc-root`):
//! 1. `/proc/<pid>/cgroup` — cgroup v1 and v2, systemd and cgroupfs drivers:
//!    a Kubernetes pod slice gives the pod UID (and the container id); a
//!    Slurm step cgroup (`…/job_<id>/step_<id>/task_<n>`) gives the job id.
//! 2. `/proc/<pid>/environ` — `SLURM_JOB_ID`, for Slurm sites without cgroup
//!    process tracking.
//! 3. The mapping directory (dcgm-exporter's HPC convention): a file
//!    `<dir>/<gpu index>` holding the id of the Slurm job that owns the GPU,
//!    written by the prolog and removed by the epilog. A process on a MIG
//!    slice is looked up by the slice's own ids instead
//!    (`<dir>/MIG-<uuid>`, `<dir>/MIG-GPU-<card uuid>_<gi>_<ci>`:
//!    [`crate::slurm::plan::mig_mapping_name`]), never by its card's index.
//!
//! A pod UID is turned into `namespace/pod` by a [`PodResolver`]. The one
//! built in reads the process's own environment for `GPUFIT_POD_NAMESPACE` /
//! `GPUFIT_POD_NAME` (the gpufit controller injects both through the
//! downward API) or the common `POD_NAMESPACE` / `POD_NAME`. When neither is
//! there the job is known by its pod UID alone (`kind: pod_uid`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{LazyLock, Mutex};

use regex::Regex;
use serde::{Deserialize, Serialize};

// === job identity ===

/// The identity of a job on this node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum JobKey {
    /// A Kubernetes pod with a known namespace and name. Id: `namespace/pod`.
    Pod { namespace: String, pod: String },
    /// A Kubernetes pod known only by its UID. Id: the UID.
    PodUid { pod_uid: String },
    /// A Slurm job. Id: the job id.
    Slurm { slurm_job_id: String },
}

impl JobKey {
    /// The id used in `/v1/jobs/{id}`: `namespace/pod`, a pod UID, or a Slurm job id.
    pub fn id(&self) -> String {
        match self {
            JobKey::Pod { namespace, pod } => format!("{namespace}/{pod}"),
            JobKey::PodUid { pod_uid } => pod_uid.clone(),
            JobKey::Slurm { slurm_job_id } => slurm_job_id.clone(),
        }
    }

    /// `pod`, `pod_uid` or `slurm`.
    pub fn kind(&self) -> &'static str {
        match self {
            JobKey::Pod { .. } => "pod",
            JobKey::PodUid { .. } => "pod_uid",
            JobKey::Slurm { .. } => "slurm",
        }
    }
}

// === cgroup parsing ===

/// What a cgroup path says about a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupIdentity {
    /// A Kubernetes pod; the UID always with dashes, the container id when the path names one.
    Pod {
        uid: String,
        container_id: Option<String>,
    },
    /// A Slurm job (and step / task when the path names them).
    Slurm {
        job_id: String,
        step: Option<String>,
        task: Option<u32>,
    },
}

// Pod UIDs: RFC 4122 UUIDs (systemd slices write `_` for `-`), or for static
// pods the 32-hex config hash the kubelet uses as UID.
static POD_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}|[0-9a-fA-F]{32})(?:\.slice)?(?:/|$)",
    )
    .expect("static regex")
});
// Container ids: 64 hex, bare (cgroupfs) or in a runtime scope
// (`cri-containerd-…`, `crio-…`, `docker-…`, `cri-dockerd-…`, `crio-conmon-…`).
static CONTAINER_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:[a-z-]+-)?([0-9a-f]{64})(?:\.scope)?$").expect("static regex")
});
static SLURM_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"/job_(\d+)(?:/step_([A-Za-z0-9_]+))?(?:/user)?(?:/task_(\d+))?(?:/|$)")
        .expect("static regex")
});

/// Parses the text of `/proc/<pid>/cgroup` (v1: one `id:controllers:path`
/// line per hierarchy; v2: the single `0::path` line). None when no line
/// names a pod or a Slurm job (a system service, a login session, a plain
/// docker container).
pub fn parse_cgroup(text: &str) -> Option<CgroupIdentity> {
    for line in text.lines() {
        // The path is everything after the second ':' (paths may hold ':').
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(_), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if let Some(id) = parse_cgroup_path(path) {
            return Some(id);
        }
    }
    None
}

/// Parses one cgroup path (see [`parse_cgroup`]).
pub fn parse_cgroup_path(path: &str) -> Option<CgroupIdentity> {
    if let Some(c) = POD_RE.captures(path) {
        let uid = c[1].replace('_', "-").to_ascii_lowercase();
        let after = &path[c.get(0).map_or(path.len(), |m| m.end())..];
        let container_id = after
            .split('/')
            .find_map(|seg| CONTAINER_RE.captures(seg).map(|c| c[1].to_string()));
        return Some(CgroupIdentity::Pod { uid, container_id });
    }
    if let Some(c) = SLURM_RE.captures(path) {
        return Some(CgroupIdentity::Slurm {
            job_id: c[1].to_string(),
            step: c.get(2).map(|m| m.as_str().to_string()),
            task: c.get(3).and_then(|m| m.as_str().parse().ok()),
        });
    }
    None
}

/// Values of interest in a NUL-separated `/proc/<pid>/environ`.
fn env_value<'a>(environ: &'a [u8], name: &str) -> Option<&'a str> {
    environ.split(|b| *b == 0).find_map(|kv| {
        let kv = std::str::from_utf8(kv).ok()?;
        let (k, v) = kv.split_once('=')?;
        (k == name && !v.is_empty()).then_some(v)
    })
}

// === reading /proc (behind a trait so tests feed strings) ===

/// Reads a process's cgroup and environment.
pub trait ProcReader: Send + Sync {
    /// Text of `/proc/<pid>/cgroup`.
    fn cgroup(&self, pid: u32) -> std::io::Result<String>;
    /// Bytes of `/proc/<pid>/environ` (NUL-separated `NAME=value`).
    fn environ(&self, pid: u32) -> std::io::Result<Vec<u8>>;
}

/// Reads from a proc filesystem root (`/proc`, or the host's mounted elsewhere).
#[derive(Debug, Clone)]
pub struct ProcFs {
    pub root: PathBuf,
}

impl ProcReader for ProcFs {
    fn cgroup(&self, pid: u32) -> std::io::Result<String> {
        std::fs::read_to_string(self.root.join(pid.to_string()).join("cgroup"))
    }
    fn environ(&self, pid: u32) -> std::io::Result<Vec<u8>> {
        std::fs::read(self.root.join(pid.to_string()).join("environ"))
    }
}

/// Pod UID → (namespace, pod name).
pub trait PodResolver: Send + Sync {
    /// `environ` is the process's environment when it could be read.
    fn resolve(&self, pod_uid: &str, environ: Option<&[u8]>) -> Option<(String, String)>;
}

/// The built-in resolver: the process's own `GPUFIT_POD_NAMESPACE` /
/// `GPUFIT_POD_NAME` (downward API, injected by the gpufit controller),
/// else `POD_NAMESPACE` / `POD_NAME`.
#[derive(Debug, Clone, Default)]
pub struct EnvPodResolver;

impl PodResolver for EnvPodResolver {
    fn resolve(&self, _pod_uid: &str, environ: Option<&[u8]>) -> Option<(String, String)> {
        let env = environ?;
        [
            ("GPUFIT_POD_NAMESPACE", "GPUFIT_POD_NAME"),
            ("POD_NAMESPACE", "POD_NAME"),
        ]
        .iter()
        .find_map(|(ns, name)| {
            Some((
                env_value(env, ns)?.to_string(),
                env_value(env, name)?.to_string(),
            ))
        })
    }
}

/// Reads the mapping directory: `<dir>/<gpu index>` holds a Slurm job id.
fn mapping_dir_job(dir: &Path, gpu: u32) -> Option<String> {
    mapping_file_job(dir, &gpu.to_string())
}

/// Reads the mapping file `<dir>/<name>`: a Slurm job id.
fn mapping_file_job(dir: &Path, name: &str) -> Option<String> {
    let text = std::fs::read_to_string(dir.join(name)).ok()?;
    let id = text.trim();
    // A job id is a number, possibly an array task `123_4`; anything else is ignored.
    (!id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .then(|| id.to_string())
}

// === the attributor ===

/// Attributes PIDs to jobs, caching each PID's answer while it is alive.
pub struct Attributor {
    proc: Box<dyn ProcReader>,
    pods: Box<dyn PodResolver>,
    mapping_dir: Option<PathBuf>,
    cache: Mutex<HashMap<u32, Option<JobKey>>>,
}

impl Attributor {
    pub fn new(
        proc: Box<dyn ProcReader>,
        pods: Box<dyn PodResolver>,
        mapping_dir: Option<PathBuf>,
    ) -> Self {
        Self {
            proc,
            pods,
            mapping_dir,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Reads `/proc` under `proc_root` with the built-in pod resolver.
    pub fn from_proc_root(proc_root: PathBuf, mapping_dir: Option<PathBuf>) -> Self {
        Self::new(
            Box::new(ProcFs { root: proc_root }),
            Box::new(EnvPodResolver),
            mapping_dir,
        )
    }

    /// The job of `pid` running on GPU `gpu`, without caching.
    pub fn attribute(&self, pid: u32, gpu: u32) -> Option<JobKey> {
        self.attribute_on(pid, gpu, None)
    }

    /// The job of `pid` running on GPU `gpu` — on a MIG slice whose mapping
    /// file names are `slice_names` when given — without caching.
    pub fn attribute_on(
        &self,
        pid: u32,
        gpu: u32,
        slice_names: Option<&[String]>,
    ) -> Option<JobKey> {
        let environ = self.proc.environ(pid).ok();
        if let Ok(text) = self.proc.cgroup(pid) {
            match parse_cgroup(&text) {
                Some(CgroupIdentity::Pod { uid, .. }) => {
                    return Some(match self.pods.resolve(&uid, environ.as_deref()) {
                        Some((namespace, pod)) => JobKey::Pod { namespace, pod },
                        None => JobKey::PodUid { pod_uid: uid },
                    });
                }
                Some(CgroupIdentity::Slurm { job_id, .. }) => {
                    return Some(JobKey::Slurm {
                        slurm_job_id: job_id,
                    })
                }
                None => {}
            }
        }
        if let Some(id) = environ
            .as_deref()
            .and_then(|e| env_value(e, "SLURM_JOB_ID"))
        {
            return Some(JobKey::Slurm {
                slurm_job_id: id.to_string(),
            });
        }
        let dir = self.mapping_dir.as_deref()?;
        let id = match slice_names {
            None => mapping_dir_job(dir, gpu),
            // On a MIG node the card's index file is no job's: a slice's
            // job is found by the slice's own ids only.
            Some(names) => names.iter().find_map(|n| mapping_file_job(dir, n)),
        };
        id.map(|slurm_job_id| JobKey::Slurm { slurm_job_id })
    }

    /// Fills `job` on every observation that has none; forgets PIDs no
    /// longer observed so the cache stays as small as the process list.
    pub fn attribute_all(&self, processes: &mut [super::source::ProcessObservation]) {
        self.attribute_all_on(processes, &[]);
    }

    /// [`Attributor::attribute_all`], with the sample's devices: a process
    /// on a MIG slice is looked up in the mapping directory by its slice's
    /// ids (from `gpus`).
    pub fn attribute_all_on(
        &self,
        processes: &mut [super::source::ProcessObservation],
        gpus: &[super::source::GpuInfo],
    ) {
        let mut cache = match self.cache.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        };
        let mut fresh = HashMap::with_capacity(processes.len());
        for p in processes.iter_mut() {
            if p.job.is_some() {
                continue;
            }
            let job = match cache.get(&p.pid) {
                Some(j) => j.clone(),
                None => self.attribute_on(p.pid, p.gpu, slice_names(p, gpus).as_deref()),
            };
            fresh.insert(p.pid, job.clone());
            p.job = job;
        }
        *cache = fresh;
    }
}

/// The mapping file names of the MIG slice a process runs on (None on a
/// whole GPU): its `MIG-<uuid>` and, when its instance ids are known, the
/// `MIG-GPU-<card uuid>_<gi>_<ci>` form; empty when the slice is not in
/// `gpus` (no file can then be told to be its).
fn slice_names(
    p: &super::source::ProcessObservation,
    gpus: &[super::source::GpuInfo],
) -> Option<Vec<String>> {
    let slice = p.mig.as_ref()?;
    let Some(g) = gpus
        .iter()
        .find(|g| g.index == p.gpu && g.mig.as_ref().is_some_and(|m| m.device == slice.device))
    else {
        return Some(Vec::new());
    };
    let instance = g.mig.as_ref().and_then(|m| {
        Some((
            m.parent_uuid.as_str(),
            m.gpu_instance_id?,
            m.compute_instance_id?,
        ))
    });
    Some(
        [
            crate::slurm::plan::mig_mapping_name(Some(&g.uuid), None),
            crate::slurm::plan::mig_mapping_name(None, instance),
        ]
        .into_iter()
        .flatten()
        .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f4d7a3e-5b9c-4b1e-9e0c-2a0c7c3d8f11";
    const CID: &str = "3c1b2f9d8e7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c";

    fn pod(cid: Option<&str>) -> Option<CgroupIdentity> {
        Some(CgroupIdentity::Pod {
            uid: UID.to_string(),
            container_id: cid.map(str::to_string),
        })
    }

    fn slurm(job: &str, step: Option<&str>, task: Option<u32>) -> Option<CgroupIdentity> {
        Some(CgroupIdentity::Slurm {
            job_id: job.to_string(),
            step: step.map(str::to_string),
            task,
        })
    }

    #[test]
    fn real_world_cgroup_shapes_map_to_pods_and_slurm_jobs() {
        let uid_ = UID.replace('-', "_");
        let cases: Vec<(&str, String, Option<CgroupIdentity>)> = vec![
            (
                "v2 systemd containerd burstable",
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{CID}.scope\n"),
                pod(Some(CID)),
            ),
            (
                "v2 systemd CRI-O besteffort",
                format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{CID}.scope\n"),
                pod(Some(CID)),
            ),
            (
                "v2 systemd guaranteed (no QoS slice)",
                format!("0::/kubepods.slice/kubepods-pod{uid_}.slice/cri-containerd-{CID}.scope"),
                pod(Some(CID)),
            ),
            (
                "v2 kind / nested kubelet slice",
                format!("0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{uid_}.slice/cri-containerd-{CID}.scope"),
                pod(Some(CID)),
            ),
            (
                "v2 cgroupfs driver",
                format!("0::/kubepods/burstable/pod{UID}/{CID}"),
                pod(Some(CID)),
            ),
            (
                "v1 cgroupfs containerd, several hierarchies",
                format!("12:pids:/kubepods/burstable/pod{UID}/{CID}\n11:memory:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n"),
                pod(Some(CID)),
            ),
            (
                "v1 cgroupfs guaranteed",
                format!("4:devices:/kubepods/pod{UID}/{CID}"),
                pod(Some(CID)),
            ),
            (
                "v1 systemd docker (dockershim)",
                format!("9:cpuset:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/docker-{CID}.scope"),
                pod(Some(CID)),
            ),
            (
                "CRI-O conmon belongs to the pod, container id of the conmon scope",
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-conmon-{CID}.scope"),
                pod(Some(CID)),
            ),
            (
                "pod sandbox level (no container)",
                format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice"),
                pod(None),
            ),
            (
                "static pod with a 32-hex config-hash UID",
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6d6f5e2b1f0e0b7d3c6a8f9e0d1c2b3a.slice/cri-containerd-aa.scope".to_string(),
                Some(CgroupIdentity::Pod { uid: "6d6f5e2b1f0e0b7d3c6a8f9e0d1c2b3a".into(), container_id: None }),
            ),
            (
                "Slurm cgroup v1",
                "7:memory:/slurm/uid_1000/job_1234/step_0/task_0\n6:devices:/slurm/uid_1000/job_1234/step_0\n".to_string(),
                slurm("1234", Some("0"), Some(0)),
            ),
            (
                "Slurm cgroup v1 with node name (multiple slurmd)",
                "5:freezer:/slurm_node01/uid_1000/job_77/step_batch".to_string(),
                slurm("77", Some("batch"), None),
            ),
            (
                "Slurm cgroup v2 task",
                "0::/system.slice/slurmstepd.scope/job_4321/step_0/user/task_3".to_string(),
                slurm("4321", Some("0"), Some(3)),
            ),
            (
                "Slurm cgroup v2 batch step",
                "0::/system.slice/slurmstepd.scope/job_4321/step_batch/user/task_0".to_string(),
                slurm("4321", Some("batch"), Some(0)),
            ),
            (
                "Slurm cgroup v2 extern step",
                "0::/system.slice/slurmstepd.scope/job_9/step_extern".to_string(),
                slurm("9", Some("extern"), None),
            ),
            ("login session", "0::/user.slice/user-1000.slice/session-3.scope".to_string(), None),
            ("plain docker container", format!("0::/system.slice/docker-{CID}.scope"), None),
            ("init", "0::/init.scope".to_string(), None),
            ("root", "0::/".to_string(), None),
            ("garbage", "not a cgroup file\n::\n".to_string(), None),
            ("empty", String::new(), None),
            (
                "a path that merely mentions pod is not a pod",
                "0::/system.slice/podman-1234.scope".to_string(),
                None,
            ),
        ];
        for (what, text, want) in cases {
            assert_eq!(parse_cgroup(&text), want, "{what}: {text}");
        }
    }

    struct FakeProc {
        cgroup: HashMap<u32, String>,
        environ: HashMap<u32, Vec<u8>>,
    }

    impl ProcReader for FakeProc {
        fn cgroup(&self, pid: u32) -> std::io::Result<String> {
            self.cgroup
                .get(&pid)
                .cloned()
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
        fn environ(&self, pid: u32) -> std::io::Result<Vec<u8>> {
            self.environ
                .get(&pid)
                .cloned()
                .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        }
    }

    fn attributor(mapping_dir: Option<PathBuf>) -> Attributor {
        let uid_ = UID.replace('-', "_");
        let pod_cg = format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{CID}.scope");
        let cgroup = HashMap::from([
            (10, pod_cg.clone()),
            (11, pod_cg),
            (
                20,
                "0::/system.slice/slurmstepd.scope/job_555/step_0/user/task_0".into(),
            ),
            (30, "0::/user.slice/user-0.slice/session-1.scope".into()),
            (40, "0::/user.slice/user-0.slice/session-1.scope".into()),
        ]);
        let environ = HashMap::from([
            (
                10,
                b"PATH=/bin\0GPUFIT_POD_NAMESPACE=team-a\0GPUFIT_POD_NAME=train-0\0".to_vec(),
            ),
            (30, b"HOME=/root\0SLURM_JOB_ID=808\0".to_vec()),
        ]);
        Attributor::new(
            Box::new(FakeProc { cgroup, environ }),
            Box::new(EnvPodResolver),
            mapping_dir,
        )
    }

    #[test]
    fn pod_with_downward_api_env_resolves_to_namespace_and_name() {
        let a = attributor(None);
        assert_eq!(
            a.attribute(10, 0),
            Some(JobKey::Pod {
                namespace: "team-a".into(),
                pod: "train-0".into()
            })
        );
        assert_eq!(
            a.attribute(11, 0),
            Some(JobKey::PodUid {
                pod_uid: UID.into()
            })
        );
    }

    #[test]
    fn slurm_job_comes_from_cgroup_then_environment_then_mapping_dir() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("3"), "4242\n").expect("write mapping file");
        std::fs::write(dir.path().join("4"), "not a job id!\n").expect("write mapping file");
        let a = attributor(Some(dir.path().to_path_buf()));
        let slurm = |id: &str| {
            Some(JobKey::Slurm {
                slurm_job_id: id.into(),
            })
        };
        assert_eq!(a.attribute(20, 3), slurm("555"));
        assert_eq!(a.attribute(30, 3), slurm("808"));
        assert_eq!(a.attribute(40, 3), slurm("4242"));
        assert_eq!(
            a.attribute(40, 4),
            None,
            "malformed mapping file is ignored"
        );
        assert_eq!(a.attribute(40, 5), None, "no mapping file for GPU 5");
        assert_eq!(a.attribute(99, 0), None, "unreadable /proc entry");
    }

    #[test]
    fn proc_fs_reads_cgroup_and_environ_under_its_root() {
        let root = tempfile::tempdir().expect("temp dir");
        let p = root.path().join("4321");
        std::fs::create_dir(&p).expect("mkdir");
        std::fs::write(
            p.join("cgroup"),
            "0::/system.slice/slurmstepd.scope/job_99/step_0/user/task_0\n",
        )
        .expect("write cgroup");
        std::fs::write(p.join("environ"), b"A=1\0").expect("write environ");
        let a = Attributor::from_proc_root(root.path().to_path_buf(), None);
        let mut obs = vec![super::super::source::ProcessObservation {
            pid: 4321,
            gpu: 0,
            mig: None,
            used_bytes: 1,
            max_bytes: None,
            running: true,
            job: None,
        }];
        a.attribute_all(&mut obs);
        assert_eq!(
            obs[0].job,
            Some(JobKey::Slurm {
                slurm_job_id: "99".into()
            })
        );
    }

    #[test]
    fn job_ids_are_namespace_slash_pod_uid_or_slurm_id() {
        assert_eq!(
            JobKey::Pod {
                namespace: "a".into(),
                pod: "b".into()
            }
            .id(),
            "a/b"
        );
        assert_eq!(
            JobKey::Slurm {
                slurm_job_id: "12".into()
            }
            .id(),
            "12"
        );
    }

    /// The Prolog's MIG mapping files, in both of Slurm's id forms, name
    /// the job of a process on that slice; the card's index file does not.
    #[test]
    fn a_process_on_a_mig_slice_is_found_by_its_slices_mapping_file() {
        use crate::sidecar::simulate::{parse_mig_layout, SimulateConfig, SimulatedSource};
        use crate::sidecar::source::GpuSource;
        use crate::slurm::plan::{mapping_files_named, mapping_names, Env};
        let gpus = SimulatedSource::new(&SimulateConfig {
            gpus: 1,
            model: "NVIDIA A100-SXM4-40GB".into(),
            memory_bytes: None,
            node: "n".into(),
            demo_jobs: 0,
            mig: parse_mig_layout("0:1g.5gb,3g.20gb").expect("layout"),
            mig_parent_refused: false,
        })
        .expect("simulate")
        .sample()
        .gpus;
        let slice = &gpus[2];
        let m = slice.mig.as_ref().expect("a slice");
        let legacy = format!(
            "MIG-{}/{}/{}",
            m.parent_uuid,
            m.gpu_instance_id.expect("gi"),
            m.compute_instance_id.expect("ci")
        );
        for (job, visible) in [("700", slice.uuid.clone()), ("701", legacy)] {
            let dir = tempfile::tempdir().expect("temp dir");
            // Another job owns gres index 0: not this slice's process's.
            std::fs::write(dir.path().join("0"), "999\n").expect("write");
            let env: Env = [
                ("CUDA_VISIBLE_DEVICES".to_string(), visible.clone()),
                ("SLURM_JOB_GPUS".to_string(), "1".to_string()),
            ]
            .into();
            let names = mapping_names(&env).expect("names");
            assert_eq!(names.len(), 1, "{names:?}");
            for (path, content) in mapping_files_named(dir.path(), job, &names) {
                std::fs::write(path, content).expect("write");
            }
            let a = attributor(Some(dir.path().to_path_buf()));
            let on = |device: u32| super::super::source::ProcessObservation {
                pid: 40,
                gpu: 0,
                mig: Some(super::super::source::SliceRef {
                    device,
                    profile: String::new(),
                }),
                used_bytes: 1,
                max_bytes: None,
                running: true,
                job: None,
            };
            let mut obs = vec![on(1)];
            a.attribute_all_on(&mut obs, &gpus);
            assert_eq!(
                obs[0].job,
                Some(JobKey::Slurm {
                    slurm_job_id: job.into()
                }),
                "{visible}"
            );
            // The other slice has no mapping file: no job, not index 0's.
            let a = attributor(Some(dir.path().to_path_buf()));
            let mut obs = vec![on(0)];
            a.attribute_all_on(&mut obs, &gpus);
            assert_eq!(obs[0].job, None, "{visible}");
        }
    }
}
