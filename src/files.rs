//! Writing a file so that an interruption never leaves half of it, and locking a file that
//! several processes update.

use std::path::{Path, PathBuf};

/// Why `path` cannot be read as a file: a folder is there, or nothing is.
pub fn not_a_file(path: &Path) -> String {
    match path.is_dir() {
        true => format!("{} is a folder, not a file", path.display()),
        false => format!("file not found: {}", path.display()),
    }
}

/// Writes `bytes` to `path`: its folder is created if missing, the bytes go to a temporary
/// file beside it (named per process and writer, so two writing at once each write a whole
/// file), flushed to the disk, then renamed over `path`: after a crash or a power cut `path`
/// holds the old bytes or the new ones. On failure the temporary file is removed.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    let write = WRITES.fetch_add(1, Ordering::Relaxed);
    tmp.push(format!(".{}-{write}.partial", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    written
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })?;
    // The rename itself is durable once the folder is (where a folder can be opened).
    if let Ok(d) = std::fs::File::open(dir.unwrap_or(Path::new("."))) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// An exclusive lock for updating `path` (the file `<path>.lock` beside it, created if
/// missing, its folder too), held until the returned file is dropped; waits while another
/// process holds it.
pub fn lock_beside(path: &Path) -> std::io::Result<std::fs::File> {
    let mut lock = path.as_os_str().to_owned();
    lock.push(".lock");
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock)?;
    file.lock()?;
    Ok(file)
}
