//! Per-job GPU memory: current and peak, kept until read after the job ended.
//!
//! A job's memory is tracked per GPU, because a GPU's memory is the limit a
//! job runs into: `peak_bytes` of a job is the largest per-GPU peak, the
//! figure the advisor compares with one GPU's capacity.
//!
//! A MIG slice is a device of its own (its memory is isolated from its
//! siblings'): a job's processes on a slice count on that slice, keyed by
//! the card's index and the slice's place on it, never on the card or a
//! sibling slice.
//!
//! Per GPU, the current value is the sum of the job's processes on it; the
//! peak is the largest such sum seen. With NVML accounting on, each process
//! contributes its exact lifetime maximum instead of its current use (the
//! sum of maxima is exact for the usual one process per GPU, an upper bound
//! otherwise), and the peak says `nvml_accounting`; otherwise `sampled`.
//! A peak stated in the job's own log, when supplied, wins (`log`).
//!
//! Memory stays bounded: an ended job is dropped once it has been read
//! through the API and `retention_after_read` has passed, or unread after
//! `max_unread_age`; beyond `max_jobs` the oldest ended jobs go first.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::attribution::JobKey;
use super::source::{ProcessObservation, SliceRef};
pub use crate::wire::sidecar::{JobGpuView, JobView, PeakMethod};

/// A device a job's memory is tracked on: a whole GPU (`None`) or one MIG
/// slice of it.
type Device = (u32, Option<SliceRef>);

/// Bounds on what the tracker keeps.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    /// Most jobs kept (running jobs are never dropped; ended ones are, oldest first).
    pub max_jobs: usize,
    /// How long an ended job stays after its first read through the API.
    pub retention_after_read: Duration,
    /// How long an ended job stays when nobody reads it.
    pub max_unread_age: Duration,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        Self {
            max_jobs: 1024,
            // Long enough for an epilog, a controller retry and a few Prometheus scrapes.
            retention_after_read: Duration::from_secs(300),
            max_unread_age: Duration::from_secs(3600),
        }
    }
}

#[derive(Debug, Clone, Default)]
struct GpuUsage {
    current: u64,
    peak: u64,
    exact: bool,
}

#[derive(Debug, Clone)]
struct TrackedJob {
    key: JobKey,
    gpus: BTreeMap<Device, GpuUsage>,
    processes: usize,
    first_seen: DateTime<Utc>,
    last_seen: DateTime<Utc>,
    ended_at: Option<DateTime<Utc>>,
    first_read_after_end: Option<DateTime<Utc>>,
    log_peak: Option<u64>,
}

/// One job in one sample: its key, per GPU (sum of current, sum of peak
/// candidates, all from accounting?), and its running process count.
type Seen = (JobKey, BTreeMap<Device, (u64, u64, bool)>, usize);

/// The per-job state machine, fed one sample at a time.
#[derive(Debug, Default)]
pub struct Tracker {
    cfg: TrackerConfig,
    jobs: HashMap<String, TrackedJob>,
}

impl Tracker {
    pub fn new(cfg: TrackerConfig) -> Self {
        Self {
            cfg,
            jobs: HashMap::new(),
        }
    }

    /// Number of jobs held.
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Whether a process of job `id` may be tracked without holding more
    /// running jobs than `max_jobs` (ended ones make room as they go): the
    /// job is held already, or fewer than `max_jobs` are running.
    pub fn has_room_for(&self, id: &str) -> bool {
        self.jobs.contains_key(id)
            || self.jobs.values().filter(|j| j.ended_at.is_none()).count() < self.cfg.max_jobs
    }

