//! Command line: `kubectl migdra layout|fits|claims`, with kubectl's usual connection flags
//! (accepted before or after the command, since kubectl passes everything after `migdra`).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use migdra_api::{inventory::DEFAULT_DRIVER_NAME, profile::ProfileName};

use crate::{
    claims,
    client::{self, ClientError, KubeOptions, Needs},
    fits::{self, Shape},
    layout,
    render::{self, Format, RenderError, Style},
};

/// Shows migdra's MIG layouts, where a new claim would land, and the state of claims.
#[derive(Debug, Parser)]
#[command(name = "kubectl-migdra", bin_name = "kubectl migdra", version)]
pub struct Cli {
    /// Connection and output options.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to show.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Path to the kubeconfig file.
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Namespace of the claims to show (`claims`); default: the context's namespace.
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
    /// Claims of all namespaces (`claims`).
    #[arg(short = 'A', long, global = true)]
    pub all_namespaces: bool,
    /// The DRA driver name migdra was installed with.
    #[arg(long, global = true, default_value = DEFAULT_DRIVER_NAME)]
    pub driver: String,
    /// Output format.
    #[arg(short = 'o', long, global = true, value_enum, default_value_t = Format::Text)]
    pub output: Format,
    /// No colours, even on a terminal (also when NO_COLOR is set).
    #[arg(long, global = true)]
    pub no_color: bool,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Per node and GPU: the memory-slice map, each instance with its claim and pods,
    /// foreign instances, free placements per profile and fragmentation.
    Layout {
        /// Nodes to show (all GPU nodes when none).
        nodes: Vec<String>,
    },
    /// Where a new claim for one MIG device would land now under the published device
    /// order, or why it cannot. Exits 1 when it lands on no node.
    Fits {
        /// A MIG profile, e.g. 3g.40gb.
        #[arg(required_unless_present = "memory", conflicts_with = "memory")]
        profile: Option<String>,
        /// Instead of a profile: any MIG device with at least this much memory, e.g. 20Gi.
        #[arg(long)]
        memory: Option<String>,
        /// Only this node.
        #[arg(long)]
        node: Option<String>,
    },
    /// Claims of migdra's devices with their pods, devices and state.
    Claims,
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The cluster could not be read.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The output could not be written.
    #[error(transparent)]
    Render(#[from] RenderError),
}

/// What a command printed, and how it ends.
#[derive(Debug)]
pub struct Outcome {
    pub stdout: String,
    /// Warnings for standard error (what could not be read).
    pub warnings: Vec<String>,
    pub exit_code: u8,
}

/// Runs one command against the cluster.
pub async fn run(cli: Cli) -> Result<Outcome, CliError> {
    let global = &cli.global;
    let shape = match &cli.command {
        Command::Fits { profile, memory, .. } => Some(parse_shape(profile.as_deref(), memory.as_deref())?),
        _ => None,
    };
    let connection = client::connect(&KubeOptions {
        kubeconfig: global.kubeconfig.clone(),
        context: global.context.clone(),
    })
    .await?;
    let style = Style::detect(global.no_color);
    let needs = match &cli.command {
        Command::Layout { .. } => Needs {
            gpu_nodes: true,
            claims: true,
            pods: true,
            ..Needs::default()
        },
        Command::Fits { .. } => Needs {
            gpu_nodes: true,
            slices: true,
            claims: true,
            policies: true,
            ..Needs::default()
        },
        Command::Claims => Needs {
            namespace: (!global.all_namespaces).then(|| {
                global
                    .namespace
                    .clone()
                    .unwrap_or_else(|| connection.default_namespace.clone())
            }),
            gpu_nodes: true,
            claims: true,
            pods: true,
            events: true,
            device_classes: true,
            ..Needs::default()
        },
    };
    let snapshot = client::snapshot(&connection, &global.driver, &needs).await?;
    let mut exit_code = 0;
    let stdout = match (&cli.command, shape) {
        (Command::Layout { nodes }, _) => {
            let view = layout::build(&snapshot, nodes);
            output(&view, global.output, |v| render::text::layout(v, &style))?
        }
        (Command::Fits { node, .. }, shape) => {
            let shape = shape.ok_or_else(|| CliError::Usage("fits needs a PROFILE or --memory".into()))?;
            let view = fits::build(&snapshot, &shape, node.as_deref());
            if view.nodes.iter().all(|n| n.lands.is_none()) {
                exit_code = 1;
            }
            output(&view, global.output, |v| render::text::fits(v, &style))?
        }
        (Command::Claims, _) => {
            let view = claims::build(&snapshot, needs.namespace.as_deref());
            output(&view, global.output, |v| render::text::claims(v, &style))?
        }
    };
    Ok(Outcome {
        stdout,
        warnings: snapshot.warnings,
        exit_code,
    })
}

/// The shape `fits` asks about.
pub fn parse_shape(profile: Option<&str>, memory: Option<&str>) -> Result<Shape, CliError> {
    match (profile, memory) {
        (Some(p), None) => p
            .parse::<ProfileName>()
            .map(Shape::Profile)
            .map_err(|e| CliError::Usage(e.to_string())),
        (None, Some(m)) => Shape::memory(m).map_err(CliError::Usage),
        _ => Err(CliError::Usage(
            "give either a PROFILE or --memory, not both".into(),
        )),
    }
}

fn output<T: serde::Serialize>(
    view: &T,
    format: Format,
    text: impl Fn(&T) -> String,
) -> Result<String, CliError> {
    Ok(match format {
        Format::Text => text(view),
        Format::Json => render::json(view)?,
        Format::Yaml => render::yaml(view)?,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn global_flags_are_accepted_after_the_command_as_kubectl_passes_them() {
        let cli = Cli::try_parse_from([
            "kubectl-migdra",
            "claims",
            "-n",
            "team-b",
            "-o",
            "json",
            "--context",
            "prod",
        ])
        .unwrap();
        assert!(matches!(cli.command, Command::Claims));
        assert_eq!(cli.global.namespace.as_deref(), Some("team-b"));
        assert_eq!(cli.global.output, Format::Json);
        assert_eq!(cli.global.context.as_deref(), Some("prod"));
        assert_eq!(cli.global.driver, DEFAULT_DRIVER_NAME);
    }

    #[test]
    fn fits_takes_a_profile_or_a_memory_size_but_not_both() {
        let cli =
            Cli::try_parse_from(["kubectl-migdra", "fits", "--memory", "20Gi", "--node", "n1"]).unwrap();
        let Command::Fits {
            profile,
            memory,
            node,
        } = cli.command
        else {
            panic!("not fits")
        };
        assert_eq!(
            (profile, memory.as_deref(), node.as_deref()),
            (None, Some("20Gi"), Some("n1"))
        );
        assert!(Cli::try_parse_from(["kubectl-migdra", "fits"]).is_err());
        assert!(Cli::try_parse_from(["kubectl-migdra", "fits", "1g.10gb", "--memory", "1Gi"]).is_err());
        assert!(matches!(
            parse_shape(Some("3g.40gb"), None),
            Ok(Shape::Profile(_))
        ));
        assert!(matches!(parse_shape(Some("3g"), None), Err(CliError::Usage(_))));
        assert!(
            matches!(parse_shape(None, Some("20Gi")), Ok(Shape::Memory { bytes, .. }) if bytes == 20 << 30)
        );
    }
}
