//! The gpu-check report: what was found per GPU, the findings (mismatches and warnings),
//! the table rendering and the exit code. Plain values, so rendering is tested on hand-built
//! reports.

use std::fmt::Write as _;

use migdra_api::catalog::DataSource;
use serde::Serialize;

use super::{
    EXIT_MISMATCH, EXIT_OK,
    exercise::{ExerciseReport, GpuUsers},
    preview::{CapabilityReport, DriverFilesReport, LayoutsPreview, PublishedReport},
};
use crate::nvml::GpuDescription;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Severity {
    /// migdra's expectation and the GPU disagree: the check fails (exit code 1).
    Mismatch,
    /// Worth knowing (an estimate in the catalog, a missing optional file); does not fail.
    Warning,
}

/// One line of the verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    pub severity: Severity,
    /// Self-contained.
    pub message: String,
}

impl Finding {
    pub fn mismatch(message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Mismatch,
            message: message.into(),
        }
    }

    pub fn warning(message: impl Into<String>) -> Self {
        Self {
            severity: Severity::Warning,
            message: message.into(),
        }
    }
}

/// How a profile compares with the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum RowStatus {
    /// Every field matches.
    Match,
    /// Only fields the catalog marks as estimates differ.
    EstimateDiffers,
    /// A documented field differs.
    Mismatch,
    /// The catalog has no such profile.
    NotInCatalog,
    /// The catalog has no such model: the row is NVML's, nothing compared.
    DerivedFromNvml,
}

impl RowStatus {
    fn as_str(self) -> &'static str {
        match self {
            RowStatus::Match => "match",
            RowStatus::EstimateDiffers => "estimate differs",
            RowStatus::Mismatch => "MISMATCH",
            RowStatus::NotInCatalog => "NOT IN CATALOG",
            RowStatus::DerivedFromNvml => "from NVML",
        }
    }
}

/// One GPU-instance profile as NVML reports it, with its catalog verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ProfileRow {
    /// `3g.40gb`.
    pub name: String,
    /// GPU-instance profile ID and index.
    pub id: u32,
    pub index: u32,
    pub compute_slices: u32,
    /// Of one placement.
    pub memory_slices: u32,
    pub instance_count: u32,
    /// Of one instance.
    pub memory_mib: u64,
    pub multiprocessors: u32,
    /// Possible placement starts.
    pub placements: Vec<u32>,
    /// Device names migdra would publish for this profile (one per offered placement).
    pub device_names: Vec<String>,
    /// The name NVML's versioned profile info gives (read for unknown models, MIG on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_name: Option<String>,
    pub catalog: RowStatus,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MigMode {
    pub enabled: bool,
    pub pending_enabled: bool,
}

/// Everything found about one GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    /// NVML index.
    pub index: u32,
    pub minor: u32,
    pub uuid: String,
    pub product_name: String,
    /// PCI device ID (`0x2330`), which identifies the model.
    pub pci_device_id: Option<String>,
    pub memory_mib: u64,
    /// `None` for a GPU that is not MIG-capable.
    pub mig: Option<MigMode>,
    /// Catalog key of the recognised model.
    pub catalog_model: Option<String>,
    /// `documented` or `estimated`.
    pub catalog_source: Option<String>,
    /// In NVML index order.
    pub profiles: Vec<ProfileRow>,
    /// The pool migdra would publish for the GPU.
    pub published: Option<PublishedReport>,
    pub capabilities: Option<CapabilityReport>,
    /// Other processes using the GPU (full mode refuses while there are any).
    pub users: Option<GpuUsers>,
    /// Maximal layouts and the counters' verdict on them.
    pub layouts: Option<LayoutsPreview>,
    /// Full mode's results.
    pub exercise: Option<ExerciseReport>,
    /// Including those of the parts above.
    pub findings: Vec<Finding>,
}

