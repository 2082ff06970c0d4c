//! Minimal SVG charts for bench reports (no plotting dependency needed for two chart types).

const W: f64 = 720.0;
const H: f64 = 360.0;
const M: f64 = 50.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// `text` with the characters XML reserves escaped (config and category names are the user's).
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn frame(title: &str, y_max: f64, y_label: &str) -> String {
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{title}</text>\
         <text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{y_label}</text>",
        W / 2.0,
        H / 2.0,
        H / 2.0
    );
    for i in 0..=4 {
        let v = y_max * i as f64 / 4.0;
        let y = H - M - (H - 2.0 * M) * i as f64 / 4.0;
        s += &format!(
            "<line x1=\"{M}\" x2=\"{}\" y1=\"{y}\" y2=\"{y}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.2}</text>",
            W - M,
            M - 6.0,
            y + 4.0
        );
    }
    s
}

fn legend(names: &[&str]) -> String {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let y = M + 16.0 * i as f64;
            format!(
                "<rect x=\"{}\" y=\"{}\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>",
                W - M - 150.0,
                y - 9.0,
                COLORS[i % COLORS.len()],
                W - M - 135.0,
                y,
                escape(n)
            )
        })
        .collect()
}

/// Acceptance rate by draft position, one line per config.
pub fn acceptance(series: &[(String, Vec<f64>)]) -> String {
    let n = series
        .iter()
        .map(|(_, v)| v.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let x = |i: usize| M + (W - 2.0 * M - 160.0) * i as f64 / (n - 1) as f64;
    let y = |v: f64| H - M - (H - 2.0 * M) * v;
    let mut s = frame(
        "Acceptance rate by draft position (given the position was reviewed)",
        1.0,
        "acceptance",
    );
    for i in 0..n {
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x(i),
            H - M + 16.0,
            i + 1
        );
    }
    for (k, (_, v)) in series.iter().enumerate() {
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(i, &a)| format!("{:.1},{:.1}", x(i), y(a)))
            .collect();
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>",
            COLORS[k % COLORS.len()],
            pts.join(" ")
        );
    }
    s += &legend(&series.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>());
    s + "</svg>\n"
}

/// Speedup over autoregressive decoding per category, grouped bars per config.
pub fn speedup(categories: &[String], series: &[(String, Vec<f64>)]) -> String {
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(1.0, f64::max)
        .ceil();
    let group = (W - 2.0 * M - 160.0) / categories.len().max(1) as f64;
    let bar = group * 0.8 / series.len().max(1) as f64;
    let y = |v: f64| H - M - (H - 2.0 * M) * v / y_max;
    let mut s = frame(
        "Speedup over autoregressive decoding by category",
        y_max,
        "speedup",
    );
    s += &format!(
        "<line x1=\"{M}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"black\" stroke-dasharray=\"4\"/>",
        W - M - 160.0,
        y(1.0),
        y(1.0)
    );
    for (c, cat) in categories.iter().enumerate() {
        let x0 = M + group * c as f64 + group * 0.1;
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x0 + group * 0.4,
            H - M + 16.0,
            escape(cat)
        );
        for (k, (_, v)) in series.iter().enumerate() {
            let val = v.get(c).copied().unwrap_or(0.0);
            s += &format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"/>",
                x0 + bar * k as f64,
                y(val),
                bar * 0.95,
                (H - M - y(val)).max(0.0),
                COLORS[k % COLORS.len()]
            );
        }
    }
    s += &legend(&series.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>());
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_escaped() {
        let svg = speedup(&["a<b".into()], &[("x&y".into(), vec![1.2])]);
        assert!(svg.contains("a&lt;b") && svg.contains("x&amp;y"), "{svg}");
        assert!(!svg.contains("a<b") && !svg.contains("x&y"));
    }
}
