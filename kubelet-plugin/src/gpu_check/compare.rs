//! Discovered GPU against the catalog: is the model known, and does every GPU-instance
//! profile NVML reports match the catalog's entry field by field? Pure.
//!
//! Rule: a difference in a field the catalog marks as an estimate ([`GpuModel::estimates`])
//! is a warning ("estimate differs", the catalog should be corrected); a difference anywhere
//! else, an unknown model or a profile the catalog lacks is a mismatch. Profile ID, index,
//! slice counts and instance count are never estimates: they decide device names and
//! counters.

use std::collections::BTreeMap;

use migdra_api::{
    catalog::{GpuModel, ProfileField},
    geometry::MigProfile,
};

use super::report::{Finding, ProfileRow, RowStatus};
use crate::nvml::GpuDescription;

/// The outcome of comparing one GPU with the catalog.
#[derive(Clone, Debug, PartialEq)]
pub struct CatalogComparison {
    pub model: Option<&'static GpuModel>,
    /// One row per NVML profile.
    pub rows: Vec<ProfileRow>,
    pub findings: Vec<Finding>,
}

/// Finds the GPU's model in `catalog` the way the plugin does, by PCI device ID (product
/// names differ between boards of one model and drift between drivers), then compares every
/// profile. A MIG-capable model the catalog does not know is described from NVML alone:
/// `nvml_names` are the profile names NVML reports (read while MIG is on).
pub fn compare_with_catalog(
    gpu: &GpuDescription,
    catalog: &'static [GpuModel],
    nvml_names: &BTreeMap<u32, String>,
) -> CatalogComparison {
    let model = gpu
        .pci_device_id
        .and_then(|id| catalog.iter().find(|m| m.pci_device_ids.contains(&id)));
    let gpu_label = format!("GPU {} ({})", gpu.index, gpu.product_name);
    let Some(mig) = &gpu.mig else {
        let message = match model {
            Some(m) => format!(
                "{gpu_label}: catalog model {} is MIG-capable but NVML reports no MIG support \
                 (GetMigMode not supported, e.g. in a VM); migdra can publish it only whole",
                m.key
            ),
            None => format!("{gpu_label}: not MIG-capable; migdra publishes it whole, no MIG checks"),
        };
        let findings = vec![Finding::warning(message)];
        return CatalogComparison {
            model,
            rows: Vec::new(),
            findings,
        };
    };
    let Some(model) = model else {
        return derived_from_nvml(gpu, &gpu_label, &mig.profiles, nvml_names);
    };
    let mut findings = Vec::new();
    let label = format!("{gpu_label} [{}]", model.key);
    for e in model.estimates {
        let fields = e.fields.iter().map(|f| f.as_str()).collect::<Vec<_>>().join(", ");
        let profiles = if e.profile_ids.is_empty() {
            "every profile".to_string()
        } else {
            format!("profile IDs {:?}", e.profile_ids)
        };
        findings.push(Finding::warning(format!(
            "{label}: catalog values estimated, not documented: {fields} of {profiles} ({})",
            e.why
        )));
    }
    if gpu.architecture != Some(model.architecture) {
        findings.push(Finding::mismatch(format!(
            "{label}: architecture: NVML {:?}, catalog {:?}",
            gpu.architecture, model.architecture
        )));
    }
    if gpu.memory_mib != model.memory_mib {
        findings.push(Finding::warning(format!(
            "{label}: total memory: NVML {} MiB, catalog {} MiB (budgets come from NVML at run time)",
            gpu.memory_mib, model.memory_mib
        )));
    }
    let mut rows = Vec::new();
    for p in &mig.profiles {
        let Some(c) = model.profiles.iter().find(|c| c.gi_profile_id == p.gi_profile_id) else {
            findings.push(Finding::mismatch(format!(
                "{label}: profile {} (ID {}, index {}) is not in the catalog",
                p.name, p.gi_profile_id, p.gi_profile_index
            )));
            rows.push(row(p, RowStatus::NotInCatalog));
            continue;
        };
        let mut status = RowStatus::Match;
        for diff in differences(p, c) {
            let estimate = diff.field.and_then(|f| model.estimate(p.gi_profile_id, f));
            let text = format!(
                "{label}: profile {} (ID {}) {}: NVML {}, catalog {}",
                p.name, p.gi_profile_id, diff.what, diff.nvml, diff.catalog
            );
            match estimate {
                Some(e) => {
                    if status == RowStatus::Match {
                        status = RowStatus::EstimateDiffers;
                    }
                    findings.push(Finding::warning(format!(
                        "{text} (catalog value is an estimate: {}; please report NVML's value)",
                        e.why
                    )));
                }
                None => {
                    status = RowStatus::Mismatch;
                    findings.push(Finding::mismatch(text));
                }
            }
        }
        rows.push(row(p, status));
    }
    for c in &model.profiles {
        if !mig.profiles.iter().any(|p| p.gi_profile_id == c.gi_profile_id) {
            findings.push(Finding::warning(format!(
                "{label}: catalog profile {} (ID {}) is not reported by NVML (older driver?); \
                 migdra publishes only what NVML reports",
                c.name, c.gi_profile_id
            )));
        }
    }
    CatalogComparison {
        model: Some(model),
        rows,
        findings,
    }
}

