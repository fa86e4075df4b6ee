use std::{
    fs,
    os::unix::fs::{PermissionsExt, symlink},
    path::{Path, PathBuf},
};

use migdra_fake_nvml::driver_root::{
    self as fake, DriverRootLayout, DriverRootOptions, LdCacheFormat, create_driver_root, ld_so_cache_bytes,
    old_format_prefix,
};
use proptest::prelude::*;

use super::{ldcache::LdCacheEntry, *};

const VERSION: &str = "575.57.08";
const KERNEL: &str = "6.8.0-45-generic";
const LIB: &str = "/usr/lib/x86_64-linux-gnu";

/// The versioned libraries the fake installs, by stem.
const FAKE_LIBRARIES: &[&str] = &[
    "libcuda",
    "libcudadebugger",
    "libnvidia-cfg",
    "libnvidia-gpucomp",
    "libnvidia-ml",
    "libnvidia-nvvm",
    "libnvidia-ptxjitcompiler",
];

fn fake_root(options: &DriverRootOptions) -> (tempfile::TempDir, DriverRootLayout) {
    let dir = tempfile::tempdir().unwrap();
    let layout = create_driver_root(dir.path(), VERSION, options).unwrap();
    (dir, layout)
}

/// Inputs for a root this process sees at its host path, with no hook on the "host".
fn inputs(root: &Path, version: &str) -> DiscoveryInputs {
    DiscoveryInputs {
        driver_root: HostDir {
            on_host: root.into(),
            visible_at: root.into(),
        },
        driver_version: version.into(),
        kernel_release: KERNEL.into(),
        host_root: root.join("no-such-host-root"),
        hook_path: PathBuf::from(DEFAULT_HOOK_PATH),
        arch: LibraryArch::X86_64,
    }
}

fn container_paths(files: &[DriverFile]) -> Vec<String> {
    files
        .iter()
        .map(|f| f.container_path.display().to_string())
        .collect()
}

fn links(files: &DriverFiles) -> Vec<(String, String)> {
    files
        .soname_links
        .iter()
        .map(|l| (l.link.display().to_string(), l.target.clone()))
        .collect()
}

fn expected_links() -> Vec<(String, String)> {
    let mut expected = vec![(format!("{LIB}/libcuda.so"), "libcuda.so.1".to_string())];
    for (soname, stem) in [
        ("libcuda.so.1", "libcuda"),
        ("libcudadebugger.so.1", "libcudadebugger"),
        ("libnvidia-cfg.so.1", "libnvidia-cfg"),
        ("libnvidia-ml.so.1", "libnvidia-ml"),
        ("libnvidia-nvvm.so.4", "libnvidia-nvvm"),
        ("libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler"),
    ] {
        expected.push((format!("{LIB}/{soname}"), format!("{stem}.so.{VERSION}")));
    }
    expected.sort();
    expected
}

// ---- linker cache parser ----

fn sample_entries() -> Vec<fake::LdCacheEntry> {
    vec![
        fake::LdCacheEntry::x86_64("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        fake::LdCacheEntry {
            flags: fake::FLAG_ELF_LIBC6,
            key: "libcuda.so.1".into(),
            value: "/usr/lib/i386-linux-gnu/libcuda.so.1".into(),
        },
        fake::LdCacheEntry {
            flags: fake::FLAG_ELF_LIBC6 | fake::FLAG_AARCH64_LIB64,
            key: "libnvidia-ml.so.1".into(),
            value: "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1".into(),
        },
    ]
}

fn as_parsed(entries: &[fake::LdCacheEntry]) -> Vec<LdCacheEntry> {
    entries
        .iter()
        .map(|e| LdCacheEntry {
            flags: e.flags,
            soname: e.key.clone().into(),
            path: PathBuf::from(&e.value),
        })
        .collect()
}

#[test]
fn parses_what_the_fake_writes() {
    let entries = sample_entries();
    let parsed = ldcache::parse(&ld_so_cache_bytes(&entries)).unwrap();
    assert_eq!(parsed, as_parsed(&entries));
}

#[test]
fn skips_an_old_format_table_to_the_new_format() {
    let entries = sample_entries();
    // 0 and 2 old entries need no padding, 1 and 3 need 4 bytes of it.
    for old_entries in 0..4 {
        let mut bytes = old_format_prefix(old_entries);
        bytes.extend_from_slice(&ld_so_cache_bytes(&entries));
        let parsed = ldcache::parse(&bytes).unwrap();
        assert_eq!(parsed, as_parsed(&entries), "{old_entries} old entries");
    }
}

#[test]
fn old_format_alone_is_an_error() {
    let bytes = old_format_prefix(2);
    assert_eq!(
        ldcache::parse(&bytes),
        Err(LdCacheError::OldFormatOnly { offset: 40 })
    );
    let mut bytes = old_format_prefix(1);
    bytes.extend_from_slice(b"not the new magic at all");
    assert_eq!(
        ldcache::parse(&bytes),
        Err(LdCacheError::OldFormatOnly { offset: 32 })
    );
}

