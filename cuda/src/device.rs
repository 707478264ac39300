//! The launch interface: device memory and kernel launches, on a GPU through
//! cudarc or on the emulated device, with the same calls and the same checks.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::driver::Driver;
use crate::pool::{size_class, FreeLists};
use crate::table::{kernel, ParamKind};

/// Largest single device allocation this process makes (a limit, not the
/// device's size): a request for more is an error, not an attempt.
pub const MAX_ALLOCATION_BYTES: usize = 1 << 40;

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("no CUDA driver on this machine ({0}); the emulated device needs none")]
    NoDriver(String),
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("kernel {0} is not one of cuda/kernels/*.cu")]
    UnknownKernel(String),
    #[error("kernel {kernel}: {detail}")]
    BadLaunch { kernel: String, detail: String },
    #[error("device allocation of {0} bytes is above the limit of {MAX_ALLOCATION_BYTES}")]
    TooLarge(usize),
    #[error("NVRTC: {0}")]
    Compile(String),
}

/// A value a device buffer may hold: plain bits, any pattern valid.
///
/// # Safety
/// Implementors have no padding and every bit pattern is a valid value.
pub unsafe trait DeviceValue: Copy + Default + Send + Sync + 'static {}
unsafe impl DeviceValue for f32 {}
unsafe impl DeviceValue for f64 {}
unsafe impl DeviceValue for u8 {}
unsafe impl DeviceValue for u16 {}
unsafe impl DeviceValue for u32 {}
unsafe impl DeviceValue for i32 {}
unsafe impl DeviceValue for u64 {}
unsafe impl DeviceValue for i64 {}

/// Which device a [`Gpu`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuKind {
    /// The kernels compiled for the host; device memory is host memory.
    Emulated,
    /// A real GPU through the CUDA driver.
    Cuda,
}

/// One kernel argument, passed by value the way `cuLaunchKernel` takes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A device address (a buffer's start, or an element of it).
    Ptr(u64),
    I32(i32),
    U32(u32),
    F32(f32),
    F64(f64),
    I64(i64),
    U64(u64),
}

impl Arg {
    fn kind(&self) -> ParamKind {
        match self {
            Arg::Ptr(_) => ParamKind::Ptr,
            Arg::I32(_) => ParamKind::I32,
            Arg::U32(_) => ParamKind::U32,
            Arg::F32(_) => ParamKind::F32,
            Arg::F64(_) => ParamKind::F64,
            Arg::I64(_) => ParamKind::I64,
            Arg::U64(_) => ParamKind::U64,
        }
    }

    fn value_ptr(&mut self) -> *mut core::ffi::c_void {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => v as *mut u64 as *mut _,
            Arg::I32(v) => v as *mut i32 as *mut _,
            Arg::U32(v) => v as *mut u32 as *mut _,
            Arg::F32(v) => v as *mut f32 as *mut _,
            Arg::F64(v) => v as *mut f64 as *mut _,
            Arg::I64(v) => v as *mut i64 as *mut _,
        }
    }
}

impl From<u32> for Arg {
    fn from(v: u32) -> Self {
        Arg::U32(v)
    }
}
impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}
impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}
impl From<f64> for Arg {
    fn from(v: f64) -> Self {
        Arg::F64(v)
    }
}
impl<T: DeviceValue> From<&DeviceBuffer<T>> for Arg {
    fn from(b: &DeviceBuffer<T>) -> Self {
        Arg::Ptr(b.addr)
    }
}

enum Backend {
    /// `reverse`: each block's threads run last to first between barriers.
    Emulated {
        reverse: bool,
    },
    Cuda(Driver),
}

unsafe extern "C" {
    fn di_emu_set_reverse_schedule(reverse: i32);
}

struct Inner {
    backend: Backend,
    /// Bytes of live buffers.
    in_use: AtomicUsize,
    /// Freed buffers kept for reuse.
    pool: std::sync::Mutex<FreeLists>,
}

/// A device: the emulated one or a GPU. Clones share it.
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({})", self.name())
    }
}

/// `len` values of `T` in a device's memory, freed on drop.
pub struct DeviceBuffer<T: DeviceValue> {
    addr: u64,
    len: usize,
    gpu: Gpu,
    _values: PhantomData<T>,
}

impl<T: DeviceValue> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

