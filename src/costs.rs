//! What a forward pass costs on this machine: measured once per model file and machine, kept
//! in a cache file, and used while generating (adaptive drafting weighs a draft's expected
//! tokens against these costs) as well as by the bench and the planner.

use crate::error::{Error, Result};
use crate::model::{LoadedModel, Model};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A model's measured forward times on this machine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForwardCost {
    /// Seconds of a forward over one token (a decode step) after [`CONTEXT`] tokens.
    pub decode_seconds: f64,
    /// `(k, r(k))`: the time of a forward over k tokens relative to one token, ascending in k,
    /// starting at `(1, 1.0)`.
    pub ratios: Vec<(usize, f64)>,
    /// `(k, s)`: seconds a forward over k tokens takes longer per token of context beyond
    /// [`CONTEXT`] (attention reads the whole cache for every token fed).
    #[serde(default)]
    pub per_context: Vec<(usize, f64)>,
}

/// The forward lengths measured.
pub const MEASURED: [usize; 8] = [1, 2, 3, 4, 6, 8, 12, 16];
/// The context the forward lengths are measured after.
pub const CONTEXT: usize = 64;
/// The longer context measured for the context term, and the lengths measured there.
pub const LONG_CONTEXT: usize = 384;
/// The forward lengths measured at the longer context.
pub const MEASURED_LONG: [usize; 3] = [1, 4, 16];

impl ForwardCost {
    /// Whether the cost can be used: a positive decode time, well-formed r(k) points and a
    /// finite context term at increasing k.
    pub fn is_well_formed(&self) -> bool {
        self.decode_seconds.is_finite()
            && self.decode_seconds > 0.0
            && well_formed_ratios(&self.ratios)
            && self.per_context.windows(2).all(|w| w[0].0 < w[1].0)
            && self.per_context.iter().all(|p| p.1.is_finite())
    }

    /// r(k), interpolated between the measured lengths and extrapolated past them.
    pub fn ratio(&self, k: f64) -> f64 {
        interpolate(&self.ratios, k)
    }

    /// Seconds of a forward over `k` tokens after [`CONTEXT`] tokens.
    pub fn seconds(&self, k: usize) -> f64 {
        self.decode_seconds * self.ratio(k as f64)
    }

    /// Seconds of a forward over `k` tokens after `context` tokens.
    pub fn seconds_at(&self, k: usize, context: usize) -> f64 {
        let extra = context.saturating_sub(CONTEXT) as f64;
        let slope = if self.per_context.is_empty() {
            0.0
        } else {
            interpolate(&self.per_context, k as f64).max(0.0)
        };
        self.seconds(k) + extra * slope
    }
}

/// Whether r(k) points can be interpolated: (1, 1.0) first, then finite positive values at
/// increasing k.
pub fn well_formed_ratios(points: &[(usize, f64)]) -> bool {
    points.len() >= 2
        && points[0] == (1, 1.0)
        && points.windows(2).all(|w| w[0].0 < w[1].0)
        && points.iter().all(|p| p.1.is_finite() && p.1 > 0.0)
}

/// Linear interpolation of `(k, value)` points (ascending in k), held at the first value
/// before the first point and extrapolated from the last two past the end. With no points a
/// forward over k tokens costs k; with one, it grows in proportion.
///
/// The result never falls as k grows, though noise can measure a longer forward as cheaper
/// than a shorter one: it is at least every point's value at or before k, and past the end
/// a falling last slope gives way to the mean slope over all points (costs of extra tokens,
/// which the gate and the planner weigh, must not come out negative or zero for good).
pub fn interpolate(points: &[(usize, f64)], k: f64) -> f64 {
    let Some(&first) = points.first() else {
        return k;
    };
    if points.len() == 1 {
        return first.1 * k / first.0.max(1) as f64;
    }
    if k <= first.0 as f64 {
        return first.1;
    }
    let slope = |a: (usize, f64), b: (usize, f64)| (b.1 - a.1) / (b.0 - a.0).max(1) as f64;
    let floor = points
        .iter()
        .take_while(|p| p.0 as f64 <= k)
        .map(|p| p.1)
        .fold(f64::MIN, f64::max);
    for w in points.windows(2) {
        let (a, b) = (w[0], w[1]);
        if k <= b.0 as f64 {
            return (a.1 + slope(a, b) * (k - a.0 as f64)).max(floor);
        }
    }
    let (a, b) = (points[points.len() - 2], points[points.len() - 1]);
    let last = match slope(a, b) {
        s if s > 0.0 => s,
        _ => slope(first, b).max(0.0),
    };
    (b.1 + last * (k - b.0 as f64)).max(floor)
}

