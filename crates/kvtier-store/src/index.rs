//! [`SharedIndex`]: one store's [`StoreIndex`] (its budget and eviction order) behind a lock,
//! shared by every namespace's handle on the store and by the calls that run without the GIL.
//!
//! A poisoned lock is taken over as it is: the index is only ever changed by its own methods,
//! which leave it consistent or panic before changing anything a later call relies on.

use std::sync::{Mutex, MutexGuard};

use kvtier::StoreIndex;

#[derive(Debug)]
pub struct SharedIndex(Mutex<StoreIndex>);

impl SharedIndex {
    pub fn new(index: StoreIndex) -> Self {
        SharedIndex(Mutex::new(index))
    }

    pub fn lock(&self) -> MutexGuard<'_, StoreIndex> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
