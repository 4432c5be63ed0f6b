//! Model catalog: architecture numbers from each model's published config.json.
//!
//! Every row below is transcribed from the model's `config.json` on the
//! Hugging Face Hub, at `https://huggingface.co/<id>/blob/main/config.json`
//! (the `<id>` is the row's first name): `hidden_size`,
//! `num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`,
//! `head_dim` (or hidden / heads), `intermediate_size`, `vocab_size`,
//! `tie_word_embeddings`, `max_position_embeddings`, and for Mixtral
//! `num_local_experts` / `num_experts_per_tok`. GPT-2 uses `n_embd`, `n_layer`,
//! `n_head`, `n_positions` (MLP 4 × n_embd); T5 uses `d_model`, `num_layers`
//! (per stack), `num_heads`, `d_kv`, `d_ff`. Parameter totals are the counts
//! the model cards / `model.num_parameters()` give; a test recomputes each
//! from the shape numbers and requires agreement within 2 %.

use std::collections::HashMap;
use std::sync::OnceLock;

use serde_json::Value;

use crate::workload::{ArchKind, ArchQuirks, Method, ModelArch};

use super::CatalogError;

/// A resolved model reference: the architecture, plus the method when the
/// name implies one (torchtune `llama3_1/8B_lora_single_device` → LoRA).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelRef {
    pub arch: ModelArch,
    pub method: Option<Method>,
}

struct Row {
    /// Hugging Face id first, then other accepted names.
    names: &'static [&'static str],
    /// torchtune model family and size token (`llama3_1`, `8b`), if torchtune ships it.
    torchtune: Option<(&'static str, &'static str)>,
    kind: ArchKind,
    params: u64,
    hidden: u32,
    layers: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    intermediate: u32,
    vocab: u32,
    tied: bool,
    gated: bool,
    experts: u32,
    experts_per_token: u32,
    max_pos: u32,
}

#[allow(clippy::too_many_arguments)]
const fn dec(
    names: &'static [&'static str],
    torchtune: Option<(&'static str, &'static str)>,
    params: u64,
    hidden: u32,
    layers: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    intermediate: u32,
    vocab: u32,
    tied: bool,
    max_pos: u32,
) -> Row {
    Row {
        names,
        torchtune,
        kind: ArchKind::DecoderOnly,
        params,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        vocab,
        tied,
        gated: true,
        experts: 1,
        experts_per_token: 1,
        max_pos,
    }
}

const fn gpt2(
    names: &'static [&'static str],
    params: u64,
    hidden: u32,
    layers: u32,
    heads: u32,
) -> Row {
    Row {
        names,
        torchtune: None,
        kind: ArchKind::DecoderOnly,
        params,
        hidden,
        layers,
        heads,
        kv_heads: heads,
        head_dim: hidden / heads,
        intermediate: 4 * hidden,
        vocab: 50257,
        tied: true,
        gated: false,
        experts: 1,
        experts_per_token: 1,
        max_pos: 1024,
    }
}

const fn bert(
    names: &'static [&'static str],
    params: u64,
    hidden: u32,
    layers: u32,
    heads: u32,
) -> Row {
    Row {
        names,
        torchtune: None,
        kind: ArchKind::EncoderOnly,
        params,
        hidden,
        layers,
        heads,
        kv_heads: heads,
        head_dim: 64,
        intermediate: 4 * hidden,
        vocab: 30522,
        tied: true,
        gated: false,
        experts: 1,
        experts_per_token: 1,
        max_pos: 512,
    }
}

