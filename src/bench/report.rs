//! The bench report: `report.json` (the fields are documented on the types), `report.md`
//! (the tables), and two SVG charts.

use super::measure::ModelCost;
use super::plot;
use super::run::{BenchOptions, RunRecord};
use super::summary::Summary;
use crate::error::Result;
use crate::gate::BUCKET_EDGES;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The whole report (`report.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// When the run started (UTC).
    pub date: String,
    /// Compute threads used.
    pub threads: usize,
    /// The CPU ([`crate::costs::cpu_name`]).
    #[serde(default)]
    pub cpu: String,
    /// The kernel family the models ran with.
    #[serde(default)]
    pub kernels: String,
    /// The command line that produced the report.
    pub command: String,
    /// The run's settings.
    pub options: BenchOptions,
    /// (k, r(k)): target forward over k tokens relative to one.
    pub verify_cost: Vec<(usize, f64)>,
    /// Every model's measured cost.
    pub models: Vec<ModelCost>,
    /// One record per (config, prompt, repeat).
    pub runs: Vec<RunRecord>,
    /// Aggregates per config and category.
    pub summary: Vec<Summary>,
    /// True if Ctrl-C or a failed generation stopped the run early (the report holds what was
    /// gathered).
    pub interrupted: bool,
}

impl Report {
    /// Writes `report.json`, `report.md`, `acceptance.svg` and `speedup.svg` into `dir`
    /// (created if missing); returns the markdown: a line naming the machine and the
    /// measured costs, then the tables.
    pub fn write(&self, dir: &Path) -> Result<String> {
        std::fs::create_dir_all(dir)?;
        let table = format!("{}\n\n{}", self.costs_line(), markdown(&self.summary));
        let json = serde_json::to_string_pretty(self).expect("plain data");
        let write =
            |name: &str, bytes: &[u8]| crate::files::write_atomically(&dir.join(name), bytes);
        write("report.json", json.as_bytes())?;
        write("report.md", table.as_bytes())?;
        let overall = || self.summary.iter().filter(|s| s.category == "all");
        let acceptance: Vec<(String, Vec<f64>)> = overall()
            .filter(|s| s.config != "autoregressive")
            .map(|s| (s.config.clone(), s.acceptance_by_position.clone()))
            .collect();
        let mut categories: Vec<String> = self
            .summary
            .iter()
            .map(|s| s.category.clone())
            .filter(|c| c != "all")
            .collect();
        categories.sort();
        categories.dedup();
        let speedups: Vec<(String, Vec<f64>)> = overall()
            .filter(|s| s.config != "autoregressive")
            .map(|s| {
                let v = categories
                    .iter()
                    .map(|c| {
                        self.summary
                            .iter()
                            .find(|x| x.config == s.config && &x.category == c)
                            .map_or(0.0, |x| x.speedup_mean)
                    })
                    .collect();
                (s.config.clone(), v)
            })
            .collect();
        write("acceptance.svg", plot::acceptance(&acceptance).as_bytes())?;
        write(
            "speedup.svg",
            plot::speedup(&categories, &speedups).as_bytes(),
        )?;
        Ok(table)
    }

    /// Greedy runs whose tokens differ from autoregressive decoding (a bug if any).
    pub fn greedy_mismatches(&self) -> usize {
        self.summary
            .iter()
            .filter(|s| s.category == "all")
            .map(|s| s.greedy_mismatches)
            .sum()
    }

    /// One line: each model's decode time and c, and the target's r(k).
    pub fn costs_line(&self) -> String {
        let costs: Vec<String> = self
            .models
            .iter()
            .map(|m| {
                format!(
                    "{} {:.1} ms (c = {:.2})",
                    m.model, m.decode_ms, m.c_measured
                )
            })
            .collect();
        let r: Vec<String> = self
            .verify_cost
            .iter()
            .map(|(k, r)| format!("r({k}) = {r:.2}"))
            .collect();
        let contended = match self.models.iter().find_map(ModelCost::contended) {
            Some(share) => format!(
                " (measured while other work had the CPU, {:.0}% of this process's threads' \
                 time: too high)",
                share * 100.0
            ),
            None => String::new(),
        };
        format!(
            "{}, {} kernels, {} threads; decode: {}; verify: {}{contended}",
            self.cpu,
            self.kernels,
            self.threads,
            costs.join(", "),
            r.join(", ")
        )
    }
}

/// The current time as `YYYY-MM-DD HH:MM UTC`.
pub fn utc_now() -> String {
    let t = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    format!("{} {} UTC", &t[..10], &t[11..16])
}

/// The terminal / README table: one row per config over the whole suite, then speedup per
/// category.
pub fn markdown(summary: &[Summary]) -> String {
    let mut out = String::from(
        "| config | tokens/s | speedup (± sd) | end to end | tokens/call | SWI (params) | SWI (measured c) | predicted (paper) | predicted (CPU) | predicted (run-time cost model) | greedy mismatches |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for s in summary.iter().filter(|s| s.category == "all") {
        out += &format!(
            "| {} | {:.1} | {:.2} ± {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} |\n",
            s.config,
            s.decode_tokens_per_second,
            s.speedup_mean,
            s.speedup_sd,
            s.end_to_end_mean,
            s.tokens_per_call,
            s.swi_params,
            s.swi_measured,
            s.predicted_paper,
            s.predicted_cpu,
            s.predicted_runtime
                .map_or("-".into(), |p| format!("{p:.2}")),
            s.greedy_mismatches
        );
    }
    let mut cats: Vec<&str> = summary
        .iter()
        .map(|s| s.category.as_str())
        .filter(|c| *c != "all")
        .collect();
    cats.sort();
    cats.dedup();
    out += &format!(
        "\n| speedup by category | {} |\n|---|{}\n",
        cats.join(" | "),
        "---|".repeat(cats.len())
    );
    let mut configs: Vec<&str> = Vec::new();
    for s in summary {
        if !configs.contains(&s.config.as_str()) {
            configs.push(&s.config);
        }
    }
    for c in configs {
        let cells: Vec<String> = cats
            .iter()
            .map(|cat| {
                summary
                    .iter()
                    .find(|s| s.config == c && s.category == *cat)
                    .map_or("-".into(), |s| format!("{:.2}", s.speedup_mean))
            })
            .collect();
        out += &format!("| {c} | {} |\n", cells.join(" | "));
    }
    out + &acceptance_table(summary) + &confidence_table(summary)
}

/// Acceptance by draft position at every review level (CS Drafting Figure 1), over the
/// suite, for the first positions.
fn acceptance_table(summary: &[Summary]) -> String {
    const SHOWN: usize = 10;
    let mut rows: Vec<(String, &[f64])> = Vec::new();
    for s in summary.iter().filter(|s| s.category == "all") {
        if !s.acceptance_by_position.is_empty() {
            rows.push((format!("{} (target)", s.config), &s.acceptance_by_position));
        }
        for (node, a) in &s.acceptance_by_level {
            rows.push((format!("{}: `{node}`", s.config), a));
        }
    }
    let width = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).min(SHOWN);
    if width == 0 {
        return String::new();
    }
    let mut out = format!(
        "\n| acceptance by draft position | {} |\n|---|{}\n",
        (1..=width)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(width)
    );
    for (name, a) in rows {
        let cells: Vec<String> = (0..width)
            .map(|i| a.get(i).map_or("-".into(), |x| format!("{x:.2}")))
            .collect();
        out += &format!("| {name} | {} |\n", cells.join(" | "));
    }
    out
}

/// Acceptance by confidence bucket at the target, per config and drafter (adaptive drafting).
fn confidence_table(summary: &[Summary]) -> String {
    let rows: Vec<(String, Vec<Option<f64>>)> = summary
        .iter()
        .filter(|s| s.category == "all")
        .flat_map(|s| {
            s.acceptance_by_confidence.iter().map(move |d| {
                let cells = BUCKET_EDGES
                    .iter()
                    .map(|&e| {
                        d.buckets
                            .iter()
                            .find(|b| b.up_to == Some(e))
                            .map(|b| b.accepted as f64 / b.reviewed.max(1) as f64)
                    })
                    .collect();
                (format!("{}: `{}`", s.config, d.drafter), cells)
            })
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut lower = 0.0;
    let heads: Vec<String> = BUCKET_EDGES
        .iter()
        .map(|&e| {
            let h = format!("{lower:.2}-{e:.2}");
            lower = e;
            h
        })
        .collect();
    let mut out = format!(
        "\n| acceptance by confidence | {} |\n|---|{}\n",
        heads.join(" | "),
        "---|".repeat(heads.len())
    );
    for (name, cells) in rows {
        let cells: Vec<String> = cells
            .iter()
            .map(|c| c.map_or("-".into(), |x| format!("{x:.2}")))
            .collect();
        out += &format!("| {name} | {} |\n", cells.join(" | "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::BenchOptions;

    #[test]
    fn the_costs_line_says_when_the_costs_were_measured_on_a_busy_machine() {
        let model = |cpu_share| ModelCost {
            model: "m.gguf".into(),
            params: 1,
            decode_ms: 50.0,
            forward_cost: vec![(1, 1.0), (2, 1.2)],
            c_measured: 1.0,
            c_params: 1.0,
            cpu_share,
        };
        let report = |cpu_share| Report {
            date: utc_now(),
            threads: 2,
            cpu: "CPU".into(),
            kernels: "avx2".into(),
            command: String::new(),
            options: BenchOptions {
                max_new_tokens: 8,
                repeats: 1,
                warmup_prompts: 0,
                sampling: None,
            },
            verify_cost: vec![(1, 1.0), (2, 1.2)],
            models: vec![model(cpu_share)],
            runs: Vec::new(),
            summary: Vec::new(),
            interrupted: false,
        };
        let idle = "CPU, avx2 kernels, 2 threads; decode: m.gguf 50.0 ms (c = 1.00); verify: \
                    r(1) = 1.00, r(2) = 1.20";
        assert_eq!(report(Some(0.98)).costs_line(), idle);
        assert_eq!(report(None).costs_line(), idle);
        assert_eq!(
            report(Some(0.61)).costs_line(),
            format!(
                "{idle} (measured while other work had the CPU, 61% of this process's \
                 threads' time: too high)"
            )
        );
    }

    #[test]
    fn utc_now_is_a_plausible_date() {
        let d = utc_now();
        assert_eq!(d.len(), "2026-11-22 07:28 UTC".len(), "{d}");
        let year: i32 = d[..4].parse().unwrap();
        let month: u32 = d[5..7].parse().unwrap();
        let day: u32 = d[8..10].parse().unwrap();
        assert!(
            year >= 2024 && (1..=12).contains(&month) && (1..=31).contains(&day),
            "{d}"
        );
    }
}
