//! Engineering settings: the only fields gpufit may ever set (docs/design.md, "Domain").
//! Scientific settings (learning rate, global batch, LoRA rank, data, seed,
//! sequence length) live in [`crate::workload::Workload`] and are never
//! written by gpufit.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Numeric precision of the training step.
///
/// Plain `bf16`/`fp16`: parameters held in that type (torchtune, litgpt).
/// `-mixed`: fp32 parameters with autocast (HF Trainer, Lightning `bf16-mixed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Dtype {
    Fp32,
    Bf16,
    Fp16,
    Bf16Mixed,
    Fp16Mixed,
}

impl Dtype {
    pub const ALL: [Dtype; 5] = [
        Dtype::Fp32,
        Dtype::Bf16,
        Dtype::Fp16,
        Dtype::Bf16Mixed,
        Dtype::Fp16Mixed,
    ];

    /// The flag / wire spelling (`bf16-mixed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Bf16Mixed => "bf16-mixed",
            Dtype::Fp16Mixed => "fp16-mixed",
        }
    }

    /// Whether this dtype needs bf16 hardware support (compute capability ≥ 8.0).
    pub fn needs_bf16(self) -> bool {
        matches!(self, Dtype::Bf16 | Dtype::Bf16Mixed)
    }

    /// Autocast over fp32 weights (`bf16-mixed`, `fp16-mixed`).
    pub fn is_mixed(self) -> bool {
        matches!(self, Dtype::Bf16Mixed | Dtype::Fp16Mixed)
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    /// Accepts the flag spellings plus common aliases (`bfloat16`, `float32`,
    /// `bf16_mixed`, `16-mixed`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let n = s.trim().to_ascii_lowercase().replace('_', "-");
        Ok(match n.as_str() {
            "fp32" | "float32" | "32" | "32-true" | "float" => Dtype::Fp32,
            "bf16" | "bfloat16" | "bf16-true" => Dtype::Bf16,
            "fp16" | "float16" | "half" | "16-true" => Dtype::Fp16,
            "bf16-mixed" | "amp-bf16" => Dtype::Bf16Mixed,
            "fp16-mixed" | "16-mixed" | "amp-fp16" | "amp" => Dtype::Fp16Mixed,
            _ => {
                return Err(format!(
                    "unknown dtype `{s}`: use one of fp32, bf16, fp16, bf16-mixed, fp16-mixed"
                ))
            }
        })
    }
}

/// Data-loader advice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct DataLoaderSettings {
    pub num_workers: u32,
    pub pin_memory: bool,
    pub persistent_workers: bool,
    pub prefetch_factor: u32,
}

impl Default for DataLoaderSettings {
    fn default() -> Self {
        // PyTorch's own defaults for a worker-backed loader (prefetch_factor 2).
        DataLoaderSettings {
            num_workers: 4,
            pin_memory: true,
            persistent_workers: true,
            prefetch_factor: 2,
        }
    }
}

/// The engineering settings of one training step configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct EngineeringSettings {
    pub micro_batch_size: u32,
    /// Derived: m × a × W = G when a global batch G is given.
    pub gradient_accumulation_steps: u32,
    pub dtype: Dtype,
    pub activation_checkpointing: bool,
    pub activation_offloading: bool,
    pub compile: bool,
    pub dataloader: DataLoaderSettings,
}

impl Default for EngineeringSettings {
    fn default() -> Self {
        EngineeringSettings {
            micro_batch_size: 1,
            gradient_accumulation_steps: 1,
            dtype: Dtype::Bf16,
            activation_checkpointing: false,
            activation_offloading: false,
            compile: false,
            dataloader: DataLoaderSettings::default(),
        }
    }
}

/// Engineering fields the user fixed explicitly. A pinned field is kept as is;
/// gpufit only warns when it predicts the pinned value will run out of memory.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Pins {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_offloading: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_workers: Option<u32>,
    /// Full fine-tunes whose framework trains with fp32 master weights by
    /// default (HF Trainer, Lightning): `Some(true)` lets the advisor offer
    /// pure bf16 weights, `Some(false)` forbids them, `None` (auto) offers
    /// them only when nothing with fp32 master weights fits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pure_bf16: Option<bool>,
}

