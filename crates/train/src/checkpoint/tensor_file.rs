//! Safetensors files written byte for byte the same for the same tensors.
//!
//! The `safetensors` crate keeps a file's metadata in a `HashMap`, so two
//! files of the same tensors and metadata can differ in the order of the
//! header's keys. Checkpoints must not: the same run writes the same bytes.
//! This writer lays a file out as the format says (an 8-byte little-endian
//! header length, a JSON header padded with spaces to a multiple of 8, the
//! tensors' bytes back to back) with the metadata's keys and the tensors in
//! name order, and hashes the bytes as it writes them, so a checkpoint's
//! manifest needs no second read. Any safetensors reader reads the files.

use std::collections::BTreeMap;
use std::io::{BufWriter, Write};
use std::path::Path;

use xxhash_rust::xxh3::Xxh3Default;

/// A float32 tensor to write: its values are produced only when written,
/// so that a file larger than memory's spare room can be streamed.
pub(crate) struct F32Tensor {
    /// Name in the file.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Produces the `shape.product()` values, row-major.
    pub values: Box<dyn FnOnce() -> Vec<f32>>,
}

/// Size and xxh3-64 of a written file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Written {
    /// Bytes in the file.
    pub bytes: u64,
    /// xxh3-64 of those bytes.
    pub xxh3: u64,
}

/// A writer that hashes what passes through it.
struct Hashing<W> {
    inner: W,
    hash: Xxh3Default,
    bytes: u64,
}

impl<W: Write> Hashing<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.hash.update(bytes);
        self.bytes += bytes.len() as u64;
        self.inner.write_all(bytes)
    }
}

/// The header of a file of `tensors` (sorted by name) with `metadata`.
fn header(metadata: &BTreeMap<String, String>, tensors: &[F32Tensor]) -> Vec<u8> {
    let mut json = String::from("{");
    let mut entries = vec![];
    if !metadata.is_empty() {
        // A BTreeMap serializes in key order.
        entries.push(format!(
            "\"__metadata__\":{}",
            serde_json::to_string(metadata).expect("strings serialize")
        ));
    }
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + 4 * t.shape.iter().product::<usize>();
        entries.push(format!(
            "{}:{{\"dtype\":\"F32\",\"shape\":{},\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name).expect("strings serialize"),
            serde_json::to_string(&t.shape).expect("numbers serialize"),
        ));
        offset = end;
    }
    json += &entries.join(",");
    json.push('}');
    let mut bytes = json.into_bytes();
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    bytes
}

/// Writes `tensors` and `metadata` as a safetensors file into `file`, syncs
/// it to disk, and returns its size and hash. Two calls with the same
/// names, shapes, values and metadata write the same bytes, whatever the
/// order of `tensors`.
pub(crate) fn write(
    file: std::fs::File,
    metadata: &BTreeMap<String, String>,
    tensors: Vec<F32Tensor>,
) -> std::io::Result<Written> {
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let written = write_to(&mut out, metadata, tensors)?;
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    Ok(written)
}

/// The safetensors bytes of `tensors` and `metadata` (as [`write`]).
pub(crate) fn to_bytes(
    metadata: &BTreeMap<String, String>,
    tensors: Vec<F32Tensor>,
) -> std::io::Result<Vec<u8>> {
    let mut out = vec![];
    write_to(&mut out, metadata, tensors)?;
    Ok(out)
}

/// The checksum of checkpoint files (format 2): xxh3-64.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Writes `bytes` to `path` (a checkpoint's file: no link followed) and
/// syncs it; returns their size and hash.
pub(crate) fn write_bytes(path: &Path, bytes: &[u8]) -> std::io::Result<Written> {
    crate::nofollow::write(path, bytes)?;
    Ok(Written {
        bytes: bytes.len() as u64,
        xxh3: checksum(bytes),
    })
}

