//! Advisor rules (docs/design.md, "Contracts" and "The advisor"), one test per rule. The memory model here is a
//! small linear stand-in so the rules are tested as relations, independent
//! of the real estimator's byte values.

use crate::run::RunOutcome;
use chrono::Utc;
use proptest::prelude::{any, prop_assert, prop_assert_eq, proptest, ProptestConfig};

use super::*;
use crate::memory::{Breakdown, Estimate};
use crate::run::{RunResult, RunSource};
use crate::settings::Dtype;
use crate::units::GIB;
use crate::workload::{ArchKind, Attention, ModelArch};
use crate::workload::{Framework, LoraConfig, LoraTarget, Method, Optimizer, Sharding};
use proptest::strategy::Strategy as Strategy_;

/// fixed + slope × m, with the usual directions: fp32 doubles both, QLoRA /
/// LoRA / 8-bit optimizer / ZeRO-3 shrink the fixed part, checkpointing and
/// offloading shrink the slope.
struct Linear {
    fixed_gib: f64,
    slope_gib: f64,
}

impl MemoryModel for Linear {
    fn estimate(&self, w: &Workload, s: &EngineeringSettings) -> Result<Estimate, MemoryError> {
        w.validate()?;
        if s.micro_batch_size == 0 {
            return Err(MemoryError::ZeroMicroBatch);
        }
        let mut fixed = self.fixed_gib;
        let mut slope = self.slope_gib * w.seq_len as f64 / 2048.0;
        if s.dtype == Dtype::Fp32 {
            fixed *= 2.0;
            slope *= 2.0;
        }
        fixed *= match w.method {
            Method::Full => 1.0,
            Method::Lora => 0.4,
            Method::Qlora => 0.15,
        };
        if w.optimizer == Optimizer::Adamw8bit {
            fixed *= 0.7;
        }
        if matches!(w.sharding, Sharding::Zero3 | Sharding::Fsdp) {
            fixed /= w.gpus as f64;
        }
        if s.activation_checkpointing {
            slope *= 0.25;
        }
        if s.activation_offloading {
            slope *= 0.5;
        }
        let fixed_b = (fixed * GIB as f64) as u64;
        let slope_b = (slope * GIB as f64) as u64;
        let peak = fixed_b + slope_b * s.micro_batch_size as u64;
        Ok(Estimate {
            micro_batch_size: s.micro_batch_size,
            peak_bytes: peak,
            fixed_bytes: fixed_b,
            per_sample_bytes: slope_b,
            peak_allocated_bytes: peak,
            peak_reserved_bytes: peak,
            device_bytes: peak,
            min_device_bytes: peak,
            breakdown: Breakdown::default(),
        })
    }
}

const MODEL: Linear = Linear {
    fixed_gib: 20.0,
    slope_gib: 2.0,
};

fn opts(m: &Linear) -> AdvisorOptions<'_> {
    AdvisorOptions {
        model: m,
        cpus_per_gpu: Some(12),
    }
}

fn workload() -> Workload {
    Workload {
        model: ModelArch {
            name: "meta-llama/Llama-3.1-8B".into(),
            kind: ArchKind::DecoderOnly,
            params: 8_030_000_000,
            hidden_size: 4096,
            num_layers: 32,
            num_attention_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            intermediate_size: 14336,
            vocab_size: 128_256,
            tied_embeddings: false,
            gated_mlp: true,
            num_experts: 1,
            experts_per_token: 1,
            max_position_embeddings: 131_072,
            quirks: Default::default(),
        },
        method: Method::Full,
        lora: None,
        seq_len: 2048,
        optimizer: Optimizer::Adamw,
        global_batch: None,
        gpus: 1,
        sharding: Sharding::None,
        framework: Framework::Torchtune,
        attention: Attention::Sdpa,
    }
}

fn a100() -> GpuSpec {
    GpuSpec {
        name: "NVIDIA A100-SXM4-80GB".into(),
        memory_bytes: 80 * GIB,
        compute_capability: "8.0".into(),
        bf16: true,
        fp8: false,
        bf16_tflops: 312.0,
        fp32_tflops: 19.5,
        memory_bandwidth_gbs: 2039.0,
    }
}

fn t4() -> GpuSpec {
    GpuSpec {
        name: "Tesla T4".into(),
        memory_bytes: 15 * GIB,
        compute_capability: "7.5".into(),
        bf16: false,
        fp8: false,
        bf16_tflops: 65.0,
        fp32_tflops: 8.1,
        memory_bandwidth_gbs: 320.0,
    }
}

/// A run of the test workload on the A100.
fn run(m: u32, dtype: Dtype, ckpt: bool) -> RunRecord {
    let w = workload();
    RunRecord {
        confirmation: Default::default(),
        nodes: None,
        id: None,
        timestamp: Utc::now(),
        cluster: None,
        node: None,
        source: RunSource::Cli,
        job_id: None,
        model: w.model.name.clone(),
        method: w.method,
        gpu_model: a100().name,
        seq_len: w.seq_len,
        lora_rank: None,
        gpus: 1,
        global_batch: None,
        settings: EngineeringSettings {
            micro_batch_size: m,
            dtype,
            activation_checkpointing: ckpt,
            ..EngineeringSettings::default()
        },
        result: RunResult {
            outcome: RunOutcome::Succeeded,
            peak_memory_bytes: None,
            samples_per_sec: None,
            tokens_per_sec: None,
            duration_sec: None,
        },
        predicted_peak_bytes: None,
    }
}

fn ok(m: u32) -> RunRecord {
    run(m, Dtype::Bf16, false)
}

fn ok_peak(m: u32, gib: f64) -> RunRecord {
    let mut r = ok(m);
    r.result.peak_memory_bytes = Some((gib * GIB as f64) as u64);
    r
}

fn oom(m: u32) -> RunRecord {
    let mut r = ok(m);
    r.result.outcome = RunOutcome::GpuOom;
    r
}

fn ask(
    w: &Workload,
    gpu: &GpuSpec,
    s: Strategy,
    pins: &Pins,
    h: &[RunRecord],
) -> Result<Suggestion, AdvisorError> {
    ask_with(&MODEL, w, gpu, s, pins, h)
}

fn ask_with(
    model: &Linear,
    w: &Workload,
    gpu: &GpuSpec,
    s: Strategy,
    pins: &Pins,
    h: &[RunRecord],
) -> Result<Suggestion, AdvisorError> {
    let req = AdviceRequest {
        workload: w,
        gpu,
        strategy: s,
        targets: StrategyTargets::default(),
        pins,
        history: h,
    };
    suggest_with(&req, &opts(model))
}

fn balanced(h: &[RunRecord]) -> Suggestion {
    ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &Pins::default(),
        h,
    )
    .expect("a suggestion")
}

/// Pins that keep the candidate search on bf16 + checkpointing off, so
/// tests about history see exactly the runs they wrote.
fn bf16_no_ckpt() -> Pins {
    Pins {
        dtype: Some(Dtype::Bf16),
        activation_checkpointing: Some(false),
        ..Pins::default()
    }
}

fn balanced_pinned(h: &[RunRecord]) -> Suggestion {
    ask(&workload(), &a100(), Strategy::Balanced, &bf16_no_ckpt(), h).expect("a suggestion")
}

fn sentences(s: &str) -> usize {
    s.split(". ").count()
}

// === sources ===

#[test]
fn without_history_the_source_is_heuristic_with_confidence_below_half() {
    let s = balanced(&[]);
    assert_eq!(s.source, SuggestionSource::Heuristic);
    assert!(s.confidence < 0.5, "confidence {}", s.confidence);
    assert!(s.memory_fraction <= 0.85 + 1e-9);
    assert!(s.settings.micro_batch_size >= 1);
}

#[test]
fn historical_data_starts_from_the_largest_success_with_the_settings_most_runs_used() {
    // No peaks recorded; three runs with checkpointing on, one with it off.
    let h = vec![
        run(4, Dtype::Bf16, true),
        run(12, Dtype::Bf16, true),
        run(8, Dtype::Bf16, true),
        run(2, Dtype::Bf16, false),
    ];
    let s = balanced(&h);
    assert_eq!(s.source, SuggestionSource::HistoricalData);
    assert!(s.settings.activation_checkpointing, "majority setting");
    assert_eq!(s.settings.dtype, Dtype::Bf16);
    assert!(
        s.settings.micro_batch_size >= 12,
        "got {}",
        s.settings.micro_batch_size
    );
    assert!(s.confidence >= 0.5);
}

