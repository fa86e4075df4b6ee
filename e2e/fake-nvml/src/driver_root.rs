//! A fake NVIDIA driver root: the user-space files a driver installation puts on a node
//! (versioned libraries with their soname and development links, utilities, GSP firmware,
//! optionally the persistenced socket) and the root's linker cache `etc/ld.so.cache`, so the
//! kubelet plugin's driver-file discovery can be tested, and an e2e node can be given a
//! driver root, without a GPU.
//!
//! The files are markers, not ELF objects: discovery only looks at names, links and the
//! linker cache. The cache is written in glibc's format by [`ld_so_cache_bytes`]; the layout
//! is described there.

use std::{
    fs, io,
    os::unix::fs::{PermissionsExt, symlink},
    path::{Path, PathBuf},
};

/// Directory (inside the root) of the fake libraries: Debian's multiarch directory.
pub const LIB_DIR: &str = "/usr/lib/x86_64-linux-gnu";
/// Directory (inside the root) of the fake utilities.
pub const BIN_DIR: &str = "/usr/bin";
/// The persistenced socket (inside the root), when [`DriverRootOptions::persistenced_socket`].
pub const PERSISTENCED_SOCKET: &str = "/run/nvidia-persistenced/socket";

/// ld.so.cache entry flags: a libc6 ELF library (`FLAG_ELF_LIBC6`).
pub const FLAG_ELF_LIBC6: i32 = 0x0003;
/// ld.so.cache entry flags: 64-bit x86 library (`FLAG_X8664_LIB64`).
pub const FLAG_X8664_LIB64: i32 = 0x0300;
/// ld.so.cache entry flags: 64-bit ARM library (`FLAG_AARCH64_LIB64`).
pub const FLAG_AARCH64_LIB64: i32 = 0x0a00;
/// Magic of glibc's current cache format (followed by [`LD_CACHE_NEW_VERSION`]).
pub const LD_CACHE_NEW_MAGIC: &[u8] = b"glibc-ld.so.cache";
/// Version of glibc's current cache format.
pub const LD_CACHE_NEW_VERSION: &[u8] = b"1.1";
/// Magic of glibc's old (libc5-era) cache format.
pub const LD_CACHE_OLD_MAGIC: &[u8] = b"ld.so-1.7.0";

/// The driver libraries the fake installs: (file name stem, soname). A soname equal to the
/// versioned file name (`None`) means the library has no separate soname link, as
/// libnvidia-gpucomp.
const LIBRARIES: &[(&str, Option<&str>)] = &[
    ("libcuda", Some("libcuda.so.1")),
    ("libcudadebugger", Some("libcudadebugger.so.1")),
    ("libnvidia-cfg", Some("libnvidia-cfg.so.1")),
    ("libnvidia-gpucomp", None),
    ("libnvidia-ml", Some("libnvidia-ml.so.1")),
    ("libnvidia-nvvm", Some("libnvidia-nvvm.so.4")),
    ("libnvidia-ptxjitcompiler", Some("libnvidia-ptxjitcompiler.so.1")),
];

/// The utilities the fake installs in [`BIN_DIR`].
const BINARIES: &[&str] = &[
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-smi",
];

/// The GSP firmware files the fake installs in `lib/firmware/nvidia/<version>/`.
const FIRMWARE: &[&str] = &["gsp_ga10x.bin", "gsp_tu10x.bin"];

/// Which cache file to write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LdCacheFormat {
    /// No `etc/ld.so.cache`: discovery must fall back to searching directories.
    None,
    /// glibc's current format only (what ldconfig writes since glibc 2.32).
    #[default]
    New,
    /// An old-format table followed by the current format, as ldconfig wrote in "compat"
    /// mode (the old table's entries are zeroed: readers of the new format skip them).
    OldThenNew,
}

/// What [`create_driver_root`] puts into the root besides the libraries and utilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRootOptions {
    /// The linker cache to write.
    pub ld_cache: LdCacheFormat,
    /// Create the persistenced socket path (a plain file: discovery only checks existence).
    pub persistenced_socket: bool,
    /// Create the GSP firmware files.
    pub firmware: bool,
    /// Extra cache entries that point outside the fake's files (e.g. `libc.so.6`), as a real
    /// node's cache has; discovery must skip them.
    pub unrelated_cache_entries: bool,
}

impl Default for DriverRootOptions {
    fn default() -> Self {
        Self {
            ld_cache: LdCacheFormat::New,
            persistenced_socket: false,
            firmware: true,
            unrelated_cache_entries: true,
        }
    }
}

/// One installed library: paths are on the host (`dir` joined with the path in the root).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FakeLibrary {
    /// The versioned file, e.g. `…/libcuda.so.575.57.08`.
    pub file: PathBuf,
    /// The soname link to it (`…/libcuda.so.1`), absent when the soname is the file name.
    pub soname_link: Option<PathBuf>,
    /// The development link `…/libcuda.so` (→ the soname link, or the file).
    pub dev_link: PathBuf,
}

