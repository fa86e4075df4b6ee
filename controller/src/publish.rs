//! Carrying out a [`PoolDiff`] against the API: create or replace every slice of the new
//! generation in pool order, then delete what is no longer wanted. Every write records what
//! the slice cache should show next and which slices the controller owns (see
//! [`crate::expectations`]).

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, PostParams, Preconditions},
};

use crate::{
    compare::{PoolDiff, SliceDelete, SliceWrite, specs_match},
    error::{Error, is_not_found},
    expectations::Expectations,
    metrics::{Metrics, SliceOperation},
    status::FIELD_MANAGER,
};

/// What publishing needs.
pub struct Publisher<'a> {
    /// The cluster-wide ResourceSlice API.
    pub api: &'a Api<ResourceSlice>,
    /// Where writes are recorded.
    pub expectations: &'a Expectations,
    /// Write counters.
    pub metrics: &'a Metrics,
    /// The node whose pool this is.
    pub node: &'a str,
}

impl Publisher<'_> {
    /// Applies `diff`: for a new generation writes first (so it is complete before anything
    /// of the old one disappears) and deletes last; for a kept generation the other way round
    /// (see [`PoolDiff::deletes_first`]). Stops at the first error. Returns the slices it
    /// wrote with the resourceVersions the server gave them.
    pub async fn apply(&self, diff: &PoolDiff) -> Result<Vec<(String, Option<String>)>, Error> {
        if diff.deletes_first {
            self.deletes(diff).await?;
        }
        let mut written = Vec::with_capacity(diff.writes.len());
        for write in &diff.writes {
            written.push(self.write(write).await?);
        }
        if !diff.deletes_first {
            self.deletes(diff).await?;
        }
        Ok(written)
    }

    async fn deletes(&self, diff: &PoolDiff) -> Result<(), Error> {
        for delete in &diff.deletes {
            self.delete(delete).await?;
        }
        Ok(())
    }

    async fn write(&self, write: &SliceWrite) -> Result<(String, Option<String>), Error> {
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PostParams::default()
        };
        let slice = write.slice();
        let name = slice.name_any();
        let (operation, result) = match write {
            SliceWrite::Create(s) => (SliceOperation::Create, self.api.create(&params, s).await),
            SliceWrite::Replace(s) => (SliceOperation::Update, self.api.replace(&name, &params, s).await),
        };
        let stored = result.map_err(|e| Error::slice_write(operation.as_str(), &name, e))?;
        self.metrics.slice_write(operation);
        tracing::debug!(
            slice = %name,
            operation = operation.as_str(),
            generation = slice.spec.pool.generation,
            "wrote ResourceSlice"
        );
        let version = stored.resource_version();
        self.expectations.written(self.node, &name, version.clone());
        if stored.spec.pool.generation != slice.spec.pool.generation
            || !specs_match(&slice.spec, &stored.spec)
        {
            return Err(Error::FieldsDropped { name });
        }
        Ok((name, version))
    }

    async fn delete(&self, delete: &SliceDelete) -> Result<(), Error> {
        let params = DeleteParams {
            preconditions: delete.uid.as_ref().map(|uid| Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        // Recorded first: the delete event may reach the watch before the answer reaches us.
        self.expectations.deleting(self.node, &delete.name);
        match self.api.delete(&delete.name, &params).await {
            Ok(_) => self.metrics.slice_write(SliceOperation::Delete),
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                self.expectations.delete_failed(self.node, &delete.name);
                return Err(Error::slice_write(
                    SliceOperation::Delete.as_str(),
                    &delete.name,
                    e,
                ));
            }
        }
        tracing::debug!(slice = %delete.name, "deleted ResourceSlice");
        Ok(())
    }
}
