//! The CUDA form of every kernel: each one is expanded as a launch would
//! expand it, compiled to CUDA C++ by CubeCL's C++ backend, and the C++ to
//! PTX for Hopper (sm_90) by NVRTC. No GPU or driver is needed, only
//! libnvrtc (`scripts/test.sh` installs it from PyPI's
//! `nvidia-cuda-nvrtc-cu12` wheel and puts it on `LD_LIBRARY_PATH`).
//!
//! The expansion borrows the Vulkan device's properties (lavapipe here):
//! none of these kernels branch on them.

use cubecl::prelude::*;
use cubecl::{Compiler, CubeKernel};
use cubecl_cpp::shared::{CompilationOptions, CppCompiler};
use cubecl_cpp::target::Cuda;
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::moe::{moe_gather_kernel, moe_group_kernel, moe_route_kernel, moe_scatter_kernel};
use super::quant::quant_matmul_kernel;
use super::*;

/// CUDA C++ for `kernel`, or why CubeCL's C++ backend refused it.
fn cuda_source(kernel: impl CubeKernel) -> Result<String, String> {
    let mut compiler = CppCompiler::<Cuda>::default();
    let options = CompilationOptions {
        warp_size: 32,
        ..Default::default()
    };
    compiler
        .compile(kernel.define(), &options)
        .map(|k| k.to_string())
        .map_err(|e| format!("{e:?}"))
}

/// PTX for sm_90 from `source`, or NVRTC's log.
fn ptx(source: &str) -> Result<String, String> {
    let opts = CompileOptions {
        arch: Some("sm_90"),
        ..Default::default()
    };
    compile_ptx_with_opts(source, opts)
        .map(|p| p.to_src())
        .map_err(|e| format!("{e:?}"))
}