#[test]
fn bad_magic_is_an_error() {
    let mut bytes = ld_so_cache_bytes(&sample_entries());
    bytes[0] = b'G';
    assert_eq!(ldcache::parse(&bytes), Err(LdCacheError::BadMagic));
    assert_eq!(ldcache::parse(b""), Err(LdCacheError::BadMagic));
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = ld_so_cache_bytes(&sample_entries());
    for len in 0..bytes.len() {
        assert!(
            ldcache::parse(&bytes[..len]).is_err(),
            "a cache cut at {len} of {} bytes parsed",
            bytes.len()
        );
    }
    assert!(matches!(
        ldcache::parse(&bytes[..30]),
        Err(LdCacheError::Truncated {
            what: "new-format header",
            needed: 48,
            len: 30,
            ..
        })
    ));
}

#[test]
fn string_offset_out_of_range_names_the_field() {
    let mut bytes = ld_so_cache_bytes(&sample_entries());
    // Entry 1's value offset: header 48 + entry 24 + flags 4 + key 4.
    let field = 48 + 24 + 8;
    bytes[field..field + 4].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
    let err = ldcache::parse(&bytes).unwrap_err();
    assert_eq!(
        err,
        LdCacheError::StringOutOfRange {
            offset: field,
            entry: 1,
            field: "value",
            value: 0xffff_fff0,
            len: bytes.len(),
        }
    );
    assert!(err.to_string().starts_with(&format!("byte {field}:")), "{err}");
}

#[test]
fn unterminated_string_is_an_error() {
    let mut bytes = ld_so_cache_bytes(&sample_entries());
    let last = bytes.len() - 1;
    assert_eq!(bytes[last], 0);
    bytes[last] = b'x';
    assert!(matches!(
        ldcache::parse(&bytes),
        Err(LdCacheError::UnterminatedString { entry: 2, .. })
    ));
}

#[test]
fn huge_entry_count_is_truncation_not_allocation() {
    let mut bytes = ld_so_cache_bytes(&sample_entries());
    bytes[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        ldcache::parse(&bytes),
        Err(LdCacheError::Truncated {
            what: "entry table",
            ..
        })
    ));
}

#[test]
fn big_endian_cache_is_refused() {
    let mut bytes = ld_so_cache_bytes(&sample_entries());
    bytes[28] = 3;
    assert_eq!(
        ldcache::parse(&bytes),
        Err(LdCacheError::ByteOrder {
            offset: 28,
            order: "big-endian"
        })
    );
    // ldconfig before glibc 2.32 left the byte order unset.
    bytes[28] = 0;
    assert_eq!(ldcache::parse(&bytes).unwrap().len(), 3);
}

#[test]
fn architecture_filter_takes_one_64_bit_abi() {
    assert!(LibraryArch::X86_64.accepts(0x0303));
    assert!(!LibraryArch::X86_64.accepts(0x0003), "i386");
    assert!(!LibraryArch::X86_64.accepts(0x0803), "x32");
    assert!(!LibraryArch::X86_64.accepts(0x0a03));
    assert!(!LibraryArch::X86_64.accepts(0x0301), "not a libc6 library");
    assert!(LibraryArch::Aarch64.accepts(0x0a03));
    assert!(!LibraryArch::Aarch64.accepts(0x0303));
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = ldcache::parse(&bytes);
        let mut prefixed = b"glibc-ld.so.cache1.1".to_vec();
        prefixed.extend_from_slice(&bytes);
        let _ = ldcache::parse(&prefixed);
        let mut old = b"ld.so-1.7.0".to_vec();
        old.extend_from_slice(&bytes);
        let _ = ldcache::parse(&old);
    }

    #[test]
    fn corrupted_valid_caches_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = ld_so_cache_bytes(&sample_entries());
        for (index, value) in flips {
            let at = index.index(bytes.len());
            bytes[at] = value;
        }
        if let Ok(entries) = ldcache::parse(&bytes) {
            prop_assert!(entries.len() <= bytes.len() / 24);
        }
    }
}

// ---- discovery ----