/// A MIG-capable GPU whose PCI device ID the catalog does not know: migdra publishes what NVML
/// reports (slice counts, placements, memory, engines), named from slice count and memory.
/// That is a warning, not a failure: nothing is compared, so the operator is told to check
/// the names and to report the model.
fn derived_from_nvml(
    gpu: &GpuDescription,
    gpu_label: &str,
    profiles: &[MigProfile],
    nvml_names: &BTreeMap<u32, String>,
) -> CatalogComparison {
    let pci = gpu
        .pci_device_id
        .map_or_else(|| "unreadable".to_string(), |id| format!("{id:#06x}"));
    let mut findings = vec![Finding::warning(format!(
        "{gpu_label}: unknown model, derived from NVML: PCI device ID {pci} is not in migdra's \
         catalog; its {} profiles are published as NVML reports them, named from slice count \
         and memory (please report the model and this output)",
        profiles.len()
    ))];
    let rows = profiles
        .iter()
        .map(|p| {
            let mut row = row(p, RowStatus::DerivedFromNvml);
            row.nvml_name = nvml_names.get(&p.gi_profile_id).cloned();
            if let Some(nvml) = row.nvml_name.as_deref().filter(|n| *n != row.name) {
                findings.push(Finding::warning(format!(
                    "{gpu_label}: profile ID {} is named {nvml:?} by NVML and published as {:?}",
                    p.gi_profile_id, row.name
                )));
            }
            row
        })
        .collect();
    if nvml_names.is_empty() {
        findings.push(Finding::warning(format!(
            "{gpu_label}: NVML's profile names are only readable with MIG mode on; the names \
             above are derived"
        )));
    }
    CatalogComparison {
        model: None,
        rows,
        findings,
    }
}

fn row(p: &MigProfile, catalog: RowStatus) -> ProfileRow {
    ProfileRow {
        name: p.name.to_string(),
        id: p.gi_profile_id,
        index: p.gi_profile_index,
        compute_slices: p.compute_slices,
        memory_slices: p.memory_slices,
        instance_count: p.instance_count,
        memory_mib: p.memory_mib,
        multiprocessors: p.engines.multiprocessors,
        placements: p.placements.clone(),
        device_names: Vec::new(),
        nvml_name: None,
        catalog,
    }
}

/// One field that differs.
struct Difference {
    what: &'static str,
    /// The catalog field, when the catalog can mark it as an estimate.
    field: Option<ProfileField>,
    nvml: String,
    catalog: String,
}