fn dev() -> GpuDevice {
    GpuDevice::open(0).unwrap_or_else(|e| panic!("the expansion needs a Vulkan device: {e}"))
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm_90() {
    // SAFETY (of `is_culib_present`): only tries to `dlopen` libnvrtc.
    assert!(
        unsafe { cudarc::nvrtc::sys::is_culib_present() },
        "libnvrtc not found: scripts/test.sh installs the nvidia-cuda-nvrtc-cu12 wheel and \
         puts its lib directory on LD_LIBRARY_PATH"
    );
    let dev = dev();
    let c = dev.client();
    let (p, t) = (c.properties_shared(), c.target_properties_shared());
    let f = dev.zeros(64);
    let u = dev.upload(&[0u32; 64]);
    let grid = || (CubeCount::Static(1, 1, 1), CubeDim::new_1d(64));
    let mut kernels: Vec<(&str, Result<String, String>)> = Vec::new();
    macro_rules! kernel {
        ($name:ident, $dim:expr, $($arg:expr),* $(,)?) => {{
            let (count, dim): (CubeCount, CubeDim) = $dim;
            let k = $name::create_dummy_kernel(p.clone(), t.clone(), count, dim, $($arg),*);
            kernels.push((stringify!($name), cuda_source(k)));
        }};
    }
    kernel!(
        rms_norm_kernel,
        rows_grid(2),
        arg(&f),
        arg(&f),
        arg(&f),
        1e-5,
        576,
        ROW_UNITS
    );
    // Without and with a post norm (Gemma's).
    for post in [false, true] {
        kernel!(
            add_rms_norm_kernel,
            rows_grid(2),
            arg(&f),
            arg(&f),
            arg(&f),
            arg(&f),
            arg(&f),
            1e-5,
            576,
            ROW_UNITS,
            post
        );
    }
    kernel!(
        head_rms_norm_kernel,
        (
            CubeCount::Static(5, 2, 1),
            CubeDim::new_1d(ROW_UNITS as u32)
        ),
        arg(&f),
        arg(&f),
        arg(&f),
        1e-6,
        1536,
        4,
        256,
        ROW_UNITS
    );
    // SwiGLU and GeGLU.
    for gelu in [false, true] {
        kernel!(glu_kernel, grid(), arg(&f), arg(&f), 1536, gelu);
    }
    kernel!(
        rope_kernel,
        grid(),
        arg(&f),
        arg(&u),
        arg(&f),
        768,
        960,
        64,
        32,
        false
    );
    kernel!(
        rope_kernel,
        grid(),
        arg(&f),
        arg(&u),
        arg(&f),
        768,
        960,
        64,
        32,
        true
    );
    // A one-token grid and an eight-token tile (the two shapes of the
    // tile loop).
    for n_tok in [1, 8] {
        let (count, dim, tile, n) = matmul_grid("cuda", n_tok, 576)
            .ok()
            .flatten()
            .expect("a grid");
        kernel!(
            matmul_kernel,
            (count.clone(), dim),
            arg(&f),
            arg(&f),
            arg(&f),
            n,
            576,
            MATMUL_UNITS,
            tile
        );
        // The quantised kernel in every format, at columns every format's
        // blocks divide, writing rows 8.. of rows of 600.
        for format in QFormat::ALL {
            kernel!(
                quant_matmul_kernel,
                (count.clone(), dim),
                arg(&f),
                arg(&u),
                arg(&f),
                arg(&u),
                0,
                n,
                600,
                8,
                512,
                MATMUL_UNITS,
                tile,
                format
            );
        }
    }
    kernel!(
        argmax_kernel,
        rows_grid(1),
        arg(&f),
        arg(&u),
        49_152,
        ROW_UNITS
    );
    for k in [1, 8, TOP_K_MAX] {
        kernel!(
            top_k_kernel,
            rows_grid(1),
            arg(&f),
            arg(&u),
            arg(&f),
            arg(&f),
            49_152,
            k,
            ROW_UNITS
        );
    }
    kernel!(
        attention_kernel,
        rows_grid(9),
        arg(&f),
        arg(&u),
        arg(&u),
        arg(&u),
        arg(&f),
        arg(&f),
        0.125,
        0,
        4096,
        512,
        0,
        // A sliding window of 512 positions (u32::MAX: none).
        512,
        960,
        64,
        9,
        3,
        16,
        ROW_UNITS,
    );
    kernel!(
        kv_write_kernel,
        grid(),
        arg(&f),
        arg(&u),
        arg(&u),
        0,
        4096,
        960,
        576,
        768,
        64,
        3,
        16
    );
    kernel!(add_kernel, grid(), arg(&f), arg(&f));
    kernel!(add_bias_kernel, grid(), arg(&f), arg(&f));
    kernel!(softcap_kernel, grid(), arg(&f), 30.0);
    kernel!(copy_kernel, grid(), arg(&f), arg(&f));
    kernel!(gather_rows_kernel, grid(), arg(&f), arg(&u), arg(&f), 576);
    kernel!(fill_kernel, grid(), arg(&f), 0.0);
    // Softmax routing (Mixtral), and sigmoid with normalised weights
    // (DeepSeek-V3's 256 experts).
    for (experts, top_k, sigmoid) in [(8, 2, false), (256, 8, true)] {
        kernel!(
            moe_route_kernel,
            grid(),
            arg(&f),
            arg(&f),
            arg(&u),
            arg(&f),
            2.5,
            experts,
            top_k,
            sigmoid,
            sigmoid
        );
        kernel!(
            moe_group_kernel,
            grid(),
            arg(&u),
            arg(&f),
            arg(&u),
            arg(&f),
            arg(&u),
            experts,
            top_k
        );
    }
    kernel!(
        moe_gather_kernel,
        grid(),
        arg(&f),
        arg(&u),
        arg(&u),
        arg(&f),
        3,
        576
    );
    kernel!(
        moe_scatter_kernel,
        grid(),
        arg(&f),
        arg(&u),
        arg(&f),
        arg(&u),
        arg(&f),
        3,
        576
    );

    let mut failed = Vec::new();
    for (name, source) in &kernels {
        match source.as_deref().map_err(String::clone).and_then(ptx) {
            Ok(ptx) if ptx.contains(".entry") => {}
            Ok(_) => failed.push(format!("{name}: PTX without an entry point")),
            Err(e) => failed.push(format!("{name}: {e}")),
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}