const ROWS: &[Row] = &[
    // --- Llama 3.x (meta-llama) ---
    dec(
        &[
            "meta-llama/Llama-3.2-1B",
            "llama-3.2-1b",
            "meta-llama/Llama-3.2-1B-Instruct",
        ],
        Some(("llama3_2", "1b")),
        1_235_814_400,
        2048,
        16,
        32,
        8,
        64,
        8192,
        128_256,
        true,
        131_072,
    ),
    dec(
        &[
            "meta-llama/Llama-3.2-3B",
            "llama-3.2-3b",
            "meta-llama/Llama-3.2-3B-Instruct",
        ],
        Some(("llama3_2", "3b")),
        3_212_749_824,
        3072,
        28,
        24,
        8,
        128,
        8192,
        128_256,
        true,
        131_072,
    ),
    dec(
        &[
            "meta-llama/Llama-3.1-8B",
            "llama-3.1-8b",
            "meta-llama/Llama-3.1-8B-Instruct",
            "meta-llama/Meta-Llama-3.1-8B",
        ],
        Some(("llama3_1", "8b")),
        8_030_261_248,
        4096,
        32,
        32,
        8,
        128,
        14336,
        128_256,
        false,
        131_072,
    ),
    dec(
        &[
            "meta-llama/Meta-Llama-3-8B",
            "llama-3-8b",
            "meta-llama/Meta-Llama-3-8B-Instruct",
            "llama3-8b",
        ],
        Some(("llama3", "8b")),
        8_030_261_248,
        4096,
        32,
        32,
        8,
        128,
        14336,
        128_256,
        false,
        8192,
    ),
    dec(
        &[
            "meta-llama/Llama-3.1-70B",
            "llama-3.1-70b",
            "meta-llama/Llama-3.1-70B-Instruct",
            "meta-llama/Llama-3.3-70B-Instruct",
            "llama-3.3-70b",
        ],
        Some(("llama3_1", "70b")),
        70_553_706_496,
        8192,
        80,
        64,
        8,
        128,
        28672,
        128_256,
        false,
        131_072,
    ),
    dec(
        &[
            "meta-llama/Meta-Llama-3-70B",
            "llama-3-70b",
            "meta-llama/Meta-Llama-3-70B-Instruct",
        ],
        Some(("llama3", "70b")),
        70_553_706_496,
        8192,
        80,
        64,
        8,
        128,
        28672,
        128_256,
        false,
        8192,
    ),
    // --- Llama 2 ---
    dec(
        &[
            "meta-llama/Llama-2-7b-hf",
            "llama-2-7b",
            "meta-llama/Llama-2-7b-chat-hf",
        ],
        Some(("llama2", "7b")),
        6_738_415_616,
        4096,
        32,
        32,
        32,
        128,
        11008,
        32000,
        false,
        4096,
    ),
    dec(
        &[
            "meta-llama/Llama-2-13b-hf",
            "llama-2-13b",
            "meta-llama/Llama-2-13b-chat-hf",
        ],
        Some(("llama2", "13b")),
        13_015_864_320,
        5120,
        40,
        40,
        40,
        128,
        13824,
        32000,
        false,
        4096,
    ),
    // --- Mistral / Mixtral ---
    dec(
        &[
            "mistralai/Mistral-7B-v0.1",
            "mistral-7b",
            "mistralai/Mistral-7B-Instruct-v0.1",
            "mistral-7b-v0.1",
        ],
        Some(("mistral", "7b")),
        7_241_732_096,
        4096,
        32,
        32,
        8,
        128,
        14336,
        32000,
        false,
        32768,
    ),
    dec(
        &[
            "mistralai/Mistral-7B-v0.3",
            "mistral-7b-v0.3",
            "mistralai/Mistral-7B-Instruct-v0.3",
        ],
        None,
        7_248_023_552,
        4096,
        32,
        32,
        8,
        128,
        14336,
        32768,
        false,
        32768,
    ),
    Row {
        // Mixtral: num_local_experts 8, num_experts_per_tok 2; every expert's
        // gate/up/down counts towards the 46.7 B total, only 2 run per token.
        names: &[
            "mistralai/Mixtral-8x7B-v0.1",
            "mixtral-8x7b",
            "mistralai/Mixtral-8x7B-Instruct-v0.1",
        ],
        torchtune: None,
        kind: ArchKind::DecoderOnly,
        params: 46_702_792_704,
        hidden: 4096,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 14336,
        vocab: 32000,
        tied: false,
        gated: true,
        experts: 8,
        experts_per_token: 2,
        max_pos: 32768,
    },
    // --- Qwen2.5 (Qwen) ---
    dec(
        &[
            "Qwen/Qwen2.5-0.5B",
            "qwen2.5-0.5b",
            "Qwen/Qwen2.5-0.5B-Instruct",
        ],
        Some(("qwen2_5", "0.5b")),
        494_032_768,
        896,
        24,
        14,
        2,
        64,
        4864,
        151_936,
        true,
        32768,
    ),
    dec(
        &[
            "Qwen/Qwen2.5-1.5B",
            "qwen2.5-1.5b",
            "Qwen/Qwen2.5-1.5B-Instruct",
        ],
        Some(("qwen2_5", "1.5b")),
        1_543_714_304,
        1536,
        28,
        12,
        2,
        128,
        8960,
        151_936,
        true,
        131_072,
    ),
    dec(
        &["Qwen/Qwen2.5-3B", "qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct"],
        Some(("qwen2_5", "3b")),
        3_085_938_688,
        2048,
        36,
        16,
        2,
        128,
        11008,
        151_936,
        true,
        32768,
    ),
    dec(
        &["Qwen/Qwen2.5-7B", "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct"],
        Some(("qwen2_5", "7b")),
        7_615_616_512,
        3584,
        28,
        28,
        4,
        128,
        18944,
        152_064,
        false,
        131_072,
    ),
    dec(
        &[
            "Qwen/Qwen2.5-14B",
            "qwen2.5-14b",
            "Qwen/Qwen2.5-14B-Instruct",
        ],
        Some(("qwen2_5", "14b")),
        14_770_033_664,
        5120,
        48,
        40,
        8,
        128,
        13824,
        152_064,
        false,
        131_072,
    ),
    dec(
        &[
            "Qwen/Qwen2.5-32B",
            "qwen2.5-32b",
            "Qwen/Qwen2.5-32B-Instruct",
        ],
        Some(("qwen2_5", "32b")),
        32_763_876_352,
        5120,
        64,
        40,
        8,
        128,
        27648,
        152_064,
        false,
        131_072,
    ),
    dec(
        &[
            "Qwen/Qwen2.5-72B",
            "qwen2.5-72b",
            "Qwen/Qwen2.5-72B-Instruct",
        ],
        Some(("qwen2_5", "72b")),
        72_706_203_648,
        8192,
        80,
        64,
        8,
        128,
        29568,
        152_064,
        false,
        131_072,
    ),
    // --- Gemma 2 (google): head_dim from config (256 for 2B/9B, 128 for 27B) ---
    dec(
        &["google/gemma-2-2b", "gemma-2-2b", "google/gemma-2-2b-it"],
        Some(("gemma2", "2b")),
        2_614_341_888,
        2304,
        26,
        8,
        4,
        256,
        9216,
        256_000,
        true,
        8192,
    ),
    dec(
        &["google/gemma-2-9b", "gemma-2-9b", "google/gemma-2-9b-it"],
        Some(("gemma2", "9b")),
        9_241_705_984,
        3584,
        42,
        16,
        8,
        256,
        14336,
        256_000,
        true,
        8192,
    ),
    dec(
        &["google/gemma-2-27b", "gemma-2-27b", "google/gemma-2-27b-it"],
        Some(("gemma2", "27b")),
        27_227_128_320,
        4608,
        46,
        32,
        16,
        128,
        36864,
        256_000,
        true,
        8192,
    ),
    // --- Phi-3 mini (microsoft) ---
    dec(
        &[
            "microsoft/Phi-3-mini-4k-instruct",
            "phi-3-mini",
            "phi-3-mini-4k",
        ],
        Some(("phi3", "mini")),
        3_821_079_552,
        3072,
        32,
        32,
        32,
        96,
        8192,
        32064,
        false,
        4096,
    ),
    // --- Falcon (tiiuae): config.json `multi_query: true` (one K/V head),
    // `parallel_attn: true`, `new_decoder_architecture: false` (one
    // LayerNorm a block), GELU MLP 4 × hidden, the head tied to the
    // embedding (FalconConfig's `tie_word_embeddings` default), no biases;
    // family details in `family_quirks` ---
    Row {
        names: &["tiiuae/falcon-7b", "falcon-7b", "tiiuae/falcon-7b-instruct"],
        torchtune: None,
        kind: ArchKind::DecoderOnly,
        params: 6_921_720_704,
        hidden: 4544,
        layers: 32,
        heads: 71,
        kv_heads: 1,
        head_dim: 64,
        intermediate: 18176,
        vocab: 65024,
        tied: true,
        gated: false,
        experts: 1,
        experts_per_token: 1,
        max_pos: 2048,
    },
    // --- GPT-2 (openai-community) ---
    gpt2(
        &["openai-community/gpt2", "gpt2", "gpt2-small"],
        124_439_808,
        768,
        12,
        12,
    ),
    gpt2(
        &["openai-community/gpt2-medium", "gpt2-medium"],
        354_823_168,
        1024,
        24,
        16,
    ),
    gpt2(
        &["openai-community/gpt2-large", "gpt2-large"],
        774_030_080,
        1280,
        36,
        20,
    ),
    gpt2(
        &["openai-community/gpt2-xl", "gpt2-xl"],
        1_557_611_200,
        1600,
        48,
        25,
    ),
    // --- BERT (google-bert) ---
    bert(
        &[
            "google-bert/bert-base-uncased",
            "bert-base-uncased",
            "bert-base",
        ],
        109_482_240,
        768,
        12,
        12,
    ),
    bert(
        &[
            "google-bert/bert-large-uncased",
            "bert-large-uncased",
            "bert-large",
        ],
        335_141_888,
        1024,
        24,
        16,
    ),
    // --- T5 (google-t5): 12 encoder + 12 decoder blocks, d_ff 3072, relu MLP ---
    Row {
        names: &["google-t5/t5-base", "t5-base"],
        torchtune: None,
        kind: ArchKind::EncoderDecoder,
        params: 222_903_552,
        hidden: 768,
        layers: 24,
        heads: 12,
        kv_heads: 12,
        head_dim: 64,
        intermediate: 3072,
        vocab: 32128,
        tied: true,
        gated: false,
        experts: 1,
        experts_per_token: 1,
        max_pos: 512,
    },
];