#[test]
fn discovers_the_fake_root_through_its_linker_cache() {
    let (dir, layout) = fake_root(&DriverRootOptions::default());
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();

    let mut expected: Vec<String> = FAKE_LIBRARIES
        .iter()
        .map(|stem| format!("{LIB}/{stem}.so.{VERSION}"))
        .collect();
    expected.sort();
    assert_eq!(container_paths(&files.libraries), expected);
    let mut hosts: Vec<PathBuf> = files.libraries.iter().map(|l| l.host_path.clone()).collect();
    let mut installed: Vec<PathBuf> = layout.libraries.iter().map(|l| l.file.clone()).collect();
    hosts.sort();
    installed.sort();
    assert_eq!(hosts, installed);
    assert_eq!(links(&files), expected_links());
    assert_eq!(files.library_dirs, [PathBuf::from(LIB)]);
    assert_eq!(
        container_paths(&files.binaries),
        [
            "/usr/bin/nvidia-cuda-mps-control",
            "/usr/bin/nvidia-cuda-mps-server",
            "/usr/bin/nvidia-debugdump",
            "/usr/bin/nvidia-persistenced",
            "/usr/bin/nvidia-smi",
        ]
    );
    assert_eq!(
        container_paths(&files.firmware),
        [
            format!("/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
            format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"),
        ]
    );
    assert_eq!(files.firmware[0].host_path, layout.firmware[0]);
    assert!(files.ipc.is_empty());
    assert_eq!(files.hook, None);
    assert_eq!(files.version, VERSION);
}

#[test]
fn fallback_search_finds_what_the_cache_names() {
    let (with_cache, _) = fake_root(&DriverRootOptions::default());
    let (without, layout) = fake_root(&DriverRootOptions {
        ld_cache: LdCacheFormat::None,
        ..DriverRootOptions::default()
    });
    assert_eq!(layout.ld_cache, None);
    let from_cache = discover(&inputs(with_cache.path(), VERSION)).unwrap();
    let from_search = discover(&inputs(without.path(), VERSION)).unwrap();
    assert_eq!(
        container_paths(&from_search.libraries),
        container_paths(&from_cache.libraries)
    );
    assert_eq!(links(&from_search), links(&from_cache));
    assert!(from_search.libraries[0].host_path.starts_with(without.path()));
}

#[test]
fn old_then_new_cache_gives_the_same_files() {
    let (new, _) = fake_root(&DriverRootOptions::default());
    let (compat, _) = fake_root(&DriverRootOptions {
        ld_cache: LdCacheFormat::OldThenNew,
        ..DriverRootOptions::default()
    });
    let a = discover(&inputs(new.path(), VERSION)).unwrap();
    let b = discover(&inputs(compat.path(), VERSION)).unwrap();
    assert_eq!(container_paths(&a.libraries), container_paths(&b.libraries));
    assert_eq!(links(&a), links(&b));
}

#[test]
fn cache_without_the_driver_falls_back_to_the_directories() {
    let (dir, layout) = fake_root(&DriverRootOptions::default());
    let (reference, _) = fake_root(&DriverRootOptions::default());
    fs::write(
        layout.ld_cache.unwrap(),
        ld_so_cache_bytes(&[fake::LdCacheEntry::x86_64(
            "libc.so.6",
            "/lib/x86_64-linux-gnu/libc.so.6",
        )]),
    )
    .unwrap();
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();
    let expected = discover(&inputs(reference.path(), VERSION)).unwrap();
    assert_eq!(
        container_paths(&files.libraries),
        container_paths(&expected.libraries)
    );
    assert_eq!(links(&files), links(&expected));
}

#[test]
fn fallback_prefers_the_first_directory_for_a_name() {
    let (dir, _) = fake_root(&DriverRootOptions {
        ld_cache: LdCacheFormat::None,
        ..DriverRootOptions::default()
    });
    // A 32-bit copy in /usr/lib (RHEL layout) must lose to the multiarch one.
    let lib32 = dir.path().join("usr/lib");
    fs::write(lib32.join(format!("libcuda.so.{VERSION}")), "32-bit").unwrap();
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();
    let cuda: Vec<_> = container_paths(&files.libraries)
        .into_iter()
        .filter(|p| p.contains("libcuda.so."))
        .collect();
    assert_eq!(cuda, [format!("{LIB}/libcuda.so.{VERSION}")]);
}

#[test]
fn a_driver_container_root_gives_host_paths_under_it() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let mut inputs = inputs(dir.path(), VERSION);
    inputs.driver_root = HostDir {
        on_host: PathBuf::from("/run/nvidia/driver"),
        visible_at: dir.path().to_path_buf(),
    };
    let files = discover(&inputs).unwrap();
    let cuda = files
        .libraries
        .iter()
        .find(|l| l.container_path.ends_with(format!("libcuda.so.{VERSION}")))
        .unwrap();
    assert_eq!(
        cuda.host_path,
        PathBuf::from(format!("/run/nvidia/driver{LIB}/libcuda.so.{VERSION}"))
    );
    assert_eq!(
        cuda.container_path,
        PathBuf::from(format!("{LIB}/libcuda.so.{VERSION}"))
    );
}

