use clap::Parser;

// Simulations and serving allocate and free many short-lived buffers (frames,
// token lists) of up to megabytes; glibc's allocator hands the large ones back
// to the kernel and faults them in again, zeroed, on every event.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (not exported by the bindings).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() {
    // Keep freed pages for reuse instead of returning them to the kernel 10 ms
    // later: a simulation's event loop frees and allocates the same megabytes
    // every event, and each return costs a fault and a zeroing of every page.
    // SAFETY: sets a process-wide allocator option; no pointers are involved.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    let cli = deepinfer::cli::Cli::parse();
    if let Err(err) = deepinfer::cli::run(cli) {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
}
