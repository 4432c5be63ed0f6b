//! The history stores against one contract: SQLite on a temp file, and a
//! real PostgreSQL server started by the test from Debian's binaries on
//! 127.0.0.1 (a free port, a temp data directory), stopped afterwards.

use gpufit::core::run::RunOutcome;
use std::io::Write;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use gpufit::core::run::{
    FailureReason, NodeReportEffect, NodeReports, RunRecord, RunResult, RunSource,
};
use gpufit::core::settings::{Dtype, EngineeringSettings};
use gpufit::core::similarity::HistoryQuery;
use gpufit::core::workload::Method;
use gpufit::history::jsonl::{ImportOptions, JsonlReader};
use gpufit::history::sqlite::{SqliteOptions, SqliteStore};
use gpufit::history::{self, HistoryError, HistoryStore, ListFilter};

// === fixtures ===

/// Each call is a distinct job (a real scheduler never reuses a job id
/// within a cluster), so the stores keep every one.
static NEXT_JOB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn run(model: &str, gpu: &str, seq: u32, batch: u32, minute: u32) -> RunRecord {
    let job = NEXT_JOB.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc
            .with_ymd_and_hms(2026, 1, 1, 10, minute, 0)
            .single()
            .expect("valid time"),
        cluster: Some("c1".into()),
        node: Some("n1".into()),
        source: RunSource::Cli,
        job_id: Some(format!("job-{minute}-{job}")),
        model: model.into(),
        method: Method::Lora,
        gpu_model: gpu.into(),
        seq_len: seq,
        lora_rank: Some(16),
        gpus: 1,
        global_batch: Some(64),
        settings: EngineeringSettings {
            micro_batch_size: batch,
            gradient_accumulation_steps: 64 / batch.max(1),
            dtype: Dtype::Bf16,
            activation_checkpointing: true,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::Succeeded,
            peak_memory_bytes: Some(20_000_000_000 + batch as u64 * 1_000_000_000),
            samples_per_sec: Some(3.5),
            tokens_per_sec: Some(7168.0),
            duration_sec: Some(600.0),
        },
        predicted_peak_bytes: Some(21_000_000_000),
    }
}

fn oom(mut r: RunRecord) -> RunRecord {
    r.result = RunResult {
        outcome: RunOutcome::GpuOom,
        peak_memory_bytes: None,
        samples_per_sec: None,
        tokens_per_sec: None,
        duration_sec: Some(12.0),
    };
    r
}

const M: &str = "meta-llama/Llama-3.1-8B";
const A100: &str = "NVIDIA A100-SXM4-80GB";
const H100: &str = "NVIDIA H100 80GB HBM3";

/// The behaviour every store must have. Starts from an empty store.
fn contract(store: &dyn HistoryStore) {
    assert_eq!(store.count().unwrap(), 0);

    // record → similar gives the same record back, id filled in (its
    // settings confirmation too: the stores keep all three).
    let first = run(M, A100, 2048, 4, 1)
        .with_confirmation(gpufit::core::confirm::Confirmation::Unconfirmed);
    let id = store.record(&first).unwrap();
    let got = store
        .similar(&HistoryQuery::new(M, Method::Lora, A100, 2048))
        .unwrap();
    assert_eq!(got.len(), 1);
    let mut want = first.clone();
    want.id = Some(id);
    assert_eq!(got[0], want, "every field survives the round trip");

    // similar: same key within ±10 % sequence; other keys excluded.
    store
        .record(
            &run(M, A100, 2200, 8, 2)
                .with_confirmation(gpufit::core::confirm::Confirmation::RanOther),
        )
        .unwrap(); // +7 %: similar
    store.record(&run(M, A100, 4096, 8, 3)).unwrap(); // other seq
    store.record(&run(M, H100, 2048, 8, 4)).unwrap(); // other GPU
    store
        .record(&run("Qwen/Qwen2.5-7B", A100, 2048, 8, 5))
        .unwrap(); // other model
    let mut full = run(M, A100, 2048, 8, 6);
    full.method = Method::Full;
    store.record(&full).unwrap(); // other method
    store.record(&oom(run(M, A100, 2048, 16, 7))).unwrap(); // an OOM, same key
    assert_eq!(store.count().unwrap(), 7);
    let sim = store
        .similar(&HistoryQuery::new(M, Method::Lora, A100, 2048))
        .unwrap();
    let mut batches: Vec<u32> = sim.iter().map(|r| r.settings.micro_batch_size).collect();
    batches.sort();
    assert_eq!(batches, vec![4, 8, 16]);
    assert_eq!(sim.iter().filter(|r| r.is_oom()).count(), 1);
    assert_eq!(
        sim.iter()
            .find(|r| r.seq_len == 2200)
            .map(|r| r.confirmation),
        Some(gpufit::core::confirm::Confirmation::RanOther)
    );

    // list: newest first, filters, limit.
    let all = store.list(&ListFilter::default()).unwrap();
    assert_eq!(all.len(), 7);
    assert!(all.windows(2).all(|w| w[0].timestamp >= w[1].timestamp));
    assert!(
        all[0]
            .job_id
            .as_deref()
            .is_some_and(|j| j.starts_with("job-7-")),
        "{:?}",
        all[0].job_id
    );
    let h100 = store
        .list(&ListFilter {
            gpu_model: Some(H100.into()),
            ..ListFilter::default()
        })
        .unwrap();
    assert_eq!(h100.len(), 1);
    let two = store
        .list(&ListFilter {
            model: Some(M.into()),
            limit: Some(2),
            ..ListFilter::default()
        })
        .unwrap();
    assert_eq!(two.len(), 2);

    // set_peak fills in a peak; an unknown id is an error.
    let mut late = run(M, A100, 2048, 2, 8);
    late.result.peak_memory_bytes = None;
    let late_id = store.record(&late).unwrap();
    store.set_peak(late_id, 31_000_000_000).unwrap();
    let back = store
        .similar(&HistoryQuery::new(M, Method::Lora, A100, 2048))
        .unwrap()
        .into_iter()
        .find(|r| r.id == Some(late_id))
        .unwrap();
    assert_eq!(back.result.peak_memory_bytes, Some(31_000_000_000));
    assert!(matches!(
        store.set_peak(999_999, 1),
        Err(HistoryError::NoSuchRun { .. })
    ));

    // record_batch is all or nothing.
    let before = store.count().unwrap();
    let mut failing = vec![
        Ok(run(M, A100, 2048, 1, 9)),
        Ok(run(M, A100, 2048, 1, 10)),
        Err(HistoryError::Io {
            path: "x.jsonl".into(),
            message: "disk went away".into(),
        }),
    ]
    .into_iter();
    assert!(store.record_batch(&mut failing).is_err());
    assert_eq!(
        store.count().unwrap(),
        before,
        "a failed batch stores nothing"
    );
    let mut ok = (0..50).map(|k| Ok(run(M, H100, 1024, 1 + k % 8, 11)));
    assert_eq!(store.record_batch(&mut ok).unwrap(), 50);
    assert_eq!(store.count().unwrap(), before + 50);

    // for_each streams every record, oldest first.
    let mut seen = 0;
    let mut last = None;
    store
        .for_each(&mut |r| {
            if let Some(prev) = last {
                assert!(r.timestamp >= prev);
            }
            last = Some(r.timestamp);
            seen += 1;
            Ok(())
        })
        .unwrap();
    assert_eq!(seen, before + 50);
}

