//! Core errors → the Python hierarchy in `kvtier.errors`. The match is exhaustive with no
//! catch-all arm, so a new core error cannot ship unmapped.

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

/// Builds the Python exception for a core error (falls back to RuntimeError only if the
/// `kvtier.errors` module itself cannot be imported).
pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| {
        let class = py
            .import("kvtier.errors")
            .and_then(|m| m.getattr(class_name(&err)));
        match class {
            Ok(class) => match class.call1((err.to_string(),)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            Err(e) => e,
        }
    })
}

pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