    /// Whether no job is held.
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Folds one sample in. Processes without a job are ignored; jobs with
    /// no process in this sample are marked ended (their peak is kept).
    pub fn update(&mut self, processes: &[ProcessObservation], now: DateTime<Utc>) {
        // (job id) → (device) → (sum of current, sum of peak candidates, all exact?)
        let mut seen: HashMap<String, Seen> = HashMap::new();
        for p in processes {
            let Some(job) = &p.job else { continue };
            let entry = seen
                .entry(job.id())
                .or_insert_with(|| (job.clone(), BTreeMap::new(), 0));
            let g = entry
                .1
                .entry((p.gpu, p.mig.clone()))
                .or_insert((0, 0, true));
            if p.running {
                g.0 = g.0.saturating_add(p.used_bytes);
                entry.2 += 1;
            }
            let candidate = p.max_bytes.unwrap_or(p.used_bytes).max(p.used_bytes);
            g.1 = g.1.saturating_add(candidate);
            g.2 &= p.max_bytes.is_some();
        }
        for (id, (key, gpus, nprocs)) in seen {
            let job = self.jobs.entry(id).or_insert_with(|| TrackedJob {
                key,
                gpus: BTreeMap::new(),
                processes: 0,
                first_seen: now,
                last_seen: now,
                ended_at: None,
                first_read_after_end: None,
                log_peak: None,
            });
            for u in job.gpus.values_mut() {
                u.current = 0;
            }
            for (gpu, (current, candidate, exact)) in gpus {
                let u = job.gpus.entry(gpu).or_default();
                u.current = current;
                if candidate > u.peak {
                    u.peak = candidate;
                    u.exact = exact;
                } else if candidate == u.peak && exact {
                    u.exact = true;
                }
            }
            job.processes = nprocs;
            if nprocs > 0 {
                job.last_seen = now;
                job.ended_at = None;
                job.first_read_after_end = None;
            } else if job.ended_at.is_none() {
                job.ended_at = Some(now);
            }
        }
        for job in self.jobs.values_mut() {
            if job.last_seen < now && job.ended_at.is_none() {
                job.ended_at = Some(now);
                job.processes = 0;
                for u in job.gpus.values_mut() {
                    u.current = 0;
                }
            }
        }
        self.evict(now);
    }

    /// Records the peak a job's own log states (bytes per GPU). Creates the
    /// job when it is not tracked (e.g. reported after eviction).
    pub fn set_log_peak(&mut self, key: JobKey, peak_bytes: u64, now: DateTime<Utc>) -> JobView {
        let job = self.jobs.entry(key.id()).or_insert_with(|| TrackedJob {
            key,
            gpus: BTreeMap::new(),
            processes: 0,
            first_seen: now,
            last_seen: now,
            ended_at: Some(now),
            first_read_after_end: None,
            log_peak: None,
        });
        job.log_peak = Some(peak_bytes);
        view(job, "")
    }

    /// A job by id, marking it read (which starts its eviction clock once ended).
    pub fn read(&mut self, id: &str, node: &str, now: DateTime<Utc>) -> Option<JobView> {
        let job = self.jobs.get_mut(id)?;
        if job.ended_at.is_some() && job.first_read_after_end.is_none() {
            job.first_read_after_end = Some(now);
        }
        Some(view(job, node))
    }