fn differences(nvml: &MigProfile, catalog: &MigProfile) -> Vec<Difference> {
    let fields = |p: &MigProfile| {
        let e = p.engines;
        [
            ("name", None, p.name.to_string()),
            ("profile index", None, p.gi_profile_index.to_string()),
            ("compute slices", None, p.compute_slices.to_string()),
            ("memory slices", None, p.memory_slices.to_string()),
            ("instance count", None, p.instance_count.to_string()),
            (
                "placements",
                Some(ProfileField::Placements),
                format!("{:?}", sorted(&p.placements)),
            ),
            (
                "memory MiB",
                Some(ProfileField::MemoryMib),
                p.memory_mib.to_string(),
            ),
            (
                "multiprocessors",
                Some(ProfileField::Multiprocessors),
                e.multiprocessors.to_string(),
            ),
            (
                "copy engines",
                Some(ProfileField::CopyEngines),
                e.copy_engines.to_string(),
            ),
            ("decoders", Some(ProfileField::Decoders), e.decoders.to_string()),
            ("encoders", None, e.encoders.to_string()),
            (
                "JPEG engines",
                Some(ProfileField::JpegEngines),
                e.jpeg_engines.to_string(),
            ),
            (
                "OFA engines",
                Some(ProfileField::OfaEngines),
                e.ofa_engines.to_string(),
            ),
        ]
    };
    fields(nvml)
        .into_iter()
        .zip(fields(catalog))
        .filter(|(a, b)| a.2 != b.2)
        .map(|((what, field, nvml), (_, _, catalog))| Difference {
            what,
            field,
            nvml,
            catalog,
        })
        .collect()
}