#[test]
fn absolute_links_resolve_inside_the_root() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Merged /usr: /lib -> /usr/lib (absolute), libraries only under /usr/lib/<multiarch>.
    fs::create_dir_all(root.join("usr/lib/x86_64-linux-gnu")).unwrap();
    symlink("/usr/lib", root.join("lib")).unwrap();
    for stem in ["libcuda", "libnvidia-ml"] {
        let file = format!("{stem}.so.{VERSION}");
        fs::write(root.join("usr/lib/x86_64-linux-gnu").join(&file), "x").unwrap();
        // Absolute soname link, as some packagers write them.
        symlink(
            format!("{LIB}/{file}"),
            root.join(format!("usr/lib/x86_64-linux-gnu/{stem}.so.1")),
        )
        .unwrap();
    }
    fs::create_dir_all(root.join("etc")).unwrap();
    // ldconfig scanned /lib/x86_64-linux-gnu, which is the same directory.
    fs::write(
        root.join("etc/ld.so.cache"),
        ld_so_cache_bytes(&[
            fake::LdCacheEntry::x86_64("libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1"),
            fake::LdCacheEntry::x86_64("libnvidia-ml.so.1", "/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        ]),
    )
    .unwrap();
    let files = discover(&inputs(root, VERSION)).unwrap();
    assert_eq!(
        container_paths(&files.libraries),
        [
            format!("{LIB}/libcuda.so.{VERSION}"),
            format!("{LIB}/libnvidia-ml.so.{VERSION}")
        ]
    );
    assert_eq!(
        files.libraries[0].host_path,
        root.join(format!("usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}"))
    );
    assert!(links(&files).contains(&(format!("{LIB}/libcuda.so.1"), format!("libcuda.so.{VERSION}"))));
}

#[test]
fn link_loops_are_skipped_not_followed_forever() {
    let (dir, _) = fake_root(&DriverRootOptions {
        ld_cache: LdCacheFormat::None,
        ..DriverRootOptions::default()
    });
    let lib = dir.path().join("usr/lib/x86_64-linux-gnu");
    symlink("libloop.so.2", lib.join("libloop.so.1")).unwrap();
    symlink("libloop.so.1", lib.join("libloop.so.2")).unwrap();
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();
    assert!(links(&files).iter().all(|(link, _)| !link.contains("libloop")));
}

#[test]
fn vdpau_libraries_beside_cached_directories_are_included() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let vdpau = dir.path().join("usr/lib/x86_64-linux-gnu/vdpau");
    fs::create_dir_all(&vdpau).unwrap();
    fs::write(vdpau.join(format!("libvdpau_nvidia.so.{VERSION}")), "x").unwrap();
    symlink(
        format!("libvdpau_nvidia.so.{VERSION}"),
        vdpau.join("libvdpau_nvidia.so.1"),
    )
    .unwrap();
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();
    assert!(container_paths(&files.libraries).contains(&format!("{LIB}/vdpau/libvdpau_nvidia.so.{VERSION}")));
    assert!(links(&files).contains(&(
        format!("{LIB}/vdpau/libvdpau_nvidia.so.1"),
        format!("libvdpau_nvidia.so.{VERSION}")
    )));
    assert_eq!(
        files.library_dirs,
        [PathBuf::from(LIB), PathBuf::from(format!("{LIB}/vdpau"))]
    );
}

#[test]
fn missing_libcuda_is_an_error_naming_what_was_searched() {
    let (dir, layout) = fake_root(&DriverRootOptions::default());
    fs::remove_file(&layout.libraries[0].file).unwrap();
    let err = discover(&inputs(dir.path(), VERSION)).unwrap_err();
    assert!(
        matches!(
            err,
            DriverFilesError::MissingLibrary {
                library: "libcuda",
                ..
            }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.starts_with(&format!(
            "no libcuda.so.{VERSION} found under {root} (searched: {root}/etc/ld.so.cache, \
             {root}/usr/lib64, ",
            root = dir.path().display(),
        )),
        "{message}"
    );
}

#[test]
fn missing_libcuda_in_the_fallback_lists_the_directories() {
    let dir = tempfile::tempdir().unwrap();
    let err = discover(&inputs(dir.path(), VERSION)).unwrap_err();
    let message = err.to_string();
    let root = dir.path().display();
    assert!(
        message.contains(&format!(
            "(searched: {root}/usr/lib64, {root}/usr/lib64/vdpau, {root}/usr/lib/x86_64-linux-gnu, "
        )),
        "{message}"
    );
    assert!(message.contains(&format!("{root}/lib/vdpau)")), "{message}");
}

#[test]
fn missing_libnvidia_ml_is_an_error() {
    let (dir, layout) = fake_root(&DriverRootOptions::default());
    let ml = layout
        .libraries
        .iter()
        .find(|l| l.file.ends_with(format!("libnvidia-ml.so.{VERSION}")))
        .unwrap();
    fs::remove_file(&ml.file).unwrap();
    let err = discover(&inputs(dir.path(), VERSION)).unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("no libnvidia-ml.so.{VERSION} found")),
        "{err}"
    );
}

#[test]
fn another_driver_version_finds_nothing() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let err = discover(&inputs(dir.path(), "580.65.06")).unwrap_err();
    assert!(
        err.to_string().starts_with("no libcuda.so.580.65.06 found"),
        "{err}"
    );
}

#[test]
fn corrupt_cache_in_the_root_is_an_error_with_its_path() {
    let (dir, layout) = fake_root(&DriverRootOptions::default());
    let cache = layout.ld_cache.unwrap();
    let bytes = fs::read(&cache).unwrap();
    fs::write(&cache, &bytes[..bytes.len() - 5]).unwrap();
    let err = discover(&inputs(dir.path(), VERSION)).unwrap_err();
    assert!(
        matches!(&err, DriverFilesError::CorruptLdCache { path, .. } if *path == cache),
        "{err}"
    );
}

#[test]
fn invalid_versions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for version in ["", "../575", "575 57"] {
        assert!(matches!(
            discover(&inputs(dir.path(), version)),
            Err(DriverFilesError::InvalidVersion(_))
        ));
    }
}

#[test]
fn hook_is_found_on_the_host_root_only_when_executable() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let host = tempfile::tempdir().unwrap();
    let hook = host.path().join("usr/bin/nvidia-cdi-hook");
    fs::create_dir_all(hook.parent().unwrap()).unwrap();
    fs::write(&hook, "#!/bin/sh\n").unwrap();
    fs::set_permissions(&hook, fs::Permissions::from_mode(0o644)).unwrap();
    let mut inputs = inputs(dir.path(), VERSION);
    inputs.host_root = host.path().to_path_buf();
    assert_eq!(discover(&inputs).unwrap().hook, None);
    fs::set_permissions(&hook, fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        discover(&inputs).unwrap().hook,
        Some(PathBuf::from(DEFAULT_HOOK_PATH))
    );
}

