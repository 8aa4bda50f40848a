use std::marker::PhantomData;
use std::sync::{Mutex, OnceLock};

use cubecl::bytes::Bytes;
use cubecl::prelude::{Client, CubeElement};
use cubecl::server::Handle;
use cubecl::wgpu::{
    RuntimeOptions, Vulkan, WgpuBackend, WgpuDevice, WgpuDeviceKind, WgpuInitError, WgpuRuntime,
    try_init_setup,
};
use cubecl_runtime::runtime::Runtime;

use crate::cuda;
use crate::error::GpuError;
pub use crate::runtime::GpuRuntime;

/// An opened GPU: where buffers live and kernels run.
#[derive(Clone)]
pub struct GpuDevice {
    client: Client,
    name: String,
    runtime: GpuRuntime,
    /// `[u32::MAX]`: the row count of a matmul whose rows are all live
    /// (see `kernels::matmul_q_live`).
    all_rows: Buffer<u32>,
}

impl std::fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDevice")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// `len` values of `T` (f32 activations and weights, u32 positions or
/// quantised weight words) in device memory.
#[derive(Clone, Debug)]
pub struct Buffer<T = f32> {
    pub(crate) handle: Handle,
    pub(crate) len: usize,
    _t: PhantomData<T>,
}

impl<T> Buffer<T> {
    /// Values held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Devices opened so far: `gpu:N`'s index, its client, its name.
static OPENED: Mutex<Vec<(usize, GpuDevice)>> = Mutex::new(Vec::new());

/// The runtime [`GpuDevice::open`] asks for, fixed at first use.
static PREFERRED: OnceLock<GpuRuntime> = OnceLock::new();

/// The runtime chosen after a device was opened on another.
#[derive(Debug, thiserror::Error)]
#[error("the GPU runtime is already {0} for this process")]
pub struct RuntimeAlreadyChosen(pub GpuRuntime);

/// Chooses the runtime [`GpuDevice::open`] asks for (`--gpu-runtime`), for
/// the life of the process, as `--cpu-isa` fixes the CPU's instruction
/// set: call it before the first device is opened. Choosing the same one
/// again is a no-op; another one is an error and changes nothing.
pub fn prefer_runtime(runtime: GpuRuntime) -> Result<(), RuntimeAlreadyChosen> {
    match *PREFERRED.get_or_init(|| runtime) {
        chosen if chosen == runtime => Ok(()),
        chosen => Err(RuntimeAlreadyChosen(chosen)),
    }
}

impl GpuDevice {
    /// Opens GPU `index` (`gpu:index` on the command line) on the
    /// `runtime` asked for: with [`GpuRuntime::Auto`], the index-th CUDA
    /// device where a CUDA driver is present, else the index-th discrete,
    /// integrated or virtual Vulkan GPU, in that order of preference, and
    /// for index 0 a CPU Vulkan device (lavapipe) when there is no GPU at
    /// all. [`GpuDevice::name`] says which runtime was chosen.
    /// A device opened before in this process is shared: CubeCL registers
    /// each device once per process.
    pub fn open_on(index: usize, runtime: GpuRuntime) -> Result<GpuDevice, GpuError> {
        let mut opened = OPENED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, dev)) = opened
            .iter()
            .find(|(i, d)| *i == index && runtime.admits(d.runtime))
        {
            return Ok(dev.clone());
        }
        let (client, name, chosen) = open_client(index, runtime)?;
        let all_rows = Buffer {
            handle: client.create_from_slice(u32::as_bytes(&[u32::MAX])),
            len: 1,
            _t: PhantomData,
        };
        let dev = GpuDevice {
            client,
            name,
            runtime: chosen,
            all_rows,
        };
        opened.push((index, dev.clone()));
        Ok(dev)
    }

    /// [`GpuDevice::open_on`] the runtime [`prefer_runtime`] chose for this
    /// process ([`GpuRuntime::Auto`] unless it was called).
    pub fn open(index: usize) -> Result<GpuDevice, GpuError> {
        Self::open_on(index, *PREFERRED.get_or_init(GpuRuntime::default))
    }

    /// The adapter and its runtime, as the startup line names them.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The runtime the device was opened on (never `Auto`).
    pub fn runtime(&self) -> GpuRuntime {
        self.runtime
    }

    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) fn all_rows(&self) -> &Buffer<u32> {
        &self.all_rows
    }

    /// Copies `data` to a new device buffer.
    pub fn upload<T: CubeElement>(&self, data: &[T]) -> Buffer<T> {
        Buffer {
            handle: self.client.create_from_slice(T::as_bytes(data)),
            len: data.len(),
            _t: PhantomData,
        }
    }

    /// Copies raw bytes (quantised weights) to a new buffer of
    /// little-endian 32-bit words, zero-padded to a whole word.
    pub fn upload_words(&self, bytes: &[u8]) -> Buffer<u32> {
        let words: Vec<u32> = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect();
        self.upload(&words)
    }

    /// A new buffer of `len` zeros.
    pub fn zeros(&self, len: usize) -> Buffer<f32> {
        self.upload(&vec![0.0f32; len])
    }

    /// A new buffer of `len` values that kernels write before they read
    /// (nothing is copied to the device).
    pub fn empty<T: CubeElement>(&self, len: usize) -> Buffer<T> {
        Buffer {
            handle: self.client.empty(len.max(1) * size_of::<T>()),
            len,
            _t: PhantomData,
        }
    }

    /// Copies `data` into `buf` from value `at` on.
    pub fn write_at<T: CubeElement>(
        &self,
        buf: &Buffer<T>,
        at: usize,
        data: &[T],
    ) -> Result<(), GpuError> {
        self.write_bytes(buf, at, T::as_bytes(data))
    }

    /// Copies raw bytes, whole values of `T`, into `buf` from value `at` on
    /// (a KV block from the host pool).
    pub fn write_bytes<T>(&self, buf: &Buffer<T>, at: usize, bytes: &[u8]) -> Result<(), GpuError> {
        let elem = size_of::<T>();
        if !bytes.len().is_multiple_of(elem) {
            return Err(GpuError::Shape {
                kernel: "write",
                what: format!("{} bytes are not whole values of {elem}", bytes.len()),
            });
        }
        let range = self.range(buf, at, bytes.len() / elem, "write")?;
        self.client
            .write(&range, Bytes::from_bytes_vec(bytes.to_vec()));
        Ok(())
    }

    /// The raw bytes of values `at..at + len` of each buffer, with one wait
    /// for the kernels that write them.
    pub fn download_bytes<T>(
        &self,
        ranges: &[(&Buffer<T>, usize, usize)],
    ) -> Result<Vec<Vec<u8>>, GpuError> {
        let handles = ranges
            .iter()
            .map(|&(buf, at, len)| self.range(buf, at, len, "read"))
            .collect::<Result<Vec<_>, _>>()?;
        let bytes = self.client.read(handles).map_err(|e| GpuError::Device {
            kernel: "read",
            message: e.to_string(),
        })?;
        Ok(bytes.iter().map(|b| b.to_vec()).collect())
    }

    /// The handle of values `at..at + len` of `buf`, checked against its
    /// length (the device would otherwise clamp or fault).
    fn range<T>(
        &self,
        buf: &Buffer<T>,
        at: usize,
        len: usize,
        what: &'static str,
    ) -> Result<Handle, GpuError> {
        let elem = size_of::<T>() as u64;
        match at.checked_add(len) {
            Some(end) if end <= buf.len && len > 0 => Ok(buf
                .handle
                .clone()
                .offset_start(at as u64 * elem)
                .offset_end(buf.handle.size() - end as u64 * elem)),
            _ => Err(GpuError::Shape {
                kernel: what,
                what: format!("values {at}..+{len} of a buffer of {}", buf.len),
            }),
        }
    }

    /// Reads a buffer back (waiting for the kernels that write it).
    pub fn download<T: CubeElement>(&self, buf: &Buffer<T>) -> Result<Vec<T>, GpuError> {
        let bytes = self
            .client
            .read_one(buf.handle.clone())
            .map_err(|e| GpuError::Device {
                kernel: "read",
                message: e.to_string(),
            })?;
        let mut values = T::from_bytes(&bytes).to_vec();
        values.truncate(buf.len);
        Ok(values)
    }
}

