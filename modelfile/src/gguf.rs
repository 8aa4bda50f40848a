//! GGUF reader (format versions 2 and 3, little-endian).
//!
//! The file is treated as hostile input: the reader never panics, never reads
//! out of bounds, bounds every count and length taken from the file by the
//! bytes remaining before allocating anything, and consumes at least one byte
//! per loop iteration, so it always terminates.  All tensor data ranges are
//! validated when the file is opened, so [`GgufFile::tensor_data`] is a plain
//! slice afterwards.
//!
//! Layout:
//!
//! ```text
//! magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//! kv_count × (string key | u32 value type | value)
//! tensor_count × (string name | u32 n_dims | n_dims × u64 dim | u32 ggml type | u64 offset)
//! padding to `general.alignment` (default 32)
//! data section (tensor offsets are relative to its start)
//! ```
//!
//! Strings are a u64 byte length followed by UTF-8 bytes; arrays are a u32
//! element type, a u64 count and the elements (nested arrays allowed up to
//! [`MAX_ARRAY_DEPTH`]).

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tandem_kernels::GgmlType;

use crate::storage::Backing;

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when the file does not
/// set `general.alignment`.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Metadata key holding the alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of arrays accepted (an array of scalars has depth 1).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Most dimensions a tensor may have.
pub const MAX_DIMS: u32 = 4;

/// Smallest possible encoded metadata entry: key length (8) + value type (4)
/// + a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Smallest possible encoded tensor info: name length (8) + n_dims (4) + one
/// dim (8) + type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;

/// Everything that can go wrong reading a GGUF file.  Every variant says
/// where: a byte offset, a metadata key, or a tensor name.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "truncated GGUF: need {need} bytes at offset {offset} reading {what}, but only {available} remain"
    )]
    Truncated {
        need: u64,
        offset: u64,
        available: u64,
        what: String,
    },
    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error(
        "big-endian GGUF (version {swapped} byte-swapped as {version:#010x} at offset 4): only little-endian files are supported"
    )]
    BigEndian { version: u32, swapped: u32 },
    #[error(
        "unsupported GGUF version {version} at offset 4 (supported: 2 and 3; version 1 used 32-bit counts and is obsolete)"
    )]
    UnsupportedVersion { version: u32 },
    #[error(
        "{what} {count} at offset {offset} is impossible: only {remaining} bytes remain after it (at least {min_each} bytes each)"
    )]
    CountTooLarge {
        what: String,
        count: u64,
        offset: u64,
        remaining: u64,
        min_each: u64,
    },
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("unknown metadata value type {type_id} at offset {offset} in {what}")]
    UnknownValueType {
        type_id: u32,
        offset: u64,
        what: String,
    },
    #[error("invalid bool byte {value} at offset {offset} in {what} (must be 0 or 1)")]
    InvalidBool {
        value: u8,
        offset: u64,
        what: String,
    },
    #[error("arrays nested deeper than {max} levels at offset {offset} in value of key `{key}`")]
    NestingTooDeep { key: String, offset: u64, max: u32 },
    #[error("duplicate metadata key `{key}` at offset {offset}")]
    DuplicateKey { key: String, offset: u64 },
    #[error("duplicate tensor name `{name}` at offset {offset}")]
    DuplicateTensor { name: String, offset: u64 },
    #[error(
        "tensor `{tensor}`: n_dims {n_dims} at offset {offset} is out of range (must be 1..={MAX_DIMS})"
    )]
    BadDimCount {
        tensor: String,
        n_dims: u32,
        offset: u64,
    },
    #[error("tensor `{tensor}`: dimension {index} at offset {offset} is zero")]
    ZeroDim {
        tensor: String,
        index: usize,
        offset: u64,
    },
    #[error("tensor `{tensor}`: dims {dims:?} overflow (element or byte count does not fit)")]
    DimsOverflow { tensor: String, dims: Vec<u64> },
    #[error("tensor `{tensor}`: unknown ggml type id {type_id} at offset {offset}")]
    UnknownTensorType {
        tensor: String,
        type_id: u32,
        offset: u64,
    },
    #[error(
        "tensor `{tensor}`: row length {row_len} (dims[0]) is not a multiple of the {ty} block length {block_len}"
    )]
    RowNotBlockAligned {
        tensor: String,
        row_len: u64,
        ty: &'static str,
        block_len: usize,
    },
    #[error(
        "tensor `{tensor}`: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: usize,
    },
    #[error(
        "tensor `{tensor}`: data bytes {start}..{end} (absolute) lie outside the {file_len}-byte file"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("metadata key `{ALIGNMENT_KEY}` must be an unsigned integer, found {found}")]
    AlignmentWrongType { found: String },
    #[error(
        "metadata key `{ALIGNMENT_KEY}` is {value}: the alignment must be a non-zero power of two that fits in u32"
    )]
    BadAlignment { value: i128 },
    #[error("missing metadata key `{key}`")]
    MissingKey { key: String },
    #[error("metadata key `{key}`: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key `{key}`: value {value} does not fit in {expected}")]
    OutOfRange {
        key: String,
        value: String,
        expected: &'static str,
    },
    #[error("missing tensor `{name}`")]
    MissingTensor { name: String },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The GGUF value type id (0 U8 … 12 F64).
    pub fn type_id(&self) -> u32 {
        match self {
            GgufValue::U8(_) => 0,
            GgufValue::I8(_) => 1,
            GgufValue::U16(_) => 2,
            GgufValue::I16(_) => 3,
            GgufValue::U32(_) => 4,
            GgufValue::I32(_) => 5,
            GgufValue::F32(_) => 6,
            GgufValue::Bool(_) => 7,
            GgufValue::String(_) => 8,
            GgufValue::Array(_) => 9,
            GgufValue::U64(_) => 10,
            GgufValue::I64(_) => 11,
            GgufValue::F64(_) => 12,
        }
    }

    /// A short description of the type, for error messages: `u32`,
    /// `string`, `array<string>` (element type taken from the first
    /// element), `array<empty>`.
    pub fn type_name(&self) -> String {
        match self {
            GgufValue::Array(items) => match items.first() {
                Some(first) => format!("array<{}>", first.type_name()),
                None => "array<empty>".to_owned(),
            },
            other => ValueType::from_id(other.type_id())
                .map_or("?", ValueType::name)
                .to_owned(),
        }
    }

    /// The value as an integer, if it is one of the eight integer types.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            GgufValue::U8(v) => v.into(),
            GgufValue::I8(v) => v.into(),
            GgufValue::U16(v) => v.into(),
            GgufValue::I16(v) => v.into(),
            GgufValue::U32(v) => v.into(),
            GgufValue::I32(v) => v.into(),
            GgufValue::U64(v) => v.into(),
            GgufValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a float, if it is F32 or F64.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }
}

