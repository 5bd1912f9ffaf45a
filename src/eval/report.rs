//! What `lorafit eval` shows: the verifiable-instruction scores aggregated IFEval's way
//! (prompt and instruction level, strict and loose, and per instruction kind), and the tables a
//! person reads: plain-text tables for the terminal and a markdown before/after report.
//!
//! [`IfevalScores`] and [`ChartRow`] hold plain numbers so that a chart can be drawn from them
//! without parsing text; [`preference_chart`] and [`ifeval_chart`] draw the before/after bar
//! charts (`crate::plot`) that `lorafit eval --compare --report FILE.md` writes as `FILE.png`.

use super::ifeval::Verdicts;
use super::preference::{PreferenceComparison, PreferenceRun, HEADLINE};
use crate::plot::{BarChart, Canvas};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// Strict and loose accuracy of one instruction kind.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindScore {
    /// The instruction id, e.g. `punctuation:no_comma`.
    pub id: String,
    /// Instructions of this kind scored.
    pub count: usize,
    pub strict: f64,
    pub loose: f64,
}

/// Accuracies over a prompt set, each a fraction in [0, 1].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IfevalScores {
    pub prompts: usize,
    pub instructions: usize,
    pub prompt_strict: f64,
    pub prompt_loose: f64,
    pub instruction_strict: f64,
    pub instruction_loose: f64,
    /// Per instruction kind, sorted by id.
    pub by_kind: Vec<KindScore>,
}

/// Aggregates per-prompt verdicts. `ids[i]` are prompt i's instruction ids, in the order of
/// `verdicts[i]`.
pub fn aggregate(ids: &[Vec<String>], verdicts: &[Verdicts]) -> IfevalScores {
    let prompts = verdicts.len();
    let frac = |n: usize, d: usize| if d == 0 { 0.0 } else { n as f64 / d as f64 };
    let mut kinds: BTreeMap<&str, (usize, usize, usize)> = BTreeMap::new();
    let (mut inst, mut inst_strict, mut inst_loose) = (0, 0, 0);
    for (prompt_ids, v) in ids.iter().zip(verdicts) {
        for ((id, &s), &l) in prompt_ids.iter().zip(&v.strict).zip(&v.loose) {
            let k = kinds.entry(id.as_str()).or_default();
            k.0 += 1;
            k.1 += s as usize;
            k.2 += l as usize;
            inst += 1;
            inst_strict += s as usize;
            inst_loose += l as usize;
        }
    }
    IfevalScores {
        prompts,
        instructions: inst,
        prompt_strict: frac(verdicts.iter().filter(|v| v.all_strict()).count(), prompts),
        prompt_loose: frac(verdicts.iter().filter(|v| v.all_loose()).count(), prompts),
        instruction_strict: frac(inst_strict, inst),
        instruction_loose: frac(inst_loose, inst),
        by_kind: kinds
            .into_iter()
            .map(|(id, (n, s, l))| KindScore {
                id: id.to_string(),
                count: n,
                strict: frac(s, n),
                loose: frac(l, n),
            })
            .collect(),
    }
}

/// One bar pair of a before/after chart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChartRow {
    pub label: String,
    pub before: f64,
    pub after: f64,
}