fn sorted(v: &[u32]) -> Vec<u32> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use migdra_api::catalog;

    use super::*;

    /// A GPU exactly as the catalog describes `key`.
    fn gpu_like(key: &str) -> GpuDescription {
        crate::nvml::catalog_gpu(0, key, Some(true))
    }

    fn no_names() -> BTreeMap<u32, String> {
        BTreeMap::new()
    }

    fn mismatches(c: &CatalogComparison) -> Vec<&str> {
        c.findings
            .iter()
            .filter(|f| f.severity == super::super::Severity::Mismatch)
            .map(|f| f.message.as_str())
            .collect()
    }

    #[test]
    fn a_gpu_equal_to_its_documented_entry_matches_without_findings() {
        let c = compare_with_catalog(&gpu_like("H100-80GB"), catalog::models(), &no_names());
        assert_eq!(c.model.map(|m| m.key), Some("H100-80GB"));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        assert_eq!(c.rows.len(), 7);
        assert!(c.rows.iter().all(|r| r.catalog == RowStatus::Match));
    }

    #[test]
    fn the_pcie_card_is_recognised_by_its_pci_device_id_not_its_name() {
        let mut gpu = gpu_like("H100-PCIE-80GB");
        gpu.product_name = "NVIDIA H100 80GB HBM3".into(); // the SXM name: ignored
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert_eq!(c.model.map(|m| m.key), Some("H100-PCIE-80GB"));
        assert!(mismatches(&c).is_empty());
        // Its SM counts are estimates: the check warns that they are.
        assert!(
            c.findings
                .iter()
                .any(|f| f.message.contains("multiprocessors of every profile"))
        );
        // The SXM device ID with the PCIe numbers: the SMs differ from documented values.
        gpu.pci_device_id = Some(0x2330);
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert_eq!(c.model.map(|m| m.key), Some("H100-80GB"));
        assert!(
            mismatches(&c)
                .iter()
                .any(|m| m.contains("multiprocessors: NVML 114, catalog 132"))
        );
    }

    #[test]
    fn gh200_is_found_whatever_its_name() {
        let mut gpu = gpu_like("H100-96GB");
        gpu.pci_device_id = Some(0x2342);
        gpu.product_name = "NVIDIA GH200 480GB".into();
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert_eq!(c.model.map(|m| m.key), Some("H100-96GB"));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
    }

    #[test]
    fn an_unknown_model_is_derived_from_nvml_with_a_warning_not_a_failure() {
        let mut gpu = gpu_like("H100-80GB");
        gpu.product_name = "NVIDIA H999".into();
        gpu.pci_device_id = Some(0x2999);
        let names = BTreeMap::from([(19, "1g.10gb".to_string()), (9, "3g.40gb-x".to_string())]);
        let c = compare_with_catalog(&gpu, catalog::models(), &names);
        assert!(c.model.is_none());
        assert!(mismatches(&c).is_empty(), "{:?}", mismatches(&c));
        assert!(
            c.findings[0]
                .message
                .contains("unknown model, derived from NVML: PCI device ID 0x2999"),
            "{}",
            c.findings[0].message
        );
        assert_eq!(c.rows.len(), 7);
        assert!(c.rows.iter().all(|r| r.catalog == RowStatus::DerivedFromNvml));
        let three_g = c.rows.iter().find(|r| r.id == 9).unwrap();
        assert_eq!(three_g.nvml_name.as_deref(), Some("3g.40gb-x"));
        // Only the name that differs from the derived one is reported.
        let renamed: Vec<_> = c
            .findings
            .iter()
            .filter(|f| f.message.contains("is named"))
            .collect();
        assert_eq!(renamed.len(), 1, "{renamed:?}");
        assert!(
            renamed[0]
                .message
                .contains("\"3g.40gb-x\" by NVML and published as \"3g.40gb\"")
        );

        // Without MIG on, NVML gives no names: said so.
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert!(
            c.findings
                .iter()
                .any(|f| f.message.contains("only readable with MIG mode on"))
        );
    }

    #[test]
    fn a_documented_field_that_differs_is_a_mismatch_naming_both_values() {
        let mut gpu = gpu_like("H100-80GB");
        let profiles = &mut gpu.mig.as_mut().unwrap().profiles;
        let three_g = profiles.iter_mut().find(|p| p.gi_profile_id == 9).unwrap();
        three_g.placements = vec![0, 2, 4];
        three_g.memory_mib += 1;
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        let m = mismatches(&c);
        assert_eq!(m.len(), 2, "{m:?}");
        assert!(
            m.iter()
                .any(|l| l.contains("placements: NVML [0, 2, 4], catalog [0, 4]"))
        );
        assert!(
            m.iter()
                .any(|l| l.contains("memory MiB: NVML 40449, catalog 40448"))
        );
        let row = c.rows.iter().find(|r| r.id == 9).unwrap();
        assert_eq!(row.catalog, RowStatus::Mismatch);
    }

    #[test]
    fn an_estimated_field_that_differs_is_a_warning_and_structure_is_never_estimated() {
        let mut gpu = gpu_like("B200");
        let profiles = &mut gpu.mig.as_mut().unwrap().profiles;
        let seven_g = profiles.iter_mut().find(|p| p.gi_profile_id == 0).unwrap();
        seven_g.engines.multiprocessors = 140; // estimated in the catalog
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert!(mismatches(&c).is_empty(), "{:?}", mismatches(&c));
        assert_eq!(
            c.rows.iter().find(|r| r.id == 0).unwrap().catalog,
            RowStatus::EstimateDiffers
        );
        assert!(
            c.findings
                .iter()
                .any(|f| f.severity == super::super::Severity::Warning
                    && f.message.contains("multiprocessors: NVML 140, catalog 144"))
        );

        // Instance count is never an estimate, even on a model with estimated placements.
        let profiles = &mut gpu.mig.as_mut().unwrap().profiles;
        profiles
            .iter_mut()
            .find(|p| p.gi_profile_id == 19)
            .unwrap()
            .instance_count = 6;
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert_eq!(mismatches(&c).len(), 1);
    }

    #[test]
    fn profiles_only_one_side_has() {
        let mut gpu = gpu_like("A100-SXM4-40GB");
        let profiles = &mut gpu.mig.as_mut().unwrap().profiles;
        let missing = profiles.remove(0); // 1g.5gb, ID 19
        let mut extra = missing.clone();
        extra.gi_profile_id = 42;
        extra.gi_profile_index = 13;
        profiles.push(extra);
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        let m = mismatches(&c);
        assert_eq!(m.len(), 1, "{m:?}");
        assert!(m[0].contains("(ID 42, index 13) is not in the catalog"));
        assert!(
            c.findings
                .iter()
                .any(|f| f.severity == super::super::Severity::Warning
                    && f.message.contains("1g.5gb (ID 19) is not reported by NVML"))
        );
    }

    #[test]
    fn a_gpu_without_mig_is_a_warning_only() {
        let mut gpu = gpu_like("A100-SXM4-40GB");
        gpu.mig = None;
        gpu.product_name = "NVIDIA L4".into();
        gpu.pci_device_id = Some(0x27b8);
        let c = compare_with_catalog(&gpu, catalog::models(), &no_names());
        assert!(mismatches(&c).is_empty());
        assert_eq!(c.findings.len(), 1);
        assert!(c.rows.is_empty());
    }
}
