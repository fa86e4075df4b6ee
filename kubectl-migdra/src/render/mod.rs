//! Output of the views: text for people (coloured on a terminal, plain when piped, with
//! `--no-color` or with `NO_COLOR` set) and JSON or YAML for scripts (the views' serde form).

pub mod text;

use std::io::IsTerminal;

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Text for people.
    Text,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

/// Why a view could not be serialised.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("writing JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("writing YAML: {0}")]
    Yaml(#[from] serde_saphyr::SerializeError),
}

/// A view as pretty JSON with a trailing newline.
pub fn json<T: Serialize>(view: &T) -> Result<String, RenderError> {
    let mut out = serde_json::to_string_pretty(view)?;
    out.push('\n');
    Ok(out)
}

/// A view as YAML.
pub fn yaml<T: Serialize>(view: &T) -> Result<String, RenderError> {
    Ok(serde_saphyr::to_string(view)?)
}

/// Whether text is coloured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Style {
    pub color: bool,
}

/// The colours text uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paint {
    Bold,
    /// Secondary detail.
    Dim,
    /// Free capacity, healthy, prepared.
    Green,
    /// Foreign instances, allocated but not prepared.
    Yellow,
    /// Failures, unhealthy GPUs.
    Red,
    /// migdra's instances.
    Cyan,
    /// Partitions allocated but not created yet.
    Magenta,
}

impl Style {
    pub const PLAIN: Style = Style { color: false };

    /// Colours only when standard output is a terminal, `--no-color` was not given and
    /// `NO_COLOR` is unset or empty (<https://no-color.org>).
    pub fn detect(no_color_flag: bool) -> Style {
        let no_color_env = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Style {
            color: !no_color_flag && !no_color_env && std::io::stdout().is_terminal(),
        }
    }

    /// `text` in `paint`, or `text` itself without colours.
    pub fn paint(&self, text: &str, paint: Paint) -> String {
        if !self.color || text.is_empty() {
            return text.to_string();
        }
        let code = match paint {
            Paint::Bold => "1",
            Paint::Dim => "2",
            Paint::Green => "32",
            Paint::Yellow => "33",
            Paint::Red => "31",
            Paint::Cyan => "36",
            Paint::Magenta => "35",
        };
        format!("\x1b[{code}m{text}\x1b[0m")
    }
}
