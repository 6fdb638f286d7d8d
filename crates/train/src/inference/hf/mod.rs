//! Hugging Face folders: a tvq model as `transformers` loads it, and back.
//!
//! [`export_hf`] writes a folder that
//! `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and
//! `AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)` load
//! without a network:
//!
//! | file | what |
//! |---|---|
//! | `model.safetensors` | the weights and codebooks, tvq's names and layouts (as `tvq export` writes them) |
//! | `config.json` | the model's `[model]` settings under tvq's names, `auto_map`, the special ids |
//! | `configuration_tvq.py`, `modeling_tvq.py` | the model in PyTorch, written here (`hf/*.py`) |
//! | `tokenizer.json`, `tokenizer_config.json` | the vocabulary ([`Vocab::tokenizer_json`]) |
//!
//! [`import_hf`] reads such a folder back (one written by tvq, or changed
//! and saved again by `transformers`) under the rules of any untrusted
//! file: the config's size is bounded, its settings validated, and the
//! weights' names, types and shapes checked before use.

use std::path::Path;

use serde_json::{Map, Value, json};
use tvq_data::Vocab;
use tvq_model::{AttentionForm, CountWeight, RelativeBias, TransformerVqConfig, WindowKeys};

use crate::checkpoint::{self, tensor_file, untrusted};
use crate::error::TrainError;
use crate::inference::export::ExportInfo;
use crate::nofollow;
use crate::placement::Model;

/// The model file `transformers` runs (remote code).
const MODELING: &str = include_str!("modeling_tvq.py");
/// Its configuration class.
const CONFIGURATION: &str = include_str!("configuration_tvq.py");

pub use crate::checkpoint::{HF_CONFIG as CONFIG, HF_WEIGHTS as WEIGHTS};
/// The tokenizer's file in a folder.
pub const TOKENIZER: &str = "tokenizer.json";

/// Writes `model` into the folder `dir` (created if missing; tvq's files
/// in it replaced), as the module documentation lists. Refused for the
/// settings the PyTorch model does not compute: the rotary position and
/// the quadratic form.
pub fn export_hf(
    model: &Model,
    info: &ExportInfo,
    vocab: &Vocab,
    dir: &Path,
) -> Result<(), TrainError> {
    let cfg = &info.model;
    let unsupported = |key: &str, value: &str| TrainError::Config {
        key: format!("model.{key}"),
        reason: format!(
            "is {value}: the Hugging Face model computes VQ attention with the toeplitz or xl bias"
        ),
    };
    if cfg.bias == RelativeBias::Rotary {
        return Err(unsupported("bias", "\"rotary\""));
    }
    if cfg.attention == AttentionForm::Quadratic {
        return Err(unsupported("attention", "\"quadratic\""));
    }
    std::fs::create_dir_all(dir).map_err(|e| TrainError::io(dir, e))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        nofollow::write(&path, bytes).map_err(|e| TrainError::io(&path, e))
    };
    let mut meta = checkpoint::weights_metadata(info.step);
    // What `transformers`' safetensors writer puts there (older readers ask for it).
    meta.insert("format".into(), "pt".into());
    let weights = dir.join(WEIGHTS);
    nofollow::create(&weights)
        .and_then(|file| tensor_file::write(file, &meta, checkpoint::model_tensors(model)))
        .map_err(|e| TrainError::io(&weights, e))?;
    write(CONFIG, &pretty(&config_json(info, vocab)))?;
    write("configuration_tvq.py", CONFIGURATION.as_bytes())?;
    write("modeling_tvq.py", MODELING.as_bytes())?;
    write(TOKENIZER, vocab.tokenizer_json()?.as_bytes())?;
    let eos = vocab.eos_name();
    let mut tokenizer_config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        // tvq starts every stream after the end-of-document token, which
        // tokenizer.json's post-processor puts before a text.
        "bos_token": eos,
        "eos_token": eos,
        // A special token's name in a text is text, as tvq reads it.
        "split_special_tokens": true,
        "model_max_length": 1u64 << 40,
    });
    if matches!(vocab, Vocab::Bytes) {
        tokenizer_config["pad_token"] = json!("<pad>");
    }
    write("tokenizer_config.json", &pretty(&tokenizer_config))
}