// === SQLite ===

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("temp dir")
}

/// Recording the same run twice (a retried Epilog, a replayed reconcile, a
/// re-imported file) stores it once; the replay updates it.
fn a_run_recorded_twice_is_stored_once(store: &dyn HistoryStore) {
    let before = store.count().unwrap();
    let mut r = run(M, A100, 4096, 3, 30);
    r.result.peak_memory_bytes = None;
    let id = store.record(&r).unwrap();
    r.result.peak_memory_bytes = Some(31_000_000_000);
    let id2 = store.record(&r).unwrap();
    assert_eq!(id, id2, "the replay updates the same row");
    assert_eq!(store.count().unwrap(), before + 1);
    let q = HistoryQuery::new(M, Method::Lora, A100, 4096);
    let got: Vec<RunRecord> = store
        .similar(&q)
        .unwrap()
        .into_iter()
        .filter(|x| x.job_id == r.job_id)
        .collect();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].result.peak_memory_bytes, Some(31_000_000_000));
    // Without a job id the content identifies the run: a batch holding the
    // same record twice, imported twice, stores it once.
    let mut anon = run(M, A100, 4096, 5, 31);
    anon.job_id = None;
    anon.source = RunSource::Import;
    for _ in 0..2 {
        let mut batch = vec![Ok(anon.clone()), Ok(anon.clone())].into_iter();
        store.record_batch(&mut batch).unwrap();
    }
    assert_eq!(store.count().unwrap(), before + 2);
    // Keyed where it was parsed (an import's reader thread), recorded one
    // at a time, or in a batch: one key, one row.
    let keyed = anon.clone().keyed().unwrap();
    assert_eq!(keyed.key(), anon.identity());
    let mut batch = vec![Ok(keyed)].into_iter();
    assert_eq!(store.record_batch_keyed(&mut batch).unwrap(), 1);
    store.record(&anon).unwrap();
    assert_eq!(store.count().unwrap(), before + 2);
    // A record that fails validation is refused before it is keyed.
    let mut bad = anon.clone();
    bad.gpu_model = "auto".into();
    assert!(bad.keyed().is_err());
}

/// One node's report of multi-node job `job` (of `expected` nodes).
fn node_report(job: &str, node: &str, peak: u64, expected: u32) -> RunRecord {
    let mut r = run(M, A100, 8192, 2, 40);
    r.node = Some(node.into());
    r.source = RunSource::Slurm;
    r.job_id = Some(job.into());
    r.result.peak_memory_bytes = Some(peak);
    // Eight GPUs a node: a job's node count is bounded by its GPUs.
    r.gpus = 8 * expected.max(1);
    r.nodes = Some(NodeReports {
        reported: 1,
        expected,
        without_peak: Vec::new(),
    });
    r
}

/// The job's one record, found by its job id.
fn job_record(store: &dyn HistoryStore, job: &str) -> RunRecord {
    let all = store.list(&ListFilter::default()).unwrap();
    let mine: Vec<RunRecord> = all
        .into_iter()
        .filter(|r| r.job_id.as_deref() == Some(job))
        .collect();
    assert_eq!(mine.len(), 1, "one record of job {job}: {mine:?}");
    mine.into_iter().next().unwrap()
}