impl Row {
    fn arch(&self) -> ModelArch {
        ModelArch {
            name: self.names[0].to_string(),
            kind: self.kind,
            params: self.params,
            hidden_size: self.hidden,
            num_layers: self.layers,
            num_attention_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            intermediate_size: self.intermediate,
            vocab_size: self.vocab,
            tied_embeddings: self.tied,
            gated_mlp: self.gated,
            num_experts: self.experts,
            experts_per_token: self.experts_per_token,
            max_position_embeddings: self.max_pos,
            quirks: family_quirks(self.names[0]),
        }
    }
}

/// Family details of catalog models, as their config.json files give them
/// (`activation_function: gelu_new` for GPT-2; Gemma 2's four norms per
/// block, `attn_logit_softcapping: 50`, `final_logit_softcapping: 30`).
fn family_quirks(id: &str) -> ArchQuirks {
    if id.starts_with("openai-community/gpt2") {
        ArchQuirks {
            composite_gelu: true,
            attn_softmax_no_upcast: true,
            fused_qkv: true,
            unrotated_qkv_views: true,
            ..ArchQuirks::default()
        }
    } else if id.starts_with("microsoft/Phi-3") {
        ArchQuirks {
            fused_qkv: true,
            fused_gate_up: true,
            // Phi-3-mini-4k-instruct's config.json: "sliding_window": 2047
            sliding_window: 2047,
            ..ArchQuirks::default()
        }
    } else if id.starts_with("mistralai/Mistral-7B-v0.1")
        || id.starts_with("mistralai/Mistral-7B-Instruct-v0.1")
    {
        // v0.1's config.json: "sliding_window": 4096 (v0.2 and v0.3: null)
        ArchQuirks {
            sliding_window: 4096,
            ..ArchQuirks::default()
        }
    } else if id.starts_with("tiiuae/falcon-7b") {
        // as `arch_from_hf_config` reads Falcon-7B's config.json (checked
        // against it in the tests): transformers' SDPA falls to the math
        // kernel for its one K/V head, its eager softmax stays in the
        // activations' dtype, rotary keeps the value's dtype, one fused
        // query_key_value, attention and MLP in parallel off one LayerNorm,
        // and dropout 0 (FalconConfig's defaults)
        ArchQuirks {
            sdpa_math_fallback: true,
            attn_softmax_16bit: true,
            fused_qkv: true,
            parallel_residual: true,
            rotary_in_value_dtype: true,
            single_norm: true,
            no_resid_dropout: true,
            no_attn_dropout: true,
            ..ArchQuirks::default()
        }
    } else if id.starts_with("google-bert/") {
        ArchQuirks {
            attn_softmax_no_upcast: true,
            ..ArchQuirks::default()
        }
    } else if id.starts_with("google/gemma-2") {
        ArchQuirks {
            sandwich_norms: true,
            attn_softcapping: true,
            final_softcapping: true,
            norm_scale_fp32: true,
            // "sliding_window": 4096 on every other layer
            sliding_window: 4096,
            alternating_sliding_window: true,
            ..ArchQuirks::default()
        }
    } else {
        ArchQuirks::default()
    }
}