#[test]
fn binaries_must_be_executable_and_the_first_directory_wins() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let root = dir.path();
    fs::set_permissions(root.join("usr/bin/nvidia-smi"), fs::Permissions::from_mode(0o644)).unwrap();
    fs::create_dir_all(root.join("usr/sbin")).unwrap();
    fs::write(root.join("usr/sbin/nvidia-smi"), "#!/bin/sh\n").unwrap();
    fs::set_permissions(
        root.join("usr/sbin/nvidia-smi"),
        fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    fs::create_dir_all(root.join("sbin")).unwrap();
    fs::write(root.join("sbin/nvidia-imex"), "#!/bin/sh\n").unwrap();
    fs::set_permissions(root.join("sbin/nvidia-imex"), fs::Permissions::from_mode(0o755)).unwrap();
    let files = discover(&inputs(root, VERSION)).unwrap();
    let paths = container_paths(&files.binaries);
    assert!(paths.contains(&"/usr/sbin/nvidia-smi".to_string()), "{paths:?}");
    assert!(!paths.contains(&"/usr/bin/nvidia-smi".to_string()), "{paths:?}");
    assert!(paths.contains(&"/sbin/nvidia-imex".to_string()), "{paths:?}");
    assert!(!paths.iter().any(|p| p.ends_with("nvidia-imex-ctl")));
}

#[test]
fn firmware_updates_directory_wins_per_file() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let updates = dir
        .path()
        .join(format!("lib/firmware/updates/{KERNEL}/nvidia/{VERSION}"));
    fs::create_dir_all(&updates).unwrap();
    fs::write(updates.join("gsp_ga10x.bin"), "newer").unwrap();
    fs::write(updates.join("README"), "not firmware").unwrap();
    let files = discover(&inputs(dir.path(), VERSION)).unwrap();
    assert_eq!(
        container_paths(&files.firmware),
        [
            format!("/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"),
            format!("/lib/firmware/updates/{KERNEL}/nvidia/{VERSION}/gsp_ga10x.bin"),
        ]
    );
}

#[test]
fn ipc_endpoints_take_the_first_candidate_that_exists() {
    let (dir, layout) = fake_root(&DriverRootOptions {
        persistenced_socket: true,
        ..DriverRootOptions::default()
    });
    let root = dir.path();
    // Also under /var/run: /run wins.
    fs::create_dir_all(root.join("var/run/nvidia-persistenced")).unwrap();
    fs::write(root.join("var/run/nvidia-persistenced/socket"), "").unwrap();
    fs::create_dir_all(root.join("var/run/nvidia-fabricmanager")).unwrap();
    fs::write(root.join("var/run/nvidia-fabricmanager/socket"), "").unwrap();
    let files = discover(&inputs(root, VERSION)).unwrap();
    assert_eq!(
        container_paths(&files.ipc),
        [
            "/run/nvidia-persistenced/socket",
            "/var/run/nvidia-fabricmanager/socket",
        ]
    );
    assert_eq!(Some(files.ipc[0].host_path.clone()), layout.persistenced_socket);
}

/// Where the host's MPS control daemon keeps its pipes (and where MPS clients look).
const MPS_PIPE_DIR: &str = "tmp/nvidia-mps";

#[test]
fn the_hosts_mps_pipe_directory_is_never_handed_to_containers() {
    let (dir, _) = fake_root(&DriverRootOptions {
        persistenced_socket: true,
        ..DriverRootOptions::default()
    });
    let root = dir.path();
    // A running MPS control daemon: its pipe directory with a pipe and its log directory.
    fs::create_dir_all(root.join(MPS_PIPE_DIR)).unwrap();
    fs::write(root.join(MPS_PIPE_DIR).join("control"), "").unwrap();
    fs::create_dir_all(root.join("var/log/nvidia-mps")).unwrap();
    let files = discover(&inputs(root, VERSION)).unwrap();
    let edits = container_edits(&files);
    assert!(!edits.mounts.is_empty(), "the driver's files are mounted");
    let mps: Vec<&Mount> = edits
        .mounts
        .iter()
        .filter(|m| m.container_path.contains("nvidia-mps") || m.host_path.contains("nvidia-mps"))
        .collect();
    assert!(mps.is_empty(), "MPS mounts: {mps:?}");
    // The other daemon socket still is, writable.
    let socket = edits
        .mounts
        .iter()
        .find(|m| m.container_path == "/run/nvidia-persistenced/socket")
        .expect("the persistenced socket is mounted");
    assert!(!socket.options.iter().any(|o| o == "ro"), "{socket:?}");
}

#[test]
fn kernel_release_is_read_and_trimmed() {
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir_all(dir.path().join("sys/kernel")).unwrap();
    fs::write(dir.path().join("sys/kernel/osrelease"), format!("{KERNEL}\n")).unwrap();
    assert_eq!(read_kernel_release(dir.path()).unwrap(), KERNEL);
    let err = read_kernel_release(&dir.path().join("nope")).unwrap_err();
    assert!(err.to_string().contains("sys/kernel/osrelease"), "{err}");
}