fn write_to(
    out: &mut impl Write,
    metadata: &BTreeMap<String, String>,
    mut tensors: Vec<F32Tensor>,
) -> std::io::Result<Written> {
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
        return Err(std::io::Error::other(format!(
            "two tensors named {}",
            w[0].name
        )));
    }
    let header = header(metadata, &tensors);
    let mut out = Hashing {
        inner: out,
        hash: Xxh3Default::new(),
        bytes: 0,
    };
    out.put(&(header.len() as u64).to_le_bytes())?;
    out.put(&header)?;
    let mut chunk = Vec::with_capacity(1 << 16);
    for t in tensors {
        let len = t.shape.iter().product::<usize>();
        let values = (t.values)();
        if values.len() != len {
            return Err(std::io::Error::other(format!(
                "{} has {} values for shape {:?}",
                t.name,
                values.len(),
                t.shape
            )));
        }
        for part in values.chunks(1 << 14) {
            chunk.clear();
            chunk.extend(part.iter().flat_map(|x| x.to_le_bytes()));
            out.put(&chunk)?;
        }
    }
    Ok(Written {
        bytes: out.bytes,
        xxh3: out.hash.digest(),
    })
}

/// Size and xxh3-64 of the file at `path`, read in pieces.
pub(crate) fn hash_file(path: &Path) -> std::io::Result<Written> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut hash = Xxh3Default::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        bytes += n as u64;
    }
    Ok(Written {
        bytes,
        xxh3: hash.digest(),
    })
}

