//! Carrying out a [`PoolDiff`] against the API: create or replace every slice of the new
//! generation in pool order, then delete what is no longer wanted. Every write records what
//! the slice cache should show next and which slices the controller owns (see
//! [`crate::expectations`]).
//!
//! The slices are encoded to JSON before the first request, and only the bytes are held
//! while the writes wait on the API server: JSON is several times smaller than the objects
//! (maps of attributes), and a cold start has up to `--max-concurrent-reconciles` pools
//! waiting at once.

use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, PostParams, Preconditions},
};

use crate::{
    compare::{PoolDiff, SPEC_HASH_ANNOTATION, SliceDelete, SliceWrite, spec_hash},
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

/// Whether a write creates or replaces its slice.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WriteKind {
    Create,
    Replace,
}

impl WriteKind {
    fn operation(self) -> SliceOperation {
        match self {
            Self::Create => SliceOperation::Create,
            Self::Replace => SliceOperation::Update,
        }
    }

    /// The tag `Api::create` / `Api::replace` give their requests.
    fn request_tag(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Replace => "replace",
        }
    }
}

/// One slice write, encoded.
struct EncodedWrite {
    kind: WriteKind,
    name: String,
    generation: i64,
    /// The hash of the canonical spec sent ([`spec_hash`]): the answer must show the same.
    spec_hash: String,
    body: Vec<u8>,
}

impl EncodedWrite {
    fn new(write: SliceWrite) -> Result<Self, Error> {
        let (kind, slice) = match write {
            SliceWrite::Create(s) => (WriteKind::Create, s),
            SliceWrite::Replace(s) => (WriteKind::Replace, s),
        };
        let name = slice.name_any();
        // `diff_pool` annotates every write with its hash; computed only if one were missing.
        let spec_hash = match slice.annotations().get(SPEC_HASH_ANNOTATION) {
            Some(hash) => hash.clone(),
            None => spec_hash(&slice.spec),
        };
        let body = serde_json::to_vec(&slice)
            .map_err(|e| Error::slice_write(kind.operation().as_str(), &name, kube::Error::SerdeError(e)))?;
        Ok(Self {
            kind,
            name,
            generation: slice.spec.pool.generation,
            spec_hash,
            body,
        })
    }
}

impl Publisher<'_> {
    /// Applies `diff`: for a new generation writes first (so it is complete before anything
    /// of the old one disappears) and deletes last; for a kept generation the other way round
    /// (see [`PoolDiff::deletes_first`]). Stops at the first error. Returns the slices it
    /// wrote with the resourceVersions the server gave them.
    pub async fn apply(&self, diff: PoolDiff) -> Result<Vec<(String, Option<String>)>, Error> {
        let PoolDiff {
            writes,
            deletes,
            deletes_first,
            ..
        } = diff;
        // Before any await: from here on only the bytes are held.
        let writes = writes
            .into_iter()
            .map(EncodedWrite::new)
            .collect::<Result<Vec<_>, _>>()?;
        if deletes_first {
            self.deletes(&deletes).await?;
        }
        let mut written = Vec::with_capacity(writes.len());
        for write in writes {
            written.push(self.write(write).await?);
        }
        if !deletes_first {
            self.deletes(&deletes).await?;
        }
        Ok(written)
    }

    async fn deletes(&self, deletes: &[SliceDelete]) -> Result<(), Error> {
        for delete in deletes {
            self.delete(delete).await?;
        }
        Ok(())
    }

    async fn write(&self, write: EncodedWrite) -> Result<(String, Option<String>), Error> {
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_string()),
            ..PostParams::default()
        };
        let EncodedWrite {
            kind,
            name,
            generation,
            spec_hash: sent_hash,
            body,
        } = write;
        let request = kube::core::Request::new(self.api.resource_url());
        let built = match kind {
            WriteKind::Create => request.create(&params, body),
            WriteKind::Replace => request.replace(&name, &params, body),
        };
        let operation = kind.operation();
        let result = match built {
            Ok(mut request) => {
                request.extensions_mut().insert(kind.request_tag());
                // The client behind `api` sends the bytes as they are.
                self.api
                    .clone()
                    .into_client()
                    .request::<ResourceSlice>(request)
                    .await
            }
            Err(e) => Err(kube::Error::BuildRequest(e)),
        };
        let stored = result.map_err(|e| Error::slice_write(operation.as_str(), &name, e))?;
        self.metrics.slice_write(operation);
        tracing::debug!(
            slice = %name,
            operation = operation.as_str(),
            generation,
            "wrote ResourceSlice"
        );
        let version = stored.resource_version();
        self.expectations.written(self.node, &name, version.clone());
        if stored.spec.pool.generation != generation || spec_hash(&stored.spec) != sent_hash {
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
