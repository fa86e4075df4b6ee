//! Text renderings of the views. The memory-slice map prints one character per slice:
//! the slice number where the entry covers it, `.` elsewhere, e.g. `[0 1 2 3 . . . .]`.

use std::fmt::Write as _;

use super::{Paint, Style};
use crate::{
    claims::{ClaimState, ClaimsView},
    fits::FitsView,
    layout::{GpuLayout, InstanceLayout, InstanceOwnerView, LayoutView, MigMode, SliceUse},
    usage::DeviceUse,
};

/// Width of the `profile@start` column.
const LABEL_WIDTH: usize = 14;

/// The layout view as text.
pub fn layout(view: &LayoutView, style: &Style) -> String {
    let mut out = String::new();
    if view.nodes.is_empty() {
        let _ = writeln!(out, "no GpuNodes of driver {}", view.driver);
    }
    for node in &view.nodes {
        let mut heading = format!(
            "{}  pool {}",
            style.paint(&format!("NODE {}", node.node), Paint::Bold),
            node.pool
        );
        match &node.plugin {
            Some(p) if p.registered => {
                let _ = write!(heading, "  plugin {} registered", p.version);
            }
            Some(p) => {
                let _ = write!(
                    heading,
                    "  plugin {} {}",
                    p.version,
                    style.paint("not registered", Paint::Red)
                );
            }
            None => {}
        }
        let _ = writeln!(out, "{heading}");
        if let Some(problem) = &node.problem {
            let _ = writeln!(out, "  {}", style.paint(problem, Paint::Yellow));
        }
        for gpu in &node.gpus {
            gpu_text(&mut out, gpu, style);
        }
    }
    out
}

fn gpu_text(out: &mut String, gpu: &GpuLayout, style: &Style) {
    let mode = match gpu.mig {
        MigMode::Enabled => "MIG on".to_string(),
        MigMode::Disabled if gpu.mode_switchable => "MIG off (switchable)".to_string(),
        MigMode::Disabled => "MIG off".to_string(),
        MigMode::Unsupported => "no MIG".to_string(),
    };
    let health = if gpu.healthy {
        String::new()
    } else {
        format!(
            "  {}",
            style.paint(
                &format!("UNHEALTHY: {}", gpu.health_reason.as_deref().unwrap_or("unknown")),
                Paint::Red
            )
        )
    };
    let _ = writeln!(
        out,
        "  {}  {}  {mode}{health}  {}",
        style.paint(&format!("GPU {}", gpu.minor), Paint::Bold),
        gpu.product,
        style.paint(&gpu.uuid, Paint::Dim)
    );
    if !gpu.whole_gpu.is_empty() {
        let _ = writeln!(
            out,
            "    whole GPU  {}",
            style.paint(&users_text(&gpu.whole_gpu), Paint::Cyan)
        );
    } else if gpu.mig != MigMode::Enabled && gpu.instances.is_empty() {
        let _ = writeln!(out, "    whole GPU  idle");
    }
    if gpu.mig == MigMode::Enabled && gpu.instances.is_empty() && gpu.whole_gpu.is_empty() {
        let _ = writeln!(
            out,
            "    [{}]  no MIG instances",
            vec!["."; gpu.memory_slices as usize].join(" ")
        );
    }
    for instance in &gpu.instances {
        instance_text(out, gpu, instance, style);
    }
    if let Some(f) = &gpu.fragmentation {
        let map = slice_map(gpu.memory_slices, |s| {
            gpu.slice_map.get(s as usize) == Some(&SliceUse::Free)
        });
        let summary = match &f.largest_fit {
            _ if f.free_slices == 0 => "none".to_string(),
            Some(p) => {
                let fragmentation = format!("fragmentation {}%", f.percent);
                let fragmentation = if f.percent > 0 {
                    style.paint(&fragmentation, Paint::Yellow)
                } else {
                    fragmentation
                };
                format!(
                    "{} of {}; largest fit {p} ({}); {fragmentation}",
                    f.free_slices,
                    slices_text(gpu.memory_slices),
                    slices_text(f.largest_fit_slices)
                )
            }
            None => format!(
                "{} of {}; {}",
                f.free_slices,
                slices_text(gpu.memory_slices),
                style.paint("no profile fits (fragmentation 100%)", Paint::Yellow)
            ),
        };
        let _ = writeln!(out, "    free [{}]  {summary}", style.paint(&map, Paint::Green));
        if !gpu.free.is_empty() {
            let placements: Vec<String> = gpu
                .free
                .iter()
                .map(|p| {
                    let starts: Vec<String> = p.starts.iter().map(u32::to_string).collect();
                    format!("{}@{}", p.profile, starts.join(","))
                })
                .collect();
            let _ = writeln!(out, "      {}", placements.join("  "));
        }
    }
}

