//! The GPU behind [`crate::Gpu`]: the CUDA driver through cudarc, loaded at
//! run time. Each kernel file becomes a module at its first launch: NVRTC
//! compiles it for this GPU's architecture (a cubin; PTX where NVRTC cannot
//! target the GPU), so a binary carries sources, not one GPU's code.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use crate::device::DeviceError;
use crate::nvrtc::{self, Target};
use crate::table::KernelInfo;

pub(crate) struct Driver {
    context: sys::CUcontext,
    name: String,
    capability: (i32, i32),
    total_memory: usize,
    modules: Mutex<BTreeMap<&'static str, sys::CUmodule>>,
    functions: Mutex<BTreeMap<&'static str, sys::CUfunction>>,
}

// SAFETY: the context and module handles are used only under `set_current`
// on the calling thread; the driver API is thread-safe.
unsafe impl Send for Driver {}
unsafe impl Sync for Driver {}

fn driver_error(e: result::DriverError) -> DeviceError {
    DeviceError::Driver(format!("{e:?}"))
}

impl Driver {
    pub(crate) fn open(ordinal: usize) -> Result<Self, DeviceError> {
        // SAFETY: only probes for the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::NoDriver("libcuda.so could not be loaded".into()));
        }
        if !nvrtc::available() {
            return Err(DeviceError::NoDriver(
                "libnvrtc could not be loaded (the kernels are compiled for the GPU at start; \
                 put the CUDA toolkit's lib64 on LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        result::init().map_err(|e| DeviceError::NoDriver(format!("cuInit failed: {e:?}")))?;
        let count = result::device::get_count().map_err(driver_error)?;
        if ordinal as i32 >= count {
            return Err(DeviceError::NoDriver(format!("GPU {ordinal} asked for, {count} present")));
        }
        let device = result::device::get(ordinal as i32).map_err(driver_error)?;
        // SAFETY: a device handle from the driver.
        unsafe {
            let context = result::primary_ctx::retain(device).map_err(driver_error)?;
            result::ctx::set_current(context).map_err(driver_error)?;
            let name = result::device::get_name(device).map_err(driver_error)?;
            let major = result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            )
            .map_err(driver_error)?;
            let minor = result::device::get_attribute(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
            .map_err(driver_error)?;
            let total_memory = result::device::total_mem(device).map_err(driver_error)?;
            Ok(Self {
                context,
                name,
                capability: (major, minor),
                total_memory,
                modules: Mutex::new(BTreeMap::new()),
                functions: Mutex::new(BTreeMap::new()),
            })
        }
    }

    pub(crate) fn describe(&self) -> String {
        format!(
            "{} (sm_{}{}, {:.1} GiB)",
            self.name,
            self.capability.0,
            self.capability.1,
            self.total_memory as f64 / (1u64 << 30) as f64
        )
    }

    pub(crate) fn total_memory(&self) -> usize {
        self.total_memory
    }

    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: the context was retained in `open` and is never released.
        unsafe { result::ctx::set_current(self.context) }.map_err(driver_error)
    }

    pub(crate) fn alloc_zeroed(&self, bytes: usize) -> Result<u64, DeviceError> {
        self.current()?;
        // SAFETY: a fresh allocation, zeroed before use.
        unsafe {
            let ptr = result::malloc_sync(bytes.max(1)).map_err(driver_error)?;
            result::memset_d8_async(ptr, 0, bytes.max(1), std::ptr::null_mut()).map_err(driver_error)?;
            Ok(ptr)
        }
    }

    /// Zeros over `bytes` at `addr`, ordered with the launches (the null stream).
    pub(crate) fn zero(&self, addr: u64, bytes: usize) -> Result<(), DeviceError> {
        if bytes == 0 {
            return Ok(());
        }
        self.current()?;
        // SAFETY: the caller's buffer holds `bytes`.
        unsafe { result::memset_d8_async(addr, 0, bytes, std::ptr::null_mut()) }.map_err(driver_error)
    }

    pub(crate) fn free(&self, addr: u64) {
        if self.current().is_ok() {
            // SAFETY: `addr` came from `alloc_zeroed` and is freed once (on drop).
            let _ = unsafe { result::free_sync(addr) };
        }
    }

    pub(crate) fn copy_to_device<T>(&self, dst: u64, values: &[T]) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: the caller checked the destination range.
        unsafe { result::memcpy_htod_sync(dst, values) }.map_err(driver_error)
    }

