//! The crate's errors: [`Error`] for a call given what it cannot use (nothing is read or
//! written then), and [`Refusal`], why a stored value is not served. A refused value is a miss
//! to the store that holds it, never an error of the call that read it.

use crate::format::{CHECKSUM_BYTES, FORMAT_VERSION, MAGIC};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A disk store's key that is not `kvtier:<namespace digest>:<name>`.
    #[error("invalid key: {key:?}; expected a store key, kvtier:<namespace digest>:<name>")]
    NotAStoreKey { key: String },
    /// A header text longer than its u16 length field can say.
    #[error("invalid {what}: {len} bytes, expected at most 65535")]
    TextTooLong { what: &'static str, len: usize },
    /// A header longer than its u16 length field can say.
    #[error("invalid header: {len} bytes, expected at most 65535")]
    HeaderTooLong { len: usize },
    /// A buffer to seal into that is shorter than the value.
    #[error("invalid buffer: {len} bytes, expected at least {need}")]
    ShortBuffer { len: usize, need: usize },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a stored value is refused: which of the checks of [`crate::format::check`] it failed.
/// The messages are what `kvtier.errors.PayloadError` says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{len} bytes: shorter than any header")]
    TooShort { len: usize },
    #[error(
        "magic {magic:?} is not {:?}: not a kvtier value",
        String::from_utf8_lossy(MAGIC)
    )]
    NotKvtier { magic: String },
    #[error("format version {version}, this kvtier reads {FORMAT_VERSION}")]
    Version { version: u16 },
    #[error(
        "{len} bytes, the header says {header} + {payload} + {CHECKSUM_BYTES}: truncated or padded"
    )]
    Length {
        len: usize,
        header: usize,
        payload: u64,
    },
    #[error("written under another namespace (model, tenant, codec or shape)")]
    Namespace,
    #[error("header length does not match its texts")]
    HeaderLength,
    #[error("header texts run past the header")]
    TextsOverrun,
    #[error("written as {name} {written:?}, read as {read:?}")]
    Text {
        name: &'static str,
        written: String,
        read: String,
    },
    #[error("header texts differ")]
    Texts,
    #[error("checksum mismatch: the value is corrupt")]
    Checksum,
}
