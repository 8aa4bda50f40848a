//! Bytes backing model weights.
//!
//! A model file is either memory-mapped read-only (the normal case: the page
//! cache holds the weights, loading is instant and several processes share
//! them) or held in an owned buffer (tests, fuzzing, files fetched over the
//! network).

use std::fmt;
use std::ops::Deref;

/// Bytes backing model weights: a read-only memory map or an owned buffer.
pub enum Backing {
    /// A read-only memory map of a file.
    Mmap(memmap2::Mmap),
    /// Bytes held in memory.
    Owned(Vec<u8>),
}

impl Backing {
    /// `"mmap"` or `"owned"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Backing::Mmap(_) => "mmap",
            Backing::Owned(_) => "owned",
        }
    }
}

impl Deref for Backing {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

impl AsRef<[u8]> for Backing {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl From<Vec<u8>> for Backing {
    fn from(v: Vec<u8>) -> Self {
        Backing::Owned(v)
    }
}

impl fmt::Debug for Backing {
    /// Prints the kind and length only, never the bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Backing::{}({} bytes)", self.kind(), self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_deref_and_debug() {
        let b = Backing::from(vec![1u8, 2, 3]);
        assert_eq!(&*b, &[1, 2, 3]);
        assert_eq!(format!("{b:?}"), "Backing::owned(3 bytes)");
    }
}
