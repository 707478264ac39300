// The emulated device's scheduler: blocks one after another, a block's
// threads as fibers switched at barriers (see cuda_emu.h).
#include "cuda_emu.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace di_emu {

thread_local dim3 block_idx;
thread_local dim3 block_dim;
thread_local dim3 grid_dim;
thread_local dim3 thread_idx;

namespace {

// Bytes of stack per emulated thread: kernels keep their arrays in registers
// or shared memory, so a CUDA thread's frame is small.
constexpr size_t kStackBytes = 64 * 1024;
// The most threads a block may have (CUDA's limit).
constexpr unsigned kMaxThreads = 1024;
// The most dynamic shared memory a launch may ask for (Hopper's opt-in limit).
constexpr unsigned kMaxDynamicShared = 227 * 1024;

#if defined(__x86_64__)
// Saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save and continues on `next`.
extern "C" void di_emu_switch(void** save, void* next);
asm(R"(
    .text
    .globl di_emu_switch
    .type di_emu_switch,@function
di_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size di_emu_switch, .-di_emu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
struct Context {
    void* sp = nullptr;
};
#else
struct Context {
    ucontext_t uc;
};
#endif

struct Fiber {
    Context ctx;
    dim3 tid;
    unsigned linear = 0;
    bool done = false;
    char* stack = nullptr;
};

struct Barrier {
    unsigned arrived = 0;
    unsigned generation = 0;
};

struct Block {
    std::vector<Fiber> fibers;
    Context scheduler;
    unsigned current = 0;
    unsigned live = 0;
    unsigned threads = 0;
    Barrier block_barrier;
    std::vector<Barrier> warp_barriers;
    std::vector<unsigned long long> exchange;
    void (*body)(void*) = nullptr;
    void* env = nullptr;
};

thread_local Block* current_block = nullptr;
// 1: the scheduler resumes a block's threads last to first. A kernel whose
// threads read what others write without a barrier between gives other
// results in the two orders (the fibers otherwise hide such races).
thread_local int reverse_schedule = 0;
// Arrivals at barriers and finished threads: a round of the scheduler that
// moves none of them has every live thread parked for good.
thread_local unsigned long long progress = 0;

thread_local std::vector<char*>* stacks = nullptr;
thread_local std::vector<unsigned char>* shared_memory = nullptr;

char* stack_for(unsigned i) {
    if (!stacks) stacks = new std::vector<char*>();
    while (stacks->size() <= i) {
        char* s = static_cast<char*>(std::aligned_alloc(64, kStackBytes));
        if (!s) trap("out of memory for an emulated thread's stack");
        stacks->push_back(s);
    }
    return (*stacks)[i];
}

void switch_to(Context& save, Context& next) {
#if defined(__x86_64__)
    di_emu_switch(&save.sp, next.sp);
#else
    swapcontext(&save.uc, &next.uc);
#endif
}

void fiber_main() {
    Block* b = current_block;
    Fiber& f = b->fibers[b->current];
    b->body(b->env);
    f.done = true;
    b->live -= 1;
    progress += 1;
    switch_to(f.ctx, b->scheduler);
    trap("a finished emulated thread was resumed");
}

#if defined(__x86_64__)
extern "C" void di_emu_fiber_entry() { fiber_main(); }

void prepare(Fiber& f) {
    // The initial frame di_emu_switch pops: MXCSR and control word, six
    // registers, then the entry point as the return address; above it a zero
    // return address so that the entry runs with a call's stack alignment.
    auto top = reinterpret_cast<uintptr_t>(f.stack + kStackBytes) & ~uintptr_t(15);
    auto* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = 0;
    *--sp = reinterpret_cast<uint64_t>(&di_emu_fiber_entry);
    for (int i = 0; i < 6; ++i) *--sp = 0;
    *--sp = 0;
    uint32_t mxcsr = 0x1F80;
    uint16_t fpu_cw = 0x037F;
    std::memcpy(sp, &mxcsr, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpu_cw, 2);
    f.ctx.sp = sp;
}
#else
void prepare(Fiber& f) {
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = f.stack;
    f.ctx.uc.uc_stack.ss_size = kStackBytes;
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, &fiber_main, 0);
}
#endif

void yield_to_scheduler() {
    Block* b = current_block;
    switch_to(b->fibers[b->current].ctx, b->scheduler);
    thread_idx = b->fibers[b->current].tid;
}

void wait(Barrier& barrier, unsigned expected) {
    progress += 1;
    unsigned generation = barrier.generation;
    if (++barrier.arrived == expected) {
        barrier.arrived = 0;
        barrier.generation += 1;
        return;
    }
    while (barrier.generation == generation) yield_to_scheduler();
}

Block& block() {
    if (!current_block) trap("a barrier outside a kernel");
    return *current_block;
}

unsigned linear_tid() { return block().fibers[block().current].linear; }

}  // namespace