/// The on-disk value types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    fn from_id(id: u32) -> Option<ValueType> {
        Some(match id {
            0 => ValueType::U8,
            1 => ValueType::I8,
            2 => ValueType::U16,
            3 => ValueType::I16,
            4 => ValueType::U32,
            5 => ValueType::I32,
            6 => ValueType::F32,
            7 => ValueType::Bool,
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::U64,
            11 => ValueType::I64,
            12 => ValueType::F64,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            ValueType::U8 => "u8",
            ValueType::I8 => "i8",
            ValueType::U16 => "u16",
            ValueType::I16 => "i16",
            ValueType::U32 => "u32",
            ValueType::I32 => "i32",
            ValueType::F32 => "f32",
            ValueType::Bool => "bool",
            ValueType::String => "string",
            ValueType::Array => "array",
            ValueType::U64 => "u64",
            ValueType::I64 => "i64",
            ValueType::F64 => "f64",
        }
    }

    /// Fewest bytes one encoded value of this type can occupy.
    fn min_size(self) -> usize {
        match self {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 | ValueType::String => 8,
            ValueType::Array => 4 + 8,
        }
    }
}

/// Where in the file a read happens; formatted only when an error is built.
#[derive(Clone, Copy)]
enum Ctx<'a> {
    Header(&'static str),
    KeyName {
        index: u64,
    },
    Value {
        key: &'a str,
    },
    TensorName {
        index: u64,
    },
    TensorField {
        tensor: &'a str,
        field: &'static str,
    },
}

impl fmt::Display for Ctx<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Ctx::Header(what) => f.write_str(what),
            Ctx::KeyName { index } => write!(f, "key of metadata entry {index}"),
            Ctx::Value { key } => write!(f, "value of metadata key `{key}`"),
            Ctx::TensorName { index } => write!(f, "name of tensor info {index}"),
            Ctx::TensorField { tensor, field } => write!(f, "{field} of tensor `{tensor}`"),
        }
    }
}

/// A bounds-checked little-endian cursor.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn off(pos: usize) -> u64 {
    pos as u64
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, ctx: Ctx<'_>) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n);
        match end.and_then(|end| self.buf.get(self.pos..end)) {
            Some(bytes) => {
                self.pos += n;
                Ok(bytes)
            }
            None => Err(GgufError::Truncated {
                need: n as u64,
                offset: off(self.pos),
                available: self.remaining() as u64,
                what: ctx.to_string(),
            }),
        }
    }

    fn array<const N: usize>(&mut self, ctx: Ctx<'_>) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N, ctx)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, ctx: Ctx<'_>) -> Result<u8, GgufError> {
        Ok(self.array::<1>(ctx)?[0])
    }

    fn u32(&mut self, ctx: Ctx<'_>) -> Result<u32, GgufError> {
        self.array(ctx).map(u32::from_le_bytes)
    }

    fn u64(&mut self, ctx: Ctx<'_>) -> Result<u64, GgufError> {
        self.array(ctx).map(u64::from_le_bytes)
    }

    /// Reads a count and checks that `count × min_each` bytes can still
    /// follow, so that anything sized by it is bounded by the file size.
    fn count(&mut self, what: &str, min_each: usize, ctx: Ctx<'_>) -> Result<usize, GgufError> {
        let at = self.pos;
        let count = self.u64(ctx)?;
        let remaining = self.remaining();
        let fits = usize::try_from(count)
            .ok()
            .filter(|&c| c.checked_mul(min_each).is_some_and(|b| b <= remaining));
        fits.ok_or_else(|| GgufError::CountTooLarge {
            what: format!("{what} in {ctx}"),
            count,
            offset: off(at),
            remaining: remaining as u64,
            min_each: min_each as u64,
        })
    }

    fn string(&mut self, ctx: Ctx<'_>) -> Result<String, GgufError> {
        let len = self.count("string length", 1, ctx)?;
        let start = self.pos;
        let bytes = self.take(len, ctx)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidUtf8 {
                what: ctx.to_string(),
                offset: off(start + e.valid_up_to()),
            }),
        }
    }

    fn value_type(&mut self, ctx: Ctx<'_>) -> Result<ValueType, GgufError> {
        let at = self.pos;
        let id = self.u32(ctx)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            type_id: id,
            offset: off(at),
            what: ctx.to_string(),
        })
    }

    /// Reads one value of type `ty`; `depth` is the number of arrays
    /// enclosing it.
    fn value(&mut self, ty: ValueType, key: &str, depth: u32) -> Result<GgufValue, GgufError> {
        let ctx = Ctx::Value { key };
        Ok(match ty {
            ValueType::U8 => GgufValue::U8(self.u8(ctx)?),
            ValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(ctx)?)),
            ValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(ctx)?)),
            ValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(ctx)?)),
            ValueType::U32 => GgufValue::U32(self.u32(ctx)?),
            ValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(ctx)?)),
            ValueType::U64 => GgufValue::U64(self.u64(ctx)?),
            ValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(ctx)?)),
            ValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(ctx)?)),
            ValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(ctx)?)),
            ValueType::Bool => {
                let at = self.pos;
                match self.u8(ctx)? {
                    0 => GgufValue::Bool(false),
                    1 => GgufValue::Bool(true),
                    value => {
                        return Err(GgufError::InvalidBool {
                            value,
                            offset: off(at),
                            what: ctx.to_string(),
                        });
                    }
                }
            }
            ValueType::String => GgufValue::String(self.string(ctx)?),
            ValueType::Array => {
                let at = self.pos;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        key: key.to_owned(),
                        offset: off(at),
                        max: MAX_ARRAY_DEPTH,
                    });
                }
                let elem = self.value_type(ctx)?;
                let n = self.count("array length", elem.min_size(), ctx)?;
                // `n` is bounded by the bytes remaining, so this allocation
                // is at most a small multiple of the file size.
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                GgufValue::Array(items)
            }
        })
    }
}

/// One tensor's description from the tensor-info table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Product of the dims (saturating; exact for every tensor of a file
    /// that opened successfully).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Bytes of data: rows × bytes per row (saturating; exact for every
    /// tensor of a file that opened successfully).
    pub fn n_bytes(&self) -> usize {
        self.checked_n_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of data, or `None` when the row length is not a whole number of
    /// blocks or the size overflows.
    fn checked_n_bytes(&self) -> Option<usize> {
        let (&row_len, rest) = self.dims.split_first()?;
        let row_bytes = self.ty.row_bytes(usize::try_from(row_len).ok()?)?;
        rest.iter().try_fold(row_bytes, |acc, &d| {
            acc.checked_mul(usize::try_from(d).ok()?)
        })
    }
}

/// A parsed GGUF file: metadata, tensor table, and the bytes behind them.
pub struct GgufFile {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    backing: Arc<Backing>,
    data_start: usize,
    alignment: usize,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .field("backing", &self.backing)
            .finish()
    }
}