impl<T: DeviceValue> DeviceBuffer<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of element `index` as a kernel argument.
    pub fn at(&self, index: usize) -> Arg {
        assert!(index <= self.len, "element {index} of a buffer of {}", self.len);
        Arg::Ptr(self.addr + (index * std::mem::size_of::<T>()) as u64)
    }

    /// The buffer's start as a kernel argument.
    pub fn arg(&self) -> Arg {
        Arg::Ptr(self.addr)
    }

    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T: DeviceValue> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        self.gpu.free(self.addr, self.bytes());
    }
}

/// Emulated device memory: 64-byte aligned host allocations (a GPU's are
/// at least 256-byte aligned; kernels may rely on 16).
const EMULATED_ALIGN: usize = 64;

impl Gpu {
    /// The emulated device.
    pub fn emulated() -> Gpu {
        Gpu { inner: Arc::new(Inner::new(Backend::Emulated { reverse: false })) }
    }

    /// The emulated device running each block's threads in the opposite
    /// order between barriers: a kernel that reads another thread's write
    /// without a barrier (a race a GPU would show) gives other results here.
    pub fn emulated_reversed() -> Gpu {
        Gpu { inner: Arc::new(Inner::new(Backend::Emulated { reverse: true })) }
    }

    /// GPU `ordinal` through the CUDA driver, with every kernel file compiled
    /// (NVRTC) and loaded; an error (never a panic) when this machine has no
    /// driver, no NVRTC or no such GPU, or a kernel does not load.
    pub fn cuda(ordinal: usize) -> Result<Gpu, DeviceError> {
        let driver = Driver::open(ordinal)?;
        driver.load_all()?;
        Ok(Gpu { inner: Arc::new(Inner::new(Backend::Cuda(driver))) })
    }

    pub fn kind(&self) -> GpuKind {
        match self.inner.backend {
            Backend::Emulated { .. } => GpuKind::Emulated,
            Backend::Cuda(_) => GpuKind::Cuda,
        }
    }

    /// A line naming the device (`emulated` or the GPU's name and compute capability).
    pub fn name(&self) -> String {
        match &self.inner.backend {
            Backend::Emulated { reverse: false } => "emulated device (kernels compiled for the host)".to_string(),
            Backend::Emulated { reverse: true } => {
                "emulated device (kernels compiled for the host, threads reversed)".to_string()
            }
            Backend::Cuda(d) => d.describe(),
        }
    }

