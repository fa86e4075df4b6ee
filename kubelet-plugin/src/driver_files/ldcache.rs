//! A reader of glibc's linker cache (`/etc/ld.so.cache`), the list of sonames and library
//! paths `ldconfig` writes and the dynamic loader consults.
//!
//! Format (little-endian on the architectures we run on):
//! - optionally the old format first: magic `ld.so-1.7.0` (11 bytes) + 1 byte padding,
//!   `nlibs: u32`, then `nlibs` entries of 12 bytes; the new format follows, its start
//!   aligned to 8 bytes;
//! - the new format: magic `glibc-ld.so.cache` + version `1.1` (20 bytes), `nlibs: u32`,
//!   `len_strings: u32`, `flags: u8` (endianness in the low two bits: 0 unset, 2 little,
//!   3 big), 3 bytes padding, `extension_offset: u32`, 12 unused bytes — 48 bytes — then
//!   `nlibs` entries of 24 bytes (`flags: i32`, `key: u32`, `value: u32`, `osversion: u32`,
//!   `hwcap: u64`), then the string table. `key` (the soname) and `value` (the library's
//!   path) are offsets of NUL-terminated strings, counted from the start of the new-format
//!   header.
//!
//! The parser trusts nothing: every count and offset is bounds-checked, and a corrupt file
//! gives an [`LdCacheError`] naming the byte offset, never a panic.

use std::{ffi::OsString, os::unix::ffi::OsStringExt, path::PathBuf};

const OLD_MAGIC: &[u8] = b"ld.so-1.7.0";
const OLD_HEADER_LEN: usize = 16;
const OLD_ENTRY_LEN: usize = 12;
const NEW_MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
const NEW_HEADER_LEN: usize = 48;
const NEW_ENTRY_LEN: usize = 24;
/// Alignment of the new-format header after an old-format table.
const NEW_HEADER_ALIGN: usize = 8;

/// The entry type (low byte of an entry's flags) of glibc ELF libraries.
pub const FLAG_ELF_LIBC6: i32 = 0x0003;
const FLAG_TYPE_MASK: i32 = 0x00ff;
/// The architecture ("required") bits.
const FLAG_REQUIRED_MASK: i32 = 0xff00;
pub const FLAG_X8664_LIB64: i32 = 0x0300;
pub const FLAG_AARCH64_LIB64: i32 = 0x0a00;

/// A malformed cache: what is wrong and where (`offset` is the byte offset of the structure
/// or field concerned, `len` the file's length).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LdCacheError {
    #[error("byte 0: not a glibc linker cache (no \"glibc-ld.so.cache1.1\" or \"ld.so-1.7.0\" magic)")]
    BadMagic,
    /// An old-format cache without the new format after it (the loader of every supported
    /// glibc reads only the new format).
    #[error("byte {offset}: old-format cache without the new-format table after it")]
    OldFormatOnly { offset: usize },
    /// The file ends before a structure it declares, which needs the file to reach `needed`.
    #[error("byte {offset}: file ends before the {what} ({needed} bytes needed, file has {len})")]
    Truncated {
        offset: usize,
        what: &'static str,
        needed: usize,
        len: usize,
    },
    /// The header declares a byte order we do not read ("big-endian" or "invalid").
    #[error("byte {offset}: cache byte order is {order}, expected little-endian")]
    ByteOrder { offset: usize, order: &'static str },
    /// An entry's `key` or `value` string offset points outside the file.
    #[error("byte {offset}: entry {entry}'s {field} offset {value} is outside the file ({len} bytes)")]
    StringOutOfRange {
        offset: usize,
        entry: usize,
        field: &'static str,
        value: u32,
        len: usize,
    },
    /// A string runs to the end of the file without its NUL.
    #[error("byte {offset}: string of entry {entry} is not NUL-terminated")]
    UnterminatedString { offset: usize, entry: usize },
}

/// One library of the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LdCacheEntry {
    pub flags: i32,
    /// The soname, e.g. `libcuda.so.1`.
    pub soname: OsString,
    /// The path the loader opens for it, e.g. `/usr/lib/x86_64-linux-gnu/libcuda.so.1`.
    pub path: PathBuf,
}

/// Which entries of a cache to take: glibc libraries (`FLAG_ELF_LIBC6`) of one 64-bit
/// architecture, i.e. flags exactly `0x0303` for x86-64 and `0x0a03` for aarch64; 32-bit
/// (`0x0003`) and x32 entries of the same soname are skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LibraryArch {
    X86_64,
    Aarch64,
}

impl LibraryArch {
    /// The architecture this program was built for (aarch64 builds take aarch64 libraries,
    /// every other build x86-64 ones).
    pub const HOST: LibraryArch = if cfg!(target_arch = "aarch64") {
        LibraryArch::Aarch64
    } else {
        LibraryArch::X86_64
    };

    pub fn accepts(self, flags: i32) -> bool {
        let required = match self {
            LibraryArch::X86_64 => FLAG_X8664_LIB64,
            LibraryArch::Aarch64 => FLAG_AARCH64_LIB64,
        };
        flags & FLAG_TYPE_MASK == FLAG_ELF_LIBC6 && flags & FLAG_REQUIRED_MASK == required
    }