// ---- planning ----

fn file(host: &str, container: &str) -> DriverFile {
    DriverFile {
        host_path: host.into(),
        container_path: container.into(),
    }
}

/// A driver container root at /run/nvidia/driver with two libraries.
fn hand_built() -> DriverFiles {
    DriverFiles {
        version: VERSION.into(),
        libraries: vec![
            file(
                "/run/nvidia/driver/usr/lib64/libcuda.so.575.57.08",
                "/usr/lib64/libcuda.so.575.57.08",
            ),
            file(
                "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.575.57.08",
                "/usr/lib64/libnvidia-ml.so.575.57.08",
            ),
        ],
        binaries: vec![file(
            "/run/nvidia/driver/usr/bin/nvidia-smi",
            "/usr/bin/nvidia-smi",
        )],
        firmware: vec![],
        ipc: vec![file(
            "/run/nvidia/driver/run/nvidia-persistenced/socket",
            "/run/nvidia-persistenced/socket",
        )],
        soname_links: vec![
            SonameLink {
                link: "/usr/lib64/libcuda.so".into(),
                target: "libcuda.so.1".into(),
            },
            SonameLink {
                link: "/usr/lib64/libcuda.so.1".into(),
                target: "libcuda.so.575.57.08".into(),
            },
            SonameLink {
                link: "/usr/lib64/libnvidia-ml.so.1".into(),
                target: "libnvidia-ml.so.575.57.08".into(),
            },
        ],
        library_dirs: vec!["/usr/lib64".into()],
        hook: Some("/usr/bin/nvidia-cdi-hook".into()),
    }
}

#[test]
fn hook_argv0_is_the_hook_file_name() {
    let mut files = hand_built();
    files.hook = Some("/opt/toolkit/bin/nvidia-cdi-hook-1.17".into());
    let edits = container_edits(&files);
    assert_eq!(edits.hooks.len(), 4);
    assert!(edits.hooks.iter().all(|h| h.path == "/opt/toolkit/bin/nvidia-cdi-hook-1.17"
        && h.args[0] == "nvidia-cdi-hook-1.17"));
}

#[test]
fn edits_mount_files_and_run_the_toolkits_hooks_in_its_order() {
    let edits = container_edits(&hand_built());
    let json = serde_json::to_value(&edits).unwrap();
    let ro = ["ro", "nosuid", "nodev", "rbind", "rprivate"];
    let expected = serde_json::json!({
        "env": [
            "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib64",
            "NVIDIA_VISIBLE_DEVICES=void",
        ],
        "mounts": [
            {
                "hostPath": "/run/nvidia/driver/run/nvidia-persistenced/socket",
                "containerPath": "/run/nvidia-persistenced/socket",
                "options": ["nosuid", "nodev", "rbind", "rprivate", "noexec"],
            },
            {
                "hostPath": "/run/nvidia/driver/usr/bin/nvidia-smi",
                "containerPath": "/usr/bin/nvidia-smi",
                "options": ro,
            },
            {
                "hostPath": "/run/nvidia/driver/usr/lib64/libcuda.so.575.57.08",
                "containerPath": "/usr/lib64/libcuda.so.575.57.08",
                "options": ro,
            },
            {
                "hostPath": "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.575.57.08",
                "containerPath": "/usr/lib64/libnvidia-ml.so.575.57.08",
                "options": ro,
            },
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": [
                    "nvidia-cdi-hook", "create-symlinks",
                    "--link", "libcuda.so.1::/usr/lib64/libcuda.so",
                    "--link", "libcuda.so.575.57.08::/usr/lib64/libcuda.so.1",
                    "--link", "libnvidia-ml.so.575.57.08::/usr/lib64/libnvidia-ml.so.1",
                ],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            },
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": [
                    "nvidia-cdi-hook", "enable-cuda-compat",
                    "--host-driver-version=575.57.08",
                ],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            },
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib64"],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            },
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "disable-device-node-modification"],
                "env": ["NVIDIA_CTK_DEBUG=false"],
            },
        ],
    });
    assert_eq!(json, expected, "{}", serde_json::to_string_pretty(&json).unwrap());
    // And it reads back as the same edits.
    let back: ContainerEdits = serde_json::from_value(json).unwrap();
    assert_eq!(back, edits);
}

#[test]
fn without_the_hook_soname_paths_are_mounts_instead() {
    let mut files = hand_built();
    files.hook = None;
    let edits = container_edits(&files);
    assert!(edits.hooks.is_empty());
    let mounts: Vec<(&str, &str)> = edits
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.host_path.as_str()))
        .collect();
    assert_eq!(
        mounts,
        [
            (
                "/run/nvidia-persistenced/socket",
                "/run/nvidia/driver/run/nvidia-persistenced/socket"
            ),
            ("/usr/bin/nvidia-smi", "/run/nvidia/driver/usr/bin/nvidia-smi"),
            (
                "/usr/lib64/libcuda.so.1",
                "/run/nvidia/driver/usr/lib64/libcuda.so.575.57.08"
            ),
            (
                "/usr/lib64/libcuda.so.575.57.08",
                "/run/nvidia/driver/usr/lib64/libcuda.so.575.57.08"
            ),
            (
                "/usr/lib64/libnvidia-ml.so.1",
                "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.575.57.08"
            ),
            (
                "/usr/lib64/libnvidia-ml.so.575.57.08",
                "/run/nvidia/driver/usr/lib64/libnvidia-ml.so.575.57.08"
            ),
        ]
    );
    assert!(edits.env.contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string()));
}