impl Pins {
    /// True when any pinned field changes the memory of a step (everything
    /// but compile and the data loader).
    pub fn pins_memory(&self) -> bool {
        self.micro_batch_size.is_some()
            || self.dtype.is_some()
            || self.activation_checkpointing.is_some()
            || self.activation_offloading.is_some()
    }

    /// Later pins win field by field ("last write wins").
    pub fn merged_with(&self, later: &Pins) -> Pins {
        Pins {
            micro_batch_size: later.micro_batch_size.or(self.micro_batch_size),
            gradient_accumulation_steps: later
                .gradient_accumulation_steps
                .or(self.gradient_accumulation_steps),
            dtype: later.dtype.or(self.dtype),
            activation_checkpointing: later
                .activation_checkpointing
                .or(self.activation_checkpointing),
            activation_offloading: later.activation_offloading.or(self.activation_offloading),
            compile: later.compile.or(self.compile),
            num_workers: later.num_workers.or(self.num_workers),
            pure_bf16: later.pure_bf16.or(self.pure_bf16),
        }
    }
}

/// One engineering setting as a training script receives it: the
/// `{placeholder}` gpufit fills in a command, the environment variable it
/// sets, and how the value is written. The one table of these
/// ([`SETTING_VARS`]) serves the Kubernetes injection, the Slurm TaskProlog
/// and `find-max-batch`, so a script reads the same names everywhere.
#[derive(Debug, Clone, Copy)]
pub struct SettingVar {
    /// The placeholder's name, without braces (`micro_batch_size`).
    pub placeholder: &'static str,
    /// The environment variable (`GPUFIT_MICRO_BATCH_SIZE`).
    pub env: &'static str,
    /// The value as the script reads it.
    pub render: fn(&EngineeringSettings) -> String,
}

impl SettingVar {
    /// The placeholder as written in a command: `{micro_batch_size}`.
    pub fn placeholder_text(&self) -> String {
        format!("{{{}}}", self.placeholder)
    }
}

/// A table row (a `const fn`, so the rows below stay one line each).
const fn var(
    placeholder: &'static str,
    env: &'static str,
    render: fn(&EngineeringSettings) -> String,
) -> SettingVar {
    SettingVar {
        placeholder,
        env,
        render,
    }
}

pub const MICRO_BATCH_SIZE: SettingVar = var("micro_batch_size", "GPUFIT_MICRO_BATCH_SIZE", |s| {
    s.micro_batch_size.to_string()
});
pub const GRADIENT_ACCUMULATION_STEPS: SettingVar = var(
    "gradient_accumulation_steps",
    "GPUFIT_GRAD_ACCUM_STEPS",
    |s| s.gradient_accumulation_steps.to_string(),
);
pub const DTYPE: SettingVar = var("dtype", "GPUFIT_DTYPE", |s| s.dtype.as_str().to_string());
pub const ACTIVATION_CHECKPOINTING: SettingVar = var(
    "activation_checkpointing",
    "GPUFIT_ACTIVATION_CHECKPOINTING",
    |s| s.activation_checkpointing.to_string(),
);
pub const ACTIVATION_OFFLOADING: SettingVar = var(
    "activation_offloading",
    "GPUFIT_ACTIVATION_OFFLOADING",
    |s| s.activation_offloading.to_string(),
);
pub const COMPILE: SettingVar = var("compile", "GPUFIT_COMPILE", |s| s.compile.to_string());
pub const NUM_WORKERS: SettingVar = var("num_workers", "GPUFIT_DATALOADER_NUM_WORKERS", |s| {
    s.dataloader.num_workers.to_string()
});
pub const PIN_MEMORY: SettingVar = var("pin_memory", "GPUFIT_DATALOADER_PIN_MEMORY", |s| {
    s.dataloader.pin_memory.to_string()
});
pub const PERSISTENT_WORKERS: SettingVar = var(
    "persistent_workers",
    "GPUFIT_DATALOADER_PERSISTENT_WORKERS",
    |s| s.dataloader.persistent_workers.to_string(),
);
pub const PREFETCH_FACTOR: SettingVar = var(
    "prefetch_factor",
    "GPUFIT_DATALOADER_PREFETCH_FACTOR",
    |s| s.dataloader.prefetch_factor.to_string(),
);

