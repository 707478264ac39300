//! Untrusted bytes as a peer would send them: every decoder of the wire
//! format must return a value or a typed error, never panic, and whatever it
//! accepts must encode back to a frame that decodes to the same message.

#![no_main]

use deepinfer_actors::wire::{decode, decode_with_limit, encode, peek_kind, read_frame, MAX_FRAME_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = peek_kind(data);
    let _ = decode_with_limit(data, 4096);
    let streamed = read_frame(&mut &data[..], MAX_FRAME_BYTES);
    if let Ok(frame) = decode(data) {
        // Compared as bytes: floats in a frame may be NaN.
        let again = encode(&frame.envelope, &frame.body).expect("a decoded frame encodes");
        let streamed = streamed.expect("the stream decoder accepts what the slice decoder does");
        assert_eq!(encode(&streamed.envelope, &streamed.body).ok(), Some(again.clone()), "decoders agree");
        let round = decode(&again).expect("an encoded frame decodes");
        assert_eq!(encode(&round.envelope, &round.body).ok(), Some(again), "encoding is stable");
    }
});