    /// Every job, sorted by id, marking ended ones read.
    pub fn read_all(&mut self, node: &str, now: DateTime<Utc>) -> Vec<JobView> {
        let mut out: Vec<JobView> = self
            .jobs
            .values_mut()
            .map(|job| {
                if job.ended_at.is_some() && job.first_read_after_end.is_none() {
                    job.first_read_after_end = Some(now);
                }
                view(job, node)
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// A job by id without marking it read.
    pub fn peek(&self, id: &str, node: &str) -> Option<JobView> {
        self.jobs.get(id).map(|j| view(j, node))
    }

    /// Every job without marking anything read (for metrics).
    pub fn peek_all(&self, node: &str) -> Vec<JobView> {
        self.jobs.values().map(|j| view(j, node)).collect()
    }

    fn evict(&mut self, now: DateTime<Utc>) {
        let after_read = chrono::Duration::from_std(self.cfg.retention_after_read)
            .unwrap_or(chrono::Duration::MAX);
        let unread =
            chrono::Duration::from_std(self.cfg.max_unread_age).unwrap_or(chrono::Duration::MAX);
        self.jobs
            .retain(|_, j| match (j.ended_at, j.first_read_after_end) {
                (None, _) => true,
                (Some(_), Some(read)) => now - read < after_read,
                (Some(ended), None) => now - ended < unread,
            });
        if self.jobs.len() > self.cfg.max_jobs {
            let mut ended: Vec<(bool, DateTime<Utc>, String)> = self
                .jobs
                .iter()
                .filter_map(|(id, j)| {
                    j.ended_at
                        .map(|e| (j.first_read_after_end.is_none(), e, id.clone()))
                })
                .collect();
            // Read jobs before unread ones, then oldest first.
            ended.sort();
            let excess = self.jobs.len() - self.cfg.max_jobs;
            for (_, _, id) in ended.into_iter().take(excess) {
                self.jobs.remove(&id);
            }
        }
    }
}

fn view(j: &TrackedJob, node: &str) -> JobView {
    let gpus: Vec<JobGpuView> = j
        .gpus
        .iter()
        .map(|((gpu, mig), u)| JobGpuView {
            gpu: *gpu,
            mig: mig.clone(),
            current_bytes: u.current,
            peak_bytes: u.peak,
            method: if u.exact {
                PeakMethod::NvmlAccounting
            } else {
                PeakMethod::Sampled
            },
        })
        .collect();
    let top = gpus.iter().max_by_key(|g| (g.peak_bytes, g.method));
    let measured_peak_bytes = top.map_or(0, |g| g.peak_bytes);
    let measured_method = top.map_or(PeakMethod::Sampled, |g| g.method);
    let (peak_bytes, method) = match j.log_peak {
        Some(p) => (p, PeakMethod::Log),
        None => (measured_peak_bytes, measured_method),
    };
    let (namespace, pod, pod_uid, slurm_job_id) = match &j.key {
        JobKey::Pod { namespace, pod } => (Some(namespace.clone()), Some(pod.clone()), None, None),
        JobKey::PodUid { pod_uid } => (None, None, Some(pod_uid.clone()), None),
        JobKey::Slurm { slurm_job_id } => (None, None, None, Some(slurm_job_id.clone())),
    };
    JobView {
        id: j.key.id(),
        kind: j.key.kind().to_string(),
        namespace,
        pod,
        pod_uid,
        slurm_job_id,
        node: node.to_string(),
        running: j.ended_at.is_none(),
        current_bytes: gpus.iter().map(|g| g.current_bytes).max().unwrap_or(0),
        current_total_bytes: gpus.iter().map(|g| g.current_bytes).sum(),
        peak_bytes,
        method,
        measured_peak_bytes,
        measured_method,
        gpus,
        processes: j.processes,
        first_seen: j.first_seen,
        last_seen: j.last_seen,
        ended_at: j.ended_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000 + s, 0).expect("valid timestamp")
    }

    fn slurm(id: &str) -> JobKey {
        JobKey::Slurm {
            slurm_job_id: id.into(),
        }
    }

    fn obs(pid: u32, gpu: u32, used: u64, max: Option<u64>, job: &JobKey) -> ProcessObservation {
        ProcessObservation {
            pid,
            gpu,
            mig: None,
            used_bytes: used,
            max_bytes: max,
            running: true,
            job: Some(job.clone()),
        }
    }

    #[test]
    fn sampled_peak_survives_the_fall_and_the_end_of_the_job() {
        let j = slurm("7");
        let mut tr = Tracker::new(TrackerConfig::default());
        for (i, used) in [10u64, 30, 50, 20].iter().enumerate() {
            tr.update(&[obs(1, 0, *used, None, &j)], t(i as i64));
        }
        let v = tr.read("7", "n", t(4)).expect("tracked");
        assert_eq!((v.current_bytes, v.peak_bytes), (20, 50));
        assert_eq!(v.method, PeakMethod::Sampled);
        assert!(v.running);
        tr.update(&[], t(5));
        let v = tr.read("7", "n", t(5)).expect("kept after the end");
        assert_eq!((v.current_bytes, v.peak_bytes, v.running), (0, 50, false));
        assert_eq!(v.ended_at, Some(t(5)));
    }

    #[test]
    fn accounting_maximum_is_exact_and_beats_a_missed_sample() {
        let j = slurm("8");
        let mut tr = Tracker::new(TrackerConfig::default());
        tr.update(&[obs(1, 0, 10, Some(70), &j)], t(0));
        let v = tr.read("8", "n", t(0)).expect("tracked");
        assert_eq!((v.peak_bytes, v.method), (70, PeakMethod::NvmlAccounting));
    }

    #[test]
    fn job_peak_is_the_largest_per_gpu_peak_and_processes_on_one_gpu_add_up() {
        let j = slurm("9");
        let mut tr = Tracker::new(TrackerConfig::default());
        tr.update(
            &[
                obs(1, 0, 30, None, &j),
                obs(2, 0, 5, None, &j),
                obs(3, 1, 32, None, &j),
            ],
            t(0),
        );
        let v = tr.read("9", "n", t(0)).expect("tracked");
        assert_eq!(v.peak_bytes, 35);
        assert_eq!(v.current_total_bytes, 67);
        assert_eq!(v.gpus.len(), 2);
        assert_eq!(v.processes, 3);
    }

    #[test]
    fn log_stated_peak_is_preferred_and_the_measured_one_is_kept_beside_it() {
        let j = slurm("10");
        let mut tr = Tracker::new(TrackerConfig::default());
        tr.update(&[obs(1, 0, 40, None, &j)], t(0));
        tr.set_log_peak(j, 45, t(1));
        let v = tr.read("10", "n", t(1)).expect("tracked");
        assert_eq!((v.peak_bytes, v.method), (45, PeakMethod::Log));
        assert_eq!(
            (v.measured_peak_bytes, v.measured_method),
            (40, PeakMethod::Sampled)
        );
    }

    #[test]
    fn ended_job_is_evicted_only_after_it_was_read_and_retention_passed() {
        let cfg = TrackerConfig {
            max_jobs: 100,
            retention_after_read: Duration::from_secs(10),
            max_unread_age: Duration::from_secs(100),
        };
        let (a, b) = (slurm("a"), slurm("b"));
        let mut tr = Tracker::new(cfg);
        tr.update(&[obs(1, 0, 1, None, &a), obs(2, 0, 1, None, &b)], t(0));
        tr.update(&[], t(1));
        assert!(tr.read("a", "n", t(2)).is_some());
        tr.update(&[], t(11));
        assert_eq!(tr.len(), 2, "a read 9 s ago, b unread");
        tr.update(&[], t(12));
        assert!(
            tr.read("a", "n", t(12)).is_none(),
            "a evicted 10 s after its read"
        );
        assert!(tr.peek_all("n").iter().any(|j| j.id == "b"));
        tr.update(&[], t(101));
        assert!(tr.is_empty(), "unread b dropped after max_unread_age");
    }

    #[test]
    fn tracker_never_holds_more_than_max_jobs_ended_ones_go_oldest_first() {
        let cfg = TrackerConfig {
            max_jobs: 3,
            ..TrackerConfig::default()
        };
        let mut tr = Tracker::new(cfg);
        for i in 0..10u32 {
            let j = slurm(&i.to_string());
            tr.update(&[obs(i, 0, 1, None, &j)], t(i as i64));
            assert!(tr.len() <= 3);
        }
        tr.update(&[], t(20));
        let ids: Vec<String> = tr.read_all("n", t(20)).into_iter().map(|j| j.id).collect();
        assert_eq!(ids, vec!["7", "8", "9"]);
    }

    #[test]
    fn a_job_that_comes_back_is_running_again_with_its_old_peak() {
        let j = slurm("11");
        let mut tr = Tracker::new(TrackerConfig::default());
        tr.update(&[obs(1, 0, 90, None, &j)], t(0));
        tr.update(&[], t(1));
        tr.update(&[obs(2, 0, 10, None, &j)], t(2));
        let v = tr.read("11", "n", t(2)).expect("tracked");
        assert!(v.running);
        assert_eq!((v.current_bytes, v.peak_bytes), (10, 90));
    }

    #[test]
    fn peaks_on_mig_slices_of_one_card_stay_apart_and_off_the_card() {
        let (a, b) = (slurm("a"), slurm("b"));
        let slice = |device: u32| {
            Some(SliceRef {
                device,
                profile: "1g.10gb".into(),
            })
        };
        let on = |pid: u32, device: u32, used: u64, job: &JobKey| ProcessObservation {
            mig: slice(device),
            ..obs(pid, 0, used, None, job)
        };
        let mut tr = Tracker::new(TrackerConfig::default());
        // Two jobs on two slices of GPU 0; a second process of `a` on its slice.
        tr.update(&[on(1, 0, 8, &a), on(2, 1, 3, &b), on(3, 0, 1, &a)], t(0));
        tr.update(&[on(1, 0, 2, &a), on(2, 1, 9, &b)], t(1));
        let va = tr.read("a", "n", t(1)).expect("tracked");
        let vb = tr.read("b", "n", t(1)).expect("tracked");
        assert_eq!((va.peak_bytes, va.current_bytes), (9, 2), "8 + 1 at t0");
        assert_eq!((vb.peak_bytes, vb.current_bytes), (9, 9));
        assert_eq!(va.gpus.len(), 1);
        assert_eq!(va.gpus[0].mig, slice(0));
        assert_eq!(vb.gpus[0].mig, slice(1));
        // The same job on the whole GPU 1 and on slice 0 of GPU 0: two devices.
        tr.update(&[on(1, 0, 4, &a), obs(4, 1, 50, None, &a)], t(2));
        let va = tr.read("a", "n", t(2)).expect("tracked");
        assert_eq!(va.gpus.len(), 2);
        assert_eq!(va.peak_bytes, 50);
        assert_eq!(va.gpus[0].peak_bytes, 9, "the slice keeps its own peak");
    }
}