/// Every setting a script can receive, in the order they are injected.
pub const SETTING_VARS: [SettingVar; 10] = [
    MICRO_BATCH_SIZE,
    GRADIENT_ACCUMULATION_STEPS,
    DTYPE,
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOADING,
    COMPILE,
    NUM_WORKERS,
    PIN_MEMORY,
    PERSISTENT_WORKERS,
    PREFETCH_FACTOR,
];

/// The environment variables for a set of engineering settings, in a fixed
/// order: what the Kubernetes pod template and the Slurm TaskProlog inject,
/// so a training script reads the same names on both.
pub fn env_vars(s: &EngineeringSettings) -> Vec<(&'static str, String)> {
    SETTING_VARS
        .iter()
        .map(|v| (v.env, (v.render)(s)))
        .collect()
}

/// Replaces every `{placeholder}` of [`SETTING_VARS`] in one word.
pub fn substitute(word: &str, s: &EngineeringSettings) -> String {
    if !word.contains('{') {
        return word.to_string();
    }
    SETTING_VARS.iter().fold(word.to_string(), |out, v| {
        out.replace(&v.placeholder_text(), &(v.render)(s))
    })
}

// === pins: the one parser ===

/// The settings a job may pin, by their [`SETTING_VARS`] names: the one
/// vocabulary of the webhook's `gpufit.io/pins`, the Slurm job comment and
/// `GPUFIT_*` variables, and the CLI.
pub const PINNABLE: [SettingVar; 7] = [
    MICRO_BATCH_SIZE,
    GRADIENT_ACCUMULATION_STEPS,
    DTYPE,
    ACTIVATION_CHECKPOINTING,
    ACTIVATION_OFFLOADING,
    COMPILE,
    NUM_WORKERS,
];

/// Other names a pin is known by, → its [`SETTING_VARS`] name. Each
/// setting's variable without `GPUFIT_` (`grad_accum_steps`,
/// `dataloader_num_workers`) is accepted too, so what gpufit injects can be
/// given back as a pin.
pub const PIN_ALIASES: [(&str, &str); 6] = [
    ("micro_batch", "micro_batch_size"),
    ("grad_accum", "gradient_accumulation_steps"),
    ("gradient_accumulation", "gradient_accumulation_steps"),
    ("checkpointing", "activation_checkpointing"),
    ("offloading", "activation_offloading"),
    ("workers", "num_workers"),
];

/// Why a pin cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PinError {
    #[error("`{0}` is not an engineering setting that can be pinned: use micro_batch_size, gradient_accumulation_steps, dtype, activation_checkpointing, activation_offloading, compile or num_workers")]
    Unknown(String),
    #[error("{key}: {why}")]
    BadValue { key: &'static str, why: String },
    #[error("{0} is pinned twice")]
    Twice(&'static str),
}

/// The pinnable setting a key names (any case, `-` or `_`, with or without
/// `GPUFIT_`; its name, its variable's name or an alias), or None.
pub fn pin_var(key: &str) -> Option<SettingVar> {
    let k = key.trim().to_ascii_lowercase().replace('-', "_");
    let k = k.strip_prefix("gpufit_").unwrap_or(&k);
    let name = PIN_ALIASES
        .iter()
        .find(|(alias, _)| *alias == k)
        .map_or(k, |(_, name)| *name);
    PINNABLE.iter().copied().find(|v| {
        v.placeholder == name
            || v.env
                .strip_prefix("GPUFIT_")
                .is_some_and(|e| e.eq_ignore_ascii_case(name))
    })
}

/// A switch: `true`/`on`/`yes`/`1` or `false`/`off`/`no`/`0` (any case).
pub fn parse_switch(v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" | "1" => Ok(true),
        "false" | "off" | "no" | "0" => Ok(false),
        _ => Err(format!("`{}` is not a switch: use true or false", v.trim())),
    }
}

