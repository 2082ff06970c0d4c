//! Reading GGUF files: a header reader that trusts nothing it reads.
//!
//! A model file may be a half-finished download, a file for another architecture or a
//! hand-edited one. Every length and count is bounded by the bytes left in the file before
//! anything is allocated, every tensor's type, dimensions and data range are checked, and
//! duplicate keys or tensor names are errors, so a malformed header ends in
//! [`Error::BadModelFile`] naming the file and the offending value, never in a panic or an
//! allocation of exabytes. The result is candle's own [`Content`], which its tokenizer reads.

use crate::error::{Error, Result};
use crate::model::kernels::Kernels;
use crate::model::qweight::QWeight;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

const MAGIC: u32 = 0x4655_4747; // "GGUF" read as a little-endian u32
const MAX_DIMS: u32 = 4; // GGML_MAX_DIMS
const MAX_DEPTH: usize = 8; // nested arrays; real files use at most 1
const DEFAULT_ALIGNMENT: u64 = 32;
/// The most items reserved ahead of parsing them. A count is bounded by the bytes left in the
/// file, but an item in memory can be 32 times its size on disk (a `Value` per u8 of an
/// array): reserving for a corrupt count would ask for far more memory than the file backs.
const PREALLOCATED: usize = 1 << 16;
/// What the parsed metadata may take in memory beyond the file's size, in bytes. Items in
/// memory outweigh their bytes on disk (a 32-byte `Value` per u8 of an array), so their total
/// is bounded apart from the bytes left: by the file's size and this much, room for a
/// vocabulary-only file's half a million tokens.
const METADATA_SLACK: u64 = 64 << 20;

/// Anything a GGUF file can be read from: a file, or bytes in memory.
pub trait Source: Read + Seek + Send {}
impl<T: Read + Seek + Send> Source for T {}

/// Where the regions of a GGUF file end, for tools and tests that probe them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// End of the fixed header (magic, version, counts).
    pub header_end: u64,
    /// End of the metadata key-value pairs.
    pub metadata_end: u64,
    /// End of the tensor-info table.
    pub tensor_infos_end: u64,
    /// Start of the tensor data (after alignment padding).
    pub data_start: u64,
    /// Size of the whole file.
    pub size: u64,
}

/// An open GGUF file whose header has been read and checked against the file size.
pub struct GgufFile<'a> {
    /// The file, for messages.
    pub path: PathBuf,
    /// The checked header: metadata and tensor infos.
    pub content: Content,
    /// Where the header's regions end.
    pub layout: Layout,
    reader: Box<dyn Source + 'a>,
    /// Room for the blocks of the tensor being repacked, kept for the next one: allocating
    /// each tensor's afresh would fault in every page of the model twice.
    scratch: Vec<u64>,
    /// The tensors read so far, so that one the model never reads is found.
    read: std::collections::HashSet<String>,
}

impl GgufFile<'static> {
    /// Opens and checks the GGUF file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::ModelNotFound(path.to_path_buf()));
        }
        let file = File::open(path).map_err(|e| Error::BadModelFile {
            path: path.to_path_buf(),
            reason: format!("cannot open it: {e}"),
        })?;
        GgufFile::from_reader(path, BufReader::with_capacity(1 << 20, file))
    }
}