/// `config.json`: every setting of the model under tvq's names, and what
/// `transformers` needs to find the classes and the special tokens.
fn config_json(info: &ExportInfo, vocab: &Vocab) -> Value {
    let mut out = match serde_json::to_value(&info.model) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    let eos = vocab.eos();
    let hf = json!({
        "architectures": ["TvqForCausalLM"],
        "model_type": "tvq",
        "auto_map": {
            "AutoConfig": "configuration_tvq.TvqConfig",
            "AutoModelForCausalLM": "modeling_tvq.TvqForCausalLM",
        },
        "dtype": "float32",
        "bos_token_id": eos,
        "eos_token_id": eos,
        "pad_token_id": tvq_data::vocab::PAD,
        "tvq_vocab": vocab.id(),
        "tvq_step": info.step,
    });
    if let Value::Object(hf) = hf {
        out.extend(hf);
    }
    Value::Object(out)
}

fn pretty(value: &Value) -> Vec<u8> {
    serde_json::to_vec_pretty(value).expect("a JSON value serializes")
}

/// Reads the folder `dir` (written by [`export_hf`], or saved again by
/// `transformers`) into a model on `device` and the [`ExportInfo`] an
/// export of it carries.
pub fn import_hf(
    dir: &Path,
    device: &burn::DispatchDevice,
) -> Result<(ExportInfo, Model), TrainError> {
    let path = dir.join(CONFIG);
    let bad = |reason: String| TrainError::Import {
        path: path.clone(),
        reason,
    };
    let text = untrusted::read_at_most(&path, untrusted::JSON_LIMIT)
        .map_err(|e| TrainError::io(&path, e))?;
    let json: Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    let Value::Object(json) = json else {
        return Err(bad("not a JSON object".into()));
    };
    if json.get("model_type").and_then(Value::as_str) != Some("tvq") {
        return Err(bad(
            "its model_type is not \"tvq\": not a folder of `tvq export --format hf`".into(),
        ));
    }
    let model: TransformerVqConfig = serde_json::from_value(Value::Object(model_settings(&json)))
        .map_err(|e| bad(e.to_string()))?;
    model.validate().map_err(|e| bad(e.to_string()))?;
    let vocab_id = json.get("tvq_vocab").and_then(Value::as_str);
    let (vocab, tokenizer) = if vocab_id == Some("bytes+3") {
        (Vocab::Bytes, None)
    } else {
        let file = dir.join(TOKENIZER);
        let file = std::fs::canonicalize(&file).map_err(|e| TrainError::io(&file, e))?;
        (Vocab::load_tokenizer(&file)?, Some(file))
    };
    if vocab.size() > model.vocab_size {
        return Err(bad(format!(
            "its vocabulary has {} tokens, more than the model's {}",
            vocab.size(),
            model.vocab_size
        )));
    }
    let weights = dir.join(WEIGHTS);
    let net = checkpoint::model_of_file(&weights, &model, device)?;
    let info = ExportInfo {
        format: "tvq".into(),
        model,
        vocab: vocab.id(),
        tokenizer,
        step: json.get("tvq_step").and_then(Value::as_u64).unwrap_or(0),
    };
    Ok((info, net))
}

/// The keys of `config.json` that are settings of the model: those a
/// config with every optional setting given serializes (`transformers`
/// adds its own keys beside them, and writes an absent setting as null).
fn model_settings(json: &Map<String, Value>) -> Map<String, Value> {
    let every = TransformerVqConfig {
        vocab_size: 1,
        rotary_channel: Some(0),
        cache_limit: Some(1),
        code_limit: Some(1),
        count_weight: CountWeight::Learned,
        window_keys: WindowKeys::Exact,
        ..TransformerVqConfig::default()
    };
    let Ok(Value::Object(keys)) = serde_json::to_value(every) else {
        return Map::new();
    };
    json.iter()
        .filter(|(key, _)| keys.contains_key(*key))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}