#[test]
fn missing_memory_falls_back_to_historical_data_and_says_nothing_about_memory() {
    let s = balanced_pinned(&[ok(3), ok(5)]);
    assert_eq!(s.source, SuggestionSource::HistoricalData);
    assert!(!s.reasoning.to_lowercase().contains("memory analysis"));
    assert!(!s.reasoning.contains("measured"));
    assert!(s.settings.micro_batch_size >= 5);
}

#[test]
fn one_measured_point_scales_the_memory_model_and_extrapolates() {
    // Model: 20 + 2m GiB. Measured 12 GiB at m=2 → the model is 0.5× too
    // high, so a larger batch than the heuristic's fits.
    let heuristic = balanced_pinned(&[]).settings.micro_batch_size;
    let s = balanced_pinned(&[ok_peak(2, 12.0)]);
    assert_eq!(s.source, SuggestionSource::HistoricalDataWithMemory);
    assert!(
        s.settings.micro_batch_size > heuristic,
        "{} vs {heuristic}",
        s.settings.micro_batch_size
    );
    assert!(s.predicted_peak_bytes as f64 <= 0.85 * (80 * GIB) as f64);
    let r = s.reasoning.to_lowercase();
    assert!(r.contains("memory analysis"), "{r}");
    assert!(r.contains("12.0 gib"), "measured number in: {r}");
    assert!(r.contains(&format!("micro batch {}", s.settings.micro_batch_size)));
}

/// `ok_peak(m, gib)` as a two-node job's record whose peak is one node's
/// only: the other node never reported (`missing`) or reported no peak.
fn partial_peak(m: u32, gib: f64, missing: bool) -> RunRecord {
    let mut r = ok_peak(m, gib);
    r.source = RunSource::Slurm;
    r.nodes = Some(crate::run::NodeReports {
        reported: if missing { 1 } else { 2 },
        expected: 2,
        without_peak: if missing {
            Vec::new()
        } else {
            vec!["n2".into()]
        },
    });
    r
}

#[test]
fn a_partial_multi_node_peak_is_not_extrapolated_from_and_the_reasoning_says_so() {
    // 12 GiB at m=2 on one node of two (the model says 24): as the job's
    // peak it would scale the model ×0.5 and suggest a much larger batch.
    let whole = balanced_pinned(&[ok_peak(2, 12.0)]);
    for missing in [true, false] {
        let s = balanced_pinned(&[partial_peak(2, 12.0, missing)]);
        let unknown = balanced_pinned(&[ok(2)]);
        assert_ne!(s.source, SuggestionSource::HistoricalDataWithMemory);
        assert_eq!(
            s.settings.micro_batch_size, unknown.settings.micro_batch_size,
            "a lower bound under the model changes nothing"
        );
        assert!(
            whole.settings.micro_batch_size > s.settings.micro_batch_size,
            "{} vs {}",
            whole.settings.micro_batch_size,
            s.settings.micro_batch_size
        );
        assert!(s.reasoning.contains("lower bound"), "{}", s.reasoning);
        assert!(!s.reasoning.contains("Memory analysis"), "{}", s.reasoning);
    }
    assert!(
        !whole.reasoning.contains("lower bound"),
        "{}",
        whole.reasoning
    );
}

#[test]
fn a_partial_multi_node_peak_floors_predictions_at_and_above_its_batch() {
    // 60 GiB at m=4 on one node (the model says 28): the job needed at
    // least 60 there, so every batch from 4 up is predicted at least that.
    let h = [partial_peak(4, 60.0, false)];
    let at = |m: u32| {
        // The run's own settings (an uncompiled peak does not bound a
        // compiled prediction: compile never adds memory).
        let pins = Pins {
            micro_batch_size: Some(m),
            compile: Some(false),
            ..bf16_no_ckpt()
        };
        ask(&workload(), &a100(), Strategy::Balanced, &pins, &h)
            .expect("a suggestion")
            .predicted_peak_bytes
    };
    let floor = 60 * GIB;
    assert!(at(4) >= floor && at(6) >= floor, "{} {}", at(4), at(6));
    assert!(
        at(3) < floor,
        "below its batch it bounds nothing: {}",
        at(3)
    );
    // A node that never reported: its job's success is not known, so it is
    // no "largest success" to start from either.
    let s = balanced_pinned(&[partial_peak(23, 20.0, true)]);
    assert!(s.settings.micro_batch_size < 23, "{s:?}");
    let s = balanced_pinned(&[ok(23)]);
    assert!(s.settings.micro_batch_size >= 23, "{s:?}");
}

/// `ok_peak(m, gib)` recorded with the injected settings while nothing
/// confirms the job ran them (a script that may ignore GPUFIT_*).
fn unconfirmed_peak(m: u32, gib: f64) -> RunRecord {
    let mut r = ok_peak(m, gib);
    r.confirmation = crate::confirm::Confirmation::Unconfirmed;
    r
}

#[test]
fn an_unconfirmed_run_is_a_floor_never_a_point_to_extrapolate_from_or_a_proven_batch() {
    // 12 GiB at m=2, had the job run 2, would scale the model down and move
    // the batch up; unconfirmed, it may be another batch's peak.
    let confirmed = balanced_pinned(&[ok_peak(2, 12.0)]);
    let s = balanced_pinned(&[unconfirmed_peak(2, 12.0)]);
    let unknown = balanced_pinned(&[]);
    assert_eq!(confirmed.source, SuggestionSource::HistoricalDataWithMemory);
    assert_ne!(s.source, SuggestionSource::HistoricalDataWithMemory);
    assert!(
        confirmed.settings.micro_batch_size > s.settings.micro_batch_size,
        "{} vs {}",
        confirmed.settings.micro_batch_size,
        s.settings.micro_batch_size
    );
    assert_eq!(
        s.settings.micro_batch_size, unknown.settings.micro_batch_size,
        "a floor under the model changes nothing"
    );
    assert!(s.reasoning.contains("did not confirm"), "{}", s.reasoning);
    assert!(!s.reasoning.contains("multi-node"), "{}", s.reasoning);
    // A high unconfirmed peak still raises the floor at its batch.
    let pins = Pins {
        micro_batch_size: Some(4),
        compile: Some(false),
        ..bf16_no_ckpt()
    };
    let floor = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &pins,
        &[unconfirmed_peak(4, 60.0)],
    )
    .expect("a suggestion")
    .predicted_peak_bytes;
    assert!(floor >= 60 * GIB, "{floor}");
    // An unconfirmed success at 23 is no proof that 23 fits.
    let mut r = ok(23);
    r.confirmation = crate::confirm::Confirmation::Unconfirmed;
    assert!(balanced_pinned(&[r]).settings.micro_batch_size < 23);
    // The same run confirmed is.
    assert!(balanced_pinned(&[ok(23)]).settings.micro_batch_size >= 23);
}

#[test]
fn two_measured_points_are_fitted_by_least_squares() {
    // True line 30 + 1 GiB/sample (model says 20 + 2): 0.85 × 80 = 68 → 38
    // on the fitted line; extrapolating from 10 keeps a noise margin, so a
    // little below that.
    let s = balanced_pinned(&[ok_peak(4, 34.0), ok_peak(10, 40.0)]);
    assert_eq!(s.source, SuggestionSource::HistoricalDataWithMemory);
    let m = s.settings.micro_batch_size;
    assert!((28..=38).contains(&m), "{m}");
    assert!(
        s.reasoning.contains("fitted over 2 measured batch sizes"),
        "{}",
        s.reasoning
    );
    let predicted_gib = s.predicted_peak_bytes as f64 / GIB as f64;
    assert!(
        (predicted_gib - (30.0 + m as f64)).abs() < 0.01,
        "{predicted_gib}"
    );
    // More measurements near the target shrink the margin.
    let s2 = balanced_pinned(&[
        ok_peak(4, 34.0),
        ok_peak(10, 40.0),
        ok_peak(30, 60.0),
        ok_peak(34, 64.0),
    ]);
    assert!(
        s2.settings.micro_batch_size >= 36,
        "{}",
        s2.settings.micro_batch_size
    );
}

#[test]
fn when_every_similar_run_failed_the_advice_is_micro_batch_one_with_checkpointing() {
    let mut other = ok(2);
    other.result.outcome = RunOutcome::Failed { host_oom: false };
    let s = balanced(&[oom(8), oom(4), other]);
    assert_eq!(s.source, SuggestionSource::LearnedFromFailures);
    assert_eq!(s.settings.micro_batch_size, 1);
    assert!(s.settings.activation_checkpointing);
    assert!(s.reasoning.contains("3 similar runs"), "{}", s.reasoning);
}

