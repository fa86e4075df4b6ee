//! Caller memory: the out pointers, arrays and string buffers NVML functions take. Each
//! wrapper is created (unsafely) from a pointer the caller passed under NVML's contract;
//! using it afterwards is safe. A NULL pointer is INVALID_ARGUMENT, never dereferenced.

use std::ffi::{c_char, c_uint};

use crate::code::{INSUFFICIENT_SIZE, INVALID_ARGUMENT, UNKNOWN};

/// An out parameter that receives one value: a [`Ptr`] or a [`StrBuf`].
pub(super) trait Out {
    /// What is written.
    type Value;

    /// Fails with INVALID_ARGUMENT for NULL.
    fn check(&self) -> Result<(), u32>;

    /// Writes the value (INVALID_ARGUMENT for NULL).
    fn put(&self, value: Self::Value) -> Result<(), u32>;
}

/// A pointer parameter: NULL, or valid for reads and writes of one `T` during the call.
pub(super) struct Ptr<T>(pub(super) *mut T);

impl<T> Ptr<T> {
    /// # Safety
    /// `ptr` must be NULL or valid for reads and writes of a `T` for the rest of the call.
    pub(super) unsafe fn new(ptr: *mut T) -> Self {
        Ptr(ptr)
    }

    pub(super) fn check(&self) -> Result<(), u32> {
        if self.0.is_null() {
            Err(INVALID_ARGUMENT)
        } else {
            Ok(())
        }
    }

    pub(super) fn set(&self, value: T) -> Result<(), u32> {
        self.check()?;
        // SAFETY: non-NULL, and valid for writes per the constructor's contract.
        unsafe { self.0.write(value) };
        Ok(())
    }

    pub(super) fn get(&self) -> Result<T, u32>
    where
        T: Copy,
    {
        self.check()?;
        // SAFETY: non-NULL, and valid for reads per the constructor's contract.
        Ok(unsafe { self.0.read() })
    }

    /// The leading `version` field of a versioned NVML struct.
    pub(super) fn version(&self) -> Result<u32, u32> {
        self.check()?;
        // SAFETY: every versioned NVML struct starts with its u32 version; valid per contract.
        Ok(unsafe { self.0.cast::<u32>().read() })
    }

    /// Reinterprets the storage as another version of the same-sized struct.
    pub(super) fn cast<U>(&self) -> Ptr<U> {
        assert!(size_of::<U>() <= size_of::<T>(), "cast to a larger struct");
        Ptr(self.0.cast())
    }
}

impl<T> Out for Ptr<T> {
    type Value = T;

    fn check(&self) -> Result<(), u32> {
        Ptr::check(self)
    }

    fn put(&self, value: T) -> Result<(), u32> {
        self.set(value)
    }
}

/// An array parameter: NULL, or valid for writes of as many `T` as NVML's contract for the
/// function promises (the in/out count, or the profile's instance count).
pub(super) struct Array<T>(*mut T);

impl<T> Array<T> {
    /// # Safety
    /// `ptr` must be NULL or valid for writes of the number of `T`s the function's NVML
    /// contract requires the caller to provide.
    pub(super) unsafe fn new(ptr: *mut T) -> Self {
        Array(ptr)
    }

    pub(super) fn is_null(&self) -> bool {
        self.0.is_null()
    }

    pub(super) fn fill(&self, items: Vec<T>) -> Result<(), u32> {
        if self.0.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        for (i, item) in items.into_iter().enumerate() {
            // SAFETY: within the capacity the caller promised (checked against the count
            // where NVML passes one).
            unsafe { self.0.add(i).write(item) };
        }
        Ok(())
    }

    /// The possible-placements protocol: a NULL array asks for the count only; a count
    /// smaller than needed gives INSUFFICIENT_SIZE with the needed count written back.
    pub(super) fn fill_counted(&self, count: &Ptr<c_uint>, items: Vec<T>) -> Result<(), u32> {
        let n = u32::try_from(items.len()).map_err(|_| UNKNOWN)?;
        if self.is_null() {
            return count.set(n);
        }
        if count.get()? < n {
            count.set(n)?;
            return Err(INSUFFICIENT_SIZE);
        }
        self.fill(items)?;
        count.set(n)
    }

    /// The list protocol (`GetGpuInstances`, `GetComputeInstances`): no size parameter; the
    /// caller's array holds the profile's instance count.
    pub(super) fn fill_listed(&self, count: &Ptr<c_uint>, items: Vec<T>) -> Result<(), u32> {
        let n = u32::try_from(items.len()).map_err(|_| UNKNOWN)?;
        self.fill(items)?;
        count.set(n)
    }
}

/// A string buffer parameter with its length.
pub(super) struct StrBuf(*mut c_char, c_uint);

impl StrBuf {
    /// # Safety
    /// `ptr` must be NULL or valid for writes of `len` bytes.
    pub(super) unsafe fn new(ptr: *mut c_char, len: c_uint) -> Self {
        StrBuf(ptr, len)
    }

    pub(super) fn set(&self, s: &str) -> Result<(), u32> {
        self.check()?;
        if (self.1 as usize) < s.len() + 1 {
            return Err(INSUFFICIENT_SIZE);
        }
        for (i, b) in s.bytes().chain(std::iter::once(0)).enumerate() {
            // SAFETY: i < len, checked above; valid per the constructor's contract.
            unsafe { self.0.add(i).write(b as c_char) };
        }
        Ok(())
    }
}

impl Out for StrBuf {
    type Value = String;

    fn check(&self) -> Result<(), u32> {
        if self.0.is_null() {
            Err(INVALID_ARGUMENT)
        } else {
            Ok(())
        }
    }

    fn put(&self, value: String) -> Result<(), u32> {
        self.set(&value)
    }
}

/// A NUL-terminated fixed-size C string field (truncated to fit).
pub(super) fn fixed_str<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (slot, b) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *slot = b as c_char;
    }
    out
}
