//! The core's one error type. Every fallible call validates its whole input before it mutates
//! anything, so an `Err` always means "nothing changed". The bindings map each variant onto a
//! Python exception with an exhaustive match, so a new variant cannot ship unmapped.

use crate::config::Tier;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error(
        "out of capacity in {tier}/level {level}: requested {requested} bytes, {free} free of a \
         {budget}-byte budget"
    )]
    OutOfCapacity {
        tier: Tier,
        level: u8,
        requested: u64,
        free: u64,
        budget: u64,
    },
    #[error("out of slots in {tier}/level {level}: requested {requested}, free {free}")]
    OutOfSlots {
        tier: Tier,
        level: u8,
        requested: u64,
        free: u64,
    },
    #[error("unknown block {block}: not allocated (freed, evicted, or never handed out)")]
    UnknownBlock { block: u32 },
    #[error("unknown sequence {seq}: not created or already freed")]
    UnknownSequence { seq: u32 },
    #[error("block {block} is {reason}; it cannot be changed until that ends")]
    BlockBusy { block: u32, reason: &'static str },
    #[error("invalid config: {field}: {reason}")]
    InvalidConfig { field: &'static str, reason: String },
    #[error("unknown policy {name:?}: expected one of importance, lru, lfu, h2o, scissorhands")]
    UnknownPolicy { name: String },
    #[error("{what}: expected {expected} values, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("invalid {what}: {reason}")]
    InvalidArgument { what: &'static str, reason: String },
    #[error("plan {pending} is still pending: commit or abort it before planning again")]
    PlanPending { pending: u64 },
    #[error("no pending plan with id {plan}")]
    UnknownPlan { plan: u64 },
}

pub type Result<T> = std::result::Result<T, Error>;
