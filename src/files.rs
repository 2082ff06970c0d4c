//! Writing a file so that an interruption never leaves half of it.

use std::path::{Path, PathBuf};

/// Writes `bytes` to `path`: its folder is created if missing, the bytes go to a temporary
/// file beside it (named per process, so two processes writing at once each write a whole
/// file), which is then renamed over `path`. On failure the temporary file is removed.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.partial", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}
