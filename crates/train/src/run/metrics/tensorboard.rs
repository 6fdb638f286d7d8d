//! TensorBoard event files, written as a run goes (`runs/X/tb/`).
//!
//! An event file is a sequence of records, each `length: u64 LE`,
//! `masked_crc32c(length): u32 LE`, `data`, `masked_crc32c(data): u32 LE`,
//! where `data` is a protobuf `tensorflow.Event`. The messages below are the
//! few fields of TensorFlow's `event.proto`, `summary.proto` and
//! `tensor.proto` that scalars and text need, with their field numbers;
//! `prost` encodes them and `crc32c` frames them. The first event of a file
//! names the format (`brain.Event:2`), as TensorBoard expects.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;

use prost::Message;

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the Unix epoch when the event was written.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event holds.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// The payload of an [`Event`].
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The file's format, in its first event.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Summary values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// The values, one per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    /// The series' name (`train/loss`).
    #[prost(string, tag = "1")]
    pub tag: String,
    /// Which plugin shows it (text; scalars need none).
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
    /// The value.
    #[prost(oneof = "Content", tags = "2, 8")]
    pub content: Option<Content>,
}

/// The value of a [`Value`].
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Content {
    /// A scalar (TensorBoard's are `f32`).
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    /// A tensor: here, one string for the text plugin.
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    /// The plugin.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    /// `"text"`.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// The plugin's own settings (none).
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorflow.TensorProto`, for a string scalar.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `DT_STRING` (7).
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// The shape: a scalar (no dimensions).
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    /// The strings.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {}

const DT_STRING: i32 = 7;

/// TensorFlow's masked CRC32C of a record's parts.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An event file being written; every event is flushed to the file as it
/// is added, so a running TensorBoard sees it at once.
pub struct EventWriter {
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `path` and writes the format event.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        let mut writer = Self {
            file: BufWriter::new(crate::nofollow::create(path)?),
        };
        writer.write(&Event {
            wall_time: now(),
            step: 0,
            what: Some(What::FileVersion("brain.Event:2".into())),
        })?;
        Ok(writer)
    }

    /// One event at `step` with a scalar for each `(tag, value)`.
    pub fn scalars(&mut self, step: u64, values: &[(String, f64)]) -> std::io::Result<()> {
        let value = values
            .iter()
            .map(|(tag, v)| Value {
                tag: tag.clone(),
                metadata: None,
                content: Some(Content::SimpleValue(*v as f32)),
            })
            .collect();
        self.summary(step, Summary { value })
    }

    /// One event at `step` with `text` under `tag`, for the text plugin
    /// (which renders Markdown).
    pub fn text(&mut self, step: u64, tag: &str, text: &str) -> std::io::Result<()> {
        let value = Value {
            tag: tag.into(),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: vec![],
                }),
            }),
            content: Some(Content::Tensor(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            })),
        };
        self.summary(step, Summary { value: vec![value] })
    }

    fn summary(&mut self, step: u64, summary: Summary) -> std::io::Result<()> {
        self.write(&Event {
            wall_time: now(),
            step: step as i64,
            what: Some(What::Summary(summary)),
        })
    }

    fn write(&mut self, event: &Event) -> std::io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut record = Vec::with_capacity(data.len() + 16);
        record.extend_from_slice(&len);
        record.extend_from_slice(&masked_crc(&len).to_le_bytes());
        record.extend_from_slice(&data);
        record.extend_from_slice(&masked_crc(&data).to_le_bytes());
        self.file.write_all(&record)?;
        self.file.flush()
    }

    /// Flushes and syncs the file to disk.
    pub fn sync(&mut self) -> std::io::Result<()> {
        self.file.flush()?;
        self.file.get_ref().sync_all()
    }
}

/// Reads every complete event of an event file, checking both checksums of
/// each record; a record cut short at the end (a writer killed mid-write)
/// ends the list, as it does for TensorBoard.
pub fn read_events(path: &Path) -> std::io::Result<Vec<Event>> {
    let mut bytes = vec![];
    File::open(path)?.read_to_end(&mut bytes)?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut events = vec![];
    let mut rest = bytes.as_slice();
    while rest.len() >= 12 {
        let (len, tail) = rest.split_at(8);
        let n = u64::from_le_bytes(len.try_into().expect("8 bytes")) as usize;
        if u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) != masked_crc(len) {
            return Err(bad("a record's length fails its checksum"));
        }
        let tail = &tail[4..];
        if tail.len() < n + 4 {
            break;
        }
        let (data, tail) = tail.split_at(n);
        if u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) != masked_crc(data) {
            return Err(bad("a record's data fails its checksum"));
        }
        events.push(Event::decode(data).map_err(|_| bad("a record is not an Event"))?);
        rest = &tail[4..];
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_read_back_as_written_with_checked_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.out.tfevents.1.tvq");
        let mut w = EventWriter::create(&path).unwrap();
        w.scalars(3, &[("train/loss".into(), 2.5), ("train/lr".into(), 1e-4)])
            .unwrap();
        w.text(4, "samples", "    In the beginning").unwrap();
        drop(w);
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 3);
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let Some(What::Summary(s)) = &events[1].what else {
            panic!("a summary")
        };
        assert_eq!(events[1].step, 3);
        assert_eq!(s.value[1].tag, "train/lr");
        assert_eq!(s.value[1].content, Some(Content::SimpleValue(1e-4)));
        let Some(What::Summary(s)) = &events[2].what else {
            panic!("a summary")
        };
        let Some(Content::Tensor(t)) = &s.value[0].content else {
            panic!("a tensor")
        };
        assert_eq!(t.string_val, [b"    In the beginning".to_vec()]);

        // TensorBoard's own `masked_crc32c` (Python) gives these.
        assert_eq!(masked_crc(&0u64.to_le_bytes()), 0x0798_0329);
        assert_eq!(masked_crc(b"tvq"), 0x49bc_e590);

        // A flipped byte is caught; a cut record ends the list.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(read_events(&path).is_err());
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes[..n - 3]).unwrap();
        assert_eq!(read_events(&path).unwrap().len(), 2);
    }
}
