//! Images on the wire: what a request carries for each image (its span, its
//! resize plan, its content hash, and its patches or its encoded rows), what
//! a step item carries for the images its positions reach, and the image
//! encoder's protocol. Mirrors of the engine's `RequestImage` and
//! `ImagePlan`, which do not derive rkyv; the conversions and every check
//! against the model live in `proto::images`.

use rkyv::{Archive, Deserialize, Serialize};

/// An image's resize plan (the engine's `ImagePlan`, sizes as u32).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PlanWire {
    pub width: u32,
    pub height: u32,
    pub best_width: u32,
    pub best_height: u32,
    pub n_vit_h: u32,
    pub n_vit_w: u32,
    pub n_llm_h: u32,
    pub n_llm_w: u32,
}

/// What fills an image's span.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum ImageData {
    /// The resized, normalised patches (the tower runs where the span is needed).
    Patches(Vec<f32>),
    /// The span's embedding rows `[plan tokens, dim]`, encoded already.
    Rows(Vec<f32>),
}

/// One image of a request as it travels client → router → scheduler (and
/// with a handoff to the decode instance, which may have to recompute).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct ImageWire {
    /// Prompt position of the span's first token.
    pub start: u32,
    pub plan: PlanWire,
    /// The engine's `image_hash` of the prepared pixels and plan: the
    /// prefix-cache keys and the encoder cache go by it.
    pub hash: u64,
    pub content: ImageData,
}

/// An image whose span a step item's positions reach; its values (patches
/// or rows) follow the item's restored blocks and imported state in the
/// step request's body.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct StepImage {
    pub start: u32,
    pub plan: PlanWire,
    pub hash: u64,
    /// The values are the span's rows (else the patches).
    pub rows: bool,
    /// How many values follow in the body.
    pub values: u32,
}

/// One image to encode: its hash and plan; its patches in the body.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct EncodeImage {
    pub hash: u64,
    pub plan: PlanWire,
    /// Patch values that follow in the body.
    pub values: u32,
}

/// The image encoder's protocol (prefill scheduler ↔ encoder instance).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum EncoderMsg {
    /// Scheduler → encoder: encode these images of request `id`. Body: the
    /// patches of each image, in order (an image whose rows the encoder's
    /// cache holds costs no tower run).
    Encode { id: u64, attempt: u32, images: Vec<EncodeImage> },
    /// Encoder → scheduler: the rows of one image, `[tokens, dim]` in the body.
    Encoded { id: u64, attempt: u32, hash: u64, tokens: u32, dim: u32, cached: bool },
    /// Encoder → scheduler: the image cannot be encoded here (why); the
    /// scheduler encodes it colocated.
    Refused { id: u64, attempt: u32, hash: u64, why: String },
}