/// Lower-case alphanumerics only, so `Llama-3.1-8B`, `llama3.1_8b` and
/// `LLAMA 3.1 8B` meet.
fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Name variants of a catalog name: with and without the organisation.
fn keys_of(name: &str) -> Vec<String> {
    let mut v = vec![normalize(name)];
    if let Some((_, base)) = name.rsplit_once('/') {
        v.push(normalize(base));
    }
    v
}

struct Index {
    archs: Vec<ModelArch>,
    by_key: HashMap<String, usize>,
    /// (torchtune family, size token) → row.
    by_torchtune: HashMap<(String, String), usize>,
}

fn index() -> &'static Index {
    static INDEX: OnceLock<Index> = OnceLock::new();
    INDEX.get_or_init(|| {
        let mut by_key = HashMap::new();
        let mut by_torchtune = HashMap::new();
        for (i, r) in ROWS.iter().enumerate() {
            for n in r.names {
                for k in keys_of(n) {
                    by_key.entry(k).or_insert(i);
                }
            }
            if let Some((fam, size)) = r.torchtune {
                by_torchtune.insert((fam.to_string(), normalize(size)), i);
            }
        }
        Index {
            archs: ROWS.iter().map(Row::arch).collect(),
            by_key,
            by_torchtune,
        }
    })
}

/// Method implied by a torchtune recipe / builder name.
fn method_in(s: &str) -> Option<Method> {
    let s = s.to_ascii_lowercase();
    if s.contains("qlora") {
        Some(Method::Qlora)
    } else if s.contains("lora") || s.contains("dora") {
        Some(Method::Lora)
    } else if s.contains("full") {
        Some(Method::Full)
    } else {
        None
    }
}

/// `llama3_1/8B_lora_single_device` → (llama3_1, 8b, LoRA).
fn torchtune_config(name: &str) -> Option<(usize, Option<Method>)> {
    let (family, rest) = name.split_once('/')?;
    let size = rest.split('_').next()?;
    let idx = index();
    let i = *idx
        .by_torchtune
        .get(&(family.to_ascii_lowercase(), normalize(size)))?;
    Some((i, method_in(rest)))
}

/// `torchtune.models.llama3_1.lora_llama3_1_8b` → (llama3_1, 8b, LoRA).
fn torchtune_component(name: &str) -> Option<(usize, Option<Method>)> {
    let rest = name.strip_prefix("torchtune.models.")?;
    let (family, builder) = rest.split_once('.')?;
    let (method, b) = if let Some(b) = builder.strip_prefix("qlora_") {
        (Some(Method::Qlora), b)
    } else if let Some(b) = builder.strip_prefix("lora_") {
        (Some(Method::Lora), b)
    } else {
        (None, builder)
    };
    let size = b.strip_prefix(family)?.trim_start_matches('_');
    // Sizes are written `8b`, `0_5b` (0.5B), `mini`.
    let size = size.replace('_', ".");
    let idx = index();
    let i = *idx
        .by_torchtune
        .get(&(family.to_ascii_lowercase(), normalize(&size)))?;
    Some((i, method.or(Some(Method::Full))))
}

/// Resolves a Hugging Face id, short id, torchtune config name or torchtune
/// component path to a catalog model.
pub fn lookup_model(name: &str) -> Result<ModelRef, CatalogError> {
    let idx = index();
    let trimmed = name.trim();
    if trimmed.starts_with("torchtune.models.") {
        if let Some((i, method)) = torchtune_component(trimmed) {
            return Ok(ModelRef {
                arch: idx.archs[i].clone(),
                method,
            });
        }
    }
    if let Some((i, method)) = torchtune_config(trimmed) {
        return Ok(ModelRef {
            arch: idx.archs[i].clone(),
            method,
        });
    }
    for k in keys_of(trimmed) {
        if let Some(&i) = idx.by_key.get(&k) {
            return Ok(ModelRef {
                arch: idx.archs[i].clone(),
                method: None,
            });
        }
    }
    Err(CatalogError::UnknownModel {
        name: name.to_string(),
        suggestions: close_matches(trimmed),
    })
}

fn close_matches(name: &str) -> Vec<String> {
    let key = keys_of(name).pop().unwrap_or_default();
    if key.is_empty() {
        return Vec::new();
    }
    let mut scored: Vec<(usize, usize)> = ROWS
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let d = r
                .names
                .iter()
                .flat_map(|n| keys_of(n))
                .map(|c| {
                    if c.starts_with(&key) {
                        0
                    } else {
                        super::edit_distance(&key, &c)
                    }
                })
                .min()
                .unwrap_or(usize::MAX);
            (d, i)
        })
        .collect();
    scored.sort();
    let limit = (key.len() / 2).max(2);
    scored
        .into_iter()
        .filter(|(d, _)| *d <= limit)
        .take(3)
        .map(|(_, i)| ROWS[i].names[0].to_string())
        .collect()
}

fn bad(path: &str, message: impl Into<String>) -> CatalogError {
    CatalogError::BadConfig {
        path: path.to_string(),
        message: message.into(),
    }
}

/// Reads the first of `keys` present as a positive integer.
fn get_u32(v: &Value, path: &str, keys: &[&str]) -> Result<Option<u32>, CatalogError> {
    for k in keys {
        if let Some(x) = v.get(*k) {
            if x.is_null() {
                continue;
            }
            let n = x.as_u64().ok_or_else(|| {
                bad(
                    path,
                    format!("`{k}` must be a non-negative integer, got {x}"),
                )
            })?;
            let n = u32::try_from(n).map_err(|_| bad(path, format!("`{k}` = {n} is too large")))?;
            return Ok(Some(n));
        }
    }
    Ok(None)
}