/// What is measured: a model, scoring its whole vocabulary or only some tokens (a draft
/// model's trimmed vocabulary, whose forward costs less).
#[derive(Clone, Copy)]
pub struct Subject<'a> {
    /// The model.
    pub model: &'a LoadedModel,
    /// The tokens it scores, if not all.
    pub vocabulary: Option<&'a [u32]>,
}

impl<'a> From<&'a LoadedModel> for Subject<'a> {
    fn from(model: &'a LoadedModel) -> Self {
        Self {
            model,
            vocabulary: None,
        }
    }
}

/// A model's name with the size of the trimmed vocabulary it scores, if any: what costs and
/// forward calls are reported under (`model.gguf (vocabulary 32770)`).
pub fn subject_label(model: &str, vocabulary: Option<usize>) -> String {
    match vocabulary {
        Some(n) => format!("{model} (vocabulary {n})"),
        None => model.to_string(),
    }
}

/// The trimmed vocabulary's size in a [`subject_label`] of `model`, if it names one.
pub fn trimmed_size(label: &str, model: &str) -> Option<usize> {
    let size = label.strip_prefix(model)?.strip_prefix(" (vocabulary ")?;
    size.strip_suffix(')')?.parse().ok()
}

/// Measured costs, and how much of the CPU the measurement had.
pub struct Measurement {
    /// Per model, in the order asked.
    pub costs: Vec<ForwardCost>,
    /// The CPU time this process used over the wall time of its threads (at most one per
    /// core): near 1 or above when they ran alone (the kernels' thread pool spins between
    /// tasks), lower when other work took the CPU and the times came out too long. `None`
    /// where the platform does not tell.
    pub cpu_share: Option<f64>,
}

/// The CPU share ([`Measurement::cpu_share`]) below which a measurement was contended: on
/// 2 cores of an AMD EPYC (family 23, AVX2 kernels) it was 0.985 alone, and 0.61 beside one
/// busy process (where a 1.5B decode step took three times as long).
pub const MIN_CPU_SHARE: f64 = 0.85;

/// The CPU share of a measurement if it says other work had the CPU ([`MIN_CPU_SHARE`]).
pub fn contended(cpu_share: Option<f64>) -> Option<f64> {
    cpu_share.filter(|&s| s < MIN_CPU_SHARE)
}

/// Measures `models` side by side: every model at every length of [`MEASURED`] after
/// [`CONTEXT`] tokens, each length of [`MEASURED_LONG`] also after [`LONG_CONTEXT`] next to
/// it, in each of `reps` repetitions (after a warm-up).
///
/// Every figure is a median over the repetitions of what was timed close together: r(k) of
/// each repetition's own k-token and one-token forwards, the context term of each pair of
/// forwards over the same tokens at the two contexts, timed one after the other. A machine's
/// speed can move by a fifth within minutes (a shared cloud machine's did), and the context
/// term is a millisecond or two on a 20 ms forward: timed in two phases, all the short
/// forwards and then all the long ones, the 1.5B's came out between -12.6 and 2.9 us per
/// token of context in four calibrations; paired, between 1.9 and 3.2 in six.
pub fn measure(models: &[Subject], reps: usize) -> Result<Measurement> {
    assert!(reps > 0, "a measurement takes at least one repetition");
    let (wall, cpu) = (Instant::now(), cpu_seconds());
    let times = forward_times(models, reps)?;
    // More threads than cores cannot all run at once.
    let cores = std::thread::available_parallelism().map_or(usize::MAX, |n| n.get());
    let threads = candle_core::utils::get_num_threads().min(cores) as f64;
    let cpu_share = cpu
        .zip(cpu_seconds())
        .map(|(start, end)| (end - start) / (wall.elapsed().as_secs_f64() * threads));
    let costs = times
        .into_iter()
        .map(|Times { short, long }| {
            let at = |k: usize| &short[MEASURED.iter().position(|&m| m == k).expect("measured")];
            let per_rep = |a: &[f64], b: &[f64], f: &dyn Fn(f64, f64) -> f64| {
                median(a.iter().zip(b).map(|(&a, &b)| f(a, b)).collect())
            };
            ForwardCost {
                decode_seconds: median(at(1).clone()),
                // (r(1) is 1 exactly: each one-token time over itself.)
                ratios: MEASURED
                    .iter()
                    .zip(&short)
                    .map(|(&k, t)| (k, per_rep(t, at(1), &|t, d| t / d)))
                    .collect(),
                per_context: MEASURED_LONG
                    .iter()
                    .zip(&long)
                    .map(|(&k, t)| {
                        let extra = (LONG_CONTEXT - CONTEXT) as f64;
                        (k, per_rep(t, at(k), &|long, short| (long - short) / extra))
                    })
                    .collect(),
            }
        })
        .collect();
    Ok(Measurement { costs, cpu_share })
}

