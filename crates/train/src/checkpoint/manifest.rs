//! `manifest.json`: every file of a checkpoint with its size and checksum,
//! written last, so that a checkpoint with a manifest is complete and one
//! whose files do not match it is damaged.
//!
//! Format 2 (this version):
//!
//! ```json
//! {"format": 2, "checksum": "xxh3-64",
//!  "files": {"model.safetensors": {"bytes": 133820, "xxh3": "d06ce165a7be2137"}, ...}}
//! ```
//!
//! Format 1 (burn records) was a bare map of the files, each with its
//! `bytes` and `fnv1a` (FNV-1a 64, hex); it is still read.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tvq_data::hash::fnv1a;

use super::tensor_file::{Written, hash_file};
use super::{bad, untrusted};
use crate::error::TrainError;

/// The checkpoint format this version writes.
pub const FORMAT: u32 = 2;

/// The files a checkpoint of each format must list.
fn required(format: u32) -> &'static [&'static str] {
    match format {
        1 => &[
            "model.bin",
            "optim-decay.bin",
            "optim-no-decay.bin",
            "state.safetensors",
            "trainer.json",
        ],
        _ => &[
            "model.safetensors",
            "optimizer.safetensors",
            "state.safetensors",
            "trainer.json",
        ],
    }
}

/// Whether a checkpoint of `format` may hold a file `name`: one it must
/// list, or format 1's optional Toeplitz moments.
fn known(format: u32, name: &str) -> bool {
    required(format).contains(&name) || (format == 1 && name == "optim-toeplitz.bin")
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    format: u32,
    checksum: String,
    files: BTreeMap<String, Entry>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    bytes: u64,
    xxh3: String,
}

/// The manifest of the `files` written (name, size and hash), as bytes.
pub(crate) fn to_bytes(files: &BTreeMap<&str, Written>) -> Vec<u8> {
    let manifest = Manifest {
        format: FORMAT,
        checksum: "xxh3-64".into(),
        files: files
            .iter()
            .map(|(name, w)| {
                let entry = Entry {
                    bytes: w.bytes,
                    xxh3: format!("{:016x}", w.xxh3),
                };
                (name.to_string(), entry)
            })
            .collect(),
    };
    serde_json::to_vec_pretty(&manifest).expect("serializable")
}

/// Checks every file of the checkpoint `dir` against its manifest; returns
/// the checkpoint's format.
///
/// The manifest is untrusted: each entry must name a file a checkpoint
/// holds (a plain name, so nothing outside `dir` is ever opened), that file
/// must be a regular file (not a link, not `/dev/zero`) of the size stated,
/// checked from its metadata before a byte of it is read.
pub(crate) fn verify(dir: &Path) -> Result<u32, TrainError> {
    let path = dir.join("manifest.json");
    let text = match untrusted::read_at_most(&path, untrusted::JSON_LIMIT) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad(dir, "no manifest.json (incomplete checkpoint)"));
        }
        other => other.map_err(|e| bad(dir, format!("manifest.json {e}")))?,
    };
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(dir, format!("manifest.json: {e}")))?;
    let (format, files) = match json.get("format") {
        Some(_) => {
            let m: Manifest = serde_json::from_value(json)
                .map_err(|e| bad(dir, format!("manifest.json: {e}")))?;
            if m.format != FORMAT {
                return Err(bad(
                    dir,
                    format!(
                        "checkpoint format {} is not one this tvq reads (1 and {FORMAT}); \
                         a newer tvq may read it",
                        m.format
                    ),
                ));
            }
            let files = m.files.into_iter().map(|(n, e)| (n, e.bytes, e.xxh3));
            (m.format, files.collect::<Vec<_>>())
        }
        None => {
            let m: BTreeMap<String, serde_json::Value> = serde_json::from_value(json)
                .map_err(|e| bad(dir, format!("manifest.json: {e}")))?;
            let files = m.into_iter().map(|(n, e)| {
                let bytes = e["bytes"].as_u64().unwrap_or(u64::MAX);
                (
                    n,
                    bytes,
                    e["fnv1a"].as_str().unwrap_or_default().to_string(),
                )
            });
            (1, files.collect())
        }
    };
    for (name, ..) in &files {
        if !known(format, name) {
            return Err(bad(
                dir,
                format!("manifest.json lists {name:?}, which is not a file of a checkpoint"),
            ));
        }
    }
    for name in required(format) {
        if !files.iter().any(|(n, ..)| n == name) {
            return Err(bad(dir, format!("manifest lacks {name}")));
        }
    }
    for (name, bytes, want) in files {
        let path = dir.join(&name);
        let unfit = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::NotFound => bad(dir, format!("{name} is missing")),
            _ => bad(dir, format!("{name} {e}")),
        };
        let len = untrusted::regular_file_len(&path).map_err(unfit)?;
        if len != bytes {
            return Err(bad(
                dir,
                format!("{name} holds {len} bytes, its manifest says {bytes}"),
            ));
        }
        let got = if format == 1 {
            let data = untrusted::read_exactly(&path, bytes).map_err(unfit)?;
            format!("{:016x}", fnv1a(&data))
        } else {
            format!("{:016x}", hash_file(&path).map_err(unfit)?.xxh3)
        };
        if got != want {
            return Err(bad(dir, format!("{name} does not match its checksum")));
        }
    }
    Ok(format)
}