// === hard rules ===

#[test]
fn an_oom_caps_the_suggestion_strictly_below_it() {
    // Memory says 38 would fit, but 20 ran out of memory with these settings.
    let h = vec![ok_peak(4, 34.0), ok_peak(10, 40.0), oom(20)];
    for strategy in Strategy::ALL {
        let s = ask(&workload(), &a100(), strategy, &bf16_no_ckpt(), &h).unwrap();
        assert!(
            s.settings.micro_batch_size < 20,
            "{strategy}: {}",
            s.settings.micro_batch_size
        );
    }
    let s = balanced_pinned(&h);
    // The OOM also says the fitted slope was too small, so the answer is
    // more careful than "19".
    assert!(
        (10..20).contains(&s.settings.micro_batch_size),
        "{}",
        s.settings.micro_batch_size
    );
    assert!(
        s.reasoning.contains("20 ran out of memory"),
        "{}",
        s.reasoning
    );
}

#[test]
fn an_oom_with_checkpointing_off_says_nothing_about_checkpointing_on() {
    let pins = Pins {
        dtype: Some(Dtype::Bf16),
        activation_checkpointing: Some(true),
        ..Pins::default()
    };
    let without = ask(&workload(), &a100(), Strategy::Balanced, &pins, &[]).unwrap();
    let with_oom_off = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &pins,
        &[ok(1), oom(2)],
    )
    .unwrap();
    assert_eq!(
        without.settings.micro_batch_size,
        with_oom_off.settings.micro_batch_size
    );
    assert!(with_oom_off.settings.micro_batch_size > 2);
}

#[test]
fn an_oom_on_another_gpu_model_does_not_cap_the_suggestion() {
    let mut other = oom(2);
    other.gpu_model = "NVIDIA H100 80GB HBM3".into();
    let s = balanced_pinned(&[other]);
    assert!(s.settings.micro_batch_size > 2);
    assert_eq!(s.source, SuggestionSource::Heuristic);
}

#[test]
fn when_micro_batch_one_does_not_fit_the_error_lists_alternatives_that_fit() {
    // 100 GiB fixed on an 80 GiB card.
    let big = Linear {
        fixed_gib: 100.0,
        slope_gib: 2.0,
    };
    let err = ask_with(
        &big,
        &workload(),
        &a100(),
        Strategy::Balanced,
        &Pins::default(),
        &[],
    )
    .unwrap_err();
    match err {
        AdvisorError::DoesNotFit {
            alternatives,
            needed_gib,
            capacity_gib,
            ..
        } => {
            assert!(needed_gib > capacity_gib);
            let changes: Vec<Change> = alternatives
                .iter()
                .filter_map(|a| match a {
                    Alternative::Fits { change, .. } => Some(*change),
                    _ => None,
                })
                .collect();
            let all = render_alternatives(&alternatives, &DomainChanges);
            assert!(
                changes.iter().any(|c| matches!(c, Change::Qlora { .. })),
                "{all}"
            );
            assert!(changes.contains(&Change::Zero3 { gpus: 2 }), "{all}");
            assert!(all.contains("ZeRO-3/FSDP over 2 GPUs"), "{all}");
            // Checkpointing alone does not save the fixed part: not listed.
            assert!(!changes.contains(&Change::Checkpointing), "{all}");
            // The core's words are the domain's, never a command-line flag
            // (this text reaches TrainingJob conditions).
            assert!(!all.contains("--"), "{all}");
            // 8-bit AdamW: 100 × 0.7 = 70 GiB fits the card but not the
            // 68 GiB target: listed, and said to be above the target.
            let eight = alternatives
                .iter()
                .find(|a| {
                    matches!(
                        a,
                        Alternative::Fits {
                            change: Change::Optimizer8bit,
                            ..
                        }
                    )
                })
                .expect("8-bit alternative");
            assert!(
                eight.to_string().contains("above the balanced target"),
                "{eight}"
            );
        }
        other => panic!("expected DoesNotFit, got {other:?}"),
    }
}

#[test]
fn when_nothing_at_all_fits_the_error_says_to_use_a_bigger_gpu() {
    let huge = Linear {
        fixed_gib: 100_000.0,
        slope_gib: 2.0,
    };
    let err = ask_with(
        &huge,
        &workload(),
        &t4(),
        Strategy::Balanced,
        &Pins::default(),
        &[],
    )
    .unwrap_err();
    assert!(err.to_string().contains("GPU with more memory"), "{err}");
}

#[test]
fn an_oom_at_micro_batch_one_with_checkpointing_is_does_not_fit() {
    let mut r = run(1, Dtype::Bf16, true);
    r.result.outcome = RunOutcome::GpuOom;
    let err = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &Pins::default(),
        &[r],
    )
    .unwrap_err();
    assert!(matches!(err, AdvisorError::DoesNotFit { .. }), "{err:?}");
}

// === strategies ===

#[test]
fn conservative_turns_checkpointing_on_and_compile_off_and_aggressive_compiles() {
    let c = ask(
        &workload(),
        &a100(),
        Strategy::Conservative,
        &Pins::default(),
        &[],
    )
    .unwrap();
    assert!(c.settings.activation_checkpointing);
    assert!(!c.settings.compile);
    let a = ask(
        &workload(),
        &a100(),
        Strategy::Aggressive,
        &Pins::default(),
        &[],
    )
    .unwrap();
    assert!(a.settings.compile);
}

#[test]
fn strategy_targets_are_configurable() {
    let w = workload();
    let pins = bf16_no_ckpt();
    let mut targets = StrategyTargets::default();
    let base = suggest_with(
        &AdviceRequest {
            workload: &w,
            gpu: &a100(),
            strategy: Strategy::Balanced,
            targets,
            pins: &pins,
            history: &[],
        },
        &opts(&MODEL),
    )
    .unwrap();
    targets.conservative = 0.5;
    targets.balanced = 0.6;
    let lower = suggest_with(
        &AdviceRequest {
            workload: &w,
            gpu: &a100(),
            strategy: Strategy::Balanced,
            targets,
            pins: &pins,
            history: &[],
        },
        &opts(&MODEL),
    )
    .unwrap();
    assert!(lower.settings.micro_batch_size < base.settings.micro_batch_size);
    assert!(
        lower.reasoning.contains("target 60 %"),
        "{}",
        lower.reasoning
    );
    targets.balanced = 1.5;
    let bad = suggest_with(
        &AdviceRequest {
            workload: &w,
            gpu: &a100(),
            strategy: Strategy::Balanced,
            targets,
            pins: &pins,
            history: &[],
        },
        &opts(&MODEL),
    );
    assert!(matches!(bad, Err(AdvisorError::BadPin(_))));
}

fn arb_history() -> impl Strategy_<Value = Vec<RunRecord>> {
    let one = (1u32..64, 0u8..3, any::<bool>(), 10.0f64..90.0).prop_map(|(m, kind, ckpt, gib)| {
        let mut r = run(m, Dtype::Bf16, ckpt);
        match kind {
            0 => r.result.peak_memory_bytes = Some((gib * GIB as f64) as u64),
            1 => {}
            _ => {
                r.result.outcome = RunOutcome::GpuOom;
            }
        }
        r
    });
    proptest::collection::vec(one, 0..8)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn micro_batch_is_monotone_across_strategies(h in arb_history(), seq in 256u32..8192) {
        let mut w = workload();
        w.seq_len = seq;
        let got: Vec<_> = Strategy::ALL
            .iter()
            .map(|&s| ask(&w, &a100(), s, &Pins::default(), &h))
            .collect();
        if got.iter().all(|g| g.is_ok()) {
            let m: Vec<u32> = got.iter().map(|g| g.as_ref().unwrap().settings.micro_batch_size).collect();
            prop_assert!(m[0] <= m[1] && m[1] <= m[2], "{m:?}");
        }
    }

    #[test]
    fn hard_rules_hold_for_any_history(h in arb_history(), strategy in 0usize..3) {
        let s = Strategy::ALL[strategy];
        if let Ok(sug) = ask(&workload(), &a100(), s, &Pins::default(), &h) {
            let m = sug.settings.micro_batch_size;
            // Never at or above an OOM of the same key and settings.
            for r in h.iter().filter(|r| r.is_oom()) {
                if r.settings.activation_checkpointing == sug.settings.activation_checkpointing
                    && r.settings.dtype == sug.settings.dtype
                {
                    prop_assert!(m < r.settings.micro_batch_size, "m {m} vs oom {}", r.settings.micro_batch_size);
                }
            }
            // Never predicted above the GPU's memory.
            prop_assert!(sug.predicted_peak_bytes <= a100().memory_bytes);
            prop_assert!(sug.confidence <= MAX_CONFIDENCE);
            prop_assert!(sug.confidence > 0.0);
        }
    }

    #[test]
    fn the_global_batch_is_kept_exactly(g_per in 1u32..512, gpus in 1u32..9, strategy in 0usize..3) {
        let mut w = workload();
        w.gpus = gpus;
        w.global_batch = Some(g_per * gpus);
        let s = ask(&w, &a100(), Strategy::ALL[strategy], &Pins::default(), &[]).unwrap();
        let e = &s.settings;
        prop_assert_eq!(e.micro_batch_size * e.gradient_accumulation_steps * gpus, g_per * gpus);
        prop_assert_eq!(s.effective_batch(gpus), g_per * gpus);
        prop_assert!(s.reasoning.contains("keeps the global batch"));
    }
}

