//! Device names in the ResourceSlice pool. Each name is a DNS label that encodes the GPU,
//! the profile and the placement, and parses back, so that the kubelet plugin needs nothing
//! but the allocated device name to know what to create.
//!
//! * whole GPU: `gpu-<minor>`
//! * MIG partition: `gpu-<minor>-mig-<profile label>-<start>`, e.g. `gpu-0-mig-1g10gb-me-6`
//!
//! `<minor>` is the GPU's device minor number (`/dev/nvidia<minor>`), stable across plugin
//! restarts, unlike NVML's enumeration index.

use std::{fmt, str::FromStr};

use crate::profile::ProfileName;

/// A parsed device name; `minor` is the (parent) GPU's device minor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceName {
    Gpu {
        minor: u32,
    },
    Mig {
        minor: u32,
        profile: ProfileName,
        start: u32,
    },
}

/// A device name that is not one of migdra's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a migdra device name (expected gpu-<minor> or gpu-<minor>-mig-<profile>-<start>)")]
pub struct InvalidDeviceName {
    pub name: String,
}

impl DeviceName {
    /// The parent GPU's device minor.
    pub fn minor(&self) -> u32 {
        match self {
            DeviceName::Gpu { minor } | DeviceName::Mig { minor, .. } => *minor,
        }
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceName::Gpu { minor } => write!(f, "gpu-{minor}"),
            DeviceName::Mig {
                minor,
                profile,
                start,
            } => write!(f, "gpu-{minor}-mig-{}-{start}", profile.to_label()),
        }
    }
}

impl FromStr for DeviceName {
    type Err = InvalidDeviceName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidDeviceName { name: s.to_string() };
        let rest = s.strip_prefix("gpu-").ok_or_else(invalid)?;
        let (minor, rest) = match rest.split_once('-') {
            Some((minor, rest)) => (minor, Some(rest)),
            None => (rest, None),
        };
        let minor = parse_canonical_u32(minor).ok_or_else(invalid)?;
        let Some(rest) = rest else {
            return Ok(DeviceName::Gpu { minor });
        };
        let rest = rest.strip_prefix("mig-").ok_or_else(invalid)?;
        let (label, start) = rest.rsplit_once('-').ok_or_else(invalid)?;
        let start = parse_canonical_u32(start).ok_or_else(invalid)?;
        let profile = ProfileName::from_label(label).map_err(|_| invalid())?;
        Ok(DeviceName::Mig {
            minor,
            profile,
            start,
        })
    }
}

/// Parses a decimal without sign or leading zeros, so that every number has one spelling.
fn parse_canonical_u32(s: &str) -> Option<u32> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

/// True when `s` is a valid DNS label (RFC 1123): lower-case alphanumerics and '-', at most
/// 63 characters, starting and ending with an alphanumeric.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{catalog, profile::ProfileVariant};

    #[test]
    fn examples() {
        let mig = DeviceName::Mig {
            minor: 3,
            profile: "1g.10gb+me".parse().unwrap(),
            start: 6,
        };
        assert_eq!(mig.to_string(), "gpu-3-mig-1g10gb-me-6");
        assert_eq!("gpu-3-mig-1g10gb-me-6".parse::<DeviceName>().unwrap(), mig);
        assert_eq!(
            "gpu-12".parse::<DeviceName>().unwrap(),
            DeviceName::Gpu { minor: 12 }
        );
    }

    #[test]
    fn rejects_foreign_names() {
        for bad in [
            "gpu",
            "gpu-",
            "gpu-01",
            "gpu-a",
            "gpu-0-mig",
            "gpu-0-mig-3g40gb",
            "gpu-0-mig-3g40gb-",
            "gpu-0-mig-3g40gb-04",
            "gpu-0-mig-3g.40gb-4",
            "gpu-0-mig-3g40gb-xx-4",
            "gpu-0-foo-3g40gb-4",
            "mig-0",
        ] {
            assert!(bad.parse::<DeviceName>().is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn every_catalog_placement_has_a_dns_label_name() {
        for model in catalog::models() {
            for (profile, start) in model.geometry().all_placements() {
                let name = DeviceName::Mig {
                    minor: 255,
                    profile: profile.name,
                    start,
                }
                .to_string();
                assert!(is_dns_label(&name), "{name}");
            }
        }
    }

    proptest! {
        #[test]
        fn round_trips(minor in 0u32..100_000, g in 1u32..9, gb in 1u32..1000, v in 0usize..5, start in 0u32..8, whole in any::<bool>()) {
            let variants = [ProfileVariant::Standard, ProfileVariant::MediaEngines, ProfileVariant::NoMediaEngines,
                ProfileVariant::AllMediaEngines, ProfileVariant::Graphics];
            let name = if whole {
                DeviceName::Gpu { minor }
            } else {
                DeviceName::Mig { minor, profile: ProfileName::new(g, gb, variants[v]), start }
            };
            let text = name.to_string();
            prop_assert!(is_dns_label(&text));
            prop_assert_eq!(text.parse::<DeviceName>().unwrap(), name);
        }
    }
}
