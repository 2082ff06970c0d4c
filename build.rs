//! Fingerprints the code that decides how fast a forward pass runs (the model code and its
//! arithmetic), so that forward costs cached by an older build are measured again
//! (`src/costs.rs`).

use std::path::Path;

fn main() {
    let mut files = Vec::new();
    for root in ["src/model", "src/vecmath.rs"] {
        println!("cargo:rerun-if-changed={root}");
        collect(Path::new(root), &mut files);
    }
    files.sort();
    // FNV-1a over every file's path and bytes.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for f in &files {
        let bytes = std::fs::read(f).unwrap_or_default();
        for b in f.to_string_lossy().bytes().chain(bytes) {
            hash = (hash ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    println!("cargo:rustc-env=CASCADE_MODEL_CODE={hash:016x}");
}

fn collect(path: &Path, out: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        entries.iter().for_each(|p| collect(p, out));
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}