#[test]
fn duplicate_inputs_give_one_mount_and_one_link_each() {
    let mut files = hand_built();
    files.libraries.push(files.libraries[0].clone());
    files.soname_links.push(files.soname_links[1].clone());
    files.library_dirs.push("/usr/lib64".into());
    let edits = container_edits(&files);
    assert_eq!(edits, container_edits(&hand_built()));
}

#[test]
fn discovered_fake_root_plans_links_and_ldcache_folders() {
    let (dir, _) = fake_root(&DriverRootOptions::default());
    let host = tempfile::tempdir().unwrap();
    let hook = host.path().join("usr/bin/nvidia-cdi-hook");
    fs::create_dir_all(hook.parent().unwrap()).unwrap();
    fs::write(&hook, "#!/bin/sh\n").unwrap();
    fs::set_permissions(&hook, fs::Permissions::from_mode(0o755)).unwrap();
    let mut inputs = inputs(dir.path(), VERSION);
    inputs.host_root = host.path().to_path_buf();
    let edits = container_edits(&discover(&inputs).unwrap());
    // 7 libraries + 5 utilities + 2 firmware files.
    assert_eq!(edits.mounts.len(), 14);
    assert!(
        edits
            .mounts
            .windows(2)
            .all(|w| w[0].container_path < w[1].container_path)
    );
    let symlinks = &edits.hooks[0].args;
    assert_eq!(symlinks[1], "create-symlinks");
    assert_eq!(symlinks.len(), 2 + 2 * expected_links().len());
    assert!(symlinks.contains(&format!("libcuda.so.1::{LIB}/libcuda.so")));
    assert!(symlinks.contains(&format!("libnvidia-ml.so.{VERSION}::{LIB}/libnvidia-ml.so.1")));
    let stages: Vec<&str> = edits.hooks.iter().map(|h| h.args[1].as_str()).collect();
    assert_eq!(
        stages,
        [
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification"
        ]
    );
    assert_eq!(edits.hooks[1].args[2], format!("--host-driver-version={VERSION}"));
    assert_eq!(
        edits.hooks[2].args,
        ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB]
    );
    assert!(edits.env.contains(&format!("NVIDIA_CTK_LIBCUDA_DIR={LIB}")));
}

// ---- device nodes ----

#[test]
fn all_control_nodes_present_is_fine() {
    assert!(check_required_device_nodes(Path::new("/host/dev"), |_| true).is_ok());
}

#[test]
fn missing_uvm_nodes_say_which_module_is_missing() {
    let err =
        check_required_device_nodes(Path::new("/host/dev"), |p| !p.ends_with("nvidia-uvm")).unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with(
            "/dev/nvidia-uvm missing: the nvidia-uvm kernel module is not loaded (no nvidia-uvm in /proc/devices"
        ),
        "{message}"
    );
    assert!(
        message.ends_with("(looked for /host/dev/nvidia-uvm)"),
        "{message}"
    );
    let err = check_required_device_nodes(Path::new("/dev"), |_| false).unwrap_err();
    let DriverFilesError::MissingDeviceNodes(missing) = &err else {
        panic!("{err}");
    };
    let nodes: Vec<&str> = missing.iter().map(|m| m.node.as_str()).collect();
    assert_eq!(
        nodes,
        ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    );
    assert!(
        err.to_string()
            .starts_with("/dev/nvidiactl missing: the nvidia kernel module is not loaded; ")
    );
    assert!(!err.to_string().contains("looked for"), "{err}");
}

#[test]
fn missing_uvm_nodes_are_made_from_the_major_and_present_ones_kept() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let dev = tempfile::tempdir().unwrap();
    // Without a major (module not loaded) nothing is made.
    assert!(create_missing_uvm_nodes(dev.path(), None).unwrap().is_empty());
    assert!(!dev.path().join("nvidia-uvm").exists());
    // An existing node (here a plain file standing for one) is left alone.
    fs::write(dev.path().join("nvidia-uvm"), b"").unwrap();
    let created = create_missing_uvm_nodes(dev.path(), Some(511)).unwrap();
    assert_eq!(created, [dev.path().join("nvidia-uvm-tools")]);
    assert!(fs::metadata(dev.path().join("nvidia-uvm")).unwrap().is_file());
    let tools = fs::metadata(dev.path().join("nvidia-uvm-tools")).unwrap();
    assert!(tools.file_type().is_char_device());
    assert_eq!(tools.rdev(), libc::makedev(511, 1));
    assert_eq!(tools.mode() & 0o7777, 0o666);
    assert!(
        create_missing_uvm_nodes(dev.path(), Some(511))
            .unwrap()
            .is_empty()
    );
    // A device root that cannot hold nodes is an error naming the path.
    let err = create_missing_uvm_nodes(&dev.path().join("no-such-dir"), Some(511)).unwrap_err();
    assert!(err.to_string().contains("no-such-dir/nvidia-uvm"), "{err}");
}