/// What [`create_driver_root`] made; every path is on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverRootLayout {
    /// The root (`dir`).
    pub root: PathBuf,
    /// The driver version in the file names.
    pub version: String,
    /// Installed libraries, in the order of the fake's table (sorted by name).
    pub libraries: Vec<FakeLibrary>,
    /// Installed utilities, sorted by name.
    pub binaries: Vec<PathBuf>,
    /// Installed firmware files, sorted.
    pub firmware: Vec<PathBuf>,
    /// The persistenced socket, when created.
    pub persistenced_socket: Option<PathBuf>,
    /// The linker cache, when written.
    pub ld_cache: Option<PathBuf>,
}

/// One entry of a linker cache: `key` is the soname, `value` the path the loader opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LdCacheEntry {
    /// `FLAG_*` bits: library type in the low byte, architecture in the next.
    pub flags: i32,
    /// Soname, e.g. `libcuda.so.1`.
    pub key: String,
    /// Full path, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1`.
    pub value: String,
}

impl LdCacheEntry {
    /// An x86-64 libc6 library entry.
    pub fn x86_64(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            flags: FLAG_ELF_LIBC6 | FLAG_X8664_LIB64,
            key: key.into(),
            value: value.into(),
        }
    }
}

/// Host path of a path inside the root.
fn in_root(root: &Path, path_in_root: &str) -> PathBuf {
    root.join(path_in_root.trim_start_matches('/'))
}

/// Creates a fake driver root of `version` under `dir` (which must exist).
pub fn create_driver_root(
    dir: &Path,
    version: &str,
    options: &DriverRootOptions,
) -> io::Result<DriverRootLayout> {
    let lib_dir = in_root(dir, LIB_DIR);
    fs::create_dir_all(&lib_dir)?;
    let mut libraries = Vec::new();
    let mut cache_entries = Vec::new();
    for (stem, soname) in LIBRARIES {
        let file_name = format!("{stem}.so.{version}");
        let file = lib_dir.join(&file_name);
        fs::write(&file, format!("fake {file_name} (not an ELF object)\n"))?;
        // Relative link targets, as the driver installer makes them.
        let soname_link = match soname {
            Some(soname) => {
                let link = lib_dir.join(soname);
                symlink(&file_name, &link)?;
                Some(link)
            }
            None => None,
        };
        let soname = soname.map_or(file_name.clone(), |s| s.to_string());
        let dev_link = lib_dir.join(format!("{stem}.so"));
        symlink(&soname, &dev_link)?;
        // ldconfig records the soname and the path of the soname link.
        cache_entries.push(LdCacheEntry::x86_64(&soname, format!("{LIB_DIR}/{soname}")));
        libraries.push(FakeLibrary {
            file,
            soname_link,
            dev_link,
        });
    }
    if options.unrelated_cache_entries {
        cache_entries.push(LdCacheEntry::x86_64(
            "libc.so.6",
            "/lib/x86_64-linux-gnu/libc.so.6",
        ));
        // A 32-bit copy of libcuda: the same soname, another architecture.
        cache_entries.push(LdCacheEntry {
            flags: FLAG_ELF_LIBC6,
            key: "libcuda.so.1".into(),
            value: "/usr/lib/i386-linux-gnu/libcuda.so.1".into(),
        });
    }

    let bin_dir = in_root(dir, BIN_DIR);
    fs::create_dir_all(&bin_dir)?;
    let mut binaries = Vec::new();
    for name in BINARIES {
        let path = bin_dir.join(name);
        fs::write(&path, format!("#!/bin/sh\necho fake {name} {version}\n"))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
        binaries.push(path);
    }

    let mut firmware = Vec::new();
    if options.firmware {
        let fw_dir = in_root(dir, &format!("/lib/firmware/nvidia/{version}"));
        fs::create_dir_all(&fw_dir)?;
        for name in FIRMWARE {
            let path = fw_dir.join(name);
            fs::write(&path, format!("fake {name} {version}\n"))?;
            firmware.push(path);
        }
    }

    let persistenced_socket = if options.persistenced_socket {
        let path = in_root(dir, PERSISTENCED_SOCKET);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        fs::write(&path, b"")?;
        Some(path)
    } else {
        None
    };

    let ld_cache = match options.ld_cache {
        LdCacheFormat::None => None,
        format => {
            let path = in_root(dir, "/etc/ld.so.cache");
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)?;
            }
            let mut bytes = Vec::new();
            if format == LdCacheFormat::OldThenNew {
                bytes = old_format_prefix(cache_entries.len());
            }
            bytes.extend_from_slice(&ld_so_cache_bytes(&cache_entries));
            fs::write(&path, bytes)?;
            Some(path)
        }
    };

    Ok(DriverRootLayout {
        root: dir.to_path_buf(),
        version: version.to_string(),
        libraries,
        binaries,
        firmware,
        persistenced_socket,
        ld_cache,
    })
}

/// Size of the new-format header: magic (17) + version (3) + `nlibs` (4) + `len_strings`
/// (4) + flags (1) + padding (3) + `extension_offset` (4) + unused (3 × 4).
pub const LD_CACHE_NEW_HEADER_LEN: usize = 48;
/// Size of a new-format entry: flags (i32), key, value (u32 string offsets), osversion
/// (u32), hwcap (u64).
pub const LD_CACHE_NEW_ENTRY_LEN: usize = 24;
/// Header flag: the file is little-endian (`cache_file_new_flags_endian_little`).
const CACHE_FLAGS_LITTLE_ENDIAN: u8 = 2;

