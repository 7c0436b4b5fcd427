//! The crate's one error type. [`crate::attend`] checks its whole input (sizes, descriptors,
//! every block's pool and slot against the pool's bytes) before it reads a byte, so an `Err`
//! means nothing was written to `out` or `mass`.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A size, a table or a buffer that does not fit the problem.
    #[error("invalid {what}: {reason}")]
    InvalidArgument { what: &'static str, reason: String },
    /// A pool descriptor the kernel cannot read (or whose rows cannot hold what it says).
    #[error("pool {pool}: {reason}")]
    InvalidPool { pool: usize, reason: String },
    /// A block-table entry that names a pool the call was not given.
    #[error("sequence {seq}, block {block}: pool {pool} out of range (-1 to {max})")]
    PoolOutOfRange {
        seq: usize,
        block: usize,
        pool: i64,
        max: i64,
    },
    /// A block-table entry that names a slot its pool does not have.
    #[error(
        "sequence {seq}, block {block}: slot {slot} out of range of pool {pool} ({slots} slots)"
    )]
    SlotOutOfRange {
        seq: usize,
        block: usize,
        pool: usize,
        slot: i64,
        slots: usize,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        what,
        reason: reason.into(),
    }
}