impl<'a> GgufFile<'a> {
    /// Reads the header of a GGUF file held by `reader` (`path` names it in messages).
    pub fn from_reader(path: &Path, mut reader: impl Source + 'a) -> Result<Self> {
        let bad = |reason: String| Error::BadModelFile {
            path: path.to_path_buf(),
            reason,
        };
        let seek_error = |e: std::io::Error| bad(format!("cannot read it: {e}"));
        let size = reader.seek(SeekFrom::End(0)).map_err(seek_error)?;
        reader.seek(SeekFrom::Start(0)).map_err(seek_error)?;
        let (content, layout) = {
            let mut r = HeaderReader {
                inner: &mut reader,
                pos: 0,
                size,
                memory_left: size.saturating_add(METADATA_SLACK),
            };
            read_header(&mut r).map_err(|e| match e {
                Error::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                    bad(format!("file is truncated: the header ends at byte {size}"))
                }
                Error::Io(io) => seek_error(io),
                Error::BadModelFile { reason, .. } => bad(reason),
                e => e,
            })?
        };
        Ok(Self {
            path: path.to_path_buf(),
            content,
            layout,
            reader: Box::new(reader),
            scratch: Vec::new(),
            read: Default::default(),
        })
    }

    /// A [`Error::BadModelFile`] naming this file.
    pub(crate) fn bad(&self, reason: String) -> Error {
        Error::BadModelFile {
            path: self.path.clone(),
            reason,
        }
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// The string metadata value of `key`.
    pub fn string(&self, key: &str) -> Result<String> {
        match self.get(key).map(|v| v.to_string()) {
            Some(Ok(s)) => Ok(s.clone()),
            _ => Err(self.bad(format!("metadata `{key}` is missing or not a string"))),
        }
    }

    /// An unsigned integer of any width (signed ones if not negative).
    pub fn usize(&self, key: &str) -> Result<usize> {
        let n = match self.get(key) {
            Some(Value::U8(v)) => Some(*v as u64),
            Some(Value::U16(v)) => Some(*v as u64),
            Some(Value::U32(v)) => Some(*v as u64),
            Some(Value::U64(v)) => Some(*v),
            Some(Value::I8(v)) => u64::try_from(*v).ok(),
            Some(Value::I16(v)) => u64::try_from(*v).ok(),
            Some(Value::I32(v)) => u64::try_from(*v).ok(),
            Some(Value::I64(v)) => u64::try_from(*v).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok()).ok_or_else(|| {
            self.bad(format!(
                "metadata `{key}` is missing or not a non-negative integer"
            ))
        })
    }

    /// A float (f32 or f64), or `default` when the key is absent.
    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::F32(v)) => Ok(*v),
            Some(Value::F64(v)) => Ok(*v as f32),
            Some(_) => Err(self.bad(format!("metadata `{key}` is not a float"))),
        }
    }

    /// Whether the file has tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads tensor `name`, which must have `dims` (rows, then columns; one entry for 1-D),
    /// packed for the `kernels` family.
    pub fn tensor(&mut self, name: &str, dims: &[usize], kernels: Kernels) -> Result<QWeight> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.bad(format!("tensor `{name}` is missing")))?;
        if info.shape.dims() != dims {
            return Err(self.bad(format!(
                "tensor `{name}` has shape {:?}, expected {dims:?} from the metadata",
                info.shape.dims()
            )));
        }
        self.read.insert(name.to_string());
        let offset = self.content.tensor_data_offset;
        let reader = &mut self.reader;
        QWeight::read(reader, offset, name, info, kernels, &mut self.scratch).map_err(|e| match e {
            Error::BadModelFile { reason, .. } => self.bad(reason),
            Error::Io(io) => self.bad(format!("reading tensor `{name}`: {io}")),
            other => other,
        })
    }

    /// The first tensor (by name) that has not been read, if any: after a model has read all
    /// it uses, one it does not know, such as a bias or an expert its architecture lacks.
    pub fn unread_tensor(&self) -> Option<&str> {
        self.content
            .tensor_infos
            .keys()
            .filter(|name| !self.read.contains(*name))
            .min()
            .map(String::as_str)
    }

    /// The shape of tensor `name` (rows, then columns), if present.
    pub fn dims(&self, name: &str) -> Option<&[usize]> {
        self.content.tensor_infos.get(name).map(|i| i.shape.dims())
    }
}

/// A reader that knows how many bytes remain, so no length it reads is trusted beyond them.
struct HeaderReader<'r, R> {
    inner: &'r mut R,
    pos: u64,
    size: u64,
    /// Bytes of memory the metadata's values and the tensor infos may still take.
    memory_left: u64,
}

fn malformed(reason: String) -> Error {
    Error::BadModelFile {
        path: PathBuf::new(),
        reason,
    }
}