/// A linker cache in glibc's current format (little-endian), holding `entries` in order.
///
/// Layout: the 48-byte header (see [`LD_CACHE_NEW_HEADER_LEN`]), the entry table
/// ([`LD_CACHE_NEW_ENTRY_LEN`] bytes each), then the string table of NUL-terminated
/// strings. String offsets in entries count from the start of the new-format header.
pub fn ld_so_cache_bytes(entries: &[LdCacheEntry]) -> Vec<u8> {
    let strings_start = LD_CACHE_NEW_HEADER_LEN + entries.len() * LD_CACHE_NEW_ENTRY_LEN;
    let mut strings = Vec::new();
    let mut offsets = Vec::with_capacity(entries.len());
    for entry in entries {
        let mut push = |s: &str| {
            let offset = strings_start + strings.len();
            strings.extend_from_slice(s.as_bytes());
            strings.push(0);
            offset as u32
        };
        let key = push(&entry.key);
        let value = push(&entry.value);
        offsets.push((key, value));
    }
    let mut bytes = Vec::with_capacity(strings_start + strings.len());
    bytes.extend_from_slice(LD_CACHE_NEW_MAGIC);
    bytes.extend_from_slice(LD_CACHE_NEW_VERSION);
    bytes.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    bytes.push(CACHE_FLAGS_LITTLE_ENDIAN);
    bytes.extend_from_slice(&[0; 3]);
    bytes.extend_from_slice(&0u32.to_le_bytes()); // no extensions
    bytes.extend_from_slice(&[0; 12]);
    for (entry, (key, value)) in entries.iter().zip(offsets) {
        bytes.extend_from_slice(&entry.flags.to_le_bytes());
        bytes.extend_from_slice(&key.to_le_bytes());
        bytes.extend_from_slice(&value.to_le_bytes());
        bytes.extend_from_slice(&0u32.to_le_bytes()); // osversion
        bytes.extend_from_slice(&0u64.to_le_bytes()); // hwcap
    }
    bytes.extend_from_slice(&strings);
    bytes
}

/// An old-format cache table of `entries` zeroed entries, padded so the new-format header
/// that follows is 8-byte aligned (as ldconfig aligns it): magic (11) + padding (1) +
/// `nlibs` (4), then 12 bytes per entry (flags, key, value).
pub fn old_format_prefix(entries: usize) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(LD_CACHE_OLD_MAGIC);
    bytes.push(0);
    bytes.extend_from_slice(&(entries as u32).to_le_bytes());
    bytes.resize(16 + entries * 12, 0);
    bytes.resize(bytes.len().next_multiple_of(8), 0);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_versioned_files_behind_relative_soname_links() {
        let dir = tempfile::tempdir().unwrap();
        let layout = create_driver_root(dir.path(), "575.57.08", &DriverRootOptions::default()).unwrap();
        let cuda = &layout.libraries[0];
        assert_eq!(
            cuda.file,
            dir.path().join("usr/lib/x86_64-linux-gnu/libcuda.so.575.57.08")
        );
        let soname_link = cuda.soname_link.as_ref().unwrap();
        assert_eq!(
            fs::read_link(soname_link).unwrap(),
            Path::new("libcuda.so.575.57.08")
        );
        assert_eq!(fs::read_link(&cuda.dev_link).unwrap(), Path::new("libcuda.so.1"));
        let gpucomp = layout
            .libraries
            .iter()
            .find(|l| l.file.ends_with("libnvidia-gpucomp.so.575.57.08"))
            .unwrap();
        assert_eq!(gpucomp.soname_link, None);
        let smi = layout
            .binaries
            .iter()
            .find(|b| b.ends_with("nvidia-smi"))
            .unwrap();
        assert_eq!(fs::metadata(smi).unwrap().permissions().mode() & 0o777, 0o755);
        assert_eq!(layout.firmware.len(), 2);
        assert!(layout.ld_cache.unwrap().is_file());
        assert_eq!(layout.persistenced_socket, None);
    }

    #[test]
    fn cache_strings_sit_after_the_entry_table() {
        let bytes = ld_so_cache_bytes(&[LdCacheEntry::x86_64("libx.so.1", "/lib/libx.so.1")]);
        assert_eq!(&bytes[..20], b"glibc-ld.so.cache1.1");
        assert_eq!(u32::from_le_bytes(bytes[20..24].try_into().unwrap()), 1);
        let key_offset = u32::from_le_bytes(bytes[52..56].try_into().unwrap()) as usize;
        assert_eq!(key_offset, LD_CACHE_NEW_HEADER_LEN + LD_CACHE_NEW_ENTRY_LEN);
        assert_eq!(&bytes[key_offset..key_offset + 10], b"libx.so.1\0");
        assert_eq!(old_format_prefix(1).len(), 32);
        assert_eq!(old_format_prefix(2).len(), 40);
    }
}