/// The CPU time (user and system) this process has used so far, where the platform tells.
fn cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        // SAFETY: `rusage` is plain data, valid all zeros; getrusage only writes to it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: a valid pointer to a `rusage`, as getrusage requires.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
            return None;
        }
        let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        Some(seconds(usage.ru_utime) + seconds(usage.ru_stime))
    }
    #[cfg(not(unix))]
    None
}

/// One model's forward times, one per repetition: `short[i]` of a forward over `MEASURED[i]`
/// tokens after [`CONTEXT`], `long[i]` over `MEASURED_LONG[i]` after [`LONG_CONTEXT`].
struct Times {
    short: Vec<Vec<f64>>,
    long: Vec<Vec<f64>>,
}

/// The forward times [`measure`] takes the medians of, per model.
fn forward_times(models: &[Subject], reps: usize) -> Result<Vec<Times>> {
    let context = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| 100 + (i * 7) % 5000).collect() };
    let (short_ctx, long_ctx) = (context(CONTEXT), context(LONG_CONTEXT));
    // Per model, one instance at each context.
    let mut instances = Vec::new();
    for s in models {
        let mut pair = Vec::new();
        for ctx in [&short_ctx, &long_ctx] {
            let mut m: Box<dyn Model> = Box::new(s.model.instance("cost", None));
            m.restrict_vocabulary(s.vocabulary)?;
            m.prefill(ctx)?;
            pair.push(m);
        }
        instances.push(pair);
    }
    let mut times: Vec<Times> = models
        .iter()
        .map(|_| Times {
            short: vec![Vec::with_capacity(reps); MEASURED.len()],
            long: vec![Vec::with_capacity(reps); MEASURED_LONG.len()],
        })
        .collect();
    let timed = |m: &mut Box<dyn Model>, k: usize, ctx: usize| -> Result<f64> {
        let feed: Vec<u32> = (0..k as u32).map(|i| 300 + i).collect();
        let start = Instant::now();
        m.forward(&feed)?;
        let seconds = start.elapsed().as_secs_f64();
        m.truncate(ctx);
        Ok(seconds)
    };
    for rep in 0..=reps {
        for (pair, t) in instances.iter_mut().zip(times.iter_mut()) {
            for (i, &k) in MEASURED.iter().enumerate() {
                // A pair's two forwards in turns of order, so that whatever favours the second
                // of two (a warm cache) cancels out of the context term.
                let j = MEASURED_LONG.iter().position(|&l| l == k);
                let long_first = rep % 2 == 1;
                let mut long = None;
                if let (Some(j), true) = (j, long_first) {
                    long = Some((j, timed(&mut pair[1], k, LONG_CONTEXT)?));
                }
                let short = timed(&mut pair[0], k, CONTEXT)?;
                if let (Some(j), false) = (j, long_first) {
                    long = Some((j, timed(&mut pair[1], k, LONG_CONTEXT)?));
                }
                if rep > 0 {
                    // The first round is a warm-up.
                    t.short[i].push(short);
                    if let Some((j, long)) = long {
                        t.long[j].push(long);
                    }
                }
            }
        }
    }
    Ok(times)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What [`CostCache::costs`] tells as it goes.
pub enum CostEvent<'a> {
    /// These models are being measured.
    Measuring(&'a [String]),
    /// Models' costs were measured while other work had the CPU: they are too high.
    Contended {
        /// The models ([`CostCache::label`]).
        models: &'a [String],
        /// When they were measured (UTC).
        measured: &'a str,
        /// [`Measurement::cpu_share`].
        cpu_share: f64,
    },
    /// The costs just measured could not be written to the cache (the reason, naming the
    /// file): they serve this run only.
    NotSaved(&'a str),
}

impl std::fmt::Display for CostEvent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Measuring(names) => write!(f, "measuring {}", names.join(", ")),
            Self::Contended {
                models,
                measured,
                cpu_share,
            } => write!(
                f,
                "the forward costs of {} were measured ({measured}) while other work had the \
                 CPU (this process ran {:.0}% of its threads' time): they are too high, so \
                 drafting is too cautious; run `cascade calibrate` when the machine is idle",
                models.join(", "),
                cpu_share * 100.0
            ),
            Self::NotSaved(reason) => write!(
                f,
                "{reason}: the costs measured now serve this run only, and the next run \
                 measures them again"
            ),
        }
    }
}

