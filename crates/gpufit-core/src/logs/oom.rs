//! PyTorch's CUDA out-of-memory error.
//!
//! Current wording (PyTorch ≥ 2.1, `c10/cuda/CUDACachingAllocator.cpp`):
//! ```text
//! torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total
//! capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process
//! has 78.08 GiB memory in use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and
//! 1.98 GiB is reserved by PyTorch but unallocated. …
//! ```
//! Older wording (PyTorch ≤ 2.0):
//! `RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total
//! capacity; 14.56 GiB already allocated; 3.19 MiB free; 14.73 GiB reserved in total by PyTorch)`.
//! Sizes come from PyTorch's `format_size`: `bytes`, `KiB`, `MiB`, `GiB` —
//! binary units. ROCm builds say `HIP out of memory`; a raw driver failure
//! says `CUDA error: out of memory`; library allocations fail with
//! `CUBLAS_STATUS_ALLOC_FAILED` / `CUDNN_STATUS_ALLOC_FAILED` (see [`MARKERS`]).

use std::sync::LazyLock;

use regex::Regex;

use super::{cut, num, to_bytes, LogFormat, OomInfo, ParsedLog};
use crate::run::FailureReason;

const SIZE: &str = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|KiB|MiB|GiB|TiB)";

fn re(pattern: &str) -> Regex {
    Regex::new(&pattern.replace("{SIZE}", SIZE)).expect("static regex")
}

static TRIED: LazyLock<Regex> = LazyLock::new(|| re(r"Tried to allocate {SIZE}"));
static TOTAL_NEW: LazyLock<Regex> = LazyLock::new(|| {
    re(r"GPU ([0-9]+) has a total capacit(?:y|ies) of {SIZE} of which {SIZE} is free")
});
static TOTAL_OLD: LazyLock<Regex> = LazyLock::new(|| re(r"\(GPU ([0-9]+); {SIZE} total capacity"));
static IN_USE: LazyLock<Regex> = LazyLock::new(|| re(r"this process has {SIZE} memory in use"));
static ALLOC_NEW: LazyLock<Regex> = LazyLock::new(|| re(r"{SIZE} is allocated by PyTorch"));
static UNALLOC_NEW: LazyLock<Regex> =
    LazyLock::new(|| re(r"{SIZE} is reserved by PyTorch but unallocated"));
static ALLOC_OLD: LazyLock<Regex> = LazyLock::new(|| re(r"{SIZE} already allocated"));
static FREE_OLD: LazyLock<Regex> = LazyLock::new(|| re(r"; {SIZE} free"));
static RESERVED_OLD: LazyLock<Regex> = LazyLock::new(|| re(r"{SIZE} reserved in total by PyTorch"));

fn size(c: &regex::Captures<'_>, i: usize) -> Option<u64> {
    to_bytes(num(c.get(i)?.as_str())?, c.get(i + 1)?.as_str())
}

/// Every marker of a GPU out-of-memory failure, in one place so the log
/// parser, the Kubernetes reconciler (termination messages), the Slurm
/// Epilog (output tail) and `find-max-batch` classify a line the same way.
/// Before, the library markers lived only in the reconciler, so a cuBLAS
/// allocation failure was an OOM on Kubernetes and "other error" on Slurm.
pub const MARKERS: &[&str] = &[
    // PyTorch's caching allocator (CUDA and ROCm builds) and its exception type.
    "CUDA out of memory",
    "HIP out of memory",
    "OutOfMemoryError",
    // A raw driver / runtime failure, as PyTorch reports it and by error name.
    "CUDA error: out of memory",
    "cudaErrorMemoryAllocation",
    // cuBLAS workspace and cuDNN allocations fail outside PyTorch's allocator.
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    // JAX / XLA.
    "RESOURCE_EXHAUSTED: Out of memory",
];