fn instance_text(out: &mut String, gpu: &GpuLayout, instance: &InstanceLayout, style: &Style) {
    let map = slice_map(gpu.memory_slices, |s| instance.memory_slices.contains(&s));
    let label = match &instance.profile {
        Some(p) => format!("{p}@{}", instance.start),
        None => format!("profile {}@{}", instance.profile_id, instance.start),
    };
    let (paint, who) = match instance.owner {
        InstanceOwnerView::Foreign => (Paint::Yellow, "foreign (not migdra's)".to_string()),
        InstanceOwnerView::Allocated => (
            Paint::Magenta,
            format!("allocated, not created yet: {}", users_text(&instance.users)),
        ),
        InstanceOwnerView::Migdra => {
            let who = if !instance.users.is_empty() {
                users_text(&instance.users)
            } else if let Some(claim) = &instance.recorded_claim {
                format!("claim {claim} (no allocation of it found)")
            } else {
                "migdra (no claim recorded)".to_string()
            };
            (Paint::Cyan, who)
        }
    };
    let uuid = instance
        .mig_uuid
        .as_deref()
        .map(|u| format!("  {}", style.paint(u, Paint::Dim)))
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "    [{}]  {label:<LABEL_WIDTH$} {}{uuid}",
        style.paint(&map, paint),
        style.paint(&who, paint)
    );
}

fn or_dash(text: String) -> String {
    if text.is_empty() { "-".into() } else { text }
}

fn slices_text(n: u32) -> String {
    if n == 1 {
        "1 slice".to_string()
    } else {
        format!("{n} slices")
    }
}

fn slice_map(slices: u32, covers: impl Fn(u32) -> bool) -> String {
    (0..slices)
        .map(|s| if covers(s) { s.to_string() } else { ".".into() })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `ns/pod (claim ns/claim)` per claim; `claim ns/claim (no pod)` for a claim no pod uses.
fn users_text(users: &[DeviceUse]) -> String {
    users
        .iter()
        .map(|u| {
            if u.pods.is_empty() {
                format!("claim {} (no pod)", u.claim)
            } else {
                let pods: Vec<String> = u.pods.iter().map(ToString::to_string).collect();
                format!("{} (claim {})", pods.join(", "), u.claim)
            }
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

/// The fits view as text.
pub fn fits(view: &FitsView, style: &Style) -> String {
    let shape = match (&view.request.profile, &view.request.memory) {
        (Some(p), _) => p.clone(),
        (None, Some(m)) => format!("a MIG device with at least {m}"),
        (None, None) => "the request".to_string(),
    };
    let mut out = String::new();
    if view.nodes.is_empty() {
        let _ = writeln!(out, "no GpuNodes to place {shape} on");
    }
    for node in &view.nodes {
        let head = format!("{shape} on {}:", style.paint(&node.node, Paint::Bold));
        if let Some(landing) = &node.lands {
            let slices: Vec<String> = landing.memory_slices.iter().map(u32::to_string).collect();
            let _ = writeln!(
                out,
                "{head} lands on {} (GPU {}, {}@{}, memory slices {})",
                style.paint(&landing.device, Paint::Green),
                landing.gpu,
                landing.profile,
                landing.start,
                slices.join(",")
            );
        } else if let Some(problem) = &node.problem {
            let _ = writeln!(out, "{head} {}", style.paint(problem, Paint::Red));
        } else {
            let _ = writeln!(out, "{head} {}", style.paint("does not fit", Paint::Red));
            let width = node.blocked.iter().map(|b| b.device.len()).max().unwrap_or(0);
            for blocked in &node.blocked {
                let _ = writeln!(out, "  {:<width$}  {}", blocked.device, blocked.reason);
            }
        }
    }
    out
}

/// The claims view as a table.
pub fn claims(view: &ClaimsView, style: &Style) -> String {
    let mut out = String::new();
    if view.claims.is_empty() {
        let _ = writeln!(out, "no claims of migdra's devices");
        return out;
    }
    let rows: Vec<[String; 6]> = view
        .claims
        .iter()
        .map(|c| {
            let devices: Vec<String> = c.devices.iter().map(|d| d.device.clone()).collect();
            let pods: Vec<String> = c
                .pods
                .iter()
                .map(|p| {
                    if p.phase.is_empty() {
                        p.name.clone()
                    } else {
                        format!("{} ({})", p.name, p.phase)
                    }
                })
                .collect();
            [
                c.namespace.clone(),
                c.name.clone(),
                format!("{:?}", c.state),
                c.node.clone().unwrap_or_else(|| "-".into()),
                or_dash(devices.join(",")),
                or_dash(pods.join(", ")),
            ]
        })
        .collect();
    let header = ["NAMESPACE", "NAME", "STATE", "NODE", "DEVICES", "PODS"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: [&str; 6], paint_state: Option<Paint>| {
        let mut text = String::new();
        for (i, cell) in cells.iter().enumerate() {
            let padded = if i + 1 == cells.len() {
                cell.to_string()
            } else {
                format!("{cell:<width$}  ", width = widths[i])
            };
            match (i, paint_state) {
                (2, Some(p)) => text.push_str(&style.paint(&padded, p)),
                _ => text.push_str(&padded),
            }
        }
        text
    };
    let _ = writeln!(out, "{}", style.paint(&line(header, None), Paint::Bold));
    for (row, claim) in rows.iter().zip(&view.claims) {
        let paint = match claim.state {
            ClaimState::Pending => Paint::Dim,
            ClaimState::Allocated => Paint::Yellow,
            ClaimState::Prepared => Paint::Green,
            ClaimState::Failed => Paint::Red,
        };
        let _ = writeln!(out, "{}", line(row.each_ref().map(String::as_str), Some(paint)));
        if claim.state == ClaimState::Failed
            && let Some(message) = &claim.message
        {
            let _ = writeln!(
                out,
                "  {}",
                style.paint(&format!("message: {message}"), Paint::Red)
            );
        }
    }
    out
}
