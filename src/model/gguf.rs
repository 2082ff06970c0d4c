//! Opening GGUF files: header, metadata and tensors, with errors that say what is wrong.

use crate::error::{Error, Result};
use crate::model::kernels::Kernels;
use crate::model::qweight::QWeight;
use candle_core::quantized::gguf_file::{Content, Value};
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An open GGUF file whose tensor table has been checked against the file size.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::ModelNotFound(path.to_path_buf()));
        }
        let bad = |reason: String| Error::BadModelFile {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let content =
            Content::read(&mut reader).map_err(|e| bad(format!("invalid header: {e}")))?;
        // A truncated download keeps a valid header: check every tensor fits in the file.
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count() as u64;
            let block = info.ggml_dtype.block_size() as u64;
            let bytes = elems / block * info.ggml_dtype.type_size() as u64;
            let end = content.tensor_data_offset + info.offset + bytes;
            if end > size {
                return Err(bad(format!(
                    "file is truncated: tensor `{name}` ends at byte {end} but the file has {size} bytes"
                )));
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    fn bad(&self, reason: String) -> Error {
        Error::BadModelFile {
            path: self.path.clone(),
            reason,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub fn string(&self, key: &str) -> Result<String> {
        match self.get(key).map(|v| v.to_string()) {
            Some(Ok(s)) => Ok(s.clone()),
            _ => Err(self.bad(format!("metadata `{key}` is missing or not a string"))),
        }
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        match self
            .get(key)
            .map(|v| v.to_u64().or_else(|_| v.to_u32().map(u64::from)))
        {
            Some(Ok(n)) => Ok(n as usize),
            _ => Err(self.bad(format!("metadata `{key}` is missing or not an integer"))),
        }
    }

    pub fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .to_f32()
                .map_err(|_| self.bad(format!("metadata `{key}` is not a float"))),
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads tensor `name`, packed for the `kernels` family.
    pub fn tensor(&mut self, name: &str, kernels: Kernels) -> Result<QWeight> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::BadModelFile {
                path: self.path.clone(),
                reason: format!("tensor `{name}` is missing"),
            })?;
        QWeight::read(
            &mut self.reader,
            self.content.tensor_data_offset,
            name,
            info,
            kernels,
        )
        .map_err(|e| match e {
            Error::BadModelFile { reason, .. } => self.bad(reason),
            Error::Io(io) => self.bad(format!("reading tensor `{name}`: {io}")),
            other => other,
        })
    }
}