/// The header: the version, and the tensor and metadata counts (each
/// checked against the bytes left for its table).
fn read_header(r: &mut Reader<'_>) -> Result<(u32, usize, usize), GgufError> {
    let magic: [u8; 4] = r.array(Ctx::Header("magic"))?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32(Ctx::Header("version"))?;
    match version {
        2 | 3 => {}
        v if matches!(v.swap_bytes(), 1..=3) => {
            return Err(GgufError::BigEndian {
                version: v,
                swapped: v.swap_bytes(),
            });
        }
        v => return Err(GgufError::UnsupportedVersion { version: v }),
    }
    let tensor_count_at = r.pos;
    let tensor_count = r.u64(Ctx::Header("tensor count"))?;
    let kv_count = r.count(
        "metadata entry count",
        MIN_KV_BYTES,
        Ctx::Header("metadata entry count"),
    )?;
    // The tensor infos follow the metadata, so both tables must fit.
    let room_for_tensors = (r.remaining() - kv_count * MIN_KV_BYTES) / MIN_TENSOR_INFO_BYTES;
    let tensor_count = usize::try_from(tensor_count)
        .ok()
        .filter(|&n| n <= room_for_tensors)
        .ok_or_else(|| GgufError::CountTooLarge {
            what: "tensor count in header".to_owned(),
            count: tensor_count,
            offset: off(tensor_count_at),
            remaining: (r.remaining() - kv_count * MIN_KV_BYTES) as u64,
            min_each: MIN_TENSOR_INFO_BYTES as u64,
        })?;
    Ok((version, tensor_count, kv_count))
}

/// Metadata entries in file order, and each key's index.
type Metadata = (Vec<(String, GgufValue)>, HashMap<String, usize>);

fn read_metadata(r: &mut Reader<'_>, kv_count: usize) -> Result<Metadata, GgufError> {
    let mut metadata = Vec::with_capacity(kv_count);
    let mut metadata_index = HashMap::with_capacity(kv_count);
    for index in 0..kv_count as u64 {
        let key_at = r.pos;
        let key = r.string(Ctx::KeyName { index })?;
        if metadata_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: off(key_at),
            });
        }
        let ty = r.value_type(Ctx::Value { key: &key })?;
        let value = r.value(ty, &key, 0)?;
        metadata_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }
    Ok((metadata, metadata_index))
}

/// `general.alignment`, or the default: a power of two.
fn alignment_of(
    metadata: &[(String, GgufValue)],
    index: &HashMap<String, usize>,
) -> Result<usize, GgufError> {
    let Some(&i) = index.get(ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let value = &metadata[i].1;
    let Some(v) = value.as_integer() else {
        return Err(GgufError::AlignmentWrongType {
            found: value.type_name(),
        });
    };
    match u32::try_from(v) {
        Ok(a) if a.is_power_of_two() => Ok(a as usize),
        _ => Err(GgufError::BadAlignment { value: v }),
    }
}

/// The tensor infos in file order, and each name's index.
fn read_tensor_infos(
    r: &mut Reader<'_>,
    tensor_count: usize,
) -> Result<(Vec<TensorInfo>, HashMap<String, usize>), GgufError> {
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut tensor_index = HashMap::with_capacity(tensor_count);
    for index in 0..tensor_count as u64 {
        let name_at = r.pos;
        let name = r.string(Ctx::TensorName { index })?;
        if tensor_index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                name,
                offset: off(name_at),
            });
        }
        let info = read_tensor_info(r, name)?;
        check_tensor_shape(&info)?;
        tensor_index.insert(info.name.clone(), tensors.len());
        tensors.push(info);
    }
    Ok((tensors, tensor_index))
}

/// The rest of tensor `name`'s info: its dimensions, type and offset.
fn read_tensor_info(r: &mut Reader<'_>, name: String) -> Result<TensorInfo, GgufError> {
    let field = |field| Ctx::TensorField {
        tensor: &name,
        field,
    };
    let n_dims_at = r.pos;
    let n_dims = r.u32(field("n_dims"))?;
    if !(1..=MAX_DIMS).contains(&n_dims) {
        return Err(GgufError::BadDimCount {
            tensor: name,
            n_dims,
            offset: off(n_dims_at),
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for i in 0..n_dims as usize {
        let dim_at = r.pos;
        let d = r.u64(field("dims"))?;
        if d == 0 {
            return Err(GgufError::ZeroDim {
                tensor: name,
                index: i,
                offset: off(dim_at),
            });
        }
        dims.push(d);
    }
    let type_at = r.pos;
    let type_id = r.u32(field("type"))?;
    let Some(ty) = GgmlType::from_ggml_id(type_id) else {
        return Err(GgufError::UnknownTensorType {
            tensor: name,
            type_id,
            offset: off(type_at),
        });
    };
    let offset = r.u64(field("offset"))?;
    Ok(TensorInfo {
        name,
        dims,
        ty,
        offset,
    })
}

/// Every tensor's data is aligned and inside the file.
fn check_tensor_data(
    tensors: &[TensorInfo],
    data_start: usize,
    alignment: usize,
    file_len: u64,
) -> Result<(), GgufError> {
    for t in tensors {
        if !t.offset.is_multiple_of(alignment as u64) {
            return Err(GgufError::MisalignedTensor {
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let start = (data_start as u64).checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes() as u64));
        match (start, end) {
            (Some(_), Some(end)) if end <= file_len => {}
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    tensor: t.name.clone(),
                    start: start.unwrap_or(u64::MAX),
                    end: end.unwrap_or(u64::MAX),
                    file_len,
                });
            }
        }
    }
    Ok(())
}

impl GgufFile {
    /// Memory-maps `path` read-only and parses it.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        let backing = if len == 0 {
            // Mapping an empty file fails on some platforms; the parse below
            // reports it as truncated.
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and we never hand out mutable
            // access.  As with every mmap-based loader, the caller must not
            // truncate or rewrite the file while it is mapped; model files
            // are treated as immutable.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
            Backing::Mmap(map)
        };
        GgufFile::from_backing(Arc::new(backing))
    }

    /// Parses a GGUF image already in memory.
    pub fn from_backing(backing: Arc<Backing>) -> Result<GgufFile, GgufError> {
        let buf: &[u8] = &backing;
        let mut r = Reader { buf, pos: 0 };
        let (version, tensor_count, kv_count) = read_header(&mut r)?;
        let (metadata, metadata_index) = read_metadata(&mut r, kv_count)?;
        // Alignment (needed before the tensor offsets can be checked).
        let alignment = alignment_of(&metadata, &metadata_index)?;
        let (tensors, tensor_index) = read_tensor_infos(&mut r, tensor_count)?;
        // Data section: starts at the next multiple of the alignment.  With
        // no tensors the padding may be missing, which is harmless.
        let data_start = r.pos.div_ceil(alignment).saturating_mul(alignment);
        check_tensor_data(&tensors, data_start, alignment, buf.len() as u64)?;
        Ok(GgufFile {
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            backing,
            data_start,
            alignment,
        })
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of the data section and of every tensor's data.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute byte offset of the data section in the backing (a multiple
    /// of the alignment; past the end of the backing only when the file has
    /// no tensors and omits the trailing padding).
    pub fn data_start(&self) -> usize {
        self.data_start
    }

    /// All metadata entries, in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of metadata key `key`, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&GgufValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_owned(),
        })
    }

    fn wrong_type(key: &str, expected: &'static str, found: &GgufValue) -> GgufError {
        GgufError::WrongType {
            key: key.to_owned(),
            expected,
            found: found.type_name(),
        }
    }

    /// An integer value that fits in u32, whatever its stored integer type.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let value = self.require(key)?;
        let v = value
            .as_integer()
            .ok_or_else(|| Self::wrong_type(key, "an integer", value))?;
        u32::try_from(v).map_err(|_| GgufError::OutOfRange {
            key: key.to_owned(),
            value: v.to_string(),
            expected: "u32",
        })
    }

    /// An F32 or F64 value (F64 is rounded to f32).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let value = self.require(key)?;
        match *value {
            GgufValue::F32(v) => Ok(v),
            GgufValue::F64(v) => Ok(v as f32),
            _ => Err(Self::wrong_type(key, "a float", value)),
        }
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            GgufValue::Bool(b) => Ok(*b),
            other => Err(Self::wrong_type(key, "a bool", other)),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            GgufValue::String(s) => Ok(s),
            other => Err(Self::wrong_type(key, "a string", other)),
        }
    }

    fn get_array(&self, key: &str, expected: &'static str) -> Result<&[GgufValue], GgufError> {
        match self.require(key)? {
            GgufValue::Array(items) => Ok(items),
            other => Err(Self::wrong_type(key, expected, other)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        const EXPECTED: &str = "an array of strings";
        self.get_array(key, EXPECTED)?
            .iter()
            .map(|v| match v {
                GgufValue::String(s) => Ok(s.as_str()),
                other => Err(Self::wrong_type(key, EXPECTED, &array_of(other))),
            })
            .collect()
    }

    /// An array of integers (any integer type) that all fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        const EXPECTED: &str = "an array of integers";
        self.get_array(key, EXPECTED)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let n = v
                    .as_integer()
                    .ok_or_else(|| Self::wrong_type(key, EXPECTED, &array_of(v)))?;
                i32::try_from(n).map_err(|_| GgufError::OutOfRange {
                    key: key.to_owned(),
                    value: format!("{n} (element {i})"),
                    expected: "i32",
                })
            })
            .collect()
    }

    /// An array of F32 or F64 values (F64 rounded to f32).
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const EXPECTED: &str = "an array of floats";
        self.get_array(key, EXPECTED)?
            .iter()
            .map(|v| match *v {
                GgufValue::F32(x) => Ok(x),
                GgufValue::F64(x) => Ok(x as f32),
                _ => Err(Self::wrong_type(key, EXPECTED, &array_of(v))),
            })
            .collect()
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_owned(),
            })
    }

    /// The raw (possibly quantised) bytes of tensor `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.tensor(name)?;
        let range = self.tensor_range(info);
        let file_len = self.backing.len() as u64;
        self.backing
            .get(range.clone())
            .ok_or_else(|| GgufError::TensorOutOfBounds {
                tensor: name.to_owned(),
                start: range.start as u64,
                end: range.end as u64,
                file_len,
            })
    }

    /// Absolute byte range of `info`'s data in [`GgufFile::backing`].  For a
    /// `TensorInfo` taken from this file it was validated at open; for any
    /// other the range may lie outside the backing (it saturates instead of
    /// overflowing).
    pub fn tensor_range(&self, info: &TensorInfo) -> Range<usize> {
        let start = usize::try_from(info.offset)
            .unwrap_or(usize::MAX)
            .saturating_add(self.data_start);
        start..start.saturating_add(info.n_bytes())
    }

    /// The bytes behind the file.
    pub fn backing(&self) -> &Arc<Backing> {
        &self.backing
    }
}