fn need_u32(v: &Value, path: &str, keys: &[&str]) -> Result<u32, CatalogError> {
    match get_u32(v, path, keys)? {
        Some(0) => Err(bad(path, format!("`{}` must be positive", keys[0]))),
        Some(n) => Ok(n),
        None => Err(bad(
            path,
            format!("missing `{}`: is this a transformer config.json?", keys[0]),
        )),
    }
}

/// Parameter count from the shape numbers: embeddings (+ untied output
/// head), per layer attention (q, k, v, o), MLP (per expert, plus the router)
/// and norms. Biases are ignored except in the classic (GPT-2/BERT/T5) MLP;
/// they are < 0.1 % of any catalog model.
pub fn count_params(a: &ModelArch) -> u64 {
    let h = a.hidden_size as u64;
    let qd = a.num_attention_heads as u64 * a.head_dim as u64;
    let kvd = a.num_kv_heads as u64 * a.head_dim as u64;
    let attn = h * qd + 2 * h * kvd + qd * h;
    let i = a.intermediate_size as u64;
    let mlp_one = if a.gated_mlp {
        3 * h * i
    } else {
        2 * h * i + i + h
    };
    let experts = a.num_experts.max(1) as u64;
    let router = if experts > 1 { h * experts } else { 0 };
    let per_layer = attn + mlp_one * experts + router + 2 * h;
    // T5's decoder blocks also have cross-attention (another q,k,v,o).
    let cross = if a.kind == ArchKind::EncoderDecoder {
        (a.num_layers as u64 / 2) * (attn + h)
    } else {
        0
    };
    let v = a.vocab_size as u64;
    let embed = v * h * if a.tied_embeddings { 1 } else { 2 };
    // Learned positions: BERT and GPT-2 (whose q, k and v go unrotated).
    // The other classic decoders (GPT-NeoX, Phi, Falcon) rotate q and k
    // and have no position table.
    let pos = if a.kind == ArchKind::EncoderOnly || a.quirks.unrotated_qkv_views {
        a.max_position_embeddings as u64 * h
    } else {
        0
    };
    embed + pos + a.num_layers as u64 * per_layer + cross + h
}

/// The attention window of a `config.json` (0: none). A key the file
/// leaves out takes the config class's default: 4,096 for `MistralConfig`,
/// none for the others; Qwen2's window is off unless `use_sliding_window`
/// (its files carry a `sliding_window` they do not use). Gemma 3's
/// pattern (five windowed layers in six) is counted as every layer.
fn sliding_window(v: &Value, model_type: &str) -> u32 {
    let window = match v.get("sliding_window") {
        Some(w) => w.as_u64(),
        None => (model_type == "mistral").then_some(4096),
    };
    let used = v
        .get("use_sliding_window")
        .and_then(Value::as_bool)
        .unwrap_or(!model_type.starts_with("qwen2"));
    match window {
        Some(w) if used => u32::try_from(w).unwrap_or(u32::MAX),
        _ => 0,
    }
}

/// Whether a config.json's `architectures` names a task head of a few
/// outputs per sequence or token (`BertForSequenceClassification`,
/// `…ForTokenClassification`, `…ForQuestionAnswering`,
/// `…ForMultipleChoice`) rather than one over the vocabulary
/// (`…ForCausalLM`, `…ForMaskedLM`): `from_pretrained` of such a class
/// builds that head. `false` when the field is absent or names none.
pub fn small_task_head_in_hf_config(json: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(json) else {
        return false;
    };
    v.get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|list| {
            list.iter().filter_map(Value::as_str).any(|a| {
                [
                    "ForSequenceClassification",
                    "ForTokenClassification",
                    "ForQuestionAnswering",
                    "ForMultipleChoice",
                ]
                .iter()
                .any(|suffix| a.ends_with(suffix))
            })
        })
}