#[test]
fn the_global_batch_picks_the_largest_dividing_micro_batch_that_fits() {
    // Without G balanced fits m = 20 (bf16, no ckpt: 20 + 2m·1.35 + margin ≤ 68).
    let free = balanced_pinned(&[]).settings.micro_batch_size;
    let mut w = workload();
    w.global_batch = Some(64);
    let s = ask(&w, &a100(), Strategy::Balanced, &bf16_no_ckpt(), &[]).unwrap();
    let m = s.settings.micro_batch_size;
    assert_eq!(64 % m, 0);
    assert!(m <= free);
    // The next divisor up would not fit.
    assert!(2 * m > free, "m {m}, free {free}");
}

#[test]
fn without_a_global_batch_the_reasoning_says_the_effective_batch_changed() {
    let s = balanced(&[]);
    assert_eq!(s.settings.gradient_accumulation_steps, 1);
    assert!(
        s.reasoning.contains("effective batch changed"),
        "{}",
        s.reasoning
    );
    assert!(sentences(&s.reasoning) <= 2, "{}", s.reasoning);
}

// === balanced floor ===

#[test]
fn balanced_never_goes_below_the_largest_micro_batch_that_already_succeeded() {
    // A success at 30 without a measured peak: the model says 80 GiB there,
    // above the 68 GiB balanced target, but it ran.
    let s = balanced_pinned(&[ok(30), ok(10)]);
    assert!(
        s.settings.micro_batch_size >= 30,
        "{}",
        s.settings.micro_batch_size
    );
    // Measured at 72 GiB, above the target (issue 40): the largest batch
    // that meets it instead, never above 30.
    let s = balanced_pinned(&[ok_peak(30, 72.0), ok_peak(10, 32.0)]);
    let m = s.settings.micro_batch_size;
    assert!(m < 30, "{m}");
    assert!(s.predicted_peak_bytes as f64 <= 68.0 * GIB as f64, "{s:?}");
    // Conservative may go lower.
    let c = ask(
        &workload(),
        &a100(),
        Strategy::Conservative,
        &bf16_no_ckpt(),
        &[ok_peak(30, 72.0), ok_peak(10, 32.0)],
    )
    .unwrap();
    assert!(c.settings.micro_batch_size < 30);
}

#[test]
fn a_memory_changing_pin_lifts_the_balanced_floor() {
    let h = [ok_peak(30, 72.0), ok_peak(10, 32.0)];
    let pins = Pins {
        micro_batch_size: Some(8),
        ..bf16_no_ckpt()
    };
    let s = ask(&workload(), &a100(), Strategy::Balanced, &pins, &h).unwrap();
    assert_eq!(s.settings.micro_batch_size, 8);
    // Pinning checkpointing on: the ckpt-off success says nothing about it.
    let pins = Pins {
        activation_checkpointing: Some(true),
        dtype: Some(Dtype::Bf16),
        ..Pins::default()
    };
    let s = ask(&workload(), &a100(), Strategy::Balanced, &pins, &h).unwrap();
    assert_eq!(s.source, SuggestionSource::Heuristic);
}

// === confidence ===

#[test]
fn confidence_grows_with_runs_memory_data_and_a_known_boundary_and_is_capped() {
    let one = balanced_pinned(&[ok(4)]).confidence;
    let three = balanced_pinned(&[ok(4), ok(6), ok(8)]).confidence;
    assert!(three > one, "{three} vs {one}");
    let mem = balanced_pinned(&[ok_peak(4, 34.0)]).confidence;
    assert!(mem > one, "{mem} vs {one}");
    let mem2 = balanced_pinned(&[ok_peak(4, 34.0), ok_peak(10, 40.0)]).confidence;
    let bounded = balanced_pinned(&[ok_peak(4, 34.0), ok_peak(10, 40.0), oom(45)]).confidence;
    assert!(bounded > mem2, "{bounded} vs {mem2}");
    // Measured peaks stay under the 68 GiB target (a run at or above it
    // leaves the source at plain historical data).
    let many: Vec<RunRecord> = (1..36)
        .map(|m| ok_peak(m, 30.0 + m as f64))
        .chain([oom(60)])
        .collect();
    let capped = balanced_pinned(&many).confidence;
    assert!(capped <= MAX_CONFIDENCE && capped > 0.9, "{capped}");
}

// === pins ===

#[test]
fn pins_win_and_a_pin_predicted_to_run_out_of_memory_is_a_warning() {
    let pins = Pins {
        micro_batch_size: Some(40),
        activation_checkpointing: Some(false),
        dtype: Some(Dtype::Fp32),
        compile: Some(false),
        ..Pins::default()
    };
    let s = ask(&workload(), &a100(), Strategy::Aggressive, &pins, &[]).unwrap();
    assert_eq!(s.settings.micro_batch_size, 40);
    assert_eq!(s.settings.dtype, Dtype::Fp32);
    assert!(!s.settings.activation_checkpointing);
    assert!(
        !s.settings.compile,
        "aggressive would compile, but the pin wins"
    );
    assert!(
        s.warnings.iter().any(|w| w.contains("run out of memory")),
        "{:?}",
        s.warnings
    );
}

#[test]
fn the_last_pin_wins() {
    let first = Pins {
        micro_batch_size: Some(2),
        ..Pins::default()
    };
    let later = Pins {
        micro_batch_size: Some(6),
        ..Pins::default()
    };
    let pins = first.merged_with(&later);
    let s = ask(&workload(), &a100(), Strategy::Balanced, &pins, &[]).unwrap();
    assert_eq!(s.settings.micro_batch_size, 6);
}

#[test]
fn a_pinned_micro_batch_at_a_known_oom_is_kept_with_a_warning() {
    let pins = Pins {
        micro_batch_size: Some(8),
        ..bf16_no_ckpt()
    };
    let s = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &pins,
        &[oom(6), ok(2)],
    )
    .unwrap();
    assert_eq!(s.settings.micro_batch_size, 8);
    assert!(
        s.warnings
            .iter()
            .any(|w| w.contains("already ran out of memory")),
        "{:?}",
        s.warnings
    );
}

#[test]
fn no_scientific_field_is_ever_changed() {
    let mut w = workload();
    w.method = Method::Lora;
    w.lora = Some(LoraConfig {
        rank: 32,
        targets: vec![LoraTarget::Q, LoraTarget::V],
    });
    w.global_batch = Some(96);
    w.gpus = 4;
    w.seq_len = 4096;
    let before = w.clone();
    let histories = [vec![], vec![ok(4)], vec![oom(8), oom(4)]];
    for h in &histories {
        for s in Strategy::ALL {
            if let Ok(sug) = ask(&w, &a100(), s, &Pins::default(), h) {
                // The global batch comes out exactly; the JSON carries only
                // engineering fields (no model, seq_len, lora, optimizer...).
                assert_eq!(sug.effective_batch(4), 96);
                let json = serde_json::to_value(&sug).unwrap();
                let keys: Vec<&str> = json
                    .as_object()
                    .unwrap()
                    .keys()
                    .map(|k| k.as_str())
                    .collect();
                for scientific in [
                    "seq_len",
                    "max_seq_length",
                    "lora",
                    "lora_rank",
                    "global_batch",
                    "optimizer",
                    "model",
                    "method",
                    "gpus",
                    "learning_rate",
                    "lr",
                    "epochs",
                    "seed",
                ] {
                    assert!(
                        !keys.contains(&scientific),
                        "suggestion carries {scientific}"
                    );
                }
            }
        }
    }
    assert_eq!(w, before, "the workload is untouched");
}