impl Pins {
    /// Sets the pin `var` from its text value.
    pub fn set(&mut self, var: SettingVar, value: &str) -> Result<(), PinError> {
        let v = value.trim();
        let bad = |why: String| PinError::BadValue {
            key: var.placeholder,
            why,
        };
        let whole = || {
            v.parse::<u32>()
                .ok()
                .filter(|n| *n >= 1)
                .ok_or_else(|| bad(format!("`{v}` is not a whole number of at least 1")))
        };
        let switch = || parse_switch(v).map_err(bad);
        let slot_taken = match var.placeholder {
            "micro_batch_size" => self.micro_batch_size.replace(whole()?).is_some(),
            "gradient_accumulation_steps" => {
                self.gradient_accumulation_steps.replace(whole()?).is_some()
            }
            "dtype" => self
                .dtype
                .replace(v.parse::<Dtype>().map_err(bad)?)
                .is_some(),
            "activation_checkpointing" => {
                self.activation_checkpointing.replace(switch()?).is_some()
            }
            "activation_offloading" => self.activation_offloading.replace(switch()?).is_some(),
            "compile" => self.compile.replace(switch()?).is_some(),
            "num_workers" => self
                .num_workers
                .replace(
                    v.parse::<u32>()
                        .map_err(|_| bad(format!("`{v}` is not a whole number")))?,
                )
                .is_some(),
            other => return Err(PinError::Unknown(other.to_string())),
        };
        if slot_taken {
            return Err(PinError::Twice(var.placeholder));
        }
        Ok(())
    }
}

/// Pins from `key=value` pairs: the one parser of pins, wherever they are
/// written. An unknown key, a bad value or a setting given twice (under
/// any of its names) is refused.
pub fn parse_pins<'a>(
    pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Pins, PinError> {
    let mut p = Pins::default();
    for (k, v) in pairs {
        let var = pin_var(k).ok_or_else(|| PinError::Unknown(k.trim().to_string()))?;
        p.set(var, v)?;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_has_its_own_placeholder_and_variable() {
        let mut names: Vec<&str> = SETTING_VARS.iter().map(|v| v.placeholder).collect();
        let mut envs: Vec<&str> = SETTING_VARS.iter().map(|v| v.env).collect();
        names.sort();
        names.dedup();
        envs.sort();
        envs.dedup();
        assert_eq!(names.len(), SETTING_VARS.len());
        assert_eq!(envs.len(), SETTING_VARS.len());
        assert!(envs.iter().all(|e| e.starts_with("GPUFIT_")));
    }

    #[test]
    fn placeholders_are_filled_with_the_rendered_values() {
        let s = EngineeringSettings {
            micro_batch_size: 6,
            dtype: Dtype::Bf16Mixed,
            activation_checkpointing: true,
            ..Default::default()
        };
        assert_eq!(
            substitute(
                "--bs={micro_batch_size} --dtype {dtype}/{activation_checkpointing}",
                &s
            ),
            "--bs=6 --dtype bf16-mixed/true"
        );
        assert_eq!(substitute("{unknown}", &s), "{unknown}");
        let env = env_vars(&s);
        assert_eq!(env[0], ("GPUFIT_MICRO_BATCH_SIZE", "6".to_string()));
    }

    #[test]
    fn pins_read_every_name_of_a_setting_once() {
        // The webhook's, Slurm's and the injected variables' names agree.
        for (a, b) in [
            ("gradient_accumulation_steps", "grad_accum_steps"),
            ("num_workers", "dataloader_num_workers"),
            ("micro_batch_size", "GPUFIT_MICRO_BATCH_SIZE"),
            ("num_workers", "GPUFIT_DATALOADER_NUM_WORKERS"),
            ("activation_checkpointing", "checkpointing"),
        ] {
            assert_eq!(
                pin_var(a).map(|v| v.placeholder),
                pin_var(b).map(|v| v.placeholder),
                "{a} / {b}"
            );
        }
        let p = parse_pins([
            ("micro-batch-size", "4"),
            ("grad_accum_steps", "8"),
            ("dtype", "bf16"),
            ("compile", "ON"),
            ("dataloader_num_workers", "0"),
        ])
        .expect("pins");
        assert_eq!(p.micro_batch_size, Some(4));
        assert_eq!(p.gradient_accumulation_steps, Some(8));
        assert_eq!(p.compile, Some(true));
        assert_eq!(p.num_workers, Some(0));
        assert_eq!(
            parse_pins([("num_workers", "2"), ("dataloader_num_workers", "3")]),
            Err(PinError::Twice("num_workers"))
        );
        assert!(matches!(
            parse_pins([("pin_memory", "true")]),
            Err(PinError::Unknown(_))
        ));
        assert!(parse_pins([("micro_batch_size", "0")]).is_err());
        assert!(parse_pins([("compile", "maybe")]).is_err());
    }
}
