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
    ResourceExt,
    api::{DeleteParams, PostParams, Preconditions},
};

use crate::{
    compare::{PoolDiff, SPEC_HASH_ANNOTATION, SliceDelete, SliceWrite, spec_hash},
    context::Context,
    error::{Error, is_not_found},
    status::FIELD_MANAGER,
};

/// One slice write, encoded.
struct EncodedWrite {
    replace: bool,
    name: String,
    generation: i64,
    /// The hash of the canonical spec sent ([`spec_hash`]): the answer must show the same.
    spec_hash: String,
    body: Vec<u8>,
}

impl EncodedWrite {
    fn new(write: SliceWrite) -> Result<Self, Error> {
        let replace = matches!(write, SliceWrite::Replace(_));
        let (SliceWrite::Create(slice) | SliceWrite::Replace(slice)) = write;
        let name = slice.name_any();
        // `diff_pool` annotates every write with its hash; computed only if one were missing.
        let spec_hash = match slice.annotations().get(SPEC_HASH_ANNOTATION) {
            Some(hash) => hash.clone(),
            None => spec_hash(&slice.spec),
        };
        let operation = if replace { "update" } else { "create" };
        let body = serde_json::to_vec(&slice)
            .map_err(|e| Error::slice_write(operation, &name, kube::Error::SerdeError(e)))?;
        Ok(Self {
            replace,
            name,
            generation: slice.spec.pool.generation,
            spec_hash,
            body,
        })
    }
}

/// Applies `diff` to `node`'s slices: for a new generation writes first (so it is complete
/// before anything of the old one disappears) and deletes last; for a kept generation the
/// other way round (see [`PoolDiff::deletes_first`]). Stops at the first error. Returns the
/// slices it wrote with the resourceVersions the server gave them.
pub async fn apply(
    ctx: &Context,
    node: &str,
    diff: PoolDiff,
) -> Result<Vec<(String, Option<String>)>, Error> {
    // Before any await: from here on only the bytes are held.
    let writes = diff
        .writes
        .into_iter()
        .map(EncodedWrite::new)
        .collect::<Result<Vec<_>, _>>()?;
    if diff.deletes_first {
        deletes(ctx, node, &diff.deletes).await?;
    }
    let mut written = Vec::with_capacity(writes.len());
    for encoded in writes {
        written.push(write(ctx, node, encoded).await?);
    }
    if !diff.deletes_first {
        deletes(ctx, node, &diff.deletes).await?;
    }
    Ok(written)
}

async fn write(ctx: &Context, node: &str, write: EncodedWrite) -> Result<(String, Option<String>), Error> {
    let params = PostParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PostParams::default()
    };
    let EncodedWrite {
        replace,
        name,
        generation,
        spec_hash: sent_hash,
        body,
    } = write;
    let request = kube::core::Request::new(ctx.slice_api.resource_url());
    // The tags `Api::create` / `Api::replace` give their requests.
    let (operation, built, tag) = if replace {
        ("update", request.replace(&name, &params, body), "replace")
    } else {
        ("create", request.create(&params, body), "create")
    };
    let result = match built {
        Ok(mut request) => {
            request.extensions_mut().insert(tag);
            // The client behind `api` sends the bytes as they are.
            ctx.slice_api
                .clone()
                .into_client()
                .request::<ResourceSlice>(request)
                .await
        }
        Err(e) => Err(kube::Error::BuildRequest(e)),
    };
    let stored = result.map_err(|e| Error::slice_write(operation, &name, e))?;
    ctx.metrics.slice_write(operation);
    tracing::debug!(slice = %name, operation, generation, "wrote ResourceSlice");
    let version = stored.resource_version();
    ctx.expectations.written(node, &name, version.clone());
    if stored.spec.pool.generation != generation || spec_hash(&stored.spec) != sent_hash {
        return Err(Error::FieldsDropped { name });
    }
    Ok((name, version))
}

async fn deletes(ctx: &Context, node: &str, deletes: &[SliceDelete]) -> Result<(), Error> {
    for delete in deletes {
        let params = DeleteParams {
            preconditions: delete.uid.as_ref().map(|uid| Preconditions {
                uid: Some(uid.clone()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        // Recorded first: the delete event may reach the watch before the answer reaches us.
        ctx.expectations.deleting(node, &delete.name);
        match ctx.slice_api.delete(&delete.name, &params).await {
            Ok(_) => ctx.metrics.slice_write("delete"),
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                ctx.expectations.delete_failed(node, &delete.name);
                return Err(Error::slice_write("delete", &delete.name, e));
            }
        }
        tracing::debug!(slice = %delete.name, "deleted ResourceSlice");
    }
    Ok(())
}