/// The markers as whole words: `OutOfMemoryError` in
/// `torch.OutOfMemoryError:`, never inside a longer word.
static MARKER_WORDS: LazyLock<Regex> = LazyLock::new(|| {
    let alternatives: Vec<String> = MARKERS.iter().map(|m| regex::escape(m)).collect();
    Regex::new(&format!(r"\b(?:{})\b", alternatives.join("|"))).expect("static regex")
});

/// What a failure reason written by a person or a tool says when it means
/// GPU memory ran out, besides the markers: the word `OOM`, "out of
/// memory" (`out_of_memory`), `cuda_oom`, `OutOfMemoryError` — whole words,
/// any case. A following `kill` (group 1) is the host's OOM killer
/// (`oom-killed`, `OOM killer`), which is host memory, not GPU memory:
/// Kubernetes' `OOMKilled` and `oom_killed` are single words and never
/// match at all.
static REASON_WORDS: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\b(?:oom|out[ _-]of[ _-]memory|cuda[ _-]?oom|outofmemory(?:error)?)\b([ _-]?kill)?",
    )
    .expect("static regex")
});

/// Whether a line is a GPU out-of-memory error (a marker, as a whole word).
pub fn is_oom_line(line: &str) -> bool {
    MARKER_WORDS.is_match(line)
}

/// A failure reason as any path meets it — a stored spelling (`OOM`,
/// `other_error`), an exception line, a termination message, free text in
/// an imported history — read the one way every path reads it: an OOM
/// when it is a GPU out-of-memory marker or says OOM / out of memory in
/// whole words (so "bloom-7b crashed" is not one), else another error.
pub fn failure_reason(text: &str) -> FailureReason {
    if let Ok(f) = text.parse::<FailureReason>() {
        return f;
    }
    let says_oom =
        is_oom_line(text) || REASON_WORDS.captures_iter(text).any(|c| c.get(1).is_none());
    if says_oom {
        FailureReason::Oom
    } else {
        FailureReason::OtherError
    }
}

/// The lines Slurm's slurmstepd and srun write into a job's output when
/// the job's cgroup ran out of host memory (Slurm `src/slurmd/slurmstepd`,
/// `task/cgroup` and `jobacct_gather`): `Detected 1 oom_kill event in
/// StepId=7.0. Some of the step tasks have been OOM Killed.` (older:
/// `Detected 1 oom-kill event(s) in StepId=7.batch. Some of your processes
/// may have been killed by the cgroup out-of-memory handler.`), `StepId=7.0
/// exceeded memory limit (734003200 > 52428800), being killed`, and srun's
/// `task 0: Out Of Memory`. Host memory, never the GPU's.
static HOST_OOM_KILL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\bdetected \d+ oom[-_]kill event|\bexceeded memory limit \(\d+ > \d+\), being killed|\btasks? [\d,-]+: out of memory\s*$",
    )
    .expect("static regex")
});

/// The first line of `text` that says the host's OOM killer (a cgroup
/// memory limit) ended the job, as Slurm writes it ([`HOST_OOM_KILL`]).
pub fn first_host_oom_kill_line(text: &str) -> Option<&str> {
    text.lines().find(|l| HOST_OOM_KILL.is_match(l.trim_end()))
}

/// The first line of `text` that is a GPU out-of-memory error.
pub fn first_oom_line(text: &str) -> Option<&str> {
    text.lines().find(|l| is_oom_line(l))
}

/// The CUDA out-of-memory marker scanner: what it has seen of a log so far.
#[derive(Debug, Default)]
pub struct OomParser {
    info: Option<OomInfo>,
}

