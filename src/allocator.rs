//! The allocator of every deepinfer process: mimalloc, keeping freed pages.
//!
//! Serving, simulations and the forward pass allocate and free the same
//! megabytes over and over (frames, token lists, a layer's activations).
//! glibc's allocator hands large blocks back to the kernel and faults them in
//! again, zeroed, on the next allocation: in a prefill that was 4% of the
//! time in page faults and 3% zeroing. mimalloc keeps them per thread, and
//! its large blocks start on a cache line, so the linear kernels read
//! activations in place instead of copying them to an aligned buffer first.
//!
//! Linking this crate installs it; binaries call [`keep_freed_pages`] first.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (not exported by the bindings).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keep freed pages for reuse instead of returning them to the kernel 10 ms
/// later: each return costs a fault and a zeroing of every page when the
/// memory is taken again.
pub fn keep_freed_pages() {
    // SAFETY: sets a process-wide allocator option; no pointers are involved.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}