/// The environment variable naming the cost cache file.
pub const COSTS_ENV: &str = "CASCADE_COSTS";

/// Repetitions of a calibration (each model at every measured length).
const REPS: usize = 5;

/// Measured costs, by model file and machine, in a JSON file (`CASCADE_COSTS`, else
/// `$XDG_CACHE_HOME/cascade/costs.json`, else `~/.cache/cascade/costs.json`). An entry is
/// keyed by the model file (name, size, modification time), the CPU model, the kernel family,
/// the thread count and a fingerprint of the model code (`build.rs`), so another machine,
/// another file, another setting or a build with other kernels measures anew.
pub struct CostCache {
    path: PathBuf,
    entries: BTreeMap<String, Entry>,
    /// The format of a file written by a newer build, which this one neither reads nor
    /// overwrites.
    newer: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Entry {
    /// When it was measured (UTC).
    measured: String,
    cost: ForwardCost,
    /// [`Measurement::cpu_share`].
    #[serde(default)]
    cpu_share: Option<f64>,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    version: u32,
    entries: BTreeMap<String, Entry>,
}

/// A cache file's version alone: read first, since another version's entries may have
/// another shape.
#[derive(Deserialize)]
struct Version {
    version: u32,
}

/// 3: r(k) and the context term from forwards timed close together ([`measure`]); entries
/// measured otherwise are measured again.
const VERSION: u32 = 3;

/// The most entries the cache keeps: every build with other model code, every model file
/// and setting adds one, and the oldest go first.
pub const MAX_ENTRIES: usize = 64;

/// Drops the entries measured longest ago beyond [`MAX_ENTRIES`] (times are UTC, written
/// `YYYY-MM-DD HH:MM`, so they sort as text), never those in `keep` (the ones in use).
fn prune(entries: &mut BTreeMap<String, Entry>, keep: &[String]) {
    let mut by_age: Vec<(String, String)> = entries
        .iter()
        .filter(|(k, _)| !keep.contains(k))
        .map(|(k, e)| (e.measured.clone(), k.clone()))
        .collect();
    by_age.sort();
    let excess = entries.len().saturating_sub(MAX_ENTRIES).min(by_age.len());
    for (_, key) in &by_age[..excess] {
        entries.remove(key);
    }
}

impl CostCache {
    /// Where the cache lives by default.
    pub fn default_path() -> PathBuf {
        if let Some(p) = std::env::var_os(COSTS_ENV) {
            return PathBuf::from(p);
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))
            .unwrap_or_else(std::env::temp_dir);
        base.join("cascade").join("costs.json")
    }

