//! Memory-mapped token arrays, and the cache file that holds a corpus once
//! it has been turned into tokens.
//!
//! Cache layout (little endian): magic `TVQTOKS\0`, format version `u32`,
//! bytes per token `u32` (1: raw bytes, token = byte + 3; 2 or 4: token ids),
//! token count `u64`, fingerprint length `u32`, info length `u32`, the
//! fingerprint (JSON describing the source and tokenizer), the info (JSON
//! statistics of the text); zero padding to a 64-byte boundary; the tokens.
//! A cache whose fingerprint differs from the corpus's is stale and rebuilt;
//! one that cannot be parsed is an error. Caches are written to a temporary
//! file that is renamed into place only once complete.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::DataError;
use crate::vocab::N_SPECIAL;

const MAGIC: &[u8; 8] = b"TVQTOKS\0";
const VERSION: u32 = 1;
const ALIGN: usize = 64;

/// A read-only array of tokens backed by a memory map.
#[derive(Clone, Debug)]
pub struct MappedTokens {
    map: Arc<Backing>,
    offset: usize,
    width: usize,
    len: usize,
}

/// What a token array reads from: a file's memory map, or bytes made in
/// memory (synthetic tasks).
#[derive(Debug)]
enum Backing {
    Map(Mmap),
    Memory(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Map(map) => map,
            Self::Memory(bytes) => bytes,
        }
    }
}

impl MappedTokens {
    /// Byte-level tokens made in memory (token = byte + 3).
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        Self {
            len: bytes.len(),
            map: Arc::new(Backing::Memory(bytes)),
            offset: 0,
            width: 1,
        }
    }

    /// Token ids made in memory, 4 bytes each.
    pub fn from_ids(ids: &[u32]) -> Self {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        Self {
            len: ids.len(),
            map: Arc::new(Backing::Memory(bytes)),
            offset: 0,
            width: 4,
        }
    }

    /// Maps a raw file whose bytes are the tokens (token = byte + 3).
    pub fn raw_bytes(path: &Path) -> Result<Self, DataError> {
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let len = file.metadata().map_err(|e| DataError::io(path, e))?.len() as usize;
        if len == 0 {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
            });
        }
        // SAFETY: the corpus is opened read-only; tvq never writes to it while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
        Ok(Self {
            map: Arc::new(Backing::Map(map)),
            offset: 0,
            width: 1,
            len,
        })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The largest token id (`None` when empty), in one pass over the map.
    pub fn max(&self) -> Option<u32> {
        let bytes = &self.map[self.offset..self.offset + self.len * self.width];
        match self.width {
            1 => bytes.iter().max().map(|&b| b as u32 + N_SPECIAL),
            2 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                .max(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .max(),
        }
    }

    /// Token `i`.
    pub fn get(&self, i: usize) -> u32 {
        let at = self.offset + i * self.width;
        let b = &self.map[at..at + self.width];
        match self.width {
            1 => b[0] as u32 + N_SPECIAL,
            2 => u16::from_le_bytes([b[0], b[1]]) as u32,
            _ => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        }
    }
}

/// Writes tokens of the given width to a cache, atomically.
pub struct CacheWriter {
    tmp: PathBuf,
    path: PathBuf,
    out: Option<BufWriter<File>>,
    width: usize,
    count: u64,
}

/// Fixed part of the header: magic, version, width, count, two lengths.
const FIXED: usize = 8 + 4 + 4 + 8 + 4 + 4;

fn header(fingerprint: &str, info: &str, width: usize, count: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(ALIGN);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&(width as u32).to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&(fingerprint.len() as u32).to_le_bytes());
    h.extend_from_slice(&(info.len() as u32).to_le_bytes());
    h.extend_from_slice(fingerprint.as_bytes());
    h.extend_from_slice(info.as_bytes());
    h.resize(h.len().div_ceil(ALIGN) * ALIGN, 0);
    h
}

impl CacheWriter {
    /// Starts a cache at `path` (written to a temporary file beside it).
    pub fn create(path: &Path, fingerprint: &str, width: usize) -> Result<Self, DataError> {
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let file = File::create(&tmp).map_err(|e| DataError::io(&tmp, e))?;
        let out = BufWriter::with_capacity(1 << 20, file);
        // The header (with the count and the statistics) is written at the end.
        let _ = fingerprint;
        Ok(Self {
            tmp,
            path: path.to_path_buf(),
            out: Some(out),
            width,
            count: 0,
        })
    }

    /// Appends one token.
    pub fn push(&mut self, token: u32) -> Result<(), DataError> {
        let bytes = token.to_le_bytes();
        let out = self.out.as_mut().expect("writer is open until finish");
        let fits = match self.width {
            1 => (N_SPECIAL..N_SPECIAL + 256).contains(&token),
            2 => token <= u32::from(u16::MAX),
            _ => true,
        };
        if !fits {
            return Err(DataError::BadCache {
                path: self.path.clone(),
                reason: format!(
                    "token id {token} does not fit its {}-byte width",
                    self.width
                ),
            });
        }
        let r = match self.width {
            1 => out.write_all(&[(token - N_SPECIAL) as u8]),
            2 => out.write_all(&bytes[..2]),
            _ => out.write_all(&bytes),
        };
        self.count += 1;
        r.map_err(|e| DataError::io(&self.tmp, e))
    }

