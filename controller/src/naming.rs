//! Names and labels of the ResourceSlices the controller writes.
//!
//! A slice is named `<node>-<driver>-<index>`, the index zero-padded to (at least) three
//! digits, so that within a pool the names sort in pool order: counter slices first, then
//! device slices in first-fit order (the scheduler walks a pool's slices by name). The
//! names are deterministic, so a restarted controller finds and rewrites its own slices
//! instead of piling up new ones. A name that would exceed 253 characters keeps a prefix of
//! the node name plus a hash of the whole node name.

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::{ResourceExt, core::PartialObjectMeta};
use sha2::{Digest, Sha256};

/// Label on every slice: the node it describes (when the node name is a valid label value).
pub const NODE_LABEL: &str = "gpu.migdra.dev/node";

/// The node a slice the controller wrote describes, from its metadata alone (the cache holds
/// no specs): the node label, else the Node owner reference (a node name too long for a
/// label value).
pub fn slice_node(slice: &PartialObjectMeta<ResourceSlice>) -> Option<&str> {
    slice.labels().get(NODE_LABEL).map(String::as_str).or_else(|| {
        slice
            .owner_references()
            .iter()
            .find(|o| o.kind == "Node" && o.api_version == "v1")
            .map(|o| o.name.as_str())
    })
}

/// Longest object name Kubernetes accepts (a DNS subdomain).
pub const MAX_NAME_LENGTH: usize = 253;

const MAX_LABEL_VALUE_LENGTH: usize = 63;

/// Hex digits of the node-name hash used when a name must be shortened.
const HASH_LENGTH: usize = 10;

/// Digits of the index: at least three, more only for pools of 1000 slices or more.
pub fn index_width(slice_count: usize) -> usize {
    let digits = slice_count
        .saturating_sub(1)
        .checked_ilog10()
        .map_or(1, |d| d as usize + 1);
    digits.max(3)
}

/// The name of slice `index` of a pool of `slice_count` slices of `driver` on `node`.
pub fn slice_name(node: &str, driver: &str, index: usize, slice_count: usize) -> String {
    let width = index_width(slice_count);
    let suffix = format!("-{driver}-{index:0width$}");
    let full = format!("{node}{suffix}");
    if full.len() <= MAX_NAME_LENGTH {
        return full;
    }
    let hash = hex::encode(Sha256::digest(node.as_bytes()));
    let hash = &hash[..HASH_LENGTH];
    // `<prefix>-<hash><suffix>`; the prefix must end in an alphanumeric character.
    let room = MAX_NAME_LENGTH.saturating_sub(suffix.len() + HASH_LENGTH + 1);
    let prefix =
        node[..node.floor_char_boundary(room)].trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    if prefix.is_empty() {
        format!("{hash}{suffix}")
    } else {
        format!("{prefix}-{hash}{suffix}")
    }
}

/// True when `s` is 1 to `max` bytes that `allowed` accepts, alphanumeric at both ends.
fn is_token(s: &str, max: usize, allowed: impl Fn(u8) -> bool) -> bool {
    let bytes = s.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= max
        && bytes.iter().all(|b| allowed(*b))
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.last().is_some_and(u8::is_ascii_alphanumeric)
}

/// True when `s` is a valid object name: a lower-case RFC 1123 subdomain of at most 253
/// characters.
pub fn is_dns_subdomain(s: &str) -> bool {
    let label_char = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-';
    s.len() <= MAX_NAME_LENGTH
        && s.split('.')
            .all(|part| is_token(part, MAX_NAME_LENGTH, label_char))
}

/// The node label value, when `node` is a valid label value (at most 63 characters,
/// alphanumeric at both ends, `-`, `_` and `.` inside).
pub fn node_label_value(node: &str) -> Option<&str> {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    is_token(node, MAX_LABEL_VALUE_LENGTH, allowed).then_some(node)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER: &str = "gpu.migdra.dev";

    #[test]
    fn names_sort_in_pool_order() {
        let names: Vec<String> = (0..12).map(|i| slice_name("node-a", DRIVER, i, 12)).collect();
        assert_eq!(names[0], "node-a-gpu.migdra.dev-000");
        assert_eq!(names[11], "node-a-gpu.migdra.dev-011");
        let mut sorted = names.clone();
        sorted.sort();
        assert_eq!(sorted, names);
        // Pools past 1000 slices widen every index of the pool alike.
        let big: Vec<String> = [0, 9, 10, 999, 1000, 1203]
            .iter()
            .map(|i| slice_name("n", DRIVER, *i, 1204))
            .collect();
        assert_eq!(big[0], "n-gpu.migdra.dev-0000");
        let mut sorted = big.clone();
        sorted.sort();
        assert_eq!(sorted, big);
        assert_eq!(index_width(0), 3);
        assert_eq!(index_width(1000), 3);
        assert_eq!(index_width(1001), 4);
    }

    #[test]
    fn names_are_valid_and_bounded() {
        for node in [
            "node-a",
            "ip-10-0-0-1.ec2.internal",
            "a",
            &"x".repeat(253),
            &format!("{}.{}", "a".repeat(200), "b-".repeat(26) + "c"),
        ] {
            for index in [0, 7, 100] {
                let name = slice_name(node, DRIVER, index, 128);
                assert!(name.len() <= MAX_NAME_LENGTH, "{name} is too long");
                assert!(is_dns_subdomain(&name), "{name} is not a DNS subdomain");
                assert!(name.ends_with(&format!("-{DRIVER}-{index:03}")), "{name}");
            }
        }
        // Shortened names stay distinct for distinct long nodes with a common prefix.
        let long_a = format!("{}a", "n".repeat(252));
        let long_b = format!("{}b", "n".repeat(252));
        assert_ne!(
            slice_name(&long_a, DRIVER, 0, 1),
            slice_name(&long_b, DRIVER, 0, 1)
        );
        // Shortening never leaves a separator before the hash.
        let dotted = format!("{}.{}", "a".repeat(219), "b".repeat(30));
        let name = slice_name(&dotted, DRIVER, 0, 1);
        assert!(is_dns_subdomain(&name), "{name}");
    }

    #[test]
    fn subdomain_check() {
        assert!(is_dns_subdomain("a-b.c"));
        for bad in ["", "A", "a..b", "-a", "a-", "a_b", &"a".repeat(254)] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
    }

    #[test]
    fn label_values() {
        assert_eq!(node_label_value("node-a"), Some("node-a"));
        assert_eq!(
            node_label_value("ip-10-0-0-1.ec2.internal"),
            Some("ip-10-0-0-1.ec2.internal")
        );
        assert_eq!(node_label_value(&"n".repeat(64)), None);
        assert_eq!(node_label_value(""), None);
    }
}