    /// An empty cache that will be saved at `path`.
    pub fn empty(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            entries: BTreeMap::new(),
            newer: None,
        }
    }

    /// The cache at `path`; a missing or empty file is an empty cache, an unreadable one an
    /// error that names it. A file of an older format is measured again and replaced; one
    /// written by a newer build is left as it is, so that going back to an older build for a
    /// while does not cost the newer one its measurements: the older build then keeps what it
    /// measures for the run only ([`CostCache::written_by_newer_build`]), unless
    /// `CASCADE_COSTS` gives it a file of its own.
    pub fn open(path: &Path) -> Result<Self> {
        match Self::open_to_replace(path)? {
            (cache, None) => Ok(cache),
            (_, Some(damaged)) => Err(damaged),
        }
    }

    /// [`CostCache::open`] for calibrating, which measures everything again: a cost cache of
    /// this format whose entries cannot be read is an empty cache, with that error beside it
    /// (a warning). Anything else that cannot be read is still an error, so that a file that
    /// is no cost cache (a config named by mistake) is never written over.
    pub fn open_to_replace(path: &Path) -> Result<(Self, Option<Error>)> {
        let error = |message: String| Error::config(path.display().to_string(), message);
        let mut cache = Self::empty(path);
        match std::fs::read_to_string(path) {
            // Created beforehand (`mktemp`, `touch`): nothing in it yet.
            Ok(text) if text.trim().is_empty() => {}
            Ok(text) => {
                let version = serde_json::from_str::<Version>(&text)
                    .map_err(|e| {
                        error(format!(
                            "not a cost cache ({e}); name another file (`CASCADE_COSTS`, \
                             `--cache`), or delete it"
                        ))
                    })?
                    .version;
                if version == VERSION {
                    match serde_json::from_str::<CacheFile>(&text) {
                        Ok(file) => {
                            // An entry edited out of shape is measured again.
                            cache.entries = file.entries;
                            cache.entries.retain(|_, e| e.cost.is_well_formed());
                        }
                        Err(e) => {
                            let damaged = error(format!(
                                "unreadable cost cache ({e}); `cascade calibrate` replaces it, \
                                 or delete it"
                            ));
                            return Ok((cache, Some(damaged)));
                        }
                    }
                } else if version > VERSION {
                    cache.newer = Some(version);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(error(format!("cannot read the cost cache: {e}"))),
        }
        Ok((cache, None))
    }

    /// If a newer build wrote the file, says so (`PATH: written by a newer cascade (cost cache
    /// format N; this build reads 3)`): this build then measures what it needs on every run
    /// and does not save.
    pub fn written_by_newer_build(&self) -> Option<String> {
        self.newer.map(|v| {
            format!(
                "{}: written by a newer cascade (cost cache format {v}; this build reads {VERSION})",
                self.path.display()
            )
        })
    }

    /// The cache file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The key of a model on this machine (with the size of its trimmed vocabulary, if any).
    pub fn key(subject: Subject) -> String {
        let model = subject.model;
        let meta = std::fs::metadata(&model.path).ok();
        let size = meta.as_ref().map_or(0, |m| m.len());
        let mtime = meta
            .and_then(|m| m.modified().ok())
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs());
        let name = model
            .path
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into());
        let vocabulary = subject
            .vocabulary
            .map_or(String::new(), |v| format!(" | vocabulary {}", v.len()));
        format!(
            "{name} {size} {mtime} | {} | {} | {} threads{vocabulary} | code {}",
            cpu_name(),
            model.weights.kernels,
            candle_core::utils::get_num_threads(),
            env!("CASCADE_MODEL_CODE")
        )
    }

    /// The cached cost of `subject`, if measured on this machine.
    pub fn get(&self, subject: Subject) -> Option<&ForwardCost> {
        self.entries.get(&Self::key(subject)).map(|e| &e.cost)
    }

    /// The costs of `models`, measuring (together, interleaved) those not cached, or all of
    /// them with `remeasure`, and adding them to the cache file (read again first: other
    /// processes may write it too). `events` hears which models are being measured, of every
    /// cost returned that was measured while other work had the CPU (such costs are too high,
    /// but they are cached all the same: a busy machine would otherwise measure again on every
    /// run, slower still; the warning comes with every use until `cascade calibrate` measures
    /// them anew), and of costs the file could not keep.
    pub fn costs(
        &mut self,
        models: &[Subject],
        remeasure: bool,
        events: &mut dyn FnMut(CostEvent),
    ) -> Result<Vec<ForwardCost>> {
        // Keyed once: a model file rewritten meanwhile would change its key.
        let keys: Vec<String> = models.iter().map(|&m| Self::key(m)).collect();
        let missing: Vec<(Subject, &String)> = models
            .iter()
            .copied()
            .zip(&keys)
            .filter(|(_, k)| remeasure || !self.entries.contains_key(*k))
            .collect();
        if !missing.is_empty() {
            let names: Vec<String> = missing.iter().map(|&(m, _)| Self::label(m)).collect();
            events(CostEvent::Measuring(&names));
            let subjects: Vec<Subject> = missing.iter().map(|&(m, _)| m).collect();
            let measured = measure(&subjects, REPS)?;
            let now = crate::bench::utc_now();
            let fresh: Vec<(String, Entry)> = missing
                .iter()
                .zip(measured.costs)
                .map(|(&(_, key), cost)| {
                    let entry = Entry {
                        measured: now.clone(),
                        cost,
                        cpu_share: measured.cpu_share,
                    };
                    (key.clone(), entry)
                })
                .collect();
            if let Err(e) = self.record(fresh, &keys) {
                events(CostEvent::NotSaved(&e.to_string()));
            }
        }
        let entries: Vec<&Entry> = keys
            .iter()
            .map(|k| self.entries.get(k).expect("measured above"))
            .collect();
        // One warning per contended measurement, naming the models it measured.
        let mut warnings: Vec<(&str, f64, Vec<String>)> = Vec::new();
        for (&m, e) in models.iter().zip(&entries) {
            let Some(share) = contended(e.cpu_share) else {
                continue;
            };
            match warnings
                .iter_mut()
                .find(|w| w.0 == e.measured && w.1 == share)
            {
                Some(w) => w.2.push(Self::label(m)),
                None => warnings.push((&e.measured, share, vec![Self::label(m)])),
            }
        }
        for (measured, cpu_share, models) in warnings {
            events(CostEvent::Contended {
                models: &models,
                measured,
                cpu_share,
            });
        }
        Ok(entries.into_iter().map(|e| e.cost.clone()).collect())
    }

    /// A subject's name in messages: the model file, and its trimmed vocabulary's size.
    pub fn label(subject: Subject) -> String {
        subject_label(
            &crate::config::file_label(&subject.model.path),
            subject.vocabulary.map(<[u32]>::len),
        )
    }

    /// Adds the entries measured now (`fresh`) and writes the file, keeping what other
    /// processes wrote since this cache was opened: under the file's lock it is read again
    /// first, so two processes measuring different models at once keep both. The entries in
    /// `in_use` are not pruned. The entries stay in this cache even if writing fails.
    fn record(&mut self, fresh: Vec<(String, Entry)>, in_use: &[String]) -> Result<()> {
        let keys: Vec<String> = fresh.iter().map(|(k, _)| k.clone()).collect();
        self.entries.extend(fresh);
        if self.newer.is_some() {
            return Ok(()); // a newer build's file: left as it is
        }
        let _lock = crate::files::lock_beside(&self.path).map_err(|e| self.unwritable(e))?;
        // An unreadable file is replaced, as `calibrate` replaces it.
        if let Ok(on_disk) = Self::open(&self.path) {
            if on_disk.newer.is_some() {
                self.newer = on_disk.newer; // written by a newer build meanwhile
                return Ok(());
            }
            // What was measured now, and what is in use if another process pruned it.
            let mut entries = on_disk.entries;
            for (k, e) in &self.entries {
                if keys.contains(k) || (in_use.contains(k) && !entries.contains_key(k)) {
                    entries.insert(k.clone(), e.clone());
                }
            }
            self.entries = entries;
        }
        prune(&mut self.entries, in_use);
        self.save()
    }

    /// Writes the cache (to a temporary file first, so an interrupted write loses nothing);
    /// nothing where a newer build wrote the file.
    pub fn save(&self) -> Result<()> {
        if self.newer.is_some() {
            return Ok(()); // a newer build's file: left as it is
        }
        let file = CacheFile {
            version: VERSION,
            entries: self.entries.clone(),
        };
        let text = serde_json::to_string_pretty(&file).expect("plain data");
        crate::files::write_atomically(&self.path, text.as_bytes()).map_err(|e| self.unwritable(e))
    }

    /// The error of a cache file that cannot be locked or written.
    fn unwritable(&self, e: std::io::Error) -> Error {
        Error::config(
            self.path.display().to_string(),
            format!("cannot write the cost cache: {e}"),
        )
    }
}