// === candidates ===

#[test]
fn candidates_respect_bf16_support() {
    let mut w = workload();
    w.framework = Framework::Hf;
    let small = Linear {
        fixed_gib: 4.0,
        slope_gib: 0.5,
    };
    let s = ask_with(&small, &w, &t4(), Strategy::Balanced, &Pins::default(), &[])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.settings.dtype, Dtype::Fp16Mixed);
    assert!(!s.settings.dtype.needs_bf16(), "{:?}", s.settings.dtype);
    let s = ask(&w, &a100(), Strategy::Balanced, &Pins::default(), &[]).unwrap();
    assert_eq!(s.settings.dtype, Dtype::Bf16Mixed);
}

#[test]
fn the_fastest_candidate_that_meets_the_target_wins() {
    // Small model: without checkpointing a large batch fits, so paying the
    // recompute is slower → checkpointing off.
    let small = Linear {
        fixed_gib: 10.0,
        slope_gib: 1.0,
    };
    let s = ask_with(
        &small,
        &workload(),
        &a100(),
        Strategy::Balanced,
        &Pins::default(),
        &[],
    )
    .unwrap();
    assert!(!s.settings.activation_checkpointing);
    assert_eq!(
        s.settings.dtype,
        Dtype::Bf16,
        "bf16 beats fp32 on tensor cores"
    );
    // Huge activations: without checkpointing not even micro batch 1 meets
    // the target; with it several do: checkpointing wins. (Where micro
    // batch 1 without checkpointing meets the target, it is usually the
    // faster one for an 8B model: the H100 measured 11,575 tokens/s at 1
    // against 9,509 with checkpointing at 12.)
    let act = Linear {
        fixed_gib: 40.0,
        slope_gib: 30.0,
    };
    let s = ask_with(
        &act,
        &workload(),
        &a100(),
        Strategy::Balanced,
        &Pins::default(),
        &[],
    )
    .unwrap();
    assert!(s.settings.activation_checkpointing, "{s:?}");
}

#[test]
fn measured_settings_are_judged_by_their_own_history() {
    // Checkpointing on was measured to be far cheaper than the model thinks;
    // checkpointing off has only the model → the measured candidate is used.
    let h = vec![
        {
            let mut r = run(8, Dtype::Bf16, true);
            r.result.peak_memory_bytes = Some(22 * GIB);
            r
        },
        {
            let mut r = run(16, Dtype::Bf16, true);
            r.result.peak_memory_bytes = Some(24 * GIB);
            r
        },
    ];
    let s = balanced(&h);
    assert!(s.settings.activation_checkpointing);
    assert_eq!(s.source, SuggestionSource::HistoricalDataWithMemory);
}

#[test]
fn balanced_compiles_only_where_compiling_has_worked() {
    assert!(!balanced(&[]).settings.compile);
    let mut r = ok_peak(4, 34.0);
    r.settings.compile = true;
    let s = balanced_pinned(&[r, ok_peak(10, 40.0)]);
    assert!(s.settings.compile);
}

// === reasoning, data loader, errors ===

#[test]
fn reasoning_is_one_or_two_sentences_with_numbers() {
    let s = balanced(&[]);
    assert!(sentences(&s.reasoning) <= 2, "{}", s.reasoning);
    assert!(s.reasoning.contains("GiB"));
    assert!(s.reasoning.contains('%'));
    assert!(s
        .reasoning
        .contains(&s.settings.micro_batch_size.to_string()));
}

#[test]
fn data_loader_advice_follows_the_cpus_per_gpu() {
    let s = balanced(&[]);
    assert_eq!(
        s.settings.dataloader.num_workers, 8,
        "12 cores → 8 workers (capped)"
    );
    assert!(s.settings.dataloader.pin_memory && s.settings.dataloader.persistent_workers);
    let few = AdvisorOptions {
        model: &MODEL,
        cpus_per_gpu: Some(1),
    };
    let w = workload();
    let g = a100();
    let p = Pins::default();
    let req = AdviceRequest {
        workload: &w,
        gpu: &g,
        strategy: Strategy::Balanced,
        targets: StrategyTargets::default(),
        pins: &p,
        history: &[],
    };
    let s = suggest_with(&req, &few).unwrap();
    assert_eq!(s.settings.dataloader.num_workers, 0);
    assert!(!s.settings.dataloader.persistent_workers);
}

/// A run killed for host memory (Kubernetes `OOMKilled`, Slurm
/// `OUT_OF_MEMORY`) with `workers` data-loader workers and pinned memory.
fn host_killed(m: u32, workers: u32) -> RunRecord {
    let mut r = ok(m);
    r.result.outcome = RunOutcome::Failed { host_oom: true };
    r.settings.dataloader.num_workers = workers;
    r.settings.dataloader.pin_memory = true;
    r
}

#[test]
fn a_host_memory_kill_lowers_the_workers_and_unpins_memory_not_the_micro_batch() {
    let fresh = balanced(&[]);
    let s = balanced(&[host_killed(fresh.settings.micro_batch_size, 8)]);
    assert_eq!(
        s.settings.micro_batch_size, fresh.settings.micro_batch_size,
        "the micro batch is the one without the kill"
    );
    assert_eq!(
        s.settings.dataloader.num_workers, 4,
        "half the 8 that were killed"
    );
    assert!(!s.settings.dataloader.pin_memory);
    assert!(s.settings.dataloader.persistent_workers);
    assert!(
        s.reasoning.contains("killed for host memory")
            && s.reasoning.contains("4 workers and no pinned memory"),
        "{}",
        s.reasoning
    );
    // The same failure as a GPU OOM is the other lesson: a smaller micro batch.
    let mut gpu_oom = host_killed(fresh.settings.micro_batch_size, 8);
    gpu_oom.result.outcome = RunOutcome::GpuOom;
    let g = balanced(&[gpu_oom]);
    assert!(g.settings.micro_batch_size < fresh.settings.micro_batch_size);
    assert!(g.settings.dataloader.pin_memory);
    assert!(!g.reasoning.contains("host memory"), "{}", g.reasoning);
}

#[test]
fn repeated_host_memory_kills_keep_halving_and_a_later_success_with_more_workers_lifts_them() {
    let m = balanced(&[]).settings.micro_batch_size;
    let mut first = host_killed(m, 8);
    first.timestamp = Utc::now() - chrono::Duration::hours(2);
    let mut second = host_killed(m, 4);
    second.timestamp = Utc::now() - chrono::Duration::hours(1);
    let s = balanced(&[first.clone(), second.clone()]);
    assert_eq!(
        s.settings.dataloader.num_workers, 2,
        "half the fewest killed (4)"
    );
    assert!(
        s.reasoning.contains("2 similar runs were killed"),
        "{}",
        s.reasoning
    );
    // One worker killed: none next time.
    let s = balanced(&[host_killed(m, 1)]);
    assert_eq!(s.settings.dataloader.num_workers, 0);
    assert!(!s.settings.dataloader.persistent_workers);
    // A later success with 8 workers (its memory limit raised): both kills forgotten.
    let mut later = ok(m);
    later.settings.dataloader.num_workers = 8;
    let s = balanced(&[first, second, later]);
    assert_eq!(s.settings.dataloader.num_workers, 8);
    assert!(s.settings.dataloader.pin_memory);
    assert!(!s.reasoning.contains("host memory"), "{}", s.reasoning);
}

#[test]
fn a_pinned_worker_count_is_kept_with_a_warning_after_a_host_memory_kill() {
    let pins = Pins {
        num_workers: Some(6),
        ..Pins::default()
    };
    let s = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &pins,
        &[host_killed(2, 6)],
    )
    .expect("a suggestion");
    assert_eq!(s.settings.dataloader.num_workers, 6);
    assert!(!s.settings.dataloader.pin_memory);
    assert!(
        s.warnings
            .iter()
            .any(|w| w.contains("pinned at 6") && w.contains("3 or fewer")),
        "{:?}",
        s.warnings
    );
}

#[test]
fn a_gpu_without_memory_and_a_zero_pin_are_clear_errors() {
    let mut g = a100();
    g.memory_bytes = 0;
    assert!(matches!(
        ask(&workload(), &g, Strategy::Balanced, &Pins::default(), &[]),
        Err(AdvisorError::BadGpu(_))
    ));
    let pins = Pins {
        micro_batch_size: Some(0),
        ..Pins::default()
    };
    assert!(ask(&workload(), &a100(), Strategy::Balanced, &pins, &[]).is_err());
}