    /// The Debian multiarch directory name.
    pub fn multiarch(self) -> &'static str {
        match self {
            LibraryArch::X86_64 => "x86_64-linux-gnu",
            LibraryArch::Aarch64 => "aarch64-linux-gnu",
        }
    }
}

fn read_u32(bytes: &[u8], offset: usize, what: &'static str) -> Result<u32, LdCacheError> {
    let end = offset.saturating_add(4);
    let field = bytes
        .get(offset..end)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .ok_or(LdCacheError::Truncated {
            offset,
            what,
            needed: end,
            len: bytes.len(),
        })?;
    Ok(u32::from_le_bytes(field))
}

fn require(bytes: &[u8], offset: usize, len: usize, what: &'static str) -> Result<(), LdCacheError> {
    match offset.checked_add(len) {
        Some(end) if end <= bytes.len() => Ok(()),
        end => Err(LdCacheError::Truncated {
            offset,
            what,
            needed: end.unwrap_or(usize::MAX),
            len: bytes.len(),
        }),
    }
}

/// Where the new-format header starts.
fn new_format_start(bytes: &[u8]) -> Result<usize, LdCacheError> {
    if bytes.starts_with(NEW_MAGIC) {
        return Ok(0);
    }
    if !bytes.starts_with(OLD_MAGIC) {
        return Err(LdCacheError::BadMagic);
    }
    require(bytes, 0, OLD_HEADER_LEN, "old-format header")?;
    let old_count = read_u32(bytes, OLD_MAGIC.len() + 1, "old-format entry count")? as usize;
    let old_end = old_count
        .checked_mul(OLD_ENTRY_LEN)
        .and_then(|table| table.checked_add(OLD_HEADER_LEN));
    let start = old_end.and_then(|end| end.checked_next_multiple_of(NEW_HEADER_ALIGN));
    let Some(start) = start else {
        return Err(LdCacheError::Truncated {
            offset: OLD_HEADER_LEN,
            what: "old-format entry table",
            needed: usize::MAX,
            len: bytes.len(),
        });
    };
    require(
        bytes,
        OLD_HEADER_LEN,
        start - OLD_HEADER_LEN,
        "old-format entry table",
    )?;
    if bytes.len() == start {
        return Err(LdCacheError::OldFormatOnly { offset: start });
    }
    match bytes.get(start..) {
        Some(rest) if rest.starts_with(NEW_MAGIC) => Ok(start),
        _ => Err(LdCacheError::OldFormatOnly { offset: start }),
    }
}

/// The NUL-terminated string at `base + offset`.
fn read_string(
    bytes: &[u8],
    base: usize,
    field_offset: usize,
    entry: usize,
    field: &'static str,
) -> Result<Vec<u8>, LdCacheError> {
    let value = read_u32(bytes, field_offset, "entry table")?;
    let start = base
        .checked_add(value as usize)
        .filter(|&start| start < bytes.len())
        .ok_or(LdCacheError::StringOutOfRange {
            offset: field_offset,
            entry,
            field,
            value,
            len: bytes.len(),
        })?;
    let rest = &bytes[start..];
    let nul = rest
        .iter()
        .position(|&b| b == 0)
        .ok_or(LdCacheError::UnterminatedString { offset: start, entry })?;
    Ok(rest[..nul].to_vec())
}

/// Every entry of a cache file's contents, in file order.
pub fn parse(bytes: &[u8]) -> Result<Vec<LdCacheEntry>, LdCacheError> {
    let base = new_format_start(bytes)?;
    require(bytes, base, NEW_HEADER_LEN, "new-format header")?;
    let count = read_u32(bytes, base + NEW_MAGIC.len(), "new-format header")? as usize;
    let strings_len = read_u32(bytes, base + NEW_MAGIC.len() + 4, "new-format header")? as usize;
    let flags_offset = base + NEW_MAGIC.len() + 8;
    let order = match bytes[flags_offset] & 0b11 {
        0 | 2 => None,
        1 => Some("invalid"),
        _ => Some("big-endian"),
    };
    if let Some(order) = order {
        return Err(LdCacheError::ByteOrder {
            offset: flags_offset,
            order,
        });
    }
    let table = base + NEW_HEADER_LEN;
    let table_len = count.saturating_mul(NEW_ENTRY_LEN);
    require(bytes, table, table_len, "entry table")?;
    require(bytes, table + table_len, strings_len, "string table")?;

    let mut entries = Vec::with_capacity(count);
    for index in 0..count {
        let at = table + index * NEW_ENTRY_LEN;
        let flags = read_u32(bytes, at, "entry table")? as i32;
        let soname = read_string(bytes, base, at + 4, index, "key")?;
        let path = read_string(bytes, base, at + 8, index, "value")?;
        entries.push(LdCacheEntry {
            flags,
            soname: OsString::from_vec(soname),
            path: PathBuf::from(OsString::from_vec(path)),
        });
    }
    Ok(entries)
}