/// The CPU: its model name, family, model and stepping (`/proc/cpuinfo`; a model name such as
/// "AMD EPYC" covers CPUs of very different speed) and the SIMD flags the kernels use, or the
/// architecture where that is unknown. It names the machine in cost-cache keys and reports.
pub fn cpu_name() -> String {
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return std::env::consts::ARCH.to_string();
    };
    let field = |key: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim())
            .unwrap_or_default()
    };
    let flags = field("flags");
    let simd: Vec<&str> = SIMD_FLAGS
        .into_iter()
        .filter(|f| flags.split(' ').any(|x| x == *f))
        .collect();
    let name = match field("model name") {
        "" => std::env::consts::ARCH,
        name => name,
    };
    format!(
        "{name}, family {} model {} stepping {} ({})",
        field("cpu family"),
        field("model"),
        field("stepping"),
        simd.join(" ")
    )
}

/// The CPU flags that decide which kernels run (AVX-512 VL, which the avx512 family needs too,
/// comes with every CPU that has AVX-512 VNNI, so it would add nothing to a cost's key).
const SIMD_FLAGS: [&str; 7] = [
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_length_measured_at_the_long_context_is_measured_at_the_short_one() {
        // The context term of a length is its long forward against its short one, timed
        // just before it.
        assert!(MEASURED_LONG.iter().all(|k| MEASURED.contains(k)));
        assert_eq!(MEASURED[0], 1);
    }

    #[test]
    fn interpolation_between_and_beyond_measured_points() {
        let p = [(1, 1.0), (2, 1.2), (4, 1.6), (8, 2.8)];
        assert_eq!(interpolate(&p, 1.0), 1.0);
        assert!((interpolate(&p, 3.0) - 1.4).abs() < 1e-12);
        assert!((interpolate(&p, 6.0) - 2.2).abs() < 1e-12);
        // Past the end: the last slope, 0.3 per token.
        assert!((interpolate(&p, 10.0) - 3.4).abs() < 1e-12);
        // Nothing measured: k tokens cost k.
        assert_eq!(interpolate(&[], 5.0), 5.0);
        // A noisy measurement where more tokens came out cheaper: r(k) still never falls.
        let noisy = ForwardCost {
            decode_seconds: 0.05,
            ratios: vec![(1, 1.0), (8, 3.0), (12, 5.0), (16, 4.5)],
            per_context: Vec::new(),
        };
        let r: Vec<f64> = (1..=64).map(|k| noisy.ratio(k as f64)).collect();
        assert!(r.windows(2).all(|w| w[0] <= w[1]), "{r:?}");
        assert_eq!((r[11], r[15]), (5.0, 5.0));
        // Past the end, the mean slope (3.5 over 15 tokens), not the falling last one.
        assert!(
            (r[63] - (4.5 + 3.5 / 15.0 * 48.0)).abs() < 1e-9,
            "{}",
            r[63]
        );
        let c = ForwardCost {
            decode_seconds: 0.05,
            ratios: p.to_vec(),
            per_context: vec![(1, 1e-5), (16, 1e-4)],
        };
        assert!((c.seconds(4) - 0.08).abs() < 1e-12);
        // 100 tokens past the calibration context: 1 ms more for one token.
        assert!((c.seconds_at(1, CONTEXT + 100) - 0.051).abs() < 1e-12);
        assert_eq!(c.seconds_at(4, 10), c.seconds(4));
    }

    #[test]
    fn a_corrupt_cache_is_an_error_that_names_it_and_a_missing_one_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("costs.json");
        assert!(CostCache::open(&path).unwrap().entries.is_empty());
        std::fs::write(&path, "").unwrap();
        assert!(CostCache::open(&path).unwrap().entries.is_empty());
        std::fs::write(&path, "[target]\nmodel = \"m.gguf\"\n").unwrap();
        let e = CostCache::open(&path).err().unwrap().to_string();
        assert!(
            e.starts_with(&format!("{}: not a cost cache (", path.display())),
            "{e}"
        );
        assert!(CostCache::open_to_replace(&path).is_err());
        let damaged = format!(r#"{{"version": {VERSION}, "entries": {{"x": 1}}}}"#);
        std::fs::write(&path, damaged).unwrap();
        let e = CostCache::open(&path).err().unwrap().to_string();
        assert!(
            e.starts_with(&format!("{}: unreadable cost cache (", path.display())),
            "{e}"
        );
        let (cache, damaged) = CostCache::open_to_replace(&path).unwrap();
        assert!(cache.entries.is_empty());
        assert_eq!(damaged.unwrap().to_string(), e);
    }

    /// A file a newer build wrote (whose entries this build may not parse) is neither read nor
    /// overwritten; an older format is read as empty and replaced.
    #[test]
    fn a_newer_builds_cache_is_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("costs.json");
        let newer = format!(
            r#"{{"version": {}, "entries": {{"x": [1, 2]}}}}"#,
            VERSION + 1
        );
        std::fs::write(&path, &newer).unwrap();
        let cache = CostCache::open(&path).unwrap();
        assert!(cache.entries.is_empty());
        assert_eq!(
            cache.written_by_newer_build().unwrap(),
            format!(
                "{}: written by a newer cascade (cost cache format {}; this build reads {VERSION})",
                path.display(),
                VERSION + 1
            )
        );
        cache.save().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), newer);
        // An older format: empty, and saving writes this build's.
        std::fs::write(&path, r#"{"version": 1, "entries": {"x": [1, 2]}}"#).unwrap();
        let cache = CostCache::open(&path).unwrap();
        assert!(cache.entries.is_empty() && cache.written_by_newer_build().is_none());
        cache.save().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(&format!(r#""version": {VERSION}"#)), "{text}");
    }

    /// An entry measured at `decode_ms` (well formed, so it is read back).
    fn entry(decode_ms: f64) -> Entry {
        Entry {
            measured: "2026-11-29 05:00".into(),
            cost: ForwardCost {
                decode_seconds: decode_ms / 1e3,
                ratios: vec![(1, 1.0), (4, 1.6)],
                per_context: Vec::new(),
            },
            cpu_share: None,
        }
    }

    /// Two processes that opened the cache before either measured each keep the other's
    /// entries when they write; a model measured again takes its new cost.
    #[test]
    fn processes_measuring_at_once_keep_each_others_costs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("costs.json");
        let (mut a, mut b) = (
            CostCache::open(&path).unwrap(),
            CostCache::open(&path).unwrap(),
        );
        a.record(vec![("a".into(), entry(10.0))], &[]).unwrap();
        b.record(vec![("b".into(), entry(20.0))], &[]).unwrap();
        let decode = |k: &str| {
            let cache = CostCache::open(&path).unwrap();
            cache.entries.get(k).map(|e| e.cost.decode_seconds)
        };
        assert_eq!((decode("a"), decode("b")), (Some(0.01), Some(0.02)));
        a.record(vec![("b".into(), entry(30.0))], &[]).unwrap();
        assert_eq!((decode("a"), decode("b")), (Some(0.01), Some(0.03)));
        // Where the file cannot be written, the costs still serve this cache, and the error
        // names the file.
        let blocked = dir.path().join("costs.json").join("costs.json");
        let mut c = CostCache::empty(&blocked);
        let e = c.record(vec![("c".into(), entry(5.0))], &[]).unwrap_err();
        assert!(
            e.to_string().starts_with(&format!(
                "{}: cannot write the cost cache: ",
                blocked.display()
            )),
            "{e}"
        );
        assert_eq!(c.entries["c"].cost.decode_seconds, 0.005);
    }

    /// The same under contention: four threads, each with the cache open as its own (the
    /// lock is the file's, so threads contend for it as processes do), record at once; the
    /// file ends with every entry.
    #[test]
    fn caches_recording_at_once_lose_no_entry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("costs.json");
        std::thread::scope(|s| {
            for t in 0..4 {
                let path = &path;
                s.spawn(move || {
                    let mut cache = CostCache::open(path).unwrap();
                    for i in 0..10 {
                        let key = format!("t{t}-{i}");
                        cache
                            .record(vec![(key, entry(1.0 + i as f64))], &[])
                            .unwrap();
                    }
                });
            }
        });
        let cache = CostCache::open(&path).unwrap();
        let mut keys: Vec<&String> = cache.entries.keys().collect();
        keys.sort();
        let mut want: Vec<String> = (0..4)
            .flat_map(|t| (0..10).map(move |i| format!("t{t}-{i}")))
            .collect();
        want.sort();
        assert_eq!(keys, want.iter().collect::<Vec<_>>());
    }

    #[test]
    fn the_cache_keeps_the_latest_entries() {
        let cost = ForwardCost {
            decode_seconds: 0.05,
            ratios: vec![(1, 1.0), (4, 1.6)],
            per_context: Vec::new(),
        };
        let mut entries: BTreeMap<String, Entry> = (0..MAX_ENTRIES + 3)
            .map(|i| {
                // Keys in another order than the times.
                let entry = Entry {
                    measured: format!("2026-11-{:02} 10:00 UTC", 1 + (i * 7) % 28),
                    cost: cost.clone(),
                    cpu_share: None,
                };
                (format!("model {i:03}"), entry)
            })
            .collect();
        let mut times: Vec<String> = entries.values().map(|e| e.measured.clone()).collect();
        times.sort();
        // An entry in use is kept however old: the oldest of all.
        let oldest = entries
            .iter()
            .min_by_key(|(k, e)| (&e.measured, *k))
            .map(|(k, _)| k.clone())
            .unwrap();
        prune(&mut entries, std::slice::from_ref(&oldest));
        assert_eq!(entries.len(), MAX_ENTRIES);
        assert!(entries.contains_key(&oldest));
        let oldest_other = entries
            .iter()
            .filter(|(k, _)| **k != oldest)
            .map(|(_, e)| &e.measured)
            .min()
            .unwrap();
        // The three dropped were the oldest after it.
        assert!(times[1..4].iter().all(|t| t <= oldest_other));
        assert_eq!(times[4], *oldest_other);
    }

    #[test]
    fn cached_costs_out_of_shape_are_measured_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("costs.json");
        let entry = |decode: f64, ratios: &str| {
            format!(
                r#"{{"measured": "now", "cost": {{"decode_seconds": {decode}, "ratios": {ratios}}}}}"#
            )
        };
        let file = format!(
            r#"{{"version": {VERSION}, "entries": {{"good": {}, "zero": {}, "descending": {}}}}}"#,
            entry(0.05, "[[1, 1.0], [4, 1.6]]"),
            entry(0.0, "[[1, 1.0], [4, 1.6]]"),
            entry(0.05, "[[1, 1.0], [4, 1.6], [2, 1.2]]"),
        );
        std::fs::write(&path, file).unwrap();
        let cache = CostCache::open(&path).unwrap();
        assert_eq!(cache.entries.keys().collect::<Vec<_>>(), ["good"]);
    }
}