/// Issue 47: a record written whole (`record`, an import's batch) never
/// replaces a job's multi-node record nor a run of its id over an hour
/// apart; the store says why (`Invalid`) and the stored record is as it was.
/// A replay of the same run still updates it in place.
fn a_whole_record_never_replaces_a_multi_node_one_or_another_run(store: &dyn HistoryStore) {
    use gpufit::history::HistoryError;
    let rec = |job: &str| job_record(store, job);
    store
        .record_node_report(&node_report("guard-1", "n1", 30_000_000_000, 2))
        .unwrap();
    let before = rec("guard-1");
    let mut whole = node_report("guard-1", "n1", 20_000_000_000, 2);
    whole.nodes = None;
    match store.record(&whole) {
        Err(HistoryError::Invalid(e)) => {
            assert!(e.to_string().contains("does not replace"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // Through a batch (an import), it is held back too.
    let mut batch = vec![Ok(whole.clone())].into_iter();
    let _ = store.record_batch(&mut batch);
    assert_eq!(rec("guard-1"), before);
    // A reused Slurm job id: the older run stays.
    let mut old = node_report("guard-2", "n1", 30_000_000_000, 1);
    old.nodes = None;
    store.record(&old).unwrap();
    let before = rec("guard-2");
    let mut later = old.clone();
    later.timestamp += chrono::Duration::hours(2);
    assert!(matches!(
        store.record(&later),
        Err(HistoryError::Invalid(_))
    ));
    assert_eq!(rec("guard-2"), before);
    // The same run again (a peak filled in) updates it.
    let mut replay = old.clone();
    replay.result.peak_memory_bytes = Some(31_000_000_000);
    store.record(&replay).unwrap();
    assert_eq!(
        rec("guard-2").result.peak_memory_bytes,
        Some(31_000_000_000)
    );
}

/// The nodes of a multi-node job fold into one record whose peak is the
/// largest node's and whose node counts survive the store (migration 3):
/// a repeated node counts once, a smaller peak after a larger one changes
/// no peak, one node's OOM makes the job an OOM, a report past the window
/// is refused and leaves the record as it was.
fn node_reports_make_one_record(store: &dyn HistoryStore) {
    let before = store.count().unwrap();
    // Each call says what the report did (the controller's metrics count
    // the job from it): made the record, joined it and completed it, nothing.
    let first = store
        .record_node_report_outcome(&node_report("multi-1", "n2", 30_000_000_000, 2))
        .unwrap();
    assert_eq!(
        (first.effect, first.completed),
        (NodeReportEffect::Created, false)
    );
    let id = first.id;
    let partial = job_record(store, "multi-1");
    assert_eq!(
        partial.nodes.as_ref().map(|n| (n.reported, n.expected)),
        Some((1, 2))
    );
    let second = store
        .record_node_report_outcome(&node_report("multi-1", "n1", 33_000_000_000, 2))
        .unwrap();
    assert_eq!(
        (second.effect, second.completed),
        (NodeReportEffect::Joined, true)
    );
    assert_eq!(id, second.id, "the second node updates the job's record");
    assert_eq!(
        second
            .record
            .as_ref()
            .and_then(|r| r.nodes.as_ref())
            .map(|n| n.reported),
        Some(2)
    );
    // n1 again (a retried Epilog) with another peak: counted once.
    let third = store
        .record_node_report_outcome(&node_report("multi-1", "n1", 35_000_000_000, 2))
        .unwrap();
    assert_eq!(
        (third.effect, third.completed, third.record.is_none()),
        (NodeReportEffect::Repeated, false, true)
    );
    assert_eq!(id, third.id);
    let whole = job_record(store, "multi-1");
    assert_eq!(whole.result.peak_memory_bytes, Some(33_000_000_000));
    assert_eq!(
        whole.nodes.as_ref().map(|n| (n.reported, n.partial())),
        Some((2, false))
    );
    assert_eq!(whole.node.as_deref(), Some("n1,n2"));
    assert!(whole.result.success());

    // Out of order: the larger peak first, a smaller one after it; the
    // third node ran out of memory.
    store
        .record_node_report(&node_report("multi-2", "a", 40_000_000_000, 3))
        .unwrap();
    store
        .record_node_report(&node_report("multi-2", "b", 20_000_000_000, 3))
        .unwrap();
    let two = job_record(store, "multi-2");
    assert_eq!(two.result.peak_memory_bytes, Some(40_000_000_000));
    assert_eq!(
        two.nodes.as_ref().map(|n| (n.reported, n.partial())),
        Some((2, true))
    );
    let mut oom_node = node_report("multi-2", "c", 25_000_000_000, 3);
    oom_node.result.outcome = RunOutcome::GpuOom;
    store.record_node_report(&oom_node).unwrap();
    let three = job_record(store, "multi-2");
    assert!(three.is_oom(), "one node's OOM is the job's: {three:?}");
    assert_eq!(three.result.peak_memory_bytes, Some(40_000_000_000));
    assert_eq!(
        three.nodes.as_ref().map(|n| (n.reported, n.expected)),
        Some((3, 3))
    );

    // A report two hours after the job's end: refused, record unchanged.
    store
        .record_node_report(&node_report("multi-3", "n1", 30_000_000_000, 2))
        .unwrap();
    let mut late = node_report("multi-3", "n2", 50_000_000_000, 2);
    late.timestamp += chrono::Duration::hours(2);
    let err = store.record_node_report(&late).unwrap_err();
    assert!(
        matches!(
            err,
            HistoryError::Invalid(gpufit::core::run::RecordError::LateNodeReport { .. })
        ),
        "{err:?}"
    );
    let kept = job_record(store, "multi-3");
    assert_eq!(kept.result.peak_memory_bytes, Some(30_000_000_000));
    assert_eq!(
        kept.nodes.as_ref().map(|n| (n.reported, n.partial())),
        Some((1, true))
    );
    // A report that names no node is refused before anything is written.
    let mut nameless = node_report("multi-4", "x", 30_000_000_000, 2);
    nameless.node = None;
    assert!(store.record_node_report(&nameless).is_err());

    // A node whose Epilog could not read its sidecar reports no peak: it
    // counts as reported, the record's peak is partial (1 of 2 nodes'
    // peaks) and says which node it lacks (migration 5).
    let peakless = |node: &str| {
        let mut r = node_report("multi-5", node, 0, 2);
        r.result.peak_memory_bytes = None;
        r
    };
    store
        .record_node_report(&node_report("multi-5", "n1", 30_000_000_000, 2))
        .unwrap();
    store.record_node_report(&peakless("n2")).unwrap();
    let lacking = job_record(store, "multi-5");
    let n = lacking.nodes.clone().unwrap();
    assert_eq!((n.reported, n.peaks(), n.partial()), (2, 1, true));
    assert_eq!(n.without_peak, vec!["n2".to_string()]);
    assert_eq!(lacking.result.peak_memory_bytes, Some(30_000_000_000));
    assert_eq!(lacking.full_peak(), None);
    // n2 again without a peak: nothing changes.
    store.record_node_report(&peakless("n2")).unwrap();
    assert_eq!(job_record(store, "multi-5"), lacking);
    // n2 again, now with its peak: the record is whole, n2 counted once.
    store
        .record_node_report(&node_report("multi-5", "n2", 36_000_000_000, 2))
        .unwrap();
    let upgraded = job_record(store, "multi-5");
    let n = upgraded.nodes.clone().unwrap();
    assert_eq!((n.reported, n.peaks(), n.partial()), (2, 2, false));
    assert!(n.without_peak.is_empty());
    assert_eq!(upgraded.full_peak(), Some(36_000_000_000));
    assert_eq!(upgraded.node.as_deref(), Some("n1,n2"));
    // Every node without a peak: no peak, 0 of 2.
    let mut a = peakless("a");
    a.job_id = Some("multi-6".into());
    let mut b = peakless("b");
    b.job_id = Some("multi-6".into());
    store.record_node_report(&a).unwrap();
    store.record_node_report(&b).unwrap();
    let none = job_record(store, "multi-6");
    assert_eq!(none.result.peak_memory_bytes, None);
    assert_eq!(none.nodes.as_ref().map(|n| n.peaks()), Some(0));
    assert_eq!(
        none.nodes.map(|n| n.without_peak),
        Some(vec!["a".to_string(), "b".to_string()])
    );
    assert_eq!(store.count().unwrap(), before + 5);
}

/// A node report of the schema before migration 5 (a multi-node record, 1
/// of 2) as an older gpufit stored it.
const V3_ROW: &str =
    "INSERT INTO runs (timestamp_us, cluster, node, source, job_id, model, method, \
    gpu_model, seq_len, gpus, micro_batch_size, gradient_accumulation_steps, dtype, \
    activation_checkpointing, activation_offloading, compile, num_workers, pin_memory, \
    persistent_workers, prefetch_factor, success, peak_memory_bytes, run_key, nodes_reported, \
    nodes_expected) VALUES";

/// A history written at schema version 3 (before the peakless-node list)
/// opens, migrates, reads its multi-node record as before (every reported
/// node's peak in), and takes a peakless report into it.
fn a_version_3_history_migrates(store: &dyn HistoryStore) {
    let old = job_record(store, "v3-1");
    let n = old.nodes.clone().unwrap();
    assert_eq!((n.reported, n.expected, n.peaks()), (1, 2, 1));
    assert!(n.without_peak.is_empty());
    assert_eq!(old.result.peak_memory_bytes, Some(30_000_000_000));
    assert_eq!(
        old.confirmation,
        gpufit::core::confirm::Confirmation::Confirmed,
        "a row from before migration 6 reads confirmed, as it was used then"
    );
    let mut report = old.clone();
    report.id = None;
    report.node = Some("n2".into());
    report.result.peak_memory_bytes = None;
    report.nodes = Some(NodeReports {
        reported: 1,
        expected: 2,
        without_peak: Vec::new(),
    });
    store.record_node_report(&report).unwrap();
    let merged = job_record(store, "v3-1");
    let n = merged.nodes.clone().unwrap();
    assert_eq!((n.reported, n.peaks()), (2, 1));
    assert_eq!(n.without_peak, vec!["n2".to_string()]);
    assert_eq!(merged.node.as_deref(), Some("n1,n2"));
}

/// The run key the stores give `r` (so an old row is found by its key).
fn key_of(r: &RunRecord) -> String {
    r.clone().keyed().unwrap().key().to_string()
}

fn v3_row(r: &RunRecord, bool_true: &str, bool_false: &str) -> String {
    format!(
        "{V3_ROW} ({}, 'c1', 'n1', 'slurm', 'v3-1', '{}', 'full', '{}', {}, {}, {}, 1, 'bf16', \
         {bool_false}, {bool_false}, {bool_false}, 0, {bool_false}, {bool_false}, 2, {bool_true}, \
         30000000000, '{}', 1, 2)",
        r.timestamp.timestamp_micros(),
        r.model,
        r.gpu_model,
        r.seq_len,
        r.gpus,
        r.settings.micro_batch_size,
        key_of(r),
    )
}

/// The record [`v3_row`] writes, as a node report would make it.
fn v3_record() -> RunRecord {
    let mut r = node_report("v3-1", "n1", 30_000_000_000, 2);
    r.cluster = Some("c1".into());
    r.lora_rank = None;
    r.global_batch = None;
    r.settings.dtype = gpufit::core::settings::Dtype::Bf16;
    r
}

#[test]
fn a_sqlite_history_of_schema_version_3_migrates_to_the_peakless_node_list() {
    use gpufit::history::schema;
    let d = tmp();
    let path = d.path().join("v3.db");
    let r = v3_record();
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(&schema::create_runs(
            "INTEGER",
            "INTEGER",
            "REAL",
            "INTEGER PRIMARY KEY",
        ))
        .unwrap();
        c.execute_batch(schema::ADD_RUN_KEY).unwrap();
        c.execute_batch(&schema::add_node_counts("INTEGER"))
            .unwrap();
        c.execute_batch(&v3_row(&r, "1", "0")).unwrap();
        c.execute_batch("PRAGMA user_version = 3").unwrap();
    }
    let store = SqliteStore::open(&path).unwrap();
    a_version_3_history_migrates(&store);
    drop(store);
    let c = rusqlite::Connection::open(&path).unwrap();
    let v: i64 = c
        .query_row("PRAGMA user_version", [], |row| row.get(0))
        .unwrap();
    assert_eq!(v, gpufit::history::sqlite::schema_version());
    // 6: the settings confirmation (older rows read `confirmed`).
    assert_eq!(v, 6);
}

/// Environment of a child process that reports nodes (see
/// [`node_report_child`]): `URL|TAG|NODE|JOBS|NODES`.
const CHILD_ENV: &str = "GPUFIT_TEST_NODE_REPORTER";

/// The report of node `node` (of `nodes`) for concurrent job `j` of `tag`:
/// every node's peak differs, job j's largest is node nodes-1's; node 0
/// of every fifth job ran out of memory.
fn concurrent_report(tag: &str, j: u32, node: u32, nodes: u32) -> RunRecord {
    let peak = 30_000_000_000 + u64::from(node) * 1_000_000_000 + u64::from(j);
    let mut r = node_report(&format!("{tag}-{j}"), &format!("n{node}"), peak, nodes);
    if node == 0 && j.is_multiple_of(5) {
        r.result.outcome = RunOutcome::GpuOom;
    }
    r
}

/// Reports node `node` of every job `0..jobs`, each twice (a retried
/// Epilog), through its own connection to `url`.
fn report_node_of_every_job(url: &str, tag: &str, node: u32, jobs: u32, nodes: u32) {
    let store = history::open(url).unwrap();
    for j in 0..jobs {
        let r = concurrent_report(tag, j, node, nodes);
        store.record_node_report(&r).unwrap();
        store.record_node_report(&r).unwrap();
    }
}

/// Not a test on its own: the body of the child processes
/// [`nodes_report_from_processes`] starts (it returns at once otherwise).
#[test]
fn node_report_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let f: Vec<&str> = spec.split('|').collect();
    let num = |i: usize| f[i].parse::<u32>().unwrap();
    report_node_of_every_job(f[0], f[1], num(2), num(3), num(4));
}

/// Every node of `jobs` jobs reporting at the same moment, one thread or
/// one process per node, each through its own connection: one record per
/// job, the largest node's peak, every node counted once.
fn nodes_report_concurrently(url: &str, tag: &str, processes: bool) {
    const JOBS: u32 = 25;
    const NODES: u32 = 4;
    if processes {
        let exe = std::env::current_exe().unwrap();
        let children: Vec<_> = (0..NODES)
            .map(|node| {
                std::process::Command::new(&exe)
                    .args([
                        "--exact",
                        "node_report_child",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env(CHILD_ENV, format!("{url}|{tag}|{node}|{JOBS}|{NODES}"))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "a reporting process failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    } else {
        let go = std::sync::Barrier::new(NODES as usize);
        std::thread::scope(|s| {
            for node in 0..NODES {
                let go = &go;
                s.spawn(move || {
                    go.wait();
                    report_node_of_every_job(url, tag, node, JOBS, NODES);
                });
            }
        });
    }
    let store = history::open(url).unwrap();
    let all = store.list(&ListFilter::default()).unwrap();
    for j in 0..JOBS {
        let job = format!("{tag}-{j}");
        let mine: Vec<&RunRecord> = all
            .iter()
            .filter(|r| r.job_id.as_deref() == Some(job.as_str()))
            .collect();
        assert_eq!(mine.len(), 1, "job {job}: {mine:?}");
        let r = mine[0];
        let want = concurrent_report(tag, j, NODES - 1, NODES);
        assert_eq!(
            r.result.peak_memory_bytes, want.result.peak_memory_bytes,
            "job {job}: the largest node's peak"
        );
        assert_eq!(
            r.nodes.as_ref().map(|n| (n.reported, n.expected)),
            Some((NODES, NODES)),
            "job {job}: every node once: {r:?}"
        );
        assert_eq!(r.node.as_deref(), Some("n0,n1,n2,n3"));
        assert_eq!(r.is_oom(), j.is_multiple_of(5), "job {job}: {r:?}");
    }
}

/// A run killed for host memory keeps that fact through the store
/// (migration 4) and teaches the next suggestion of the workload, read from
/// that store, fewer data-loader workers and no pinned memory — not a
/// smaller micro batch.
fn host_memory_kills_reach_the_advisor(store: &dyn HistoryStore) {
    use gpufit::core::advisor::{Strategy, StrategyTargets};
    use gpufit::core::request::{ModelRequest, WorkloadRequest};
    use gpufit::core::settings::Pins;
    use gpufit::service::{Ask, Pipeline};

    let model = "Qwen/Qwen2.5-7B";
    let w = WorkloadRequest {
        model: Some(ModelRequest::Catalog(model.into())),
        method: Some(Method::Lora),
        seq_len: Some(4096),
        ..WorkloadRequest::default()
    }
    .resolve()
    .unwrap();
    let gpu = gpufit::core::catalog::lookup_gpu(A100).unwrap();
    let pins = Pins::default();
    let ask = Ask {
        workload: &w,
        gpu: &gpu,
        strategy: Strategy::Balanced,
        pins: &pins,
    };
    let pipeline = Pipeline::new(StrategyTargets::default()).with_cpus_per_gpu(Some(16));
    let before = pipeline.suggest(store, &ask).unwrap();
    assert_eq!(before.settings.dataloader.num_workers, 8);
    assert!(before.settings.dataloader.pin_memory);

    let mut killed = run(
        &w.model.name,
        A100,
        4096,
        before.settings.micro_batch_size,
        30,
    );
    killed.result = RunResult {
        outcome: RunOutcome::Failed { host_oom: true },
        peak_memory_bytes: None,
        samples_per_sec: None,
        tokens_per_sec: None,
        duration_sec: Some(40.0),
    };
    killed.settings.dataloader.num_workers = 8;
    killed.settings.dataloader.pin_memory = true;
    store.record(&killed).unwrap();
    let q = HistoryQuery::new(&w.model.name, Method::Lora, A100, 4096);
    let back = store.similar(&q).unwrap();
    assert_eq!(back.len(), 1);
    assert!(back[0].result.host_oom(), "host_oom survives the store");
    assert_eq!(
        back[0].result.failure_reason(),
        Some(FailureReason::OtherError)
    );

    let after = pipeline.suggest(store, &ask).unwrap();
    assert_eq!(
        after.settings.micro_batch_size,
        before.settings.micro_batch_size
    );
    assert_eq!(after.settings.dataloader.num_workers, 4);
    assert!(!after.settings.dataloader.pin_memory);
    assert!(
        after.reasoning.contains("killed for host memory"),
        "{}",
        after.reasoning
    );
}

#[test]
fn sqlite_store_meets_the_contract() {
    let d = tmp();
    let store = SqliteStore::open(&d.path().join("h.db")).unwrap();
    contract(&store);
    a_run_recorded_twice_is_stored_once(&store);
    node_reports_make_one_record(&store);
    a_whole_record_never_replaces_a_multi_node_one_or_another_run(&store);
    host_memory_kills_reach_the_advisor(&store);
}

/// A history written before migration 4 opens, gains `host_oom` = false
/// on its rows, and keeps every row.
#[test]
fn a_version_3_sqlite_history_is_migrated_to_host_oom() {
    use gpufit::history::schema;
    let d = tmp();
    let path = d.path().join("v3.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(&schema::create_runs(
            "INTEGER",
            "INTEGER",
            "REAL",
            "INTEGER PRIMARY KEY",
        ))
        .unwrap();
        c.execute_batch(schema::ADD_RUN_KEY).unwrap();
        c.execute_batch(&schema::add_node_counts("INTEGER"))
            .unwrap();
        c.execute_batch(
            "INSERT INTO runs (timestamp_us, source, model, method, gpu_model, seq_len, gpus,
                micro_batch_size, gradient_accumulation_steps, dtype, activation_checkpointing,
                activation_offloading, compile, num_workers, pin_memory, persistent_workers,
                prefetch_factor, success, failure_reason)
             VALUES (1767261600000000, 'cli', 'meta-llama/Llama-3.1-8B', 'lora',
                'NVIDIA A100-SXM4-80GB', 8192, 1, 4, 16, 'bf16', 1, 0, 0, 4, 1, 1, 2, 0, 'other_error');
             PRAGMA user_version = 3;",
        )
        .unwrap();
    }
    let store = SqliteStore::open(&path).unwrap();
    let rows = store
        .similar(&HistoryQuery::new(M, Method::Lora, A100, 8192))
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert!(!rows[0].result.host_oom());
    assert_eq!(
        rows[0].result.failure_reason(),
        Some(FailureReason::OtherError)
    );
    let c = rusqlite::Connection::open(&path).unwrap();
    let v: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v, gpufit::history::sqlite::schema_version());
}

#[test]
fn sqlite_nodes_reporting_at_once_from_threads_and_processes_make_one_record_each() {
    let d = tmp();
    let url = format!("sqlite:{}", d.path().join("h.db").display());
    history::open(&url).unwrap();
    nodes_report_concurrently(&url, "threads", false);
    nodes_report_concurrently(&url, "processes", true);
}

#[test]
fn sqlite_finds_a_jobs_record_through_the_run_key_index() {
    let d = tmp();
    let path = d.path().join("h.db");
    let _s = SqliteStore::open(&path).unwrap();
    let c = rusqlite::Connection::open(&path).unwrap();
    let sql = format!(
        "EXPLAIN QUERY PLAN {}",
        gpufit::history::schema::select_by_key("'k'")
    );
    let plan: Vec<String> = c
        .prepare(&sql)
        .unwrap()
        .query_map([], |r| r.get::<_, String>(3))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(
        plan.iter().any(|p| p.contains("USING INDEX runs_run_key")),
        "{plan:?}"
    );
}

#[test]
fn sqlite_open_creates_missing_directories_and_records_survive_reopening() {
    let d = tmp();
    let path = d.path().join("a/b/history.db");
    let url = format!("sqlite:{}", path.display());
    {
        let s = history::open(&url).unwrap();
        s.record(&run(M, A100, 2048, 4, 1)).unwrap();
    }
    let s = history::open(&url).unwrap();
    assert_eq!(s.count().unwrap(), 1);
}

#[test]
fn sqlite_uses_wal_and_answers_similar_from_the_key_index() {
    let d = tmp();
    let path = d.path().join("h.db");
    let _s = SqliteStore::open(&path).unwrap();
    let c = rusqlite::Connection::open(&path).unwrap();
    let mode: String = c
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    let version: i64 = c
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, gpufit::history::sqlite::schema_version());
    let plan: Vec<String> = c
        .prepare("EXPLAIN QUERY PLAN SELECT * FROM runs WHERE model = 'm' AND method = 'lora' AND gpu_model = 'g' AND seq_len BETWEEN 1 AND 2")
        .unwrap()
        .query_map([], |r| r.get::<_, String>(3))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert!(
        plan.iter().any(|p| p.contains("runs_similarity_key")),
        "plan: {plan:?}"
    );
}

#[test]
fn a_new_sqlite_history_gets_8_kib_pages_and_an_existing_one_keeps_its_own() {
    let d = tmp();
    let page_size = |p: &std::path::Path| -> i64 {
        rusqlite::Connection::open(p)
            .unwrap()
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .unwrap()
    };
    let fresh = d.path().join("new.db");
    let s = SqliteStore::open(&fresh).unwrap();
    s.record(&run("m", "NVIDIA H100 80GB HBM3", 2048, 4, 0))
        .unwrap();
    drop(s);
    assert_eq!(page_size(&fresh), 8192);
    // a history made with SQLite's default 4 KiB pages (an older gpufit)
    let old = d.path().join("old.db");
    {
        let c = rusqlite::Connection::open(&old).unwrap();
        c.execute_batch("PRAGMA page_size = 4096; CREATE TABLE t (x); DROP TABLE t;")
            .unwrap();
    }
    let s = SqliteStore::open(&old).unwrap();
    s.record(&run("m", "NVIDIA H100 80GB HBM3", 2048, 4, 1))
        .unwrap();
    assert_eq!(s.count().unwrap(), 1);
    drop(s);
    assert_eq!(page_size(&old), 4096);
}

#[test]
fn a_locked_sqlite_file_gives_a_clear_error_and_loses_nothing() {
    let d = tmp();
    let path = d.path().join("h.db");
    let store = SqliteStore::open_with(
        &path,
        SqliteOptions {
            busy_timeout: Duration::from_millis(200),
        },
    )
    .unwrap();
    store.record(&run(M, A100, 2048, 4, 1)).unwrap();

    let holder = rusqlite::Connection::open(&path).unwrap();
    holder.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let err = store.record(&run(M, A100, 2048, 8, 2)).unwrap_err();
    assert!(matches!(err, HistoryError::Locked { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("locked by another process") && msg.contains("nothing was written"),
        "{msg}"
    );
    holder.execute_batch("ROLLBACK").unwrap();

    store.record(&run(M, A100, 2048, 8, 3)).unwrap();
    assert_eq!(store.count().unwrap(), 2, "the first record is still there");
}

#[test]
fn a_corrupt_sqlite_file_gives_a_clear_error_and_is_left_untouched() {
    let d = tmp();
    let path = d.path().join("h.db");
    let garbage: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &garbage).unwrap();
    let err = SqliteStore::open(&path).unwrap_err();
    assert!(matches!(err, HistoryError::Corrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("left untouched"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
}

#[test]
fn a_damaged_page_in_a_real_history_is_reported_not_hidden() {
    let d = tmp();
    let path = d.path().join("h.db");
    {
        let s = SqliteStore::open(&path).unwrap();
        let mut many = (0..2000).map(|k| Ok(run(M, A100, 2048, 1 + k % 8, 1)));
        s.record_batch(&mut many).unwrap();
        // Fold the WAL into the main file so the damage below hits real data.
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)").unwrap();
    }
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 16_384);
    for b in &mut bytes[8192..12_288] {
        *b = 0xA5;
    }
    std::fs::write(&path, &bytes).unwrap();
    let outcome = SqliteStore::open(&path).and_then(|s| {
        s.check()?;
        s.list(&ListFilter::default()).map(|_| ())
    });
    let err = outcome.expect_err("damage must not go unnoticed");
    assert!(
        matches!(
            err,
            HistoryError::Corrupt { .. } | HistoryError::Store { .. }
        ),
        "{err:?}"
    );
}

#[test]
fn a_history_from_a_newer_gpufit_is_refused() {
    let d = tmp();
    let path = d.path().join("h.db");
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute_batch("PRAGMA user_version = 99").unwrap();
    drop(c);
    let err = SqliteStore::open(&path).unwrap_err();
    assert!(
        matches!(err, HistoryError::SchemaTooNew { found: 99, .. }),
        "{err:?}"
    );
}

#[test]
fn two_writers_on_one_sqlite_file_lose_no_record() {
    let d = tmp();
    let path = d.path().join("h.db");
    SqliteStore::open(&path).unwrap();
    let threads: Vec<_> = (0..2)
        .map(|t| {
            let p = path.clone();
            std::thread::spawn(move || {
                let s = SqliteStore::open(&p).unwrap();
                for k in 0..100 {
                    s.record(&run(M, A100, 2048, 1 + (k + t) % 8, 1)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(SqliteStore::open(&path).unwrap().count().unwrap(), 200);
}

#[test]
fn jsonl_import_into_sqlite_counts_skipped_lines_and_export_round_trips() {
    let d = tmp();
    let src = d.path().join("run_logs.jsonl");
    let mut f = std::fs::File::create(&src).unwrap();
    let good = r#"{"timestamp": "2026-01-01T10:00:00", "config": {"model": "my-private-model", "max_seq_length": 2048, "batch_size": 8, "dtype": "bf16", "enable_activation_checkpointing": false, "enable_activation_offloading": false, "compile": true, "gradient_accumulation_steps": 2}, "result": {"success": true, "peak_memory_gb": 61.5, "samples_per_sec": 9.1, "failure_reason": null, "duration_sec": 300.0}, "gpu_type": "NVIDIA H100 80GB HBM3"}"#;
    for k in 0..10 {
        writeln!(
            f,
            "{}",
            good.replace("\"batch_size\": 8", &format!("\"batch_size\": {}", k + 1))
        )
        .unwrap();
    }
    writeln!(f, "{{truncated").unwrap();
    writeln!(f, "{}", good.replace("61.5", "-3")).unwrap();
    f.write_all(&good.as_bytes()[..100]).unwrap();
    drop(f);

    let store = SqliteStore::open(&d.path().join("h.db")).unwrap();
    let file = std::fs::File::open(&src).unwrap();
    let mut rd = JsonlReader::new(
        std::io::BufReader::new(file),
        "run_logs.jsonl",
        ImportOptions::default(),
    );
    assert_eq!(store.record_batch(&mut rd).unwrap(), 10);
    let st = rd.stats();
    assert_eq!((st.lines, st.imported, st.skipped), (13, 10, 3));

    let recs = store
        .similar(&HistoryQuery::new(
            "my-private-model",
            Method::Full,
            H100,
            2048,
        ))
        .unwrap();
    assert_eq!(
        recs.len(),
        10,
        "an unknown model keeps its name, method full"
    );
    assert!(recs
        .iter()
        .all(|r| r.result.peak_memory_bytes == Some(61_500_000_000)));

    // Export and re-import into a second store: the same records.
    let mut out = Vec::new();
    store
        .for_each(&mut |r| {
            gpufit::history::jsonl::write_record(&mut out, &r).map_err(|e| HistoryError::Io {
                path: "export".into(),
                message: e.to_string(),
            })
        })
        .unwrap();
    let second = SqliteStore::open(&d.path().join("h2.db")).unwrap();
    let mut rd2 = JsonlReader::new(&out[..], "export", ImportOptions::default());
    assert_eq!(second.record_batch(&mut rd2).unwrap(), 10);
    let strip = |mut v: Vec<RunRecord>| {
        v.iter_mut().for_each(|r| r.id = None);
        v
    };
    assert_eq!(
        strip(second.list(&ListFilter::default()).unwrap()),
        strip(store.list(&ListFilter::default()).unwrap())
    );
}

// === PostgreSQL ===

#[path = "common/postgres.rs"]
mod pg;
use pg::{free_port, Postgres};

#[test]
fn postgres_store_meets_the_same_contract_on_a_real_server() {
    let pg = Postgres::start();

    let url = pg.create_db("contract");
    let store = history::open(&url).unwrap();
    contract(store.as_ref());
    a_run_recorded_twice_is_stored_once(store.as_ref());
    node_reports_make_one_record(store.as_ref());
    a_whole_record_never_replaces_a_multi_node_one_or_another_run(store.as_ref());

    // A database at schema version 3 migrates (to 5) and keeps its rows.
    let v3 = pg.create_db("v3");
    {
        use gpufit::history::schema;
        let mut c = postgres::Client::connect(&v3, postgres::NoTls).unwrap();
        c.batch_execute(&schema::create_runs(
            "BIGINT",
            "BOOLEAN",
            "DOUBLE PRECISION",
            "BIGSERIAL PRIMARY KEY",
        ))
        .unwrap();
        c.batch_execute(schema::ADD_RUN_KEY).unwrap();
        c.batch_execute(&schema::add_node_counts("BIGINT")).unwrap();
        c.batch_execute(&v3_row(&v3_record(), "TRUE", "FALSE"))
            .unwrap();
        c.batch_execute(
            "CREATE TABLE gpufit_schema (version BIGINT NOT NULL); INSERT INTO gpufit_schema VALUES (3)",
        )
        .unwrap();
    }
    let migrated = history::open(&v3).unwrap();
    a_version_3_history_migrates(migrated.as_ref());
    let mut c = postgres::Client::connect(&v3, postgres::NoTls).unwrap();
    let version: i64 = c
        .query_one("SELECT version FROM gpufit_schema", &[])
        .unwrap()
        .get(0);
    assert_eq!(version, 6);

    let nodes = pg.create_db("nodes");
    nodes_report_concurrently(&nodes, "threads", false);
    nodes_report_concurrently(&nodes, "processes", true);
    host_memory_kills_reach_the_advisor(store.as_ref());

    // Reconnecting (a second replica) migrates nothing and sees every record.
    let n = store.count().unwrap();
    let again = history::open(&url).unwrap();
    assert_eq!(again.count().unwrap(), n);

    // Replicas starting together on a fresh database migrate exactly once.
    let fresh = pg.create_db("racing");
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let u = fresh.clone();
            std::thread::spawn(move || history::open(&u).map(|s| s.count().ok()))
        })
        .collect();
    for h in handles {
        let opened = h.join().unwrap();
        assert!(opened.is_ok(), "{:?}", opened.err());
    }
    let mut c = postgres::Client::connect(&fresh, postgres::NoTls).unwrap();
    let versions: i64 = c
        .query_one("SELECT COUNT(*) FROM gpufit_schema", &[])
        .unwrap()
        .get(0);
    assert_eq!(versions, 1);
    let idx: i64 = c
        .query_one(
            "SELECT COUNT(*) FROM pg_indexes WHERE tablename = 'runs' AND indexname = 'runs_similarity_key'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(idx, 1, "the similarity key is indexed");

    // A server that is not there is a clear error, not a hang.
    let dead = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=2",
        free_port()
    );
    let err = history::open(&dead)
        .err()
        .expect("no server there")
        .to_string();
    assert!(err.contains("cannot connect"), "{err}");
}

/// A partial multi-node record stays partial through `history export` and
/// `history import`; counts no job can have are dropped, not trusted.
#[test]
fn a_partial_multi_node_record_survives_export_and_import() {
    let d = tmp();
    let store = SqliteStore::open(&d.path().join("h.db")).unwrap();
    store
        .record_node_report(&node_report("exp-1", "n1", 30_000_000_000, 2))
        .unwrap();
    store
        .record_node_report(&node_report("exp-2", "n1", 30_000_000_000, 2))
        .unwrap();
    store
        .record_node_report(&node_report("exp-2", "n2", 31_000_000_000, 2))
        .unwrap();
    let mut out = Vec::new();
    store
        .for_each(&mut |r| {
            gpufit::history::jsonl::write_record(&mut out, &r).map_err(|e| HistoryError::Io {
                path: "export".into(),
                message: e.to_string(),
            })
        })
        .unwrap();
    let second = SqliteStore::open(&d.path().join("h2.db")).unwrap();
    let mut rd = JsonlReader::new(&out[..], "export", ImportOptions::default());
    assert_eq!(second.record_batch(&mut rd).unwrap(), 2);
    let partial = job_record(&second, "exp-1");
    assert_eq!(
        partial.nodes.as_ref().map(|n| (n.reported, n.expected)),
        Some((1, 2))
    );
    let whole = job_record(&second, "exp-2");
    assert_eq!(
        whole.nodes.as_ref().map(|n| (n.reported, n.expected)),
        Some((2, 2))
    );
    assert_eq!(whole.node.as_deref(), Some("n1,n2"));
    // A node that reports into the imported record is merged as usual.
    second
        .record_node_report(&node_report("exp-1", "n2", 40_000_000_000, 2))
        .unwrap();
    let done = job_record(&second, "exp-1");
    assert_eq!(done.nodes.as_ref().map(|n| n.partial()), Some(false));
    assert_eq!(done.result.peak_memory_bytes, Some(40_000_000_000));

    // A record with a peakless node keeps its list through export/import.
    let mut peakless = node_report("exp-3", "n2", 0, 2);
    peakless.result.peak_memory_bytes = None;
    store
        .record_node_report(&node_report("exp-3", "n1", 30_000_000_000, 2))
        .unwrap();
    store.record_node_report(&peakless).unwrap();
    let mut out3 = Vec::new();
    gpufit::history::jsonl::write_record(&mut out3, &job_record(&store, "exp-3")).unwrap();
    let line3 = String::from_utf8(out3).unwrap();
    assert!(
        line3.contains(r#""without_peak":["n2"]"#),
        "the export lists the peakless node: {line3}"
    );
    let fourth = SqliteStore::open(&d.path().join("h4.db")).unwrap();
    let mut rd = JsonlReader::new(line3.as_bytes(), "exp-3", ImportOptions::default());
    assert_eq!(fourth.record_batch(&mut rd).unwrap(), 1);
    let back = job_record(&fourth, "exp-3");
    let n = back.nodes.clone().unwrap();
    assert_eq!((n.reported, n.peaks(), n.partial()), (2, 1, true));
    // n2's late peak upgrades the imported record as it would the original.
    fourth
        .record_node_report(&node_report("exp-3", "n2", 41_000_000_000, 2))
        .unwrap();
    assert_eq!(
        job_record(&fourth, "exp-3").full_peak(),
        Some(41_000_000_000)
    );
    // A list naming a node the record does not list, or one twice: dropped.
    for bad in [r#""without_peak":["n9"]"#, r#""without_peak":["n2","n2"]"#] {
        let l = line3.replace(r#""without_peak":["n2"]"#, bad);
        assert_ne!(l, line3);
        let fifth = SqliteStore::open(&d.path().join(format!("h5-{}.db", bad.len()))).unwrap();
        let mut rd = JsonlReader::new(l.as_bytes(), "bad", ImportOptions::default());
        assert_eq!(fifth.record_batch(&mut rd).unwrap(), 1);
        assert_eq!(job_record(&fifth, "exp-3").nodes, None, "{bad}");
    }

    let text = String::from_utf8(out).unwrap();
    let line = text.lines().next().unwrap();
    let bad = line.replace(
        r#""nodes":{"reported":1,"expected":2}"#,
        r#""nodes":{"reported":3,"expected":2}"#,
    );
    assert_ne!(bad, line, "the export writes the counts: {line}");
    let third = SqliteStore::open(&d.path().join("h3.db")).unwrap();
    let mut rd = JsonlReader::new(bad.as_bytes(), "bad", ImportOptions::default());
    assert_eq!(third.record_batch(&mut rd).unwrap(), 1);
    assert_eq!(job_record(&third, "exp-1").nodes, None);
}