void trap(const char* what) {
    std::fprintf(stderr, "emulated device: %s\n", what);
    std::fflush(stderr);
    std::abort();
}

void sync_block() {
    Block& b = block();
    if (b.live != b.threads) trap("__syncthreads after some threads of the block returned");
    wait(b.block_barrier, b.threads);
}

void sync_warp() {
    Block& b = block();
    unsigned warp = linear_tid() / 32;
    unsigned members = std::min(32u, b.threads - warp * 32);
    wait(b.warp_barriers[warp], members);
}

unsigned long long exchange(unsigned long long value, int mode, int operand, int width) {
    Block& b = block();
    unsigned t = linear_tid();
    unsigned lane = t % 32;
    unsigned segment = lane / width * width;
    unsigned in_segment = lane - segment;
    int source = static_cast<int>(in_segment);
    switch (mode) {
        case 0: source = static_cast<int>(in_segment ^ static_cast<unsigned>(operand)); break;
        case 1: source = static_cast<int>(in_segment) + operand; break;
        case 2: source = static_cast<int>(in_segment) - operand; break;
        default: source = operand % width; break;
    }
    if (source < 0 || source >= width) source = static_cast<int>(in_segment);
    b.exchange[t] = value;
    sync_warp();
    unsigned from = t - lane + segment + static_cast<unsigned>(source);
    if (from >= b.threads) trap("a shuffle read a lane past the block's last thread");
    unsigned long long out = b.exchange[from];
    sync_warp();
    return out;
}

extern "C" void di_emu_set_reverse_schedule(int reverse) { reverse_schedule = reverse; }

void* dynamic_shared() {
    if (!shared_memory) trap("dynamic shared memory outside a kernel");
    return shared_memory->data();
}

void launch(dim3 grid, dim3 block_shape, unsigned int shared_bytes, void (*body)(void*), void* env) {
    unsigned threads = block_shape.x * block_shape.y * block_shape.z;
    if (threads == 0 || threads > kMaxThreads) trap("a block of 0 or more than 1024 threads");
    if (shared_bytes > kMaxDynamicShared) trap("dynamic shared memory above 227 KiB");
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) trap("an empty grid");
    if (current_block) trap("a launch from inside a kernel");
    if (!shared_memory) shared_memory = new std::vector<unsigned char>();

    Block b;
    b.threads = threads;
    b.fibers.resize(threads);
    b.warp_barriers.resize((threads + 31) / 32);
    b.exchange.resize(threads);
    b.body = body;
    b.env = env;
    for (unsigned i = 0; i < threads; ++i) {
        b.fibers[i].linear = i;
        b.fibers[i].tid = dim3(i % block_shape.x, i / block_shape.x % block_shape.y, i / (block_shape.x * block_shape.y));
        b.fibers[i].stack = stack_for(i);
    }
    grid_dim = grid;
    block_dim = block_shape;
    current_block = &b;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                block_idx = dim3(x, y, z);
                // Fresh shared memory holds garbage on a GPU; a fixed pattern in
                // every block makes a kernel that reads its dynamic shared
                // memory before writing it fail the same way every run.
                shared_memory->assign(shared_bytes + 16, 0xA5);
                b.live = threads;
                b.block_barrier = Barrier();
                for (auto& w : b.warp_barriers) w = Barrier();
                for (auto& f : b.fibers) {
                    f.done = false;
                    prepare(f);
                }
                while (b.live > 0) {
                    unsigned long long before = progress;
                    for (unsigned k = 0; k < threads; ++k) {
                        unsigned i = reverse_schedule ? threads - 1 - k : k;
                        if (b.fibers[i].done) continue;
                        b.current = i;
                        thread_idx = b.fibers[i].tid;
                        switch_to(b.scheduler, b.fibers[i].ctx);
                    }
                    if (progress == before && b.live > 0) {
                        current_block = nullptr;
                        trap("every live thread waits at a barrier that cannot fill (a barrier some threads skip)");
                    }
                }
            }
    current_block = nullptr;
}

}  // namespace di_emu