    /// Appends raw bytes (width 1 only).
    pub fn push_raw(&mut self, bytes: &[u8]) -> Result<(), DataError> {
        debug_assert_eq!(self.width, 1);
        self.count += bytes.len() as u64;
        let out = self.out.as_mut().expect("writer is open until finish");
        out.write_all(bytes)
            .map_err(|e| DataError::io(&self.tmp, e))
    }

    /// Completes the file with its header, syncs it and renames it into
    /// place. The tokens were streamed to a scratch file first, because the
    /// header's length depends on the statistics known only now.
    pub fn finish(mut self, fingerprint: &str, info: &str) -> Result<(), DataError> {
        let tmp = self.tmp.clone();
        let io = |e| DataError::io(&tmp, e);
        let out = self.out.take().expect("finish is called once");
        out.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        let body = self
            .tmp
            .with_extension(format!("body-{}", std::process::id()));
        std::fs::rename(&self.tmp, &body).map_err(io)?;
        let result = (|| {
            let mut file = File::create(&self.tmp)?;
            file.write_all(&header(fingerprint, info, self.width, self.count))?;
            std::io::copy(&mut File::open(&body)?, &mut file)?;
            file.sync_all()
        })();
        let _ = std::fs::remove_file(&body);
        result.map_err(io)?;
        std::fs::rename(&self.tmp, &self.path).map_err(|e| DataError::io(&self.path, e))
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        // Unfinished (error or panic): leave nothing half-written behind.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Opens the cache at `path` if it exists and was built from `fingerprint`,
/// with its info; `Ok(None)` when it is missing or stale.
pub fn open_cache(
    path: &Path,
    fingerprint: &str,
) -> Result<Option<(MappedTokens, String)>, DataError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(DataError::io(path, e)),
    };
    let bad = |reason: &str| DataError::BadCache {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    // SAFETY: cache files are only replaced by rename, never modified in place.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
    if map.len() < FIXED || &map[..8] != MAGIC {
        return Err(bad("wrong magic"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(map[at..at + 4].try_into().unwrap());
    if u32_at(8) != VERSION {
        return Err(bad(&format!(
            "format version {} instead of {VERSION}",
            u32_at(8)
        )));
    }
    let width = u32_at(12) as usize;
    if ![1, 2, 4].contains(&width) {
        return Err(bad("bad token width"));
    }
    let count = u64::from_le_bytes(map[16..24].try_into().unwrap()) as usize;
    let (fp_len, info_len) = (u32_at(24) as usize, u32_at(28) as usize);
    if map.len() < FIXED + fp_len + info_len {
        return Err(bad("truncated header"));
    }
    if &map[FIXED..FIXED + fp_len] != fingerprint.as_bytes() {
        return Ok(None);
    }
    let info = std::str::from_utf8(&map[FIXED + fp_len..FIXED + fp_len + info_len])
        .map_err(|_| bad("info is not UTF-8"))?
        .to_string();
    let offset = (FIXED + fp_len + info_len).div_ceil(ALIGN) * ALIGN;
    let data = count.checked_mul(width).and_then(|d| d.checked_add(offset));
    if data != Some(map.len()) {
        return Err(bad("truncated token data"));
    }
    Ok(Some((
        MappedTokens {
            map: Arc::new(Backing::Map(map)),
            offset,
            width,
            len: count,
        },
        info,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unfinished_cache_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.tvq-cache");
        {
            let mut w = CacheWriter::create(&path, "fp", 2).unwrap();
            w.push(5).unwrap();
            // dropped without finish(): an interruption
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let mut w = CacheWriter::create(&path, "fp", 4).unwrap();
        for t in [7, 70_000, 1] {
            w.push(t).unwrap();
        }
        w.finish("fp", "{}").unwrap();
        let (t, info) = open_cache(&path, "fp").unwrap().unwrap();
        assert_eq!(info, "{}");
        assert_eq!(
            (0..t.len()).map(|i| t.get(i)).collect::<Vec<_>>(),
            vec![7, 70_000, 1]
        );
        assert!(
            open_cache(&path, "other").unwrap().is_none(),
            "another fingerprint is stale"
        );
    }

    /// A cache refuses an id its width cannot hold (instead of keeping its
    /// low bytes), and a header whose count overflows is a bad cache.
    #[test]
    fn caches_hold_every_id_or_refuse_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.tvq-cache");
        let mut w = CacheWriter::create(&path, "fp", 2).unwrap();
        w.push(65_535).unwrap();
        let err = w.push(65_536).unwrap_err();
        assert!(err.to_string().contains("65536"), "{err}");
        drop(w);
        let mut w = CacheWriter::create(&path, "fp", 2).unwrap();
        w.push(7).unwrap();
        w.finish("fp", "{}").unwrap();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&path, bytes).unwrap();
        let err = open_cache(&path, "fp").unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