impl GpuReport {
    /// An empty report for a discovered GPU.
    pub fn new(gpu: &GpuDescription) -> Self {
        Self {
            index: gpu.index,
            minor: gpu.minor,
            uuid: gpu.uuid.clone(),
            product_name: gpu.product_name.clone(),
            pci_device_id: gpu.pci_device_id.map(|id| format!("{id:#06x}")),
            memory_mib: gpu.memory_mib,
            mig: gpu.mig.as_ref().map(|m| MigMode {
                enabled: m.enabled,
                pending_enabled: m.pending_enabled,
            }),
            ..Self::default()
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuCheckReport {
    /// `read-only` or `full`.
    pub mode: String,
    pub driver_version: String,
    pub gpus: Vec<GpuReport>,
    /// Driver files the CDI spec would mount.
    pub driver_files: Option<DriverFilesReport>,
    /// Node-level findings (driver files).
    pub findings: Vec<Finding>,
    /// What the check did not cover.
    pub notes: Vec<String>,
}

pub fn source_name(source: DataSource) -> String {
    match source {
        DataSource::Documented => "documented".into(),
        DataSource::Estimated => "estimated".into(),
    }
}

impl GpuCheckReport {
    pub fn new(read_only: bool, driver_version: String) -> Self {
        Self {
            mode: if read_only { "read-only" } else { "full" }.into(),
            driver_version,
            ..Self::default()
        }
    }

    /// Every finding, node-level ones last.
    pub fn all_findings(&self) -> impl Iterator<Item = &Finding> {
        self.gpus.iter().flat_map(|g| &g.findings).chain(&self.findings)
    }

    pub fn mismatches(&self) -> usize {
        self.all_findings()
            .filter(|f| f.severity == Severity::Mismatch)
            .count()
    }

    /// 0 without mismatches, 1 with.
    pub fn exit_code(&self) -> i32 {
        match self.mismatches() {
            0 => EXIT_OK,
            _ => EXIT_MISMATCH,
        }
    }

    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "migdra gpu-check ({}), driver {}",
            self.mode, self.driver_version
        );
        for gpu in &self.gpus {
            render_gpu(&mut out, gpu);
        }
        if let Some(files) = &self.driver_files {
            let summary = files.summary.as_ref().map_or("not discovered (see warnings)".into(), |s| {
                let hook = s.hook.as_deref().unwrap_or("none");
                format!(
                    "{} libraries, {} utilities, {} firmware files, {} sockets, {} soname links, hook {hook}",
                    s.libraries, s.binaries, s.firmware, s.ipc, s.soname_links
                )
            });
            let _ = writeln!(out, "\nDriver files under {}:\n  {summary}", files.driver_root);
        }
        for note in &self.notes {
            let _ = writeln!(out, "\nnote: {note}");
        }
        let _ = writeln!(out);
        for f in self.all_findings() {
            let tag = match f.severity {
                Severity::Mismatch => "MISMATCH",
                Severity::Warning => "warning",
            };
            let _ = writeln!(out, "{tag}: {}", f.message);
        }
        let warnings = self.all_findings().count() - self.mismatches();
        let _ = writeln!(
            out,
            "result: {} ({} mismatches, {warnings} warnings)",
            if self.mismatches() == 0 { "OK" } else { "FAILED" },
            self.mismatches()
        );
        out
    }
}

fn render_gpu(out: &mut String, gpu: &GpuReport) {
    let on = |enabled: bool| if enabled { "on" } else { "off" };
    let mig = match gpu.mig {
        None => "not MIG-capable".to_string(),
        Some(m) if m.enabled == m.pending_enabled => format!("MIG {}", on(m.enabled)),
        Some(m) => format!("MIG {} (pending {})", on(m.enabled), on(m.pending_enabled)),
    };
    let catalog = match (&gpu.catalog_model, &gpu.catalog_source) {
        (Some(key), Some(source)) => format!("catalog {key} ({source})"),
        _ if gpu.mig.is_some() => "unknown model, derived from NVML".into(),
        _ => "not in the catalog".into(),
    };
    let _ = writeln!(
        out,
        "\nGPU {} (minor {}) {} {} MiB, PCI device {}, {mig}, {catalog}\n  {}",
        gpu.index,
        gpu.minor,
        gpu.product_name,
        gpu.memory_mib,
        gpu.pci_device_id.as_deref().unwrap_or("unknown"),
        gpu.uuid
    );
    if !gpu.profiles.is_empty() {
        let _ = writeln!(
            out,
            "  {:<12} {:>3} {:>5} {:>5} {:>4} {:>8} {:>4}  {:<15} {:>7}  {:<16} first device name",
            "PROFILE", "ID", "INDEX", "SLICE", "INST", "MiB", "SM", "PLACEMENTS", "DEVICES", "CATALOG"
        );
    }
    for p in &gpu.profiles {
        let placements = p
            .placements
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let _ = writeln!(
            out,
            "  {:<12} {:>3} {:>5} {:>5} {:>4} {:>8} {:>4}  {:<15} {:>7}  {:<16} {}",
            p.name,
            p.id,
            p.index,
            format!("{}/{}", p.compute_slices, p.memory_slices),
            p.instance_count,
            p.memory_mib,
            p.multiprocessors,
            placements,
            p.device_names.len(),
            p.catalog.as_str(),
            p.device_names.first().map_or("-", String::as_str)
        );
    }
    if let Some(published) = &gpu.published {
        let (slices, others): (Vec<_>, Vec<_>) = published
            .counters
            .iter()
            .partition(|(k, _)| k.starts_with("memory-slice-"));
        let (slices, counters) = (slices.len(), others.iter().map(|(k, v)| format!("{k}={v}")));
        let counters = counters.collect::<Vec<_>>().join(" ");
        let _ = writeln!(
            out,
            "  published: {} devices; counter set {}: {counters}, {slices} memory-slice counters; {} never-binding counters left out",
            published.device_count,
            published.counter_set.as_deref().unwrap_or("none"),
            published.counters_left_out.len()
        );
    }
    if let Some(published) = &gpu.published {
        // The attributes of the whole GPU and of its first partition; JSON has every device's.
        let whole = published.devices.iter().find(|d| d.profile_id.is_none());
        let partition = published.devices.iter().find(|d| d.profile_id.is_some());
        for d in whole.into_iter().chain(partition) {
            let attributes = d.attributes.iter().map(|(k, v)| format!("{k}={v}"));
            let capacity = d.capacity.iter().map(|(k, v)| format!("{k}={v}"));
            let _ = writeln!(
                out,
                "  attributes of {}: {}; capacity: {}",
                d.name,
                attributes.collect::<Vec<_>>().join(" "),
                capacity.collect::<Vec<_>>().join(" ")
            );
        }
    }
    if let Some(caps) = &gpu.capabilities {
        let _ = writeln!(
            out,
            "  capabilities: nvidia-caps major {}, mig-minors {}, {} existing instance(s) checked",
            caps.caps_major.map_or("missing".into(), |m| m.to_string()),
            if caps.mig_minors_present {
                "present"
            } else {
                "missing"
            },
            caps.instances.len()
        );
    }
    if let Some(users) = &gpu.users {
        let used = match (users.is_empty(), &users.nvml_error) {
            (true, None) => "no other process seen".to_string(),
            (true, Some(_)) => "NVML's process list unreadable".to_string(),
            (false, _) => users.describe(),
        };
        let _ = writeln!(out, "  in use: {used}");
    }
    if let Some(l) = &gpu.layouts {
        let _ = writeln!(
            out,
            "  layouts: {} maximal, the counters accept {}",
            l.maximal, l.counters_accept
        );
        for refused in &l.counters_refuse {
            let _ = writeln!(out, "    counters refuse {refused}");
        }
    }
    if let Some(ex) = &gpu.exercise {
        render_exercise(out, ex);
    }
}

fn render_exercise(out: &mut String, ex: &ExerciseReport) {
    let _ = writeln!(
        out,
        "  full mode: {} placements exercised ({} ok), MIG mode {}",
        ex.placements.len(),
        ex.placements.iter().filter(|p| p.ok).count(),
        ex.mig_mode_note
    );
    let _ = writeln!(
        out,
        "    {:<16} {:>3} {:>3}  {:<40} CAPABILITY MINORS (GI/CI)",
        "PLACEMENT", "GI", "CI", "MIG UUID"
    );
    for p in &ex.placements {
        let _ = writeln!(
            out,
            "    {:<16} {:>3} {:>3}  {:<40} {}{}",
            format!("{}@{}", p.profile, p.start),
            p.gpu_instance.map_or("-".into(), |v| v.to_string()),
            p.compute_instance.map_or("-".into(), |v| v.to_string()),
            p.mig_uuid.as_deref().unwrap_or("-"),
            p.capability_minors
                .map_or("-".into(), |(gi, ci)| format!("{gi}/{ci}")),
            if p.ok { "" } else { "  FAILED" }
        );
    }
    let _ = writeln!(
        out,
        "    {:<20} {:>5} {:>10} {:>10}",
        "NVML CALL", "COUNT", "P50 ms", "MAX ms"
    );
    let disagree: Vec<_> = ex.layouts.iter().filter(|l| !l.agree()).collect();
    let _ = writeln!(
        out,
        "    layouts created side by side: {} ({} accepted by NVML, {} where NVML and the counters disagree)",
        ex.layouts.len(),
        ex.layouts.iter().filter(|l| l.nvml_refused.is_none()).count(),
        disagree.len()
    );
    for l in disagree {
        let _ = writeln!(
            out,
            "      {}: NVML {}, counters {}",
            l.layout,
            l.nvml_refused
                .as_deref()
                .map_or("accept".into(), |e| format!("refuse ({e})")),
            l.counters_refused
                .as_deref()
                .map_or("accept".into(), |e| format!("refuse ({e})"))
        );
    }
    for t in &ex.timings {
        let _ = writeln!(
            out,
            "    {:<20} {:>5} {:>10.3} {:>10.3}",
            t.call, t.count, t.p50_ms, t.max_ms
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, id: u32, catalog: RowStatus) -> ProfileRow {
        ProfileRow {
            name: name.into(),
            id,
            index: 2,
            compute_slices: 3,
            memory_slices: 4,
            instance_count: 2,
            memory_mib: 40448,
            multiprocessors: 60,
            placements: vec![0, 4],
            device_names: vec![format!("gpu-1-mig-{}-4", name.replace('.', ""))],
            nvml_name: None,
            catalog,
        }
    }

    fn report(findings: Vec<Finding>) -> GpuCheckReport {
        let mut r = GpuCheckReport::new(true, "580.82.07".into());
        r.gpus.push(GpuReport {
            index: 0,
            minor: 1,
            uuid: "GPU-1".into(),
            product_name: "NVIDIA H100 80GB HBM3".into(),
            pci_device_id: Some("0x2330".into()),
            memory_mib: 81559,
            mig: Some(MigMode {
                enabled: false,
                pending_enabled: true,
            }),
            catalog_model: Some("H100-80GB".into()),
            catalog_source: Some("documented".into()),
            profiles: vec![row("3g.40gb", 9, RowStatus::Mismatch)],
            published: None,
            capabilities: None,
            users: None,
            layouts: None,
            exercise: None,
            findings,
        });
        r
    }

    #[test]
    fn mismatches_fail_and_warnings_do_not() {
        let ok = report(vec![Finding::warning("an estimate")]);
        assert_eq!(ok.exit_code(), EXIT_OK);
        let table = ok.render_table();
        assert!(table.contains("warning: an estimate\n"), "{table}");
        assert!(
            table.ends_with("result: OK (0 mismatches, 1 warnings)\n"),
            "{table}"
        );

        let mut failed = report(vec![Finding::mismatch("3g placements differ")]);
        failed.findings.push(Finding::warning("driver files missing"));
        assert_eq!(failed.exit_code(), EXIT_MISMATCH);
        let table = failed.render_table();
        // GPU findings first, node findings after, one line each.
        let first = table.find("MISMATCH: 3g placements differ").unwrap();
        let second = table.find("warning: driver files missing").unwrap();
        assert!(first < second, "{table}");
        assert!(
            table.contains("result: FAILED (1 mismatches, 1 warnings)"),
            "{table}"
        );
    }

    #[test]
    fn the_table_shows_the_gpu_its_catalog_entry_and_each_profile() {
        let table = report(Vec::new()).render_table();
        assert!(table.starts_with("migdra gpu-check (read-only), driver 580.82.07\n"));
        assert!(
            table.contains("GPU 0 (minor 1) NVIDIA H100 80GB HBM3 81559 MiB, PCI device 0x2330, MIG off (pending on), catalog H100-80GB (documented)"),
            "{table}"
        );
        let line = table
            .lines()
            .find(|l| l.trim_start().starts_with("3g.40gb"))
            .unwrap();
        let cells: Vec<_> = line.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "3g.40gb",
                "9",
                "2",
                "3/4",
                "2",
                "40448",
                "60",
                "0,4",
                "1",
                "MISMATCH",
                "gpu-1-mig-3g40gb-4"
            ]
        );
    }

    #[test]
    fn json_names_fields_in_camel_case() {
        let json = serde_json::to_value(report(vec![Finding::mismatch("x")])).unwrap();
        assert_eq!(json["gpus"][0]["catalogModel"], "H100-80GB");
        assert_eq!(json["gpus"][0]["profiles"][0]["catalog"], "mismatch");
        assert_eq!(json["gpus"][0]["findings"][0]["severity"], "mismatch");
        assert_eq!(json["gpus"][0]["mig"]["pendingEnabled"], true);
    }
}
