//! The small part of Kubernetes quantities the slice model needs: non-negative integers with
//! an optional binary (`Ki`..`Ei`) or decimal (`k`..`E`) suffix, in canonical form.

/// Parses an integer quantity into its value in base units. `None` for anything else
/// (fractions, exponents, negative numbers, overflow).
pub fn parse(q: &str) -> Option<u128> {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (digits, suffix) = q.split_at(split);
    if digits.is_empty() {
        return None;
    }
    let n: u128 = digits.parse().ok()?;
    let factor: u128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        _ => return None,
    };
    n.checked_mul(factor)
}

/// A MiB amount as a quantity (`81559Mi`), or `0`.
pub fn mebibytes(mib: u64) -> String {
    if mib == 0 {
        "0".to_string()
    } else {
        format!("{mib}Mi")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_integer_quantities() {
        assert_eq!(parse("0"), Some(0));
        assert_eq!(parse("7"), Some(7));
        assert_eq!(parse("1Ki"), Some(1024));
        assert_eq!(parse("81559Mi"), Some(81559 << 20));
        assert_eq!(parse("2G"), Some(2_000_000_000));
        for bad in ["", "Mi", "-1", "1.5", "1e3", "1mi", "1 Mi"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
        assert_eq!(parse(&mebibytes(40192)), Some(40192 << 20));
    }
}
