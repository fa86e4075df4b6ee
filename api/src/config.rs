//! Opaque device configuration that users pass in claims and DeviceClasses, parsed strictly:
//! an unknown kind, field or value is an error that names what was wrong.
//!
//! ```yaml
//! config:
//! - requests: ["gpu"]
//!   opaque:
//!     driver: gpu.migdra.dev
//!     parameters:
//!       apiVersion: gpu.migdra.dev/v1alpha1
//!       kind: DeviceConfig
//!       env:
//!         MY_SETTING: "1"
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::inventory::API_VERSION;

/// `kind` of [`DeviceConfig`].
pub const DEVICE_CONFIG_KIND: &str = "DeviceConfig";

/// Environment variables a user may not set, because migdra sets them to select the device.
const RESERVED_ENV: &[&str] = &[
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_MIG_CONFIG_DEVICES",
    "NVIDIA_CTK_LIBCUDA_DIR",
];

/// Environment variables a user may not set because a NVIDIA container runtime that reads the
/// container's environment (legacy or auto mode) grants more from them than the claim's devices:
/// MIG monitoring of every GPU, driver capabilities, IMEX channels, GPUDirect Storage, MOFED,
/// NVSwitch and GDRCopy devices.
const RUNTIME_GRANT_ENV: &[&str] = &[
    "NVIDIA_MIG_MONITOR_DEVICES",
    "NVIDIA_DRIVER_CAPABILITIES",
    "NVIDIA_IMEX_CHANNELS",
    "NVIDIA_GDS",
    "NVIDIA_MOFED",
    "NVIDIA_NVSWITCH",
    "NVIDIA_GDRCOPY",
];

/// Prefix of the per-device variables through which the plugin tells a container the UUID of
/// each of its devices (`MIGDRA_DEVICE_UUID_<DEVICE>`); users may not set any of them.
pub const DEVICE_UUID_ENV_PREFIX: &str = "MIGDRA_DEVICE_UUID_";

/// Configuration of the devices of one or more requests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceConfig {
    /// Always `gpu.migdra.dev/v1alpha1`.
    pub api_version: String,
    /// Always `DeviceConfig`.
    pub kind: String,
    /// Extra environment variables for the containers that use the devices.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

/// Why an opaque configuration was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not valid JSON for a DeviceConfig (includes unknown fields).
    #[error("invalid {DEVICE_CONFIG_KIND}: {0}")]
    Malformed(String),
    #[error("unsupported apiVersion {0:?}: expected {API_VERSION}")]
    ApiVersion(String),
    #[error("unsupported kind {0:?}: expected {DEVICE_CONFIG_KIND}")]
    Kind(String),
    #[error(
        "invalid environment variable name {0:?}: use letters, digits and '_', not starting with a digit"
    )]
    EnvName(String),
    #[error("environment variable {0} is set by migdra and cannot be configured")]
    ReservedEnv(String),
    #[error(
        "environment variable {0} would make a NVIDIA container runtime grant the container more \
         than its claim's devices, and cannot be configured"
    )]
    RuntimeGrantEnv(String),
}

impl DeviceConfig {
    /// Parses and validates raw opaque parameters.
    pub fn parse(parameters: &serde_json::Value) -> Result<Self, ConfigError> {
        let config: DeviceConfig =
            serde_json::from_value(parameters.clone()).map_err(|e| ConfigError::Malformed(e.to_string()))?;
        if config.api_version != API_VERSION {
            return Err(ConfigError::ApiVersion(config.api_version));
        }
        if config.kind != DEVICE_CONFIG_KIND {
            return Err(ConfigError::Kind(config.kind));
        }
        for name in config.env.keys() {
            let valid = name
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(ConfigError::EnvName(name.clone()));
            }
            if RESERVED_ENV.contains(&name.as_str()) || name.starts_with(DEVICE_UUID_ENV_PREFIX) {
                return Err(ConfigError::ReservedEnv(name.clone()));
            }
            if RUNTIME_GRANT_ENV.contains(&name.as_str()) {
                return Err(ConfigError::RuntimeGrantEnv(name.clone()));
            }
        }
        Ok(config)
    }

    /// Applies `later` on top of `self`: later entries win, key by key.
    pub fn merge(&mut self, later: &DeviceConfig) {
        self.env
            .extend(later.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
}

/// One opaque configuration entry of an allocation, as the plugin sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigEntry<'a> {
    /// Requests it applies to (empty: all). May name `<request>/<subrequest>`.
    pub requests: &'a [String],
    pub parameters: &'a serde_json::Value,
}

