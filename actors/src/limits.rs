//! Every limit of the runtime in one place, with the relationships between
//! them checked when the crate compiles. A limit is what keeps a bad peer,
//! a slow actor or a burst from growing memory without end: each queue, frame
//! and table below has one, and code elsewhere refers to these names.

use std::time::Duration;

/// Largest payload a frame may declare (after the length prefix).
pub const MAX_FRAME_BYTES: u32 = 64 << 20;
/// What a frame's header (envelope, preamble, padding) may take beside its
/// body: a body of up to `MAX_FRAME_BYTES - FRAME_HEADER_BYTES_MAX` always fits.
pub const FRAME_HEADER_BYTES_MAX: u32 = 8 << 20;

/// Frames queued per actor address, on every transport.
pub const DEFAULT_QUEUE: usize = 4096;
/// Frames from the network an actor may hold in its (unbounded) ractor
/// mailbox or be handling at once; past it its inbox fills and the
/// transport refuses and counts, so at most `DEFAULT_QUEUE + MAILBOX_FRAMES`
/// frames wait for any actor.
pub const MAILBOX_FRAMES: usize = 256;

/// QUIC: frames queued per peer on the control lane.
pub const CONTROL_QUEUE: usize = 1024;
/// QUIC: frames queued per peer on the data lane (each up to the frame limit).
pub const DATA_QUEUE: usize = 64;
/// QUIC: a failed lane dials again after this long, doubling up to the most.
pub const BACKOFF_MIN: Duration = Duration::from_millis(50);
pub const BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Largest body of exported states one step answer carries; past it the
/// exports are left out and the scheduler falls back to recomputing.
pub const MAX_EXPORT_BYTES: usize = 48 << 20;
/// Tries of one state transfer before the request is placed elsewhere and recomputed.
pub const TRANSFER_ATTEMPTS: u32 = 3;
/// Prefilled requests one prefill scheduler holds for adoption (sent or
/// waiting for a transfer slot) before it pauses: at this backlog it starts
/// no step until adoptions bring it below (backpressure on prefill).
pub const MAX_PENDING_TRANSFERS: usize = 1024;
/// Most handoffs one prefill scheduler holds at all: the backlog at which it
/// paused plus what its last step finished. Past it a new handoff is
/// rerouted (recomputed on a decode instance) instead of held.
pub const MAX_HANDOFF_BACKLOG: usize = 16 * MAX_PENDING_TRANSFERS;
/// State transfers one prefill scheduler has unacknowledged towards one
/// decode instance; the others wait their turn at the prefill instance,
/// their acknowledgement deadline not yet running.
pub const TRANSFER_WINDOW: usize = 32;
/// The slowest rate a transfer's bytes are assumed to move at: a sent
/// transfer's acknowledgement deadline is the control timeout plus the time
/// the bytes in flight ahead of it and its own take at this rate.
pub const TRANSFER_RATE_FLOOR_BYTES_PER_S: u64 = 1 << 30;

/// Waiting requests the scheduler looks up again in the lower cache tiers
/// each plan (the head of the queue); every other waiting request is looked
/// up once, as admission may reach past held ones.
pub const LOOKUP_SCAN: usize = 64;

/// Blocks a cache manager remembers being on its disk tier (for routing); past it the oldest keys are forgotten.
pub const MAX_DISK_KEYS: usize = 1 << 20;
/// Values one answer to a promotion carries; blocks past it stay below and are computed.
pub const MAX_PROMOTE_BYTES: usize = 32 << 20;
/// Promotions a cache manager has waiting on its disk at once; past it a promotion is answered from memory only.
pub const MAX_PENDING_PROMOTES: usize = 1024;
/// Images one encoder instance holds waiting for its tower; past it a new
/// image is refused (its scheduler encodes it on its own workers).
pub const MAX_ENCODER_QUEUE: usize = 256;
/// Images one encode request may carry (a request's images).
pub const MAX_ENCODE_IMAGES: usize = 64;
/// Bytes of encoded rows an encoder instance keeps for repeated images.
pub const ENCODER_CACHE_BYTES: u64 = 1 << 30;
/// Bytes of span rows a prefill worker keeps of the images it encoded
/// itself (a span chunked over steps is encoded once).
pub const WORKER_IMAGE_CACHE_BYTES: u64 = 256 << 20;
/// Images a scheduler has out at encoders at once; past it a request's
/// images are encoded on its own workers.
pub const MAX_PENDING_ENCODES: usize = 1024;
/// Image hashes a router remembers the encoder of (cache affinity).
pub const MAX_ENCODER_AFFINITY: usize = 1 << 16;

// A promotion's answer fits one frame.
const _: () = assert!(MAX_PROMOTE_BYTES + FRAME_HEADER_BYTES_MAX as usize <= MAX_FRAME_BYTES as usize);
// An exported state travels in one frame (worker → scheduler → scheduler):
// the largest export, with its header, fits the frame limit.
const _: () = assert!(MAX_EXPORT_BYTES + FRAME_HEADER_BYTES_MAX as usize <= MAX_FRAME_BYTES as usize);
// An actor's mailbox never holds more than its inbox could.
const _: () = assert!(MAILBOX_FRAMES > 0 && MAILBOX_FRAMES <= DEFAULT_QUEUE);
// Control frames (heartbeats, acknowledgements) never wait behind data.
const _: () = assert!(CONTROL_QUEUE > DATA_QUEUE && DATA_QUEUE > 0);
const _: () = assert!(BACKOFF_MIN.as_nanos() > 0 && BACKOFF_MIN.as_nanos() < BACKOFF_MAX.as_nanos());
// A transfer is retried at least once; the handoff table is bounded.
const _: () = assert!(TRANSFER_ATTEMPTS >= 2 && MAX_PENDING_TRANSFERS > 0);
const _: () = assert!(MAX_HANDOFF_BACKLOG > MAX_PENDING_TRANSFERS);
// A window of transfers fits the receiver's mailbox and a QUIC data lane, so
// a burst of finished prefills is never refused by the transport.
const _: () = assert!(TRANSFER_WINDOW > 0 && TRANSFER_WINDOW <= MAILBOX_FRAMES && TRANSFER_WINDOW <= DATA_QUEUE);
// A window of the largest states still drains within a few seconds past the control timeout.
const _: () = assert!(
    TRANSFER_RATE_FLOOR_BYTES_PER_S > 0
        && (TRANSFER_WINDOW as u64 * MAX_FRAME_BYTES as u64) / TRANSFER_RATE_FLOOR_BYTES_PER_S <= 4
);
// The worst case a peer's data lane holds stays within a few GiB.
const _: () = assert!(DATA_QUEUE as u64 * MAX_FRAME_BYTES as u64 <= 4 << 30);
// A queue of encodes is bounded by the encoder's mailbox and its own queue.
const _: () = assert!(MAX_ENCODE_IMAGES > 0 && MAX_ENCODE_IMAGES <= MAX_ENCODER_QUEUE);