/// The before/after numbers of two IFEval runs, headline rows first, then one strict and one
/// loose row per instruction kind present in either run (a kind missing from one run is 0 there).
pub fn ifeval_chart_rows(before: &IfevalScores, after: &IfevalScores) -> Vec<ChartRow> {
    let row = |label: &str, b: f64, a: f64| ChartRow {
        label: label.to_string(),
        before: b,
        after: a,
    };
    let mut rows = vec![
        row("prompt strict", before.prompt_strict, after.prompt_strict),
        row("prompt loose", before.prompt_loose, after.prompt_loose),
        row(
            "instruction strict",
            before.instruction_strict,
            after.instruction_strict,
        ),
        row(
            "instruction loose",
            before.instruction_loose,
            after.instruction_loose,
        ),
    ];
    let mut ids: Vec<&str> = before
        .by_kind
        .iter()
        .chain(&after.by_kind)
        .map(|k| k.id.as_str())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    let find = |s: &IfevalScores, id: &str| s.by_kind.iter().find(|k| k.id == id).cloned();
    for id in ids {
        let (b, a) = (find(before, id), find(after, id));
        let get = |k: &Option<KindScore>, f: fn(&KindScore) -> f64| k.as_ref().map_or(0.0, f);
        rows.push(row(
            &format!("{id} strict"),
            get(&b, |k| k.strict),
            get(&a, |k| k.strict),
        ));
        rows.push(row(
            &format!("{id} loose"),
            get(&b, |k| k.loose),
            get(&a, |k| k.loose),
        ));
    }
    rows
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

fn signed_pct(x: f64) -> String {
    format!("{:+.1}", 100.0 * x)
}

/// Markdown for one IFEval run.
pub fn ifeval_markdown(title: &str, s: &IfevalScores) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# {title}\n");
    let _ = writeln!(
        out,
        "{} prompts, {} instructions.\n",
        s.prompts, s.instructions
    );
    let _ = writeln!(out, "| level | strict | loose |\n|---|---|---|");
    let _ = writeln!(
        out,
        "| prompt | {} | {} |",
        pct(s.prompt_strict),
        pct(s.prompt_loose)
    );
    let _ = writeln!(
        out,
        "| instruction | {} | {} |\n",
        pct(s.instruction_strict),
        pct(s.instruction_loose)
    );
    let _ = writeln!(
        out,
        "| instruction kind | n | strict | loose |\n|---|---|---|---|"
    );
    for k in &s.by_kind {
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            k.id,
            k.count,
            pct(k.strict),
            pct(k.loose)
        );
    }
    out
}

/// The before/after markdown report of two IFEval runs over one prompt set.
pub fn ifeval_comparison_markdown(
    title: &str,
    before_name: &str,
    after_name: &str,
    before: &IfevalScores,
    after: &IfevalScores,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# {title}\n");
    let _ = writeln!(
        out,
        "Before: `{before_name}`. After: `{after_name}`. {} prompts, {} instructions. \
         Strict checks the response as generated; loose also accepts it with the first and/or \
         last line removed and `*` deleted (IFEval's rule). Change in percentage points.\n",
        after.prompts, after.instructions
    );
    let _ = writeln!(
        out,
        "| level | strict before | strict after | change | loose before | loose after | change |\n|---|---|---|---|---|---|---|"
    );
    for (name, bs, as_, bl, al) in [
        (
            "prompt",
            before.prompt_strict,
            after.prompt_strict,
            before.prompt_loose,
            after.prompt_loose,
        ),
        (
            "instruction",
            before.instruction_strict,
            after.instruction_strict,
            before.instruction_loose,
            after.instruction_loose,
        ),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} | {} | {} | {} |",
            pct(bs),
            pct(as_),
            signed_pct(as_ - bs),
            pct(bl),
            pct(al),
            signed_pct(al - bl)
        );
    }
    let _ = writeln!(
        out,
        "\n| instruction kind | n | strict before | strict after | loose before | loose after |\n|---|---|---|---|---|---|"
    );
    let rows = ifeval_chart_rows(before, after);
    // Rows after the four headline ones come in (strict, loose) pairs per kind.
    for pair in rows[4..].chunks(2) {
        let [s, l] = pair else { continue };
        let id = s.label.trim_end_matches(" strict");
        let n = after
            .by_kind
            .iter()
            .chain(&before.by_kind)
            .find(|k| k.id == id)
            .map_or(0, |k| k.count);
        let _ = writeln!(
            out,
            "| `{id}` | {n} | {} | {} | {} | {} |",
            pct(s.before),
            pct(s.after),
            pct(l.before),
            pct(l.after)
        );
    }
    out
}