/// Resolves the configuration of the device allocated for `request` (which may be
/// `<request>/<subrequest>`): entries are given class entries first, then claim entries, each
/// in order; every entry that applies is validated and merged, later ones winning.
pub fn resolve(entries: &[ConfigEntry<'_>], request: &str) -> Result<DeviceConfig, ConfigError> {
    let base = request.split('/').next().unwrap_or(request);
    let mut resolved = DeviceConfig::default();
    for entry in entries {
        let applies = entry.requests.is_empty() || entry.requests.iter().any(|r| r == request || r == base);
        if applies {
            resolved.merge(&DeviceConfig::parse(entry.parameters)?);
        }
    }
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn config(env: serde_json::Value) -> serde_json::Value {
        json!({"apiVersion": API_VERSION, "kind": "DeviceConfig", "env": env})
    }

    #[test]
    fn parses_valid_config() {
        let c = DeviceConfig::parse(&config(json!({"A": "1"}))).unwrap();
        assert_eq!(c.env.get("A").map(String::as_str), Some("1"));
    }

    #[test]
    fn rejects_bad_configs_with_clear_messages() {
        let unknown_field = json!({"apiVersion": API_VERSION, "kind": "DeviceConfig", "sharing": "mps"});
        let err = DeviceConfig::parse(&unknown_field).unwrap_err();
        assert!(err.to_string().contains("unknown field `sharing`"), "{err}");

        let err = DeviceConfig::parse(&json!({"apiVersion": "v1", "kind": "DeviceConfig"})).unwrap_err();
        assert_eq!(err, ConfigError::ApiVersion("v1".into()));
        let err = DeviceConfig::parse(&json!({"apiVersion": API_VERSION, "kind": "GpuConfig"})).unwrap_err();
        assert_eq!(err, ConfigError::Kind("GpuConfig".into()));
        assert_eq!(
            DeviceConfig::parse(&config(json!({"1X": "a"}))).unwrap_err(),
            ConfigError::EnvName("1X".into())
        );
        assert_eq!(
            DeviceConfig::parse(&config(json!({"CUDA_VISIBLE_DEVICES": "0"}))).unwrap_err(),
            ConfigError::ReservedEnv("CUDA_VISIBLE_DEVICES".into())
        );
        assert_eq!(
            DeviceConfig::parse(&config(json!({"MIGDRA_DEVICE_UUID_GPU_0": "x"}))).unwrap_err(),
            ConfigError::ReservedEnv("MIGDRA_DEVICE_UUID_GPU_0".into())
        );
        for name in RUNTIME_GRANT_ENV {
            let err = DeviceConfig::parse(&config(json!({*name: "all"}))).unwrap_err();
            assert_eq!(err, ConfigError::RuntimeGrantEnv(name.to_string()));
            assert!(err.to_string().contains(name), "{err}");
        }
        assert!(matches!(
            DeviceConfig::parse(&config(json!({"A": 1}))).unwrap_err(),
            ConfigError::Malformed(_)
        ));
    }

    #[test]
    fn resolve_applies_matching_entries_in_order() {
        let class = config(json!({"A": "class", "B": "class"}));
        let claim_all = config(json!({"A": "claim"}));
        let claim_other = config(json!({"B": "other"}));
        let broken = json!({"kind": "Nope"});
        let all: Vec<String> = vec![];
        let gpu = vec!["gpu".to_string()];
        let other = vec!["other".to_string()];
        let entries = [
            ConfigEntry {
                requests: &all,
                parameters: &class,
            },
            ConfigEntry {
                requests: &gpu,
                parameters: &claim_all,
            },
            ConfigEntry {
                requests: &other,
                parameters: &claim_other,
            },
        ];
        let resolved = resolve(&entries, "gpu/mig-2g").unwrap();
        assert_eq!(resolved.env["A"], "claim");
        assert_eq!(resolved.env["B"], "class");
        // An entry for another request is not applied, so its errors do not matter here...
        let with_broken = [ConfigEntry {
            requests: &other,
            parameters: &broken,
        }];
        assert!(resolve(&with_broken, "gpu").is_ok());
        // ...but it fails the request it applies to.
        assert!(resolve(&with_broken, "other").is_err());
    }
}