#[test]
fn plan_gives_three_monotone_strategies() {
    let w = workload();
    let g = a100();
    let p = Pins::default();
    let req = AdviceRequest {
        workload: &w,
        gpu: &g,
        strategy: Strategy::Balanced,
        targets: StrategyTargets::default(),
        pins: &p,
        history: &[],
    };
    let plan = plan_with(&req, &opts(&MODEL)).unwrap();
    assert_eq!(plan.len(), 3);
    assert!(plan[0].settings.micro_batch_size <= plan[1].settings.micro_batch_size);
    assert!(plan[1].settings.micro_batch_size <= plan[2].settings.micro_batch_size);
    assert_eq!(plan[2].strategy, Strategy::Aggressive);
}

#[test]
fn micro_batch_one_over_the_target_but_within_the_card_is_suggested_with_a_warning() {
    // 70 + 2 GiB at micro batch 1: over the 68 GiB balanced target, under 80 GiB.
    let heavy = Linear {
        fixed_gib: 70.0,
        slope_gib: 2.0,
    };
    let s = ask_with(
        &heavy,
        &workload(),
        &a100(),
        Strategy::Balanced,
        &bf16_no_ckpt(),
        &[],
    )
    .unwrap();
    assert_eq!(s.settings.micro_batch_size, 1);
    assert!(
        s.warnings
            .iter()
            .any(|w| w.contains("above the balanced target")),
        "{:?}",
        s.warnings
    );
}

#[test]
fn a_batch_that_teaches_nothing_new_is_not_suggested_again() {
    // One run at micro batch 1 measured 60 GiB: the scaled model says 2
    // meets the 68 GiB target, but the split between fixed part and slope
    // is unknown, so the pessimistic line has no room beyond 1. Running 1
    // again would teach nothing: the best estimate's 2 is tried.
    let s = balanced_pinned(&[ok_peak(1, 60.0)]);
    assert_eq!(s.settings.micro_batch_size, 2);
    // With a run at 2 that measured too much, no further step is taken.
    let s = balanced_pinned(&[ok_peak(1, 60.0), ok_peak(2, 67.9)]);
    assert_eq!(s.settings.micro_batch_size, 2);
}

#[test]
fn when_nothing_meets_the_target_the_settings_with_the_most_room_win() {
    // 70 GiB fixed: micro batch 1 is over the target with and without
    // checkpointing; checkpointing leaves more room, so it is chosen.
    let heavy = Linear {
        fixed_gib: 70.0,
        slope_gib: 4.0,
    };
    let pins = Pins {
        dtype: Some(Dtype::Bf16),
        ..Pins::default()
    };
    let s = ask_with(&heavy, &workload(), &a100(), Strategy::Balanced, &pins, &[]).unwrap();
    assert_eq!(s.settings.micro_batch_size, 1);
    assert!(s.settings.activation_checkpointing);
}

#[test]
fn an_absurd_pinned_micro_batch_is_a_warning_not_a_panic() {
    let pins = Pins {
        micro_batch_size: Some(u32::MAX),
        gradient_accumulation_steps: Some(u32::MAX),
        ..Pins::default()
    };
    let mut w = workload();
    w.gpus = 8;
    let s = ask(&w, &a100(), Strategy::Balanced, &pins, &[]).unwrap();
    assert_eq!(s.settings.micro_batch_size, u32::MAX);
    assert!(s.warnings.iter().any(|w| w.contains("run out of memory")));
    assert_eq!(s.effective_batch(8), u32::MAX);
}

// === one memory truth, precision policy, exact global batch (issue 9) ===

fn builtin(
    w: &Workload,
    gpu: &GpuSpec,
    s: Strategy,
    pins: &Pins,
) -> Result<Suggestion, AdvisorError> {
    suggest(&AdviceRequest {
        workload: w,
        gpu,
        strategy: s,
        targets: StrategyTargets::default(),
        pins,
        history: &[],
    })
}

fn h100() -> GpuSpec {
    crate::catalog::lookup_gpu("NVIDIA H100 80GB HBM3").expect("catalog GPU")
}

fn catalog_workload(model: &str, method: Method, framework: Framework, seq: u32) -> Workload {
    let m = crate::catalog::lookup_model(model).expect("catalog model");
    Workload {
        model: m.arch,
        method,
        lora: (method != Method::Full).then(|| LoraConfig {
            rank: 16,
            targets: crate::memory::default_lora_targets(framework),
        }),
        seq_len: seq,
        framework,
        ..workload()
    }
}