/// The headline metrics of one preference run as a terminal table.
pub fn preference_table(run: &PreferenceRun) -> String {
    let mut out = format!("{} preference pairs, {}\n", run.examples.len(), run.subject);
    for k in HEADLINE {
        if let Some(v) = run.overall.get(k) {
            let _ = writeln!(out, "  {k:<10} {v:>10.4}");
        }
    }
    out
}

/// Before/after headline metrics as a terminal table (the demo's and `--compare`'s).
pub fn preference_comparison_table(c: &PreferenceComparison) -> String {
    let mut out = format!(
        "{} preference pairs: before = {}, after = {}\n",
        c.per_example.len(),
        c.before.subject,
        c.after.subject
    );
    let _ = writeln!(
        out,
        "  {:<10} {:>10} {:>10} {:>10}",
        "", "before", "after", "change"
    );
    for k in HEADLINE {
        let (Some(b), Some(a)) = (c.before.overall.get(k), c.after.overall.get(k)) else {
            continue;
        };
        let _ = writeln!(out, "  {k:<10} {b:>10.4} {a:>10.4} {:>+10.4}", a - b);
    }
    let improved = c
        .per_example
        .iter()
        .filter(|e| e.delta.get("margin").is_some_and(|d| *d > 0.0))
        .count();
    let _ = writeln!(
        out,
        "  margin grew on {improved} of {} pairs",
        c.per_example.len()
    );
    out
}

/// The headline metrics of one preference run as markdown.
pub fn preference_markdown(run: &PreferenceRun) -> String {
    let mut out = format!(
        "{} preference pairs, `{}`.\n\n| metric | value |\n|---|---|\n",
        run.examples.len(),
        run.subject
    );
    for k in HEADLINE {
        if let Some(v) = run.overall.get(k) {
            let _ = writeln!(out, "| {k} | {v:.4} |");
        }
    }
    out
}

/// Before/after headline metrics as markdown.
pub fn preference_comparison_markdown(c: &PreferenceComparison) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| metric | before (`{}`) | after (`{}`) | change |\n|---|---|---|---|",
        c.before.subject, c.after.subject
    );
    for k in HEADLINE {
        let (Some(b), Some(a)) = (c.before.overall.get(k), c.after.overall.get(k)) else {
            continue;
        };
        let _ = writeln!(out, "| {k} | {b:.4} | {a:.4} | {:+.4} |", a - b);
    }
    out
}

/// A subject's name short enough for a legend: a path's last two components.
fn legend_name(subject: &str) -> String {
    let parts: Vec<&str> = subject.trim_end_matches('/').rsplit('/').take(3).collect();
    if parts.len() <= 2 {
        return subject.to_string();
    }
    format!(".../{}/{}", parts[1], parts[0])
}

/// The legend entries of a before/after chart.
fn legend(before: &str, after: &str) -> [String; 2] {
    [
        format!("before: {}", legend_name(before)),
        format!("after: {}", legend_name(after)),
    ]
}