// ---- the NVML library ----

#[test]
fn nvml_is_found_in_the_library_directory_of_the_distribution_and_architecture() {
    let lib = |root: &Path, dir: &str| {
        let dir = root.join(dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libnvidia-ml.so.580.82.07"), b"").unwrap();
        std::os::unix::fs::symlink("libnvidia-ml.so.580.82.07", dir.join(NVML_LIBRARY)).unwrap();
    };
    // Ubuntu, x86_64 and arm64 (a GH200 node).
    for (arch, dir) in [
        (LibraryArch::X86_64, "usr/lib/x86_64-linux-gnu"),
        (LibraryArch::Aarch64, "usr/lib/aarch64-linux-gnu"),
    ] {
        let root = tempfile::tempdir().unwrap();
        lib(root.path(), dir);
        assert_eq!(
            find_nvml_library(root.path(), arch),
            Some(root.path().join(dir).join("libnvidia-ml.so.580.82.07"))
        );
    }
    // Only this architecture's triplet: an arm64 plugin never loads an x86 library.
    let root = tempfile::tempdir().unwrap();
    lib(root.path(), "usr/lib/x86_64-linux-gnu");
    assert_eq!(find_nvml_library(root.path(), LibraryArch::Aarch64), None);
    // RHEL: lib64 wins over the 32-bit copy in usr/lib.
    let root = tempfile::tempdir().unwrap();
    lib(root.path(), "usr/lib");
    lib(root.path(), "usr/lib64");
    assert_eq!(
        find_nvml_library(root.path(), LibraryArch::X86_64),
        Some(root.path().join("usr/lib64/libnvidia-ml.so.580.82.07"))
    );
    // An absolute link resolves inside the root (a driver container's layout).
    let root = tempfile::tempdir().unwrap();
    fs::create_dir_all(root.path().join("usr/lib64")).unwrap();
    fs::create_dir_all(root.path().join("opt/nvidia")).unwrap();
    fs::write(root.path().join("opt/nvidia/libnvidia-ml.so.580.82.07"), b"").unwrap();
    std::os::unix::fs::symlink(
        "/opt/nvidia/libnvidia-ml.so.580.82.07",
        root.path().join("usr/lib64").join(NVML_LIBRARY),
    )
    .unwrap();
    assert_eq!(
        find_nvml_library(root.path(), LibraryArch::X86_64),
        Some(root.path().join("opt/nvidia/libnvidia-ml.so.580.82.07"))
    );
    // Nothing installed.
    assert_eq!(
        find_nvml_library(tempfile::tempdir().unwrap().path(), LibraryArch::X86_64),
        None
    );
}

// ---- re-discovery ----

#[test]
fn cache_discovers_again_only_when_inputs_change() {
    let mut cache = DriverFilesCache::default();
    let mut calls = Vec::new();
    let mut get = |cache: &mut DriverFilesCache, version: &str| {
        cache
            .get_with(&inputs(Path::new("/r"), version), |inputs| {
                calls.push(inputs.driver_version.clone());
                let mut files = hand_built();
                files.version = inputs.driver_version.clone();
                Ok(files)
            })
            .map(|files| files.version.clone())
    };
    assert_eq!(get(&mut cache, "575.57.08").unwrap(), "575.57.08");
    assert_eq!(get(&mut cache, "575.57.08").unwrap(), "575.57.08");
    assert_eq!(get(&mut cache, "580.65.06").unwrap(), "580.65.06");
    assert_eq!(get(&mut cache, "580.65.06").unwrap(), "580.65.06");
    assert_eq!(calls, ["575.57.08", "580.65.06"]);
}

#[test]
fn cache_does_not_keep_failures() {
    let mut cache = DriverFilesCache::default();
    let inputs = inputs(Path::new("/r"), VERSION);
    let err = cache.get_with(&inputs, |i| {
        Err(DriverFilesError::InvalidVersion(i.driver_version.clone()))
    });
    assert!(err.is_err());
    let mut called = false;
    cache
        .get_with(&inputs, |_| {
            called = true;
            Ok(hand_built())
        })
        .unwrap();
    assert!(called);
}

#[test]
fn driver_upgrade_on_disk_is_picked_up_with_the_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    fs::create_dir(&root).unwrap();
    create_driver_root(&root, VERSION, &DriverRootOptions::default()).unwrap();
    let mut cache = DriverFilesCache::default();
    let old = cache.get(&inputs(&root, VERSION)).unwrap();
    // Upgrade: the old files are replaced by the new version's.
    fs::remove_dir_all(&root).unwrap();
    fs::create_dir(&root).unwrap();
    create_driver_root(&root, "580.65.06", &DriverRootOptions::default()).unwrap();
    let same = cache.get(&inputs(&root, VERSION)).unwrap();
    assert!(
        std::sync::Arc::ptr_eq(&old, &same),
        "same inputs reuse the last discovery"
    );
    let new = cache.get(&inputs(&root, "580.65.06")).unwrap();
    assert_eq!(new.version, "580.65.06");
    assert!(
        container_paths(&new.libraries).contains(&format!("{LIB}/libcuda.so.580.65.06")),
        "{:?}",
        new.libraries
    );
}