impl<R: Read> HeaderReader<'_, R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b)?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        self.bytes().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64> {
        self.bytes().map(u64::from_le_bytes)
    }

    fn remaining(&self) -> u64 {
        self.size.saturating_sub(self.pos)
    }

    /// A count of items of at least `min_bytes` each, bounded by the bytes left.
    fn count(&mut self, what: &str, min_bytes: u64) -> Result<usize> {
        let at = self.pos;
        let n = self.u64()?;
        if n.saturating_mul(min_bytes) > self.remaining() {
            return Err(malformed(format!(
                "{what} at byte {at} is {n}, more than the {} bytes left in the file can hold: \
                 the file is cut short, or damaged",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    /// Takes the memory of `items` (the count of `what`, read at byte `at`) of `values` values
    /// each from the metadata's budget.
    fn charge(&mut self, what: &str, at: u64, items: usize, values: u64) -> Result<()> {
        let bytes = (items as u64)
            .saturating_mul(values)
            .saturating_mul(std::mem::size_of::<Value>() as u64);
        match self.memory_left.checked_sub(bytes) {
            Some(left) => {
                self.memory_left = left;
                Ok(())
            }
            None => Err(malformed(format!(
                "{what} at byte {at} is {items}, more than the memory a file of {} bytes may \
                 take (its size and {} MiB)",
                self.size,
                METADATA_SLACK >> 20
            ))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(&format!("length of {what}"), 1)?;
        let mut b = vec![0u8; len];
        self.inner.read_exact(&mut b)?;
        let at = self.pos;
        self.pos += len as u64;
        String::from_utf8(b).map_err(|_| malformed(format!("{what} at byte {at} is not UTF-8")))
    }

    fn value(&mut self, key: &str, kind: u32, depth: usize) -> Result<Value> {
        Ok(match kind {
            0 => Value::U8(self.bytes::<1>()?[0]),
            1 => Value::I8(self.bytes::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.bytes()?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.bytes()?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes()?)),
            7 => match self.bytes::<1>()?[0] {
                b @ (0 | 1) => Value::Bool(b == 1),
                b => return Err(malformed(format!("metadata `{key}`: bool byte {b}"))),
            },
            8 => Value::String(self.string(&format!("metadata `{key}`"))?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(malformed(format!(
                        "metadata `{key}`: arrays nested deeper than {MAX_DEPTH}"
                    )));
                }
                let item = self.u32()?;
                let min = min_value_bytes(item).ok_or_else(|| {
                    malformed(format!("metadata `{key}`: unknown array item type {item}"))
                })?;
                let what = format!("length of metadata `{key}`");
                let at = self.pos;
                let n = self.count(&what, min)?;
                self.charge(&what, at, n, 1)?;
                let mut items = Vec::with_capacity(n.min(PREALLOCATED));
                for _ in 0..n {
                    items.push(self.value(key, item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.bytes()?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes()?)),
            _ => {
                return Err(malformed(format!(
                    "metadata `{key}`: unknown value type {kind}"
                )))
            }
        })
    }
}

/// The fewest bytes a value of GGUF type `kind` takes, or `None` for an unknown type.
fn min_value_bytes(kind: u32) -> Option<u64> {
    Some(match kind {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// The tensor types of GGUF's numbering that the loader may meet.
fn dtype(id: u32) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match id {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        _ => return None,
    })
}

/// Names of GGUF tensor types that exist but that the loader does not read.
fn unsupported_type(id: u32) -> Option<&'static str> {
    Some(match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

fn read_header<R: Read>(r: &mut HeaderReader<'_, R>) -> Result<(Content, Layout)> {
    let magic = r.u32()?;
    if magic != MAGIC {
        return Err(malformed(format!(
            "not a GGUF file (magic {magic:#010x}, expected {MAGIC:#010x} \"GGUF\")"
        )));
    }
    let magic = match r.u32()? {
        2 => VersionedMagic::GgufV2,
        3 => VersionedMagic::GgufV3,
        v => {
            return Err(malformed(format!(
                "GGUF version {v} is not supported (2 and 3 are)"
            )))
        }
    };
    // A tensor info takes at least 24 bytes (name length, dims count, type, offset),
    // a key-value pair at least 13 (key length, type, one byte).
    let at = r.pos;
    let tensor_count = r.count("tensor count", 24)?;
    // A tensor's name, shape and offset take about four values' memory.
    r.charge("tensor count", at, tensor_count, 4)?;
    let at = r.pos;
    let kv_count = r.count("metadata count", 13)?;
    r.charge("metadata count", at, kv_count, 2)?; // a key with its slot, a value
    let header_end = r.pos;

    let mut metadata = HashMap::with_capacity(kv_count.min(PREALLOCATED));
    for _ in 0..kv_count {
        let key = r.string("metadata key")?;
        let kind = r.u32()?;
        let value = r.value(&key, kind, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(malformed(format!("metadata `{key}` appears twice")));
        }
    }
    let metadata_end = r.pos;

    let mut tensor_infos = HashMap::with_capacity(tensor_count.min(PREALLOCATED));
    for _ in 0..tensor_count {
        let name = r.string("tensor name")?;
        let n_dims = r.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(malformed(format!(
                "tensor `{name}` has {n_dims} dimensions (1 to {MAX_DIMS} allowed)"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64()?);
        }
        let type_id = r.u32()?;
        let offset = r.u64()?;
        let ggml_dtype = dtype(type_id).ok_or_else(|| {
            malformed(match unsupported_type(type_id) {
                Some(kind) => format!(
                    "tensor `{name}` is {kind}, a type cascade cannot read (it reads F32, F16, \
                     Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K)"
                ),
                None => format!("tensor `{name}` has unknown type id {type_id}"),
            })
        })?;
        let too_many = || {
            malformed(format!(
                "tensor `{name}` has dimensions {dims:?}: zero or too many elements"
            ))
        };
        let elems = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n > 0)
            .ok_or_else(too_many)?;
        let block = ggml_dtype.block_size() as u64;
        if dims[0] % block != 0 {
            return Err(malformed(format!(
                "tensor `{name}`: row length {} is not a multiple of the {ggml_dtype:?} block size {block}",
                dims[0]
            )));
        }
        // Checked too: a size that wrapped around would pass the bounds check below.
        let bytes = (elems / block)
            .checked_mul(ggml_dtype.type_size() as u64)
            .ok_or_else(too_many)?;
        let shape: Vec<usize> = dims.iter().rev().map(|&d| d as usize).collect();
        let info = TensorInfo {
            ggml_dtype,
            shape: shape.into(),
            offset,
        };
        // The data range is checked once the data start is known; stash the size in the map.
        if tensor_infos.insert(name.clone(), (info, bytes)).is_some() {
            return Err(malformed(format!("tensor `{name}` appears twice")));
        }
    }
    let tensor_infos_end = r.pos;

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => *a as u64,
        Some(v) => {
            return Err(malformed(format!(
                "metadata `general.alignment` is {v:?}, expected a power of two as u32"
            )))
        }
    };
    let data_start = tensor_infos_end.div_ceil(alignment) * alignment;
    // In the file's order, so that a truncated file names the first tensor it cuts.
    let mut in_order: Vec<_> = tensor_infos.iter().collect();
    in_order.sort_by_key(|(name, (info, _))| (info.offset, *name));
    for (name, (info, bytes)) in in_order {
        if info.offset % alignment != 0 {
            return Err(malformed(format!(
                "tensor `{name}`: offset {} is not a multiple of the alignment {alignment}",
                info.offset
            )));
        }
        let end = data_start
            .checked_add(info.offset)
            .and_then(|s| s.checked_add(*bytes));
        match end {
            Some(end) if end <= r.size => {}
            _ => {
                return Err(malformed(format!(
                    "file is truncated: tensor `{name}` ends at byte {} but the file has {} bytes",
                    end.map_or("beyond 2^64".into(), |e| e.to_string()),
                    r.size
                )))
            }
        }
    }
    let content = Content {
        magic,
        metadata,
        tensor_infos: tensor_infos
            .into_iter()
            .map(|(name, (info, _))| (name, info))
            .collect(),
        tensor_data_offset: data_start,
    };
    let layout = Layout {
        header_end,
        metadata_end,
        tensor_infos_end,
        data_start,
        size: r.size,
    };
    Ok((content, layout))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A GGUF (version 3, no tensors) whose one metadata key holds `n` u8 items.
    fn with_u8_array(n: u64) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(MAGIC.to_le_bytes());
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes()); // tensors
        b.extend(1u64.to_le_bytes()); // metadata
        let key = b"bytes";
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key);
        b.extend(9u32.to_le_bytes()); // array
        b.extend(0u32.to_le_bytes()); // of u8
        b.extend(n.to_le_bytes());
        b.resize(b.len() + n as usize, 7);
        b
    }

    /// An array of small items is bounded by the memory its values take, not only by the
    /// bytes left: 8 MiB of u8 items would take 256 MiB as values.
    #[test]
    fn an_array_of_small_items_is_bounded_by_its_memory() {
        let read =
            |n: u64| GgufFile::from_reader(Path::new("m.gguf"), Cursor::new(with_u8_array(n)));
        let small = read(1 << 20).unwrap();
        assert!(matches!(small.get("bytes"), Some(Value::Array(a)) if a.len() == 1 << 20));
        let n = 8 << 20;
        let e = read(n).err().unwrap().to_string();
        let size = with_u8_array(n).len();
        assert_eq!(
            e,
            format!(
                "cannot read GGUF file m.gguf: length of metadata `bytes` at byte 45 is {n}, more \
                 than the memory a file of {size} bytes may take (its size and 64 MiB)"
            )
        );
    }

    /// Tensor infos draw on the same budget: 24 bytes of file each, about 128 in memory.
    #[test]
    fn many_tensor_infos_are_bounded_by_their_memory() {
        let header = |tensors: u64| {
            let mut b = Vec::new();
            b.extend(MAGIC.to_le_bytes());
            b.extend(3u32.to_le_bytes());
            b.extend(tensors.to_le_bytes());
            b.extend(0u64.to_le_bytes()); // metadata
            b.resize(b.len() + 24 * tensors as usize, 0);
            b
        };
        let n = 1u64 << 20;
        let e = GgufFile::from_reader(Path::new("m.gguf"), Cursor::new(header(n)))
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            format!(
                "cannot read GGUF file m.gguf: tensor count at byte 8 is {n}, more than the \
                 memory a file of {} bytes may take (its size and 64 MiB)",
                header(n).len()
            )
        );
        // Fewer get as far as reading the first (empty) tensor name.
        let e = GgufFile::from_reader(Path::new("m.gguf"), Cursor::new(header(1000)))
            .err()
            .unwrap()
            .to_string();
        assert!(!e.contains("memory"), "{e}");
    }
}
