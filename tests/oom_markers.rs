//! A job's failure is a GPU out-of-memory on every path or on none: the
//! Slurm Epilog (the job's output tail), the Kubernetes reconciler (the
//! container's termination message) and the log parser share
//! `core::logs::oom` (docs/design.md, "Log parsing").

use gpufit::controller::crd::AttemptOutcome;
use gpufit::controller::reconcile::classify_failure;
use gpufit::core::logs::{parse_str, LogOutcome};
use gpufit::slurm::exec::is_cuda_oom;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

const OOM_LINES: &[&str] = &[
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB is free.",
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.19 MiB free; 14.73 GiB reserved in total by PyTorch)",
    "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.00 GiB.",
    "RuntimeError: CUDA error: out of memory",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation: out of memory",
    "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.",
];

const OTHER_LINES: &[&str] = &[
    "RuntimeError: CUDA error: device-side assert triggered",
    "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled system error",
    "Killed",
    "MemoryError",
    "ValueError: loss is nan",
];

fn job() -> Job {
    serde_json::from_value(
        json!({"metadata": {"name": "t-1"}, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}),
    )
    .expect("job")
}

fn pod_with_message(message: &str) -> Pod {
    serde_json::from_value(
        json!({"metadata": {"name": "t-1-abcde"}, "status": {"containerStatuses": [{
        "name": "train", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}]}}),
    )
    .expect("pod")
}

/// The same output, as the Slurm Epilog reads it (the end of the job's
/// output file) and as Kubernetes hands it over (the termination message).
fn output_with(line: &str) -> String {
    format!("step 10 | loss:1.2\nTraceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n{line}\n")
}

#[test]
fn slurm_epilog_and_reconciler_classify_the_same_lines_identically() {
    for (line, expect_oom) in OOM_LINES
        .iter()
        .map(|l| (l, true))
        .chain(OTHER_LINES.iter().map(|l| (l, false)))
    {
        let text = output_with(line);
        let slurm = is_cuda_oom(&text);
        let (outcome, _) = classify_failure(&job(), &[pod_with_message(&text)]);
        let kube = outcome == AttemptOutcome::Oom;
        let parsed = parse_str(&text).expect("parses").outcome == Some(LogOutcome::OutOfMemory);
        assert_eq!(slurm, expect_oom, "Slurm Epilog on {line:?}");
        assert_eq!(kube, expect_oom, "reconciler on {line:?}");
        assert_eq!(parsed, expect_oom, "log parser on {line:?}");
    }
}
