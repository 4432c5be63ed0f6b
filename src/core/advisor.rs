//! The advisor: workload + GPU + strategy + pins + history → engineering
//! settings, with confidence, source and reasoning (SPEC §3).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::core::catalog::GpuSpec;
use crate::core::memory::MemoryError;
use crate::core::run::RunRecord;
use crate::core::settings::{EngineeringSettings, Pins};
use crate::core::workload::Workload;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum AdvisorError {
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// Even micro batch 1 does not fit: says what would.
    #[error("{model} does not fit on {gpu} even at micro batch 1 (needs {needed_gib:.1} GiB of {capacity_gib:.1} GiB). What would: {}", .alternatives.join("; "))]
    DoesNotFit {
        model: String,
        gpu: String,
        needed_gib: f64,
        capacity_gib: f64,
        alternatives: Vec<String>,
    },
    #[error("invalid pin: {0}")]
    BadPin(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    Conservative,
    Balanced,
    #[serde(alias = "extreme")]
    Aggressive,
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "conservative" => Ok(Strategy::Conservative),
            "balanced" => Ok(Strategy::Balanced),
            "aggressive" | "extreme" => Ok(Strategy::Aggressive),
            o => Err(format!(
                "unknown strategy `{o}`: use conservative, balanced or aggressive"
            )),
        }
    }
}

/// Target fraction of GPU memory for the predicted peak, per strategy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StrategyTargets {
    pub conservative: f64,
    pub balanced: f64,
    pub aggressive: f64,
}

impl Default for StrategyTargets {
    fn default() -> Self {
        StrategyTargets {
            conservative: 0.70,
            balanced: 0.85,
            aggressive: 0.93,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SuggestionSource {
    Heuristic,
    HistoricalData,
    HistoricalDataWithMemory,
    LearnedFromFailures,
}

/// What the advisor says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Suggestion {
    #[serde(flatten)]
    pub settings: EngineeringSettings,
    pub predicted_peak_bytes: u64,
    /// predicted_peak_bytes / GPU memory.
    pub memory_fraction: f64,
    pub confidence: f64,
    pub source: SuggestionSource,
    pub strategy: Strategy,
    pub gpu: String,
    pub reasoning: String,
    pub warnings: Vec<String>,
}

/// Everything the advisor needs for one suggestion.
#[derive(Debug, Clone)]
pub struct AdviceRequest<'a> {
    pub workload: &'a Workload,
    pub gpu: &'a GpuSpec,
    pub strategy: Strategy,
    pub targets: StrategyTargets,
    pub pins: &'a Pins,
    /// Runs returned by the history store for `HistoryQuery` of this workload
    /// and GPU (may include other dtypes/checkpointing; the advisor filters).
    pub history: &'a [RunRecord],
}

/// Suggests engineering settings.
pub fn suggest(req: &AdviceRequest<'_>) -> Result<Suggestion, AdvisorError> {
    let _ = req;
    Err(AdvisorError::BadPin("advisor not implemented yet".into()))
}
