//! MIG profile names: `<G>g.<GB>gb[suffix]` for GPU instances and
//! `<C>c.<G>g.<GB>gb[suffix]` for compute instances that do not span their GPU instance.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

/// The media/graphics variant of a profile, written as a suffix of its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum ProfileVariant {
    /// No suffix.
    #[default]
    Standard,
    /// `+me`: at least one media engine (decoder, encoder, JPEG, OFA).
    MediaEngines,
    /// `-me`: no media engines.
    NoMediaEngines,
    /// `+me.all`: all media engines of the GPU.
    AllMediaEngines,
    /// `+gfx`: graphics APIs.
    Graphics,
}

impl ProfileVariant {
    /// The suffix as NVIDIA writes it in profile names.
    pub fn suffix(self) -> &'static str {
        match self {
            Self::Standard => "",
            Self::MediaEngines => "+me",
            Self::NoMediaEngines => "-me",
            Self::AllMediaEngines => "+me.all",
            Self::Graphics => "+gfx",
        }
    }

    /// The suffix in a DNS-label-safe spelling, used inside device names.
    pub fn label_suffix(self) -> &'static str {
        match self {
            Self::Standard => "",
            Self::MediaEngines => "-me",
            Self::NoMediaEngines => "-nome",
            Self::AllMediaEngines => "-meall",
            Self::Graphics => "-gfx",
        }
    }

    const ALL: [ProfileVariant; 5] = [
        Self::Standard,
        Self::MediaEngines,
        Self::NoMediaEngines,
        Self::AllMediaEngines,
        Self::Graphics,
    ];
}

/// A parsed GPU-instance profile name such as `3g.40gb` or `1g.10gb+me`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProfileName {
    /// Compute slices of the GPU instance (the `G` in `<G>g`).
    pub compute_slices: u32,
    /// Memory in (marketing) gigabytes, as printed in the name.
    pub memory_gb: u32,
    /// Media/graphics variant.
    pub variant: ProfileVariant,
}

/// A profile name that does not follow NVIDIA's `<G>g.<GB>gb[suffix]` form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid MIG profile name {name:?}: expected <G>g.<GB>gb with an optional +me, -me, +me.all or +gfx suffix"
)]
pub struct InvalidProfileName {
    pub name: String,
}

impl ProfileName {
    pub fn new(compute_slices: u32, memory_gb: u32, variant: ProfileVariant) -> Self {
        Self {
            compute_slices,
            memory_gb,
            variant,
        }
    }

    /// The DNS-label-safe spelling used in device names: `3g.40gb+me` becomes `3g40gb-me`.
    pub fn to_label(&self) -> String {
        format!(
            "{}g{}gb{}",
            self.compute_slices,
            self.memory_gb,
            self.variant.label_suffix()
        )
    }

    /// Parses the spelling produced by [`ProfileName::to_label`].
    pub fn from_label(label: &str) -> Result<Self, InvalidProfileName> {
        parse_name(label, "g", ProfileVariant::label_suffix).ok_or_else(|| InvalidProfileName {
            name: label.to_string(),
        })
    }
}

/// Parses `<G><separator><GB>gb<suffix>`, the suffix spelled as `suffix_of` spells it.
fn parse_name(
    s: &str,
    separator: &str,
    suffix_of: fn(ProfileVariant) -> &'static str,
) -> Option<ProfileName> {
    let (g, rest) = split_number(s)?;
    let (gb, rest) = split_number(rest.strip_prefix(separator)?)?;
    let suffix = rest.strip_prefix("gb")?;
    let variant = ProfileVariant::ALL
        .into_iter()
        .find(|v| suffix_of(*v) == suffix)?;
    Some(ProfileName::new(g, gb, variant))
}

impl fmt::Display for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}g.{}gb{}",
            self.compute_slices,
            self.memory_gb,
            self.variant.suffix()
        )
    }
}

impl FromStr for ProfileName {
    type Err = InvalidProfileName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // NVML's v2/v3 profile info spells names as "MIG 1g.10gb"; accept that too.
        parse_name(s.strip_prefix("MIG ").unwrap_or(s), "g.", ProfileVariant::suffix)
            .filter(|p| p.compute_slices > 0 && p.memory_gb > 0)
            .ok_or_else(|| InvalidProfileName { name: s.to_string() })
    }
}

impl Serialize for ProfileName {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ProfileName {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for ProfileName {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ProfileName".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": r"^[1-9][0-9]*g\.[1-9][0-9]*gb(\+me|-me|\+me\.all|\+gfx)?$",
            "description": "A MIG GPU-instance profile name such as 3g.40gb or 1g.10gb+me"
        })
    }
}

/// Splits a leading decimal number (no sign, no leading zero unless it is "0") off `s`.
fn split_number(s: &str) -> Option<(u32, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    if end == 0 || (end > 1 && s.starts_with('0')) {
        return None;
    }
    let n = s[..end].parse().ok()?;
    Some((n, &s[end..]))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parses_nvidia_spellings() {
        let p: ProfileName = "1g.10gb+me".parse().unwrap();
        assert_eq!(p, ProfileName::new(1, 10, ProfileVariant::MediaEngines));
        assert_eq!(
            "MIG 7g.80gb".parse::<ProfileName>().unwrap().to_string(),
            "7g.80gb"
        );
        assert_eq!(
            "2g.24gb+me.all".parse::<ProfileName>().unwrap().variant,
            ProfileVariant::AllMediaEngines
        );
        assert_eq!(
            "1g.12gb-me".parse::<ProfileName>().unwrap().variant,
            ProfileVariant::NoMediaEngines
        );
        assert_eq!(
            "4g.48gb+gfx".parse::<ProfileName>().unwrap().variant,
            ProfileVariant::Graphics
        );
    }

    #[test]
    fn rejects_malformed_names() {
        for bad in [
            "",
            "1g",
            "1g.10",
            "1g.10gb+",
            "1g.10gb+xx",
            "g.10gb",
            "01g.10gb",
            "0g.5gb",
            "1g.10GB",
            "1c.1g.10gb",
        ] {
            assert!(bad.parse::<ProfileName>().is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn label_is_dns_safe() {
        let p: ProfileName = "1g.10gb+me.all".parse().unwrap();
        assert_eq!(p.to_label(), "1g10gb-meall");
        assert!(
            p.to_label()
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        );
    }

    fn any_profile() -> impl Strategy<Value = ProfileName> {
        (1u32..=8, 1u32..=400, 0usize..5)
            .prop_map(|(g, gb, v)| ProfileName::new(g, gb, ProfileVariant::ALL[v]))
    }

    proptest! {
        #[test]
        fn display_and_label_round_trip(p in any_profile()) {
            prop_assert_eq!(p.to_string().parse::<ProfileName>().unwrap(), p);
            prop_assert_eq!(ProfileName::from_label(&p.to_label()).unwrap(), p);
        }
    }
}