impl OomParser {
    /// Feeds one line (terminator removed, trailing space trimmed).
    pub fn feed(&mut self, line: &str) {
        if !is_oom_line(line) && self.info.is_none() {
            return;
        }
        // The message is one line in PyTorch, but people wrap it: the lines
        // right after an OOM line may carry its sizes, so keep reading them.
        let starts_new = is_oom_line(line);
        let info = self.info.get_or_insert_with(OomInfo::default);
        if starts_new && info.message.is_empty() {
            info.message = cut(line.trim(), 400);
        }
        if let Some(c) = TRIED.captures(line) {
            info.tried_to_allocate_bytes = size(&c, 1).or(info.tried_to_allocate_bytes);
        }
        if let Some(c) = TOTAL_NEW.captures(line) {
            info.gpu_index = c[1].parse().ok().or(info.gpu_index);
            info.gpu_total_bytes = size(&c, 2).or(info.gpu_total_bytes);
            info.gpu_free_bytes = size(&c, 4).or(info.gpu_free_bytes);
        } else if let Some(c) = TOTAL_OLD.captures(line) {
            info.gpu_index = c[1].parse().ok().or(info.gpu_index);
            info.gpu_total_bytes = size(&c, 2).or(info.gpu_total_bytes);
            if let Some(f) = FREE_OLD.captures(line) {
                info.gpu_free_bytes = size(&f, 1).or(info.gpu_free_bytes);
            }
        }
        if let Some(c) = IN_USE.captures(line) {
            info.process_in_use_bytes = size(&c, 1).or(info.process_in_use_bytes);
        }
        if let Some(c) = ALLOC_NEW
            .captures(line)
            .or_else(|| ALLOC_OLD.captures(line))
        {
            info.allocated_bytes = size(&c, 1).or(info.allocated_bytes);
        }
        if let Some(c) = RESERVED_OLD.captures(line) {
            info.reserved_bytes = size(&c, 1).or(info.reserved_bytes);
        } else if let Some(c) = UNALLOC_NEW.captures(line) {
            // New wording gives reserved-but-unallocated; reserved = allocated + that.
            if let (Some(a), Some(u)) = (info.allocated_bytes, size(&c, 1)) {
                info.reserved_bytes = Some(a.saturating_add(u));
            }
        }
    }

    /// Writes what was found; returns whether an OOM was seen.
    pub fn finish(self, out: &mut ParsedLog) -> bool {
        let Some(info) = self.info else {
            return false;
        };
        out.formats.push(LogFormat::CudaOom);
        if info.gpu_total_bytes.is_some() {
            out.gpu_total_bytes = info.gpu_total_bytes;
        }
        out.oom = Some(info);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse_str, LogOutcome};
    use crate::units::{GIB, MIB};

    fn gib(x: f64) -> u64 {
        (x * GIB as f64).round() as u64
    }