    /// Bytes of device memory this process's buffers hold now.
    pub fn memory_in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Relaxed)
    }

    /// The device's total memory, where it has a size of its own.
    pub fn total_memory(&self) -> Option<usize> {
        match &self.inner.backend {
            Backend::Emulated { .. } => None,
            Backend::Cuda(d) => Some(d.total_memory()),
        }
    }

    /// A buffer of `len` zeros.
    pub fn zeros<T: DeviceValue>(&self, len: usize) -> Result<DeviceBuffer<T>, DeviceError> {
        let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or(DeviceError::TooLarge(usize::MAX))?;
        if bytes > MAX_ALLOCATION_BYTES {
            return Err(DeviceError::TooLarge(bytes));
        }
        let class = size_class(bytes);
        let reused = self.inner.pool.lock().unwrap_or_else(|p| p.into_inner()).take(class);
        let addr = match reused {
            Some(addr) => {
                self.inner.zero(addr, bytes)?;
                addr
            }
            None => match self.inner.allocate(class) {
                Ok(addr) => addr,
                Err(_) => {
                    // Out of memory: give the pool's buffers back and try once more.
                    let held = self.inner.pool.lock().unwrap_or_else(|p| p.into_inner()).drain();
                    for (addr, class) in held {
                        self.inner.release(addr, class);
                    }
                    self.inner.allocate(class)?
                }
            },
        };
        self.inner.in_use.fetch_add(bytes, Ordering::Relaxed);
        Ok(DeviceBuffer { addr, len, gpu: self.clone(), _values: PhantomData })
    }

    /// A buffer holding `values`.
    pub fn upload<T: DeviceValue>(&self, values: &[T]) -> Result<DeviceBuffer<T>, DeviceError> {
        let buf = self.zeros::<T>(values.len())?;
        self.write(&buf, 0, values)?;
        Ok(buf)
    }

    /// Copy `values` into `buf` from element `offset` on.
    pub fn write<T: DeviceValue>(&self, buf: &DeviceBuffer<T>, offset: usize, values: &[T]) -> Result<(), DeviceError> {
        assert!(offset + values.len() <= buf.len, "write of {} at {offset} into {}", values.len(), buf.len);
        if values.is_empty() {
            return Ok(());
        }
        let dst = buf.addr + (offset * std::mem::size_of::<T>()) as u64;
        let bytes = std::mem::size_of_val(values);
        match &self.inner.backend {
            // SAFETY: dst..dst+bytes lies inside the buffer (asserted above).
            Backend::Emulated { .. } => unsafe {
                std::ptr::copy_nonoverlapping(values.as_ptr() as *const u8, dst as *mut u8, bytes)
            },
            Backend::Cuda(d) => d.copy_to_device(dst, values)?,
        }
        Ok(())
    }

    /// The whole buffer back on the host.
    pub fn download<T: DeviceValue>(&self, buf: &DeviceBuffer<T>) -> Result<Vec<T>, DeviceError> {
        self.download_range(buf, 0, buf.len)
    }

    /// Elements `offset..offset + len` back on the host.
    pub fn download_range<T: DeviceValue>(
        &self,
        buf: &DeviceBuffer<T>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<T>, DeviceError> {
        assert!(offset + len <= buf.len, "read of {len} at {offset} from {}", buf.len);
        let mut out = vec![T::default(); len];
        if len == 0 {
            return Ok(out);
        }
        let src = buf.addr + (offset * std::mem::size_of::<T>()) as u64;
        match &self.inner.backend {
            // SAFETY: src..src+len lies inside the buffer (asserted above).
            Backend::Emulated { .. } => unsafe {
                std::ptr::copy_nonoverlapping(src as *const T, out.as_mut_ptr(), len);
            },
            Backend::Cuda(d) => d.copy_to_host(&mut out, src)?,
        }
        Ok(out)
    }

    /// Copy `len` elements from `src[src_offset..]` to `dst[dst_offset..]` on the device.
    pub fn copy<T: DeviceValue>(
        &self,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        dst: &DeviceBuffer<T>,
        dst_offset: usize,
        len: usize,
    ) -> Result<(), DeviceError> {
        assert!(src_offset + len <= src.len && dst_offset + len <= dst.len, "device copy out of bounds");
        // A GPU's device-to-device copy is undefined over overlapping ranges.
        assert!(
            src.addr != dst.addr || src_offset + len <= dst_offset || dst_offset + len <= src_offset,
            "a device copy within one buffer over overlapping ranges"
        );
        if len == 0 {
            return Ok(());
        }
        let size = std::mem::size_of::<T>();
        let (s, d) = (src.addr + (src_offset * size) as u64, dst.addr + (dst_offset * size) as u64);
        match &self.inner.backend {
            // SAFETY: both ranges lie inside their buffers and do not overlap.
            Backend::Emulated { .. } => unsafe { std::ptr::copy(s as *const u8, d as *mut u8, len * size) },
            Backend::Cuda(drv) => drv.copy_on_device(d, s, len * size)?,
        }
        Ok(())
    }

    /// Launch kernel `name` over `grid` blocks of `block` threads with
    /// `shared` bytes of dynamic shared memory. The arguments are checked
    /// against the kernel's parameters (count and kind) before anything runs.
    pub fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared: u32,
        args: &[Arg],
    ) -> Result<(), DeviceError> {
        let info = kernel(name).ok_or_else(|| DeviceError::UnknownKernel(name.to_string()))?;
        let bad = |detail: String| DeviceError::BadLaunch { kernel: name.to_string(), detail };
        if args.len() != info.params.len() {
            return Err(bad(format!("{} arguments for {} parameters", args.len(), info.params.len())));
        }
        for (i, (a, p)) in args.iter().zip(info.params).enumerate() {
            if a.kind() != *p {
                return Err(bad(format!("argument {i} is {:?}, the parameter {:?}", a.kind(), p)));
            }
        }
        let threads = block.0 as u64 * block.1 as u64 * block.2 as u64;
        if threads == 0 || threads > 1024 {
            return Err(bad(format!("a block of {threads} threads")));
        }
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 || grid.1 > 65535 || grid.2 > 65535 {
            return Err(bad(format!("a grid of {grid:?}")));
        }
        let mut values: Vec<Arg> = args.to_vec();
        let mut pointers: Vec<*mut core::ffi::c_void> = values.iter_mut().map(Arg::value_ptr).collect();
        match &self.inner.backend {
            Backend::Emulated { reverse } => {
                // SAFETY: sets a thread-local flag of the emulator.
                unsafe { di_emu_set_reverse_schedule(i32::from(*reverse)) };
                let g = [grid.0, grid.1, grid.2];
                let b = [block.0, block.1, block.2];
                // SAFETY: the argument kinds match the kernel's parameters;
                // pointers are addresses of live emulated buffers.
                unsafe { (info.emulated)(g.as_ptr(), b.as_ptr(), shared, pointers.as_mut_ptr()) };
                Ok(())
            }
            Backend::Cuda(d) => d.launch(info, grid, block, shared, &mut pointers),
        }
    }

    /// Wait for every launch so far (a no-op on the emulated device, which
    /// runs each launch before returning).
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        match &self.inner.backend {
            Backend::Emulated { .. } => Ok(()),
            Backend::Cuda(d) => d.synchronize(),
        }
    }

    fn free(&self, addr: u64, bytes: usize) {
        self.inner.in_use.fetch_sub(bytes, Ordering::Relaxed);
        let class = size_class(bytes);
        let kept = self.inner.pool.lock().unwrap_or_else(|p| p.into_inner()).give(class, addr);
        if !kept {
            self.inner.release(addr, class);
        }
    }

    /// Bytes of freed buffers held for reuse.
    pub fn memory_pooled(&self) -> usize {
        self.inner.pool.lock().unwrap_or_else(|p| p.into_inner()).held_bytes()
    }
}