/// The before/after chart of a preference comparison: accuracy and mean margin, each in its own
/// panel with its own scale (accuracy is a fraction, the margin a log-odds difference).
pub fn preference_chart(c: &PreferenceComparison, (width, height): (usize, usize)) -> Canvas {
    let [b, a] = legend(&c.before.subject, &c.after.subject);
    let value = |run: &PreferenceRun, k: &str| run.overall.get(k).copied().unwrap_or(f64::NAN);
    let mut canvas = Canvas::new(width, height);
    let panel_w = width / 2;
    for (i, (key, title, label)) in [
        ("accuracy", "Preference accuracy", "accuracy"),
        ("margin", "Mean margin", "margin"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut chart = BarChart::new(title, label, &[label]);
        chart.series(&b, vec![value(&c.before, key)]);
        chart.series(&a, vec![value(&c.after, key)]);
        canvas.blit(&chart.render(panel_w, height), i * panel_w, 0);
    }
    canvas
}

/// The before/after chart of two IFEval runs: strict and loose accuracy at prompt and
/// instruction level.
pub fn ifeval_chart(
    before_name: &str,
    after_name: &str,
    before: &IfevalScores,
    after: &IfevalScores,
    (width, height): (usize, usize),
) -> Canvas {
    let rows = ifeval_chart_rows(before, after);
    let rows = &rows[..4];
    let labels = [
        "prompt strict",
        "prompt loose",
        "instr. strict",
        "instr. loose",
    ];
    let [b, a] = legend(before_name, after_name);
    let mut chart = BarChart::new(
        "Verifiable-instruction following, before and after",
        "accuracy",
        &labels,
    );
    chart.series(&b, rows.iter().map(|r| r.before).collect());
    chart.series(&a, rows.iter().map(|r| r.after).collect());
    chart.render(width, height)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(strict: &[bool], loose: &[bool]) -> Verdicts {
        Verdicts {
            strict: strict.to_vec(),
            loose: loose.to_vec(),
        }
    }

    fn ids(list: &[&[&str]]) -> Vec<Vec<String>> {
        list.iter()
            .map(|p| p.iter().map(|s| s.to_string()).collect())
            .collect()
    }

    #[test]
    fn aggregate_counts_prompts_instructions_and_kinds() {
        let ids = ids(&[&["a", "b"], &["a"], &["b", "c"]]);
        let verdicts = [
            v(&[true, false], &[true, true]),
            v(&[true], &[true]),
            v(&[false, false], &[true, false]),
        ];
        let s = aggregate(&ids, &verdicts);
        assert_eq!((s.prompts, s.instructions), (3, 5));
        assert_eq!(s.prompt_strict, 1.0 / 3.0);
        assert_eq!(s.prompt_loose, 2.0 / 3.0);
        assert_eq!(s.instruction_strict, 2.0 / 5.0);
        assert_eq!(s.instruction_loose, 4.0 / 5.0);
        let kinds: Vec<(&str, usize, f64, f64)> = s
            .by_kind
            .iter()
            .map(|k| (k.id.as_str(), k.count, k.strict, k.loose))
            .collect();
        assert_eq!(
            kinds,
            vec![("a", 2, 1.0, 1.0), ("b", 2, 0.0, 1.0), ("c", 1, 0.0, 0.0)]
        );
    }

    #[test]
    fn chart_rows_and_markdown_pair_kinds_across_runs() {
        let before = aggregate(
            &ids(&[&["a"], &["b"]]),
            &[v(&[false], &[true]), v(&[true], &[true])],
        );
        let after = aggregate(
            &ids(&[&["a"], &["c"]]),
            &[v(&[true], &[true]), v(&[true], &[true])],
        );
        let rows = ifeval_chart_rows(&before, &after);
        let labels: Vec<&str> = rows.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "prompt strict",
                "prompt loose",
                "instruction strict",
                "instruction loose",
                "a strict",
                "a loose",
                "b strict",
                "b loose",
                "c strict",
                "c loose"
            ]
        );
        assert_eq!((rows[0].before, rows[0].after), (0.5, 1.0));
        assert_eq!((rows[4].before, rows[4].after), (0.0, 1.0));
        // "b" is absent after, "c" absent before: 0 there.
        assert_eq!((rows[6].before, rows[6].after), (1.0, 0.0));
        assert_eq!((rows[8].before, rows[8].after), (0.0, 1.0));
        let md = ifeval_comparison_markdown("t", "base", "adapter", &before, &after);
        assert!(
            md.contains("| prompt | 50.0% | 100.0% | +50.0 | 100.0% | 100.0% | +0.0 |"),
            "{md}"
        );
        assert!(
            md.contains("| `a` | 1 | 0.0% | 100.0% | 100.0% | 100.0% |"),
            "{md}"
        );
        assert!(
            md.contains("| `c` | 1 | 0.0% | 100.0% | 0.0% | 100.0% |"),
            "{md}"
        );
    }
}
