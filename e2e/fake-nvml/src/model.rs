//! GPU models the fake can simulate: every MIG-capable model of `migdra_api::catalog`, plus a
//! few GPUs without MIG so the "not MIG-capable" paths can be exercised.

use migdra_api::catalog::{self, GpuModel};

/// What the fake needs to know about a GPU model.
#[derive(Clone, Copy, Debug)]
pub struct FakeModel {
    /// Configuration key.
    pub key: &'static str,
    /// Product name (`nvmlDeviceGetName`).
    pub product_name: &'static str,
    /// PCI device ID (vendor 0x10de).
    pub pci_device_id: u16,
    /// `nvmlDeviceArchitecture_t` value.
    pub architecture: u32,
    /// CUDA compute capability.
    pub cuda_compute_capability: (i32, i32),
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// Multiprocessors of the whole GPU.
    pub multiprocessors: u32,
    /// The MIG model, for MIG-capable GPUs.
    pub mig: Option<&'static GpuModel>,
}

/// `NVML_DEVICE_ARCH_TURING`.
const ARCH_TURING: u32 = 6;
/// `NVML_DEVICE_ARCH_AMPERE`.
const ARCH_AMPERE: u32 = 7;
/// `NVML_DEVICE_ARCH_ADA`.
const ARCH_ADA: u32 = 8;

const fn plain(
    key: &'static str,
    product_name: &'static str,
    pci_device_id: u16,
    architecture: u32,
    cuda_compute_capability: (i32, i32),
    memory_mib: u64,
    multiprocessors: u32,
) -> FakeModel {
    FakeModel {
        key,
        product_name,
        pci_device_id,
        architecture,
        cuda_compute_capability,
        memory_mib,
        multiprocessors,
        mig: None,
    }
}

/// GPUs without MIG.
const PLAIN_MODELS: &[FakeModel] = &[
    plain("L4", "NVIDIA L4", 0x27B8, ARCH_ADA, (8, 9), 23034, 58),
    plain("A10", "NVIDIA A10", 0x2236, ARCH_AMPERE, (8, 6), 23028, 72),
    plain("T4", "Tesla T4", 0x1EB8, ARCH_TURING, (7, 5), 15360, 40),
];

impl FakeModel {
    /// Looks a model up by configuration key (case-insensitive).
    pub fn lookup(key: &str) -> Option<FakeModel> {
        if let Some(m) = catalog::model(key) {
            return Some(FakeModel {
                key: m.key,
                product_name: m.product_name,
                pci_device_id: m.pci_device_ids.first().copied().unwrap_or(0),
                architecture: m.architecture.nvml_value(),
                cuda_compute_capability: (
                    i32::try_from(m.cuda_compute_capability.0).unwrap_or(0),
                    i32::try_from(m.cuda_compute_capability.1).unwrap_or(0),
                ),
                memory_mib: m.memory_mib,
                multiprocessors: m.multiprocessors,
                mig: Some(m),
            });
        }
        PLAIN_MODELS
            .iter()
            .find(|p| p.key.eq_ignore_ascii_case(key))
            .copied()
    }

    /// Every key the fake accepts.
    pub fn keys() -> Vec<&'static str> {
        catalog::models()
            .iter()
            .map(|m| m.key)
            .chain(PLAIN_MODELS.iter().map(|p| p.key))
            .collect()
    }

    /// Total memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_and_plain_models_resolve() {
        let h100 = FakeModel::lookup("h100-80gb").unwrap();
        assert_eq!(h100.architecture, 9);
        assert!(h100.mig.is_some());
        let l4 = FakeModel::lookup("L4").unwrap();
        assert!(l4.mig.is_none());
        assert!(FakeModel::lookup("RTX-9999").is_none());
        assert!(FakeModel::keys().contains(&"A30-24GB"));
    }
}