#[test]
fn where_the_optimizer_step_dominates_the_batch_is_not_extrapolated_to_the_cap() {
    // Qwen2.5-1.5B full under HF on an H100: the optimizer step (fp32
    // master weights, foreach temporaries) is the peak at micro batch 1 and
    // 2, so a line through those two points had slope 0 and "fit" 1024.
    let w = catalog_workload("Qwen/Qwen2.5-1.5B", Method::Full, Framework::Hf, 2048);
    let s = builtin(&w, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert!(s.settings.micro_batch_size < 64, "{s:?}");
    let est = crate::memory::estimate(&w, &s.settings).unwrap();
    let rel = (s.predicted_peak_bytes as f64 - est.peak_bytes as f64).abs() / est.peak_bytes as f64;
    assert!(
        rel < 0.01,
        "predicted {} vs estimate {}",
        s.predicted_peak_bytes,
        est.peak_bytes
    );
    assert!(s.memory_fraction <= 0.85);
}

#[test]
fn the_prediction_includes_the_accumulation_the_advisor_sets() {
    // With a global batch, accumulation > 1 keeps the gradients alive
    // during the next forward: the printed peak must include them.
    let w = Workload {
        global_batch: Some(64),
        ..catalog_workload(
            "meta-llama/Llama-3.2-1B",
            Method::Full,
            Framework::Torchtune,
            2048,
        )
    };
    let s = builtin(&w, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    let st = &s.settings;
    assert_eq!(st.micro_batch_size * st.gradient_accumulation_steps, 64);
    assert!(st.gradient_accumulation_steps > 1, "{st:?}");
    let est = crate::memory::estimate(&w, st).unwrap();
    let one = crate::memory::estimate(
        &w,
        &EngineeringSettings {
            gradient_accumulation_steps: 1,
            ..st.clone()
        },
    )
    .unwrap();
    assert!(est.peak_bytes > one.peak_bytes, "accumulation costs memory");
    assert_eq!(s.predicted_peak_bytes, est.peak_bytes);
}

#[test]
fn a_lora_base_is_held_in_bf16_in_every_framework_and_fp32_never_unpinned() {
    for f in [
        Framework::Generic,
        Framework::Hf,
        Framework::Torchtune,
        Framework::Litgpt,
        Framework::Lightning,
    ] {
        for method in [Method::Lora, Method::Qlora] {
            let w = catalog_workload("Qwen/Qwen2.5-7B", method, f, 2048);
            for st in Strategy::ALL {
                let s = builtin(&w, &h100(), st, &Pins::default()).unwrap();
                assert_eq!(s.settings.dtype, Dtype::Bf16, "{f:?} {method:?} {st}");
            }
        }
    }
    // On a GPU without bf16, the base is fp16 (torchtune: fp32, its only
    // other precision).
    let w = catalog_workload("Qwen/Qwen2.5-0.5B", Method::Lora, Framework::Hf, 512);
    let s = builtin(&w, &t4(), Strategy::Balanced, &Pins::default()).unwrap();
    assert_eq!(s.settings.dtype, Dtype::Fp16);
    // A pin wins.
    let pins = Pins {
        dtype: Some(Dtype::Fp32),
        ..Pins::default()
    };
    let s = builtin(&w, &h100(), Strategy::Balanced, &pins).unwrap();
    assert_eq!(s.settings.dtype, Dtype::Fp32);
}

#[test]
fn pure_bf16_is_offered_to_hf_only_when_nothing_else_fits_and_the_switch_decides() {
    // Qwen2.5-7B full on an H100 under HF: fp32 master weights need
    // 16 bytes/param + more: nothing with bf16-mixed meets the target.
    let w = catalog_workload("Qwen/Qwen2.5-7B", Method::Full, Framework::Hf, 2048);
    let auto = builtin(&w, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert_eq!(auto.settings.dtype, Dtype::Bf16);
    assert!(
        auto.warnings.iter().any(|x| x.contains("pure bf16")),
        "{:?}",
        auto.warnings
    );
    let forbid = Pins {
        pure_bf16: Some(false),
        ..Pins::default()
    };
    match builtin(&w, &h100(), Strategy::Balanced, &forbid) {
        Ok(s) => assert_eq!(s.settings.dtype, Dtype::Bf16Mixed),
        Err(AdvisorError::DoesNotFit { alternatives, .. }) => {
            assert!(
                matches!(
                    alternatives[0],
                    Alternative::Fits {
                        change: Change::PureBf16 { .. },
                        ..
                    }
                ),
                "{alternatives:?}"
            )
        }
        Err(e) => panic!("{e}"),
    }
    // A small model fits with fp32 master weights: HF's default is kept.
    let small = catalog_workload("Qwen/Qwen2.5-0.5B", Method::Full, Framework::Hf, 512);
    let s = builtin(&small, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert_eq!(s.settings.dtype, Dtype::Bf16Mixed);
    // torchtune's default is pure bf16.
    let tt = catalog_workload("Qwen/Qwen2.5-0.5B", Method::Full, Framework::Torchtune, 512);
    let s = builtin(&tt, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert_eq!(s.settings.dtype, Dtype::Bf16);
}

#[test]
fn a_global_batch_the_pins_cannot_meet_is_refused_naming_the_nearest_choices() {
    let w = Workload {
        global_batch: Some(7),
        ..workload()
    };
    let pins = Pins {
        micro_batch_size: Some(2),
        ..Pins::default()
    };
    match ask(&w, &a100(), Strategy::Balanced, &pins, &[]) {
        Err(AdvisorError::GlobalBatch { global, reason }) => {
            assert_eq!(global, 7);
            assert!(reason.contains("1 or 7"), "{reason}");
        }
        other => panic!("expected a global-batch error, got {other:?}"),
    }
    let pins = Pins {
        gradient_accumulation_steps: Some(3),
        ..Pins::default()
    };
    let w = Workload {
        global_batch: Some(64),
        ..workload()
    };
    assert!(matches!(
        ask(&w, &a100(), Strategy::Balanced, &pins, &[]),
        Err(AdvisorError::GlobalBatch { .. })
    ));
    // Pinned accumulation that divides: the micro batch follows exactly.
    let pins = Pins {
        gradient_accumulation_steps: Some(4),
        ..Pins::default()
    };
    let s = ask(&w, &a100(), Strategy::Balanced, &pins, &[]).unwrap();
    assert_eq!(s.settings.micro_batch_size, 16);
    assert_eq!(s.settings.gradient_accumulation_steps, 4);
}

#[test]
fn a_run_already_above_the_target_leaves_the_source_at_historical_data() {
    // 20 + 2m GiB; m = 25 measured 72 GiB = 90 % of 80 GiB, over 85 %.
    let s = balanced_pinned(&[ok_peak(25, 72.0)]);
    assert_eq!(
        s.source,
        SuggestionSource::HistoricalData,
        "{}",
        s.reasoning
    );
    assert!(!s.reasoning.to_lowercase().contains("memory analysis"));
    assert!(
        s.reasoning
            .contains("micro batch 25 already peaked at 72.0 GiB"),
        "{}",
        s.reasoning
    );
    // Measured over the target (issue 40): the largest batch that meets it,
    // below the one that ran, and no over-target warning.
    assert!(s.settings.micro_batch_size < 25, "{s:?}");
    assert!(s.predicted_peak_bytes as f64 <= 68.0 * GIB as f64, "{s:?}");
    assert!(!s
        .warnings
        .iter()
        .any(|w| w.contains("above the balanced target")));
}

#[test]
fn one_wild_measurement_among_consistent_runs_does_not_move_the_suggestion() {
    let clean = [ok_peak(4, 28.0), ok_peak(8, 36.0), ok_peak(12, 44.0)];
    let base = balanced_pinned(&clean).settings.micro_batch_size;
    let mut poisoned = clean.to_vec();
    poisoned.push(ok_peak(6, 79.0));
    let s = balanced_pinned(&poisoned);
    assert_eq!(s.settings.micro_batch_size, base, "{}", s.reasoning);
    assert!(s.reasoning.contains("left out"), "{}", s.reasoning);
}

// === throughput: learned, explored, no flip-flop (issue 10) ===

fn ok_speed(m: u32, ckpt: bool, compile: bool, gib: f64, tps: f64) -> RunRecord {
    let mut r = run(m, Dtype::Bf16, ckpt);
    r.settings.compile = compile;
    r.result.peak_memory_bytes = Some((gib * GIB as f64) as u64);
    r.result.tokens_per_sec = Some(tps);
    r
}

fn bf16_pins() -> Pins {
    Pins {
        dtype: Some(Dtype::Bf16),
        ..Pins::default()
    }
}

#[test]
fn measured_throughput_decides_between_measured_settings() {
    // The model ranks checkpointing off first; the runs say on is faster
    // here: measured numbers win over the model.
    let h = [
        ok_speed(4, false, false, 28.0, 5_000.0),
        ok_speed(8, true, false, 30.0, 9_000.0),
    ];
    let pins = Pins {
        compile: Some(false),
        ..bf16_pins()
    };
    let s = ask(&workload(), &a100(), Strategy::Balanced, &pins, &h).unwrap();
    assert!(s.settings.activation_checkpointing, "{}", s.reasoning);
    assert!(s.reasoning.contains("tokens/s"), "{}", s.reasoning);
    assert!(s.predicted_tokens_per_sec > 0.0);
}

#[test]
fn balanced_tries_compile_once_the_uncompiled_speed_is_known_and_keeps_the_faster() {
    // Nothing measured: no compile (a failed compile would cost a job).
    assert!(
        !ask(&workload(), &a100(), Strategy::Balanced, &bf16_pins(), &[])
            .unwrap()
            .settings
            .compile
    );
    let base = ok_speed(16, false, false, 52.0, 10_000.0);
    let s = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &bf16_pins(),
        std::slice::from_ref(&base),
    )
    .unwrap();
    assert!(
        s.settings.compile,
        "predicted faster and safe: tried. {}",
        s.reasoning
    );
    // The trade-off names both sides' settings: the compiled candidate and
    // the uncompiled runner-up differ only in compile, and must not read
    // alike ("… with bf16, checkpointing off …, vs … with bf16,
    // checkpointing off …").
    let speeds = s
        .reasoning
        .split("; ")
        .find(|p| p.contains("tokens/s"))
        .expect("a throughput clause");
    let (mine, theirs) = speeds.split_once(", vs ").expect("a runner-up");
    assert!(mine.contains("compile on"), "{}", s.reasoning);
    assert!(theirs.contains("compile off"), "{}", s.reasoning);
    // Compiled measured slower: back to uncompiled, and it stays there.
    let slow = ok_speed(s.settings.micro_batch_size, false, true, 50.0, 9_500.0);
    let h = vec![base.clone(), slow.clone()];
    let s2 = ask(&workload(), &a100(), Strategy::Balanced, &bf16_pins(), &h).unwrap();
    assert!(!s2.settings.compile, "{}", s2.reasoning);
    let again = ok_speed(s2.settings.micro_batch_size, false, false, 52.0, 10_050.0);
    let h = vec![base.clone(), slow, again];
    let s3 = ask(&workload(), &a100(), Strategy::Balanced, &bf16_pins(), &h).unwrap();
    assert!(!s3.settings.compile, "no flip-flop: {}", s3.reasoning);
    // A compile that crashed (not an OOM) is not tried again.
    let mut broke = ok_speed(16, false, true, 0.0, 0.0);
    broke.result.outcome = RunOutcome::Failed { host_oom: false };
    broke.result.peak_memory_bytes = None;
    broke.result.tokens_per_sec = None;
    let s4 = ask(
        &workload(),
        &a100(),
        Strategy::Balanced,
        &bf16_pins(),
        &[base, broke],
    )
    .unwrap();
    assert!(!s4.settings.compile);
}

#[test]
fn an_untried_setting_within_the_noise_of_the_measured_one_is_not_tried() {
    // ckpt off measured at 10,000 tokens/s; the model predicts ckpt on a
    // little lower, and compile is pinned off: the measured setting stays.
    let h = [ok_speed(16, false, false, 52.0, 10_000.0)];
    let pins = Pins {
        compile: Some(false),
        ..bf16_pins()
    };
    for _ in 0..3 {
        let s = ask(&workload(), &a100(), Strategy::Balanced, &pins, &h).unwrap();
        assert!(!s.settings.activation_checkpointing);
    }
}

// === adversarial histories over the catalog, builtin model ===

fn arb_catalog_run() -> impl Strategy_<Value = (usize, bool, u32, bool, f64, f64)> {
    (
        0usize..2,        // dtype: bf16 / bf16-mixed
        any::<bool>(),    // checkpointing
        1u32..64,         // micro batch
        any::<bool>(),    // OOM
        0.05f64..1.0,     // peak as a fraction of the card
        0.0f64..50_000.0, // tokens/s
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn catalog_hard_rules_hold_for_any_history(
        model in 0usize..8,
        gpu in 0usize..4,
        method in 0usize..3,
        g in proptest::option::of(proptest::sample::select(vec![16u32, 32, 48, 64, 96])),
        strategy in 0usize..3,
        runs in proptest::collection::vec(arb_catalog_run(), 0..12),
    ) {
        let models = ["Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.2-1B",
            "meta-llama/Llama-3.1-8B", "google/gemma-2-2b", "microsoft/phi-2", "mistralai/Mistral-7B-v0.1"];
        let gpus = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4", "Tesla T4"];
        let Ok(m) = crate::catalog::lookup_model(models[model]) else { return Ok(()); };
        let gpu = crate::catalog::lookup_gpu(gpus[gpu]).unwrap();
        let method = [Method::Full, Method::Lora, Method::Qlora][method];
        let w = Workload {
            model: m.arch,
            method,
            lora: (method != Method::Full).then(|| LoraConfig { rank: 16, targets: vec![LoraTarget::Q, LoraTarget::V] }),
            global_batch: g,
            framework: Framework::Hf,
            ..workload()
        };
        let cap = gpu.memory_bytes as f64;
        let h: Vec<RunRecord> = runs.iter().map(|&(d, ckpt, mb, is_oom, frac, tps)| {
            let mut r = run(mb, [Dtype::Bf16, Dtype::Bf16Mixed][d], ckpt);
            r.model = w.model.name.clone();
            r.method = method;
            r.gpu_model = gpu.name.clone();
            if is_oom {
                r.result.outcome = RunOutcome::GpuOom;
            } else {
                r.result.peak_memory_bytes = Some((frac * cap) as u64);
                r.result.tokens_per_sec = Some(tps);
            }
            r
        }).collect();
        let s = Strategy::ALL[strategy];
        let req = AdviceRequest { workload: &w, gpu: &gpu, strategy: s, targets: StrategyTargets::default(), pins: &Pins::default(), history: &h };
        match suggest(&req) {
            Ok(sug) => {
                let st = &sug.settings;
                if let Some(g) = g {
                    prop_assert_eq!(st.micro_batch_size * st.gradient_accumulation_steps, g);
                }
                prop_assert!((sug.predicted_peak_bytes as f64) <= cap, "{sug:?}");
                prop_assert!(sug.predicted_tokens_per_sec.is_finite() && sug.predicted_tokens_per_sec >= 0.0);
                if sug.source != SuggestionSource::LearnedFromFailures {
                    for r in h.iter().filter(|r| r.is_oom()) {
                        if r.settings.activation_checkpointing == st.activation_checkpointing && r.settings.dtype == st.dtype {
                            prop_assert!(st.micro_batch_size < r.settings.micro_batch_size);
                        }
                    }
                }
                prop_assert!(gpu.bf16 || st.dtype != Dtype::Bf16 || method != Method::Full);
            }
            Err(AdvisorError::DoesNotFit { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

#[test]
fn a_peak_that_is_the_allocator_cache_filling_the_card_is_not_learned_as_need() {
    // Model: 20 + 2m GiB on an 80 GiB card. A run at m=4 (model 28 GiB)
    // succeeded and NVML saw 77 GiB: variable-length batches let the
    // caching allocator fill the card (bench/data/h100/steps.csv). It fitted;
    // it does not say the step needs 77 GiB.
    let without_peak = balanced_pinned(&[ok(4)]);
    let cache_filled = balanced_pinned(&[ok_peak(4, 77.0)]);
    assert_eq!(
        cache_filled.settings.micro_batch_size,
        without_peak.settings.micro_batch_size
    );
    assert!(cache_filled.settings.micro_batch_size >= 4);
    // A measured peak the model merely under-predicts is still learned.
    let under = balanced_pinned(&[ok_peak(4, 34.0)]);
    assert!(
        under.settings.micro_batch_size < cache_filled.settings.micro_batch_size,
        "{} vs {}",
        under.settings.micro_batch_size,
        cache_filled.settings.micro_batch_size
    );
}

#[test]
fn a_first_run_plans_with_the_measured_margin_and_says_so_in_numbers() {
    // No history: the micro batch is the largest whose plan (estimate +
    // stated margins, at least the framework's measured 99th percentile of
    // under-prediction) meets the target, and the reasoning prints that plan.
    for fw in [Framework::Hf, Framework::Litgpt, Framework::Torchtune] {
        let w = catalog_workload("meta-llama/Llama-3.1-8B", Method::Lora, fw, 2048);
        let gpu = h100();
        let s = builtin(&w, &gpu, Strategy::Balanced, &Pins::default()).unwrap();
        let m = s.settings.micro_batch_size;
        let at = |m: u32| {
            let mut t = s.settings.clone();
            t.micro_batch_size = m;
            crate::memory::estimate(&w, &t).unwrap()
        };
        let plan = first_run_plan(&at(m), fw);
        let margin = under_prediction_margin(fw);
        assert!(plan >= at(m).peak_bytes as f64 * (1.0 + margin) - 1.0);
        let budget = 0.85 * gpu.memory_bytes as f64;
        assert!(plan <= budget, "{fw:?}: plan {plan} over {budget}");
        assert!(
            first_run_plan(&at(m + 1), fw) > budget,
            "{fw:?}: micro batch {} would also have met the target",
            m + 1
        );
        let said = format!("it was chosen with {:.1} GiB", plan / GIB as f64);
        assert!(s.reasoning.contains(&said), "{fw:?}: {}", s.reasoning);
        assert!(
            s.reasoning
                .contains(&format!("at least +{:.1} %", 100.0 * margin)),
            "{}",
            s.reasoning
        );
        // and says which percentile the margin is (advisor::margin)
        assert!(
            s.reasoning.contains("on 99 of 100 measured"),
            "{}",
            s.reasoning
        );
    }
}

#[test]
fn falcons_math_kernel_sdpa_gets_advice_to_run_eager_and_flash_models_do_not() {
    // Falcon-7B through transformers' SDPA runs PyTorch's math kernel
    // (its one K/V head with an explicit mask): eager is predicted faster
    // and smaller (measured on an H100: 2,680 tokens/s in 23.30 GiB on SDPA,
    // 5,017 in 18.81 GiB eager, LoRA 2 × 2,048 checkpointed).
    let arch = crate::catalog::models::falcon_7b_measured();
    let falcon = Workload {
        model: arch,
        method: Method::Lora,
        lora: Some(LoraConfig {
            rank: 16,
            targets: vec![LoraTarget::Q, LoraTarget::K, LoraTarget::V],
        }),
        framework: Framework::Hf,
        attention: Attention::Sdpa,
        ..workload()
    };
    let s = builtin(&falcon, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    let advice = s
        .warnings
        .iter()
        .find(|w| w.contains("attn_implementation=\"eager\""))
        .unwrap_or_else(|| panic!("no eager advice: {:?}", s.warnings));
    // the figures it gives are the models' for exactly these settings
    let eager = Workload {
        attention: Attention::Eager,
        ..falcon.clone()
    };
    let tps = crate::throughput::tokens_per_sec(&eager, &h100(), &s.settings);
    assert!(tps > s.predicted_tokens_per_sec, "{advice}");
    assert!(
        advice.contains(&format!("{:.1} GiB instead of", {
            let e = crate::memory::estimate(&eager, &s.settings).unwrap();
            e.peak_bytes as f64 / GIB as f64
        })),
        "{advice}"
    );
    // nothing is changed by it: the settings are gpufit's own, and a job
    // already on eager attention gets no such advice
    let on_eager = builtin(&eager, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert!(!on_eager.warnings.iter().any(|w| w.contains("math kernel")));
    // a flash-kernel model through SDPA gets none either
    let llama = catalog_workload("meta-llama/Llama-3.1-8B", Method::Lora, Framework::Hf, 2048);
    let l = builtin(&llama, &h100(), Strategy::Balanced, &Pins::default()).unwrap();
    assert!(
        !l.warnings.iter().any(|w| w.contains("math kernel")),
        "{:?}",
        l.warnings
    );
}