/// The values of a float32 safetensors tensor (little-endian on disk).
pub(crate) fn f32_values(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A safetensors file whose tensors are all F32: `bytes` itself when they
/// already are, else the file written again with its F16 and BF16 tensors
/// widened to F32 (every such value is exactly an F32). Any other type is
/// an error naming the first such tensor.
pub(crate) fn widened_to_f32(bytes: Vec<u8>) -> Result<Vec<u8>, String> {
    use safetensors::{Dtype, SafeTensors, tensor::TensorView};
    let file = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let mut tensors = file.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    if let Some((name, view)) = tensors
        .iter()
        .find(|(_, v)| !matches!(v.dtype(), Dtype::F32 | Dtype::F16 | Dtype::BF16))
    {
        return Err(format!(
            "tensor {name} is stored as {:?}; tvq reads F32 (or F16 and BF16, widened)",
            view.dtype()
        ));
    }
    if tensors.iter().all(|(_, v)| v.dtype() == Dtype::F32) {
        return Ok(bytes);
    }
    let widened: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, v)| {
            let halves = v
                .data()
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]));
            let data: Vec<u8> = match v.dtype() {
                Dtype::F32 => v.data().to_vec(),
                Dtype::BF16 => halves
                    .flat_map(|h| half::bf16::from_bits(h).to_f32().to_le_bytes())
                    .collect(),
                _ => halves
                    .flat_map(|h| half::f16::from_bits(h).to_f32().to_le_bytes())
                    .collect(),
            };
            (name.clone(), v.shape().to_vec(), data)
        })
        .collect();
    let views = widened
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| e.to_string())?;
    safetensors::serialize(views, header.metadata().clone()).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::{Dtype, SafeTensors};

    fn tensor(name: &str, shape: &[usize], start: f32) -> F32Tensor {
        let n: usize = shape.iter().product();
        F32Tensor {
            name: name.into(),
            shape: shape.to_vec(),
            values: Box::new(move || (0..n).map(|i| start + i as f32).collect()),
        }
    }

    /// An all-F32 file passes as it is; F16 and BF16 tensors come back as
    /// the F32 values they stand for, exactly, with the metadata kept.
    #[test]
    fn half_precision_tensors_widen_exactly_and_f32_files_pass_unchanged() {
        use safetensors::tensor::TensorView;
        let f32_file = safetensors::serialize(
            [(
                "a",
                TensorView::new(Dtype::F32, vec![1], &1.5f32.to_le_bytes()).unwrap(),
            )],
            None,
        )
        .unwrap();
        assert_eq!(widened_to_f32(f32_file.clone()).unwrap(), f32_file);
        let values = [1.0f32, -2.5, 0.0078125, 384.0]; // exact in both types
        let as_f16: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let as_bf16: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect();
        let meta = Some(std::collections::HashMap::from([(
            "k".to_string(),
            "v".to_string(),
        )]));
        let mixed = safetensors::serialize(
            [
                (
                    "h",
                    TensorView::new(Dtype::F16, vec![2, 2], &as_f16).unwrap(),
                ),
                (
                    "b",
                    TensorView::new(Dtype::BF16, vec![4], &as_bf16).unwrap(),
                ),
            ],
            meta.clone(),
        )
        .unwrap();
        let widened = widened_to_f32(mixed).unwrap();
        let file = SafeTensors::deserialize(&widened).unwrap();
        for name in ["h", "b"] {
            let t = file.tensor(name).unwrap();
            assert_eq!(t.dtype(), Dtype::F32);
            assert_eq!(f32_values(&t), values, "{name}");
        }
        assert_eq!(file.tensor("h").unwrap().shape(), [2, 2]);
        let (_, header) = SafeTensors::read_metadata(&widened).unwrap();
        assert_eq!(header.metadata(), &meta);
    }

    /// The safetensors crate reads what this writer wrote; the bytes do not
    /// depend on the order the tensors or metadata came in; the returned
    /// hash is the file's.
    #[test]
    fn files_read_back_and_the_same_tensors_give_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let meta = |keys: &[&str]| -> BTreeMap<String, String> {
            keys.iter()
                .map(|k| (k.to_string(), format!("v-{k}")))
                .collect()
        };
        let a = dir.path().join("a.safetensors");
        let b = dir.path().join("b.safetensors");
        let keys = ["z", "a", "m", "b", "q", "c", "x", "d"];
        let wa = write(
            std::fs::File::create(&a).unwrap(),
            &meta(&keys),
            vec![
                tensor("w.2", &[2, 3], 0.0),
                tensor("b", &[5], 10.0),
                tensor("s", &[], 7.0),
            ],
        )
        .unwrap();
        let mut reversed = keys;
        reversed.reverse();
        write(
            std::fs::File::create(&b).unwrap(),
            &meta(&reversed),
            vec![
                tensor("s", &[], 7.0),
                tensor("b", &[5], 10.0),
                tensor("w.2", &[2, 3], 0.0),
            ],
        )
        .unwrap();
        let bytes = std::fs::read(&a).unwrap();
        assert_eq!(bytes, std::fs::read(&b).unwrap());
        assert_eq!(wa, hash_file(&a).unwrap());
        assert_eq!(wa.bytes, bytes.len() as u64);
        assert_eq!(wa.xxh3, xxhash_rust::xxh3::xxh3_64(&bytes));

        let file = SafeTensors::deserialize(&bytes).unwrap();
        let w = file.tensor("w.2").unwrap();
        assert_eq!((w.dtype(), w.shape()), (Dtype::F32, &[2, 3][..]));
        assert_eq!(f32_values(&w), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(f32_values(&file.tensor("s").unwrap()), [7.0]);
        assert_eq!(f32_values(&file.tensor("b").unwrap())[4], 14.0);
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(header.metadata().as_ref().unwrap()["q"], "v-q");
    }

    #[test]
    fn a_wrong_value_count_or_a_repeated_name_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let short = F32Tensor {
            name: "t".into(),
            shape: vec![3],
            values: Box::new(|| vec![1.0]),
        };
        let err = write(
            std::fs::File::create(&path).unwrap(),
            &BTreeMap::new(),
            vec![short],
        )
        .unwrap_err();
        assert!(err.to_string().contains("1 values"), "{err}");
        let twice = vec![tensor("t", &[1], 0.0), tensor("t", &[1], 0.0)];
        let err = write(
            std::fs::File::create(&path).unwrap(),
            &BTreeMap::new(),
            twice,
        )
        .unwrap_err();
        assert!(err.to_string().contains("two tensors named t"), "{err}");
    }
}