/// Parses a Hugging Face `config.json` text into an architecture.
///
/// Understands the Llama/Mistral/Qwen/Gemma/Phi-3/Mixtral key names
/// (`hidden_size`, `num_hidden_layers`, …), GPT-2's (`n_embd`, `n_layer`,
/// `n_head`, `n_positions`), BERT's, and T5's (`d_model`, `num_layers`,
/// `d_ff`, `d_kv`). The parameter count is computed from the shape.
pub fn arch_from_hf_config(name: &str, json: &str) -> Result<ModelArch, CatalogError> {
    let v: Value =
        serde_json::from_str(json).map_err(|e| bad(name, format!("not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad(name, "expected a JSON object"));
    }
    let model_type = v
        .get("model_type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_ascii_lowercase();
    let is_t5 = matches!(model_type.as_str(), "t5" | "mt5") || v.get("d_model").is_some();
    let is_enc = matches!(
        model_type.as_str(),
        "bert" | "roberta" | "distilbert" | "electra" | "deberta"
    );
    let hidden = need_u32(&v, name, &["hidden_size", "n_embd", "d_model", "dim"])?;
    let mut layers = need_u32(
        &v,
        name,
        &["num_hidden_layers", "n_layer", "num_layers", "n_layers"],
    )?;
    if is_t5 {
        let dec = get_u32(&v, name, &["num_decoder_layers"])?.unwrap_or(layers);
        layers += dec;
    }
    let heads = need_u32(
        &v,
        name,
        &["num_attention_heads", "n_head", "num_heads", "n_heads"],
    )?;
    // Falcon-7B/40B write `multi_query: true` (one K/V head) instead of a count.
    let multi_query = v.get("multi_query").and_then(Value::as_bool) == Some(true)
        && v.get("new_decoder_architecture").and_then(Value::as_bool) != Some(true);
    let kv_heads = get_u32(
        &v,
        name,
        &["num_key_value_heads", "n_kv_heads", "num_kv_heads"],
    )?
    .filter(|&k| k > 0)
    .unwrap_or(if multi_query { 1 } else { heads });
    let head_dim = get_u32(&v, name, &["head_dim", "d_kv"])?
        .filter(|&d| d > 0)
        .unwrap_or(hidden / heads);
    let gated = if is_t5 {
        v.get("feed_forward_proj")
            .and_then(Value::as_str)
            .is_some_and(|s| s.starts_with("gated"))
    } else {
        // plain two-matrix MLPs: GPT-2, GPT-NeoX (Pythia), Phi-1/2, Falcon
        !(is_enc
            || model_type.starts_with("gpt2")
            || matches!(
                model_type.as_str(),
                "gpt_neox" | "phi" | "falcon" | "gpt_bigcode"
            )
            || v.get("n_embd").is_some())
    };
    let intermediate = match get_u32(
        &v,
        name,
        &["intermediate_size", "n_inner", "d_ff", "ffn_dim"],
    )? {
        Some(i) if i > 0 => i,
        _ => 4 * hidden,
    };
    let vocab = need_u32(&v, name, &["vocab_size", "n_vocab", "padded_vocab_size"])?;
    let max_pos = get_u32(
        &v,
        name,
        &[
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "seq_length",
        ],
    )?
    .unwrap_or(0);
    let experts = get_u32(
        &v,
        name,
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )?
    .filter(|&e| e > 0)
    .unwrap_or(1);
    let experts_per_token = get_u32(&v, name, &["num_experts_per_tok", "top_k"])?
        .filter(|&e| e > 0)
        .unwrap_or(1)
        .min(experts);
    let tied = v
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        // transformers' PretrainedConfig default is True.
        .unwrap_or(true);
    if heads > hidden {
        return Err(bad(
            name,
            format!("{heads} attention heads for hidden size {hidden}"),
        ));
    }
    let kind = if is_t5 {
        ArchKind::EncoderDecoder
    } else if is_enc {
        ArchKind::EncoderOnly
    } else {
        ArchKind::DecoderOnly
    };
    let display = v
        .get("_name_or_path")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .unwrap_or(name)
        .to_string();
    let act = ["hidden_act", "activation_function", "hidden_activation"]
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_str))
        .unwrap_or("");
    let cap = |k: &str| v.get(k).and_then(Value::as_f64).is_some_and(|c| c > 0.0);
    let flag = |k: &str| v.get(k).and_then(Value::as_bool);
    // A dropout probability of 0 (`F.dropout` then returns its input and
    // keeps no mask). A key the file leaves out takes the config class's
    // default: 0.0 for GPT-NeoX, Phi and Falcon, 0.1 for GPT-2, BERT and
    // DistilBERT (their `*Config.__init__` defaults). Gated (Llama-family)
    // blocks have no dropout at all; the flags describe classic blocks.
    let class_default_off = matches!(model_type.as_str(), "gpt_neox" | "phi" | "falcon");
    let dropout_off = |keys: &[&str]| {
        !gated
            && match keys.iter().find_map(|k| v.get(*k).and_then(Value::as_f64)) {
                Some(p) => p <= 0.0,
                None => class_default_off,
            }
    };
    let quirks = ArchQuirks {
        composite_gelu: matches!(act, "gelu_new" | "gelu_fast"),
        sandwich_norms: matches!(model_type.as_str(), "gemma2" | "gemma3" | "gemma3_text"),
        norm_scale_fp32: matches!(
            model_type.as_str(),
            "gemma" | "gemma2" | "gemma3" | "gemma3_text"
        ),
        attn_softcapping: cap("attn_logit_softcapping"),
        final_softcapping: cap("final_logit_softcapping"),
        sdpa_math_fallback: model_type == "falcon" && kv_heads < heads && kv_heads == 1,
        attn_softmax_16bit: model_type == "falcon",
        attn_softmax_no_upcast: matches!(
            model_type.as_str(),
            "bert" | "distilbert" | "roberta" | "gpt2"
        ),
        fused_qkv: matches!(
            model_type.as_str(),
            "gpt_neox" | "phi3" | "gpt2" | "falcon" | "gpt_bigcode" | "bloom"
        ),
        parallel_residual: match model_type.as_str() {
            // transformers' GPTNeoXConfig / FalconConfig defaults are True
            "gpt_neox" => flag("use_parallel_residual").unwrap_or(true),
            "falcon" => flag("parallel_attn").unwrap_or(true),
            "phi" => true,
            _ => false,
        },
        // transformers' config defaults: GPT-NeoX rotary_pct 0.25, Phi 0.5,
        // StableLM 0.25
        partial_rotary: match model_type.as_str() {
            "gpt_neox" => v.get("rotary_pct").and_then(Value::as_f64).unwrap_or(0.25) < 1.0,
            "phi" | "stablelm" => {
                v.get("partial_rotary_factor")
                    .and_then(Value::as_f64)
                    .unwrap_or(if model_type == "phi" { 0.5 } else { 0.25 })
                    < 1.0
            }
            _ => false,
        },
        rotary_in_value_dtype: model_type == "falcon",
        fused_gate_up: model_type == "phi3",
        one_resid_dropout: model_type == "distilbert",
        unrotated_qkv_views: model_type == "gpt2",
        single_norm: model_type == "phi"
            || (model_type == "falcon" && !flag("new_decoder_architecture").unwrap_or(false)),
        no_resid_dropout: dropout_off(&[
            "hidden_dropout",
            "resid_pdrop",
            "hidden_dropout_prob",
            "dropout",
        ]),
        no_attn_dropout: dropout_off(&[
            "attention_dropout",
            "attn_pdrop",
            "attention_probs_dropout_prob",
        ]),
        sliding_window: sliding_window(&v, &model_type),
        alternating_sliding_window: model_type == "gemma2",
    };
    let mut arch = ModelArch {
        name: display,
        kind,
        params: 0,
        hidden_size: hidden,
        num_layers: layers,
        num_attention_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        intermediate_size: intermediate,
        vocab_size: vocab,
        tied_embeddings: tied,
        gated_mlp: gated,
        num_experts: experts,
        experts_per_token,
        max_position_embeddings: max_pos,
        quirks,
    };
    arch.params = count_params(&arch);
    Ok(arch)
}

/// Falcon-7B as the measured rows built it (bench/data/configs): one shared
/// K/V head, transformers' SDPA on PyTorch's math kernel. For tests.
#[cfg(test)]
pub(crate) fn falcon_7b_measured() -> ModelArch {
    arch_from_hf_config(
        "tiiuae__falcon-7b.json",
        include_str!("../../../../bench/data/configs/tiiuae__falcon-7b.json"),
    )
    .expect("the repository's Falcon-7B config.json")
}

/// Every model in the catalog.
pub fn all_models() -> Vec<ModelArch> {
    index().archs.clone()
}

/// Other names a catalog model answers to (short ids, instruct variants),
/// and its torchtune family/size when torchtune ships it.
pub fn aliases(id: &str) -> Vec<String> {
    ROWS.iter()
        .find(|r| r.names[0] == id)
        .map(|r| {
            let mut v: Vec<String> = r.names[1..].iter().map(|s| s.to_string()).collect();
            if let Some((f, s)) = r.torchtune {
                v.push(format!(
                    "{f}/{}",
                    if s == "mini" {
                        s.to_string()
                    } else {
                        s.to_ascii_uppercase()
                    }
                ));
            }
            v
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_totals_agree_with_the_shape_numbers() {
        for a in all_models() {
            let c = count_params(&a) as f64;
            let rel = (c - a.params as f64).abs() / a.params as f64;
            assert!(rel < 0.02, "{}: counted {c}, catalog {}", a.name, a.params);
        }
    }

    #[test]
    fn hugging_face_and_short_ids_resolve_to_the_same_model() {
        let a = lookup_model("meta-llama/Llama-3.1-8B").unwrap();
        let b = lookup_model("llama-3.1-8b").unwrap();
        let c = lookup_model("Llama-3.1-8B-Instruct").unwrap();
        assert_eq!(a.arch, b.arch);
        assert_eq!(a.arch, c.arch);
        assert_eq!(a.arch.hidden_size, 4096);
        assert_eq!(a.method, None);
    }

    #[test]
    fn torchtune_config_names_imply_the_method() {
        let r = lookup_model("llama3_1/8B_lora_single_device").unwrap();
        assert_eq!(r.arch.name, "meta-llama/Llama-3.1-8B");
        assert_eq!(r.method, Some(Method::Lora));
        let q = lookup_model("llama3/8B_qlora_single_device").unwrap();
        assert_eq!(q.method, Some(Method::Qlora));
        let f = lookup_model("qwen2_5/0.5B_full").unwrap();
        assert_eq!(f.arch.hidden_size, 896);
        assert_eq!(f.method, Some(Method::Full));
    }

    #[test]
    fn torchtune_component_paths_resolve_with_their_method() {
        let r = lookup_model("torchtune.models.llama3_1.lora_llama3_1_8b").unwrap();
        assert_eq!(r.arch.name, "meta-llama/Llama-3.1-8B");
        assert_eq!(r.method, Some(Method::Lora));
        let q = lookup_model("torchtune.models.llama2.qlora_llama2_7b").unwrap();
        assert_eq!(q.arch.hidden_size, 4096);
        assert_eq!(q.method, Some(Method::Qlora));
        let f = lookup_model("torchtune.models.qwen2_5.qwen2_5_0_5b").unwrap();
        assert_eq!(f.arch.hidden_size, 896);
        assert_eq!(f.method, Some(Method::Full));
    }

    #[test]
    fn mixtral_counts_every_expert() {
        let m = lookup_model("mixtral-8x7b").unwrap().arch;
        assert_eq!((m.num_experts, m.experts_per_token), (8, 2));
        assert!(m.params > 46_000_000_000);
    }

    #[test]
    fn unknown_model_lists_close_matches() {
        let Err(e) = lookup_model("llama-3.1-9b") else {
            panic!("unknown model must be an error");
        };
        assert!(e.to_string().contains("meta-llama/Llama-3.1-8B"), "{e}");
    }

    #[test]
    fn hf_config_json_is_parsed_into_an_architecture() {
        let json = r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,
            "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,
            "vocab_size":128256,"tie_word_embeddings":false,"max_position_embeddings":131072}"#;
        let a = arch_from_hf_config("config.json", json).unwrap();
        let cat = lookup_model("llama-3.1-8b").unwrap().arch;
        assert_eq!(a.head_dim, 128);
        let rel = (a.params as f64 - cat.params as f64).abs() / cat.params as f64;
        assert!(rel < 0.01, "{} vs {}", a.params, cat.params);
    }

    #[test]
    fn gpt2_style_config_is_parsed() {
        let json = r#"{"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"vocab_size":50257}"#;
        let a = arch_from_hf_config("gpt2.json", json).unwrap();
        assert!(!a.gated_mlp);
        assert_eq!(a.intermediate_size, 3072);
        assert!((a.params as f64 / 124_439_808.0 - 1.0).abs() < 0.02);
    }

    #[test]
    fn the_catalogs_falcon_is_its_config_json() {
        let catalog = lookup_model("tiiuae/falcon-7b").unwrap().arch;
        let parsed = falcon_7b_measured();
        assert_eq!(catalog.quirks, parsed.quirks);
        assert_eq!(
            ModelArch {
                name: parsed.name.clone(),
                params: parsed.params,
                ..catalog.clone()
            },
            parsed
        );
        // the published count against the shapes' (which give its GELU MLP
        // biases it does not have: 0.01 %); no position table (it rotates)
        let rel = (parsed.params as f64 - catalog.params as f64).abs() / catalog.params as f64;
        assert!(rel < 2e-4, "{} against {}", parsed.params, catalog.params);
    }

    #[test]
    fn family_details_come_from_config_json() {
        // Falcon-7B: one shared K/V head, GELU MLP, SDPA falls back to math.
        let falcon = arch_from_hf_config(
            "falcon.json",
            r#"{"model_type": "falcon", "hidden_size": 4544, "num_hidden_layers": 32,
                "num_attention_heads": 71, "multi_query": true, "vocab_size": 65024}"#,
        )
        .unwrap();
        assert_eq!(falcon.num_kv_heads, 1);
        assert!(!falcon.gated_mlp);
        assert!(falcon.quirks.sdpa_math_fallback);
        // Phi-2: plain MLP with the composite gelu_new.
        let phi = arch_from_hf_config(
            "phi.json",
            r#"{"model_type": "phi", "hidden_size": 2560, "num_hidden_layers": 32,
                "num_attention_heads": 32, "intermediate_size": 10240,
                "vocab_size": 51200, "hidden_act": "gelu_new"}"#,
        )
        .unwrap();
        assert!(!phi.gated_mlp && phi.quirks.composite_gelu);
        assert!(!phi.quirks.sdpa_math_fallback);
        // Gemma 2: four norms per block and both soft-caps, in the catalog too.
        let gemma = lookup_model("google/gemma-2-2b").unwrap().arch;
        assert!(gemma.quirks.sandwich_norms);
        assert!(gemma.quirks.attn_softcapping && gemma.quirks.final_softcapping);
        let llama = lookup_model("meta-llama/Llama-3.1-8B").unwrap().arch;
        assert_eq!(llama.quirks, ArchQuirks::default());
        // Counted block details (bench/data/saved_tensors.jsonl): Falcon's
        // rotary keeps the value's dtype; GPT-2's q, k, v are unrotated
        // views of c_attn's output; Phi-3 fuses gate and up; DistilBERT
        // drops one residual branch — from config.json and the catalog alike.
        assert!(falcon.quirks.rotary_in_value_dtype && !phi.quirks.rotary_in_value_dtype);
        assert!(phi.quirks.partial_rotary && !falcon.quirks.partial_rotary);
        let gpt2 = lookup_model("openai-community/gpt2").unwrap().arch;
        assert!(gpt2.quirks.unrotated_qkv_views && gpt2.quirks.fused_qkv);
        let phi3 = lookup_model("microsoft/Phi-3-mini-4k-instruct")
            .unwrap()
            .arch;
        assert!(phi3.quirks.fused_gate_up && !phi3.quirks.unrotated_qkv_views);
        let distil = arch_from_hf_config(
            "distilbert.json",
            r#"{"model_type": "distilbert", "dim": 768, "n_layers": 6, "n_heads": 12,
                "hidden_dim": 3072, "vocab_size": 30522}"#,
        )
        .unwrap();
        assert!(distil.quirks.one_resid_dropout && !gpt2.quirks.one_resid_dropout);
    }

    /// The attention window, as each config.json gives it or its config
    /// class defaults it: the catalog's published files and a file that
    /// leaves the key out read the same way.
    #[test]
    fn sliding_windows_come_from_config_json() {
        let window = |json: &str| arch_from_hf_config("c.json", json).unwrap().quirks;
        let base = r#""hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 14336, "vocab_size": 32000"#;
        // MistralConfig's default is 4,096; null is none
        assert_eq!(
            window(&format!(r#"{{"model_type": "mistral", {base}}}"#)).sliding_window,
            4096
        );
        assert_eq!(
            window(&format!(
                r#"{{"model_type": "mistral", "sliding_window": null, {base}}}"#
            ))
            .sliding_window,
            0
        );
        // Phi3Config's default is none; the published mini-4k file says 2,047
        assert_eq!(
            window(&format!(r#"{{"model_type": "phi3", {base}}}"#)).sliding_window,
            0
        );
        assert_eq!(
            window(&format!(
                r#"{{"model_type": "phi3", "sliding_window": 2047, {base}}}"#
            ))
            .sliding_window,
            2047
        );
        // Qwen2 files carry a window they do not use
        let qwen = format!(
            r#"{{"model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": false, {base}}}"#
        );
        assert_eq!(window(&qwen).sliding_window, 0);
        let gemma = window(&format!(
            r#"{{"model_type": "gemma2", "sliding_window": 4096, {base}}}"#
        ));
        assert!(gemma.sliding_window == 4096 && gemma.alternating_sliding_window);
        // the catalog: as the published files
        let q = |id: &str| lookup_model(id).unwrap().arch.quirks;
        assert_eq!(q("mistralai/Mistral-7B-v0.1").sliding_window, 4096);
        assert_eq!(q("mistralai/Mistral-7B-Instruct-v0.1").sliding_window, 4096);
        assert_eq!(q("mistralai/Mistral-7B-v0.3").sliding_window, 0);
        assert_eq!(q("microsoft/Phi-3-mini-4k-instruct").sliding_window, 2047);
        assert!(q("google/gemma-2-9b").alternating_sliding_window);
        assert_eq!(q("Qwen/Qwen2.5-7B").sliding_window, 0);
    }

    #[test]
    fn broken_config_json_is_a_clear_error() {
        assert!(matches!(
            arch_from_hf_config("c.json", "{not json"),
            Err(CatalogError::BadConfig { .. })
        ));
        let e = arch_from_hf_config("c.json", r#"{"hidden_size": 10}"#).unwrap_err();
        assert!(e.to_string().contains("num_hidden_layers"), "{e}");
        let e = arch_from_hf_config("c.json", r#"{"hidden_size": -3, "num_hidden_layers": 2}"#)
            .unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
    }
}