/// The device `index` on `runtime`: its client, name and runtime, or why
/// there is none on any runtime asked for.
fn open_client(
    index: usize,
    runtime: GpuRuntime,
) -> Result<(Client, String, GpuRuntime), GpuError> {
    let not_asked = |r: &str| format!("not tried ({r} asked for)");
    let cuda = if runtime.admits(GpuRuntime::Cuda) {
        match cuda::open(index) {
            Ok((client, name)) => return Ok((client, name, GpuRuntime::Cuda)),
            Err(why) => why,
        }
    } else {
        not_asked("Vulkan")
    };
    let vulkan = if runtime.admits(GpuRuntime::Vulkan) {
        match open_vulkan(index) {
            Ok((client, name)) => return Ok((client, name, GpuRuntime::Vulkan)),
            Err(why) => why,
        }
    } else {
        not_asked("CUDA")
    };
    Err(GpuError::NoDevice {
        index,
        cuda,
        vulkan,
    })
}

/// The index-th Vulkan adapter, or why there is none.
fn open_vulkan(index: usize) -> Result<(Client, String), String> {
    let mut kinds = vec![
        WgpuDeviceKind::DiscreteGpu(index),
        WgpuDeviceKind::IntegratedGpu(index),
        WgpuDeviceKind::VirtualGpu(index),
    ];
    if index == 0 {
        kinds.push(WgpuDeviceKind::Cpu);
    }
    let mut failed = Vec::new();
    for kind in kinds {
        let device = WgpuDevice {
            kind,
            backend: WgpuBackend::Vulkan,
        };
        match try_init_setup::<Vulkan>(&device, RuntimeOptions::default()) {
            Ok(setup) => {
                let info = setup.adapter.get_info();
                let name = format!("{} ({:?}, Vulkan)", info.name, info.device_type);
                return Ok((<WgpuRuntime>::client(&device), name));
            }
            // "No adapter of this kind" is the expected miss; anything
            // else (a driver failing to start) is worth reporting.
            Err(WgpuInitError::AdapterUnavailable { .. }) => {}
            Err(e) => failed.push(e.to_string()),
        }
    }
    Err(if failed.is_empty() {
        "no discrete, integrated, virtual or CPU adapter".to_string()
    } else {
        failed.join("; ")
    })
}