    pub(crate) fn copy_to_host<T>(&self, out: &mut [T], src: u64) -> Result<(), DeviceError> {
        self.current()?;
        self.synchronize()?;
        // SAFETY: the caller checked the source range.
        unsafe { result::memcpy_dtoh_sync(out, src) }.map_err(driver_error)
    }

    pub(crate) fn copy_on_device(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: the caller checked both ranges. Ordered with the launches
        // on the null stream, like them without waiting.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, std::ptr::null_mut()) }.map_err(driver_error)
    }

    pub(crate) fn synchronize(&self) -> Result<(), DeviceError> {
        self.current()?;
        result::ctx::synchronize().map_err(driver_error)
    }

    /// Compile and load every kernel file now, so that a GPU that cannot run
    /// them fails when it is opened, not at a request's first step.
    pub(crate) fn load_all(&self) -> Result<(), DeviceError> {
        self.current()?;
        for info in crate::table::KERNELS {
            self.function(info)?;
        }
        Ok(())
    }

    fn function(&self, info: &'static KernelInfo) -> Result<sys::CUfunction, DeviceError> {
        if let Some(f) = self.functions.lock().expect("kernel table").get(info.name) {
            return Ok(*f);
        }
        let module = {
            let mut modules = self.modules.lock().expect("module table");
            match modules.get(info.file) {
                Some(m) => *m,
                None => {
                    let arch = format!("sm_{}{}{}", self.capability.0, self.capability.1, arch_suffix(self.capability));
                    let image = nvrtc::compile(info.file, Target::Cubin(&arch)).or_else(|_| {
                        let virtual_arch = format!("compute_{}{}", self.capability.0, self.capability.1);
                        nvrtc::compile(info.file, Target::Ptx(&virtual_arch))
                    })?;
                    // SAFETY: a cubin or NUL-terminated PTX from NVRTC.
                    let m =
                        unsafe { result::module::load_data(image.image.as_ptr() as *const _) }.map_err(driver_error)?;
                    modules.insert(info.file, m);
                    m
                }
            }
        };
        let name = CString::new(info.name).expect("kernel names have no NUL");
        // SAFETY: a loaded module.
        let f = unsafe { result::module::get_function(module, name) }.map_err(driver_error)?;
        self.functions.lock().expect("kernel table").insert(info.name, f);
        Ok(f)
    }

    pub(crate) fn launch(
        &self,
        info: &'static KernelInfo,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        params: &mut [*mut core::ffi::c_void],
    ) -> Result<(), DeviceError> {
        self.current()?;
        let f = self.function(info)?;
        // Above 48 KiB of shared memory in all (static and dynamic) a kernel
        // must opt in to the dynamic part it asks for.
        let static_shared = if shared > 0 {
            // SAFETY: a function handle of this context.
            unsafe {
                result::function::get_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                )
            }
            .map_err(driver_error)?
            .max(0) as u32
        } else {
            0
        };
        if shared > 0 && shared + static_shared > 48 * 1024 {
            // SAFETY: a function handle of this context.
            unsafe {
                result::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
            }
            .map_err(driver_error)?;
        }
        // SAFETY: the arguments were checked against the kernel's parameters.
        unsafe { result::launch_kernel(f, grid, block, shared, std::ptr::null_mut(), params) }.map_err(driver_error)
    }
}

/// Hopper and Blackwell kernels may use the architecture-specific features
/// (`sm_90a`, `sm_100a`).
fn arch_suffix(capability: (i32, i32)) -> &'static str {
    match capability {
        (9, 0) | (10, 0) | (10, 3) => "a",
        _ => "",
    }
}
