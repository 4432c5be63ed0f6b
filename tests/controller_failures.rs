//! Why a training Job failed, from its pods' termination messages: a CUDA
//! out-of-memory told from a host-memory kill and from other errors.

use gpufit::controller::crd::AttemptOutcome;
use gpufit::controller::reconcile::classify_failure;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

fn failed_job() -> Job {
    serde_json::from_value(json!({"metadata": {"name": "t-1"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}]}}))
    .expect("job")
}

fn pod_terminated(exit_code: i32, reason: &str, message: &str) -> Pod {
    serde_json::from_value(
        json!({"metadata": {"name": "t-1-abcde"}, "status": {"containerStatuses": [{
        "name": "train", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}}]}}),
    )
    .expect("pod")
}

#[test]
fn a_cuda_out_of_memory_termination_message_is_an_oom() {
    let msg = "Traceback (most recent call last):\n  File \"train.py\", line 9\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.2 GiB is free.\n";
    let (outcome, why) = classify_failure(&failed_job(), &[pod_terminated(1, "Error", msg)]);
    assert_eq!(outcome, AttemptOutcome::Oom);
    assert!(why.contains("CUDA out of memory"), "{why}");
}

#[test]
fn a_host_memory_kill_is_not_a_gpu_oom() {
    let (outcome, why) = classify_failure(&failed_job(), &[pod_terminated(137, "OOMKilled", "")]);
    assert_eq!(outcome, AttemptOutcome::Failed);
    assert!(why.contains("host memory"), "{why}");
}

#[test]
fn another_error_reports_the_exit_code_and_last_log_line() {
    let (outcome, why) = classify_failure(
        &failed_job(),
        &[pod_terminated(
            2,
            "Error",
            "loading data\nFileNotFoundError: /data/train.jsonl\n",
        )],
    );
    assert_eq!(outcome, AttemptOutcome::Failed);
    assert!(
        why.contains("code 2") && why.contains("FileNotFoundError"),
        "{why}"
    );
}

#[test]
fn a_failed_job_without_pods_reports_the_job_condition() {
    let (outcome, why) = classify_failure(&failed_job(), &[]);
    assert_eq!(outcome, AttemptOutcome::Failed);
    assert!(why.contains("backoff limit"), "{why}");
}
