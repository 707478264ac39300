//! The distributed runtime of deepinfer.
