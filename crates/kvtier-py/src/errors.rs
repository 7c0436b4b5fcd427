//! Core and store errors → the Python hierarchy in `kvtier.errors`. Each match is exhaustive
//! with no catch-all arm, so a new error cannot ship unmapped. (A stored value that fails its
//! checks is a `kvtier_store::Refusal`, raised or handed back as `PayloadError` where it is
//! read: `sealed::payload_error`.)

use kvtier::Error;
use pyo3::prelude::*;

fn class_name(err: &Error) -> &'static str {
    match err {
        Error::OutOfCapacity { .. } | Error::OutOfSlots { .. } => "OutOfCapacityError",
        Error::UnknownBlock { .. } => "InvalidBlockError",
        Error::UnknownSequence { .. } => "InvalidSequenceError",
        Error::BlockBusy { .. } => "BlockBusyError",
        Error::InvalidConfig { .. } | Error::UnknownPolicy { .. } => "ConfigError",
        Error::LengthMismatch { .. } | Error::InvalidArgument { .. } => "InvalidArgumentError",
        Error::PlanPending { .. } | Error::UnknownPlan { .. } => "PlanError",
    }
}

fn store_class_name(err: &kvtier_store::Error) -> &'static str {
    use kvtier_store::Error as E;
    match err {
        E::NotAStoreKey { .. }
        | E::TextTooLong { .. }
        | E::HeaderTooLong { .. }
        | E::ShortBuffer { .. } => "InvalidArgumentError",
    }
}

/// Builds the Python exception for an error of the CPU kernels (`kvtier-attend`: attention and
/// the codecs): every one is bad input from the caller, `InvalidArgumentError`.
pub fn attend_to_py(err: kvtier_attend::Error) -> PyErr {
    use kvtier_attend::Error as E;
    let class = match err {
        E::InvalidArgument { .. }
        | E::InvalidPool { .. }
        | E::PoolOutOfRange { .. }
        | E::SlotOutOfRange { .. } => "InvalidArgumentError",
    };
    raise(class, err.to_string())
}

/// `kvtier.errors.InvalidArgumentError(message)`.
pub fn invalid(message: String) -> PyErr {
    raise("InvalidArgumentError", message)
}

/// An instance of `kvtier.errors.<class>(message)` (falls back to the import's error only if
/// the `kvtier.errors` module itself cannot be imported).
fn raise(class: &str, message: String) -> PyErr {
    Python::attach(|py| {
        let class = py.import("kvtier.errors").and_then(|m| m.getattr(class));
        match class {
            Ok(class) => match class.call1((message,)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(e) => e,
        }
    })
}

/// Builds the Python exception for a core error.
pub fn to_py(err: Error) -> PyErr {
    raise(class_name(&err), err.to_string())
}

/// Builds the Python exception for a store error.
pub fn store_to_py(err: kvtier_store::Error) -> PyErr {
    raise(store_class_name(&err), err.to_string())
}

pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

impl<T> IntoPy<T> for Result<T, kvtier_store::Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(store_to_py)
    }
}