impl Inner {
    fn new(backend: Backend) -> Self {
        Self { backend, in_use: AtomicUsize::new(0), pool: std::sync::Mutex::new(FreeLists::default()) }
    }

    /// `class` bytes of zeros, newly allocated.
    fn allocate(&self, class: usize) -> Result<u64, DeviceError> {
        match &self.backend {
            Backend::Emulated { .. } => {
                let layout = std::alloc::Layout::from_size_align(class, EMULATED_ALIGN).expect("layout");
                // SAFETY: a size class is never zero.
                let p = unsafe { std::alloc::alloc_zeroed(layout) };
                if p.is_null() {
                    return Err(DeviceError::TooLarge(class));
                }
                Ok(p as u64)
            }
            Backend::Cuda(d) => d.alloc_zeroed(class),
        }
    }

    /// Zeros over the first `bytes` of a reused buffer.
    fn zero(&self, addr: u64, bytes: usize) -> Result<(), DeviceError> {
        match &self.backend {
            // SAFETY: the buffer holds at least `bytes` (its class).
            Backend::Emulated { .. } => unsafe { std::ptr::write_bytes(addr as *mut u8, 0, bytes) },
            Backend::Cuda(d) => d.zero(addr, bytes)?,
        }
        Ok(())
    }

    /// Give a buffer of `class` bytes back to the allocator.
    fn release(&self, addr: u64, class: usize) {
        match &self.backend {
            Backend::Emulated { .. } => {
                let layout = std::alloc::Layout::from_size_align(class, EMULATED_ALIGN).expect("layout");
                // SAFETY: allocated in `allocate` with this layout.
                unsafe { std::alloc::dealloc(addr as *mut u8, layout) };
            }
            Backend::Cuda(d) => d.free(addr),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let held = self.pool.get_mut().unwrap_or_else(|p| p.into_inner()).drain();
        for (addr, class) in held {
            self.release(addr, class);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_freed_buffer_comes_back_zeroed_to_the_next_request_of_its_class() {
        let gpu = Gpu::emulated();
        let a = gpu.upload(&[1.0f32; 100]).unwrap();
        let addr = a.addr;
        drop(a);
        assert_eq!(gpu.memory_in_use(), 0);
        assert_eq!(gpu.memory_pooled(), 512, "400 bytes are held as a 512-byte class");
        let b = gpu.zeros::<f32>(90).unwrap();
        assert_eq!(b.addr, addr, "the same class reuses the freed buffer");
        assert_eq!(gpu.download(&b).unwrap(), vec![0.0f32; 90], "zeroed on reuse");
        assert_eq!(gpu.memory_pooled(), 0);
        let c = gpu.zeros::<f32>(1000).unwrap();
        assert_ne!(c.addr, addr, "another class takes another buffer");
    }
}
