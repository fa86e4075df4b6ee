//! Golden files: `tests/golden/<name>`, rewritten when `MIGDRA_UPDATE_GOLDEN` is set.

use std::path::PathBuf;

/// Environment variable that rewrites the goldens instead of comparing.
pub const UPDATE: &str = "MIGDRA_UPDATE_GOLDEN";

/// Compares `actual` with the golden `name`, or rewrites it.
pub fn check(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os(UPDATE).is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden {} missing ({e}); run with {UPDATE}=1", path.display()));
    assert!(
        expected == actual,
        "{name} differs from its golden {} (run with {UPDATE}=1 to accept)\n--- expected\n{expected}\n--- actual\n{actual}",
        path.display()
    );
}
