//! One block file of the disk tier: a header, then the block's bytes.
//!
//! ```text
//! magic "TNDMKV01" | namespace u64 | block hash u64 | payload len u64 |
//! checksum u64 (xxh3 of the four fields before it and the payload) | payload
//! ```
//! (little endian). A file whose header or checksum does not match what
//! the reader expects is corrupt: the caller treats it as a miss. With
//! direct I/O the file is padded to [`ALIGN`] and moved through aligned
//! buffers, as `O_DIRECT` requires.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use tandem_types::block_hash::BlockHash;

const MAGIC: &[u8; 8] = b"TNDMKV01";
pub const HEADER_LEN: usize = 40;
/// Alignment of direct I/O buffers, offsets and lengths.
pub const ALIGN: usize = 4096;

/// Why a file does not hold the block asked for.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("not a block file (bad magic)")]
    Magic,
    #[error("written for another model or KV layout")]
    Namespace,
    #[error("holds block {found:016x}, not {want:016x}")]
    WrongBlock { found: BlockHash, want: BlockHash },
    #[error("payload of {found} bytes, expected {want}")]
    Length { found: u64, want: usize },
    #[error("truncated: {have} bytes of {need}")]
    Truncated { have: usize, need: usize },
    #[error("checksum mismatch")]
    Checksum,
}

/// What identifies a block file's contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The model and KV layout the bytes belong to.
    pub namespace: u64,
    pub hash: BlockHash,
}

fn checksum(head: &[u8], payload: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(head);
    h.update(payload);
    h.digest()
}

/// The file's bytes: header and payload, padded to [`ALIGN`] when `padded`.
fn encode(key: Key, payload: &[u8], padded: bool) -> AlignedBuf {
    let len = HEADER_LEN + payload.len();
    let mut buf = AlignedBuf::zeroed(if padded {
        len.next_multiple_of(ALIGN)
    } else {
        len
    });
    let b = buf.as_mut_slice();
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&key.namespace.to_le_bytes());
    b[16..24].copy_from_slice(&key.hash.to_le_bytes());
    b[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let sum = checksum(&b[..32], payload);
    b[32..40].copy_from_slice(&sum.to_le_bytes());
    b[HEADER_LEN..len].copy_from_slice(payload);
    buf
}

/// The payload of `bytes` if they are a whole, intact file of `key` with
/// `want_len` bytes of payload.
fn decode(key: Key, want_len: usize, bytes: &[u8]) -> Result<&[u8], FileError> {
    let need = HEADER_LEN + want_len;
    if bytes.len() < HEADER_LEN {
        return Err(FileError::Truncated {
            have: bytes.len(),
            need,
        });
    }
    let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
    if &bytes[..8] != MAGIC {
        return Err(FileError::Magic);
    }
    if word(8) != key.namespace {
        return Err(FileError::Namespace);
    }
    if word(16) != key.hash {
        return Err(FileError::WrongBlock {
            found: word(16),
            want: key.hash,
        });
    }
    if word(24) != want_len as u64 {
        return Err(FileError::Length {
            found: word(24),
            want: want_len,
        });
    }
    if bytes.len() < need {
        return Err(FileError::Truncated {
            have: bytes.len(),
            need,
        });
    }
    let payload = &bytes[HEADER_LEN..need];
    if checksum(&bytes[..32], payload) != word(32) {
        return Err(FileError::Checksum);
    }
    Ok(payload)
}

fn open_options(direct: bool) -> OpenOptions {
    let mut o = OpenOptions::new();
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o
}

/// Writes the block file of `key` at `path` (created or replaced); returns
/// its size on disk.
pub fn write(path: &Path, key: Key, payload: &[u8], direct: bool) -> io::Result<u64> {
    let buf = encode(key, payload, direct);
    let mut f = open_options(direct)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(buf.as_slice())?;
    Ok(buf.len() as u64)
}

/// Reads the block file at `path` and returns its payload if it is an
/// intact file of `key` with `want_len` bytes of payload.
pub fn read(path: &Path, key: Key, want_len: usize, direct: bool) -> Result<Vec<u8>, FileError> {
    let mut f = open_options(direct).read(true).open(path)?;
    let size = f.metadata()?.len() as usize;
    let mut buf = AlignedBuf::zeroed(size.next_multiple_of(ALIGN));
    let got = read_full(&mut f, buf.as_mut_slice())?;
    Ok(decode(key, want_len, &buf.as_slice()[..got.min(size)])?.to_vec())
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Whether `dir`'s file system takes `O_DIRECT` writes (tmpfs does not).
pub fn probe_direct_io(dir: &Path) -> io::Result<()> {
    let path = dir.join(".direct-io-probe");
    let result = write(
        &path,
        Key {
            namespace: 0,
            hash: 0,
        },
        &[0; 16],
        true,
    );
    let _ = std::fs::remove_file(&path);
    result.map(|_| ())
}

/// A zeroed heap buffer aligned to [`ALIGN`] (what `O_DIRECT` needs).
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.max(ALIGN), ALIGN).expect("valid layout")
    }

    fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        Self { ptr, len }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds at least `len` initialised (zeroed) bytes,
        // owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this same layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const KEY: Key = Key {
        namespace: 0xabc,
        hash: 0x1234,
    };

    fn payload() -> Vec<u8> {
        (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn a_written_block_reads_back_equal_buffered_and_direct() {
        // /var/tmp: a disk file system (a tmpfs /tmp would refuse O_DIRECT).
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        probe_direct_io(dir.path()).expect("/var/tmp takes O_DIRECT");
        let p = dir.path().join("b.kv");
        for (direct, size) in [
            (false, HEADER_LEN + 10_000),
            (true, (HEADER_LEN + 10_000).next_multiple_of(ALIGN)),
        ] {
            assert_eq!(write(&p, KEY, &payload(), direct).unwrap(), size as u64);
            assert_eq!(std::fs::metadata(&p).unwrap().len(), size as u64);
            assert_eq!(read(&p, KEY, 10_000, direct).unwrap(), payload());
        }
    }

    #[test]
    fn damaged_files_are_refused_never_returned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.kv");
        let good = encode(KEY, &payload(), false).as_slice().to_vec();
        let cases: Vec<(&str, Vec<u8>, Key, usize)> = vec![
            (
                "flipped payload bit",
                flip(&good, HEADER_LEN + 5000),
                KEY,
                10_000,
            ),
            ("flipped checksum", flip(&good, 33), KEY, 10_000),
            ("truncated", good[..good.len() - 1].to_vec(), KEY, 10_000),
            ("header only", good[..20].to_vec(), KEY, 10_000),
            ("empty", Vec::new(), KEY, 10_000),
            ("bad magic", flip(&good, 0), KEY, 10_000),
            (
                "other model",
                good.clone(),
                Key {
                    namespace: 1,
                    ..KEY
                },
                10_000,
            ),
            ("other block", good.clone(), Key { hash: 9, ..KEY }, 10_000),
            ("other length", good.clone(), KEY, 9_999),
        ];
        for (what, bytes, key, len) in cases {
            std::fs::write(&p, &bytes).unwrap();
            assert!(read(&p, key, len, false).is_err(), "{what} was accepted");
        }
        std::fs::write(&p, &good).unwrap();
        assert_eq!(read(&p, KEY, 10_000, false).unwrap(), payload());
    }

    fn flip(b: &[u8], i: usize) -> Vec<u8> {
        let mut v = b.to_vec();
        v[i] ^= 0x10;
        v
    }
}