/// Wraps a single element so that error messages say `array<T>`.
fn array_of(elem: &GgufValue) -> GgufValue {
    let placeholder = match elem {
        // Avoid cloning large nested arrays or strings just for a name.
        GgufValue::Array(_) => GgufValue::Array(Vec::new()),
        GgufValue::String(_) => GgufValue::String(String::new()),
        other => other.clone(),
    };
    GgufValue::Array(vec![placeholder])
}

/// Checks that `info`'s element and byte counts fit and that its rows are a
/// whole number of quantisation blocks.
fn check_tensor_shape(info: &TensorInfo) -> Result<(), GgufError> {
    let overflow = || GgufError::DimsOverflow {
        tensor: info.name.clone(),
        dims: info.dims.clone(),
    };
    info.dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(overflow)?;
    let row_len = info.dims.first().copied().unwrap_or(0);
    let block_len = info.ty.block_len();
    if block_len == 0 || !row_len.is_multiple_of(block_len as u64) {
        return Err(GgufError::RowNotBlockAligned {
            tensor: info.name.clone(),
            row_len,
            ty: info.ty.name(),
            block_len,
        });
    }
    info.checked_n_bytes().ok_or_else(overflow)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // ---- a tiny GGUF writer -------------------------------------------------

    fn put_u32(b: &mut Vec<u8>, v: u32) {
        b.extend_from_slice(&v.to_le_bytes());
    }

    fn put_u64(b: &mut Vec<u8>, v: u64) {
        b.extend_from_slice(&v.to_le_bytes());
    }

    fn put_str(b: &mut Vec<u8>, s: &[u8]) {
        put_u64(b, s.len() as u64);
        b.extend_from_slice(s);
    }

    fn put_payload(b: &mut Vec<u8>, v: &GgufValue) {
        match v {
            GgufValue::U8(x) => b.push(*x),
            GgufValue::I8(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
            GgufValue::Bool(x) => b.push(u8::from(*x)),
            GgufValue::String(s) => put_str(b, s.as_bytes()),
            GgufValue::Array(items) => {
                put_u32(b, items.first().map_or(0, GgufValue::type_id));
                put_u64(b, items.len() as u64);
                for item in items {
                    put_payload(b, item);
                }
            }
        }
    }

    fn put_kv(b: &mut Vec<u8>, key: &str, v: &GgufValue) {
        put_str(b, key.as_bytes());
        put_u32(b, v.type_id());
        put_payload(b, v);
    }

    #[derive(Clone)]
    struct Spec {
        name: String,
        dims: Vec<u64>,
        type_id: u32,
        data: Vec<u8>,
        /// Overrides the computed (aligned) offset.
        offset: Option<u64>,
    }

    fn spec(name: &str, dims: &[u64], type_id: u32, n_bytes: usize) -> Spec {
        let seed = name
            .bytes()
            .fold(7u8, |a, c| a.wrapping_mul(31).wrapping_add(c));
        Spec {
            name: name.to_owned(),
            dims: dims.to_vec(),
            type_id,
            data: (0..n_bytes).map(|i| seed.wrapping_add(i as u8)).collect(),
            offset: None,
        }
    }

    /// Writes a GGUF image.  The alignment is taken from a
    /// `general.alignment` U32 entry if there is one, else 32.  Tensor data
    /// is laid out in order, each padded to the alignment; nothing follows
    /// the last tensor's data.
    fn build(version: u32, kvs: &[(&str, GgufValue)], tensors: &[Spec]) -> Vec<u8> {
        let align = kvs
            .iter()
            .find_map(|(k, v)| match (k, v) {
                (&ALIGNMENT_KEY, GgufValue::U32(a)) if *a > 0 => Some(*a as usize),
                _ => None,
            })
            .unwrap_or(DEFAULT_ALIGNMENT);
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        put_u32(&mut b, version);
        put_u64(&mut b, tensors.len() as u64);
        put_u64(&mut b, kvs.len() as u64);
        for (k, v) in kvs {
            put_kv(&mut b, k, v);
        }
        let mut offsets = Vec::new();
        let mut cur = 0usize;
        for t in tensors {
            let o = cur.div_ceil(align) * align;
            offsets.push(o);
            cur = o + t.data.len();
        }
        for (t, &o) in tensors.iter().zip(&offsets) {
            put_str(&mut b, t.name.as_bytes());
            put_u32(&mut b, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut b, d);
            }
            put_u32(&mut b, t.type_id);
            put_u64(&mut b, t.offset.unwrap_or(o as u64));
        }
        if !tensors.is_empty() {
            let data_start = b.len().div_ceil(align) * align;
            b.resize(data_start, 0);
            for (t, &o) in tensors.iter().zip(&offsets) {
                b.resize(data_start + o, 0);
                b.extend_from_slice(&t.data);
            }
        }
        b
    }

    fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        GgufFile::from_backing(Arc::new(Backing::Owned(bytes.to_vec())))
    }

    fn parse_err(bytes: &[u8]) -> GgufError {
        match parse(bytes) {
            Ok(f) => panic!("expected an error, parsed {f:?}"),
            Err(e) => e,
        }
    }

    fn s(v: &str) -> GgufValue {
        GgufValue::String(v.to_owned())
    }

    fn all_kvs() -> Vec<(&'static str, GgufValue)> {
        use GgufValue as V;
        vec![
            ("general.architecture", s("llama")),
            ("general.name", s("tïny ✓ model")),
            ("t.u8", V::U8(200)),
            ("t.i8", V::I8(-5)),
            ("t.u16", V::U16(60000)),
            ("t.i16", V::I16(-30000)),
            ("t.u32", V::U32(4_000_000_000)),
            ("t.i32", V::I32(-2_000_000_000)),
            ("t.u64", V::U64(u64::MAX)),
            ("t.i64", V::I64(i64::MIN)),
            ("t.f32", V::F32(1.5e-5)),
            ("t.f64", V::F64(-2.25)),
            ("t.true", V::Bool(true)),
            ("t.false", V::Bool(false)),
            ("t.empty_str", s("")),
            ("t.arr_u32", V::Array(vec![V::U32(1), V::U32(2), V::U32(3)])),
            ("t.arr_i64", V::Array(vec![V::I64(-1), V::I64(7)])),
            ("t.arr_str", V::Array(vec![s("<s>"), s(""), s("héllo")])),
            ("t.arr_f32", V::Array(vec![V::F32(0.5), V::F32(-1.0)])),
            ("t.arr_f64", V::Array(vec![V::F64(0.25)])),
            ("t.arr_bool", V::Array(vec![V::Bool(true), V::Bool(false)])),
            ("t.arr_empty", V::Array(vec![])),
            (
                "t.nested",
                V::Array(vec![
                    V::Array(vec![V::U8(1), V::U8(2)]),
                    V::Array(vec![V::U8(3)]),
                ]),
            ),
            (
                "t.nested_str",
                V::Array(vec![V::Array(vec![s("a"), s("bc")]), V::Array(vec![])]),
            ),
        ]
    }

    /// F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8.
    fn sample_tensors() -> Vec<Spec> {
        vec![
            spec("token_embd.weight", &[32, 3], 8, 3 * 34),
            spec("blk.0.attn_norm.weight", &[5], 0, 20),
            spec("blk.0.ffn_down.weight", &[64, 2], 3, 2 * 2 * 20),
            spec("output.weight", &[2, 3, 2, 1], 1, 2 * 12),
        ]
    }

    fn sample() -> Vec<u8> {
        build(3, &all_kvs(), &sample_tensors())
    }

    // ---- valid files ---------------------------------------------------------

    #[test]
    fn round_trips_every_value_type_in_order() {
        let f = parse(&sample()).expect("valid file");
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 32);
        let got: Vec<(&str, &GgufValue)> = f.metadata().collect();
        let want = all_kvs();
        assert_eq!(got.len(), want.len());
        for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
            assert_eq!(gk, wk);
            assert_eq!(*gv, wv);
            assert_eq!(f.get(wk), Some(wv));
        }
        assert_eq!(f.get("nope"), None);
    }

    #[test]
    fn typed_getters() {
        let f = parse(&sample()).expect("valid file");
        assert_eq!(f.get_str("general.architecture").expect("str"), "llama");
        assert_eq!(f.get_str("general.name").expect("str"), "tïny ✓ model");
        assert_eq!(f.get_u32("t.u8").expect("u8"), 200);
        assert_eq!(f.get_u32("t.u16").expect("u16"), 60000);
        assert_eq!(f.get_u32("t.u32").expect("u32"), 4_000_000_000);
        assert!(matches!(
            f.get_u32("t.i8"),
            Err(GgufError::OutOfRange { .. })
        ));
        assert!(matches!(
            f.get_u32("t.u64"),
            Err(GgufError::OutOfRange { .. })
        ));
        assert!(matches!(
            f.get_u32("t.i64"),
            Err(GgufError::OutOfRange { .. })
        ));
        assert_eq!(f.get_f32("t.f32").expect("f32"), 1.5e-5);
        assert_eq!(f.get_f32("t.f64").expect("f64"), -2.25);
        assert!(f.get_bool("t.true").expect("bool"));
        assert!(!f.get_bool("t.false").expect("bool"));
        assert_eq!(
            f.get_str_array("t.arr_str").expect("strs"),
            vec!["<s>", "", "héllo"]
        );
        assert_eq!(f.get_i32_array("t.arr_u32").expect("ints"), vec![1, 2, 3]);
        assert_eq!(f.get_i32_array("t.arr_i64").expect("ints"), vec![-1, 7]);
        assert_eq!(
            f.get_i32_array("t.arr_empty").expect("ints"),
            Vec::<i32>::new()
        );
        assert_eq!(
            f.get_f32_array("t.arr_f32").expect("floats"),
            vec![0.5, -1.0]
        );
        assert_eq!(f.get_f32_array("t.arr_f64").expect("floats"), vec![0.25]);

        let e = f.get_u32("general.architecture").expect_err("wrong type");
        assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("general.architecture") && msg.contains("string"),
            "{msg}"
        );
        let e = f.get_str_array("t.arr_u32").expect_err("wrong elem type");
        assert!(e.to_string().contains("array<u32>"), "{e}");
        let e = f.get_f32("t.u32").expect_err("wrong type");
        assert!(e.to_string().contains("t.u32"), "{e}");
        assert!(f.get_bool("t.u8").is_err());
        assert!(f.get_str_array("general.name").is_err());
        assert!(f.get_i32_array("t.arr_f32").is_err());
        assert!(f.get_f32_array("t.nested").is_err());
        let e = f.get_u32("missing.key").expect_err("missing");
        assert!(matches!(e, GgufError::MissingKey { .. }));
        assert!(e.to_string().contains("missing.key"));
    }

    #[test]
    fn tensors_and_data() {
        let bytes = sample();
        let f = parse(&bytes).expect("valid file");
        let specs = sample_tensors();
        assert_eq!(f.tensors().len(), specs.len());
        assert_eq!(f.data_start() % 32, 0);
        for (t, sp) in f.tensors().iter().zip(&specs) {
            assert_eq!(t.name, sp.name);
            assert_eq!(t.dims, sp.dims);
            assert_eq!(Some(t.ty), GgmlType::from_ggml_id(sp.type_id));
            assert_eq!(t.offset % 32, 0);
            assert_eq!(t.n_bytes(), sp.data.len());
            assert_eq!(t.n_elements(), sp.dims.iter().product::<u64>());
            assert_eq!(f.tensor(&t.name).expect("present"), t);
            assert_eq!(f.tensor_data(&t.name).expect("data"), &sp.data[..]);
            assert_eq!(&bytes[f.tensor_range(t)], &sp.data[..]);
        }
        // The last tensor's data ends the file exactly.
        let last = f.tensors().last().expect("tensors");
        assert_eq!(f.tensor_range(last).end, bytes.len());
        let e = f.tensor("blk.9.nope").expect_err("missing");
        assert!(matches!(e, GgufError::MissingTensor { .. }));
        assert!(e.to_string().contains("blk.9.nope"));
        assert!(f.tensor_data("blk.9.nope").is_err());
        let dbg = format!("{f:?}");
        assert!(dbg.contains("tensors: 4"), "{dbg}");
    }

    #[test]
    fn custom_alignment_and_version_2() {
        let kvs = vec![
            (ALIGNMENT_KEY, GgufValue::U32(64)),
            ("general.architecture", s("llama")),
        ];
        let f = parse(&build(2, &kvs, &sample_tensors())).expect("valid file");
        assert_eq!(f.version(), 2);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_start() % 64, 0);
        for t in f.tensors() {
            assert_eq!(t.offset % 64, 0);
            assert_eq!(f.tensor_range(t).start % 64, 0);
        }
        // Alignment 1 is a power of two, and other integer types are accepted.
        let kvs = [(ALIGNMENT_KEY, GgufValue::U64(1))];
        let mut t = spec("a", &[3], 0, 12);
        t.offset = Some(0);
        let mut u = spec("b", &[1], 0, 4);
        u.offset = Some(12);
        // build() pads with 32 unless the key is U32; lay out by hand.
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        put_u32(&mut b, 3);
        put_u64(&mut b, 2);
        put_u64(&mut b, 1);
        put_kv(&mut b, kvs[0].0, &kvs[0].1);
        for x in [&t, &u] {
            put_str(&mut b, x.name.as_bytes());
            put_u32(&mut b, 1);
            put_u64(&mut b, x.dims[0]);
            put_u32(&mut b, 0);
            put_u64(&mut b, x.offset.expect("set"));
        }
        let start = b.len();
        b.extend_from_slice(&t.data);
        b.extend_from_slice(&u.data);
        let f = parse(&b).expect("alignment 1");
        assert_eq!(f.alignment(), 1);
        assert_eq!(f.data_start(), start);
        assert_eq!(f.tensor_data("b").expect("b"), &u.data[..]);
    }

    #[test]
    fn no_tensors_no_padding_is_fine() {
        let f = parse(&build(3, &[("a", GgufValue::U8(1))], &[])).expect("valid");
        assert!(f.tensors().is_empty());
        let f = parse(&build(3, &[], &[])).expect("valid");
        assert_eq!(f.metadata().count(), 0);
    }

    #[test]
    fn open_memory_maps_a_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        let bytes = sample();
        std::fs::write(&path, &bytes).expect("write");
        let f = GgufFile::open(&path).expect("open");
        assert_eq!(f.backing().kind(), "mmap");
        assert_eq!(f.backing().len(), bytes.len());
        assert_eq!(f.tensors().len(), 4);

        let empty = dir.path().join("empty.gguf");
        std::fs::write(&empty, b"").expect("write");
        assert!(matches!(
            GgufFile::open(&empty),
            Err(GgufError::Truncated { .. })
        ));
        let e = GgufFile::open(&dir.path().join("absent.gguf")).expect_err("absent");
        assert!(matches!(e, GgufError::Io { .. }));
        assert!(e.to_string().contains("absent.gguf"), "{e}");
    }

    // ---- corruption ------------------------------------------------------------

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        for len in 0..bytes.len() {
            assert!(parse(&bytes[..len]).is_err(), "truncated to {len} parsed");
        }
        let e = parse_err(&bytes[..20]);
        assert_eq!(
            e.to_string(),
            "truncated GGUF: need 8 bytes at offset 16 reading metadata entry count, but only 4 remain"
        );
    }

    #[test]
    fn bad_magic_and_versions() {
        let mut b = sample();
        b[0] = b'X';
        assert!(matches!(parse_err(&b), GgufError::BadMagic { .. }));
        for v in [0u32, 1, 4, 0xffff_ffff] {
            let b = build(v, &[], &[]);
            let e = parse_err(&b);
            assert!(
                matches!(e, GgufError::UnsupportedVersion { version } if version == v),
                "{e}"
            );
        }
        assert!(
            parse_err(&build(1, &[], &[]))
                .to_string()
                .contains("version 1")
        );
        // A big-endian writer stores the version byte-swapped.
        let mut b = build(3, &[], &[]);
        b[4..8].copy_from_slice(&3u32.to_be_bytes());
        let e = parse_err(&b);
        assert!(matches!(e, GgufError::BigEndian { swapped: 3, .. }), "{e}");
        assert!(e.to_string().contains("big-endian"));
    }

    #[test]
    fn huge_counts_and_lengths() {
        // Tensor count.
        let mut b = sample();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_err(&b);
        assert!(
            matches!(e, GgufError::CountTooLarge { offset: 8, .. }),
            "{e}"
        );
        b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(parse_err(&b), GgufError::CountTooLarge { .. }));
        // Metadata entry count.
        let mut b = sample();
        b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        let e = parse_err(&b);
        assert!(
            matches!(e, GgufError::CountTooLarge { offset: 16, .. }),
            "{e}"
        );
        // Key string length.
        let mut b = sample();
        b[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = parse_err(&b);
        assert!(
            matches!(e, GgufError::CountTooLarge { offset: 24, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("key of metadata entry 0"), "{e}");
        // String value length.
        let b = build(3, &[("k", s("hello"))], &[]);
        let at = 24 + 8 + 1 + 4;
        let mut b2 = b.clone();
        b2[at..at + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        let e = parse_err(&b2);
        assert!(e.to_string().contains("`k`"), "{e}");
        // One byte too long is merely truncated data.
        let mut b3 = b.clone();
        b3[at..at + 8].copy_from_slice(&6u64.to_le_bytes());
        assert!(parse(&b3).is_err());
        // Array length.
        let b = build(
            3,
            &[("arr", GgufValue::Array(vec![GgufValue::U64(1)]))],
            &[],
        );
        let at = 24 + 8 + 3 + 4 + 4;
        let mut b2 = b.clone();
        b2[at..at + 8].copy_from_slice(&(u64::MAX / 8 + 1).to_le_bytes());
        assert!(matches!(parse_err(&b2), GgufError::CountTooLarge { .. }));
        let mut b2 = b.clone();
        b2[at..at + 8].copy_from_slice(&2u64.to_le_bytes());
        assert!(matches!(parse_err(&b2), GgufError::CountTooLarge { .. }));
    }

    #[test]
    fn bad_utf8() {
        let b = build(3, &[("key", s("ab"))], &[]);
        let mut k = b.clone();
        k[24 + 8 + 1] = 0xff;
        let e = parse_err(&k);
        assert!(
            matches!(e, GgufError::InvalidUtf8 { offset: 33, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("key of metadata entry 0"), "{e}");
        let mut v = b.clone();
        let at = 24 + 8 + 3 + 4 + 8 + 1;
        v[at] = 0xc3; // a lone lead byte at the end
        let e = parse_err(&v);
        assert!(matches!(e, GgufError::InvalidUtf8 { offset, .. } if offset == at as u64));
        assert!(e.to_string().contains("`key`"), "{e}");
        // Tensor names too.
        let mut t = build(3, &[], &[spec("tens", &[1], 0, 4)]);
        t[24 + 8] = 0x80;
        let e = parse_err(&t);
        assert!(matches!(e, GgufError::InvalidUtf8 { .. }));
        assert!(e.to_string().contains("tensor info 0"), "{e}");
    }

    #[test]
    fn bad_bool_and_unknown_value_types() {
        let b = build(3, &[("flag", GgufValue::Bool(true))], &[]);
        let at = 24 + 8 + 4 + 4;
        let mut b2 = b.clone();
        b2[at] = 2;
        let e = parse_err(&b2);
        assert!(matches!(e, GgufError::InvalidBool { value: 2, .. }), "{e}");
        assert!(e.to_string().contains("`flag`"));
        // Inside an array.
        let b = build(
            3,
            &[("flags", GgufValue::Array(vec![GgufValue::Bool(false)]))],
            &[],
        );
        let mut b2 = b.clone();
        let last = b2.len() - 1;
        b2[last] = 0xff;
        assert!(matches!(parse_err(&b2), GgufError::InvalidBool { .. }));
        // Unknown value type, top level and array element.
        let mut b2 = b.clone();
        b2[24 + 8 + 5..24 + 8 + 5 + 4].copy_from_slice(&13u32.to_le_bytes());
        let e = parse_err(&b2);
        assert!(
            matches!(e, GgufError::UnknownValueType { type_id: 13, .. }),
            "{e}"
        );
        let mut b2 = b.clone();
        b2[24 + 8 + 5 + 4..24 + 8 + 5 + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = parse_err(&b2);
        assert!(
            matches!(
                e,
                GgufError::UnknownValueType {
                    type_id: u32::MAX,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn nesting_is_bounded() {
        let mut v = GgufValue::U8(1);
        for _ in 0..MAX_ARRAY_DEPTH {
            v = GgufValue::Array(vec![v]);
        }
        assert!(parse(&build(3, &[("deep", v.clone())], &[])).is_ok());
        let v = GgufValue::Array(vec![v]);
        let e = parse_err(&build(3, &[("deep", v)], &[]));
        assert!(matches!(e, GgufError::NestingTooDeep { .. }), "{e}");
        // A long chain of nested array headers with nothing inside.
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        put_u32(&mut b, 3);
        put_u64(&mut b, 0);
        put_u64(&mut b, 1);
        put_str(&mut b, b"x");
        put_u32(&mut b, 9);
        for _ in 0..10_000 {
            put_u32(&mut b, 9);
            put_u64(&mut b, 1);
        }
        assert!(matches!(parse_err(&b), GgufError::NestingTooDeep { .. }));
    }

    #[test]
    fn duplicates() {
        let e = parse_err(&build(
            3,
            &[
                ("a", GgufValue::U8(1)),
                ("b", GgufValue::U8(1)),
                ("a", GgufValue::U8(2)),
            ],
            &[],
        ));
        assert!(
            matches!(e, GgufError::DuplicateKey { ref key, .. } if key == "a"),
            "{e}"
        );
        let e = parse_err(&build(
            3,
            &[],
            &[spec("w", &[1], 0, 4), spec("w", &[1], 0, 4)],
        ));
        assert!(
            matches!(e, GgufError::DuplicateTensor { ref name, .. } if name == "w"),
            "{e}"
        );
    }

    #[test]
    fn bad_tensor_shapes_and_types() {
        let e = parse_err(&build(3, &[], &[spec("t0", &[], 0, 4)]));
        assert!(matches!(e, GgufError::BadDimCount { n_dims: 0, .. }), "{e}");
        assert!(e.to_string().contains("`t0`"));
        let e = parse_err(&build(3, &[], &[spec("t5", &[1, 1, 1, 1, 1], 0, 4)]));
        assert!(matches!(e, GgufError::BadDimCount { n_dims: 5, .. }), "{e}");
        let e = parse_err(&build(3, &[], &[spec("z", &[4, 0], 0, 4)]));
        assert!(matches!(e, GgufError::ZeroDim { index: 1, .. }), "{e}");
        let e = parse_err(&build(3, &[], &[spec("big", &[1 << 32, 1 << 32], 0, 4)]));
        assert!(matches!(e, GgufError::DimsOverflow { .. }), "{e}");
        // Elements fit in u64 but bytes do not fit in usize.
        let e = parse_err(&build(3, &[], &[spec("bytes", &[1 << 62, 1], 0, 4)]));
        assert!(matches!(e, GgufError::DimsOverflow { .. }), "{e}");
        let e = parse_err(&build(3, &[], &[spec("q", &[33], 8, 34)]));
        assert!(
            matches!(
                e,
                GgufError::RowNotBlockAligned {
                    row_len: 33,
                    block_len: 32,
                    ..
                }
            ),
            "{e}"
        );
        let e = parse_err(&build(3, &[], &[spec("odd.type", &[4], 99, 16)]));
        assert!(
            matches!(e, GgufError::UnknownTensorType { type_id: 99, ref tensor, .. } if tensor == "odd.type"),
            "{e}"
        );
        let msg = e.to_string();
        assert!(msg.contains("odd.type") && msg.contains("99"), "{msg}");
    }

    #[test]
    fn bad_tensor_offsets() {
        let mut t = sample_tensors();
        t[1].offset = Some(32 * 4 + 4);
        let e = parse_err(&build(3, &[], &t));
        assert!(
            matches!(
                e,
                GgufError::MisalignedTensor {
                    offset: 132,
                    alignment: 32,
                    ..
                }
            ),
            "{e}"
        );
        let mut t = sample_tensors();
        t[0].offset = Some(1 << 20);
        let e = parse_err(&build(3, &[], &t));
        assert!(
            matches!(e, GgufError::TensorOutOfBounds { ref tensor, .. } if tensor == "token_embd.weight"),
            "{e}"
        );
        let mut t = sample_tensors();
        t[0].offset = Some(u64::MAX - 31);
        assert!(matches!(
            parse_err(&build(3, &[], &t)),
            GgufError::TensorOutOfBounds { .. }
        ));
        let mut b = sample();
        b.pop();
        let e = parse_err(&b);
        assert!(
            matches!(e, GgufError::TensorOutOfBounds { ref tensor, .. } if tensor == "output.weight"),
            "{e}"
        );
    }

    #[test]
    fn bad_alignment() {
        for a in [0u32, 3, 48, u32::MAX] {
            let e = parse_err(&build(3, &[(ALIGNMENT_KEY, GgufValue::U32(a))], &[]));
            assert!(
                matches!(e, GgufError::BadAlignment { value } if value == i128::from(a)),
                "{e}"
            );
        }
        let e = parse_err(&build(3, &[(ALIGNMENT_KEY, GgufValue::I32(-32))], &[]));
        assert!(matches!(e, GgufError::BadAlignment { value: -32 }), "{e}");
        let e = parse_err(&build(3, &[(ALIGNMENT_KEY, GgufValue::U64(1 << 32))], &[]));
        assert!(matches!(e, GgufError::BadAlignment { .. }), "{e}");
        let e = parse_err(&build(3, &[(ALIGNMENT_KEY, s("32"))], &[]));
        assert!(matches!(e, GgufError::AlignmentWrongType { .. }), "{e}");
        assert!(e.to_string().contains("general.alignment"));
        let e = parse_err(&build(3, &[(ALIGNMENT_KEY, GgufValue::F32(32.0))], &[]));
        assert!(matches!(e, GgufError::AlignmentWrongType { .. }), "{e}");
    }

    // ---- deterministic mutation fuzzing ------------------------------------

    use tandem_types::SeededRng as SplitMix;

    /// Touches everything a loader would, so that a parse that "succeeds"
    /// into an inconsistent state is caught too.
    fn exercise(f: &GgufFile) {
        let len = f.backing().len();
        for t in f.tensors() {
            let data = f.tensor_data(&t.name).expect("validated tensor data");
            assert_eq!(data.len(), t.n_bytes());
            let r = f.tensor_range(t);
            assert!(r.start <= r.end && r.end <= len);
            assert_eq!(r.start % f.alignment(), 0);
            assert!(t.n_elements() > 0);
            assert!(f.tensor(&t.name).is_ok());
        }
        for (k, v) in f.metadata() {
            let _ = v.type_name();
            let _ = f.get_u32(k).map_err(|e| e.to_string());
            let _ = f.get_f32(k).map_err(|e| e.to_string());
            let _ = f.get_bool(k).map_err(|e| e.to_string());
            let _ = f.get_str(k).map_err(|e| e.to_string());
            let _ = f.get_str_array(k).map_err(|e| e.to_string());
            let _ = f.get_i32_array(k).map_err(|e| e.to_string());
            let _ = f.get_f32_array(k).map_err(|e| e.to_string());
        }
        let _ = format!("{f:?}");
    }

    fn mutate(rng: &mut SplitMix, base: &[u8], length_fields: &[usize]) -> Vec<u8> {
        const HUGE: [u64; 9] = [
            u64::MAX,
            u64::MAX / 2,
            1 << 63,
            1 << 40,
            1 << 32,
            (1 << 32) - 1,
            0,
            4096,
            65,
        ];
        const U32S: [u32; 10] = [0, 1, 2, 4, 5, 8, 9, 13, 0x8000_0000, u32::MAX];
        let mut v = base.to_vec();
        for _ in 0..1 + rng.below(4) {
            match rng.below(8) {
                0 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] ^= 1 << rng.below(8);
                }
                1 if !v.is_empty() => {
                    let i = rng.below(v.len());
                    v[i] = rng.next_u64() as u8;
                }
                2 => {
                    let at = rng.below(v.len() + 1);
                    let n = 1 + rng.below(8);
                    let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                    v.splice(at..at, ins);
                }
                3 if !v.is_empty() => {
                    let at = rng.below(v.len());
                    let end = (at + 1 + rng.below(16)).min(v.len());
                    v.drain(at..end);
                }
                4 => {
                    let n = rng.below(v.len() + 1);
                    v.truncate(n);
                }
                5 | 6 => {
                    let at = length_fields[rng.below(length_fields.len())];
                    let mut val = HUGE[rng.below(HUGE.len())];
                    if rng.below(4) == 0 {
                        val = val.wrapping_add(rng.below(64) as u64);
                    }
                    if let Some(dst) = v.get_mut(at..at + 8) {
                        dst.copy_from_slice(&val.to_le_bytes());
                    }
                }
                _ => {
                    if v.len() >= 4 {
                        let at = rng.below(v.len() - 3);
                        let val = U32S[rng.below(U32S.len())];
                        v[at..at + 4].copy_from_slice(&val.to_le_bytes());
                    }
                }
            }
        }
        v
    }

    #[test]
    fn seeded_mutations_never_panic() {
        // A smaller file than `sample()` keeps each parse cheap.
        let kvs = vec![
            ("general.architecture", s("llama")),
            ("a.u32", GgufValue::U32(30)),
            ("a.f32", GgufValue::F32(1e-5)),
            ("a.bool", GgufValue::Bool(true)),
            ("a.i64", GgufValue::I64(-3)),
            ("a.toks", GgufValue::Array(vec![s("<s>"), s("a"), s("bc")])),
            (
                "a.ints",
                GgufValue::Array(vec![GgufValue::I32(1), GgufValue::I32(-2)]),
            ),
            (
                "a.nest",
                GgufValue::Array(vec![GgufValue::Array(vec![GgufValue::U16(1)])]),
            ),
        ];
        let tensors = vec![
            spec("x", &[32, 2], 8, 68),
            spec("y", &[3], 0, 12),
            spec("z", &[2, 2], 1, 8),
        ];
        let base = build(3, &kvs, &tensors);
        assert!(parse(&base).is_ok());
        // Likely length / count / dim / offset fields: small non-zero u64s.
        let length_fields: Vec<usize> = (0..base.len().saturating_sub(7))
            .filter(|&i| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&base[i..i + 8]);
                (1..=4096).contains(&u64::from_le_bytes(w))
            })
            .collect();
        assert!(length_fields.len() > 20);

        let mut rng = SplitMix::new(0x5eed_6775_f000_0001);
        let (mut ok, mut err) = (0u32, 0u32);
        for _ in 0..20_000 {
            let m = mutate(&mut rng, &base, &length_fields);
            match parse(&m) {
                Ok(f) => {
                    exercise(&f);
                    ok += 1;
                }
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    err += 1;
                }
            }
        }
        eprintln!("seeded mutations: {ok} parsed, {err} rejected");
        // Both outcomes must be well represented, or the mutations are not
        // exercising the reader.
        assert!(ok > 500 && err > 5_000, "ok {ok}, err {err}");
    }
}