    #[test]
    fn current_wording_gives_total_capacity_and_sizes() {
        let p = parse_str(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.08 GiB memory in use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and 1.98 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n",
        )
        .unwrap();
        assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory));
        assert_eq!(p.gpu_total_bytes, Some(gib(79.15)));
        let o = p.oom.unwrap();
        assert_eq!(o.tried_to_allocate_bytes, Some(2 * GIB));
        assert_eq!(o.gpu_free_bytes, Some(gib(1.06)));
        assert_eq!(o.process_in_use_bytes, Some(gib(78.08)));
        assert_eq!(o.allocated_bytes, Some(gib(75.12)));
        assert_eq!(o.reserved_bytes, Some(gib(75.12) + gib(1.98)));
        assert_eq!(o.gpu_index, Some(0));
    }

    #[test]
    fn old_wording_gives_total_capacity_and_sizes() {
        let p = parse_str(
            "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 15.78 GiB total capacity; 14.56 GiB already allocated; 3.19 MiB free; 14.73 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.\n",
        )
        .unwrap();
        let o = p.oom.clone().unwrap();
        assert_eq!(p.gpu_total_bytes, Some(gib(15.78)));
        assert_eq!(o.tried_to_allocate_bytes, Some(20 * MIB));
        assert_eq!(o.reserved_bytes, Some(gib(14.73)));
        assert_eq!(o.gpu_free_bytes, Some((3.19 * MIB as f64).round() as u64));
        assert_eq!(o.gpu_index, Some(1));
        let r = p.to_run_result(true);
        assert!(!r.success());
        assert_eq!(r.failure_reason(), Some(crate::run::FailureReason::Oom));
    }

    #[test]
    fn library_allocation_failures_are_ooms() {
        for line in [
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
            "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
            "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB",
        ] {
            let p = parse_str(&format!("{line}\n")).unwrap();
            assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory), "{line}");
        }
        assert_eq!(
            super::first_oom_line("step 1\nCUBLAS_STATUS_ALLOC_FAILED\n"),
            Some("CUBLAS_STATUS_ALLOC_FAILED")
        );
        assert_eq!(super::first_oom_line("loss 1.2\nexit 1\n"), None);
    }

    #[test]
    fn failure_reasons_say_oom_in_whole_words_only() {
        use super::failure_reason;
        use crate::run::FailureReason::{Oom, OtherError};
        for (text, want) in [
            // The stored spellings.
            ("OOM", Oom),
            ("oom", Oom),
            ("out_of_memory", Oom),
            ("other_error", OtherError),
            ("error", OtherError),
            // Markers and words.
            ("CUDA out of memory", Oom),
            (
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                Oom,
            ),
            ("RuntimeError: CUDA error: out of memory", Oom),
            ("job hit OOM at step 300", Oom),
            ("Out of memory on rank 3", Oom),
            ("cuda-oom", Oom),
            // A model's name is not a failure kind.
            ("bloom-7b crashed", OtherError),
            ("zoom: loss went nan", OtherError),
            ("roomy batch failed", OtherError),
            // The host's OOM killer: host memory, not the GPU's.
            ("oom_killed", OtherError),
            ("OOMKilled", OtherError),
            ("container was oom-killed", OtherError),
            ("invoked the OOM killer", OtherError),
            ("", OtherError),
        ] {
            assert_eq!(failure_reason(text), want, "{text:?}");
        }
    }

    #[test]
    fn slurms_cgroup_oom_kill_lines_are_host_memory_and_cuda_ooms_are_not() {
        for line in [
            "slurmstepd: error: Detected 1 oom_kill event in StepId=1054.0. Some of the step tasks have been OOM Killed.",
            "[2026-09-21T10:00:00.123] error: Detected 2 oom_kill events in StepId=7.0. Some of the step tasks have been OOM Killed.",
            "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=7.batch. Some of your processes may have been killed by the cgroup out-of-memory handler.",
            "slurmstepd: error: StepId=7.batch exceeded memory limit (734003200 > 52428800), being killed",
            "srun: error: nid005475: tasks 0-2,5,7: Out Of Memory",
            "srun: error: ana: task 0: Out Of Memory",
        ] {
            let text = format!("step 10 loss 1.2\n{line}\n");
            assert_eq!(super::first_host_oom_kill_line(&text), Some(line), "{line}");
        }
        for text in [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "RuntimeError: CUDA error: out of memory",
            "task 0 finished; memory fine",
            "",
        ] {
            assert_eq!(super::first_host_oom_kill_line(text), None, "{text}");
        }
    }

    #[test]
    fn markers_inside_longer_words_are_not_ooms() {
        assert!(super::is_oom_line("torch.OutOfMemoryError: x"));
        assert!(!super::is_oom_line("MyOutOfMemoryErrorHandler registered"));
        assert!(!super::is_oom_line("XCUBLAS_STATUS_ALLOC_FAILED_COUNT=0"));
    }

    #[test]
    fn a_driver_level_oom_without_sizes_is_still_an_oom() {
        let p = parse_str("RuntimeError: CUDA error: out of memory\n").unwrap();
        assert_eq!(p.outcome, Some(LogOutcome::OutOfMemory));
        assert_eq!(p.gpu_total_bytes, None);
    }
}
