//! The one table `make bench` prints: one row per figure, each next to its anchor measured in
//! the same run, the ratio when both are numbers, the goal and whether it was met
//! (reported, never asserted), plus the context that makes numbers comparable (command,
//! machine, versions, load).

use std::fmt::Write as _;

/// One row of the table.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// `B1` … `B7`.
    pub id: &'static str,
    /// What was measured.
    pub measure: String,
    /// The figure.
    pub value: String,
    /// The anchor measured in the same run (empty when the issue names none).
    pub anchor: String,
    /// Figure ÷ anchor, when both are numbers.
    pub ratio: Option<f64>,
    /// The goal.
    pub goal: &'static str,
    /// Whether the goal was met; `None` when it cannot be judged from this run.
    pub met: Option<bool>,
    /// Counts, load average and caveats.
    pub note: String,
}

/// The run's context, printed above the table.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Context {
    /// Date (UTC).
    pub date: String,
    /// The command that produced the table.
    pub command: String,
    /// Machine: cores, memory, CPU model.
    pub machine: String,
    /// Versions of migdra and the upstream components.
    pub versions: String,
    /// Anything else to state once (heartbeat form, builds).
    pub notes: Vec<String>,
}

/// Escapes a cell: pipes would end it, newlines would end the row.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// The table as Markdown, with the context above it.
pub fn render(context: &Context, rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "- date: {}", cell(&context.date));
    let _ = writeln!(out, "- command: `{}`", context.command);
    let _ = writeln!(out, "- machine: {}", cell(&context.machine));
    let _ = writeln!(out, "- versions: {}", cell(&context.versions));
    for note in &context.notes {
        let _ = writeln!(out, "- {}", cell(note));
    }
    out.push('\n');
    out.push_str("| # | measure | result | anchor, same run | ratio | goal | met | notes |\n");
    out.push_str("|---|---|---|---|---|---|---|---|\n");
    for row in rows {
        let ratio = row.ratio.map_or_else(String::new, |r| format!("{r:.2}×"));
        let met = match row.met {
            Some(true) => "yes",
            Some(false) => "no",
            None => "—",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            row.id,
            cell(&row.measure),
            cell(&row.value),
            if row.anchor.is_empty() {
                "—".to_string()
            } else {
                cell(&row.anchor)
            },
            ratio,
            cell(row.goal),
            met,
            cell(&row.note),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rows_with_ratio_and_escapes_cells() {
        let context = Context {
            date: "2026-12-01".into(),
            command: "make bench".into(),
            machine: "2 cores".into(),
            versions: "migdra 0.1.0".into(),
            notes: vec!["heartbeat: GpuNode status".into()],
        };
        let rows = [
            Row {
                id: "B1",
                measure: "pods/s".into(),
                value: "6.0".into(),
                anchor: "8.8".into(),
                ratio: Some(6.0 / 8.8),
                goal: "≥ 80% of the anchor",
                met: Some(false),
                note: "a | b\nc".into(),
            },
            Row {
                id: "B3",
                measure: "CPU".into(),
                value: "1 %".into(),
                anchor: String::new(),
                ratio: None,
                goal: "≤ 5% of a core",
                met: None,
                note: String::new(),
            },
        ];
        let text = render(&context, &rows);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"- command: `make bench`"));
        assert!(lines.contains(&"- heartbeat: GpuNode status"));
        assert!(
            lines.contains(&"| B1 | pods/s | 6.0 | 8.8 | 0.68× | ≥ 80% of the anchor | no | a \\| b c |")
        );
        assert!(lines.contains(&"| B3 | CPU | 1 % | — |  | ≤ 5% of a core | — |  |"));
        // Header, separator and one line per row.
        assert_eq!(lines.iter().filter(|l| l.starts_with('|')).count(), 4);
    }
}
